"""torch.distributed's own functions against a standby's sandbox, as a training script calls them.

A standby of a 4-rank job before it holds ranks (rank -1): the world group, a group of
``rt.new_group`` without rank 0 and a 2 x 2 mesh, each on a sandbox communicator, built by the
runtime as a standby builds them. Every collective and object collective must complete at once,
with what :mod:`rlaunch.runtime.sandbox` documents, never garbage; point-to-point calls are
refused with a sentence. Nothing goes over the wire.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.device_mesh as torch_mesh
from torch.distributed import HashStore, ProcessGroup
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from rlaunch.errors import SandboxError
from rlaunch.runtime import sandbox
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.runtime import Runtime

pytestmark = pytest.mark.timeout(60)

WORLD = 4


class _Link:
    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return {}


class Standby:
    """The runtime of a standby, and the groups its script made."""

    def __init__(self) -> None:
        self.rt = Runtime(
            rank=-1, world_size=WORLD, generation=0, link=_Link(), store=HashStore(),
            world_comm=SandboxComm(0, WORLD), standby=True, sandbox_steps=0, timeout=datetime.timedelta(seconds=5),
        )  # type: ignore[arg-type]  # fmt: skip
        self.pair = self.rt.new_group("pair", [1, 2])
        self.mesh = self.rt.device_mesh((2, 2), ("dp", "tp"))
        self.dp = self.mesh["dp"].get_group()  # the standby is laid out as rank 0: members [0, 2], its place 0


@pytest.fixture
def standby(monkeypatch: pytest.MonkeyPatch) -> Iterator[Standby]:
    assert not dist.is_initialized(), "these tests need a process without a default group"
    monkeypatch.setattr(torch_mesh, "get_rank", torch_mesh.get_rank)  # the standby's mesh replaces it: put back
    # and serves the groups of the dimensions torch flattens or unflattens from it: put back too
    monkeypatch.setattr(DeviceMesh, "_init_process_groups", DeviceMesh.__dict__["_init_process_groups"])
    job = Standby()
    sockets = _sockets()
    try:
        yield job
        assert _sockets() == sockets, "the sandbox opened no socket"
    finally:
        job.rt._shutdown()
    assert not dist.is_initialized()


def _sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def test_a_standby_is_rank_minus_one_in_the_world_and_in_its_groups_and_rank_0_in_its_mesh(standby: Standby) -> None:
    assert (dist.get_rank(), dist.get_world_size()) == (-1, WORLD)
    assert dist.get_process_group_ranks(None) == list(range(WORLD))
    assert (dist.get_rank(standby.pair), dist.get_world_size(standby.pair)) == (-1, 2)
    assert dist.get_global_rank(standby.pair, 0) == 1 and dist.get_group_rank(standby.pair, 2) == 1
    assert dist.get_process_group_ranks(standby.pair) == [1, 2], "the standby's -1 is answered, not listed"
    assert (dist.get_rank(standby.dp), dist.get_world_size(standby.dp)) == (0, 2)
    assert dist.get_process_group_ranks(standby.dp) == [0, 2]
    assert standby.mesh.get_local_rank("dp") == 0 and standby.mesh.get_local_rank("tp") == 0
    assert dist.get_backend() == "gloo" and dist.get_backend(standby.pair) == "gloo"


# -- object collectives ---------------------------------------------------------------------------


def _receivers(job: Standby) -> list[tuple[str, dict[str, Any]]]:
    """Ways a script names a source that is another rank than the standby."""
    return [
        ("world, src=0", {"src": 0}),
        ("world, src=3", {"src": 3}),
        ("new_group, src=1 (global)", {"src": 1, "group": job.pair}),
        ("new_group, group_src=1", {"group_src": 1, "group": job.pair}),
        ("mesh, group_src=1", {"group_src": 1, "group": job.dp}),
    ]


def test_broadcast_object_list_gives_a_receiver_what_it_passed(standby: Standby) -> None:
    """The standby is a receiver (its rank is -1): it keeps its own objects, as if it were the source,
    even one that cannot be pickled. Before the sandbox served object collectives it read a size
    nobody wrote and tried to allocate hundreds of petabytes."""
    for what, where in _receivers(standby):
        config, unpicklable = {"lr": 0.1, "layers": [4, 4]}, threading.Lock()
        objects: list[Any] = ["run-7", config, None, ("a", 2), unpicklable]
        dist.broadcast_object_list(objects, **where)
        assert objects == ["run-7", {"lr": 0.1, "layers": [4, 4]}, None, ("a", 2), unpicklable], what
        assert objects[1] is config and objects[4] is unpicklable, f"{what}: the very objects, as the source keeps"
    device_given = ["x" * 10_000]
    dist.broadcast_object_list(device_given, src=0, device=torch.device("cpu"))
    assert device_given == ["x" * 10_000]
    assert not sandbox._HELD, "every object held for torch's unpickling was handed back"


def test_broadcast_object_list_with_the_standby_as_source_keeps_its_objects(standby: Standby) -> None:
    config = {"lr": 0.1}
    objects: list[Any] = [config]
    dist.broadcast_object_list(objects, group_src=0, group=standby.dp)  # its place in its mesh line
    assert objects[0] is config


def test_scatter_object_list_gives_a_receiver_its_piece_or_what_it_passed(standby: Standby) -> None:
    for what, where in _receivers(standby):
        out: list[Any] = ["unset"]
        dist.scatter_object_list(out, None, **where)
        assert out == ["unset"], f"{what}: a receiver without the input list keeps what it passed"
        pieces = [{"shard": r} for r in range(WORLD)]
        dist.scatter_object_list(out, pieces, **where)
        assert out == [{"shard": 0}], f"{what}: with the input list, the piece of the rank it lays out as"
        assert out[0] is pieces[0]
    out = [None]
    dist.scatter_object_list(out, ["mine", "theirs"], group_src=0, group=standby.dp)  # the standby is the source
    assert out == ["mine"]
    assert not sandbox._HELD


def test_all_gather_object_and_gather_object_give_the_object_in_every_slot(standby: Standby) -> None:
    for group in (None, standby.pair, standby.dp):
        size = dist.get_world_size(group)
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, {"rank": -1}, group=group)
        assert gathered == [{"rank": -1}] * size
    dist.gather_object({"rank": -1}, None, dst=0)  # not the destination: nothing to fill, as torch
    at_dst: list[Any] = [None, None]
    dist.gather_object({"v": 5}, at_dst, group_dst=0, group=standby.dp)
    assert at_dst == [{"v": 5}, {"v": 5}]


def test_an_object_collective_the_sandbox_does_not_recognize_is_refused_not_read(
    standby: Standby, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose broadcast_object_list receives into another buffer than 2.13's: the sandbox says
    so in a sentence instead of leaving the receiver an uninitialized size."""
    real = c10d.broadcast

    def elsewhere(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return real(tensor.clone(), *args, **kwargs)

    monkeypatch.setattr(c10d, "broadcast", elsewhere)
    with pytest.raises(SandboxError, match=r"broadcast_object_list issued a broadcast that rlaunch's sandbox does not"):
        dist.broadcast_object_list([None], src=0)


# -- tensor collectives ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.13 renamed some: both names are called
@pytest.mark.parametrize("which", ["world", "new_group", "mesh"])
def test_every_tensor_collective_completes_with_this_ranks_data(standby: Standby, which: str) -> None:
    group = {"world": None, "new_group": standby.pair, "mesh": standby.dp}[which]
    n = dist.get_world_size(group)
    lay = 0  # the rank the sandbox lays out as: 0, or the standby's place in its mesh line (0 here)
    src = {"group_src": 1, "group": group}  # another rank than the standby's
    mine = torch.tensor([1.0, 2.0, 3.0])

    for reduce in (dist.all_reduce, lambda t, **kw: dist.reduce(t, group_dst=0, **kw)):
        t = mine.clone()
        reduce(t, group=group)
        assert torch.equal(t, mine), "a reduction over copies of this rank's data is its data"
    t = mine.clone()
    dist.broadcast(t, **src)
    assert torch.equal(t, mine), "a receiver keeps its data, as if it were the source"
    work = dist.all_reduce(t, group=group, async_op=True)
    assert work is not None and work.is_completed() and work.wait()

    parts = [torch.zeros(3) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    assert all(torch.equal(p, mine) for p in parts)
    flat = torch.zeros(3 * n)
    dist.all_gather_into_tensor(flat, mine, group=group)
    assert torch.equal(flat, mine.repeat(n))
    piece = torch.zeros(2)
    dist.reduce_scatter_tensor(piece, torch.arange(2.0 * n), group=group)
    assert torch.equal(piece, torch.arange(2.0 * n)[2 * lay : 2 * lay + 2])
    flat.zero_()
    dist.all_gather_single(flat, mine, group=group)
    assert torch.equal(flat, mine.repeat(n))
    piece.zero_()
    dist.reduce_scatter_single(piece, torch.arange(2.0 * n), group=group)
    assert torch.equal(piece, torch.arange(2.0 * n)[2 * lay : 2 * lay + 2])
    listed = torch.zeros(2)
    dist.reduce_scatter(listed, [torch.full((2,), float(r)) for r in range(n)], group=group)
    assert torch.equal(listed, torch.full((2,), float(lay)))

    mixed = torch.full((2 * n,), -1.0)
    dist.all_to_all_single(mixed, torch.arange(2.0 * n), group=group)
    assert torch.equal(mixed, torch.arange(2.0 * n))
    uneven = torch.full((n + 1,), -1.0)  # this rank sends 1 to each, receives 2 from the first
    dist.all_to_all_single(uneven, torch.arange(float(n)), [2] + [1] * (n - 1), [1] * n, group=group)
    assert torch.equal(uneven, torch.cat([torch.arange(float(n)), torch.zeros(1)]))
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(r)) for r in range(n)], group=group)
    assert [o[0].item() for o in outs] == list(range(n))

    slots = [torch.zeros(3) for _ in range(n)]
    if dist.get_rank(group) == 0:
        dist.gather(mine, slots, group_dst=0, group=group)
        assert all(torch.equal(s, mine) for s in slots)
    dist.gather(mine, None, **{"group_dst": 1, "group": group})
    received = torch.full((2,), 9.0)
    dist.scatter(received, None, **src)
    assert torch.equal(received, torch.full((2,), 9.0)), "a receiver keeps its output"

    dist.barrier(group=group)
    dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
    dist.all_reduce_coalesced([mine.clone(), torch.ones(2)], group=group)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_functional_collectives_resolve_the_runtimes_groups(standby: Standby) -> None:
    mine = torch.tensor([1.0, 2.0])
    for group in (standby.rt.group, standby.pair, standby.dp):
        n = group.size()
        assert torch.equal(funcol.all_reduce(mine, "sum", group), mine)
        assert torch.equal(funcol.all_gather_tensor(mine, 0, group), mine.repeat(n))
        assert torch.equal(funcol.broadcast(mine, group.members[1], group), mine)


