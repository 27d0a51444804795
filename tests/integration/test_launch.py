"""The launcher end to end: real agents, real etcd, real gloo training, faults on purpose."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster import SCRIPTS, TRAIN, Cluster, checksums, etcd_counters, run_store, wait_for

STEPS = ("--steps", "24")


def test_two_active_and_a_standby_complete_the_example(cluster: Cluster, reference_checksum: str) -> None:
    a, b, c = cluster.agents_in_order(["a", "b", "c"], TRAIN, *STEPS, "--step-time", "0.1")
    status = wait_for(
        lambda: (s := cluster.status())["generation"] and len(s["nodes"]) == 3 and s, 60, "all three nodes"
    )
    roles = {n["node_id"]: (n["role"], n["node_rank"]) for n in status["nodes"]}
    assert roles == {"a": ("active", 0), "b": ("active", 1), "c": ("standby", None)}
    assert [a.wait(120), b.wait(120), c.wait(60)] == [0, 0, 0]
    assert checksums(a.output() + b.output()) == {reference_checksum}
    assert "[a/0]" in a.output() and "[b/1]" in b.output()
    assert "checksum" not in c.output(), "the standby must not have run workers"


@pytest.mark.parametrize("victim", ["b", "controller"])
def test_sigkill_of_an_active_node_hands_its_rank_to_the_standby(
    cluster: Cluster, reference_checksum: str, victim: str
) -> None:
    ckpt = cluster.tmp / "ckpt.pt"
    args = (*STEPS, "--step-time", "0.15", "--ckpt", str(ckpt), "--ckpt-every", "6")
    agents = dict(
        zip("abc", cluster.agents_in_order(["a", "b", "c"], TRAIN, *args, flags=("--max-restarts", "2")), strict=True)
    )
    wait_for(ckpt.exists, 90, "the first checkpoint")
    before = cluster.status()
    if victim == "controller":
        victim = before["controller"]
    lost_rank = next(n["node_rank"] for n in before["nodes"] if n["node_id"] == victim)
    agents[victim].kill_with_workers()
    after = wait_for(
        lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running" and n,
        60, "the standby to take over",
    )  # fmt: skip
    assert after["node_rank"] == lost_rank and after["ranks"] == [lost_rank]
    status = cluster.status()
    assert status["controller"] in set(agents) - {victim}, "a live agent must lead"
    survivors = [agents[n] for n in "abc" if n != victim]
    assert [s.wait(120) for s in survivors] == [0, 0]
    assert checksums("".join(s.output() for s in survivors)) == {reference_checksum}
    assert "resumed from step" in agents["c"].output()


def test_worker_failure_restarts_every_worker(cluster: Cluster) -> None:
    env = {"FAIL_RANK": "1", "FAIL_TIMES": "1"}
    a, b = cluster.agents_in_order(["a", "b"], SCRIPTS / "flaky.py", flags=("--max-restarts", "1"), env=env)
    assert a.wait(60) == 0 and b.wait(60) == 0
    # both nodes ran attempt 0 and attempt 1: rank 0 was restarted although it had not failed
    assert "attempt 0 rank 0" in a.output() and "attempt 1 rank 0" in a.output()
    assert "attempt 1 rank 1" in b.output()


def test_restarts_exhausted_fails_the_job_loudly(cluster: Cluster) -> None:
    env = {"FAIL_RANK": "0", "FAIL_TIMES": "5"}
    a, b = cluster.agents_in_order(["a", "b"], SCRIPTS / "flaky.py", flags=("--max-restarts", "1"), env=env)
    assert a.wait(60) == 1 and b.wait(60) == 1
    assert "all 1 restarts are used; the job failed" in a.output()
    assert "exit codes {'0': 3}" in b.output()


def test_sigterm_stops_whole_worker_trees(cluster: Cluster) -> None:
    a = cluster.agent("a", SCRIPTS / "sleeper.py", nnodes=1)
    wait_for(lambda: "sleeper ready" in a.output(), 30, "the worker and its grandchild")
    worker = a.workers()[0]
    tree = [worker, *worker.children(recursive=True)]
    assert len(tree) == 2
    a.signal(signal.SIGTERM)
    assert a.wait(30) == 1
    assert "received SIGTERM" in a.output()
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive


def test_workers_get_torchrun_environment(cluster: Cluster, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    flags = ("--nproc-per-node", "2", "--max-restarts", "4")
    a, b = cluster.agents_in_order(
        ["a", "b"], SCRIPTS / "env_dump.py", "--x", "1", flags=flags, env={"DUMP_DIR": str(dump)}
    )
    assert a.wait(60) == 0 and b.wait(60) == 0
    envs = {int(p.stem): json.loads(p.read_text()) for p in dump.glob("*.json")}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        node = "a" if rank < 2 else "b"
        assert env["RANK"] == str(rank) and env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["WORLD_SIZE"] == "4" and env["ROLE_WORLD_SIZE"] == "4"
        assert env["GROUP_RANK"] == str(rank // 2) and env["GROUP_WORLD_SIZE"] == "2"
        assert env["ROLE_NAME"] == "default" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "4"
        assert env["TORCHELASTIC_RUN_ID"] == cluster.job_id and env["OMP_NUM_THREADS"] == "1"
        assert env["RLAUNCH_NODE_ID"] == node and env["RLAUNCH_ROLE"] == "active"
        assert env["RLAUNCH_AGENT_ADDR"].endswith(".sock")
        assert env["allreduce"] == 4.0 and env["argv"] == ["--x", "1"]
    assert len({env["MASTER_PORT"] for env in envs.values()}) == 1


def test_log_files_redirects_tee_and_filter(cluster: Cluster, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    flags = ("--nproc-per-node", "2", "--log-dir", str(logs), "-r", "0:1", "-t", "1:1", "--local-ranks-filter", "1")
    a = cluster.agent("a", TRAIN, "--steps", "4", "--log-every", "1", nnodes=1, flags=flags)
    assert a.wait(60) == 0
    attempt = logs / cluster.job_id / "a" / "attempt_1"
    out0 = (attempt / "0" / "stdout.log").read_text()
    out1 = (attempt / "1" / "stdout.log").read_text()
    assert "step 4/4" in out0 and "done" in out0, "rank 0's stdout is redirected to its file"
    assert "done" in out1, "rank 1's stdout is teed to its file"
    console = a.output()
    assert "[a/1] rank 1/2 done" in console, "rank 1 is teed and passes the filter"
    assert "[a/0]" not in console, "rank 0 is redirected and filtered out"
    events = [json.loads(line) for line in (logs / cluster.job_id / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert "workers_started" in kinds and "workers_succeeded" in kinds


def test_events_are_written_to_etcd(cluster: Cluster) -> None:
    a = cluster.agent("a", SCRIPTS / "flaky.py", nnodes=1, flags=("--max-restarts", "1"), env={"FAIL_TIMES": "1"})
    assert a.wait(60) == 0

    async def read(store):  # type: ignore[no-untyped-def]
        from rlaunch.store.keys import JobKeys

        kvs, _ = await store.get_prefix(JobKeys(cluster.job_id).events_prefix)
        return [json.loads(kv.value) for kv in kvs]

    deadline = time.monotonic() + 10
    events = run_store(cluster.endpoint, read)
    while time.monotonic() < deadline and not any(e["kind"] == "workers_failed" for e in events):
        time.sleep(0.2)
        events = run_store(cluster.endpoint, read)
    kinds = [e["kind"] for e in events]
    for kind in ("node_joined", "controller_elected", "generation", "workers_started", "workers_failed"):
        assert kind in kinds, kinds
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)


def _etcd_requests(endpoint: str) -> dict[str, float]:
    """Requests etcd has handled, by gRPC method, from its own Prometheus counters."""
    handled, received = etcd_counters(endpoint, "grpc_server_handled_total", "grpc_server_msg_received_total").values()
    return {m: handled.get(m, 0.0) + received.get(m, 0.0) for m in handled.keys() | received.keys()}


def test_steady_state_etcd_traffic_is_only_lease_keepalives(cluster: Cluster) -> None:
    """While training runs, agents and controller send etcd nothing but lease renewals."""
    agents = cluster.agents_in_order(["a", "b", "c"], TRAIN, "--steps", "100000", "--step-time", "0.01")
    wait_for(lambda: all(a.workers() for a in agents[:2]), 60, "the workers to start")
    wait_for(lambda: "step 20/" in agents[0].output(), 60, "training to make progress")
    time.sleep(1.0)  # let the start-up writes settle
    before = _etcd_requests(cluster.endpoint)
    time.sleep(6.0)
    after = _etcd_requests(cluster.endpoint)
    grew = {m: after[m] - before.get(m, 0.0) for m in after if after[m] != before.get(m, 0.0)}
    assert grew.get("LeaseKeepAlive", 0) > 0, "keepalives must continue"
    assert set(grew) <= {"LeaseKeepAlive"}, f"steady-state etcd requests beyond keepalives: {grew}"
