#!/usr/bin/env python3
"""Benchmark: training efficiency under periodic maintenance, rlaunch drains against torchrun restarts.

Three runs of one job (scripts/bench_train.py, DDP over gloo, one process per node, 1 thread
each), one after another, each measured over a window of --minutes (default 10) that opens once
the job trains (its third step done) and, for rlaunch, its standby is warm:
  base      rlaunch, 2 active nodes and 1 warm standby, no migration. Every --every seconds the
            standby's agent is stopped and a new one started (a new node id), as the drain run
            restarts its drained node: both runs then carry the same CPU load from standby
            warm-ups on this one machine (on a cluster they happen on other machines), and
            they differ only by the migrations;
  rlaunch   the same job; every --every seconds (at 0.5, 1.5, 2.5, ... periods into the
            window) one active node is drained (`rlaunch drain`) onto the standby, then
            undrained (`rlaunch undrain`) and started again as an agent, and it becomes the next
            standby. The node drained is the one active longest, so the three nodes take turns.
            A drain waits for the standby to be warm if it is not yet. The bench runs the
            drain and undrain commands' own functions (rlaunch.cli.drain) in its process: a
            CLI process start-up takes some 15 s of a loaded 2-core machine;
  torchrun  plain DDP under torchrun (c10d rendezvous), checkpointing every --ckpt-every steps
            (rank 0, torch.save, synchronous). At the same times both torchrun agents and their
            workers are SIGKILLed and the job is started again at once, resuming from its last
            checkpoint: steps since that checkpoint are lost, and the restart (processes,
            imports, rendezvous, loading) is time without steps. Restarting at once leaves out
            any scheduler delay, in torchrun's favour. A kill waits until the restarted job has
            done a step, so each period trains at least once.

Definitions (rank 0's timeline, one line per step: step, start, end, role, pid; the rank-0
process changes when its node is drained, and the file goes on):
  progress(t)      1 + the step of the last step completed by time t (by end time). After a
                   restart from a checkpoint, steps start again from the checkpoint's, so lost
                   steps are taken back: progress is the training state the job holds at t.
  useful steps     progress(window end) - progress(window start): distinct steps applied and
                   kept, each counted once however many times it ran.
  kept execution   of a step: its last run, if no restart took it back (walking the steps by
                   end time, a step supersedes every kept run of the same or a later step).
  useful-step time the seconds of the window inside kept executions (start to end of each),
                   except that the first 3 steps begun after each event (a drain's switch, a
                   torchrun kill, the base run's standby restart; from the end of the last step
                   before it) count at most the run's median step time: a slow first step after
                   a switch or a restart is downtime. The time between steps, a switch,
                   a restart, lost steps and the step under way at the window's end are not in
                   it. Step durations are each run's own, not the base run's median: the runs
                   follow each other on a shared machine whose load drifts, and a step that
                   takes longer because the machine is busier is still training.
  useful fraction  useful-step time / the window's wall time (base: the time between steps
                   and the capped steps after its standby restarts are its only losses, about
                   1 %).
  efficiency       a run's useful fraction / the base run's. Two variants are printed too:
                   `*_median` counts each useful step as the run's median step time (steps
                   under load are skewed: the mean is above the median, by a share that moves
                   with the load), and `*_same_step` counts it as the base run's median (useful
                   steps / the base run's): both move with the machine's load between runs.
  downtime         of one event: prev = the last step done before the event (for a drain, the
                   start of the joiner's first step, i.e. the switch; for torchrun, the kill);
                   the wall time from prev's end until progress is 3 steps beyond it, minus 3
                   median steps. For torchrun it includes the restart and the redone steps.
                   `median_reported_downtime_s` is what `rlaunch drain` reports (the workers'
                   `switched` events: a survivor's first step after the switch over its median).
The prepare phase of a drain runs while training continues: its cost (CPU on this machine) is
in the efficiency, not in the downtime.

Prints one JSON object; the logs, timelines and each run's run.json stay in a temporary
directory (`logs` in the JSON), from which `--analyze DIR` prints the JSON again. Usage:
  scripts/bench_efficiency.py [--minutes 10] [--every 60] [--ckpt-every 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlaunch.cli.drain import _drain, _undrain  # noqa: E402
from rlaunch.cli.status import fetch_status  # noqa: E402
from rlaunch.errors import RlaunchError  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd, free_port  # noqa: E402
from scripts import bench_migration  # noqa: E402
from scripts.ending import die_with_parent, end_on_sigterm  # noqa: E402

WORKER = REPO / "scripts" / "bench_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FOREVER = 10**7  # steps: every run is ended by the bench once its window is over
AFTER = 3  # steps after an event that its downtime waits for
POLL_S = 2.0  # seconds between reads of the job's status: each is a new etcd client, CPU on a loaded machine

Row = tuple[int, float, float, str, int]


def log(msg: str) -> None:
    print(f"[effic {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    """bench_migration's wait, polling every POLL_S: each read of the job's status costs CPU here."""
    return bench_migration.wait_until(pred, timeout, what, POLL_S)


def poll(pred: Any, deadline: float) -> bool:
    """Whether ``pred`` becomes true before the wall-clock ``deadline``."""
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(POLL_S)
    return False


def sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 1.0))


# -- timelines --------------------------------------------------------------------------------


def read_rows(path: Path) -> list[Row]:
    """Trained steps (not sandbox ones) of one rank's timeline, by end time."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[3] in ("real", "active"):
            rows.append((int(parts[0]), float(parts[1]), float(parts[2]), parts[3], int(parts[4])))
    return sorted(rows, key=lambda r: r[2])


