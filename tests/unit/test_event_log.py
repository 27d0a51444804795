"""The event log: every event of an agent gets its own etcd key, even within one tick of the clock;
events queued together go in one request, within a count and a byte limit, and a failed request's
events are written one by one."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from rlaunch import events
from rlaunch.errors import StoreUnavailableError
from rlaunch.events import BYTES_PER_REQUEST, EVENTS_PER_REQUEST, EventLog
from rlaunch.store.keys import JobKeys


@pytest.mark.parametrize("tick", [1_800_000_000.0, 1_800_000_000.007, 1_712_345_678.123456, 1.5])
def test_events_in_one_clock_tick_get_distinct_increasing_keys(tick: float) -> None:
    """Neighbouring float times often round to one nanosecond (1_800_000_000.007 did), and etcd
    refuses a transaction that puts one key twice: keys come from a count of nanoseconds."""
    etcd, keys, seen = _CountingEtcd(), JobKeys("job"), []

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: tick)  # type: ignore[arg-type]
        log.observers.append(seen.append)
        log.start()
        for i in range(EVENTS_PER_REQUEST + 10):
            log.emit("progress" if i % 2 else "generation", 1)
        await log.close(timeout=1.0)

    asyncio.run(run())
    stamps = [key for request in etcd.requests for key in request]
    assert len(stamps) == EVENTS_PER_REQUEST + 10 and len(set(stamps)) == len(stamps), stamps
    assert stamps == sorted(stamps), "keys sort in the order of the events"
    times = [e.time for e in seen]
    assert all(a < b for a, b in itertools.pairwise(times)), "each event's time is later than the last one's"
    assert all(abs(t - tick) < 1e-4 for t in times)
    assert [int(k.rsplit("/", 1)[1].split("-")[0]) / 1e9 for k in stamps] == times, "a key is its event's time"


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
    """Records each request's keys and sizes; ``down``: the requests that fail (``put_all``, or a
    ``put`` of the key ending with the given text)."""

    def __init__(self, down: tuple[str, ...] = ()) -> None:
        self.requests: list[list[str]] = []
        self.sizes: list[int] = []
        self.down = down
        self.grants = 0

    @property
    def puts(self) -> list[str]:
        return [",".join(request) for request in self.requests]

    async def grant_lease(self, ttl: int) -> int:
        self.grants += 1
        return 1

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        if any(key.endswith(d) for d in self.down):
            raise StoreUnavailableError(f"etcd did not take {key}")
        self.requests.append([key])
        self.sizes.append(len(key) + len(value))

    async def put_all(self, items: list[tuple[str, bytes]], lease: int | None = None) -> None:
        if "put_all" in self.down:
            raise StoreUnavailableError("etcd did not answer within 5.0 s")
        self.requests.append([k for k, _ in items])
        self.sizes.append(sum(len(k) + len(v) for k, v in items))

    async def put_each(self, items: list[tuple[str, bytes, int | None]]) -> None:
        await asyncio.sleep(0.001)  # a request to etcd: other tasks run meanwhile
        if "put_each" in self.down:
            raise StoreUnavailableError("etcd did not answer within 5.0 s")
        self.requests.append([f"{k}@{lease}" for k, _, lease in items])
        self.sizes.append(sum(len(k) + len(v) for k, v, _ in items))


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


def _emit_all(etcd: _CountingEtcd, *events: tuple[str, dict[str, Any]]) -> JobKeys:
    """Emit ``events`` (kind, data) at once, one second apart (keys 1e9, 2e9, ... ns), and flush them."""
    keys = JobKeys("job")
    times = iter(range(1, len(events) + 1))

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: float(next(times)))  # type: ignore[arg-type]
        log.start()
        for kind, data in events:
            log.emit(kind, 2, **data)
        await log.close(timeout=2.0)

    asyncio.run(run())
    return keys


def test_a_failed_batch_is_written_event_by_event() -> None:
    """An outage loses no more events than when each went alone: a request that fails is tried
    again one event at a time (each once), in order."""
    etcd = _CountingEtcd(down=("put_all", f"{3 * 10**9:020d}-n1"))
    keys = _emit_all(etcd, *((f"kind{i}", {}) for i in range(1, 6)))
    written = [keys.event(t * 10**9, "n1") for t in (1, 2, 4, 5)]
    assert etcd.puts == written, "every event but the third (whose own put failed too) is written, in order"


def test_a_batch_is_capped_by_its_bytes() -> None:
    """A generation event carries the rank map (~80 KB at 4,096 nodes); etcd refuses a request over
    1.5 MiB, so a batch holds at most BYTES_PER_REQUEST (an event larger alone goes alone)."""
    etcd = _CountingEtcd()
    big = {"assignment": {f"node-{i:05d}": i for i in range(5_000)}}  # ~100 KB encoded
    huge = {"blob": "x" * (BYTES_PER_REQUEST + 1)}
    _emit_all(etcd, *(("generation", big) for _ in range(12)), ("huge", huge), ("generation", big))
    assert sum(len(r) for r in etcd.requests) == 14 and len(etcd.requests) >= 4, etcd.sizes
    over = [len(r) for size, r in zip(etcd.sizes, etcd.requests, strict=True) if size > BYTES_PER_REQUEST]
    assert over == [1], f"only the huge event goes over the limit, alone: {etcd.sizes}"
    keys = [k for r in etcd.requests for k in r]
    assert keys == sorted(keys), "in order"


def test_a_record_goes_in_one_request_with_the_events_emitted_before_it() -> None:
    """A move's offer and the node state published with it go with the node record: one request of
    a node's at a fault, not two. The record keeps its lease, the events theirs; later events follow."""
    etcd = _CountingEtcd()
    keys = JobKeys("job")
    times = iter([1.0, 2.0, 3.0])

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        log.emit("replacement_offered", 2)
        log.emit("node_state", 2)
        await log.put_with(keys.node("n1"), b"{}", 7)
        log.emit("recovered", 2)
        await log.close(timeout=1.0)

    asyncio.run(run())
    first, second, third = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0, 3.0))
    assert etcd.puts == [f"{keys.node('n1')}@7,{first}@1,{second}@1", third]


