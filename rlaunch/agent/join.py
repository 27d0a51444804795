"""Joining the job: agree on the job spec (writing it if first) and register this node atomically.

An agent joins by creating its node record under its lease, guarded by the revision of the job
spec it checked, in one transaction; the first agent writes the spec and its record together.
Leftovers of a previous run (a spec with no live nodes) are cleared; a job that has ended but whose
agents are still exiting is waited out. An agent is refused, with a sentence saying what to do,
when its spec differs from the job's, when its node was drained and not undrained, when its node
was suspected of silent data corruption in this job, or when a live agent already holds its node id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rlaunch.controller.view import read_snapshot
from rlaunch.errors import JoinError, RecordError
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import JobSpec, NodeRecord, SuspectMark, decode, encode

log = logging.getLogger(__name__)

#: How often a joining agent looks again while an ended job's agents are still exiting.
ENDED_JOB_POLL_S = 0.5


async def join_job(
    store: Store,
    keys: JobKeys,
    spec: JobSpec,
    record: NodeRecord,
    lease: int,
    rdzv_timeout: float,
    sleep: Callable[[float], Awaitable[object]],
) -> None:
    """Register ``record`` (this node) in the job, writing ``spec`` if this agent is the first.

    Raises :class:`~rlaunch.errors.JoinError` when this agent may not join.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + rdzv_timeout
    node_id, job_id = record.node_id, keys.job_id
    node_key = keys.node(node_id)
    while True:
        # The spec first: its creator registered with it atomically, so a snapshot read after it
        # shows that node. Read the other way round, agents starting together see "a spec, no
        # nodes" and clear each other's registrations as leftovers.
        spec_kv = await store.get(keys.spec)
        snap = await read_snapshot(store, keys)
        finished = snap.generation is not None and snap.generation.status.terminal
        if spec_kv is not None and finished and snap.nodes:
            if loop.time() > end:
                raise JoinError(
                    f"Job {job_id!r} has ended but its agents are still exiting after "
                    f"{rdzv_timeout:.0f} s; stop them or use another --rdzv-id."
                )
            await sleep(ENDED_JOB_POLL_S)
            continue
        if spec_kv is not None and not snap.nodes:
            # Nobody runs this job any more: what is left belongs to a previous run.
            if await store.delete_prefix_guarded(keys.prefix, keys.spec, spec_kv.mod_revision):
                log.info("[%s] cleared the leftovers of a previous run of job %s", node_id, job_id)
            continue
        if spec_kv is None:
            items = [(keys.spec, encode(spec), None), (node_key, encode(record), lease)]
            if await store.create_all(items):
                return
            continue
        if await store.get(keys.drained(node_id)) is not None:
            raise JoinError(
                f"Node {node_id!r} was drained from job {job_id!r}; run `rlaunch undrain "
                f"{node_id} --rdzv-endpoint ... --rdzv-id {job_id}` before it rejoins."
            )
        suspect = await store.get(keys.suspect(node_id))
        if suspect is not None:
            raise JoinError(suspect_message(keys, node_id, suspect.value))
        try:
            theirs = decode(JobSpec, spec_kv.value, keys.spec)
        except RecordError as exc:
            raise JoinError(f"{exc} This agent cannot check that it runs the same job, so it will not join.") from exc
        diffs = spec.differences(theirs)
        if diffs:
            raise JoinError(
                f"This agent's job differs from job {job_id!r} in etcd: {'; '.join(diffs)}. "
                "Launch every node with the same script, arguments, --nnodes, --nproc-per-node, --max-restarts "
                "and --verify-every, or pick another --rdzv-id."
            )
        if await store.create_all([(node_key, encode(record), lease)], guard=(keys.spec, spec_kv.mod_revision)):
            return
        existing = await store.get(node_key)
        if existing is not None:
            raise JoinError(duplicate_message(keys, node_id, existing.value))


def duplicate_message(keys: JobKeys, node_id: str, raw: bytes) -> str:
    """The refusal for an agent whose node id a live agent holds (``raw``: that agent's record)."""
    try:
        other = decode(NodeRecord, raw, keys.node(node_id))
        where = f" (host {other.host}, pid {other.pid})"
    except RecordError:
        where = ""
    return (
        f"Node id {node_id!r} is already registered in job {keys.job_id!r} by a live "
        f"agent{where}; give this agent another --node-id or stop the other one."
    )


def suspect_message(keys: JobKeys, node_id: str, raw: bytes) -> str:
    """The refusal for an agent whose node was suspected of silent data corruption in this job."""
    try:
        why = f": {decode(SuspectMark, raw, keys.suspect(node_id)).fault}"
    except RecordError:
        why = ""
    return (
        f"Node {node_id!r} was taken out of job {keys.job_id!r} because silent data corruption was suspected on "
        f"it{why}. It takes no ranks in this job again; check the machine (its GPUs' memory and compute), then "
        "run it in another job (another --rdzv-id)."
    )
