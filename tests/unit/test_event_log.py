"""Every event of an agent gets its own etcd key, even within one tick of the clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from rlaunch.events import EventLog
from rlaunch.store.keys import JobKeys


def test_events_in_one_clock_tick_get_distinct_increasing_keys() -> None:
    keys = JobKeys("job")
    log = EventLog(store=None, keys=keys, node_id="n1", jsonl=None, clock=lambda: 1_800_000_000.0)  # type: ignore[arg-type]
    seen: list[Any] = []
    log.observers.append(seen.append)
    for kind in ("generation", "progress", "switched"):
        log.emit(kind, 1)
    stamps = [keys.event(int(e.time * 1e9), e.node_id) for e in seen]
    assert len(set(stamps)) == 3 and stamps == sorted(stamps), stamps


class _StuckEtcd:
    """An etcd that never answers (an outage): the file must not wait for it."""

    async def grant_lease(self, ttl: int) -> int:
        await asyncio.Event().wait()
        return 0


def test_events_jsonl_is_written_whatever_etcd_does(tmp_path: Path) -> None:
    path = tmp_path / "job" / "events.jsonl"

    async def run() -> None:
        log = EventLog(store=_StuckEtcd(), keys=JobKeys("job"), node_id="n1", jsonl=path)  # type: ignore[arg-type]
        log.start()
        for kind in ("node_joined", "generation", "workers_succeeded"):
            log.emit(kind, 1)
        await log.close(timeout=0.1)

    asyncio.run(run())
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["node_joined", "generation", "workers_succeeded"]


class _CountingEtcd:
    def __init__(self) -> None:
        self.puts: list[str] = []

    async def grant_lease(self, ttl: int) -> int:
        return 1

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self.puts.append(key)

    async def put_all(self, items: list[tuple[str, bytes]], lease: int | None = None) -> None:
        self.puts.append(",".join(k for k, _ in items))


def test_a_local_event_reaches_the_file_and_the_observers_but_not_etcd(tmp_path: Path) -> None:
    path = tmp_path / "job" / "events.jsonl"
    etcd = _CountingEtcd()
    seen: list[Any] = []

    async def run() -> None:
        log = EventLog(store=etcd, keys=JobKeys("job"), node_id="n1", jsonl=path)  # type: ignore[arg-type]
        log.observers.append(seen.append)
        log.start()
        log.note("snapshot_committed", 1, rank=0, step=20)
        log.emit("generation", 2)
        await log.close(timeout=1.0)

    asyncio.run(run())
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["snapshot_committed", "generation"] and [e.kind for e in seen] == kinds
    assert len(etcd.puts) == 1, "only the generation event is written to etcd"


def test_events_queued_together_go_in_one_request_in_order() -> None:
    etcd = _CountingEtcd()
    keys = JobKeys("job")
    times = iter([1.0, 2.0, 3.0, 4.0])

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        log.emit("replacement_offered", 2)  # an offer and the state published with it, queued together
        log.emit("node_state", 2)
        await asyncio.sleep(0.01)
        log.emit("recovered", 2)
        await log.close(timeout=1.0)

    asyncio.run(run())
    first, second = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0))
    assert etcd.puts == [f"{first},{second}", keys.event(int(3.0 * 1e9), "n1")]
