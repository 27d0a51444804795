"""``rlaunch status``: the job as etcd sees it, as a table or one JSON object."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rlaunch.agent.moves import combine, sentence
from rlaunch.cli.options import CACERT, CERT, ENDPOINT, JOB_ID, KEY, TIMEOUT, USER, connection, fail
from rlaunch.controller.view import JobSnapshot, read_snapshot
from rlaunch.errors import RlaunchError, StoreError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import LiveMoves
from rlaunch.store.security import EtcdSecurity


def build_status(snap: JobSnapshot, job_id: str, ttls: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The status object from a snapshot and each node's ``(granted, remaining)`` lease TTL."""
    gen = snap.generation
    order = sorted(snap.nodes.values(), key=lambda v: v.join_revision)
    nodes = []
    for view in order:
        rec = view.record
        node_rank = gen.node_rank(rec.node_id) if gen else None
        granted, remaining = ttls.get(rec.node_id, (0, 0))
        nodes.append({
            "node_id": rec.node_id,
            "host": rec.host,
            "addr": rec.addr,
            "role": "active" if node_rank is not None else "standby",
            "state": rec.state.value,
            "node_rank": node_rank,
            "ranks": gen.ranks_of(rec.node_id) if gen else [],
            "restarts": rec.restarts,
            "last_seen_s": max(0, granted - remaining) if remaining >= 0 else None,
            "runtime": rec.runtime,
            "fault": rec.fault,
            "failure": rec.failure,
            "message": rec.message,
            "live_moves": rec.live_moves.value,
            "moves_reason": rec.moves_reason,
        })  # fmt: skip
    for mark in sorted(snap.drained.values(), key=lambda m: m.at):
        if mark.node_id not in snap.nodes:
            nodes.append({
                "node_id": mark.node_id, "host": "", "addr": "", "role": "none", "state": "drained", "node_rank": None,
                "ranks": [], "restarts": 0, "last_seen_s": None, "runtime": False, "fault": "",
                "failure": "", "message": "", "live_moves": "unknown", "moves_reason": "",
                "replaced_by": mark.replaced_by,
            })  # fmt: skip
    for suspect in sorted(snap.suspects.values(), key=lambda m: m.at):
        if suspect.node_id not in snap.nodes and suspect.node_id not in snap.drained:
            nodes.append({
                "node_id": suspect.node_id, "host": "", "addr": "", "role": "none", "state": "failed",
                "node_rank": None, "ranks": [], "restarts": 0, "last_seen_s": None, "runtime": False,
                "fault": suspect.fault, "failure": "fault", "message": "", "live_moves": "unknown", "moves_reason": "",
            })  # fmt: skip
    moves, moves_reason = job_moves(snap)
    return {
        "job": job_id,
        "generation": gen.number if gen else 0,
        "status": gen.status.value if gen else "rendezvous",
        "restart_count": gen.restart_count if gen else 0,
        "reason": gen.reason if gen else "",
        "controller": snap.leader,
        "live_moves": moves.value,
        "moves_reason": moves_reason,
        "nodes": nodes,
        "problems": snap.problems,
    }


def job_moves(snap: JobSnapshot) -> tuple[LiveMoves, str]:
    """The job's live moves: as far as every node holding ranks allows (the reason of the first, in
    node rank order, that allows less); ``unknown`` until each of them reported."""
    gen = snap.generation
    if gen is None:
        return LiveMoves.UNKNOWN, ""
    held = sorted((n for n in gen.assignment if n in snap.nodes), key=lambda n: gen.assignment[n])
    return combine((snap.nodes[n].record.live_moves, snap.nodes[n].record.moves_reason) for n in held)


async def fetch_status(
    endpoint: str, job_id: str, timeout: float, security: EtcdSecurity | None = None
) -> dict[str, Any] | None:
    """The status object, or None when etcd holds no such job."""
    store = Store(parse_endpoints(endpoint), timeout=min(timeout, 5.0), security=security)
    keys = JobKeys(job_id)
    try:
        await store.connect(timeout)
        snap = await read_snapshot(store, keys, suspects=True)
        if snap.spec is None and snap.generation is None and not snap.nodes and not snap.drained and not snap.suspects:
            return None
        ttls = {}
        for node_id, lease in snap.node_leases.items():
            if lease:
                try:
                    ttls[node_id] = await store.lease_ttl(lease)
                except StoreError:
                    ttls[node_id] = (0, -1)
        return build_status(snap, job_id, ttls)
    finally:
        await store.close()


