"""This node's fault: once found, the node gives up its ranks and takes none again in the job.

Two sources find one: the GPU health detector (:mod:`rlaunch.detectors.gpu`: an XID, an
uncorrectable ECC error, ...) and the runtime's replica check, which compares fingerprints of the
parameters and optimizer state across data-parallel replicas every ``--verify-every`` steps: a rank
whose copy differs from its replicas' reports ``sdc_suspected`` (silent data corruption) through
the worker link. Either way :class:`Faults` keeps the sentence, which every node record made from
then on carries (``fault``), so the planner no longer lets the node hold ranks
(:func:`rlaunch.controller.planner.can_hold_ranks`): its ranks go to a ready standby by a live
replacement, as for a lost node. The agent's loop then stops the workers and records the node
``failed``.

Order matters for a suspect worker, which exits non-zero right after its report: the fault is set
before anything is awaited, and the record that carries it is sent before the worker gets its
reply. So its exit is never seen, by the agent or the controller, without the fault, and is never
taken for an ordinary worker failure that restarts the node in place. A suspect also leaves a mark
in etcd (``suspects/<node>``, not leased), so that an agent restarted on the node is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rlaunch.agent.record import RecordPublisher
from rlaunch.agent.reports import SdcReport
from rlaunch.errors import StoreError
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import SuspectMark, encode

log = logging.getLogger(__name__)


class Faults:
    """The node's fault sentence ("" until one is found) and how it is made known."""

    def __init__(
        self,
        node_id: str,
        store: Store,
        keys: JobKeys,
        records: RecordPublisher,
        emit: Callable[..., None],
        wake: Callable[[], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self._store = store
        self._keys = keys
        self._records = records
        self._emit = emit
        self._wake = wake
        self._clock = clock
        #: every fault found, joined by "; " ("" while the node is healthy)
        self.sentence = ""
        #: the replica check suspected silent data corruption on this node
        self.suspected = False
        self._mark: SuspectMark | None = None  # the suspect mark, until etcd has taken it

    async def found(self, fault: str) -> None:
        """Take this node out of the job for ``fault`` (a sentence); a fault already known is not repeated.

        The sentence is set before anything is awaited (every record made from now on carries it);
        then the record is sent at once (if etcd does not take it, the agent's loop sends it again).
        """
        if not fault or fault in self.sentence:
            return
        self.sentence = f"{self.sentence}; {fault}" if self.sentence else fault
        log.error("[%s] %s: this node gives up its ranks", self.node_id, fault)
        self._wake()
        if self._records.record is not None:
            try:
                await self._records.republish()
            except StoreError as exc:
                log.warning("[%s] could not publish its fault yet (the loop sends it again): %s", self.node_id, exc)

    async def sdc_suspected(self, local_rank: int, report: SdcReport, generation: int) -> None:
        """A local rank's copy differs from its replicas' (the worker link waits for this before replying)."""
        self._emit("sdc_suspected", generation, local_rank=local_rank, rank=report.rank, step=report.step,
                   sentence=report.sentence, evidence=report.evidence)  # fmt: skip
        if not self.suspected:
            self.suspected = True
            self._mark = SuspectMark(node_id=self.node_id, generation=generation, rank=report.rank, step=report.step,
                                     fault=report.sentence, at=self._clock())  # fmt: skip
        await self.found(report.sentence)
        try:
            await self.resend()
        except StoreError as exc:
            log.warning("[%s] could not leave its suspect mark yet (the loop sends it again): %s", self.node_id, exc)

    async def resend(self) -> None:
        """Write the suspect mark if etcd has not taken it yet (raises StoreError while etcd does not answer)."""
        mark = self._mark
        if mark is not None:
            await self._store.put(self._keys.suspect(self.node_id), encode(mark))
            if self._mark is mark:
                self._mark = None
