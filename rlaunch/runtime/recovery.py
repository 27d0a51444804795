"""Live replacement after a fault, as one surviving rank of the runtime takes part in it.

A failed collective, or the agent's word that a replacement is planned (:meth:`Recovery.on_replace`,
on the listener thread), marks the affected groups failed: the rest of the step's collectives
return at once and the step reaches ``rt.optimizer_step``. There the survivors apply the commit
rule of the per-step vote (:func:`commit_point`): each reports the last step it applied; if any
survivor applied step s, every survivor applies s (its gradients were synced, since the vote for s
needed every rank), else all discard s and redo it. Only the groups that touch the replaced ranks
(or failed on some survivor) are rebuilt. The replacement (a warm standby, or the failed node's
restarted workers) receives its state from a data-parallel replica, at the end of the step
(:meth:`Recovery.send_replicas`). A replacement that no replica can serve (sharded state without a
replicated dimension, per-rank state, parameters that differ by rank) rolls back instead, where
the job takes host snapshots: every survivor puts its own copy of the last committed snapshot
back, the lost rank's buddy sends the copy it holds to the joiner, and the steps since are redone
(:mod:`rlaunch.runtime.snapshots`). Without a snapshot that can serve, it is refused with a
sentence the agent puts on the node's failure, and the job restarts: before anything is written
where the job takes no snapshots, else once the survivors' reports say no snapshot can serve
(every survivor decides from the same reports, so all decide alike). In a loop a framework drives
(``rt.drive()``), a replacement where some survivor would roll forward is refused the same way
(:func:`driven_refusal`).

Two faults a few seconds apart give two plans; a survivor recovers to the newest one it holds, and
one that began the exchange of an older plan moves to the newer one as soon as it arrives (the
older exchange can never complete: its survivors include the second fault's ranks).
:class:`Recovery` holds what only recovery needs (the plans handed over by the listener, the
channels to send on) and reads and updates the rank's :class:`~rlaunch.runtime.rankstate.RankState`
on the main thread.
"""

from __future__ import annotations

import datetime
import json
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from rlaunch.plans import ReplacePlan
from rlaunch.runtime import buckets, rng, shards
from rlaunch.runtime.agent_link import AgentLinkError
from rlaunch.runtime.carried import Plan
from rlaunch.runtime.groups import retire
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.snapshots import HostSnapshots, Rollback, rollback
from rlaunch.runtime.stepstate import broadcasts, buffer_names, module_buffers
from rlaunch.runtime.transfer import send_state
from rlaunch.runtime.vote import RefusedError

#: How long one wait for the other survivors' reports lasts before this rank looks for a newer plan.
GATHER_POLL_S = 2.0


def commit_point(mine: int, step: int, applied: Sequence[int]) -> tuple[int, bool]:
    """The commit rule: the last step every survivor must have applied, and whether this rank
    applies ``step`` now (roll forward).

    ``mine`` is the last step this rank applied, ``step`` the one it is in, ``applied`` every
    survivor's last applied step (its own included). The vote for a step needs every rank, so
    survivors are at most one step apart, and if any of them applied ``step``, every rank
    finished its gradient sync for it: it is applied everywhere. Otherwise it is discarded.
    """
    agreed = max(applied)
    if not mine <= agreed <= mine + 1 or agreed > step:
        raise RuntimeError(
            f"The survivors' last applied steps {sorted(set(applied))} are inconsistent with this rank's {mine} "
            f"at step {step}; the recovery cannot be trusted, so this worker stops."
        )
    return agreed, agreed > mine


def driven_refusal(moved: Sequence[int], agreed: int, applied: Sequence[int]) -> str:
    """Why a loop a framework drives cannot be recovered live here ("" when it can): some survivor
    would roll forward (``applied``: every survivor's last applied step; ``agreed``: the commit point).

    That survivor goes on past step ``agreed``'s vote, into what the framework runs before the next
    step (Lightning's SIGTERM broadcast, the collectives of ``on_train_batch_end``), while the
    survivors that had applied it redo the next step from its start: their first collectives would
    be paired with the wrong ones. Every survivor decides from the same reports, so all refuse alike.
    """
    if min(applied) >= agreed:
        return ""
    return (
        f"a live replacement of ranks {list(moved)} cannot be made here: the fault came in step {agreed}'s vote, "
        "which some survivors applied and others did not, and a framework's loop cannot roll the survivors that did "
        f"not apply it forward: they would issue the collectives that follow the vote while the others redo step "
        f"{agreed + 1}"
    )


