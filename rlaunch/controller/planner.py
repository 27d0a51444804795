"""The controller's decisions, as a pure function of the cluster view.

``plan(now, view, cfg)`` returns the next :class:`Generation` to write (or ``None``) and a
sentence saying why. It performs no I/O and reads no clock: the controller tick reads the view,
calls it, and writes the result with compare-and-swap. Tests build views by hand.

Rules (torchrun's semantics, plus standbys):
- The first ``nnodes`` non-standby nodes to join (in etcd create order) form generation 1,
  with node ranks in join order; later nodes are standbys.
- A worker failure restarts every node in a new generation with the same ranks, counted
  against ``max_restarts``; past it the job fails.
- A lost node (lease gone, stopping, or reporting a fault: a hardware fault, or silent data
  corruption suspected by the runtime's replica check) does not count as a restart: its node rank
  goes to the earliest-joined spare node, never back to a faulty node. With no spare, the job waits
  up to ``replace_timeout`` for one, then fails; the reasons name the fault.
- A lost node is handled before worker failures seen in the same view: the new generation
  restarts every worker anyway, and the failures are taken as caused by the loss.
- Live replacement (``replace``) comes first when every node's workers use the runtime and the
  job is settled (every other assigned node runs the current generation): each lost or failed
  node's ranks go to a ready standby, else (workers failed, node healthy) back to the node
  itself, restarted in place; the survivors keep their processes and send the state. A node
  whose workers failed with ``refused`` (they said no live move may follow: a refused
  replacement, a move or a replica check that failed) takes the restart rules instead. With a
  lost node and no standby, the job waits up to ``standby_wait`` (survivors keep waiting), then
  falls back to the restart rules below. A worker failure counts against ``max_restarts``.
- A restart's barrier: once every node it assigns acknowledged it (each stopped the workers of
  earlier generations), the generation is written again with ``all_acked``, and only then do the
  nodes start their workers. (Each node waiting for every other node's ack itself had every node
  receive every ack: N² watch events.)
- When every assigned node reports success for the current generation, the job succeeded.
- A drain request for an active node, once every node runs the current generation and a
  standby is ready, hands the node rank to that standby: live (``migrate``: nobody else
  restarts) when every active node's workers use the runtime, else by a restart that does not
  count against ``max_restarts``. A straggler (see rlaunch.detectors.straggler) is moved the
  same way, after any requested drain.
- A standby that a node holding ranks reported unreachable (a network cut, see
  rlaunch.controller.cutoff) is given no ranks while the report stands.
"""

from __future__ import annotations

import dataclasses

from rlaunch.store.records import (
    Generation,
    GenerationStatus,
    JobSpec,
    NodeRecord,
    NodeState,
)

#: States in which a node not holding ranks may be given some in a restart (every worker starts
#: anew, so a node whose own workers failed is fine; one with a fault is not live).
_SPARE_STATES = (NodeState.WAITING, NodeState.WARMING, NodeState.STANDBY, NodeState.FAILED)
#: A reason names nodes one by one up to this many; past it, it counts the rest (a reason is in the
#: generation's head, which every node receives: its size must not grow with the job).
NAMED_NODES = 16


@dataclasses.dataclass(frozen=True)
class NodeView:
    """A live node: its record and the etcd revision at which it joined."""

    record: NodeRecord
    join_revision: int


@dataclasses.dataclass(frozen=True)
class ClusterView:
    spec: JobSpec
    nodes: dict[str, NodeView]
    generation: Generation | None
    #: node ids with a pending drain request
    drains: frozenset[str] = frozenset()
    #: active nodes the straggler detector found slow for its whole window (moved like drains)
    stragglers: frozenset[str] = frozenset()
    #: nodes that acknowledged the generation (read while it waits for acks: a restart's barrier)
    acked: frozenset[str] = frozenset()
    #: standbys that a node holding ranks could not reach (a network cut): they take no ranks now
    unreachable: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    controller: str
    replace_timeout: float
    master_port: int = 0  # 0: use the port advertised by the node holding node rank 0
    #: how long a live replacement of a lost node waits for a standby before a full restart
    standby_wait: float = 30.0


