"""Live moves and silent data corruption, reported by real workers to real agents over a real etcd.

One job: a and b train (``tests/scripts/sdc_report.py``, which sends the reports the runtime's
replica check will send), c is a warm standby. Every rank reports ``moves``; the test reads them
from ``rlaunch status --json``. Then b's rank reports itself suspect (``sdc_suspected``) and exits
3: b must give its ranks to c by a live replacement, never be restarted in place, show the fault
in ``rlaunch status``, count it in its metrics, and the event must be in ``rlaunch report``.
"""

from __future__ import annotations

import csv
import json
import re
import urllib.request

import pytest

from rlaunch.store.embedded import free_port
from tests.cluster import SCRIPTS, AgentProc, Cluster, wait_for
from tests.integration.test_migration import warm

pytestmark = pytest.mark.timeout(300)

SCRIPT = SCRIPTS / "sdc_report.py"
ARGS = ("--steps", "60", "--step-time", "0.05", "--suspect", "b", "--hold-at", "20")
SUSPECT = "silent data corruption suspected on rank 1: its parameters differ from those of its replicas (ranks [0])"
FINAL = re.compile(r"rank (\d+) final: params=(\w+)")


def test_a_suspect_rank_is_replaced_by_the_standby_live_and_its_node_never_gets_ranks_again(cluster: Cluster) -> None:
    trigger = cluster.tmp / "corrupt"
    agents: dict[str, AgentProc] = {}
    for node in ("a", "b", "c"):
        # b's port is chosen just before b binds it: a, started earlier, may take a port chosen earlier
        extra = ("--metrics-port", str(port := free_port())) if node == "b" else ()
        agents[node] = cluster.agent(node, SCRIPT, *ARGS, "--trigger", str(trigger),
                                     flags=("--verify-every", "7", "--max-restarts", "3", *extra))  # fmt: skip
        cluster.registered(agents[node])
    a, b, c = agents["a"], agents["b"], agents["c"]
    wait_for(lambda: warm(cluster, "c"), 120, "standby c to be warm")
    before = wait_for(lambda: (s := cluster.status())["live_moves"] != "unknown" and s, 60, "a and b to report moves")
    assert before["live_moves"] == "drain and replacement" and before["moves_reason"] == ""
    moves = {n["node_id"]: n["live_moves"] for n in before["nodes"]}
    assert moves == {"a": "drain and replacement", "b": "drain and replacement", "c": "unknown"}, before
    assert "live moves: drain and replacement" in a.output() and "event live_moves" in b.output()

    trigger.touch()  # b's rank, held at step 20, reports itself suspect and exits 3
    wait_for(lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running", 90,
             "the standby to take b's rank")  # fmt: skip
    res = cluster.cli("status", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, "--json")
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    node_b = next(n for n in status["nodes"] if n["node_id"] == "b")
    assert (node_b["role"], node_b["state"], node_b["ranks"]) == ("standby", "failed", []), node_b
    assert node_b["fault"].startswith(SUSPECT) and node_b["failure"] == "fault", node_b
    assert status["generation"] == 2 and f"b (fault: {SUSPECT}" in status["reason"], status["reason"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        page = reply.read().decode()
    assert 'rlaunch_sdc_suspected_total{node="b"} 1.0' in page, page[-2000:]

    assert a.wait(180) == 0 and c.wait(180) == 0 and b.wait(60) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert b.output().count("event workers_started") == 1, "the suspect's node was never given ranks again"
    assert "this node gives up its ranks" in b.output() and "event sdc_suspected" in b.output()
    assert "'plan': 'replace'" in a.output() and a.output().count("event workers_started") == 1
    finals = {int(m.group(1)): m.group(2) for x in (a, c) for m in FINAL.finditer(x.output())}
    assert sorted(finals) == [0, 1] and len(set(finals.values())) == 1, "the replicas end with the same weights"
    assert all(x.output().count("verify_every=7") >= 1 for x in (a, b, c)), "every worker got --verify-every"

    out = cluster.tmp / "report"
    res = cluster.cli("report", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id,
                      "-o", str(out / "job.html"), "--csv", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    with next(out.glob("*-events.csv")).open() as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "sdc_suspected"]
    assert len(rows) == 1 and rows[0]["node"] == "b", rows
    data = json.loads(rows[0]["data"])
    assert (data["rank"], data["step"], data["evidence"]["replicas"]) == (1, 20, [0]), data
