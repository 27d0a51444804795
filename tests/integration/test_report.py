"""``rlaunch report`` on a real job: agents train, a node is drained live, a worker is killed and
rejoins live; the report (from etcd and from events.jsonl, made while the job runs) shows all of
it, and Chromium draws it."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from rlaunch.store.embedded import free_port
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, decode
from tests.cluster import REPO, Cluster, run_store, wait_for

pytestmark = pytest.mark.timeout(480)  # a real job with a warm-up, a drain and a fault, on a shared machine

RESILIENT = REPO / "examples" / "train_resilient.py"
ARGS = ("--steps", "100000", "--step-time", "0.05")  # runs until the test has what it needs


def events(cluster: Cluster) -> list[Event]:
    async def read(store: Any) -> list[Event]:
        kvs, _ = await store.get_prefix(JobKeys(cluster.job_id).events_prefix)
        return [decode(Event, kv.value, kv.key) for kv in kvs]

    return list(run_store(cluster.endpoint, read))


def happened(cluster: Cluster, node: str, kind: str, gen: int) -> bool:
    return any(e.node_id == node and e.kind == kind and e.generation == gen for e in events(cluster))


def held(port: int, node: str) -> float:
    """The progress samples node's agent holds in memory (its metrics page)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rlaunch_progress_samples_held" and s.labels.get("node") == node:
                return float(s.value)
    return 0.0


def progress_events(cluster: Cluster, node: str, gen: int) -> list[Event]:
    return [e for e in events(cluster) if e.node_id == node and e.kind == "progress" and e.generation == gen]


@pytest.fixture
def job(cluster: Cluster, tmp_path: Path) -> Cluster:
    """A running job that went through a drain and a fault: a and b train, c stands by; b is drained
    to c, then c's worker is killed and c rejoins live. (The cluster fixture stops it afterwards.)

    Progress is sampled every second but held in memory: it reaches etcd only with another event
    of the same agent (here the drain and the fault), never while the job trains quietly."""
    env = {"RLAUNCH_PROGRESS_S": "1"}
    ports, agents = {}, {}
    for n in "abc":
        ports[n] = free_port()  # just before its agent binds it: one started earlier may take a port chosen earlier
        flags = ("--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), "--metrics-port", str(ports[n]))
        agents[n] = cluster.agent(n, RESILIENT, *ARGS, flags=flags, env=env)
        cluster.registered(agents[n], 60)
    a, c = agents["a"], agents["c"]
    wait_for(lambda: (n := cluster.node("c")) and n["state"] == "standby" and n["runtime"], 180, "standby c warm")
    wait_for(lambda: held(ports["b"], "b") >= 2, 60, "b to hold two progress samples")
    assert progress_events(cluster, "b", 1) == [], "a quietly training node wrote its progress to etcd"
    res = cluster.cli("drain", "b", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, timeout=120)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: progress_events(cluster, "b", 1), 60, "b's samples to go with its drain")
    batches = progress_events(cluster, "b", 1)  # the first carries what b held; later ones, its last steps
    assert len(batches[0].data["samples"]) >= 2 and all(e.data["flushed"] != "full" for e in batches), batches
    wait_for(lambda: held(ports["c"], "c") >= 1, 60, "c to train in b's place")
    c.workers()[0].kill()
    wait_for(lambda: happened(cluster, "c", "joined", 3), 180, "c to rejoin live after its worker was killed")
    wait_for(lambda: progress_events(cluster, "c", 2), 60, "c's samples to go with its fault")
    assert a.proc.poll() is None and c.proc.poll() is None, c.output()[-3000:]
    return cluster


def test_report_of_a_real_job_with_a_drain_and_a_fault(job: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = job.cli(
        "report", "--rdzv-endpoint", job.endpoint, "--rdzv-id", job.job_id, "-o", str(out / "r.html"),
        "--csv", str(out / "csv"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "1 drain(s), 1 recovery(ies)" in res.stdout, res.stdout
    page = (out / "r.html").read_text()
    for element in ('id="rlaunch-timeline"', 'id="rlaunch-steps"', 'id="rlaunch-summary"', "Plotly.newPlot"):
        assert element in page
    assert "drain g2:" in page and "recovery g3:" in page and "No step times" not in page

    incidents = list(csv.DictReader((out / "csv" / "r-incidents.csv").open()))
    assert [(i["kind"], i["generation"], i["downtime_source"]) for i in incidents] == [
        ("drain", "2", "runtime"), ("recovery", "3", "runtime"),
    ]  # fmt: skip
    assert 0 < float(incidents[0]["downtime_s"]) < 5 and incidents[0]["nodes"] == "b c"
    progress = list(csv.DictReader((out / "csv" / "r-progress.csv").open()))
    by_node = {p["node"] for p in progress if p["source"] == "progress"}
    assert {"a", "b", "c"} <= by_node, by_node  # b before its drain, c after it
    assert all(float(p["step_s"]) > 0 for p in progress)
    assert any(p["source"] == "switched" for p in progress)
    for node in by_node:  # a few records a minute, never one per step (here every second, as asked)
        times = [float(p["time_unix"]) for p in progress if p["node"] == node and p["source"] == "progress"]
        assert all(b - a >= 0.9 for a, b in zip(times, times[1:], strict=False)), (node, times)
    rows = list(csv.DictReader((out / "csv" / "r-events.csv").open()))
    batched = [len(json.loads(e["data"])["samples"]) for e in rows if e["kind"] == "progress"]
    assert sum(batched) == len([p for p in progress if p["source"] == "progress"])

    # The events.jsonl under --log-dir tells the same story (the CLI's drain request is only in etcd;
    # the job still runs, so the file may hold a few more progress events).
    jsonl = tmp_path / "logs" / job.job_id / "events.jsonl"
    res = job.cli("report", "--events", str(jsonl), "-o", str(out), "--csv", str(out / "from-file"))
    assert res.returncode == 0, res.stderr
    assert (out / f"rlaunch-report-{job.job_id}.html").is_file()
    again = list(csv.DictReader((out / "from-file" / f"rlaunch-report-{job.job_id}-incidents.csv").open()))
    assert [(i["kind"], i["generation"]) for i in again] == [("drain", "2"), ("recovery", "3")]
    assert again[1]["downtime_s"] == incidents[1]["downtime_s"]

    # Drawn by a browser, the page is a picture, not a blank: the plots rendered.
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert chromium, "the report's screenshot test needs chromium (apt-get install -y chromium; .ci/run installs it)"
    shot = tmp_path / "shot.png"
    subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1800",
         "--virtual-time-budget=10000", f"--user-data-dir={tmp_path / 'chromium'}", f"--screenshot={shot}",
         (out / "r.html").as_uri()],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert shot.is_file(), "chromium wrote no screenshot"
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert pixels.shape[:2] == (1800, 1400)
    # The timeline's bars: "running" green (#43a047) covers a visible area once plotly drew it.
    green = np.all(np.abs(pixels - np.array([0x43, 0xA0, 0x47])) < 12, axis=-1).mean()
    assert green > 0.01, f"only {green:.4f} of the screenshot is the timeline's green: the plots did not render"
    assert pixels.std() > 20, "the screenshot is nearly uniform"


def test_report_refuses_a_job_that_is_not_there(cluster: Cluster, tmp_path: Path) -> None:
    res = cluster.cli("report", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", "no-such-job")
    assert res.returncode == 1 and "Job 'no-such-job' has no events in etcd" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    res = cluster.cli("report", "--rdzv-endpoint", dead, "--rdzv-id", "j", "--timeout", "1")
    assert res.returncode == 1 and f"etcd at {dead} did not answer" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