def after_vote_refusal(step: int, own: int) -> str:
    """Why no replica may stand in for a lost rank once step ``step`` of ``rt.steps()`` went past its
    vote on ``own`` collectives that handed this rank its own inputs ("" when none did).

    What a script runs after ``rt.optimizer_step`` (an evaluation, a metric reduced for a plateau
    scheduler or an early stop) is not run again by any redone step; a fault there makes its
    collectives give this rank its own values, which the script may have kept in what a joiner
    receives. A rollback to a host snapshot runs that code again; without one, the job restarts.
    """
    if own <= 0:
        return ""
    what = "a collective" if own == 1 else f"{own} collectives"
    return (
        f"{what} issued after step {step}'s vote (after rt.optimizer_step, such as an evaluation's or a metric's "
        "all_reduce) gave this rank its own values instead of the result across ranks, which the script may have "
        "kept, and no redone step runs them again (issue such collectives before rt.optimizer_step, or inside "
        "rt.alike() when their inputs are the same on every rank)"
    )


def first_refusal(reports: Sequence[dict[str, Any]], agreed: int) -> str:
    """Why no replica may serve the replaced ranks, from every survivor's report ("" when one may).

    Every survivor decides from the same reports: the first refusal any of them gave stands, then the
    first survivor that wrote parameters before the vote of a step the commit rule discards (one
    whose last applied step is the commit point ``agreed``: it is in the next step, which is redone).
    A survivor rolled forward applies the step it wrote them in, as every rank does.
    """
    refused = next((str(r["refused"]) for r in reports if r["refused"]), "")
    return refused or next((str(r["touched"]) for r in reports if r["touched"] and int(r["applied"]) == agreed), "")


def generation_split(reports: Sequence[dict[str, Any]], generation: int) -> str:
    """Why the survivors cannot recover to ``generation`` together ("" when they can): a drain's switch
    crossed the fault, and some survivors switched to the drain's groups while others did not, so
    the groups the replacement keeps would not match."""
    held = {int(r["rank"]): int(r["generation"]) for r in reports}
    if len(set(held.values())) <= 1:
        return ""
    return (
        f"the survivors of generation {generation} stand in different generations (rank: generation {held}): a "
        "drain's switch crossed the fault, so the groups they would keep do not match"
    )


def newest(plans: Sequence[ReplacePlan]) -> ReplacePlan:
    """The plan to recover to: the one of the highest generation (older ones were superseded)."""
    return max(plans, key=lambda p: p.generation)


