"""Fencing: an agent that cannot renew its lease stops its workers; the job goes on without it."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import uuid
from collections.abc import Callable

from rlaunch.controller.controller import Controller
from rlaunch.controller.planner import PlannerConfig
from rlaunch.events import EventLog
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import JobSpec
from tests.cluster import TRAIN, Cluster, checksums, run_store, wait_for


def test_a_sigstopped_agent_is_fenced_and_the_standby_takes_over(cluster: Cluster, reference_checksum: str) -> None:
    ckpt = cluster.tmp / "ckpt.pt"
    args = ("--steps", "24", "--step-time", "0.15", "--ckpt", str(ckpt), "--ckpt-every", "6")
    a, b, c = cluster.agents_in_order(["a", "b", "c"], TRAIN, *args, flags=("--max-restarts", "3"))
    wait_for(ckpt.exists, 90, "the first checkpoint")
    b.signal(signal.SIGSTOP)  # the agent freezes; its lease (TTL 3 s) runs out
    try:
        wait_for(
            lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running",
            60, "the standby to take node b's rank",
        )  # fmt: skip
    finally:
        b.signal(signal.SIGCONT)
    assert b.wait(30) == 1, "a fenced agent exits non-zero"
    out = b.output()
    assert "stops its workers and exits because" in out and "lease" in out
    started = [int(g) for g in re.findall(r"event workers_started \(generation (\d+)\)", out)]
    assert started == [1], f"the fenced node must never start workers in a later generation: {started}"
    assert a.wait(120) == 0 and c.wait(120) == 0
    assert checksums(a.output() + c.output()) == {reference_checksum}


def test_a_stale_controller_is_deposed_when_its_node_id_is_elected_again(endpoint: str) -> None:
    """A controller partitioned away (its lease gone) and a restarted agent of the same node id,
    elected since: the stale one's next tick sees another election and stops leading, and its
    generation writes are refused by etcd (the fence is the leader key's create revision)."""
    keys = JobKeys("job-" + uuid.uuid4().hex[:8])
    spec = JobSpec(keys.job_id, 1, 1, 0, "train.py", [], "f", "test")

    async def go(store: Store) -> None:
        def controller(lease: int) -> Controller:
            events = EventLog(store, keys, "a", None, time.time)
            return Controller(store, keys, spec, PlannerConfig("a", 60.0), lease, events)

        stop, wake = asyncio.Event(), asyncio.Event()
        old_lease = await store.grant_lease(30)
        stale = controller(old_lease)
        campaign = asyncio.create_task(stale.run(stop, wake))
        await asyncio.wait_for(_until(lambda: stale.leading), 10)
        stop.set()
        await campaign
        await store.revoke_lease(old_lease)  # the partitioned controller never hears of it
        fresh = controller(await store.grant_lease(30))
        stop, wake = asyncio.Event(), asyncio.Event()
        campaign = asyncio.create_task(fresh.run(stop, wake))
        await asyncio.wait_for(_until(lambda: fresh.leading), 10)
        stop.set()
        await campaign
        assert stale.leading, "the stale controller still believes it leads (it heard nothing)"
        old_term = stale._term
        assert not await store.put_guarded(keys.generation, b"{}", 0, fence=(keys.leader, old_term)), (
            "etcd refuses a write fenced by the old election"
        )
        await stale.tick()
        assert not stale.leading, "the leader key names node a again, but it is another election"
        assert fresh.leading
        # An election whose answer was lost (the key exists on the controller's own lease) is adopted.
        lease = await store.grant_lease(30)
        lost_reply = controller(lease)
        await store.delete(keys.leader)
        made = await store.create(keys.leader, b"a", lease=lease)
        assert await lost_reply.campaign() and lost_reply._term == made
        assert not await controller(await store.grant_lease(30)).campaign(), "another lease's key is not adopted"

    run_store(endpoint, go)


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.05)
