#!/usr/bin/env python3
"""Chaos trials: real faults at chosen moments of a running job; every trial must end as if none hit.

Each trial starts a job of 2 active nodes and 1 warm standby (one worker each, on one embedded
etcd), runs scripts/chaos_train.py and injects one fault kind at one moment:

  kinds    worker_kill (SIGKILL of a worker), node_kill (SIGKILL of an agent and its workers),
           worker_stop (SIGSTOP of a worker: a hang), xid (a critical XID through the fake NVML
           file), controller_kill (SIGKILL of the agent that runs the controller)
  moments  forward, grad_sync, vote, optimizer (the faulted rank is paused there, see
           chaos_train.py, and the fault lands during the pause), drain_prepare (a drain of the
           faulted node was just planned and is being prepared)

Kinds and moments are dealt from seeded shuffles, so any 5 consecutive trials cover every kind
and every moment. A trial passes when the job completed, the final parameters and optimizer
state are bit-identical to an uninterrupted reference run, no process of the trial is left, and
it ended within --trial-timeout. Prints one JSON object: trials, passed, failures (with each
trial's seed, kind and moment), recovery times. Exit status 0 only if every trial passed.

    scripts/chaos.py --trials 30 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
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

from rlaunch.cli.status import fetch_status  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd  # noqa: E402
from scripts.bench_migration import wait_until  # noqa: E402
from scripts.ending import die_with_parent, end_on_sigterm  # noqa: E402

TRAIN = REPO / "scripts" / "chaos_train.py"
KINDS = ("worker_kill", "node_kill", "worker_stop", "xid", "controller_kill")
MOMENTS = ("forward", "grad_sync", "vote", "optimizer", "drain_prepare")
FINAL = re.compile(r"rank (\d+) final: steps=\d+ params=(\w+) optim=(\w+)")
TAG_VAR = "RLAUNCH_CHAOS_TAG"
#: Seconds the faulted rank stays paused at its moment; an XID needs the GPU check (every 2 s).
PAUSE_S = {"xid": 4.0}
DEFAULT_PAUSE_S = 1.5


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def finals(text: str) -> dict[int, tuple[str, str]]:
    """rank -> (params, optimizer) digests; a rank printed twice (restarted job) keeps the last."""
    return {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(text)}


def reference(steps: int, step_time: float) -> dict[int, tuple[str, str]]:
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(TRAIN),
         "--steps", str(steps), "--step-time", str(step_time)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    got = finals(res.stdout)
    if res.returncode != 0 or sorted(got) != [0, 1]:
        raise RuntimeError(f"the reference run failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return got


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_VAR) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Trial:
    """One job under one fault; every process it starts carries its tag and is ended by it."""

    def __init__(self, endpoint: str, work: Path, index: int, seed: int, kind: str, moment: str, args: Any) -> None:
        self.endpoint, self.work, self.index, self.seed = endpoint, work, index, seed
        self.kind, self.moment, self.args = kind, moment, args
        self.rng = random.Random(seed)
        self.job = f"chaos-{seed}"
        self.tag = f"chaos-{os.getpid()}-{seed}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.drain: subprocess.Popen[bytes] | None = None  # the `rlaunch drain` of a drain_prepare trial
        self.marker = work / "paused"
        #: the TMPDIR of the trial's processes (the agents' control sockets), removed at close: an agent
        #: the trial kills cannot remove its own. In /tmp: a Unix socket's path must fit in 108 bytes.
        self.scratch = Path(tempfile.mkdtemp(prefix="rlaunch-chaos-", dir="/tmp"))

    def output(self, node: str) -> str:
        path = self.work / f"{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, node: str, pause: str, standby: bool = False) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", TAG_VAR: self.tag, "CHAOS_PAUSE": pause,
               "RLAUNCH_FAKE_NVML": str(self.work / f"nvml-{node}.json"), "TMPDIR": str(self.scratch)}  # fmt: skip
        argv = [
            sys.executable, "-m", "rlaunch", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job, "--node-id", node,
            "--lease-ttl", "3", "--rdzv-timeout", "60", "--max-restarts", "3", "--hang-timeout", "5",
            "--standby-wait", "20", "--log-dir", str(self.work / "logs"), *(["--standby"] if standby else []),
            str(TRAIN), "--steps", str(self.args.steps), "--step-time", str(self.args.step_time),
        ]  # fmt: skip
        out = (self.work / f"{node}.log").open("wb")
        self.procs[node] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip

    def status(self) -> dict[str, Any]:
        return asyncio.run(fetch_status(self.endpoint, self.job, 5.0)) or {}

    def node_state(self, node: str) -> dict[str, Any]:
        return next((n for n in self.status().get("nodes", []) if n["node_id"] == node), {})

    def workers(self, node: str) -> list[psutil.Process]:
        try:
            return [c for c in psutil.Process(self.procs[node].pid).children() if "etcd" not in c.name()]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> dict[str, Any]:
        began = time.monotonic()
        target_rank = self.rng.choice([0, 1])
        fault_step = self.rng.randint(12, self.args.steps // 2)
        pause = ""
        if self.moment != "drain_prepare":
            pause_s = PAUSE_S.get(self.kind, DEFAULT_PAUSE_S)
            pause = f"{target_rank}:{fault_step}:{self.moment}:{pause_s}:{self.marker}"
        for node, standby in (("a", False), ("b", False), ("c", True)):
            self.start(node, pause, standby)
            wait_until(lambda n=node: self.node_state(n), 60, f"node {node} to join")
        wait_until(lambda: self.node_state("c").get("state") == "standby" and self.node_state("c").get("runtime"),
                   90, "the standby to be warm")  # fmt: skip
        controller = self.status().get("controller", "a")
        holder = {r: n["node_id"] for n in self.status()["nodes"] for r in n.get("ranks", [])}
        target = controller if self.kind == "controller_kill" else holder[target_rank]
        if self.moment == "drain_prepare":
            wait_until(lambda: f"step {fault_step // 10 * 10}/" in self.output(holder[0]), 90, "training to progress")
            # The faulted node is the one being drained: a fault on the other active node would need
            # a second spare once the drain has taken the only standby (the job would rightly fail).
            drained = target
            self.drain = subprocess.Popen(
                [sys.executable, "-m", "rlaunch", "drain", drained, "--rdzv-endpoint", self.endpoint,
                 "--rdzv-id", self.job, "--timeout", "30"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, TAG_VAR: self.tag}, start_new_session=True,
            )  # fmt: skip
            wait_until(lambda: "migration_offered" in self.output(target), 60, "the drain to be planned")
        else:
            wait_until(self.marker.exists, 120, f"rank {target_rank} to pause at step {fault_step} ({self.moment})")
        fault_at = time.time()
        self.inject(target)
        log(f"trial {self.index}: {self.kind} on {target} at {self.moment} (step {fault_step}), seed {self.seed}")
        alive = [n for n in self.procs if not (n == target and self.kind in ("node_kill", "controller_kill"))]
        end = began + self.args.trial_timeout
        for node in alive:
            try:
                self.procs[node].wait(max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                limit = self.args.trial_timeout
                raise TimeoutError(f"node {node} did not finish within the trial's {limit:.0f} s") from None
        if self.drain is not None:
            # It ends on its own: the node drained, or the job ended first (the move was abandoned).
            self.drain.wait(max(1.0, end - time.monotonic()))
        codes = {n: self.procs[n].returncode for n in alive}
        return {"fault_at": fault_at, "target": target, "codes": codes, "seconds": time.monotonic() - began}

    def inject(self, target: str) -> None:
        if self.kind == "worker_kill":
            for w in self.workers(target):
                w.kill()
        elif self.kind == "worker_stop":
            for w in self.workers(target):
                w.suspend()
        elif self.kind == "node_kill":
            victims = [psutil.Process(self.procs[target].pid), *self.workers(target)]
            for p in victims:
                p.kill()
        elif self.kind == "controller_kill":
            os.kill(self.procs[target].pid, signal.SIGKILL)
        elif self.kind == "xid":
            path = self.work / f"nvml-{target}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps([{"kind": "xid", "gpu": 0, "detail": "79"}]))
            tmp.rename(path)

    def recovery(self, fault_at: float) -> tuple[str, float | None, bool]:
        """How the job recovered (live or restart), how long after the fault, and whether a
        survivor rolled the step forward, from events.jsonl."""
        path = self.work / "logs" / self.job / "events.jsonl"
        events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        events = [e for e in events if e["time"] >= fault_at]
        rolled = any(e["kind"] == "recovered" and e["data"].get("rolled_forward") for e in events)
        for kind, how in (("recovered", "live"), ("workers_started", "restart")):
            times = [e["time"] for e in events if e["kind"] == kind]
            if times:
                return how, round(min(times) - fault_at, 3), rolled
        return "none", None, rolled

    def close(self) -> list[str]:
        """End every process of the trial; name any that had to be killed or was left over."""
        for proc in [*self.procs.values(), *([self.drain] if self.drain else [])]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        leftovers = []
        for p in tagged(self.tag):
            leftovers.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
            p.kill()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return leftovers


def deal(rng: random.Random, items: tuple[str, ...], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        batch = list(items)
        rng.shuffle(batch)
        out.extend(batch)
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--trial-timeout", type=float, default=150.0)
    ap.add_argument("--work", default="", help="keep each trial's logs under this directory (default: a temporary one)")
    args = ap.parse_args()
    end_on_sigterm()
    rng = random.Random(args.seed)
    kinds, moments = deal(rng, KINDS, args.trials), deal(rng, MOMENTS, args.trials)
    began = time.monotonic()
    ref = reference(args.steps, args.step_time)
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="rlaunch-chaos-") as tmp, EmbeddedEtcd() as etcd:
        root = Path(args.work or tmp)
        for i in range(args.trials):
            seed = args.seed * 1000 + i
            work = root / f"trial-{i}"
            work.mkdir(parents=True)
            trial = Trial(etcd.endpoint, work, i, seed, kinds[i], moments[i], args)
            row: dict[str, Any] = {"trial": i, "seed": seed, "kind": kinds[i], "moment": moments[i]}
            why = ""
            try:
                ran = trial.run()
                got = finals("".join(trial.output(n) for n in trial.procs))
                how, recovery_s, rolled = trial.recovery(ran["fault_at"])
                row.update(target=ran["target"], seconds=round(ran["seconds"], 1), path=how, recovery_s=recovery_s,
                           rolled_forward=rolled)  # fmt: skip
                if any(code != 0 for code in ran["codes"].values()):
                    why = f"agents exited with {ran['codes']}"
                elif got != ref:
                    why = f"final digests {got} differ from the reference {ref}"
            except Exception as exc:  # noqa: BLE001 - a failed trial is reported, the others still run
                why = f"{type(exc).__name__}: {exc}"
            finally:
                left = trial.close()
            if left and not why:
                why = f"processes left over: {left}"
            row["passed"] = not why
            results.append(row)
            if why:
                row["why"] = why
                failures.append(row)
                log(f"trial {i} FAILED: {why}")
    times = [r["recovery_s"] for r in results if r.get("recovery_s") is not None]
    out = {
        "trials": args.trials,
        "passed": sum(r["passed"] for r in results),
        "seed": args.seed,
        "failures": failures,
        "recovery_s": {
            "median": round(statistics.median(times), 3) if times else None,
            "max": round(max(times), 3) if times else None,
            "live": sum(r.get("path") == "live" for r in results),
            "restart": sum(r.get("path") == "restart" for r in results),
            "rolled_forward": sum(bool(r.get("rolled_forward")) for r in results),
        },
        "results": results,
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["passed"] == args.trials else 1)


if __name__ == "__main__":
    main()
