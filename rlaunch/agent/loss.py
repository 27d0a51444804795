"""When a node's record says that its workers lost a peer (pure logic; the worker link and the agent's
loop drive it).

A worker whose collective fails tells its agent (``recovering``), and the node's record then says when
(``peer_lost_at``): the controller probes the generation's agents on it and revokes the lease of any
whose agent is gone (:mod:`rlaunch.detectors.liveness`). One report is all the controller needs, but in
a data-parallel job every survivor sees the loss at once: at 4,096 nodes, 4,095 records written within
a moment, which delayed the controller's plan by about a second (``scripts/bench_control_plane.py
--survivor-reports``), and each fresh one made the controller probe every agent again.

So a node says a loss after a random part of ``SPREAD_PER_NODE_S`` x the generation's node count, and
not at all if the controller's probe round (for that generation or a later one) reached the node
meanwhile: the round answers the losses before it (an agent gone when its probe came was found, and
a silent host is left to its lease, which a report would not change). A round's probes go out over a
moment, not at once: a node lost after its own probe but before this node's is not found by it,
and this node's report of it is dropped; any report by a node probed before the loss, or the lost
node's lease, finds it. Where k nodes see a loss, the first report comes after spread / (k + 1) on
average: about 1 ms where every node sees it, whatever the job's size; where one node alone does,
half the spread (2 ms at 4 nodes, 2 s at 4,096, still well within the lease's TTL, which detects the
loss otherwise). Under rlaunch's runtime that case is rare: each step ends with a vote on the world
group, so every survivor sees a loss within a step, whichever group failed first (spreading a report
over its failed groups' ranks instead was tried, and gained nothing).

The workers of one node report a loss within milliseconds of each other: reports within
``SAME_LOSS_S`` of the node's last, in the same generation, are the same loss.
"""

from __future__ import annotations

import dataclasses

#: The longest a node waits before its record says a loss, per node of the generation.
SPREAD_PER_NODE_S = 0.001
#: A failed collective a local worker reports within this long of the node's last report, in the same
#: generation, is the same loss: the node's record says it once (each local rank sees it within ms).
SAME_LOSS_S = 1.0


@dataclasses.dataclass
class LossReport:
    """A node's report of its workers' lost peers: what its record says, and what it will say.

    Wall-clock times are for the record (the controller compares them with each other); monotonic
    ones time the waits on this node.
    """

    #: the loss the record says (its ``peer_lost_at``; 0: none yet)
    said_at: float = 0.0
    #: the latest loss the workers reported: when (wall and monotonic) and in which generation
    seen_at: float = 0.0
    seen_mono: float = float("-inf")
    generation: int = -1
    #: when (monotonic) the record says the latest loss, unless a probe round comes first; None: nothing waits
    due: float | None = None
    #: when (monotonic) the controller's probe round last reached this node, and for which generation
    probed_mono: float = float("-inf")
    probed_generation: int = -1

    def seen(self, generation: int, nodes: int, wall: float, mono: float, draw: float) -> float | None:
        """A local worker saw a collective fail in ``generation``, of ``nodes`` nodes; ``draw`` is uniform
        in [0, 1). Returns how long until the record may say it, or None where it is the loss already
        noted (another local worker's report of it)."""
        if generation == self.generation and mono - self.seen_mono < SAME_LOSS_S:
            return None
        delay = draw * SPREAD_PER_NODE_S * max(nodes, 1)
        self.seen_at, self.seen_mono, self.generation, self.due = wall, mono, generation, mono + delay
        return delay

    def probed(self, mono: float, generation: int) -> None:
        """The controller's probe round for ``generation`` reached this node (a late probe of a round for
        an earlier generation than one that reached it already is ignored)."""
        if generation >= self.probed_generation:
            self.probed_mono, self.probed_generation = mono, generation

    def covered(self) -> bool:
        """Whether a probe round came after the latest loss was seen, for its generation or a later one
        (a round for an earlier one did not probe the nodes that joined since)."""
        return self.probed_mono >= self.seen_mono and self.probed_generation >= self.generation

    def waiting(self) -> bool:
        """Whether a loss waits to be said: the timer set by :meth:`seen` wakes the agent's loop only
        then (not if a probe round made the report needless)."""
        return self.due is not None and not self.covered()

    def to_say(self, mono: float) -> bool:
        """Whether the record says the latest loss now (it then says :attr:`said_at`): once it is due,
        unless a probe round reached the node since the loss was seen (it is then dropped)."""
        if self.due is None or mono < self.due:
            return False
        self.due = None
        if self.covered():
            return False
        self.said_at = self.seen_at
        return True
