"""What an ``rlaunch`` command costs to start: CPU seconds and wall time, against torchrun's and a bare interpreter's.

A ``rlaunch drain`` often runs on a machine that trains, and there its CPU is taken from the
training processes. Each case runs ``--repeats`` times (default 5), in turns, and the JSON gives the
median user+system CPU seconds and wall seconds of each, read from ``wait4``; the baselines are
``torchrun --help`` and ``python -c pass`` in the same interpreter. The drain cases fail fast on
purpose: one against an endpoint nothing listens on (``--timeout 1``: the imports and one refused
connection), one on an invalid ``--timeout`` (the imports alone). ``modules`` counts what each
command imported.

    python scripts/bench_cli.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEAD = ["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"]
#: Each case: the module run with ``python -m`` and its arguments (None: a bare interpreter, ``python -c pass``).
CASES: dict[str, tuple[str, list[str]] | None] = {
    "baseline: python -c pass": None,
    "baseline: torchrun --help": ("torch.distributed.run", ["--help"]),
    "rlaunch --help": ("rlaunch", ["--help"]),
    "rlaunch status --help": ("rlaunch", ["status", "--help"]),
    "rlaunch drain --help": ("rlaunch", ["drain", "--help"]),
    "rlaunch drain (dead endpoint, --timeout 1)": ("rlaunch", ["drain", "n1", *DEAD, "--timeout", "1"]),
    "rlaunch drain (--timeout 0, usage error)": ("rlaunch", ["drain", "n1", *DEAD, "--timeout", "0"]),
}
#: No case takes longer than this (the drain against a dead endpoint gives up after 1 s).
CASE_TIMEOUT_S = 60.0


def command(case: tuple[str, list[str]] | None) -> list[str]:
    return [sys.executable, "-c", "pass"] if case is None else [sys.executable, "-m", case[0], *case[1]]


def run_once(case: tuple[str, list[str]] | None) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of one run of the case."""
    start = time.monotonic()
    proc = subprocess.Popen(command(case), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:  # reaped here, by wait4, which reads its resource usage (Popen.wait would reap it first)
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = 0
            break
        if time.monotonic() - start > CASE_TIMEOUT_S:
            proc.kill()
            os.wait4(proc.pid, 0)
            proc.returncode = -9
            raise SystemExit(f"{' '.join(command(case))} ran past {CASE_TIMEOUT_S:.0f} s; nothing was measured.")
        time.sleep(0.005)
    return usage.ru_utime + usage.ru_stime, time.monotonic() - start


def modules_of(case: tuple[str, list[str]] | None) -> dict[str, object]:
    """How many modules the case had imported when it exited, and whether torch was among them."""
    probe = "import atexit, sys; atexit.register(lambda: print(len(sys.modules), 'torch' in sys.modules))"
    code = probe
    if case is not None:
        module, args = case
        code += f"; import runpy; sys.argv = [{module!r}, *{args!r}]; runpy.run_module({module!r}, run_name='__main__')"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=CASE_TIMEOUT_S
    )  # fmt: skip
    count, torch = res.stdout.strip().splitlines()[-1].split()
    return {"modules": int(count), "torch": torch == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    if opts.repeats < 1:
        parser.error(f"--repeats {opts.repeats}: each case must run at least once; pass 1 or more.")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for _ in range(opts.repeats):
        for name, case in CASES.items():
            runs[name].append(run_once(case))
    out: dict[str, object] = {"repeats": opts.repeats, "load_average": os.getloadavg()}
    for name, case in CASES.items():
        cpu = [c for c, _ in runs[name]]
        out[name] = {"cpu_s": round(statistics.median(cpu), 3), "cpu_s_runs": [round(c, 3) for c in cpu],
                     "wall_s": round(statistics.median(w for _, w in runs[name]), 3), **modules_of(case)}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
