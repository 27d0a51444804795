"""``rlaunch drain`` / ``rlaunch undrain``: planned maintenance of one node.

``drain`` checks the request against the job (the node must hold ranks; a standby must be
ready unless ``--wait``), writes it for the controller, and waits until the node is drained,
printing the measured downtime. ``undrain`` lifts the drained mark so the node can rejoin as a
standby.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import typer

from rlaunch.cli.options import CACERT, CERT, ENDPOINT, JOB_ID, KEY, USER, connection, fail
from rlaunch.controller.planner import is_ready
from rlaunch.controller.view import JobSnapshot, read_snapshot
from rlaunch.errors import RecordError, RlaunchError, UsageError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import DrainedMark, DrainRequest, Event, GenerationHead, NodeState, decode, encode
from rlaunch.store.security import EtcdSecurity

#: How often the command reads the node's drained mark while it waits (bounded by --timeout).
POLL_S = 0.2
#: How far another host's clock may lag this one's and its events still be read as the drain's.
CLOCK_MARGIN_S = 60.0


class DrainRefused(RlaunchError):
    """The drain request does not fit the job as it is."""


def check_drain(snap: JobSnapshot, node_id: str, job_id: str, wait: bool) -> None:
    """Raise :class:`DrainRefused` with a sentence when ``node_id`` cannot be drained now."""
    gen = snap.generation
    if node_id in snap.drained:
        raise DrainRefused(f"Node {node_id!r} is already drained from job {job_id!r}.")
    if node_id not in snap.nodes:
        known = ", ".join(sorted(snap.nodes)) or "none"
        raise DrainRefused(f"Job {job_id!r} has no live node {node_id!r} (its nodes: {known}).")
    if gen is None or gen.node_rank(node_id) is None:
        state = snap.nodes[node_id].record.state.value
        raise DrainRefused(
            f"Node {node_id!r} holds no ranks in job {job_id!r} (it is {state}); only active nodes can be drained."
        )
    live = all(snap.nodes[n].record.runtime for n in gen.assignment if n in snap.nodes)
    ready = [n for n, v in snap.nodes.items() if n not in gen.assignment and is_ready(v.record, live)]
    if not ready and not wait:
        idle = [n for n in snap.nodes if n not in gen.assignment]
        failed = sorted(n for n in idle if snap.nodes[n].record.state == NodeState.FAILED)
        why = f" (standby {', '.join(failed)} failed: its log and rlaunch status say why)" if failed else ""
        raise DrainRefused(
            f"Job {job_id!r} has no ready standby to take the ranks of node {node_id!r}{why}; start one "
            "(rlaunch --standby ...) or pass --wait to wait for one."
        )


async def _drain(
    endpoint: str, job_id: str, node_id: str, wait: bool, timeout: float, security: EtcdSecurity | None = None
) -> dict[str, Any]:
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    try:
        await store.connect(min(timeout, 10.0))
        snap = await read_snapshot(store, keys)
        if snap.spec is None:
            raise DrainRefused(f"No job {job_id!r} exists in etcd at {endpoint}; check --rdzv-id.")
        check_drain(snap, node_id, job_id, wait)
        requested = time.time()
        await store.put(keys.drain_request(node_id), encode(DrainRequest(node_id=node_id, requested_at=requested)))
        await store.put(
            keys.event(int(requested * 1e9), "cli"),
            encode(Event(time=requested, node_id="cli", kind="drain_requested", generation=0, data={"node": node_id})),
        )
        try:
            mark = await _wait_drained(store, keys, job_id, node_id, timeout)
        except RecordError:  # a malformed head or mark: said as it is, and the request is withdrawn
            await store.delete(keys.drain_request(node_id))
            raise
        if mark is None:
            await store.delete(keys.drain_request(node_id))
            raise DrainRefused(
                f"Node {node_id!r} was not drained within {timeout:.0f} s; the request was withdrawn. "
                "See `rlaunch events` for what happened."
            )
        return {"node": node_id, "replaced_by": mark.replaced_by, "generation": mark.generation,
                **await _switch_stats(store, keys, mark.generation, requested)}  # fmt: skip
    finally:
        await store.close()


async def _wait_drained(store: Store, keys: JobKeys, job_id: str, node_id: str, timeout: float) -> DrainedMark | None:
    """The node's drained mark once its agent leaves it; ``None`` after ``timeout`` seconds.

    Each poll reads two small keys, the generation's head and the node's mark (in that order, so a
    job that ends right after the move is not taken for one that ended before it), not the job's
    whole state, whose node records grow with the job (4,096 of them every 0.2 s at scale).
    Raises :class:`DrainRefused` when the job ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kv = await store.get(keys.generation)
        head = decode(GenerationHead, kv.value, kv.key) if kv is not None else None
        kv = await store.get(keys.drained(node_id))
        if kv is not None:
            return decode(DrainedMark, kv.value, kv.key)
        if head is not None and head.status.terminal:
            raise DrainRefused(
                f"Job {job_id!r} ended ({head.status.value}: {head.reason}) before node {node_id!r} was drained."
            )
        await asyncio.sleep(POLL_S)
    return None


