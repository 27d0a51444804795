"""scripts/gpu_check.py's gloo and transfer parts on the CPU (``--device cpu``): the harness the
device machine runs with CUDA tensors (tests/scripts/cuda_train.py, a drain and a live replacement
against an uninterrupted run; a large state transfer from a leaver that exits at once) must work
before a session spends its scarce GPU minutes on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import REPO


@pytest.mark.timeout(900)
def test_the_gpu_checks_gloo_and_transfer_parts_run_bit_identical_on_the_cpu(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--parts", "gloo,transfer",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=840, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-4000:])
    gloo = json.loads((tmp_path / "gpu_check.json").read_text())["gloo"]
    assert gloo["ok"] and gloo["devices"] == ["cpu"]
    for kind in ("drain", "replace"):
        assert gloo[kind]["identical"] == {"0": True, "1": True}, gloo[kind]
        assert gloo[kind]["exit_codes"][:2] == [0, 0]
    assert "drained: its ranks moved to c" in gloo["drain"]["note"][0]
    # the transfer part: 64 MiB from a leaver that exits at once, landed whole and digest-checked
    transfer = json.loads((tmp_path / "gpu_check.json").read_text())["transfer"]
    assert transfer["ok"] and transfer["recv"]["identical"] and transfer["recv"]["bytes"] == 64 << 20, transfer
    assert transfer["fraction_of_bound"] > 0 and transfer["bound_gbps"] == transfer["recv"]["loopback_gbps"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert set(summary) == {"gloo.drain", "gloo.replace", "transfer"} and all(c["ok"] for c in summary.values())
