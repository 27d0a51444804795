"""The agent's state machine: every state against every observation it can meet, decided purely."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import pytest

from rlaunch.agent.states import (
    EXIT_FAILED,
    SHUTDOWN_GRACE_S,
    STALE_GRACE_S,
    Acknowledge,
    AgentState,
    Decision,
    Emit,
    EtcdLost,
    Exit,
    Fenced,
    ForgetWorkers,
    IllegalTransition,
    Log,
    Look,
    MarkDrained,
    Need,
    Node,
    Observation,
    Offer,
    Publish,
    Published,
    ReapFailed,
    ReapSandbox,
    SandboxUse,
    Settled,
    Signalled,
    StartSandbox,
    StartWorkers,
    StopWorkers,
    WorkersExited,
)
from rlaunch.agent.transitions import SANDBOX_FAILED, decide
from rlaunch.store.records import Generation, GenerationStatus, NodeState

ME = "n1"
NPROC = 2
S = AgentState
RUNNING_STATES = (S.SANDBOX, S.ACTIVE, S.SETTLING, S.LEAVING)
IDLE_STATES = (S.IDLE, S.STARTING, S.LEAVING_DONE)
LIVE_STATES = RUNNING_STATES + IDLE_STATES


def gen(
    number: int = 5,
    *,
    status: GenerationStatus = GenerationStatus.RUNNING,
    assignment: dict[str, int] | None = None,
    kind: str = "restart",
    leavers: list[str] | None = None,
    joiners: list[str] | None = None,
    reason: str = "",
) -> Generation:
    return Generation(
        number=number, status=status, assignment={ME: 0, "n2": 1} if assignment is None else assignment,
        nnodes=2, nproc_per_node=NPROC, master_addr="127.0.0.1", master_port=29500, restart_count=0,
        reason=reason, controller="n2", created_at=0.0, kind=kind, leavers=leavers or [], joiners=joiners or [],
    )  # fmt: skip


def look(g: Generation | None, **kw: Any) -> Look:
    return Look(g, ME, NPROC, **kw)


def published(state: NodeState, generation: int = 5, **codes: int) -> Published:
    return Published(state, generation, codes)


def node(state: AgentState = S.IDLE, **kw: Any) -> Node:
    return Node(state=state, **kw)


def events(d: Decision) -> list[str]:
    return [a.name for a in d.actions if isinstance(a, Emit)]


def publishes(d: Decision) -> list[NodeState]:
    return [a.state for a in d.actions if isinstance(a, Publish)]


def of(d: Decision, kind: type) -> list[Any]:
    return [a for a in d.actions if isinstance(a, kind)]


def workers_run_after(before: AgentState, d: Decision) -> bool:
    """Whether workers run once the decision's actions are done, from the actions alone."""
    running = before.workers_run
    for a in d.actions:
        if isinstance(a, (StopWorkers, ForgetWorkers, ReapFailed, ReapSandbox)):
            running = False
        elif isinstance(a, (StartWorkers, StartSandbox)):
            running = True
    return running


# -- every state against every observation -------------------------------------------------------


def _observations() -> list[Observation]:
    migrate_me_leaving = gen(6, kind="migrate", assignment={"n3": 0, "n2": 1}, leavers=[ME], joiners=["n3"])
    migrate_me_joining = gen(6, kind="migrate", assignment={ME: 0, "n2": 1}, leavers=["n3"], joiners=[ME])
    replace_me_joining = gen(6, kind="replace", assignment={ME: 0, "n2": 1}, leavers=["n3"], joiners=[ME])
    replace_survivor = gen(6, kind="replace", assignment={ME: 0, "n2": 1}, leavers=["n3"], joiners=["n2"])
    no_ranks = gen(6, assignment={"n2": 0, "n3": 1})
    gens: list[Generation | None] = [
        None,
        gen(6),
        gen(6, status=GenerationStatus.WAITING),
        gen(6, status=GenerationStatus.SUCCEEDED),
        gen(6, status=GenerationStatus.FAILED),
        migrate_me_leaving,
        migrate_me_joining,
        replace_me_joining,
        replace_survivor,
        no_ranks,
    ]
    looks: list[Observation] = []
    gens += [dataclasses.replace(g, all_acked=True) for g in gens if g is not None]  # a restart's barrier passed
    for g, left, fault, rt in itertools.product(
        gens, (frozenset(), frozenset({0, 1})), ("", "ECC"), (None, True, False)
    ):
        looks.append(look(g, left=left, fault=fault, uses_runtime=rt, nodes_changed=True))
    all_codes: list[tuple[int | None, ...]] = [(None, None), (0, None), (0, 0), (1, None), (-9, 0)]
    exits: list[Observation] = [
        WorkersExited(codes, 6, left) for codes, left in itertools.product(all_codes, (frozenset(), frozenset({0, 1})))
    ]
    lost: list[Observation] = [EtcdLost(61.0, 60.0, state) for state in (None, *NodeState)]
    return [*looks, *exits, *lost, Settled(), Signalled("SIGTERM"), Fenced("etcd says its lease is gone")]


