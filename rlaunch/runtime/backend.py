"""The communicator layer: which backend a group uses, and how its communicators are built, made
ready, cut and released.

A runtime group (:class:`rlaunch.runtime.groups.SwitchableGroup`) forwards each collective to a
*communicator*: a ``ProcessGroup`` built here on a fresh prefix of the c10d store, with one
backend per device type, as torch's ``cpu:gloo,cuda:nccl`` default has:

- :attr:`Backend.GLOO`: gloo for CPU and CUDA tensors (gloo stages CUDA tensors through the host);
- :attr:`Backend.NCCL`: NCCL for CUDA tensors, gloo for CPU ones (the per-step vote is a CPU scalar).

A group's backend comes from an explicit argument (``rt.new_group(..., backend="nccl")``), else from
the device type of its mesh (``rt.device_mesh(..., device_type="cuda")``), else from the job's
default (``RLAUNCH_BACKEND``: ``gloo``, ``nccl`` or ``auto``, which is NCCL where the machine has a
GPU for each of its workers): :func:`choose` and :func:`default_backend` are that decision, pure.

NCCL communicators are created non-blocking where NCCL allows it (see :mod:`rlaunch.runtime.nccl`):
:meth:`Communicators.build` returns as soon as NCCL has the setup in hand, so the next generation's
communicators are built on the runtime's background thread while training runs on the current
ones, and :meth:`Communicators.wait_ready` waits for them only at the switch. A communicator is
*cut* when its group is abandoned or fails: its NCCL communicator is aborted (``ncclCommAbort``:
its kernels stop, later operations raise) and its gloo connections are shut down (gloo cannot
cancel an operation in flight; shutting its sockets down makes the operation fail at once, here
and at every peer). :meth:`Communicators.settle` waits for the GPU where a caller must know that
NCCL work ended, and :meth:`Communicators.error` reads what torch's watchdog found.
Every NCCL call goes through an :class:`rlaunch.runtime.nccl.NcclApi`, which tests replace with a
fake (:func:`use`).
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroup, Store
from torch.distributed.distributed_c10d import ProcessGroupGloo

from rlaunch.errors import UsageError
from rlaunch.runtime import priority
from rlaunch.runtime.nccl import NcclApi, NcclSetupError, TorchNccl

log = logging.getLogger(__name__)

#: The job's default backend: gloo, nccl or auto (NCCL where CUDA is available).
BACKEND_ENV = "RLAUNCH_BACKEND"
#: How long :func:`cut` waits for an NCCL abort before going on (the abort goes on regardless).
ABORT_WAIT_S = 10.0


class Backend(str, enum.Enum):
    """The backend of a runtime group's CUDA tensors (CPU tensors always use gloo)."""

    GLOO = "gloo"
    NCCL = "nccl"


def parse(value: str, what: str) -> Backend | None:
    """``gloo`` or ``nccl`` (None for ``auto``); ``what`` names the value in the error."""
    text = value.strip().lower()
    if text == "auto":
        return None
    try:
        return Backend(text)
    except ValueError:
        raise UsageError(f"{what} is {value!r}; use 'gloo', 'nccl' or 'auto'.") from None


def default_backend(env: Mapping[str, str], gpus: int) -> Backend:
    """The job's default: ``RLAUNCH_BACKEND`` if set, else NCCL where this machine has a GPU for
    each of its workers (``LOCAL_WORLD_SIZE``; NCCL refuses two ranks on one GPU), else gloo."""
    chosen = parse(env.get(BACKEND_ENV, "auto"), BACKEND_ENV)
    if chosen is not None:
        return chosen
    workers = int(env.get("LOCAL_WORLD_SIZE", "1") or "1")
    return Backend.NCCL if gpus > 0 and gpus >= workers else Backend.GLOO


def visible_gpus() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose(requested: str | None, device_type: str | None, default: Backend) -> Backend:
    """A group's backend: ``requested`` if given, else from ``device_type`` (a mesh's), else ``default``."""
    if requested is not None:
        chosen = parse(requested, "The backend asked for")
        if chosen is not None:
            return chosen
    if device_type is None:
        return default
    if device_type == "cpu":
        return Backend.GLOO
    if device_type == "cuda":
        return Backend.NCCL
    raise UsageError(f"The device type {device_type!r} has no rlaunch backend; use 'cpu' (gloo) or 'cuda' (NCCL).")


