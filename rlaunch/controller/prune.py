"""Which generations' c10d store prefixes (``kv/g<n>/``) no worker can still read: a pure decision.

Workers build the groups of generation ``n`` on ``kv/g<n>/`` (world group, rebuilt groups,
transfer channels, the commit-rule exchange), and only while they set up that generation: gloo
reads the store while a group is built, never after. So once generation ``m`` runs and every node
it assigns ranks to reports ``running`` (or ``succeeded``) *at* ``m`` — restarted workers started,
survivors recovered, joiners joined — no worker is still building a group of an older generation,
and every ``kv/g<k>/`` with ``k < m`` can go. The controller deletes them (one leader, after its
write of ``m`` has been acted on); a build of an abandoned older plan still in flight somewhere
was already waiting on peers that left it, and fails as it would have.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlaunch.controller.planner import NodeView
from rlaunch.store.records import Generation, GenerationStatus, NodeState

#: Node states that show a node's workers are past setting up the generation on its record.
SETTLED = frozenset({NodeState.RUNNING, NodeState.SUCCEEDED})


def prunable_below(gen: Generation | None, nodes: Mapping[str, NodeView]) -> tuple[int, str]:
    """``(m, reason)``: the store prefixes of generations below ``m`` are safe to delete (0: none)."""
    if gen is None or gen.status is not GenerationStatus.RUNNING:
        return 0, "no generation is running"
    for node in gen.assignment:
        view = nodes.get(node)
        if view is None:
            return 0, f"node {node} of generation {gen.number} has no record"
        if view.record.generation != gen.number or view.record.state not in SETTLED:
            return 0, (
                f"node {node} is {view.record.state.value} at generation {view.record.generation}, "
                f"not yet settled at generation {gen.number}"
            )
    return gen.number, f"every node of generation {gen.number} is settled"
