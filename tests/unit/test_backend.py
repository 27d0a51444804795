"""The backend seam with a fake NCCL: which backend a group gets, and the NCCL-facing calls made
(which communicator, in what order, with which options) when communicators are built in the
background, waited for at the switch, aborted on a fault and released after a switch.

Gloo is real here (communicators over a ``HashStore``); only the NCCL side is the fake, which
hands out torch's ``FakeProcessGroup`` (a real c10d backend that does nothing) so that it can be
registered for CUDA tensors as a real ``ProcessGroupNCCL`` would be. It stands in for
:class:`rlaunch.runtime.nccl.TorchNccl` as a whole (what ``TorchNccl`` itself does with torch's
``ProcessGroupNCCL`` is tested in ``test_nccl.py``, over a fake of that class).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed import HashStore, ProcessGroup

from rlaunch.errors import UsageError
from rlaunch.runtime import backend as backends
from rlaunch.runtime import rng
from rlaunch.runtime.backend import Backend, Communicators, choose, default_backend
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from tests.unit import gloo_groups as gloo

TIMEOUT = datetime.timedelta(seconds=20)
GPU = torch.device("cuda", 3)


class FakeNccl:
    """Records every NCCL-facing call as (call, communicator name, details)."""

    def __init__(self, ready_after: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.names: dict[int, str] = {}
        self.ready_after = ready_after  # polls answered "not ready" before "ready"
        self._polls: dict[str, int] = {}
        self.errors: dict[str, str] = {}  # communicator name -> the error torch's watchdog recorded
        self.lock = threading.Lock()

    def create(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        name: str,
        device: torch.device,
        timeout: datetime.timedelta,
        blocking: bool,
        ranks: Any,
    ) -> Any:
        comm = FakeProcessGroup._create_internal(rank, size)
        with self.lock:
            self.names[id(comm)] = name
            self.calls.append(
                ("create", name, {"rank": rank, "size": size, "device": str(device), "timeout": timeout,
                                  "blocking": blocking, "ranks": None if ranks is None else list(ranks),
                                  "thread": threading.current_thread().name})
            )  # fmt: skip
        return comm

    def ready(self, comm: Any) -> bool:
        name = self.names[id(comm)]
        with self.lock:
            polls = self._polls[name] = self._polls.get(name, 0) + 1
            self.calls.append(("ready", name, {"thread": threading.current_thread().name}))
        return polls > self.ready_after

    def abort(self, comm: Any) -> None:
        with self.lock:
            self.calls.append(("abort", self.names[id(comm)], {}))

    def error(self, comm: Any) -> str:
        return self.errors.get(self.names[id(comm)], "")

    def synchronize(self, comm: Any) -> None:
        with self.lock:
            self.calls.append(("synchronize", self.names[id(comm)], {"thread": threading.current_thread().name}))

    def sequence(self) -> list[tuple[str, str]]:
        """The calls without their details, ready polls collapsed: what happened to which communicator."""
        out: list[tuple[str, str]] = []
        for call, name, _ in self.calls:
            if not out or out[-1] != (call, name):
                out.append((call, name))
        return out


def _build(prefix: str, backend: Backend, store: Any = None) -> ProcessGroup:
    return backends.build(store or HashStore(), prefix, 0, 1, TIMEOUT, backend)


# --- which backend ------------------------------------------------------------------------------


def test_an_explicit_backend_wins_over_the_device_type_and_the_default() -> None:
    assert choose("gloo", "cuda", Backend.NCCL) is Backend.GLOO
    assert choose("NCCL", "cpu", Backend.GLOO) is Backend.NCCL


def test_the_device_type_chooses_as_torchs_cpu_gloo_cuda_nccl_default() -> None:
    assert choose(None, "cuda", Backend.GLOO) is Backend.NCCL
    assert choose(None, "cpu", Backend.NCCL) is Backend.GLOO
    assert choose("auto", "cuda", Backend.GLOO) is Backend.NCCL


def test_without_either_the_jobs_default_is_used() -> None:
    assert choose(None, None, Backend.NCCL) is Backend.NCCL
    assert choose(None, None, Backend.GLOO) is Backend.GLOO


def test_the_jobs_default_is_nccl_where_each_worker_has_a_gpu_unless_the_env_says_otherwise() -> None:
    assert default_backend({}, gpus=1) is Backend.NCCL
    assert default_backend({"LOCAL_WORLD_SIZE": "8"}, gpus=8) is Backend.NCCL
    assert default_backend({"LOCAL_WORLD_SIZE": "4"}, gpus=1) is Backend.GLOO  # NCCL: one rank per GPU
    assert default_backend({}, gpus=0) is Backend.GLOO
    assert default_backend({"RLAUNCH_BACKEND": "gloo"}, gpus=1) is Backend.GLOO
    assert default_backend({"RLAUNCH_BACKEND": "nccl"}, gpus=0) is Backend.NCCL
    assert default_backend({"RLAUNCH_BACKEND": "auto"}, gpus=0) is Backend.GLOO


def test_unknown_backends_and_device_types_are_refused_with_a_sentence() -> None:
    with pytest.raises(UsageError, match=r"RLAUNCH_BACKEND is 'mpi'; use 'gloo', 'nccl' or 'auto'\."):
        default_backend({"RLAUNCH_BACKEND": "mpi"}, gpus=1)
    with pytest.raises(UsageError, match=r"device type 'xpu' has no rlaunch backend"):
        choose(None, "xpu", Backend.GLOO)


# --- building -------------------------------------------------------------------------------------


def test_an_nccl_communicator_is_created_non_blocking_on_the_ranks_gpu(fake: FakeNccl) -> None:
    pg = _build("g1/world/", Backend.NCCL)
    assert len(fake.calls) == 1
    call, name, options = fake.calls[0]
    assert (call, name) == ("create", "g1.world")
    assert options["blocking"] is False
    assert (options["rank"], options["size"], options["device"], options["timeout"]) == (0, 1, "cuda:3", TIMEOUT)
    # CUDA tensors go to NCCL, CPU tensors (the vote) to gloo, as torch's cpu:gloo,cuda:nccl
    assert fake.names[id(pg._get_backend(torch.device("cuda")))] == "g1.world"
    assert pg._get_backend(torch.device("cpu")).name() == "gloo"
    assert backends.current().carries(pg, "cuda") and backends.current().carries(pg, "cpu")
    backends.current().release(pg)


def test_a_gloo_communicator_makes_no_nccl_call_and_takes_cuda_tensors_through_gloo(fake: FakeNccl) -> None:
    pg = _build("g1/world/", Backend.GLOO)
    assert fake.calls == []
    assert pg._get_backend(torch.device("cuda")).name() == "gloo"
    assert not backends.current().carries(pg, "cuda")
    t = torch.ones(3)
    pg.allreduce([t]).wait()  # a real gloo communicator of one rank
    assert t.tolist() == [1.0, 1.0, 1.0]


# --- phase 1: built in the background, waited for only at the switch ----------------------------


def test_the_next_generation_is_created_in_the_background_and_waited_for_only_at_the_switch() -> None:
    nccl = FakeNccl(ready_after=3)
    previous = backends.use(Communicators(nccl, device=lambda: GPU))
    try:
        current = _build("g1/world/", Backend.NCCL)
        group = SwitchableGroup("world", [0], 0, current, 1, guarded=False, backend=Backend.NCCL)
        built: dict[str, Any] = {}
        store = HashStore()
        prepare = threading.Thread(
            target=lambda: built.update(comm=_build("g2/world/", Backend.NCCL, store)), name="rlaunch-prepare"
        )
        prepare.start()
        prepare.join(30)
        assert "comm" in built
        # training goes on over the current communicator meanwhile: no NCCL call waits for g2
        t = torch.full((2,), 2.0)
        group.allreduce([t]).wait()
        assert t.tolist() == [2.0, 2.0]
        assert [c[:2] for c in nccl.calls] == [("create", "g1.world"), ("create", "g2.world")]
        assert nccl.calls[1][2]["thread"] == "rlaunch-prepare" and nccl.calls[1][2]["blocking"] is False

        group.swap(built["comm"], 2)  # the switch: the only place that waits
        polls = [c for c in nccl.calls if c[0] == "ready"]
        assert [c[1] for c in polls] == ["g2.world"] * 4  # three "not yet", then ready
        assert {c[2]["thread"] for c in polls} == {threading.current_thread().name}
        assert group.comm is built["comm"] and group.version == 2
        # the replaced communicator is aborted when released (non-collective, unlike destroy)
        backends.current().release(current)
        assert nccl.sequence()[-1] == ("abort", "g1.world")
        backends.current().release(built["comm"])
    finally:
        backends.use(previous)


def test_a_communicator_that_never_becomes_ready_fails_the_switch_with_a_sentence() -> None:
    nccl = FakeNccl(ready_after=10**9)
    now = [0.0]
    comms = Communicators(nccl, device=lambda: GPU, clock=lambda: now[0])
    pg = comms.build(HashStore(), "g2/world/", 0, 1, TIMEOUT, Backend.NCCL)

    def tick(seconds: float) -> None:
        now[0] += 1.0

    with pytest.raises(TimeoutError, match=r"NCCL communicator g2\.world was not ready within 5 s of its first use"):
        comms.wait_ready(pg, 5.0, wait=tick)
    assert 5 <= sum(1 for c in nccl.calls if c[0] == "ready") <= 7
    comms.release(pg)


# --- aborting on faults --------------------------------------------------------------------------


def _pair(comms: list[Communicators], backend: Backend) -> list[ProcessGroup]:
    """Two ranks of one communicator in this process (each with its own layer: builds are serialized)."""
    store = HashStore()
    out: dict[int, ProcessGroup] = {}

    def build(rank: int) -> None:
        out[rank] = comms[rank].build(store, "g1/pair/", rank, 2, TIMEOUT, backend)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [out[0], out[1]]


def test_abandon_aborts_the_nccl_communicator_then_cuts_gloo_and_the_pending_operation_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nccl = FakeNccl()
    layers = [Communicators(nccl, device=lambda: GPU), Communicators(FakeNccl(), device=lambda: GPU)]
    pg0, pg1 = _pair(layers, Backend.NCCL)
    order: list[str] = []
    shutdown = backends._shutdown
    monkeypatch.setattr(
        backends, "_shutdown", lambda fds: (order.append(f"shutdown {len(fds)} sockets"), shutdown(fds))
    )
    real_abort = nccl.abort
    monkeypatch.setattr(nccl, "abort", lambda comm: (order.append("abort"), real_abort(comm)))
    previous = backends.use(layers[0])
    try:
        group = SwitchableGroup("pair", [0, 1], 0, pg0, 1, guarded=True, backend=Backend.NCCL)
        t = torch.full((4,), 5.0)
        work = group.allreduce([t])  # rank 1 never joins: pending
        assert group.busy
        group.abandon("rank 1 is being replaced")
        work.wait()  # returns: the caller gets its inputs back
        assert t.tolist() == [5.0] * 4
        assert group.failed == "rank 1 is being replaced"
        assert order[0] == "abort" and order[1].startswith("shutdown") and order[1] != "shutdown 0 sockets"
        assert nccl.sequence() == [("create", "g1.pair"), ("abort", "g1.pair")]
        group.abandon("again")  # a cut communicator is not aborted twice
        assert [c[0] for c in nccl.calls].count("abort") == 1
    finally:
        backends.use(previous)
        layers[1].cut(id(pg1))


def test_a_failed_operation_cuts_its_communicator_without_waiting_for_the_abort(fake: FakeNccl) -> None:
    pg = _build("g1/world/", Backend.NCCL)
    aborted = threading.Event()
    fake.abort = lambda comm: aborted.set()  # type: ignore[method-assign]
    backends.cut(id(pg), wait=0)
    assert aborted.wait(10)
    assert not backends.current().carries(pg, "cuda")  # forgotten: a later cut does nothing


def test_abandoning_a_sandboxed_group_makes_no_nccl_call(fake: FakeNccl) -> None:
    group = SwitchableGroup("world", [0, 1], 0, SandboxComm(0, 2), 1, backend=Backend.NCCL)
    group.abandon("standby chosen")
    assert fake.calls == []


# --- the futures handed back for CUDA tensors -----------------------------------------------------


class _OnDevice:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_futures_of_cuda_tensors_know_their_devices() -> None:
    from rlaunch.runtime.works import cuda_devices

    found = cuda_devices([_OnDevice("cuda:1"), _OnDevice("cpu"), _OnDevice("cuda:0"), _OnDevice("cuda:1")])
    assert found == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert cuda_devices([_OnDevice("cpu")]) == []


# --- the runtime's phase 1 builds each group with its own backend -------------------------------


def _nccl_runtime(world_comm: Any, generation: int, store: Any) -> Any:
    """A one-rank runtime whose groups' backend is NCCL (no agent link)."""
    from rlaunch.runtime.runtime import Runtime

    return Runtime(
        rank=0, world_size=1, generation=generation, link=None, store=store, world_comm=world_comm,
        standby=False, sandbox_steps=0, timeout=TIMEOUT, backend=Backend.NCCL,
    )  # fmt: skip


