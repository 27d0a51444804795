"""Five seeded chaos trials (scripts/chaos.py): every fault kind and every moment, once each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster import REPO


# Past five quiet trials (about 130 s) and one that runs into chaos.py's own --trial-timeout (150 s), so
# that such a trial is reported with its failure rather than cut off by pytest's default timeout.
@pytest.mark.timeout(480)
def test_five_seeded_chaos_trials_all_end_bit_identical_with_nothing_left_over() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--trials", "5", "--seed", "3"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    out = json.loads(res.stdout)
    assert res.returncode == 0 and out["passed"] == 5, (out["failures"], res.stderr[-3000:])
    assert {r["kind"] for r in out["results"]} == {"worker_kill", "node_kill", "worker_stop", "xid", "controller_kill"}
    assert {r["moment"] for r in out["results"]} == {"forward", "grad_sync", "vote", "optimizer", "drain_prepare"}
    assert out["recovery_s"]["live"] >= 3, "faults outside a drain are recovered live"
