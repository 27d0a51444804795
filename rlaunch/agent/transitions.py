"""The node agent's state machine: a pure decision of what to do on each observation.

:func:`decide` takes the agent's :class:`~rlaunch.agent.states.Node` (its
:class:`~rlaunch.agent.states.AgentState` and what it remembers across states) and one
observation; it returns a :class:`~rlaunch.agent.states.Decision`: the steps to carry out (typed
actions, each with the node as it stands from the moment the action runs) and the node after the
last. It does no I/O and reads no clock; :mod:`rlaunch.agent.agent` carries the actions out. When
a decision needs a read from etcd to go on (whether the job uses the runtime), it says so in
``Decision.need``; the agent reads and decides again with the answer.

Observations: ``Look`` (bring the node in line with the current generation; made on every loop
round), ``WorkersExited``, ``Settled`` (a move's workers all joined or recovered), ``Signalled``,
``Fenced``, ``EtcdLost`` (no etcd member answered for ``--rdzv-timeout``). An observation a state
cannot take raises
:class:`~rlaunch.agent.states.IllegalTransition`.

==============  =====================  ==================================================================
state           observation            next state (actions)
==============  =====================  ==================================================================
any             Signalled              exited (stop with grace, record ``stopping``, exit 1)
any             Fenced                 exited (kill at once, exit 1)
training        EtcdLost               no change: training workers are never stopped for an outage alone
other           EtcdLost               exited (stop a sandbox; exit 0 if its workers succeeded or handed
                                       their ranks over, else 1)
any             Look: job ended        exited (stop, exit 0 or 1)
any             Look: fault            idle (stop, record ``failed``): a GPU fault, or suspected SDC
idle            Look: restart, ranks   starting (record ``restarting``, ack)
starting        Look: all acked        active (start workers, record ``running``): the controller wrote
                                       the generation again once every assigned node had acked
idle            Look: no ranks         sandbox if the job uses the runtime and no sandbox ran yet
                                       (read node records when they changed), else idle; record
                                       ``warming`` / ``standby`` / ``failed`` (its sandbox died)
sandbox         Look: migrate, joiner  settling (offer ``joiner``, record ``restarting``)
sandbox         Look: replace, joiner  settling (offer ``joiner``, record ``restarting``)
idle, active    Look: replace, joiner  settling (stop, fresh sandbox, offer ``joiner``)
active          Look: migrate          active (offer ``survivor``, record ``running``)
active          Look: replace          settling (offer ``survivor``; the record stays ``running`` at the last)
idle, sandbox   Look: replace, ranks   idle (stop; record ``failed`` with the last exit codes)
active          Look: no ranks         idle (kill at once: its ranks belong to others)
active          Look: waiting, ranks   idle (stop with grace, record ``restarting``)
active, sandbox Look: restart          starting (stop, record ``restarting``, ack)
settling        Settled                active (record ``running`` at the new generation)
active          Look: leaver, migrate  leaving (record ``draining``, offer ``leaver``)
active, idle    Look: leaver, restart  leaving_done (record ``draining``, stop)
leaving         Look: all state sent   leaving_done (stop), then as below
leaving_done    Look: all state sent   exited (``drained/`` mark, record ``drained``, exit 0)
leaving_done    Look: workers finished idle, move ended here (moot: record ``succeeded``)
leaving_done    Look: state not sent   idle, move ended here (``migration_failed``)
leaving(_done)  Look: not a leaver     active / idle (``migration_abandoned``)
sandbox         WorkersExited          idle, sandbox failed (record ``failed``)
leaving         WorkersExited all 0    leaving_done (finished if not all state was sent)
running         WorkersExited, failed  idle / leaving_done (reap, record ``failed``: fault, hang,
                                       refused, signal or exit)
active/settling WorkersExited all 0    idle (record ``succeeded``)
exited          anything               IllegalTransition
not running     WorkersExited          IllegalTransition
not settling    Settled                IllegalTransition
==============  =====================  ==================================================================

A node whose move ended in generation ``n`` (``move_ended_in``) is never offered as that
generation's leaver again, and a fresh agent named as an old leaver (no workers ever) just
stands by. A replacement never names its leavers to leave: they failed, and stay as spares.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from rlaunch.agent.states import (
    EXIT_FAILED,
    SHUTDOWN_GRACE_S,
    STALE_GRACE_S,
    Acknowledge,
    Action,
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
    ReapFailed,
    ReapSandbox,
    SandboxUse,
    Settled,
    Signalled,
    StartSandbox,
    StartWorkers,
    Step,
    StopWorkers,
    WorkersExited,
)
from rlaunch.store.records import Generation, GenerationStatus, NodeState

#: what a standby whose sandbox failed says on its record (and so in rlaunch status)
SANDBOX_FAILED = (
    "exit",
    "its sandbox workers exited (its log says why), so this standby is not warm and takes no ranks; fix what "
    "the script does in a sandbox (docs/operations.md: Warm standbys), then restart the agent",
)


class _Plan:
    """Builds a decision: ``set`` changes the node, ``do`` adds actions taken with the node as set."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.steps: list[Step] = []
        self.need: Need | None = None

    def set(self, **changes: Any) -> None:
        self.node = dataclasses.replace(self.node, **changes)

    def do(self, *actions: Action) -> None:
        self.steps.extend(Step(a, self.node) for a in actions)

    def stop(self, grace: float = SHUTDOWN_GRACE_S, event_gen: int | None = None) -> None:
        """Stop the workers (if any run): the node is idle, a sandbox stopped before use is spent."""
        if self.node.state is AgentState.SANDBOX and self.node.sandbox is SandboxUse.USED:
            self.set(sandbox=SandboxUse.SPENT)
        if self.node.state.workers_run:
            self.set(state=AgentState.LEAVING_DONE if self.node.state is AgentState.LEAVING else AgentState.IDLE)
        self.do(StopWorkers(grace, self.node.worker_gen if event_gen is None else event_gen))

    def start_sandbox(self, gen: Generation) -> None:
        if self.node.sandbox is not SandboxUse.FAILED:
            self.set(sandbox=SandboxUse.USED)
        self.set(state=AgentState.SANDBOX)
        self.do(StartSandbox(gen))

    def decision(self) -> Decision:
        return Decision(self.node, tuple(self.steps), self.need)


