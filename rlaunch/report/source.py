"""Where a report's events come from: the job's ``events/`` keys in etcd, or ``events.jsonl`` files.

An ``events.jsonl`` (written under ``--log-dir``) holds the events of the agents that ran on
that machine; several files (one per machine) merge into one stream, in time order, with the
duplicates that a shared log directory may hold dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlaunch.errors import RecordError
from rlaunch.report import ReportError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, decode
from rlaunch.store.security import EtcdSecurity


def parse_event(obj: Any, where: str) -> Event:
    """An :class:`Event` from one decoded JSON object; ``where`` names it in the error."""
    if not isinstance(obj, dict):
        raise ReportError(f"{where} is not an event: expected a JSON object, got {type(obj).__name__}.")
    try:
        time, node, kind, gen = float(obj["time"]), str(obj["node_id"]), str(obj["kind"]), int(obj["generation"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(
            f"{where} is not an event: it needs time, node_id, kind and generation ({exc!r} is missing or wrong)."
        ) from exc
    data = obj.get("data") or {}
    if not isinstance(data, dict):
        raise ReportError(f"{where} is not an event: its data is {type(data).__name__}, not an object.")
    return Event(time=time, node_id=node, kind=kind, generation=gen, data=data)


def parse_jsonl(lines: Iterable[str], name: str) -> list[Event]:
    """The events of an ``events.jsonl`` text; a malformed line is an error naming the file and line."""
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"Line {number} of {name}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(
                f"{where} is not JSON ({exc.msg}); give an events.jsonl written by rlaunch --log-dir."
            ) from exc
        events.append(parse_event(obj, where))
    return events


def merge(streams: Iterable[list[Event]]) -> list[Event]:
    """One stream in time order, without exact duplicates."""
    seen: set[tuple[float, str, str, int, str]] = set()
    out = []
    for ev in (e for stream in streams for e in stream):
        key = (ev.time, ev.node_id, ev.kind, ev.generation, json.dumps(ev.data, sort_keys=True, default=str))
        if key not in seen:
            seen.add(key)
            out.append(ev)
    return sorted(out, key=lambda e: e.time)


def read_files(paths: list[Path]) -> list[Event]:
    """The merged events of ``paths``; a missing or empty file is an error that names it."""
    streams = []
    for path in paths:
        if path.is_dir() and (path / "events.jsonl").is_file():
            path = path / "events.jsonl"
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise ReportError(
                f"The events file {str(path)!r} does not exist; give the events.jsonl under --log-dir/<job>/."
            ) from None
        except OSError as exc:
            raise ReportError(f"The events file {str(path)!r} cannot be read ({exc.strerror or exc}).") from exc
        streams.append(parse_jsonl(text.splitlines(), repr(str(path))))
    events = merge(streams)
    if not events:
        names = ", ".join(repr(str(p)) for p in paths)
        raise ReportError(f"The events file(s) {names} hold no events; there is nothing to report.")
    return events


def job_of(paths: list[Path]) -> str:
    """The job id an ``events.jsonl`` path names: its folder (``<log_dir>/<job>/events.jsonl``)."""
    path = paths[0]
    folder = path if path.is_dir() else path.resolve().parent
    return folder.name or "job"


async def read_etcd(
    endpoint: str, job_id: str, connect_s: float = 10.0, security: EtcdSecurity | None = None
) -> tuple[list[Event], int]:
    """The job's events in etcd, in time order, and how many records were unreadable and skipped."""
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    try:
        await store.connect(connect_s)
        kvs, _ = await store.get_prefix(keys.events_prefix)
        spec = await store.get(keys.spec) if not kvs else None
    finally:
        await store.close()
    if not kvs:
        known = "it exists, but" if spec is not None else "no such job exists there, or"
        raise ReportError(
            f"Job {job_id!r} has no events in etcd at {endpoint} ({known} its events expired: they are kept "
            "for a day); check --rdzv-id, or give --events with the events.jsonl from --log-dir."
        )
    events, bad = [], 0
    for kv in kvs:
        try:
            events.append(decode(Event, kv.value, kv.key))
        except RecordError:
            bad += 1
    return sorted(events, key=lambda e: e.time), bad
