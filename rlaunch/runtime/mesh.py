"""A ``DeviceMesh`` whose dimension groups are runtime groups.

``rt.device_mesh((2, 2), ("replicate", "shard"))`` returns a real
``torch.distributed.device_mesh.DeviceMesh``; FSDP2 (``fully_shard``), HSDP and DTensor tensor
parallelism run on it unchanged. Global ranks are laid out as ``torch.arange(world).reshape(shape)``,
as ``init_device_mesh`` does. Along each dimension the mesh falls into *lines*: the ranks that
share every other coordinate. Each rank holds one :class:`SwitchableGroup` per dimension, for its
own line, named ``mesh.<dim>.<line>`` on every member, so a move rebuilds exactly the lines that
contain a moved rank (the runtime's usual rule) and the others keep their communicators.

A standby builds the mesh in its sandbox as if it held rank 0 (torch needs a coordinate to
shard parameters; an unevenly sharded model is re-laid out for the rank it takes, by
:mod:`rlaunch.runtime.reshard`, once the mesh is rebound) while
``dist.get_rank()`` stays a rank no active worker holds: until it joins, torch's mesh module
alone (slicing ``mesh["tp"]`` asks it for the global rank) is shown the mesh's rank. When it is
given rank ``r``, :meth:`RuntimeMesh.rebind` moves each of its dimension groups to ``r``'s line,
in place, so the group objects FSDP and DTensor captured stay valid, and every mesh object sliced
from this one (DTensors, FSDP and tensor-parallel hooks hold them) takes ``r``'s coordinate.

This module is pure bookkeeping over torch's objects; building communicators is the runtime's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.device_mesh as torch_mesh
from torch.distributed.device_mesh import DeviceMesh

from rlaunch.runtime import heap
from rlaunch.runtime.groups import SwitchableGroup


def layout(shape: Sequence[int]) -> torch.Tensor:
    """Global ranks arranged in ``shape`` (row-major), as ``init_device_mesh`` arranges them."""
    return torch.arange(_numel(shape), dtype=torch.int).reshape(tuple(shape))


def line_of(mesh: torch.Tensor, rank: int, dim: int) -> tuple[int, list[int]]:
    """The line of ``rank`` along ``dim``: its index among that dimension's lines, and its members."""
    lines = mesh.transpose(dim, -1).reshape(-1, mesh.shape[dim]).tolist()
    for index, members in enumerate(lines):
        if rank in members:
            return index, [int(r) for r in members]
    raise ValueError(f"Rank {rank} is not in the mesh of shape {tuple(mesh.shape)}.")


def coordinate(mesh: torch.Tensor, rank: int) -> tuple[int, ...]:
    found = (mesh == rank).nonzero()
    if found.size(0) != 1:
        raise ValueError(f"Rank {rank} is not in the mesh of shape {tuple(mesh.shape)}.")
    return tuple(int(c) for c in found[0].tolist())


def group_name(dim_name: str, line: int) -> str:
    return f"mesh.{dim_name}.{line}"


def check_shape(shape: Sequence[int], names: Sequence[str] | None, world_size: int) -> tuple[str, ...]:
    """Validate a mesh request; return its dimension names (``dim0``, ``dim1``... by default)."""
    dims = tuple(int(s) for s in shape)
    if not dims or any(s < 1 for s in dims):
        raise ValueError(f"The mesh shape {tuple(shape)} must be one or more positive sizes.")
    if _numel(dims) != world_size:
        raise ValueError(
            f"The mesh shape {dims} holds {_numel(dims)} ranks but the job has {world_size}; "
            "give a shape whose sizes multiply to the world size."
        )
    chosen = tuple(names) if names is not None else tuple(f"dim{i}" for i in range(len(dims)))
    if len(chosen) != len(dims) or len(set(chosen)) != len(chosen):
        raise ValueError(f"The mesh dimension names {chosen} must be {len(dims)} distinct names.")
    return chosen


class RuntimeMesh:
    """The runtime's side of a device mesh: its layout, this rank's groups and the torch object."""

    def __init__(self, shape: Sequence[int], names: Sequence[str], rank: int) -> None:
        self.names = tuple(names)
        self.ranks = layout(shape)
        self.rank = rank
        self.groups: list[SwitchableGroup] = []
        self.device_mesh: DeviceMesh | None = None
        self._global_rank: Callable[..., int] | None = None  # torch's, while a sandbox shows ours

    def show_rank_to_torch(self) -> None:
        """(standby) Until :meth:`rebind`, torch's mesh module sees this mesh's rank as the global rank."""
        original = torch_mesh.get_rank  # type: ignore[attr-defined]

        def mesh_rank(group: Any = None) -> int:
            return self.rank if group is None else int(original(group))

        self._global_rank = original
        torch_mesh.get_rank = mesh_rank  # type: ignore[attr-defined]

    def lines(self, rank: int) -> list[tuple[str, list[int]]]:
        """For each dimension, the name and members of ``rank``'s line."""
        out = []
        for dim, dim_name in enumerate(self.names):
            index, members = line_of(self.ranks, rank, dim)
            out.append((group_name(dim_name, index), members))
        return out

    def every_line(self) -> list[tuple[str, list[int]]]:
        """Every line of every dimension, as (group name, members): the mesh groups of the whole job."""
        out = []
        for dim, dim_name in enumerate(self.names):
            lines = self.ranks.transpose(dim, -1).reshape(-1, self.ranks.shape[dim]).tolist()
            out += [(group_name(dim_name, i), [int(r) for r in members]) for i, members in enumerate(lines)]
        return out

    def build(self, device_type: str, groups: list[SwitchableGroup], registered: list[str]) -> DeviceMesh:
        """The torch mesh over ``groups`` (one per dimension, registered under ``registered``)."""
        self.groups = groups
        mesh = DeviceMesh(device_type, self.ranks, mesh_dim_names=self.names, _init_backend=False, _rank=self.rank)
        mesh._dim_group_names = list(registered)
        for name, group in zip(registered, groups, strict=True):
            mesh._pg_registry[name] = group
        self.device_mesh = mesh
        return mesh

    def rebind(self, rank: int) -> list[tuple[str, SwitchableGroup, str]]:
        """Give this rank's dimension groups the lines of ``rank``; return (old name, group, new name).

        The caller renames the groups (in the group table, which keeps their build order) and
        re-registers them (their rank mapping changed).
        """
        self.rank = rank
        moved = []
        for group, (name, members) in zip(self.groups, self.lines(rank), strict=True):
            group.members = members
            group.group_rank = members.index(rank)
            moved.append((group.label, group, name))
        for view in self._views():
            view._rank = rank
            view._coordinate_on_dim = view._compute_coordinate_on_dim()
        if self._global_rank is not None:
            torch_mesh.get_rank = self._global_rank  # type: ignore[attr-defined]
            self._global_rank = None
        return moved

    def _views(self) -> list[DeviceMesh]:
        """This mesh and every mesh sliced or flattened from it (found once, when a joiner rebinds)."""
        root = self.device_mesh
        if root is None:
            return []
        return [o for o in heap.instances(DeviceMesh) if o is root or o._root_mesh is root]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return coordinate(self.ranks, rank)

    def describe(self) -> dict[str, Any]:
        return {"shape": list(self.ranks.shape), "names": list(self.names)}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