# -- the decision ---------------------------------------------------------------------------------


def decide(node: Node, obs: Observation) -> Decision:
    """What to do on ``obs`` in ``node`` (pure); raises :class:`IllegalTransition` when it cannot be taken."""
    if node.state is AgentState.EXITED:
        raise IllegalTransition(f"The agent has exited; it cannot take {type(obs).__name__} any more.")
    if isinstance(obs, Signalled):
        return _on_signal(node, obs)
    if isinstance(obs, Fenced):
        return _on_fenced(node, obs)
    if isinstance(obs, EtcdLost):
        return _on_etcd_lost(node, obs)
    if isinstance(obs, Look):
        return _on_look(node, obs)
    if isinstance(obs, WorkersExited):
        return _on_exit(node, obs)
    if isinstance(obs, Settled):
        return _on_settled(node)
    raise IllegalTransition(f"Unknown observation {obs!r}.")


def _on_signal(node: Node, obs: Signalled) -> Decision:
    p = _Plan(node)
    p.do(
        Log(logging.WARNING, f"received {obs.signal}; stopping its workers"),
        Emit("agent_signalled", node.worker_gen, {"signal": obs.signal}),
        Publish(NodeState.STOPPING, node.worker_gen, best_effort=True),
    )
    p.stop()
    p.set(state=AgentState.EXITED)
    p.do(Exit(EXIT_FAILED))
    return p.decision()


def _on_fenced(node: Node, obs: Fenced) -> Decision:
    p = _Plan(node)
    p.do(Log(logging.ERROR, obs.reason), Emit("fenced", node.worker_gen, {"reason": obs.reason}))
    p.stop(STALE_GRACE_S)
    p.set(state=AgentState.EXITED)
    p.do(Exit(EXIT_FAILED))
    return p.decision()