OBSERVATIONS = _observations()
NODES = [
    node(state, worker_gen=wg, acked_gen=ag, sandbox=sb, finished=fin)
    for state, wg, ag, sb, fin in itertools.product(LIVE_STATES, (0, 5, 6), (0, 6), tuple(SandboxUse), (False, True))
]


def _illegal(n: Node, obs: Observation) -> bool:
    if isinstance(obs, WorkersExited):
        return not n.state.workers_run
    if isinstance(obs, Settled):
        return n.state is not S.SETTLING
    return False


def test_every_state_takes_every_observation_it_can_and_keeps_its_workers_consistent() -> None:
    decided = 0
    for n, obs in itertools.product(NODES, OBSERVATIONS):
        if _illegal(n, obs):
            with pytest.raises(IllegalTransition):
                decide(n, obs)
            continue
        d = decide(n, obs)
        decided += 1
        # The state says whether workers run; the actions must agree with it.
        assert d.node.state.workers_run == workers_run_after(n.state, d), (n, obs, d)
        # An exit is the last action and only an exit leads to EXITED.
        assert (d.exit_code is not None) == (d.node.state is S.EXITED), (n, obs, d)
        if d.exit_code is not None:
            assert isinstance(d.actions[-1], Exit)
        # A read is asked for only when it was not given.
        if d.need is Need.RUNTIME:
            assert isinstance(obs, Look) and obs.uses_runtime is None
        # Deciding is pure: the same question gets the same answer.
        assert decide(n, obs) == d
    assert decided > 10_000


@pytest.mark.parametrize("obs", [look(gen()), WorkersExited((0,), 5), Settled(), Signalled("SIGINT"), Fenced("x")])
def test_an_exited_agent_takes_nothing(obs: Observation) -> None:
    with pytest.raises(IllegalTransition, match="has exited"):
        decide(node(S.EXITED), obs)


@pytest.mark.parametrize("state", IDLE_STATES)
def test_workers_cannot_exit_where_none_run(state: AgentState) -> None:
    with pytest.raises(IllegalTransition, match=f"No workers run in state {state.value}"):
        decide(node(state), WorkersExited((1,), 5))


@pytest.mark.parametrize("state", [s for s in LIVE_STATES if s is not S.SETTLING])
def test_only_a_settling_node_settles(state: AgentState) -> None:
    with pytest.raises(IllegalTransition, match="Only a settling node"):
        decide(node(state), Settled())


# -- signals, fencing, the job's end -------------------------------------------------------------


@pytest.mark.parametrize("state", [S.ACTIVE, S.SETTLING, S.LEAVING])
def test_training_workers_are_never_stopped_for_an_etcd_outage_alone(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), EtcdLost(3600.0, 60.0, NodeState.RUNNING))
    assert d.node.state is state and not d.actions


@pytest.mark.parametrize(
    ("state", "published", "code", "says"),
    [
        (S.IDLE, NodeState.SUCCEEDED, 0, "this node's workers succeeded"),
        (S.IDLE, NodeState.FAILED, EXIT_FAILED, "this node's workers failed"),
        (S.SANDBOX, NodeState.STANDBY, EXIT_FAILED, "is a standby"),
        (S.STARTING, NodeState.RESTARTING, EXIT_FAILED, "waits for a restart"),
        (S.LEAVING_DONE, NodeState.DRAINING, 0, "handed their ranks over"),
        (S.LEAVING_DONE, NodeState.FAILED, EXIT_FAILED, "this node's workers failed"),
    ],
)
def test_with_no_training_workers_an_agent_ends_once_etcd_is_gone_for_the_rdzv_timeout(
    state: AgentState, published: NodeState, code: int, says: str
) -> None:
    d = decide(node(state, worker_gen=5), EtcdLost(61.0, 60.0, published))
    assert d.node.state is S.EXITED and d.exit_code == code
    (line,) = of(d, Log)
    assert says in line.message and "outcome could not be recorded" in line.message and "61 s" in line.message
    assert of(d, StopWorkers) == [StopWorkers(SHUTDOWN_GRACE_S, 5)], "a standby's sandbox workers are stopped"


