#!/usr/bin/env python3
"""Benchmark: a planned node move with rlaunch against what torchrun users do today.

One run, one model (25M parameters, AdamW, a step of several hundred ms here), 2 active nodes
plus 1 standby, one process per node, 1 thread each:
  steady   rlaunch with no event, and plain DDP under torchrun with no event: the reference
           digests, the steady-state step-time and peak-RSS overheads of the runtime;
  (a)      rlaunch drain of node b onto a warm standby;
  (b)      torchrun: node b's agent gets SIGTERM, its worker checkpoints and exits, the job
           exits and torchrun starts every worker again on the new node set (c10d rendezvous),
           resuming from the checkpoint (see run_torchrun for why not an in-place restart);
  (c)      rlaunch drain onto a standby with warm-up turned off (--sandbox-steps 0).
Downtime of an event = wall time of the 6 steps around it minus 6 median steps. Prints one JSON
object. Usage: scripts/bench_migration.py [--steps 40] [--event-at 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlaunch.cli.status import fetch_status  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd, free_port  # noqa: E402

WORKER = REPO / "scripts" / "bench_train.py"
WIDTH, DEPTH = 2048, 6  # bench_train.py's defaults
PARAMS = DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def read_timeline(path: Path) -> list[tuple[int, float, float, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        step, start, end, role, _pid = line.split()
        rows.append((int(step), float(start), float(end), role))
    return rows


def steps_done(path: Path) -> int:
    return sum(1 for r in read_timeline(path) if r[3] in ("real", "active"))


def finals(text: str) -> dict[int, dict[str, Any]]:
    out = {}
    for line in text.splitlines():
        if "FINAL " in line:
            rec = json.loads(line.split("FINAL ", 1)[1])
            out[rec["rank"]] = rec
    return out


def median_step(rows: list[tuple[int, float, float, str]]) -> float:
    durations = [end - start for step, start, end, role in rows if role in ("real", "active") and step >= 2]
    return statistics.median(durations)


def downtime(rows: list[tuple[int, float, float, str]], t_event: float, median: float) -> tuple[float, int]:
    """Extra wall time of the 6 steps around the event over 6 median steps, and the event's step.

    The event's step is the first one not done before the event; steps redone after it (from a
    checkpoint) count from their first run, and the window ends with their last.
    """
    real = [r for r in rows if r[3] in ("real", "active")]
    first = {s: end for s, _, end, _ in sorted(real, key=lambda r: -r[2])}  # first occurrence wins
    last = {s: end for s, _, end, _ in sorted(real, key=lambda r: r[2])}  # last occurrence wins
    event_step = min((s for s, end in first.items() if end > t_event), default=real[-1][0])
    lo, hi = max(event_step - 3, min(first)), min(event_step + 3, max(last))
    return (last[hi] - first[lo]) - (hi - lo) * median, event_step


class Procs:
    """Processes of one scenario, each with a log file; all are ended on exit."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = (self.work / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_rlaunch(
    root: Path, etcd: str, name: str, steps: int, event_at: int | None, sandbox_steps: int
) -> dict[str, Any]:
    work = root / name
    timeline = work / "timeline"
    timeline.mkdir(parents=True)
    procs = Procs(work)
    job = f"bench-{name}"
    nodes = ["a", "b", "c"] if event_at is not None else ["a", "b"]
    try:
        for node in nodes:
            procs.start(node, [
                sys.executable, "-m", "rlaunch", "--nnodes", "2", "--rdzv-endpoint", etcd, "--rdzv-id", job,
                "--node-id", node, "--sandbox-steps", str(sandbox_steps), str(WORKER), "--mode", "rlaunch",
                "--steps", str(steps), "--timeline", str(timeline),
            ])  # fmt: skip
            wait_until(lambda n=node: _node(etcd, job, n), 60, f"{name}: node {node} to join")
        t_event = None
        if event_at is not None:
            wait_until(lambda: (n := _node(etcd, job, "c")) and n["state"] == "standby" and n["runtime"], 180,
                       f"{name}: standby c to be ready")  # fmt: skip
            wait_until(lambda: steps_done(timeline / "rank0.txt") >= event_at, 300, f"{name}: step {event_at}")
            t_event = time.time()
            drain = subprocess.run(
                [sys.executable, "-m", "rlaunch", "drain", "b", "--rdzv-endpoint", etcd, "--rdzv-id", job],
                capture_output=True, text=True, timeout=300, env=ENV,
            )  # fmt: skip
            log(f"{name}: {drain.stdout.strip() or drain.stderr.strip()}")
            if drain.returncode != 0:
                raise RuntimeError(f"{name}: rlaunch drain failed: {drain.stderr}")
        survivors = ["a", "c"] if event_at is not None else ["a", "b"]
        codes = [procs.wait(n, 600) for n in nodes]
        if any(codes):
            raise RuntimeError(f"{name}: agents exited {codes}; logs in {work}")
        result: dict[str, Any] = {"finals": {}, "t_event": t_event, "timeline": timeline}
        for n in survivors:
            result["finals"].update(finals(procs.output(n)))
        if event_at is not None:
            result["drain_stdout"] = drain.stdout.strip()
        return result
    finally:
        procs.close()


