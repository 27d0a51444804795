"""The NCCL boundary: every call rlaunch makes to ``ProcessGroupNCCL`` goes through :class:`NcclApi`.

:mod:`rlaunch.runtime.backend` builds, waits for and aborts NCCL communicators only through an
object with this interface, so tests without a GPU substitute a fake that records each call
(which communicator, in what order, with which options) and CI checks the ordering that matters:
a next-generation communicator is created non-blocking on a background thread, waited for only
at the switch, and aborted when its group is abandoned.

:class:`TorchNccl` is the real one, over torch's ``ProcessGroupNCCL`` (torch 2.11–2.13):

- ``create`` builds a ``ProcessGroupNCCL`` with ``Options.config.blocking = 0`` (NCCL's
  non-blocking ``ncclCommInitRankConfig``) and connects it at once on the rank's GPU
  (``eager_connect_single_device``): the call returns while NCCL finishes its setup on its own;
- ``ready`` is ``_is_initialized()``: every NCCL communicator of the group finished its setup;
- ``abort`` is ``abort()`` (``ncclCommAbort``): operations pending on it return with an error.

``ncclCommSplit`` from a live communicator (``split_group``, or ``Options.split_from``) is not used:
a split is collective over the parent's members, and a joiner is not one of them.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch
from torch.distributed import Store


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
    ) -> Any:
        """A communicator of ``size`` ranks on ``store``, connected on ``device``; with
        ``blocking=False`` it returns before the communicator is ready."""

    def ready(self, comm: Any) -> bool:
        """Whether ``comm`` finished its setup (true at once for a blocking one)."""

    def abort(self, comm: Any) -> None:
        """Abort ``comm`` (``ncclCommAbort``): its pending operations return with an error."""


class NcclUnavailableError(RuntimeError):
    """This torch has no NCCL (a CPU build) or this machine has no GPU."""


class TorchNccl:
    """:class:`NcclApi` over torch's ``ProcessGroupNCCL``."""

    def __init__(self) -> None:
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
        self._cls: Any = ProcessGroupNCCL

    def options(self, *, name: str, timeout: datetime.timedelta, blocking: bool) -> Any:
        opts = self._cls.Options()
        opts.is_high_priority_stream = False
        opts.config.blocking = 1 if blocking else 0
        opts._timeout = timeout
        opts.group_name = name
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
    ) -> Any:
        comm = self._cls(store, rank, size, self.options(name=name, timeout=timeout, blocking=blocking))
        # Connect now, not at the first collective: that first collective is on the training
        # thread, at the switch, and must not be where the setup cost is paid.
        comm.eager_connect_single_device(device)
        return comm

    def ready(self, comm: Any) -> bool:
        return bool(comm._is_initialized())

    def abort(self, comm: Any) -> None:
        comm.abort()

    @staticmethod
    def version() -> tuple[int, ...]:
        """The NCCL version torch runs with (``torch.cuda.nccl.version()``)."""
        return tuple(torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
