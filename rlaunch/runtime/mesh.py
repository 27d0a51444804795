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

A dimension made from the mesh later, by torch's ``mesh["replicate", "shard"]._flatten("dp")`` or
``world._unflatten(0, (2, 2), ("replicate", "shard"))`` (torchtitan's way), is such a dimension
too: torch asks :meth:`RuntimeMesh.serve_torch`'s hook for its groups instead of calling
``new_group``, and gets one runtime group per rank, for its line, named ``mesh.<name>.<line>``
(:mod:`rlaunch.runtime.meshlines` finds the lines from torch's layout). A name given again with the
same lines gets the same group (torchtitan unflattens ``pp`` and ``tp`` in several meshes); with
other lines it is refused.

This module is pure bookkeeping over torch's objects; building communicators is the runtime's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.device_mesh as torch_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName

from rlaunch.errors import UsageError
from rlaunch.runtime import heap, meshlines
from rlaunch.runtime.groups import SwitchableGroup


class RuntimeMesh:
    """The runtime's side of a device mesh: its layout, this rank's groups and the torch object."""

    def __init__(self, shape: Sequence[int], names: Sequence[str], rank: int) -> None:
        self.names = tuple(names)
        self.ranks = meshlines.layout(shape)
        self.rank = rank
        #: every dimension, as (name, lines): the mesh's own, then those torch flattened or unflattened
        self.dims = [(name, meshlines.dim_lines(self.ranks, dim)) for dim, name in enumerate(self.names)]
        self.groups: list[SwitchableGroup] = []  # this rank's group of each dimension, in the order of dims
        self.device_mesh: DeviceMesh | None = None
        self._table: torch.Tensor | None = None  # coordinates(), until a dimension is added
        self._global_rank: Callable[..., int] | None = None  # torch's, while a sandbox shows ours

    def show_rank_to_torch(self) -> None:
        """(standby) Until :meth:`rebind`, torch's mesh module sees this mesh's rank as the global rank."""
        original = torch_mesh.get_rank  # type: ignore[attr-defined]

        def mesh_rank(group: Any = None) -> int:
            return self.rank if group is None else int(original(group))

        self._global_rank = original
        torch_mesh.get_rank = mesh_rank  # type: ignore[attr-defined]

    def serve_torch(self, make: Callable[[str, list[int]], SwitchableGroup]) -> None:
        """Have torch's mesh ask ``make`` (a group's name, members) for the groups of every dimension it
        flattens or unflattens from this mesh, instead of building them with ``new_group``.

        Torch builds those groups in ``DeviceMesh._init_process_groups`` (from ``_flatten`` and
        ``_unflatten``), given the layout of the new dimensions over the root mesh's ranks; meshes
        that are not this one's keep torch's own.
        """
        original = DeviceMesh._init_process_groups

        def init_process_groups(
            mesh_layout: Any, rank_map: torch.Tensor, dim_names: tuple[str, ...] | None, overrides: Any
        ) -> list[GroupName]:
            root = self.device_mesh
            if root is None or rank_map is not root._rank_map:
                return original(mesh_layout, rank_map, dim_names, overrides)
            names = [dim_names[dim] if dim_names else f"dim_{dim}" for dim in range(len(mesh_layout))]
            world = len(rank_map)
            every = [
                [[int(rank_map[i]) for i in line] for line in meshlines.lines_at(sub.all_ranks_from_zero(), world)]
                for sub in mesh_layout
            ]
            for name, override, lines in zip(names, overrides, every, strict=True):
                # a dimension of size 1 talks to no one: its backend does not matter (torchtitan's "fake")
                if tuple(override) != (None, None) and any(len(line) > 1 for line in lines):
                    raise UsageError(
                        f"The mesh dimension {name!r} was given a backend_override; rlaunch's mesh groups take the "
                        "backend of rt.device_mesh's device_type, so flatten or unflatten without one."
                    )
            for name, lines in zip(names, every, strict=True):  # refused before any group is made
                meshlines.check_derived(name, lines, self.dims)
            out = []
            for name, lines in zip(names, every, strict=True):
                held = meshlines.check_derived(name, lines, self.dims)
                if held is None:
                    index, members = meshlines.find_line(lines, self.rank)
                    group = make(meshlines.group_name(name, index), members)  # first: it may fail
                    self.dims.append((name, lines))
                    self.groups.append(group)
                    self._table = None
                    held = len(self.dims) - 1
                out.append(GroupName(str(self.groups[held].registered_name)))
            return out

        DeviceMesh._init_process_groups = staticmethod(init_process_groups)  # type: ignore[method-assign,assignment]

    def dim_names(self) -> tuple[str, ...]:
        """The name of every dimension: the mesh's own, then those flattened or unflattened from it."""
        return tuple(name for name, _ in self.dims)

    def coordinates(self) -> torch.Tensor:
        """Every global rank's coordinate on each dimension of :meth:`dim_names` (one row per rank)."""
        if self._table is None:
            self._table = meshlines.coordinates(self.dims, self.ranks.numel())
        return self._table

    def lines(self, rank: int) -> list[tuple[str, list[int]]]:
        """For each dimension, the name and members of ``rank``'s line."""
        out = []
        for dim_name, lines in self.dims:
            index, members = meshlines.find_line(lines, rank)
            out.append((meshlines.group_name(dim_name, index), members))
        return out

    def every_line(self) -> list[tuple[str, list[int]]]:
        """Every line of every dimension, as (group name, members): the mesh groups of the whole job."""
        return [
            (meshlines.group_name(name, i), members) for name, lines in self.dims for i, members in enumerate(lines)
        ]

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
        """This mesh and every mesh sliced, flattened or unflattened from it (found once, when a joiner rebinds)."""
        root = self.device_mesh
        if root is None:
            return []
        return [o for o in heap.instances(DeviceMesh) if o is root or o._root_mesh is root]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return meshlines.coordinate(self.ranks, rank)