def _node(etcd: str, job: str, node_id: str) -> dict[str, Any] | None:
    status = asyncio.run(fetch_status(etcd, job, 5.0))
    return next((n for n in status["nodes"] if n["node_id"] == node_id), None) if status else None


def _torchrun(
    procs: Procs, name: str, node: str, port: int, host: bool, steps: int, work: Path, extra: tuple[str, ...] = ()
) -> None:
    """Start node ``node``'s torchrun agent; ``extra`` goes to bench_train.py after its own flags."""
    procs.start(node, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
        "--rdzv-conf", f"is_host={int(host)}", "--monitor-interval", "0.1", str(WORKER), "--mode", "plain",
        "--steps", str(steps), "--timeline", str(work / "timeline"), "--ckpt", str(work / "ckpt.pt"), *extra,
    ])  # fmt: skip


def run_torchrun(root: Path, name: str, steps: int, event_at: int | None) -> dict[str, Any]:
    """Plain DDP under torchrun; with an event: SIGTERM to b, the job exits, torchrun restarts on a and c.

    torchrun's in-place elastic restart with a spare agent waiting (c10d, --max-restarts) did not
    re-rendezvous on this machine (its store keys timed out after 60 s), so the restart here is the
    job-level one: the job exits and torchrun is started again at once on the new node set, which
    resumes from the checkpoint. That leaves out any scheduler delay, in torchrun's favour.
    """
    work = root / name
    (work / "timeline").mkdir(parents=True)
    procs = Procs(work)
    try:
        port = free_port()
        for node, host in (("a", True), ("b", False)):
            _torchrun(procs, name, node, port, host, steps, work)
            time.sleep(2.0)  # a hosts the c10d store
        t_event = None
        survivors = ["a", "b"]
        if event_at is not None:
            wait_until(lambda: steps_done(work / "timeline" / "rank0.txt") >= event_at, 300, f"{name}: step {event_at}")
            t_event = time.time()
            procs.procs["b"].send_signal(signal.SIGTERM)  # maintenance: b checkpoints and leaves
            procs.wait("b", 120)
            procs.wait("a", 120)  # its worker loses its peer; with no restarts left, the job exits
            port = free_port()
            for node, host in (("a2", True), ("c", False)):
                _torchrun(procs, f"{name}-2", node, port, host, steps, work)
            survivors = ["a2", "c"]
        for n in survivors:
            code = procs.wait(n, 900)
            if code:
                raise RuntimeError(f"{name}: torchrun on {n} exited {code}; logs in {work}")
        result: dict[str, Any] = {"finals": {}, "t_event": t_event, "timeline": work / "timeline"}
        for n in survivors:
            result["finals"].update(finals(procs.output(n)))
        return result
    finally:
        procs.close()


BANDWIDTH = textwrap.dedent("""
    import datetime, sys, time, torch
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    rank, port, mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    t = torch.ones(mib * 2**18)
    best = 0.0
    for _ in range(3):
        pg.barrier().wait()
        start = time.perf_counter()
        (pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)).wait()
        pg.barrier().wait()
        best = max(best, t.numel() * 4 / (time.perf_counter() - start))
    if rank == 1:
        print(best)
""")


