"""The report's pure parts: events → timeline (generations, node states, incidents, points), CSV rows,
the page's elements, the progress event's data, and the command's sentences on bad input."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlaunch.agent.metrics import AgentMetrics
from rlaunch.agent.progress import (
    PROGRESS_BATCH,
    PROGRESS_EVERY_S,
    ProgressReporter,
    progress_batch,
    progress_data,
    progress_every_s,
    read_sample,
)
from rlaunch.cli import app
from rlaunch.cli.report import default_name
from rlaunch.errors import UsageError
from rlaunch.report import ReportError, export, render, source, timeline
from rlaunch.store.records import Event

T0 = 1_800_000_000.0


def ev(t: float, node: str, kind: str, gen: int = 0, /, **data: Any) -> Event:
    return Event(time=T0 + t, node_id=node, kind=kind, generation=gen, data=data)


def job_events() -> list[Event]:
    """A job told by its events: a and b train, c stands by; b is drained to c; c's worker dies and is
    replaced live; later a node is lost and the job restarts."""
    return [
        ev(0.0, "a", "node_joined"),
        ev(1.0, "b", "node_joined"),
        ev(1.1, "a", "generation", 1, plan="restart", status="running", reason="2 node(s) joined",
           assignment={"a": 0, "b": 1}, restart_count=0),
        ev(1.2, "a", "node_state", 1, state="restarting", previous="waiting"),
        ev(1.2, "b", "node_state", 1, state="restarting", previous="waiting"),
        ev(1.5, "a", "node_state", 1, state="running", previous="restarting"),
        ev(1.5, "b", "node_state", 1, state="running", previous="restarting"),
        ev(2.0, "c", "node_joined"),
        ev(2.1, "c", "node_state", 1, state="standby", previous="waiting"),
        ev(30.0, "a", "progress", 1, steps=300, applied=299, step_s=0.1, goodput=0.9, ranks=1),
        ev(40.0, "cli", "drain_requested", 0, node="b"),
        ev(40.1, "a", "generation", 2, plan="migrate", status="running", reason="draining b",
           assignment={"a": 0, "c": 1}, restart_count=0),
        ev(40.1, "b", "migration_offered", 2, role="leaver", joiners=["c"]),
        # a batch (today's agents): b's sample of t=30.2 rides along with its first event after it
        ev(40.1, "b", "progress", 1, flushed="migration_offered", samples=[
            {"time": T0 + 30.2, "generation": 1, "steps": 300, "applied": 299, "step_s": 0.11, "goodput": None,
             "ranks": 1},
        ]),
        ev(40.1, "c", "migration_offered", 2, role="joiner", leavers=["b"], joiners=["c"]),
        ev(40.1, "b", "node_state", 2, state="draining", previous="running"),
        ev(40.3, "b", "state_sent", 2, local_rank=0, bytes=2048, seconds=0.01),
        ev(40.3, "c", "joined", 2, local_rank=0, seconds=0.2),
        ev(40.4, "a", "switched", 2, rank=0, downtime_ms=25.0, step_ms=130.0, median_ms=100.0),
        ev(40.4, "c", "node_state", 2, state="running", previous="standby"),
        ev(40.6, "b", "node_state", 2, state="drained", previous="draining"),
        ev(40.6, "b", "drained", 2, replaced_by="c"),
        ev(50.0, "a", "recovering", 2, local_rank=0, step=400),
        ev(50.1, "c", "workers_failed", 2, exit_codes={"0": -9}),
        ev(50.1, "c", "node_state", 2, state="failed", previous="running"),
        ev(50.2, "a", "generation", 3, plan="replace", status="running", reason="c restarted in place",
           assignment={"a": 0, "c": 1}, restart_count=1),
        ev(50.2, "a", "replacement_offered", 3, role="survivor", leavers=["c"], joiners=["c"]),
        ev(50.2, "c", "replacement_offered", 3, role="joiner", leavers=["c"]),
        ev(52.0, "a", "recovered", 3, seconds=1.9, rank=0, step=400),
        ev(52.1, "c", "joined", 3, local_rank=0, seconds=0.3),
        ev(52.1, "c", "node_state", 3, state="running", previous="failed"),
        ev(60.0, "a", "node_dead", 3, node="c", reason="its lease expired"),
        ev(60.1, "a", "generation", 4, plan="restart", status="running", reason="c was lost",
           assignment={"a": 0, "d": 1}, restart_count=2),
        ev(61.0, "a", "node_state", 4, state="restarting", previous="running"),
        ev(64.0, "a", "node_state", 4, state="running", previous="restarting"),
        ev(65.0, "d", "node_state", 4, state="running", previous="restarting"),
        ev(70.0, "a", "generation", 4, plan="restart", status="succeeded", reason="the job succeeded",
           assignment={"a": 0, "d": 1}, restart_count=2),
    ]  # fmt: skip


@pytest.fixture
def tl() -> timeline.Timeline:
    return timeline.build("job-1", list(reversed(job_events())))  # any order


def test_generations_keep_their_first_time_and_last_status(tl: timeline.Timeline) -> None:
    assert [(g.number, g.plan, g.status) for g in tl.generations] == [
        (1, "restart", "running"), (2, "migrate", "running"), (3, "replace", "running"), (4, "restart", "succeeded"),
    ]  # fmt: skip
    assert tl.generations[3].time == T0 + 60.1 and tl.generations[3].reason == "c was lost"
    assert tl.outcome == "succeeded" and tl.start == T0 and tl.end == T0 + 70.0
    assert tl.nodes == ["a", "b", "c", "d"]


def test_each_node_state_lasts_until_the_next_one(tl: timeline.Timeline) -> None:
    b = [(s.state, round(s.start - T0, 3), round(s.end - T0, 3), s.role) for s in tl.segments if s.node == "b"]
    assert b == [
        ("waiting", 1.0, 1.2, "joining"), ("restarting", 1.2, 1.5, "joining"), ("running", 1.5, 40.1, "active"),
        ("draining", 40.1, 40.6, "leaving"), ("drained", 40.6, 70.0, "gone"),
    ]  # fmt: skip
    c = [s.state for s in tl.segments if s.node == "c"]
    assert c == ["waiting", "standby", "running", "failed", "running"]


def test_a_drain_runs_from_its_request_and_its_downtime_is_the_switch(tl: timeline.Timeline) -> None:
    drain = tl.incidents[0]
    assert (drain.kind, drain.generation, drain.nodes) == ("drain", 2, ("b", "c"))
    assert drain.start == T0 + 40.0 and drain.end == T0 + 40.6
    assert drain.downtime_s == pytest.approx(0.025) and drain.measured
    assert drain.detail == "b → c; 2.0 KiB of state moved"


def test_a_recovery_starts_at_the_first_sign_of_the_fault(tl: timeline.Timeline) -> None:
    rec = tl.incidents[1]
    assert (rec.kind, rec.generation, rec.nodes) == ("recovery", 3, ("c",))
    assert rec.start == T0 + 50.0  # the survivor noticed before c's agent reported
    assert rec.end == T0 + 52.1
    assert rec.downtime_s == pytest.approx(1.9) and rec.measured
    assert rec.detail.startswith("workers failed on c; c restarted in place")


def test_a_restart_is_over_once_every_node_runs_again(tl: timeline.Timeline) -> None:
    rst = tl.incidents[2]
    assert (rst.kind, rst.generation, rst.nodes) == ("restart", 4, ("a", "d"))
    assert rst.start == T0 + 60.0 and rst.end == T0 + 65.0
    assert rst.downtime_s == pytest.approx(5.0) and not rst.measured
    assert len(tl.incidents) == 3  # the first generation is the start, not an incident


def test_findings_name_the_node_they_are_about(tl: timeline.Timeline) -> None:
    assert [(f.node, f.kind, f.label) for f in tl.findings] == [
        ("c", "workers_failed", "workers failed"), ("c", "node_dead", "node lost"),
    ]  # fmt: skip


def test_points_come_from_progress_and_switches(tl: timeline.Timeline) -> None:
    assert [(p.node, p.source, p.step_s, p.goodput) for p in tl.points] == [
        ("a", "progress", 0.1, 0.9), ("b", "progress", 0.11, None), ("a", "switched", 0.13, None),
    ]  # fmt: skip
    s = tl.summary()
    assert (s["drains"], s["recoveries"], s["restarts"], s["findings"], s["generations"]) == (1, 1, 1, 2, 4)
    assert s["downtime_s"] == pytest.approx(0.025 + 1.9 + 5.0)
    assert s["median_downtime_s"] == pytest.approx(1.9)
    assert s["goodput"] == pytest.approx(0.9) and s["median_step_s"] == pytest.approx(0.105)


def test_csv_tables_load_back_with_one_row_per_record(tl: timeline.Timeline, tmp_path: Path) -> None:
    paths = export.write_csv(tl, tmp_path / "out", "rlaunch-report-job-1")
    assert [p.name for p in paths] == [f"rlaunch-report-job-1-{t}.csv" for t in export.TABLES]
    tables = {t: list(csv.DictReader(p.open())) for t, p in zip(export.TABLES, paths, strict=True)}
    assert len(tables["events"]) == len(job_events())
    switched = next(r for r in tables["events"] if r["kind"] == "switched")
    assert float(switched["downtime_s"]) == 0.025 and json.loads(switched["data"])["step_ms"] == 130.0
    assert switched["time_utc"].endswith("+00:00") and float(switched["elapsed_s"]) == 40.4
    assert [(r["kind"], r["downtime_source"]) for r in tables["incidents"]] == [
        ("drain", "runtime"), ("recovery", "runtime"), ("restart", "events"),
    ]  # fmt: skip
    assert [r["goodput"] for r in tables["progress"]] == ["0.9", "", ""]
    assert len(tables["nodes"]) == len(tl.segments) and len(tables["generations"]) == 4


def test_the_page_holds_the_timeline_the_plot_and_plotly_itself(tl: timeline.Timeline) -> None:
    page = render.render_html(tl)
    assert 'id="rlaunch-timeline"' in page and 'id="rlaunch-steps"' in page and 'id="rlaunch-summary"' in page
    assert "drain g2: 25 ms" in page and "recovery g3: 1.90 s" in page and "restart g4: 5.00 s" in page
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js is inlined
    assert '<script src="http' not in page and "cdn.plot.ly/plotly" not in page.split("</script>", 1)[1]


def test_a_page_without_step_times_says_so() -> None:
    tl = timeline.build("j", [e for e in job_events() if e.kind not in ("progress", "switched")])
    page = render.render_html(tl)
    assert 'id="rlaunch-steps"' in page and "No step times in these events" in page


def test_a_straggler_move_and_a_drain_without_the_runtime_are_told_apart() -> None:
    events = [
        ev(0.0, "a", "generation", 1, plan="restart", status="running", reason="2 node(s) joined",
           assignment={"a": 0, "b": 1}, restart_count=0),
        ev(9.0, "a", "straggler", 1, node="b", compute_s={"a": 0.1, "b": 0.3}),
        ev(10.0, "a", "generation", 2, plan="migrate", status="running", reason="straggler b: c takes node rank 1 live",
           assignment={"a": 0, "c": 1}, restart_count=0),
        ev(10.0, "c", "migration_offered", 2, role="joiner", leavers=["b"], joiners=["c"]),
        ev(10.5, "a", "switched", 2, rank=0, downtime_ms=30.0, step_ms=130.0, median_ms=100.0),
        ev(20.0, "cli", "drain_requested", 0, node="c"),
        ev(20.5, "a", "generation", 3, plan="restart", status="running",
           reason="draining c: b takes node rank 1 by restarting every worker (the script does not use rlaunch.init())",
           assignment={"a": 0, "b": 1}, restart_count=0),
        ev(23.0, "a", "node_state", 3, state="running", previous="restarting"),
        ev(24.0, "b", "node_state", 3, state="running", previous="standby"),
    ]  # fmt: skip
    tl = timeline.build("j", events)
    move, drain = tl.incidents
    assert (move.kind, move.detail, move.downtime_s, move.measured) == ("migration", "straggler b → c", 0.03, True)
    assert (drain.kind, drain.start, drain.end, drain.measured) == ("drain", T0 + 20.0, T0 + 24.0, False)
    assert drain.downtime_s == pytest.approx(4.0) and drain.detail.startswith("draining c: b takes node rank 1")
    s = tl.summary()
    assert (s["drains"], s["migrations"], s["restarts"]) == (1, 1, 0)
    assert [f.node for f in tl.findings] == ["b"]


def test_a_job_that_never_started_still_has_a_page() -> None:
    tl = timeline.build("j", [ev(0.0, "a", "node_joined")])
    assert (tl.outcome, tl.generations, tl.incidents, tl.summary()["goodput"]) == ("unknown", (), (), None)
    assert [(s.node, s.state) for s in tl.segments] == [("a", "waiting")]
    assert 'id="rlaunch-timeline"' in render.render_html(tl)


def test_lines_break_where_the_reports_stopped(tl: timeline.Timeline) -> None:
    xs, ys = render.gapped([0.0, 1.0, 2.0, 3.0, 10.0, 11.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], usual=1.0)
    assert xs == [0.0, 1.0, 2.0, 3.0, None, 10.0, 11.0] and ys == [1.0, 2.0, 3.0, 4.0, None, 5.0, 6.0]
    assert render.gapped([0.0, 9.0], [1.0, 2.0], usual=0.0) == ([0.0, 9.0], [1.0, 2.0])
    assert render.usual_interval(tl) == 0.0  # one report per node: no interval known


def test_durations_read_as_people_write_them() -> None:
    assert [render.duration(s) for s in (None, 0.0241, 9.582, 200.0, 7500.0)] == [
        "n/a", "24 ms", "9.58 s", "3 min 20 s", "2 h 05 min",
    ]  # fmt: skip


def test_jsonl_errors_name_the_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"time": T0, "node_id": "a", "kind": "node_joined", "generation": 0, "data": {}})
    path = tmp_path / "job-x" / "events.jsonl"
    path.parent.mkdir()
    path.write_text(good + "\n\n" + "{not json\n")
    with pytest.raises(ReportError, match=r"Line 3 of .*events.jsonl' is not JSON"):
        source.read_files([path])
    path.write_text(good + "\n" + json.dumps({"time": 1.0, "kind": "x"}) + "\n")
    with pytest.raises(ReportError, match=r"Line 2 .* needs time, node_id, kind and generation"):
        source.read_files([path])
    path.write_text("")
    with pytest.raises(ReportError, match="hold no events"):
        source.read_files([path])
    with pytest.raises(ReportError, match="does not exist"):
        source.read_files([tmp_path / "nope.jsonl"])
    path.write_text(good + "\n")
    assert source.job_of([path]) == "job-x" and source.job_of([path.parent]) == "job-x"


def test_files_of_several_machines_merge_in_time_order_without_duplicates() -> None:
    one = [ev(2.0, "a", "x"), ev(1.0, "a", "y")]
    two = [ev(1.0, "a", "y"), ev(1.5, "b", "z")]
    assert [e.kind for e in source.merge([one, two])] == ["y", "z", "x"]


def test_progress_data_is_none_until_a_step_is_done() -> None:
    sample = {"steps": 10.0, "step_s": 0.25, "goodput": 0.8, "applied": 9.0, "ranks": 2.0}
    assert progress_data(10.0, sample) is None
    assert progress_data(4.0, sample) == {"steps": 6, "applied": 9, "step_s": 0.25, "goodput": 0.8, "ranks": 2}
    assert progress_data(4.0, {**sample, "goodput": math.nan})["goodput"] is None  # type: ignore[index]


def test_progress_reads_the_agents_metrics() -> None:
    now = [100.0]
    metrics = AgentMetrics("n1", 2, clock=lambda: now[0])
    assert read_sample(metrics.registry, "n1")["steps"] == 0.0
    metrics.heartbeat(0, 5, 4, 0.2, 0.1)
    metrics.heartbeat(1, 5, 4, 0.4, 0.1)
    now[0] = 102.0
    metrics.heartbeat(0, 15, 14, 0.2, 0.1)
    sample = read_sample(metrics.registry, "n1")
    assert (sample["steps"], sample["applied"], sample["ranks"]) == (20.0, 14.0, 2.0)
    assert sample["step_s"] == pytest.approx(0.3)  # the median of the two ranks
    assert sample["goodput"] == pytest.approx(1.0)  # rank 0: 10 steps of 0.2 s in 2 s


def test_progress_cadence_comes_from_the_environment() -> None:
    assert progress_every_s({}) == PROGRESS_EVERY_S
    assert progress_every_s({"RLAUNCH_PROGRESS_S": "2.5"}) == 2.5
    for bad in ("0.1", "soon", "nan"):
        with pytest.raises(UsageError, match="RLAUNCH_PROGRESS_S"):
            progress_every_s({"RLAUNCH_PROGRESS_S": bad})


def test_the_command_writes_the_page_and_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "logs" / "job:1" / "events.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(e.__dict__) + "\n" for e in job_events()))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["report", "--events", str(path), "--csv", "tables"])
    assert res.exit_code == 0, res.output
    assert default_name("job:1") == "rlaunch-report-job_1.html"
    assert (tmp_path / "rlaunch-report-job_1.html").stat().st_size > 1_000_000
    assert "1 drain(s), 1 recovery(ies), 1 restart(s)" in res.output
    assert (tmp_path / "tables" / "rlaunch-report-job_1-incidents.csv").is_file()


def test_the_command_refuses_bad_input_with_a_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    runner = CliRunner()
    res = runner.invoke(app, ["report", "--events", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["report"])
    assert res.exit_code == 2 and "Say where the events are" in res.output


def test_progress_samples_wait_in_memory_until_another_event_or_a_full_batch() -> None:
    now = [100.0]
    metrics = AgentMetrics("n1", 1, clock=lambda: now[0])
    emitted: list[tuple[str, int, dict[str, Any]]] = []
    reporter = ProgressReporter(
        metrics.registry, "n1", lambda kind, gen, **data: emitted.append((kind, gen, data)), 30.0, 3, lambda: now[0]
    )
    steps = reporter.sample(0.0, 1)  # no step yet: nothing kept
    assert reporter.held == 0
    for total in (10, 20):
        now[0] += 30.0
        metrics.heartbeat(0, total, total - 1, 0.2, 0.1)
        steps = reporter.sample(steps, 1)
    assert reporter.held == 2 and emitted == []  # steady state: nothing written
    reporter.observe(Event(time=now[0], node_id="n1", kind="progress", generation=1))  # its own kind: no flush
    assert emitted == []
    reporter.observe(Event(time=now[0], node_id="n1", kind="node_state", generation=2))
    assert [(k, g, d["flushed"], [s["time"] for s in d["samples"]]) for k, g, d in emitted] == [
        ("progress", 1, "node_state", [130.0, 160.0])
    ]
    # goodput: 10 steps of 0.2 s in 30 s
    assert emitted[0][2]["samples"][1] == {
        "time": 160.0, "generation": 1, "steps": 10, "applied": 19, "step_s": 0.2, "goodput": 0.0667, "ranks": 1
    }  # fmt: skip
    reporter.observe(Event(time=now[0], node_id="n1", kind="node_state", generation=2))  # nothing held
    assert len(emitted) == 1 and reporter.held == 0
    for total in (30, 40, 50):
        now[0] += 30.0
        metrics.heartbeat(0, total, total - 1, 0.2, 0.1)
        steps = reporter.sample(steps, 2)
    assert len(emitted) == 2 and emitted[1][2]["flushed"] == "full" and len(emitted[1][2]["samples"]) == 3


def test_a_batch_becomes_one_point_per_sample_in_time_order() -> None:
    batch = ev(50.0, "a", "progress", 2, flushed="exit", samples=[
        {"time": T0 + 10.0, "generation": 1, "steps": 5, "applied": 4, "step_s": 0.3, "goodput": 0.5, "ranks": 1},
        {"time": T0 + 40.0, "generation": 2, "steps": 5, "applied": 9, "step_s": 0.4, "goodput": None, "ranks": 1},
    ])  # fmt: skip
    tl = timeline.build("j", [ev(0.0, "a", "node_joined"), ev(20.0, "a", "switched", 1, step_ms=250.0), batch])
    assert [(p.time - T0, p.generation, p.source, p.step_s) for p in tl.points] == [
        (10.0, 1, "progress", 0.3), (20.0, 1, "switched", 0.25), (40.0, 2, "progress", 0.4),
    ]  # fmt: skip


def test_progress_batch_comes_from_the_environment() -> None:
    assert progress_batch({}) == PROGRESS_BATCH
    assert progress_batch({"RLAUNCH_PROGRESS_BATCH": "4"}) == 4
    for bad in ("0", "-1", "many", "2.5"):
        with pytest.raises(UsageError, match="RLAUNCH_PROGRESS_BATCH"):
            progress_batch({"RLAUNCH_PROGRESS_BATCH": bad})


def test_silent_data_corruption_is_a_finding_and_names_the_recovery_it_caused() -> None:
    sentence = "rank 1's parameters differ from those of its replicas at step 40"
    events = [
        ev(0.0, "a", "generation", 1, plan="restart", status="running", reason="2 node(s) joined",
           assignment={"a": 0, "b": 1}, restart_count=0),
        ev(5.0, "b", "live_moves", 1, moves="drain and replacement", reason="", previous="unknown"),
        ev(10.0, "b", "sdc_suspected", 1, local_rank=0, rank=1, step=40, sentence=sentence,
           evidence={"object": "model", "replicas": [0]}),
        ev(10.1, "b", "workers_failed", 1, exit_codes={"0": 3}),
        ev(10.2, "a", "generation", 2, plan="replace", status="running", reason=f"b (fault: {sentence}) replaced by c",
           assignment={"a": 0, "c": 1}, restart_count=0),
        ev(10.2, "c", "replacement_offered", 2, role="joiner", leavers=["b"]),
        ev(10.2, "a", "replacement_offered", 2, role="survivor", leavers=["b"], joiners=["c"]),
        ev(11.0, "a", "recovered", 2, seconds=0.8, rank=0, step=40),
        ev(11.1, "c", "joined", 2, local_rank=0, seconds=0.9),
    ]  # fmt: skip
    tl = timeline.build("j", events)
    assert [(f.node, f.label) for f in tl.findings][0] == ("b", "silent data corruption suspected")
    (recovery,) = tl.incidents
    assert recovery.start == T0 + 10.0, "the outage starts at the suspicion"
    assert recovery.detail == "silent data corruption suspected on b; c took the ranks of b live"
    header, rows = export.rows(tl)["events"]
    assert any(r[4] == "sdc_suspected" and sentence in r[-1] for r in rows), "the events table lists it"


def test_a_rollback_to_a_host_snapshot_and_the_fault_path_are_in_the_report() -> None:
    how = "a fault rolls back to the last committed host snapshot (one every 20 steps: about 20 steps redone at most)"
    events = [
        ev(0.0, "a", "generation", 1, plan="restart", status="running", reason="2 node(s) joined",
           assignment={"a": 0, "b": 1}, restart_count=0),
        ev(5.0, "a", "live_moves", 1, moves="drain and replacement", reason=how, previous="unknown"),
        ev(5.1, "b", "live_moves", 1, moves="drain and replacement", reason=how, previous="unknown"),
        ev(10.0, "a", "recovering", 1, local_rank=0, step=30),
        ev(10.5, "a", "generation", 2, plan="replace", status="running", reason="b (lost) replaced by c",
           assignment={"a": 0, "c": 1}, restart_count=0),
        ev(10.5, "a", "replacement_offered", 2, role="survivor", leavers=["b"], joiners=["c"]),
        ev(11.0, "a", "recovered", 2, seconds=0.6, rank=0, step=30, resume_at=20, rolled_back_to=20, steps_redone=10),
        ev(11.1, "c", "joined", 2, local_rank=0, seconds=0.7),
        ev(12.0, "c", "live_moves", 2, moves="drain and replacement", reason=how, previous="unknown"),
    ]  # fmt: skip
    tl = timeline.build("j", events)
    (recovery,) = tl.incidents
    assert recovery.detail.endswith(
        "c took the ranks of b live, rolled back to the host snapshot of step 20 (10 steps redone)"
    )
    assert tl.live_moves == f"drain and replacement: {how}", "the nodes of the last generation: a and c"
    assert f"Live moves: drain and replacement: {how}" in render.render_html(tl)
