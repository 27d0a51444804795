"""Process groups whose communicator is swapped in place, and the sandbox communicator.

:class:`SwitchableGroup` is a real ``ProcessGroup`` (DDP and ``torch.distributed`` accept it)
whose collectives are forwarded, from Python, to an inner communicator: a gloo group of the
current generation, or a :class:`SandboxComm` that serves every collective locally with
shape-correct results and no traffic. A migration swaps the inner communicator between two
steps; DDP keeps its buckets, so results stay bit-identical. Old communicators are released on a
background thread: dropping a gloo group with a pending operation blocks until its timeout.

Each real collective is guarded: its result reaches the caller through a future the group owns (or,
for gloo's reduce-scatters, which have no future, through the caller's own ``wait()``). If the
communicator fails (a peer died) or the runtime abandons the group (its agent said a peer is gone or
hung; gloo itself would wait for its timeout), the caller's future completes with its own inputs and
the group is marked ``failed``: later collectives return at once (torch's object collectives give
the caller's own objects, as a sandbox does), so the step runs to ``optimizer_step``, where the
runtime recovers. From the recovery to the step's boundary a group is ``held``: the rest of the
step's collectives return at once too, since the rebuilt communicator's other members (a joiner
waiting for its state among them) are already at that boundary. Each group counts the collectives
that handed their caller its own inputs (:attr:`SwitchableGroup.own_results`): work after a step's
vote, which no redone step runs again, must not go on from such values (see ``rlaunch.lightning``
and :func:`rlaunch.runtime.recovery.after_vote_refusal`); those issued inside :func:`alike` are left
out. Once the training loop has ended no vote follows, so the guard stops
(:meth:`SwitchableGroup.stop_guarding`): a collective that cannot run then raises, as under
torchrun. An NCCL collective's future completes when it is queued on the GPU, so the guard sees it
succeed even when it is lost later, in a communicator that is cut or records an error before the GPU
ran it: each group also counts the collectives queued on its communicator's GPU since that work was
last known done (:meth:`SwitchableGroup.device_done`, after the runtime waited for the GPU before a
step's vote), and adds them to ``own_results`` when it loses them. Gloo cannot cancel an operation
in flight (``abort()`` does not wake it), so abandoning a group also shuts down its communicator's
connected sockets (found at build time): the inner operation then fails at once instead of staying
in flight on the caller's tensors, where a frozen peer that resumed before being fenced could still
complete it and write stale data into them (a DDP bucket of a later step). A failed communicator is
cut the same way, and a cut one is destroyed without waiting for its timeout. An NCCL communicator
(CUDA tensors of a group whose backend is NCCL) is aborted instead (``ncclCommAbort`` wakes its
pending operations): see :mod:`rlaunch.runtime.backend`.

What the sandbox gives for each collective (object collectives included) is described in
:mod:`rlaunch.runtime.sandbox`. The futures it and the guard hand back are CUDA-aware, so a caller
waiting on them synchronizes with the current stream as it would with NCCL's.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import GroupName
from torch.futures import Future

from rlaunch.errors import RlaunchError
from rlaunch.runtime import backend as backends
from rlaunch.runtime import works
from rlaunch.runtime.priority import yield_thread
from rlaunch.runtime.sandbox import SandboxComm, in_object_collective

log = logging.getLogger(__name__)
#: How long a replaced communicator is kept before it is destroyed (see _Retirer).
RETIRE_AFTER_S = 20.0
#: How long abandon() waits for a cut operation to fail before handing the tensors back.
ABANDON_WAIT_S = 1.0
#: How long a switch waits for a communicator built in the background to be ready.
READY_TIMEOUT_S = 300.0

#: ProcessGroup methods that carry traffic; each is forwarded to the inner communicator.
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall",
    "barrier", "send", "recv", "recv_anysource", "reduce", "gather", "scatter",
    # torch >= 2.13 names, which FSDP2 and functional collectives call
    "all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "all_to_all_single",
)  # fmt: skip


_issuing = threading.local()  # .alike: collectives issued now on this thread have inputs alike on every rank


@contextlib.contextmanager
def alike() -> Iterator[None]:
    """Collectives issued inside, on this thread, have inputs that are the same on every rank (a flag
    that is 0 everywhere, say): handing a caller its own inputs then gives every rank the same result,
    so they are not counted in :attr:`SwitchableGroup.own_results`."""
    before = getattr(_issuing, "alike", False)
    _issuing.alike = True
    try:
        yield
    finally:
        _issuing.alike = before


class LostCollectiveError(RlaunchError, RuntimeError):
    """A collective (a barrier included) issued after the training loop ended could not run with
    every member, and no step is left whose vote could redo it. A ``RuntimeError``, as torch's own
    errors of a failed collective are."""


class _InFlight(NamedTuple):
    """A guarded operation in flight."""

    future: Future[Any] | None  # what its caller waits on (None: the caller waits on the work itself)
    tensors: list[torch.Tensor]  # its inputs, handed back if it is abandoned
    ended: threading.Event  # set when the communicator is done with it
    work: Any  # the inner work of one its caller waits on (whether it is still running), else None
    counted: bool  # handing back its inputs counts in own_results (see alike)


class _Retirer:
    """Drops old communicators on a daemon thread, well after the switch that replaced them.

    A gloo group's destructor joins its threads and may hold the GIL while it does; run right
    after a switch it would slow the first steps of the new generation. So each communicator is
    kept RETIRE_AFTER_S seconds, then dropped on this low-priority thread. At exit the rest are
    dropped at once (a gloo group destroyed during interpreter shutdown aborts the process).
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[float, Any]] = queue.Queue()
        self._now = threading.Event()
        threading.Thread(target=self._run, name="rlaunch-retire", daemon=True).start()
        atexit.register(self.drain, 30.0)

    def retire(self, comm: Any) -> None:
        self._queue.put((time.monotonic() + RETIRE_AFTER_S, comm))

    def _run(self) -> None:
        yield_thread()
        while True:
            due, comm = self._queue.get()
            self._now.wait(max(0.0, due - time.monotonic()))
            backends.current().release(comm)
            del comm
            self._queue.task_done()

    def drain(self, timeout: float) -> None:
        self._now.set()
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.05)


