"""Watches bound to the etcd watch stream they were made on.

aetcd multiplexes a client's watches over one gRPC stream (its ``Watcher``), and two of its ways
can cross watches up:

- it cancels a watch through whichever stream the client holds *when cancel is called*; once
  the client has moved its new watches to a fresh stream (after one broke), a late cancel of an
  old watch removes the fresh stream's watch with the same id (etcd numbers each stream's watches
  from 0), which then never delivers another change, silently;
- it hands each "created" answer to whichever creation is waiting on the stream at the time; a
  creation that stopped waiting (aetcd's own timeout, or a cancel from outside) leaves its answer
  to come, and the next creation takes it: that watch follows the other's key.

So rlaunch makes its watches on a stream directly (:class:`WatchStreams`): each watch keeps the
stream it was made on and is cancelled there; a creation that ended without its answer retires
the stream, so that its late answer can only be dropped (later watches go on a new stream), and
a watch that the abandoned creation made after all is cancelled at once; a retired stream is
shut down when its last watch is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
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
        self._stream = stream
        self.watch_id = watch_id
        self._queue = queue
        self._cancelled = False

    async def events(self) -> AsyncIterator[aetcd.rtypes.Event]:
        """The watch's changes; raises :class:`aetcd.exceptions.ClientError` when its stream breaks."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                _raise_translated(item)
            if item is None:  # the stream was shut down
                raise aetcd.exceptions.ClientError("the watch stream was shut down")
            yield item

    async def cancel(self) -> None:
        """Cancel the watch on its own stream (once; later calls do nothing)."""
        if not self._cancelled:
            self._cancelled = True
            await self._streams.cancel(self._stream, self.watch_id)


class WatchStreams:
    """One client's watch streams: the one new watches are made on, and retired ones that still
    serve watches made earlier. ``make`` opens a new stream object (on the client's channel)."""

    def __init__(self, make: Callable[[], aetcd.watcher.Watcher]) -> None:
        self._make = make
        self._current: aetcd.watcher.Watcher | None = None
        #: the watches not yet cancelled, per stream (the current one and retired ones)
        self._open: dict[aetcd.watcher.Watcher, int] = {}
        self._closing: set[asyncio.Future[None]] = set()

    @property
    def current(self) -> aetcd.watcher.Watcher:
        """The stream new watches are made on."""
        if self._current is None:
            self._current = self._make()
            self._open[self._current] = 0
        return self._current

    def renew(self) -> None:
        """Make later watches on a new stream; the present one serves its watches until they are cancelled."""
        old, self._current = self._current, None
        if old is not None and self._open.get(old) == 0:
            self._shut(old)

    async def open(self, key: bytes, range_end: bytes | None, start_revision: int | None, timeout: float) -> BoundWatch:
        """A watch on ``[key, range_end)`` (``range_end`` None: ``key`` alone) from ``start_revision``.

        Raises aetcd's :class:`~aetcd.exceptions.ClientError` (a timeout: ``WatchTimeoutError``) or
        :class:`asyncio.TimeoutError` after ``timeout`` s; either way the stream is retired.
        """
        stream = self.current
        queue: asyncio.Queue[Any] = asyncio.Queue()
        creating = asyncio.ensure_future(
            stream.add_callback(key, queue.put, range_end=range_end, start_revision=start_revision)
        )
        try:
            callback = await asyncio.wait_for(asyncio.shield(creating), timeout)
        except BaseException as exc:
            self._abandon(stream, creating)
            _raise_translated(exc)
        self._open[stream] = self._open.get(stream, 0) + 1
        return BoundWatch(self, stream, int(callback.watch_id), queue)

    def _abandon(self, stream: aetcd.watcher.Watcher, creating: asyncio.Future[Any]) -> None:
        """A creation ended here without its answer: its stream takes no more creations, and a watch
        it makes after all is cancelled as soon as it is made."""
        if stream is self._current:
            self.renew()

        def made(task: asyncio.Future[Any]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            self._open[stream] = self._open.get(stream, 0) + 1
            self._track(asyncio.ensure_future(self.cancel(stream, int(task.result().watch_id))))

        creating.add_done_callback(made)

    async def cancel(self, stream: aetcd.watcher.Watcher, watch_id: int) -> None:
        """Cancel a watch on the stream it was made on; a retired stream left with none is shut down."""
        try:
            await stream.cancel(watch_id)
        finally:
            if stream in self._open:  # (not shut down already)
                self._open[stream] -= 1
                if self._open[stream] <= 0 and stream is not self._current:
                    self._shut(stream)

    def _shut(self, stream: aetcd.watcher.Watcher) -> None:
        self._open.pop(stream, None)
        self._track(asyncio.ensure_future(stream.shutdown()))

    def _track(self, task: asyncio.Future[None]) -> None:
        """Keep a background step referenced until it ends, and log how it failed (never raised)."""
        self._closing.add(task)

        def ended(t: asyncio.Future[None]) -> None:
            self._closing.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("closing an etcd watch failed: %r", t.exception())

        task.add_done_callback(ended)

    async def close(self) -> None:
        """Shut every stream down (the client closes): their watches end with an error."""
        streams, self._open, self._current = list(self._open), {}, None
        for stream in streams:
            await stream.shutdown()

    def set_metadata(self, metadata: Any) -> None:
        """Credentials for the streams made from now on (and the current one, at its next opening)."""
        if self._current is not None:
            self._current._metadata = metadata