def can_hold_ranks(record: NodeRecord) -> bool:
    """A live node that may hold ranks: not stopping, and no fault reported (hardware, or suspected SDC)."""
    return record.state is not NodeState.STOPPING and not record.fault


def plan(now: float, view: ClusterView, cfg: PlannerConfig) -> tuple[Generation | None, str]:
    gen = view.generation
    if gen is None:
        return _first(now, view, cfg)
    if gen.status.terminal:
        return None, f"the job has {gen.status.value}; nothing to do"
    live = {n for n, v in view.nodes.items() if can_hold_ranks(v.record)}
    lost = sorted(n for n in gen.assignment if n not in live)
    failed = sorted(n for n in gen.assignment if n in live and _failed_in(view.nodes[n].record, gen))
    if (lost or failed) and gen.status is GenerationStatus.RUNNING:
        decided = _replace(now, view, cfg, gen, lost, failed)
        if decided is not None:
            return decided
    if lost or gen.status is GenerationStatus.WAITING:
        survivors = [n for n in gen.assignment if n in live]
        return _fill(now, view, cfg, gen, survivors, lost)
    stalled = _stalled_move(view, gen)
    if stalled:
        reason = f"{stalled}; restarting every node with the new assignment"
        return _generation(now, view, cfg, gen.number + 1, dict(gen.assignment), gen.restart_count, reason), reason
    if gen.waits_for_acks and view.acked.issuperset(gen.assignment):
        reason = f"every node of generation {gen.number} stopped its earlier workers and acknowledged; they start"
        return dataclasses.replace(gen, all_acked=True), reason

    records = {n: view.nodes[n].record for n in gen.assignment}
    if failed:
        what = _listed([f"{n} ({_failure(records[n])})" for n in failed], ", ")
        if gen.restart_count >= view.spec.max_restarts:
            reason = f"workers failed on {what} and all {view.spec.max_restarts} restarts are used; the job failed"
            return dataclasses.replace(gen, status=GenerationStatus.FAILED, reason=reason), reason
        reason = (
            f"workers failed on {what}; restarting every node "
            f"(restart {gen.restart_count + 1} of {view.spec.max_restarts})"
        )
        return (
            _generation(now, view, cfg, gen.number + 1, dict(gen.assignment), gen.restart_count + 1, reason),
            reason,
        )
    if all(r.state is NodeState.SUCCEEDED and r.generation == gen.number for r in records.values()) or _moot(
        view, gen, records
    ):
        reason = f"every node finished generation {gen.number}; the job succeeded"
        return dataclasses.replace(gen, status=GenerationStatus.SUCCEEDED, reason=reason), reason
    if view.drains or view.stragglers:
        return _drain(now, view, cfg, gen, records)
    return None, f"generation {gen.number} is running"


def _stalled_move(view: ClusterView, gen: Generation) -> str:
    """Why a live move can no longer finish: a leaver went before its joiner joined ("" if none)."""
    if gen.kind != "migrate":
        return ""
    for leaver, joiner in zip(gen.leavers, gen.joiners, strict=True):
        # a joiner publishes RESTARTING until its workers have the state (a lost joiner is handled as lost)
        joined = joiner in view.nodes and view.nodes[joiner].record.state is not NodeState.RESTARTING
        record = view.nodes[leaver].record if leaver in view.nodes else None
        gone = record is None or not can_hold_ranks(record) or record.state is NodeState.FAILED
        if gone and not joined:
            return f"{leaver} was lost or failed before handing its state to {joiner}"
    return ""


def _failure(record: NodeRecord) -> str:
    """A failed node's failure, as the restart reason names it."""
    if record.failure == "refused":  # no live move may follow (a refused replacement, a failed check): say why
        return f"no live move: {record.message}"
    return f"exit codes {record.exit_codes}"


