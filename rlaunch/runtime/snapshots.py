"""Host-memory snapshots for layouts without a replica, and the rollback they make possible.

Pure FSDP2, tensor parallelism and TP x FSDP hold each shard on one rank only: no replica can
serve a lost rank. So every ``RLAUNCH_SNAPSHOT_EVERY`` steps (``auto``: see :func:`choose`), at a
step's start, each rank of such a job copies its state into its own host memory (what it rolls
back to) and sends that copy to its *buddy*, the rank ``nproc`` ranks further on the ring, which
is on the next machine, and receives in turn the copy of the rank whose buddy it is. The copy
to the buddy runs on a thread of its own, over a gloo pair of its own, while training goes on.
No GPU memory is used, and each machine holds twice its own ranks' state at most: its ranks'
copies and those it holds for the previous machine. ``RLAUNCH_SNAPSHOT_MBPS`` bounds the
exchange's bandwidth (:func:`rlaunch.runtime.hostcopy.send`).

A snapshot counts once every rank holds both its parts: each step's vote carries "I hold
snapshot S" (:data:`SECTION`), and the vote in which every rank says so commits it, as a vote
commits a step. The schedule (which step is snapshot S) is the same on every rank, and so is the
choice to take them at all: the vote also carries "no replica can serve me", and the job takes
snapshots from the vote after any rank said so (a joiner learns it with the state it receives).

The interval is a value every rank holds alike (``RankState.snapshot_every``; a joiner learns it
with its state), and the vote carries it, so that ranks that disagree are seen. With ``auto`` it
is chosen at each commit (but a generation's first: see :meth:`HostSnapshots.commit`) by
:func:`choose`, a pure function of the vote's sums: what the ranks
measured a snapshot to cost (the excess of the steps it overlapped over the steps no snapshot
overlapped, :meth:`HostSnapshots.stepped`), their median step, and how many steps the snapshot
took to commit.
Every rank reads the same sums in the same vote, so every rank moves to the same interval at the
same step, never from its own clock.

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

import collections
import dataclasses
import datetime
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from rlaunch.errors import UsageError
from rlaunch.runtime import backend as backends
from rlaunch.runtime import hostcopy, meeting, rng
from rlaunch.runtime.agent_link import AgentLinkError
from rlaunch.runtime.groups import retire
from rlaunch.runtime.handover import Receiving
from rlaunch.runtime.hostcopy import HostCopy
from rlaunch.runtime.priority import yield_thread
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.transfer import TransferError

log = logging.getLogger(__name__)

#: the environment variable that sets the interval: a number of steps, ``auto`` or 0 (off)
ENV = "RLAUNCH_SNAPSHOT_EVERY"
#: the environment variable that bounds each rank's exchange with its buddy, in MB/s (0: unbounded)
RATE_ENV = "RLAUNCH_SNAPSHOT_MBPS"
#: ``auto``'s interval before any snapshot's cost was measured, and its grid: it takes multiples of
#: this many steps only (see :func:`choose`), so a snapshot that takes two steps to commit leaves
#: one fault in ten or fewer to restart, and snapshots fall on the same steps whatever it chose
#: (see docs/layouts.md, "Host snapshots", for their sizing)
AUTO_EVERY = 20
#: the longest interval ``auto`` takes, in steps: past it, snapshots costing more than the target
#: are kept, so that a fault never redoes more (the log says so)
AUTO_MAX = 100
#: ``auto``'s target: a snapshot's measured cost spread over its interval stays within this
#: percentage of the step time
TARGET_PCT = 1
#: ``auto`` keeps the window in which a fault can only restart the job (a snapshot's start to its
#: commit) to at most one step in this many
WINDOW_SHARE = 10
#: the snapshots whose measured cost a rank keeps (it votes their median)
COSTS_KEPT = 5
#: the periods of steps that no snapshot overlapped a rank keeps (a snapshot's cost is its steps'
#: excess over their median)
QUIET_KEPT = 50
#: the vote section: the snapshot each rank holds both parts of, its square, whether the rank
#: needs snapshots, the interval it follows, and what it measured (see HostSnapshots.terms)
SECTION = "snapshot"
#: the vote carries a snapshot's step modulo this (+1): its square times the world size stays exact
#: in float64 up to 2 million ranks, and the ranks are never that many steps apart
VOTE_MOD = 1 << 16
#: how long a snapshot's start waits for the previous generation's exchange to end once its pairs
#: are cut (an exchange of this generation still running is not waited for: the snapshot is skipped)
JOIN_WAIT_S = 1.0
#: the snapshot pairs' gloo timeout, for every operation, and how long their two sides may take to
#: meet (rlaunch.runtime.meeting; once met, the build itself has it again)
PAIR_TIMEOUT = datetime.timedelta(seconds=60)
#: after a drain that kept the committed snapshot (see HostSnapshots.keeps), the steps from the
#: drain's first within which the joiner must hold the leaver's copies (it receives them once the
#: first ended: the others are theirs); past them, every rank takes a new snapshot, as after any
#: other move
HANDOVER_STEPS = 6
#: the steps a drain waits, after a snapshot was taken, for its exchange to end before its ranks vote
#: ready anyway (see HostSnapshots.exchanging; with snapshots this often or more, it never waits): a
#: drain agreed while an exchange runs cannot keep a snapshot
EXCHANGE_WAIT_STEPS = 4


def interval(value: str) -> tuple[int, bool]:
    """``RLAUNCH_SNAPSHOT_EVERY`` as the first interval in steps (0: off) and whether ``auto`` chooses the next ones."""
    text = value.strip().lower()
    if text == "auto":
        return AUTO_EVERY, True
    if text.isascii() and text.isdigit():
        return int(text), False
    raise UsageError(
        f"{ENV}={value!r} is not valid: give a number of steps between host snapshots (such as 20), auto "
        f"(chosen from what they cost: {AUTO_EVERY} steps or a multiple) or 0 (off)."
    )


def choose(current: int, cost_ms: int, step_ms: int, window: int) -> int:
    """``auto``'s interval after a commit, in steps (pure: every rank computes it from the same vote sums).

    ``cost_ms`` and ``step_ms``: the sums, over the ranks that measured one, of a snapshot's cost
    and of the median step (milliseconds, whole numbers: their sums are exact on every rank);
    ``window``: the steps from the committed snapshot's start to its commit. The interval is the
    smallest multiple of :data:`AUTO_EVERY` that keeps the cost within :data:`TARGET_PCT` % of the
    steps and the window within one step in :data:`WINDOW_SHARE`, at most :data:`AUTO_MAX`. It
    grows at once when the current one misses that, and shrinks only to half or less, so that the
    noise of the measurement does not move it at every commit.
    """
    needed = max(AUTO_EVERY, WINDOW_SHARE * window)
    if cost_ms > 0 and step_ms > 0:
        needed = max(needed, -(-100 * cost_ms // (TARGET_PCT * step_ms)))  # ceil, in integers
    chosen = min(-(-needed // AUTO_EVERY) * AUTO_EVERY, AUTO_MAX)
    return chosen if chosen > current or 2 * chosen <= current else current


def rate(value: str) -> float:
    """``RLAUNCH_SNAPSHOT_MBPS`` as bytes per second (0: unbounded)."""
    try:
        mbps = float(value)
    except ValueError:
        mbps = -1.0
    if not mbps >= 0 or mbps == float("inf"):
        raise UsageError(
            f"{RATE_ENV}={value!r} is not valid: give the most MB/s each rank's snapshot exchange may take "
            "(such as 500), or 0 (unbounded, the default)."
        )
    return mbps * 1e6


def buddy(rank: int, world: int, per_node: int) -> int:
    """The rank that holds ``rank``'s snapshot: ``per_node`` ranks on, on the next machine."""
    return (rank + per_node) % world


