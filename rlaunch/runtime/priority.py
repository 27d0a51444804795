"""Where training keeps every core busy, the runtime's own background work takes what it leaves.

Linux nice values are per thread, so a thread lowers itself (:func:`yield_thread`: snapshot
exchanges, the handover's receive, the retirer of old groups), and a leaving rank lowers every
thread of its process once the joiner can start (:func:`yield_process`, gloo's threads included).
"""

from __future__ import annotations

import contextlib
import os
import threading

#: the lowest priority Linux gives a thread
LOWEST = 19


def yield_thread() -> None:
    """Lower the calling thread to the lowest priority (best effort: a refusal changes nothing)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)


def yield_process() -> None:
    """Lower every thread of this process to the lowest priority (best effort, as above)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(tid), LOWEST)