def _moot(view: ClusterView, gen: Generation, records: dict[str, NodeRecord]) -> bool:
    """A move the job outran: every leaver's workers finished the job instead of handing their
    state over (all ranks run the same number of steps), and every other node finished too.
    The joiners have nothing left to take."""
    if gen.kind != "migrate":
        return False
    finished = {n for n, r in records.items() if r.state is NodeState.SUCCEEDED and r.generation == gen.number}
    for leaver, joiner in zip(gen.leavers, gen.joiners, strict=True):
        record = view.nodes[leaver].record if leaver in view.nodes else None
        if record is None or record.state is not NodeState.SUCCEEDED or record.generation != gen.number:
            return False
        finished.add(joiner)
    return finished >= set(records)


def _why_out(view: ClusterView, node: str) -> str:
    """Why a node of the generation cannot hold its ranks: its fault, or lost (gone, or stopping)."""
    record = view.nodes[node].record if node in view.nodes else None
    return f"fault: {record.fault}" if record is not None and record.fault else "lost"


def _faults(view: ClusterView, nodes: list[str]) -> str:
    """`` (b: <fault>; ...)`` for those of ``nodes`` with a fault on their record ("" if none)."""
    found = [f"{n}: {view.nodes[n].record.fault}" for n in nodes if n in view.nodes and view.nodes[n].record.fault]
    return f" ({_listed(found, '; ')})" if found else ""


def _failed_in(record: NodeRecord, gen: Generation) -> bool:
    return record.state is NodeState.FAILED and record.generation == gen.number


def is_ready(record: NodeRecord, job_uses_runtime: bool) -> bool:
    """A standby that may take a leaver's ranks: warm (its sandbox workers ran) if the job migrates live."""
    return record.state is NodeState.STANDBY and (record.runtime or not job_uses_runtime)


def _drain(
    now: float, view: ClusterView, cfg: PlannerConfig, gen: Generation, records: dict[str, NodeRecord]
) -> tuple[Generation | None, str]:
    """Hand a draining (or straggling) node's rank to a ready standby (one move at a time)."""
    asked = [n for n in view.drains if n in gen.assignment]
    slow = [n for n in view.stragglers if n in gen.assignment]
    leaver = min(asked or slow, key=lambda n: gen.assignment[n], default=None)
    if leaver is None:
        return None, f"drain requested for {sorted(view.drains)}, which hold no ranks"
    what = "draining" if asked else "straggler"
    settled = all(r.state is NodeState.RUNNING and r.generation == gen.number for r in records.values())
    if not settled:
        return None, f"{what} {leaver} waits until every node runs generation {gen.number}"
    live = all(r.runtime for r in records.values())
    ready = _ready_standbys(view, gen, live)
    if not ready:
        return None, f"{what} {leaver} waits for a ready standby"
    joiner = ready[0]
    assignment = dict(gen.assignment)
    assignment[joiner] = assignment.pop(leaver)
    kind = "migrate" if live else "restart"
    how = "live" if live else "by restarting every worker (the script does not use rlaunch.init())"
    reason = f"{what} {leaver}: {joiner} takes node rank {assignment[joiner]} {how}"
    new = _generation(now, view, cfg, gen.number + 1, assignment, gen.restart_count, reason)
    return dataclasses.replace(new, kind=kind, leavers=[leaver], joiners=[joiner]), reason


