"""Re-laying a joiner's sharded model out for the mesh coordinate it takes, in place.

A standby builds its model in a sandbox before it knows which rank it will take, laid out as mesh
rank 0 (see :mod:`rlaunch.runtime.mesh`). When a sharded dimension does not divide evenly (GPT-2's
50,257-row vocabulary, a regression head ``nn.Linear(128, 1)``), FSDP2 gives each rank
``ceil(rows / world)`` rows as ``torch.chunk`` does, so the last ranks hold fewer rows or none, and
the joiner's local shards, their optimizer state and FSDP's cached sizes are rank 0's, not those of
the rank it takes: the transfer would refuse them. FSDP2 keeps each shard in a padded storage of
``ceil(rows / world)`` rows, the same size on every rank, whose first rows are the local view. So
:func:`to_coordinate`, called once the mesh has the new coordinate and before the state arrives,
narrows that view to the new rank's rows and recomputes what FSDP derived from the rank (its sizes,
strides and cached mesh ranks) as ``fully_shard`` computes them; a DTensor outside FSDP (tensor
parallel) gets a local tensor of the new coordinate's shape; the gradients and optimizer state of
each re-laid parameter follow. Parameter objects stay the same objects, so the module and the
optimizer's ``param_groups`` keep holding one and the same parameter; values are not kept, since
the transfer overwrites every one. What cannot be re-laid out this way is named by
:func:`refusal`: such a model trains as usual and only cannot move live.

This module is pure bookkeeping over torch's objects; it imports DTensor and FSDP only when a
tracked model uses them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rlaunch.errors import RlaunchError


class ReshardError(RlaunchError):
    """A joiner's model holds a shard that cannot be laid out for the rank it takes."""


def refusal(tracked: dict[str, Any]) -> str:
    """A sentence naming the first tracked shard a joiner could not re-lay out ("" if none).

    It depends on the model's structure only, so every rank answers alike at any step. Shards
    whose shape is the same at every coordinate never need re-laying; among the others, FSDP2's
    own shards and DTensors outside FSDP can be re-laid, but not FSDP over a tensor-parallel
    shard whose own shape differs by coordinate (FSDP would have to reallocate its padded
    storage and all-gather buffers), a shard held in a tensor subclass (Float8 and the like), nor
    a DTensor outside FSDP on a GPU (autograd's device threads keep DTensor's decisions, taken in
    the sandbox at rank 0's coordinate, where the joiner cannot clear them).
    """
    if not _dtensors_loaded():
        return ""
    fsdp = _fsdp_params(tracked)
    for name, t in _sharded(tracked):
        fp = fsdp.get(id(t))
        what, fix = _fsdp_refusal(fp) if fp is not None else _local_refusal(t)
        if what:
            return (
                f"{name} of global shape {tuple(t.shape)} {what}; a standby lays its model out as rank 0 before it "
                "knows its rank and cannot re-lay such a shard out for another rank, so this model trains on but "
                f"cannot move live (drains and live replacements are refused). {fix}"
            )
    return ""


def to_coordinate(tracked: dict[str, Any]) -> list[str]:
    """(joiner) Lay every tracked shard out for this rank's mesh coordinate; return the re-laid names.

    Called after the mesh was rebound to the new rank and before the state is received. Raises
    :class:`ReshardError` (with :func:`refusal`'s sentence) for a shard that cannot be re-laid.
    """
    if not _dtensors_loaded():
        return []
    from torch.distributed.tensor import DTensor

    why = refusal(tracked)
    if why:
        raise ReshardError(f"This joiner cannot lay out its model for its rank: {why}.")
    fsdp = _fsdp_params(tracked)
    for fp in fsdp.values():
        _check_between_steps(fp)
    for fp in fsdp.values():
        _refresh_mesh_ranks(fp)
    old: dict[int, tuple[int, ...]] = {}  # id(tensor) -> its local shape before, for the optimizer state
    moved: list[str] = []
    with torch.no_grad():
        for name, t in _sharded(tracked):
            if id(t) in old:  # tied or listed twice
                continue
            assert isinstance(t, DTensor)
            before = tuple(t._local_tensor.shape)
            old[id(t)] = before
            fp = fsdp.get(id(t))
            if fp is not None:
                _fsdp_to_coordinate(fp)
            elif _uneven(t.shape, t.device_mesh, t.placements):
                t._local_tensor = _new_local(t._local_tensor, _local_shape(t))
            if tuple(t._local_tensor.shape) != before:
                moved.append(name)
                _grad_to_coordinate(t)
        for obj in tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                for p in (p for g in obj.param_groups for p in g["params"]):
                    if id(p) in old and tuple(p._local_tensor.shape) != old[id(p)]:
                        _state_to_coordinate(obj.state.get(p, {}), p, old[id(p)])
    if moved:
        _forget_sharding_decisions()
    return moved


