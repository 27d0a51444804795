"""The NCCL boundary: every call rlaunch makes to ``ProcessGroupNCCL`` goes through :class:`NcclApi`.

:mod:`rlaunch.runtime.backend` builds, waits for, checks and aborts NCCL communicators only through
an object with this interface. :class:`TorchNccl` is the real one, over torch's
``ProcessGroupNCCL`` (torch 2.11–2.13). It is written after what that class does, not after what
a caller would like it to do (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` and
``NCCLUtils.cpp``; the test fake in ``tests/fake_nccl.py`` follows the same lines and cites them):

- **Setup.** ``create`` builds a ``ProcessGroupNCCL`` and connects it at once on the rank's GPU
  (``eager_connect_single_device``). In non-blocking mode (``Options.config.blocking = 0``) that
  returns while NCCL finishes its setup on its own, and torch marks the communicator initialized
  only the next time something asks it for the ``ncclComm_t`` (``NCCLComm::getNcclComm`` calls
  ``waitReady``): polling ``_is_initialized()`` alone never sees it become ready. So a
  non-blocking communicator gets a thread of its own that asks for it (``_comm_ptr()``, under
  the communicator's device), which waits while NCCL answers ``ncclInProgress`` and fails if the
  setup fails or is aborted; ``ready`` reads that thread's outcome.
- **NCCL 2.26.** Torch 2.7.1 stopped choosing non-blocking mode itself, to avoid a hang of NCCL
  2.26 in that mode (pytorch/pytorch#153960). On NCCL 2.26, and where the user set
  ``TORCH_NCCL_USE_COMM_NONBLOCKING=0``, communicators are built blocking: ``create`` returns
  once the setup is done (it runs on the runtime's background thread, so training goes on).
- **Completion.** An NCCL operation's future completes when it is queued, and ``wait()`` only
  makes the current stream wait for it: the host learns that the GPU finished only by
  synchronizing a stream (``synchronize``).
- **Errors.** A failed or timed-out operation is found by torch's watchdog, which records it on
  the backend (``get_error()``: ``COMM_ERROR``, ``TIMEOUT``); :meth:`TorchNccl.error` reads it.
- **Abort.** ``abort()`` (``ncclCommAbort`` on every communicator of the group, set-up ones
  included) stops their kernels; later operations raise. It neither completes nor fails work
  already handed out, which is why the runtime never waits on NCCL work it cannot abandon. It
  takes the communicator's lock, which torch holds while it waits for a setup, so an abort of a
  communicator still being set up is made by its setup thread once that wait ends (at the latest
  after ``TORCH_NCCL_NONBLOCKING_TIMEOUT``).
- **Point to point.** After ``eager_connect_single_device`` torch sends and receives on the
  group's own communicator (no second, lazily made 2-rank communicator), so a channel whose
  setup is done has nothing left to build at its first send.

``ncclCommSplit`` from a live communicator (``split_group``) is not used: a split is collective
over the parent's members, and a joiner is not one of them. ``shrink_group`` is not used either:
the survivors of a replacement rebuild only the groups the moved ranks were in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import ErrorType
from torch.distributed import Store

#: NCCL versions whose non-blocking mode torch itself avoids (a hang; pytorch/pytorch#153960)
NON_BLOCKING_HANGS = ((2, 26),)
#: the user's own choice of NCCL's mode, as torch reads it
NON_BLOCKING_ENV = "TORCH_NCCL_USE_COMM_NONBLOCKING"


class NcclApi(Protocol):
    """What rlaunch asks of NCCL; tests pass a fake with the same methods."""

    def create(
        self,
        store: Store,
        rank: int,
        size: int,
        *,
        name: str,
        device: torch.device,
        timeout: datetime.timedelta,
        blocking: bool,
        ranks: Sequence[int] | None,
    ) -> Any:
        """A communicator of ``size`` ranks on ``store``, connected on ``device``; with
        ``blocking=False`` it may return before the communicator is ready. ``ranks``: the
        members' global ranks (torch's ``global_ranks_in_group``; None where not known)."""

    def ready(self, comm: Any) -> bool:
        """Whether ``comm`` finished its setup (a poll; raises :class:`NcclSetupError` if it failed)."""

    def error(self, comm: Any) -> str:
        """The error torch recorded on ``comm`` (``TIMEOUT``, ``COMM_ERROR``; "" if none)."""

    def synchronize(self, comm: Any) -> None:
        """Block until the work queued on ``comm``'s device's current stream is done on the GPU."""

    def abort(self, comm: Any) -> None:
        """Abort ``comm`` (``ncclCommAbort``): its kernels stop and later operations on it raise."""


class NcclUnavailableError(RuntimeError):
    """This torch has no NCCL (a CPU build) or this machine has no GPU."""


class NcclSetupError(RuntimeError):
    """An NCCL communicator's setup failed (or was aborted) before it became ready."""


