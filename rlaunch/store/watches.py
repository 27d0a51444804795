"""Watches bound to the etcd watch stream they were made on.

aetcd multiplexes a client's watches over one gRPC stream (its ``Watcher``), and several of its
ways can cross watches up or leave one silent:

- it cancels a watch through whichever stream the client holds *when cancel is called*; once
  the client has moved its new watches to a fresh stream (after one broke), a late cancel of an
  old watch removes the fresh stream's watch with the same id (etcd numbers each stream's watches
  from 0), which then never delivers another change, silently;
- a ``Watcher`` whose gRPC stream broke opens a new one at its next watch, under the same object,
  so the same late cancel hits a watch made since;
- it hands each "created" answer to whichever creation is waiting on the stream at the time; a
  creation that stopped waiting (aetcd's own timeout) leaves its answer to come, and the next
  creation on that stream takes it: that watch follows the other's key;
- it takes etcd's refusal of a creation ("created" and "canceled" at once: a stale auth token,
  a permission denied) for a watch, which never delivers anything.

So rlaunch makes its watches on a stream of its own kind (:class:`WatchStream`: one object is one
gRPC stream, never reopened once it ended; a refused creation fails with etcd's reason), through
:class:`WatchStreams`: each watch keeps the stream it was made on and is cancelled there.
Creations on a stream take turns under a lock of rlaunch's, each holding it until its own answer
or its failure: one that failed retires the stream before it lets the next in, so no later
creation is made where a late answer can still come (a waiting one moves to the new stream). A
caller that stops waiting (its timeout, a cancel) leaves the creation to finish under the lock; a
watch it makes after all is cancelled at once, as is one registered by an answer that came just as
aetcd's own wait for it gave up. A retired stream is shut down once no watch or
creation uses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, NoReturn

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.rtypes
import aetcd.watcher

log = logging.getLogger(__name__)


def raise_translated(exc: BaseException) -> NoReturn:
    """Raise ``exc`` as aetcd's client methods do: a gRPC error as its :class:`aetcd.exceptions.ClientError`."""
    if isinstance(exc, aetcd.rpc.AioRpcError):
        aetcd.exceptions._handle_exception(exc)
    raise exc


class WatchStream(aetcd.watcher.Watcher):  # type: ignore[misc]
    """One gRPC watch stream: never reopened once it ended (``on_end`` is told at once), and a
    creation etcd refuses fails with etcd's reason instead of becoming a watch that delivers nothing."""

    def __init__(self, stub: Any, timeout: int, metadata: Any, on_end: Callable[[WatchStream], None]) -> None:
        super().__init__(stub, timeout=timeout, metadata=metadata)
        self.ended = False
        self._on_end = on_end

    async def setup(self) -> None:
        if self.ended:
            raise aetcd.exceptions.ConnectionFailedError("the watch stream has ended")
        await super().setup()

    async def _terminate_stream(self, error: Any) -> None:
        if not self.ended:
            self.ended = True
            self._on_end(self)
        await super()._terminate_stream(error)

    async def _handle_response(self, response: Any) -> None:
        if response.created and (response.canceled or response.compact_revision):
            async with self._lock:
                waiting = self._new_callback
                if waiting is not None:
                    waiting.error = (
                        aetcd.exceptions.RevisionCompactedError(response.compact_revision)
                        if response.compact_revision
                        else aetcd.exceptions.ClientError(response.cancel_reason or "etcd refused the watch")
                    )
                    self._new_callback_ready.notify_all()
            return
        await super()._handle_response(response)

    def watches_of(self, callback: Callable[[Any], Any]) -> list[int]:
        """The ids of this stream's watches that deliver to ``callback``. A creation whose answer came
        just as aetcd's own wait for it timed out failed, yet its watch is registered here."""
        return [watch_id for watch_id, cb in self._callbacks.items() if cb.callback is callback]


