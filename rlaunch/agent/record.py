"""This node's record in etcd (``nodes/<node_id>``): what the controller knows of the node.

The record is the node's state from the moment it is published: a record etcd did not take (it
was unreachable) is sent again by the agent's loop until etcd has it, so a failure reported
during an outage reaches the controller when etcd is back. Besides the node state it carries what
the node's workers reported (runtime use, the last lost peer, compute time per step, which live
moves its ranks allow), the nodes its agent could not reach while they were stalled (see
:mod:`rlaunch.agent.reach`) and its fault, if one was found (see :mod:`rlaunch.agent.faults`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable

from rlaunch.agent.config import LaunchConfig
from rlaunch.agent.reach import Reach
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.errors import StoreError
from rlaunch.store.client import Store
from rlaunch.store.embedded import free_port
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import LiveMoves, NodeRecord, NodeState, encode

log = logging.getLogger(__name__)

#: A node's compute time per step goes to its record at most this often, and only when it moved
#: by more than COMPUTE_CHANGE (a fraction): the straggler detector needs trends, not every step.
COMPUTE_EVERY_S = 5.0
COMPUTE_CHANGE = 0.25
#: A node record etcd did not take (it was unreachable) is sent again at most this often.
RESEND_EVERY_S = 1.0


class RecordPublisher:
    """Builds, publishes and re-sends this node's record."""

    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        cfg: LaunchConfig,
        link: WorkerLink,
        emit: Callable[..., None],
        *,
        addr: str,
        probe_port: int,
        lease: Callable[[], int],
        restarts: Callable[[], int],
        fault: Callable[[], str],
        moves: Callable[[], tuple[LiveMoves, str]] = lambda: (LiveMoves.UNKNOWN, ""),
        reach: Callable[[], Reach] = Reach,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        put: Callable[[str, bytes, int], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        #: how the record goes to etcd: ``(key, value, lease)``; the agent's sends the events emitted
        #: with it in the same request (see rlaunch.events.EventLog.put_with)
        self._put = put or (lambda key, value, lease: store.put(key, value, lease=lease))
        self._keys = keys
        self._cfg = cfg
        self._link = link
        self._emit = emit
        self._addr = addr
        self._probe_port = probe_port
        self._lease = lease
        self._restarts = restarts
        self._fault = fault
        self._moves = moves
        self._reach = reach
        self._clock = clock
        self._monotonic = monotonic
        self.record: NodeRecord | None = None
        self._unsent = False  # etcd has not acknowledged self.record yet
        self._resend_at = 0.0  # when to try sending it again
        self._compute_at = 0.0  # when compute_s was last published
        # One send at a time, each of the latest record: the main loop and a worker's report (a
        # fault) both publish, and two puts in flight could land in either order.
        self._sending = asyncio.Lock()

    def make(
        self,
        state: NodeState,
        generation: int,
        exit_codes: dict[str, int] | None = None,
        failure: tuple[str, str] = ("", ""),
    ) -> NodeRecord:
        cfg = self._cfg
        moves, moves_reason = self._moves()
        reach = self._reach()
        return NodeRecord(
            node_id=cfg.node_id,
            host=socket.gethostname(),
            addr=self._addr,
            pid=os.getpid(),
            nproc=cfg.nproc_per_node,
            standby_only=cfg.standby,
            state=state,
            generation=generation,
            restarts=self._restarts(),
            master_port=free_port("0.0.0.0"),
            updated_at=self._clock(),
            exit_codes=exit_codes or {},
            runtime=len(self._link.state.hello) >= cfg.nproc_per_node,
            fault=self._fault(),
            failure=failure[0],
            message=failure[1],
            probe_port=self._probe_port,
            peer_lost_at=self._link.state.loss.said_at,
            compute_s=round(self.compute_s(), 6),
            live_moves=moves,
            moves_reason=moves_reason,
            probed_at=reach.probed_at,
            unreachable=list(reach.unreachable),
        )

    async def publish(
        self,
        state: NodeState,
        generation: int,
        exit_codes: dict[str, int] | None = None,
        failure: tuple[str, str] = ("", ""),
    ) -> None:
        """Make ``state`` this node's record (a ``node_state`` event when the state changes) and send it."""
        previous = self.record.state if self.record else None
        # The record is this node's state from now on, sent again by the loop until etcd has it:
        # a failure reported while etcd is unreachable must reach the controller when it is back.
        self.record, self._unsent = self.make(state, generation, exit_codes, failure), True
        if previous is not state:
            self._emit("node_state", generation, state=state.value, previous=previous.value if previous else None)
        await self._send()

    async def try_publish(self, state: NodeState, generation: int) -> None:
        """:meth:`publish`, saying so in the log rather than raising when etcd does not take it."""
        try:
            await self.publish(state, generation)
        except StoreError as exc:
            log.warning("[%s] could not publish state %s: %s", self._cfg.node_id, state.value, exc)

    async def republish(self) -> None:
        """Publish the current record again with fresh worker reports and fault (same state, generation,
        exit codes and failure)."""
        r = self.record
        assert r is not None
        await self.publish(r.state, r.generation, dict(r.exit_codes), (r.failure, r.message))

    async def resend(self) -> None:
        """Send the record again if etcd has not taken it, at most every :data:`RESEND_EVERY_S`."""
        if self._unsent and self._monotonic() >= self._resend_at:
            self._resend_at = self._monotonic() + RESEND_EVERY_S
            await self._send()

    def joined(self, record: NodeRecord) -> None:
        """``record`` was registered when the node joined."""
        self.record, self._unsent = record, False

    async def _send(self) -> None:
        async with self._sending:
            record = self.record
            assert record is not None
            await self._put(self._keys.node(self._cfg.node_id), encode(record), self._lease())
            if record is self.record:
                self._unsent = False  # (a newer record made meanwhile is sent by its own publish)

    def compute_moved(self) -> bool:
        """Whether the workers' compute time per step moved enough to be published again."""
        if not self._link.state.compute_s or self._monotonic() - self._compute_at < COMPUTE_EVERY_S:
            return False
        assert self.record is not None
        now, before = self.compute_s(), self.record.compute_s
        return before <= 0 or abs(now - before) > COMPUTE_CHANGE * before

    def compute_published(self) -> None:
        self._compute_at = self._monotonic()

    def compute_s(self) -> float:
        values = list(self._link.state.compute_s.values())
        return statistics.median(values) if values else 0.0