def non_blocking(requested: bool, version: tuple[int, ...], env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether a communicator is built non-blocking: asked for, the user did not turn NCCL's
    non-blocking mode off, and this NCCL is not one whose non-blocking mode hangs."""
    if not requested or env.get(NON_BLOCKING_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return tuple(version[:2]) not in NON_BLOCKING_HANGS


@dataclasses.dataclass
class _Setup:
    """A non-blocking communicator's setup, finished on a thread of its own."""

    name: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str = ""
    #: an abort was asked for while torch still waited on NCCL: the setup thread makes it when torch lets go
    abort: bool = False


class _Cuda(Protocol):
    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...
    def synchronize(self, device: torch.device) -> None: ...


class _TorchCuda:
    """The two CUDA calls :class:`TorchNccl` makes."""

    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()


class TorchNccl:
    """:class:`NcclApi` over torch's ``ProcessGroupNCCL``.

    ``pg_class``, ``version`` and ``cuda`` are torch's own unless given: tests pass a fake of
    ``ProcessGroupNCCL`` that behaves as torch 2.13's does, on a machine without a GPU.
    """

    def __init__(
        self,
        pg_class: Any = None,
        *,
        version: tuple[int, ...] | None = None,
        cuda: _Cuda | None = None,
        env: dict[str, str] | os._Environ[str] = os.environ,
    ) -> None:
        if pg_class is None:
            try:
                from torch.distributed.distributed_c10d import ProcessGroupNCCL
            except ImportError as exc:
                raise NcclUnavailableError(
                    f"NCCL was asked for, but this torch ({torch.__version__}) was built without it; "
                    "use the gloo backend (RLAUNCH_BACKEND=gloo) or a CUDA build of torch."
                ) from exc
            if not torch.cuda.is_available():
                raise NcclUnavailableError(
                    "NCCL was asked for, but CUDA is not available in this process (no GPU or driver); "
                    "use the gloo backend (RLAUNCH_BACKEND=gloo)."
                )
            pg_class = ProcessGroupNCCL
        self._cls: Any = pg_class
        self.nccl_version = version if version is not None else tuple(torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        self._cuda: _Cuda = cuda or _TorchCuda()
        self._env = env
        self._setups: dict[int, _Setup] = {}
        self._devices: dict[int, torch.device] = {}
        self._lock = threading.Lock()

    def options(
        self, *, name: str, timeout: datetime.timedelta, blocking: bool, ranks: Sequence[int] | None
    ) -> Any:  # fmt: skip
        opts = self._cls.Options()
        opts.is_high_priority_stream = False
        opts.config.blocking = 1 if blocking else 0
        opts._timeout = timeout
        opts.group_name = name
        if ranks is not None:  # torch reads it for its logs, its flight recorder and a split
            opts.global_ranks_in_group = list(ranks)
        return opts

    def create(
        self,
        store: Store,
        rank: int,
        size: int,
        *,
        name: str,
        device: torch.device,
        timeout: datetime.timedelta,
        blocking: bool,
        ranks: Sequence[int] | None,
    ) -> Any:
        nb = non_blocking(not blocking, self.nccl_version, self._env)
        comm = self._cls(store, rank, size, self.options(name=name, timeout=timeout, blocking=not nb, ranks=ranks))
        # Connect now, not at the first collective: that first collective is on the training
        # thread, at the switch, and must not be where the setup cost is paid. (Blocking, this
        # returns once NCCL is done; it runs on the runtime's background thread, where it cannot
        # be aborted: a peer lost meanwhile holds up that thread until NCCL gives up.)
        comm.eager_connect_single_device(device)
        with self._lock:
            self._devices[id(comm)] = device
            self._setups.pop(id(comm), None)  # of a communicator gone before, at the same address
        if nb:
            setup = _Setup(name)
            with self._lock:
                self._setups[id(comm)] = setup
            threading.Thread(
                target=self._finish_setup, args=(comm, device, setup), name="rlaunch-nccl-setup", daemon=True
            ).start()
        return comm

    def _finish_setup(self, comm: Any, device: torch.device, setup: _Setup) -> None:
        """(setup thread) Ask for the ``ncclComm_t``: torch waits while NCCL is in progress, then
        marks the communicator initialized (or raises: the setup failed or passed
        ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, which the agent sets for workers). Torch holds the
        communicator's lock for the whole wait, so an abort asked for meanwhile is made here, after."""
        try:
            with self._cuda.device(device):  # _comm_ptr() reads the current device's communicator
                if not comm._comm_ptr():
                    setup.error = f"torch has no NCCL communicator for {device}"
        except Exception as exc:  # noqa: BLE001 - any failure is the setup's, reported by ready()
            setup.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with self._lock:
            setup.done.set()
            abort = setup.abort
        if abort:
            comm.abort()

    def ready(self, comm: Any) -> bool:
        with self._lock:
            setup = self._setups.get(id(comm))
        if setup is not None:
            if not setup.done.is_set():
                return False
            if setup.error:
                raise NcclSetupError(f"The NCCL communicator {setup.name} failed its setup: {setup.error}.")
            with self._lock:
                self._setups.pop(id(comm), None)  # done: torch's own flag says the rest
        return bool(comm._is_initialized())

    def error(self, comm: Any) -> str:
        found = comm.get_error()
        return "" if found == ErrorType.SUCCESS else str(found.name)

    def synchronize(self, comm: Any) -> None:
        with self._lock:
            device = self._devices.get(id(comm))
        if device is not None:
            self._cuda.synchronize(device)

    def abort(self, comm: Any) -> None:
        """Abort ``comm`` now, or, while its setup thread waits inside torch (which holds the
        communicator's lock meanwhile, so that an abort here would block), once that wait ends."""
        with self._lock:
            self._devices.pop(id(comm), None)
            setup = self._setups.get(id(comm))  # kept: ready() says why the setup failed
            if setup is not None and not setup.done.is_set():
                setup.abort = True
                return
        comm.abort()