# -- what there is ----------------------------------------------------------------------------


def _dtensors_loaded() -> bool:
    """Whether DTensor was imported at all: a model without one has nothing to re-lay out."""
    return "torch.distributed.tensor" in sys.modules


def _is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _sharded(tracked: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, DTensor) of every parameter and buffer of the tracked modules that is a DTensor."""
    for name, obj in tracked.items():
        if isinstance(obj, nn.Module):
            for key, t in (*obj.named_parameters(), *obj.named_buffers()):
                if _is_dtensor(t):
                    yield f"{name}.{key}", t


def _fsdp_params(tracked: dict[str, Any]) -> dict[int, Any]:
    """FSDP2's ``FSDPParam`` of every parameter of the tracked modules, by id of the parameter.

    Keyed by the sharded parameter and, mid-step, by the unsharded one the module then holds, so
    that :func:`refusal` answers alike whenever it is asked.
    """
    if "torch.distributed.fsdp" not in sys.modules:
        return {}
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for obj in tracked.values():
        if not isinstance(obj, nn.Module):
            continue
        for module in obj.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        found[id(fp.sharded_param)] = fp
                        for attr in ("_unsharded_param", "_sharded_post_forward_param"):
                            if getattr(fp, attr, None) is not None:
                                found[id(getattr(fp, attr))] = fp
    return found


# -- what cannot be re-laid -------------------------------------------------------------------


def _fsdp_refusal(fp: Any) -> tuple[str, str]:
    """What makes FSDP's shard ``fp`` impossible to re-lay, and the fix (("", "") if nothing does)."""
    if fp.is_dtensor and fp._unsharded_dtensor_spec is not None:
        spec = fp._unsharded_dtensor_spec
        ways = _uneven(spec.shape, spec.mesh, spec.placements)
        if ways:
            return (
                f"is sharded by FSDP over a tensor-parallel shard whose shape differs by coordinate (its dimension "
                f"{ways[0]} is split {ways[1]} ways unevenly)",
                f"Make its dimension {ways[0]} a multiple of {ways[1]} to let it move.",
            )
    if type(fp._sharded_local_tensor) is not torch.Tensor and _fsdp_uneven(fp):
        dim, ways = fp.fsdp_placement.dim, fp.mesh_info.shard_mesh_size
        return (
            f"is held in a {type(fp._sharded_local_tensor).__name__} and sharded by FSDP {ways} ways unevenly",
            f"Make its dimension {dim} a multiple of {ways} to let it move.",
        )
    return "", ""


def _local_refusal(t: Any) -> tuple[str, str]:
    """What makes the DTensor ``t`` outside FSDP impossible to re-lay, and the fix (("", "") if nothing does)."""
    ways = _uneven(t.shape, t.device_mesh, t.placements)
    if ways is None:
        return "", ""
    fix = f"Make its dimension {ways[0]} a multiple of {ways[1]} to let it move."
    if type(t._local_tensor) is not torch.Tensor:
        return f"is held in a {type(t._local_tensor).__name__} and sharded {ways[1]} ways unevenly", fix
    if t.device.type != "cpu":
        return f"is a DTensor on {t.device.type} outside FSDP, sharded {ways[1]} ways unevenly", fix
    return "", ""


def _uneven(shape: torch.Size, mesh: Any, placements: Any) -> tuple[int, int] | None:
    """(tensor dimension, ways) of the first dimension ``placements`` split unevenly over ``mesh``, or None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ways: dict[int, int] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            ways[placement.dim] = ways.get(placement.dim, 1) * mesh.size(mesh_dim)
    for dim, n in sorted(ways.items()):
        if shape[dim] % n:
            return dim, n
    return None


def _fsdp_uneven(fp: Any) -> bool:
    dim = fp.fsdp_placement.dim
    return bool(fp._orig_size[dim] % getattr(fp.mesh_info, "shard_mesh_size", 1))


# -- re-laying --------------------------------------------------------------------------------


def _check_between_steps(fp: Any) -> None:
    """Between steps FSDP holds every parameter sharded; the module's parameters are then its shards."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if fp.sharded_state != ShardedState.SHARDED:
        raise ReshardError(
            f"FSDP's parameter {fp._param_fqn or fp._module_info.param_name} is {fp.sharded_state.name} where the "
            "joiner lays its model out, not SHARDED; shards are re-laid out only between steps."
        )


