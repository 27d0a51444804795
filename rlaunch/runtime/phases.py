"""Where a planned move's time goes: the phases each rank marks, and the event's breakdown.

Every rank that takes part in a migration marks the moments it lives through, on the wall clock
(``time.time()``: one clock base for every rank of a host, and NTP's across hosts), and reports
them once its part is over (the leaver when its state is sent, the others after their first step
in the new generation); the agent logs them as a ``move_phases`` event. The phases (a joiner swaps
its groups before its transfer, the others after the boundary):

- ``plan_seen``: the plan reached the rank (a joiner: the plan that gives it ranks);
- ``prepared``: phase 1 done, the next generation's communicators built;
- ``ready_voted``: the first vote that said "ready for this generation" (leaver and survivors);
- ``boundary``: the switch began, after the step every rank voted ready in (leaver and survivors);
- ``transfer_start``, ``transfer_end``: the state transfer (leaver and joiner; with its bytes): on
  the joiner, its last tensor landed;
- ``params_landed`` (joiner): every tensor but the optimizer state landed, and the joiner may start
  its first step while the rest lands (see :class:`rlaunch.runtime.transfer.Landing`);
- ``verified`` (joiner): every digest compared with the sender's, before its first vote;
- ``groups_swapped``: the rank's groups hold the new communicators (survivors and joiner);
- ``first_step_start``, ``first_step_end``: the rank's first step in the new generation; inside it,
  ``work_start`` (what the runtime does at a step's start is done: the post-move host snapshot's
  copy, or the wait for the previous snapshot's exchange), ``work_done`` (the script called
  ``rt.optimizer_step``: its forward and backward passes ran, with their collectives, which wait for
  the slowest rank; on a GPU, their kernels were queued, and the wait for them falls in the vote's
  part; on a joiner whose script reads the optimizer state before, the rest of its landing too) and
  ``voted`` (the step's vote passed, after the joiner's landing and digests and, on every rank, the
  post-move comparison of replicas; not marked where the step went to recovery);
- ``snapshot_taken`` (a layout with no replica: survivors and joiner): the host snapshot that
  covers the new generation against faults was copied, at the first step's start (a joiner's
  optimizer state must have landed first, and a survivor waits up to a second for its previous
  snapshot's exchange; if that still runs, the step takes none and this is not marked); its
  exchange with the buddy then runs beside the steps (:mod:`rlaunch.runtime.snapshots`).

:func:`breakdown` turns every rank's report of one move into the event's phases, in seconds.
Phase 1 and the wait for the vote run while training goes on; the downtime is what lies between
the boundary and the last rank's first step end, less one median step.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlaunch.runtime.agent_link import AgentLink, AgentLinkError

log = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    PLAN_SEEN = "plan_seen"
    PREPARED = "prepared"
    READY_VOTED = "ready_voted"
    BOUNDARY = "boundary"
    TRANSFER_START = "transfer_start"
    PARAMS_LANDED = "params_landed"
    TRANSFER_END = "transfer_end"
    VERIFIED = "verified"
    GROUPS_SWAPPED = "groups_swapped"
    FIRST_STEP_START = "first_step_start"
    SNAPSHOT_TAKEN = "snapshot_taken"
    WORK_START = "work_start"
    WORK_DONE = "work_done"
    VOTED = "voted"
    FIRST_STEP_END = "first_step_end"


@dataclasses.dataclass
class MovePhases:
    """One rank's marks for the move to ``generation``, in which it is ``role`` (leaver, joiner, survivor)."""

    generation: int
    role: str
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    transfer_bytes: int = 0

    def mark(self, phase: Phase, at: float | None = None) -> None:
        """Mark ``phase`` now (or at ``at``, a ``time.time()`` taken earlier); a phase is marked once,
        at its first moment."""
        self.marks.setdefault(phase.value, time.time() if at is None else at)

    def report(self) -> dict[str, Any]:
        """The JSON values the rank sends its agent."""
        return {"generation": self.generation, "role": self.role, "marks": dict(self.marks),
                "bytes": self.transfer_bytes}  # fmt: skip


def report(link: AgentLink | None, rank: int, phases: MovePhases) -> None:
    """Send ``phases`` to the rank's agent; a report that cannot be made is logged, never raised:
    the move it describes goes on regardless."""
    if link is None:
        return
    try:
        link.call("phases", rank=rank, **phases.report())
    except (OSError, AgentLinkError) as exc:
        log.warning("rank %d: the phases of the move to generation %d were not reported: %s", rank, phases.generation,
                    exc)  # fmt: skip


