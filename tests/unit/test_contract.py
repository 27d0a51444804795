"""The cross-rank contract: the group table's order, the step contract and the group catalog, compared
as the vote's allreduce would sum them."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
from torch.distributed import HashStore
from torch.distributed.device_mesh import DeviceMesh

from rlaunch.runtime import contract
from rlaunch.runtime.contract import GroupCatalog, StepContract
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.grouptable import GroupTable
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.runtime import Runtime


@pytest.mark.parametrize("values", [[5, 5, 5], [2**64 - 1] * 4, [0, 0]])
def test_64_bit_values_agree_exactly_when_all_are_equal(values: list[int]) -> None:
    summed = [sum(x) for x in zip(*(contract.terms(v) for v in values), strict=True)]
    assert contract.agree(len(values), summed)
    changed = [*values[:-1], values[-1] ^ (1 << 63)]
    summed = [sum(x) for x in zip(*(contract.terms(v) for v in changed), strict=True)]
    assert not contract.agree(len(values), summed)
    assert contract.from_limbs(contract.limbs(values[0])) == values[0]


def test_a_broken_step_contract_names_the_ranks_and_what_differs() -> None:
    rows = [StepContract(3, 40, 39, -1, 7).row(), StepContract(3, 40, 39, -1, 7).row()]
    rows.append(StepContract(4, 40, 38, -1, 7).row())
    text = contract.explain(torch.tensor(rows, dtype=torch.float64))
    assert "the generation being applied differs (ranks [0, 1] have 3, ranks [2] have 4)" in text
    assert "the last applied step (the commit point) differs (ranks [0, 1] have 39, ranks [2] have 38)" in text
    assert "the step being voted" not in text and "layout" not in text and "kept" not in text


def test_a_joiner_that_missed_a_kept_snapshot_is_named() -> None:
    """A drain kept snapshot 20 on the survivors; a joiner that did not hear of it takes its own: the
    contract's digest differs, and the gathered rows name the rank and the snapshot."""
    survivor, joiner = StepContract(2, 41, 40, 20, 7), StepContract(2, 41, 40, -1, 7)
    assert survivor.digest() != joiner.digest()
    text = contract.explain(torch.tensor([survivor.row(), joiner.row()], dtype=torch.float64))
    assert text == "the host snapshot a drain kept (-1: none) differs (ranks [0] have 20, ranks [1] have -1)"


def _table(order: list[tuple[str, list[int]]], rank: int) -> GroupTable:
    table = GroupTable(HashStore(), datetime.timedelta(seconds=5))
    for name, members in order:
        table.add(SwitchableGroup(name, members, rank, SandboxComm(0, len(members)), 1))
    return table


def _summed(catalog: GroupCatalog, tables: dict[int, GroupTable]) -> torch.Tensor:
    return torch.stack([catalog.section(t.describe(), r) for r, t in tables.items()]).sum(dim=0)


def test_groups_built_in_another_order_are_named() -> None:
    lines = {0: ("mesh.dp.0", [0, 1]), 1: ("mesh.dp.0", [0, 1])}
    good = {r: _table([("world", [0, 1]), lines[r], ("extra", [0, 1])], r) for r in (0, 1)}
    catalog = GroupCatalog(["world", "mesh.dp.0", "extra"])
    sizes = {"world": 2, "mesh.dp.0": 2, "extra": 2}
    assert catalog.disagreeing(_summed(catalog, good), sizes) == []
    # a joiner that put its mesh group after a group made later: both groups are named
    bad = {0: good[0], 1: _table([("world", [0, 1]), ("extra", [0, 1]), lines[1]], 1)}
    assert catalog.disagreeing(_summed(catalog, bad), sizes) == ["extra", "mesh.dp.0"]


def test_a_group_at_another_version_on_one_member_is_named() -> None:
    tables = {r: _table([("world", [0, 1, 2]), ("sub", [1, 2])], r) for r in (0, 1, 2)}
    catalog = GroupCatalog(["world", "sub"])
    sizes = {"world": 3, "sub": 2}
    assert catalog.disagreeing(_summed(catalog, tables), sizes) == []
    tables[2]["sub"].version = 2
    assert catalog.disagreeing(_summed(catalog, tables), sizes) == ["sub"]


class _Link:
    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return {}


def test_a_joiner_renames_its_mesh_groups_where_they_stand_in_the_build_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standby lays its mesh out as rank 0, then makes a group of its own: when it joins as
    rank 3 its mesh groups take rank 3's lines without moving behind that group (they did: a
    joiner then waited on other rendezvous than the survivors until the 300 s timeout)."""
    rt = Runtime(
        rank=-1, world_size=4, generation=0, link=_Link(), store=HashStore(), world_comm=SandboxComm(0, 4),
        standby=True, sandbox_steps=0, timeout=datetime.timedelta(seconds=5),
    )  # type: ignore[arg-type]  # fmt: skip
    # the mesh serves the groups of the dimensions torch flattens or unflattens from it: put back after
    monkeypatch.setattr(DeviceMesh, "_init_process_groups", DeviceMesh.__dict__["_init_process_groups"])
    try:
        rt.device_mesh((2, 2), ("dp", "tp"))
        rt.new_group("metrics", [0, 1, 2, 3])
        before = rt._s.groups.names()
        assert before == ["world", "mesh.dp.0", "mesh.tp.0", "metrics"]
        rt._joining.rebind_mesh(3)
        assert rt._s.groups.names() == ["world", "mesh.dp.1", "mesh.tp.1", "metrics"]
        survivor = RuntimeMesh((2, 2), ("dp", "tp"), 3)
        assert [n for n, _ in survivor.lines(3)] == rt._s.groups.names()[1:3]
    finally:
        rt._shutdown()
