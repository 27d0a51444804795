"""Looking for a network cut: an agent whose workers wait on their peers too long probes the others.

A host cut from its peers but not from etcd renews its lease, so nothing expires, and gloo sees
the cut as collectives that never complete on both sides of it: every rank of the job waits,
none fails, and no hang detector fires (a rank waiting on peers is a victim, not hung). So when a
local worker has waited on peers without completing a step for longer than the stall limit
(:meth:`rlaunch.detectors.hang.HangDetector.stall_limit`: a few median steps, at least a few
seconds), its agent probes the liveness port of every other node of the job (those holding ranks
and the standbys), and publishes on its node record which of them did not answer at all
(``unreachable``, with ``probed_at``). Refused connections are not a cut (the host answered; its
agent is gone, which the controller's own probe handles). It probes again every
:data:`PROBE_EVERY_S` while the stall lasts, publishing only what changed, and clears the report
once its workers complete steps again. The controller decides from every node's report whom the
cut takes out (:mod:`rlaunch.controller.cutoff`).

A probe is a TCP connection that sends nothing: a round costs one connection per node, and only
while a stall lasts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from rlaunch.detectors.hang import HangDetector
from rlaunch.detectors.liveness import Answer, probe

log = logging.getLogger(__name__)

#: While the stall lasts, probe again this often (seconds).
PROBE_EVERY_S = 5.0
#: How long one probe waits: past TCP's first SYN retransmission (1 s), so one lost packet is no cut.
PROBE_TIMEOUT_S = 3.0
#: Probes in flight at once (a round over thousands of nodes does not open them all together; each
#: is a file descriptor). A round takes about PROBE_TIMEOUT_S per this many silent nodes.
PROBE_CONCURRENCY = 512


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another node's agent, as its node record advertises it."""

    node_id: str
    addr: str
    probe_port: int


@dataclasses.dataclass(frozen=True)
class Reach:
    """This node's current probe report (``probed_at`` 0: no stall, nothing to report)."""

    probed_at: float = 0.0
    unreachable: tuple[str, ...] = ()


class PeerProbe:
    """Probes the other agents while this node's workers are stalled on peers; holds the report."""

    def __init__(
        self,
        node_id: str,
        hangs: HangDetector,
        peers: Callable[[], Awaitable[Sequence[Peer]]],
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        knock: Callable[[str, int, float], Awaitable[Answer]] = probe,
    ) -> None:
        self._node_id = node_id
        self._hangs = hangs
        self._peers = peers
        self._clock = clock
        self._monotonic = monotonic
        self._knock = knock
        self.current = Reach()
        self._next_round = 0.0

    async def check(self, watching: bool) -> bool:
        """Probe if the workers are stalled and a round is due; drop the report once they are not.

        ``watching``: this node's workers hold ranks and train. Returns whether the report changed
        (the node record should be published again).
        """
        now = self._monotonic()
        if not (watching and self._hangs.stalled_s(now) > self._hangs.stall_limit()):
            self._next_round = 0.0
            if self.current.probed_at:
                log.info("[%s] the workers complete steps again; the probe report is cleared", self._node_id)
                self.current = Reach()
                return True
            return False
        if now < self._next_round:
            return False
        self._next_round = now + PROBE_EVERY_S
        peers = [p for p in await self._peers() if p.node_id != self._node_id and p.probe_port]
        room = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def one(peer: Peer) -> Answer:
            async with room:
                return await self._knock(peer.addr, peer.probe_port, PROBE_TIMEOUT_S)

        answers = await asyncio.gather(*(one(p) for p in peers))
        silent = tuple(sorted(p.node_id for p, a in zip(peers, answers, strict=True) if a is Answer.SILENT))
        changed = not self.current.probed_at or silent != self.current.unreachable
        self.current = Reach(self._clock(), silent)
        if changed:
            log.warning(
                "[%s] the workers have waited on their peers for %.1f s; of %d other node(s), %s",
                self._node_id, self._hangs.stalled_s(now), len(peers),
                f"these did not answer a probe: {list(silent)}" if silent else "every one answered a probe",
            )  # fmt: skip
        return changed
