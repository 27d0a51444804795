"""etcd outages: a job on a real 3-member etcd cluster survives the loss of a member and of all of them.

One job goes through everything, to keep the suite short:
1. one etcd member (the leader) is SIGKILLed: training goes on and a live drain still works;
2. the member comes back on its data, then every member is SIGKILLed for 30 s: no worker
   restarts, nobody is fenced, steps keep completing;
3. etcd comes back on the same ports and data: the agents' leases survived (etcd extends leases
   when a leader is elected), keepalives resume, ``rlaunch status`` is right, and a worker crash
   after that, with the etcd leader down again, is still recovered live.
The fencing of a node that really is cut off while etcd is up for the others is tested by the
frozen-node tests (test_fencing.py, test_recovery.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from rlaunch.agent.lease import LeaseKeeper, LeaseState, keepalive_store
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.waiting import wait_event
from tests.cluster import SCRIPTS, AgentProc, Cluster, kill_leftovers, reap_zombies, run_store, wait_for
from tests.etcd_cluster import EtcdCluster
from tests.integration.test_migration import RESILIENT, warm
from tests.integration.test_store_scale import Agents

#: Long enough never to end on its own: the test stops the job when it has seen everything.
ARGS = ("--steps", "1000000", "--step-time", "0.05", "--log-every", "5")
OUTAGE_S = 30.0
TTL = 5
STEP = re.compile(r"\[a/0\] step (\d+)/")


@pytest.fixture
def etcd_job(tmp_path: Path) -> Iterator[tuple[EtcdCluster, Cluster]]:
    """A 3-member etcd cluster and a job whose agents take all three endpoints; nothing outlives it."""
    tag = uuid.uuid4().hex
    etcd = EtcdCluster(tmp_path, tag)
    cluster = Cluster(etcd.endpoints, tmp_path, tag)
    try:
        etcd.start()
        yield etcd, cluster
    finally:
        cluster.close()
        etcd.stop()
        reap_zombies()
        left = kill_leftovers(tag)
        assert not left, f"processes left running after the test: {left}"


def steps(agent: AgentProc) -> int:
    """The last step rank 0 (on node a) reported."""
    found = STEP.findall(agent.output())
    return int(found[-1]) if found else 0


def progress(agent: AgentProc, by: int, timeout: float, what: str) -> int:
    start = steps(agent)
    wait_for(lambda: steps(agent) >= start + by, timeout, f"{by} more steps {what} (from step {start})")
    return steps(agent)


def pids(agent: AgentProc) -> list[int]:
    return sorted(p.pid for p in agent.workers())


def node_leases(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """node id -> (lease id, granted TTL) of each node record."""
    keys = JobKeys(cluster.job_id)

    async def read(store):  # type: ignore[no-untyped-def]
        kvs, _ = await store.get_prefix(keys.nodes_prefix)
        return {kv.key.rsplit("/", 1)[-1]: (kv.lease, (await store.lease_ttl(kv.lease))[0]) for kv in kvs}

    return dict(run_store(cluster.endpoint, read))


def test_a_job_survives_the_loss_of_one_etcd_member_and_a_30s_outage_of_all(
    etcd_job: tuple[EtcdCluster, Cluster],
) -> None:
    etcd, cluster = etcd_job
    flags = ("--max-restarts", "2", "--lease-ttl", str(TTL))  # the default TTL (the harness's is 3 s)
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *ARGS, flags=flags)
    wait_for(lambda: warm(cluster, "c"), 120, "standby c to be warm")
    progress(a, 10, 60, "before any fault")

    # 1. The etcd leader dies: the job trains on and drains b onto the standby c, live.
    lost = etcd.leader()
    etcd.kill(lost)
    progress(a, 10, 60, "with etcd member " + lost.name + " down")
    res = cluster.cli("drain", "b", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, timeout=120)
    assert res.returncode == 0 and "node b drained" in res.stdout, (res.stdout, res.stderr)
    assert b.wait(60) == 0, b.output()[-3000:]
    etcd.restart(lost)
    etcd.wait_healthy(etcd.members)
    progress(a, 10, 60, "after the drain")
    before = cluster.status()
    nodes = {n["node_id"]: n for n in before["nodes"]}
    assert (nodes["c"]["role"], nodes["c"]["state"], nodes["b"]["state"]) == ("active", "running", "drained")
    leases = node_leases(cluster)
    assert {n: granted for n, (_, granted) in leases.items()} == {"a": TTL, "c": TTL}, leases
    workers = {"a": pids(a), "c": pids(c)}
    assert all(workers.values()), workers

    # 2. Every etcd member dies for 30 s (six lease TTLs): the workers train on, untouched.
    for member in etcd.members:
        etcd.kill(member)
    outage_end = time.monotonic() + OUTAGE_S
    seen = [steps(a)]
    while time.monotonic() < outage_end:
        time.sleep(min(15.0, max(0.0, outage_end - time.monotonic())))
        seen.append(steps(a))
    assert all(x < y for x, y in zip(seen, seen[1:], strict=False)), f"steps must complete every 15 s: {seen}"
    assert {"a": pids(a), "c": pids(c)} == workers, "no worker may restart during the outage"
    assert a.proc.poll() is None and c.proc.poll() is None, "no agent may exit during the outage"

    # 3. etcd returns on its ports and data: leases survived, keepalives resume, status is right.
    for member in etcd.members:
        etcd.restart(member)
    etcd.wait_healthy(etcd.members)
    wait_for(lambda: "event etcd_back" in a.output() and "event etcd_back" in c.output(), 60, "keepalives to resume")
    time.sleep(TTL + 2)  # a lease kept only by etcd's extension on election (TTL + 1 s) would be gone by now
    assert node_leases(cluster) == leases, "the agents' leases must survive the outage"
    res = cluster.cli("status", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, "--json")
    assert res.returncode == 0, res.stderr
    after = json.loads(res.stdout)
    assert (after["generation"], after["status"], after["controller"]) == (
        before["generation"], before["status"], before["controller"],
    )  # fmt: skip
    live = {n["node_id"]: n for n in after["nodes"] if n["role"] == "active"}
    assert sorted(live) == ["a", "c"] and all(n["state"] == "running" for n in live.values()), after
    assert all(n["last_seen_s"] is not None and n["last_seen_s"] <= TTL for n in live.values()), after
    for agent in (a, c):
        out = agent.output()
        assert "event fenced" not in out and "stops its workers" not in out, out[-3000:]
        assert "event workers_stopped" not in out and "event workers_failed" not in out, out[-3000:]
    assert len(re.findall(r"event workers_started", a.output())) == 1
    assert {"a": pids(a), "c": pids(c)} == workers
    progress(a, 10, 60, "after etcd came back")

    # 4. A fault after the outage, with the new etcd leader down, is still recovered: c's worker
    #    crashes and restarts in place, live.
    etcd.kill(etcd.leader())
    psutil.Process(workers["c"][0]).kill()
    wait_for(lambda: len(re.findall(r"event joined", c.output())) >= 2, 120, "c's new worker to join")
    progress(a, 10, 60, "after the recovery")
    assert pids(a) == workers["a"], "the survivor's worker must never restart"
    assert cluster.status()["generation"] > before["generation"]


def test_the_lease_is_kept_through_an_outage_and_lost_only_on_etcds_word(tmp_path: Path) -> None:
    """The lease keeper against one real etcd member: SIGKILLed past the TTL, restarted, then revoked."""
    etcd = EtcdCluster(tmp_path, uuid.uuid4().hex, size=1).start()
    member = etcd.members[0]
    backs: list[tuple[float, int]] = []
    pauses: list[tuple[float, LeaseState]] = []  # each wait of the keeper, with its state then

    async def scenario() -> tuple[str | None, LeaseState, list[LeaseState]]:
        store = keepalive_store(Store(parse_endpoints(etcd.endpoints)))
        stop = asyncio.Event()
        try:
            lease = await store.grant_lease(2)

            def sleep(seconds: float) -> Awaitable[bool]:
                pauses.append((seconds, keeper.state))
                return wait_event(stop, seconds)

            keeper = LeaseKeeper(
                store, lease, 2, "n", sleep=sleep, on_back=lambda s, r: backs.append((s, r)), draw=lambda: 0.5
            )
            task = asyncio.create_task(keeper.run())
            seen = []
            await asyncio.sleep(1.0)
            seen.append(keeper.state)
            await asyncio.to_thread(etcd.kill, member)
            await asyncio.sleep(5.0)  # more than twice the TTL without an answer
            seen.append(keeper.state)
            assert not task.done(), "an unanswered keepalive must not end the lease"
            await asyncio.to_thread(etcd.restart, member)
            await asyncio.to_thread(etcd.wait_healthy, etcd.members)
            end = asyncio.get_running_loop().time() + 20
            while keeper.state is not LeaseState.HELD and asyncio.get_running_loop().time() < end:
                await asyncio.sleep(0.1)
            seen.append(keeper.state)
            _, remaining = await store.lease_ttl(lease)
            assert remaining > 0, "etcd extends the lease when it elects a leader again"
            await store.revoke_lease(lease)  # as a controller does for a node it found dead
            why = await asyncio.wait_for(task, 10)
            return why, keeper.state, seen
        finally:
            stop.set()
            await store.close()

    try:
        why, final, seen = asyncio.run(scenario())
    finally:
        etcd.stop()
    assert seen == [LeaseState.HELD, LeaseState.UNREACHABLE, LeaseState.HELD], seen
    assert len(backs) == 1 and backs[0][0] >= 5.0 and backs[0][1] > 0, backs
    assert final is LeaseState.LOST and why is not None and "etcd answered that its lease" in why, why
    # Renewed every TTL/3, but a random part of it first, and again once etcd answered after the outage
    # (draw 0.5: half of it), so that leases taken or answered together renew apart.
    third = 2 / 3
    drawn = [i for i, (p, _) in enumerate(pauses) if p == pytest.approx(third / 2)]
    assert len(drawn) == 2 and drawn[0] == 0, pauses
    assert pauses[drawn[1] - 1][1] is LeaseState.UNREACHABLE, f"drawn again right after the outage: {pauses}"
    assert all(state is LeaseState.HELD for i, (_, state) in enumerate(pauses) if i in drawn), pauses
    assert all(p == pytest.approx(third) for i, (p, _) in enumerate(pauses) if i not in drawn), pauses


def test_a_cut_off_node_is_fenced_and_its_workers_killed_without_a_sigterm(cluster: Cluster) -> None:
    """etcd is up for the others: b's lease expires while its agent is frozen; on waking it is fenced."""
    a, b = cluster.agents_in_order(["a", "b"], SCRIPTS / "stubborn.py", env={"STUBBORN_RANK": "1"})
    wait_for(lambda: "stubborn ready, rank 1" in b.output(), 60, "b's worker to start")
    b.signal(signal.SIGSTOP)  # the agent freezes; its worker runs on
    try:
        wait_for(lambda: cluster.node("b") is None, 60, "b's lease to expire")
    finally:
        b.signal(signal.SIGCONT)
    assert b.wait(60) == 1, b.output()[-3000:]
    out = b.output()
    assert "stops its workers and exits because etcd answered that its lease" in out, out[-3000:]
    assert "event workers_stopped (generation 1) {'codes': {'0': -9}}" in out, out[-3000:]
    assert "got SIGTERM" not in out, "a stale worker is SIGKILLed at once, never given a SIGTERM grace"


