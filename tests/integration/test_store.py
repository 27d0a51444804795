"""The etcd boundary against a real etcd server: guarded writes, leases, watches, failover."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import pytest

from rlaunch.errors import PlanError, StoreError, StoreUnavailableError
from rlaunch.events import EVENTS_PER_REQUEST, EventLog
from rlaunch.store import client, generations
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.embedded import EmbeddedEtcd, free_port
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, Generation, GenerationStatus, decode
from tests.cluster import etcd_counters, run_store
from tests.etcd_cluster import EtcdCluster


def prefix() -> str:
    return f"/rlaunch-test/{uuid.uuid4().hex[:8]}/"


def test_create_is_exclusive_and_guarded_put_fences(endpoint: str) -> None:
    p = prefix()

    async def go(store: Store) -> None:
        term = await store.create(p + "leader", b"a")
        assert term > 0
        assert not await store.create(p + "leader", b"b"), "a second controller must not be elected"
        assert not await store.put_guarded(p + "gen", b"1", mod_revision=5), "absent key: only revision 0 matches"
        assert await store.put_guarded(p + "gen", b"1", mod_revision=0, fence=(p + "leader", term))
        kv = await store.get(p + "gen")
        assert kv is not None and kv.value == b"1"
        # a stale writer (old revision) is refused
        assert await store.put_guarded(p + "gen", b"2", kv.mod_revision, fence=(p + "leader", term))
        assert not await store.put_guarded(p + "gen", b"3", kv.mod_revision, fence=(p + "leader", term))
        # the leader key made again with the same value (a restarted agent of the same node id):
        # the old term no longer passes, the new one does
        kv2 = await store.get(p + "gen")
        assert kv2 is not None
        await store.delete(p + "leader")
        term2 = await store.create(p + "leader", b"a")
        assert term2 > term
        assert not await store.put_guarded(p + "gen", b"4", kv2.mod_revision, fence=(p + "leader", term))
        assert (await store.get(p + "gen")).value == b"2"  # type: ignore[union-attr]
        assert await store.put_guarded(p + "gen", b"5", kv2.mod_revision, fence=(p + "leader", term2))

    run_store(endpoint, go)


def test_a_generation_is_written_as_head_and_map_in_one_fenced_transaction(endpoint: str) -> None:
    """The head and the whole rank map go together, or not at all (a stale revision, a lost term);
    a node holding the previous generation rebuilds the map from the head, a fresh reader reads it."""
    keys = JobKeys(f"gen-{uuid.uuid4().hex[:8]}")

    def make(number: int, assignment: dict[str, int]) -> Generation:
        return Generation(number=number, status=GenerationStatus.RUNNING, assignment=assignment, nnodes=2,
                          nproc_per_node=1, master_addr="h", master_port=1, restart_count=0, reason="", controller="a",
                          created_at=1.0)  # fmt: skip

    async def go(store: Store) -> None:
        term = await store.create(keys.leader, b"a")
        first, second = make(1, {"a": 0, "b": 1}), make(2, {"a": 0, "c": 1})
        assert await generations.write(store, keys, first, None, 0, fence=(keys.leader, term))
        rev, held = await generations.read(store, keys)
        assert held == first
        assert not await generations.write(store, keys, second, first, rev - 1, fence=(keys.leader, term))
        assert not await generations.write(store, keys, second, first, rev, fence=(keys.leader, term + 1))
        assert await generations.read(store, keys) == (rev, first), "neither key changed"
        assert await generations.write(store, keys, second, first, rev, fence=(keys.leader, term))
        head = await store.get(keys.generation)
        assert head is not None and b'"given": {"c": 1}' in head.value and b'"a": 0' not in head.value
        assert await generations.follow(store, keys, head.value, first) == second
        assert (await generations.read(store, keys))[1] == second, "a fresh reader reads the whole map"
        with pytest.raises(PlanError, match="another rank map"):
            await generations.write(store, keys, make(2, {"a": 0, "d": 1}), second, head.mod_revision)
        await store.delete_prefix(keys.prefix)

    run_store(endpoint, go)


def test_create_all_is_atomic(endpoint: str) -> None:
    p = prefix()

    async def go(store: Store) -> None:
        await store.put(p + "b", b"taken")
        assert not await store.create_all([(p + "a", b"1", None), (p + "b", b"2", None)])
        assert await store.get(p + "a") is None, "nothing is written when one key exists"
        assert await store.create_all([(p + "a", b"1", None), (p + "c", b"2", None)])

    run_store(endpoint, go)


def test_events_queued_in_one_clock_tick_all_reach_etcd(endpoint: str) -> None:
    """A batch of events emitted within one tick of the clock goes in one transaction, which etcd
    refuses if two share a key (1_800_000_000.007 s made neighbouring times one nanosecond); and
    generation-sized events past etcd's 1.5 MiB request limit all arrive too."""
    keys = JobKeys(f"events-{uuid.uuid4().hex[:8]}")
    big = {"assignment": {f"node-{i:05d}": i for i in range(5_000)}}  # ~100 KB encoded

    async def go(store: Store) -> None:
        log = EventLog(store, keys, "n1", clock=lambda: 1_800_000_000.007)
        log.start()
        for i in range(EVENTS_PER_REQUEST):
            log.emit("progress", 1, i=i)
        for i in range(20):
            log.emit("generation", 2, i=i, **big)
        await log.close(timeout=20.0)
        kvs, _ = await store.get_prefix(keys.events_prefix)
        events = [decode(Event, kv.value, kv.key) for kv in sorted(kvs, key=lambda kv: kv.key)]
        assert [(e.kind, e.data["i"]) for e in events] == [("progress", i) for i in range(EVENTS_PER_REQUEST)] + [
            ("generation", i) for i in range(20)
        ], "every event is in etcd, its key in the order emitted"

    run_store(endpoint, go)