def torch_backend_string(backend: Backend) -> str:
    """What ``init_process_group``/``new_group`` take for ``backend`` under plain torchrun."""
    return "cpu:gloo,cuda:nccl" if backend is Backend.NCCL else "gloo"


def cuda_device(env: Mapping[str, str]) -> torch.device:
    """This worker's GPU: ``LOCAL_RANK`` modulo the visible GPUs, as ``init_device_mesh`` picks it."""
    count = max(torch.cuda.device_count(), 1)
    return torch.device("cuda", int(env.get("LOCAL_RANK", "0")) % count)


#: torch's gloo interface choice (a comma-separated list of interface names), kept as under torchrun
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
#: the address the worker's agent advertises to the job (rlaunch.agent.env)
HOST_ADDR_ENV = "RLAUNCH_HOST_ADDR"


def gloo_bind_addr(env: Mapping[str, str]) -> str | None:
    """The address a runtime communicator's gloo binds and tells its peers: the agent's advertised
    address, which reaches the other hosts of the job (``--local-addr``, else the source address
    of the route to etcd). None where ``GLOO_SOCKET_IFNAME`` names the interfaces (torch then
    binds those) or no agent address is known (torch then binds what the host name resolves to,
    which on many hosts is a loopback address that no other host can reach)."""
    if env.get(GLOO_IFNAME_ENV):
        return None
    return env.get(HOST_ADDR_ENV) or None


def _gloo_device(addr: str) -> Any:
    """A gloo device bound to ``addr``; torch's default device, said once, where ``addr`` is not an
    address of this machine (a NAT or public ``--local-addr``: advertised, but never local)."""
    global _unbindable
    if _unbindable != addr:
        try:
            return ProcessGroupGloo.create_device(hostname=addr)
        except RuntimeError as exc:
            log.warning(
                "gloo cannot bind the advertised address %s (%s); it binds what torch picks instead "
                "(GLOO_SOCKET_IFNAME, else the host name's address): set GLOO_SOCKET_IFNAME to the interface "
                "that reaches the other hosts", addr, exc,
            )  # fmt: skip
            _unbindable = addr
    return ProcessGroupGloo.create_default_device()


#: the advertised address gloo could not bind (tried once, then torch's default device is used)
_unbindable = ""
#: the name gloo (torch 2.13) gives the thread of a communicator's TCP transport: its device's event
#: loop, which reads what every pair receives (the process group's workers, ``pt_gloo_runloop``, do
#: not take part in a send or receive). The thread names itself once it runs, which may be after the
#: build returned: so a build notes every thread that appeared meanwhile, and :meth:`yield_cpu`
#: picks this one among them by name.
GLOO_LOOP = "gloo_tcp_loop"


def _connected_inet_fds() -> set[int]:
    """File descriptors of this process's connected (not listening) TCP sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as s:
                listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if s.family in (socket.AF_INET, socket.AF_INET6) and not listening:
                    found.add(int(name))
        except OSError:
            continue  # closed meanwhile
    return found


def _shutdown(fds: set[int]) -> None:
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by gloo


class NotMet(Exception):
    """A build's ``meet`` said its peers are not building it now (see :mod:`rlaunch.runtime.meeting`)."""


