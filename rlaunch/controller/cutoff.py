"""Which nodes a network cut takes out of the job: a pure decision over the agents' probe reports.

A host cut from its peers but not from etcd keeps its lease, and gloo sees the cut as collectives
that never complete, on both sides of it: nothing fails, every rank waits. So an agent whose
workers have waited on peers too long probes the other nodes' agents (:mod:`rlaunch.agent.reach`)
and publishes on its node record the ones it could not reach. This module puts those reports
together into a graph of cut pairs among the generation's nodes and chooses whom to take out:

- a pair is cut when either side reported the other unreachable. A drop in one direction only
  breaks TCP both ways (a connection needs packets in both), so an asymmetric drop is a cut pair
  like any other; which side dropped cannot be told, and does not matter;
- the nodes taken out are a smallest set that leaves no cut pair, found greedily: the node in the
  most cut pairs first; among equals the one cut from more standbys (a host cut from everyone
  cannot reach the standbys either, its peer can); then the one with the highest node rank (so
  that of two nodes cut from each other alone, node rank 0's node stays, with the job's first rank);
- a verdict waits until every node of the generation has published a probe round, or until
  :data:`REPORTS_WAIT_S` after the first report of a cut: a decision on the first report alone
  could take out the wrong side (a node cut from everyone reports everyone else first);
- a standby that a remaining node cannot reach is not given ranks (it could not join).

The controller revokes the leases of the nodes taken out, so they are fenced by the lease rule
and their ranks go to standbys as for any lost node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

#: Longest wait for the other nodes' reports once one node reported a cut (seconds).
REPORTS_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The nodes to take out (possibly none yet) and the standbys no remaining node can use."""

    out: tuple[str, ...] = ()
    #: standbys some remaining node could not reach: they may not take ranks now
    unreachable_standbys: frozenset[str] = frozenset()
    #: a cut was reported and the decision waits for more reports
    waiting: bool = False
    reason: str = ""


def decide(
    members: Sequence[str],
    reports: Mapping[str, Sequence[str]],
    standbys: Sequence[str],
    waited_s: float,
) -> Verdict:
    """Whom a cut takes out.

    ``members``: the generation's nodes with a live lease, in node-rank order. ``reports``: for each
    node whose agent published a current probe round, the nodes it could not reach (empty: it reached
    every one). ``standbys``: nodes that hold no ranks. ``waited_s``: how long the controller has
    seen a report of a cut.
    """
    rank = {n: i for i, n in enumerate(members)}
    pairs = {frozenset((a, b)) for a, seen in reports.items() if a in rank for b in seen if b in rank and b != a}
    spare = set(standbys)
    cut_from_standbys = {n: len(spare.intersection(reports.get(n, ()))) for n in members}
    if not pairs:
        return Verdict(unreachable_standbys=_unusable(members, reports, standbys, ()))
    silent = [n for n in members if n not in reports]
    if silent and waited_s < REPORTS_WAIT_S:
        return Verdict(waiting=True, reason=f"a cut was reported; waiting for the probe reports of {silent}")
    out: list[str] = []
    left = set(pairs)
    while left:
        degree: dict[str, int] = {}
        for pair in left:
            for node in pair:
                degree[node] = degree.get(node, 0) + 1
        worst = max(degree, key=lambda n: (degree[n], cut_from_standbys[n], rank[n]))
        out.append(worst)
        left = {p for p in left if worst not in p}
    reason = "; ".join(_why(node, pairs, reports) for node in out)
    if silent:
        reason += f" (no probe report from {silent} within {REPORTS_WAIT_S:.0f} s)"
    return Verdict(tuple(out), _unusable(members, reports, standbys, out), reason=reason)


def _why(node: str, pairs: set[frozenset[str]], reports: Mapping[str, Sequence[str]]) -> str:
    peers = sorted(next(iter(p - {node})) for p in pairs if node in p)
    said = sorted(n for n, seen in reports.items() if (n == node and set(seen) & set(peers)) or node in seen)
    return f"node {node} and {peers} cannot reach each other (as probed by {said})"


def _unusable(
    members: Sequence[str], reports: Mapping[str, Sequence[str]], standbys: Sequence[str], out: Sequence[str]
) -> frozenset[str]:
    staying = set(members) - set(out)
    return frozenset(s for s in standbys for n in staying if s in reports.get(n, ()))
