"""Shards of DTensors on the move: their local data, what identifies them, who holds a replica.

Two FSDP shards of one parameter have the same name, shape and dtype on every rank, so a
transfer header that names only tensors cannot tell a right source from a wrong one. Each
DTensor therefore travels with a :func:`describe` record: its placements, global shape, the
global offset of the local shard, and the sender's mesh coordinate on every dimension the
tensor is sharded on. The receiver compares it with its own live tensor (:func:`mismatch`)
before a single byte is received, and refuses a different shard with a sentence.

A rank's *replicas* are the ranks with the same coordinate on every mesh dimension that is not
replicated: the dimensions on which some tracked DTensor is sharded (FSDP's ``shard``, tensor
parallel's ``tp``). Under HSDP the ``replicate`` dimension holds replicas; pure FSDP, or tensor
parallel without a replicated dimension, has none, and a lost rank's shards cannot be rebuilt
from the survivors: :func:`replica_sources` says so, and the job falls back to a restart.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlaunch.runtime import reshard


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor (40 MB) into scripts that never use it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes move: a DTensor's local shard (a view of its live storage)."""
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


def like(local_shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local_shard`` as the same shard of a tensor shaped and placed like ``param`` (a DTensor
    around it when ``param`` is one): optimizer state a joiner creates for a sharded parameter."""
    if not _is_dtensor(param):
        return local_shard
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor)
    return DTensor.from_local(
        local_shard, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def describe(t: torch.Tensor) -> dict[str, Any] | None:
    """What identifies ``t``'s shard (None for a plain tensor): JSON-ready."""
    if not _is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(t, torch.distributed.tensor.DTensor)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("A DTensor on a mesh this rank is not part of cannot be moved.")
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    sharded = [i for i, p in enumerate(t.placements) if not isinstance(p, Replicate)]
    return {
        "placements": [str(p) for p in t.placements],
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "global_shape": list(t.shape),
        "offset": [int(o) for o in offset],
        "coordinate": {str(i): int(coord[i]) for i in sharded},
    }


def mismatch(name: str, mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    """A sentence saying why the sender's shard of ``name`` is not the receiver's ("" if it is)."""
    if mine is None and theirs is None:
        return ""
    if mine is None or theirs is None:
        side = "the sender's" if theirs is not None else "this rank's"
        return f"{name} is a sharded DTensor only on {side} side; both must shard the model the same way."
    for key, what in (
        ("mesh_dims", "mesh dimensions"),
        ("placements", "placements"),
        ("global_shape", "global shape"),
        ("offset", "global offset"),
        ("coordinate", "mesh coordinate on its sharded dimensions"),
    ):
        if mine.get(key) != theirs.get(key):
            return (
                f"The shard of {name} offered has {what} {theirs.get(key)} but this rank holds {what} "
                f"{mine.get(key)}: it is a different shard, so it is refused before any byte is received."
            )
    return ""


def tensors(tracked: dict[str, Any]) -> Iterable[torch.Tensor]:
    """Every tensor of the tracked modules and optimizers (DTensors included)."""
    for obj in tracked.values():
        if isinstance(obj, torch.nn.Module):
            yield from obj.state_dict(keep_vars=True).values()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def move_refusal(tracked: dict[str, Any]) -> str:
    """A sentence saying why no rank of the tracked model can move live ("" if every rank can).

    A standby lays its model out as rank 0 before it knows its rank, then re-lays it out for the
    rank it takes (see :mod:`rlaunch.runtime.reshard`); uneven FSDP2 shards and DTensors outside
    FSDP can be re-laid, a few layouts cannot. Such a model trains as usual; a drain or a live
    replacement of it is refused with this sentence, and ``rlaunch status`` shows it.
    """
    return reshard.refusal(tracked)


def sharded_dims(tracked: dict[str, Any], names: Sequence[str]) -> list[str]:
    """The mesh dimensions (by name, among ``names``) on which some tracked DTensor is sharded.

    A DTensor lives on the root mesh, on a slice of it, or on a mesh flattened or unflattened from
    it; a dimension outside its mesh holds the same data on every coordinate (it is replicated
    there, by DDP or by HSDP), as is one with a ``Replicate`` placement.
    """
    found: set[str] = set()
    for t in tensors(tracked):
        if not _is_dtensor(t):
            continue
        from torch.distributed.tensor import Replicate

        dims = t.device_mesh.mesh_dim_names or ()
        for dim, placement in zip(dims, t.placements, strict=False):
            if not isinstance(placement, Replicate):
                found.add(dim)
    return [n for n in names if n in found]


def replica_sources(
    coords: torch.Tensor, names: Sequence[str], sharded: Sequence[str], moved: Iterable[int], survivors: Sequence[int]
) -> tuple[dict[int, int], str]:
    """For each moved rank, a surviving rank holding the same shards; or ({}, why none does).

    ``coords`` holds every rank's coordinate on each dimension of ``names`` (one row per rank:
    :func:`rlaunch.runtime.meshlines.coordinates`). Replicas share every coordinate on the
    ``sharded`` dimensions. The moved ranks are spread over their replicas so that no one rank
    sends them all.
    """
    keep = [names.index(n) for n in sharded]
    alive = set(survivors)
    sources: dict[int, int] = {}
    load: dict[int, int] = {}
    for rank in sorted(moved):
        coord = _coordinate(coords, rank)
        key = [coord[i] for i in keep]
        replicas = [r for r in sorted(alive) if [_coordinate(coords, r)[i] for i in keep] == key]
        if not replicas:
            dims = ", ".join(repr(n) for n in sharded) or "none"
            return {}, (
                f"rank {rank} (mesh coordinate {coord}) has no surviving replica of its shards: the model is "
                f"sharded on mesh dimension(s) {dims} and no surviving rank shares that coordinate"
            )
        src = min(replicas, key=lambda r: (load.get(r, 0), r))
        load[src] = load.get(src, 0) + 1
        sources[rank] = src
    return sources, ""


def _coordinate(coords: torch.Tensor, rank: int) -> tuple[int, ...]:
    return tuple(int(c) for c in coords[rank].tolist())
