"""The agent's side of the worker runtime: requests workers send over the control socket.

- ``hello``: a worker announces it uses the runtime; it learns its role, rank and generation
  (a :class:`~rlaunch.plans.Hello`).
- ``kv_*``: c10d store operations, kept in etcd under ``kv/`` (groups are built on them).
- ``wait_plan``: a long wait for the next migration or replacement this worker takes part in
  (a :class:`~rlaunch.plans.MigratePlan` or :class:`~rlaunch.plans.ReplacePlan`, with its
  :class:`~rlaunch.plans.Role`).
- ``warm`` / ``prepared`` / ``joined`` / ``left`` / ``switched`` / ``recovering`` / ``recovered``:
  progress reports, which the agent turns into node states and events.
- ``unrecoverable``: a survivor refused a live replacement (no replica holds what a replaced rank
  had: its shards, or its per-rank state); it exits next, and
  the node's failure says why (the job falls back to a restart).
- ``moves``: whether a drain can move this rank live and a live replacement can serve it, and if
  not why (a :class:`~rlaunch.agent.reports.MovesReport`); the latest one per local rank is kept
  for the node's summary (see :mod:`rlaunch.agent.moves`).
- ``sdc_suspected``: the replica check found this rank's copy different from its replicas'
  (a :class:`~rlaunch.agent.reports.SdcReport`). The agent takes the node out of the job
  (:attr:`WorkerLink.on_sdc`) *before* it replies: the worker exits non-zero only after the reply,
  so its exit is never seen before the fault, and is never taken for an ordinary worker failure
  that restarts the node in place.
- ``snapshot``: a host snapshot every rank holds was committed (layouts without a replica; see
  :mod:`rlaunch.runtime.snapshots`): this rank's bytes and what copying and exchanging it took
  (a ``snapshot_committed`` event, local: the log, events.jsonl and the metrics, not etcd).
- ``snapshot_handover``: a drain's joiner holds the leaver's two copies of the host snapshot the
  job kept across the drain (see :mod:`rlaunch.runtime.handover`): a local ``snapshot_handed_over``
  event with the step, the bytes and the seconds it took.
- ``done``: the worker's ``rt.steps()`` ended; it says what comparing replicas cost it over the
  job (a ``verification`` event: seconds spent, comparisons, steps and the median step).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rlaunch.agent.control import ControlServer
from rlaunch.agent.loss import LossReport
from rlaunch.agent.metrics import AgentMetrics
from rlaunch.agent.reports import MovesReport, ReportError, SdcReport, require
from rlaunch.detectors.hang import HangDetector
from rlaunch.errors import StoreError, StoreUnavailableError
from rlaunch.plans import Hello, MigratePlan, Plan, ReplacePlan, Role, StartRole, plan_to_json
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: Longest a worker may be kept in one ``wait_plan`` call before it asks again.
PLAN_WAIT_S = 30.0
#: How long a worker's store read waits before it reads again after etcd broke off (see _value_when_set).
KV_RETRY_S = 0.5


@dataclasses.dataclass
class LinkState:
    """What the node's workers have reported, for the agent's main loop."""

    hello: set[int] = dataclasses.field(default_factory=set)
    warm: set[int] = dataclasses.field(default_factory=set)
    prepared: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    left: set[int] = dataclasses.field(default_factory=set)
    joined: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    recovered: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    #: the peer losses the local workers reported, and when the node record says them (see rlaunch.agent.loss)
    loss: LossReport = dataclasses.field(default_factory=LossReport)
    #: each local worker's median compute time per step (from its heartbeats)
    compute_s: dict[int, float] = dataclasses.field(default_factory=dict)
    #: why a survivor refused a live replacement ("" if none did): no replica held a replaced rank's state
    unrecoverable: str = ""
    #: local ranks whose rt.steps() has ended (no longer watched for hangs)
    done: set[int] = dataclasses.field(default_factory=set)
    #: each local rank's latest ``moves`` report
    moves: dict[int, MovesReport] = dataclasses.field(default_factory=dict)


def replica_sources(gen: Generation) -> dict[int, int]:
    """For a replacement: which surviving rank sends each replaced rank its state.

    Every rank is taken as a data-parallel replica of every other (DDP); the replaced ranks are
    spread over the survivors so that no one rank sends them all.
    """
    if gen.kind != "replace":
        return {}
    moved = sorted(r for joiner in gen.joiners for r in gen.ranks_of(joiner))
    survivors = [r for r in range(gen.world_size) if r not in moved]
    return {m: survivors[i % len(survivors)] for i, m in enumerate(moved)} if survivors else {}


class WorkerLink:
    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        lease: Callable[[], int],
        emit: Callable[..., None],
        wake: Callable[[], None],
        note: Callable[..., None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        emit_with_record: Callable[..., None] | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._sleep = sleep
        self._keys = keys
        self._lease = lease
        self._emit = emit
        self._note = note or emit  # local events (not written to etcd)
        #: events the node record follows (a worker joined or recovered: running once all did), which may wait for it
        self._emit_with_record = emit_with_record or emit
        self._wake = wake
        self._draw = draw  # uniform in [0, 1): the wait before the record says a loss
        self.state = LinkState()
        self.role = StartRole.ACTIVE
        self.generation: Generation | None = None
        self.node_id = ""
        self.sandbox_steps = 3
        self._plans: dict[int, Plan] = {}
        self._plan_changed = asyncio.Event()
        self.hangs = HangDetector(60.0)
        self.metrics: AgentMetrics | None = None
        #: takes the node out of the job on an ``sdc_suspected`` report (local rank, report); the
        #: agent sets it, and the reply waits for it
        self.on_sdc: Callable[[int, SdcReport], Awaitable[None]] | None = None

    def register(self, server: ControlServer) -> None:
        ops = (
            "hello", "wait_plan", "warm", "prepared", "joined", "left", "switched", "phases", "recovering", "recovered",
            "heartbeat", "replica_sent", "unrecoverable", "done", "moves", "sdc_suspected", "snapshot",
            "snapshot_handover", "kv_set", "kv_get", "kv_add", "kv_compare_set", "kv_check", "kv_delete", "kv_count",
            "kv_gather",
        )  # fmt: skip
        for op in ops:
            server.register(op, getattr(self, "_" + op))

    def reset(self, role: StartRole | str, generation: Generation | None) -> None:
        """New workers are starting (``active`` or ``standby``): forget what the previous ones reported."""
        self.state = LinkState()
        self.role = StartRole(role)
        self.generation = generation
        self._plans.clear()
        self.hangs.reset()

    def offer(self, gen: Generation, role: Role | str, nproc: int) -> None:
        """Hand migration or replacement ``gen`` to the local workers as ``role`` (survivor|leaver|joiner)."""
        role = Role(role)
        moved = tuple(r for joiner in gen.joiners for r in gen.ranks_of(joiner))
        if role is Role.LEAVER:
            base = gen.assignment[gen.joiners[gen.leavers.index(self.node_id)]] * gen.nproc_per_node
        else:
            base = gen.assignment[self.node_id] * gen.nproc_per_node
        for local_rank in range(nproc):
            rank = base + local_rank
            if gen.kind == "replace":
                self._plans[local_rank] = ReplacePlan(
                    generation=gen.number, role=role, rank=rank, moved_ranks=moved, world_size=gen.world_size,
                    sources=replica_sources(gen),
                )  # fmt: skip
            else:
                self._plans[local_rank] = MigratePlan(
                    generation=gen.number, role=role, rank=rank, moved_ranks=moved, world_size=gen.world_size
                )
        self.generation = gen
        self._plan_changed.set()

    # -- progress -----------------------------------------------------------------------------

    async def _hello(self, req: dict[str, Any]) -> dict[str, Any]:
        local_rank = int(req["local_rank"])
        self.state.hello.add(local_rank)
        self._wake()
        gen = self.generation
        if self.role is StartRole.STANDBY or gen is None:
            world = gen.world_size if gen else 0
            hello = Hello(StartRole.STANDBY, -1, world, 0, sandbox_steps=self.sandbox_steps)
        else:
            rank = gen.assignment[self.node_id] * gen.nproc_per_node + local_rank
            hello = Hello(StartRole.ACTIVE, rank, gen.world_size, gen.number, sandbox_steps=self.sandbox_steps)
        return hello.to_json()

    async def _wait_plan(self, req: dict[str, Any]) -> dict[str, Any]:
        local_rank, after = int(req["local_rank"]), int(req["after"])
        loop = asyncio.get_running_loop()
        end = loop.time() + PLAN_WAIT_S
        while True:
            plan = self._plans.get(local_rank)
            if plan is not None and plan.generation > after:
                return plan.to_json()
            self._plan_changed.clear()
            remaining = end - loop.time()
            if remaining <= 0:
                return plan_to_json(None)
            await wait_event(self._plan_changed, remaining)  # a plan set as it times out is still taken

    async def _warm(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.warm.add(int(req["local_rank"]))
        self._wake()
        return {}

    async def _prepared(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.prepared.setdefault(int(req["generation"]), set()).add(int(req["local_rank"]))
        self._wake()
        return {}

    async def _joined(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.joined.setdefault(int(req["generation"]), set()).add(int(req["local_rank"]))
        self._emit_with_record("joined", int(req["generation"]), local_rank=req["local_rank"], seconds=req["seconds"],
                   verify_s=round(float(req.get("verify_s", 0.0)), 4))  # fmt: skip
        self._wake()
        return {}

    async def _replica_sent(self, req: dict[str, Any]) -> dict[str, Any]:
        self._emit("replica_sent", int(req["generation"]), local_rank=req["local_rank"], ranks=req["ranks"],
                   bytes=req["bytes"], seconds=round(req["seconds"], 3))  # fmt: skip
        return {}

    async def _heartbeat(self, req: dict[str, Any]) -> dict[str, Any]:
        if float(req.get("compute_s", 0.0)) > 0:
            self.state.compute_s[int(req["local_rank"])] = float(req["compute_s"])
        if int(req["local_rank"]) not in self.state.done:
            self.hangs.heartbeat(int(req["local_rank"]), time.monotonic(), int(req["steps"]), float(req["step_s"]),
                                 bool(req["waiting"]))  # fmt: skip
        if self.metrics is not None and "applied" in req and int(req.get("rank", -1)) >= 0:
            self.metrics.heartbeat(int(req["rank"]), int(req["steps"]), int(req["applied"]), float(req["step_s"]),
                                   float(req.get("compute_s", 0.0)))  # fmt: skip
        return {}

    async def _recovering(self, req: dict[str, Any]) -> dict[str, Any]:
        """A local worker saw a collective fail. The node reports the loss (its record's ``peer_lost_at``,
        on which the controller probes) once for all its workers, after a wait that spreads the job's
        reports of one loss (see rlaunch.agent.loss); the agent's loop is woken when it is due, unless
        a probe round made it needless. The event goes with the node's next record (or alone, after
        ``rlaunch.events.RECORD_WAIT_S``)."""
        gen = self.generation
        number, nodes = (gen.number, len(gen.assignment)) if gen else (0, 1)
        delay = self.state.loss.seen(number, nodes, time.time(), time.monotonic(), self._draw())
        if delay is not None:
            asyncio.get_running_loop().call_later(delay, self._wake_if_waiting)
        self._emit_with_record("recovering", number, local_rank=req["local_rank"], step=req["step"])
        return {}

    def _wake_if_waiting(self) -> None:
        if self.state.loss.waiting():
            self._wake()

    async def _recovered(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.recovered.setdefault(int(req["generation"]), set()).add(int(req["local_rank"]))
        self._wake()
        fields = ("rank", "step", "resume_at", "rolled_forward", "rebuilt", "dirty", "sends_to")
        back = {"rolled_back_to": req["rolled_back_to"], "steps_redone": req["steps_redone"]} if req.get(
            "rolled_back_to") is not None else {}  # fmt: skip
        self._emit_with_record("recovered", int(req["generation"]), seconds=round(req["seconds"], 3),
                   **{k: req[k] for k in fields}, **back)  # fmt: skip
        return {}

    async def _done(self, req: dict[str, Any]) -> dict[str, Any]:
        """The worker's ``rt.steps()`` ended: its hang watch stops (saving and teardown may take long)."""
        self.hangs.forget(int(req["local_rank"]))
        self.state.done.add(int(req["local_rank"]))
        if "verify_s" in req:  # what comparing the replicas cost this rank over the job
            self._emit("verification", self.generation.number if self.generation else 0, rank=req["rank"],
                       steps=req["steps"], step_s=round(req["step_s"], 4), verify_s=round(req["verify_s"], 4),
                       verifications=req["verifications"])  # fmt: skip
        return {}

    async def _unrecoverable(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.unrecoverable = str(req["reason"])
        self._emit("replacement_refused", int(req["generation"]), local_rank=req["local_rank"], reason=req["reason"])
        return {}

    async def _moves(self, req: dict[str, Any]) -> dict[str, Any]:
        """A rank's latest answer on live moves; the agent's loop publishes the node's summary."""
        self.state.moves[int(req["local_rank"])] = MovesReport.from_request(req)
        self._wake()
        return {}

    async def _sdc_suspected(self, req: dict[str, Any]) -> dict[str, Any]:
        """This rank's copy differs from its replicas': the node is out of the job before the reply.

        A malformed report still takes the node out (the worker found its own copy suspect), and
        then answers with the sentence naming the bad field.
        """
        local_rank = int(req["local_rank"])
        try:
            report, problem = SdcReport.from_request(req), None
        except ReportError as exc:
            report, problem = SdcReport.malformed(req, str(exc)), exc
        if self.on_sdc is None:
            raise ReportError("This agent cannot take a node out of the job yet; it is still starting.")
        await self.on_sdc(local_rank, report)
        if problem is not None:
            raise problem
        return {}

    async def _left(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.left.add(int(req["local_rank"]))
        self._emit("state_sent", int(req["generation"]), local_rank=req["local_rank"], bytes=req["bytes"],
                   seconds=req["seconds"])  # fmt: skip
        return {}

    async def _switched(self, req: dict[str, Any]) -> dict[str, Any]:
        self._emit("switched", int(req["generation"]), rank=req["rank"], downtime_ms=round(req["downtime_ms"], 1),
                   step_ms=round(req["step_ms"], 1), median_ms=round(req["median_ms"], 1),
                   verify_ms=round(float(req.get("verify_ms", 0.0)), 1))  # fmt: skip
        return {}

    async def _snapshot(self, req: dict[str, Any]) -> dict[str, Any]:
        """A host snapshot every rank holds was committed (see rlaunch.runtime.snapshots): this rank's
        part, as a local event (it recurs every few steps: not written to etcd)."""
        self._note("snapshot_committed", self.generation.number if self.generation else 0,
                   rank=require(req, "snapshot", "rank", int), step=require(req, "snapshot", "step", int),
                   bytes=require(req, "snapshot", "bytes", int),
                   copy_s=round(require(req, "snapshot", "copy_s", float), 4),
                   exchange_s=round(require(req, "snapshot", "exchange_s", float), 4),
                   every=require(req, "snapshot", "every", int),
                   cost_s=round(require(req, "snapshot", "cost_s", float), 4))  # fmt: skip
        return {}

    async def _snapshot_handover(self, req: dict[str, Any]) -> dict[str, Any]:
        """A drain's joiner holds the leaver's copies of the kept host snapshot (a local event, as ``snapshot``)."""
        self._note("snapshot_handed_over", self.generation.number if self.generation else 0,
                   rank=require(req, "snapshot_handover", "rank", int),
                   step=require(req, "snapshot_handover", "step", int),
                   bytes=require(req, "snapshot_handover", "bytes", int),
                   seconds=round(require(req, "snapshot_handover", "seconds", float), 4))  # fmt: skip
        return {}

    async def _phases(self, req: dict[str, Any]) -> dict[str, Any]:
        """Where a move's time went on one rank (see rlaunch.runtime.phases): logged as it came."""
        marks = {str(k): round(float(v), 6) for k, v in dict(req["marks"]).items()}
        self._emit("move_phases", int(req["generation"]), rank=int(req["rank"]), role=str(req["role"]), marks=marks,
                   bytes=int(req["bytes"]))  # fmt: skip
        return {}

    # -- the c10d store in etcd ---------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._keys.kv(key)

    async def _kv_set(self, req: dict[str, Any]) -> dict[str, Any]:
        await self._store.put(self._key(req["key"]), base64.b64decode(req["value"]), lease=self._lease())
        return {}

    async def _kv_get(self, req: dict[str, Any]) -> dict[str, Any]:
        key, timeout = self._key(req["key"]), float(req["timeout"])
        unset = f"The store key {req['key']!r} was not set within {timeout:.0f} s"
        value = await self._value_when_set(key, timeout, unset)
        return {"value": base64.b64encode(value).decode()}

    async def _value_when_set(self, key: str, timeout: float, unset: str) -> bytes:
        """The key's value once it is set: read, then watched from the revision read. When etcd
        breaks off (the watched member lost, a request that found no member), it reads and
        watches again, on the next member, :data:`KV_RETRY_S` later, until ``timeout``: a worker
        waiting on a group's rendezvous does not fail for a member etcd can do without. Past
        ``timeout`` it raises :class:`StoreError`: ``unset`` and the last way etcd broke off, if it did."""
        broke: list[str] = []

        async def read() -> bytes:
            while True:
                try:
                    kv, revision = await self._store.get_at(key)
                    if kv is not None:
                        return kv.value
                    async for ev in self._store.watch_prefix(key, start_revision=revision + 1, exact=True):
                        if not ev.deleted:
                            return ev.value
                except StoreUnavailableError as exc:
                    if not broke:
                        log.warning("a worker's wait for the store key %s broke off (%s); reading it again", key, exc)
                    broke.append(str(exc))
                    await self._sleep(KV_RETRY_S)

        try:
            return await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            cause = f" (etcd broke off {len(broke)} time(s) meanwhile, last: {broke[-1].rstrip('.')})" if broke else ""
            raise StoreError(f"{unset}{cause}.") from None

    async def _kv_gather(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every value under ``prefix`` once ``count`` are there, in key order, at O(1) requests per caller.

        Each caller counts the keys (keys only); the one that sees all of them reads their values
        once and publishes the list under ``done``, which the others wait for (one exact watch), so
        N callers cost O(N) requests instead of each reading the N others. Several callers may see
        the full count; they publish the same list.
        """
        prefix, done, count = self._key(req["prefix"]), self._key(req["done"]), int(req["count"])
        timeout = float(req["timeout"])
        if len(await self._store.keys_under(prefix)) >= count:
            kvs, _ = await self._store.get_prefix(prefix)
            values = [base64.b64encode(kv.value).decode() for kv in sorted(kvs, key=lambda kv: kv.key)]
            await self._store.put(done, json.dumps(values).encode(), lease=self._lease())
            return {"values": values}
        unset = f"Fewer than {count} store keys were set under {req['prefix']!r} within {timeout:.0f} s"
        return {"values": json.loads(await self._value_when_set(done, timeout, unset))}

    async def _kv_add(self, req: dict[str, Any]) -> dict[str, Any]:
        key, amount = self._key(req["key"]), int(req["amount"])
        for _ in range(1000):
            kv = await self._store.get(key)
            value = (int(kv.value) if kv is not None else 0) + amount
            if await self._store.put_guarded(
                key, str(value).encode(), kv.mod_revision if kv else 0, lease=self._lease()
            ):
                return {"value": value}
        raise StoreError(f"The store counter {req['key']!r} kept changing; add({amount}) gave up after 1000 tries.")

    async def _kv_compare_set(self, req: dict[str, Any]) -> dict[str, Any]:
        key = self._key(req["key"])
        expected, desired = base64.b64decode(req["expected"]), base64.b64decode(req["desired"])
        kv = await self._store.get(key)
        current = kv.value if kv is not None else None
        if (current is None and expected == b"") or current == expected:
            if await self._store.put_guarded(key, desired, kv.mod_revision if kv else 0, lease=self._lease()):
                return {"value": base64.b64encode(desired).decode()}
            kv = await self._store.get(key)
            current = kv.value if kv is not None else None
        return {"value": base64.b64encode(current if current is not None else expected).decode()}

    async def _kv_check(self, req: dict[str, Any]) -> dict[str, Any]:
        for key in req["keys"]:
            if await self._store.get(self._key(key)) is None:
                return {"value": False}
        return {"value": True}

    async def _kv_delete(self, req: dict[str, Any]) -> dict[str, Any]:
        key = self._key(req["key"])
        existed = await self._store.get(key) is not None
        await self._store.delete(key)
        return {"value": existed}

    async def _kv_count(self, req: dict[str, Any]) -> dict[str, Any]:
        kvs, _ = await self._store.get_prefix(self._keys.kv(""))
        return {"value": len(kvs)}
