"""A creation that failed on aetcd's own timeout while its answer registered the watch anyway.

aetcd's ``add_callback`` waits for etcd's "created" answer under its own timeout; an answer handled
just as that wait gives up registers the watch although the creation raised. The stream stands in
for aetcd's watcher (the client library's boundary: the timing cannot be forced on a real etcd);
``watches_of`` is the real one. In aetcd 1.0.0's ``aetcd/watcher.py``: ``_handle_response`` (lines
116-132) stores the callback under the answer's watch id and sets its ``watch_id`` while it holds
the watcher's lock, and ``add_callback`` (lines 312-322) raises ``WatchTimeoutError`` when its
``wait_for`` gives up, so a creation can raise after its watch was registered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd.exceptions
import aetcd.watcher
import pytest

from rlaunch.store.watches import WatchStream, WatchStreams


class AnsweredTooLate:
    """A stream whose one creation's answer registers watch 7 as the creation times out."""

    watches_of = WatchStream.watches_of

    def __init__(self) -> None:
        self._callbacks: dict[int, aetcd.watcher.WatcherCallback] = {}
        self.cancelled: list[int] = []
        self.shut = False

    async def add_callback(self, key: bytes, callback: Any, range_end: Any = None, start_revision: Any = None) -> Any:
        self._callbacks[7] = aetcd.watcher.WatcherCallback(callback)
        self._callbacks[7].watch_id = 7
        raise aetcd.exceptions.WatchTimeoutError

    async def cancel(self, watch_id: int) -> None:
        self._callbacks.pop(watch_id, None)
        self.cancelled.append(watch_id)

    async def shutdown(self) -> None:
        self.shut = True


def test_a_watch_registered_by_a_late_answer_is_cancelled_and_its_stream_shut_down() -> None:
    async def main() -> AnsweredTooLate:
        made: list[AnsweredTooLate] = []

        def make(on_end: Any) -> Any:
            made.append(AnsweredTooLate())
            return made[-1]

        streams = WatchStreams(make)
        with pytest.raises(aetcd.exceptions.WatchTimeoutError):
            await streams.open(b"k", None, None, 5.0)
        for _ in range(10):  # the cancel and the shutdown run in the background
            await asyncio.sleep(0)
        return made[0]

    stream = asyncio.run(main())
    assert stream.cancelled == [7], "the watch nobody reads is cancelled"
    assert stream.shut, "the retired stream, unused once the watch is cancelled, is shut down"