def test_lease_expiry_deletes_attached_keys(endpoint: str) -> None:
    p = prefix()

    async def go(store: Store) -> None:
        lease = await store.grant_lease(2)
        await store.put(p + "node", b"x", lease=lease)
        assert await store.refresh_lease(lease) > 0
        granted, remaining = await store.lease_ttl(lease)
        assert granted == 2 and 0 <= remaining <= 2
        deadline = time.monotonic() + 10
        while await store.get(p + "node") is not None:
            assert time.monotonic() < deadline, "the key outlived its lease"
            await asyncio.sleep(0.2)
        assert await store.refresh_lease(lease) <= 0

    run_store(endpoint, go)


def hold(server: EmbeddedEtcd, on: bool) -> None:
    """SIGSTOP (``on``) or SIGCONT the test's etcd. A stop returns once every thread of etcd is stopped:
    the signal's delivery is not instant, and a request sent just after it was answered (in 0.5 ms)."""
    if server.proc is None:
        return
    server.proc.send_signal(signal.SIGSTOP if on else signal.SIGCONT)
    tasks = Path(f"/proc/{server.proc.pid}/task")
    deadline = time.monotonic() + 5
    while on and not all(stopped(t) for t in tasks.iterdir()):
        assert time.monotonic() < deadline, "etcd did not stop within 5 s of its SIGSTOP"
        time.sleep(0.001)


def stopped(task: Path) -> bool:
    """Whether a thread is stopped (state ``T``; one that is gone counts as stopped)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return True


def keepalive_counts(endpoint: str) -> tuple[float, float]:
    """``(streams started, messages received)`` of etcd's LeaseKeepAlive, from its own counters."""
    started, received = etcd_counters(endpoint, "grpc_server_started_total", "grpc_server_msg_received_total").values()
    return started.get("LeaseKeepAlive", 0.0), received.get("LeaseKeepAlive", 0.0)


