"""A standby's join: given ranks, it takes its place in the groups, receives the state, and lands
the rest of it (the optimizer's) while its first step runs.

:meth:`Joining.join` waits for the plan that gives this standby ranks, moves its mesh groups to the
lines of its new rank, builds the move's communicators (phase 1 of :mod:`rlaunch.runtime.migration`),
leaves the sandbox and receives the parameters. The optimizer state lands in the background; a hold
on the optimizers (:mod:`rlaunch.runtime.pending`) makes whatever reads it first wait for
:meth:`Joining.land`, which verifies all of it once, before the first vote. Where the job keeps its
host snapshot across the drain, the transfer header names it, and once the state landed the same
channel brings the leaver's copies of it (:mod:`rlaunch.runtime.handover`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlaunch.errors import RlaunchError, TransferBrokenError
from rlaunch.plans import Role
from rlaunch.runtime import handover, pending, reshard, sandboxgroups
from rlaunch.runtime.agent_link import AgentLinkError
from rlaunch.runtime.groups import retire
from rlaunch.runtime.grouptable import WORLD
from rlaunch.runtime.migration import Migration
from rlaunch.runtime.moves import Moves
from rlaunch.runtime.phases import MovePhases, Phase
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.registry import register, unregister
from rlaunch.runtime.snapshots import HostSnapshots
from rlaunch.runtime.transfer import Landing, TransferError, receive_state
from rlaunch.runtime.voting import Voting

log = logging.getLogger(__name__)


class Joining:
    """A standby's way into the job, and the landing of the state it received (see the module docstring)."""

    def __init__(
        self,
        s: RankState,
        migration: Migration,
        moves: Moves,
        voting: Voting,
        host: HostSnapshots,
        start_listener: Callable[[], None],
    ) -> None:
        self._s = s
        self._migration = migration
        self._host = host
        self._moves = moves
        self._voting = voting
        self._start_listener = start_listener
        #: the transfer whose optimizer state still lands during the first step: the landing, its
        #: channel and the hold on the optimizers' state (see land)
        self._held: tuple[Landing, Any, pending.Held] | None = None
        self._kept = -1  # the host snapshot the leaver hands over on the same channel (-1: none)
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside land (a signal handler may re-enter it)
        #: a landing that failed: every later land raises it again, so no step applies on partial state
        self._failed: BaseException | None = None

    def rebind_mesh(self, rank: int) -> None:
        """(joiner) Move the mesh's dimension groups to the lines of ``rank``, before they are rebuilt.

        The group table renames them where they stand, so the joiner builds its groups in the
        survivors' order.
        """
        s = self._s
        if s.mesh is None:
            return
        for old, group, new in s.mesh.rebind(rank):
            s.groups.rename(old, new)
            register(group, s.store, {g: i for i, g in enumerate(group.members)})

    def join(self) -> int:
        """Wait to be given ranks, build the new groups, receive state; return the next step."""
        s = self._s
        assert s.link is not None
        if not s.tracked:
            raise RuntimeError(
                "rt.track() was not called before rt.steps(): a standby has nothing to receive its state into; "
                "call rt.track(model=..., optimizer=...) first."
            )
        plan = self._migration.wait_plan(0)
        began = time.perf_counter()
        phases = MovePhases(plan.generation, Role.JOINER.value)
        phases.mark(Phase.PLAN_SEEN)
        s.rank = plan.rank
        self.rebind_mesh(s.rank)
        comms = self._migration.prepare(plan)
        phases.mark(Phase.PREPARED)
        s.standby = False
        self.leave_sandbox(comms, plan.generation)
        phases.mark(Phase.GROUPS_SWAPPED)
        reshard.to_coordinate(s.tracked)  # uneven shards: rank 0's shapes become this rank's
        phases.mark(Phase.TRANSFER_START)
        link = s.link

        def joined(landing: Landing) -> None:
            """(landing thread) Every byte is here: the sender may go. The agent hears it now, before the
            leaver is drained (a leaver gone before its joiner joined is a stalled move, restarted)."""
            try:
                link.call(
                    "joined", generation=plan.generation, seconds=time.perf_counter() - began,
                    verify_s=landing.verify_s,
                )  # fmt: skip
            except (OSError, AgentLinkError) as exc:  # the agent is gone: it stops this worker anyway
                log.warning("rank %d: the agent did not hear that the state landed: %s", s.rank, exc)

        with self._broken_transfer():
            landing = receive_state(comms["channel"], s.tracked, rank=s.rank, learn=self._learn, on_landed=joined)
        phases.mark(Phase.PARAMS_LANDED)
        s.after_move = phases
        # The first step runs while the optimizer state lands: whatever reads it first waits for it.
        optimizers = [o for o in s.tracked.values() if isinstance(o, torch.optim.Optimizer)]
        hold = pending.hold(optimizers, self.land)
        self._held = (landing, comms["channel"], hold)
        s.applied = landing.step - 1
        s.generation = plan.generation
        if self._kept >= 0:
            self._host.expect(plan.generation, self._kept, landing.step)
        s.verify_due = True  # the first vote after joining compares the replicas
        if not hold.whole:
            self.land()  # an optimizer whose state nothing could guard: it is whole before the step
        self._start_listener()
        return landing.step

    def land(self) -> None:
        """(joiner) Wait for the rest of the state and verify all of it, once, before anything reads
        the optimizer state: before the first vote (a move that does not verify is committed nowhere:
        this rank never votes, the others' vote fails and they redo the step without it), before a host
        snapshot, at the first step's end, and wherever the script reads an optimizer's ``state``."""
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise RlaunchError(
                    f"rank {self._s.rank}: the optimizer state was read by code that interrupted its own landing (a "
                    "signal handler that saves a checkpoint during a joiner's first step); it cannot wait for itself, "
                    "so this worker stops: save from the training loop, or after rt.optimizer_step(), instead."
                )
            self._lock.acquire()
        self._owner = threading.get_ident()
        try:
            self._land_locked()
        finally:
            self._owner = None
            self._lock.release()

    def _land_locked(self) -> None:
        if self._failed is not None:
            # Caught by the script once (a retry loop, a logging hook): the state is still partial, so
            # no step may apply on it.
            raise RlaunchError(
                f"rank {self._s.rank}: the state this joiner received did not land whole ({self._failed}); "
                "it cannot train on, so this worker stops."
            ) from self._failed
        held, self._held = self._held, None
        if held is None:
            return
        landing, channel, hold = held
        s = self._s
        assert s.after_move is not None
        try:
            with self._broken_transfer():
                landed = landing.finish()  # reads no optimizer's state: the hold stands until it is whole
        except BaseException as exc:
            # The hold stays: every later read of the partial state (a checkpoint a script saves after
            # catching this) raises too.
            self._failed = exc
            retire(channel)  # one use only (an NCCL channel is aborted when retired)
            raise
        hold.release()
        if self._kept >= 0:  # the leaver's snapshot copies follow on the channel, which retires after them
            self._host.receive(channel)
        else:
            retire(channel)
        s.after_move.mark(Phase.TRANSFER_END, landing.landed_at or None)
        s.after_move.mark(Phase.VERIFIED)
        # The vote of its first step compares what landed, as digested: no second pass over it. (The other
        # ranks read theirs at that vote: a survivor's state corrupted after the boundary is caught.)
        self._voting.prime(landed.terms, landing.step)
        # From what it learnt: it takes host snapshots when the others do. (Its checks walk the
        # optimizer state: not before it is whole, or the first step would wait for it.)
        self._moves.report()

    def _learn(self, known: dict[str, Any]) -> None:
        """(joiner) What the leaver knows, and the host snapshot it hands over after the state (if any)."""
        self._moves.learn(known)
        kept = known.get(handover.KEY, -1)
        if not isinstance(kept, int) or isinstance(kept, bool) or kept < -1:
            raise TransferError(
                f"rank {self._s.rank}: the transfer header names the host snapshot {kept!r} to hand over, not a step; "
                "is the sender another rlaunch version? This standby does not take the rank."
            )
        self._kept = kept

    @contextlib.contextmanager
    def _broken_transfer(self) -> Iterator[None]:
        """A transfer whose sender went away or never came (the job ended, or it died) is a
        :class:`TransferBrokenError`; a refused one stays a :class:`TransferError`."""
        try:
            yield
        except TransferError:
            raise
        except (RuntimeError, TimeoutError) as exc:
            raise TransferBrokenError(
                f"The state transfer for rank {self._s.rank} broke off ({str(exc).splitlines()[0]}): its sender is "
                "gone, so this standby cannot take the rank and stops; if the job still runs, the controller plans "
                "again."
            ) from exc

    def leave_sandbox(self, comms: dict[str, Any], generation: int) -> None:
        """(joiner) Take this rank's place in every group: a group with this rank gets its communicator
        of ``generation`` and is known to torch with its members only; one without it is held as an
        active non-member holds it, with no communicator (its sandbox's would answer collectives
        with made-up data) and unknown to torch. torch's own ``new_group`` is put back (see
        :mod:`rlaunch.runtime.sandboxgroups`)."""
        s = self._s
        sandboxgroups.leave()
        for group in s.groups:
            group.group_rank = group.members.index(s.rank) if s.rank in group.members else -1
            if group.label in comms:
                group.swap(comms[group.label], generation)
                if group.label != WORLD:
                    register(group, s.store, {g: i for i, g in enumerate(group.members)})
            elif group.group_rank < 0:
                unregister(group)
                group.comm = None