class BoundWatch:
    """One watch, on the stream it was made on: iterate :meth:`events`, then :meth:`close` it."""

    def __init__(self, streams: WatchStreams, stream: WatchStream, watch_id: int, queue: asyncio.Queue[Any]) -> None:
        self._streams = streams
        self.stream = stream
        self.watch_id = watch_id
        self._queue = queue
        self._cancelling: asyncio.Future[None] | None = None

    async def events(self) -> AsyncIterator[aetcd.rtypes.Event]:
        """The watch's changes; raises :class:`aetcd.exceptions.ClientError` when its stream breaks,
        and ends when the client shuts the stream down (it closes)."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise_translated(item)
            yield item

    def close(self) -> asyncio.Future[None]:
        """Start cancelling the watch on its own stream (once), without waiting: it happens even
        if the caller is cancelled right after. Returns the cancel under way."""
        if self._cancelling is None:
            self._cancelling = self._streams.in_background(self._streams.cancel(self.stream, self.watch_id))
        return self._cancelling


class WatchStreams:
    """One client's watch streams: the one new watches are made on, and retired ones that still
    serve watches made earlier. ``make(on_end)`` makes a new stream (on the client's channel)."""

    def __init__(self, make: Callable[[Callable[[WatchStream], None]], WatchStream]) -> None:
        self._make = make
        self._current: WatchStream | None = None
        #: per stream in use (the current one and retired ones): its watches not yet cancelled and
        #: its creations under way, and the lock its creations take turns under
        self._users: dict[WatchStream, int] = {}
        self._turns: dict[WatchStream, asyncio.Lock] = {}
        self._background: set[asyncio.Future[None]] = set()  # cancels and shutdowns under way
        self._closed = False

    def _current_stream(self) -> WatchStream:
        if self._closed:
            raise aetcd.exceptions.ConnectionFailedError("the etcd client was closed")
        if self._current is None:
            self._current = self._make(self.retire)
            self._users[self._current] = 0
            self._turns[self._current] = asyncio.Lock()
        return self._current

    def _is_current(self, stream: WatchStream) -> bool:
        return stream is self._current

    def renew(self) -> None:
        """Make later watches on a new stream; the present one serves its watches until they are cancelled."""
        old, self._current = self._current, None
        if old is not None:
            self._release(old, 0)

    def retire(self, stream: WatchStream) -> None:
        """``stream`` broke or was refused: later watches go on a new one (if it was not retired already)."""
        if stream is self._current:
            self.renew()

    async def open(self, key: bytes, range_end: bytes | None, start_revision: int | None, timeout: float) -> BoundWatch:
        """A watch on ``[key, range_end)`` (``range_end`` None: ``key`` alone) from ``start_revision``.

        Raises aetcd's :class:`~aetcd.exceptions.ClientError` (its timeout: ``WatchTimeoutError``;
        etcd's refusal, with its reason) or :class:`asyncio.TimeoutError` after ``timeout`` s.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue()
        creating = asyncio.ensure_future(self._create(key, range_end, start_revision, queue.put))
        try:
            stream, watch_id = await asyncio.wait_for(asyncio.shield(creating), timeout)
        except BaseException as exc:
            creating.add_done_callback(self._unwanted)
            raise_translated(exc)
        return BoundWatch(self, stream, watch_id, queue)

    async def _create(
        self, key: bytes, range_end: bytes | None, start_revision: int | None, deliver: Callable[[Any], Any]
    ) -> tuple[WatchStream, int]:
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
                    if stream in self._users:  # not shut down already (the client closed)
                        for watch_id in stream.watches_of(deliver):  # made by an answer that came as aetcd gave up
                            self._users[stream] += 1
                            self.in_background(self.cancel(stream, watch_id))
                    self._release(stream)
                    raise
                return stream, int(callback.watch_id)

    def _unwanted(self, creating: asyncio.Future[tuple[WatchStream, int]]) -> None:
        """A creation its caller stopped waiting for ended: a watch it made is cancelled at once."""
        if creating.cancelled() or creating.exception() is not None:
            return
        stream, watch_id = creating.result()
        self.in_background(self.cancel(stream, watch_id))

    async def cancel(self, stream: WatchStream, watch_id: int) -> None:
        """Cancel a watch on the stream it was made on; a retired stream left unused is shut down."""
        try:
            await stream.cancel(watch_id)
        finally:
            self._release(stream)

    def _release(self, stream: WatchStream, uses: int = 1) -> None:
        """``stream`` has ``uses`` users fewer; once retired and unused, it is shut down."""
        if stream not in self._users:  # shut down already (or the client closed)
            return
        self._users[stream] -= uses
        if self._users[stream] <= 0 and stream is not self._current:
            del self._users[stream], self._turns[stream]
            self.in_background(stream.shutdown())

    def in_background(self, step: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run a cancel or a shutdown beside the caller, referenced until it ends (a failure is
        logged, never raised); returns it."""
        task = asyncio.ensure_future(step)
        self._background.add(task)

        def ended(t: asyncio.Future[None]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("cancelling an etcd watch or shutting its stream down failed: %r", t.exception())

        task.add_done_callback(ended)
        return task

    async def close(self) -> None:
        """Shut every stream down (the client closes): their watches end, and no watch is made after."""
        self._closed = True
        streams, self._users, self._turns, self._current = list(self._users), {}, {}, None
        for stream in streams:
            await stream.shutdown()
