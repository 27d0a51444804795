"""The command line as a user meets it: status output and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rlaunch.store.embedded import free_port
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import NodeRecord, NodeState, encode
from tests.cluster import SCRIPTS, TRAIN, Cluster, run_store, wait_for


def rlaunch(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlaunch", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_status_table_and_json_while_running(cluster: Cluster) -> None:
    agents = cluster.agents_in_order(["a", "b", "c"], SCRIPTS / "sleeper.py")
    wait_for(lambda: cluster.status()["generation"] == 1, 30, "the first generation")
    base = ("status", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id)

    res = cluster.cli(*base, "--json")
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["job"] == cluster.job_id and status["generation"] == 1
    assert status["controller"] in {"a", "b", "c"}
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert set(nodes) == {"a", "b", "c"}
    for node in nodes.values():
        assert set(node) >= {"node_id", "host", "role", "state", "node_rank", "ranks", "restarts", "last_seen_s"}
        assert 0 <= node["last_seen_s"] <= 3
    assert (nodes["a"]["role"], nodes["a"]["node_rank"], nodes["a"]["ranks"]) == ("active", 0, [0])
    assert (nodes["b"]["role"], nodes["b"]["node_rank"], nodes["b"]["ranks"]) == ("active", 1, [1])
    assert (nodes["c"]["role"], nodes["c"]["node_rank"], nodes["c"]["state"]) == ("standby", None, "standby")

    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", *base], env={**cluster.env(), "COLUMNS": "80"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    table = res.stdout
    assert f"job {cluster.job_id}" in table and "generation 1" in table
    for word in ("node", "rank", " standby ", " active ", " running "):
        assert word in table
    assert "…" not in table and max(map(len, table.splitlines())) <= 80, table
    for agent in agents:
        agent.close()


def test_status_of_a_job_that_does_not_exist(endpoint: str) -> None:
    res = rlaunch("status", "--rdzv-endpoint", endpoint, "--rdzv-id", "no-such-job", "--json")
    assert res.returncode == 1
    assert "no job 'no-such-job' exists" in res.stderr
    res = rlaunch("events", "--rdzv-endpoint", endpoint, "--rdzv-id", "no-such-job")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "No job 'no-such-job' exists in etcd" in res.stderr


def test_unreachable_etcd_is_named_within_the_timeout(tmp_path: Path) -> None:
    port = free_port()
    start = time.monotonic()
    res = rlaunch("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "2", str(TRAIN))
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert f"etcd at 127.0.0.1:{port} did not answer within 2.0 s" in res.stderr
    assert elapsed < 15
    res = rlaunch("status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "1")
    assert res.returncode == 1 and f"127.0.0.1:{port}" in res.stderr


def test_missing_script_is_refused_at_once(endpoint: str) -> None:
    start = time.monotonic()
    res = rlaunch("--rdzv-endpoint", endpoint, "no/such/train.py")
    assert res.returncode == 2
    assert "The training script 'no/such/train.py' does not exist" in res.stderr
    res = rlaunch("--rdzv-endpoint", endpoint, str(TRAIN.parent))
    assert res.returncode == 2 and f"The training script '{TRAIN.parent}' is a directory" in res.stderr
    assert time.monotonic() - start < 10


def test_invalid_flag_values_are_refused() -> None:
    cases = {
        ("--nnodes", "1:2"): "nodes that join beyond it become warm standbys",
        ("--nproc-per-node", "abc"): "--nproc-per-node 'abc' is not valid",
        ("--max-restarts", "x"): "Invalid value for '--max-restarts'",
        ("--bogus-flag",): "No such option: --bogus-flag",
        ("--lease-ttl", "1"): "--lease-ttl 1 is not valid",
        ("--redirects", "7"): "--redirects '7' is not valid",
        ("--rdzv-endpoint", "nohost"): "The rendezvous endpoint 'nohost' is not valid",
    }
    for flags, message in cases.items():
        res = rlaunch(*flags, str(TRAIN), timeout=30)
        assert res.returncode == 2, (flags, res.stderr)
        # click's own messages come in a rich box that may wrap: compare the words only
        words = " ".join(res.stderr.replace("│", " ").split())
        assert message in words, (flags, res.stderr)


def test_conflicting_spec_is_refused_naming_the_difference(cluster: Cluster) -> None:
    a = cluster.agent("a", SCRIPTS / "sleeper.py")
    cluster.registered(a)
    other = cluster.agent("b", SCRIPTS / "sleeper.py", flags=("--nproc-per-node", "2"))
    assert other.wait(30) == 1
    assert "nproc_per_node: 1 (job) vs 2 (this agent)" in other.output()
    assert a.proc.poll() is None, "the running agent must not be disturbed"


def test_duplicate_node_id_is_refused(cluster: Cluster) -> None:
    a = cluster.agent("a", SCRIPTS / "sleeper.py")
    cluster.registered(a)
    twin = cluster.agent("a2", SCRIPTS / "sleeper.py", flags=("--node-id", "a"))
    assert twin.wait(30) == 1
    assert "Node id 'a' is already registered" in twin.output()
    assert "another --node-id" in twin.output()
    assert a.proc.poll() is None


def test_malformed_records_are_reported_and_the_job_completes(cluster: Cluster) -> None:
    keys = JobKeys(cluster.job_id)

    async def plant(store):  # type: ignore[no-untyped-def]
        await store.put(keys.node("garbage"), b"{not json")
        await store.put(keys.node("half"), json.dumps({"node_id": "half", "state": "bogus"}).encode())

    a = cluster.agent("a", TRAIN, "--steps", "6", nnodes=1)
    cluster.registered(a)
    run_store(cluster.endpoint, plant)
    assert a.wait(60) == 0
    out = a.output()
    assert f"The record at {keys.node('garbage')} is not valid JSON" in out
    assert f"The record at {keys.node('half')} lacks the field" in out
    status = cluster.cli("status", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, "--json")
    assert status.returncode == 0 and "not valid JSON" in status.stdout


def test_malformed_spec_refuses_to_join(cluster: Cluster) -> None:
    keys = JobKeys(cluster.job_id)

    async def plant(store):  # type: ignore[no-untyped-def]
        await store.put(keys.spec, b"[1, 2]")
        lease = await store.grant_lease(30)
        ghost = NodeRecord(
            node_id="ghost", host="h", addr="127.0.0.1", pid=1, nproc=1, standby_only=False,
            state=NodeState.RUNNING, generation=1, restarts=0, master_port=1, updated_at=0.0,
        )  # fmt: skip
        await store.put(keys.node("ghost"), encode(ghost), lease=lease)  # a live agent runs the job

    run_store(cluster.endpoint, plant)
    a = cluster.agent("a", TRAIN, nnodes=1)
    assert a.wait(30) == 1
    assert f"The record at {keys.spec} is not a JSON object" in a.output()
    assert "will not join" in a.output()


def test_script_named_like_a_subcommand_runs_with_run(tmp_path: Path) -> None:
    script = tmp_path / "status"
    script.write_text("print('launched the script called status')\n")
    res = rlaunch("run", "--standalone", str(script), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "launched the script called status" in res.stdout


def test_standby_flag_keeps_an_early_node_out_of_the_active_set(cluster: Cluster) -> None:
    c = cluster.agent("c", SCRIPTS / "sleeper.py", flags=("--standby",))
    cluster.registered(c)
    cluster.agents_in_order(["a", "b"], SCRIPTS / "sleeper.py")
    status = wait_for(lambda: (s := cluster.status())["generation"] == 1 and s, 30, "the first generation")
    roles = {n["node_id"]: (n["role"], n["node_rank"]) for n in status["nodes"]}
    assert roles == {"a": ("active", 0), "b": ("active", 1), "c": ("standby", None)}
    assert c.proc.poll() is None


def test_pet_environment_variables_are_read_as_torchrun_does(endpoint: str) -> None:
    import os

    env = {**os.environ, "PET_MAX_RESTARTS": "x"}
    res = rlaunch("--rdzv-endpoint", endpoint, str(TRAIN), env=env)
    assert res.returncode == 2
    assert "PET_MAX_RESTARTS" in res.stderr
    env = {**os.environ, "PET_NNODES": "2:4"}
    res = rlaunch("--rdzv-endpoint", endpoint, str(TRAIN), env=env)
    assert res.returncode == 2 and "--nnodes '2:4'" in res.stderr