@pytest.mark.parametrize("state", LIVE_STATES)
def test_a_signal_stops_the_workers_with_grace_and_exits_1(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), Signalled("SIGTERM"))
    assert d.node.state is S.EXITED and d.exit_code == EXIT_FAILED
    assert events(d) == ["agent_signalled"]
    assert of(d, Publish) == [Publish(NodeState.STOPPING, 5, best_effort=True)]
    assert of(d, StopWorkers) == [StopWorkers(SHUTDOWN_GRACE_S, 5)]


@pytest.mark.parametrize("state", LIVE_STATES)
def test_a_fenced_node_kills_its_workers_at_once_and_exits_1(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), Fenced("its lease is gone"))
    assert d.node.state is S.EXITED and d.exit_code == EXIT_FAILED
    assert events(d) == ["fenced"] and of(d, Emit)[0].fields == {"reason": "its lease is gone"}
    assert of(d, StopWorkers) == [StopWorkers(STALE_GRACE_S, 5)]
    assert not of(d, Publish)


@pytest.mark.parametrize("state", LIVE_STATES)
@pytest.mark.parametrize(("status", "code"), [(GenerationStatus.SUCCEEDED, 0), (GenerationStatus.FAILED, EXIT_FAILED)])
def test_a_terminal_generation_stops_the_workers_and_exits(
    state: AgentState, status: GenerationStatus, code: int
) -> None:
    d = decide(node(state, worker_gen=5), look(gen(6, status=status, reason="out of restarts")))
    assert d.exit_code == code and d.node.state is S.EXITED
    assert of(d, StopWorkers) == [StopWorkers(SHUTDOWN_GRACE_S, 5)]


@pytest.mark.parametrize("state", LIVE_STATES)
def test_no_generation_yet_means_nothing_to_do(state: AgentState) -> None:
    n = node(state)
    assert decide(n, look(None)) == Decision(n)


# -- a hardware fault ----------------------------------------------------------------------------


@pytest.mark.parametrize("state", LIVE_STATES)
def test_a_faulty_node_stops_its_workers_and_says_failed_once(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), look(gen(6), fault="GPU 0 fell off the bus"))
    assert not d.node.state.workers_run and of(d, StopWorkers)
    assert publishes(d) == [NodeState.FAILED]
    assert of(d, Publish)[0].failure == ("fault", "GPU 0 fell off the bus"), "its failure is the fault"
    again = decide(d.node, look(gen(6), fault="GPU 0 fell off the bus", published=published(NodeState.FAILED, 6)))
    assert publishes(again) == []


# -- restarts ------------------------------------------------------------------------------------


def test_a_restart_stops_acknowledges_and_waits_for_every_ack() -> None:
    d = decide(node(S.ACTIVE, worker_gen=5, acked_gen=4), look(gen(6)))
    assert d.actions == (
        StopWorkers(SHUTDOWN_GRACE_S, 5),
        Publish(NodeState.RESTARTING, 6),
        Acknowledge(6, 4),
    )
    assert d.node == node(S.STARTING, worker_gen=5, acked_gen=6)
    assert d.need is None, "it reads no acks: the controller says when all are in"
    # The ack is taken as done only after etcd has it: a failed put is tried again.
    ack_step = d.steps[-1]
    assert isinstance(ack_step.action, Acknowledge) and ack_step.node.acked_gen == 4


def test_a_restart_starts_the_workers_once_the_generation_says_every_assigned_node_acked() -> None:
    n = node(S.STARTING, worker_gen=5, acked_gen=6)
    assert decide(n, look(gen(6))) == Decision(n)
    acked = dataclasses.replace(gen(6), all_acked=True)
    d = decide(n, look(acked))
    assert d.actions == (StartWorkers(acked), Publish(NodeState.RUNNING, 6))
    assert d.node == node(S.ACTIVE, worker_gen=6, acked_gen=6)