def test_a_worker_failure_during_an_outage_reaches_the_controller_when_etcd_is_back(tmp_path: Path) -> None:
    """The failed node's record cannot be written while etcd is down; it is written once etcd is back."""
    tag = uuid.uuid4().hex
    etcd = EtcdCluster(tmp_path, tag, size=1)
    cluster = Cluster(etcd.endpoints, tmp_path, tag)
    try:
        etcd.start()
        a, b = cluster.agents_in_order(["a", "b"], SCRIPTS / "stubborn.py", flags=("--max-restarts", "1"))
        wait_for(lambda: "stubborn ready" in a.output() and "stubborn ready" in b.output(), 60, "the workers")
        etcd.kill(etcd.members[0])
        b.workers()[0].kill()
        wait_for(lambda: "event workers_failed" in b.output(), 30, "b to see its worker fail")
        time.sleep(3 * 3)  # several loop rounds (and a lease TTL) without etcd
        assert a.proc.poll() is None and b.proc.poll() is None, "no agent may exit while etcd is down"
        etcd.restart(etcd.members[0])
        etcd.wait_healthy(etcd.members)
        for agent in (a, b):
            wait_for(lambda ag=agent: "event workers_started (generation 2)" in ag.output(), 60, "the restart")
        assert "event fenced" not in a.output() + b.output()
        assert cluster.status()["restart_count"] == 1
    finally:
        cluster.close()
        etcd.stop()
    left = kill_leftovers(tag)
    assert not left, f"processes left running after the test: {left}"


