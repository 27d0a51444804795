"""A timeline as CSV files a BI tool can load: one table per kind of record, one row per record.

Times are given twice: ``time_utc`` (ISO 8601, UTC) and ``elapsed_s`` (seconds since the job's first
event). Free-form event data stays as one JSON column (``data``), with the commonly used figures
also in columns of their own.
"""

from __future__ import annotations

import csv
import datetime
import json
from pathlib import Path
from typing import Any

from rlaunch.report.timeline import Timeline

#: The files :func:`write_csv` writes, by table.
TABLES = ("events", "progress", "incidents", "nodes", "generations")


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


def rows(tl: Timeline) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """Each table's header and rows (pure: what :func:`write_csv` writes)."""
    t0 = tl.start

    def when(t: float) -> list[Any]:
        return [iso(t), round(t, 6), round(t - t0, 3)]

    stamp = ["time_utc", "time_unix", "elapsed_s"]
    events = [
        [*when(e.time), e.node_id, e.kind, e.generation, _downtime(e.kind, e.data),
         json.dumps(e.data, sort_keys=True, default=str)]
        for e in tl.events
    ]  # fmt: skip
    progress = [
        [*when(p.time), p.node, p.generation, p.source, p.steps, p.applied, p.step_s,
         "" if p.goodput is None else p.goodput]
        for p in tl.points
    ]  # fmt: skip
    incidents = [
        [i.kind, i.generation, iso(i.start), round(i.start - t0, 3), iso(i.end), round(i.end - t0, 3),
         "" if i.downtime_s is None else round(i.downtime_s, 6), "runtime" if i.measured else "events",
         " ".join(i.nodes), i.detail]
        for i in tl.incidents
    ]  # fmt: skip
    nodes = [
        [s.node, s.state, s.role, s.generation, iso(s.start), round(s.start - t0, 3), iso(s.end),
         round(s.end - t0, 3), round(s.end - s.start, 3)]
        for s in tl.segments
    ]  # fmt: skip
    gens = [
        [*when(g.time), g.number, g.plan, g.status, g.restart_count, json.dumps(g.assignment, sort_keys=True), g.reason]
        for g in tl.generations
    ]
    return {
        "events": ([*stamp, "node", "kind", "generation", "downtime_s", "data"], events),
        "progress": ([*stamp, "node", "generation", "source", "steps", "applied_step", "step_s", "goodput"], progress),
        "incidents": (
            [
                "kind",
                "generation",
                "start_utc",
                "start_elapsed_s",
                "end_utc",
                "end_elapsed_s",
                "downtime_s",
                "downtime_source",
                "nodes",
                "detail",
            ],
            incidents,
        ),  # fmt: skip
        "nodes": (
            [
                "node",
                "state",
                "role",
                "generation",
                "start_utc",
                "start_elapsed_s",
                "end_utc",
                "end_elapsed_s",
                "duration_s",
            ],
            nodes,
        ),  # fmt: skip
        "generations": ([*stamp, "generation", "plan", "status", "restart_count", "assignment", "reason"], gens),
    }


def _downtime(kind: str, data: dict[str, Any]) -> Any:
    """The downtime an event reports, in seconds ("" if none)."""
    if kind == "switched" and "downtime_ms" in data:
        return round(float(data["downtime_ms"]) / 1000, 6)
    if kind == "recovered" and "seconds" in data:
        return data["seconds"]
    return ""


def write_csv(tl: Timeline, folder: Path, prefix: str) -> list[Path]:
    """Write ``<prefix>-<table>.csv`` for every table into ``folder``; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (header, table) in rows(tl).items():
        path = folder / f"{prefix}-{name}.csv"
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(table)
        written.append(path)
    return written
