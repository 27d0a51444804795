"""What people read: the status table at 80 columns, and event values rounded for them."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from rlaunch.cli.events import format_event, human
from rlaunch.cli.status import render_table
from rlaunch.store.records import Event, NodeState


def status_with(states: list[str], host: str = "ip-10-0-12-34.ec2.internal") -> dict[str, Any]:
    nodes = [
        {
            "node_id": f"node-{i}", "host": host, "role": "active" if i < 2 else "standby", "state": state,
            "node_rank": i if i < 2 else None, "ranks": [8 * i + r for r in range(8)] if i < 2 else [],
            "restarts": 0, "last_seen_s": 1, "runtime": True, "fault": "", "failure": "signal" if i == 3 else "",
            "message": "worker(s) failed with exit codes {'0': -9} (by local rank)" if i == 3 else "",
        }
        for i, state in enumerate(states)
    ]  # fmt: skip
    return {
        "job": "demo", "generation": 3, "status": "running", "restart_count": 0, "controller": "node-0",
        "reason": "drain of node-1: node-2 takes node rank 1 live", "nodes": nodes, "problems": [],
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
