"""Unit tests of the pure planner: cluster views built by hand, assertions on plans and reasons."""

from __future__ import annotations

import dataclasses

import pytest

from rlaunch.controller.planner import ClusterView, NodeView, PlannerConfig, plan
from rlaunch.store.records import Generation, GenerationStatus, JobSpec, NodeRecord, NodeState

NOW = 1000.0
CFG = PlannerConfig(controller="ctl", replace_timeout=60.0)


def spec(nnodes: int = 2, nproc: int = 2, max_restarts: int = 3) -> JobSpec:
    return JobSpec(
        job_id="job",
        nnodes=nnodes,
        nproc_per_node=nproc,
        max_restarts=max_restarts,
        entrypoint="train.py",
        args=[],
        fingerprint="f" * 16,
        rlaunch_version="0.1.0",
    )


def rec(
    node_id: str,
    state: NodeState = NodeState.WAITING,
    *,
    generation: int = 0,
    standby_only: bool = False,
    master_port: int | None = None,
    exit_codes: dict[str, int] | None = None,
) -> NodeRecord:
    """A node record whose addr and port are derived from its id, so tests can tell nodes apart."""
    return NodeRecord(
        node_id=node_id,
        host=f"host-{node_id}",
        addr=f"addr-{node_id}",
        pid=100,
        nproc=2,
        standby_only=standby_only,
        state=state,
        generation=generation,
        restarts=0,
        master_port=master_port if master_port is not None else 29000 + len(node_id),
        updated_at=NOW,
        exit_codes=exit_codes or {},
    )


def view(*records: NodeRecord, generation: Generation | None = None, **spec_kw: int) -> ClusterView:
    """A view whose nodes joined in argument order (join revisions 10, 20, ...)."""
    nodes = {r.node_id: NodeView(record=r, join_revision=10 * (i + 1)) for i, r in enumerate(records)}
    return ClusterView(spec=spec(**spec_kw), nodes=nodes, generation=generation)


def gen(
    number: int,
    assignment: dict[str, int],
    *,
    status: GenerationStatus = GenerationStatus.RUNNING,
    restart_count: int = 0,
    nnodes: int = 2,
    deadline: float = 0.0,
) -> Generation:
    return Generation(
        number=number,
        status=status,
        assignment=assignment,
        nnodes=nnodes,
        nproc_per_node=2,
        master_addr="addr-old",
        master_port=1234,
        restart_count=restart_count,
        reason="",
        controller="ctl",
        created_at=NOW - 100,
        deadline=deadline,
    )


# --- the first generation ---------------------------------------------------------------------


def test_waits_for_enough_nodes_and_reason_counts_them() -> None:
    new, reason = plan(NOW, view(rec("a"), nnodes=3), CFG)
    assert new is None
    assert "1 of 3" in reason


def test_standby_only_nodes_do_not_count_towards_the_first_generation() -> None:
    new, reason = plan(NOW, view(rec("a"), rec("s", standby_only=True), nnodes=2), CFG)
    assert new is None
    assert "1 of 2" in reason


def test_first_generation_assigns_node_ranks_in_join_order() -> None:
    records = {n: rec(n) for n in ("a", "b", "c")}
    # "c" joined first, then "a", then "b": dict order must not matter, join_revision must.
    nodes = {
        "a": NodeView(records["a"], join_revision=20),
        "b": NodeView(records["b"], join_revision=30),
        "c": NodeView(records["c"], join_revision=5),
    }
    new, reason = plan(NOW, ClusterView(spec=spec(nnodes=3), nodes=nodes, generation=None), CFG)
    assert new is not None
    assert new.assignment == {"c": 0, "a": 1, "b": 2}
    assert list(new.assignment) == ["c", "a", "b"]
    assert new.number == 1
    assert new.status is GenerationStatus.RUNNING
    assert new.restart_count == 0
    assert new.nnodes == 3
    assert new.nproc_per_node == 2
    assert new.controller == "ctl"
    assert new.created_at == NOW
    assert new.reason == reason
    assert "3 node(s) joined" in reason