def test_records_sent_one_after_the_other_each_take_the_events_emitted_before_them() -> None:
    """A survivor offers, publishes, then (its workers recovered) says so and publishes again: two
    requests. The writer, woken by the first events, does not take the next record's events first."""
    etcd = _CountingEtcd()
    keys = JobKeys("job")
    times = iter([1.0, 2.0, 3.0, 4.0])

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        for _ in range(2):
            log.emit("offered_or_recovered", 2)
            log.emit("node_state", 2)
            await log.put_with(keys.node("n1"), b"{}", 7)
        await log.close(timeout=1.0)

    asyncio.run(run())
    one, two, three, four = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0, 3.0, 4.0))
    record = f"{keys.node('n1')}@7"
    assert etcd.puts == [f"{record},{one}@1,{two}@1", f"{record},{three}@1,{four}@1"]


@pytest.mark.parametrize("record_down", [False, True])
def test_a_record_etcd_did_not_take_with_its_events_goes_alone_and_they_are_written_first_by_the_log(
    record_down: bool,
) -> None:
    """The request of a record and its events failed (the events' lease gone, say): the record goes at
    once alone (raising only if etcd does not take it either: the agent sends it again later), the
    events' lease is granted anew, and the events stay first in line, before the ones emitted after."""
    keys = JobKeys("job")
    etcd = _CountingEtcd(down=("put_each", keys.node("n1")) if record_down else ("put_each",))
    times = iter([1.0, 2.0])

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.emit("node_state", 2)  # before the writer runs: pending when the record goes
        if record_down:
            with pytest.raises(StoreUnavailableError):
                await log.put_with(keys.node("n1"), b"{}", 7)
        else:
            await log.put_with(keys.node("n1"), b"{}", 7)
        log.emit("recovered", 2)
        log.start()
        await log.close(timeout=1.0)

    asyncio.run(run())
    events = f"{keys.event(int(1e9), 'n1')},{keys.event(int(2e9), 'n1')}"
    assert etcd.puts == ([] if record_down else [keys.node("n1")]) + [events], "in order, together"
    assert etcd.grants == 2, "the lease of the failed request is not used again"


def test_a_record_does_not_wait_for_a_request_of_events_in_flight() -> None:
    """An outage can hold the writer's request (and its event-by-event retries) for many timeouts: the
    record goes alone meanwhile, and the events stay with the writer, in order."""
    etcd = _CountingEtcd()
    keys = JobKeys("job")
    times = iter([1.0, 2.0])
    held = asyncio.Event()

    async def run() -> None:
        slow_put = etcd.put

        async def put(key: str, value: bytes, lease: int | None = None) -> None:
            if key != keys.node("n1"):
                await held.wait()  # the event's request hangs until the record went
            await slow_put(key, value, lease)

        etcd.put = put  # type: ignore[method-assign]
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        log.emit("replacement_offered", 2)
        await asyncio.sleep(0.01)  # the writer took it and waits on etcd
        log.emit("node_state", 2)
        await asyncio.wait_for(log.put_with(keys.node("n1"), b"{}", 7), 1.0)
        held.set()
        await log.close(timeout=1.0)

    asyncio.run(run())
    first, second = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0))
    assert etcd.puts == [keys.node("n1"), first, second]


