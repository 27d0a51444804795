"""Unit tests of the sandbox communicator and the switchable group, in-process and without traffic.

A standby warms up by running the training script on a :class:`SwitchableGroup` whose inner
communicator is a :class:`SandboxComm`: every collective must complete at once, locally, with
outputs shaped as a real collective would leave them, and DDP must train over it with no default
process group and no socket.
"""

from __future__ import annotations

import copy
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions
from torch.nn.parallel import DistributedDataParallel as DDP

from rlaunch.errors import SandboxError
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup

pytestmark = pytest.mark.timeout(60)

RANK, SIZE = 1, 4


@pytest.fixture
def comm() -> SandboxComm:
    return SandboxComm(rank=RANK, size=SIZE)


def done(work: dist.Work) -> None:
    """The work a sandbox returns is already complete: nobody else takes part."""
    assert work.is_completed()
    assert work.wait() is True


def test_rank_and_size_are_the_ones_given(comm: SandboxComm) -> None:
    assert (comm.rank(), comm.size()) == (RANK, SIZE)


def test_allreduce_broadcast_and_reduce_leave_the_tensor_as_it_is(comm: SandboxComm) -> None:
    for name, opts in [
        ("allreduce", dist.AllreduceOptions()),
        ("broadcast", dist.BroadcastOptions()),
        ("reduce", dist.ReduceOptions()),
    ]:
        t = torch.arange(6.0).reshape(2, 3)
        work = getattr(comm, name)([t], opts)
        done(work)
        assert torch.equal(t, torch.arange(6.0).reshape(2, 3)), name
        (result,) = work.get_future().value()
        assert result is t, f"{name} completes with the caller's own tensor"


def test_allgather_fills_every_slot_with_the_input(comm: SandboxComm) -> None:
    inp = torch.tensor([1.0, 2.0, 3.0])
    outs = [[torch.zeros(3) for _ in range(SIZE)]]
    done(comm.allgather(outs, [inp], AllgatherOptions()))
    assert all(torch.equal(o, inp) for o in outs[0])
    assert torch.equal(inp, torch.tensor([1.0, 2.0, 3.0])), "the input is not touched"


def test_allgather_base_holds_size_copies(comm: SandboxComm) -> None:
    inp = torch.tensor([1.0, 2.0, 3.0])
    flat = torch.zeros(SIZE * 3)
    done(comm._allgather_base(flat, inp, AllgatherOptions()))
    assert torch.equal(flat, inp.repeat(SIZE))
    stacked = torch.zeros(SIZE, 3)
    done(comm._allgather_base(stacked, inp, AllgatherOptions()))
    assert torch.equal(stacked, inp.expand(SIZE, 3))


def test_allgather_into_tensor_coalesced_fills_each_output(comm: SandboxComm) -> None:
    inputs = [torch.tensor([1.0, 2.0]), torch.tensor([7.0])]
    outputs = [torch.zeros(SIZE * 2), torch.zeros(SIZE)]
    done(comm.allgather_into_tensor_coalesced(outputs, inputs, AllgatherOptions()))
    assert torch.equal(outputs[0], inputs[0].repeat(SIZE))
    assert torch.equal(outputs[1], torch.full((SIZE,), 7.0))


def test_reduce_scatter_gives_this_ranks_input(comm: SandboxComm) -> None:
    inputs = [[torch.full((2,), float(r)) for r in range(SIZE)]]
    out = torch.full((2,), -1.0)
    done(comm.reduce_scatter([out], inputs, dist.ReduceScatterOptions()))
    assert torch.equal(out, torch.full((2,), float(RANK)))


def test_reduce_scatter_base_gives_this_ranks_chunk(comm: SandboxComm) -> None:
    inp = torch.arange(SIZE * 3, dtype=torch.float32)
    out = torch.zeros(3)
    done(comm._reduce_scatter_base(out, inp, dist.ReduceScatterOptions()))
    assert torch.equal(out, inp.chunk(SIZE)[RANK])
    out2d = torch.zeros(1, 3)
    done(comm._reduce_scatter_base(out2d, inp.reshape(SIZE, 3), dist.ReduceScatterOptions()))
    assert torch.equal(out2d, inp.reshape(SIZE, 1, 3)[RANK])


def test_reduce_scatter_tensor_coalesced_gives_each_output_its_chunk(comm: SandboxComm) -> None:
    inputs = [torch.arange(SIZE * 2, dtype=torch.float32), torch.arange(SIZE, dtype=torch.float32) + 100]
    outputs = [torch.zeros(2), torch.zeros(1)]
    done(comm.reduce_scatter_tensor_coalesced(outputs, inputs, dist.ReduceScatterOptions()))
    assert torch.equal(outputs[0], inputs[0].chunk(SIZE)[RANK])
    assert torch.equal(outputs[1], torch.tensor([100.0 + RANK]))


def test_alltoall_base_and_alltoall_return_the_input_in_the_output_shape(comm: SandboxComm) -> None:
    inp = torch.arange(8.0)
    out = torch.zeros(SIZE, 2)
    done(comm.alltoall_base(out, inp, [], [], dist.AllToAllOptions()))
    assert torch.equal(out, inp.reshape(SIZE, 2))
    inputs = [torch.full((2,), float(r)) for r in range(SIZE)]
    outputs = [torch.zeros(2) for _ in range(SIZE)]
    done(comm.alltoall(outputs, inputs, dist.AllToAllOptions()))
    assert all(torch.equal(o, i) for o, i in zip(outputs, inputs, strict=True))


