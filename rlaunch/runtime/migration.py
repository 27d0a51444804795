"""Planned migration (a drain, a straggler moved), as one rank of the runtime takes part in it.

Phase 1 runs in the background, on the listener thread (:meth:`Migration.listen`): it takes each
plan the agent hands this rank. For a migration, the rank builds the next version of every group
that touches the moved ranks on fresh store prefixes (the group table decides which, in its
build order), and the leaver and the joiner open a transfer channel (:meth:`Migration.prepare`).
The rank then reports ``prepared``, and its per-step vote carries the generation it is ready for
(:attr:`Migration.ready`); a replacement plan goes to :class:`~rlaunch.runtime.recovery.Recovery`
instead. A preparation that fails (etcd unreachable in the middle of it, say) is logged and the
listener goes on: the move stalls and the controller takes the restart path, but the rank still
receives every later plan. Phase 2 comes at the boundary after the step whose vote found every
rank ready for the same generation (:meth:`Migration.switch`): the leaver sends its state to the
joiner and exits 0, the others swap their affected groups in place. Where the job keeps its host
snapshot across a drain (:meth:`HostSnapshots.keeps <rlaunch.runtime.snapshots.HostSnapshots.keeps>`),
the leaver then hands its copies to the joiner before it exits (:mod:`rlaunch.runtime.handover`).
A standby joins through the same plans (:meth:`rlaunch.runtime.joining.Joining.join` uses
:meth:`wait_plan` and :meth:`prepare`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlaunch.plans import Plan, ReplacePlan, Role, plan_from_json
from rlaunch.runtime import backend as backends
from rlaunch.runtime import buckets, handover, rng
from rlaunch.runtime.agent_link import AgentLinkError
from rlaunch.runtime.groups import retire
from rlaunch.runtime.grouptable import GroupTable
from rlaunch.runtime.phases import MovePhases, Phase, report
from rlaunch.runtime.priority import yield_process
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.snapshots import HostSnapshots
from rlaunch.runtime.transfer import send_state

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A migration plan whose communicators (and transfer channel) phase 1 has built."""

    plan: Plan
    comms: dict[str, Any]
    phases: MovePhases  # the move's marks on this rank (see rlaunch.runtime.phases)