def test_a_node_that_first_sees_a_restart_past_its_barrier_still_stops_and_acks_before_it_starts() -> None:
    acked = dataclasses.replace(gen(6), all_acked=True)
    d = decide(node(S.ACTIVE, worker_gen=5, acked_gen=4), look(acked))
    assert [type(a) for a in d.actions] == [StopWorkers, Publish, Acknowledge, StartWorkers, Publish]


def test_a_warm_standby_given_ranks_in_a_restart_stops_its_sandbox_for_good() -> None:
    d = decide(node(S.SANDBOX, sandbox=SandboxUse.USED), look(dataclasses.replace(gen(6), all_acked=True)))
    assert d.node.state is S.ACTIVE and d.node.sandbox is SandboxUse.USED
    assert [type(a) for a in d.actions] == [StopWorkers, Publish, Acknowledge, StartWorkers, Publish]


def test_a_migration_to_a_node_without_workers_is_a_restart_for_it() -> None:
    g = gen(6, kind="migrate", leavers=["n3"], joiners=[ME])
    d = decide(node(S.IDLE), look(g))
    assert of(d, Acknowledge) == [Acknowledge(6, 0)] and d.node.state is S.STARTING


@pytest.mark.parametrize("state", [S.IDLE, S.ACTIVE, S.SETTLING])
def test_workers_of_this_generation_are_left_to_the_controller(state: AgentState) -> None:
    n = node(state, worker_gen=6)
    assert decide(n, look(gen(6))) == Decision(n)


# -- migrations ----------------------------------------------------------------------------------


def test_a_warm_standby_joins_a_migration_with_its_workers() -> None:
    g = gen(6, kind="migrate", leavers=["n3"], joiners=[ME])
    d = decide(node(S.SANDBOX, sandbox=SandboxUse.USED), look(g))
    assert d.actions[0] == Offer(g, "joiner") and events(d) == ["migration_offered"]
    assert of(d, Emit)[0].fields["role"] == "joiner"
    assert publishes(d) == [NodeState.RESTARTING]
    assert d.node == node(S.SETTLING, worker_gen=6, sandbox=SandboxUse.USED)


@pytest.mark.parametrize("state", [S.ACTIVE, S.SETTLING])
def test_a_survivor_keeps_its_workers_through_a_migration(state: AgentState) -> None:
    g = gen(6, kind="migrate", leavers=["n3"], joiners=["n4"], assignment={ME: 0, "n4": 1})
    d = decide(node(state, worker_gen=5), look(g))
    assert d.actions[0] == Offer(g, "survivor") and publishes(d) == [NodeState.RUNNING]
    assert d.node == node(S.ACTIVE, worker_gen=6)


def test_a_settling_node_is_running_once_its_workers_joined() -> None:
    d = decide(node(S.SETTLING, worker_gen=6), Settled())
    assert d.actions == (Publish(NodeState.RUNNING, 6),) and d.node.state is S.ACTIVE


# -- replacements --------------------------------------------------------------------------------


def replacement(joiners: list[str]) -> Generation:
    return gen(6, kind="replace", leavers=["n3"], joiners=joiners)


def test_a_warm_joiner_takes_the_replaced_ranks_with_its_sandbox_workers() -> None:
    g = replacement([ME])
    d = decide(node(S.SANDBOX, sandbox=SandboxUse.USED), look(g))
    assert d.actions[0] == Offer(g, "joiner") and not of(d, StopWorkers)
    assert events(d) == ["replacement_offered"] and publishes(d) == [NodeState.RESTARTING]
    assert d.node.state is S.SETTLING and d.node.worker_gen == 6


@pytest.mark.parametrize("state", [S.IDLE, S.ACTIVE])
def test_a_joiner_without_a_sandbox_restarts_in_place_through_one(state: AgentState) -> None:
    g = replacement([ME])
    d = decide(node(state, worker_gen=5, sandbox=SandboxUse.FAILED), look(g))
    assert [type(a) for a in d.actions][:3] == [StopWorkers, StartSandbox, Offer]
    assert d.node.state is S.SETTLING and d.node.sandbox is SandboxUse.FAILED  # (a failed sandbox stays known)


