"""A fake of torch's ``ProcessGroupNCCL`` (and the two CUDA calls rlaunch makes), for a machine
without a GPU: it behaves as torch 2.13's does, not as rlaunch would like it to.

Each behaviour follows torch's sources (``torch/csrc/distributed/c10d/``, function names given;
line numbers are those of the 2.11–2.13 era tree and drift a little between releases):

- **Non-blocking setup is seen lazily.** ``NCCLUtils.cpp`` ``NCCLComm::create`` (~L90-103) sets
  ``initialized_ = !nonBlocking_``: "Under nonblocking mode, we check whether comm is initialized
  the *next* time ncclComm_ is accessed". ``NCCLComm::getNcclComm`` (~L155-168) is that access: it
  calls ``waitReady`` (~L180-213, a loop while NCCL answers ``ncclInProgress``, throwing on any
  other error or after ``TORCH_NCCL_NONBLOCKING_TIMEOUT``), then sets ``initialized_``.
  ``ProcessGroupNCCL::isInitialized`` (~L1161, Python ``_is_initialized()``) only reads the flag,
  and ``eagerConnectSingleDevice`` (~L1098) never calls ``getNcclComm``. So here too:
  :meth:`FakeProcessGroupNCCL._is_initialized` stays false after a non-blocking
  ``eager_connect_single_device`` until :meth:`_comm_ptr` (``getCommPtr``, ~L3335: it reads the
  communicator of the *current* CUDA device, and gives 0 where that device has none) has waited
  for the setup. ``getNcclComm``, ``waitReady`` and ``abort`` all take the communicator's own
  (recursive) mutex, so the wait holds it: an abort from another thread waits until the setup
  ends, by success, by an error, or after ``TORCH_NCCL_NONBLOCKING_TIMEOUT``.
- **Blocking setup** returns from ``eager_connect_single_device`` once NCCL is done.
- **Futures complete at enqueue.** ``ProcessGroupNCCL.cpp`` ``collective`` (~L3934)
  ``work->future_->markCompleted(...)`` right after queuing (point to point: ~L4404); ``WorkNCCL::wait``
  (~L857-926) only makes the current stream wait on the NCCL end event unless blocking wait or a
  timeout is asked for. Here :class:`FakeWork` is done for the host at once, and on the GPU only
  when the stream is synchronized (:meth:`FakeCuda.synchronize`).
- **Errors surface through the watchdog and the backend's error query.** The watchdog records
  ``error_ = ErrorType::COMM_ERROR`` or ``TIMEOUT`` (~L2357-2389); ``getError`` (~L1176, Python
  ``get_error()``) reads it. :meth:`FakeProcessGroupNCCL.watchdog_found` is that record.
- **abort() stops kernels, never completes work.** ``ProcessGroupNCCL::abort`` (~L1553-1577) aborts
  every communicator, those still being set up included (``inInitializationCommMap_``), each under
  its mutex (see above); work already handed out is neither completed nor failed, and any later
  operation raises "NCCL communicator was aborted" from ``getNcclComm``.
- **Point to point after eager init uses the group's communicator.** ``pointToPoint`` (~L4166-4245):
  "In eagerInit mode, reuse the parent comm. Do not lazily create p2p communicators"; without eager
  init a first send makes a separate 2-rank communicator keyed ``"low:high"``. :attr:`p2p_comms`
  records the lazily made ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import ErrorType


class _Config:
    def __init__(self) -> None:
        self.blocking = 1  # NCCL's default (ncclConfig_t.blocking)


class _Options:
    def __init__(self) -> None:
        self.config = _Config()
        self.is_high_priority_stream = False
        self._timeout: Any = None
        self.group_name = ""
        self.global_ranks_in_group: list[int] = []


class FakeCuda:
    """The current device (per thread, as CUDA's is) and the stream synchronizations asked for."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.synchronized: list[torch.device] = []
        self.queued: list[FakeWork] = []  # work the GPU has not finished
        self.lock = threading.Lock()

    def current(self) -> torch.device:
        return getattr(self._local, "device", torch.device("cuda", 0))  # a new thread starts on device 0

    @contextlib.contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        previous = self.current()
        self._local.device = device
        try:
            yield
        finally:
            self._local.device = previous

    def synchronize(self, device: torch.device) -> None:
        """The host waits for the GPU: every queued kernel on ``device`` ends."""
        with self.lock:
            self.synchronized.append(device)
            for work in [w for w in self.queued if w.device == device]:
                work.gpu_done = True
                self.queued.remove(work)


@dataclasses.dataclass(eq=False)
class FakeWork:
    """An NCCL operation: done for the host when queued, done on the GPU only after a sync."""

    device: torch.device
    gpu_done: bool = False

    def wait(self) -> bool:
        return True  # orders streams only

    def is_completed(self) -> bool:
        return self.gpu_done


class FakeProcessGroupNCCL:
    """Torch's ``ProcessGroupNCCL``, as far as rlaunch uses it (see the module docstring).

    The class attributes are per test: :meth:`reset` gives a fresh world.
    """

    Options = _Options
    cuda = FakeCuda()
    made: list[FakeProcessGroupNCCL] = []

    @classmethod
    def reset(cls, cuda: FakeCuda) -> None:
        cls.cuda = cuda
        cls.made = []

    def __init__(self, store: Any, rank: int, size: int, options: _Options) -> None:
        self.store, self.rank, self.size, self.options = store, rank, size, options
        self.device: torch.device | None = None
        self.initialized = False
        self.aborted = False
        self.error = ErrorType.SUCCESS
        self.eager = False
        self.p2p_comms: list[str] = []
        self._setup_done = threading.Event()  # NCCL left ncclInProgress
        self._setup_error = ""
        self._mutex = threading.RLock()  # NCCLComm::mutex_
        self.waiting = threading.Event()  # a thread waits inside getNcclComm (holding the mutex)
        type(self).made.append(self)

    # -- the test's side: what NCCL and the watchdog do on their own ---------------------------------

    def finish_setup(self, error: str = "") -> None:
        """NCCL's setup ends (with ``error``, it failed)."""
        self._setup_error = error
        self._setup_done.set()

    def watchdog_found(self, error: ErrorType) -> None:
        """Torch's watchdog saw an operation fail or time out."""
        self.error = error

    # -- torch's side ---------------------------------------------------------------------------------

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.device, self.eager = device, True
        if self.options.config.blocking:
            self._setup_done.wait()
            if self._setup_error:
                raise RuntimeError(f"NCCL error in: ncclCommInitRankConfig: {self._setup_error}")
            self.initialized = True
        # non-blocking: NCCL goes on by itself; initialized_ stays false until getNcclComm()

    def _get_nccl_comm(self) -> None:
        """``NCCLComm::getNcclComm``: under the mutex, wait while in progress, then mark the
        communicator initialized."""
        with self._mutex:
            if self.aborted:
                raise RuntimeError(f"NCCL communicator was aborted on rank {self.rank}.")
            self.waiting.set()
            try:
                self._setup_done.wait()
            finally:
                self.waiting.clear()
            if self._setup_error:
                raise RuntimeError(f"NCCL error in: waitReady: {self._setup_error}")
            self.initialized = True

    def _comm_ptr(self) -> int:
        if self.cuda.current() != self.device:
            return 0  # getCommPtr: no communicator for the current device
        self._get_nccl_comm()
        return id(self)

    def _is_initialized(self) -> bool:
        return self.initialized

    def get_error(self) -> ErrorType:
        return self.error

    def send(self, peer: int) -> FakeWork:
        """A point-to-point send (``pointToPoint``): queued on the GPU, done for the host."""
        if not self.eager:
            self.p2p_comms.append(f"{min(self.rank, peer)}:{max(self.rank, peer)}")
        self._get_nccl_comm()
        assert self.device is not None
        work = FakeWork(self.device)
        with self.cuda.lock:
            self.cuda.queued.append(work)
        return work

    def abort(self) -> None:
        with self._mutex:
            self.aborted = True
