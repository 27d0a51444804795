"""A job's timeline, built from its events alone (pure: no I/O, no clock).

What the events say, arranged for a picture and for a table:

- **generations**: each new generation the controller wrote (its plan, status and reason);
- **segments**: each node's state over time, from its ``node_state`` events (the role follows
  from the state: active, standby, leaving, gone);
- **incidents**: every drain (live, or by a restart for a script without the runtime), straggler
  migration, live replacement after a fault (``replace``) and restart, with the downtime the
  workers measured when they reported one (``switched``'s ``downtime_ms``, ``recovered``'s
  ``seconds``), otherwise the time from the fault until the nodes ran again;
- **findings**: the detectors' and agents' alarms (a failed worker, a lost node, a hang, a GPU fault,
  silent data corruption suspected by the replica check, a straggler, a fenced agent, a task of an
  agent that failed and started again), drawn as marks on the node they concern;
- **points**: step time and goodput over time, per node, from the samples in the agents' batched
  ``progress`` events (one sample per 30 s of training, see rlaunch.agent.progress), and the step
  that took each migration (``switched``: its ``step_ms``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from rlaunch.agent.moves import combine, sentence
from rlaunch.store.records import Event, LiveMoves

LIVE_MOVES = {m.value for m in LiveMoves}

#: Node state -> the role it means, for the legend and the CSV.
ROLES = {
    "waiting": "joining",
    "warming": "standby",
    "standby": "standby",
    "restarting": "joining",
    "running": "active",
    "draining": "leaving",
    "drained": "gone",
    "succeeded": "gone",
    "failed": "failed",
    "stopping": "gone",
}
#: Event kinds that report a fault or a finding, and the words a reader sees for each.
FINDINGS = {
    "workers_failed": "workers failed",
    "node_dead": "node lost",
    "worker_hung": "worker hung",
    "gpu_fault": "GPU fault",
    "sdc_suspected": "silent data corruption suspected",
    "straggler": "straggler",
    "fenced": "agent fenced",
    "agent_task_failed": "agent task failed",
    "sandbox_failed": "standby workers failed",
    "migration_failed": "migration failed",
    "migration_abandoned": "migration abandoned",
    "replacement_refused": "replacement refused",
    "agent_signalled": "agent signalled",
    "plan_failed": "plan failed",
}
#: Findings that start an outage (the next generation's incident is measured from them).
FAULTS = ("workers_failed", "node_dead", "worker_hung", "gpu_fault", "sdc_suspected", "fenced")
#: Incident kind per plan of a new generation.
INCIDENTS = {"migrate": "drain", "replace": "recovery", "restart": "restart"}


@dataclasses.dataclass(frozen=True)
class GenerationMark:
    number: int
    time: float
    plan: str
    status: str
    reason: str
    assignment: dict[str, int]
    restart_count: int


@dataclasses.dataclass(frozen=True)
class Segment:
    """Node ``node`` was in ``state`` from ``start`` to ``end`` (seconds since the epoch)."""

    node: str
    state: str
    start: float
    end: float
    generation: int

    @property
    def role(self) -> str:
        return ROLES.get(self.state, self.state)


@dataclasses.dataclass(frozen=True)
class Incident:
    """A drain, recovery or restart: from ``start`` (request or fault) to ``end`` (all running again)."""

    kind: str
    generation: int
    start: float
    end: float
    nodes: tuple[str, ...]
    downtime_s: float | None
    measured: bool  # the downtime is what the workers measured (else the wall time from start to end)
    detail: str


@dataclasses.dataclass(frozen=True)
class Finding:
    time: float
    node: str
    kind: str
    generation: int
    label: str


@dataclasses.dataclass(frozen=True)
class Point:
    """One step-time/goodput sample of a node (``source``: ``progress`` or ``switched``)."""

    time: float
    node: str
    generation: int
    source: str
    step_s: float
    goodput: float | None
    steps: int
    applied: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    job: str
    start: float
    end: float
    outcome: str
    generations: tuple[GenerationMark, ...]
    segments: tuple[Segment, ...]
    incidents: tuple[Incident, ...]
    findings: tuple[Finding, ...]
    points: tuple[Point, ...]
    events: tuple[Event, ...]

    @property
    def nodes(self) -> list[str]:
        """Node ids in the order they first appear (the CLI's own pseudo-node left out)."""
        seen: dict[str, None] = {}
        for ev in self.events:
            if ev.node_id != "cli":
                seen.setdefault(ev.node_id, None)
        return list(seen)

    @property
    def live_moves(self) -> str:
        """What a drain and a fault would do at the end, as ``rlaunch status`` says it: the weakest of
        the last generation's nodes' latest ``live_moves`` (with how a fault is recovered, such as a
        rollback to host snapshots and the steps it redoes); "" when no node said."""
        holding = set(self.generations[-1].assignment) if self.generations else set()
        latest: dict[str, tuple[LiveMoves, str]] = {}
        for ev in self.events:
            if ev.kind == "live_moves" and ev.node_id in holding and ev.data.get("moves") in LIVE_MOVES:
                latest[ev.node_id] = (LiveMoves(ev.data["moves"]), str(ev.data.get("reason", "")))
        if not latest:
            return ""
        return sentence(*combine(latest[n] for n in sorted(latest)))

    def summary(self) -> dict[str, Any]:
        """Figures for the page's header and the reader in a hurry."""
        downtimes = [i.downtime_s for i in self.incidents if i.downtime_s is not None]
        last = {}
        for p in self.points:
            if p.source == "progress" and p.goodput is not None:
                last[p.node] = p.goodput
        step_times = [p.step_s for p in self.points if p.source == "progress"]
        return {
            "job": self.job,
            "outcome": self.outcome,
            "wall_s": self.end - self.start,
            "nodes": len(self.nodes),
            "generations": len(self.generations),
            "drains": sum(i.kind == "drain" for i in self.incidents),
            "migrations": sum(i.kind == "migration" for i in self.incidents),
            "recoveries": sum(i.kind == "recovery" for i in self.incidents),
            "restarts": sum(i.kind == "restart" for i in self.incidents),
            "findings": len(self.findings),
            "downtime_s": sum(downtimes),
            "median_downtime_s": statistics.median(downtimes) if downtimes else None,
            "median_step_s": statistics.median(step_times) if step_times else None,
            "goodput": statistics.fmean(last.values()) if last else None,
            "live_moves": self.live_moves,
        }


def build(job: str, events: list[Event]) -> Timeline:
    """The timeline of ``job`` from its events (any order; at least one)."""
    events = sorted(events, key=lambda e: e.time)
    start, end = events[0].time, events[-1].time
    gens = _generations(events)
    return Timeline(
        job=job,
        start=start,
        end=end,
        outcome=gens[-1].status if gens else "unknown",
        generations=tuple(_latest_status(gens)),
        segments=tuple(_segments(events, end)),
        incidents=tuple(_incidents(events, gens)),
        findings=tuple(
            Finding(e.time, _subject(e), e.kind, e.generation, FINDINGS[e.kind]) for e in events if e.kind in FINDINGS
        ),
        points=tuple(_points(events)),
        events=tuple(events),
    )


def _generations(events: list[Event]) -> list[GenerationMark]:
    """Every ``generation`` event (the last one of a number carries the job's final status)."""
    out = []
    for e in events:
        if e.kind == "generation":
            d = e.data
            out.append(
                GenerationMark(
                    number=e.generation,
                    time=e.time,
                    plan=str(d.get("plan", "")),
                    status=str(d.get("status", "")),
                    reason=str(d.get("reason", "")),
                    assignment={str(k): int(v) for k, v in dict(d.get("assignment") or {}).items()},
                    restart_count=int(d.get("restart_count", 0)),
                )  # fmt: skip
            )
    return out


def _latest_status(gens: list[GenerationMark]) -> list[GenerationMark]:
    """One mark per generation number: when it was first written, with the status it was last given."""
    first: dict[int, GenerationMark] = {}
    for g in gens:
        held = first.get(g.number)
        first[g.number] = g if held is None else dataclasses.replace(held, status=g.status)
    return sorted(first.values(), key=lambda g: g.time)


def _segments(events: list[Event], end: float) -> list[Segment]:
    """Each node's states over time; the last one lasts until the job's last event."""
    open_: dict[str, tuple[str, float, int]] = {}
    out = []
    for e in events:
        if e.kind == "node_joined" and e.node_id not in open_:
            open_[e.node_id] = ("waiting", e.time, e.generation)
        elif e.kind == "node_state":
            state = str(e.data.get("state", ""))
            held = open_.get(e.node_id)
            if held is not None:
                if held[0] == state:
                    continue
                out.append(Segment(e.node_id, held[0], held[1], e.time, held[2]))
            open_[e.node_id] = (state, e.time, e.generation)
    out.extend(Segment(node, state, since, end, gen) for node, (state, since, gen) in open_.items())
    return sorted(out, key=lambda s: (s.node, s.start))


def _subject(e: Event) -> str:
    """The node an event is about (the controller reports other nodes' loss and slowness)."""
    node = e.data.get("node")
    return str(node) if isinstance(node, str) and node else e.node_id


def _incidents(events: list[Event], gens: list[GenerationMark]) -> list[Incident]:
    out = []
    seen: set[int] = set()
    previous_time = events[0].time
    for g in gens:
        if g.number in seen:
            continue
        seen.add(g.number)
        first = g.number == min(x.number for x in gens)
        if first and g.plan == "restart" and g.restart_count == 0:
            previous_time = g.time
            continue
        kind = incident_kind(g)
        mine = [e for e in events if e.generation == g.number]
        before = [e for e in events if previous_time <= e.time <= g.time]
        out.append(_incident(kind, g, mine, before, events))
        previous_time = g.time
    return out


def incident_kind(g: GenerationMark) -> str:
    """What a new generation was for: a ``drain`` (asked for: live, or by restarting every worker
    when the script does not use the runtime), a ``migration`` (a straggler moved), a ``recovery``
    (failed ranks replaced live) or a ``restart``."""
    if g.plan in ("migrate", "restart") and g.reason.startswith(("draining ", "straggler ")):
        return "drain" if g.reason.startswith("draining ") else "migration"
    return INCIDENTS.get(g.plan, g.plan or "change")


def _incident(kind: str, g: GenerationMark, mine: list[Event], before: list[Event], events: list[Event]) -> Incident:
    """One incident: where it starts, ends, which nodes it concerns and its downtime."""
    leavers = sorted(
        {n for e in mine if e.kind in ("migration_offered", "replacement_offered") for n in e.data.get("leavers", [])}
    )
    joiners = sorted(
        {n for e in mine if e.kind in ("migration_offered", "replacement_offered") for n in e.data.get("joiners", [])}
    )
    asked = [e for e in before if e.kind == "drain_requested"]
    if g.plan == "migrate":
        requests = [e for e in asked if e.data.get("node") in leavers]
        start = requests[-1].time if requests else g.time
        done = [e.time for e in mine if e.kind in ("drained", "switched", "joined")]
        end = max(done) if done else g.time
        switched = [
            float(e.data["downtime_ms"]) / 1000 for e in mine if e.kind == "switched" and "downtime_ms" in e.data
        ]
        sent = [e for e in mine if e.kind == "state_sent"]
        moved = sum(int(e.data.get("bytes", 0)) for e in sent)
        detail = "straggler " if kind == "migration" else ""
        detail += f"{', '.join(leavers) or '?'} → {', '.join(joiners) or '?'}"
        detail += f"; {_bytes(moved)} of state moved" if sent else ""
        downtime, measured = (max(switched), True) if switched else (end - start, False)
        return Incident(kind, g.number, start, end, tuple(leavers + joiners), downtime, measured, detail)
    faults = [e for e in before if e.kind in FAULTS]
    signs = [e.time for e in before if e.kind in FAULTS or e.kind == "recovering"]  # a survivor may notice first
    start = min(signs) if signs else g.time
    if kind == "recovery":
        done = [e.time for e in mine if e.kind in ("recovered", "joined")]
        end = max(done) if done else g.time
        secs = [float(e.data["seconds"]) for e in mine if e.kind == "recovered" and "seconds" in e.data]
        downtime, measured = (max(secs), True) if secs else (end - start, False)
        why = faults[0].kind if faults else "fault"
        detail = f"{FINDINGS.get(why, why)} on {', '.join(sorted({_subject(f) for f in faults})) or '?'}; "
        if joiners and joiners == leavers:
            detail += f"{', '.join(joiners)} restarted in place while the others kept their processes"
        else:
            detail += f"{', '.join(joiners) or '?'} took the ranks of {', '.join(leavers) or '?'} live"
        back = [e.data for e in mine if e.kind == "recovered" and e.data.get("rolled_back_to") is not None]
        if back:  # no replica: the survivors rolled back to a host snapshot
            redone = max(int(d.get("steps_redone", 0)) for d in back)
            detail += f", rolled back to the host snapshot of step {back[0]['rolled_back_to']} ({redone} steps redone)"
        return Incident(
            kind, g.number, start, end, tuple(sorted(set(leavers) | set(joiners))), downtime, measured, detail
        )
    # A restart (also a drain of a script without the runtime): every node of the new generation
    # starts its workers again; it is over once all run.
    if kind == "drain" and asked:
        start = asked[-1].time
    running = _first_running(events, g)
    end = max(running.values()) if running and len(running) == len(g.assignment) else g.time
    detail = g.reason
    return Incident(
        kind, g.number, start, end, tuple(sorted(g.assignment)), end - start if running else None, False, detail
    )


def _first_running(events: list[Event], g: GenerationMark) -> dict[str, float]:
    """When each node of generation ``g`` first ran in it."""
    out: dict[str, float] = {}
    for e in events:
        if (e.generation == g.number and e.kind == "node_state" and e.data.get("state") == "running"
                and e.node_id in g.assignment and e.node_id not in out):  # fmt: skip
            out[e.node_id] = e.time
    return out


def _samples(e: Event) -> list[tuple[float, int, dict[str, Any]]]:
    """A ``progress`` event's samples as ``(time, generation, data)``: a batch (``data.samples``, see
    rlaunch.agent.progress) or, from agents before batching, the event itself as one sample."""
    batch = e.data.get("samples")
    if not isinstance(batch, list):
        return [(e.time, e.generation, e.data)]
    return [
        (float(s.get("time", e.time)), int(s.get("generation", e.generation)), s) for s in batch if isinstance(s, dict)
    ]


def _points(events: list[Event]) -> list[Point]:
    out = []
    for e in events:
        d = e.data
        if e.kind == "progress":
            for when, generation, s in _samples(e):
                if float(s.get("step_s") or 0) > 0:
                    goodput = s.get("goodput")
                    out.append(
                        Point(when, e.node_id, generation, "progress", float(s["step_s"]),
                              None if goodput is None else float(goodput), int(s.get("steps", 0)),
                              int(s.get("applied", -1)))
                    )  # fmt: skip
        elif e.kind == "switched" and "step_ms" in d:
            out.append(Point(e.time, e.node_id, e.generation, "switched", float(d["step_ms"]) / 1000, None, 1, -1))
    return sorted(out, key=lambda p: p.time)  # a batch's samples are older than the event that carried them


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
