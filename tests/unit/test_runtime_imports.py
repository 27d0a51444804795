"""The worker runtime stays light: what it imports, and its own median (rlaunch.runtime.runtime)."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

from rlaunch.runtime.runtime import _median


def test_median_matches_statistics_median_for_odd_and_even_lengths() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 4, 49, 50):
        values = [rng.uniform(0.0, 2.0) for _ in range(n)]
        assert _median(values) == statistics.median(values)


def test_the_worker_runtime_imports_no_agent_cli_or_etcd_module() -> None:
    # A fresh interpreter: this test process may have imported anything already.
    code = (
        "import sys, torch, torch.distributed, torch.nn.parallel; before = set(sys.modules); "
        "import rlaunch; import rlaunch.runtime.runtime; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    added = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert added, "the probe printed nothing: it did not import the runtime"
    heavy = ("aetcd", "grpc", "rich", "typer", "statistics", "decimal", "rlaunch.agent", "rlaunch.cli",
             "rlaunch.controller", "rlaunch.store")  # fmt: skip
    assert [m for m in added if m.split(".")[0] in heavy or m.startswith(heavy)] == []
    assert all(m.startswith("rlaunch") for m in added), f"the runtime imports more than its own modules: {added}"