def test_phase_one_builds_each_affected_group_with_its_backend(fake: FakeNccl) -> None:
    from rlaunch.plans import MigratePlan, Role

    rt = _nccl_runtime(world_comm=SandboxComm(0, 1), generation=1, store=HashStore())
    rt._s.groups.add(SwitchableGroup("cpu_side", [0], 0, SandboxComm(0, 1), 1, backend=Backend.GLOO))
    plan = MigratePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(0,), world_size=1)
    comms = rt._migration.prepare(plan)
    assert sorted(comms) == ["cpu_side", "world"]
    # only the NCCL group made an NCCL call: one non-blocking create of generation 2's communicator
    assert [(c[0], c[1], c[2]["blocking"]) for c in fake.calls] == [("create", "g2.world", False)]
    assert backends.current().carries(comms["world"], "cuda")
    assert not backends.current().carries(comms["cpu_side"], "cuda")
    for comm in comms.values():
        backends.current().release(comm)


def test_with_nccl_groups_the_vote_waits_for_the_steps_gpu_work_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL completes a future when its kernel is queued: only a stream synchronize before the
    vote makes a full vote mean that every rank's gradient sync ended."""
    order: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            order.append("synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    rt = _nccl_runtime(world_comm=gloo.one_rank(), generation=0, store=None)
    vote = rt.group.allreduce
    monkeypatch.setattr(rt.group, "allreduce", lambda *a, **k: (order.append("vote"), vote(*a, **k))[1])
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.track(model=model, optimizer=opt)
    for _ in rt.steps(1):
        model(torch.ones(1, 2)).sum().backward()
        assert rt.optimizer_step(opt)
    assert order == ["synchronize", "vote"]


def test_a_rank_votes_ready_only_once_its_nccl_communicators_are_ready(fake: FakeNccl) -> None:
    """A peer failing while NCCL builds must delay the move, not hang every rank at the switch."""
    from rlaunch.plans import MigratePlan, Role
    from rlaunch.runtime.migration import Prepared
    from rlaunch.runtime.phases import MovePhases

    fake.ready_after = 2
    rt = _nccl_runtime(world_comm=SandboxComm(0, 1), generation=1, store=HashStore())
    plan = MigratePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(0,), world_size=1)
    comms = rt._migration.prepare(plan)
    rt._migration._prepared = Prepared(plan, comms, MovePhases(2, "survivor"))
    assert [rt._migration.ready for _ in range(3)] == [0, 0, 2], "ready for generation 2 once built"
    assert [c[0] for c in fake.calls] == ["create", "ready", "ready", "ready"], "polled, never waited"
    for comm in comms.values():
        backends.current().release(comm)


