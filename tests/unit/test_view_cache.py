"""The controller's record cache: unchanged records (same key and mod revision) are decoded once,
changed ones again, deleted ones forgotten, and malformed ones reported on every read."""

from __future__ import annotations

import asyncio
from typing import Any

from rlaunch.controller.view import RecordCache, read_snapshot
from rlaunch.store.client import KV
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation, GenerationStatus, NodeRecord, NodeState, encode

KEYS = JobKeys("cache")


class FakeStore:
    """Holds key -> KV; answers the reads read_snapshot makes."""

    def __init__(self) -> None:
        self.kvs: dict[str, KV] = {}
        self.revision = 1

    def put(self, key: str, value: bytes) -> None:
        self.revision += 1
        created = self.kvs[key].create_revision if key in self.kvs else self.revision
        self.kvs[key] = KV(key, value, created, self.revision, 7)

    async def get(self, key: str) -> KV | None:
        return self.kvs.get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        return [kv for k, kv in sorted(self.kvs.items()) if k.startswith(prefix)], self.revision


def record(node: str, state: NodeState = NodeState.RUNNING) -> bytes:
    return encode(NodeRecord(
        node_id=node, host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False, state=state, generation=1,
        restarts=0, master_port=1, updated_at=0.0,
    ))  # fmt: skip


def generation(number: int) -> bytes:
    return encode(Generation(
        number=number, status=GenerationStatus.RUNNING, assignment={"a": 0, "b": 1}, nnodes=2, nproc_per_node=1,
        master_addr="127.0.0.1", master_port=1, restart_count=0, reason="", controller="a", created_at=0.0,
    ))  # fmt: skip


def read(store: FakeStore, cache: RecordCache) -> Any:
    return asyncio.run(read_snapshot(store, KEYS, cache))  # type: ignore[arg-type]


def test_unchanged_records_are_reused_and_changed_ones_decoded_again() -> None:
    store, cache = FakeStore(), RecordCache()
    store.put(KEYS.generation, generation(1))
    for node in ("a", "b", "c"):
        store.put(KEYS.node(node), record(node))
    first = read(store, cache)
    store.put(KEYS.node("b"), record("b", NodeState.FAILED))
    del store.kvs[KEYS.node("c")]
    second = read(store, cache)
    assert second.nodes["a"] is first.nodes["a"] and second.generation is first.generation
    assert second.nodes["b"].record.state is NodeState.FAILED and set(second.nodes) == {"a", "b"}
    assert second.node_leases == {"a": 7, "b": 7}
    store.put(KEYS.node("c"), record("c", NodeState.WAITING))  # c back under a new lease: decoded anew
    store.put(KEYS.generation, generation(2))
    third = read(store, cache)
    assert third.nodes["c"].record.state is NodeState.WAITING and third.nodes["c"] is not first.nodes["c"]
    assert third.generation.number == 2 and third.generation_revision == store.kvs[KEYS.generation].mod_revision


def test_a_malformed_record_is_reported_on_every_read() -> None:
    store, cache = FakeStore(), RecordCache()
    store.put(KEYS.node("a"), b"{not json")
    store.put(KEYS.node("b"), record("x"))  # names another node than its key
    for _ in range(2):
        snap = read(store, cache)
        assert snap.nodes == {} and len(snap.problems) == 2, snap.problems
        assert "not valid JSON" in snap.problems[0] and "names node 'x'" in snap.problems[1]


def test_suspect_marks_are_read_only_when_asked_for() -> None:
    from rlaunch.store.records import SuspectMark

    store, mark = FakeStore(), SuspectMark(node_id="b", generation=1, rank=1, step=40, fault="differs", at=5.0)
    store.put(KEYS.generation, generation(1))
    store.put(KEYS.suspect("b"), encode(mark))
    assert read(store, RecordCache()).suspects == {}, "the controller's ticks spare the read"
    asked = asyncio.run(read_snapshot(store, KEYS, suspects=True))  # type: ignore[arg-type]
    assert asked.suspects == {"b": mark}