class Communicators:
    """Builds communicators and remembers, by ``id()``, what cutting each one takes.

    By id: a callback on a communicator's own thread must not hold the communicator, or dropping
    the last reference there would make it join its own thread.
    """

    def __init__(
        self,
        nccl: NcclApi | None = None,
        *,
        device: Callable[[], torch.device] = lambda: cuda_device(os.environ),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nccl = nccl
        self._device = device
        self._clock = clock
        self._lock = threading.Lock()  # gloo builds are serialized: see _gloo
        self._sockets: dict[int, set[int]] = {}
        self._threads: dict[int, set[int]] = {}  # the threads that appeared as each one was built (see yield_cpu)
        self._nccl_comms: dict[int, Any] = {}
        self._failed_setups: set[int] = set()  # NCCL communicators whose failed setup was logged

    @property
    def nccl(self) -> NcclApi:
        """The NCCL API, made on first use (a gloo-only job never touches it)."""
        if self._nccl is None:
            self._nccl = TorchNccl()
        return self._nccl

    def _gloo(
        self, store: Store, rank: int, size: int, timeout: datetime.timedelta, meet: Callable[[], bool] | None
    ) -> tuple[Any, set[int], set[int]]:
        """A gloo backend, its connected sockets and the threads that appeared while it was built.
        Gloo starts its threads and connects every pair while it is built, so the sockets that appear
        meanwhile are its own (builds are serialized), and so are its threads among those. With
        ``meet``, it is called first, holding the lock: :class:`NotMet` if it says False."""
        with self._lock:
            if meet is not None and not meet():
                raise NotMet("the communicator's other side did not come to build it in time")
            before = _connected_inet_fds()
            threads_before = priority.threads()
            addr = gloo_bind_addr(os.environ)
            if addr is None:
                gloo = ProcessGroupGloo(store, rank, size, timeout=timeout)
            else:
                options = ProcessGroupGloo._Options()
                options._devices = [_gloo_device(addr)]
                options._timeout = timeout
                gloo = ProcessGroupGloo(store, rank, size, options)
            return gloo, _connected_inet_fds() - before, priority.threads() - threads_before

    def build(
        self,
        store: Store,
        prefix: str,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        backend: Backend = Backend.GLOO,
        ranks: Sequence[int] | None = None,
        meet: Callable[[], bool] | None = None,
    ) -> ProcessGroup:
        """A standalone communicator of ``size`` ranks on ``prefix`` of ``store`` (no default group needed);
        ``ranks``: its members' global ranks, for torch's logs (None where not known); ``meet``: see
        :mod:`rlaunch.runtime.meeting` (a build whose peers are known to build it now).

        With NCCL it may return before the NCCL communicator is ready (see :meth:`wait_ready`).
        """
        pstore = PrefixStore(prefix, store)
        name = prefix.strip("/").replace("/", ".")
        gloo, sockets, threads = self._gloo(pstore, rank, size, timeout, meet)
        pg = ProcessGroup(pstore, rank, size)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        if backend is Backend.NCCL:
            device = self._device()
            comm = self.nccl.create(
                PrefixStore("nccl/", pstore), rank, size, name=name, device=device, timeout=timeout, blocking=False,
                ranks=None if ranks is None else list(ranks),
            )  # fmt: skip
            # for tensors of the rank's device type: CUDA (a test's fake NCCL may take CPU tensors instead)
            pg._register_backend(torch.device(device.type), ProcessGroup.BackendType.NCCL, comm)
            pg._set_default_backend(ProcessGroup.BackendType.NCCL)
            pg.bound_device_id = device
            self._nccl_comms[id(pg)] = comm
        else:
            pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, gloo)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._set_group_name(name)
        self._sockets[id(pg)] = sockets
        self._threads[id(pg)] = threads
        return pg

    def transport_threads(self, comm: Any) -> set[int]:
        """The live threads of ``comm``'s gloo transport (one, or none yet), among those that appeared as it
        was built."""
        return self._threads.get(id(comm), set()) & priority.threads((GLOO_LOOP,))

    def yield_cpu(self, comm: Any) -> None:
        """Lower the thread of ``comm``'s gloo transport (which reads what it receives) to the lowest
        priority: what it carries from now on is background work beside training."""
        priority.yield_threads(self.transport_threads(comm))

    def carries(self, comm: Any, device_type: str) -> bool:
        """Whether ``comm`` moves tensors of ``device_type`` itself (else they are staged on the CPU)."""
        if device_type == "cpu":
            return True
        return device_type == "cuda" and id(comm) in self._nccl_comms

    def completes_at_enqueue(self, comm: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether an operation of ``comm`` on ``tensors`` is NCCL's: its future completes when it is
        queued on the GPU, not when the GPU is done (gloo's complete when the operation ends)."""
        if id(comm) not in self._nccl_comms:
            return False
        device_type = comm.bound_device_id.type
        return any(t.device.type == device_type for t in tensors)

    def is_ready(self, comm: Any) -> bool:
        """Whether ``comm`` can carry traffic now: its NCCL communicator finished its non-blocking
        setup (a poll, it never waits; gloo's is ready once built). A setup that failed is never
        ready: it is logged once, and the move waits for a newer plan."""
        nccl = self._nccl_comms.get(id(comm))
        if nccl is None:
            return True
        try:
            return bool(self.nccl.ready(nccl))
        except NcclSetupError as exc:
            if id(nccl) not in self._failed_setups:
                self._failed_setups.add(id(nccl))
                log.warning("%s; this rank will not vote ready for the move that needs it", exc)
            return False

    def error(self, comm: Any) -> str:
        """The error torch's NCCL watchdog recorded on ``comm`` ("" if none, or no NCCL)."""
        nccl = self._nccl_comms.get(id(comm))
        return self.nccl.error(nccl) if nccl is not None else ""

    def settle(self, comm: Any) -> None:
        """Block until the GPU finished what ``comm`` was given: NCCL's ``wait()`` only orders
        streams, so a sender must not report its state sent, nor a joiner use what it received,
        before this (at once for gloo, whose operations end on the host)."""
        nccl = self._nccl_comms.get(id(comm))
        if nccl is not None:
            self.nccl.synchronize(nccl)

    def wait_ready(self, comm: Any, timeout: float, wait: Callable[[float], object] | None = None) -> None:
        """Wait until the NCCL communicator of ``comm`` finished its non-blocking setup (at once for gloo).

        Raises ``TimeoutError`` with a sentence after ``timeout`` seconds, and
        :class:`rlaunch.runtime.nccl.NcclSetupError` if the setup failed.
        """
        nccl = self._nccl_comms.get(id(comm))
        if nccl is None:
            return
        pause = wait or threading.Event().wait
        end = self._clock() + timeout
        while not self.nccl.ready(nccl):
            if self._clock() >= end:
                raise TimeoutError(
                    f"The NCCL communicator {comm.group_name} was not ready within {timeout:.0f} s of its first use; "
                    "a peer may have failed while building it."
                )
            pause(0.005)

    def cut(self, comm_id: int, *, wait: float = ABORT_WAIT_S) -> None:
        """Make every operation pending on the communicator ``id(comm)`` fail now, here and at its peers:
        abort its NCCL communicator, then shut down its gloo connections (never its listening socket:
        gloo's listener thread aborts the process if accept() fails).

        The abort runs on a thread of its own (this may be a communicator's callback thread, which an
        abort would join), waited for up to ``wait`` seconds.
        """
        nccl = self._nccl_comms.pop(comm_id, None)
        if nccl is not None:
            done = self._abort_in_background(nccl)
            if wait > 0 and not done.wait(wait):
                log.warning("aborting an NCCL communicator took more than %.0f s; going on", wait)
        _shutdown(self._sockets.pop(comm_id, set()))

    def _abort_in_background(self, nccl: Any) -> threading.Event:
        done = threading.Event()
        api = self.nccl

        def run() -> None:
            try:
                api.abort(nccl)
            except Exception:  # noqa: BLE001 - an abort that fails leaves nothing more to do
                log.exception("aborting an NCCL communicator failed")
            finally:
                done.set()

        threading.Thread(target=run, name="rlaunch-nccl-abort", daemon=True).start()
        return done

    def forget(self, comm_id: int) -> None:
        """``id(comm)`` may be reused from now on: never cut its sockets (see :meth:`release`)."""
        self._sockets.pop(comm_id, None)
        self._threads.pop(comm_id, None)

    def release(self, comm: Any) -> None:
        """(retire thread) A replaced communicator is about to be dropped: abort its NCCL
        communicator first (non-collective, unlike ``ncclCommDestroy``, which waits for peers)."""
        self._sockets.pop(id(comm), None)
        self._threads.pop(id(comm), None)
        nccl = self._nccl_comms.pop(id(comm), None)
        if nccl is not None:
            try:
                self.nccl.abort(nccl)
            except Exception:  # noqa: BLE001 - the communicator is dropped regardless
                log.exception("aborting a retired NCCL communicator failed")


_current = Communicators()


def use(comms: Communicators) -> Communicators:
    """Make ``comms`` the process's communicator layer (tests pass one with a fake NCCL); return the previous."""
    global _current
    previous, _current = _current, comms
    return previous


def current() -> Communicators:
    return _current


def build(
    store: Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta, backend: Backend = Backend.GLOO,
    ranks: Sequence[int] | None = None, meet: Callable[[], bool] | None = None,
) -> ProcessGroup:  # fmt: skip
    return _current.build(store, prefix, rank, size, timeout, backend, ranks, meet)


def cut(comm_id: int, *, wait: float = ABORT_WAIT_S) -> None:
    _current.cut(comm_id, wait=wait)


def yield_cpu(comm: Any) -> None:
    _current.yield_cpu(comm)