def test_a_job_whose_etcd_is_gone_for_good_ends_with_each_nodes_own_result(
    etcd_job: tuple[EtcdCluster, Cluster],
) -> None:
    """Every etcd member dies for good while the job trains: the workers finish untouched, and then
    each agent (and the standby) ends --rdzv-timeout after etcd went silent, with a sentence and its
    own workers' result, rather than retrying for ever (under Slurm: holding the allocation)."""
    etcd, cluster = etcd_job
    timeout_s = 8
    flags = ("--rdzv-timeout", str(timeout_s))
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, "--steps", "400", "--step-time", "0.05", flags=flags)
    wait_for(lambda: warm(cluster, "c"), 120, "standby c to be warm")
    progress(a, 5, 60, "before the outage")
    for member in etcd.members:
        etcd.kill(member)
    killed_at = time.monotonic()
    ended: dict[str, float] = {}

    def all_ended() -> bool:
        for agent in (a, b, c):
            if agent.name not in ended and agent.proc.poll() is not None:
                ended[agent.name] = time.monotonic() - killed_at
        return len(ended) == 3

    wait_for(all_ended, 180, "every agent to end without etcd")
    assert (a.wait(1), b.wait(1)) == (0, 0), "the workers succeeded: that is each node's result"
    assert c.wait(1) == 1, "a standby has no result of its own: the job's outcome is unknown to it"
    assert ended["c"] >= timeout_s, f"the standby waited --rdzv-timeout for etcd: {ended}"
    for agent, mine in ((a, "this node's workers succeeded"), (b, "this node's workers succeeded"), (c, "standby")):
        out = agent.output()
        assert "the job's outcome could not be recorded in etcd" in out and mine in out, out[-3000:]
    assert "rank 0 final: steps=400 " in a.output() and "workers_failed" not in a.output() + b.output()


