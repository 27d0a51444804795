"""Which live moves a job allows, from what its workers' runtime reports (pure: no I/O).

Each active worker's runtime tells its agent, after its first step's vote and whenever the answer
changes, whether a planned drain can move its rank live (``drain``) and whether a live replacement
after a fault can serve it (``replace``: a replica holds its state), with a sentence saying why
not (the ``moves`` op of :mod:`rlaunch.agent.worker_link`, a
:class:`~rlaunch.agent.reports.MovesReport`). The agent keeps the latest report of
each local rank and puts the node's summary on its record (``live_moves``, ``moves_reason``);
``rlaunch status`` sums the active nodes up into one line for the job. A node or a job can move
live only as far as every one of its ranks can, so both summaries are the weakest of their parts:

- ``drain and replacement``: every rank allows both;
- ``drain only`` / ``replacement only``: every rank allows the one, some rank not the other;
- ``none``: some rank allows no drain and some rank no replacement;
- ``unknown``: a rank (a node) has not reported yet.

The reason is the first one given by a rank (a node, in node rank order) that lacks something.
Where every rank allows both, it is the first note a rank gave on how: a job without replicas is
replaced live by a rollback to its host snapshots, and its ranks say so with the steps it would
redo (``drain and replacement: a fault rolls back to the last host snapshot ...``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlaunch.agent.reports import MovesReport
from rlaunch.store.records import LiveMoves


def combine(parts: Iterable[tuple[LiveMoves, str]]) -> tuple[LiveMoves, str]:
    """The weakest of ``parts`` (each a summary and its reason), with the first reason of one that lacks a move."""
    parts = list(parts)
    if not parts or any(moves is LiveMoves.UNKNOWN for moves, _ in parts):
        return LiveMoves.UNKNOWN, ""
    moves = LiveMoves.of(all(m.allows_drain for m, _ in parts), all(m.allows_replacement for m, _ in parts))
    if moves is LiveMoves.BOTH:
        return moves, next((note for _, note in parts if note), "")  # how (a rollback), where a rank said
    return moves, next((why for m, why in parts if m is not LiveMoves.BOTH and why), "")


def node_summary(reports: Mapping[int, MovesReport], nproc: int) -> tuple[LiveMoves, str]:
    """The node's summary from its local ranks' latest reports (``unknown`` until all ``nproc`` reported)."""
    if any(local not in reports for local in range(nproc)):
        return LiveMoves.UNKNOWN, ""
    ranks = [reports[local] for local in range(nproc)]
    return combine((LiveMoves.of(r.drain, r.replace), r.why_not()) for r in ranks)


def sentence(moves: LiveMoves, reason: str) -> str:
    """How a summary reads after ``Live moves: `` (the agent's log line, ``rlaunch status``)."""
    if moves is LiveMoves.UNKNOWN:
        return "not known yet"
    return f"{moves.value}: {reason}" if reason else moves.value


class NodeMoves:
    """This node's summary as last published, and whether its workers' reports changed it."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.current: tuple[LiveMoves, str] = (LiveMoves.UNKNOWN, "")

    def update(self, reports: Mapping[int, MovesReport]) -> LiveMoves | None:
        """Take the latest reports; the previous summary if they changed it (first known, or another), else None.

        Reports of fewer than every local rank (new workers that have not all reported yet) leave
        the last summary standing: a restart does not make the node ``unknown`` again.
        """
        summary = node_summary(reports, self.nproc)
        if summary[0] is LiveMoves.UNKNOWN or summary == self.current:
            return None
        previous, self.current = self.current[0], summary
        return previous