def _replace(
    now: float, view: ClusterView, cfg: PlannerConfig, gen: Generation, lost: list[str], failed: list[str]
) -> tuple[Generation | None, str] | None:
    """Replace lost and failed nodes live, or wait for a standby; ``None``: restart instead."""
    out = set(lost) | set(failed)
    survivors = [n for n in gen.assignment if n not in out]
    records = {n: view.nodes[n].record for n in gen.assignment if n in view.nodes}
    if not survivors or not all(r.runtime for r in records.values()):
        return None  # nobody holds a replica, or the script does not use the runtime: torchrun's restart
    if not all(records[n].state is NodeState.RUNNING and records[n].generation == gen.number for n in survivors):
        return None  # a move is still in flight: only a restart is safe
    if any(n in records and records[n].state is NodeState.RESTARTING for n in gen.joiners):
        return None  # a joiner of the current move has not joined: survivors may be mid-preparation
    if failed and gen.restart_count >= view.spec.max_restarts:
        return None  # the restart rules fail the job
    if any(records[n].failure == "refused" for n in failed if n in records):
        return None  # its workers said no live move may follow (a refused replacement, a failed check)
    ready = _ready_standbys(view, gen, True)
    # Standbys go to lost and faulty nodes first: a node whose workers failed can restart in place.
    leavers = sorted(out, key=lambda n: (n in failed, gen.assignment[n]))
    joiners: list[str] = []
    for node in leavers:
        if ready:
            joiners.append(ready.pop(0))
        elif node in failed:
            joiners.append(node)  # its GPU is fine: restart its workers in place
        else:
            if gen.deadline and now >= gen.deadline:
                return None  # no standby came in time: fall back to a restart
            if gen.deadline:
                return None, f"waiting for a standby to replace {node} live"
            reason = (
                f"node {node} lost{_faults(view, [node])} and no standby is ready; waiting up to "
                f"{cfg.standby_wait:.0f} s for one"
            )
            return dataclasses.replace(gen, deadline=now + cfg.standby_wait, reason=reason), reason
    assignment = {n: gen.assignment[n] for n in survivors}
    moves = []
    for leaver, joiner in zip(leavers, joiners, strict=True):
        assignment[joiner] = gen.assignment[leaver]
        how = "restarted in place" if joiner == leaver else f"replaced by {joiner}"
        why = _why_out(view, leaver) if leaver in lost else "workers failed"
        moves.append(f"{leaver} ({why}) {how}")
    reason = _listed(moves, "; ") + f"; {_some('survivors', survivors)} keep their processes"
    restarts = gen.restart_count + (1 if failed else 0)
    new = _generation(now, view, cfg, gen.number + 1, assignment, restarts, reason)
    return dataclasses.replace(new, kind="replace", leavers=leavers, joiners=joiners), reason


def _some(what: str, nodes: list[str]) -> str:
    """``survivors ['a', 'b']``, or ``the 4095 survivors`` past :data:`NAMED_NODES`."""
    return f"{what} {nodes}" if len(nodes) <= NAMED_NODES else f"the {len(nodes)} {what}"


def _listed(items: list[str], sep: str) -> str:
    """``items`` joined by ``sep``, the first :data:`NAMED_NODES` of them and a count of the rest."""
    shown = sep.join(items[:NAMED_NODES])
    return shown if len(items) <= NAMED_NODES else f"{shown}{sep}and {len(items) - NAMED_NODES} more"


def _ranks(ranks: list[int]) -> str:
    """``[2, 5]``, or the first :data:`NAMED_NODES` ranks and a count of the rest."""
    return f"[{_listed([str(r) for r in ranks], ', ')}]"


def _ready_standbys(view: ClusterView, gen: Generation, job_uses_runtime: bool) -> list[str]:
    """The ready standbys that every node holding ranks can reach, earliest joined first."""
    return _by_join(view, [
        n for n in view.nodes
        if n not in gen.assignment and n not in view.unreachable and is_ready(view.nodes[n].record, job_uses_runtime)
    ])  # fmt: skip


def _by_join(view: ClusterView, names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: view.nodes[n].join_revision)