def test_a_survivor_recovers_in_place_through_a_replacement_and_publishes_once_when_it_did() -> None:
    """Its record goes from running at the last generation to running at this one, with the offer (which
    waits for it) and its workers' reports: one request per node at a fault (8,190 fewer at 4,096 nodes)."""
    g = replacement(["n4"])
    d = decide(node(S.ACTIVE, worker_gen=5), look(g))
    assert d.actions[0] == Offer(g, "survivor") and publishes(d) == []
    assert [(a.name, a.with_record) for a in of(d, Emit)] == [("replacement_offered", True)]
    assert d.node == node(S.SETTLING, worker_gen=6)
    settled = decide(d.node, Settled())
    assert publishes(settled) == [NodeState.RUNNING] and of(settled, Publish)[0].generation == 6
    assert settled.node.state is S.ACTIVE


@pytest.mark.parametrize("state", [S.IDLE, S.SANDBOX])
def test_a_survivor_whose_workers_ended_reports_failed_with_their_codes(state: AgentState) -> None:
    d = decide(
        node(state, worker_gen=5, sandbox=SandboxUse.USED),
        look(replacement(["n4"]), published=published(NodeState.FAILED, 5, **{"0": 1})),
    )
    assert of(d, StopWorkers) == [StopWorkers(SHUTDOWN_GRACE_S, 6)]  # (said in the replacement's generation)
    assert of(d, Publish) == [Publish(NodeState.FAILED, 6, exit_codes={"0": 1})]
    assert d.node.state is S.IDLE and d.node.worker_gen == 6


def test_a_replacement_never_names_its_leavers_to_leave() -> None:
    g = gen(6, kind="replace", leavers=[ME], joiners=["n3"], assignment={"n3": 0, "n2": 1})
    d = decide(node(S.IDLE, worker_gen=5), look(g, nodes_changed=False))
    assert not of(d, MarkDrained) and publishes(d) == [NodeState.STANDBY]


# -- standing by ---------------------------------------------------------------------------------

NO_RANKS = gen(6, assignment={"n2": 0, "n3": 1})


def test_a_node_left_without_ranks_kills_its_stale_workers_at_once() -> None:
    d = decide(node(S.ACTIVE, worker_gen=5), look(NO_RANKS, nodes_changed=False))
    assert of(d, StopWorkers) == [StopWorkers(STALE_GRACE_S, 5)] and of(d, Log)[0].level == logging.ERROR
    assert publishes(d) == [NodeState.STANDBY]


def test_a_waiting_generation_stops_a_ranked_node_with_grace_and_says_restarting() -> None:
    d = decide(node(S.ACTIVE, worker_gen=5), look(gen(6, status=GenerationStatus.WAITING)))
    assert of(d, StopWorkers) == [StopWorkers(SHUTDOWN_GRACE_S, 5)]
    assert publishes(d) == [NodeState.RESTARTING] and d.node.state is S.IDLE


def test_a_standby_asks_whether_the_job_uses_the_runtime_when_node_records_changed() -> None:
    d = decide(node(S.IDLE), look(NO_RANKS, nodes_changed=True))
    assert d == Decision(node(S.IDLE), need=Need.RUNTIME)
    warm = decide(node(S.IDLE), look(NO_RANKS, uses_runtime=True))
    assert warm.actions == (StartSandbox(NO_RANKS), Publish(NodeState.WARMING, 6))
    assert warm.node == node(S.SANDBOX, sandbox=SandboxUse.USED)
    cold = decide(node(S.IDLE), look(NO_RANKS, uses_runtime=False))
    assert cold.actions == (Publish(NodeState.STANDBY, 6),)


def test_a_standby_is_warming_until_every_sandbox_worker_warmed_up() -> None:
    n = node(S.SANDBOX, sandbox=SandboxUse.USED)
    assert publishes(decide(n, look(NO_RANKS, warm=1))) == [NodeState.WARMING]
    assert publishes(decide(n, look(NO_RANKS, warm=2))) == [NodeState.STANDBY]
    assert publishes(decide(n, look(NO_RANKS, warm=2, published=published(NodeState.STANDBY, 6)))) == []


def test_a_standby_starts_its_sandbox_once_only() -> None:
    for used in (SandboxUse.USED, SandboxUse.SPENT, SandboxUse.FAILED):
        d = decide(node(S.IDLE, sandbox=used), look(NO_RANKS, nodes_changed=True))
        assert d.need is None and not of(d, StartSandbox)


def test_a_standby_whose_sandbox_was_stopped_unwarmed_stays_warming() -> None:
    d = decide(node(S.IDLE, sandbox=SandboxUse.SPENT), look(NO_RANKS, warm=0))
    assert publishes(d) == [NodeState.WARMING]