#: The columns of the table, each ``(header, no_wrap)``. Words that name a role or a state never
#: wrap or get cut; problem sentences go below the table, so the table fits 80 columns.
_COLUMNS = (
    ("node", True), ("host", False), ("role", True), ("state", True), ("node\nrank", True),
    ("ranks", True), ("restarts", True), ("seen", True), ("live\nmoves", True),
)  # fmt: skip
#: A node's live moves in its column, in one short word (the job's line below the heading says it whole).
_MOVES_WORD = {
    "drain and replacement": "both", "drain only": "drain", "replacement only": "repl", "none": "none",
    "unknown": "-",
}  # fmt: skip


def moves_line(status: dict[str, Any]) -> str:
    """The job's line: ``Live moves: drain only: <why>`` (``not known yet`` until every active node reported)."""
    return f"Live moves: {sentence(LiveMoves(status.get('live_moves', 'unknown')), status.get('moves_reason', ''))}"


def _problem(node: dict[str, Any]) -> str:
    """A sentence about a node's fault or failure ("" when it has none)."""
    if node.get("fault"):
        return str(node["fault"])
    if node.get("failure"):
        return str(node.get("message") or node["failure"])
    return ""


def _short_host(host: str) -> str:
    """A host name without its domain (an IP address stays whole), as people say it."""
    if not host or host.replace(".", "").isdigit() or ":" in host:
        return host
    return host.split(".", 1)[0]


def render_table(status: dict[str, Any]) -> Group:
    """A heading and the job's live moves, the nodes as a table that fits 80 columns, then the reason and
    node problems (a node's fault, or its failure; why a node moves less live than ``both``).

    The heading and the sentences are printed at the terminal's width, not the table's.
    """
    notes = [f"{n['node_id']}: {_problem(n)}" for n in status["nodes"] if _problem(n)]
    notes += [f"{n['node_id']}: live moves {sentence(LiveMoves(n['live_moves']), n['moves_reason'])}"
              for n in status["nodes"] if n.get("moves_reason") and n["role"] == "active"]  # fmt: skip
    if status["reason"]:
        notes.insert(0, status["reason"])
    heading = Text(
        f"job {status['job']} · generation {status['generation']} ({status['status']}) · "
        f"controller {status['controller'] or '-'} · restarts {status['restart_count']}",
        style="bold",
    )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for header, no_wrap in _COLUMNS:
        table.add_column(header, no_wrap=no_wrap, overflow="fold")
    for n in status["nodes"]:
        ranks = n["ranks"]
        table.add_row(
            n["node_id"], _short_host(n["host"]), n["role"], n["state"],
            "-" if n["node_rank"] is None else str(n["node_rank"]),
            f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else ",".join(map(str, ranks)) or "-",
            str(n["restarts"]),
            "-" if n["last_seen_s"] is None else f"{n['last_seen_s']}s ago",
            _MOVES_WORD.get(n.get("live_moves", "unknown"), n.get("live_moves", "-")),
        )  # fmt: skip
    return Group(heading, Text(moves_line(status)), table, *(Text(note) for note in notes))


def status(
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = JOB_ID,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    watch: bool = typer.Option(False, "--watch", help="Refresh every second until interrupted."),
    timeout: float = TIMEOUT,
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Show a job's generation, controller and nodes."""
    console = Console()
    try:
        _, security = connection(rdzv_endpoint, cacert, cert, key, user)
        while True:
            result = asyncio.run(fetch_status(rdzv_endpoint, rdzv_id, timeout, security))
            if result is None:
                print(
                    f"rlaunch: no job {rdzv_id!r} exists in etcd at {rdzv_endpoint}; check --rdzv-id.",
                    file=sys.stderr,
                )
                sys.exit(1)
            if as_json:
                print(json.dumps(result), flush=True)
            else:
                if watch:
                    console.clear()
                console.print(render_table(result))
                for problem in result["problems"]:
                    console.print(f"[yellow]warning:[/] {problem}")
            if not watch:
                return
            time.sleep(1.0)
    except RlaunchError as exc:
        fail(exc)
    except KeyboardInterrupt:
        return
