"""``rlaunch events``: the job's structured event stream, as lines or JSON, optionally followed."""

from __future__ import annotations

import asyncio
import datetime
import json

import typer

from rlaunch.cli.options import CACERT, CERT, ENDPOINT, JOB_ID, KEY, USER, connection, fail
from rlaunch.errors import RecordError, RlaunchError, UsageError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, decode
from rlaunch.store.security import EtcdSecurity


def human(value: object) -> str:
    """A data value as people read it: floats to at most 3 decimals, containers element-wise."""
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.001:
            return f"{value:.2g}"
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {human(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(human(v) for v in value) + "]"
    return str(value)


def format_event(ev: Event) -> str:
    """One line for people (``--json`` prints the exact record instead)."""
    when = datetime.datetime.fromtimestamp(ev.time).strftime("%H:%M:%S.%f")[:-3]
    data = " ".join(f"{k}={human(v)}" for k, v in ev.data.items())
    return f"{when} gen {ev.generation:<3} {ev.node_id:<12} {ev.kind:<20} {data}"


async def _events(
    endpoint: str, job_id: str, follow: bool, as_json: bool, security: EtcdSecurity | None = None
) -> None:
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)

    def show(raw: bytes, key: str) -> None:
        try:
            ev = decode(Event, raw, key)
        except RecordError as exc:
            print(f"warning: {exc}", flush=True)
            return
        print(json.dumps(ev.__dict__) if as_json else format_event(ev), flush=True)

    try:
        await store.connect(10.0)
        kvs, revision = await store.get_prefix(keys.events_prefix)
        if not kvs and await store.get(keys.spec) is None:
            raise UsageError(f"No job {job_id!r} exists in etcd at {endpoint}; check --rdzv-id.")
        for kv in kvs:
            show(kv.value, kv.key)
        if follow:
            async for ev in store.watch_prefix(keys.events_prefix, start_revision=revision + 1):
                if not ev.deleted:
                    show(ev.value, ev.key)
    finally:
        await store.close()


def events(
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = JOB_ID,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until interrupted."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Show a job's events: joins, generations, restarts, migrations (with their downtime)."""
    try:
        _, security = connection(rdzv_endpoint, cacert, cert, key, user)
        asyncio.run(_events(rdzv_endpoint, rdzv_id, follow, as_json, security))
    except RlaunchError as exc:
        fail(exc)
    except KeyboardInterrupt:
        return