def test_a_store_key_a_worker_waits_for_is_read_through_the_loss_of_the_member_it_watched(tmp_path: Path) -> None:
    """A worker's store ``get`` (a group's rendezvous) waits on the agent's watch of the key; the
    etcd member that watch runs on is SIGKILLed before the key is set (by a peer, through another
    member): the agent reads and watches again on the next member, and the worker gets the value
    instead of a store error."""
    etcd = EtcdCluster(tmp_path, uuid.uuid4().hex).start()
    agents = Agents(etcd.endpoints, 1)
    try:
        store = agents.worker_store(0, 1)
        waiting = ThreadPoolExecutor(1)
        got = waiting.submit(store.get, "g1/world/rank_1")
        time.sleep(1.0)
        assert not got.done(), "the key is not set yet"
        assert agents.store is not None
        watched = next(m for m in etcd.members if m.endpoint == str(agents.store.endpoint))
        etcd.kill(watched)
        peer = [m.endpoint for m in etcd.members if m is not watched]
        run_store(",".join(peer), lambda s: s.put(agents.job.kv("g1/world/rank_1"), b"addr-of-rank-1"))
        assert got.result(timeout=60) == b"addr-of-rank-1"
        waiting.shutdown()
    finally:
        agents.close()
        etcd.stop()
