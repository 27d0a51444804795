"""Lines of flattened and unflattened mesh dimensions, and the groups torch's mesh gets for them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch.distributed.device_mesh as torch_mesh
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from rlaunch.errors import UsageError
from rlaunch.runtime import registry
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.meshlines import check_derived, lines_at


def test_flattened_dimensions_have_the_lines_torch_builds_groups_for() -> None:
    """Every flatten of adjacent or spread dimensions of several meshes: the lines are torch's own
    (``global_ranks``, what its ``new_group`` calls get) and each line's order is the coordinate's."""
    for shape in ((2, 2), (2, 3), (2, 2, 2), (3, 2, 2), (2, 1, 4)):
        mesh = _MeshLayout.from_sizes_strides(shape)
        world = mesh.numel()
        for n in range(2, len(shape) + 1):
            for dims in itertools.combinations(range(len(shape)), n):
                flat = _MeshLayout([mesh[d] for d in dims]).collapse()
                assert lines_at(flat.all_ranks_from_zero(), world) == sorted(flat.global_ranks(world)), (shape, dims)


def test_unflattened_dimensions_have_the_lines_torch_builds_groups_for() -> None:
    for shape, dim, sizes in (((8,), 0, (2, 4)), ((8,), 0, (2, 2, 2)), ((2, 6), 1, (3, 2)), ((4, 2), 0, (2, 2))):
        mesh = _MeshLayout.from_sizes_strides(shape)
        world = mesh.numel()
        split = mesh[dim].composition(_MeshLayout.from_sizes_strides(sizes))
        for sub in split:
            assert lines_at(sub.all_ranks_from_zero(), world) == sorted(sub.global_ranks(world)), (shape, sizes)


def test_lines_by_hand() -> None:
    # (a, b, c) = (2, 2, 2): a and c flattened, then b and c
    assert lines_at([0, 1, 4, 5], 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lines_at([0, 1, 2, 3], 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a world of 8 unflattened into (2, 4): the first dimension's lines
    assert lines_at([0, 4], 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="do not tile 6 ranks"):
        lines_at([0, 4], 6)
    with pytest.raises(ValueError, match="must start at 0"):
        lines_at([1, 2], 4)


def test_a_dimension_name_given_again_reuses_or_is_refused() -> None:
    dims = [("world", [[0, 1, 2, 3]]), ("tp", [[0, 1], [2, 3]])]
    assert check_derived("tp", [[0, 1], [2, 3]], dims) == 1  # torchtitan unflattens tp in several meshes
    a = [[0, 4], [2, 6], [1, 5], [3, 7]]  # dimension 0 of a (2, 2, 2) mesh, in the mesh's own order
    assert check_derived("a", [[0, 4], [1, 5], [2, 6], [3, 7]], [("a", a)]) == 0, "the same lines, sorted"
    assert check_derived("dp", [[0, 2], [1, 3]], dims) is None
    with pytest.raises(UsageError, match=r"'tp' made by _flatten or _unflatten has the lines \[\[0, 2\], \[1, 3\]\]"):
        check_derived("tp", [[0, 2], [1, 3]], dims)
    with pytest.raises(UsageError, match="not by rank"):
        check_derived("odd", [[1, 0], [3, 2]], dims)


@pytest.fixture
def torch_groups() -> Iterator[list[SwitchableGroup]]:
    """Groups made known to torch in the test, forgotten after it; torch's own group building and rank put back."""
    made: list[SwitchableGroup] = []
    original, get_rank = DeviceMesh.__dict__["_init_process_groups"], torch_mesh.get_rank  # type: ignore[attr-defined]
    yield made
    DeviceMesh._init_process_groups = original  # type: ignore[method-assign]
    torch_mesh.get_rank = get_rank  # type: ignore[attr-defined]
    for group in made:
        registry.unregister(group)


def test_torch_unflattens_the_mesh_onto_runtime_groups_that_a_joiner_rebinds(
    torch_groups: list[SwitchableGroup],
) -> None:
    """A standby's 1-D mesh of 8 ranks (laid out as rank 0), unflattened as torchtitan does and then
    flattened back in part: each new dimension gets a runtime group named after its line, a name
    given again gets the same group, and joining as rank 6 moves every group to rank 6's lines."""
    mesh = RuntimeMesh((8,), ("world",), 0)

    def make(name: str, members: list[int]) -> SwitchableGroup:
        group = SwitchableGroup(name, members, 0, SandboxComm(members.index(0), len(members)), 0)
        registry.register(group, None, {g: i for i, g in enumerate(members)}, standby=members.index(0))
        torch_groups.append(group)
        return group

    job = SwitchableGroup("world", range(8), 0, SandboxComm(0, 8), 0)  # rt.group: torch's default group
    registry.register(job, None, {i: i for i in range(8)}, default=True, standby=0)
    torch_groups.append(job)
    world = make("mesh.world.0", list(range(8)))
    root = mesh.build("cpu", [world], [str(world.registered_name)])
    mesh.show_rank_to_torch()  # as on a standby
    mesh.serve_torch(make)
    three = root._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
    assert [g.label for g in torch_groups[1:]] == ["mesh.world.0", "mesh.pp.0", "mesh.dp.0", "mesh.tp.0"]
    assert [g.members for g in torch_groups[2:]] == [[0, 4], [0, 2], [0, 1]]
    assert three["tp"].get_group() is torch_groups[4] and three.get_coordinate() == (0, 0, 0)
    again = root._unflatten(0, (2, 4), ("pp", "rest"))
    assert again["pp"].get_group() is torch_groups[2] and len(torch_groups) == 6  # pp reused, rest new
    dp_tp = three["dp", "tp"]._flatten("dp_tp")
    assert dp_tp.get_group().label == "mesh.dp_tp.0" and dp_tp.get_group().members == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="'a' was given a backend_override; rlaunch's mesh groups take the backend"):
        root._unflatten(0, (2, 4), ("a", "b"), backend_override={"a": "gloo"})
    with pytest.raises(UsageError, match="'pp' made by _flatten or _unflatten has the lines"):
        root._unflatten(0, (4, 2), ("quarter", "pp"))  # pp's lines were [0, 4]...: refused before quarter is made
    assert len(torch_groups) == 7 and "quarter" not in mesh.dim_names()
    assert ("mesh.dp.1", [1, 3]) in mesh.every_line() and len(mesh.every_line()) == 1 + 4 + 4 + 4 + 2 + 2

    moved = mesh.rebind(6)  # (pp, dp, tp) = (1, 1, 0)
    assert [(old, new) for old, _, new in moved] == [
        ("mesh.world.0", "mesh.world.0"), ("mesh.pp.0", "mesh.pp.2"), ("mesh.dp.0", "mesh.dp.2"),
        ("mesh.tp.0", "mesh.tp.3"), ("mesh.rest.0", "mesh.rest.1"), ("mesh.dp_tp.0", "mesh.dp_tp.1"),
    ]  # fmt: skip
    assert [g.members for _, g, _ in moved][1:] == [[2, 6], [4, 6], [6, 7], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert three.get_coordinate() == (1, 1, 0) and dp_tp.get_coordinate() == (2,)
