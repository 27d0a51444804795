"""Watches bound to the etcd watch stream they were made on.

aetcd multiplexes a client's watches over one gRPC stream (its ``Watcher``), and two of its ways
can cross watches up:

- it cancels a watch through whichever stream the client holds *when cancel is called*; once
  the client has moved its new watches to a fresh stream (after one broke), a late cancel of an
  old watch removes the fresh stream's watch with the same id (etcd numbers each stream's watches
  from 0), which then never delivers another change, silently;
- it hands each "created" answer to whichever creation is waiting on the stream at the time; a
  creation that stopped waiting (aetcd's own timeout) leaves its answer to come, and the next
  creation on that stream takes it: that watch follows the other's key.

So rlaunch makes its watches on a stream directly (:class:`WatchStreams`): each watch keeps the
stream it was made on and is cancelled there. Creations on a stream take turns under a lock of
rlaunch's, each holding it until its own answer or its failure: one that failed (aetcd's timeout,
a broken stream) retires the stream before it lets the next in, so no later creation is made
where a late answer can still come (a waiting one moves to the new stream). A caller that stops
waiting (its timeout, a cancel) leaves the creation to finish under the lock; a watch it makes
after all is cancelled at once. A retired stream is shut down once no watch or creation uses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.rtypes
import aetcd.watcher

log = logging.getLogger(__name__)


def _raise_translated(exc: BaseException) -> None:
    """Raise ``exc`` as aetcd's client methods do: a gRPC error as its :class:`aetcd.exceptions.ClientError`."""
    if isinstance(exc, aetcd.rpc.AioRpcError):
        aetcd.exceptions._handle_exception(exc)
    raise exc


class BoundWatch:
    """One watch, on the stream it was made on: iterate :meth:`events`, then :meth:`cancel` it."""

    def __init__(self, streams: WatchStreams, stream: aetcd.watcher.Watcher, watch_id: int, queue: asyncio.Queue[Any]):
        self._streams = streams
        self.stream = stream
        self.watch_id = watch_id
        self._queue = queue
        self._cancelled = False

    async def events(self) -> AsyncIterator[aetcd.rtypes.Event]:
        """The watch's changes; raises :class:`aetcd.exceptions.ClientError` when its stream breaks,
        and ends when the client shuts the stream down (it closes)."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                _raise_translated(item)
            yield item

    async def cancel(self) -> None:
        """Cancel the watch on its own stream (once; later calls do nothing)."""
        if not self._cancelled:
            self._cancelled = True
            await self._streams.cancel(self.stream, self.watch_id)


class WatchStreams:
    """One client's watch streams: the one new watches are made on, and retired ones that still
    serve watches made earlier. ``make`` opens a new stream object (on the client's channel)."""

    def __init__(self, make: Callable[[], aetcd.watcher.Watcher]) -> None:
        self._make = make
        self._current: aetcd.watcher.Watcher | None = None
        #: per stream in use (the current one and retired ones): its watches not yet cancelled and
        #: its creations under way, and the lock its creations take turns under
        self._users: dict[aetcd.watcher.Watcher, int] = {}
        self._turns: dict[aetcd.watcher.Watcher, asyncio.Lock] = {}
        self._background: set[asyncio.Future[None]] = set()  # cancels and shutdowns under way

    def _current_stream(self) -> aetcd.watcher.Watcher:
        if self._current is None:
            self._current = self._make()
            self._users[self._current] = 0
            self._turns[self._current] = asyncio.Lock()
        return self._current

    def _is_current(self, stream: aetcd.watcher.Watcher) -> bool:
        return stream is self._current

    def renew(self) -> None:
        """Make later watches on a new stream; the present one serves its watches until they are cancelled."""
        old, self._current = self._current, None
        if old is not None:
            self._release(old, 0)

    def retire(self, stream: aetcd.watcher.Watcher) -> None:
        """``stream`` broke: later watches go on a new one (nothing changes if it was retired already)."""
        if stream is self._current:
            self.renew()

    async def open(self, key: bytes, range_end: bytes | None, start_revision: int | None, timeout: float) -> BoundWatch:
        """A watch on ``[key, range_end)`` (``range_end`` None: ``key`` alone) from ``start_revision``.

        Raises aetcd's :class:`~aetcd.exceptions.ClientError` (its timeout: ``WatchTimeoutError``)
        or :class:`asyncio.TimeoutError` after ``timeout`` s.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue()
        creating = asyncio.ensure_future(self._create(key, range_end, start_revision, queue.put))
        try:
            stream, watch_id = await asyncio.wait_for(asyncio.shield(creating), timeout)
        except BaseException as exc:
            creating.add_done_callback(self._unwanted)
            _raise_translated(exc)
        return BoundWatch(self, stream, watch_id, queue)

    async def _create(
        self, key: bytes, range_end: bytes | None, start_revision: int | None, deliver: Callable[[Any], Any]
    ) -> tuple[aetcd.watcher.Watcher, int]:
        """Make the watch on the current stream, in its turn (see the module's docstring)."""
        while True:
            stream = self._current_stream()
            async with self._turns[stream]:
                if not self._is_current(stream):
                    continue  # retired while this creation waited: not where a late answer may come
                self._users[stream] += 1
                try:
                    callback = await stream.add_callback(
                        key, deliver, range_end=range_end, start_revision=start_revision
                    )
                except BaseException:
                    self.retire(stream)  # its answer may still come there: no creation follows it
                    self._release(stream)
                    raise
                return stream, int(callback.watch_id)

    def _unwanted(self, creating: asyncio.Future[tuple[aetcd.watcher.Watcher, int]]) -> None:
        """A creation its caller stopped waiting for ended: a watch it made is cancelled at once."""
        if creating.cancelled() or creating.exception() is not None:
            return
        stream, watch_id = creating.result()
        self._in_background(self.cancel(stream, watch_id))

    async def cancel(self, stream: aetcd.watcher.Watcher, watch_id: int) -> None:
        """Cancel a watch on the stream it was made on; a retired stream left unused is shut down."""
        try:
            await stream.cancel(watch_id)
        finally:
            self._release(stream)

    def _release(self, stream: aetcd.watcher.Watcher, uses: int = 1) -> None:
        """``stream`` has ``uses`` users fewer; once retired and unused, it is shut down."""
        if stream not in self._users:  # shut down already (or the client closed)
            return
        self._users[stream] -= uses
        if self._users[stream] <= 0 and stream is not self._current:
            del self._users[stream], self._turns[stream]
            self._in_background(stream.shutdown())

    def _in_background(self, step: Coroutine[Any, Any, None]) -> None:
        """Run a cancel or a shutdown beside the caller, referenced until it ends; a failure is logged."""
        task = asyncio.ensure_future(step)
        self._background.add(task)

        def ended(t: asyncio.Future[None]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("cancelling an etcd watch or shutting its stream down failed: %r", t.exception())

        task.add_done_callback(ended)

    async def close(self) -> None:
        """Shut every stream down (the client closes): their watches end."""
        streams, self._users, self._turns, self._current = list(self._users), {}, {}, None
        for stream in streams:
            await stream.shutdown()

    def set_metadata(self, metadata: Any) -> None:
        """Credentials for the streams made from now on (and the current one, at its next opening)."""
        if self._current is not None:
            self._current._metadata = metadata
