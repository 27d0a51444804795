"""Following the job's generations: watch the keys this node acts on, keep the latest generation.

One watch per agent, narrowed to what the node acts on (never ``kv/`` or ``events/``): the
generation key and the leader key, plus node records where this node decides from them, and the
acks, drain requests and marks for the leader. Every change wakes the agent's loop; changes the
controller acts on wake the controller too, and while this node leads, the node records' changes
feed the controller's copy of them (:mod:`rlaunch.controller.feed`), which follows etcd only while
one watch runs. After a failed watch it reads the keys afresh and watches again from the revision
it read, so no change is lost.

The generation key holds the generation's head, whose size is that of its change, not of the job:
the rank map is rebuilt from the generation held, or read whole when the head does not change that
one (see :mod:`rlaunch.store.generations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlaunch.controller.feed import NodeFeed
from rlaunch.errors import RecordError, StoreError
from rlaunch.store import generations
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a failed watch waits before it reads and watches again.
RETRY_S = 1.0


class GenerationWatch:
    """The latest generation this node has seen, and whether node records changed since last asked."""

    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        node_id: str,
        wake: Callable[[], None],
        wake_controller: Callable[[], None],
        on_generation: Callable[[Generation], None],
        feed: NodeFeed | None = None,
    ) -> None:
        self._store = store
        #: the node records for this node's controller, kept from this watch while it leads
        self._feed = feed
        self._keys = keys
        self._node_id = node_id
        self._wake = wake
        self._wake_controller = wake_controller
        self._on_generation = on_generation
        self.generation: Generation | None = None
        #: node records may have changed since the agent last cleared this (a standby re-reads them only then)
        self.nodes_changed = True
        self._reported: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the keys this node acts on until ``stop``: keep the latest generation, wake the loops."""
        keys, store = self._keys, self._store
        failing = False
        while not stop.is_set():
            try:
                kv, revision = await store.get_at(keys.generation)
                if failing:
                    log.info("[%s] watching etcd again from revision %d", self._node_id, revision + 1)
                failing = False
                if kv is not None:
                    await self.take(kv.value)
                leader, _ = await store.get_at(keys.leader)
                await self._watch(revision, leader is not None and leader.value == self._node_id.encode())
            except StoreError as exc:
                # Said once per outage: the lease keeper reports how long etcd stays away.
                log.log(logging.DEBUG if failing else logging.WARNING, "[%s] watching etcd failed, retrying: %s",
                        self._node_id, exc)  # fmt: skip
                failing = True
                await wait_event(stop, RETRY_S)

    async def _watch(self, revision: int, leading: bool) -> None:
        """One watch of the keys this node acts on, from ``revision`` + 1 (read just before), until
        they change (leadership, or this node's part) or it breaks. While this node leads, the
        controller's feed follows this watch, and only while it runs, however it ends."""
        keys, ranges = self._keys, self.ranges(leading)
        feed = self._feed if leading else None
        if feed is not None:
            feed.watching()  # (after the read of the revision the watch starts from)
        try:
            self.nodes_changed = True  # anything may have changed while the watch was down
            self._wake()
            self._wake_controller()
            async with contextlib.aclosing(self._store.watch_many(ranges, start_revision=revision + 1)) as events:
                async for ev in events:
                    if ev.key == keys.generation and not ev.deleted:
                        await self.take(ev.value)
                    elif ev.key.startswith(keys.nodes_prefix):
                        self.nodes_changed = True
                        if feed is not None:
                            feed.saw(ev)
                    elif ev.key == keys.leader:
                        leading = not ev.deleted and ev.value == self._node_id.encode()
                    self._wake()
                    # A non-leader campaigns only when the leader key goes (with its lease).
                    if leading or (ev.key == keys.leader and ev.deleted):
                        self._wake_controller()
                    if self.ranges(leading) != ranges:
                        return  # leadership or this node's part changed: follow other keys
        finally:
            if feed is not None:
                feed.blind()

    async def read_changed_nodes(self, read: Callable[[], Awaitable[T]]) -> T:
        """``read()`` the node records because they changed since last asked (:attr:`nodes_changed`).

        The change is marked seen before the read, so that one during it is read again; if the read
        fails it is marked again: otherwise the next look would decide without the records, and a
        standby that needed them to warm up would stay cold until some record changed again.
        """
        self.nodes_changed = False
        try:
            return await read()
        except BaseException:
            self.nodes_changed = True
            raise

    def ranges(self, leading: bool) -> tuple[tuple[str, bool], ...]:
        """The ``(key or prefix, exact)`` ranges this node acts on (never ``kv/`` or ``events/``).

        Every node: the generation and the leader key (to campaign when it goes). Node records only
        for the leader (its planner reads them) and for a node a generation gives no ranks (a
        standby decides on warm workers from them); the acks (a restart starts once the controller
        saw them all), drain requests and marks only for the leader. No node watches what every
        other node writes (acks; records while the job forms): with N nodes, N² watch events.
        """
        k, gen = self._keys, self.generation
        ranges = [(k.generation, True), (k.leader, True)]
        if leading or (gen is not None and self._node_id not in gen.assignment):
            ranges.append((k.nodes_prefix, False))
        if leading:
            ranges += [(k.all_acks_prefix, False), (k.drains_prefix, False), (k.drained_prefix, False)]
        return tuple(ranges)

    async def take(self, raw: bytes) -> None:
        """Keep the generation whose head is ``raw`` if it is not older than the one held (said once
        if invalid). Raises :class:`StoreError` when its rank map had to be read and could not."""
        try:
            gen = await generations.follow(self._store, self._keys, raw, self.generation)
        except RecordError as exc:
            if str(exc) not in self._reported:
                self._reported.add(str(exc))
                log.error("[%s] %s", self._node_id, exc)
            return
        if gen is None:
            return  # a newer generation replaced it while its map was read: the watch brings that one
        if self.generation is None or gen.number >= self.generation.number:
            self.generation = gen
            self._on_generation(gen)
