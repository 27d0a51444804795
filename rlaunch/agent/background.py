"""The agent's background tasks, kept running: one that ends by an error is said, then started again.

Each background task (the lease renewal, the watch of the job's generations, the controller, the
GPU checks, the probes of stalled peers, the progress samples) handles the errors it expects: etcd
unreachable, a malformed record. One that ends by any other error (a bug in rlaunch, or an answer
of the machine it was not written for, such as an NVML error it does not know) would stop what it
does for the rest of the job, with one line in the log. So :func:`keep_running` logs its traceback
at ERROR, reports it (the agent emits an ``agent_task_failed`` event: ``rlaunch events`` shows it,
and ``rlaunch report`` marks it on the node), and starts it again after a pause:
:data:`FIRST_PAUSE_S`, doubled at each failure that follows a short run, up to :data:`MAX_PAUSE_S`;
a run that lasted :data:`MAX_PAUSE_S` or more starts the count again.

The agent does not leave the job instead: every agent runs the same controller and watch code on
the same records, so a bug there would take every new leader, or every node at once, out of a job
that was training.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: The pause before a failed task starts again the first time.
FIRST_PAUSE_S = 1.0
#: The longest pause; a task that ran this long before it failed starts with the first pause again.
MAX_PAUSE_S = 30.0


def next_pause(previous: float, ran_s: float) -> float:
    """The pause before a task that failed after running ``ran_s`` seconds starts again, the pause
    before its last start having been ``previous`` (0: none yet)."""
    if previous <= 0 or ran_s >= MAX_PAUSE_S:
        return FIRST_PAUSE_S
    return min(2 * previous, MAX_PAUSE_S)


async def keep_running(
    name: str,
    start: Callable[[], Awaitable[object]],
    stop: asyncio.Event,
    failed: Callable[[str, str, int], None],
    node_id: str,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run ``start()`` until it returns or ``stop`` is set; each time it raises, log its traceback, call
    ``failed(name, error, failures)`` (``name``: what the task does, such as "the lease renewal") and
    start it again after a pause (see the module's docstring). A cancel ends it as any task's does."""
    pause, failures = 0.0, 0
    while not stop.is_set():
        began = clock()
        try:
            await start()
            return
        except Exception as exc:
            failures += 1
            pause = next_pause(pause, clock() - began)
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.error("[%s] %s ended by an error (%s); it starts again in %.0f s", node_id, name, error, pause,
                      exc_info=exc)  # fmt: skip
            failed(name, error, failures)
        await wait_event(stop, pause)