def _on_etcd_lost(node: Node, obs: EtcdLost) -> Decision:
    """etcd gone for ``--rdzv-timeout``: a node with training workers waits on (they need no etcd);
    one whose workers all exited, or a standby, has nothing left to do and ends with its own result."""
    p = _Plan(node)
    if node.state.workers_run and node.state is not AgentState.SANDBOX:
        return p.decision()
    code = EXIT_FAILED
    if obs.published is NodeState.FAILED:
        mine = "this node's workers failed"
    elif obs.published is NodeState.SUCCEEDED:
        code, mine = 0, "this node's workers succeeded"
    elif node.state is AgentState.LEAVING_DONE:
        code, mine = 0, "this node's workers handed their ranks over (a drain) or finished"
    else:
        mine = "no worker of this node trains (it is a standby, or waits for a restart)"
    p.stop()
    p.set(state=AgentState.EXITED)
    p.do(
        Log(
            logging.ERROR,
            f"No etcd member has answered for {obs.unreachable_s:.0f} s (--rdzv-timeout {obs.timeout:.0f} s) and "
            f"{mine}, so this agent exits {code}: the job's outcome could not be recorded in etcd. Read the other "
            "nodes' logs for it, or run rlaunch status once etcd is back.",
        ),
        Exit(code),
    )
    return p.decision()


def _on_settled(node: Node) -> Decision:
    if node.state is not AgentState.SETTLING:
        raise IllegalTransition(f"Only a settling node's workers can settle; this node is {node.state.value}.")
    p = _Plan(node)
    p.set(state=AgentState.ACTIVE)
    p.do(Publish(NodeState.RUNNING, node.worker_gen))
    return p.decision()


def _on_exit(node: Node, obs: WorkersExited) -> Decision:
    """Workers exited (some or all): a failed sandbox, a leaver's end, a failure or a success."""
    if not node.state.workers_run:
        raise IllegalTransition(f"No workers run in state {node.state.value}, so none can exit.")
    codes = obs.codes
    p = _Plan(node)
    if node.state is AgentState.SANDBOX:
        if all(c is None for c in codes):
            return p.decision()
        p.set(state=AgentState.IDLE, sandbox=SandboxUse.FAILED)
        named = {str(i): c for i, c in enumerate(codes)}
        p.do(
            ReapSandbox(),
            Log(logging.ERROR, f"sandbox workers exited (codes {list(codes)}); this standby is not warm"),
            Emit("sandbox_failed", node.worker_gen, {"codes": named}),
        )
        exited = {k: c for k, c in named.items() if c is not None}
        p.do(Publish(NodeState.FAILED, obs.generation, exited, SANDBOX_FAILED))
        return p.decision()
    if node.state is AgentState.LEAVING and all(c == 0 for c in codes):
        # They handed their state over (or finished the job); the next look decides which.
        p.set(state=AgentState.LEAVING_DONE, finished=len(obs.left) < len(codes))
        p.do(ForgetWorkers())
        return p.decision()
    if any(c is not None and c != 0 for c in codes):
        p.set(state=AgentState.LEAVING_DONE if node.state is AgentState.LEAVING else AgentState.IDLE)
        exit_codes = {str(i): c for i, c in enumerate(codes) if c is not None and c != 0}
        p.do(ReapFailed(node.worker_gen, exit_codes))
        if obs.fault:
            # The node's fault ended them (a suspect worker exits after reporting itself): the fault
            # is on the record as well, so the controller hands the ranks to a standby, never back here.
            failure = ("fault", obs.fault)
        elif obs.hung:
            failure = ("hang", "; ".join(obs.hung))
        elif obs.unrecoverable:
            failure = ("refused", obs.unrecoverable)
        else:
            kind = "signal" if any(c < 0 for c in exit_codes.values()) else "exit"
            failure = (kind, f"worker(s) failed with exit codes {exit_codes} (by local rank)")
        p.do(Publish(NodeState.FAILED, node.worker_gen, exit_codes, failure))
    elif all(c == 0 for c in codes):
        p.set(state=AgentState.IDLE)
        p.do(ForgetWorkers(), Emit("workers_succeeded", node.worker_gen))
        p.do(Publish(NodeState.SUCCEEDED, node.worker_gen))
    return p.decision()