_retirer: _Retirer | None = None


def retire(comm: Any) -> None:
    global _retirer
    if _retirer is None:
        _retirer = _Retirer()
    _retirer.retire(comm)


class SwitchableGroup(ProcessGroup):  # type: ignore[misc]
    """A named group of global ranks whose communicator is swapped between steps.

    ``version`` is the generation whose communicator it holds; it changes only when the group
    is rebuilt, which is how tests see that an untouched group was kept. ``backend`` is the
    backend its communicators are built with (see :mod:`rlaunch.runtime.backend`).
    """

    #: made by the runtime (``rt.group``, ``rt.new_group``, a mesh's), so a move can rebuild it; see
    #: :class:`rlaunch.runtime.sandboxgroups.SandboxTorchGroup` for one that is not
    made_by_runtime = True

    def __init__(
        self,
        name: str,
        members: Sequence[int],
        my_rank: int,
        comm: Any,
        version: int,
        guarded: bool = True,
        backend: backends.Backend = backends.Backend.GLOO,
    ) -> None:
        self.members = sorted(members)
        self.group_rank = self.members.index(my_rank) if my_rank in self.members else -1
        super().__init__(max(self.group_rank, 0), len(self.members))
        self.label = name
        self.comm = comm
        self.version = version
        self.backend = backend
        #: the name under which torch.distributed knows this group (None: not registered)
        self.registered_name: str | None = None
        #: why the current communicator is unusable ("" while it works); reset by swap()
        self.failed = ""
        #: perf_counter() when this rank last issued a collective here (its compute was done by then)
        self.last_issue = 0.0
        #: guard collectives (under rlaunch); without an agent to recover, errors reach the caller
        self.guarded = guarded
        #: a replacement is planned: until the recovery ends, collectives return at once, un-issued
        #: (a peer already in recovery would never issue its side; see Recovery.on_replace)
        self.paused = False
        #: why this rank no longer uses the group ("" while it does): it left the job in a drain (see leave)
        self.left = ""
        #: this rank's step was recovered: until the step's boundary its collectives return at once,
        #: un-issued (the rebuilt communicator's other members, a joiner among them, are at the boundary)
        self.held = False
        #: why no recovery follows a collective that cannot run ("" while one can): see stop_guarding
        self.unguarded_since = ""
        #: the operations in flight, by issue number
        self._pending: dict[int, _InFlight] = {}
        #: collectives that handed their caller its own inputs instead of a result (the group had failed
        #: or was paused, or abandoned them in flight), barriers, sends and those issued inside alike() aside
        self.own_results = 0
        #: collectives (barriers and point-to-point calls included) issued here so far
        self.issued = 0
        #: counted collectives whose futures completed when they were queued on the GPU (NCCL's), so far;
        #: those past ``_device_settled`` are not known done there, and count in own_results if their
        #: communicator is cut or records an error first
        self._device_queued = 0
        self._device_settled = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        #: serves torch's object collectives while the group is failed or paused (see unissued)
        self._stand_in: SandboxComm | None = None

    def swap(self, comm: Any, version: int, ready_timeout: float = READY_TIMEOUT_S) -> None:
        """Use ``comm`` from now on. A communicator built in the background (NCCL's non-blocking
        setup) is waited for here, at the switch, and nowhere before.

        A pause stays: a replacement planned before a drain's switch (a peer of the drain was lost)
        still needs its recovery, and the drain's communicator may hold the lost peer. Only the
        recovery ends the pause (:meth:`rlaunch.runtime.recovery.Recovery.recover`).
        """
        backends.current().wait_ready(comm, ready_timeout)
        with self._lock:
            old, self.comm, self.version = self.comm, comm, version
            self.failed = ""
            self._device_settled = self._device_queued  # the old one's work is not lost: it is retired, not cut
        backends.current().forget(id(old))  # from now on its fds may be reused: never cut them
        retire(old)

    def stop_guarding(self, why: str) -> None:
        """The runtime is done stepping (``why`` says so): no step's vote follows to redo what a
        collective that could not run got wrong. From now on a communicator's failure reaches the
        caller, as under torchrun (gloo's: NCCL's under rlaunch's settings does not raise in the
        caller's wait), and a collective of a failed, paused (a replacement planned after the last
        step's vote) or held group raises :class:`LostCollectiveError` instead of handing its caller
        its own inputs: a final evaluation's sum would otherwise be this rank's alone, without a
        word. A group the rank left in a drain still returns at once (its peers swapped it out)."""
        with self._lock:
            self.unguarded_since = why  # first: a collective on another thread meanwhile raises, never hands back
            self.guarded = False

    def _lost(self, name: str) -> LostCollectiveError:
        if self.failed:
            state = f"failed ({self.failed})"
        elif self.held:
            state = (
                "is held for a replacement that never received its state (the loop ended inside a step the "
                "recovery had just recovered, before the step's end, where the replacement is sent it)"
            )
        else:
            state = "is paused for the replacement of a lost rank, planned after the last step's vote"
        # inside a finally block while the loop unwinds on an error: that error is what to read first
        stopping = sys.exc_info()[1]
        after = f" The worker was already stopping on: {stopping}" if stopping is not None else ""
        return LostCollectiveError(
            f"A collective ({name}) on group {self.label} (rank {self.group_rank} of it) was issued after "
            f"{self.unguarded_since}, but the group {state}; no step is left to redo it, so it is refused rather "
            "than go on as if every member had taken part. The job restarts if --max-restarts allows: resume "
            f"from the script's last checkpoint.{after}"
        )

    @property
    def busy(self) -> bool:
        """A collective is in flight (read without the lock: a hint for the heartbeat)."""
        return any(op.future is not None or not op.work.is_completed() for op in list(self._pending.values()))

    def abandon(self, why: str) -> None:
        """Give up this group's operations in flight: their callers get their inputs back.

        Its communicator is cut: NCCL's is aborted (its pending operations return), gloo's
        connections are shut down (see :meth:`rlaunch.runtime.backend.Communicators.cut`).
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            self.failed = self.failed or why
            self.own_results += sum(op.counted for op in pending.values()) + self._take_unsettled()
        backends.cut(id(self.comm))
        for op in pending.values():
            if op.future is not None:  # an operation its caller waits for ends in that wait: the cut fails it
                op.ended.wait(ABANDON_WAIT_S)  # the cut operation lets go of the tensors first
                op.future.set_result(op.tensors)

    def leave(self, why: str) -> None:
        """This rank handed its state over in a drain and its worker is ending: from now on its
        collectives here return at once, un-issued. Its peers have swapped this communicator out, so
        one issued after the switch (a framework's teardown; Lightning's SIGTERM handler, which
        broadcasts on the default group when the agent stops the worker) would wait for peers that
        never issue it. The group is not failed, and what it hands back is not counted in
        :attr:`own_results`: no step is recovered or checked on this rank again."""
        self.left = self.left or why

    @property
    def device_queued(self) -> int:
        """How many counted collectives were queued on the GPU here so far: read it before waiting for the
        GPU, and pass it to :meth:`device_done` once the wait ended well."""
        return self._device_queued

    def device_done(self, queued: int) -> None:
        """The GPU finished the collectives queued here before :attr:`device_queued` read ``queued``, and
        the communicator recorded no error: they are no longer lost if it is cut later."""
        with self._lock:
            self._device_settled = max(self._device_settled, queued)

    def device_lost(self) -> None:
        """The GPU work queued here is not known to have ended well (its communicator recorded an error,
        or the wait for the GPU failed): the collectives queued since it was last known done count in
        :attr:`own_results`."""
        with self._lock:
            self.own_results += self._take_unsettled()

    def _take_unsettled(self) -> int:
        """(under the lock) The collectives queued on the GPU and not known done, counted once."""
        lost, self._device_settled = self._device_queued - self._device_settled, self._device_queued
        return lost

    def _guard(
        self, comm_id: int, work: dist.Work, tensors: list[torch.Tensor], counted: bool, queued: bool
    ) -> dist.Work:
        """``queued``: the work is NCCL's, whose future completes when it is queued on the GPU."""
        try:
            inner = work.get_future()
        except RuntimeError:  # gloo's reduce-scatters give no future: their caller's wait() waits
            inner = None
        outer: Future[Any] | None = works.future(tensors) if inner is not None else None
        key = next(self._ids)
        ended = threading.Event()
        with self._lock:
            abandoned = bool(self.failed)  # abandoned since the caller checked: never wait on it
            if abandoned:
                self.own_results += counted
            else:
                self._pending[key] = _InFlight(outer, tensors, ended, work if outer is None else None, counted)
            # paused since the caller checked (a replacement plan came): the peers may never issue it
            overtaken = self.paused and not abandoned
        if abandoned and outer is not None:
            outer.set_result(tensors)
        # The callback below may run on the communicator's own thread, and what it holds is let go of
        # there, after it woke the caller. Were it to hold the group, a caller that then let go of it
        # (a script ending right after its last collective) would leave the last reference on that
        # thread, and the communicator, freed there, would join its own thread: std::terminate.
        group = weakref.ref(self)

        def finished(outcome: Callable[[], Any]) -> None:
            try:
                value, error = outcome(), ""
            except Exception as exc:  # noqa: BLE001 - any failure of the communicator
                value, error = tensors, str(exc).splitlines()[0]
            ended.set()
            if error:
                # its other operations must fail too, not complete later (no-op once swapped out); not
                # waited for: this may be the communicator's own thread, which an NCCL abort joins
                backends.cut(comm_id, wait=0)
            me = group()
            settled = me is None or me._settle(key, comm_id, counted, queued, error)
            del me  # before the caller is woken (see above)
            if settled and outer is not None and not outer.done():  # (abandoned: the caller has its inputs)
                outer.set_result(value)

        if inner is None or outer is None:
            waits = _CallerWaits(work, tensors, finished) if not abandoned else works.done(tensors)
        else:
            inner.add_done_callback(lambda f: finished(f.value))
            waits = torch._C._distributed_c10d._create_work_from_future(outer)
        if overtaken:
            self.abandon("a replacement was planned while its collective was in flight")
        return waits

    def _settle(self, key: int, comm_id: int, counted: bool, queued: bool, error: str) -> bool:
        """Book an operation that ended (``error``: how it failed, or ""); False if it was abandoned."""
        with self._lock:
            if self._pending.pop(key, None) is None:
                return False
            current = comm_id == id(self.comm)
            if error:
                # the operations queued on the cut communicator's GPU are lost with it
                self.own_results += counted + (self._take_unsettled() if current else 0)
            elif counted and queued and current:
                self._device_queued += 1  # queued, not done: lost if the communicator is cut first
            if error and not self.failed:
                self.failed = error
                log.warning(
                    "group %s (rank %d of it): a collective failed (%s); this step will be recovered",
                    self.label, self.group_rank, error,
                )  # fmt: skip
        return True

    def unissued(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dist.Work:
        """A collective of a failed, paused, held or left group: it returns at once, un-issued, with the caller's
        inputs as they are (the step is rolled forward or redone; its results are not used, unless the
        caller is past the step's vote: see :attr:`own_results`, which a left group does not add to).
        After the training loop ended it raises instead (see :meth:`stop_guarding`), but on a left group.

        One issued by torch's object collectives is served as a sandbox serves it (every rank's
        object is the caller's own, as if it were the source): they receive sizes and bytes that a
        peer writes, and a receiver left with unwritten buffers would read garbage (an EOFError,
        or an allocation of petabytes) before the step ever reached its recovery.
        """
        if self.unguarded_since and not self.left:
            raise self._lost(name)
        if not self.left and _counted(name):  # (a left group takes no lock: a signal handler may issue here)
            with self._lock:
                self.own_results += 1
        if name in _OBJECT_CARRIERS and in_object_collective():
            if self._stand_in is None:
                self._stand_in = SandboxComm(max(self.group_rank, 0), len(self.members))
            return getattr(self._stand_in, name)(*args, **kwargs)
        return works.done(works.flat(args))

    def rank(self) -> int:
        return self.group_rank

    def size(self) -> int:
        return len(self.members)

    @property
    def sandboxed(self) -> bool:
        return isinstance(self.comm, SandboxComm)

    @property
    def group_name(self) -> GroupName:
        """The name torch.distributed knows this group by: functional collectives resolve it.

        torch's own answer reads it from a backend, and this group holds none (its communicator does).
        """
        if self.registered_name is None:
            raise RuntimeError(f"The runtime group {self.label} is not registered with torch.distributed.")
        return GroupName(self.registered_name)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """``dist.monitored_barrier`` on this group (torch calls it from Python; torch's C++ method
        would look for a backend this group does not hold). Without ``timeout`` (Lightning's barrier
        calls it so), the communicator's own applies, as with torch's method.

        It returns at once in a sandbox and once the group failed, is paused or held; otherwise it runs on
        the communicator. Under rlaunch a failure (a peer gone, or the cut of an abandoned
        communicator) fails the group as a failed collective does, and the step is recovered.
        """
        self.issued += 1
        if self.unguarded_since and not self.left and (self.failed or self.paused or self.held):
            raise self._lost("monitored_barrier")
        if self.failed or self.paused or self.left or self.held or self.sandboxed:
            return
        comm = self.comm
        try:
            if timeout is None:
                comm.monitored_barrier(wait_all_ranks=wait_all_ranks)
            else:
                comm.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        except RuntimeError as exc:
            if not self.guarded:
                raise
            why = str(exc).splitlines()[0]
            with self._lock:
                self.failed = self.failed or why
                self.own_results += self._take_unsettled()
            backends.cut(id(comm), wait=0)
            log.warning(
                "group %s (rank %d of it): a monitored barrier failed (%s); this step will be recovered",
                self.label, self.group_rank, why,
            )  # fmt: skip


class _CallerWaits(dist.Work):  # type: ignore[misc]
    """A guarded operation without a future (gloo's reduce-scatters), waited for in its caller's wait().

    The wait runs in the caller's thread, so the operation's tensors are let go of the moment the
    caller is done with them, as with torch's own work. (A waiter thread kept the last gradient
    buffer alive until the thread next ran: a layer's worth of FSDP's peak memory.) A failure, or
    the cut of an abandoned communicator, ends the wait at once; the caller gets its inputs back.
    """

    def __init__(
        self, work: dist.Work, tensors: list[torch.Tensor], finished: Callable[[Callable[[], Any]], None]
    ) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._tensors = tensors
        self._finished: Callable[[Callable[[], Any]], None] | None = finished

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        work, finished, self._work, self._finished = self._work, self._finished, None, None
        if work is not None and finished is not None:
            tensors = self._tensors

            def outcome() -> list[torch.Tensor]:
                work.wait()
                return tensors

            finished(outcome)
        return True

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def result(self) -> list[torch.Tensor]:
        return self._tensors


#: The operations torch's object collectives issue (broadcast_object_list and scatter_object_list
#: broadcast sizes and scatter bytes; all_gather_object and gather_object gather both).
_OBJECT_CARRIERS = ("broadcast", "scatter", "allgather", "gather")

#: Point-to-point operations: not guarded (gloo gives them no future). The runtime's transfers use
#: them; a script's own send/recv is not recovered after a fault (and a sandbox refuses it).
_UNGUARDED = ("send", "recv", "recv_anysource")


def _counted(name: str) -> bool:
    """Whether a collective ``name`` issued now counts in ``own_results`` when it hands back its
    caller's inputs: a barrier and a send have no result, and those issued inside :func:`alike` give every
    rank the same."""
    return name not in ("barrier", "send") and not getattr(_issuing, "alike", False)


def _forward(name: str) -> Any:
    def method(self: SwitchableGroup, *args: Any, **kwargs: Any) -> Any:
        self.issued += 1
        if self.failed or self.paused or self.left or self.held:
            return self.unissued(name, args, kwargs)
        comm = self.comm
        try:
            work = getattr(comm, name)(*args, **kwargs)
        except RuntimeError as exc:
            # torch's watchdog aborted the NCCL communicator (an error it found) between two of this
            # step's collectives: the step fails as a failed collective does. Any other error at
            # issue (a wrong tensor) is the caller's, and is raised as it is.
            recorded = backends.current().error(comm) if self.guarded and name not in _UNGUARDED else ""
            if not recorded:
                raise
            with self._lock:
                self.failed = self.failed or f"its NCCL communicator recorded {recorded} ({str(exc).splitlines()[0]})"
                self.own_results += _counted(name) + self._take_unsettled()
            backends.cut(id(comm), wait=0)
            return works.done(works.flat(args))
        if name in _UNGUARDED or not self.guarded or isinstance(comm, SandboxComm):
            return work
        self.last_issue = time.perf_counter()
        tensors = works.flat(args)
        at_enqueue = backends.current().completes_at_enqueue(comm, tensors)
        return self._guard(id(comm), work, tensors, _counted(name), at_enqueue)

    method.__name__ = name
    return method


for _name in COLLECTIVES:
    setattr(SwitchableGroup, _name, _forward(_name))
