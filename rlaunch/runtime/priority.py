"""Where training keeps every core busy, the runtime's own background work takes what it leaves.

Linux nice values are per thread, and a thread starts at the value of the thread that made it. So a
thread lowers itself (:func:`yield_thread`: snapshot exchanges, whose pairs gloo then builds with
threads as low, the handover's receive, the retirer of old groups); a leaving rank lowers every
thread of its process once the joiner can start (:func:`yield_process`, gloo's threads included);
and a joiner lowers the thread gloo made for the move's channel once its first step ended and
only the snapshot handover follows on it (:func:`yield_threads`, given what the communicator
layer noted when it built the channel).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection

#: the lowest priority Linux gives a thread
LOWEST = 19


def yield_thread() -> None:
    """Lower the calling thread to the lowest priority (best effort: a refusal changes nothing)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)


def yield_process() -> None:
    """Lower every thread of this process to the lowest priority (best effort, as above)."""
    yield_threads(threads())


def yield_threads(tids: Collection[int]) -> None:
    """Lower the threads ``tids`` of this process, as :func:`threads` just listed them, to the lowest
    priority (best effort, as above)."""
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST)


def threads(named: Collection[str] = ()) -> set[int]:
    """The ids of this process's threads (only those whose name is one of ``named``, if given)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return set()
    found = set()
    for task in tasks:
        if named:
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    if f.read().strip() not in named:
                        continue
            except OSError:
                continue  # ended meanwhile
        found.add(int(task))
    return found
