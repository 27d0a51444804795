"""The controller against a real etcd: a plan the store refuses as a planner's bug is reported and
skipped, and the controller goes on (it would otherwise end while its agent keeps the leader key,
and the job would stall without a word)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import pytest

from rlaunch.controller import controller as controller_module
from rlaunch.controller.controller import Controller
from rlaunch.controller.planner import ClusterView, PlannerConfig
from rlaunch.events import EventLog
from rlaunch.store import generations
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, Generation, GenerationStatus, JobSpec
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