def test_events_that_wait_for_the_record_go_in_its_request() -> None:
    """A replacement's survivor: its offer and its workers' ``recovered`` wait for the ``running`` record
    that follows them, so the move costs the node one request (and etcd none while they wait)."""
    etcd = _CountingEtcd()
    keys = JobKeys("job")
    times = iter([1.0, 2.0])

    async def run() -> None:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        log.emit_with_record("replacement_offered", 2)
        await asyncio.sleep(0.05)  # the writer is woken: it must leave the event for the record
        log.emit_with_record("recovered", 2)
        await asyncio.sleep(0.05)
        assert etcd.puts == []
        await log.put_with(keys.node("n1"), b"{}", 7)
        await log.close(timeout=1.0)

    asyncio.run(run())
    one, two = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0))
    assert etcd.puts == [f"{keys.node('n1')}@7,{one}@1,{two}@1"]


def test_an_event_whose_record_does_not_come_goes_alone_when_its_wait_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "RECORD_WAIT_S", 0.2)
    etcd = _CountingEtcd()
    keys = JobKeys("job")

    async def run() -> list[str]:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: 1.0)  # type: ignore[arg-type]
        log.start()
        log.emit_with_record("recovered", 2)
        await asyncio.sleep(0.1)
        early = list(etcd.puts)
        await asyncio.sleep(0.3)
        await log.close(timeout=1.0)
        return early

    assert asyncio.run(run()) == [], "not before its wait ends"
    assert etcd.puts == [keys.event(int(1e9), "n1")], "nor lost when no record comes"


@pytest.mark.parametrize("then", ["emit", "close", "failed record", "record alone"])
def test_waiting_events_go_at_once_with_one_that_does_not_wait_at_close_or_when_a_record_goes_without_them(
    then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events reach etcd in the order they were emitted: one that does not wait takes the waiting ones
    along in its request; the log's close sends them; a record that went without them (its request
    with them failed, or a request of events was in flight) releases them: they go on their own, first
    in line, long before their wait ends."""
    monkeypatch.setattr(events, "RECORD_WAIT_S", 30.0)
    keys = JobKeys("job")
    etcd = _CountingEtcd(down=("put_each",) if then == "failed record" else ())
    times = iter([1.0, 2.0])
    one, two = (keys.event(int(t * 1e9), "n1") for t in (1.0, 2.0))
    record = keys.node("n1")

    async def run() -> list[str]:
        log = EventLog(store=etcd, keys=keys, node_id="n1", clock=lambda: next(times))  # type: ignore[arg-type]
        log.start()
        if then == "record alone":
            gate = asyncio.Event()
            put = etcd.put

            async def slow_put(key: str, value: bytes, lease: int | None = None) -> None:
                if key == one:
                    await gate.wait()  # the writer's request of event one is in flight
                await put(key, value, lease)

            etcd.put = slow_put  # type: ignore[method-assign]
            log.emit("replica_sent", 2)
            await asyncio.sleep(0.02)
            log.emit_with_record("recovered", 2)
            await log.put_with(record, b"{}", 7)  # goes alone: the events' request is in flight
            gate.set()
        else:
            log.emit_with_record("replacement_offered", 2)
            await asyncio.sleep(0.02)
            assert etcd.puts == [], "it waits"
            if then == "emit":
                log.emit("recovering", 2)
            elif then == "failed record":
                await log.put_with(record, b"{}", 7)
                log.emit_with_record("recovered", 2)
        await asyncio.sleep(0.1)
        before_close = list(etcd.puts)
        await asyncio.wait_for(log.close(timeout=1.0), 2.0)
        return before_close

    before_close = asyncio.run(run())
    expected = {
        "emit": [f"{one},{two}"],
        "close": [one],
        "failed record": [record, f"{one},{two}"],
        "record alone": [record, one, two],
    }[then]
    assert etcd.puts == expected
    assert before_close == ([] if then == "close" else expected), "sent at once, not when the 30 s wait ends"
