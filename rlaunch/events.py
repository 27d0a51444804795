"""The structured event stream: state transitions for people, dashboards and tests.

Each event goes to the Python log, to ``events/`` in etcd (under a one-day lease so the stream
is bounded) and, when ``--log-dir`` is set, to ``<log_dir>/<job>/events.jsonl``. A *local*
event (:meth:`EventLog.note`: one that recurs while the job trains, such as a committed host
snapshot) skips etcd, which sees no traffic per step. Writes to etcd
and to the file happen on background tasks, each in order (the file's on a thread, and never
behind etcd); emitting never blocks nor fails the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlaunch.errors import StoreError
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, encode

log = logging.getLogger(__name__)

EVENT_TTL_S = 24 * 3600
#: Queued events written in one etcd transaction at most (etcd's default limit is 128 operations).
EVENTS_PER_REQUEST = 64


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
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._lines: asyncio.Queue[Event | None] = asyncio.Queue()  # for events.jsonl, written apart from etcd
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._file_task: asyncio.Task[None] | None = None
        self._last = -math.inf  # the time of the last event: each event's is later (its etcd key is its time)
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

    def _record(self, kind: str, generation: int, data: dict[str, Any], to_etcd: bool) -> None:
        # Two events in one tick of the clock (time.time() moves in 238 ns steps today) would share an
        # etcd key, the later overwriting the earlier (a progress batch right after the event it rides on).
        now = self._clock()
        self._last = now if now > self._last else math.nextafter(self._last, math.inf)
        event = Event(time=self._last, node_id=self._node_id, kind=kind, generation=generation, data=data)
        log.info("[%s] event %s (generation %d) %s", self._node_id, kind, generation, data)
        if to_etcd:
            self._queue.put_nowait(event)
        if self._jsonl is not None:
            self._lines.put_nowait(event)
        for observe in self.observers:
            observe(event)

    async def _writer(self) -> None:
        """Write the queued events in order; those queued together go in one request (an agent emits
        a few at once, such as a move's offer and the node state it publishes with it)."""
        while True:
            batch = [await self._queue.get()]
            while batch[-1] is not None and len(batch) < EVENTS_PER_REQUEST and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            events = [e for e in batch if e is not None]
            try:
                if events and self._lease is None:
                    self._lease = await self._store.grant_lease(EVENT_TTL_S)
                items = [(self._keys.event(int(e.time * 1e9), self._node_id), encode(e)) for e in events]
                if len(items) == 1:
                    await self._store.put(*items[0], lease=self._lease)
                elif items:
                    await self._store.put_all(items, lease=self._lease)
            except StoreError as exc:
                kinds = ", ".join(e.kind for e in events)
                log.warning("[%s] event(s) %s were not written to etcd: %s", self._node_id, kinds, exc)
            if batch[-1] is None:
                return

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
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
        self._task = None
