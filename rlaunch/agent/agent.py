"""The node agent: joins the job through etcd, runs its node's workers, relays generations.

One agent runs per machine (``rlaunch train.py``). It
1. checks or writes the job spec and registers its node record under a lease it keeps alive;
2. campaigns for the controller role (see :mod:`rlaunch.controller.controller`);
3. watches the job's keys; for each new generation it stops its workers, acknowledges, waits
   until every assigned node has acknowledged (so no worker meets a previous generation's
   rendezvous), then starts its workers with torchrun's environment;
4. reports its workers' success or failure on its node record, for the controller to act on;
5. stops its workers when it receives SIGTERM/SIGINT, and kills them at once when it is fenced:
   when etcd answers that its lease is gone, or a generation gives its ranks to others. An etcd
   that does not answer is no such evidence; the workers go on (see :mod:`rlaunch.agent.lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlaunch.agent.config import LaunchConfig, Std, route_addr
from rlaunch.agent.control import ControlServer
from rlaunch.agent.env import standby_env, worker_env
from rlaunch.agent.lease import LeaseKeeper, keepalive_store
from rlaunch.agent.logs import LogPolicy
from rlaunch.agent.metrics import AgentMetrics
from rlaunch.agent.progress import ProgressReporter, progress_batch, progress_every_s
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.agent.workers import WorkerGroup, become_subreaper, reap_orphans
from rlaunch.controller.controller import Controller
from rlaunch.controller.planner import PlannerConfig
from rlaunch.controller.view import read_snapshot
from rlaunch.detectors.gpu import make_gpu_health, watch_gpus
from rlaunch.detectors.liveness import serve
from rlaunch.errors import JoinError, RecordError, StoreError
from rlaunch.events import EventLog
from rlaunch.store.client import Endpoint, Store
from rlaunch.store.embedded import free_port
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import (
    Ack,
    DrainedMark,
    Generation,
    GenerationStatus,
    JobSpec,
    NodeRecord,
    NodeState,
    decode,
    encode,
)
from rlaunch.store.security import EtcdSecurity
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: Exit code of an agent whose job failed, that was signalled or fenced (as torchrun: 1).
EXIT_FAILED = 1
#: How long workers get between SIGTERM and SIGKILL (torchrun's default shutdown timeout).
SHUTDOWN_GRACE_S = 30.0
#: Stale workers (this node was fenced, or its ranks now belong to others) get none: they are
#: SIGKILLed at once, so they never overlap their ranks' new holders.
STALE_GRACE_S = 0.0
#: How often the GPU health detector runs (NVML queries are local; no etcd traffic).
HEALTH_EVERY_S = 2.0
#: How often stray zombie descendants are reaped (scanning /proc is not free).
REAP_EVERY_S = 5.0
#: A node's compute time per step goes to its record at most this often, and only when it moved
#: by more than COMPUTE_CHANGE (a fraction): the straggler detector needs trends, not every step.
COMPUTE_EVERY_S = 5.0
COMPUTE_CHANGE = 0.25
#: A node record etcd did not take (it was unreachable) is sent again at most this often.
RESEND_EVERY_S = 1.0
#: While etcd requests keep failing, the main loop says so at most this often.
ETCD_WARN_EVERY_S = 10.0


class Agent:
    def __init__(
        self,
        cfg: LaunchConfig,
        endpoints: list[Endpoint],
        *,
        keep_pids: tuple[int, ...] = (),
        security: EtcdSecurity | None = None,
        clock: Callable[[], float] = time.time,
        python: str = sys.executable,
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.keys = JobKeys(cfg.job_id)
        self.store = Store(
            endpoints, timeout=min(5.0, max(1.0, cfg.lease_ttl / 2)), security=security or cfg.etcd_security
        )
        self._keep_pids = keep_pids
        self._clock = clock
        self._python = python
        self._spec = cfg.spec()
        self._lease = 0
        self._generation: Generation | None = None
        self._record: NodeRecord | None = None
        self._record_unsent = False  # etcd has not acknowledged self._record yet
        self._resend_at = 0.0  # when to try sending it again
        self._etcd_warned_at = -ETCD_WARN_EVERY_S
        self._workers: WorkerGroup | None = None
        self._worker_gen = 0
        self._acked_gen = 0
        self._starts = 0
        self._sandbox = False  # the running workers are a standby's sandbox workers
        self._sandbox_tried = False
        self._sandbox_failed = False
        self._nodes_changed = True
        self._leaving = False
        #: the generation whose move this node was leaving in failed or was outrun by the job's end (0: none);
        #: in that generation it is an ordinary node again, never offered as its leaver twice
        self._move_ended_in = 0
        self._finished = False  # a leaver's workers exited 0 without handing their state over
        self._prepared_reported: set[int] = set()
        self._settling = 0  # a move's generation whose local workers have not all joined or recovered
        self._fault = ""  # a hardware fault sentence, once a detector found one
        self._hung: list[str] = []  # sentences about local workers killed as hung
        self._compute_at = 0.0  # when compute_s was last published
        self._signal: int | None = None
        self._fenced: str | None = None
        self._reported: set[str] = set()
        self._next_reap = 0.0
        self._log_root: Path | None = cfg.log_dir
        if self._log_root is None and any(v is not Std.NONE for v in (*cfg.redirects.values(), *cfg.tee.values())):
            self._log_root = Path(tempfile.mkdtemp(prefix="rlaunch_logs_"))
            log.info("[%s] worker logs go to %s", self.node_id, self._log_root)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until the job ends; return the exit code (0 success, 1 failure or signal)."""
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._ctl_wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        become_subreaper()
        await self.store.connect(self.cfg.rdzv_timeout)
        self.addr = self.cfg.local_addr or route_addr(self.store.endpoint)
        jsonl = self._log_root / self.cfg.job_id / "events.jsonl" if self._log_root else None
        self.events = EventLog(self.store, self.keys, self.node_id, jsonl, self._clock)
        self.events.start()
        self.metrics = AgentMetrics(self.node_id, self.cfg.nproc_per_node)
        self.events.observers.append(self.metrics.on_event)
        progress = ProgressReporter(
            self.metrics.registry, self.node_id, self.events.emit, progress_every_s(), progress_batch(), self._clock
        )
        self.events.observers.append(progress.observe)  # any other event carries the held samples along
        self.control = ControlServer()
        self._probe_server, self._probe_port = await serve()
        self.link = WorkerLink(self.store, self.keys, lambda: self._lease, self.events.emit, self._wake.set)
        self.link.node_id = self.node_id
        self.link.sandbox_steps = self.cfg.sandbox_steps
        self.link.hangs.floor_s = self.cfg.hang_timeout
        self.link.metrics = self.metrics
        tasks: list[asyncio.Task[Any]] = []
        try:
            if self.cfg.metrics_port:
                self.metrics.serve(self.addr, self.cfg.metrics_port)
            self._lease = await self.store.grant_lease(self.cfg.lease_ttl)
            await self._join()
            self.control.register("info", self._info)
            self.link.register(self.control)
            await self.control.start()
            controller = Controller(
                self.store, self.keys, self._spec,
                PlannerConfig(self.node_id, self.cfg.rdzv_timeout, self.cfg.master_port, self.cfg.standby_wait),
                self._lease, self.events, self._clock, self.cfg.straggler_window,
            )  # fmt: skip
            self.metrics.watch_controller(lambda: controller.leading, lambda: controller.stragglers_watched)
            self._gpu = make_gpu_health()
            tasks = [
                loop.create_task(self._watch_gpus()),
                loop.create_task(self._keepalive()),
                loop.create_task(self._watch()),
                loop.create_task(controller.run(self._stop, self._ctl_wake)),
                loop.create_task(progress.run(lambda: self._worker_gen, self._stop)),
            ]
            return await self._loop()
        finally:
            self._stop.set()
            await self._stop_workers()
            for t in tasks:
                t.cancel()
            # Bounded: on Python 3.11 a cancellation can be swallowed by wait_for inside a task.
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=5.0)
                if pending:
                    log.warning("[%s] %d background task(s) did not stop in time", self.node_id, len(pending))
            await self.events.close()
            self.metrics.close()
            if self._lease and self._fenced is None:  # (a fenced node's lease is gone already)
                try:
                    await self.store.revoke_lease(self._lease)
                except StoreError as exc:
                    log.warning("[%s] could not revoke its lease (it will expire): %s", self.node_id, exc)
            await self.control.close()
            self._probe_server.close()
            await self.store.close()

    def _on_signal(self, sig: int) -> None:
        self._signal = sig
        self._wake.set()

    async def _join(self) -> None:
        """Agree on the job spec (writing it if first) and register this node atomically."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.rdzv_timeout
        node_key = self.keys.node(self.node_id)
        record = self._make_record(NodeState.WAITING, 0)
        while True:
            # The spec first: its creator registered with it atomically, so a snapshot read after it
            # shows that node. Read the other way round, agents starting together see "a spec, no
            # nodes" and clear each other's registrations as leftovers.
            spec_kv = await self.store.get(self.keys.spec)
            snap = await read_snapshot(self.store, self.keys)
            finished = snap.generation is not None and snap.generation.status.terminal
            if spec_kv is not None and finished and snap.nodes:
                if loop.time() > end:
                    raise JoinError(
                        f"Job {self.cfg.job_id!r} has ended but its agents are still exiting after "
                        f"{self.cfg.rdzv_timeout:.0f} s; stop them or use another --rdzv-id."
                    )
                await self._sleep(0.5)
                continue
            if spec_kv is not None and not snap.nodes:
                # Nobody runs this job any more: what is left belongs to a previous run.
                if await self.store.delete_prefix_guarded(self.keys.prefix, self.keys.spec, spec_kv.mod_revision):
                    log.info("[%s] cleared the leftovers of a previous run of job %s", self.node_id, self.cfg.job_id)
                continue
            if spec_kv is None:
                items = [(self.keys.spec, encode(self._spec), None), (node_key, encode(record), self._lease)]
                if await self.store.create_all(items):
                    break
                continue
            if await self.store.get(self.keys.drained(self.node_id)) is not None:
                raise JoinError(
                    f"Node {self.node_id!r} was drained from job {self.cfg.job_id!r}; run `rlaunch undrain "
                    f"{self.node_id} --rdzv-endpoint ... --rdzv-id {self.cfg.job_id}` before it rejoins."
                )
            try:
                theirs = decode(JobSpec, spec_kv.value, self.keys.spec)
            except RecordError as exc:
                raise JoinError(
                    f"{exc} This agent cannot check that it runs the same job, so it will not join."
                ) from exc
            diffs = self._spec.differences(theirs)
            if diffs:
                raise JoinError(
                    f"This agent's job differs from job {self.cfg.job_id!r} in etcd: {'; '.join(diffs)}. "
                    "Launch every node with the same script, arguments, --nnodes, --nproc-per-node and "
                    "--max-restarts, or pick another --rdzv-id."
                )
            if await self.store.create_all(
                [(node_key, encode(record), self._lease)], guard=(self.keys.spec, spec_kv.mod_revision)
            ):
                break
            existing = await self.store.get(node_key)
            if existing is not None:
                raise JoinError(self._duplicate_message(existing.value))
        self._record = record
        self.events.emit("node_joined", 0, host=record.host, addr=record.addr, standby=self.cfg.standby)

    def _duplicate_message(self, raw: bytes) -> str:
        try:
            other = decode(NodeRecord, raw, self.keys.node(self.node_id))
            where = f" (host {other.host}, pid {other.pid})"
        except RecordError:
            where = ""
        return (
            f"Node id {self.node_id!r} is already registered in job {self.cfg.job_id!r} by a live "
            f"agent{where}; give this agent another --node-id or stop the other one."
        )

    # -- the main loop ------------------------------------------------------------------------

    async def _loop(self) -> int:
        while True:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                log.warning("[%s] received %s; stopping its workers", self.node_id, name)
                self.events.emit("agent_signalled", self._worker_gen, signal=name)
                await self._try_publish(NodeState.STOPPING)
                await self._stop_workers()
                return EXIT_FAILED
            if self._fenced is not None:
                log.error("[%s] %s", self.node_id, self._fenced)
                self.events.emit("fenced", self._worker_gen, reason=self._fenced)
                await self._stop_workers(STALE_GRACE_S)
                return EXIT_FAILED
            try:
                if self._record_unsent and time.monotonic() >= self._resend_at:
                    self._resend_at = time.monotonic() + RESEND_EVERY_S
                    await self._send_record()
                code = await self._act(self._generation)
                if code is not None:
                    return code
                self._check_hangs()
                await self._check_workers()
                await self._sync_link()
            except StoreError as exc:
                now = time.monotonic()
                quiet = now - self._etcd_warned_at < ETCD_WARN_EVERY_S  # (one line per outage round)
                self._etcd_warned_at = self._etcd_warned_at if quiet else now
                log.log(logging.DEBUG if quiet else logging.WARNING, "[%s] etcd request failed, will retry: %s",
                        self.node_id, exc)  # fmt: skip
            if time.monotonic() >= self._next_reap:
                reap_orphans(self._keep_pids)
                self._next_reap = time.monotonic() + REAP_EVERY_S
            timeout = self.cfg.monitor_interval if self._workers else 1.0
            await wait_event(self._wake, timeout)
            self._wake.clear()

    async def _act(self, gen: Generation | None) -> int | None:
        """Bring this node in line with generation ``gen``; an int means: exit with it."""
        if gen is None:
            return None
        if gen.status.terminal:
            await self._stop_workers()
            if gen.status is GenerationStatus.SUCCEEDED:
                log.info("[%s] the job succeeded", self.node_id)
                return 0
            log.error("[%s] the job failed: %s", self.node_id, gen.reason)
            return EXIT_FAILED
        if self._fault:
            # A faulty node gives its ranks up: the controller hands them to a standby.
            await self._stop_workers()
            if self._record is None or self._record.state is not NodeState.FAILED:
                await self._publish(NodeState.FAILED, gen.number)
            return None
        if (
            gen.kind != "replace"  # (a replacement's leavers failed; they stay in the job as spares)
            and self.node_id in gen.leavers
            and (self._worker_gen or self._leaving)
            and self._move_ended_in != gen.number
        ):
            return await self._leave(gen)  # (a fresh agent named as an old leaver is just a standby)
        # A newer generation abandoned (or never had) a move of this node: it is a node again.
        if self._leaving:
            log.warning("[%s] generation %d abandoned the move this node was leaving in", self.node_id, gen.number)
            self.events.emit("migration_abandoned", gen.number)
        self._leaving = False
        if (
            self._record is not None
            and self._record.state is NodeState.SUCCEEDED
            and self._record.generation == gen.number
        ):
            return None  # this node's workers finished the job (a moot move's leaver): the controller ends it
        node_rank = gen.node_rank(self.node_id)
        if gen.status is GenerationStatus.WAITING or node_rank is None:
            await self._stand_by(gen, holds_ranks=node_rank is not None)
            return None
        if self._worker_gen == gen.number:
            return None  # our workers for this generation run or have ended; the controller decides
        if gen.kind == "replace":
            await self._replace(gen)
            return None
        if gen.kind == "migrate" and self._workers is not None:
            # Live: survivors keep their processes; a warm standby's workers become the joiner.
            role = "joiner" if self._sandbox else "survivor"
            self.link.offer(gen, role, self.cfg.nproc_per_node)
            if role == "joiner":
                self._workers.relabel(gen.ranks_of(self.node_id))
            self._sandbox = False
            self._worker_gen = gen.number
            self.events.emit("migration_offered", gen.number, role=role, leavers=gen.leavers, joiners=gen.joiners)
            if role == "joiner":
                self._settling = gen.number
                await self._publish(NodeState.RESTARTING, gen.number)  # RUNNING once its workers joined
            else:
                await self._publish(NodeState.RUNNING, gen.number)
            return None
        if self._acked_gen != gen.number:
            await self._stop_workers()
            await self._publish(NodeState.RESTARTING, gen.number)
            await self.store.put(
                self.keys.ack(gen.number, self.node_id),
                encode(Ack(node_id=self.node_id, generation=gen.number)),
                lease=self._lease,
            )
            if self._acked_gen:
                await self.store.delete(self.keys.ack(self._acked_gen, self.node_id))
            self._acked_gen = gen.number
        acks, _ = await self.store.get_prefix(self.keys.acks_prefix(gen.number))
        acked = {kv.key.rsplit("/", 1)[-1] for kv in acks}
        if set(gen.assignment) <= acked:
            self._start_workers(gen)
            await self._publish(NodeState.RUNNING, gen.number)
        return None

    async def _replace(self, gen: Generation) -> None:
        """Take part in a live replacement: a survivor keeps its workers; a joiner's take the ranks."""
        if self.node_id in gen.joiners:
            if self._workers is None or not self._sandbox:
                # Restarted in place (its workers failed): fresh workers warm up, then receive state.
                await self._stop_workers()
                self._start_sandbox(gen)
            self.link.offer(gen, "joiner", self.cfg.nproc_per_node)
            assert self._workers is not None
            self._workers.relabel(gen.ranks_of(self.node_id))
            self._sandbox = False
            self._worker_gen = self._settling = gen.number
            self.events.emit("replacement_offered", gen.number, role="joiner", leavers=gen.leavers)
            await self._publish(NodeState.RESTARTING, gen.number)  # RUNNING once its workers joined
            return
        self._worker_gen = gen.number
        if self._workers is None or self._sandbox:
            # Its workers ended as the replacement was planned: the controller must hear of it.
            await self._stop_workers()
            codes = self._record.exit_codes if self._record else {}
            await self._publish(NodeState.FAILED, gen.number, exit_codes=codes)
            return
        self.link.offer(gen, "survivor", self.cfg.nproc_per_node)
        self._settling = gen.number
        self.events.emit("replacement_offered", gen.number, role="survivor", leavers=gen.leavers, joiners=gen.joiners)
        await self._publish(NodeState.RESTARTING, gen.number)  # RUNNING once its workers recovered

    async def _stand_by(self, gen: Generation, holds_ranks: bool) -> None:
        """Hold no running ranks: keep (or start) warm sandbox workers when the job can use them."""
        if self._workers is not None and not self._sandbox:
            if holds_ranks:
                await self._stop_workers()  # the job restarts with this node: torchrun's grace
            else:
                # The job went on without this node: its workers' ranks belong to others now.
                log.error(
                    "[%s] generation %d gives this node no ranks; killing its generation-%d workers at once",
                    self.node_id, gen.number, self._worker_gen,
                )  # fmt: skip
                await self._stop_workers(STALE_GRACE_S)
        if holds_ranks:
            target = NodeState.RESTARTING
        else:
            if self._workers is None and not self._sandbox_tried and self._nodes_changed:
                self._nodes_changed = False  # re-read node records only when the watch saw them change
                if await self._job_uses_runtime(gen):
                    self._start_sandbox(gen)
            warming = self._sandbox and len(self.link.state.warm) < self.cfg.nproc_per_node
            target = NodeState.WARMING if warming else NodeState.STANDBY
            if self._sandbox_failed:
                target = NodeState.FAILED  # its sandbox workers died: not a usable standby
        if self._record is None or self._record.state is not target or self._record.generation != gen.number:
            await self._publish(target, gen.number)

    async def _job_uses_runtime(self, gen: Generation) -> bool:
        snap = await read_snapshot(self.store, self.keys)
        return any(snap.nodes[n].record.runtime for n in gen.assignment if n in snap.nodes)

    async def _leave(self, gen: Generation) -> int | None:
        """This node leaves in ``gen``: hand its state over (or stop), then exit 0 as drained."""
        if not self._leaving:
            self._leaving = True
            await self._publish(NodeState.DRAINING, gen.number)
            if gen.kind == "migrate" and self._workers is not None:
                self.link.offer(gen, "leaver", self.cfg.nproc_per_node)
                self.events.emit("migration_offered", gen.number, role="leaver", joiners=gen.joiners)
            else:
                await self._stop_workers()
        if self._workers is not None:
            if gen.kind != "migrate" or len(self.link.state.left) < self.cfg.nproc_per_node:
                return None  # the workers exit 0 once they have sent their state
            # Every local worker sent its state: the drain is done; their teardown need not be waited for.
            await self._stop_workers()
        if gen.kind == "migrate" and len(self.link.state.left) < self.cfg.nproc_per_node and self._finished:
            # Every worker exited 0 without handing its state over: they finished the job before the
            # switch. The move is moot; the controller ends the job once the other nodes finish.
            self._move_ended_in = gen.number
            self._leaving = False
            self.events.emit("migration_moot", gen.number, reason="the workers finished the job before the switch")
            await self._publish(NodeState.SUCCEEDED, gen.number)
            return None
        if gen.kind == "migrate" and len(self.link.state.left) < self.cfg.nproc_per_node:
            # The workers ended before handing their state over: this node is not drained. Its
            # failure is on its record; it stays in the job as a node without ranks.
            self._move_ended_in = gen.number
            self._leaving = False
            log.error("[%s] the move to generation %d failed before the state was sent", self.node_id, gen.number)
            self.events.emit("migration_failed", gen.number, sent=sorted(self.link.state.left))
            return None
        joiner = gen.joiners[gen.leavers.index(self.node_id)]
        mark = DrainedMark(node_id=self.node_id, generation=gen.number, replaced_by=joiner, at=self._clock())
        await self.store.put(self.keys.drained(self.node_id), encode(mark))
        await self._publish(NodeState.DRAINED, gen.number)
        self.events.emit("drained", gen.number, replaced_by=joiner)
        log.info("[%s] drained: node rank %d now belongs to %s", self.node_id, gen.assignment[joiner], joiner)
        return 0

    def _start_workers(self, gen: Generation) -> None:
        """Start this node's workers for generation ``gen`` with torchrun's environment."""
        envs = [
            worker_env(
                os.environ,
                gen,
                node_id=self.node_id,
                local_rank=i,
                job_id=self.cfg.job_id,
                max_restarts=self.cfg.max_restarts,
                agent_addr=self.control.path,
                role=self.cfg.role,
            )  # fmt: skip
            for i in range(gen.nproc_per_node)
        ]
        ranks = gen.ranks_of(self.node_id)
        group = self._spawn(gen, "active", envs, ranks, f"attempt_{gen.number}")
        self._worker_gen = gen.number
        self._starts += 1
        self.events.emit(
            "workers_started", gen.number, ranks=ranks, pids=group.pids,
            node_rank=gen.assignment[self.node_id], restart_count=gen.restart_count,
        )  # fmt: skip

    def _start_sandbox(self, gen: Generation) -> None:
        """Start this standby's workers in sandbox mode: they warm up, then wait for ranks."""
        self._sandbox_tried = True
        envs = [
            standby_env(
                os.environ,
                gen,
                node_id=self.node_id,
                local_rank=i,
                job_id=self.cfg.job_id,
                agent_addr=self.control.path,
                role=self.cfg.role,
            )  # fmt: skip
            for i in range(gen.nproc_per_node)
        ]
        labels = [f"s{i}" for i in range(gen.nproc_per_node)]
        group = self._spawn(gen, "standby", envs, labels, "standby")
        self.events.emit("sandbox_started", gen.number, pids=group.pids)

    def _spawn(
        self, gen: Generation, role: str, envs: list[dict[str, str]], labels: list[int] | list[str], log_name: str
    ) -> WorkerGroup:
        """Start a worker group whose files (if any) go to ``<log root>/<job>/<node>/<log_name>/``."""
        attempt_dir = self._log_root / self.cfg.job_id / self.node_id / log_name if self._log_root else None
        policy = LogPolicy(
            self.node_id, self.cfg.redirects, self.cfg.tee, self.cfg.local_ranks_filter, attempt_dir,
            self.cfg.log_line_prefix_template, self.cfg.role,
        )  # fmt: skip
        self.link.reset(role, gen)
        group = WorkerGroup(self.cfg.command(self._python), envs, list(labels), policy)
        group.start()
        self._workers = group
        self._sandbox = role == "standby"
        return group

    def _check_hangs(self) -> None:
        """Kill local workers that made no progress within the hang timeout (their exit is a failure)."""
        if self._workers is None or self._sandbox:
            return
        for hang in self.link.hangs.hung(time.monotonic()):
            self.link.hangs.forget(hang.local_rank)
            self._hung.append(hang.sentence())
            log.error("[%s] %s; killing it", self.node_id, hang.sentence())
            self.events.emit(
                "worker_hung", self._worker_gen, local_rank=hang.local_rank, silent_s=round(hang.silent_s, 1),
                timeout_s=round(hang.timeout_s, 1), frozen=hang.frozen,
            )  # fmt: skip
            self._workers.kill(hang.local_rank)

    async def _check_workers(self) -> None:
        group = self._workers
        if group is None:
            return
        codes = group.poll()
        if self._sandbox and any(c is not None for c in codes):
            self._workers = None
            self._sandbox = False
            await asyncio.to_thread(group.stop, SHUTDOWN_GRACE_S)
            log.error("[%s] sandbox workers exited (codes %s); this standby is not warm", self.node_id, codes)
            self.events.emit("sandbox_failed", self._worker_gen, codes={str(i): c for i, c in enumerate(codes)})
            # Forget their hellos: a standby without workers must never look ready for a drain.
            self.link.reset("standby", self._generation)
            self._sandbox_failed = True
            exit_codes = {str(i): c for i, c in enumerate(codes) if c is not None}
            await self._publish(NodeState.FAILED, self._generation.number if self._generation else 0, exit_codes)
            return
        if self._leaving and all(c == 0 for c in codes):
            self._workers = None  # they handed their state over (or finished the job); _leave decides
            self._finished = len(self.link.state.left) < len(codes)
            return
        if any(c is not None and c != 0 for c in codes):
            self._workers = None
            final = await asyncio.to_thread(group.stop, SHUTDOWN_GRACE_S)
            exit_codes = {str(i): c for i, c in enumerate(codes) if c is not None and c != 0}
            log.error(
                "[%s] worker(s) failed in generation %d: exit codes %s (by local rank)",
                self.node_id,
                self._worker_gen,
                exit_codes,
            )
            self.events.emit(
                "workers_failed",
                self._worker_gen,
                exit_codes=exit_codes,
                final_codes={str(i): c for i, c in enumerate(final)},
            )
            if self._hung:
                failure, message = "hang", "; ".join(self._hung)
            elif self.link.state.unrecoverable:
                failure, message = "refused", self.link.state.unrecoverable
            else:
                failure = "signal" if any(c < 0 for c in exit_codes.values()) else "exit"
                message = f"worker(s) failed with exit codes {exit_codes} (by local rank)"
            self._hung = []
            await self._publish(NodeState.FAILED, self._worker_gen, exit_codes=exit_codes, failure=(failure, message))
        elif all(c == 0 for c in codes):
            self._workers = None
            self.events.emit("workers_succeeded", self._worker_gen)
            await self._publish(NodeState.SUCCEEDED, self._worker_gen)

    async def _sync_link(self) -> None:
        """Publish what the workers reported: runtime use, and readiness for a migration."""
        state = self.link.state
        uses_runtime = len(state.hello) >= self.cfg.nproc_per_node
        if self._record is not None and self._record.runtime != uses_runtime and self._workers is not None:
            await self._publish(self._record.state, self._record.generation)
        if self._record is not None and state.peer_lost_at > self._record.peer_lost_at:
            await self._publish(self._record.state, self._record.generation)  # the controller probes
        if self._record is not None and self._compute_moved():
            self._compute_at = time.monotonic()
            await self._publish(self._record.state, self._record.generation)
        if self._settling and self._settling == self._worker_gen and self._workers is not None:
            done = state.joined.get(self._settling, set()) | state.recovered.get(self._settling, set())
            if len(done) >= self.cfg.nproc_per_node:
                self._settling = 0
                await self._publish(NodeState.RUNNING, self._worker_gen)
        for gen, ranks in state.prepared.items():
            if len(ranks) >= self.cfg.nproc_per_node and gen not in self._prepared_reported:
                self._prepared_reported.add(gen)
                self.events.emit("prepared", gen)

    def _compute_moved(self) -> bool:
        if not self.link.state.compute_s or time.monotonic() - self._compute_at < COMPUTE_EVERY_S:
            return False
        assert self._record is not None
        now, before = self._compute_s(), self._record.compute_s
        return before <= 0 or abs(now - before) > COMPUTE_CHANGE * before

    def _compute_s(self) -> float:
        values = list(self.link.state.compute_s.values())
        return statistics.median(values) if values else 0.0

    async def _stop_workers(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        group, self._workers = self._workers, None
        if group is not None:
            codes = await asyncio.to_thread(group.stop, grace)
            self.events.emit("workers_stopped", self._worker_gen, codes={str(i): c for i, c in enumerate(codes)})

    # -- etcd tasks ---------------------------------------------------------------------------

    async def _keepalive(self) -> None:
        """Keep the lease alive; fence this node only when etcd answers that the lease is gone."""
        store = keepalive_store(self.store)
        keeper = LeaseKeeper(
            store, self._lease, self.cfg.lease_ttl, self.node_id,
            sleep=lambda s: wait_event(self._stop, s), on_back=self._etcd_back,
        )  # fmt: skip
        try:
            why = await keeper.run()
        finally:
            await store.close()
        if why is not None:
            self._fence(why)

    def _etcd_back(self, unreachable_s: float, remaining: int) -> None:
        self.events.emit(
            "etcd_back", self._worker_gen, unreachable_s=round(unreachable_s, 1), lease_ttl_left=remaining
        )  # fmt: skip
        self._wake.set()
        self._ctl_wake.set()

    async def _watch_gpus(self) -> None:
        """The first GPU fault takes this node out of the job (its ranks go to a standby)."""
        result = await watch_gpus(self._gpu, self._stop, HEALTH_EVERY_S)
        if isinstance(result, str):
            log.info("[%s] %s", self.node_id, result)
            self.events.emit("gpu_health_off", 0, reason=result)
        elif result:
            self._fault = "; ".join(f.sentence() for f in result)
            log.error("[%s] %s: this node gives up its ranks", self.node_id, self._fault)
            self.events.emit("gpu_fault", self._worker_gen, faults=[dataclasses.asdict(f) for f in result])
            self._wake.set()

    def _fence(self, why: str) -> None:
        self._fenced = f"This agent stops its workers and exits because {why}."
        self._wake.set()

    async def _watch(self) -> None:
        """Follow the keys this node acts on: keep the latest generation, wake the loop and the controller."""
        failing = False
        while not self._stop.is_set():
            try:
                kv, revision = await self.store.get_at(self.keys.generation)
                if failing:
                    log.info("[%s] watching etcd again from revision %d", self.node_id, revision + 1)
                failing = False
                if kv is not None:
                    self._take_generation(kv.value)
                leader, _ = await self.store.get_at(self.keys.leader)
                leading = leader is not None and leader.value == self.node_id.encode()
                ranges = self._watch_ranges(leading)
                self._nodes_changed = True  # anything may have changed while the watch was down
                self._wake.set()
                self._ctl_wake.set()
                async with contextlib.aclosing(self.store.watch_many(ranges, start_revision=revision + 1)) as events:
                    async for ev in events:
                        if ev.key == self.keys.generation and not ev.deleted:
                            self._take_generation(ev.value)
                        elif ev.key.startswith(self.keys.nodes_prefix):
                            self._nodes_changed = True
                        elif ev.key == self.keys.leader:
                            leading = not ev.deleted and ev.value == self.node_id.encode()
                        self._wake.set()
                        # A non-leader campaigns only when the leader key goes (with its lease).
                        if leading or (ev.key == self.keys.leader and ev.deleted):
                            self._ctl_wake.set()
                        if self._watch_ranges(leading) != ranges:
                            break  # leadership or this node's part changed: follow other keys
            except StoreError as exc:
                # Said once per outage: the lease keeper reports how long etcd stays away.
                log.log(logging.DEBUG if failing else logging.WARNING, "[%s] watching etcd failed, retrying: %s",
                        self.node_id, exc)  # fmt: skip
                failing = True
                await self._sleep(1.0)

    def _watch_ranges(self, leading: bool) -> tuple[tuple[str, bool], ...]:
        """The ``(key or prefix, exact)`` ranges this node acts on (never ``kv/`` or ``events/``).

        Every node: the generation, the leader key (to campaign when it goes) and the acks (a
        restart starts once all are in). Node records only for the leader (its planner reads them)
        and for a node holding no ranks (a standby decides on warm workers from them); drain
        requests and marks only for the leader.
        """
        k, gen = self.keys, self._generation
        ranges = [(k.generation, True), (k.leader, True), (k.all_acks_prefix, False)]
        if leading or gen is None or self.node_id not in gen.assignment:
            ranges.append((k.nodes_prefix, False))
        if leading:
            ranges += [(k.drains_prefix, False), (k.drained_prefix, False)]
        return tuple(ranges)

    def _take_generation(self, raw: bytes) -> None:
        try:
            gen = decode(Generation, raw, self.keys.generation)
        except RecordError as exc:
            if str(exc) not in self._reported:
                self._reported.add(str(exc))
                log.error("[%s] %s", self.node_id, exc)
            return
        if self._generation is None or gen.number >= self._generation.number:
            self._generation = gen
            self.metrics.on_generation(gen)

    async def _sleep(self, seconds: float) -> None:
        await wait_event(self._stop, seconds)

    # -- the node record ----------------------------------------------------------------------

    def _make_record(
        self,
        state: NodeState,
        generation: int,
        exit_codes: dict[str, int] | None = None,
        failure: tuple[str, str] = ("", ""),
    ) -> NodeRecord:
        return NodeRecord(
            node_id=self.node_id,
            host=socket.gethostname(),
            addr=self.addr,
            pid=os.getpid(),
            nproc=self.cfg.nproc_per_node,
            standby_only=self.cfg.standby,
            state=state,
            generation=generation,
            restarts=max(0, self._starts - 1),
            master_port=free_port("0.0.0.0"),
            updated_at=self._clock(),
            exit_codes=exit_codes or {},
            runtime=len(self.link.state.hello) >= self.cfg.nproc_per_node,
            fault=self._fault,
            failure=failure[0],
            message=failure[1],
            probe_port=self._probe_port,
            peer_lost_at=self.link.state.peer_lost_at,
            compute_s=round(self._compute_s(), 6),
        )

    async def _publish(
        self,
        state: NodeState,
        generation: int | None = None,
        exit_codes: dict[str, int] | None = None,
        failure: tuple[str, str] = ("", ""),
    ) -> None:
        gen = self._worker_gen if generation is None else generation
        previous = self._record.state if self._record else None
        # The record is this node's state from now on, sent again by the loop until etcd has it:
        # a failure reported while etcd is unreachable must reach the controller when it is back.
        self._record, self._record_unsent = self._make_record(state, gen, exit_codes, failure), True
        if previous is not state:
            self.events.emit("node_state", gen, state=state.value, previous=previous.value if previous else None)
        await self._send_record()

    async def _send_record(self) -> None:
        assert self._record is not None
        await self.store.put(self.keys.node(self.node_id), encode(self._record), lease=self._lease)
        self._record_unsent = False

    async def _try_publish(self, state: NodeState) -> None:
        try:
            await self._publish(state)
        except StoreError as exc:
            log.warning("[%s] could not publish state %s: %s", self.node_id, state.value, exc)

    async def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        gen = self._generation
        return {
            "node_id": self.node_id,
            "job_id": self.cfg.job_id,
            "generation": gen.number if gen else 0,
            "ranks": gen.ranks_of(self.node_id) if gen else [],
            "state": self._record.state.value if self._record else None,
        }