def progress(rows: list[Row], t: float) -> int:
    """1 + the step of the last step completed by ``t`` (0 before any)."""
    i = bisect.bisect_right([r[2] for r in rows], t)
    return rows[i - 1][0] + 1 if i else 0


def median_step(rows: list[Row], t0: float, t1: float) -> float:
    return statistics.median(r[2] - r[1] for r in rows if t0 <= r[1] and r[2] <= t1)


def downtime(rows: list[Row], t_event: float, median: float) -> float | None:
    """Wall time from the last step done before ``t_event`` until 3 steps beyond it, minus 3 medians."""
    before = [r for r in rows if r[2] <= t_event]
    if not before:
        return None
    prev = before[-1]
    target = prev[0] + 1 + AFTER
    after = next((r for r in rows if r[2] > t_event and r[0] + 1 >= target), None)
    return None if after is None else after[2] - prev[2] - AFTER * median


def first_rows_of_new_pids(work: Path, since: float) -> list[Row]:
    """Per rank, the first trained step of each process first seen after ``since`` (joiners)."""
    out = []
    for path in sorted((work / "timeline").glob("rank[0-9]*.txt")):
        rows = sorted(read_rows(path), key=lambda r: r[1])
        seen = {r[4] for r in rows if r[1] < since}
        for r in rows:
            if r[4] not in seen:
                seen.add(r[4])
                if r[1] >= since:
                    out.append(r)
    return out


# -- processes --------------------------------------------------------------------------------


class Procs:
    """The processes of one run, each with its log file; every one (and its children) ended on close."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = (self.work / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=ENV,
                                start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int) -> None:
        """Send ``sig`` to the process and all its descendants (torchrun's workers have their own session)."""
        proc = self.procs[name]
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if sig == signal.SIGKILL:
            proc.wait(30)
            psutil.wait_procs(tree, timeout=30)

    def stop(self, name: str, timeout: float = 40) -> None:
        """SIGTERM, then SIGKILL to the whole tree if it is not gone within ``timeout``."""
        proc = self.procs[name]
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=30)
        proc.wait(30)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None or _children(proc.pid):
                self.stop(name)


def _children(pid: int) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.NoSuchProcess:
        return []


def node_of(etcd: str, job: str, node_id: str) -> dict[str, Any] | None:
    status = asyncio.run(fetch_status(etcd, job, 5.0))
    return next((n for n in status["nodes"] if n["node_id"] == node_id), None) if status else None


def warm(etcd: str, job: str, node_id: str) -> bool:
    node = node_of(etcd, job, node_id)
    return bool(node and node["state"] == "standby" and node["runtime"])


# -- the runs ---------------------------------------------------------------------------------


