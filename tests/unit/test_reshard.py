"""A joiner laid out as rank 0 re-lays its uneven shards out for the rank it takes, in one process.

A standby builds its model on sandbox groups as mesh rank 0 (see rlaunch.runtime.mesh); here a
second model is built on sandbox groups as the target rank from the start: after
``reshard.to_coordinate`` the joiner's FSDP2 bookkeeping, local shards and optimizer state must
match it, the parameter objects must be the ones the module and the optimizer held, the state of
the target rank must be accepted by the transfer's checks, and a step on both must give the same
bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as torch_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rlaunch.runtime import reshard, shards, transfer
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.registry import register, unregister

pytestmark = pytest.mark.timeout(120)

VOCAB = 50257  # GPT-2's vocabulary: 25,129 rows on shard 0 of 2, 25,128 on shard 1


class Job:
    """One process playing a rank of a job through sandbox groups, as a standby's sandbox does."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.groups: list[SwitchableGroup] = []
        self.meshes: list[RuntimeMesh] = []
        self.default = SwitchableGroup("world", range(world), -1, SandboxComm(0, world), 0)
        register(self.default, None, {i: i for i in range(world)}, default=True)
        self.groups.append(self.default)

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...], rank: int) -> DeviceMesh:
        """A mesh laid out as ``rank`` (as Runtime.device_mesh builds a standby's)."""
        mesh = RuntimeMesh(shape, names, rank)
        groups = []
        for name, members in mesh.lines(rank):
            comm = SandboxComm(members.index(rank), len(members))
            group = SwitchableGroup(f"{name}.{len(self.meshes)}", members, rank, comm, 0)
            ranks = {g: i for i, g in enumerate(members)}
            ranks[-1] = members.index(rank)
            register(group, None, ranks)
            groups.append(group)
        self.groups += groups
        self.meshes.append(mesh)
        mesh.show_rank_to_torch()
        return mesh.build("cpu", groups, [str(g.registered_name) for g in groups])

    def laid_out(self) -> None:
        """The model is built: torch's mesh module sees the global rank again (as after a rebind)."""
        mesh = self.meshes[-1]
        if mesh._global_rank is not None:
            torch_mesh.get_rank = mesh._global_rank  # type: ignore[attr-defined]
            mesh._global_rank = None

    def join(self, mesh: RuntimeMesh, rank: int) -> None:
        """What Joining.join does to a standby's mesh before the state arrives (groups over sandboxes)."""
        for _, group, _ in mesh.rebind(rank):
            register(group, None, {g: i for i, g in enumerate(group.members)})
            group.comm = SandboxComm(group.group_rank, len(group.members))

    def close(self) -> None:
        for mesh in self.meshes:
            if mesh._global_rank is not None:
                torch_mesh.get_rank = mesh._global_rank  # type: ignore[attr-defined]
        for group in self.groups:
            unregister(group)


@pytest.fixture(autouse=True)
def meshes_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Meshes of two roots never compare equal, as in two processes.

    Here one process plays the target rank and the joiner, and torch compares meshes by their
    layout, not their rank: DTensor's caches (sharding decisions, local shapes) would hand one
    model's decisions, taken at its coordinate, to the other.
    """
    eq, key = DeviceMesh.__eq__, DeviceMesh._hash_key

    def same(a: DeviceMesh, b: object) -> bool:
        return bool(eq(a, b)) and isinstance(b, DeviceMesh) and a._get_root_mesh() is b._get_root_mesh()

    monkeypatch.setattr(DeviceMesh, "__eq__", same)
    monkeypatch.setattr(DeviceMesh, "_hash_key", lambda m: (*key(m), id(m._get_root_mesh())))


@pytest.fixture
def job() -> Iterator[Callable[[int], Job]]:
    made: list[Job] = []

    def make(world: int) -> Job:
        made.append(Job(world))
        return made[-1]

    yield make
    for j in made:
        j.close()
    forget_sharding_caches()
    assert not dist.is_initialized(), "the test left a default group registered"


def uneven_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 4), nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1))


def shard(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def forget_sharding_caches() -> None:
    """DTensor's caches keep every mesh they saw alive: forget the ones of the last test."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (6, 3), generator=g)
    opt.zero_grad(set_to_none=True)
    model(x).sin().pow(2).mean().backward()
    opt.step()


def fsdp_layout(model: nn.Module) -> list[Any]:
    """What FSDP derived from the rank, per parameter."""
    out: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    out.append((
                        tuple(fp.sharded_size), fp.contiguous_sharded_stride, tuple(fp.padded_sharded_param_size),
                        tuple(fp._sharded_local_tensor.shape), fp.mesh_info.shard_mesh_rank,
                        getattr(fp.mesh_info, "replicate_mesh_rank", None), fp._sharded_param_data.numel(),
                    ))  # fmt: skip
    return out