def loopback_bandwidth(mib: int = 256) -> float:
    """Bytes per second of a gloo send/recv between two processes on loopback (best of 3)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", BANDWIDTH, str(r), str(port), str(mib)], stdout=subprocess.PIPE,
                              text=True, env=ENV) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return float(outs[1].strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--event-at", type=int, default=15)
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlaunch-bench-"))
    log(f"logs in {root}")
    with EmbeddedEtcd() as etcd:
        steady_rl, steady_tr = [], []
        for i in range(2):  # interleaved, so that drifts in the machine's load hit both alike
            log(f"steady {i + 1}/2: rlaunch, no event")
            steady_rl.append(run_rlaunch(root, etcd.endpoint, f"steady-rlaunch-{i}", args.steps, None, 3))
            log(f"steady {i + 1}/2: torchrun, plain DDP, no event")
            steady_tr.append(run_torchrun(root, f"steady-torchrun-{i}", args.steps, None))
        log("(a) rlaunch drain onto a warm standby")
        warm = run_rlaunch(root, etcd.endpoint, "rlaunch-warm", args.steps, args.event_at, 3)
        log("(b) torchrun: SIGTERM, checkpoint, restart on the new node set")
        tr = run_torchrun(root, "torchrun-restart", args.steps, args.event_at)
        log("(c) rlaunch drain onto a cold standby (--sandbox-steps 0)")
        cold = run_rlaunch(root, etcd.endpoint, "rlaunch-cold", args.steps, args.event_at, 0)
    log("measuring loopback bandwidth")
    bandwidth = loopback_bandwidth()

    median_rl = statistics.median(
        median_step(read_timeline(r["timeline"] / f"rank{k}.txt")) for r in steady_rl for k in (0, 1)
    )
    median_tr = statistics.median(
        median_step(read_timeline(r["timeline"] / f"rank{k}.txt")) for r in steady_tr for k in (0, 1)
    )
    rows_warm = read_timeline(warm["timeline"] / "rank0.txt")
    rows_cold = read_timeline(cold["timeline"] / "rank0.txt")
    rows_tr = read_timeline(tr["timeline"] / "rank0.txt")
    med_warm, med_cold, med_tr = median_step(rows_warm), median_step(rows_cold), median_step(rows_tr)
    down_warm, step_warm = downtime(rows_warm, warm["t_event"], med_warm)
    down_cold, _ = downtime(rows_cold, cold["t_event"], med_cold)
    down_tr, _ = downtime(rows_tr, tr["t_event"], med_tr)

    def joiner_first(result: dict[str, Any], median: float) -> float:
        """The joiner's first real step over the median; its pid is the one of the sandbox rows."""
        pids = {line.split()[4] for line in (result["timeline"] / "rank-1.txt").read_text().splitlines()}
        rows = [
            line.split() for line in (result["timeline"] / "rank1.txt").read_text().splitlines()
            if line.split()[4] in pids
        ]  # fmt: skip
        return (float(rows[0][2]) - float(rows[0][1])) / median

    state_bytes = int(_events_bytes(warm))  # fp32 params + AdamW's two moments, as the leaver sent them
    reference = {r: (f["params"], f["optim"]) for r, f in steady_rl[0]["finals"].items()}

    def same(result: dict[str, Any]) -> bool:
        got = {r: (f["params"], f["optim"]) for r, f in result["finals"].items()}
        return got == reference

    rss_rl = statistics.median(f["peak_rss_kb"] for r in steady_rl for f in r["finals"].values())
    rss_tr = statistics.median(f["peak_rss_kb"] for r in steady_tr for f in r["finals"].values())
    lower = state_bytes / bandwidth
    out = {
        "params_m": round(PARAMS / 1e6, 2),
        "steps": args.steps,
        "event_at_step": step_warm,
        "median_step_s": round(med_warm, 4),
        "state_bytes": state_bytes,
        "loopback_bytes_per_s": round(bandwidth),
        "transfer_lower_bound_s": round(lower, 4),
        "rlaunch_downtime_s": round(down_warm, 3),
        "rlaunch_cold_downtime_s": round(down_cold, 3),
        "torchrun_downtime_s": round(down_tr, 3),
        "ratio_torchrun_over_rlaunch": round(down_tr / max(down_warm, 1e-3), 1),
        "joiner_first_step_over_median": round(joiner_first(warm, med_warm), 3),
        "cold_joiner_first_step_over_median": round(joiner_first(cold, med_cold), 3),
        "bit_identical": same(warm) and same(cold),
        "bit_identical_to_plain_ddp": all(same(r) for r in (*steady_rl, *steady_tr)),
        "torchrun_resume_bit_identical": same(tr),
        "steady_median_step_rlaunch_s": round(median_rl, 4),
        "steady_median_step_torchrun_s": round(median_tr, 4),
        "steady_overhead_pct": round((median_rl / median_tr - 1) * 100, 2),
        "peak_rss_rlaunch_kb": rss_rl,
        "peak_rss_torchrun_kb": rss_tr,
        "rss_overhead_pct": round((rss_rl / rss_tr - 1) * 100, 2),
        "drain_reported": warm.get("drain_stdout", ""),
    }
    out["targets"] = {
        "ratio_ge_10": out["ratio_torchrun_over_rlaunch"] >= 10,
        "downtime_le_2x_lower_bound_plus_step": down_warm <= 2 * lower + med_warm,
        "joiner_first_step_le_1_5x_median": out["joiner_first_step_over_median"] <= 1.5,
        "steady_overhead_le_2pct": out["steady_overhead_pct"] <= 2,
        "rss_overhead_le_3pct": out["rss_overhead_pct"] <= 3,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _events_bytes(result: dict[str, Any]) -> str:
    """Bytes the leaver sent, from its agent's log line for the state_sent event."""
    text = (result["timeline"].parent / "b.log").read_text(errors="replace")
    for line in text.splitlines():
        if "event state_sent" in line:
            return line.split("'bytes': ", 1)[1].split(",", 1)[0]
    raise RuntimeError("the leaver reported no state_sent event")


if __name__ == "__main__":
    main()
