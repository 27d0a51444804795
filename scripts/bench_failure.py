#!/usr/bin/env python3
"""Benchmark: an unplanned node loss with rlaunch against what torchrun users do today.

One run, bench_migration's model and setup (bench_train.py defaults, 2 active nodes plus 1
standby, one process per node, 1 thread each):
  reference  rlaunch with no event: the digests every other run must end with;
  (a)        rlaunch, node b lost: b's agent and its worker are SIGKILLed at once, as a machine
             loss would; b's lease expires after --lease-ttl, the controller plans a `replace`
             generation, the warm standby c takes rank 1 and receives its state from rank 0,
             whose process never restarts;
  (b)        torchrun: plain DDP that checkpoints every --ckpt-every steps; node b's torchrun
             agent and worker are SIGKILLed (no last checkpoint), a's worker fails, the job exits
             and torchrun is started again at once on a and c, resuming from the last periodic
             checkpoint (bench_migration.run_torchrun says why not torchrun's in-place restart;
             starting at once leaves out any scheduler delay, in torchrun's favour);
  (c)        rlaunch, b's worker alone is SIGKILLed (its agent lives on; --max-restarts 1, as a
             crash counts as a restart): worker_crash_detect_s is kill -> the controller planned
             the replacement (b's agent sees the exit within --monitor-interval, 0.1 s, and
             reports it on its node record, which the controller watches).
Each event is run --repeats times (default 5), (a) and (b) taking turns so that drifts in the
machine's load hit both alike, each in a job of its own. As in bench_migration, every figure of an
event keeps its key as the median over the runs, with ``_runs``, ``_min`` and ``_max`` beside it;
a flag (bit_identical, survivor_kept_its_process) holds only if it held in every run; a ratio is
of the medians, and ``_worst`` torchrun's least over rlaunch's most. Targets are judged on medians.

Recovery time of an event = bench_migration's downtime: wall time of the 6 steps around the
event on rank 0's timeline minus 6 median steps. Steps lost since torchrun's last checkpoint are
redone before those 6 steps end, so their time counts. The default event (step 30, checkpoints
every 20 steps) loses 10 steps: the mean loss of a failure at a random time. The checkpoints' own
cost (torchrun_ckpt_save_s, once every --ckpt-every steps) is left out, in torchrun's favour.

rlaunch's recovery is split into phases, from the bench's clock at the kill and the event log
(--log-dir; every agent stamps its events with this machine's wall clock):
  detect_s    kill -> the controller planned the `replace` generation (its record's created_at,
              the clock the planner was given; the `generation` event is stamped only after the
              write returns, when the other agents may already have acted on it): a's worker
              sees its collective fail, a's agent notes it on its record, the controller probes
              the agents and revokes b's lease as b's probe port refuses (see
              rlaunch.detectors.liveness), then plans; were the probe inconclusive (a dead
              host), the rest of b's lease would be waited for instead (up to --lease-ttl);
  plan_s      -> the last `replacement_offered` event: the generation written to etcd, and the
              agents of survivor a and joiner c saw it and handed the plan to their workers (a's
              worker had already seen its collective fail, the `recovering` event;
              survivor_noticed_s);
  transfer_s  -> the last of the survivor's `recovered` and `replica_sent` and the joiner's
              `joined` events: agreeing on the last applied step, building the new
              communicators through etcd, finishing the interrupted step's own code, sending
              the state from rank 0 to the joiner at the step boundary;
  resume_s    -> the end of rank 0's first step begun after its recovery.
The phases add up to kill -> first step completed after recovery (phases_sum_s). That interval
also holds the work of the interrupted step done before the kill, which is redone, so it exceeds
rlaunch_recovery_s by up to one median step.

``--layout fsdp`` runs the same model sharded with FSDP2 over both ranks: no replica holds a shard,
so (a) rolls back to the last host snapshot (RLAUNCH_SNAPSHOT_EVERY, ``auto`` by default: 20 steps
until a snapshot's cost is measured, then the multiple of 20 steps that keeps it within 1 %, see
rlaunch.runtime.snapshots.choose), rank 0 sends b's copy to c, and the steps since the snapshot are
redone (steps_redone; torchrun redoes those since its last checkpoint, torchrun_lost_steps).
As both redo the same steps, their recoveries differ by the restart alone, and the DDP target
(ratio_torchrun_over_rlaunch >= 10) does not apply; fsdp is judged on issue 16's "fault -> training
again, against torchrun's restart": kill -> rank 0's first step completed after the recovery
(phases_sum_s) against kill -> the first step of the relaunched job completed (torchrun_restart_s),
ratio_torchrun_restart_over_phases_sum >= 2.

What a snapshot costs the steady steps (issue 16's target: 1 % at the default interval). Runs
without an event differ from each other by far more than 1 % here (pairs of whole runs, with and
without snapshots, read -16 %, -5 % and -0.4 %), so the cost is read within runs, per snapshot,
against a null: --overhead-pairs interleaved pairs of --cost-steps-step runs, one with a snapshot
every --cost-every steps (many snapshots per run) and one without. In each run, with p(t) the
interval that ends when rank 0 begins step t (it holds step t-1's work and step t's snapshot
copy), a snapshot at step s costs p(s) + p(s+1) + p(s+2) (its copy, then its exchange beside
training; it commits within that) less three times the median p of the quiet steps around it
(outside every such window, up to three on each side: the load drifts within a run); the run
without snapshots gives the same figure at the same steps, which is the estimator's own bias and
noise. snapshot_cost_s is the median over the snapshots of the runs with, less the median of the
runs without, with a 90 % bootstrap interval (snapshot_cost_s_ci90; fixed seed).
snapshot_every is the interval ``auto`` takes at that cost (rlaunch's own choose(), with the
median step), and snapshot_overhead_pct the cost over that many median steps, with its interval:
snapshot_overhead_resolves_1pct says whether the interval lies wholly on one side of 1 %. The
first snapshot of each run (it also builds its pairs and allocates its buffers) is left out and
reported apart (snapshot_first_cost_s). runtime_cost_s is what the ranks themselves measured and
voted (the median of the `cost_s` of their `snapshot_committed` events), and snapshot_cpu the CPU
time of each part of one snapshot measured in this process with no training beside it: the copy
(on the training thread), the owner's digest, the send and receive of one copy over a loopback
gloo pair (both ends), and the check of a held copy when it is used. Host memory: each rank's
copy (snapshot_bytes_per_rank) and what a node holds (its ranks' copies and those it holds for the
other node: twice its own). (c) is left out with fsdp.
Prints one JSON object. Usage: scripts/bench_failure.py [--layout ddp|fsdp] [--steps 40] [--event-at 30]
[--repeats 5] [--overhead-pairs 2] [--cost-every 5] [--cost-steps 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import datetime
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlaunch.controller.view import read_snapshot  # noqa: E402
from rlaunch.runtime import snapshots  # noqa: E402
from rlaunch.store.client import Store, parse_endpoints  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd, free_port  # noqa: E402
from rlaunch.store.keys import JobKeys  # noqa: E402
from rlaunch.store.records import Generation  # noqa: E402
from scripts.bench_migration import (  # noqa: E402
    ENV,
    PARAMS,
    WORKER,
    Procs,
    _node,
    _torchrun,
    downtime,
    finals,
    log,
    median_step,
    read_timeline,
    run_rlaunch,
    steps_done,
    wait_until,
    with_spread,
)
from scripts.ending import end_on_sigterm  # noqa: E402

Row = tuple[int, float, float, str]


class Tree(Procs):
    """Procs whose agents can lose their workers or die with them; close also ends orphans.

    Workers run in sessions of their own (rlaunch's and torchrun's alike), so signalling an
    agent's process group does not reach them: they are found as its descendants.
    """

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.seen: list[psutil.Process] = []

    def descendants(self, name: str) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.procs[name].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.extend(found)
        return found

    def kill(self, name: str, agent: bool) -> float:
        """SIGKILL ``name``'s workers, and its agent too when ``agent``; return the time of the kill."""
        victims = [psutil.Process(self.procs[name].pid)] if agent else []
        victims += self.descendants(name)
        t_kill = time.time()
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if agent:
            self.procs[name].wait(10)
        return t_kill

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.descendants(name)
        super().close()
        for p in self.seen:
            try:
                if p.is_running():  # (is_running also checks that the pid was not reused)
                    p.kill()
            except psutil.NoSuchProcess:
                pass