def copy_state(src: dict[str, Any], dst: dict[str, Any]) -> None:
    """The transfer without the wire: dst's live tensors, checked against src's header entries."""
    pairs, kinds, _ = transfer.tensors_of(src)
    header = {"objects": kinds, "tensors": [transfer.describe(n, t) for n, t in pairs]}
    targets = transfer.live_targets(dst, header)
    with torch.no_grad():
        for target, (_, t) in zip(targets, pairs, strict=True):
            target.copy_(shards.local(t))


def locals_of(tracked: dict[str, Any]) -> list[torch.Tensor]:
    return [shards.local(t).clone() for _, t in transfer.tensors_of(tracked)[0]]


@pytest.mark.parametrize(
    ("shape", "names", "rank"),
    [((2,), ("shard",), 1), ((2, 2), ("replicate", "shard"), 3), ((2, 2), ("replicate", "shard"), 2)],
    ids=["fsdp-rank1", "hsdp-rank3", "hsdp-rank2"],
)
def test_a_joiner_laid_out_as_rank_0_takes_another_ranks_uneven_fsdp_shards(
    job: Callable[[int], Job], shape: tuple[int, ...], names: tuple[str, ...], rank: int
) -> None:
    j = job(4 if len(shape) == 2 else 2)
    target = shard(uneven_model(), j.mesh(shape, names, rank))  # laid out as `rank` from the start
    j.laid_out()
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    step(target, target_opt, seed=1)

    model = shard(uneven_model(), j.mesh(shape, names, 0))  # a standby's sandbox
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, seed=2)  # sandbox steps: optimizer state in rank 0's shapes
    params = list(model.parameters())
    storages = [p.to_local().untyped_storage().data_ptr() for p in params]
    tracked = {"model": model, "optimizer": opt}
    assert shards.move_refusal(tracked) == ""

    j.join(j.meshes[-1], rank)
    moved = reshard.to_coordinate(tracked)

    shard_coordinate = rank % 2
    every = ["model.0.weight", "model.1.bias", "model.1.weight", "model.3.bias", "model.3.weight"]
    assert sorted(moved) == (every if shard_coordinate else [])  # an odd row count each
    assert fsdp_layout(model) == fsdp_layout(target)
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True)), "the optimizer's own"
    # the local shard is still a view of FSDP's padded storage (which every rank sizes alike)
    assert [p.to_local().untyped_storage().data_ptr() for p in params] == storages
    for p, q in zip(params, target.parameters(), strict=True):
        assert isinstance(p, DTensor) and shards.describe(p) == shards.describe(q)
        assert [tuple(shards.local(v).shape) for v in opt.state[p].values()] == [
            tuple(shards.local(v).shape) for v in target_opt.state[q].values()
        ]

    copy_state({"model": target, "optimizer": target_opt}, tracked)  # the transfer's checks accept it
    step(model, opt, seed=3)
    step(target, target_opt, seed=3)
    got, want = locals_of(tracked), locals_of({"model": target, "optimizer": target_opt})
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_joiner_without_optimizer_state_gets_it_created_in_its_ranks_shapes(job: Callable[[int], Job]) -> None:
    j = job(2)
    target = shard(uneven_model(), j.mesh((2,), ("shard",), 1))
    j.laid_out()
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    step(target, target_opt, seed=1)
    model = shard(uneven_model(), j.mesh((2,), ("shard",), 0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no sandbox step (--sandbox-steps 0)
    j.join(j.meshes[-1], 1)
    tracked = {"model": model, "optimizer": opt}
    assert "model.3.weight" in reshard.to_coordinate(tracked)
    copy_state({"model": target, "optimizer": target_opt}, tracked)
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        assert [tuple(shards.local(v).shape) for v in opt.state[p].values()] == [
            tuple(shards.local(v).shape) for v in target_opt.state[q].values()
        ]


def tensor_parallel_model(out: int, mesh: DeviceMesh, rowwise: bool = True) -> nn.Module:
    """Column then row parallel; or, for an odd width, column parallel alone (torch's
    ``RowwiseParallel`` takes its input's global width as the local one times the ways)."""
    torch.manual_seed(0)
    if not rowwise:
        return parallelize_module(nn.Sequential(nn.Linear(8, out), nn.ReLU()), mesh, {"0": ColwiseParallel()})
    model = nn.Sequential(nn.Linear(8, out), nn.ReLU(), nn.Linear(out, 3))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def tp_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)  # gradients kept between steps: they must follow the layout too
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).pow(2).mean().backward()
    opt.step()


