"""Unit tests of the agent's metrics: goodput, what each event and heartbeat moves, the endpoint."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlaunch.agent.metrics import AgentMetrics, Goodput
from rlaunch.errors import UsageError
from rlaunch.store.embedded import free_port
from rlaunch.store.records import Event, Generation, GenerationStatus
from tests.unit.test_config import config

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(m: AgentMetrics, name: str, **labels: str) -> float | None:
    got = m.registry.get_sample_value(name, labels)
    return None if got is None else float(got)


def event(kind: str, generation: int = 1, **data: Any) -> Event:
    return Event(time=0.0, node_id="b", kind=kind, generation=generation, data=data)


def gen(number: int, assignment: dict[str, int], kind: str = "restart", **kw: Any) -> Generation:
    return Generation(
        number=number, status=GenerationStatus.RUNNING, assignment=assignment, nnodes=len(assignment),
        nproc_per_node=1, master_addr="127.0.0.1", master_port=1, restart_count=kw.pop("restart_count", 0),
        reason="", controller="a", created_at=0.0, kind=kind, **kw,
    )  # fmt: skip


def test_goodput_counts_each_step_once_at_the_median_step_time() -> None:
    g = Goodput(0.0, applied=-1)
    assert math.isnan(g.ratio()), "unknown until a second report"
    g.progress(10.0, applied=9, step_s=1.0)  # 10 steps in 10 s
    assert g.ratio() == 1.0
    g.progress(20.0, applied=9, step_s=1.0)  # 10 s without progress (a recovery)
    assert g.ratio() == 0.5
    g.progress(25.0, applied=4, step_s=1.0)  # a restart from a checkpoint: replayed steps are not useful
    g.progress(30.0, applied=9, step_s=1.0)
    assert g.ratio() == pytest.approx(10 / 30)
    g.progress(40.0, applied=19, step_s=1.0)
    assert g.ratio() == pytest.approx(20 / 40)


def test_goodput_is_capped_at_one() -> None:
    g = Goodput(0.0, applied=0)
    g.progress(1.0, applied=10, step_s=1.0)
    assert g.ratio() == 1.0


def test_heartbeats_move_steps_step_time_and_goodput_per_rank_and_node() -> None:
    clock = Clock()
    m = AgentMetrics("b", 2, clock)
    m.heartbeat(2, steps=5, applied=4, step_s=0.1, compute_s=0.05)
    m.heartbeat(3, steps=5, applied=4, step_s=0.3, compute_s=0.05)
    clock.now += 1.0
    m.heartbeat(2, steps=15, applied=14, step_s=0.1, compute_s=0.05)
    m.heartbeat(3, steps=10, applied=9, step_s=0.1, compute_s=0.05)
    assert value(m, "rlaunch_rank_steps_completed_total", node="b", rank="2") == 15
    assert value(m, "rlaunch_node_steps_completed_total", node="b") == 25
    assert value(m, "rlaunch_rank_goodput_ratio", node="b", rank="2") == pytest.approx(1.0)
    assert value(m, "rlaunch_rank_goodput_ratio", node="b", rank="3") == pytest.approx(0.5)
    assert value(m, "rlaunch_node_goodput_ratio", node="b") == pytest.approx(0.75)
    assert value(m, "rlaunch_rank_step_seconds", node="b", rank="2") == 0.1
    assert value(m, "rlaunch_node_step_seconds", node="b") == 0.1
    assert value(m, "rlaunch_rank_applied_step", node="b", rank="3") == 9
    clock.now += 1.0
    m.heartbeat(2, steps=3, applied=16, step_s=0.1, compute_s=0.05)  # a new process counts from 0
    assert value(m, "rlaunch_rank_steps_completed_total", node="b", rank="2") == 18


def test_a_generation_without_this_nodes_ranks_removes_their_series() -> None:
    m = AgentMetrics("b", 1, Clock())
    m.heartbeat(1, steps=5, applied=4, step_s=0.1, compute_s=0.0)
    m.on_generation(gen(2, {"a": 0, "b": 1}))
    assert value(m, "rlaunch_rank_steps_completed_total", node="b", rank="1") == 5
    m.on_generation(gen(3, {"a": 0, "c": 1}, kind="migrate", leavers=["b"], joiners=["c"]))
    assert value(m, "rlaunch_rank_steps_completed_total", node="b", rank="1") == 5, "a leaver trains on"
    m.on_generation(gen(4, {"a": 0, "c": 1}, kind="replace", leavers=["b"], joiners=["c"]))
    assert value(m, "rlaunch_rank_steps_completed_total", node="b", rank="1") is None
    assert value(m, "rlaunch_generation", node="b") == 4


def test_events_count_migrations_recoveries_and_findings() -> None:
    m = AgentMetrics("b", 1, Clock())
    m.on_event(event("migration_offered", 2, role="survivor"))
    m.on_event(event("switched", 2, rank=1, downtime_ms=250.0, step_ms=300.0, median_ms=50.0))
    m.on_event(event("replacement_offered", 3, role="survivor", leavers=["a"], joiners=["c"]))
    m.on_event(event("recovered", 3, rank=1, seconds=2.5, step=7, resume_at=8, rolled_forward=False,
                     rebuilt=["world"], sends_to=[]))  # fmt: skip
    for kind in ("worker_hung", "gpu_fault", "straggler", "node_dead", "node_dead"):
        m.on_event(event(kind))
    m.on_event(event("node_state", 3, state="running", previous="restarting"))
    m.on_event(event("snapshot_committed", 3, rank=1, step=40, bytes=1 << 20, copy_s=0.01, exchange_s=0.2))
    m.on_event(event("switched", 4))  # malformed: logged, not raised
    assert value(m, "rlaunch_migrations_total", node="b", role="survivor") == 1
    assert value(m, "rlaunch_recoveries_total", node="b", role="survivor") == 1
    assert value(m, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="migrate") == 0.25
    assert value(m, "rlaunch_node_downtime_seconds_sum", node="b", kind="replace") == 2.5
    assert value(m, "rlaunch_detector_findings_total", node="b", detector="node_loss") == 2
    assert value(m, "rlaunch_detector_findings_total", node="b", detector="hang") == 1
    assert value(m, "rlaunch_node_state", node="b", rlaunch_node_state="running") == 1
    assert value(m, "rlaunch_rank_snapshot_bytes", node="b", rank="1") == 1 << 20
    assert value(m, "rlaunch_rank_snapshot_seconds", node="b", rank="1", phase="exchange") == 0.2
    assert value(m, "rlaunch_rank_snapshot_step", node="b", rank="1") == 40
    assert time.time() - value(m, "rlaunch_rank_snapshot_committed_timestamp_seconds", node="b", rank="1") < 60
    m.on_event(event("snapshot_handed_over", 4, rank=2, step=40, bytes=2 << 20, seconds=0.3))
    assert value(m, "rlaunch_rank_snapshot_step", node="b", rank="2") == 40, "a drain's joiner holds the kept one"


def test_a_restart_counts_and_its_downtime_runs_until_the_new_workers_step() -> None:
    clock = Clock()
    m = AgentMetrics("b", 1, clock)
    m.on_event(event("workers_started", 1, ranks=[1], restart_count=0))
    assert value(m, "rlaunch_restarts_total", node="b") == 0
    m.on_event(event("workers_failed", 1, exit_codes={"0": -9}))
    clock.now += 4.0
    m.on_event(event("workers_started", 2, ranks=[1], restart_count=1))
    assert value(m, "rlaunch_restarts_total", node="b") == 1
    clock.now += 2.0
    m.heartbeat(1, steps=0, applied=-1, step_s=0.0, compute_s=0.0)  # started, no step yet
    assert value(m, "rlaunch_rank_downtime_seconds_count", node="b", rank="1", kind="restart") is None
    clock.now += 1.0
    m.heartbeat(1, steps=3, applied=2, step_s=0.1, compute_s=0.0)
    assert value(m, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="restart") == 7.0
    assert value(m, "rlaunch_node_downtime_seconds_count", node="b", kind="restart") == 1


def test_a_node_replaced_in_place_is_down_from_its_failure_until_it_joins() -> None:
    clock = Clock()
    m = AgentMetrics("b", 1, clock)
    m.on_event(event("workers_failed", 1, exit_codes={"0": -9}))
    clock.now += 6.0
    m.on_generation(gen(2, {"a": 0, "b": 1}, kind="replace", leavers=["b"], joiners=["b"]))
    m.on_event(event("replacement_offered", 2, role="joiner", leavers=["b"]))
    m.on_event(event("joined", 2, local_rank=0, seconds=0.2))
    assert value(m, "rlaunch_recoveries_total", node="b", role="joiner") == 1
    assert value(m, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="replace") == 6.0
    # a standby joiner (no failure of its own) counts from the plan
    m.on_generation(gen(3, {"a": 0, "b": 1}, kind="replace", leavers=["a"], joiners=["b"]))
    m.on_event(event("replacement_offered", 3, role="joiner", leavers=["a"]))
    m.on_event(event("joined", 3, local_rank=0, seconds=0.2))
    assert value(m, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="replace") == 6.2


def test_controller_gauges_read_the_controller_at_scrape_time() -> None:
    m = AgentMetrics("a", 1, Clock())
    state = {"leading": False, "watched": 0}
    m.watch_controller(lambda: bool(state["leading"]), lambda: int(state["watched"]))
    assert value(m, "rlaunch_controller_leading", node="a") == 0
    state.update(leading=True, watched=2)
    assert value(m, "rlaunch_controller_leading", node="a") == 1
    assert value(m, "rlaunch_stragglers_watched", node="a") == 2


def test_the_endpoint_serves_only_rlaunch_names_and_a_busy_port_is_a_usage_error() -> None:
    m = AgentMetrics("a", 1, Clock())
    port = free_port()
    m.serve("127.0.0.1", port)
    try:
        m.heartbeat(0, steps=1, applied=0, step_s=0.1, compute_s=0.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            families = list(text_string_to_metric_families(reply.read().decode()))
        names = {f.name for f in families}
        assert "rlaunch_rank_steps_completed" in names and "rlaunch_etcd_request_seconds" in names
        assert all(n.startswith("rlaunch_") for n in names), names
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(UsageError, match="--metrics-port"):
                AgentMetrics("b", 1).serve("127.0.0.1", busy.getsockname()[1])
    finally:
        m.close()


def test_metrics_port_is_off_by_default_and_checked(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    assert config(script).metrics_port == 0
    assert config(script, metrics_port=9400).metrics_port == 9400
    with pytest.raises(UsageError, match="--metrics-port 70000 is not valid"):
        config(script, metrics_port=70000)


def test_the_grafana_dashboard_uses_only_exported_names() -> None:
    board = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json").read_text())
    m = AgentMetrics("a", 1, Clock())
    m.heartbeat(0, steps=1, applied=0, step_s=0.1, compute_s=0.1)
    m.on_event(event("switched", 2, rank=0, downtime_ms=1.0, step_ms=1.0, median_ms=1.0))
    m.on_event(event("migration_offered", 2, role="survivor"))
    m.on_event(event("replacement_offered", 3, role="survivor"))
    m.watch_controller(lambda: True, lambda: 0)
    m.on_generation(gen(3, {"a": 0}))
    m.on_event(event("node_state", 3, state="running", previous="restarting"))
    exported = {s.name for family in m.registry.collect() for s in family.samples}
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"rlaunch_\w+", e)}
    assert len(exprs) >= 10 and used, board
    assert used <= exported, f"the dashboard queries names no agent exports: {sorted(used - exported)}"
    assert {"rlaunch_node_goodput_ratio", "rlaunch_etcd_request_seconds_bucket"} <= used


def test_sdc_suspected_counts_per_node_and_as_a_finding_and_live_moves_shows_the_summary() -> None:
    m = AgentMetrics("b", 2, Clock())
    assert value(m, "rlaunch_sdc_suspected_total", node="b") == 0, "present at 0 from the start"
    assert value(m, "rlaunch_detector_findings_total", node="b", detector="sdc") == 0
    evidence = {"object": "model", "digest": "0x1", "replica_digest": "0x2", "replicas": [0, 2], "method": "majority"}
    for local_rank in (0, 1):
        m.on_event(event("sdc_suspected", 3, local_rank=local_rank, rank=2 + local_rank, step=40,
                         sentence="differs", evidence=evidence))  # fmt: skip
    m.on_event(event("gpu_fault", 3, faults=[]))
    assert value(m, "rlaunch_sdc_suspected_total", node="b") == 2
    assert value(m, "rlaunch_detector_findings_total", node="b", detector="sdc") == 2
    assert value(m, "rlaunch_detector_findings_total", node="b", detector="gpu_fault") == 1
    assert value(m, "rlaunch_live_moves", node="b", rlaunch_live_moves="unknown") == 1
    m.on_event(event("live_moves", 3, moves="drain only", reason="rank 3 has no replica", previous="unknown"))
    assert value(m, "rlaunch_live_moves", node="b", rlaunch_live_moves="drain only") == 1
    assert value(m, "rlaunch_live_moves", node="b", rlaunch_live_moves="unknown") == 0
