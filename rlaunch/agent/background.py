"""The agent's background tasks, kept running: one that ends by an error is said, then started again.

Each background task (the lease renewal, the watch of the job's generations, the controller, the
GPU checks, the probes of stalled peers, the progress samples) handles the errors it expects: etcd
unreachable, a malformed record. One that ends by any other error (a bug in rlaunch, or an answer
of the machine it was not written for, such as an NVML error it does not know) would stop what it
does for the rest of the job, with one line in the log. So :func:`keep_running` logs its traceback
at ERROR, reports it (the agent emits an ``agent_task_failed`` event: ``rlaunch events`` shows it,
and ``rlaunch report`` marks it on the node), and starts it again after a pause:
:data:`FIRST_PAUSE_S`, doubled at each failure that follows a short run, up to :data:`MAX_PAUSE_S`
(the lease renewal's up to a third of the lease's TTL, the time between its renewals, so that the
lease outlives the pause); a run that lasted :data:`MAX_PAUSE_S` or more starts the count again. Of
the failures in a row by one error (its type and the place that raised it), the 1st, 2nd, 4th, 8th...
are said in full; the others in one log line.

The agent does not leave the job instead: every agent runs the same controller and watch code on
the same records, so a bug there would take every new leader, or every node at once, out of a job
that was training.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable

from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: The pause before a failed task starts again the first time.
FIRST_PAUSE_S = 1.0
#: The longest pause; a task that ran this long before it failed starts with the first pause again.
MAX_PAUSE_S = 30.0


def next_pause(previous: float, ran_s: float, most: float = MAX_PAUSE_S) -> float:
    """The pause before a task that failed after running ``ran_s`` seconds starts again, the pause
    before its last start having been ``previous`` (0: none yet), and ``most`` the longest."""
    if previous <= 0 or ran_s >= MAX_PAUSE_S:
        return min(FIRST_PAUSE_S, most)
    return min(2 * previous, most)


def worth_saying(same: int) -> bool:
    """Whether the ``same``-th failure in a row of one error is said in full (traceback, event): the 1st,
    2nd, 4th, 8th... The others are one log line each: a task that fails every 30 s on every node of a
    large job would otherwise write etcd all day."""
    return same & (same - 1) == 0


def error_of(exc: BaseException) -> tuple[str, str]:
    """How an error reads (its type and message), and what makes two failures the same error: its type
    and the place that raised it (a message may carry values that change at every failure)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return text, f"{type(exc).__name__} at {where}"


async def keep_running(
    name: str,
    start: Callable[[], Awaitable[object]],
    stop: asyncio.Event,
    failed: Callable[[str, str, int], None],
    node_id: str,
    most: float = MAX_PAUSE_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run ``start()`` until it returns or ``stop`` is set; each time it raises, say so (see
    :func:`worth_saying`: its traceback at ERROR and ``failed(name, error, failures)``, where ``name`` is
    what the task does, such as "the lease renewal") and start it again after a pause of at most
    ``most`` seconds (see the module's docstring). A cancel ends it as any task's does."""
    pause, failures, same, last = 0.0, 0, 0, ""
    while not stop.is_set():
        began = clock()
        try:
            await start()
            return
        except Exception as exc:
            if stop.is_set():  # the agent is ending: nothing starts again
                log.warning("[%s] %s ended by an error as the agent stopped: %r", node_id, name, exc)
                return
            failures += 1
            ran_s = clock() - began
            pause = next_pause(pause, ran_s, most)
            error, key = error_of(exc)
            # (a failure after a long run, or of another error, is the first of its run)
            same = same + 1 if key == last and ran_s < MAX_PAUSE_S else 1
            last = key
            if worth_saying(same):
                log.error("[%s] %s ended by an error (%s; %d failure(s) so far); it starts again in %.1f s",
                          node_id, name, error, failures, pause, exc_info=exc)  # fmt: skip
                try:
                    failed(name, error, failures)
                except Exception:  # (what reports it must not end the task for good)
                    log.exception("[%s] reporting that %s failed failed too", node_id, name)
            else:
                log.error("[%s] %s ended by an error again (%s; %d failures so far); it starts again in %.1f s",
                          node_id, name, error, failures, pause)  # fmt: skip
        await wait_event(stop, pause)
