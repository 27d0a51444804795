"""Uninterrupted 2-rank runs of a test's script on one node, and torch 2.13's teardown abort, which a
plain torchrun run of such a script sometimes ends with."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence

import psutil

TORCHRUN = "torch.distributed.run"
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun's summary of a failed rank
RUN_TIMEOUT_S = 300  # a run takes 5-30 s; one that is still going is stuck
MARK = "RLAUNCH_TEST_RUN"  # in the environment of every process of one run (see run_or_show_stacks)


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
        res = run_or_show_stacks(list(argv))
        if res.returncode == 0 or not aborted_in_torch_teardown(res.stderr):
            break
    return res


def run_or_show_stacks(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (1 thread per rank) to its end. One still running after :data:`RUN_TIMEOUT_S` fails
    the test with every process's stacks (the launcher's, its ranks', which torchrun starts in sessions
    of their own, and their loader workers'). However the call ends (a test's own timeout included),
    no process of the run is left: each carries :data:`MARK` in its environment and is found by it."""
    token = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: token}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stacks = stacks_of(marked(token))
        kill(marked(token))
        out, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"{' '.join(argv)} was still running after {RUN_TIMEOUT_S} s. Its processes' stacks:\n{stacks}\n"
            f"Its output's end:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    finally:
        kill(marked(token))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def marked(token: str) -> list[psutil.Process]:
    """The processes whose environment has :data:`MARK` set to ``token`` (wherever they were reparented)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(MARK) == token:
                found.append(p)
    return found


def kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):  # (it may have ended meanwhile)
            p.kill()


def stacks_of(procs: list[psutil.Process]) -> str:
    """Each process's stacks, every thread's, Python and native frames, as py-spy dumps them (all at
    once, 30 s at most); a dump that failed says why."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    dumps = []
    for p in procs:
        try:
            cmd = [spy, "dump", "--native", "--pid", str(p.pid)]
            dumps.append((p.pid, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        except OSError as exc:
            return f"(no stacks: py-spy could not be run: {exc})"
    parts = []
    for pid, dump in dumps:
        try:
            text, _ = dump.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            dump.kill()
            text = dump.communicate()[0] + "\n(py-spy did not finish within 30 s)"
        parts.append(f"--- process {pid} (py-spy exit code {dump.returncode}):\n{text}")
    return "\n".join(parts)


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