async def renewed(store: Store, lease: int, within_s: float = 10.0) -> int:
    """The lease's remaining TTL from the first renewal etcd answers within ``within_s``; a renewal
    may fail meanwhile only as etcd being unreachable (any other error fails the test)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await store.refresh_lease(lease)
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_a_leases_renewals_go_on_one_stream_and_a_new_one_after_etcd_did_not_answer() -> None:
    """Renewals reuse the lease's keepalive stream (etcd counts one stream started and a message per
    renewal); a renewal against a SIGSTOPped etcd fails as etcd unreachable and ends that stream, and
    the renewals once etcd answers again go on one fresh stream."""
    server = EmbeddedEtcd().start()

    async def go(store: Store) -> None:
        await store.connect(20)
        lease = await store.grant_lease(30)
        started, messages = keepalive_counts(server.endpoint)
        for _ in range(5):
            assert await store.refresh_lease(lease) > 0
        after = keepalive_counts(server.endpoint)
        assert after == (started + 1, messages + 5), (started, messages, after)
        hold(server, True)
        try:
            with pytest.raises(StoreUnavailableError):
                await store.refresh_lease(lease)
        finally:
            hold(server, False)
        assert await renewed(store, lease) > 0
        fresh = keepalive_counts(server.endpoint)
        assert fresh[0] > after[0], "the held stream was ended: renewals after it go on a new one"
        assert await store.refresh_lease(lease) > 0
        assert keepalive_counts(server.endpoint)[0] == fresh[0], "a renewal after it reuses that stream"
        await store.revoke_lease(lease)
        assert await store.refresh_lease(lease) <= 0

    try:
        run_store(server.endpoint, go)  # (5 s a request: a loaded machine's slow answer opens no new stream)
    finally:
        hold(server, False)
        server.stop()


def test_a_lease_is_renewed_again_after_etcd_restarted_under_its_keepalive_stream(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """etcd SIGKILLed and restarted (same port, same data) ends the open keepalive stream under the
    client; the renewals after fail only as etcd unreachable (any other error fails the test), until
    one is answered on a new stream: the lease is still held."""
    data = str(tmp_path / "data")
    server = EmbeddedEtcd(data_dir=data).start()
    servers = [server]

    async def go(store: Store) -> None:
        await store.connect(20)
        lease = await store.grant_lease(30)
        assert await store.refresh_lease(lease) > 0
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        await asyncio.sleep(0.5)  # gRPC sees the connection go and finishes the stream
        servers.append(EmbeddedEtcd(port=server.port, data_dir=data).start())
        assert await renewed(store, lease, within_s=20.0) > 0

    try:
        run_store(server.endpoint, go, timeout=1.0)
    finally:
        for s in servers:
            s.stop()


def test_watch_resumes_from_a_revision(endpoint: str) -> None:
    p = prefix()

    async def go(store: Store) -> None:
        _, rev = await store.get_at(p + "k")
        await store.put(p + "k", b"1")
        await store.put(p + "k", b"2")
        await store.delete(p + "k")
        seen = []
        async for ev in store.watch_prefix(p, start_revision=rev + 1):
            seen.append((ev.value, ev.deleted))
            if len(seen) == 3:
                break
        assert seen == [(b"1", False), (b"2", False), (b"", True)]

    run_store(endpoint, go)


def test_unreachable_endpoint_is_named() -> None:
    port = free_port()

    async def go() -> None:
        store = Store(parse_endpoints(f"127.0.0.1:{port}"), timeout=1)
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"etcd at 127.0.0.1:{port} did not answer within 1.5 s"):
            await store.connect(1.5)
        assert time.monotonic() - start < 6
        await store.close()

    asyncio.run(go())


def test_requests_fail_over_to_the_next_endpoint(endpoint: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    p = prefix()

    async def go() -> None:
        store = Store(parse_endpoints(f"{dead},{endpoint}"), timeout=1)
        await store.connect(10)
        await store.put(p + "x", b"1")
        assert str(store.endpoint) == endpoint
        await store.close()

    asyncio.run(go())


def test_losing_the_etcd_member_raises_a_store_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = EmbeddedEtcd().start()

    async def go() -> None:
        store = Store(parse_endpoints(server.endpoint), timeout=1)
        await store.put("/x", b"1")
        server.stop()
        with pytest.raises(StoreUnavailableError, match=server.endpoint):
            await store.get("/x")
        await store.close()

    try:
        asyncio.run(go())
    finally:
        server.stop()


def test_watches_never_cross_after_a_creation_etcd_did_not_answer_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ways aetcd crosses a client's watches, against a real etcd held by SIGSTOP so that a
    creation's answer comes late (see rlaunch.store.watches):

    1. a creation that timed out moves new watches to a fresh stream, whose first watch takes id
       0 again; the cancel of an older watch (id 0 on the first stream) must not remove it;
    2. a creation cancelled from outside leaves its answer to come: the next creation must not
       take it (it would follow the other key);
    3. a creation queued behind one that aetcd's own timeout ended (here 1 s, the store's 1.4 s)
       must not be sent on that stream, where the late answer still comes.

    gRPC's keepalive ping is given a minute here: on a loaded machine a ping sent while etcd is held
    gave up first ("Stream removed (ping timeout)"), ending the stream before the creation timeout
    the cases are about.
    """
    monkeypatch.setitem(client.CHANNEL_OPTIONS, "grpc.keepalive_timeout_ms", 60_000)
    server = EmbeddedEtcd().start()
    p = prefix()
    start = 0  # every watch starts from the revision read first: none misses a put made before it was set up

    async def follow(store: Store, key: str, seen: list[str]) -> None:
        async for ev in store.watch_prefix(p + key, start_revision=start, exact=True):
            seen.append(ev.key.removeprefix(p))

    async def settled(seen: list[str], want: list[str]) -> bool:
        for _ in range(50):
            if seen == want:
                return True
            await asyncio.sleep(0.1)
        return False

    async def go(store: Store) -> None:
        nonlocal start
        start = (await store.get_at(p + "a"))[1] + 1
        seen_a: list[str] = []
        a = asyncio.create_task(follow(store, "a", seen_a))
        await store.put(p + "a", b"1")
        assert await settled(seen_a, ["a"]), seen_a
        hold(server, True)
        try:
            with pytest.raises(StoreUnavailableError, match="refused a watch"):
                await follow(store, "d", [])  # no answer within the timeout
        finally:
            hold(server, False)
        seen_b: list[str] = []
        b = asyncio.create_task(follow(store, "b", seen_b))
        await asyncio.sleep(0.5)  # made (id 0 of its stream, as a was of the first)
        a.cancel()  # a's watch is cancelled as its generator closes
        await asyncio.gather(a, return_exceptions=True)
        await store.put(p + "b", b"1")
        assert await settled(seen_b, ["b"]), f"the watch on b must still deliver: {seen_b}"

        hold(server, True)
        try:
            c = asyncio.create_task(follow(store, "c", []))
            await asyncio.sleep(0.3)  # its creation request is out, unanswered
            c.cancel()
            await asyncio.gather(c, return_exceptions=True)
            seen_e: list[str] = []
            e = asyncio.create_task(follow(store, "e", seen_e))
            await asyncio.sleep(0.3)
        finally:
            hold(server, False)
        await asyncio.sleep(2.0)
        await store.put(p + "c", b"1")
        await store.put(p + "e", b"1")
        assert await settled(seen_e, ["e"]), f"the watch on e must follow e alone: {seen_e}"

        hold(server, True)
        try:
            x = asyncio.create_task(follow(store, "x", []))
            await asyncio.sleep(0.5)
            seen_y: list[str] = []
            y = asyncio.create_task(follow(store, "y", seen_y))  # queued behind x's creation
            await asyncio.sleep(0.7)  # x's ended by aetcd's timeout; y's is still waited for
        finally:
            hold(server, False)
        with pytest.raises(StoreUnavailableError, match="refused a watch"):
            await x
        await asyncio.sleep(1.0)
        await store.put(p + "x", b"1")
        await store.put(p + "y", b"1")
        assert await settled(seen_y, ["y"]), f"the watch on y must follow y alone: {seen_y}"
        for task in (b, e, y):
            assert not task.done(), task
            task.cancel()
        await asyncio.gather(b, e, y, return_exceptions=True)

    try:
        run_store(server.endpoint, go, timeout=1.4)
    finally:
        hold(server, False)
        server.stop()


