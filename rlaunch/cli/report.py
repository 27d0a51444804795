"""``rlaunch report``: a job's timeline and step-time plot as one HTML file, and its records as CSV."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import typer

from rlaunch.cli.options import CACERT, CERT, JOB_ID, KEY, USER, connection, fail
from rlaunch.errors import RlaunchError, UsageError
from rlaunch.report import ReportError, export, render, source, timeline
from rlaunch.store.security import EtcdSecurity


def default_name(job: str) -> str:
    """``rlaunch-report-<job>.html``, with characters a file name should not hold replaced."""
    return f"rlaunch-report-{re.sub(r'[^A-Za-z0-9._-]+', '_', job) or 'job'}.html"


def make_report(
    endpoint: str | None,
    job_id: str,
    files: list[Path],
    output: Path | None,
    csv_dir: Path | None,
    timeout: float,
    security: EtcdSecurity | None = None,
) -> tuple[Path, list[Path], timeline.Timeline]:
    """Read the events, build the timeline, write the page (and the CSV files); return what was written."""
    note = ""
    if files:
        job = job_id if job_id != "none" else source.job_of(files)
        events = source.read_files(files)
        note = f" · from {len(files)} events file(s)"
    elif endpoint:
        events, bad = asyncio.run(source.read_etcd(endpoint, job_id, timeout, security))
        job = job_id
        note = f" · from etcd at {endpoint}" + (f"; {bad} unreadable record(s) skipped" if bad else "")
    else:
        raise UsageError("Say where the events are: --rdzv-endpoint HOST:PORT --rdzv-id JOB, or --events FILE.")
    tl = timeline.build(job, events)
    path = output if output is not None else Path.cwd() / default_name(job)
    if path.is_dir():
        path = path / default_name(job)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render.render_html(tl, note), encoding="utf-8")
        tables = export.write_csv(tl, csv_dir, path.stem) if csv_dir is not None else []
    except OSError as exc:
        raise ReportError(
            f"The report could not be written to {str(exc.filename or path)!r} ({exc.strerror or exc})."
        ) from exc
    return path, tables, tl


def report(
    rdzv_endpoint: str = typer.Option(
        None, "--rdzv-endpoint", "--rdzv_endpoint", envvar=["PET_RDZV_ENDPOINT", "ETCDCTL_ENDPOINTS"],
        help="etcd client endpoint(s), [https://]host:port[,...], holding the job's events (or ETCDCTL_ENDPOINTS).",
    ),
    rdzv_id: str = JOB_ID,
    events: list[Path] = typer.Option(
        [], "--events", help="An events.jsonl from --log-dir (<log dir>/<job>/events.jsonl) instead of etcd; "
        "repeat it to merge the files of several machines.",
    ),
    output: Path = typer.Option(
        None, "--output", "-o", help="The HTML file to write (default: ./rlaunch-report-<job>.html)."
    ),
    csv_dir: Path = typer.Option(
        None, "--csv", help="Also write the events, progress records, incidents, node states and generations as CSV "
        "files into this folder.",
    ),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for etcd."),
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:  # fmt: skip
    """Write a job's report: one self-contained HTML page with its timeline, drains, faults and recoveries
    (with their downtime), and its step time and goodput over time."""
    try:
        security = connection(rdzv_endpoint, cacert, cert, key, user)[1] if rdzv_endpoint and not events else None
        path, tables, tl = make_report(rdzv_endpoint, rdzv_id, events, output, csv_dir, timeout, security)
    except RlaunchError as exc:
        fail(exc)
    s = tl.summary()
    print(
        f"report of job {tl.job} written to {path} ({s['generations']} generation(s), {s['drains']} drain(s), "
        f"{s['recoveries']} recovery(ies), {s['restarts']} restart(s))"
    )
    for table in tables:
        print(f"CSV written to {table}")
