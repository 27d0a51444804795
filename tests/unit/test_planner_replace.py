"""Unit tests of live replacement planning (``replace``): standby first, in place, wait, fallback."""

from __future__ import annotations

import dataclasses

from rlaunch.controller.planner import plan
from rlaunch.store.records import GenerationStatus, NodeRecord, NodeState
from tests.unit.test_planner import CFG, NOW, gen, rec, view


def rt(record: NodeRecord) -> NodeRecord:
    """The same record, for workers that use the runtime."""
    return dataclasses.replace(record, runtime=True)


G1 = gen(1, {"a": 0, "b": 1})


def test_failed_workers_are_replaced_live_by_a_ready_standby_and_count_as_a_restart() -> None:
    v = view(
        rt(rec("a", NodeState.RUNNING, generation=1)),
        rt(rec("b", NodeState.FAILED, generation=1, exit_codes={"0": -9})),
        rt(rec("c", NodeState.STANDBY)),
        generation=G1,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None and new.kind == "replace" and new.number == 2
    assert new.assignment == {"a": 0, "c": 1} and new.leavers == ["b"] and new.joiners == ["c"]
    assert new.restart_count == 1 and "b (workers failed) replaced by c" in reason


def test_a_lost_node_is_replaced_live_without_counting_a_restart() -> None:
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), rt(rec("c", NodeState.STANDBY)), generation=G1)
    new, reason = plan(NOW, v, CFG)
    assert new is not None and new.kind == "replace" and new.joiners == ["c"] and new.restart_count == 0
    assert "b (lost) replaced by c" in reason


def test_without_a_ready_standby_failed_workers_restart_in_place() -> None:
    warming = rt(rec("c", NodeState.WARMING))
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), rt(rec("b", NodeState.FAILED, generation=1)), warming,
             generation=G1)  # fmt: skip
    new, reason = plan(NOW, v, CFG)
    assert new is not None and new.kind == "replace" and new.leavers == ["b"] and new.joiners == ["b"]
    assert new.assignment == {"a": 0, "b": 1} and "restarted in place" in reason


def test_a_faulty_node_is_never_restarted_in_place() -> None:
    faulty = dataclasses.replace(rt(rec("b", NodeState.FAILED, generation=1)), fault="GPU 0 fell off the bus")
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), faulty, generation=G1)
    new, reason = plan(NOW, v, CFG)
    assert new is not None and new.number == 1 and new.deadline == NOW + CFG.standby_wait, reason


def test_a_lost_node_without_a_standby_waits_then_falls_back_to_a_restart() -> None:
    a = rt(rec("a", NodeState.RUNNING, generation=1))
    new, reason = plan(NOW, view(a, generation=G1), CFG)
    assert new is not None and new.number == 1 and new.status is GenerationStatus.RUNNING
    assert new.deadline == NOW + CFG.standby_wait and "waiting up to" in reason
    again, why = plan(NOW + 1, view(a, generation=new), CFG)
    assert again is None and "waiting for a standby" in why
    c = rt(rec("c", NodeState.STANDBY))
    came, _ = plan(NOW + 2, view(a, c, generation=new), CFG)
    assert came is not None and came.kind == "replace" and came.joiners == ["c"] and came.deadline == 0
    late, why = plan(new.deadline, view(a, generation=new), CFG)
    assert late is not None and late.status is GenerationStatus.WAITING and late.number == 2, why


def test_a_script_without_the_runtime_restarts_every_worker() -> None:
    v = view(rec("a", NodeState.RUNNING, generation=1), rec("b", NodeState.FAILED, generation=1),
             rec("c", NodeState.STANDBY), generation=G1)  # fmt: skip
    new, _ = plan(NOW, v, CFG)
    assert new is not None and new.kind == "restart" and new.assignment == {"a": 0, "b": 1}


def test_a_fault_while_a_move_is_in_flight_restarts_every_worker() -> None:
    g2 = dataclasses.replace(gen(2, {"a": 0, "c": 1}), kind="replace", leavers=["b"], joiners=["c"])
    v = view(rt(rec("a", NodeState.FAILED, generation=2)), rt(rec("c", NodeState.RESTARTING, generation=2)),
             rt(rec("d", NodeState.STANDBY)), generation=g2)  # fmt: skip
    new, _ = plan(NOW, v, CFG)
    assert new is not None and new.kind == "restart" and new.restart_count == 1


def test_with_restarts_used_up_a_worker_failure_fails_the_job() -> None:
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), rt(rec("b", NodeState.FAILED, generation=1)),
             rt(rec("c", NodeState.STANDBY)), generation=G1, max_restarts=0)  # fmt: skip
    new, _ = plan(NOW, v, CFG)
    assert new is not None and new.status is GenerationStatus.FAILED


