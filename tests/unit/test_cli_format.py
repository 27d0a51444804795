"""What people read: the status table at 80 columns, and event values rounded for them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rich.console import Console

from rlaunch.cli.events import format_event, human
from rlaunch.cli.status import build_status, job_moves, moves_line, render_table
from rlaunch.controller.planner import NodeView
from rlaunch.controller.view import JobSnapshot
from rlaunch.store.records import Event, LiveMoves, NodeRecord, NodeState, SuspectMark
from tests.unit.test_planner import gen, rec

BOTH, DRAIN, NONE, UNKNOWN = LiveMoves.BOTH, LiveMoves.DRAIN_ONLY, LiveMoves.NONE, LiveMoves.UNKNOWN
NO_REPLICA = "rank 3's optimizer state is sharded and no other rank holds its shard"


def status_with(states: list[str], host: str = "ip-10-0-12-34.ec2.internal") -> dict[str, Any]:
    nodes = [
        {
            "node_id": f"node-{i}", "host": host, "role": "active" if i < 2 else "standby", "state": state,
            "node_rank": i if i < 2 else None, "ranks": [8 * i + r for r in range(8)] if i < 2 else [],
            "restarts": 0, "last_seen_s": 1, "runtime": True, "fault": "", "failure": "signal" if i == 3 else "",
            "message": "worker(s) failed with exit codes {'0': -9} (by local rank)" if i == 3 else "",
            "live_moves": "drain and replacement" if i < 2 else "unknown", "moves_reason": "",
        }
        for i, state in enumerate(states)
    ]  # fmt: skip
    return {
        "job": "demo", "generation": 3, "status": "running", "restart_count": 0, "controller": "node-0",
        "reason": "drain of node-1: node-2 takes node rank 1 live", "nodes": nodes, "problems": [],
        "live_moves": "drain and replacement", "moves_reason": "",
    }  # fmt: skip


def rendered(status: dict[str, Any], width: int = 80) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_table(status))
    return console.export_text()


def test_status_at_80_columns_shows_every_state_and_role_whole() -> None:
    states = [s.value for s in NodeState]
    for i in range(0, len(states), 4):
        chunk = (states[i : i + 4] + states)[:4]
        text = rendered(status_with(chunk))
        assert "…" not in text, text
        assert all(len(line) <= 80 for line in text.splitlines())
        for state in chunk:
            assert f" {state} " in text, (state, text)
        for word in ("active", "standby", "node-0", "ip-10-0-12-34", "0-7"):
            assert word in text, (word, text)


def test_status_sentences_go_below_the_table() -> None:
    text = rendered(status_with(["running", "running", "standby", "failed"]))
    lines = text.splitlines()
    assert "node-3: worker(s) failed with exit codes {'0': -9} (by local rank)" in text
    assert "drain of node-1: node-2 takes node rank 1 live" in text
    header = next(i for i, line in enumerate(lines) if "state" in line)
    assert all("exit codes" not in line for line in lines[: header + 5])


def test_event_values_are_rounded_for_people_and_exact_in_json() -> None:
    data = {"seconds": 0.23217440400003397, "bytes": 1048576, "parts": [1.23456, 2.0], "tiny": 0.0004}
    ev = Event(time=1764500000.25, node_id="node-b", kind="state_sent", generation=2, data=data)
    line = format_event(ev)
    assert "seconds=0.232 " in line and "bytes=1048576" in line and "parts=[1.235, 2]" in line
    assert "tiny=0.0004" in line and "0.2321744" not in line
    assert json.loads(json.dumps(ev.__dict__))["data"]["seconds"] == 0.23217440400003397
    assert [human(v) for v in (12.0, 100.0, 0.0, -1.5, True, None, "x")] == [
        "12",
        "100",
        "0",
        "-1.5",
        "True",
        "None",
        "x",
    ]


# -- live moves and suspects in rlaunch status -----------------------------------------------------


def snapshot(*records: NodeRecord, assignment: dict[str, int], suspects: dict[str, SuspectMark] | None = None) -> Any:
    nodes = {r.node_id: NodeView(r, join_revision=i) for i, r in enumerate(records)}
    return JobSnapshot(None, gen(2, assignment), 1, "a", 7, nodes, {}, [], suspects=suspects or {})


def moving(node: str, moves: LiveMoves, reason: str = "") -> NodeRecord:
    return dataclasses.replace(rec(node, NodeState.RUNNING, generation=2), live_moves=moves, moves_reason=reason)


def test_status_json_has_each_nodes_moves_and_the_jobs_over_the_nodes_holding_ranks() -> None:
    snap = snapshot(moving("a", BOTH), moving("b", DRAIN, NO_REPLICA), moving("c", NONE, "standby"),
                    assignment={"a": 0, "b": 1})  # fmt: skip
    status = build_status(snap, "job", {})
    assert status["live_moves"] == "drain only" and status["moves_reason"] == NO_REPLICA
    by_node = {n["node_id"]: (n["live_moves"], n["moves_reason"]) for n in status["nodes"]}
    assert by_node == {"a": ("drain and replacement", ""), "b": ("drain only", NO_REPLICA), "c": ("none", "standby")}
    assert moves_line(status) == f"Live moves: drain only: {NO_REPLICA}"
    assert job_moves(snapshot(moving("a", BOTH), moving("b", UNKNOWN), assignment={"a": 0, "b": 1})) == (UNKNOWN, "")
    both = build_status(snapshot(moving("a", BOTH), moving("b", BOTH), assignment={"a": 0, "b": 1}), "job", {})
    assert moves_line(both) == "Live moves: drain and replacement"


def test_status_table_shows_the_jobs_line_a_word_per_node_and_why_below_at_80_columns() -> None:
    snap = snapshot(moving("a", BOTH), moving("b", DRAIN, NO_REPLICA), moving("c", UNKNOWN),
                    assignment={"a": 0, "b": 1})  # fmt: skip
    text = rendered(build_status(snap, "job", {}))
    lines, flowing = text.splitlines(), " ".join(text.split())  # (sentences wrap at the terminal's width)
    assert lines[1].startswith("Live moves: drain only: rank 3's"), "the line right below the heading"
    assert f"Live moves: drain only: {NO_REPLICA}" in flowing
    assert all(len(line) <= 80 for line in lines), text
    rows = {line.split()[0]: line.split()[-1] for line in lines if line.startswith(("a ", "b ", "c "))}
    assert rows == {"a": "both", "b": "drain", "c": "-"}, text
    assert f"b: live moves drain only: {NO_REPLICA}" in flowing
    unknown = rendered(build_status(snapshot(moving("a", UNKNOWN), assignment={"a": 0}), "job", {}))
    assert "Live moves: not known yet" in unknown


def test_status_lists_a_suspect_whose_agent_has_gone_with_its_fault() -> None:
    mark = SuspectMark(node_id="b", generation=2, rank=1, step=40, fault="rank 1's parameters differ", at=5.0)
    status = build_status(snapshot(moving("a", BOTH), assignment={"a": 0}, suspects={"b": mark}), "job", {})
    b = next(n for n in status["nodes"] if n["node_id"] == "b")
    assert (b["role"], b["state"], b["fault"], b["ranks"]) == ("none", "failed", "rank 1's parameters differ", [])
    assert "b: rank 1's parameters differ" in rendered(status)