def test_barrier_completes_at_once_and_send_and_recv_are_refused(comm: SandboxComm) -> None:
    done(comm.barrier(dist.BarrierOptions()))
    t = torch.ones(3)
    # no peer exists in a sandbox: a receive would hand the script data nobody sent
    for call in (lambda: comm.send([t], 0, 0), lambda: comm.recv([t], 0, 0), lambda: comm.recv_anysource([t], 0)):
        with pytest.raises(SandboxError, match="cannot run in a standby's sandbox"):
            call()
    assert torch.equal(t, torch.ones(3))


def test_gather_fills_the_roots_slots_and_a_non_root_passes_none(comm: SandboxComm) -> None:
    inp = torch.tensor([4.0, 5.0])
    outs = [[torch.zeros(2) for _ in range(SIZE)]]
    done(comm.gather(outs, [inp], dist.GatherOptions()))
    assert all(torch.equal(o, inp) for o in outs[0])
    done(comm.gather([], [inp], dist.GatherOptions()))


def test_scatter_gives_this_ranks_piece_and_keeps_the_output_without_one(comm: SandboxComm) -> None:
    out = torch.zeros(2)
    pieces = [[torch.full((2,), float(r)) for r in range(SIZE)]]
    done(comm.scatter([out], pieces, dist.ScatterOptions()))
    assert torch.equal(out, torch.full((2,), float(RANK)))
    kept = torch.full((2,), 9.0)
    done(comm.scatter([kept], [[]], dist.ScatterOptions()))
    assert torch.equal(kept, torch.full((2,), 9.0))


def test_allgather_coalesced_fills_one_list_per_rank(comm: SandboxComm) -> None:
    # torch's layout: output_lists[r][i] receives rank r's input i (see all_gather_coalesced)
    inputs = [torch.ones(2, 2), torch.full((3,), 2.0)]
    outputs = [[torch.zeros(2, 2), torch.zeros(3)] for _ in range(SIZE)]
    done(comm.allgather_coalesced(outputs, inputs, AllgatherOptions()))
    for per_rank in outputs:
        assert all(torch.equal(o, i) for o, i in zip(per_rank, inputs, strict=True))


def test_alltoall_base_with_uneven_splits_fills_the_output(comm: SandboxComm) -> None:
    # all_to_all_single with split sizes (as MoE token routing does): output and input differ in size
    inp = torch.arange(4.0)
    out = torch.full((8,), -1.0)
    done(comm.alltoall_base(out, inp, [2, 2, 2, 2], [1, 1, 1, 1], dist.AllToAllOptions()))
    assert out.shape == (8,)


# -- SwitchableGroup -------------------------------------------------------------------------


class Recording(SandboxComm):
    """A sandbox that notes which collectives reached it."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.calls: list[str] = []

    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        self.calls.append("allreduce")
        return super().allreduce(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> dist.Work:
        self.calls.append("broadcast")
        return super().broadcast(*args, **kwargs)


def test_switchable_group_is_a_process_group_that_forwards_to_its_comm() -> None:
    inner = Recording(0, 3)
    group = SwitchableGroup("world", [0, 1, 2], 0, inner, version=1)
    assert isinstance(group, dist.ProcessGroup)
    assert group.sandboxed
    t = torch.ones(2)
    done(group.allreduce([t], dist.AllreduceOptions()))
    done(group.broadcast([t], dist.BroadcastOptions()))
    # through torch.distributed's functions, which call the group from C++
    dist.all_reduce(t, group=group)
    dist.broadcast(t, group=group, group_src=0)
    assert inner.calls == ["allreduce", "broadcast", "allreduce", "broadcast"]
    assert torch.equal(t, torch.ones(2))


def test_swap_replaces_the_comm_and_the_version() -> None:
    first, second = Recording(0, 2), Recording(0, 2)
    group = SwitchableGroup("world", [0, 1], 0, first, version=1)
    group.swap(second, 2)
    assert (group.comm, group.version) == (second, 2)
    done(group.allreduce([torch.ones(1)], dist.AllreduceOptions()))
    assert (first.calls, second.calls) == ([], ["allreduce"])


def test_rank_and_size_follow_the_members() -> None:
    comm = SandboxComm(0, 3)
    member = SwitchableGroup("sub", [7, 2, 5], 5, comm, version=1)
    assert member.members == [2, 5, 7]
    assert (member.rank(), member.size()) == (1, 3)
    outsider = SwitchableGroup("sub", [2, 5, 7], 4, comm, version=1)
    assert (outsider.rank(), outsider.size()) == (-1, 3)
    group = SwitchableGroup("sub", [3], 3, comm, version=1)
    assert (group.rank(), group.size()) == (0, 1)


def _socket_fds() -> set[str]:
    """This process's sockets (by inode), wherever they were opened from."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def test_ddp_trains_over_a_sandbox_without_a_default_group_or_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized(), "this test needs a process without a default group"

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sandbox opened a socket")

    sockets_before = _socket_fds()
    monkeypatch.setattr(socket.socket, "__init__", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    start = copy.deepcopy(plain.state_dict())
    group = SwitchableGroup("world", range(SIZE), RANK, SandboxComm(RANK, SIZE), version=0)
    model = DDP(copy.deepcopy(plain), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        plain.zero_grad(set_to_none=True)
        plain(x).pow(2).mean().backward()
        for got, local in zip(model.parameters(), plain.parameters(), strict=True):
            # DDP divides by the group size before the allreduce; the sandbox sums only this rank
            torch.testing.assert_close(got.grad, local.grad / SIZE)
        opt.step()
        with torch.no_grad():
            for a, b in zip(plain.parameters(), model.parameters(), strict=True):
                a.copy_(b)

    assert not dist.is_initialized()
    assert not _socket_fds() - sockets_before, "no socket was opened, not even from C++"
    moved = [not torch.equal(p, start[k]) for k, p in model.module.state_dict().items()]
    assert all(moved), "every parameter took optimizer steps"