def test_tensor_parallel_dtensors_with_an_odd_width_take_the_new_coordinates_shapes(job: Callable[[int], Job]) -> None:
    j = job(2)
    target = tensor_parallel_model(5, j.mesh((2,), ("tp",), 1), rowwise=False)  # 5 columns over 2: 3 and 2
    j.laid_out()
    model = tensor_parallel_model(5, j.mesh((2,), ("tp",), 0), rowwise=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tp_step(model, opt)
    params = list(model.parameters())
    tracked = {"model": model, "optimizer": opt}
    assert shards.move_refusal(tracked) == ""
    j.join(j.meshes[-1], 1)
    assert sorted(reshard.to_coordinate(tracked)) == ["model.0.bias", "model.0.weight"]
    for p, q in zip(params, target.parameters(), strict=True):
        assert p.to_local().shape == q.to_local().shape and shards.describe(p) == shards.describe(q)
        assert p.grad is not None and p.grad.to_local().shape == q.to_local().shape
        assert all(shards.local(v).shape == q.to_local().shape for k, v in opt.state[p].items() if k != "step")
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True))
    tp_step(model, opt)  # trains at its new coordinate


def test_fsdp_over_an_uneven_tensor_parallel_shard_trains_but_cannot_move(job: Callable[[int], Job]) -> None:
    j = job(4)
    mesh = j.mesh((2, 2), ("dp", "tp"), 0)
    model = shard(tensor_parallel_model(5, mesh["tp"], rowwise=False), mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracked = {"model": model, "optimizer": opt}
    mid_forward: list[str] = []  # asked while FSDP holds the layer unsharded: the same answer
    model[0].register_forward_pre_hook(lambda *_: mid_forward.append(shards.move_refusal(tracked)))
    tp_step(model, opt)  # it trains
    why = shards.move_refusal(tracked)
    assert mid_forward == [why]
    assert why.startswith("model.0.weight of global shape (5, 8) is sharded by FSDP over a tensor-parallel"), why
    assert "cannot move live (drains and live replacements are refused). Make its dimension 0 a multiple of 2" in why
    j.join(j.meshes[-1], 1)
    with pytest.raises(reshard.ReshardError, match="cannot lay out its model for its rank: model.0.weight"):
        reshard.to_coordinate(tracked)


def test_fsdp_over_an_even_tensor_parallel_shard_moves_along_its_uneven_data_parallel_rows(
    job: Callable[[int], Job],
) -> None:
    j = job(4)
    mesh = j.mesh((2, 2), ("dp", "tp"), 2)  # 6 columns: 3 per tp coordinate, then 2 and 1 rows over dp
    target = shard(tensor_parallel_model(6, mesh["tp"]), mesh["dp"])
    j.laid_out()
    mesh = j.mesh((2, 2), ("dp", "tp"), 0)
    model = shard(tensor_parallel_model(6, mesh["tp"]), mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tp_step(model, opt)
    tracked = {"model": model, "optimizer": opt}
    assert shards.move_refusal(tracked) == ""
    j.join(j.meshes[-1], 2)
    assert "model.0.weight" in reshard.to_coordinate(tracked)
    assert fsdp_layout(model) == fsdp_layout(target)
    tp_step(model, opt)


def test_an_uneven_dtensor_outside_fsdp_off_the_cpu_cannot_move(job: Callable[[int], Job]) -> None:
    from torch.distributed.tensor import Shard

    j = job(2)
    mesh = j.mesh((2,), ("tp",), 0)
    head = nn.Linear(8, 5, device="meta")  # as on a GPU: its autograd thread keeps rank 0's decisions
    weight = DTensor.from_local(torch.empty(3, 8, device="meta"), mesh, [Shard(0)], shape=(5, 8), stride=(8, 1))
    head.weight = nn.Parameter(weight)
    why = shards.move_refusal({"model": head})
    assert why.startswith("model.weight of global shape (5, 8) is a DTensor on meta outside FSDP, sharded 2 ways"), why
    even = nn.Linear(8, 4, device="meta")
    even.weight = nn.Parameter(
        DTensor.from_local(torch.empty(2, 8, device="meta"), mesh, [Shard(0)], shape=(4, 8), stride=(8, 1))
    )
    assert shards.move_refusal({"model": even}) == "", "an even shard needs no re-laying"


def test_a_model_without_dtensors_has_nothing_to_re_lay() -> None:
    tracked = {"model": nn.Linear(3, 1), "optimizer": torch.optim.SGD(nn.Linear(3, 1).parameters())}
    assert reshard.to_coordinate(tracked) == [] and shards.move_refusal(tracked) == ""
