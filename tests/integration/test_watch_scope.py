"""Agents follow only the keys they act on, and non-leaders campaign only when the leader key goes."""

from __future__ import annotations

import time

from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from tests.cluster import TRAIN, Cluster, run_store, wait_for
from tests.integration.test_launch import _etcd_requests


def test_store_and_unrelated_writes_wake_no_agent(cluster: Cluster) -> None:
    """While a job trains, 40 writes under the job's ``kv/`` (workers' group setup) and ``events/``
    make no agent send etcd anything: no campaign transaction from the non-leaders, no re-read.
    (When every agent watched the whole job prefix, each write made every non-leader campaign.)"""
    agents = cluster.agents_in_order(["a", "b", "c"], TRAIN, "--steps", "100000", "--step-time", "0.01")
    wait_for(lambda: all(a.workers() for a in agents[:2]), 60, "the workers to start")
    wait_for(lambda: "step 20/" in agents[0].output(), 60, "training to make progress")
    time.sleep(1.0)  # let the start-up writes settle
    keys = JobKeys(cluster.job_id)

    async def write(store: Store) -> None:
        for i in range(20):
            await store.put(keys.kv(f"g99/world/0/{i}"), b"x" * 100)
            await store.put(keys.event(time.time_ns(), "bench"), b"{}")

    before = _etcd_requests(cluster.endpoint)
    run_store(cluster.endpoint, write)
    time.sleep(3.0)
    after = _etcd_requests(cluster.endpoint)
    grew = {m: after[m] - before.get(m, 0.0) for m in after if after[m] != before.get(m, 0.0)}
    grew.pop("LeaseKeepAlive", None)
    grew["Put"] = grew.get("Put", 0.0) - 2 * 40  # ours (counted as handled and as received)
    grew = {m: v for m, v in grew.items() if v}
    assert not grew.get("Txn"), f"non-leaders campaigned on unrelated writes: {grew}"
    assert not grew.get("Range"), f"agents re-read etcd on unrelated writes: {grew}"
    assert all(a.proc.poll() is None for a in agents), "the job must keep running"
