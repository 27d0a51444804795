"""Host-memory snapshots for layouts without a replica, and the rollback they make possible.

Pure FSDP2, tensor parallelism and TP x FSDP hold each shard on one rank only: no replica can
serve a lost rank. So every ``RLAUNCH_SNAPSHOT_EVERY`` steps (``auto``: :data:`AUTO_EVERY`), at a
step's start, each rank of such a job copies its state into its own host memory (what it rolls
back to) and sends that copy to its *buddy*, the rank ``nproc`` ranks further on the ring, which
is on the next machine, and receives in turn the copy of the rank whose buddy it is. The copy
to the buddy runs on a thread of its own, over a gloo pair of its own, while training goes on.
No GPU memory is used, and each machine holds twice its own ranks' state at most: its ranks'
copies and those it holds for the previous machine.

A snapshot counts once every rank holds both its parts: each step's vote carries "I hold
snapshot S" (:data:`SECTION`), and the vote in which every rank says so commits it, as a vote
commits a step. The schedule (which step is snapshot S) is the same on every rank.

After a fault that no replica can serve, the survivors agree on the snapshot to roll back to
(:func:`rollback`, from every survivor's :meth:`HostSnapshots.report`), put their own copy back in
place, and the buddy of each lost rank sends the copy it holds to that rank's joiner, which
receives it as a move. The job then redoes the steps since the snapshot. The rollback is refused
(the job restarts, with the sentence) when no snapshot was committed yet, when a lost rank's
buddy is lost too, or when the fault came while a snapshot was being taken: a rank overwrites
its own copy when the next snapshot starts, so between that start and the next commit (a step or
two) only the restart path is left.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlaunch.runtime import backend as backends
from rlaunch.runtime import hostcopy, rng
from rlaunch.runtime.groups import retire
from rlaunch.runtime.hostcopy import HostCopy
from rlaunch.runtime.rankstate import RankState

log = logging.getLogger(__name__)

#: the environment variable that sets the interval: a number of steps, ``auto`` or 0 (off)
ENV = "RLAUNCH_SNAPSHOT_EVERY"
#: the interval of ``auto``, in steps (see the README's sizing of snapshots)
AUTO_EVERY = 20
#: the vote section: the snapshot each rank holds both parts of, and its square (see HostSnapshots.terms)
SECTION = "snapshot"
#: the vote carries a snapshot's step modulo this (+1): its square times the world size stays exact
#: in float64, and the ranks are never that many steps apart
VOTE_MOD = 1 << 20
#: how long a snapshot's start waits for the previous generation's exchange to end once its pairs
#: are cut (an exchange of this generation still running is not waited for: the snapshot is skipped)
JOIN_WAIT_S = 1.0
#: the snapshot pairs' gloo timeout, for their rendezvous and every operation: a pair whose peer is
#: gone holds this process's communicator builds (they are serialized) until it ends
PAIR_TIMEOUT = datetime.timedelta(seconds=60)


def interval(value: str) -> int:
    """``RLAUNCH_SNAPSHOT_EVERY`` as steps (0: off)."""
    text = value.strip().lower()
    if text == "auto":
        return AUTO_EVERY
    if text.isascii() and text.isdigit():
        return int(text)
    raise ValueError(
        f"{ENV}={value!r} is not valid: give a number of steps between host snapshots (such as 20), auto "
        f"(every {AUTO_EVERY} steps) or 0 (off)."
    )


def buddy(rank: int, world: int, per_node: int) -> int:
    """The rank that holds ``rank``'s snapshot: ``per_node`` ranks on, on the next machine."""
    return (rank + per_node) % world


