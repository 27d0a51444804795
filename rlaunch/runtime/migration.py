"""Planned migration (a drain, a straggler moved), as one rank of the runtime takes part in it.

Phase 1 runs in the background, on the listener thread (:meth:`Migration.listen`): it takes each
plan the agent hands this rank. For a migration, the rank builds the next version of every group
that touches the moved ranks on fresh store prefixes, and the leaver and the joiner open a
transfer channel (:meth:`Migration.prepare`). The rank then reports ``prepared``, and its per-step
vote carries "ready" (:attr:`Migration.ready`); a replacement plan goes to
:class:`~rlaunch.runtime.recovery.Recovery` instead. Phase 2 comes at the boundary after the step
whose vote found every rank ready (:meth:`Migration.switch`): the leaver sends its state to the
joiner and exits 0, the others swap their affected groups in place. A standby joins through the
same plans (``Runtime._join`` uses :meth:`wait_plan` and :meth:`prepare`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from rlaunch.plans import Plan, ReplacePlan, Role, plan_from_json
from rlaunch.runtime import backend as backends
from rlaunch.runtime import rng
from rlaunch.runtime.groups import retire
from rlaunch.runtime.transfer import send_state

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A migration plan whose communicators (and transfer channel) phase 1 has built."""

    plan: Plan
    comms: dict[str, Any]


class Migration:
    """One rank's part in planned migrations: plans taken, communicators built, the switch."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._prepared: Prepared | None = None  # a plan whose communicators are built
        self._switch_to = 0  # the generation every rank voted ready for: switch at this step's end

    @property
    def ready(self) -> bool:
        """This rank built what the next generation needs (its vote says so).

        NCCL communicators count once their non-blocking setup is done: a rank votes ready only when
        the switch will not wait on them (a peer that fails while building one then delays the move,
        not the job).
        """
        prepared = self._prepared
        if prepared is None or prepared.plan.generation <= self._rt.generation:
            return False
        return all(backends.current().is_ready(comm) for comm in prepared.comms.values())

    def agree(self) -> None:
        """Every rank voted ready in this step: switch at its end."""
        self._switch_to = self._prepared.plan.generation  # type: ignore[union-attr]

    @property
    def due(self) -> bool:
        """A switch was agreed on and not made yet."""
        return self._switch_to != 0

    def listen(self) -> None:
        """Phase 1, in the background: take each plan, build what it needs, report ready."""
        rt = self._rt
        assert rt._link is not None
        after = rt.generation
        while True:
            try:
                plan = self.wait_plan(after)
                if rt._stopped.is_set():
                    # rt.steps() has ended: this rank is tearing down, and building communicators
                    # now would leave C++ threads running at exit (an abort). The move is moot.
                    return
                if isinstance(plan, ReplacePlan):
                    rt._recovery.on_replace(plan)
                    after = plan.generation
                    continue
                if not rt._tracked:
                    # Moving an empty state would corrupt the joiner: never report ready.
                    log.error(
                        "rank %d: a migration to generation %s was planned, but rt.track() was never called, "
                        "so this rank has no state to hand over; it will not switch (the drain times out).",
                        rt.rank, plan.generation,
                    )  # fmt: skip
                    return
                comms = self.prepare(plan)
            except Exception:  # noqa: BLE001 - a failed preparation must not kill training
                log.exception("rank %d: preparing for the next generation failed", rt.rank)
                return
            with self._lock:
                superseded, self._prepared = self._prepared, Prepared(plan, comms)
            for comm in superseded.comms.values() if superseded is not None else ():
                retire(comm)  # a later plan replaced it before the switch (an NCCL communicator is aborted)
            rt._link.call("prepared", generation=plan.generation)
            after = plan.generation

    def wait_plan(self, after: int) -> Plan:
        """The next plan after generation ``after`` this rank takes part in (blocks until there is one)."""
        assert self._rt._link is not None
        while True:
            plan = plan_from_json(self._rt._link.call("wait_plan", after=after))
            if plan is not None and plan.generation > after:
                return plan

    def prepare(self, plan: Plan) -> dict[str, Any]:
        """Build the communicators of ``plan`` that this rank needs (fresh store prefixes)."""
        rt = self._rt
        gen, role, moved = plan.generation, plan.role, set(plan.moved_ranks)
        comms: dict[str, Any] = {}
        if role is Role.LEAVER:
            comms["channel"] = rt._channel(gen, 0, rt.rank)
            return comms
        rank = plan.rank
        for name, group in rt._groups.items():
            if rank in group.members and moved & set(group.members):
                comms[name] = rt._group_comm(name, group.members, rank, gen)
        if role is Role.JOINER:
            comms["channel"] = rt._channel(gen, 1, rank)
        return comms

    def switch(self, next_step: int) -> None:
        """Phase 2, at the agreed boundary: move state (leaver) or swap groups (the others)."""
        rt = self._rt
        with self._lock:
            prepared, self._prepared, gen = self._prepared, None, self._switch_to
            self._switch_to = 0
        assert prepared is not None and rt._link is not None
        comms = prepared.comms
        if prepared.plan.role is Role.LEAVER:
            began = time.perf_counter()
            sent = send_state(comms["channel"], rt._tracked, next_step, rng.capture())
            rt._link.call("left", generation=gen, bytes=sent, seconds=time.perf_counter() - began)
            # Tearing this process down must not take CPU from the job it just left.
            os.nice(19)
            raise SystemExit(0)
        for name, comm in comms.items():
            rt._groups[name].swap(comm, gen)
        rt.generation = gen
        rt._measure_after_switch = True