class Migration:
    """One rank's part in planned migrations: plans taken, communicators built, the switch.

    ``on_replace`` takes a replacement plan (the listener thread hands it over); ``refusal`` says
    why this rank cannot be drained live ("" when it can); ``knowledge`` is what a joiner must learn
    from the leaver besides the tracked state (see ``Runtime._knowledge``); ``host``: this rank's host
    snapshots, which a drain may keep.
    """

    def __init__(
        self,
        state: RankState,
        on_replace: Callable[[ReplacePlan], None],
        refusal: Callable[[], str],
        knowledge: Callable[[], dict[str, Any]],
        host: HostSnapshots,
    ) -> None:
        self._s = state
        self._host = host
        self._on_replace = on_replace
        self._refusal = refusal
        self._knowledge = knowledge
        self._lock = threading.Lock()
        self._prepared: Prepared | None = None  # a plan whose communicators are built
        self._offered: Prepared | None = None  # the one this rank's last vote said it is ready for
        self._agreed: Prepared | None = None  # the one every rank voted ready for: switch at this step's end

    @property
    def _groups(self) -> GroupTable:
        return self._s.groups

    @property
    def ready(self) -> int:
        """The generation this rank built everything for (0: none; the vote carries it).

        NCCL communicators count once their non-blocking setup is done: a rank votes ready only when
        the switch will not wait on them (a peer that fails while building one then delays the move,
        not the job). Nor before every tracked DDP rebuilt its gradient buckets, in its first steps
        (see :mod:`rlaunch.runtime.buckets`), nor while a host snapshot it took a few steps ago is
        still being exchanged (:meth:`HostSnapshots.exchanging`). The plan offered is remembered: the
        switch is to that one, even if the listener takes a newer plan meanwhile.
        """
        with self._lock:
            prepared = self._prepared
        self._offered = None
        if prepared is None or prepared.plan.generation <= self._s.generation:
            return 0
        if not all(backends.current().is_ready(comm) for comm in prepared.comms.values()):
            return 0
        if buckets.awaited(self._s.tracked, self._s.votes):  # the joiner's DDP rebuilt its buckets: this one's first
            return 0
        if self._host.exchanging():  # a drain agreed once it ended keeps the new snapshot (HostSnapshots.keeps)
            return 0
        self._offered = prepared
        prepared.phases.mark(Phase.READY_VOTED)
        return prepared.plan.generation

    def agree(self, generation: int) -> None:
        """Every rank voted ready for ``generation`` in this step: switch at its end (the vote's sums say
        all ranks offered the same generation; this rank switches to the plan it offered)."""
        offered = self._offered
        if offered is not None and offered.plan.generation == generation:
            self._agreed = offered

    @property
    def due(self) -> bool:
        """A switch was agreed on and not made yet."""
        return self._agreed is not None

    def listen(self) -> None:
        """Phase 1, in the background: take each plan, build what it needs, report ready."""
        s = self._s
        assert s.link is not None
        after = s.generation
        while True:
            try:
                plan = self.wait_plan(after)
            except (OSError, AgentLinkError) as exc:
                log.warning("rank %d: the agent no longer hands out plans (%s); no more moves here", s.rank, exc)
                return
            if s.stopped.is_set():
                # rt.steps() has ended: this rank is tearing down, and building communicators
                # now would leave C++ threads running at exit (an abort). The move is moot.
                return
            after = plan.generation
            try:
                self._take(plan)
            except Exception:  # noqa: BLE001 - a failed plan must not kill training, nor the listener
                log.exception(
                    "rank %d: preparing for generation %s failed; this move will not happen here, later plans will",
                    s.rank, plan.generation,
                )  # fmt: skip

    def _take(self, plan: Plan) -> None:
        """One plan, on the listener thread: a replacement goes to recovery; a migration is prepared
        (or refused), and supersedes whatever older one was prepared and not switched to."""
        s = self._s
        assert s.link is not None
        if isinstance(plan, ReplacePlan):
            self._on_replace(plan)
            return
        phases = MovePhases(plan.generation, plan.role.value)
        phases.mark(Phase.PLAN_SEEN)
        self._supersede(None)
        why = self._refusal()
        if why:
            # Moving what cannot be moved would corrupt the joiner: never report ready.
            log.error(
                "rank %d: a drain to generation %s was planned, but %s; this rank will not switch, so the drain "
                "stalls and the controller restarts the job without the drained node.",
                s.rank, plan.generation, why,
            )  # fmt: skip
            return
        comms = self.prepare(plan)
        phases.mark(Phase.PREPARED)
        self._supersede(Prepared(plan, comms, phases))
        s.link.call("prepared", generation=plan.generation)

    def _supersede(self, prepared: Prepared | None) -> None:
        """Make ``prepared`` the plan this rank is ready for; retire the older one's communicators
        (an NCCL communicator is aborted), unless the vote already agreed on it."""
        with self._lock:
            old, self._prepared = self._prepared, prepared
        if old is not None and old is not self._agreed and old is not self._offered:
            for comm in old.comms.values():
                retire(comm)

    def wait_plan(self, after: int) -> Plan:
        """The next plan after generation ``after`` this rank takes part in (blocks until there is one)."""
        assert self._s.link is not None
        while True:
            plan = plan_from_json(self._s.link.call("wait_plan", after=after))
            if plan is not None and plan.generation > after:
                return plan

    def prepare(self, plan: Plan) -> dict[str, Any]:
        """Build the communicators of ``plan`` that this rank needs (fresh store prefixes, in build order)."""
        gen, role = plan.generation, plan.role
        kind = self._groups["world"].backend
        comms: dict[str, Any] = {}
        if role is Role.LEAVER:
            comms["channel"] = self._groups.channel(gen, 0, self._s.rank, kind)
            return comms
        comms.update(self._groups.build(self._groups.touched(plan.rank, plan.moved_ranks), plan.rank, gen))
        if role is Role.JOINER:
            comms["channel"] = self._groups.channel(gen, 1, plan.rank, kind)
        return comms

    def switch(self, next_step: int) -> None:
        """Phase 2, at the agreed boundary: move state (leaver) or swap groups (the others)."""
        s = self._s
        agreed, self._agreed, self._offered = self._agreed, None, None
        assert agreed is not None and s.link is not None
        with self._lock:
            if self._prepared is agreed:
                self._prepared = None
        gen, comms, phases = agreed.plan.generation, agreed.comms, agreed.phases
        phases.mark(Phase.BOUNDARY)
        keep = self._host.keeps(next_step)  # alike on every rank: the agree vote's sums decide
        if agreed.plan.role is Role.LEAVER:
            began = time.perf_counter()
            phases.mark(Phase.TRANSFER_START)
            known = {**self._knowledge(), **({handover.KEY: self._host.committed} if keep else {})}
            # Once the joiner can start its first step, the rest of the state (the optimizer's) and this
            # process's end take what CPU the job leaves them: on a machine short of cores, the joiner's
            # and the survivors' steps come first.
            sent = send_state(comms["channel"], s.tracked, next_step, rng.capture(), known, first_sent=yield_process)
            phases.mark(Phase.TRANSFER_END)
            phases.transfer_bytes = sent
            seconds = time.perf_counter() - began
            report(s.link, s.rank, phases)  # before "left": the agent may stop this worker as soon as it hears that
            for group in self._groups:  # before "left": the agent's SIGTERM may come right after it
                group.leave(f"rank {s.rank} left the job at step {next_step}")
            if keep:  # on this thread, before "left": the agent stops this worker once it heard that
                handover.send(comms["channel"], *self._host.copies(), s.rank)
            s.link.call("left", generation=gen, bytes=sent, seconds=seconds)
            raise SystemExit(0)
        self._host.switched(gen, next_step, keep)
        self._groups.swap(comms, gen)
        phases.mark(Phase.GROUPS_SWAPPED)
        s.generation = gen
        s.after_move = phases
        s.verify_due = True  # the first vote of the new generation compares the replicas
