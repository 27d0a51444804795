"""The controller's record cache: unchanged records (same key and mod revision) are decoded once,
changed ones again, deleted ones forgotten, and malformed ones reported on every read."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from rlaunch.controller.view import RecordCache, read_snapshot
from rlaunch.store.client import KV
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Assignment, Generation, GenerationStatus, NodeRecord, NodeState, encode

KEYS = JobKeys("cache")


class FakeStore:
    """Holds key -> KV; answers the reads read_snapshot makes."""

    def __init__(self) -> None:
        self.kvs: dict[str, KV] = {}
        self.revision = 1
        self.gets: list[str] = []

    def put(self, key: str, value: bytes) -> None:
        self.revision += 1
        created = self.kvs[key].create_revision if key in self.kvs else self.revision
        self.kvs[key] = KV(key, value, created, self.revision, 7)

    async def get(self, key: str) -> KV | None:
        self.gets.append(key)
        return self.kvs.get(key)

    async def keys_under(self, prefix: str) -> list[str]:
        self.gets.append(prefix)
        return [k for k in sorted(self.kvs) if k.startswith(prefix)]

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        return [kv for k, kv in sorted(self.kvs.items()) if k.startswith(prefix)], self.revision


def record(node: str, state: NodeState = NodeState.RUNNING) -> bytes:
    return encode(NodeRecord(
        node_id=node, host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False, state=state, generation=1,
        restarts=0, master_port=1, updated_at=0.0,
    ))  # fmt: skip


def make(number: int, assignment: dict[str, int] | None = None) -> Generation:
    return Generation(
        number=number, status=GenerationStatus.RUNNING, assignment=assignment or {"a": 0, "b": 1}, nnodes=2,
        nproc_per_node=1, master_addr="127.0.0.1", master_port=1, restart_count=0, reason="", controller="a",
        created_at=0.0,
    )  # fmt: skip


def put_generation(store: FakeStore, new: Generation, previous: Generation | None) -> None:
    """What rlaunch.store.generations.write puts: the head, and the whole map with a new number."""
    store.put(KEYS.generation, encode(new.head(previous)))
    if previous is None or previous.number != new.number:
        store.put(KEYS.assignment, encode(Assignment(number=new.number, nodes=new.assignment)))


def read(store: FakeStore, cache: RecordCache) -> Any:
    return asyncio.run(read_snapshot(store, KEYS, cache))  # type: ignore[arg-type]


def test_unchanged_records_are_reused_and_changed_ones_decoded_again() -> None:
    store, cache = FakeStore(), RecordCache()
    put_generation(store, make(1), None)
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
    put_generation(store, make(2), make(1))
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
    put_generation(store, make(1), None)
    store.put(KEYS.suspect("b"), encode(mark))
    assert read(store, RecordCache()).suspects == {}, "the controller's ticks spare the read"
    asked = asyncio.run(read_snapshot(store, KEYS, suspects=True))  # type: ignore[arg-type]
    assert asked.suspects == {"b": mark}


def test_a_new_generations_map_is_rebuilt_from_the_one_held_and_read_whole_only_past_a_gap() -> None:
    """Generation 2 moves b's rank to c: the reader holding 1 rebuilds the map from the head alone;
    a reader holding nothing, or one that missed generation 2, reads the whole map."""
    store, cache = FakeStore(), RecordCache()
    first = make(1, {"a": 0, "b": 1})
    put_generation(store, first, None)
    assert read(store, cache).generation == first
    second = make(2, {"a": 0, "c": 1})
    put_generation(store, second, first)
    store.gets.clear()
    snap = read(store, cache)
    assert snap.generation == second and KEYS.assignment not in store.gets, "rebuilt from generation 1"
    assert read(store, RecordCache()).generation == second and KEYS.assignment in store.gets, "read whole"
    third = make(3, {"a": 0, "d": 1})
    put_generation(store, third, second)
    stale = RecordCache()
    stale.generation = (1, first)  # it missed generation 2
    assert read(store, stale).generation == third
    assert read(store, cache).generation == third
    again = dataclasses.replace(third, status=GenerationStatus.SUCCEEDED)  # written again under its number
    put_generation(store, again, third)
    store.gets.clear()
    assert read(store, cache).generation == again and KEYS.assignment not in store.gets


def test_a_map_newer_than_its_head_is_read_again_and_an_older_one_is_malformed() -> None:
    store = FakeStore()
    first, second, third = make(1), make(2, {"a": 0, "c": 1}), make(3, {"a": 0, "d": 1})
    put_generation(store, first, None)
    put_generation(store, second, first)
    store.put(KEYS.assignment, encode(Assignment(number=3, nodes=third.assignment)))  # 3's head is not there yet
    head = store.kvs[KEYS.generation]

    async def racing_get(key: str) -> KV | None:  # 3's head lands between the reader's two reads
        if key == KEYS.generation and store.kvs[key] is head and KEYS.assignment in store.gets:
            store.put(KEYS.generation, encode(third.head(second)))
        store.gets.append(key)
        return store.kvs.get(key)

    store.get = racing_get  # type: ignore[method-assign]
    snap = read(store, RecordCache())
    assert snap.generation == third and not snap.problems
    store.put(KEYS.assignment, encode(Assignment(number=2, nodes=second.assignment)))  # older than its head
    snap = read(store, RecordCache())
    assert snap.generation is None and snap.generation_malformed
    assert "is generation 2's with 2 node(s), not that of generation 3" in snap.problems[0]
    # deleting the generation key would make the controller plan generation 1 under running workers
    assert "stop the job" in snap.problems[0] and "delete" not in snap.problems[0], snap.problems[0]


def test_acks_are_read_only_while_a_restart_waits_for_them() -> None:
    store = FakeStore()
    first = make(1)
    put_generation(store, first, None)
    store.put(KEYS.ack(1, "a"), b"{}")
    store.put(KEYS.ack(0, "b"), b"{}")  # another generation's
    assert read(store, RecordCache()).acked == {"a"}
    passed = dataclasses.replace(first, all_acked=True)
    put_generation(store, passed, first)
    store.gets.clear()
    assert read(store, RecordCache()).acked == frozenset() and KEYS.acks_prefix(1) not in store.gets
