"""What an ``rlaunch`` command costs to start: CPU seconds and wall time, against a bare interpreter.

A ``rlaunch drain`` often runs on a machine that trains, and there its CPU is taken from the
training processes. Each case runs ``--repeats`` times (default 5), in turns, and the
JSON gives the median user+system CPU seconds and wall seconds of each, read from ``wait4``; the
baseline is ``python -c pass`` in the same interpreter. The drain cases fail fast on purpose: one
against an endpoint nothing listens on (``--timeout 1``: the imports and one refused connection),
one on an invalid ``--timeout`` (the imports alone). ``modules`` counts what each command imported.

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
#: Each case's arguments to ``rlaunch`` (None: the baseline, a bare interpreter).
CASES: dict[str, list[str] | None] = {
    "baseline: python -c pass": None,
    "rlaunch --help": ["--help"],
    "rlaunch status --help": ["status", "--help"],
    "rlaunch drain --help": ["drain", "--help"],
    "rlaunch drain (dead endpoint, --timeout 1)": ["drain", "n1", *DEAD, "--timeout", "1"],
    "rlaunch drain (--timeout 0, usage error)": ["drain", "n1", *DEAD, "--timeout", "0"],
}


def command(argv: list[str] | None) -> list[str]:
    return [sys.executable, "-c", "pass"] if argv is None else [sys.executable, "-m", "rlaunch", *argv]


def run_once(argv: list[str] | None) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of one run of the case."""
    start = time.monotonic()
    proc = subprocess.Popen(command(argv), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped above
    return usage.ru_utime + usage.ru_stime, time.monotonic() - start


def modules_of(argv: list[str] | None) -> dict[str, object]:
    """How many modules the case had imported when it exited, and whether torch was among them."""
    probe = "import atexit, sys; atexit.register(lambda: print(len(sys.modules), 'torch' in sys.modules))"
    code = probe if argv is None else f"{probe}; from rlaunch.cli import main; main({argv!r})"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    count, torch = res.stdout.strip().splitlines()[-1].split()
    return {"modules": int(count), "torch": torch == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for _ in range(opts.repeats):
        for name, argv in CASES.items():
            runs[name].append(run_once(argv))
    out: dict[str, object] = {"repeats": opts.repeats, "load_average": os.getloadavg()}
    for name, argv in CASES.items():
        cpu = [c for c, _ in runs[name]]
        out[name] = {"cpu_s": round(statistics.median(cpu), 3), "cpu_s_runs": [round(c, 3) for c in cpu],
                     "wall_s": round(statistics.median(w for _, w in runs[name]), 3), **modules_of(argv)}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