class Recovery:
    """One rank's part in live replacements: from the plan's arrival to the replicas sent.

    ``refusal`` says why no replica can serve a replaced rank ("" when one can); ``sources`` picks
    the survivor that sends each replaced rank its state; ``knowledge`` is what the ranks learnt
    from completed votes (see :class:`~rlaunch.runtime.moves.Moves`), which a joiner receives and
    ``learn`` takes: survivors exchange it too, since a survivor rolled forward never read the
    vote the others completed.
    """

    def __init__(
        self,
        state: RankState,
        refusal: Callable[[], str],
        sources: Callable[[ReplacePlan, list[int]], tuple[dict[int, int], str]],
        knowledge: Callable[[], dict[str, Any]],
        learn: Callable[[dict[str, Any]], None],
        undrainable: Callable[[], str],
        host: HostSnapshots,
        touched: Callable[[], str],
    ) -> None:
        self._s = state
        self._touched = touched  # why redoing this step would diverge: parameters written before its vote
        self._undrainable = undrainable  # why no move at all could place this rank ("" when one can)
        self._host = host
        self._refusal = refusal
        self._sources = sources
        self._knowledge = knowledge
        self._learn = learn
        self._plans: queue.Queue[ReplacePlan] = queue.Queue()  # from the listener thread
        self._sends: dict[int, Any] = {}  # replaced rank -> channel, sent at the step boundary
        #: where the lost ranks' module buffers come from, as the survivors read their own (rlaunch.runtime.carried)
        self._plan: Plan = {}
        #: between a failed step's report to the agent and its recovery: waiting on peers, not hung
        self.active = False
        #: the recovery rolls back to a host snapshot (set from the agreement to the step boundary)
        self.rollback: Rollback | None = None

    @property
    def planned(self) -> bool:
        """A replacement was planned that this rank has not recovered from yet."""
        return not self._plans.empty()

    def on_replace(self, plan: ReplacePlan) -> None:
        """(listener thread) Ranks are being replaced: drop what waits on them, hand over the plan.

        Every group of this rank pauses first: a collective issued from now on returns at once,
        un-issued, since a peer that reached its recovery never issues its side (a tensor-parallel
        peer in the vote while this rank is still in backward). Then the groups that contain a
        replaced rank, and those with a collective in flight (which such a peer may never match),
        are abandoned: they are rebuilt, the others kept and resumed when the recovery ends.
        """
        moved = set(plan.moved_ranks)
        why = f"ranks {sorted(moved)} are being replaced (generation {plan.generation})"
        mine = self._s.groups.mine()
        for group in mine:
            group.paused = True
        for group in mine:
            if moved & set(group.members):
                group.abandon(why)
            elif group.busy:
                group.abandon(f"{why}, and one of its collectives was in flight")
        self._plans.put(plan)

    def _take_plan(self) -> ReplacePlan:
        """Wait for a plan, then take the newest of those that arrived (older ones are stale)."""
        s = self._s
        try:
            held = [self._plans.get(timeout=s.timeout.total_seconds())]
        except queue.Empty:
            raise RuntimeError(
                f"rank {s.rank}: a collective of step {s.step} failed and no replacement was planned within "
                f"{s.timeout.total_seconds():.0f} s; this worker exits so that its agent reports the failure."
            ) from None
        while True:
            try:
                held.append(self._plans.get_nowait())
            except queue.Empty:
                return newest(held)

    def _newer_than(self, plan: ReplacePlan) -> ReplacePlan | None:
        held = [plan]
        while True:
            try:
                held.append(self._plans.get_nowait())
            except queue.Empty:
                break
        best = newest(held)
        return best if best.generation > plan.generation else None

    def recover(self, apply: Callable[[], None]) -> bool:
        """(main thread) Agree on the last applied step and rebuild groups; True if this step applies.

        The state is sent to the replaced ranks at the end of the step (:meth:`send_replicas`), after
        the script's own per-step code (a scheduler step) ran, as a migration's leaver does.
        """
        s = self._s
        assert s.link is not None and s.store is not None
        began = time.perf_counter()
        self.active = True
        s.link.call("recovering", step=s.step)
        plan = self._take_plan()
        self._host.stop()  # what it holds no longer changes: it is reported next
        deadline = time.monotonic() + s.timeout.total_seconds()
        while True:
            gen, moved = plan.generation, set(plan.moved_ranks)
            # before DDP's bucket rebuild (a fault in the first step): the joiner's DDP has rebuilt, so a
            # redone step would hang (see rlaunch.runtime.buckets). A survivor whose rebuild's broadcast
            # failed partway may disagree: its refusal alone restarts the job.
            early = buckets.refusal(s.tracked, s.votes)
            if early:
                self._give_up(
                    plan.generation, f"a live replacement of ranks {sorted(moved)} cannot be made this early: {early}"
                )
            late, buffers = self._late_buffers()
            refused = s.after_vote or self._refusal() or late
            if refused and not self._host.enabled:
                self._give_up(plan.generation, self._diverges(sorted(moved), refused))
            survivors = [r for r in range(s.world_size) if r not in moved]
            dirty = sorted(g.label for g in s.groups.mine() if g.failed and not moved & set(g.members))
            report = {
                "rank": s.rank, "generation": s.generation, "applied": s.applied, "dirty": dirty,
                "knowledge": self._knowledge(),
                "refused": refused, "undrainable": self._undrainable(), "snapshot": self._host.report(moved),
                "buffers": {str(i): j for i, j in buffers.items()}, "touched": self._touched(),
            }  # fmt: skip
            s.store.set(f"g{gen}/recover/{s.rank}", json.dumps(report))
            try:
                # One exchange, O(1) store requests per survivor (not a read of every other's report).
                values = s.store.gather(
                    f"g{gen}/recover/", f"g{gen}/recovered", len(survivors), datetime.timedelta(seconds=GATHER_POLL_S)
                )
                break
            except AgentLinkError:
                # Not every survivor is here yet. If a newer plan superseded this one (a second fault),
                # the others recover to that one: so does this rank.
                newer = self._newer_than(plan)
                if newer is not None:
                    plan = newer
                elif time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rank {s.rank}: the survivors of generation {gen} did not all report within "
                        f"{s.timeout.total_seconds():.0f} s; the recovery cannot go on, so this worker stops."
                    ) from None
        reports = sorted((json.loads(v) for v in values), key=lambda r: int(r["rank"]))
        self._give_up(plan.generation, generation_split(reports, plan.generation))
        applied = [int(r["applied"]) for r in reports]
        agreed, rolled = commit_point(s.applied, s.step, applied)
        if s.driven:
            self._give_up(plan.generation, driven_refusal(sorted(moved), agreed, applied))
        refused = first_refusal(reports, agreed)
        sources, why = self._sources(plan, survivors) if not refused else ({}, refused)
        back = self._roll_back_to(plan, reports, why) if why else None
        if back is None and rolled:
            # Some survivor applied this step, so every rank finished its gradient sync: apply it.
            apply()
            s.applied = agreed
        # What a completed vote taught its ranks (what differs, the next comparison, the samplers'
        # parts): every survivor takes it from one that read the latest vote, so all decide alike.
        self._learn(min((r for r in reports if int(r["applied"]) == agreed), key=lambda r: int(r["rank"]))["knowledge"])
        # what the survivors that read the window the sends serve (after the commit point's vote) told
        self._plan = {
            int(i): j for r in reversed(reports) if int(r["applied"]) == agreed for i, j in r["buffers"].items()
        }
        dirty_names = {n for r in reports for n in r["dirty"]}
        comms = s.groups.build(s.groups.touched(s.rank, moved, also=dirty_names), s.rank, gen)
        if back is not None:
            sources = back.holders
        mine = sorted(m for m, src in sources.items() if src == s.rank)
        kind = s.groups["world"].backend
        self._sends = {m: s.groups.channel(gen, 0, m, kind) for m in mine}
        for group in s.groups:
            if group.label in comms:  # rebuilt after a fault: what its GPU ran since the last wait may be lost
                group.device_lost()
        s.groups.swap(comms, gen)
        if not self.planned:  # a newer plan came meanwhile: its pause stands until its own recovery
            for group in s.groups.mine():
                group.paused = False  # the kept groups: every member stopped at the same collective
        s.generation = gen
        resume = back.step if back is not None else agreed + 1
        if back is not None:
            s.applied = back.step - 1
        s.resume_at = resume
        self.rollback = back
        s.verify_due = True  # the first vote after the recovery compares the replicas
        s.after_vote = ""  # what the fault tainted after a vote was rolled back, or the rank was not moved
        self.active = False
        s.link.call(
            "recovered", generation=gen, rank=s.rank, step=s.step, resume_at=resume,
            rolled_forward=rolled and back is None, rebuilt=sorted(comms), dirty=sorted(dirty_names), sends_to=mine,
            seconds=time.perf_counter() - began,
            rolled_back_to=back.step if back is not None else None,
            steps_redone=agreed - back.step + 1 if back is not None else 0,
        )  # fmt: skip
        return s.applied == s.step

    def _late_buffers(self) -> tuple[str, Plan]:
        """Whether this rank's module buffers changed after the last vote past what a replica can know of a
        lost rank's (why, else ""), and where a lost rank's come from as this rank sees it (DDP broadcast
        rank 0's, an average copied the model's: see :mod:`rlaunch.runtime.carried`).

        Read from the copies of this step's start, against this rank's row of the previous step's vote:
        the window after that vote (a rank that already voted in this step is read at the send)."""
        s = self._s
        start = s.start
        if start is None or start.step != s.step or s.vote.carried_step != s.step - 1:
            return "", {}
        reading = s.vote.serving(s.step, start.saved, start.broadcasts, s.rank, s.tracked)
        return (reading, {}) if isinstance(reading, str) else ("", reading.told())

    def _roll_back_to(self, plan: ReplacePlan, reports: list[dict[str, Any]], why: str) -> Rollback:
        """The snapshot every survivor rolls back to, when no replica can serve the replaced ranks (``why``);
        else the replacement is refused (every survivor decides alike, from the same reports).

        A rank no move could place (a group torch made, a sampler part a joiner could not know)
        is refused here too: a rollback would move it as a drain does."""
        moved = sorted(plan.moved_ranks)
        undrainable = next((str(r["undrainable"]) for r in reports if r["undrainable"]), "")
        if undrainable:
            self._give_up(plan.generation, f"{self._diverges(moved, why)}, and no move can place it: {undrainable}")
        found = rollback(reports, moved, self._host.holder_of) if self._host.enabled else "no snapshots are taken"
        if isinstance(found, str):
            self._give_up(
                plan.generation, f"{self._diverges(moved, why)}, and no host snapshot can serve instead: {found}"
            )
        assert isinstance(found, Rollback)
        return found

    @staticmethod
    def _diverges(moved: list[int], why: str) -> str:
        return f"a live replacement of ranks {moved} would diverge silently: {why}"

    def send_replicas(self, next_step: int) -> None:
        """At the step boundary after a recovery (and after a redone step's start was restored):
        send this replica's state to the ranks it serves (after a rollback: the copies of their
        snapshot this rank holds)."""
        back, self.rollback = self.rollback, None
        if not self._sends:
            return
        s = self._s
        assert s.link is not None
        began = time.perf_counter()
        channels, self._sends = self._sends, {}
        plan = self._buffer_plan(next_step, sorted(channels)) if back is None else {}
        sent = 0
        for moved, channel in channels.items():
            if back is not None:  # the copy of the lost rank's state this rank holds, at the snapshot's step
                sent += self._host.send_to(channel, moved, back.step, self._knowledge())
            else:
                with s.vote.buffers_of(moved, s.tracked, plan):
                    sent += send_state(channel, s.tracked, next_step, rng.capture(), self._knowledge())
            retire(channel)  # one use only (an NCCL channel is aborted when retired)
        s.link.call(
            "replica_sent", generation=s.generation, ranks=sorted(channels), bytes=sent,
            seconds=time.perf_counter() - began,
        )  # fmt: skip

    def _buffer_plan(self, next_step: int, moved: list[int]) -> Plan:
        """Where the module buffers sent to the ``moved`` ranks come from (see :mod:`rlaunch.runtime.carried`):
        this rank's reading of its own, and what the other survivors told; else the job restarts, with why."""
        s = self._s
        start = s.start
        counts = start.broadcasts if start is not None and start.step == next_step else broadcasts(s.tracked)
        reading = s.vote.serving(next_step, module_buffers(s.tracked), counts, s.rank, s.tracked)
        if isinstance(reading, str):
            self._refuse(s.generation, self._diverges(moved, reading))
        untold = sorted(reading.unsure - self._plan.keys())
        if untold:
            self._refuse(
                s.generation,
                self._diverges(
                    moved,
                    f"the buffer {buffer_names(s.tracked)[untold[0]]} is a copy of a buffer DDP broadcast from rank 0 "
                    "after the vote, and rank 0 cannot tell whether it was made before or after the broadcast (no "
                    "other survivor told it)",
                ),
            )
        return {**self._plan, **reading.sent()}

    def refuse_tainted(self, why: str) -> None:
        """(at the boundary of a step this rank rolled forward) The rest of that step went on from
        collectives' own values (``why``), so the state the recovery is about to send would diverge:
        the job restarts instead."""
        self._give_up(self._s.generation, f"this rank's state would diverge: {why}")

    def refuse_redo(self, why: str) -> None:
        """(at the boundary of a step this rank discarded) The script changed state the redo does not put back
        (``why``): the job restarts instead."""
        self._give_up(self._s.generation, why)

    def _give_up(self, generation: int, why: str) -> None:
        """Refuse the replacement to ``generation`` if there is a reason ``why`` (see :meth:`_refuse`)."""
        if why:
            self._refuse(generation, why)

    def _refuse(self, generation: int, why: str) -> NoReturn:
        """Refuse the replacement to ``generation``: tell the agent why, then stop this worker.

        The node's failure carries the sentence, and the controller restarts every worker instead.
        """
        assert self._s.link is not None
        self._s.link.call("unrecoverable", generation=generation, reason=why)
        raise RefusedError(
            f"rank {self._s.rank}: {why.rstrip('.')}. This worker stops so that the job restarts (with --max-restarts) "
            "from your checkpoint instead."
        )


def mesh_sources(state: RankState, plan: ReplacePlan, survivors: list[int]) -> tuple[dict[int, int], str]:
    """Who sends each replaced rank its state: a rank holding the same shards (any rank without a
    mesh or declared replicas: DDP), or the declared replica set's survivors."""
    moved = sorted(plan.sources or plan.moved_ranks)
    if state.declared is not None:
        sources: dict[int, int] = {}
        for m in moved:
            peers = [r for r in state.declared.sets[state.declared.index(m)] if r in survivors]
            if not peers:
                return {}, f"rank {m} has no surviving replica among its declared replicas {state.declared.sets}"
            sources[m] = min(peers, key=lambda r: (sum(1 for v in sources.values() if v == r), r))
        return sources, ""
    if state.mesh is None:
        return dict(plan.sources), ""
    names = state.mesh.dim_names()
    sharded = shards.sharded_dims(state.tracked, names)
    return shards.replica_sources(state.mesh.coordinates(), names, sharded, moved, survivors)
