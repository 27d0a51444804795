"""Waiting that stops at once when told to: the one way loops pause in library code."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass (None: no limit); return whether it is set.

    The answer is the event's state when the wait ends, not how ``wait_for`` ended: an event set
    while the timeout is cancelling the wait makes ``wait_for`` raise although the event is set,
    and a caller that clears the event after a "not set" answer would lose that wake-up.
    """
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
    return event.is_set()