def test_when_every_node_failed_there_is_no_replica_and_every_worker_restarts() -> None:
    v = view(rt(rec("a", NodeState.FAILED, generation=1)), rt(rec("b", NodeState.FAILED, generation=1)),
             rt(rec("c", NodeState.STANDBY)), generation=G1)  # fmt: skip
    new, _ = plan(NOW, v, CFG)
    assert new is not None and new.kind == "restart"


def test_a_leaver_lost_before_its_joiner_joined_restarts_every_node() -> None:
    g2 = dataclasses.replace(gen(2, {"a": 0, "c": 1}), kind="migrate", leavers=["b"], joiners=["c"])
    a, c = rt(rec("a", NodeState.RUNNING, generation=2)), rt(rec("c", NodeState.RESTARTING, generation=2))
    new, reason = plan(NOW, view(a, c, generation=g2), CFG)
    assert new is not None and new.kind == "restart" and new.assignment == {"a": 0, "c": 1}, reason
    assert "b was lost or failed before handing its state to c" in reason and new.restart_count == 0
    failed_leaver = rt(rec("b", NodeState.FAILED, generation=1))
    new, _ = plan(NOW, view(a, c, failed_leaver, generation=g2), CFG)
    assert new is not None and new.kind == "restart"
    joined = dataclasses.replace(c, state=NodeState.RUNNING)
    new, reason = plan(NOW, view(a, joined, generation=g2), CFG)
    assert new is None, "once the joiner joined, the leaver may go"
    done = dataclasses.replace(c, state=NodeState.SUCCEEDED)
    new, reason = plan(NOW, view(dataclasses.replace(a, state=NodeState.SUCCEEDED), done, generation=g2), CFG)
    assert new is not None and new.status is GenerationStatus.SUCCEEDED, reason


def test_reasons_name_the_fault_of_a_node_that_gave_up_its_ranks() -> None:
    fault = "GPU 0 fell off the bus"
    faulty = dataclasses.replace(rt(rec("b", NodeState.FAILED, generation=1)), fault=fault)
    a = rt(rec("a", NodeState.RUNNING, generation=1))
    new, reason = plan(NOW, view(a, faulty, rt(rec("c", NodeState.STANDBY)), generation=G1), CFG)
    assert new is not None and f"b (fault: {fault}) replaced by c" in reason
    waiting, reason = plan(NOW, view(a, faulty, generation=G1), CFG)
    assert waiting is not None and f"node b lost (b: {fault}) and no standby is ready" in reason
    fallback, reason = plan(waiting.deadline, view(a, faulty, generation=waiting), CFG)
    assert fallback is not None and f"node(s) b lost (b: {fault}); no standby is ready" in reason
    failed, reason = plan(fallback.deadline, view(a, faulty, generation=fallback), CFG)
    assert failed is not None and failed.status is GenerationStatus.FAILED
    assert reason == f"no node came to take node rank(s) [1] within 60 s; b may not take one: {fault}; the job failed"


def test_workers_that_refused_a_live_move_take_the_restart_path_even_with_a_standby() -> None:
    refused = dataclasses.replace(
        rt(rec("b", NodeState.FAILED, generation=1, exit_codes={"0": 1})),
        failure="refused", message="rank 1: replicas differ after the move",
    )  # fmt: skip
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), refused, rt(rec("c", NodeState.STANDBY)), generation=G1)
    new, reason = plan(NOW, v, CFG)
    assert new is not None and new.kind == "restart" and new.restart_count == 1, reason
    assert "no live move: rank 1: replicas differ after the move" in reason


def test_a_replacement_among_many_survivors_counts_them_instead_of_naming_them() -> None:
    names = [f"n{i:03d}" for i in range(40)]
    g = gen(1, {n: i for i, n in enumerate(names)}, nnodes=40)
    records = [rt(rec(n, NodeState.RUNNING, generation=1)) for n in names[1:]]
    new, reason = plan(NOW, view(*records, rt(rec("s", NodeState.STANDBY)), generation=g, nnodes=40), CFG)
    assert new is not None and new.kind == "replace" and new.joiners == ["s"]
    assert reason == "n000 (lost) replaced by s; the 39 survivors keep their processes"


def test_a_standby_a_survivor_cannot_reach_is_passed_over_for_one_it_can() -> None:
    v = view(
        rt(rec("a", NodeState.RUNNING, generation=1)),
        rt(rec("c", NodeState.STANDBY)),
        rt(rec("d", NodeState.STANDBY)),
        generation=G1,
    )
    cut = dataclasses.replace(v, unreachable=frozenset({"c"}))
    new, _ = plan(NOW, cut, CFG)
    assert new is not None and new.joiners == ["d"], "c joined first, but a cannot reach it"
    new, reason = plan(NOW, dataclasses.replace(cut, unreachable=frozenset({"c", "d"})), CFG)
    assert new is not None and new.number == 1 and new.deadline > NOW, "no standby it can reach: it waits for one"
    assert "no standby is ready" in reason
