"""The node agent: joins the job through etcd, runs its node's workers, relays generations.

One agent runs per machine (``rlaunch train.py``). It
1. checks or writes the job spec and registers its node record under a lease it keeps alive
   (:mod:`rlaunch.agent.join`, :mod:`rlaunch.agent.lease`);
2. campaigns for the controller role (see :mod:`rlaunch.controller.controller`);
3. watches the job's keys (:mod:`rlaunch.agent.generations`); for each new generation it stops its
   workers, acknowledges, waits until the controller says every assigned node has acknowledged
   (so no worker meets a previous generation's rendezvous), then starts its workers with torchrun's environment
   (:mod:`rlaunch.agent.supervision`); a migration or replacement keeps them and hands them a plan;
4. reports its workers' success or failure on its node record (:mod:`rlaunch.agent.record`), for
   the controller to act on;
5. stops its workers when it receives SIGTERM/SIGINT, and kills them at once when it is fenced:
   when etcd answers that its lease is gone, or a generation gives its ranks to others. An etcd
   that does not answer is no such evidence; the workers go on (see :mod:`rlaunch.agent.lease`);
6. starts again any of its background tasks (the lease renewal, the watch, the controller...) that
   ends by an error, and says so (:mod:`rlaunch.agent.background`).

This module is the coordinator: it turns what it observes into observations, asks the pure
state machine in :mod:`rlaunch.agent.transitions` what to do, and carries the actions out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlaunch.addresses import route_addr
from rlaunch.agent import states as st
from rlaunch.agent.background import MAX_PAUSE_S, keep_running
from rlaunch.agent.config import LaunchConfig, Std
from rlaunch.agent.control import ControlServer
from rlaunch.agent.faults import Faults
from rlaunch.agent.generations import GenerationWatch
from rlaunch.agent.join import join_job
from rlaunch.agent.lease import LeaseKeeper, keepalive_store
from rlaunch.agent.metrics import AgentMetrics
from rlaunch.agent.moves import NodeMoves, sentence
from rlaunch.agent.progress import ProgressReporter, progress_batch, progress_every_s
from rlaunch.agent.reach import Peer, PeerProbe
from rlaunch.agent.record import RecordPublisher
from rlaunch.agent.supervision import Supervisor
from rlaunch.agent.transitions import decide
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.agent.workers import become_subreaper
from rlaunch.controller.controller import Controller
from rlaunch.controller.feed import NodeFeed
from rlaunch.controller.planner import PlannerConfig
from rlaunch.controller.view import read_snapshot
from rlaunch.detectors.gpu import make_gpu_health, watch_gpus
from rlaunch.detectors.liveness import serve
from rlaunch.errors import StoreError
from rlaunch.events import EventLog
from rlaunch.store.client import Endpoint, Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Ack, DrainedMark, Generation, NodeState, encode
from rlaunch.store.security import EtcdSecurity
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: How often the GPU health detector runs (NVML queries are local; no etcd traffic).
HEALTH_EVERY_S = 2.0
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
        monotonic: Callable[[], float] = time.monotonic,
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
        self._monotonic = monotonic
        self._python = python
        self._spec = cfg.spec()
        self._lease = 0
        #: the state machine's node: this agent's state and what it remembers (see transitions)
        self.node = st.Node()
        self._etcd_warned_at = -ETCD_WARN_EVERY_S
        self._prepared_reported: set[int] = set()
        self.moves = NodeMoves(cfg.nproc_per_node)  # which live moves the node's ranks allow, as published
        self._signal: int | None = None
        self._fenced: str | None = None
        self._keeper: LeaseKeeper | None = None  # while the lease is kept: how long etcd has been silent
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
        #: the node records the controller plans from, kept from this agent's watch while it leads
        self._feed = NodeFeed()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        become_subreaper()
        await self.store.connect(self.cfg.rdzv_timeout)
        self.addr = self.cfg.local_addr or route_addr(self.store.endpoint.host, self.store.endpoint.port)
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
        self._probe_server, self._probe_port = await serve(self._probed)
        self.link = WorkerLink(
            self.store, self.keys, lambda: self._lease, self.events.emit, self._wake.set, self.events.note,
            emit_with_record=self.events.emit_with_record,
        )  # fmt: skip
        self.link.node_id = self.node_id
        self.link.sandbox_steps = self.cfg.sandbox_steps
        self.link.hangs.floor_s = self.cfg.hang_timeout
        self.link.metrics = self.metrics
        self.reach = PeerProbe(self.node_id, self.link.hangs, self._peers, self._clock, self._monotonic)
        self.workers = Supervisor(
            self.cfg, self.link, self.events.emit, lambda: self.control.path, self.addr, self._python, self._log_root,
            self._keep_pids, self._monotonic,
        )  # fmt: skip
        self.records = RecordPublisher(
            self.store, self.keys, self.cfg, self.link, self.events.emit, addr=self.addr,
            probe_port=self._probe_port, lease=lambda: self._lease,
            restarts=lambda: max(0, self.workers.starts - 1), fault=lambda: self.faults.sentence,
            moves=lambda: self.moves.current, reach=lambda: self.reach.current, clock=self._clock,
            monotonic=self._monotonic, put=self.events.put_with,
        )  # fmt: skip
        self.faults = Faults(self.node_id, self.store, self.keys, self.records, self.events.emit, self._wake.set,
                             self._clock)  # fmt: skip
        self.link.on_sdc = lambda local, report: self.faults.sdc_suspected(local, report, self.node.worker_gen)
        self.watch = GenerationWatch(
            self.store, self.keys, self.node_id, self._wake.set, self._ctl_wake.set, self.metrics.on_generation,
            self._feed,
        )  # fmt: skip
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
                self._lease, self.events, self._clock, self.cfg.straggler_window, self._feed,
            )  # fmt: skip
            self.metrics.watch_controller(lambda: controller.leading, lambda: controller.stragglers_watched)
            self._gpu = make_gpu_health()
            # (name, body, longest pause before it starts again: see rlaunch.agent.background)
            background: list[tuple[str, Callable[[], Awaitable[object]], float]] = [
                ("the GPU health checks", self._watch_gpus, MAX_PAUSE_S),
                ("the lease renewal", self._keepalive, self.cfg.lease_ttl / 3),
                ("the probes of stalled peers", self._probe_peers, MAX_PAUSE_S),
                ("the watch of the job's generations", lambda: self.watch.run(self._stop), MAX_PAUSE_S),
                ("the controller", lambda: controller.run(self._stop, self._ctl_wake), MAX_PAUSE_S),
                ("the progress samples", lambda: progress.run(lambda: self.node.worker_gen, self._stop), MAX_PAUSE_S),
            ]
            tasks = [
                loop.create_task(keep_running(name, start, self._stop, self._task_failed, self.node_id, most))
                for name, start, most in background
            ]
            return await self._loop()
        finally:
            self._stop.set()
            await self.workers.stop(self.node.worker_gen)
            for task in tasks:
                task.cancel()
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

    def _task_failed(self, name: str, error: str, failures: int) -> None:
        """A background task ended by an error and starts again (see rlaunch.agent.background)."""
        self.events.emit("agent_task_failed", self.node.worker_gen, task=name, error=error, failures=failures)

    def _probed(self, generation: int) -> None:
        """The controller's probe round for ``generation`` reached this node: a peer loss its workers saw
        before, in that generation or an earlier one, needs no report (see rlaunch.agent.loss)."""
        self.link.state.loss.probed(time.monotonic(), generation)

    def _on_signal(self, sig: int) -> None:
        self._signal = sig
        self._wake.set()

    async def _join(self) -> None:
        """Agree on the job spec (writing it if first) and register this node atomically."""
        record = self.records.make(NodeState.WAITING, 0)
        await join_job(
            self.store, self.keys, self._spec, record, self._lease, self.cfg.rdzv_timeout,
            lambda s: wait_event(self._stop, s),
        )  # fmt: skip
        self.records.joined(record)
        self.events.emit("node_joined", 0, host=record.host, addr=record.addr, standby=self.cfg.standby)

    # -- the main loop ------------------------------------------------------------------------

    async def _loop(self) -> int:
        while True:
            if self._signal is not None:
                return await self._decide(st.Signalled(signal.Signals(self._signal).name))
            if self._fenced is not None:
                return await self._decide(st.Fenced(self._fenced))
            lost = self._etcd_lost()
            if lost is not None:
                code = await self._carry_out(decide(self.node, lost))
                if code is not None:
                    return code
            try:
                await self.records.resend()
                await self.faults.resend()
                code = await self._look()
                if code is not None:
                    return code
                if self.node.state in (st.AgentState.ACTIVE, st.AgentState.SETTLING, st.AgentState.LEAVING):
                    self.workers.check_hangs(self.node.worker_gen)
                await self._check_workers()
                await self._sync_link()
            except StoreError as exc:
                now = self._monotonic()
                quiet = now - self._etcd_warned_at < ETCD_WARN_EVERY_S  # (one line per outage round)
                self._etcd_warned_at = self._etcd_warned_at if quiet else now
                log.log(logging.DEBUG if quiet else logging.WARNING, "[%s] etcd request failed, will retry: %s",
                        self.node_id, exc)  # fmt: skip
            self.workers.reap_orphans()
            timeout = self.cfg.monitor_interval if self.workers.running else 1.0
            await wait_event(self._wake, timeout)
            self._wake.clear()

    def _etcd_lost(self) -> st.EtcdLost | None:
        """etcd silent for ``--rdzv-timeout`` or longer (the state machine decides what that ends)."""
        silent = self._keeper.unreachable_s() if self._keeper is not None else 0.0
        if silent < self.cfg.rdzv_timeout:
            return None
        record = self.records.record
        return st.EtcdLost(silent, self.cfg.rdzv_timeout, record.state if record is not None else None)

    async def _look(self) -> int | None:
        """Bring this node in line with the current generation; an int means: exit with it."""
        gen = self.watch.generation
        uses_runtime: bool | None = None
        while True:
            obs = self._observe(gen, uses_runtime)
            decision = decide(self.node, obs)
            code = await self._carry_out(decision)
            if code is not None or decision.need is None:
                return code
            assert gen is not None
            if decision.need is st.Need.RUNTIME and uses_runtime is None:
                # (re-read only when the watch saw node records change)
                snap = await self.watch.read_changed_nodes(lambda: read_snapshot(self.store, self.keys))
                uses_runtime = any(snap.nodes[n].record.runtime for n in gen.assignment if n in snap.nodes)
            else:
                raise st.IllegalTransition(f"The decision needed {decision.need.value} again after it was read.")

    def _observe(self, gen: Generation | None, uses_runtime: bool | None) -> st.Look:
        record = self.records.record
        published = st.Published(record.state, record.generation, record.exit_codes) if record else None
        state = self.link.state
        return st.Look(
            gen, self.node_id, self.cfg.nproc_per_node, published, self.faults.sentence, frozenset(state.left),
            len(state.warm), self.watch.nodes_changed, uses_runtime,
        )  # fmt: skip

    async def _decide(self, obs: st.Observation) -> int:
        """Carry out the decision on a final observation (a signal, fencing); return the exit code."""
        code = await self._carry_out(decide(self.node, obs))
        assert code is not None
        return code

    async def _carry_out(self, decision: st.Decision) -> int | None:
        """Take each step (the node first, then its action); return the exit code if one says so."""
        for step in decision.steps:
            self.node = step.node
            code = await self._do(step.action)
            if code is not None:
                self.node = decision.node
                return code
        self.node = decision.node
        if self.node.state.workers_run != self.workers.running:
            raise st.IllegalTransition(
                f"The agent is {self.node.state.value} but its workers {'' if self.workers.running else 'do not '}run."
            )
        return None

    async def _do(self, action: st.Action) -> int | None:  # noqa: PLR0911, PLR0912 - one branch per action
        if isinstance(action, st.StopWorkers):
            await self.workers.stop(action.event_gen, action.grace)
        elif isinstance(action, st.StartWorkers):
            self.workers.start_workers(action.gen)
        elif isinstance(action, st.StartSandbox):
            self.workers.start_sandbox(action.gen)
        elif isinstance(action, st.Offer):
            self.link.offer(action.gen, action.role, self.cfg.nproc_per_node)
            if action.role == "joiner":
                self.workers.relabel(action.gen)
        elif isinstance(action, st.ForgetWorkers):
            self.workers.forget()
        elif isinstance(action, st.ReapFailed):
            await self.workers.reap_failed(action.generation, dict(action.exit_codes))
            self.workers.take_hung()
        elif isinstance(action, st.ReapSandbox):
            await self.workers.reap()
            # Forget their hellos: a standby without workers must never look ready for a drain.
            self.link.reset("standby", self.watch.generation)
        elif isinstance(action, st.Publish):
            codes = dict(action.exit_codes) if action.exit_codes is not None else None
            if action.best_effort:
                await self.records.try_publish(action.state, action.generation)
            else:
                await self.records.publish(action.state, action.generation, codes, action.failure)
        elif isinstance(action, st.Acknowledge):
            ack = Ack(node_id=self.node_id, generation=action.gen)
            await self.store.put(self.keys.ack(action.gen, self.node_id), encode(ack), lease=self._lease)
            if action.previous:
                await self.store.delete(self.keys.ack(action.previous, self.node_id))
        elif isinstance(action, st.MarkDrained):
            mark = DrainedMark(node_id=self.node_id, generation=action.gen, replaced_by=action.replaced_by,
                               at=self._clock())  # fmt: skip
            await self.store.put(self.keys.drained(self.node_id), encode(mark))
        elif isinstance(action, st.Emit):
            emit = self.events.emit_with_record if action.with_record else self.events.emit
            emit(action.name, action.gen, **action.fields)
        elif isinstance(action, st.Log):
            log.log(action.level, "[%s] %s", self.node_id, action.message)
        elif isinstance(action, st.Exit):
            return action.code
        else:
            raise st.IllegalTransition(f"Unknown action {action!r}.")
        return None

    async def _check_workers(self) -> None:
        codes = self.workers.poll()
        if codes is None or all(c is None for c in codes):
            return
        gen = self.watch.generation
        state = self.link.state
        obs = st.WorkersExited(
            tuple(codes), gen.number if gen else 0, frozenset(state.left), tuple(self.workers.hung),
            state.unrecoverable, self.faults.sentence,
        )  # fmt: skip
        await self._carry_out(decide(self.node, obs))

    async def _sync_link(self) -> None:
        """Publish what the workers reported: runtime use, and readiness for a migration."""
        state, record = self.link.state, self.records.record
        uses_runtime = len(state.hello) >= self.cfg.nproc_per_node
        if record is not None and record.runtime != uses_runtime and self.workers.running:
            await self.records.republish()
        record = self.records.record
        state.loss.to_say(time.monotonic())  # the worker link's clock
        if record is not None and state.loss.said_at > record.peer_lost_at:
            await self.records.republish()  # the controller probes
        if self.records.record is not None and self.records.compute_moved():
            self.records.compute_published()
            await self.records.republish()
        if self.node.state is st.AgentState.SETTLING:
            gen = self.node.worker_gen
            done = state.joined.get(gen, set()) | state.recovered.get(gen, set())
            if len(done) >= self.cfg.nproc_per_node:
                await self._carry_out(decide(self.node, st.Settled()))
        for gen, ranks in state.prepared.items():
            if len(ranks) >= self.cfg.nproc_per_node and gen not in self._prepared_reported:
                self._prepared_reported.add(gen)
                self.events.emit("prepared", gen)
        await self._sync_moves()

    async def _sync_moves(self) -> None:
        """Publish the node's live moves summary once every local rank reported, and when it changes."""
        previous = self.moves.update(self.link.state.moves)
        if previous is None:
            return
        moves, reason = self.moves.current
        log.info("[%s] live moves: %s", self.node_id, sentence(moves, reason))
        self.events.emit("live_moves", self.node.worker_gen, moves=moves.value, reason=reason,
                         previous=previous.value)  # fmt: skip
        if self.records.record is not None:
            await self.records.republish()

    # -- background tasks ---------------------------------------------------------------------

    async def _keepalive(self) -> None:
        """Keep the lease alive; fence this node only when etcd answers that the lease is gone."""
        store = keepalive_store(self.store)
        keeper = self._keeper = LeaseKeeper(
            store, self._lease, self.cfg.lease_ttl, self.node_id,
            sleep=lambda s: wait_event(self._stop, s), on_back=self._etcd_back,
        )  # fmt: skip
        try:
            why = await keeper.run()
        finally:
            self._keeper = None
            await store.close()
        if why is not None:
            self._fenced = f"This agent stops its workers and exits because {why}."
            self._wake.set()

    async def _probe_peers(self) -> None:
        """Probe the other agents while this node's workers are stalled on peers (see rlaunch.agent.reach)."""
        while not self._stop.is_set():
            watching = self.workers.running and self.node.state in (
                st.AgentState.ACTIVE, st.AgentState.SETTLING, st.AgentState.LEAVING,
            )  # fmt: skip
            try:
                if await self.reach.check(watching) and self.records.record is not None:
                    await self.records.republish()
            except StoreError as exc:
                log.warning("[%s] could not publish the probe report (sent again with the record): %s",
                            self.node_id, exc)  # fmt: skip
            await wait_event(self._stop, 1.0)

    async def _peers(self) -> list[Peer]:
        """Every node of the job as its record advertises it (read only for a probe round)."""
        snap = await read_snapshot(self.store, self.keys)
        return [Peer(n, v.record.addr, v.record.probe_port) for n, v in sorted(snap.nodes.items())]

    def _etcd_back(self, unreachable_s: float, remaining: int) -> None:
        self.events.emit(
            "etcd_back", self.node.worker_gen, unreachable_s=round(unreachable_s, 1), lease_ttl_left=remaining
        )  # fmt: skip
        self._feed.resync()  # its watch may have been silent meanwhile
        self._wake.set()
        self._ctl_wake.set()

    async def _watch_gpus(self) -> None:
        """The first GPU fault takes this node out of the job (its ranks go to a standby)."""
        result = await watch_gpus(self._gpu, self._stop, HEALTH_EVERY_S)
        if isinstance(result, str):
            log.info("[%s] %s", self.node_id, result)
            self.events.emit("gpu_health_off", 0, reason=result)
        elif result:
            self.events.emit("gpu_fault", self.node.worker_gen, faults=[dataclasses.asdict(f) for f in result])
            await self.faults.found("; ".join(f.sentence() for f in result))

    async def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        gen, record = self.watch.generation, self.records.record
        return {
            "node_id": self.node_id,
            "job_id": self.cfg.job_id,
            "generation": gen.number if gen else 0,
            "ranks": gen.ranks_of(self.node_id) if gen else [],
            "state": record.state.value if record else None,
        }
