"""The structured event stream: state transitions for people, dashboards and tests.

Each event goes to the Python log, to ``events/`` in etcd (under a one-day lease so the stream
is bounded) and, when ``--log-dir`` is set, to ``<log_dir>/<job>/events.jsonl``. A *local*
event (:meth:`EventLog.note`: one that recurs while the job trains, such as a committed host
snapshot) skips etcd, which sees no traffic per step. Writes to etcd
and to the file happen on background tasks, each in order (the file's on a thread, and never
behind etcd); emitting never blocks nor fails the caller. The node record goes to etcd in one
request with the events pending when it is sent, unless a request of events is in flight
(:meth:`EventLog.put_with`): a move's offer and the node state published with it cost a node one
request, not two (at a fault, every node of the job writes them at once). An event that the node
record soon follows by design (a survivor's offer of a replacement, its workers' ``recovered``:
the record says ``running`` once they all did) may wait for it, a bounded time
(:meth:`EventLog.emit_with_record`), rather than cost a request of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rlaunch.errors import StoreError
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, encode

log = logging.getLogger(__name__)

EVENT_TTL_S = 24 * 3600
#: Queued events written in one etcd transaction at most (etcd's default limit is 128 operations).
EVENTS_PER_REQUEST = 64
#: Bytes (keys and values) of queued events written in one transaction at most, unless one event is
#: larger alone: etcd refuses a request over 1.5 MiB by default, and a ``generation`` event carries
#: the rank map (~80 KB at 4,096 nodes).
BYTES_PER_REQUEST = 512 * 1024


#: The longest an event emitted with :meth:`EventLog.emit_with_record` waits for the node record.
RECORD_WAIT_S = 5.0


class _Queued(NamedTuple):
    """An event on its way to etcd, with its key (from its nanosecond) and, for one that waits for the
    node record, until when (``time.monotonic``; 0: it goes at once)."""

    key: str
    event: Event
    wait_until: float = 0.0


class _Put(NamedTuple):
    """An event ready to be written: its key, its encoded value, its kind (for the log)."""

    key: str
    value: bytes
    kind: str

    @staticmethod
    def of(queued: _Queued) -> _Put:
        return _Put(queued.key, encode(queued.event), queued.event.kind)


class EventLog:
    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        node_id: str,
        jsonl: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._jsonl = jsonl
        self._clock = clock
        self._pending: collections.deque[_Queued] = collections.deque()  # emitted, not yet written
        #: set while events are pending and not all waiting for a record (see _writer), or the log closes
        self._ready = asyncio.Event()
        self._closing = False
        #: clear while a request of events is in flight (one at a time, so that they land in order)
        self._free = asyncio.Event()
        self._free.set()
        self._lines: asyncio.Queue[Event | None] = asyncio.Queue()  # for events.jsonl, written apart from etcd
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._file_task: asyncio.Task[None] | None = None
        self._last_ns = 0  # the nanosecond of the last event (its etcd key): each event's is later
        self._last_time = 0.0  # the time of the last event (``_last_ns`` in seconds): each event's is later
        #: called with every event as it is emitted (the agent's metrics count them); must not raise
        self.observers: list[Callable[[Event], None]] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._writer())
        if self._jsonl is not None:
            self._file_task = asyncio.get_running_loop().create_task(self._file_writer())

    def note(self, kind: str, generation: int, **data: Any) -> None:
        """A local event: the log, events.jsonl and the observers (metrics), not etcd."""
        self._record(kind, generation, data, to_etcd=False)

    def emit(self, kind: str, generation: int, **data: Any) -> None:
        self._record(kind, generation, data, to_etcd=True)

    def emit_with_record(self, kind: str, generation: int, **data: Any) -> None:
        """As :meth:`emit`, but the event may wait up to :data:`RECORD_WAIT_S` for the node record
        (:meth:`put_with`) to go in its request. It goes at once with an event emitted meanwhile that
        does not wait, at the log's close, and on its own once a record went without it (see
        :meth:`put_with`). Its time is when it was emitted, as any event's."""
        self._record(kind, generation, data, to_etcd=True, wait_s=RECORD_WAIT_S)

    def _record(self, kind: str, generation: int, data: dict[str, Any], to_etcd: bool, wait_s: float = 0.0) -> None:
        ns, when = self._stamp()
        event = Event(time=when, node_id=self._node_id, kind=kind, generation=generation, data=data)
        log.info("[%s] event %s (generation %d) %s", self._node_id, kind, generation, data)
        if to_etcd:
            until = time.monotonic() + wait_s if wait_s > 0 else 0.0
            self._pending.append(_Queued(self._keys.event(ns, self._node_id), event, until))
            self._ready.set()
        if self._jsonl is not None:
            self._lines.put_nowait(event)
        for observe in self.observers:
            observe(event)

    def _stamp(self) -> tuple[int, float]:
        """The next event's nanosecond (its etcd key) and time (that nanosecond in seconds), each later
        than the last event's even within one tick of the clock.

        Two events in one tick (time.time() moves in 238 ns steps today) would otherwise share a key:
        the later would overwrite the earlier, and a transaction putting both is refused by etcd, which
        loses its whole batch. Nanoseconds are counted as integers: neighbouring float times often
        round to one nanosecond. A float time has a coarser step than a nanosecond (238 ns at 1.8e9 s),
        so the count moves on until the time moves too: the report takes events of one node, kind and
        time for copies of one event.
        """
        ns = max(int(self._clock() * 1e9), self._last_ns + 1)
        while ns / 1e9 <= self._last_time:
            ns += 1  # a few hundred steps at most, and only within one tick
        self._last_ns, self._last_time = ns, ns / 1e9
        return ns, self._last_time

    async def _writer(self) -> None:
        """Write the pending events in order; those pending together go in one request (an agent emits
        a few at once, such as a move's offer and the node state it publishes with it). While every
        pending event waits for the node record (:meth:`emit_with_record`), it waits with them."""
        while True:
            await self._ready.wait()
            await self._free.wait()
            if not self._free.is_set():
                continue  # a record took the lead with the pending events meanwhile
            wait = self._wait_s()
            if wait > 0:
                self._ready.clear()  # set again by the next event, a record gone without them, or close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ready.wait(), wait)
                if self._pending:
                    self._ready.set()  # a record may have taken them meanwhile; else they go now
                continue
            taken = self._take(EVENTS_PER_REQUEST, BYTES_PER_REQUEST, alone=True)
            if not taken:
                self._ready.clear()
                if self._closing:
                    return
                continue
            batch = [put for _, put in taken]
            self._free.clear()
            try:
                if len(batch) > 1:
                    await self._put_batch(batch)
                else:
                    await self._put_one(batch[0])
            finally:
                self._free.set()

    def _release(self) -> None:
        """The pending events wait for no record any more: the writer sends them now."""
        self._pending = collections.deque(q._replace(wait_until=0.0) if q.wait_until else q for q in self._pending)
        if self._pending:
            self._ready.set()

    def _wait_s(self) -> float:
        """How long the writer leaves the pending events for the node record: while every one of them
        waits for it (:meth:`emit_with_record`), until the first of their waits ends; 0 when one does
        not wait, or the log closes."""
        if self._closing or not self._pending or any(q.wait_until == 0.0 for q in self._pending):
            return 0.0
        return max(0.0, min(q.wait_until for q in self._pending) - time.monotonic())

    def _take(self, count: int, size: int, alone: bool) -> list[tuple[_Queued, _Put]]:
        """The first pending events, encoded, up to ``count`` of them and ``size`` bytes (keys and
        values); ``alone``: the first one even when it is larger alone."""
        taken: list[tuple[_Queued, _Put]] = []
        used = 0
        while self._pending and len(taken) < count:
            put = _Put.of(self._pending[0])
            if used + len(put.key) + len(put.value) > size and (taken or not alone):
                break
            taken.append((self._pending.popleft(), put))
            used += len(put.key) + len(put.value)
        return taken

    async def put_with(self, key: str, value: bytes, lease: int) -> None:
        """Put ``key`` under ``lease`` in one request with the events pending now. While a request of
        events is in flight, the key goes alone, never waiting on it (an outage makes the writer try each
        event of a failed batch in turn), and the events stay with the writer, so that they reach etcd
        in the order they were emitted. If the request with the events fails (their lease gone, a
        request too large), its events stay pending, first in line, and the key goes alone: raises
        :class:`~rlaunch.errors.StoreError` only when etcd did not take the key itself. The pending
        events that waited for a record (:meth:`emit_with_record`) and did not go with this one wait no
        more: the writer sends them."""
        taken = []
        if self._free.is_set():
            taken = self._take(EVENTS_PER_REQUEST - 1, BYTES_PER_REQUEST - len(key) - len(value), alone=False)
        if not taken:
            self._release()  # the record they waited for goes without them (events in flight, or too large)
            await self._store.put(key, value, lease=lease)
            return
        self._free.clear()
        try:
            events_lease = await self._events_lease()
            events = [(put.key, put.value, events_lease) for _, put in taken]
            await self._store.put_each([(key, value, lease), *events])
            self._release()  # those the request had no room for
            return
        except BaseException as exc:
            self._pending.extendleft(queued for queued, _ in reversed(taken))  # first in line
            self._release()  # this record goes without them
            if not isinstance(exc, StoreError):
                raise
            self._lease = None  # if it was the events' lease that failed, the next request grants another
            log.info("[%s] a record and %d events were not written together (%s); the record goes alone",
                     self._node_id, len(taken), exc)  # fmt: skip
        finally:
            self._free.set()
        await self._store.put(key, value, lease=lease)

    async def _events_lease(self) -> int:
        """The lease every event is put under (granted at the first request, and again after a failed one)."""
        if self._lease is None:
            self._lease = await self._store.grant_lease(EVENT_TTL_S)
        return self._lease

    async def _put_batch(self, batch: list[_Put]) -> None:
        """Write ``batch`` in one transaction or, if that fails, its events one by one (so an outage
        loses no more events than when each went alone)."""
        try:
            lease = await self._events_lease()
            await self._store.put_all([(q.key, q.value) for q in batch], lease=lease)
            return
        except StoreError as exc:
            self._lease = None  # if it was the lease that failed, the next request grants another
            log.info("[%s] %d events were not written to etcd together (%s); writing them one by one",
                     self._node_id, len(batch), exc)  # fmt: skip
        for queued in batch:
            await self._put_one(queued)

    async def _put_one(self, queued: _Put) -> None:
        try:
            lease = await self._events_lease()
            await self._store.put(queued.key, queued.value, lease=lease)
        except StoreError as exc:
            self._lease = None
            log.warning("[%s] event %s was not written to etcd: %s", self._node_id, queued.kind, exc)

    async def _file_writer(self) -> None:
        """Append each event to events.jsonl, off the event loop and never waiting on etcd."""
        while (event := await self._lines.get()) is not None:
            await asyncio.to_thread(self._append, event)

    def _append(self, event: Event) -> None:
        assert self._jsonl is not None
        self._jsonl.parent.mkdir(parents=True, exist_ok=True)
        with self._jsonl.open("a") as f:
            f.write(json.dumps({**event.__dict__}) + "\n")

    async def close(self, timeout: float = 2.0) -> None:
        """Flush queued events (to etcd: bounded by ``timeout``; to events.jsonl: all) and stop the writers."""
        if self._file_task is not None:
            self._lines.put_nowait(None)
            await self._file_task  # local appends: they end however etcd is doing
            self._file_task = None
        if self._task is None:
            return
        self._closing = True
        self._ready.set()
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
        self._task = None