async def _switch_stats(store: Store, keys: JobKeys, generation: int, requested: float) -> dict[str, Any]:
    """Downtime and transfer figures reported by the workers for the migration to ``generation``.

    Read while the survivors take their first steps after the switch, often on their machines: only
    the events since the request (less a margin for the other hosts' clocks) are read, not the job's
    whole history, and each of them once (the leavers' bytes add up; another host's event may come
    later with an earlier key)."""
    since = keys.event(int((requested - CLOCK_MARGIN_S) * 1e9), "")
    seen: set[str] = set()
    out: dict[str, Any] = {}
    for _ in range(25):  # the switch is reported one step after the transfer
        kvs = [kv for kv in await store.get_after(since, keys.events_prefix) if kv.key not in seen]
        seen.update(kv.key for kv in kvs)
        for kv in kvs:
            ev = decode(Event, kv.value, kv.key)
            if ev.generation == generation and ev.kind == "switched":
                out["downtime_ms"] = max(out.get("downtime_ms", 0.0), ev.data["downtime_ms"])
            if ev.generation == generation and ev.kind == "state_sent":
                out["state_bytes"] = out.get("state_bytes", 0) + ev.data["bytes"]
                out["transfer_s"] = max(out.get("transfer_s", 0.0), ev.data["seconds"])
        if "downtime_ms" in out:
            break
        await asyncio.sleep(POLL_S)
    return out


def drain(
    node: str = typer.Argument(..., help="The node to drain."),
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = JOB_ID,
    wait: bool = typer.Option(False, "--wait", help="Wait for a ready standby instead of refusing."),
    timeout: float = typer.Option(300.0, "--timeout", help="Longest wait, in seconds, for the node to be drained."),
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Move NODE's ranks to a ready standby while the job keeps running, then retire NODE."""
    try:
        if timeout <= 0:
            raise UsageError(f"--timeout {timeout} is not valid: give a positive number of seconds.")
        _, security = connection(rdzv_endpoint, cacert, cert, key, user)
        result = asyncio.run(_drain(rdzv_endpoint, rdzv_id, node, wait, timeout, security))
    except RlaunchError as exc:
        fail(exc)
    extra = f"; downtime {result['downtime_ms']:.0f} ms" if "downtime_ms" in result else ""
    print(f"node {node} drained: its ranks moved to {result['replaced_by']} (generation {result['generation']}){extra}")


async def _undrain(endpoint: str, job_id: str, node_id: str, security: EtcdSecurity | None = None) -> None:
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    try:
        await store.connect(10.0)
        if await store.get(keys.drained(node_id)) is None:
            raise DrainRefused(f"Node {node_id!r} is not drained in job {job_id!r}; nothing to undo.")
        await store.delete(keys.drained(node_id))
    finally:
        await store.close()


def undrain(
    node: str = typer.Argument(..., help="The drained node."),
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = JOB_ID,
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Let a drained NODE rejoin the job; started again, its agent joins as a standby."""
    try:
        _, security = connection(rdzv_endpoint, cacert, cert, key, user)
        asyncio.run(_undrain(rdzv_endpoint, rdzv_id, node, security))
    except RlaunchError as exc:
        fail(exc)
    print(f"node {node} may rejoin job {rdzv_id} as a standby")
