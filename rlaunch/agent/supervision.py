"""Worker supervision: spawn this node's workers, watch them for hangs, stop or reap them.

The agent's coordinator decides *when* workers start and stop (see
:mod:`rlaunch.agent.transitions`); this module does it. It owns the node's one
:class:`~rlaunch.agent.workers.WorkerGroup` at a time: rank workers with torchrun's environment,
or a standby's sandbox workers, whose console lines and files follow the launch's log policy.
It also reaps stray zombie descendants now and then (the agent is a child subreaper).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rlaunch.agent.config import LaunchConfig
from rlaunch.agent.env import standby_env, worker_env
from rlaunch.agent.logs import LogPolicy
from rlaunch.agent.states import SHUTDOWN_GRACE_S
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.agent.workers import WorkerGroup, reap_orphans
from rlaunch.store.records import Generation

log = logging.getLogger(__name__)

#: How often stray zombie descendants are reaped (scanning /proc is not free).
REAP_EVERY_S = 5.0


class Supervisor:
    """This node's running worker group (at most one), and how it is started, checked and stopped."""

    def __init__(
        self,
        cfg: LaunchConfig,
        link: WorkerLink,
        emit: Callable[..., None],
        control_path: Callable[[], str],
        host_addr: str,
        python: str,
        log_root: Path | None,
        keep_pids: Sequence[int] = (),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self._link = link
        self._emit = emit
        self._control_path = control_path  # the agent's control socket, known once it serves
        self._host_addr = host_addr  # the address the agent advertises: its workers' gloo binds it
        self._python = python
        self._log_root = log_root
        self._keep_pids = tuple(keep_pids)
        self._monotonic = monotonic
        self.workers: WorkerGroup | None = None
        #: how many times rank workers were started (the node record's ``restarts`` is this less one)
        self.starts = 0
        #: sentences about local workers killed as hung, for the failure their exit is reported as
        self.hung: list[str] = []
        self._next_reap = 0.0

    @property
    def running(self) -> bool:
        return self.workers is not None

    # -- starting -----------------------------------------------------------------------------

    def start_workers(self, gen: Generation) -> None:
        """Start this node's workers for generation ``gen`` with torchrun's environment."""
        envs = [
            worker_env(
                os.environ,
                gen,
                node_id=self.node_id,
                local_rank=i,
                job_id=self.cfg.job_id,
                max_restarts=self.cfg.max_restarts,
                agent_addr=self._control_path(),
                host_addr=self._host_addr,
                role=self.cfg.role,
                verify_every=self.cfg.verify_every,
            )  # fmt: skip
            for i in range(gen.nproc_per_node)
        ]
        ranks = gen.ranks_of(self.node_id)
        group = self._spawn(gen, "active", envs, ranks, f"attempt_{gen.number}")
        self.starts += 1
        self._emit(
            "workers_started", gen.number, ranks=ranks, pids=group.pids,
            node_rank=gen.assignment[self.node_id], restart_count=gen.restart_count,
        )  # fmt: skip

    def start_sandbox(self, gen: Generation) -> None:
        """Start this standby's workers in sandbox mode: they warm up, then wait for ranks."""
        envs = [
            standby_env(
                os.environ,
                gen,
                node_id=self.node_id,
                local_rank=i,
                job_id=self.cfg.job_id,
                agent_addr=self._control_path(),
                host_addr=self._host_addr,
                role=self.cfg.role,
                verify_every=self.cfg.verify_every,
            )  # fmt: skip
            for i in range(gen.nproc_per_node)
        ]
        labels = [f"s{i}" for i in range(gen.nproc_per_node)]
        group = self._spawn(gen, "standby", envs, labels, "standby")
        self._emit("sandbox_started", gen.number, pids=group.pids)

    def _spawn(
        self, gen: Generation, role: str, envs: list[dict[str, str]], labels: list[int] | list[str], log_name: str
    ) -> WorkerGroup:
        """Start a worker group whose files (if any) go to ``<log root>/<job>/<node>/<log_name>/``."""
        attempt_dir = self._log_root / self.cfg.job_id / self.node_id / log_name if self._log_root else None
        policy = LogPolicy(
            self.node_id, self.cfg.redirects, self.cfg.tee, self.cfg.local_ranks_filter, attempt_dir,
            self.cfg.log_line_prefix_template, self.cfg.role,
        )  # fmt: skip
        self._link.reset(role, gen)
        group = WorkerGroup(self.cfg.command(self._python), envs, list(labels), policy)
        group.start()
        self.workers = group
        return group

    def relabel(self, gen: Generation) -> None:
        """The running workers took this node's ranks in ``gen`` (a standby's, or a restarted joiner's)."""
        assert self.workers is not None
        self.workers.relabel(gen.ranks_of(self.node_id))

    # -- checking -----------------------------------------------------------------------------

    def check_hangs(self, generation: int) -> None:
        """Kill local workers that made no progress within the hang timeout (their exit is a failure)."""
        if self.workers is None:
            return
        for hang in self._link.hangs.hung(self._monotonic()):
            self._link.hangs.forget(hang.local_rank)
            self.hung.append(hang.sentence())
            log.error("[%s] %s; killing it", self.node_id, hang.sentence())
            self._emit(
                "worker_hung", generation, local_rank=hang.local_rank, silent_s=round(hang.silent_s, 1),
                timeout_s=round(hang.timeout_s, 1), frozen=hang.frozen,
            )  # fmt: skip
            self.workers.kill(hang.local_rank)

    def poll(self) -> list[int | None] | None:
        """Each local worker's exit code (``None`` while it runs); ``None`` when no workers run."""
        return self.workers.poll() if self.workers is not None else None

    def reap_orphans(self) -> None:
        """Reap stray zombie descendants, at most every :data:`REAP_EVERY_S`."""
        if self._monotonic() >= self._next_reap:
            reap_orphans(self._keep_pids)
            self._next_reap = self._monotonic() + REAP_EVERY_S

    # -- stopping -----------------------------------------------------------------------------

    async def stop(self, generation: int, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Stop the running workers (if any), saying so in a ``workers_stopped`` event."""
        group, self.workers = self.workers, None
        if group is not None:
            codes = await asyncio.to_thread(group.stop, grace)
            self._emit("workers_stopped", generation, codes={str(i): c for i, c in enumerate(codes)})

    async def reap(self) -> list[int | None]:
        """Stop what is left of workers that exited (their process trees), quietly; return final codes."""
        group, self.workers = self.workers, None
        if group is None:
            return []
        return await asyncio.to_thread(group.stop, SHUTDOWN_GRACE_S)

    def forget(self) -> None:
        """The workers exited by themselves (0): nothing is left to stop."""
        self.workers = None

    async def reap_failed(self, generation: int, exit_codes: dict[str, int]) -> None:
        """Workers failed: stop the rest of them and report it in a ``workers_failed`` event."""
        final = await self.reap()
        log.error(
            "[%s] worker(s) failed in generation %d: exit codes %s (by local rank)",
            self.node_id,
            generation,
            exit_codes,
        )
        self._emit(
            "workers_failed",
            generation,
            exit_codes=exit_codes,
            final_codes={str(i): c for i, c in enumerate(final)},
        )

    def take_hung(self) -> list[str]:
        """The hang sentences gathered since the workers last failed, forgetting them."""
        hung, self.hung = self.hung, []
        return hung