def test_a_watch_on_a_member_cut_off_from_the_others_ends_instead_of_going_silent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A member without a leader (here the two others are SIGKILLed; in a partition, the minority
    side) receives no change any more, but keeps its watch streams open: a watch there would wait
    for ever. rlaunch's watches ask etcd to end them when their member has no leader, so the
    watcher moves on (a read fails there too, and the next request goes to the next member)."""
    etcd = EtcdCluster(tmp_path, uuid.uuid4().hex).start()
    p = prefix()

    async def go() -> None:
        watched = etcd.members[0]
        store = Store(parse_endpoints(watched.endpoint), timeout=2)
        try:
            start = (await store.get_at(p + "k"))[1] + 1

            async def follow() -> None:
                async for _ in store.watch_prefix(p + "k", start_revision=start, exact=True):
                    pass

            task = asyncio.create_task(follow())
            await asyncio.sleep(1.0)
            for member in etcd.members[1:]:
                await asyncio.to_thread(etcd.kill, member)
            with pytest.raises(StoreUnavailableError, match="no leader"):
                await asyncio.wait_for(task, 30)
        finally:
            await store.close()

    try:
        asyncio.run(go())
    finally:
        etcd.stop()


def test_a_watch_made_after_its_stream_broke_is_not_silenced_by_an_older_watchs_cancel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """etcd restarts while a watch's reader is busy: its stream broke, but the reader has not seen it
    yet. A watch made meanwhile must go on a new stream (aetcd reopened the broken one under the same
    object, numbering from 0 again, so the older watch's cancel removed the new one, silently)."""
    server = EmbeddedEtcd(data_dir=str(tmp_path / "data")).start()
    p = prefix()

    async def go() -> None:
        store = Store(parse_endpoints(server.endpoint), timeout=2.0)
        try:
            start = (await store.get_at(p + "a"))[1] + 1
            older = store.watch_prefix(p + "a", start_revision=start, exact=True)
            await store.put(p + "a", b"1")
            assert (await asyncio.wait_for(older.__anext__(), 10)).key == p + "a"  # its reader now busy
            assert server.proc is not None
            server.proc.kill()
            server.proc.wait()
            server.start()
            seen: list[str] = []

            async def follow() -> None:
                async for ev in store.watch_prefix(p + "b", start_revision=start, exact=True):
                    seen.append(ev.key)

            newer = asyncio.create_task(follow())
            await asyncio.sleep(2.0)  # made
            with pytest.raises(StoreUnavailableError, match="broke"):
                await older.__anext__()  # the older reader comes back: the break, then its cancel
            await store.put(p + "b", b"1")
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.1)
            assert seen == [p + "b"], "the newer watch must still deliver"
            newer.cancel()
            await asyncio.gather(newer, return_exceptions=True)
        finally:
            await store.close()

    try:
        asyncio.run(go())
    finally:
        server.stop()


