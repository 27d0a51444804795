"""What this rank's state allows: a live drain, a live replacement, and why not.

A move the runtime cannot make bit-identical is refused when it is asked for, with a sentence,
and the job takes the restart path; training itself goes on as under torchrun. :class:`Moves`
holds those rules in one place: the listener asks :meth:`Moves.drain_refusal` before preparing a
drain, the survivors ask :meth:`Moves.replace_refusal` before a live replacement, and the rank
reports both to its agent (:meth:`Moves.report`) so that ``rlaunch status`` and the job's log say
whether live moves are possible and, if not, why. Where no replica can serve but host snapshots
are taken, a fault is still recovered live, by a rollback: the report says so, with the steps it
would redo.

A joiner must decide as the ranks it joins do, so what they learnt while the job ran (what
differs by rank, which replicas were compared, which partition each sampler reads) travels in
the transfer header (:meth:`Moves.knowledge`, :meth:`Moves.learn`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlaunch.runtime import registry, shards
from rlaunch.runtime.contract import ContractError
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.voting import Voting


class Moves:
    """The rules for moving one rank live, and what it reported of them (see the module docstring)."""

    def __init__(self, state: RankState, voting: Voting, snapshot_every: Callable[[], int]) -> None:
        self._s = state
        self._voting = voting
        self._snapshot_every = snapshot_every  # the host snapshots' interval (0: none taken)
        self._reported: tuple[bool, bool, str] | None = None
        self._seen: tuple[Any, ...] | None = None  # what the last report was computed from
        self._every_said = 0  # the snapshots' interval the last report named

    def drain_refusal(self) -> str:
        """Why this rank's state cannot be moved live by a drain ("" when it can)."""
        s = self._s
        if s.refused:
            return s.refused
        if not s.tracked:
            return "rt.track() was never called, so this rank has no state to hand over"
        foreign = registry.foreign_groups()
        if foreign:
            return (
                f"the group(s) {', '.join(foreign)} were made by torch.distributed (new_group or init_device_mesh), "
                "not by the runtime, so a move could not rebuild them; make them with rt.new_group or rt.device_mesh"
            )
        why = shards.move_refusal(s.tracked)
        if why:
            return why
        unknown = sorted(n for n, rule in self._voting.partitions.items() if not rule)
        if unknown:
            sampler = self._voting.samplers[unknown[0]]
            return (
                f"the sampler of {unknown[0]!r} reads part {sampler.rank} of {sampler.num_replicas}, which is neither "
                "the global rank nor a coordinate of one mesh dimension on every rank, so a joiner could not know its "
                "part"
            )
        return ""

    def replace_refusal(self) -> str:
        """Why no replica can stand in for a replaced rank ("" when one can)."""
        s = self._s
        return (
            self.drain_refusal()
            or s.refused_replacement
            or s.vote.refusal(s.per_rank, s.seed is not None, s.start)
            or self._voting.verifier.refusal()
        )

    def _no_replica(self) -> str:
        """Why this rank's shards have no replica anywhere ("" when some rank holds them). A replacement
        finds its sources when it happens (``recovery.mesh_sources``): this is for the report."""
        s = self._s
        if s.declared is not None:
            alone = len(s.declared.sets[s.declared.index(s.rank)]) == 1
            return f"rank {s.rank} is alone in its declared replica set (rt.declare_replicas)" if alone else ""
        if s.mesh is None:
            return ""
        others = [r for r in range(s.world_size) if r != s.rank]
        names = s.mesh.dim_names()
        sharded = shards.sharded_dims(s.tracked, names)
        return shards.replica_sources(s.mesh.coordinates(), names, sharded, [s.rank], others)[1]

    def report(self) -> None:
        """Tell the agent whether this rank can be drained and replaced live (when that changed).

        Called after every vote; it recomputes only when what the rules read may have changed (the
        refusals walk every tracked tensor).
        """
        s = self._s
        v = self._voting
        seen = (
            s.generation, s.rank, len(s.tracked), len(s.per_rank), s.refused, s.refused_replacement, s.declared,
            tuple(sorted(s.vote.differs)),
            tuple(sorted(v.verifier.differs)), tuple(sorted(v.partitions.items())), registry.known_groups(),
            self._snapshot_every(),
        )  # fmt: skip
        if s.link is None or seen == self._seen:
            return
        self._seen = seen
        drain = self.drain_refusal()
        replace = drain or self.replace_refusal() or self._no_replica()
        moves = (not drain, not replace, drain or replace)
        every = self._snapshot_every()
        if moves != self._reported or (every and self.needs_snapshots and every != self._every_said):
            self._reported = moves
            self._every_said = every
            if every and self.needs_snapshots:  # a fault rolls back live: the replacement is possible
                note = (
                    f"a fault rolls back to the last committed host snapshot (one every {every} steps: about "
                    f"{every} steps redone at most; before the first and while one is taken, a fault restarts the "
                    f"job), since {replace}"
                )
                s.link.call("moves", drain=True, replace=True, reason=note, rank=s.rank)
            else:
                s.link.call("moves", drain=moves[0], replace=moves[1], reason=moves[2], rank=s.rank)

    @property
    def needs_snapshots(self) -> bool:
        """A drain can move this rank but no replica can stand in for it after a fault: the rollback
        to a host snapshot (:mod:`rlaunch.runtime.snapshots`) is its live path (False until reported)."""
        return self._reported is not None and self._reported[0] and not self._reported[1]

    def knowledge(self) -> dict[str, Any]:
        """What the other ranks learnt while the job ran (JSON values, for the transfer header)."""
        declared = self._s.declared
        return {
            "vote": self._s.vote.knowledge(),
            "verify": self._voting.verifier.knowledge(),
            "partitions": dict(self._voting.partitions),
            "declared": [list(m) for m in declared.sets] if declared is not None else None,
            "snapshots": self._s.snapshots_wanted,
            "snapshot_every": self._s.snapshot_every,
        }

    def learn(self, known: dict[str, Any]) -> None:
        """(joiner) Take what the sender knows, before its tracked state is loaded."""
        if not known:
            return
        s = self._s
        theirs = known.get("declared")
        mine = [list(m) for m in s.declared.sets] if s.declared is not None else None
        if theirs != mine:
            raise ContractError(
                f"rank {s.rank}: this rank's script declared the replica sets {mine} but the rank it joins declared "
                f"{theirs} (rt.declare_replicas); every rank must declare the same, so it does not take the rank."
            )
        self._s.vote.learn(known["vote"])
        self._voting.verifier.learn(known["verify"])
        self._voting.partitions = {str(k): str(v) for k, v in known["partitions"].items()}
        self._s.snapshots_wanted = bool(known.get("snapshots"))
        if self._s.snapshot_every:  # the interval auto chose, which this rank must follow from its first step
            self._s.snapshot_every = int(known.get("snapshot_every") or self._s.snapshot_every)
