"""The structured event stream: state transitions for people, dashboards and tests.

Each event goes to the Python log, to ``events/`` in etcd (under a one-day lease so the stream
is bounded) and, when ``--log-dir`` is set, to ``<log_dir>/<job>/events.jsonl``. Writes to etcd
happen on a background task in order; emitting never blocks nor fails the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
        self._lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        #: called with every event as it is emitted (the agent's metrics count them); must not raise
        self.observers: list[Callable[[Event], None]] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._writer())

    def emit(self, kind: str, generation: int, **data: Any) -> None:
        event = Event(time=self._clock(), node_id=self._node_id, kind=kind, generation=generation, data=data)
        log.info("[%s] event %s (generation %d) %s", self._node_id, kind, generation, data)
        if self._jsonl is not None:
            self._jsonl.parent.mkdir(parents=True, exist_ok=True)
            with self._jsonl.open("a") as f:
                f.write(json.dumps({**event.__dict__}) + "\n")
        self._queue.put_nowait(event)
        for observe in self.observers:
            observe(event)

    async def _writer(self) -> None:
        while True:
            event = await self._queue.get()
            if event is None:
                return
            try:
                if self._lease is None:
                    self._lease = await self._store.grant_lease(EVENT_TTL_S)
                key = self._keys.event(int(event.time * 1e9), self._node_id)
                await self._store.put(key, encode(event), lease=self._lease)
            except StoreError as exc:
                log.warning("[%s] event %s was not written to etcd: %s", self._node_id, event.kind, exc)

    async def close(self, timeout: float = 2.0) -> None:
        """Flush queued events (bounded by ``timeout``) and stop the writer."""
        if self._task is None:
            return
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
        self._task = None