def test_first_generation_skips_standby_only_and_leaves_later_nodes_as_standbys() -> None:
    v = view(rec("s", standby_only=True), rec("a"), rec("b"), rec("late"), nnodes=2)
    new, _ = plan(NOW, v, CFG)
    assert new is not None
    assert new.assignment == {"a": 0, "b": 1}
    assert new.node_rank("s") is None
    assert new.node_rank("late") is None


def test_first_generation_ignores_nodes_not_waiting() -> None:
    new, reason = plan(NOW, view(rec("a"), rec("b", NodeState.STOPPING), nnodes=2), CFG)
    assert new is None
    assert "1 of 2" in reason


def test_master_address_and_port_come_from_the_rank_zero_node() -> None:
    new, _ = plan(NOW, view(rec("first", master_port=29511), rec("second", master_port=29522)), CFG)
    assert new is not None
    assert new.master_addr == "addr-first"
    assert new.master_port == 29511


def test_configured_master_port_overrides_the_advertised_one() -> None:
    cfg = PlannerConfig(controller="ctl", replace_timeout=60.0, master_port=40000)
    new, _ = plan(NOW, view(rec("a", master_port=29511), rec("b")), cfg)
    assert new is not None
    assert new.master_addr == "addr-a"
    assert new.master_port == 40000


# --- worker failures ----------------------------------------------------------------------------