def _refresh_mesh_ranks(fp: Any) -> None:
    """FSDP caches this rank's place in its groups when ``fully_shard`` runs: take them again."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    for info in (fp.mesh_info, fp.post_forward_mesh_info):
        if isinstance(info, FSDPMeshInfo):
            info.shard_mesh_rank = info.shard_process_group.rank()
        if isinstance(info, DDPMeshInfo):
            info.replicate_mesh_rank = info.replicate_process_group.rank()


def _fsdp_to_coordinate(fp: Any) -> None:
    """Narrow FSDP's view of its padded storage to this rank's rows, as ``fully_shard`` lays it out."""
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        _chunk_with_empty,
        _get_dim_chunked_size,
    )

    if fp.is_dtensor:
        tp_shape = _local_shape_of(fp._unsharded_dtensor_spec)
        if tp_shape != tuple(fp._orig_size):
            raise ReshardError(
                f"FSDP's parameter {fp._param_fqn} is a tensor-parallel shard of shape {tuple(fp._orig_size)} here "
                f"but {tp_shape} at this rank's coordinate, so this joiner cannot re-lay it out; make its "
                "tensor-parallel dimension divide evenly to let it move."
            )
    info = fp.mesh_info
    rank, world = (info.shard_mesh_rank, info.shard_mesh_size) if isinstance(info, FSDPMeshInfo) else (0, 1)
    dim = fp.fsdp_placement.dim
    shape = fp._orig_size
    chunks = _chunk_with_empty(torch.empty(shape, device="meta"), world, dim=dim)
    size = _get_dim_chunked_size(chunks[rank], shape, dim=dim)
    if fp.post_forward_mesh_info is not None:
        fp._init_sharded_post_forward_param_metadata(torch.empty(shape, device="meta"))
    if size == fp.sharded_size or fp._sharded_param_data.is_meta:
        return  # an even shard: the same shape at every coordinate
    fp.sharded_size = size
    fp.contiguous_sharded_stride = make_contiguous_strides_for(size)
    padded = fp._sharded_param_data.view(fp.padded_sharded_param_size)
    rows = size[dim]
    padded.narrow(dim, rows, padded.size(dim) - rows).zero_()  # FSDP's padding holds zeros
    fp.sharded_param._local_tensor = padded.narrow(dim, 0, rows)


def _local_shape(t: Any) -> tuple[int, ...]:
    return _local_shape_of(t._spec)


def _local_shape_of(spec: Any) -> tuple[int, ...]:
    """The local shape of a DTensor of ``spec`` at this rank's coordinate (DTensor's own rule)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return tuple(int(s) for s in shape)


def _new_local(old: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of ``shape`` like ``old`` (``old`` itself when its shape is already right)."""
    if tuple(old.shape) == shape:
        return old
    return torch.zeros(shape, dtype=old.dtype, device=old.device).requires_grad_(old.requires_grad)


def _forget_sharding_decisions() -> None:
    """DTensor caches, by mesh and global shapes, decisions it took at this rank's coordinate: the
    local shape a ``view`` gets, how a redistribution unpads. The sandbox took them at rank 0's."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    propagator = DTensor._op_dispatcher.sharding_propagator
    # a new object, not cache_clear(): the cache is per thread (autograd's device threads have theirs)
    propagator.propagate_op_sharding = LocalLRUCache(propagator.propagate_op_sharding_non_cached)
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    _redistribute._gen_transform_infos.cache_clear()


def _grad_to_coordinate(p: Any) -> None:
    """A gradient kept between steps (``zero_grad(set_to_none=False)``) takes the new shape, as zeros.

    Gradients do not travel with the state (the step that made them is over), even shards' neither.
    """
    grad = p.grad
    if grad is None:
        return
    if _is_dtensor(grad):
        grad._local_tensor = _new_local(grad._local_tensor, tuple(p._local_tensor.shape))
    else:
        p.grad = None


def _state_to_coordinate(state: dict[str, Any], p: Any, before: tuple[int, ...]) -> None:
    """Optimizer state of the re-laid ``p`` in this rank's shapes (its values arrive with the transfer).

    A DTensor laid out as ``p`` takes ``p``'s new local shape, another DTensor its own; a plain
    tensor shaped as ``p``'s old shard takes the new one. Any other plain tensor beyond a scalar
    is dropped: the transfer creates it in the sender's shape.
    """
    shape = tuple(p._local_tensor.shape)
    for key, value in list(state.items()):
        if not isinstance(value, torch.Tensor):
            continue
        if _is_dtensor(value):
            spec = value._spec
            same = spec.mesh == p.device_mesh and spec.placements == p.placements and value.shape == p.shape
            value._local_tensor = _new_local(value._local_tensor, shape if same else _local_shape(value))
        elif tuple(value.shape) == before:
            state[key] = _new_local(value, shape)
        elif value.dim() > 0:
            del state[key]
