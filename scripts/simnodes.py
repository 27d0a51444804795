"""Simulated nodes for scripts/bench_control_plane.py: the agent's own code, without processes.

Each :class:`SimNode` is what an agent does with a generation, many of them in one process on a
few shared etcd channels:

- it holds a lease, renewed every third of its TTL (its first wait a random part of it, as an
  agent's), and a node record attached to it;
- it follows the job with the agent's own :class:`~rlaunch.agent.generations.GenerationWatch` (the
  generation's head and the leader key; node records while it holds no ranks), which rebuilds
  each generation's rank map from the one held, or reads it whole, as an agent does;
- it decides with the agent's own :func:`~rlaunch.agent.transitions.decide` on every change the
  watch wakes it for, and carries the actions out as the agent does, with no processes:
  ``Publish`` puts its node record (and a ``node_state`` event when the state changes), in one
  request with the events emitted before it, as :class:`~rlaunch.agent.record.RecordPublisher` does;
  ``Acknowledge`` puts its ack and deletes the previous one; ``Emit`` goes to its own
  :class:`~rlaunch.events.EventLog` (etcd puts in the background; an event the record follows waits
  for it, as the agent's); starting and stopping workers writes the events the supervisor writes;
  ``Offer`` hands the plan to its workers, which recover (or join) at once: a ``recovered`` event and the
  ``Settled`` decision (record ``running``). A standby's sandbox is warm at once.

Each node answers the controller's liveness probes on a port of its own, as an agent does
(:func:`~rlaunch.detectors.liveness.serve`). A survivor's workers report a lost peer when the
benchmark says so (``lose_peer``, with ``--survivor-reports``): its record then says the loss, with
their ``recovering`` event, when the agent's would (:class:`~rlaunch.agent.loss.LossReport`: after a
random wait, and not if a probe round reached it first). Not simulated: worker processes and what
they report beyond that (their hello is taken as immediate, so a record says ``runtime`` from the
first one after its workers start; no heartbeats or metrics), the agents' probes of each other, the
GPU detector.

Each node notes when it saw a generation (its watch took it), acted on it (handed it to its
workers: ``Offer`` or ``StartWorkers``), published it (its first record at that generation was
put) and ran it (record ``running`` at it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from rlaunch.agent import states as st
from rlaunch.agent.generations import GenerationWatch
from rlaunch.agent.lease import first_pause
from rlaunch.agent.loss import LossReport
from rlaunch.agent.transitions import decide
from rlaunch.controller.view import read_snapshot
from rlaunch.detectors.liveness import serve
from rlaunch.errors import StoreError
from rlaunch.events import EventLog
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Ack, Generation, NodeRecord, NodeState, encode
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: Simulated nodes' lease TTL: renewed every third of it, as agents do; long enough that a
#: thousand tasks on a loaded machine renew in time.
SIM_TTL = 30
#: A write that fails (a loaded machine) is tried again after this long, as the agent's loop does.
RETRY_S = 0.5


def pause_collector() -> None:
    """Collect once, then keep Python's garbage collector from running until :func:`resume_collector`
    (over a fault's window).

    An agent's handling of a plan allocates about 200 more container objects than it frees (a window
    at 4,096 nodes made 1,100 to 1,400 collections, each after 700 such allocations), fewer than one
    young collection's threshold, and a full collection comes after 100 young ones: an agent's
    collector does not walk its heap during a move. Here N nodes' objects share one heap, and the
    collector did, over all of them: at 4,096 nodes the nodes used 21.7 CPU seconds and took 21.4 s
    to act in one window; with the formed job's objects frozen out of its reach (:func:`gc.freeze`),
    10.3 to 11.6 CPU seconds and 10.8 to 11.6 s, the collector still taking 3.8 to 4.3 of them over
    the window's own objects; with it paused, 6.5 to 7.2 and 6.4 to 7.0 s.
    """
    gc.collect()
    gc.disable()


def resume_collector() -> None:
    gc.enable()


class GatedWrites:
    """A store whose writes wait while ``gate`` is clear; reads, watches and leases pass at once.

    With the gate closed from a fault until every node has acted, the nodes' own writes do not
    share this process's CPU with other nodes' receipt of the plan, as they do not when each agent
    has a machine of its own.
    """

    def __init__(self, store: Store, gate: asyncio.Event) -> None:
        self._store, self._gate = store, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._gate.wait()
        await self._store.put(key, value, lease=lease)

    async def put_all(self, items: list[tuple[str, bytes]], lease: int | None = None) -> None:
        await self._gate.wait()
        await self._store.put_all(items, lease=lease)

    async def put_each(self, items: list[tuple[str, bytes, int | None]]) -> None:
        await self._gate.wait()
        await self._store.put_each(items)

    async def delete(self, key: str) -> None:
        await self._gate.wait()
        await self._store.delete(key)


class SimNode:
    """One simulated agent (see the module's docstring)."""

    def __init__(self, node_id: str, store: Store, keys: JobKeys) -> None:
        self.node_id, self.store, self.keys = node_id, store, keys
        self.lease = 0
        self.node = st.Node()
        self.record: NodeRecord | None = None
        self.running = False  # whether its (simulated) workers run
        self.warm = 0
        self.settle: tuple[int, str] | None = None  # (generation, role) its workers recover or join in
        self.loss = LossReport()  # the peer losses its workers saw, as the link's
        self.probe_port = 0
        self._probe_server: asyncio.Server | None = None
        self._unsent = False  # etcd has not taken self.record yet: sent again, as the agent does
        self.seen: dict[int, float] = {}  # generation number -> monotonic time
        self.acted: dict[int, float] = {}
        self.published: dict[int, float] = {}
        self.ran: dict[int, float] = {}
        self.stop = asyncio.Event()
        self._wake = asyncio.Event()
        self.watch = GenerationWatch(store, keys, node_id, self._wake.set, lambda: None, self._saw)
        self.events = EventLog(store, keys, node_id, None, time.time)
        self._tasks: list[asyncio.Task[Any]] = []

    def _saw(self, gen: Generation) -> None:
        self.seen.setdefault(gen.number, time.monotonic())

    def make(self, state: NodeState, generation: int, codes: dict[str, int] | None = None,
             failure: tuple[str, str] = ("", "")) -> NodeRecord:  # fmt: skip
        return NodeRecord(
            node_id=self.node_id, host="sim", addr="127.0.0.1", pid=0, nproc=1, standby_only=False, state=state,
            generation=generation, restarts=0, master_port=29500, updated_at=time.time(),
            exit_codes=codes or {}, runtime=self.running, failure=failure[0], message=failure[1],
            probe_port=self.probe_port, peer_lost_at=self.loss.said_at,
        )  # fmt: skip

    def lose_peer(self, generation: int, nodes: int, wall: float, mono: float) -> None:
        """Its workers saw a collective fail (a peer is lost) in ``generation`` of ``nodes`` nodes at ``wall``
        (``time.time()``) and ``mono`` (``time.monotonic()``), the fault's moment (the benchmark tells its
        hosts a moment later): reported in its record when due, with their ``recovering`` event, as the
        agent's worker link and loop do."""
        delay = self.loss.seen(generation, nodes, wall, mono, random.random())
        if delay is not None:
            wait = max(0.0, mono + delay - time.monotonic())
            asyncio.get_running_loop().call_later(wait, lambda: self._wake.set() if self.loss.waiting() else None)
        self.events.emit_with_record("recovering", generation, local_rank=0, step=0)

    async def join(self) -> None:
        """Register under a fresh lease (the first nodes to join hold ranks, later ones stand by)."""
        self._probe_server, self.probe_port = await serve(lambda gen: self.loss.probed(time.monotonic(), gen))
        self.lease = await self.store.grant_lease(SIM_TTL)
        self.record = self.make(NodeState.WAITING, 0)
        await self.store.put(self.keys.node(self.node_id), encode(self.record), lease=self.lease)

    def start(self) -> None:
        self.events.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(t) for t in (self._keepalive(), self.watch.run(self.stop), self._loop())]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        """Say so when one of the node's tasks ends by an error: the node would stop acting, silently."""
        if not task.cancelled() and task.exception() is not None:
            log.error("simulated node %s: %s ended by an error", self.node_id, task.get_coro().__qualname__,
                      exc_info=task.exception())  # fmt: skip

    async def fail(self) -> int:
        """The node is lost: its tasks end (nothing more is written); returns its lease, to revoke."""
        lease, self.lease = self.lease, 0
        await self.close()
        return lease

    async def close(self) -> None:
        if self._probe_server is not None:  # the controller's probe now finds it gone
            self._probe_server.close()
        self.stop.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=5)
        await self.events.close(timeout=1.0)

    async def _send(self) -> None:
        record = self.record
        assert record is not None
        await self.events.put_with(self.keys.node(self.node_id), encode(record), self.lease)
        if record is self.record:
            self._unsent = False
        self.published.setdefault(record.generation, time.monotonic())
        if record.state is NodeState.RUNNING:
            self.ran.setdefault(record.generation, time.monotonic())

    async def _keepalive(self) -> None:
        pause = first_pause(SIM_TTL)  # as the agent's LeaseKeeper: nodes that joined together renew apart
        while not await wait_event(self.stop, pause):
            pause = SIM_TTL / 3
            with contextlib.suppress(StoreError):  # a loaded machine: try again at the next renewal
                await self.store.refresh_lease(self.lease)

    async def _loop(self) -> None:
        """The agent's loop: look on every wake-up; a failed etcd request is tried again."""
        while not self.stop.is_set():
            try:
                if self._unsent:
                    await self._send()
                if self.settle is not None:
                    (gen, role), self.settle = self.settle, None
                    self.events.emit_with_record("joined" if role == "joiner" else "recovered", gen, seconds=0.0,
                                                 local_rank=0)  # fmt: skip
                    await self._carry_out(decide(self.node, st.Settled()))
                await self._look()
                await self._report()
            except StoreError:
                await asyncio.sleep(RETRY_S)
                self._wake.set()
                continue
            await self._wake.wait()
            self._wake.clear()

    async def _report(self) -> None:
        """Say a peer loss its workers saw in its record, after the look, as the agent's loop does."""
        record = self.record
        self.loss.to_say(time.monotonic())
        if record is not None and self.loss.said_at > record.peer_lost_at:
            self.record = self.make(record.state, record.generation, dict(record.exit_codes),
                                    (record.failure, record.message))  # fmt: skip
            self._unsent = True
            await self._send()  # the controller probes

    async def _look(self) -> None:
        gen = self.watch.generation
        uses_runtime: bool | None = None
        while True:
            record = self.record
            published = st.Published(record.state, record.generation, record.exit_codes) if record else None
            obs = st.Look(gen, self.node_id, 1, published, "", frozenset(), self.warm, self.watch.nodes_changed,
                          uses_runtime)  # fmt: skip
            decision = decide(self.node, obs)
            await self._carry_out(decision)
            if decision.need is None or gen is None:
                return
            if decision.need is st.Need.RUNTIME and uses_runtime is None:
                snap = await self.watch.read_changed_nodes(lambda: read_snapshot(self.store, self.keys))
                uses_runtime = any(snap.nodes[n].record.runtime for n in gen.assignment if n in snap.nodes)
            else:
                raise st.IllegalTransition(f"The decision needed {decision.need.value} again after it was read.")

    async def _carry_out(self, decision: st.Decision) -> None:
        for step in decision.steps:
            self.node = step.node
            await self._do(step.action)
        self.node = decision.node

    async def _do(self, action: st.Action) -> None:  # noqa: PLR0912 - one branch per action
        now = time.monotonic()
        if isinstance(action, st.StopWorkers):
            if self.running:
                self.running, self.warm = False, 0
                self.events.emit("workers_stopped", action.event_gen, codes={"0": -15})
        elif isinstance(action, st.StartWorkers):
            self.running = True
            self.acted.setdefault(action.gen.number, now)
            self.events.emit("workers_started", action.gen.number, ranks=action.gen.ranks_of(self.node_id))
        elif isinstance(action, st.StartSandbox):
            self.running, self.warm = True, 1  # warm at once
            self.events.emit("sandbox_started", action.gen.number)
        elif isinstance(action, st.Offer):
            self.acted.setdefault(action.gen.number, now)
            self.settle = (action.gen.number, action.role)
            self._wake.set()
        elif isinstance(action, st.Publish):
            previous = self.record.state if self.record else None
            self.record = self.make(action.state, action.generation, dict(action.exit_codes or {}), action.failure)
            if previous is not action.state:
                self.events.emit("node_state", action.generation, state=action.state.value,
                                 previous=previous.value if previous else None)  # fmt: skip
            self._unsent = True
            await self._send()
        elif isinstance(action, st.Acknowledge):
            ack = Ack(node_id=self.node_id, generation=action.gen)
            await self.store.put(self.keys.ack(action.gen, self.node_id), encode(ack), lease=self.lease)
            if action.previous:
                await self.store.delete(self.keys.ack(action.previous, self.node_id))
        elif isinstance(action, st.Emit):
            emit = self.events.emit_with_record if action.with_record else self.events.emit
            emit(action.name, action.gen, **action.fields)
        elif isinstance(action, st.Log):
            pass
        else:  # drains, reaps and exits do not happen in this benchmark's events
            raise st.IllegalTransition(f"A simulated node cannot carry out {action!r}.")


def ready_standby(node: SimNode) -> bool:
    """What the planner takes as a ready standby (rlaunch.controller.planner.is_ready), as etcd has it."""
    r = node.record
    return r is not None and r.state is NodeState.STANDBY and r.runtime and node.published.get(r.generation, 0) > 0


async def until(pred: Callable[[], object], timeout: float, what: str, every: float = 0.01) -> None:
    """Look at ``pred()`` every ``every`` seconds until it is true; RuntimeError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s.")
        await asyncio.sleep(every)
