"""rlaunch.waiting: a wait reports the event as it is when the wait ends."""

from __future__ import annotations

import asyncio

from rlaunch.waiting import wait_event


def test_an_event_set_as_the_timeout_fires_is_reported_set() -> None:
    """The controller clears its wake-up event after each wait and ticks only if it was set. An
    event set in the loop iteration where the timeout cancels the wait made ``wait_for`` raise,
    the wait answered "not set", the clear dropped the wake-up, and a finished job never ended."""

    async def main() -> list[bool]:
        loop, event, answers = asyncio.get_running_loop(), asyncio.Event(), []
        for _ in range(5):
            event.clear()
            # armed just after the wait's own timer, due at the same instant
            loop.call_soon(lambda: loop.call_later(0.02, event.set))
            answers.append(await wait_event(event, 0.02) == event.is_set())
        return answers

    assert all(asyncio.run(main()))


def test_a_wait_times_out_unset_and_returns_at_once_when_set() -> None:
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        unset = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return unset, await wait_event(event, 5.0)

    assert asyncio.run(main()) == (False, True)