def source(rank: int, world: int, per_node: int) -> int:
    """The rank whose snapshot ``rank`` holds."""
    return (rank - per_node) % world


def pair_order(rank: int, world: int, per_node: int) -> list[int]:
    """The senders of ``rank``'s two snapshot pairs (its own, to its buddy; its source's, to it), in
    the order every rank builds its pairs: by round, then sender.

    Each rank builds one pair at a time, so the order decides how long the last pair waits. The pairs
    form cycles (rank, buddy, buddy's buddy, ...); along each one they are given rounds 0, 1, 0,
    1, ..., and the last pair of an odd cycle round 2, so that a rank's two pairs are in different
    rounds and the pairs of a round share no rank: every pair of a round is built at once, three
    builds deep for any world size (in sender order it was a chain of ``world`` builds)."""
    cycles = math.gcd(per_node, world)
    length = world // cycles

    def round_of(sender: int) -> int:
        position = (sender // cycles) * pow(per_node // cycles, -1, length) % length if length > 1 else 0
        return 2 if length % 2 and position == length - 1 else position % 2

    return sorted({rank, source(rank, world, per_node)}, key=lambda sender: (round_of(sender), sender))


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
    committed = max(int(snap["committed"]) for snap in by_rank.values())
    if committed < 0:
        return "no host snapshot had been committed yet"
    for rank, snap in sorted(by_rank.items()):
        if int(snap["own"]) != committed and snap.get("handover"):
            return (
                f"rank {rank} did not hold its copies of snapshot {committed} from the drained rank it replaced "
                f"({snap['handover']})"
            )
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
        if snap.get("held_refused") and int(snap["held"]) == committed:
            return f"rank {holder}'s copy of rank {lost}'s snapshot failed its check: {snap['held_refused']}"
        if int(snap["held"]) != committed or int(snap["source"]) != lost:
            return (
                f"rank {holder} does not hold rank {lost}'s snapshot of step {committed} (it holds step {snap['held']})"
            )
        holders[lost] = holder
    return Rollback(committed, holders)


class HostSnapshots:
    """One rank's host snapshots: the schedule, its own copy, the copy it holds, and the exchange.

    ``needed`` says whether no replica can serve this rank (the replica path, which loses no
    steps, is kept otherwise); ``per_node`` is the number of ranks on each machine; ``rate`` bounds
    the exchange (bytes per second, 0: unbounded).

    The main thread takes copies, votes and restores; the snapshot thread (one exchange at a time)
    builds the generation's pairs and exchanges copies. They share the pairs under a lock: a pair
    built after its generation was cut is released at once, and a generation whose pairs failed
    takes no more snapshots (its peers may still hold their ends: a rebuild under the same name
    could meet a stale end).
    """

    def __init__(
        self,
        state: RankState,
        every: int,
        per_node: int,
        needed: Callable[[], bool],
        rate: float = 0.0,
        auto: bool = False,
    ) -> None:
        self._s = state
        self._rate = rate
        self._configured = every if state.world_size > per_node else 0  # one machine: no other host to hold it
        state.snapshot_every = self._configured
        self.auto = auto and self._configured > 0  # the interval follows choose() at each commit
        self._per_node = per_node
        self._needed = needed
        self.own: HostCopy | None = None
        self.held: HostCopy | None = None  # the copy of source(rank)'s state
        self.pending = -1  # the step of the snapshot being taken (or the last one)
        self.committed = -1  # the step of the last snapshot every rank held
        self._gen: int | None = None  # the generation of the last snapshot
        self._lock = threading.Lock()
        self._pairs: tuple[int, Any, Any] | None = None  # (generation, send pair, receive pair)
        self._cut_below = -1  # pairs of generations up to this one are cut: none is kept
        self._broken: int | None = None  # a generation whose pairs failed
        self._thread: threading.Thread | None = None
        #: what the last snapshot cost: seconds on the main thread, seconds of the exchange, bytes,
        #: and (a snapshot that is not its generation's first) the excess of the steps it overlapped
        self.last: dict[str, float] = {}
        #: the step periods since the snapshot being measured started (None: none is), whether it is
        #: measured (not its generation's first: that one also builds the pairs), and whether its
        #: commit came (the period that ends next is its last)
        self._window: list[float] | None = None
        self._measured = False
        self._closing = False
        #: this rank's measured costs of its last snapshots, in seconds, and the periods of its last
        #: steps that no snapshot overlapped (see stepped)
        self._costs: collections.deque[float] = collections.deque(maxlen=COSTS_KEPT)
        self._quiet: collections.deque[float] = collections.deque(maxlen=QUIET_KEPT)
        self._warned_max = False
        #: the step whose vote found every rank holding the committed snapshot whole (-1: the last vote did not)
        self.whole_at = -1
        #: after a drain that kept the committed snapshot: the step from whose vote on, if the joiner does
        #: not hold its copies yet, every rank takes a new one (None: no such drain waits)
        self._kept_until: int | None = None
        self._handover: Receiving | None = None  # (a drain's joiner) the leaver's copies, arriving

    def turn_off(self) -> None:
        """Take no snapshots in this job: every rank calls it alike, before its first step (a loop
        that can redo only its current step has no use for them)."""
        self._configured = 0
        self._s.snapshot_every = 0
        self.auto = False

    @property
    def enabled(self) -> bool:
        """Snapshots are configured and possible (every rank answers alike: the vote's layout depends on it)."""
        return self._configured > 0

    @property
    def every(self) -> int:
        """The interval in steps every rank follows now (0: no snapshots)."""
        return self._s.snapshot_every if self.enabled else 0

    def due(self, step: int) -> bool:
        """Whether ``step``'s start takes a snapshot: when the job takes them (a vote said some rank
        needs them), every ``every`` steps and at the first step of a new generation (a move changed
        who holds what), unless a drain kept the committed one (:meth:`keeps`)."""
        s = self._s
        if not self.enabled or s.standby or not s.snapshots_wanted or self._broken == s.generation:
            return False
        return step % self.every == 0 or self._gen != s.generation

    def keeps(self, next_step: int) -> bool:
        """(at a drain's switch, on every rank alike) Whether the job keeps its committed snapshot across
        the move: the vote that agreed on it found every rank holding it whole, and ``next_step`` is
        not a scheduled snapshot's. The leaver then hands its copies to the joiner (see
        :mod:`rlaunch.runtime.handover`), and nobody takes a new snapshot at the first step; a scheduled
        one while the joiner's copies still arrive ends the wait (:meth:`take`)."""
        s = self._s
        every = self.every
        return every > 0 and s.snapshots_wanted and self.whole_at == s.step and next_step % every != 0

    def exchanging(self) -> bool:
        """Whether this rank still exchanges the snapshot it took in the last :data:`EXCHANGE_WAIT_STEPS`
        steps, with no scheduled one due sooner. A drain agreed now could not keep a snapshot (its own
        copy of the committed one is already overwritten; :meth:`keeps`), so the rank votes ready for a
        drain only once this ends (``Migration.ready``): the drain switches a step or two later, with no
        downtime for that, and keeps the new snapshot once every rank's exchange ended and it committed."""
        thread, own = self._thread, self.own
        return (
            self.every > EXCHANGE_WAIT_STEPS
            and own is not None
            and own.step == self.pending > self.committed  # taken (not skipped), not committed yet
            and thread is not None
            and thread.is_alive()
            and self._s.step - self.pending < EXCHANGE_WAIT_STEPS
        )

    def switched(self, generation: int, next_step: int, keep: bool) -> None:
        """(a survivor, at a drain's switch to ``generation``, before the rank's generation is set) With
        ``keep`` (:meth:`keeps`), keep the committed snapshot: its own copy and the one it holds stay
        valid (the ranks keep their numbers); the old pairs are cut (the leaver is in them), and the
        next snapshot builds the new ones. Without it, the first step takes a new one, as after any
        move (a drain kept earlier and still waiting for its joiner's copies waits no more)."""
        self._kept_until = next_step + HANDOVER_STEPS if keep else None
        if keep:
            self._cut(self._s.generation)
            self._gen, self._window = generation, None

    def expect(self, generation: int, step: int, next_step: int) -> None:
        """(a drain's joiner, before its first step) The job keeps snapshot ``step`` (:meth:`switched`):
        this rank's copies come from the leaver (:meth:`receive`); until then it holds none."""
        s = self._s
        link = s.link
        self.pending = self.committed = step
        self._gen, self._window = generation, None
        self._kept_until = next_step + HANDOVER_STEPS

        def landed(own: HostCopy, held: HostCopy, seconds: float) -> None:
            self.own, self.held = own, held
            if link is not None:
                try:
                    link.call("snapshot_handover", rank=s.rank, step=own.step, bytes=own.nbytes + held.nbytes,
                              seconds=seconds)  # fmt: skip
                except AgentLinkError as exc:
                    log.warning("rank %d: the agent was not told that snapshot %d arrived: %s", s.rank, own.step, exc)

        with self._lock:
            self._handover = Receiving(step, s.rank, landed)

    def receive(self, channel: Any) -> None:
        """(a drain's joiner, once its state landed) Receive the leaver's two copies of the kept
        snapshot on ``channel`` (the move's), on a thread of its own, once the first step ended
        (:meth:`first_step_ended`); :meth:`holds` once both landed."""
        receiving = self._handover
        assert receiving is not None, "expect() came first"
        if receiving.start(channel):
            self._thread = receiving.thread

    def first_step_ended(self) -> None:
        """(main thread, after a move's first step) A joiner's handover may begin (:class:`Receiving`)."""
        receiving = self._handover
        if receiving is not None:
            receiving.go()

    def copies(self) -> tuple[HostCopy, HostCopy]:
        """(a drain's leaver, when :meth:`keeps`) Its own copy and the one it holds, of the kept snapshot."""
        own, held = self.own, self.held
        assert own is not None and held is not None, "keeps() found every rank holding both"
        return own, held

    @property
    def kept(self) -> int:
        """The snapshot a drain kept while its joiner waits for its copies (-1: none; the contract compares it)."""
        return self.committed if self._kept_until is not None else -1

    def stepped(self, seconds: float) -> None:
        """(main thread, after each step) Measure what a snapshot costs the steps it overlaps.

        A snapshot's cost is the sum of the periods of the steps from its start to its commit (its
        copy, then its exchange beside training), less as many median periods of the steps no
        snapshot overlapped, and never less than its copy on this thread. Its generation's first
        snapshot is not measured: it also builds the generation's pairs and may allocate its
        buffers, which later ones do not.
        """
        window = self._window
        if window is None:
            self._quiet.append(seconds)
            return
        window.append(seconds)
        if not self._closing:
            if len(window) > max(self.every, 1):  # it never committed: the next one is measured instead
                self._window = None
            return
        self._window = None
        if self._measured and self._quiet:
            cost = max(sum(window) - len(window) * self.step_s(), self.last.get("copy_s", 0.0))
            self._costs.append(cost)
            self.last["cost_s"] = cost

    def take(self, step: int) -> bool:
        """(main thread, at ``step``'s start) Copy this rank's state, then exchange copies in the
        background; False: the previous exchange still runs, and this step takes none."""
        s = self._s
        began = time.perf_counter()
        moved = self._gen != s.generation
        if moved:
            self._cut(s.generation - 1)  # the old generations' pairs: a moved rank may be in them
        superseded = self._kept_until is not None
        if superseded:
            # A scheduled snapshot while a drain's joiner waits for its copies (every rank takes it: due()
            # is alike, no exchange runs meanwhile): it covers the new generation instead, so the wait ends
            # here on every rank, and the joiner's receive is cut (its own copy is overwritten anyway).
            self._kept_until = None
            with self._lock:
                handover = self._handover
            if handover is not None:
                handover.cut()
        with self._lock:  # this snapshot builds the generation's pairs (not measured: see stepped)
            fresh = self._pairs is None or self._pairs[0] != s.generation
        self._window = None
        if not self._join(JOIN_WAIT_S if moved or superseded else 0.0):
            # Not this turn: this rank holds no copy of ``step``, so its vote keeps it from committing.
            log.warning(
                "rank %d (generation %d): the previous snapshot's exchange still runs; step %d takes none",
                s.rank, s.generation, step,
            )  # fmt: skip
            self.pending, self._gen, self._measured = step, s.generation, False
            return False
        state = rng.capture()
        self.own = hostcopy.capture(s.tracked, step, state, self.own)
        rng.restore(state)
        self.pending, self._gen = step, s.generation
        self.last = {"copy_s": time.perf_counter() - began, "bytes": float(self.own.nbytes)}
        self._window, self._measured, self._closing = [], not fresh, False
        self._thread = threading.Thread(
            target=self._exchange, args=(self.own, s.generation), name="rlaunch-snapshot", daemon=True
        )
        self._thread.start()
        return True

    def _exchange(self, own: HostCopy, gen: int) -> None:
        """(snapshot thread) Send this rank's copy to its buddy and receive its source's copy."""
        s = self._s
        began = time.perf_counter()
        yield_thread()
        hostcopy.seal(own)  # first: a rollback to this copy needs its digests, pairs or not
        failed: list[BaseException] = []

        def send(pair: Any) -> None:
            yield_thread()
            try:
                hostcopy.send(pair, own, None, self._rate)
            except Exception as exc:  # noqa: BLE001 - reported by the exchange below
                failed.append(exc)

        sender: threading.Thread | None = None
        try:
            send_pair, recv_pair = self._pair_channels(gen)
            sender = threading.Thread(target=send, args=(send_pair,), name="rlaunch-snapshot-send", daemon=True)
            sender.start()
            self.held = hostcopy.receive(recv_pair, self.held)
            sender.join()
            if failed:
                raise failed[0]
        except Exception as exc:  # noqa: BLE001 - a peer gone, a cut pair: this snapshot is not held
            log.warning(
                "rank %d (generation %d): the snapshot of step %d was not exchanged (%s); this generation takes "
                "no more snapshots", s.rank, gen, own.step, (str(exc) or type(exc).__name__).splitlines()[0],
            )  # fmt: skip
            self.held = None
            self._broken = gen
            self._cut(gen)  # the other end must not stay in step with a stream this end left
            if sender is not None:
                sender.join(JOIN_WAIT_S)
            return
        self.last["exchange_s"] = time.perf_counter() - began

    def _pair_channels(self, gen: int) -> tuple[Any, Any]:
        """This generation's two pairs: to the buddy (as side 0) and from the source (as side 1).

        Built in :func:`pair_order` on every rank, so that the rendezvous of one never waits on a
        peer building another (with two ranks each is the other's buddy), and each only once both
        its sides came to build it (:mod:`rlaunch.runtime.meeting`: a drain's groups may be built
        meanwhile).
        """
        with self._lock:
            if self._pairs is not None and self._pairs[0] == gen:
                return self._pairs[1], self._pairs[2]
        s = self._s
        assert s.store is not None
        mine, theirs = s.rank, source(s.rank, s.world_size, self._per_node)
        built: dict[int, Any] = {}
        try:
            for sender in pair_order(s.rank, s.world_size, self._per_node):
                for side in ([0] if sender == mine else []) + ([1] if sender == theirs else []):
                    built[side] = meeting.build_pair(
                        s.store, f"g{gen}/snapshot/{sender}/", side, min(s.timeout, PAIR_TIMEOUT),
                        lambda: gen <= self._cut_below,
                    )  # fmt: skip
            with self._lock:
                if gen > self._cut_below:
                    self._pairs = (gen, built[0], built[1])
                    return built[0], built[1]
        except BaseException:
            _release(built.values())
            raise
        _release(built.values())  # cut while it was being built (a fault, a move)
        raise RuntimeError(f"the snapshot pairs of generation {gen} were cut while they were built")

    def _cut(self, upto: int) -> None:
        """End an exchange in flight: its pairs' connections are shut down, so its operations fail; a
        pair of generation ``upto`` or an older one still being built is released once built."""
        for pair in self._shut(upto):
            retire(pair)

    def close(self) -> None:
        """At exit: end an exchange in flight and release the pairs now (a gloo group left to
        interpreter teardown can abort the process)."""
        pairs = self._shut(self._s.generation)
        self._join(5.0)
        _release(pairs)

    def _shut(self, upto: int) -> list[Any]:
        """Let go of the pairs (returned, their connections shut down) and of a handover in flight;
        pairs of generation ``upto`` or older still being built are released once built."""
        with self._lock:
            pairs, self._pairs = self._pairs, None
            self._cut_below = max(self._cut_below, upto)
            handover = self._handover  # kept: report() says why its copies are missing
        if handover is not None:
            handover.cut()
        shut = list(pairs[1:]) if pairs is not None else []
        for pair in shut:
            backends.cut(id(pair))
        return shut

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
        own, held = self.own, self.held
        idle = self._thread is None or not self._thread.is_alive()
        return idle and own is not None and held is not None and own.step == self.pending == held.step

    def cost(self) -> float:
        """The median of this rank's measured snapshot costs, in seconds (0 before the first)."""
        return _median(self._costs)

    def step_s(self) -> float:
        """The median period of this rank's last steps that no snapshot overlapped (0 before the first)."""
        return _median(self._quiet)

    def terms(self) -> list[float]:
        """This rank's vote section: which snapshot it holds whole (0: none), its square, 1 if no
        replica can serve this rank (the job then takes snapshots), the interval it follows, (where it
        measured one) the median cost of its last snapshots and its median step, in whole milliseconds
        (0 and 0 before its first measurement), and the interval's square (with the interval's sum, it
        tells every rank alike whether all follow the same one)."""
        v = float(self.pending % VOTE_MOD + 1) if self.holds() else 0.0
        cost_ms = step_ms = 0.0
        if self._costs:
            cost_ms = float(max(1, round(1000 * self.cost())))
            step_ms = float(max(1, round(1000 * self.step_s())))
        every = float(self.every)
        return [v, v * v, 1.0 if self._needed() else 0.0, every, cost_ms, step_ms, every * every]

    def commit(self, summed: Sequence[float]) -> None:
        """Read the vote's sums of every rank's :meth:`terms`: when every rank holds the snapshot this
        rank is taking (all values equal, and not 0), it is committed, and ``auto`` chooses the
        interval from then on (not at a generation's first snapshot, nor at the first after a drain
        kept one: those also build the pairs); when some rank needs snapshots, the job takes them
        from the next step on. Ranks following other intervals (another ``RLAUNCH_SNAPSHOT_EVERY``)
        take none. :attr:`whole_at` says whether every rank held the committed snapshot whole (what
        a drain agreed in this vote needs to keep it: :meth:`keeps`)."""
        s = self._s
        s.snapshots_wanted = round(summed[2]) > 0
        self.whole_at = -1
        intervals, squares = round(summed[3]), round(summed[6])
        if s.world_size * squares != intervals * intervals:  # equal only when every rank's interval is the same
            if self._broken != s.generation:
                log.error(
                    "rank %d (generation %d): the ranks follow different host snapshot intervals (this one %d steps, "
                    "%d summed over %d ranks): set the same %s for every node; this generation takes no more",
                    s.rank, s.generation, self.every, intervals, s.world_size, ENV,
                )  # fmt: skip
            self._broken = s.generation
            return
        total, squares = round(summed[0]), round(summed[1])
        mine = self.pending % VOTE_MOD + 1
        all_hold = total == s.world_size * mine and s.world_size * squares == total * total
        self._kept(all_hold)
        if all_hold and self.pending > self.committed:
            self.committed = self.pending
            self._closing = True
            # A generation's first snapshot chooses nothing: it also built the pairs, so its window says
            # nothing of later ones, and it may be committed here alone (after a rollback, the survivors
            # retake the snapshot they had committed already; the joiner, or a survivor that had not read
            # that commit yet, commits it alone, and would move alone to another interval).
            if self.auto and self._measured:
                self._choose(round(summed[4]), round(summed[5]), s.step - self.pending + 1)
            if s.link is not None:
                try:
                    s.link.call(
                        "snapshot", rank=s.rank, step=self.committed, bytes=int(self.last.get("bytes", 0)),
                        copy_s=float(self.last.get("copy_s", 0.0)), exchange_s=float(self.last.get("exchange_s", 0.0)),
                        every=self.every, cost_s=self.cost(),
                    )  # fmt: skip
                except AgentLinkError as exc:
                    log.warning("rank %d: the agent was not told of snapshot %d: %s", s.rank, self.committed, exc)
        if all_hold and self.pending == self.committed:
            self.whole_at = s.step

    def _kept(self, all_hold: bool) -> None:
        """(at each vote, from its sums: alike on every rank) End the wait for a drain's handover: met
        when every rank holds the kept snapshot; past :data:`HANDOVER_STEPS`, every rank takes a new one
        at its next step, as after any other move."""
        s = self._s
        if self._kept_until is None or not (all_hold or s.step >= self._kept_until):
            return
        self._kept_until = None
        if not all_hold:
            log.warning(
                "rank %d: the drained rank's host snapshot of step %d did not reach its joiner within %d steps; every "
                "rank takes a new one", s.rank, self.committed, HANDOVER_STEPS,
            )  # fmt: skip
            self._gen = None

    def _choose(self, cost_ms: int, step_ms: int, window: int) -> None:
        """(at a commit, from the vote's sums: alike on every rank) ``auto``'s next interval."""
        s = self._s
        before = self.every
        s.snapshot_every = choose(before, cost_ms, step_ms, window)
        if s.snapshot_every != before:
            log.info(
                "rank %d: host snapshots every %d steps from now on (was %d): each costs %.1f %% of a step, the "
                "last took %d steps to commit", s.rank, s.snapshot_every, before,
                100 * cost_ms / step_ms if step_ms else 0.0, window,
            )  # fmt: skip
        over = step_ms > 0 and 100 * cost_ms > TARGET_PCT * step_ms * s.snapshot_every
        if over and not self._warned_max:
            self._warned_max = True
            log.warning(
                "rank %d: a host snapshot costs %.1f %% of a step, over %d %% even every %d steps, the most auto "
                "takes (a fault redoes at most that many); set %s to a number of steps to choose otherwise",
                s.rank, 100 * cost_ms / step_ms, TARGET_PCT, s.snapshot_every, ENV,
            )  # fmt: skip

    def stop(self) -> None:
        """(recovery) End the exchange in flight, before this rank reports what it holds."""
        self._window = None  # the steps around a fault say nothing of what a snapshot costs
        self._kept_until = None  # the recovery's generation takes a new snapshot: nothing waits
        self._cut(self._s.generation)
        if not self._join(2.0):  # one still building a pair with a lost peer: it reports no copy held
            log.warning("rank %d: the snapshot exchange did not end after its pairs were cut", self._s.rank)

    def report(self, lost: Collection[int] = ()) -> dict[str, Any]:
        """What this rank holds, for the survivors' agreement (:func:`rollback`): a copy counts once
        digested (its own) or landed whole (the one it holds). When the rank whose copy it holds is
        ``lost``, that copy is checked now against its owner's digests (``held_refused`` says why it
        failed), so that the survivors refuse a rollback that would send it."""
        s = self._s
        exchanging = self._thread is not None and self._thread.is_alive()
        own, held = self.own, self.held
        mine = source(s.rank, s.world_size, self._per_node)
        refused = ""
        if held is not None and not exchanging and mine in lost:
            try:
                hostcopy.verify(held, f"rank {s.rank}'s copy of rank {mine}'s snapshot")
            except TransferError as exc:
                refused = str(exc)
                log.error("rank %d: %s", s.rank, refused)
        handover = ""
        if own is not None and own.digests and not own.checked:  # handed over by a drain's leaver: checked here
            try:
                hostcopy.verify(own, f"rank {s.rank}'s own snapshot, handed over by the rank it replaced,")
            except TransferError as exc:
                own, handover = None, str(exc)
                log.error("rank %d: %s", s.rank, handover)
        receiving = self._handover
        if own is None and receiving is not None and not handover:
            handover = receiving.failed or "they were still arriving"
        return {
            "committed": self.committed,
            "own": own.step if own is not None and own.digests else -1,
            "handover": handover,
            "held": held.step if held is not None and not exchanging else -1,
            "held_refused": refused,
            "source": mine,
        }

    def holder_of(self, rank: int) -> int:
        return buddy(rank, self._s.world_size, self._per_node)

    def restore(self, step: int) -> None:
        """Roll this rank back to its own copy, which must be of the agreed ``step``."""
        own = self.own
        if own is None or own.step != step or not own.digests:
            raise RuntimeError(
                f"rank {self._s.rank}: the survivors agreed to roll back to step {step}, but this rank's own copy is "
                f"{'missing' if own is None else f'of step {own.step}'}; this worker stops rather than train on it."
            )
        hostcopy.restore(own, self._s.tracked, self._s.rank)

    def send_to(self, channel: Any, lost: int, step: int, knowledge: dict[str, Any]) -> int:
        """Send the copy this rank holds of ``lost`` (of the agreed ``step``) to its joiner; return the bytes sent."""
        held = self.held
        s = self._s
        if held is None or held.step != step or source(s.rank, s.world_size, self._per_node) != lost:
            raise RuntimeError(
                f"rank {s.rank}: the survivors agreed that it sends rank {lost} its copy of step {step}, but it does "
                "not hold it; this worker stops so that the job restarts."
            )
        hostcopy.verify(held, f"rank {s.rank}'s copy of rank {lost}'s snapshot")  # at once: the report checked it
        return hostcopy.send(channel, held, knowledge)


def _median(values: Collection[float]) -> float:
    """The upper median of ``values`` (0 when empty); not ``statistics``, which costs every worker 0.5 MB."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _release(pairs: Any) -> None:
    for pair in pairs:
        backends.cut(id(pair))
        backends.current().release(pair)