def _at(reports: Iterable[Mapping[str, Any]], phase: Phase, roles: tuple[str, ...] = ()) -> list[float]:
    return [
        float(r["marks"][phase.value])
        for r in reports
        if phase.value in r["marks"] and (not roles or r["role"] in roles)
    ]


def breakdown(reports: Iterable[Mapping[str, Any]], median_step: float) -> dict[str, Any]:
    """The phases of one move from every rank's report (:meth:`MovePhases.report`), in seconds.

    Off the critical path: ``prepare_s`` (first plan seen to last rank prepared), ``vote_wait_s``
    (last rank prepared to the boundary: the steps trained meanwhile). On it, each from the
    earliest boundary: ``to_transfer_s`` (to the leaver's first byte), ``transfer_s`` (the
    leaver's first byte to the joiner's last; ``transfer_gbps`` is the largest rank's bytes over
    it, so with several local ranks moving at once it understates their sum), ``params_s`` (the
    leaver's first byte to the last joiner's parameters landed: the part of the transfer the
    first step waits for), ``verified_s`` (to the last joiner's digests compared), ``swap_s`` (to the last
    rank's groups swapped), ``to_first_step_s`` (to the last rank's first step start),
    ``snapshot_s`` (the longest wait, inside a first step, from its start to the post-move host
    snapshot copied: a joiner's landing, a survivor's previous exchange, the copy; not its exchange,
    which runs beside the steps), ``first_step_s`` (the longest first step), and its parts for each
    role, the longest over the role's ranks (so a role's two parts may come from two ranks):
    ``{joiner,survivor}_work_s`` (``work_start`` to ``work_done``), ``{joiner,survivor}_vote_s``
    (``work_done`` to ``voted``),
    ``switch_to_trained_s`` (to the last rank's first step end) and ``downtime_s``, that less one
    ``median_step``. A phase no rank reported is None.
    ``boundary_at`` and ``trained_at`` are the two ends of the switch on the wall clock.
    """
    reports = list(reports)

    def span(start: list[float], end: list[float]) -> float | None:
        return round(max(end) - min(start), 4) if start and end else None

    plan, prepared = _at(reports, Phase.PLAN_SEEN), _at(reports, Phase.PREPARED)
    boundary = _at(reports, Phase.BOUNDARY)
    sent_from = _at(reports, Phase.TRANSFER_START, ("leaver",))
    landed = _at(reports, Phase.TRANSFER_END, ("joiner",))
    starts, ends = _at(reports, Phase.FIRST_STEP_START), _at(reports, Phase.FIRST_STEP_END)

    def longest(start: Phase, end: Phase, roles: tuple[str, ...] = ()) -> float | None:
        """The longest span from ``start`` to ``end`` over the ranks (of ``roles``) that marked both."""
        mine = [r["marks"] for r in reports if not roles or r["role"] in roles]
        each = [m[end.value] - m[start.value] for m in mine if start.value in m and end.value in m]
        return round(max(each), 4) if each else None

    moved = max((int(r.get("bytes", 0)) for r in reports), default=0)
    transfer = span(sent_from, landed)
    trained = span(boundary, ends)
    return {
        "prepare_s": span(plan, prepared),
        "vote_wait_s": round(min(boundary) - max(prepared), 4) if boundary and prepared else None,
        "to_transfer_s": span(boundary, sent_from),
        "transfer_s": transfer,
        "transfer_bytes": moved,
        "transfer_gbps": round(moved / transfer / 1e9, 3) if transfer and moved else None,
        "params_s": span(sent_from, _at(reports, Phase.PARAMS_LANDED, ("joiner",))),
        "verified_s": span(boundary, _at(reports, Phase.VERIFIED, ("joiner",))),
        "swap_s": span(boundary, _at(reports, Phase.GROUPS_SWAPPED, ("survivor",))),
        "to_first_step_s": span(boundary, starts),
        "snapshot_s": longest(Phase.FIRST_STEP_START, Phase.SNAPSHOT_TAKEN),
        "first_step_s": longest(Phase.FIRST_STEP_START, Phase.FIRST_STEP_END),
        "joiner_work_s": longest(Phase.WORK_START, Phase.WORK_DONE, ("joiner",)),
        "joiner_vote_s": longest(Phase.WORK_DONE, Phase.VOTED, ("joiner",)),
        "survivor_work_s": longest(Phase.WORK_START, Phase.WORK_DONE, ("survivor",)),
        "survivor_vote_s": longest(Phase.WORK_DONE, Phase.VOTED, ("survivor",)),
        "switch_to_trained_s": trained,
        "downtime_s": round(max(0.0, trained - median_step), 4) if trained is not None else None,
        "boundary_at": min(boundary) if boundary else None,
        "trained_at": max(ends) if ends else None,
    }
