"""rlaunch under a real Slurm: the sbatch example on 3 nodes, and a Slurm drain moved live to the standby.

tests/slurm/start_slurm.sh starts munged, slurmctld and three slurmd (n1..n3, all on 127.0.0.1)
in a temporary directory; the test submits examples/slurm/rlaunch.sbatch for 2 active nodes and
1 standby, marks an active node DRAIN with scontrol, and checks that `rlaunch slurm-watch` drained
it live (its ranks on the standby, the other node's worker kept), released it from the Slurm job
(Slurm sees it drained while the job runs on), and that the Slurm job completes.
Everything started here carries RLAUNCH_TEST_TAG and is checked gone at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlaunch.store.client import parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, decode
from rlaunch.store.security import EtcdSecurity, resolve_security
from tests.cluster import REPO, TAG_VAR, kill_leftovers, leftovers, reap_zombies, run_store, wait_for

SLURM = REPO / "tests" / "slurm"
SBATCH = REPO / "examples" / "slurm" / "rlaunch.sbatch"
RESILIENT = REPO / "examples" / "train_resilient.py"
FINAL = re.compile(r"\[(\w+)/\d+\] rank (\d+) final: steps=(\d+) (params=\w+ optim=\w+)")


class Slurm:
    """The private Slurm cluster: its environment and a few client calls."""

    def __init__(self, conf_dir: Path, tag: str) -> None:
        self.dir = conf_dir
        self.env = {**os.environ, "SLURM_CONF": str(conf_dir / "slurm.conf"), TAG_VAR: tag}
        self.env.pop("OMP_NUM_THREADS", None)

    def run(self, *argv: str) -> str:
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{' '.join(argv)} failed: {res.stderr}"
        return res.stdout

    def job_fields(self, job_id: str) -> dict[str, str]:
        line = self.run("scontrol", "show", "job", job_id, "-o")
        return dict(f.split("=", 1) for f in line.split() if "=" in f)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """munged, slurmctld and slurmd n1..n3 until the module ends; fails (never skips) if they do not start."""
    tag = uuid.uuid4().hex
    cluster = Slurm(tmp_path_factory.mktemp("slurm"), tag)
    start = subprocess.run(
        ["bash", str(SLURM / "start_slurm.sh"), str(cluster.dir), "3"],
        env=cluster.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        assert start.returncode == 0, f"Slurm did not start:\n{start.stdout}\n{start.stderr}"
        yield cluster
    finally:
        subprocess.run(["bash", str(SLURM / "stop_slurm.sh"), str(cluster.dir)], timeout=120)
        for _ in range(60):  # daemons reparented to pytest (a subreaper) are reaped here
            reap_zombies()
            if not leftovers(tag):
                break
            time.sleep(0.5)
        left = kill_leftovers(tag)
        assert not left, f"processes left running after Slurm stopped: {left}"


def etcd_security(endpoint: str, job_out: str) -> EtcdSecurity:
    """The TLS settings the batch script printed for its etcd (its ``export ETCDCTL_...`` line)."""
    line = next(x for x in job_out.splitlines() if x.startswith("export ETCDCTL_"))
    env = dict(word.split("=", 1) for word in shlex.split(line)[1:])
    return resolve_security(
        parse_endpoints(endpoint), cacert=env.get("ETCDCTL_CACERT"), cert=env.get("ETCDCTL_CERT"),
        key=env.get("ETCDCTL_KEY"),
    )  # fmt: skip


def job_events(endpoint: str, job: str, security: EtcdSecurity) -> list[Event]:
    async def read(store: Any) -> list[Event]:
        kvs, _ = await store.get_prefix(JobKeys(job).events_prefix)
        return [decode(Event, kv.value, kv.key) for kv in kvs]

    return run_store(endpoint, read, security)  # type: ignore[no-any-return]


def job_status(endpoint: str, job: str, security: EtcdSecurity) -> dict[str, Any]:
    import asyncio

    from rlaunch.cli.status import fetch_status

    return asyncio.run(fetch_status(endpoint, job, 5.0, security)) or {"generation": 0, "nodes": []}


@pytest.mark.timeout(540)
def test_sbatch_runs_one_agent_per_node_and_a_slurm_drain_moves_ranks_live_to_the_standby(
    slurm: Slurm, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    env = {
        "RLAUNCH": f"{sys.executable} -m rlaunch",
        "RLAUNCH_NPROC": "1",
        "RLAUNCH_STANDBYS": "1",
        "RLAUNCH_WATCH_INTERVAL": "1",
        "RLAUNCH_ARGS": "--lease-ttl 3 --rdzv-timeout 120",
    }
    slurm.env.update(env)
    job_id = slurm.run(
        "sbatch", "--parsable", "--nodes", "3", "--output", str(out), "--chdir", str(tmp_path),
        str(SBATCH), str(RESILIENT), "--steps", "800", "--step-time", "0.05",
    ).strip()  # fmt: skip
    job = f"slurm-{job_id}"
    text = lambda: out.read_text(errors="replace") if out.exists() else ""  # noqa: E731
    target, survivor = "n2", "n1"  # n1 runs the batch script and etcd: it stays in the Slurm job
    try:
        found = wait_for(lambda: re.search(r"etcd at (\S+)", text()), 90, "the batch script to start etcd")
        endpoint = found.group(1)
        assert endpoint.startswith("https://"), "the batch script's etcd serves mutual TLS"
        tls = wait_for(lambda: "export ETCDCTL_" in text() and etcd_security(endpoint, text()), 30, "its TLS settings")
        assert f"rlaunch job {job}: 2 active + 1 standby nodes of n[1-3]" in text()

        status = wait_for(
            lambda: (s := job_status(endpoint, job, tls))["generation"] >= 1 and len(s["nodes"]) == 3 and s, 120,
            "the rlaunch job's first generation with 3 nodes",
        )  # fmt: skip
        roles = {n["node_id"]: n["node_rank"] for n in status["nodes"]}
        assert roles["n3"] is None and {roles["n1"], roles["n2"]} == {0, 1}, (
            f"n3 (SLURM_NODEID 2) is the standby: {roles}"
        )
        wait_for(lambda: "step 10/" in text(), 120, "training to make progress")

        slurm.run("scontrol", "update", f"nodename={target}", "state=drain", "reason=maintenance")
        drained = lambda: next(  # noqa: E731
            (e for e in job_events(endpoint, job, tls) if e.kind == "drained" and e.node_id == target), None
        )
        mark = wait_for(drained, 180, f"rlaunch to drain {target} after Slurm marked it")

        # The survivor's "switched" comes after its first step on the new group, which can be after "drained".
        def switched() -> list[Event] | None:
            got = job_events(endpoint, job, tls)
            return got if any(e.kind == "switched" and e.node_id == survivor for e in got) else None

        events = wait_for(switched, 60, "the survivor's first step after the switch", interval=1.0)
        status = job_status(endpoint, job, tls)
        wait_for(lambda: slurm.job_fields(job_id)["NodeList"] == "n[1,3]", 60, f"{target} to leave the Slurm job")
        assert slurm.job_fields(job_id)["JobState"] == "RUNNING", "the job runs on without the drained node"
        wait_for(
            lambda: "State=IDLE+DRAIN " in slurm.run("scontrol", "show", "node", target, "-o"), 30,
            f"Slurm to see {target} drained (IDLE+DRAIN) while the job runs",
        )  # fmt: skip
    except BaseException:
        print(text()[-6000:])
        subprocess.run(["scancel", job_id], env=slurm.env, timeout=30)
        raise
    finally:
        subprocess.run(["scontrol", "update", f"nodename={target}", "state=resume"], env=slurm.env, timeout=60)

    assert mark.data["replaced_by"] == "n3", mark
    marked = [e for e in events if e.kind == "slurm_marked"]
    assert len(marked) == 1 and marked[0].data["node"] == target, marked
    assert marked[0].data["reason"] == "maintenance" and "DRAIN" in marked[0].data["state"]
    assert any(e.kind == "drain_requested" and e.data["node"] == target for e in events)
    assert any(e.kind == "joined" and e.node_id == "n3" for e in events), "the standby joined live"
    assert any(e.kind == "switched" and e.node_id == survivor for e in events), "the survivor switched live"
    started = [e for e in events if e.kind == "workers_started" and e.node_id == survivor]
    assert len(started) == 1, f"the survivor kept its worker process: {started}"
    joined = [e for e in events if e.kind == "node_joined"]
    assert {e.node_id: e.data["standby"] for e in joined} == {"n1": False, "n2": False, "n3": True}
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert nodes[target]["state"] == "drained" and nodes["n3"]["node_rank"] == roles[target], status

    fields = wait_for(
        lambda: (f := slurm.job_fields(job_id))["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and f,
        240, "the Slurm job to end",
    )  # fmt: skip
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text()[-6000:]
    finals = {m.group(2): (m.group(1), m.group(3), m.group(4)) for m in FINAL.finditer(text())}
    assert set(finals) == {"0", "1"}, text()[-4000:]
    moved, kept = str(roles[target]), str(roles[survivor])  # one worker per node: rank = node rank
    assert finals[moved][0] == "n3" and finals[kept][0] == survivor, finals
    assert finals["0"][1:] == finals["1"][1:] == ("800", finals["1"][2]), "both replicas end at step 800, identical"
    assert f"Node {target} drained from rlaunch job {job}: its ranks moved to n3" in text()
    assert f"Node {target} released from Slurm job {job_id}" in text()