# -- point to point -------------------------------------------------------------------------------

P2P: dict[str, Callable[[torch.Tensor], Any]] = {
    "send": lambda t: dist.send(t, dst=1),
    "recv": lambda t: dist.recv(t, src=1),
    "recv from any rank": lambda t: dist.recv(t),
    "isend": lambda t: dist.isend(t, dst=1),
    "irecv": lambda t: dist.irecv(t, src=1),
    "batch_isend_irecv": lambda t: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1), dist.P2POp(dist.irecv, t, 2)]),
    "send_object_list": lambda t: dist.send_object_list(["x"], dst=1),
    "recv_object_list": lambda t: dist.recv_object_list([None], src=1),
}


@pytest.mark.parametrize("call", sorted(P2P))
def test_point_to_point_is_refused_with_a_sentence(standby: Standby, call: str) -> None:
    with pytest.raises(SandboxError, match=r"cannot run in a standby's sandbox: the standby holds no rank yet") as info:
        P2P[call](torch.ones(2))
    assert "Skip the call while rt.standby is true" in str(info.value)


# -- the group around the communicator ------------------------------------------------------------


class _FailingBarrier:
    def monitored_barrier(self, timeout: datetime.timedelta, wait_all_ranks: bool = False) -> None:
        raise RuntimeError("Rank 1 failed to pass monitoredBarrier in 1000 ms")