def source(rank: int, world: int, per_node: int) -> int:
    """The rank whose snapshot ``rank`` holds."""
    return (rank - per_node) % world


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Where the survivors roll back to, and which survivor sends each lost rank its copy."""

    step: int
    holders: dict[int, int]  # lost rank -> the survivor holding its copy


def rollback(
    reports: Sequence[dict[str, Any]], moved: Sequence[int], holder_of: Callable[[int], int]
) -> Rollback | str:
    """The committed snapshot every survivor can roll back to, or why there is none (pure).

    Each report is a survivor's ``{"rank": r, "snapshot": HostSnapshots.report()}``. The newest
    snapshot any survivor saw committed is the one: a vote that committed it had every rank's
    word that it held it, and a rank gives that word up only when it starts the next snapshot.
    """
    by_rank = {int(r["rank"]): r["snapshot"] for r in reports}
    committed = max(int(s["committed"]) for s in by_rank.values())
    if committed < 0:
        return "no host snapshot had been committed yet"
    for rank, snap in sorted(by_rank.items()):
        if int(snap["own"]) != committed:
            return (
                f"rank {rank} had begun the snapshot of step {snap['own']} when the fault came, so it no longer holds "
                f"its copy of step {committed}"
            )
    holders = {}
    for lost in sorted(moved):
        holder = holder_of(lost)
        if holder in moved or holder not in by_rank:
            return f"rank {lost} and rank {holder}, which held its snapshot, were lost together"
        snap = by_rank[holder]
        if int(snap["held"]) != committed or int(snap["source"]) != lost:
            return (
                f"rank {holder} does not hold rank {lost}'s snapshot of step {committed} (it holds step {snap['held']})"
            )
        holders[lost] = holder
    return Rollback(committed, holders)


class HostSnapshots:
    """One rank's host snapshots: the schedule, its own copy, the copy it holds, and the exchange.

    ``needed`` says whether the job's layout lacks a replica (the replica path, which loses no
    steps, is kept otherwise); ``per_node`` is the number of ranks on each machine.
    """

    def __init__(self, state: RankState, every: int, per_node: int, needed: Callable[[], bool]) -> None:
        self._s = state
        self.every = every if state.world_size > per_node else 0  # one machine: no other host to hold it
        self._per_node = per_node
        self._needed = needed
        self.own: HostCopy | None = None
        self.held: HostCopy | None = None  # the copy of source(rank)'s state
        self.pending = -1  # the step of the snapshot being taken (or the last one)
        self.committed = -1  # the step of the last snapshot every rank held
        self._gen: int | None = None  # the generation of the last snapshot
        self._pairs: tuple[int, Any, Any] | None = None  # (generation, send pair, receive pair)
        self._thread: threading.Thread | None = None
        #: what the last snapshot cost: seconds on the main thread, seconds of the exchange, bytes
        self.last: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        """Snapshots are configured and possible (every rank answers alike: the vote's layout depends on it)."""
        return self.every > 0

    def due(self, step: int) -> bool:
        """Whether ``step``'s start takes a snapshot: every ``every`` steps, and at the first step of a
        new generation (a move changed who holds what)."""
        s = self._s
        if not self.enabled or s.standby or not self._needed():
            return False
        return step % self.every == 0 or self._gen != s.generation

    def take(self, step: int) -> None:
        """(main thread, at ``step``'s start) Copy this rank's state, then exchange copies in the background."""
        s = self._s
        began = time.perf_counter()
        moved = self._gen != s.generation
        if moved:
            self._cut()  # the old generation's pairs: a moved rank may be in them
        if not self._join(JOIN_WAIT_S if moved else 0.0):
            # Not this turn: this rank holds no copy of ``step``, so its vote keeps it from committing.
            log.warning("rank %d: the previous snapshot's exchange still runs; step %d takes none", s.rank, step)
            self.pending, self._gen = step, s.generation
            return
        state = rng.capture()
        self.own = hostcopy.capture(s.tracked, step, state, self.own)
        rng.restore(state)
        self.pending, self._gen = step, s.generation
        self.last = {"copy_s": time.perf_counter() - began, "bytes": float(self.own.nbytes)}
        self._thread = threading.Thread(
            target=self._exchange, args=(self.own, s.generation), name="rlaunch-snapshot", daemon=True
        )
        self._thread.start()

    def _exchange(self, own: HostCopy, gen: int) -> None:
        """(snapshot thread) Send this rank's copy to its buddy and receive its source's copy."""
        s = self._s
        began = time.perf_counter()
        try:
            send_pair, recv_pair = self._pair_channels(gen)
            hostcopy.seal(own)
            sender = threading.Thread(target=hostcopy.send, args=(send_pair, own), name="rlaunch-snapshot-send")
            sender.start()
            self.held = hostcopy.receive(recv_pair, self.held)
            sender.join()
        except Exception as exc:  # noqa: BLE001 - a peer gone, a cut pair: this snapshot is not held
            log.warning("rank %d: the snapshot of step %d was not exchanged: %s", s.rank, own.step, exc)
            self.held = None
            return
        self.last["exchange_s"] = time.perf_counter() - began

    def _pair_channels(self, gen: int) -> tuple[Any, Any]:
        """This generation's two pairs: to the buddy (as side 0) and from the source (as side 1).

        Built in the order of their sender's rank on every rank, so that the rendezvous of one
        never waits on a peer building another (with two ranks each is the other's buddy).
        """
        if self._pairs is not None and self._pairs[0] == gen:
            return self._pairs[1], self._pairs[2]
        s = self._s
        assert s.store is not None
        mine, theirs = s.rank, source(s.rank, s.world_size, self._per_node)
        built = {}
        for sender in sorted({mine, theirs}):
            for side in ([0] if sender == mine else []) + ([1] if sender == theirs else []):
                built[side] = backends.build(
                    s.store, f"g{gen}/snapshot/{sender}/", side, 2, min(s.timeout, PAIR_TIMEOUT),
                    backends.Backend.GLOO, None,
                )  # fmt: skip
        self._pairs = (gen, built[0], built[1])
        return built[0], built[1]

    def _cut(self) -> None:
        """End an exchange in flight: its pairs' connections are shut down, so its operations fail."""
        if self._pairs is None:
            return
        _, send_pair, recv_pair = self._pairs
        self._pairs = None
        for pair in (send_pair, recv_pair):
            backends.cut(id(pair))
            retire(pair)

    def close(self) -> None:
        """At exit: end an exchange in flight and release the pairs now (a gloo group left to
        interpreter teardown can abort the process)."""
        pairs, self._pairs = self._pairs, None
        for pair in pairs[1:] if pairs is not None else ():
            backends.cut(id(pair))
        self._join(5.0)
        for pair in pairs[1:] if pairs is not None else ():
            backends.current().release(pair)

    def _join(self, timeout: float) -> bool:
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def holds(self) -> bool:
        """This rank holds both parts of the snapshot being taken (its vote term)."""
        return (
            (self._thread is None or not self._thread.is_alive())
            and self.own is not None
            and self.held is not None
            and self.own.step == self.pending == self.held.step
        )

    def terms(self) -> list[float]:
        """This rank's vote section: which snapshot it holds whole (0: none) and its square."""
        v = float(self.pending % VOTE_MOD + 1) if self.holds() else 0.0
        return [v, v * v]

    def commit(self, summed: Sequence[float]) -> None:
        """Read the vote's sums of every rank's :meth:`terms`: when every rank holds the snapshot this
        rank is taking (all values equal, and not 0), it is committed."""
        world = self._s.world_size
        total, squares = round(summed[0]), round(summed[1])
        mine = self.pending % VOTE_MOD + 1
        if total == world * mine and world * squares == total * total and self.pending > self.committed:
            self.committed = self.pending
            link = self._s.link
            if link is not None:
                link.call(
                    "snapshot", rank=self._s.rank, step=self.committed, bytes=int(self.last.get("bytes", 0)),
                    copy_s=self.last.get("copy_s", 0.0), exchange_s=self.last.get("exchange_s", 0.0),
                )  # fmt: skip

    def stop(self) -> None:
        """(recovery) End the exchange in flight, before this rank reports what it holds."""
        self._cut()
        if not self._join(2.0):  # one still building a pair with a lost peer: it reports no copy held
            log.warning("rank %d: the snapshot exchange did not end after its pairs were cut", self._s.rank)

    def report(self) -> dict[str, Any]:
        """What this rank holds, for the survivors' agreement (:func:`rollback`)."""
        s = self._s
        exchanging = self._thread is not None and self._thread.is_alive()
        return {
            "committed": self.committed,
            "own": self.own.step if self.own is not None else -1,
            "held": self.held.step if self.held is not None and not exchanging else -1,
            "source": source(s.rank, s.world_size, self._per_node),
        }

    def holder_of(self, rank: int) -> int:
        return buddy(rank, self._s.world_size, self._per_node)

    def restore(self) -> None:
        """Roll this rank back to its own copy (the committed snapshot)."""
        assert self.own is not None
        hostcopy.restore(self.own, self._s.tracked, self._s.rank)

    def send_to(self, channel: Any, lost: int, knowledge: dict[str, Any]) -> int:
        """Send the copy this rank holds of ``lost`` to its joiner; return the bytes sent."""
        assert self.held is not None and source(self._s.rank, self._s.world_size, self._per_node) == lost
        return hostcopy.send(channel, self.held, knowledge)