def _on_look(node: Node, obs: Look) -> Decision:
    """Bring the node in line with the current generation."""
    p = _Plan(node)
    gen = obs.gen
    if gen is None:
        return p.decision()
    if gen.status.terminal:
        p.stop()
        p.set(state=AgentState.EXITED)
        if gen.status is GenerationStatus.SUCCEEDED:
            p.do(Log(logging.INFO, "the job succeeded"), Exit(0))
        else:
            p.do(Log(logging.ERROR, f"the job failed: {gen.reason}"), Exit(EXIT_FAILED))
        return p.decision()
    if obs.fault:
        # A faulty node gives its ranks up: the controller hands them to a standby.
        p.stop()
        if obs.published is None or obs.published.state is not NodeState.FAILED:
            p.do(Publish(NodeState.FAILED, gen.number, failure=("fault", obs.fault)))
        return p.decision()
    leaving = node.state in (AgentState.LEAVING, AgentState.LEAVING_DONE)
    if (
        gen.kind != "replace"  # (a replacement's leavers failed; they stay in the job as spares)
        and obs.node_id in gen.leavers
        and (node.worker_gen or leaving)
        and node.move_ended_in != gen.number
    ):
        _leave(p, gen, obs)  # (a fresh agent named as an old leaver is just a standby)
        return p.decision()
    if leaving:
        # A newer generation abandoned (or never had) a move of this node: it is a node again.
        p.set(state=AgentState.ACTIVE if node.state is AgentState.LEAVING else AgentState.IDLE)
        p.do(
            Log(logging.WARNING, f"generation {gen.number} abandoned the move this node was leaving in"),
            Emit("migration_abandoned", gen.number),
        )
    published = obs.published
    if published is not None and published.state is NodeState.SUCCEEDED and published.generation == gen.number:
        return p.decision()  # this node's workers finished the job (a moot move's leaver): the controller ends it
    node_rank = gen.node_rank(obs.node_id)
    if gen.status is GenerationStatus.WAITING or node_rank is None:
        _stand_by(p, gen, obs, holds_ranks=node_rank is not None)
    elif p.node.worker_gen == gen.number:
        pass  # our workers for this generation run or have ended; the controller decides
    elif gen.kind == "replace":
        _replace(p, gen, obs)
    elif gen.kind == "migrate" and p.node.state.workers_run:
        # Live: survivors keep their processes; a warm standby's workers become the joiner.
        role = "joiner" if p.node.state is AgentState.SANDBOX else "survivor"
        p.set(state=AgentState.SETTLING if role == "joiner" else AgentState.ACTIVE, worker_gen=gen.number)
        p.do(
            Offer(gen, role),
            Emit("migration_offered", gen.number, {"role": role, "leavers": gen.leavers, "joiners": gen.joiners}),
        )
        # A joiner is running once its workers joined.
        p.do(Publish(NodeState.RESTARTING if role == "joiner" else NodeState.RUNNING, gen.number))
    else:
        _restart(p, gen)
    return p.decision()


def _restart(p: _Plan, gen: Generation) -> None:
    """A restart: stop, acknowledge, and start fresh workers once every assigned node acknowledged
    (the controller then writes the generation again, ``all_acked``)."""
    if p.node.acked_gen != gen.number:
        previous = p.node.acked_gen
        p.stop()
        p.do(Publish(NodeState.RESTARTING, gen.number), Acknowledge(gen.number, previous))
        p.set(state=AgentState.STARTING, acked_gen=gen.number)  # (only once etcd has the ack)
    if gen.all_acked:
        p.set(state=AgentState.ACTIVE, worker_gen=gen.number)
        if p.node.sandbox is SandboxUse.SPENT:
            p.set(sandbox=SandboxUse.USED)
        p.do(StartWorkers(gen), Publish(NodeState.RUNNING, gen.number))


def _replace(p: _Plan, gen: Generation, obs: Look) -> None:
    """Take part in a live replacement: a survivor keeps its workers; a joiner's take the ranks."""
    if obs.node_id in gen.joiners:
        if p.node.state is not AgentState.SANDBOX:
            # Restarted in place (its workers failed): fresh workers warm up, then receive state.
            p.stop()
            p.start_sandbox(gen)
        p.set(state=AgentState.SETTLING, worker_gen=gen.number)
        p.do(Offer(gen, "joiner"), Emit("replacement_offered", gen.number, {"role": "joiner", "leavers": gen.leavers}))
        p.do(Publish(NodeState.RESTARTING, gen.number))  # RUNNING once its workers joined
        return
    p.set(worker_gen=gen.number)
    if p.node.state not in (AgentState.ACTIVE, AgentState.SETTLING):
        # Its workers ended as the replacement was planned: the controller must hear of it.
        p.stop()
        codes = dict(obs.published.exit_codes) if obs.published else {}
        p.do(Publish(NodeState.FAILED, gen.number, exit_codes=codes))
        return
    p.set(state=AgentState.SETTLING)
    fields = {"role": "survivor", "leavers": gen.leavers, "joiners": gen.joiners}
    # Nothing is published until its workers recovered: then its record says running at this generation
    # (the offer and their reports wait to go with it). Meanwhile the record it has, running at the
    # last generation, tells the controller what restarting here would: this node has not settled.
    p.do(Offer(gen, "survivor"), Emit("replacement_offered", gen.number, fields, with_record=True))