def _first(now: float, view: ClusterView, cfg: PlannerConfig) -> tuple[Generation | None, str]:
    nnodes = view.spec.nnodes
    eligible = _by_join(
        view,
        [n for n, v in view.nodes.items() if not v.record.standby_only and v.record.state is NodeState.WAITING],
    )
    if len(eligible) < nnodes:
        return None, f"waiting for nodes to join: {len(eligible)} of {nnodes} present"
    assignment = {n: i for i, n in enumerate(eligible[:nnodes])}
    named = f": {assignment}" if len(assignment) <= NAMED_NODES else ""
    reason = f"{nnodes} node(s) joined; node ranks in join order{named}"
    return _generation(now, view, cfg, 1, assignment, 0, reason), reason


def _fill(
    now: float,
    view: ClusterView,
    cfg: PlannerConfig,
    gen: Generation,
    survivors: list[str],
    lost: list[str],
) -> tuple[Generation | None, str]:
    """Give the node ranks not held by ``survivors`` to spare nodes, or wait for some."""
    held = {gen.assignment[n] for n in survivors}
    missing = [r for r in range(view.spec.nnodes) if r not in held]
    spares = _by_join(
        view,
        [
            n
            for n, v in view.nodes.items()
            if n not in survivors
            and n not in view.unreachable
            and v.record.state in _SPARE_STATES
            and can_hold_ranks(v.record)
        ],
    )
    lost_txt = f"node(s) {_listed(lost, ', ')} lost{_faults(view, lost)}; " if lost else ""
    if len(spares) >= len(missing):
        assignment = {n: gen.assignment[n] for n in survivors}
        moves = []
        for rank, node in zip(missing, spares, strict=False):
            assignment[node] = rank
            moves.append(f"{node} takes node rank {rank}")
        reason = lost_txt + _listed(moves, "; ")
        return (
            _generation(now, view, cfg, gen.number + 1, assignment, gen.restart_count, reason),
            reason,
        )
    if gen.status is GenerationStatus.WAITING:
        if now >= gen.deadline:
            # A faulty node still here is why it did not fill its own rank: the reason names its fault.
            faulty = [
                f"{n} may not take one: {v.record.fault}" for n, v in sorted(view.nodes.items()) if v.record.fault
            ]
            came = f"no node came to take node rank(s) {_ranks(missing)} within {cfg.replace_timeout:.0f} s"
            reason = "; ".join([came, _listed(faulty, "; "), "the job failed"] if faulty else [came, "the job failed"])
            return dataclasses.replace(gen, status=GenerationStatus.FAILED, reason=reason), reason
        return None, f"waiting for a node to take node rank(s) {_ranks(missing)}"
    reason = (
        f"{lost_txt}no standby is ready; waiting up to {cfg.replace_timeout:.0f} s "
        f"for a node to take node rank(s) {_ranks(missing)}"
    )
    waiting = Generation(
        number=gen.number + 1,
        status=GenerationStatus.WAITING,
        assignment={n: gen.assignment[n] for n in survivors},
        nnodes=gen.nnodes,
        nproc_per_node=gen.nproc_per_node,
        master_addr="",
        master_port=0,
        restart_count=gen.restart_count,
        reason=reason,
        controller=cfg.controller,
        created_at=now,
        deadline=now + cfg.replace_timeout,
    )
    return waiting, reason


def _generation(
    now: float,
    view: ClusterView,
    cfg: PlannerConfig,
    number: int,
    assignment: dict[str, int],
    restart_count: int,
    reason: str,
) -> Generation:
    rank0 = next(n for n, r in assignment.items() if r == 0)
    rec = view.nodes[rank0].record
    return Generation(
        number=number,
        status=GenerationStatus.RUNNING,
        assignment=dict(sorted(assignment.items(), key=lambda kv: kv[1])),
        nnodes=view.spec.nnodes,
        nproc_per_node=view.spec.nproc_per_node,
        master_addr=rec.addr,
        master_port=cfg.master_port or rec.master_port,
        restart_count=restart_count,
        reason=reason,
        controller=cfg.controller,
        created_at=now,
    )