def test_closing_the_store_ends_watch_creations_under_way_with_a_store_error() -> None:
    """Two watch creations wait on an etcd held by SIGSTOP when the store closes: each caller gets
    the store's own error, which says the store was closed (no client internals, no stream made on
    the closed channel, no member taken for failed); so does a request made after the close."""
    server = EmbeddedEtcd().start()
    p = prefix()

    async def go() -> None:
        store = Store(parse_endpoints(server.endpoint), timeout=5.0)
        await store.get(p + "z")

        async def follow(key: str) -> None:
            async for _ in store.watch_prefix(p + key, exact=True):
                pass

        hold(server, True)
        try:
            waiting = [asyncio.create_task(follow(k)) for k in ("x", "y")]
            await asyncio.sleep(0.5)
            await store.close()
            ended = await asyncio.gather(*waiting, return_exceptions=True)
        finally:
            hold(server, False)
        assert all(isinstance(e, StoreError) and "was closed" in str(e) for e in ended), ended
        # a request after the close fails the same way, and opens no connection
        with pytest.raises(StoreError, match="was closed; nothing more is sent"):
            await store.get(p + "z")
        with pytest.raises(StoreError, match="was closed"):
            async for _ in store.watch_prefix(p + "x"):
                pass
        assert not store._clients

    try:
        asyncio.run(go())
    finally:
        server.stop()
