"""``rlaunch drain`` / ``undrain`` / ``events`` against real agents: refusals, ``--wait``, the stream."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

from rlaunch.store.keys import JobKeys
from tests.cluster import REPO, SCRIPTS, TRAIN, Cluster, run_store, wait_for

RESILIENT = REPO / "examples" / "train_resilient.py"
SLEEPER = SCRIPTS / "sleeper.py"
FINAL = re.compile(r"rank (\d+) final: steps=\d+ (params=\w+ optim=\w+)")


def job_flags(cluster: Cluster) -> tuple[str, ...]:
    return ("--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id)


def running(cluster: Cluster, names: list[str]) -> None:
    """Start sleeper agents in order and wait for the first generation."""
    cluster.agents_in_order(names, SLEEPER)
    wait_for(lambda: cluster.status()["generation"] == 1, 30, "the first generation")


def drain_requested(cluster: Cluster, node: str) -> bool:
    """Whether a drain request for ``node`` lies in etcd for the controller."""

    async def get(store):  # type: ignore[no-untyped-def]
        return await store.get(JobKeys(cluster.job_id).drain_request(node))

    return run_store(cluster.endpoint, get) is not None


def state(cluster: Cluster, node: str) -> str | None:
    found = cluster.node(node)
    return found["state"] if found else None


def test_drain_of_an_unknown_node_names_it_and_the_jobs_nodes(cluster: Cluster) -> None:
    running(cluster, ["a", "b"])
    res = cluster.cli("drain", "zz", *job_flags(cluster))
    assert res.returncode == 1, res.stderr
    assert f"Job {cluster.job_id!r} has no live node 'zz' (its nodes: a, b)." in res.stderr
    assert not drain_requested(cluster, "zz")


def test_drain_of_a_standby_is_refused(cluster: Cluster) -> None:
    running(cluster, ["a", "b", "c"])
    res = cluster.cli("drain", "c", *job_flags(cluster))
    assert res.returncode == 1, res.stderr
    assert "Node 'c' holds no ranks" in res.stderr and "(it is standby)" in res.stderr
    assert "only active nodes can be drained" in res.stderr
    assert not drain_requested(cluster, "c")
    assert state(cluster, "c") == "standby", "the standby is left as it was"


def test_drain_without_a_standby_is_refused_and_suggests_wait(cluster: Cluster) -> None:
    running(cluster, ["a", "b"])
    res = cluster.cli("drain", "b", *job_flags(cluster))
    assert res.returncode == 1, res.stderr
    assert "no ready standby to take the ranks of node 'b'" in res.stderr and "--wait" in res.stderr
    assert not drain_requested(cluster, "b"), "a refused drain writes no request"
    assert (state(cluster, "a"), state(cluster, "b")) == ("running", "running")

    res = cluster.cli("drain", "b", *job_flags(cluster), "--wait", "--timeout", "2")
    assert res.returncode == 1, res.stderr
    assert "Node 'b' was not drained within 2 s; the request was withdrawn." in res.stderr
    assert not drain_requested(cluster, "b"), "a drain that timed out withdraws its request"
    assert state(cluster, "b") == "running"


def test_drain_on_a_job_that_does_not_exist(endpoint: str) -> None:
    job = "no-such-job-" + uuid.uuid4().hex[:8]
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "drain", "a", "--rdzv-endpoint", endpoint, "--rdzv-id", job],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert f"No job {job!r} exists in etcd at {endpoint}; check --rdzv-id." in res.stderr


def test_undrain_of_a_node_that_is_not_drained(cluster: Cluster) -> None:
    running(cluster, ["a", "b"])
    res = cluster.cli("undrain", "b", *job_flags(cluster))
    assert res.returncode == 1, res.stderr
    assert f"Node 'b' is not drained in job {cluster.job_id!r}; nothing to undo." in res.stderr
    assert "may rejoin" not in res.stdout
    assert state(cluster, "b") == "running"


def test_drain_wait_completes_once_a_standby_is_warm(cluster: Cluster) -> None:
    args = ("--steps", "400", "--step-time", "0.05")
    a, b = cluster.agents_in_order(["a", "b"], RESILIENT, *args)
    wait_for(lambda: "step 10/" in a.output(), 90, "training to make progress")
    waiter = subprocess.Popen(
        [sys.executable, "-m", "rlaunch", "drain", "b", *job_flags(cluster), "--wait", "--timeout", "120"],
        env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: drain_requested(cluster, "b"), 30, "the drain request to be written")
        assert waiter.poll() is None, "with --wait and no standby, drain waits instead of refusing"
        assert state(cluster, "b") == "running"
        c = cluster.agent("c", RESILIENT, *args)
        out, err = waiter.communicate(timeout=120)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    assert waiter.returncode == 0, err
    assert "node b drained: its ranks moved to c" in out, out
    again = cluster.cli("drain", "b", *job_flags(cluster))
    assert again.returncode == 1 and f"Node 'b' is already drained from job {cluster.job_id!r}." in again.stderr
    assert [a.wait(120), c.wait(60), b.wait(60)] == [0, 0, 0]
    finals = {m.group(1): m.group(2) for m in FINAL.finditer(a.output() + c.output())}
    assert set(finals) == {"0", "1"}, "a keeps rank 0, the joiner c holds rank 1"
    assert finals["0"] == finals["1"], "the joiner received the state: both replicas end identical"
    assert "final" not in b.output(), "the leaver stops at the switch"
    assert not drain_requested(cluster, "b"), "the controller consumed the request"


def test_events_of_a_short_job_as_json_and_as_text(cluster: Cluster) -> None:
    a = cluster.agent("a", TRAIN, "--steps", "4", nnodes=1)
    assert a.wait(90) == 0, a.output()[-3000:]

    res = cluster.cli("events", *job_flags(cluster), "--json")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert all(set(ev) == {"time", "node_id", "kind", "generation", "data"} for ev in events), events
    kinds = [ev["kind"] for ev in events]
    assert "node_joined" in kinds and "generation" in kinds, kinds
    joined = next(ev for ev in events if ev["kind"] == "node_joined")
    assert joined["node_id"] == "a" and joined["generation"] == 0
    first = next(ev for ev in events if ev["kind"] == "generation")
    assert first["generation"] == 1 and first["data"]["status"] == "running", first
    assert [ev["time"] for ev in events] == sorted(ev["time"] for ev in events), "in the order they happened"

    res = cluster.cli("events", *job_flags(cluster))
    assert res.returncode == 0, res.stderr
    text = res.stdout.splitlines()
    assert len(text) == len(lines), "one line per event"
    assert any("generation" in line and "status=running" in line for line in text), res.stdout
    assert any("node_joined" in line for line in text), res.stdout


def test_drain_of_a_script_without_the_runtime_restarts_every_worker_and_drains_the_node(cluster: Cluster) -> None:
    args = ("--steps", "300", "--step-time", "0.05")
    a, b, c = cluster.agents_in_order(["a", "b", "c"], TRAIN, *args)
    wait_for(lambda: state(cluster, "c") == "standby", 60, "standby c to join")
    wait_for(lambda: "step 10/" in a.output(), 90, "training to make progress")
    res = cluster.cli("drain", "b", *job_flags(cluster), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "by restarting every worker" in a.output(), "a plain DDP script cannot move live"
    assert b.wait(60) == 0 and "event drained" in b.output()
    assert a.wait(180) == 0 and c.wait(180) == 0


def test_a_standby_whose_sandbox_failed_is_named_by_status_and_drain(cluster: Cluster) -> None:
    """A script that breaks in a standby's sandbox: status says why the standby is failed, and a
    drain that finds no other standby names it."""
    script = cluster.tmp / "breaks_in_a_sandbox.py"
    script.write_text(
        "import os, time\nimport torch\nimport rlaunch\n\n"
        "rt = rlaunch.init()\n"
        "if os.environ.get('RLAUNCH_ROLE') == 'standby':\n    raise SystemExit(3)\n"
        "model = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "rt.track(model=model, optimizer=opt)\n"
        "for step in rt.steps(100_000):\n"
        "    time.sleep(0.05)\n    opt.zero_grad()\n    model(torch.ones(1, 2)).sum().backward()\n"
        "    rt.optimizer_step(opt)\n"
    )
    cluster.agents_in_order(["a", "c"], script, nnodes=1)
    wait_for(lambda: state(cluster, "c") == "failed", 120, "the standby's sandbox to fail")
    status = cluster.cli("status", *job_flags(cluster))
    assert status.returncode == 0, status.stderr
    assert "its sandbox workers exited" in status.stdout, status.stdout
    res = cluster.cli("drain", "a", *job_flags(cluster))
    assert res.returncode == 1, res.stderr
    assert "(standby c failed: its log and rlaunch status say why)" in res.stderr, res.stderr
    assert state(cluster, "a") == "running", "the refused drain left the job as it was"
