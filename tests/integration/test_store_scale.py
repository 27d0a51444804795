"""The worker store at scale: exact reads, unbounded control frames, a 512-rank world group's setup.

Everything runs the real path a worker's store call takes: ``AgentStore`` → ``AgentLink`` →
the agent's Unix control socket → ``WorkerLink``'s ``kv_*`` handlers → etcd. Ranks are threads
(the point is the store and the socket, not 512 processes).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from rlaunch.agent.control import ControlServer
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.controller.controller import Controller
from rlaunch.controller.planner import PlannerConfig
from rlaunch.events import EventLog
from rlaunch.runtime.agent_link import AgentLink
from rlaunch.runtime.store import AgentStore
from rlaunch.store import generations
from rlaunch.store.client import REQUEST_SECONDS, Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation, GenerationStatus, JobSpec, NodeRecord, NodeState, encode
from tests.cluster import run_store

TIMEOUT = datetime.timedelta(seconds=120)


def gloo_blob_size(world: int) -> int:
    """The size of one rank's rendezvous value in a gloo group of ``world`` ranks (torch 2.13:
    measured 186, 218 and 282 bytes at 4, 8 and 16 ranks)."""
    return 154 + 8 * world


class Agents:
    """``n`` agents' control sockets and store handlers, on one event loop in a thread."""

    def __init__(self, endpoint: str, n: int) -> None:
        self.job = JobKeys(f"scale-{uuid.uuid4().hex[:8]}")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.paths: list[str] = []
        self._servers: list[ControlServer] = []
        self.store: Store | None = None
        self._call(self._start(endpoint, n))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def _start(self, endpoint: str, n: int) -> None:
        self.store = Store(parse_endpoints(endpoint), timeout=10)
        for _ in range(n):
            server = ControlServer()
            link = WorkerLink(self.store, self.job, lambda: 0, lambda *a, **k: None, lambda: None)
            link.register(server)
            await server.start()
            self._servers.append(server)
            self.paths.append(server.path)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                await server.close()
            if self.store is not None:
                await self.store.delete_prefix(self.job.prefix)
                await self.store.close()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def worker_store(self, rank: int, ranks_per_agent: int) -> AgentStore:
        """Rank ``rank``'s store (``backend.build`` wraps it in a prefix store per group)."""
        return AgentStore(AgentLink(self.paths[rank // ranks_per_agent], rank % ranks_per_agent), TIMEOUT)


@pytest.fixture
def agents_factory(endpoint: str) -> Iterator[Callable[[int], Agents]]:
    made: list[Agents] = []

    def make(n: int) -> Agents:
        made.append(Agents(endpoint, n))
        return made[-1]

    yield make
    for a in made:
        a.close()


def test_exact_read_does_not_transfer_longer_keys(endpoint: str) -> None:
    """Reading ``.../1`` must not transfer ``.../10`` and up: here those hold 6 MiB, more than
    gRPC's 4 MiB reply limit, so a prefix read filtered afterwards fails outright."""
    p = f"/rlaunch-test/{uuid.uuid4().hex[:8]}/kv/"
    big = b"x" * (1 << 20)

    async def go(store: Store) -> None:
        try:
            await store.put(p + "1", b"mine")
            for i in range(10, 16):
                await store.put(p + str(i), big)
            kv, revision = await store.get_at(p + "1")
            assert kv is not None and kv.value == b"mine" and kv.key == p + "1"
            assert revision >= kv.mod_revision
            absent, rev2 = await store.get_at(p + "2")
            assert absent is None and rev2 >= revision, "an absent key still gives the revision to watch from"
        finally:
            await store.delete_prefix(p)

    run_store(endpoint, go)


def test_control_frames_carry_values_past_64_kib(agents_factory: Callable[[int], Agents]) -> None:
    """A 1 MiB store value makes the round trip worker → agent → etcd → worker intact (the old
    line protocol stopped at asyncio's 64 KiB ``readline`` limit)."""
    agents = agents_factory(1)
    store = agents.worker_store(0, 1)
    value = bytes(range(256)) * 4096
    store.set("big", value)
    assert store.get("big") == value
    assert store.add("count", 3) == 3 and store.add("count", 4) == 7
    assert store.check(["big", "count"]) and not store.check(["absent"])


def test_gloo_world_group_builds_through_the_agent_store(agents_factory: Callable[[int], Agents]) -> None:
    """A real gloo group (16 ranks on 4 agents) is built on the agent store and all-reduces."""
    world, per_agent = 16, 4
    agents = agents_factory(world // per_agent)

    def rank_main(rank: int) -> float:
        store = agents.worker_store(rank, per_agent)  # kept referenced: torch calls back into it
        pg = ProcessGroupGloo(dist.PrefixStore("g1/world/", store), rank, world, timeout=TIMEOUT)
        t = torch.tensor([float(rank)])
        pg.allreduce([t]).wait()
        return float(t.item())

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank_main, range(world)))
    assert results == [float(sum(range(world)))] * world


def test_512_rank_world_group_rendezvous_through_the_store(agents_factory: Callable[[int], Agents]) -> None:
    """512 fake ranks on 8 agents run gloo's rendezvous protocol on the store with gloo-sized
    values: each sets ``0/<rank>``, waits for and gets its peers' values. Every rank reads its two
    neighbours (often before they are set, so the wait's watch is exercised); four ranks read all
    512 values, as every rank of a real group does (all 512 × 512 reads would take minutes here)."""
    world, per_agent = 512, 64
    agents = agents_factory(world // per_agent)
    size = gloo_blob_size(world)

    def blob(rank: int) -> bytes:
        return (rank.to_bytes(2, "big") * (size // 2 + 1))[:size]

    def rank_main(rank: int) -> int:
        store = agents.worker_store(rank, per_agent)  # the keys as gloo's prefix store writes them:
        store.set(f"g1/world/0/{rank}", blob(rank))
        peers = range(world) if rank in (0, 1, 255, 511) else ((rank - 1) % world, (rank + 1) % world)
        for peer in peers:
            store.wait([f"g1/world/0/{peer}"])
            assert store.get(f"g1/world/0/{peer}") == blob(peer), f"rank {rank} read a wrong value for rank {peer}"
        return len(peers)

    with ThreadPoolExecutor(world) as pool:
        reads = list(pool.map(rank_main, range(world)))
    assert sum(reads) == 508 * 2 + 4 * world


def _etcd_requests() -> float:
    """Requests this process has sent to etcd so far (every try of every call)."""
    return next(s.value for m in REQUEST_SECONDS.collect() for s in m.samples if s.name.endswith("_count"))


def test_commit_rule_exchange_costs_o_n_store_requests(agents_factory: Callable[[int], Agents]) -> None:
    """128 survivors exchange their reports as ``Runtime._recover`` does (``gather``): each gets
    every report, in rank order, for a few etcd requests each (reading every other's report, as
    before, took 128 × 128)."""
    survivors, per_agent = 128, 16
    agents = agents_factory(survivors // per_agent)
    before = _etcd_requests()

    def survivor(rank: int) -> list[bytes]:
        store = agents.worker_store(rank, per_agent)
        store.set(f"g7/recover/{rank:04d}", json.dumps({"applied": rank % 2, "dirty": []}).encode())
        return store.gather("g7/recover/", "g7/recovered", survivors)

    with ThreadPoolExecutor(survivors) as pool:
        results = list(pool.map(survivor, range(survivors)))
    expected = [json.dumps({"applied": r % 2, "dirty": []}).encode() for r in range(survivors)]
    assert all(r == expected for r in results), "every survivor must see every report, in key order"
    sent = _etcd_requests() - before
    assert sent <= 6 * survivors, f"the exchange sent {sent:.0f} etcd requests for {survivors} survivors"


def test_the_leader_prunes_the_store_prefixes_of_settled_generations(endpoint: str) -> None:
    """Generation 3 runs on every node: the leader deletes ``kv/g1/`` and ``kv/g2/``, keeps ``kv/g3/``
    (and the store's keys outside generation prefixes)."""
    keys = JobKeys(f"prune-{uuid.uuid4().hex[:8]}")
    spec = JobSpec(job_id=keys.job_id, nnodes=2, nproc_per_node=1, max_restarts=3, entrypoint="x", args=[],
                   fingerprint="f", rlaunch_version="t")  # fmt: skip

    def record(node: str, state: NodeState, generation: int) -> bytes:
        rec = NodeRecord(node_id=node, host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False, state=state,
                         generation=generation, restarts=0, master_port=1, updated_at=0.0)  # fmt: skip
        return encode(rec)

    async def go(store: Store) -> None:
        lease = await store.grant_lease(30)
        events = EventLog(store, keys, "a", None, time.time)
        events.start()
        try:
            gen = Generation(number=3, status=GenerationStatus.RUNNING, assignment={"a": 0, "b": 1}, nnodes=2,
                             nproc_per_node=1, master_addr="127.0.0.1", master_port=1, restart_count=0, reason="",
                             controller="a", created_at=0.0)  # fmt: skip
            await store.put(keys.spec, encode(spec))
            assert await generations.write(store, keys, gen, None, 0)
            await store.put(keys.node("a"), record("a", NodeState.RUNNING, 3), lease=lease)
            await store.put(keys.node("b"), record("b", NodeState.RESTARTING, 3), lease=lease)
            for k in ("g1/world/0/0", "g2/recover/0", "g3/world/0/0", "g10/world/0/0", "other"):
                await store.put(keys.kv(k), b"v")
            ctl = Controller(store, keys, spec, PlannerConfig("a", 60.0), lease, events)
            assert await ctl.campaign()
            await ctl.tick()
            assert len(await store.keys_under(keys.kv(""))) == 5, "b is still setting up generation 3: nothing goes"
            await store.put(keys.node("b"), record("b", NodeState.RUNNING, 3), lease=lease)
            await ctl.tick()
            left, _ = await store.get_prefix(keys.kv(""))
            assert sorted(kv.key[len(keys.kv("")) :] for kv in left) == ["g10/world/0/0", "g3/world/0/0", "other"]
        finally:
            await events.close()
            await store.revoke_lease(lease)
            await store.delete_prefix(keys.prefix)

    run_store(endpoint, go)
