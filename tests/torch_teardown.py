"""Uninterrupted 2-rank runs of a test's script on one node, and torch 2.13's teardown abort, which a
plain torchrun run of such a script sometimes ends with."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

TORCHRUN = "torch.distributed.run"
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun's summary of a failed rank


def aborted_in_torch_teardown(stderr: str) -> bool:
    """Whether a rank aborted in torch's own teardown, as a run under torchrun sometimes does.

    In torch 2.13 a gloo worker thread drops a finished collective (one launched in a backward pass
    holds a Python object in its captured thread-local state; an Accelerate barrier holds tensors)
    after the rank's main thread has moved on; when that is the interpreter's finalization, the
    worker's wait for the GIL ends its thread inside C++ and the process aborts ("terminate called
    without an active exception"; seen in about one run in ten of the Accelerate port, with and
    without rlaunch code in the process: the backtrace is ``~AsyncBarrierWork`` in
    ``ProcessGroupGloo::runLoop`` taking the GIL). Only that abort counts, with torchrun's SIGTERM of
    the other rank after it. Callers run such a run again, at most twice, and never accept it.
    """
    codes = {int(code) for code in EXITCODE.findall(stderr)}
    return "terminate called without an active exception" in stderr and -6 in codes and codes <= {-6, -15}


def run_2_ranks(
    argv: Sequence[str], attempts: int = 3, fresh: Callable[[], None] = lambda: None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a launcher and its script, 1 thread per rank) and return how it ended; a run that
    aborted in torch's teardown is run again, up to ``attempts`` runs in all (1: an rlaunch run, which
    is never run again), each after ``fresh()`` (clear what the previous run wrote)."""
    for _ in range(attempts):
        fresh()
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if res.returncode == 0 or not aborted_in_torch_teardown(res.stderr):
            break
    return res


def launch(
    launcher: str, args: Sequence[str], fresh: Callable[[], None] = lambda: None
) -> subprocess.CompletedProcess[str]:
    """One uninterrupted 2-rank run of ``args`` (a script and its options) under ``launcher`` (a module:
    :data:`TORCHRUN` or ``rlaunch``). A torchrun run that aborted in torch's teardown is run again, at
    most twice (never accepted); an rlaunch run never is."""
    return run_2_ranks(
        [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", *args],
        attempts=3 if launcher == TORCHRUN else 1, fresh=fresh,
    )  # fmt: skip


def finals(final: re.Pattern[str], text: str) -> dict[int, tuple[str, ...]]:
    """Every rank's final digests in ``text``: ``final``'s first group is the rank, the others the digests."""
    return {int(m.group(1)): m.groups()[1:] for m in final.finditer(text)}


def both_finals(res: subprocess.CompletedProcess[str], final: re.Pattern[str]) -> dict[int, tuple[str, ...]]:
    """Both ranks' final digests from a run (:func:`launch`'s) that must have ended well on both."""
    got = finals(final, res.stdout)
    assert res.returncode == 0 and sorted(got) == [0, 1], res.stdout[-3000:] + res.stderr[-3000:]
    return got
