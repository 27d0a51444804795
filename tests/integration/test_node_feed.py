"""The leader's node records kept from its watch (rlaunch.controller.feed) against a real etcd: the
agent's own generation watch feeds them while its node leads, they stay equal to what etcd holds
through puts and deletions written around a whole read and through a lease's expiry, a tick reads
them from the feed while it follows, and a watch that ends for a change of leader leaves nothing
vouched for until a read under the next one. (The unit tests order a read and the changes around
it deterministically.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from rlaunch.agent.generations import GenerationWatch
from rlaunch.controller.feed import FeedState, NodeFeed
from rlaunch.controller.view import read_snapshot
from rlaunch.store.client import KV, Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import NodeRecord, NodeState, encode
from tests.cluster import run_store


class CountingStore(Store):
    """The real store client, counting whole reads of a prefix (to tell a read from the feed)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.endpoints, timeout=store.timeout)
        self.prefix_reads: list[str] = []

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        self.prefix_reads.append(prefix)
        return await super().get_prefix(prefix)


def record(node: str, generation: int) -> bytes:
    return encode(
        NodeRecord(node_id=node, host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False,
                   state=NodeState.RUNNING, generation=generation, restarts=0, master_port=1, updated_at=1.0)
    )  # fmt: skip


def same(feed: NodeFeed, kvs: list[KV]) -> bool:
    held = feed.records()
    return held is not None and sorted(held, key=lambda kv: kv.key) == sorted(kvs, key=lambda kv: kv.key)


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, f"{what} did not happen within {timeout:.0f} s"
        await asyncio.sleep(0.02)


def test_the_leaders_watch_keeps_the_node_records_equal_to_etcds(endpoint: str) -> None:
    keys = JobKeys("feed-" + uuid.uuid4().hex[:8])

    async def go(plain: Store) -> None:
        store = CountingStore(plain)
        lease = await store.grant_lease(30)
        short = await store.grant_lease(2)  # records that go with an expiring lease, as a lost node's
        for i in range(20):
            await store.put(keys.node(f"n{i:02d}"), record(f"n{i:02d}", 1), lease=short if i >= 15 else lease)
        await store.put(keys.leader, b"a", lease=lease)
        feed, stop = NodeFeed(), asyncio.Event()
        watch = GenerationWatch(store, keys, "a", lambda: None, lambda: None, lambda _: None, feed)
        task = asyncio.create_task(watch.run(stop))
        try:
            await until(lambda: feed.state is FeedState.CATCHING_UP, "the leader's watch to start")
            assert feed.records() is None, "nothing is vouched for before a whole read under this watch"

            # A tick's read, with writes around it: the feed takes it and follows.
            writes = asyncio.create_task(write_some(store, keys, lease, range(20, 60)))
            await read_snapshot(store, keys, feed=feed)
            await writes
            whole: list[KV] = []

            async def expired() -> bool:  # the short lease's end takes its 5 records with it
                nonlocal whole
                whole, _ = await store.get_prefix(keys.nodes_prefix)
                return len(whole) == 60 - 10 - 5

            for _ in range(100):
                if await expired():
                    break
                await asyncio.sleep(0.1)
            assert len(whole) == 45 and not any(kv.key.endswith(("n15", "n19")) for kv in whole)
            await until(lambda: same(feed, whole), "the feed to hold what etcd holds")

            # While it follows, a tick reads no node record from etcd, and sees the newest.
            await store.put(keys.node("n00"), record("n00", 2), lease=lease)
            whole, _ = await store.get_prefix(keys.nodes_prefix)
            await until(lambda: same(feed, whole), "the feed to take n00's new record")
            reads = len(store.prefix_reads)
            snap = await read_snapshot(store, keys, feed=feed)
            assert keys.nodes_prefix not in store.prefix_reads[reads:]
            assert snap.nodes["n00"].record.generation == 2 and len(snap.nodes) == len(whole)
            assert snap.node_leases["n00"] == lease

            # Another node leads: that watch ends, and the feed vouches for nothing.
            await store.put(keys.leader, b"b", lease=lease)
            await until(lambda: feed.state is FeedState.BLIND, "the feed to go blind with the lead")
            await store.put(keys.node("n01"), record("n01", 3), lease=lease)
            await store.put(keys.leader, b"a", lease=lease)
            await until(lambda: feed.state is FeedState.CATCHING_UP, "the leader's watch to start again")
            reads = len(store.prefix_reads)
            snap = await read_snapshot(store, keys, feed=feed)
            assert keys.nodes_prefix in store.prefix_reads[reads:], "a whole read under the new watch"
            assert snap.nodes["n01"].record.generation == 3
            whole, _ = await store.get_prefix(keys.nodes_prefix)
            assert same(feed, whole)
        finally:
            stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await store.delete_prefix(keys.prefix)
            await store.close()

    run_store(endpoint, go)


async def write_some(store: Store, keys: JobKeys, lease: int, numbers: range) -> None:
    """Puts of new records, and deletions of ten older ones, one request each."""
    for i in numbers:
        await store.put(keys.node(f"n{i:02d}"), record(f"n{i:02d}", 1), lease=lease)
        if i % 4 == 0:
            await store.delete(keys.node(f"n{(i - 20) // 4 + 2:02d}"))