# --- a state transfer over an NCCL channel ----------------------------------------------------------


@pytest.mark.parametrize("side", ["sender", "joiner"])
def test_a_transfer_waits_for_its_channels_setup_and_ends_only_once_the_gpu_is_done(
    side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL's ``wait()`` only orders streams: "sent" and "received" must mean done on the GPU (the
    leaver exits, and the joiner's channel is aborted, right after). And a channel's first use is
    the transfer itself: its setup is waited for there. One side's channel is built by the
    process's communicator layer (with the fake NCCL), the other's by a layer of its own; that
    side's tensor sends (or receives) are recorded among the NCCL calls."""
    from rlaunch.runtime import transfer
    from rlaunch.runtime.transfer import recv_state, send_state

    nccl = FakeNccl(ready_after=2)
    layers = [Communicators(nccl, device=lambda: GPU), Communicators(FakeNccl(), device=lambda: GPU)]
    previous = backends.use(layers[0])
    try:
        store, built = HashStore(), {}
        layer = {0: layers[0], 1: layers[1]} if side == "sender" else {0: layers[1], 1: layers[0]}

        def make(r: int) -> None:
            built[r] = layer[r].build(store, "g2/transfer/1/", r, 2, TIMEOUT, Backend.NCCL)

        makers = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for m in makers:
            m.start()
        for m in makers:
            m.join(30)
        torch.manual_seed(0)
        sender, receiver = {"model": torch.nn.Linear(3, 2)}, {"model": torch.nn.Linear(3, 2)}
        watched = built[0] if side == "sender" else built[1]
        real_digests, real_receive = transfer.digests_of, transfer._receive

        def digests(names: Any, pairs: Any, *args: Any) -> Any:  # the sender's: its tensors are posted by then
            if side == "sender" and threading.current_thread().name == "sender":
                nccl.calls.append(("_send", "tensor", {}))
            return real_digests(names, pairs, *args)

        def receive(channel: Any, entries: Any, targets: Any) -> Iterator[torch.Tensor]:
            for t in real_receive(channel, entries, targets):
                if channel is watched and t.numel() == 2 * 3:  # the weight has landed
                    nccl.calls.append(("_recv", "tensor", {}))
                yield t

        monkeypatch.setattr(transfer, "digests_of", digests)
        monkeypatch.setattr(transfer, "_receive", receive)
        sending = threading.Thread(target=send_state, args=(built[0], sender, 7, rng.capture()), name="sender")
        sending.start()
        assert recv_state(built[1], receiver).step == 7
        sending.join(30)
        assert torch.equal(sender["model"].weight, receiver["model"].weight)
        calls = [c[0] for c in nccl.calls if c[0] in ("ready", "synchronize", "_send", "_recv")]
        moved = "_send" if side == "sender" else "_recv"
        # ready first (twice "not yet"), then the tensors, then the GPU waited for
        assert calls == ["ready"] * 3 + [moved, "synchronize"], calls
    finally:
        backends.use(previous)


def test_gloo_binds_the_agents_advertised_address_unless_gloo_socket_ifname_names_interfaces() -> None:
    assert backends.gloo_bind_addr({"RLAUNCH_HOST_ADDR": "fd00:7::2"}) == "fd00:7::2"
    assert backends.gloo_bind_addr({"RLAUNCH_HOST_ADDR": "10.1.0.2", "GLOO_SOCKET_IFNAME": "eth1"}) is None
    assert backends.gloo_bind_addr({}) is None, "no agent (a plain torchrun): torch's own choice"


def test_an_advertised_address_gloo_cannot_bind_falls_back_to_torchs_choice_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING"):
        assert backends._gloo_device("203.0.113.7") is not None  # TEST-NET-3: never a local address
        assert backends._gloo_device("203.0.113.7") is not None
    said = [r for r in caplog.records if "cannot bind the advertised address 203.0.113.7" in r.message]
    assert len(said) == 1 and "GLOO_SOCKET_IFNAME" in said[0].message


def test_yield_cpu_lowers_the_gloo_transport_thread_of_that_communicator_and_no_other() -> None:
    """A joiner's channel carries the snapshot handover beside training once its first step ended:
    its gloo transport thread (one of the threads that appeared as it was built, found by name)
    goes to nice 19; another communicator's and the caller's stay as they were."""
    layer = Communicators()
    channel = gloo.kept(layer.build(HashStore(), "channel/", 0, 1, TIMEOUT))
    other = gloo.kept(layer.build(HashStore(), "other/", 0, 1, TIMEOUT))

    def loop(comm: Any) -> int:  # the transport thread names itself once it runs
        for _ in range(500):
            named = layer.transport_threads(comm)
            if named:
                (tid,) = named
                return tid
            time.sleep(0.01)
        raise AssertionError("no gloo transport thread among the threads the build started")

    mine, theirs = loop(channel), loop(other)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert caller < 19 and os.getpriority(os.PRIO_PROCESS, mine) == os.getpriority(os.PRIO_PROCESS, theirs) == caller
    layer.yield_cpu(channel)
    assert os.getpriority(os.PRIO_PROCESS, mine) == 19 and os.getpriority(os.PRIO_PROCESS, theirs) == caller
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    layer.release(channel)
    assert id(channel) not in layer._threads