def test_a_failed_monitored_barrier_fails_a_guarded_group_and_is_raised_where_unguarded() -> None:
    guarded = SwitchableGroup("world", [0, 1], 0, _FailingBarrier(), 1)
    guarded.monitored_barrier(datetime.timedelta(seconds=1))
    assert guarded.failed == "Rank 1 failed to pass monitoredBarrier in 1000 ms", "the step goes to recovery"
    plain = SwitchableGroup("world", [0, 1], 0, _FailingBarrier(), 1, guarded=False)
    with pytest.raises(RuntimeError, match="failed to pass monitoredBarrier"):
        plain.monitored_barrier(datetime.timedelta(seconds=1))


def test_a_joiner_holds_the_groups_without_its_rank_as_an_active_non_member(standby: Standby) -> None:
    """Joining as rank 3: the world group gets its communicator; the group of ranks 1 and 2 is no
    longer known to torch and answers nothing made up."""
    rt = standby.rt
    rt._s.rank = 3
    rt._joining.rebind_mesh(3)
    rt._s.standby = False
    # communicators of rank 3's groups, as phase 1 builds them (sandboxes stand in for them here)
    comms: dict[str, Any] = {
        g.label: SandboxComm(g.members.index(3), len(g.members)) for g in rt._s.groups if 3 in g.members
    }
    assert sorted(comms) == ["mesh.dp.1", "mesh.tp.1", "world"]
    rt._joining.leave_sandbox(comms, generation=1)
    assert rt.group.comm is comms["world"] and rt.group.rank() == 3
    assert dist.get_rank(standby.mesh["dp"].get_group()) == 1 and standby.mesh.get_local_rank("tp") == 1
    assert standby.pair.comm is None and standby.pair.rank() == -1
    assert standby.pair.registered_name is None
    with pytest.raises(ValueError, match="is not registered"):
        dist.get_rank(standby.pair)


