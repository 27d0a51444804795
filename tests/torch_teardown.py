"""torch 2.13's teardown abort, which a plain run of a test's reference script sometimes ends with."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence

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