def run_fault(
    root: Path, etcd: str, name: str, steps: int, event_at: int, lease_ttl: int, lose_node: bool,
    train_args: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """rlaunch with a warm standby; at ``event_at`` node b is lost (``lose_node``) or its worker crashes."""
    work = root / name
    timeline, logs = work / "timeline", work / "logs"
    timeline.mkdir(parents=True)
    procs = Tree(work)
    job = f"bench-{name}"
    flags = ["--lease-ttl", str(lease_ttl), "--log-dir", str(logs)]
    if not lose_node:
        flags += ["--max-restarts", "1"]  # a crashed worker counts as a restart; with none left the job fails
    try:
        for node in ("a", "b", "c"):
            procs.start(node, [
                sys.executable, "-m", "rlaunch", "--nnodes", "2", "--rdzv-endpoint", etcd, "--rdzv-id", job,
                "--node-id", node, *flags, *(["--standby"] if node == "c" else []), str(WORKER),
                "--mode", "rlaunch", "--steps", str(steps), "--timeline", str(timeline), *train_args,
            ])  # fmt: skip
            wait_until(lambda n=node: _node(etcd, job, n), 60, f"{name}: node {node} to join")
        wait_until(lambda: (n := _node(etcd, job, "c")) and n["state"] == "standby" and n["runtime"], 180,
                   f"{name}: standby c to be ready")  # fmt: skip
        wait_until(lambda: steps_done(timeline / "rank0.txt") >= event_at, 300, f"{name}: step {event_at}")
        t_kill = procs.kill("b", agent=lose_node)
        log(f"{name}: SIGKILLed {'node b (agent and worker)' if lose_node else 'the worker of node b'}")
        ends = ["a", "c"] if lose_node else ["a", "b", "c"]
        codes = [procs.wait(n, 600) for n in ends]
        if any(codes):
            raise RuntimeError(f"{name}: agents {ends} exited {codes}; logs in {work}")
        events = [json.loads(line) for line in (logs / job / "events.jsonl").read_text().splitlines()]
        result: dict[str, Any] = {
            "finals": {}, "t_event": t_kill, "timeline": timeline, "events": events,
            "last_generation": asyncio.run(last_generation(etcd, job)),
        }  # fmt: skip
        for n in ("a", "c"):
            result["finals"].update(finals(procs.output(n)))
        return result
    finally:
        procs.close()


def run_torchrun_kill(
    root: Path, name: str, steps: int, event_at: int, ckpt_every: int, train_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Plain DDP (or FSDP2) under torchrun with periodic checkpoints; node b is SIGKILLed, torchrun
    restarts on a and c (an FSDP2 rank resumes from its own shard's checkpoint)."""
    work = root / name
    (work / "timeline").mkdir(parents=True)
    procs = Tree(work)
    extra = ("--ckpt-every", str(ckpt_every), *train_args)
    try:
        port = free_port()
        for node, host in (("a", True), ("b", False)):
            _torchrun(procs, name, node, port, host, steps, work, extra)
            time.sleep(2.0)  # a hosts the c10d store
        wait_until(lambda: steps_done(work / "timeline" / "rank0.txt") >= event_at, 300, f"{name}: step {event_at}")
        t_kill = procs.kill("b", agent=True)
        log(f"{name}: SIGKILLed node b (torchrun agent and worker)")
        procs.wait("a", 120)  # its worker loses its peer; with no restarts left, the job exits
        log(f"{name}: the job exited; starting torchrun again on a and c")
        port = free_port()
        for node, host in (("a2", True), ("c", False)):
            _torchrun(procs, f"{name}-2", node, port, host, steps, work, extra)
        for n in ("a2", "c"):
            code = procs.wait(n, 900)
            if code:
                raise RuntimeError(f"{name}: torchrun on {n} exited {code}; logs in {work}")
        result: dict[str, Any] = {"finals": {}, "t_event": t_kill, "timeline": work / "timeline"}
        for n in ("a2", "c"):
            result["finals"].update(finals(procs.output(n)))
        return result
    finally:
        procs.close()


async def last_generation(endpoint: str, job: str) -> Generation | None:
    """The job's generation record as it ended (a finished generation keeps its created_at)."""
    store = Store(parse_endpoints(endpoint), timeout=5.0)
    try:
        await store.connect(10.0)
        return (await read_snapshot(store, JobKeys(job))).generation
    finally:
        await store.close()


def planned_at(result: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """When the controller planned the replace generation after the kill, and its `generation` event."""
    event = first_event(result["events"], "generation", result["t_event"], plan="replace")
    record = result["last_generation"]
    if record is None or record.number != event["generation"] or record.kind != "replace":
        raise RuntimeError(f"the job ended in generation {record}, not in the replace generation of {event}")
    return record.created_at, event


def first_event(events: list[dict[str, Any]], kind: str, after: float, **data: Any) -> dict[str, Any]:
    """The first ``kind`` event at or after ``after`` whose data has the values ``data``."""
    found = sorted(
        (e for e in events if e["kind"] == kind and e["time"] >= after and data.items() <= e["data"].items()),
        key=lambda e: e["time"],
    )
    if not found:
        raise RuntimeError(f"no {kind} event {data or ''} after the kill in the event log")
    return found[0]


def phases(result: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    """Split kill -> first step completed after recovery into the phases of the module docstring."""
    events, t_kill = result["events"], result["t_event"]
    t_plan, gen = planned_at(result)
    number = gen["generation"]
    of_gen = [e for e in events if e["generation"] == number]
    offers = [e["time"] for e in of_gen if e["kind"] == "replacement_offered"]
    recovered = [e for e in of_gen if e["kind"] == "recovered"]
    sent = [e for e in of_gen if e["kind"] == "replica_sent"]
    joined = [e for e in of_gen if e["kind"] == "joined"]
    if len(offers) < 2 or not recovered or not sent or not joined:
        seen = f"offers at {offers}, recovered {recovered}, sent {sent}, joined {joined}"
        raise RuntimeError(f"generation {number}: {seen}")
    t_offer = max(offers)
    t_done = max(e["time"] for e in recovered + sent + joined)
    # rank 0 (node a) resumes after its recovery and, as the replica, after sending the state
    t_rank0 = max(e["time"] for e in recovered + sent if e["node_id"] == "a")
    t_resume = next(end for _, start, end, _ in rows if start > t_rank0)
    noticed = first_event(events, "recovering", t_kill)
    started_a = [e for e in events if e["kind"] == "workers_started" and e["node_id"] == "a"]
    return {
        "detect_s": t_plan - t_kill,
        "plan_s": t_offer - t_plan,
        "generation_event_s": gen["time"] - t_kill,
        "transfer_s": t_done - t_offer,
        "resume_s": t_resume - t_done,
        "phases_sum_s": t_resume - t_kill,
        "survivor_noticed_s": noticed["time"] - t_kill,
        "survivor_recovered_s": recovered[0]["data"]["seconds"],
        "joiner_received_s": joined[0]["data"]["seconds"],
        "state_bytes": sum(e["data"]["bytes"] for e in sent),
        "resumed_at_step": recovered[0]["data"]["resume_at"],
        "rolled_back_to": recovered[0]["data"].get("rolled_back_to"),
        "steps_redone": recovered[0]["data"].get("steps_redone", 0),
        "plan_reason": gen["data"]["reason"],
        "survivor_kept_its_process": len(started_a) == 1,
    }


SNAPSHOT_LINE = re.compile(r"event snapshot_committed \(generation \d+\) (\{.*\})")
#: the intervals a snapshot at step s is charged: p(s), p(s+1), p(s+2) (see the module docstring)
SNAPSHOT_WINDOW = 3
#: the quiet intervals on each side of a window that give its baseline
BASELINE_SPAN = 3


def committed_snapshots(work: Path) -> list[dict[str, Any]]:
    """The `snapshot_committed` events of a no-event run's agents (a: rank 0, b: rank 1), in order."""
    found = []
    for node in ("a", "b"):
        text = (work / f"{node}.log").read_text(errors="replace")
        found += [ast.literal_eval(m.group(1)) for m in SNAPSHOT_LINE.finditer(text)]
    return found


def intervals(timeline: Path) -> dict[int, float]:
    """p(t): from rank 0's start of step t-1 to its start of step t (see the module docstring)."""
    rows = [r for r in read_timeline(timeline / "rank0.txt") if r[3] in ("real", "active")]
    return {b[0]: b[1] - a[1] for a, b in zip(rows[:-1], rows[1:], strict=True) if b[0] == a[0] + 1}


def window_costs(p: dict[int, float], at: list[int], first: int) -> tuple[list[float], float | None]:
    """What each snapshot step of ``at`` costs in the intervals ``p`` (its window's sum less as many
    medians of the quiet intervals around it: the machine's load drifts within a run), and the
    same for the window of ``first``, the run's first snapshot (which also builds its pairs)."""
    windows = {s + i for s in [*at, first] for i in range(SNAPSHOT_WINDOW)}
    quiet = {t: v for t, v in p.items() if t not in windows and t >= 3}  # steps 0 and 1: warm-up

    def cost(s: int) -> float | None:
        span = range(s - BASELINE_SPAN, s + SNAPSHOT_WINDOW + BASELINE_SPAN)
        around = [quiet[t] for t in span if t in quiet] or list(quiet.values())  # the run's, where none is near
        inside = [p.get(s + i) for i in range(SNAPSHOT_WINDOW)]
        if not around or None in inside:
            return None
        return sum(v for v in inside if v is not None) - SNAPSHOT_WINDOW * statistics.median(around)

    costs = [c for c in map(cost, at) if c is not None]
    return costs, cost(first)


def bootstrap_ci(with_: list[float], without: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 90 % interval of median(with_) - median(without), resampling both (a fixed seed: reproducible)."""
    draw = random.Random(0)
    diffs = sorted(
        statistics.median(draw.choices(with_, k=len(with_))) - statistics.median(draw.choices(without, k=len(without)))
        for _ in range(rounds)
    )
    return diffs[int(0.05 * rounds)], diffs[int(0.95 * rounds) - 1]


def snapshot_cpu() -> dict[str, float]:
    """The CPU seconds of each part of one snapshot of one rank's state (bench_train's model over 2
    FSDP ranks holds as many bytes as its half, width 2048 and depth 3, with AdamW's moments), in
    this process with no training beside it: the median of 3 rounds (see the module docstring)."""
    import threading

    import torch
    from torch.distributed import HashStore, ProcessGroup, ProcessGroupGloo

    from rlaunch.runtime import hostcopy, rng
    from scripts.bench_train import make_model

    torch.set_num_threads(1)
    model = make_model(0, 2048, 3, out=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    tracked = {"model": model, "optimizer": opt}
    store, ends = HashStore(), {}

    def build(rank: int) -> None:
        gloo = ProcessGroupGloo(store, rank, 2, timeout=datetime.timedelta(seconds=60))
        ends[rank] = ProcessGroup(store, rank, 2)
        ends[rank]._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        ends[rank]._set_default_backend(ProcessGroup.BackendType.GLOO)

    builders = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    rounds: dict[str, list[float]] = {}
    own = held = None
    for _ in range(3):
        began = time.process_time()
        own = hostcopy.capture(tracked, 20, rng.capture(), own)
        rounds.setdefault("copy_s", []).append(time.process_time() - began)
        began = time.process_time()
        hostcopy.seal(own)
        rounds.setdefault("digest_s", []).append(time.process_time() - began)
        got: dict[str, Any] = {"copy": held}
        receiver = threading.Thread(target=lambda box=got: box.update(copy=hostcopy.receive(ends[1], box["copy"])))
        began = time.process_time()
        receiver.start()
        hostcopy.send(ends[0], own)
        receiver.join()
        rounds.setdefault("send_and_receive_s", []).append(time.process_time() - began)
        held = got["copy"]
        began = time.process_time()
        hostcopy.verify(held, "the held copy")
        rounds.setdefault("check_when_used_s", []).append(time.process_time() - began)
    out = {k: round(statistics.median(v), 4) for k, v in rounds.items()}
    out["bytes"] = own.nbytes if own is not None else 0
    return out


def snapshot_figures(
    fault_events: list[list[dict[str, Any]]], cost_runs: list[dict[str, Any]], cpu: dict[str, float]
) -> dict[str, Any]:
    """What the host snapshots cost and hold (see the module docstring): from the node-loss runs'
    `snapshot_committed` events (one list per run), the cost runs' windows and the CPU breakdown."""
    per_run = [[e["data"] for e in events if e["kind"] == "snapshot_committed"] for events in fault_events]
    if not all(per_run):
        raise RuntimeError(f"a node-loss run committed no host snapshot (snapshots per run: {list(map(len, per_run))})")
    committed = [d for run in per_run for d in run]
    per_rank = max(int(d["bytes"]) for d in committed)
    with_ = [c for run in cost_runs for c in run["with"]]
    without = [c for run in cost_runs for c in run["without"]]
    step = statistics.median(v for run in cost_runs for v in run["steps"])
    cost = statistics.median(with_) - statistics.median(without)
    lo, hi = bootstrap_ci(with_, without)
    copy_s = statistics.median(float(d["copy_s"]) for d in committed)
    # auto's choice at this cost, as a rank would vote it: never less than its copy on the training thread
    every = snapshots.choose(snapshots.AUTO_EVERY, max(1, round(1000 * max(cost, copy_s))), round(1000 * step), 1)

    def pct(seconds: float) -> float:
        return round(100 * seconds / (every * step), 2)

    cpu_total = cpu["copy_s"] + cpu["digest_s"] + cpu["send_and_receive_s"]
    runtime_costs = [float(d["cost_s"]) for run in cost_runs for d in run["events"] if float(d["cost_s"]) > 0]
    firsts = [r["first"] for r in cost_runs if r["first"] is not None]
    out: dict[str, Any] = {
        "snapshot_every_followed": sorted({int(d["every"]) for d in committed}),
        "snapshot_bytes_per_rank": per_rank,
        "host_memory_per_node_bytes": 2 * per_rank,  # one rank per node: its own copy and the other node's
        "snapshot_copy_s": round(copy_s, 4),
        "snapshot_exchange_s": round(statistics.median(float(d["exchange_s"]) for d in committed), 4),
        "snapshot_cpu": cpu,
        "snapshot_cost_s": round(cost, 4),
        "snapshot_cost_s_ci90": [round(lo, 4), round(hi, 4)],
        "snapshot_cost_windows": [len(with_), len(without)],
        "snapshot_cost_s_runs": [
            [round(statistics.median(r["with"]), 4), round(statistics.median(r["without"]), 4)] for r in cost_runs
        ],
        "snapshot_first_cost_s": round(statistics.median(firsts), 3) if firsts else None,
        "runtime_cost_s": round(statistics.median(runtime_costs), 4) if runtime_costs else None,
        "cost_median_step_s": round(step, 4),
        "snapshot_every": every,
        "snapshot_overhead_pct": pct(cost),
        "snapshot_overhead_pct_ci90": [pct(lo), pct(hi)],
        "snapshot_overhead_resolves_1pct": hi < 0.01 * every * step or lo > 0.01 * every * step,
        # were every CPU second of a snapshot taken from training (both of its ends on this node's cores)
        "snapshot_cpu_bound_pct": pct(cpu_total),
    }
    with_spread(out, "snapshots_committed", [len({(d["rank"], d["step"]) for d in run}) for run in per_run])
    return out


def cost_run(root: Path, etcd: str, i: int, args: Any, train: tuple[str, ...]) -> dict[str, Any]:
    """One pair of cost runs (see the module docstring): a snapshot every --cost-every steps, then none."""
    found: dict[str, Any] = {}
    first = 0
    at = list(range(args.cost_every, args.cost_steps - SNAPSHOT_WINDOW + 1, args.cost_every))
    for every in (str(args.cost_every), "0"):
        run = run_rlaunch(root, etcd, f"snapshots-{every}-{i}", args.cost_steps, None, 3, train,
                          {**ENV, snapshots.ENV: every})  # fmt: skip
        p = intervals(run["timeline"])
        if every != "0":
            found["events"] = committed_snapshots(run["work"])
            first = min(int(e["step"]) for e in found["events"])  # its generation's first: it builds the pairs
            found["with"], found["first"] = window_costs(p, [s for s in at if s >= first + SNAPSHOT_WINDOW], first)
        else:
            found["without"], _ = window_costs(p, [s for s in at if s >= first + SNAPSHOT_WINDOW], first)
        found.setdefault("steps", []).extend(v for t, v in p.items() if t >= 3)
    return found


def save_gap(rows: list[Row], step: int) -> float:
    """The gap before the first run of ``step``: the checkpoint saved after the step before it."""
    at = next(i for i, r in enumerate(rows) if r[0] == step)
    return rows[at][1] - rows[at - 1][2]


def gap_median(rows: list[Row]) -> float:
    """The usual gap between one step's end and the next one's start (the loop's own overhead)."""
    return statistics.median(b[1] - a[2] for a, b in zip(rows[:-1], rows[1:], strict=True) if b[0] == a[0] + 1)


Same = Callable[[dict[str, Any]], bool]


def node_loss_figures(lost: dict[str, Any], same: Same) -> dict[str, Any]:
    """One rlaunch node loss: its recovery, in phases (see the module docstring)."""
    rows = read_timeline(lost["timeline"] / "rank0.txt")
    med = median_step(rows)
    down, step = downtime(rows, lost["t_event"], med)
    return {"event_at_step": step, "median_step_s": med, "rlaunch_recovery_s": down, **phases(lost, rows),
            "bit_identical": same(lost)}  # fmt: skip


def torchrun_figures(tr: dict[str, Any], ckpt_every: int, same: Same) -> dict[str, Any]:
    """One torchrun node loss: its recovery, its restart and the steps it redid."""
    rows = read_timeline(tr["timeline"] / "rank0.txt")
    med = median_step(rows)
    down, step = downtime(rows, tr["t_event"], med)
    # The relaunched job's first step is the one its checkpoint resumed from.
    relaunched = next(r for r in rows if r[1] > tr["t_event"])
    return {
        "torchrun_recovery_s": down,
        "torchrun_event_at_step": step,
        "torchrun_lost_steps": step - relaunched[0],
        "torchrun_restart_s": relaunched[2] - tr["t_event"],
        "torchrun_ckpt_save_s": save_gap(rows, ckpt_every) - gap_median(rows),
        "torchrun_median_step_s": med,
        "torchrun_resume_bit_identical": same(tr),
    }


def crash_figures(crash: dict[str, Any], same: Same) -> dict[str, Any]:
    """One crashed worker: kill -> the controller planned its replacement, and the recovery."""
    rows = read_timeline(crash["timeline"] / "rank0.txt")
    t_plan, gen = planned_at(crash)
    return {
        "worker_crash_detect_s": t_plan - crash["t_event"],
        "worker_crash_recovery_s": downtime(rows, crash["t_event"], median_step(rows))[0],
        "worker_crash_plan_reason": gen["data"]["reason"],
        "worker_crash_bit_identical": same(crash),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of repeated events (one dict per event, the same keys): each number as
    bench_migration reports one (the median, with ``_runs``, ``_min`` and ``_max``), each flag true
    only if it held in every event, anything else as it was where all events agree, else per event."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        if all(isinstance(v, bool) for v in values):
            out[key] = all(values)
        elif all(isinstance(v, int | float) for v in values):
            with_spread(out, key, values)
        else:
            out[key] = values[0] if all(v == values[0] for v in values) else values
    return out


def add_ratio(out: dict[str, Any], key: str, over: str, under: str) -> None:
    """``key``: ``over``'s median over ``under``'s; ``key_worst``: its least over ``under``'s most
    (bench_migration's ``ratio_torchrun_over_rlaunch`` and ``_worst``)."""
    out[key] = round(out[over] / max(out[under], 1e-3), 1)
    out[f"{key}_worst"] = round(out[f"{over}_min"] / max(out[f"{under}_max"], 1e-3), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--event-at", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5, help="how often each event is run, per launcher")
    ap.add_argument("--ckpt-every", type=int, default=20, help="torchrun baseline: checkpoint every N steps")
    ap.add_argument("--lease-ttl", type=int, default=3, help="rlaunch agents' --lease-ttl")
    ap.add_argument("--skip-crash", action="store_true", help="leave out (c), the crashed worker")
    ap.add_argument("--layout", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--overhead-pairs", type=int, default=2, help="fsdp: pairs of cost runs (with, without)")
    ap.add_argument("--cost-every", type=int, default=5, help="fsdp: the cost runs' snapshot interval")
    ap.add_argument("--cost-steps", type=int, default=80, help="fsdp: the cost runs' steps")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be at least 1 (the house rule for a quoted median is 5).")
    end_on_sigterm()
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="rlaunch-bench-failure-"))
    log(f"logs in {root}")
    fsdp = args.layout == "fsdp"
    train = ("--layout", args.layout)
    n = args.repeats
    lost: list[dict[str, Any]] = []
    tr: list[dict[str, Any]] = []
    crash: list[dict[str, Any]] = []
    cost_runs: list[dict[str, Any]] = []
    with EmbeddedEtcd() as etcd:
        log("reference: rlaunch, no event")
        reference_run = run_rlaunch(root, etcd.endpoint, "reference", args.steps, None, 3, train)
        for i in range(n):  # interleaved, so that drifts in the machine's load hit both alike
            log(f"(a) {i + 1}/{n} rlaunch: node b lost, the warm standby takes its rank")
            lost.append(run_fault(root, etcd.endpoint, f"rlaunch-node-loss-{i}", args.steps, args.event_at,
                                  args.lease_ttl, True, train))  # fmt: skip
            log(f"(b) {i + 1}/{n} torchrun: node b lost, restart from the checkpoint of every {args.ckpt_every} steps")
            tr.append(run_torchrun_kill(root, f"torchrun-node-loss-{i}", args.steps, args.event_at, args.ckpt_every,
                                        train))  # fmt: skip
        for i in range(args.overhead_pairs if fsdp else 0):
            log(f"snapshot cost, pair {i + 1}: a snapshot every {args.cost_every} steps, then none")
            cost_runs.append(cost_run(root, etcd.endpoint, i, args, train))
        for i in range(0 if args.skip_crash or fsdp else n):
            log(f"(c) {i + 1}/{n} rlaunch: the worker of node b crashes")
            crash.append(run_fault(root, etcd.endpoint, f"rlaunch-worker-crash-{i}", args.steps, args.event_at,
                                   args.lease_ttl, False))  # fmt: skip

    reference = {r: (f["params"], f["optim"]) for r, f in reference_run["finals"].items()}

    def same(result: dict[str, Any]) -> bool:
        return {r: (f["params"], f["optim"]) for r, f in result["finals"].items()} == reference

    rl_runs = [node_loss_figures(r, same) for r in lost]
    out: dict[str, Any] = {
        "layout": args.layout,
        "params_m": round(PARAMS / 1e6, 2),
        "steps": args.steps,
        "repeats": n,
        "lease_ttl_s": args.lease_ttl,
        "torchrun_ckpt_every": args.ckpt_every,
        **summarize(rl_runs),
        **summarize([torchrun_figures(r, args.ckpt_every, same) for r in tr]),
    }
    add_ratio(out, "ratio_torchrun_over_rlaunch", "torchrun_recovery_s", "rlaunch_recovery_s")
    add_ratio(out, "ratio_torchrun_restart_over_phases_sum", "torchrun_restart_s", "phases_sum_s")
    if fsdp:
        log("snapshot cost: the CPU time of each part, in this process")
        out.update(snapshot_figures([r["events"] for r in lost], cost_runs, snapshot_cpu()))
    if crash:
        out.update(summarize([crash_figures(r, same) for r in crash]))
    out["bench_wall_s"] = round(time.monotonic() - began, 1)
    # fsdp: both redo the steps since their last copy, so the restarts are compared (module docstring)
    out["targets"] = (
        {"ratio_torchrun_restart_over_phases_sum_ge_2": out["ratio_torchrun_restart_over_phases_sum"] >= 2}
        if fsdp
        else {"ratio_ge_10": out["ratio_torchrun_over_rlaunch"] >= 10}
    )
    out["targets"]["node_loss_detected_within_ttl_plus_1s"] = out["detect_s"] <= args.lease_ttl + 1
    if crash:
        out["targets"]["worker_crash_detected_within_1s"] = out["worker_crash_detect_s"] < 1
    if fsdp:
        out["targets"]["rolled_back_live"] = all(
            r["rolled_back_to"] is not None and r["survivor_kept_its_process"] for r in rl_runs
        )
        out["targets"]["snapshot_overhead_le_1pct"] = out["snapshot_overhead_pct"] <= 1.0
        out["targets"]["snapshot_overhead_ci90_le_1pct"] = out["snapshot_overhead_pct_ci90"][1] <= 1.0
        out["targets"]["snapshot_cpu_bound_le_1pct"] = out["snapshot_cpu_bound_pct"] <= 1.0
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