def run_rlaunch(root: Path, etcd: str, name: str, args: argparse.Namespace, drains: bool) -> dict[str, Any]:
    """The rlaunch job for one window: with drains, or (base) with only the standby restarted."""
    work = root / name
    (work / "timeline").mkdir(parents=True)
    procs = Procs(work)
    job = f"effic-{name}-{os.getpid()}"
    starts: dict[str, int] = {}

    def agent(node: str, standby: bool) -> None:
        starts[node] = starts.get(node, 0) + 1
        procs.start(f"{node}-{starts[node]}", [
            sys.executable, "-m", "rlaunch", "--nnodes", "2", "--rdzv-endpoint", etcd, "--rdzv-id", job,
            "--node-id", node, "--lease-ttl", "10", "--straggler-window", "0", *(["--standby"] if standby else []),
            str(WORKER), "--mode", "rlaunch", "--steps", str(FOREVER), "--timeline", str(work / "timeline"),
            "--width", str(args.width), "--depth", str(args.depth),
        ])  # fmt: skip

    rank0 = work / "timeline" / "rank0.txt"
    events: list[dict[str, Any]] = []
    try:
        for node in ("a", "b", "c"):
            agent(node, node == "c")
            wait_until(lambda n=node: node_of(etcd, job, n), 300, f"{name}: node {node} to register")
        wait_until(lambda: warm(etcd, job, "c"), 900, f"{name}: standby c to be warm")
        wait_until(lambda: progress(read_rows(rank0), time.time()) >= 3, 600, f"{name}: the first 3 steps")
        t0 = time.time()
        t_end = t0 + args.minutes * 60
        log(f"{name}: window open for {args.minutes * 60:.0f} s")
        active, standby = ["b", "a"], "c"  # drained in this order, joiners appended
        k = 0
        while (t_sched := t0 + args.every * (k + 0.5)) < t_end:
            sleep_until(t_sched)
            waited = time.time()
            if not poll(lambda s=standby: warm(etcd, job, s), t_end):
                log(f"{name}: standby {standby} was not warm before the window's end; no further event")
                break
            now = time.time()
            event: dict[str, Any] = {"at_s": round(now - t0, 2), "standby_wait_s": round(now - waited, 2)}
            if drains:
                victim = active.pop(0)
                event.update(node=victim, joiner=standby, t=time.time())
                try:
                    result = asyncio.run(_drain(etcd, job, victim, False, 300.0))
                except RlaunchError as exc:
                    raise RuntimeError(f"{name}: the drain of {victim} failed: {exc}") from exc
                event["drain_s"] = round(time.time() - event["t"], 2)
                event["ok"] = True
                downtime_ms = result.get("downtime_ms")
                event["reported_downtime_s"] = None if downtime_ms is None else round(downtime_ms / 1000, 4)
                log(f"{name}: node {victim} drained onto {result['replaced_by']} in {event['drain_s']} s; "
                    f"reported downtime {downtime_ms} ms")  # fmt: skip
                procs.procs[f"{victim}-{starts[victim]}"].wait(300)
                asyncio.run(_undrain(etcd, job, victim))
                agent(victim, True)
                active.append(standby)
                standby = victim
            else:  # the same standby restart, without a migration
                event.update(t=time.time())
                procs.stop(f"{standby}-{starts[standby]}")
                standby = f"c{k + 1}"
                agent(standby, True)
            events.append(event)
            k += 1
        sleep_until(t_end)
        return save_run(work, t0, t_end, events)
    finally:
        procs.close()


