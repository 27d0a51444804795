"""torchrun's static rendezvous: node rank 0 runs the job's etcd, and node ranks are kept.

``rlaunch --nnodes 4 --node-rank $SLURM_NODEID --master-addr $HEAD --master-port 29500 train.py``
works as under torchrun. Workers get ``MASTER_ADDR``/``MASTER_PORT`` as torchrun gives them
(``--master-addr``, ``--master-port``); node rank 0 also starts an embedded etcd on the port after
``--master-port`` (or ``--rdzv-conf etcd_port=N``), listening on every interface, or on the
loopback address given as ``--master-addr``. The other nodes use it as their ``--rdzv-endpoint``.

The controller gives node ranks in join order, so a node of rank ``k`` registers only once ``k``
nodes have (:func:`may_join`): join order is then node rank order whatever order the agents
start in. A node that rejoins a running job, and a ``--standby`` agent, join at once.

This mode has torchrun's single point of failure: the job's state lives on node rank 0, so
losing that machine ends the job (the other agents find etcd gone, stop their workers after
their lease TTL and exit 1). Standbys still replace any other node. For jobs that must survive
any machine, run etcd apart (``rlaunch etcd``, or a 3-member cluster) and give ``--rdzv-endpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from rlaunch.addresses import family_of
from rlaunch.agent.agent import Agent
from rlaunch.agent.config import LaunchConfig, etcd_listen_host
from rlaunch.controller.view import read_snapshot
from rlaunch.errors import EmbeddedEtcdError, JoinError, StoreError
from rlaunch.store.client import Store
from rlaunch.store.embedded import EmbeddedEtcd
from rlaunch.store.keys import JobKeys

log = logging.getLogger(__name__)

#: How often a node waiting for its turn to join, or node rank 0 waiting for the others to leave,
#: looks at etcd (a handful of reads a second, only while starting or ending).
POLL_S = 0.2


def may_join(node_rank: int | None, ranked_nodes: int, started: bool) -> bool:
    """Whether a node may register now: once ``node_rank`` nodes have (or the job already runs)."""
    return node_rank is None or started or ranked_nodes >= node_rank


async def wait_for_turn(
    store: Store,
    keys: JobKeys,
    node_rank: int | None,
    timeout: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return when this node may register so that join order gives it ``node_rank``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    await _port_open(store.endpoint.host, store.endpoint.port, timeout, sleep)
    await store.connect(max(1.0, end - loop.time()))
    while True:
        snap = await read_snapshot(store, keys)
        ranked = sum(1 for v in snap.nodes.values() if not v.record.standby_only)
        if may_join(node_rank, ranked, snap.generation is not None):
            return
        if loop.time() > end:
            raise JoinError(
                f"Node rank {node_rank} waited {timeout:.0f} s for node ranks 0 to {(node_rank or 1) - 1} to join "
                f"job {keys.job_id!r}, but only {ranked} did; start every node with its own --node-rank."
            )
        await sleep(POLL_S)


async def _port_open(host: str, port: int, timeout: float, sleep: Callable[[float], Awaitable[None]]) -> None:
    """Wait, quietly, until node rank 0's etcd accepts connections (it may start after this node)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    said = False
    while loop.time() < end:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
        except (OSError, asyncio.TimeoutError):
            if not said:
                log.info("waiting for node rank 0 to start the job's etcd at %s:%d", host, port)
                said = True
            await sleep(POLL_S)
            continue
        writer.close()
        return
    # Store.connect then names the endpoint and the timeout in its error.


async def wait_for_others(store: Store, keys: JobKeys, bound: float) -> None:
    """Keep etcd up (at most ``bound`` s) while other agents still read the job's end from it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + bound
    try:
        snap = await read_snapshot(store, keys)
        if snap.generation is None or not snap.generation.status.terminal:
            return  # the job did not end: nobody is about to leave cleanly
        while snap.nodes and loop.time() < end:
            await asyncio.sleep(POLL_S)
            snap = await read_snapshot(store, keys)
        if snap.nodes:
            log.warning("stopping the job's etcd while node(s) %s are still registered", ", ".join(sorted(snap.nodes)))
    except StoreError as exc:
        log.warning("could not check that the other nodes left before stopping etcd: %s", exc)


async def _run(cfg: LaunchConfig, keep_pids: tuple[int, ...]) -> int:
    assert cfg.static is not None and cfg.endpoints is not None
    keys = JobKeys(cfg.job_id)
    store = Store(cfg.endpoints, timeout=5.0)
    try:
        await wait_for_turn(store, keys, cfg.static.node_rank, cfg.rdzv_timeout)
    finally:
        await store.close()
    code = await Agent(cfg, cfg.endpoints, keep_pids=keep_pids).run()
    if cfg.static.hosts_etcd:
        store = Store(cfg.endpoints, timeout=5.0)
        try:
            await wait_for_others(store, keys, bound=3.0 * cfg.lease_ttl + 5.0)
        finally:
            await store.close()
    return code


def _port_free(host: str, port: int) -> bool:
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def launch_static(cfg: LaunchConfig) -> int:
    """Run one agent of a static-rendezvous job (node rank 0 runs etcd); return its exit code."""
    static = cfg.static
    assert static is not None
    if not static.hosts_etcd:
        log.info(
            "node rank %s joins the job's etcd on node rank 0 at %s (static rendezvous)",
            "-" if static.node_rank is None else static.node_rank,
            static.endpoint,
        )
        return asyncio.run(_run(cfg, ()))
    host = etcd_listen_host(static.master_addr)
    hint = (
        f"As node rank 0 (the default --node-rank), this agent runs the job's etcd on port {static.etcd_port}: "
        "is another node rank 0 running? Give every other node its --node-rank, or pick another --master-port."
    )
    if not _port_free(host, static.etcd_port):
        # Checked first: a server already listening there would look like our etcd starting.
        raise EmbeddedEtcdError(f"Port {static.etcd_port} on {host} is already in use. {hint}")
    etcd = EmbeddedEtcd(host=host, port=static.etcd_port)
    try:
        etcd.start()
    except EmbeddedEtcdError as exc:
        raise EmbeddedEtcdError(f"{exc} {hint}") from exc
    try:
        log.info(
            "node rank 0 runs the job's etcd on %s:%d for the other nodes (--master-addr %s "
            "--master-port %d). Losing this node ends the job, as under torchrun: give --rdzv-endpoint "
            "of an etcd apart to survive it.",
            host, static.etcd_port, static.master_addr, static.master_port,
        )  # fmt: skip
        assert etcd.proc is not None
        return asyncio.run(_run(cfg, (etcd.proc.pid,)))
    finally:
        etcd.stop()