def _stand_by(p: _Plan, gen: Generation, obs: Look, holds_ranks: bool) -> None:
    """Hold no running ranks: keep (or start) warm sandbox workers when the job can use them."""
    if p.node.state in (AgentState.ACTIVE, AgentState.SETTLING):
        if holds_ranks:
            p.stop()  # the job restarts with this node: torchrun's grace
        else:
            # The job went on without this node: its workers' ranks belong to others now.
            p.do(
                Log(
                    logging.ERROR,
                    f"generation {gen.number} gives this node no ranks; killing its "
                    f"generation-{p.node.worker_gen} workers at once",
                )
            )
            p.stop(STALE_GRACE_S)
    if holds_ranks:
        target = NodeState.RESTARTING
    else:
        warm = obs.warm
        if not p.node.state.workers_run and p.node.sandbox is SandboxUse.UNUSED:
            if obs.uses_runtime is None and obs.nodes_changed:
                # Re-read node records only when the watch saw them change.
                p.need = Need.RUNTIME
                return
            if obs.uses_runtime:
                p.start_sandbox(gen)
                warm = 0  # (fresh workers: none has warmed up)
        warming = (p.node.state is AgentState.SANDBOX or p.node.sandbox is SandboxUse.SPENT) and warm < obs.nproc
        target = NodeState.WARMING if warming else NodeState.STANDBY
        if p.node.sandbox is SandboxUse.FAILED:
            target = NodeState.FAILED  # its sandbox workers died: not a usable standby
    published = obs.published
    if published is None or published.state is not target or published.generation != gen.number:
        p.do(Publish(target, gen.number, failure=SANDBOX_FAILED if target is NodeState.FAILED else ("", "")))


def _leave(p: _Plan, gen: Generation, obs: Look) -> None:
    """This node leaves in ``gen``: hand its state over (or stop), then exit 0 as drained."""
    migrate = gen.kind == "migrate"
    if p.node.state not in (AgentState.LEAVING, AgentState.LEAVING_DONE):
        running = p.node.state.workers_run
        if running:
            p.set(state=AgentState.LEAVING)
        else:
            p.set(state=AgentState.LEAVING_DONE)
        p.do(Publish(NodeState.DRAINING, gen.number))
        if migrate and running:
            p.do(
                Offer(gen, "leaver"),
                Emit("migration_offered", gen.number, {"role": "leaver", "joiners": gen.joiners}),
            )
        else:
            p.stop()
    all_left = len(obs.left) >= obs.nproc
    if p.node.state is AgentState.LEAVING:
        if not migrate or not all_left:
            return  # the workers exit 0 once they have sent their state
        # Every local worker sent its state: the drain is done; their teardown need not be waited for.
        p.stop()
    if migrate and not all_left and p.node.finished:
        # Every worker exited 0 without handing its state over: they finished the job before the
        # switch. The move is moot; the controller ends the job once the other nodes finish.
        p.set(state=AgentState.IDLE, move_ended_in=gen.number)
        p.do(
            Emit("migration_moot", gen.number, {"reason": "the workers finished the job before the switch"}),
            Publish(NodeState.SUCCEEDED, gen.number),
        )
        return
    if migrate and not all_left:
        # The workers ended before handing their state over: this node is not drained. Its
        # failure is on its record; it stays in the job as a node without ranks.
        p.set(state=AgentState.IDLE, move_ended_in=gen.number)
        p.do(
            Log(logging.ERROR, f"the move to generation {gen.number} failed before the state was sent"),
            Emit("migration_failed", gen.number, {"sent": sorted(obs.left)}),
        )
        return
    joiner = gen.joiners[gen.leavers.index(obs.node_id)]
    p.do(MarkDrained(gen.number, joiner), Publish(NodeState.DRAINED, gen.number))
    p.set(state=AgentState.EXITED)
    p.do(
        Emit("drained", gen.number, {"replaced_by": joiner}),
        Log(logging.INFO, f"drained: node rank {gen.assignment[joiner]} now belongs to {joiner}"),
        Exit(0),
    )