def test_torchs_own_new_group_in_a_sandbox_serves_lightnings_barrier_and_refuses_moves_while_it_lives(
    standby: Standby,
) -> None:
    """Lightning wraps prepare_data in _InfiniteBarrier: torch's new_group, the group's
    monitored_barrier, destroy_process_group. In a sandbox torch would give a non-member (an int)
    and the barrier would fail; the group holds rank 0's place instead, serves collectives, and
    counts as a group the runtime did not make until it is destroyed."""
    from lightning_fabric.utilities.distributed import _InfiniteBarrier

    from rlaunch.runtime import registry

    with _InfiniteBarrier() as barrier:
        group = barrier.group
        assert isinstance(group, ProcessGroup) and dist.get_rank(group) == 0 and dist.get_world_size(group) == WORLD
        assert len(registry.foreign_groups()) == 1, "a move is refused while the group lives, as on active ranks"
        t = torch.arange(3.0)
        dist.all_reduce(t, group=group)
        objects: list[Any] = ["mine"]
        dist.broadcast_object_list(objects, src=2, group=group)
        assert t.tolist() == [0.0, 1.0, 2.0] and objects == ["mine"]
    assert registry.foreign_groups() == [], "destroyed with destroy_process_group"
    assert dist.new_group([1, 2]) == c10d.GroupMember.NON_GROUP_MEMBER, "rank 0 is not in it"
    with pytest.raises(ValueError, match="not all in 0..3"):
        dist.new_group([0, 4])
    with pytest.raises(ValueError, match="contain one twice"):
        dist.new_group([0, 0, 1])


def test_torchs_group_counter_moves_in_a_sandbox_as_on_every_active_rank(standby: Standby) -> None:
    """torch names each group from a counter that every rank moves at every new_group, member or not; the
    name is where the members meet in the store. A joiner whose sandbox left it behind would make its
    next group under the name of one its peers made and destroyed before, and wait there."""
    before = c10d._world.group_count
    group = dist.new_group([0, 1])
    assert group.label == f"torch.new_group.{before}" and c10d._world.group_count == before + 1
    dist.new_group([2, 3])
    assert c10d._world.group_count == before + 2, "a non-member moves it too"
    assert dist.new_group([2, 3], use_local_synchronization=True) is None, "as torch, which names it by a hash"
    assert c10d._world.group_count == before + 2
    dist.destroy_process_group(group)


def test_a_group_made_with_torch_in_the_sandbox_and_kept_past_the_join_raises_a_sentence(standby: Standby) -> None:
    from rlaunch.runtime import sandboxgroups

    kept = dist.new_group(backend="gloo")
    sandboxgroups.leave()
    assert dist.new_group is c10d.new_group and dist.new_group.__module__ == c10d.__name__, "torch's is back"
    with pytest.raises(SandboxError, match="was made with torch.distributed.new_group while this process was a"):
        dist.all_reduce(torch.ones(2), group=kept)
    with pytest.raises(SandboxError, match="Destroy such a group before training steps begin"):
        dist.monitored_barrier(group=kept)


def test_a_failed_groups_object_collectives_give_the_callers_own_objects_not_garbage() -> None:
    """After a fault, a group's collectives return at once, un-issued, until the step's recovery.
    torch's object collectives would then read sizes and bytes no peer wrote (an EOFError, or an
    allocation of petabytes); they get the caller's own objects instead, as in a sandbox."""
    from rlaunch.runtime import registry

    assert not dist.is_initialized()
    group = SwitchableGroup("failed", [0, 1], 0, SandboxComm(0, 2), 1)
    registry.register(group, HashStore(), {0: 0, 1: 1})
    try:
        group.abandon("a peer is gone")
        received: list[Any] = ["rank 0's own", {"lr": 0.1}]
        dist.broadcast_object_list(received, src=1, group=group)  # rank 1 is the source: rank 0 receives
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, "mine", group=group)
        piece: list[Any] = [None]
        dist.scatter_object_list(piece, ["for 0", "for 1"], src=1, group=group)
        tensor = torch.arange(4.0)
        dist.broadcast(tensor, src=1, group=group)
    finally:
        registry.unregister(group)
    assert received == ["rank 0's own", {"lr": 0.1}] and gathered == ["mine", "mine"] and piece == ["for 0"]
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0], "a plain collective returns its input as it is"