def run_torchrun(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Plain DDP under torchrun, checkpointing every --ckpt-every steps, killed and restarted every --every s."""
    work = root / "torchrun"
    (work / "timeline").mkdir(parents=True)
    procs = Procs(work)
    rank0 = work / "timeline" / "rank0.txt"

    def start_job(i: int) -> list[str]:
        port = free_port()
        names = []
        for node, host in (("a", True), ("b", False)):
            names.append(f"{node}-{i}")
            procs.start(names[-1], [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"effic-{i}",
                "--rdzv-conf", f"is_host={int(host)}", "--monitor-interval", "0.1", str(WORKER), "--mode", "plain",
                "--steps", str(FOREVER), "--timeline", str(work / "timeline"), "--ckpt", str(work / "ckpt.pt"),
                "--ckpt-every", str(args.ckpt_every), "--width", str(args.width), "--depth", str(args.depth),
            ])  # fmt: skip
            if host:
                time.sleep(2.0)  # a hosts the c10d store
        return names

    events: list[dict[str, Any]] = []
    try:
        job = start_job(0)
        wait_until(lambda: progress(read_rows(rank0), time.time()) >= 3, 600, "torchrun: the first 3 steps")
        t0 = time.time()
        t_end = t0 + args.minutes * 60
        log(f"torchrun: window open for {args.minutes * 60:.0f} s")
        k = 0
        started = t0
        while (t_sched := t0 + args.every * (k + 0.5)) < t_end:
            sleep_until(t_sched)
            waited = time.time()
            if not poll(lambda s=started: any(r[1] >= s for r in read_rows(rank0)), t_end):
                log("torchrun: the restarted job did no step before the window's end; no further kill")
                break
            t_kill = time.time()
            for name in job:
                procs.kill(name, signal.SIGKILL)
            log(f"torchrun: killed at progress {progress(read_rows(rank0), t_kill)}, restarting")
            started = time.time()
            job = start_job(k + 1)
            events.append({"at_s": round(t_kill - t0, 2), "t": t_kill, "step_wait_s": round(t_kill - waited, 2)})
            k += 1
        sleep_until(t_end)
        return save_run(work, t0, t_end, events)
    finally:
        procs.close()


# -- results ----------------------------------------------------------------------------------


def save_run(work: Path, t0: float, t_end: float, events: list[dict[str, Any]]) -> dict[str, Any]:
    run = {"t0": t0, "t_end": t_end, "events": events}
    (work / "run.json").write_text(json.dumps(run, indent=1))
    return run


def kept_seconds(rows: list[Row], t0: float, t_end: float, events: list[float], median: float) -> float:
    """Seconds of the window spent in the executions of steps that the job's final state holds.

    Rows are walked by end time; a step that ends supersedes every kept execution of the same
    or a later step (a restart from a checkpoint redoes them: the earlier runs were lost). The
    first AFTER steps begun after the last step that ended before each event count at most
    ``median``: a slow first step after a switch or a restart is downtime (a survivor may begin
    its first step after a switch before the joiner does, and wait for it there).
    """
    kept: list[Row] = []
    for r in rows:
        if t0 < r[2] <= t_end:
            while kept and kept[-1][0] >= r[0]:
                kept.pop()
            kept.append(r)
    capped: set[Row] = set()
    for t in events:
        anchor = max((r[2] for r in rows if r[2] <= t), default=t)  # the end of the last step before it
        capped.update([r for r in kept if r[1] >= anchor][:AFTER])
    total = 0.0
    for r in kept:
        seconds = r[2] - max(r[1], t0)
        total += min(seconds, median) if r in capped else seconds
    return total


def measure(work: Path, events: list[float]) -> dict[str, Any]:
    run = json.loads((work / "run.json").read_text())
    rows, t0, t_end = read_rows(work / "timeline" / "rank0.txt"), run["t0"], run["t_end"]
    med = median_step(rows, t0, t_end)
    steps = progress(rows, t_end) - progress(rows, t0)
    wall = t_end - t0
    kept = kept_seconds(rows, t0, t_end, events, med)
    return {
        "rows": rows, "useful_steps": steps, "median_step_s": med, "wall_s": wall, "useful_s": kept,
        "fraction": kept / wall, "fraction_median": steps * med / wall,
    }  # fmt: skip


def analyze(root: Path) -> dict[str, Any]:
    """The JSON report from a bench directory (its runs' timelines and run.json files)."""
    meta = json.loads((root / "meta.json").read_text())
    rl_run = json.loads((root / "rlaunch" / "run.json").read_text())
    joiners = first_rows_of_new_pids(root / "rlaunch", rl_run["t0"])
    switches = []
    for ev in rl_run["events"]:
        t = min((r[1] for r in joiners if ev["t"] <= r[1] <= ev["t"] + ev["drain_s"] + 5), default=None)
        switches.append(t)
    tr_run = json.loads((root / "torchrun" / "run.json").read_text())
    kills = [ev["t"] for ev in tr_run["events"]]
    base_run = json.loads((root / "base" / "run.json").read_text())
    m_base = measure(root / "base", [ev["t"] for ev in base_run["events"]])  # its standby restarts: the same caps
    m_rl = measure(root / "rlaunch", [t for t in switches if t is not None])
    m_tr = measure(root / "torchrun", kills)
    runs = {"base": m_base, "rlaunch": m_rl, "torchrun": m_tr}
    rl_down = []
    for ev, t in zip(rl_run["events"], switches, strict=True):
        ev["downtime_s"] = None if t is None else downtime(m_rl["rows"], t, m_rl["median_step_s"])
        if ev["downtime_s"] is not None:
            rl_down.append(ev["downtime_s"])
    tr_down = [d for t in kills if (d := downtime(m_tr["rows"], t, m_tr["median_step_s"])) is not None]
    reported = [ev["reported_downtime_s"] for ev in rl_run["events"] if ev.get("reported_downtime_s") is not None]

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    def rel(key: str, run: dict[str, Any]) -> float:
        return round(float(run[key]) / float(m_base[key]), 4)

    width, depth = meta["width"], meta["depth"]
    params = depth * (width * width + width) + width + 1
    return {
        "efficiency_rlaunch": rel("fraction", m_rl),
        "efficiency_torchrun": rel("fraction", m_tr),
        "efficiency_rlaunch_median": rel("fraction_median", m_rl),
        "efficiency_torchrun_median": rel("fraction_median", m_tr),
        "efficiency_rlaunch_same_step": rel("useful_steps", m_rl),
        "efficiency_torchrun_same_step": rel("useful_steps", m_tr),
        "migrations": sum(1 for ev in rl_run["events"] if ev.get("ok")),
        "torchrun_restarts": len(kills),
        "median_downtime_s": r3(statistics.median(rl_down)) if rl_down else None,
        "median_reported_downtime_s": r3(statistics.median(reported)) if reported else None,
        "median_torchrun_downtime_s": r3(statistics.median(tr_down)) if tr_down else None,
        "wall_s": round(m_base["wall_s"], 1),
        "minutes": meta["minutes"],
        "every_s": meta["every"],
        "ckpt_every_steps": meta["ckpt_every"],
        "params_m": round(params / 1e6, 2),
        "useful_steps": {k: m["useful_steps"] for k, m in runs.items()},
        "useful_s": {k: round(m["useful_s"], 1) for k, m in runs.items()},
        "useful_fraction": {k: round(m["fraction"], 4) for k, m in runs.items()},
        "median_step_s": {k: round(m["median_step_s"], 4) for k, m in runs.items()},
        "drains": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ev.items() if k != "t"}
            for ev in rl_run["events"]
        ],  # fmt: skip
        "torchrun_downtimes_s": [r3(d) for d in tr_down],
        "load_average_before": meta["load_before"],
        "load_average_after": meta.get("load_after"),
        "cpus": os.cpu_count(),
        "bench_wall_s": round(meta["ended"] - meta["began"], 1) if "ended" in meta else None,
        "target_rlaunch_ge_99pct": m_rl["fraction"] / m_base["fraction"] >= 0.99,
        "logs": str(root),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each run's measured window")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between drains (and torchrun restarts)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun: steps between checkpoints")
    ap.add_argument("--width", type=int, default=1024, help="bench_train.py's model width")
    ap.add_argument("--depth", type=int, default=6, help="bench_train.py's model depth")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--analyze", default="", help="only compute the JSON again from an earlier run's log directory")
    args = ap.parse_args()
    end_on_sigterm()
    if args.analyze:
        root = Path(args.analyze)
    else:
        root = Path(tempfile.mkdtemp(prefix="rlaunch-effic-"))
        meta: dict[str, Any] = {
            **vars(args),
            "began": time.time(),
            "load_before": [round(x, 2) for x in os.getloadavg()],
        }
        log(f"logs in {root}; load average {meta['load_before']}")
        (root / "meta.json").write_text(json.dumps(meta))
        with EmbeddedEtcd() as etcd:
            log("base: rlaunch, no migration")
            run_rlaunch(root, etcd.endpoint, "base", args, drains=False)
            log("rlaunch: a drain every period")
            run_rlaunch(root, etcd.endpoint, "rlaunch", args, drains=True)
        log("torchrun: a kill and restart from the checkpoint every period")
        run_torchrun(root, args)
        meta.update(ended=time.time(), load_after=[round(x, 2) for x in os.getloadavg()])
        (root / "meta.json").write_text(json.dumps(meta))
    text = json.dumps(analyze(root), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
