"""The records an agent and its workers exchange (rlaunch.plans): round trips, roles, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from rlaunch.errors import MessageError, RlaunchError
from rlaunch.plans import (
    Hello,
    MigratePlan,
    PlanKind,
    ReplacePlan,
    Role,
    StartRole,
    plan_from_json,
    plan_to_json,
)


def migrate_json(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "generation": 3, "kind": "migrate", "role": "survivor", "rank": 1, "moved_ranks": [2, 3],
        "world_size": 4, "sources": {},
    }  # fmt: skip
    return {**base, **over}


def replace_json(**over: Any) -> dict[str, Any]:
    return migrate_json(**{"kind": "replace", "sources": {"2": 0, "3": 1}, **over})


def wire(obj: dict[str, Any]) -> dict[str, Any]:
    """As it crosses the control socket."""
    return json.loads(json.dumps(obj))  # type: ignore[no-any-return]


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_a_migrate_plan_round_trips_through_json_for_every_role(role: Role) -> None:
    plan = MigratePlan(generation=3, role=role, rank=1, moved_ranks=(2, 3), world_size=4)
    back = plan_from_json(wire(plan_to_json(plan)))
    assert back == plan and isinstance(back, MigratePlan)
    assert back.role is role and back.kind is PlanKind.MIGRATE


@pytest.mark.parametrize("role", [Role.SURVIVOR, Role.JOINER])
def test_a_replace_plan_round_trips_through_json_with_int_sources(role: Role) -> None:
    plan = ReplacePlan(generation=5, role=role, rank=0, moved_ranks=(2, 3), world_size=4, sources={3: 1, 2: 0})
    back = plan_from_json(wire(plan.to_json()))
    assert back == plan and isinstance(back, ReplacePlan)
    assert back.sources == {2: 0, 3: 1} and list(back.sources) == [2, 3]


def test_the_wire_format_is_the_json_the_runtime_read_before_the_records() -> None:
    plan = ReplacePlan(generation=5, role=Role.JOINER, rank=2, moved_ranks=(2, 3), world_size=4, sources={2: 0, 3: 1})
    assert plan.to_json() == {
        "generation": 5, "kind": "replace", "role": "joiner", "rank": 2, "moved_ranks": [2, 3],
        "world_size": 4, "sources": {"2": 0, "3": 1},
    }  # fmt: skip
    assert MigratePlan(3, Role.LEAVER, 2, (2, 3), 4).to_json() == migrate_json(role="leaver", rank=2)


def test_no_plan_yet_is_generation_zero_both_ways() -> None:
    assert plan_to_json(None) == {"generation": 0}
    assert plan_from_json({"generation": 0}) is None


@pytest.mark.parametrize(
    "hello",
    [
        Hello(StartRole.ACTIVE, rank=3, world_size=4, generation=2),
        Hello(StartRole.STANDBY, rank=-1, world_size=4, generation=0, sandbox_steps=0),
        Hello(StartRole.STANDBY, rank=-1, world_size=0, generation=0, sandbox_steps=5),
    ],
)
def test_a_hello_answer_round_trips(hello: Hello) -> None:
    assert Hello.from_json(wire(hello.to_json())) == hello


def test_a_hello_answer_without_sandbox_steps_gets_three_as_before() -> None:
    hello = Hello.from_json({"role": "active", "rank": 0, "world_size": 2, "generation": 1})
    assert hello.sandbox_steps == 3 and hello.role is StartRole.ACTIVE


# -- roles -----------------------------------------------------------------------------------------


def test_roles_are_str_enums_with_the_wire_values() -> None:
    assert [r.value for r in Role] == ["survivor", "leaver", "joiner"]
    assert [r.value for r in StartRole] == ["active", "standby"]
    assert Role("joiner") is Role.JOINER and Role.JOINER == "joiner"
    assert json.dumps({"role": Role.LEAVER}) == '{"role": "leaver"}'


def test_a_role_given_as_its_string_in_code_becomes_the_enum() -> None:
    plan = MigratePlan(3, "joiner", 2, (2, 3), 4)  # type: ignore[arg-type]
    assert plan.role is Role.JOINER


def test_a_replacement_has_no_leaver() -> None:
    with pytest.raises(MessageError, match=r"replace plan from the agent has role='leaver'.*one of survivor, joiner"):
        plan_from_json(replace_json(role="leaver"))
    with pytest.raises(MessageError, match="role"):
        ReplacePlan(5, Role.LEAVER, 0, (2,), 4, {2: 0})


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (migrate_json(generation="3"), "generation"),
        (migrate_json(generation=-1), "generation"),
        (migrate_json(generation=True), "generation"),
        (migrate_json(generation=3.0), "generation"),
        (migrate_json(role="bystander"), "role"),
        (migrate_json(role=None), "role"),
        (migrate_json(rank=4), "rank"),
        (migrate_json(rank=-1), "rank"),
        (migrate_json(rank="1"), "rank"),
        (migrate_json(moved_ranks=[2, "3"]), "moved_ranks"),
        (migrate_json(moved_ranks=[2, 4]), "moved_ranks"),
        (migrate_json(moved_ranks=[2, 2]), "moved_ranks"),
        (migrate_json(moved_ranks={"2": 1}), "moved_ranks"),
        (migrate_json(moved_ranks=2), "moved_ranks"),
        (migrate_json(world_size=0), "world_size"),
        (migrate_json(world_size="4"), "world_size"),
        (migrate_json(sources={"2": 0}), "sources"),
        (migrate_json(sources=[]), "sources"),
        (replace_json(sources={"x": 0}), "sources"),
        (replace_json(sources={"02": 0}), "sources"),
        (replace_json(sources={"-2": 0}), "sources"),
        (replace_json(sources={"2": "0"}), "sources"),
        (replace_json(sources={"2": 9}), "sources"),
        (replace_json(sources={"1": 0}), "sources"),  # 1 is not a moved rank
        (replace_json(sources={"2": 3}), "sources"),  # 3 is being replaced: it cannot send
        (replace_json(sources=None), "sources"),
    ],
)
def test_a_malformed_field_is_refused_with_a_sentence_naming_it(obj: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageError) as info:
        plan_from_json(obj)
    message = str(info.value)
    assert f"has {field}=" in message and message.endswith("must run the same rlaunch version.")
    assert isinstance(info.value, RlaunchError)


@pytest.mark.parametrize("field", ["generation", "kind", "role", "rank", "moved_ranks", "world_size", "sources"])
def test_a_missing_field_is_refused_by_name(field: str) -> None:
    obj = replace_json()
    del obj[field]
    with pytest.raises(MessageError, match=f"lacks the field '{field}'"):
        plan_from_json(obj)


def test_an_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(MessageError, match="migrate plan from the agent has an unknown field 'comms'"):
        plan_from_json(migrate_json(comms={}))
    with pytest.raises(MessageError, match="hello answer from the agent has an unknown field 'pid'"):
        Hello.from_json({"role": "active", "rank": 0, "world_size": 2, "generation": 1, "pid": 7})
    with pytest.raises(MessageError, match="unknown field 'after'"):
        plan_from_json({"generation": 0, "after": 3})


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(MessageError, match=r"has kind='restart', which is not one of migrate, replace"):
        plan_from_json(migrate_json(kind="restart"))


@pytest.mark.parametrize("obj", [[1, 2], "plan", None, 3])
def test_a_plan_that_is_not_an_object_is_refused(obj: Any) -> None:
    with pytest.raises(MessageError, match="not a JSON object"):
        plan_from_json(obj)


def test_a_plan_without_kind_and_a_generation_is_not_taken_for_no_plan() -> None:
    with pytest.raises(MessageError, match="lacks the field 'kind'"):
        plan_from_json({"generation": 4})
    with pytest.raises(MessageError, match="lacks the field 'kind'"):
        plan_from_json({"generation": False})


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"role": "spare", "rank": 0, "world_size": 2, "generation": 1}, "role"),
        ({"role": "active", "rank": -1, "world_size": 2, "generation": 1}, "rank"),
        ({"role": "active", "rank": 2, "world_size": 2, "generation": 1}, "rank"),
        ({"role": "active", "rank": 0, "world_size": 0, "generation": 1}, "world_size"),
        ({"role": "standby", "rank": 0, "world_size": 2, "generation": 0}, "rank"),
        ({"role": "active", "rank": 0, "world_size": 2, "generation": -1}, "generation"),
        ({"role": "active", "rank": 0, "world_size": 2, "generation": 1, "sandbox_steps": -1}, "sandbox_steps"),
        ({"role": "active", "rank": 0, "world_size": 2, "generation": 1, "sandbox_steps": "3"}, "sandbox_steps"),
    ],
)
def test_a_malformed_hello_answer_is_refused_by_field(obj: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageError, match=f"hello answer from the agent has {field}="):
        Hello.from_json(obj)


def test_a_hello_answer_lacking_a_field_is_refused_by_name() -> None:
    with pytest.raises(MessageError, match="lacks the field 'world_size'"):
        Hello.from_json({"role": "active", "rank": 0, "generation": 1})


def test_records_built_in_code_are_checked_as_strictly_as_json() -> None:
    with pytest.raises(MessageError, match="has rank=4"):
        MigratePlan(3, Role.SURVIVOR, 4, (2, 3), 4)
    with pytest.raises(MessageError, match="has moved_ranks="):
        MigratePlan(3, Role.SURVIVOR, 1, [2, 3], 4)  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="has sources="):
        ReplacePlan(5, Role.SURVIVOR, 0, (2, 3), 4, {"2": 0})  # type: ignore[dict-item]
    with pytest.raises(MessageError, match="has sources="):
        ReplacePlan(5, Role.SURVIVOR, 0, (2,), 4, {3: 0})  # 3 is not a moved rank


def test_the_records_import_neither_torch_nor_asyncio() -> None:
    code = "import sys, rlaunch.plans; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "rlaunch.plans" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("torch", "asyncio", "pickle", "aetcd", "grpc")] == []


# -- the agent's side: what WorkerLink hands its workers -------------------------------------------


def generation(kind: str, leavers: list[str], joiners: list[str]) -> Any:
    from rlaunch.store.records import Generation, GenerationStatus

    assignment = {"a": 0, "c": 1} if kind == "replace" or joiners == ["c"] else {"a": 0, "b": 1}
    return Generation(
        number=4, status=GenerationStatus.RUNNING, assignment=assignment, nnodes=2, nproc_per_node=2,
        master_addr="127.0.0.1", master_port=1, restart_count=0, reason="test", controller="a", created_at=0.0,
        kind=kind, leavers=leavers, joiners=joiners,
    )  # fmt: skip


def offered(gen: Any, node: str, role: Role | str) -> list[Any]:
    import asyncio

    from rlaunch.agent.worker_link import WorkerLink

    link = WorkerLink(None, None, lambda: 0, lambda *a, **k: None, lambda: None)  # type: ignore[arg-type]
    link.node_id = node

    async def ask() -> list[Any]:
        link.offer(gen, role, 2)
        return [plan_from_json(wire(await link._wait_plan({"local_rank": i, "after": 3}))) for i in range(2)]

    return asyncio.run(ask())


def test_the_agent_offers_a_leaver_the_ranks_it_hands_over() -> None:
    plans = offered(generation("migrate", ["b"], ["c"]), "b", "leaver")
    assert plans == [MigratePlan(4, Role.LEAVER, 2, (2, 3), 4), MigratePlan(4, Role.LEAVER, 3, (2, 3), 4)]


def test_the_agent_offers_survivors_of_a_replacement_their_replica_sources() -> None:
    plans = offered(generation("replace", ["b"], ["c"]), "a", Role.SURVIVOR)
    assert plans[1] == ReplacePlan(4, Role.SURVIVOR, 1, (2, 3), 4, {2: 0, 3: 1})


def test_the_agent_refuses_to_offer_an_unknown_role() -> None:
    with pytest.raises(ValueError, match="'bystander' is not a valid Role"):
        offered(generation("migrate", ["b"], ["c"]), "a", "bystander")