def test_a_standby_whose_sandbox_failed_says_failed() -> None:
    d = decide(node(S.IDLE, sandbox=SandboxUse.FAILED), look(NO_RANKS))
    assert publishes(d) == [NodeState.FAILED]
    assert [a.failure for a in of(d, Publish)] == [SANDBOX_FAILED], "rlaunch status says why"


# -- leaving -------------------------------------------------------------------------------------

LEAVE = gen(6, kind="migrate", assignment={"n3": 0, "n2": 1}, leavers=[ME], joiners=["n3"])


def test_a_leaver_offers_its_workers_the_move_and_waits_for_their_state_to_go() -> None:
    d = decide(node(S.ACTIVE, worker_gen=5), look(LEAVE))
    assert d.actions == (
        Publish(NodeState.DRAINING, 6),
        Offer(LEAVE, "leaver"),
        Emit("migration_offered", 6, {"role": "leaver", "joiners": ["n3"]}),
    )
    assert d.node == node(S.LEAVING, worker_gen=5)
    assert decide(d.node, look(LEAVE, left=frozenset({0}))) == Decision(d.node)


@pytest.mark.parametrize("state", [S.LEAVING, S.LEAVING_DONE])
def test_a_leaver_whose_workers_all_sent_their_state_is_drained_and_exits_0(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), look(LEAVE, left=frozenset({0, 1})))
    assert d.exit_code == 0 and d.node.state is S.EXITED
    assert of(d, MarkDrained) == [MarkDrained(6, "n3")] and publishes(d) == [NodeState.DRAINED]
    assert events(d) == ["drained"]
    assert bool(of(d, StopWorkers)) == (state is S.LEAVING)
    # The mark and the record must be in etcd before the node counts as drained.
    mark = next(s for s in d.steps if isinstance(s.action, MarkDrained))
    assert mark.node.state is S.LEAVING_DONE


def test_a_leaver_whose_workers_finished_the_job_first_makes_the_move_moot() -> None:
    d = decide(node(S.LEAVING_DONE, worker_gen=5, finished=True), look(LEAVE))
    assert events(d) == ["migration_moot"] and publishes(d) == [NodeState.SUCCEEDED]
    assert d.node == node(S.IDLE, worker_gen=5, finished=True, move_ended_in=6)
    # The controller ends the job: the node waits, and is never offered that move again.
    after = decide(d.node, look(LEAVE, published=published(NodeState.SUCCEEDED, 6)))
    assert after == Decision(d.node)


def test_a_leaver_whose_workers_failed_before_sending_stays_as_a_node_without_ranks() -> None:
    d = decide(node(S.LEAVING_DONE, worker_gen=5), look(LEAVE, left=frozenset({0})))
    assert events(d) == ["migration_failed"] and of(d, Emit)[0].fields == {"sent": [0]}
    assert d.node == node(S.IDLE, worker_gen=5, move_ended_in=6)
    # Not re-offered as the leaver of the same generation: it stands by instead.
    again = decide(d.node, look(LEAVE, left=frozenset({0}), nodes_changed=False))
    assert publishes(again) == [NodeState.STANDBY] and not of(again, MarkDrained)


def test_a_leaver_of_a_restart_stops_its_workers_and_is_drained() -> None:
    g = gen(6, assignment={"n3": 0, "n2": 1}, leavers=[ME], joiners=["n3"])
    d = decide(node(S.ACTIVE, worker_gen=5), look(g))
    assert [type(a) for a in d.actions] == [Publish, StopWorkers, MarkDrained, Publish, Emit, Log, Exit]
    assert d.exit_code == 0


def test_a_fresh_agent_named_as_an_old_leaver_is_just_a_standby() -> None:
    d = decide(node(S.IDLE), look(LEAVE, nodes_changed=False))
    assert publishes(d) == [NodeState.STANDBY] and not of(d, MarkDrained)


@pytest.mark.parametrize(("state", "after"), [(S.LEAVING, S.ACTIVE), (S.LEAVING_DONE, S.IDLE)])
def test_a_newer_generation_without_the_move_abandons_it(state: AgentState, after: AgentState) -> None:
    d = decide(node(state, worker_gen=6), look(gen(7)))
    assert events(d)[0] == "migration_abandoned" and d.steps[0].node.state is after


# -- workers exiting -----------------------------------------------------------------------------


