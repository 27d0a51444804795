"""Every process a benchmark starts ends with it, however the benchmark itself ends.

- :func:`end_on_sigterm`: SIGTERM (``timeout``, a CI runner, Slurm) and SIGHUP raise
  ``SystemExit`` in the benchmark, so its ``finally`` blocks stop what it started, as on Ctrl-C.
- :func:`die_with_parent`: a ``preexec_fn`` that has the kernel SIGKILL the child when the
  benchmark dies without running any of that (SIGKILL, a crash). An rlaunch agent's workers die
  with their agent, and its embedded etcd with it, so nothing is left either way.
"""

from __future__ import annotations

import ctypes
import signal
from types import FrameType

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def end_on_sigterm() -> None:
    def leave(sig: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)
