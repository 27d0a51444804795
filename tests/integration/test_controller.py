"""The controller against a real etcd: a plan the store refuses as a planner's bug is reported and
skipped, and the controller goes on (it would otherwise end while its agent keeps the leader key,
and the job would stall without a word); its probe rounds after a reported peer loss reach every
agent, come ``ROUND_GAP_S`` apart at least, and find a gone agent."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import pytest

from rlaunch.controller import controller as controller_module
from rlaunch.controller.controller import ROUND_GAP_S, Controller
from rlaunch.controller.planner import ClusterView, PlannerConfig
from rlaunch.detectors.liveness import serve
from rlaunch.events import EventLog
from rlaunch.store import generations
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, Generation, GenerationStatus, JobSpec, NodeRecord, NodeState, encode
from tests.cluster import run_store


def test_a_plan_the_store_refuses_is_reported_and_the_controller_plans_again_at_the_next_wake(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = JobKeys("ctl-" + uuid.uuid4().hex[:8])
    spec = JobSpec(keys.job_id, 1, 1, 0, "train.py", [], "f", "test")
    first = Generation(
        number=1, status=GenerationStatus.RUNNING, assignment={"a": 0}, nnodes=1, nproc_per_node=1,
        master_addr="127.0.0.1", master_port=1, restart_count=0, reason="", controller="a", created_at=1.0,
    )  # fmt: skip
    planned: list[Generation] = []

    def planner(now: float, view: ClusterView, cfg: PlannerConfig) -> tuple[Generation | None, str]:
        """The planner with a bug: generation 1 again, with another rank map (then, fixed, its end)."""
        planned.append(planned[-1] if planned else dataclasses.replace(first, assignment={"b": 0}))
        return planned[-1], "planned"

    monkeypatch.setattr(controller_module, "plan", planner)

    async def go(store: Store) -> None:
        assert await generations.write(store, keys, first, None, 0)
        before = await store.get(keys.generation)
        seen: list[Event] = []
        events = EventLog(store, keys, "a", None, time.time)
        events.observers.append(seen.append)
        ctl = Controller(store, keys, spec, PlannerConfig("a", 60.0), await store.grant_lease(30), events)
        stop, wake = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(ctl.run(stop, wake))
        try:
            await asyncio.wait_for(_until(lambda: any(e.kind == "plan_failed" for e in seen) or task.done()), 10)
            assert not task.done(), "the controller goes on after a plan it may not write"
            wake.set()  # a change: the buggy plan is made again, and said no more
            await asyncio.wait_for(_until(lambda: len(planned) >= 2), 10)
            assert [e.kind for e in seen].count("plan_failed") == 1
            (failed,) = [e for e in seen if e.kind == "plan_failed"]
            assert failed.generation == 1 and "bug in the planner" in failed.data["reason"]
            assert "planned again with another rank map" in caplog.text
            after = await store.get(keys.generation)
            assert after is not None and before is not None and after.mod_revision == before.mod_revision
            planned.append(dataclasses.replace(first, status=GenerationStatus.SUCCEEDED))  # the planner fixed
            wake.set()
            await asyncio.wait_for(_until(lambda: any(e.kind == "generation" for e in seen)), 10)
            _, now = await generations.read(store, keys)
            assert now is not None and now.status is GenerationStatus.SUCCEEDED and now.assignment == {"a": 0}
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    with caplog.at_level(logging.ERROR, logger="rlaunch.controller.controller"):
        run_store(endpoint, go)


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.02)


def test_probe_rounds_reach_every_agent_a_round_gap_apart_and_revoke_a_gone_agents_lease(endpoint: str) -> None:
    """The controller's own loop, woken as its agent's watch wakes it: a said loss starts a round at once,
    which marks every agent with the generation; a newer report within ``ROUND_GAP_S`` waits, and its
    round comes with no wake-up once the gap has passed (a deadline tick); a loss said late but older
    than the last round's start is answered by it; a round finds an agent whose port refuses and revokes
    its lease. The controller's monotonic clock is the test's, so no step depends on the machine's speed."""
    keys = JobKeys("probe-" + uuid.uuid4().hex[:8])
    spec = JobSpec(keys.job_id, 4, 1, 0, "train.py", [], "f", "test")
    nodes = ("a", "b", "c", "d")
    gen = Generation(
        number=3, status=GenerationStatus.RUNNING, assignment={n: i for i, n in enumerate(nodes)}, nnodes=4,
        nproc_per_node=1, master_addr="127.0.0.1", master_port=1, restart_count=0, reason="", controller="a",
        created_at=1.0,
    )  # fmt: skip
    marks: dict[str, list[int]] = {n: [] for n in nodes[1:]}
    mono = [1000.0]

    def rounds() -> dict[str, int]:
        return {n: len(m) for n, m in marks.items()}

    async def go(store: Store) -> None:
        servers = {n: await serve(marks[n].append) for n in marks}
        leases = {n: await store.grant_lease(30) for n in nodes}
        stop, wake = asyncio.Event(), asyncio.Event()

        async def put(node: str, lost_at: float = 0.0) -> None:
            port = servers[node][1] if node in servers else 0
            rec = NodeRecord(node_id=node, host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False,
                             state=NodeState.RUNNING, generation=3, restarts=0, master_port=1, updated_at=0.0,
                             runtime=True, probe_port=port, peer_lost_at=lost_at)  # fmt: skip
            await store.put(keys.node(node), encode(rec), lease=leases[node])
            wake.set()  # as the agent's watch does on a change of a record

        async def rounds_become(expected: dict[str, int], within: float = 10.0) -> dict[str, int]:
            await asyncio.wait_for(_until(lambda: rounds() == expected), within)
            await asyncio.sleep(0.3)  # and no more come
            return rounds()

        seen: list[Event] = []
        events = EventLog(store, keys, "a", None, time.time)
        events.observers.append(seen.append)
        task: asyncio.Task[None] | None = None
        try:
            await store.put(keys.spec, encode(spec))
            assert await generations.write(store, keys, gen, None, 0)
            for node in nodes:
                await put(node)
            ctl = Controller(store, keys, spec, PlannerConfig("a", 60.0), leases["a"], events,
                             monotonic=lambda: mono[0])  # fmt: skip
            task = asyncio.create_task(ctl.run(stop, wake))
            await asyncio.wait_for(_until(lambda: ctl.leading), 10)
            await asyncio.sleep(0.5)
            assert rounds() == {"b": 0, "c": 0, "d": 0}, "no loss said: no round"
            await put("b", time.time())
            assert await rounds_become({"b": 1, "c": 1, "d": 1}) == {"b": 1, "c": 1, "d": 1}
            assert marks["c"] == [3], "the mark names the generation probed"
            await put("c", time.time())
            await asyncio.sleep(2.5)  # two deadline ticks, and the test's clock has not moved
            assert rounds() == {"b": 1, "c": 1, "d": 1}, "a newer report within the gap waits"
            before_round = time.time()
            mono[0] += ROUND_GAP_S
            assert await rounds_become({"b": 2, "c": 2, "d": 2}) == {"b": 2, "c": 2, "d": 2}, (
                "once the gap has passed, the round comes at a deadline tick, with no change to wake it"
            )
            await put("d", before_round)  # said late, of a loss after the last report but before that round
            mono[0] += ROUND_GAP_S
            await asyncio.sleep(2.5)
            assert rounds() == {"b": 2, "c": 2, "d": 2}, "a loss the round answered starts none"
            servers["d"][0].close()
            await servers["d"][0].wait_closed()
            await put("b", time.time())
            assert await rounds_become({"b": 3, "c": 3, "d": 2}) == {"b": 3, "c": 3, "d": 2}
            await asyncio.wait_for(_until(lambda: any(e.kind == "node_dead" for e in seen)), 10)
            assert [e.data["node"] for e in seen if e.kind == "node_dead"] == ["d"]
            for _ in range(100):
                if await store.get(keys.node("d")) is None:
                    break
                await asyncio.sleep(0.05)
            assert await store.get(keys.node("d")) is None, "the gone agent's lease was revoked"
        finally:
            stop.set()
            if task is not None:
                await asyncio.wait_for(task, 10)
            for server, _ in servers.values():
                server.close()
            for node, lease in leases.items():
                if await store.get(keys.node(node)) is not None:  # d's is revoked already
                    await store.revoke_lease(lease)
            await store.delete_prefix(keys.prefix)

    run_store(endpoint, go)


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.02)