def test_sandbox_workers_that_exit_make_a_failed_standby() -> None:
    d = decide(node(S.SANDBOX, sandbox=SandboxUse.USED), WorkersExited((1, None), 7))
    assert d.actions[0] == ReapSandbox() and events(d) == ["sandbox_failed"]
    assert of(d, Publish) == [Publish(NodeState.FAILED, 7, {"0": 1}, SANDBOX_FAILED)]
    assert d.node == node(S.IDLE, sandbox=SandboxUse.FAILED)
    assert all(s.node.sandbox is SandboxUse.FAILED for s in d.steps)  # (kept even if etcd misses the record)


@pytest.mark.parametrize("state", RUNNING_STATES)
def test_workers_still_running_are_left_alone(state: AgentState) -> None:
    n = node(state, worker_gen=5)
    assert decide(n, WorkersExited((None, None), 5)) == Decision(n)
    if state is not S.SANDBOX:
        assert decide(n, WorkersExited((0, None), 5)) == Decision(n)


@pytest.mark.parametrize(("left", "finished"), [(frozenset({0, 1}), False), (frozenset({0}), True)])
def test_a_leavers_workers_exiting_0_end_its_leaving(left: frozenset[int], finished: bool) -> None:
    d = decide(node(S.LEAVING, worker_gen=5), WorkersExited((0, 0), 6, left))
    assert d.actions == (ForgetWorkers(),)
    assert d.node == node(S.LEAVING_DONE, worker_gen=5, finished=finished)


@pytest.mark.parametrize(
    ("codes", "hung", "unrecoverable", "failure"),
    [
        ((1, 0), (), "", "exit"),
        ((-9, None), (), "", "signal"),
        ((-9, 0), ("local rank 0 made no progress for 60 s",), "", "hang"),
        ((1, 1), (), "no replica holds rank 3's shards", "refused"),
    ],
)
@pytest.mark.parametrize("state", [S.ACTIVE, S.SETTLING, S.LEAVING])
def test_failed_workers_are_reaped_and_their_failure_is_classified(
    state: AgentState, codes: tuple[int | None, ...], hung: tuple[str, ...], unrecoverable: str, failure: str
) -> None:
    d = decide(node(state, worker_gen=5), WorkersExited(codes, 6, hung=hung, unrecoverable=unrecoverable))
    exit_codes = {str(i): c for i, c in enumerate(codes) if c}
    assert d.actions[0] == ReapFailed(5, exit_codes)
    (pub,) = of(d, Publish)
    assert (pub.state, pub.generation, pub.exit_codes, pub.failure[0]) == (NodeState.FAILED, 5, exit_codes, failure)
    assert d.node.state is (S.LEAVING_DONE if state is S.LEAVING else S.IDLE)


@pytest.mark.parametrize("state", [S.ACTIVE, S.SETTLING])
def test_workers_that_all_exit_0_succeeded(state: AgentState) -> None:
    d = decide(node(state, worker_gen=5), WorkersExited((0, 0), 5))
    assert d.actions == (ForgetWorkers(), Emit("workers_succeeded", 5), Publish(NodeState.SUCCEEDED, 5))
    assert d.node == node(S.IDLE, worker_gen=5)


def test_a_failed_sends_message_names_the_codes() -> None:
    d = decide(node(S.ACTIVE, worker_gen=5), WorkersExited((3, 0), 5))
    (pub,) = of(d, Publish)
    assert pub.failure == ("exit", "worker(s) failed with exit codes {'0': 3} (by local rank)")


def test_nodes_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        node().state = S.ACTIVE  # type: ignore[misc]


@pytest.mark.parametrize("state", [S.ACTIVE, S.SETTLING])
def test_workers_that_exit_on_a_faulty_node_failed_of_the_fault(state: AgentState) -> None:
    """A suspect worker (silent data corruption) exits non-zero after its report: its failure is the fault."""
    fault = "rank 3's parameters differ from its replicas' at step 40"
    d = decide(node(state, worker_gen=5), WorkersExited((3, None), 5, hung=("x",), fault=fault))
    assert d.actions[0] == ReapFailed(5, {"0": 3})
    (pub,) = of(d, Publish)
    assert (pub.state, pub.failure) == (NodeState.FAILED, ("fault", fault))
    look_after = decide(d.node, look(gen(5), fault=fault, published=Published(NodeState.FAILED, 5, {"0": 3})))
    assert of(look_after, Publish) == [] and look_after.node.state is S.IDLE, "recorded once; it stays out"
