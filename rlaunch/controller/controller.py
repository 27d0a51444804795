"""The controller tick: elected through etcd, reads the view, calls the planner, writes.

Exactly one agent of a job leads at a time: leadership is the ``leader`` key, created only
if absent and attached to the leader's node lease, so it vanishes with a dead leader. Every
generation write is a transaction guarded by the generation key's revision (the view it was
planned from) and by the leader key still being the one this controller created (fencing: its
create revision, the election's term, not its value, which a restarted agent of the same node id
would write again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rlaunch.addresses import host_port
from rlaunch.controller import cutoff
from rlaunch.controller.feed import NodeFeed
from rlaunch.controller.planner import ClusterView, PlannerConfig, plan
from rlaunch.controller.prune import prunable_below
from rlaunch.controller.view import JobSnapshot, RecordCache, read_snapshot
from rlaunch.detectors.liveness import probe_round
from rlaunch.detectors.straggler import StragglerWatch, compute_times
from rlaunch.errors import PlanError, StoreError
from rlaunch.events import EventLog
from rlaunch.store import generations
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import JobSpec, NodeRecord
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: While a deadline is pending (a generation waiting for a replacement node), re-plan this often.
#: Otherwise the controller plans on etcd changes only, so a quiet job costs etcd nothing but
#: lease keepalives.
DEADLINE_TICK_S = 1.0
#: Longest idle wait between checks of ``stop`` (no etcd request is made on these wake-ups).
STOP_CHECK_S = 1.0
#: A leader's ticks are this far apart at least: the changes that come meanwhile are planned from
#: together. Each tick plans from every node record, and after a plan every node writes its own
#: (4,096 or more writes at 4,096 nodes): one tick for each kept the controller and etcd busy for the whole move.
TICK_GAP_S = 0.1
#: Probe rounds are this far apart at least: at a fault the survivors' reports of one loss come over a
#: while (see rlaunch.agent.loss), and each newer one would otherwise start a round of its own (one
#: connection per node of the job, every tick).
ROUND_GAP_S = 1.0


class Controller:
    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        spec: JobSpec,
        cfg: PlannerConfig,
        lease_id: int,
        events: EventLog,
        clock: Callable[[], float] = time.time,
        straggler_window: float = 0.0,
        feed: NodeFeed | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        #: the node records kept from the leading agent's watch (see rlaunch.controller.feed)
        self._feed = feed
        self._keys = keys
        self._spec = spec
        self._cfg = cfg
        self._lease_id = lease_id
        self._events = events
        self._clock = clock
        self._last_reason = ""
        self._plan_error = ""  # the last plan refused as a planner's bug (said once until a write succeeds)
        self._reported: set[str] = set()
        self._deadline_pending = False
        self._monotonic = monotonic
        #: each node's peer_lost_at when the last probe round started, and that start (controller's
        #: clock; and monotonic): see _revoke_dead
        self._answered: dict[str, float] = {}
        self._round_clock = 0.0
        self._round_at = float("-inf")
        self._round_waiting = False  # a loss was said too soon after the last round: the next one waits
        self._cut_seen_at = 0.0  # when a probe report of a cut was first seen (0: none stands)
        self._cut_waiting = False  # a cut was reported and the verdict waits for more reports
        self._cut_said = ""  # the last cut verdict logged
        self._stragglers = StragglerWatch(straggler_window)
        self._slow_reported: set[str] = set()
        self._pruned_below = 1  # kv/g<n>/ of every generation below this one has been deleted
        self._nodes = RecordCache()  # decoded node records, reused while unchanged
        self._term = 0  # the create revision of the leader key this controller made (0: not leading)

    @property
    def leading(self) -> bool:
        return self._term > 0

    @property
    def node_id(self) -> str:
        return self._cfg.controller

    @property
    def stragglers_watched(self) -> int:
        """Slow nodes this controller is watching (for the metrics)."""
        return self._stragglers.watched

    async def run(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        """Campaign for leadership and tick while leading, until ``stop`` is set.

        ``wake`` is set by the agent's watch: while leading, on every change of the keys the planner
        reads; while not, only when the leader key is deleted; and whenever the watch (re)starts.
        Between changes nothing is sent to etcd, except every ``DEADLINE_TICK_S`` while a deadline
        is pending; changes that come within ``TICK_GAP_S`` of a tick wait for the next one together.
        A tick no change woke, or one after a failed tick, reads the node records whole (see
        rlaunch.controller.feed). So does the first tick, which may follow a failed run of this method
        (rlaunch.agent.background starts it again).
        """
        work, woken, failed = True, True, True
        while not stop.is_set():
            retried, failed = failed, False
            if work:
                try:
                    if not self.leading and await self.campaign():
                        self._events.emit("controller_elected", 0, controller=self.node_id)
                    if self.leading:
                        await self.tick(whole=retried or not woken)
                        await wait_event(stop, TICK_GAP_S)
                except StoreError as exc:
                    log.warning("[%s] controller tick failed: %s", self.node_id, exc)
                    failed = True  # tried again at the next round: no change may come to wake it
            # Non-leaders campaign when the leader key changes (it vanishes with its lease). The
            # wait is bounded so that ``stop`` is seen even if a wake-up is lost; a wake-up by
            # timeout alone sends nothing to etcd unless a deadline is pending.
            deadline = self.leading and self._deadline_pending
            woken = await wait_event(wake, DEADLINE_TICK_S if deadline else STOP_CHECK_S)
            wake.clear()
            work = woken or deadline or failed

    async def campaign(self) -> bool:
        """Try to become the leader; whether this controller leads now.

        The leader key is created only if absent. A key that already exists on this agent's own
        lease is this controller's election whose answer was lost (the creation happened, its
        reply or the read after it did not arrive): it is adopted, or no controller would run
        until the lease ends.
        """
        self._term = await self._store.create(self._keys.leader, self.node_id.encode(), lease=self._lease_id)
        if not self._term:
            kv = await self._store.get(self._keys.leader)
            if kv is not None and kv.lease == self._lease_id and kv.value == self.node_id.encode():
                self._term = kv.create_revision
        return self.leading

    async def _revoke_dead(self, snap: JobSnapshot) -> bool:
        """A worker saw a peer fail: probe the generation's agents and revoke the leases of those gone,
        all before the tick plans (nodes lost together are replaced in one plan); whether any was.

        A round answers every loss said before it started: the survivors' reports of one loss come
        over a while (rlaunch.agent.loss), and a round for each newer one would connect to every agent
        each tick. So rounds are ``ROUND_GAP_S`` apart at least; a report that comes sooner waits for
        the next one (a deadline tick). A report needs a round if its node's ``peer_lost_at`` changed
        since the last round started and is later than that start: records' times are their hosts'
        clocks, so a host whose clock runs ahead costs one more round, not rounds for as long as it is
        ahead; one whose clock runs behind the controller's by more than the time from a new loss to
        the round before it leaves that loss to the lease.
        """
        gen = snap.generation
        said = any(
            v.record.peer_lost_at > max(self._round_clock, self._answered.get(n, 0.0)) for n, v in snap.nodes.items()
        )
        if not said or gen is None or gen.status.terminal:
            self._round_waiting = False
            return False
        mono = self._monotonic()
        self._round_waiting = mono - self._round_at < ROUND_GAP_S
        if self._round_waiting:
            return False
        self._round_at, self._round_clock = mono, self._clock()
        self._answered = {n: v.record.peer_lost_at for n, v in snap.nodes.items()}
        suspects = [
            (n, snap.nodes[n].record, snap.node_leases[n]) for n in gen.assignment
            if n in snap.nodes and n != self.node_id and snap.nodes[n].record.probe_port and n in snap.node_leases
        ]  # fmt: skip
        gone: list[int] = []
        await probe_round(gen.number, [(record.addr, record.probe_port) for _, record, _ in suspects], gone.append)
        for i in sorted(gone):
            await self._revoke_lost(gen.number, *suspects[i])
        return bool(gone)

    async def _revoke_lost(self, number: int, node: str, record: NodeRecord, lease: int) -> None:
        why = f"its agent no longer answers on {host_port(record.addr, record.probe_port)}"
        log.warning("[%s] controller: node %s is lost: %s; revoking its lease", self.node_id, node, why)
        self._events.emit("node_dead", number, node=node, reason=why)
        try:
            await self._store.revoke_lease(lease)
        except StoreError as exc:  # its lease decides, as without the probe
            log.warning("[%s] controller: revoking the lease of lost node %s failed: %s", self.node_id, node, exc)

    async def _take_out_cut_off(self, snap: JobSnapshot) -> cutoff.Verdict:
        """The agents' probe reports show a network cut: revoke the leases of the nodes it takes out.

        Their ranks then go to standbys as any lost node's, and each is fenced when it hears that its
        lease is gone (see rlaunch.controller.cutoff and rlaunch.agent.reach).
        """
        gen = snap.generation
        if gen is None or gen.status.terminal:
            self._cut_seen_at, self._cut_waiting = 0.0, False
            return cutoff.Verdict()
        members = [n for n in sorted(gen.assignment, key=gen.assignment.__getitem__) if n in snap.node_leases]
        reports = {n: v.record.unreachable for n, v in snap.nodes.items() if v.record.probed_at > 0}
        standbys = [n for n in snap.nodes if n not in gen.assignment]
        now = self._clock()
        if not any(reports.values()):
            self._cut_seen_at = 0.0
        elif not self._cut_seen_at:
            self._cut_seen_at = now
        verdict = cutoff.decide(members, reports, standbys, now - self._cut_seen_at if self._cut_seen_at else 0.0)
        self._cut_waiting = verdict.waiting
        if verdict.reason and verdict.reason != self._cut_said:
            log.log(logging.WARNING if verdict.out else logging.INFO, "[%s] controller: %s", self.node_id,
                    verdict.reason)  # fmt: skip
        self._cut_said = verdict.reason
        for node in verdict.out:
            self._events.emit("node_cut_off", gen.number, node=node, reason=verdict.reason)
            await self._store.revoke_lease(snap.node_leases[node])
        return verdict

    def _find_stragglers(self, snap: JobSnapshot) -> list[str]:
        gen = snap.generation
        times = compute_times(gen, lambda node: snap.nodes[node].record if node in snap.nodes else None)
        found = self._stragglers.update(self._clock(), times)
        for node in found:
            if node not in self._slow_reported:
                self._slow_reported.add(node)
                log.warning(
                    "[%s] controller: node %s is a straggler (compute s per step: %s)", self.node_id, node, times
                )
                self._events.emit("straggler", gen.number if gen else 0, node=node, compute_s=times)
        return found

    async def _prune(self, snap: JobSnapshot) -> None:
        """Delete the store prefixes of generations no worker can still read (see controller.prune)."""
        below, _ = prunable_below(snap.generation, snap.nodes)
        if below <= self._pruned_below:
            return
        for number in range(self._pruned_below, below):
            await self._store.delete_prefix(self._keys.kv_generation_prefix(number))
        log.info("[%s] controller: pruned the store prefixes of generations %d to %d", self.node_id,
                 self._pruned_below, below - 1)  # fmt: skip
        self._pruned_below = below

    async def tick(self, whole: bool = False) -> None:
        """Plan once from the job's state; ``whole``: read the node records from etcd, not the feed."""
        snap = await read_snapshot(self._store, self._keys, self._nodes, feed=self._feed, whole=whole)
        for problem in snap.problems:
            if problem not in self._reported:
                self._reported.add(problem)
                log.error("[%s] %s", self.node_id, problem)
                self._events.emit("malformed_record", 0, message=problem)
        if snap.leader_revision != self._term:
            self._term = 0
            log.warning(
                "[%s] lost controller leadership to %s (the leader key was created again since this controller "
                "was elected)", self.node_id, snap.leader,
            )  # fmt: skip
            return
        if snap.generation_malformed:
            return  # reported above; planning over it could undo a running generation
        # After a revocation, the records it deleted are read whole: the watch may not have brought
        # their deletion yet.
        if await self._revoke_dead(snap):
            snap = await read_snapshot(self._store, self._keys, self._nodes, feed=self._feed, whole=True)
        cut = await self._take_out_cut_off(snap)
        if cut.out:
            snap = await read_snapshot(self._store, self._keys, self._nodes, feed=self._feed, whole=True)
        view = ClusterView(
            spec=self._spec, nodes=snap.nodes, generation=snap.generation, drains=frozenset(snap.drains),
            stragglers=frozenset(self._find_stragglers(snap)), unreachable=cut.unreachable_standbys,
            acked=snap.acked,
        )  # fmt: skip
        new, reason = plan(self._clock(), view, self._cfg)
        after = new or snap.generation
        # a replacement node or a standby is awaited until a deadline, or a slow node's window runs
        waiting = after is not None and not after.status.terminal and after.deadline > 0
        self._deadline_pending = waiting or self._stragglers.pending or self._cut_waiting or self._round_waiting
        if reason != self._last_reason:
            log.info("[%s] controller: %s", self.node_id, reason)
            self._last_reason = reason
        if new is None:
            await self._prune(snap)
            return
        fence = (self._keys.leader, self._term)
        try:
            written = await generations.write(
                self._store, self._keys, new, snap.generation, snap.generation_revision, fence=fence
            )
        except PlanError as exc:
            # A bug in the planner: nothing is written, and the next wake plans again. Raised on, it
            # would end this task while the agent keeps the leader key alive: the job would stall.
            if str(exc) != self._plan_error:
                self._plan_error = str(exc)
                log.error("[%s] controller: %s", self.node_id, exc)
                self._events.emit("plan_failed", new.number, reason=str(exc), plan=new.kind)
            return
        if written:
            self._plan_error = ""
            self._events.emit(
                "generation", new.number, status=new.status.value, reason=reason, plan=new.kind,
                assignment=new.assignment, restart_count=new.restart_count,
            )  # fmt: skip
            for leaver in new.leavers:
                await self._store.delete(self._keys.drain_request(leaver))
        else:
            log.info("[%s] generation changed under the controller; re-planning", self.node_id)