def test_worker_failure_restarts_with_the_same_assignment() -> None:
    g = gen(4, {"a": 0, "b": 1}, restart_count=1)
    v = view(
        rec("a", NodeState.RUNNING, generation=4),
        rec("b", NodeState.FAILED, generation=4, exit_codes={"2": 1, "3": -9}),
        rec("spare", NodeState.STANDBY),
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.number == 5
    assert new.status is GenerationStatus.RUNNING
    assert new.assignment == {"a": 0, "b": 1}
    assert new.restart_count == 2
    assert new.master_addr == "addr-a"
    assert new.created_at == NOW
    assert "b" in reason
    assert "{'2': 1, '3': -9}" in reason
    assert "restart 2 of 3" in reason
    assert new.reason == reason


def test_failure_recorded_for_an_older_generation_is_ignored() -> None:
    g = gen(4, {"a": 0, "b": 1})
    v = view(rec("a", NodeState.RUNNING, generation=4), rec("b", NodeState.FAILED, generation=3), generation=g)
    new, reason = plan(NOW, v, CFG)
    assert new is None
    assert "generation 4 is running" in reason


def test_failure_with_restarts_exhausted_fails_the_job() -> None:
    g = gen(7, {"a": 0, "b": 1}, restart_count=3)
    v = view(
        rec("a", NodeState.FAILED, generation=7, exit_codes={"0": 2}),
        rec("b", NodeState.RUNNING, generation=7),
        max_restarts=3,
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.FAILED
    assert new.number == 7
    assert new.assignment == g.assignment
    assert new.reason == reason
    assert "a (exit codes {'0': 2})" in reason
    assert "all 3 restarts are used" in reason
    assert "failed" in reason


def test_failure_with_zero_max_restarts_fails_at_once() -> None:
    g = gen(1, {"a": 0, "b": 1})
    v = view(
        rec("a", NodeState.FAILED, generation=1, exit_codes={"0": 1}),
        rec("b", NodeState.RUNNING, generation=1),
        max_restarts=0,
        generation=g,
    )
    new, _ = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.FAILED


# --- success ------------------------------------------------------------------------------------


def test_all_nodes_succeeded_for_the_current_generation_means_success() -> None:
    g = gen(3, {"a": 0, "b": 1})
    v = view(
        rec("a", NodeState.SUCCEEDED, generation=3),
        rec("b", NodeState.SUCCEEDED, generation=3),
        rec("spare", NodeState.STANDBY),
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.SUCCEEDED
    assert new.number == 3
    assert "generation 3" in reason
    assert "succeeded" in reason


def test_success_for_an_older_generation_does_not_count() -> None:
    g = gen(3, {"a": 0, "b": 1})
    v = view(rec("a", NodeState.SUCCEEDED, generation=3), rec("b", NodeState.SUCCEEDED, generation=2), generation=g)
    new, reason = plan(NOW, v, CFG)
    assert new is None
    assert "generation 3 is running" in reason


def test_some_nodes_still_running_is_not_success() -> None:
    g = gen(3, {"a": 0, "b": 1})
    v = view(rec("a", NodeState.SUCCEEDED, generation=3), rec("b", NodeState.RUNNING, generation=3), generation=g)
    new, _ = plan(NOW, v, CFG)
    assert new is None


# --- lost nodes ---------------------------------------------------------------------------------


def test_lost_node_is_replaced_by_the_earliest_joined_spare_without_a_restart() -> None:
    g = gen(2, {"a": 0, "b": 1}, restart_count=1)
    v = view(
        rec("a", NodeState.RUNNING, generation=2),
        rec("busy", NodeState.RUNNING, generation=1),  # not a spare: not waiting/standby
        rec("early", NodeState.STANDBY),
        rec("late", NodeState.WAITING),
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.RUNNING
    assert new.number == 3
    assert new.assignment == {"a": 0, "early": 1}
    assert new.restart_count == 1
    assert "node(s) b lost" in reason
    assert "early takes node rank 1" in reason


def test_lost_rank_zero_moves_the_master_to_the_replacement() -> None:
    g = gen(2, {"a": 0, "b": 1})
    v = view(
        rec("b", NodeState.RUNNING, generation=2), rec("spare", NodeState.WAITING, master_port=29777), generation=g
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.assignment == {"spare": 0, "b": 1}
    assert new.master_addr == "addr-spare"
    assert new.master_port == 29777
    assert "spare takes node rank 0" in reason


def test_spare_order_follows_join_revision_not_dict_order() -> None:
    g = gen(2, {"a": 0, "b": 1})
    nodes = {
        "a": NodeView(rec("a", NodeState.RUNNING, generation=2), join_revision=1),
        "x": NodeView(rec("x", NodeState.STANDBY), join_revision=50),
        "y": NodeView(rec("y", NodeState.STANDBY), join_revision=40),
    }
    new, _ = plan(NOW, ClusterView(spec=spec(), nodes=nodes, generation=g), CFG)
    assert new is not None
    assert new.assignment == {"a": 0, "y": 1}


def test_stopping_node_counts_as_lost_and_is_not_a_spare() -> None:
    g = gen(2, {"a": 0, "b": 1})
    v = view(
        rec("a", NodeState.RUNNING, generation=2),
        rec("b", NodeState.STOPPING, generation=2),
        rec("spare", NodeState.STANDBY),
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.assignment == {"a": 0, "spare": 1}
    assert new.restart_count == 0
    assert "node(s) b lost" in reason


def test_several_lost_nodes_are_replaced_in_rank_and_join_order() -> None:
    g = gen(5, {"a": 0, "b": 1, "c": 2, "d": 3}, nnodes=4, restart_count=2)
    v = view(
        rec("b", NodeState.RUNNING, generation=5),
        rec("s1", NodeState.STANDBY),
        rec("s2", NodeState.WAITING),
        rec("s3", NodeState.STANDBY),
        rec("d", NodeState.RUNNING, generation=5),
        nnodes=4,
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.number == 6
    assert new.status is GenerationStatus.RUNNING
    assert new.assignment == {"s1": 0, "b": 1, "s2": 2, "d": 3}
    assert new.restart_count == 2
    assert "node(s) a, c lost" in reason
    assert "s1 takes node rank 0" in reason
    assert "s2 takes node rank 2" in reason
    assert "s3" not in reason


def test_lost_node_without_a_spare_waits_and_survivors_keep_their_ranks() -> None:
    g = gen(2, {"a": 0, "b": 1, "c": 2}, nnodes=3, restart_count=1)
    v = view(
        rec("a", NodeState.RUNNING, generation=2),
        rec("c", NodeState.RUNNING, generation=2),
        rec("gone", NodeState.STOPPING),  # present but stopping: no spare
        nnodes=3,
        generation=g,
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.WAITING
    assert new.number == 3
    assert new.assignment == {"a": 0, "c": 2}
    assert new.deadline == NOW + CFG.replace_timeout
    assert new.restart_count == 1
    assert new.created_at == NOW
    assert new.reason == reason
    assert "node(s) b lost" in reason
    assert "no standby is ready" in reason
    assert "60 s" in reason
    assert "[1]" in reason


def test_fewer_spares_than_lost_nodes_waits_without_partial_assignment() -> None:
    g = gen(2, {"a": 0, "b": 1, "c": 2}, nnodes=3)
    v = view(rec("a", NodeState.RUNNING, generation=2), rec("spare", NodeState.STANDBY), nnodes=3, generation=g)
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.WAITING
    assert new.assignment == {"a": 0}
    assert "[1, 2]" in reason


# --- the waiting generation --------------------------------------------------------------------


def waiting_gen() -> Generation:
    return gen(3, {"a": 0, "c": 2}, status=GenerationStatus.WAITING, nnodes=3, restart_count=1, deadline=NOW + 30)


def test_waiting_generation_is_filled_when_a_spare_appears() -> None:
    v = view(
        rec("a", NodeState.RESTARTING, generation=3),
        rec("c", NodeState.RESTARTING, generation=3),
        rec("new", NodeState.WAITING),
        nnodes=3,
        generation=waiting_gen(),
    )
    new, reason = plan(NOW, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.RUNNING
    assert new.number == 4
    assert new.assignment == {"a": 0, "new": 1, "c": 2}
    assert new.restart_count == 1
    assert new.master_addr == "addr-a"
    assert "new takes node rank 1" in reason
    assert "lost" not in reason


def test_waiting_generation_keeps_waiting_before_its_deadline() -> None:
    v = view(rec("a", NodeState.RESTARTING), rec("c", NodeState.RESTARTING), nnodes=3, generation=waiting_gen())
    new, reason = plan(NOW + 29, v, CFG)
    assert new is None
    assert "waiting for a node to take node rank(s) [1]" in reason


def test_waiting_generation_fails_past_its_deadline() -> None:
    g = waiting_gen()
    v = view(rec("a", NodeState.RESTARTING), rec("c", NodeState.RESTARTING), nnodes=3, generation=g)
    new, reason = plan(NOW + 30, v, CFG)
    assert new is not None
    assert new.status is GenerationStatus.FAILED
    assert new.number == g.number
    assert new.reason == reason
    assert "[1]" in reason
    assert "60 s" in reason
    assert "the job failed" in reason


# --- terminal generations -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [GenerationStatus.SUCCEEDED, GenerationStatus.FAILED])
def test_terminal_generation_plans_nothing(status: GenerationStatus) -> None:
    g = gen(9, {"a": 0, "b": 1}, status=status)
    # Even with a lost node and a failed node, a terminal generation stays as it is.
    v = view(rec("a", NodeState.FAILED, generation=9), rec("spare", NodeState.STANDBY), generation=g)
    new, reason = plan(NOW, v, CFG)
    assert new is None
    assert status.value in reason
    assert "nothing to do" in reason


def test_a_node_with_a_hardware_fault_gives_up_its_rank_and_is_never_a_spare() -> None:
    faulty = dataclasses.replace(rec("b", NodeState.FAILED, generation=1), fault="GPU 0 fell off the bus")
    current = gen(1, {"a": 0, "b": 1})
    # no other node: the job waits for one, and the faulty node does not fill its own rank
    new, reason = plan(NOW, view(rec("a", NodeState.RUNNING, generation=1), faulty, generation=current), CFG)
    assert new is not None and new.status is GenerationStatus.WAITING and "b lost" in reason
    # a standby takes the rank
    new, reason = plan(
        NOW, view(rec("a", NodeState.RUNNING, generation=1), faulty, rec("c", NodeState.STANDBY), generation=current),
        CFG,
    )  # fmt: skip
    assert new is not None and new.assignment == {"a": 0, "c": 1} and new.restart_count == 0


def test_a_node_whose_workers_failed_may_fill_a_lost_rank_in_a_restart() -> None:
    current = gen(2, {"a": 0, "c": 1})  # b left in generation 2, but its move failed
    new, _ = plan(NOW, view(rec("c", NodeState.RUNNING, generation=2), rec("b", NodeState.FAILED, generation=1),
                            generation=current), CFG)  # fmt: skip
    assert new is not None and new.assignment == {"b": 0, "c": 1} and new.status is GenerationStatus.RUNNING


def test_a_move_the_job_outran_ends_in_success() -> None:
    """The leaver's workers finished every step before the switch: nothing is left to move."""
    g = dataclasses.replace(gen(4, {"a": 0, "c": 1}), kind="migrate", leavers=["b"], joiners=["c"])
    done = (rec("a", NodeState.SUCCEEDED, generation=4), rec("b", NodeState.SUCCEEDED, generation=4))
    new, reason = plan(NOW, view(*done, rec("c", NodeState.RESTARTING, generation=4), generation=g), CFG)
    assert new is not None and new.status is GenerationStatus.SUCCEEDED, reason
    running = (rec("a", NodeState.RUNNING, generation=4), done[1], rec("c", NodeState.RESTARTING, generation=4))
    new, _ = plan(NOW, view(*running, generation=g), CFG)
    assert new is None or new.status is not GenerationStatus.SUCCEEDED, "a still trains: the job has not ended"


# --- a restart's barrier ------------------------------------------------------------------------


def test_a_restart_is_written_again_as_all_acked_once_every_assigned_node_acked() -> None:
    g = gen(4, {"a": 0, "b": 1})
    nodes = (rec("a", NodeState.RESTARTING, generation=4), rec("b", NodeState.RESTARTING, generation=4), rec("s"))
    some = dataclasses.replace(view(*nodes, generation=g), acked=frozenset({"a", "s"}))
    new, reason = plan(NOW, some, CFG)
    assert new is None and "generation 4 is running" in reason, "b has not acked: no worker may start"
    every = dataclasses.replace(some, acked=frozenset({"a", "b"}))
    new, reason = plan(NOW, every, CFG)
    assert new == dataclasses.replace(g, all_acked=True), "the same generation, its barrier passed"
    assert "every node of generation 4" in reason and new.reason == g.reason
    assert plan(NOW, dataclasses.replace(every, generation=new), CFG)[0] is None, "written once"


def test_a_node_lost_at_a_restarts_barrier_is_replaced_before_the_barrier_passes() -> None:
    g = gen(4, {"a": 0, "b": 1})
    v = dataclasses.replace(
        view(rec("a", NodeState.RESTARTING, generation=4), rec("s", NodeState.STANDBY), generation=g),
        acked=frozenset({"a", "b"}),  # b acked, then its lease went (its ack goes with it a moment later)
    )
    new, _ = plan(NOW, v, CFG)
    assert new is not None and new.number == 5 and new.assignment == {"a": 0, "s": 1} and not new.all_acked


# --- reasons do not grow with the job ------------------------------------------------------------


def test_reasons_name_a_few_nodes_and_count_the_rest() -> None:
    names = [f"n{i:03d}" for i in range(100)]
    first, reason = plan(NOW, view(*(rec(n) for n in names), nnodes=100), CFG)
    assert first is not None and len(first.assignment) == 100 and "n050" not in reason
    failed = [rec(n, NodeState.FAILED, generation=1, exit_codes={"0": 1}) for n in names]
    new, reason = plan(NOW, view(*failed, generation=first, nnodes=100), CFG)
    assert new is not None and new.number == 2 and "n015 (" in reason and "n016" not in reason
    assert "and 84 more" in reason and len(reason) < 1000
