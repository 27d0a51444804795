"""How ``rlaunch drain`` follows its move, against a real etcd: it waits on the node's drained mark
and the generation's head alone (``_wait_drained``), and prints the move's figures
(``_switch_stats``) from only the events since the request, each once, though the survivor's
``switched`` comes later than the leaver's ``state_sent`` and a host's clock may lag the command's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from rlaunch.cli.drain import CLOCK_MARGIN_S, DrainRefused, _switch_stats, _wait_drained
from rlaunch.errors import RecordError
from rlaunch.store.client import KV, Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import DrainedMark, Event, GenerationHead, GenerationStatus, encode

T = TypeVar("T")


class ReadLog(Store):
    """A real store that notes what each read asked for (a key, or a prefix)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(parse_endpoints(endpoint), timeout=5.0)
        self.reads: list[str] = []

    async def get(self, key: str) -> KV | None:
        self.reads.append(key)
        return await super().get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        self.reads.append(prefix + "*")
        return await super().get_prefix(prefix)

    async def keys_under(self, prefix: str) -> list[str]:
        self.reads.append(prefix + "*")
        return await super().keys_under(prefix)


def head(status: GenerationStatus, reason: str = "") -> bytes:
    return encode(GenerationHead(
        number=4, status=status, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
        reason=reason, controller="a", created_at=0.0, base=3, given={"c": 1}, taken=["b"], assigned=2,
    ))  # fmt: skip


def on_a_job(endpoint: str, body: Callable[[ReadLog, JobKeys], Awaitable[T]]) -> tuple[T, list[str]]:
    """``body``'s result on a job whose running head is written, and what it read meanwhile."""
    keys = JobKeys(f"job-{uuid.uuid4().hex[:8]}")

    async def run() -> tuple[T, list[str]]:
        store = ReadLog(endpoint)
        await store.connect(10.0)
        try:
            await store.put(keys.generation, head(GenerationStatus.RUNNING))
            store.reads.clear()
            return await body(store, keys), store.reads
        finally:
            await store.delete_prefix(keys.prefix)
            await store.close()

    return asyncio.run(run())


def test_a_drain_waits_on_the_nodes_mark_and_the_head_alone(endpoint: str) -> None:
    mark = DrainedMark(node_id="b", generation=4, replaced_by="c", at=1.0)

    async def body(store: ReadLog, keys: JobKeys) -> DrainedMark | None:
        async def leave() -> None:  # the leaver's agent, after a few polls
            await asyncio.sleep(0.7)
            await store.put(keys.drained("b"), encode(mark))

        left = asyncio.ensure_future(leave())
        got = await _wait_drained(store, keys, "job", "b", 30.0)
        await left
        return got

    got, reads = on_a_job(endpoint, body)
    assert got == mark
    assert len(reads) >= 4, "it polled until the mark came"
    assert not [r for r in reads if r.endswith("*")], f"no prefix is read while it waits: {reads}"


def test_a_job_that_ends_before_the_mark_is_named_and_a_timeout_gives_up(endpoint: str) -> None:
    async def ended(store: ReadLog, keys: JobKeys) -> str:
        await store.put(keys.generation, head(GenerationStatus.FAILED, "node a was lost with no standby"))
        with pytest.raises(DrainRefused) as refused:
            await _wait_drained(store, keys, "job-x", "b", 30.0)
        return str(refused.value)

    said, _ = on_a_job(endpoint, ended)
    assert said == "Job 'job-x' ended (failed: node a was lost with no standby) before node 'b' was drained."

    async def waits(store: ReadLog, keys: JobKeys) -> DrainedMark | None:
        return await _wait_drained(store, keys, "job-x", "b", 0.5)

    got, reads = on_a_job(endpoint, waits)
    assert got is None and len(reads) >= 4

    async def malformed(store: ReadLog, keys: JobKeys) -> str:
        await store.put(keys.drained("b"), b"{not json")
        with pytest.raises(RecordError) as bad:
            await _wait_drained(store, keys, "job-x", "b", 30.0)
        return str(bad.value)

    said, _ = on_a_job(endpoint, malformed)
    assert "drained/b" in said, said


def test_a_drain_reads_its_own_events_once_each(endpoint: str) -> None:
    keys = JobKeys(f"job-{uuid.uuid4().hex[:8]}")
    requested = 1_800_000_000.0

    async def put(store: Store, at: float, node: str, kind: str, generation: int, **data: object) -> None:
        event = Event(time=at, node_id=node, kind=kind, generation=generation, data=data)
        await store.put(keys.event(int(at * 1e9), node), encode(event))

    async def run() -> dict[str, object]:
        store = Store(parse_endpoints(endpoint), timeout=5.0)
        await store.connect(10.0)
        try:
            # long before the request (given the same generation, so that only the time can leave them out)
            await put(store, requested - CLOCK_MARGIN_S - 5, "b", "state_sent", 3, bytes=999, seconds=9.0)
            await put(store, requested - CLOCK_MARGIN_S - 4, "a", "switched", 3, downtime_ms=999.0)
            await put(store, requested + 1.0, "b", "state_sent", 3, bytes=100, seconds=0.5)
            await put(store, requested + 1.2, "c", "state_sent", 3, bytes=50, seconds=0.25)

            async def late_switch() -> None:  # after a few polls, from a host whose clock lags by 2 s
                await asyncio.sleep(0.7)
                await put(store, requested - 1.0, "a", "switched", 3, downtime_ms=420.0)

            switched = asyncio.ensure_future(late_switch())
            out = await _switch_stats(store, keys, 3, requested)
            await switched
            return out
        finally:
            await store.delete_prefix(keys.events_prefix)
            await store.close()

    out = asyncio.run(run())
    assert out == {"state_bytes": 150, "transfer_s": 0.5, "downtime_ms": 420.0}, out
