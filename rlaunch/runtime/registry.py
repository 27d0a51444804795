"""Making the runtime's groups known to ``torch.distributed`` (its Python and C++ registries).

A :class:`SwitchableGroup` is built by the runtime, not by ``new_group``, so torch does not know
it: :func:`register` enters it where ``dist.get_rank(group)``, ``DeviceMesh`` and functional
collectives look groups up (as the default group for ``rt.group``), and :func:`unregister` takes
it out again, at exit or before a joiner re-registers a group whose rank mapping changed. These
are torch's private tables (``distributed_c10d._world``); this module is the one place that
touches them.
"""

from __future__ import annotations

from torch.distributed import Store
from torch.distributed import distributed_c10d as c10d

from rlaunch.runtime.groups import SwitchableGroup


def unregister(group: SwitchableGroup) -> None:
    """Forget ``group`` in torch.distributed's Python and C++ registries (at exit, or before it is
    registered again)."""
    name = group.registered_name
    if name is None:
        return
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        table.pop(group, None)
    for members in world.tags_to_pg.values():
        while group in members:
            members.remove(group)
    c10d._unregister_process_group(name)
    if world.default_pg is group:
        c10d._update_default_pg(None)
    group.registered_name = None


def foreign_groups() -> list[str]:
    """The groups torch.distributed knows that the runtime did not make (``dist.new_group``,
    ``init_device_mesh``, in a sandbox too), each named with its ranks: a move cannot rebuild them."""
    world = c10d._world
    return [
        f"{world.pg_names.get(pg, '?')} (ranks {sorted(world.pg_group_ranks.get(pg, {}))})"
        for pg in list(world.pg_map)
        if not getattr(pg, "made_by_runtime", False)
    ]


def known_groups() -> int:
    """How many groups torch.distributed knows (a cheap sign that one was made since last asked)."""
    return len(c10d._world.pg_map)


class StandbyRanks(dict[int, int]):
    """A group's global-to-group rank mapping that also answers for a standby's global rank, -1,
    without listing it: ``dist.get_rank(group)`` works in a sandbox, while
    ``dist.get_process_group_ranks(group)`` still lists the members only."""

    def __init__(self, ranks: dict[int, int], standby: int) -> None:
        super().__init__(ranks)
        self.standby = standby

    def __contains__(self, key: object) -> bool:
        return key == -1 or super().__contains__(key)

    def __missing__(self, key: int) -> int:
        if key == -1:
            return self.standby
        raise KeyError(key)


def register(
    group: SwitchableGroup,
    store: Store | None,
    ranks: dict[int, int],
    default: bool = False,
    standby: int | None = None,
) -> None:
    """Make ``group`` known to torch.distributed (as the default group when ``default``); ``standby``:
    the group rank a standby's -1 has in it (see :class:`StandbyRanks`)."""
    name = group.registered_name or f"rlaunch.{group.label}.{id(group)}"
    unregister(group)  # registered before (a joiner's sandbox groups): the rank mapping changed
    kind, config = ("nccl", "cpu:gloo,cuda:nccl") if group.backend == "nccl" else ("gloo", "gloo")
    mapping = ranks if standby is None else StandbyRanks(ranks, standby)
    c10d._register_pg_in_world(group, kind, store, name, config, rank_mapping=mapping, add_to_default_tag=default)
    group.registered_name = name
    if default:
        c10d._update_default_pg(group)
        c10d._world.pg_group_ranks[c10d.GroupMember.WORLD] = dict(ranks)
