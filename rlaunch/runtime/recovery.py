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
replicated dimension, per-rank state) is refused before anything is written, with a sentence the
agent puts on the node's failure, and the job restarts instead.

:class:`Recovery` holds what only recovery needs (the plans handed over by the listener, the
channels to send on) and reads and updates its runtime's state (groups, applied step,
generation) on the main thread.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rlaunch.plans import ReplacePlan
from rlaunch.runtime import rng, shards
from rlaunch.runtime.groups import retire
from rlaunch.runtime.transfer import send_state
from rlaunch.runtime.vote import RefusedError

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime


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


class Recovery:
    """One rank's part in live replacements: from the plan's arrival to the replicas sent."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._plans: queue.Queue[ReplacePlan] = queue.Queue()  # from the listener thread
        self._sends: dict[int, Any] = {}  # replaced rank -> channel, sent at the step boundary
        #: between a failed step's report to the agent and its recovery: waiting on peers, not hung
        self.active = False

    @property
    def planned(self) -> bool:
        """A replacement was planned that this rank has not recovered from yet."""
        return not self._plans.empty()

    def on_replace(self, plan: ReplacePlan) -> None:
        """(listener thread) Ranks are being replaced: drop what waits on them, hand over the plan."""
        moved = set(plan.moved_ranks)
        why = f"ranks {sorted(moved)} are being replaced (generation {plan.generation})"
        for group in self._rt._mine():
            if moved & set(group.members):
                group.abandon(why)
        self._plans.put(plan)

    def recover(self, apply: Callable[[], None]) -> bool:
        """(main thread) Agree on the last applied step and rebuild groups; True if this step applies.

        The state is sent to the replaced ranks at the end of the step (:meth:`send_replicas`), after
        the script's own per-step code (a scheduler step) ran, as a migration's leaver does.
        """
        rt = self._rt
        assert rt._link is not None and rt._store is not None
        began = time.perf_counter()
        self.active = True
        rt._link.call("recovering", step=rt.step)
        try:
            plan = self._plans.get(timeout=rt._timeout.total_seconds())
        except queue.Empty:
            raise RuntimeError(
                f"rank {rt.rank}: a collective of step {rt.step} failed and no replacement was planned within "
                f"{rt._timeout.total_seconds():.0f} s; this worker exits so that its agent reports the failure."
            ) from None
        gen, moved = plan.generation, set(plan.moved_ranks)
        self._refuse_replacement(plan, sorted(moved))
        survivors = [r for r in range(rt.world_size) if r not in moved]
        dirty = sorted(g.label for g in rt._mine() if g.failed and not moved & set(g.members))
        rt._store.set(f"g{gen}/recover/{rt.rank}", json.dumps({"applied": rt._applied, "dirty": dirty}))
        # One exchange, O(1) store requests per survivor (not a read of every other's report).
        reports = [json.loads(v) for v in rt._store.gather(f"g{gen}/recover/", f"g{gen}/recovered", len(survivors))]
        agreed, rolled = commit_point(rt._applied, rt.step, [int(r["applied"]) for r in reports])
        if rolled:
            # Some survivor applied this step, so every rank finished its gradient sync: apply it.
            apply()
            rt._applied = agreed
        dirty_names = {n for r in reports for n in r["dirty"]}
        comms = {
            name: rt._group_comm(name, group.members, rt.rank, gen)
            for name, group in rt._groups.items()
            if rt.rank in group.members and (moved & set(group.members) or name in dirty_names)
        }
        sources = self._replica_sources(plan, survivors)
        mine = sorted(m for m, src in sources.items() if src == rt.rank)
        self._sends = {m: rt._channel(gen, 0, m) for m in mine}
        for name, comm in comms.items():
            rt._groups[name].swap(comm, gen)
        rt.generation = gen
        rt._resume_at = agreed + 1
        self.active = False
        rt._link.call(
            "recovered", generation=gen, rank=rt.rank, step=rt.step, resume_at=agreed + 1,
            rolled_forward=rolled, rebuilt=sorted(comms), sends_to=mine, seconds=time.perf_counter() - began,
        )  # fmt: skip
        return rt._applied == rt.step

    def send_replicas(self, next_step: int) -> None:
        """At the step boundary after a recovery (and after a redone step's start was restored):
        send this replica's state to the ranks it serves."""
        if not self._sends:
            return
        rt = self._rt
        assert rt._link is not None
        began = time.perf_counter()
        channels, self._sends = self._sends, {}
        sent = 0
        for moved, channel in channels.items():
            with rt._vote.buffers_of(moved, next_step, rt._tracked, rt.rank):
                sent += send_state(channel, rt._tracked, next_step, rng.capture())
            retire(channel)  # one use only (an NCCL channel is aborted when retired)
        rt._link.call(
            "replica_sent", generation=rt.generation, ranks=sorted(channels), bytes=sent,
            seconds=time.perf_counter() - began,
        )  # fmt: skip

    def _replica_sources(self, plan: ReplacePlan, survivors: list[int]) -> dict[int, int]:
        """Who sends each replaced rank its state: a rank holding the same shards (any rank without a mesh)."""
        rt = self._rt
        moved = list(plan.sources)
        if rt._mesh is None:
            return dict(plan.sources)
        sharded = shards.sharded_dims(rt._tracked, rt._mesh.names)
        sources, why = shards.replica_sources(rt._mesh.ranks, rt._mesh.names, sharded, moved, survivors)
        self._give_up(plan, why)
        return sources

    def _refuse_replacement(self, plan: ReplacePlan, moved: list[int]) -> None:
        """Stop, before anything is written, when no replica holds what the replaced ranks had."""
        rt = self._rt
        why = rt._vote.refusal(rt._per_rank, rt._seed is not None, rt._start)
        self._give_up(plan, f"a live replacement of ranks {moved} would diverge silently: {why}" if why else "")

    def _give_up(self, plan: ReplacePlan, why: str) -> None:
        """Refuse the replacement of ``plan`` (if ``why``): tell the agent why, then stop this worker.

        The node's failure carries the sentence, and the controller restarts every worker instead.
        """
        if not why:
            return
        assert self._rt._link is not None
        self._rt._link.call("unrecoverable", generation=plan.generation, reason=why)
        raise RefusedError(
            f"rank {self._rt.rank}: {why}. This worker stops so that the job restarts (with --max-restarts) "
            "from your checkpoint instead."
        )
