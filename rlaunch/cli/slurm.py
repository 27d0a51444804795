"""``rlaunch slurm-watch``: drain, live, the nodes of a Slurm job that Slurm marks for maintenance.

The command wires :class:`rlaunch.integrations.slurm_watch.SlurmDrainWatch` to etcd: a marked
node is announced in the job's event stream (``slurm_marked``), drained with the same request
``rlaunch drain`` writes and, once its agent has exited, released from the Slurm job so that Slurm
can take it; it runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import typer

from rlaunch.cli.drain import DrainRefused, _drain, check_drain
from rlaunch.cli.options import CACERT, CERT, ENDPOINT, JOB_ID, KEY, USER, connection, fail, setup_logging
from rlaunch.controller.view import read_snapshot
from rlaunch.errors import RlaunchError, UsageError
from rlaunch.integrations.slurm import SlurmNode, parse_fields
from rlaunch.integrations.slurm_watch import (
    Outcome,
    Releaser,
    SlurmDrainWatch,
    job_nodes,
    read_nodes,
    release_node,
    run_scontrol,
)
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, encode
from rlaunch.store.security import EtcdSecurity

log = logging.getLogger(__name__)


async def drain_node(endpoint: str, job_id: str, node: str, timeout: float, security: EtcdSecurity) -> Outcome:
    """Drain ``node`` as ``rlaunch drain`` does (no ``--wait``); a refusal comes back as its sentence."""
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    try:
        await store.connect(10.0)
        snap = await read_snapshot(store, keys)
        if node in snap.drained:
            return Outcome(True, f"Node {node} is already drained from rlaunch job {job_id}.")
        try:
            check_drain(snap, node, job_id, wait=False)
        except DrainRefused:
            check_drain(snap, node, job_id, wait=True)  # refused for another reason: that sentence
            return Outcome(False, f"The rlaunch job {job_id} has no ready standby yet to take node {node}'s ranks.")
        result = await _drain(endpoint, job_id, node, False, timeout, security)
    except RlaunchError as exc:
        return Outcome(False, str(exc))
    finally:
        await store.close()
    extra = f"; downtime {result['downtime_ms']:.0f} ms" if "downtime_ms" in result else ""
    return Outcome(
        True,
        f"Node {node} drained from rlaunch job {job_id}: its ranks moved to {result['replaced_by']} "
        f"(generation {result['generation']}){extra}.",
    )


async def agent_present(endpoint: str, job_id: str, node: str, security: EtcdSecurity) -> bool:
    """Whether ``node``'s agent is still registered in the rlaunch job (its lease alive)."""
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    try:
        await store.connect(10.0)
        return node in (await read_snapshot(store, JobKeys(job_id))).nodes
    finally:
        await store.close()


async def announce(endpoint: str, job_id: str, node: SlurmNode, why: str, security: EtcdSecurity) -> None:
    """Record in the job's event stream that Slurm marked ``node`` (best effort: a failure is logged)."""
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=5.0, security=security)
    now = time.time()
    data = {"node": node.name, "state": node.state_text, "reason": node.reason or "", "message": why}
    try:
        await store.connect(10.0)
        await store.put(keys.event(int(now * 1e9), "slurm"), encode(Event(now, "slurm", "slurm_marked", 0, data)))
    except RlaunchError as exc:
        log.warning("The slurm_marked event for node %s could not be written: %s", node.name, exc)
    finally:
        await store.close()


async def _watch(
    endpoint: str,
    job_id: str,
    nodes: str,
    interval: float,
    scontrol: str,
    timeout: float,
    slurm_job: str | None,
    security: EtcdSecurity,
) -> None:
    keep: frozenset[str] = frozenset()
    if slurm_job:
        job = parse_fields(await run_scontrol(scontrol, "show", "job", "-o", slurm_job))
        keep = frozenset({job["BatchHost"]} if job.get("BatchHost") else ())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = SlurmDrainWatch(
        read=lambda: read_nodes(nodes, scontrol),
        drain=lambda node: drain_node(endpoint, job_id, node, timeout, security),
        announce=lambda node, why: announce(endpoint, job_id, node, why, security),
        interval=interval,
        stop=stop,
        release=Releaser(
            slurm_job,
            present=lambda node: agent_present(endpoint, job_id, node, security),
            shrink=lambda node: release_node(slurm_job, node, scontrol),
        )
        if slurm_job
        else None,
        keep=keep,
    )
    log.info("watching Slurm nodes %s every %g s for rlaunch job %s", nodes, interval, job_id)
    await watch.run()


def slurm_watch(
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = JOB_ID,
    nodes: str = typer.Option(
        None, "--nodes", help="Slurm hostlist of the job's nodes, e.g. n[1-4]; default: $SLURM_JOB_NODELIST."
    ),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between two looks at Slurm's node states."),
    scontrol: str = typer.Option("scontrol", "--scontrol", help="The scontrol program to ask."),
    timeout: float = typer.Option(300.0, "--timeout", help="Longest wait, in seconds, for one node to be drained."),
    slurm_job: str = typer.Option(
        None,
        "--slurm-job",
        envvar="SLURM_JOB_ID",
        help="The Slurm job a drained node is released from (not its batch host); default: $SLURM_JOB_ID.",
    ),
    release: bool = typer.Option(
        True, "--release/--no-release", help="Release each drained node from the Slurm job, so that Slurm can take it."
    ),
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Drain live, from the job, each node Slurm marks DRAIN, FAIL or MAINTENANCE (run inside the Slurm job)."""
    setup_logging()
    try:
        if interval <= 0:
            raise UsageError(f"--interval {interval} is not valid: give a positive number of seconds.")
        if timeout <= 0:
            raise UsageError(f"--timeout {timeout} is not valid: give a positive number of seconds.")
        job = slurm_job if release else None
        _, security = connection(rdzv_endpoint, cacert, cert, key, user)
        asyncio.run(_watch(rdzv_endpoint, rdzv_id, nodes or job_nodes(), interval, scontrol, timeout, job, security))
    except RlaunchError as exc:
        fail(exc)
