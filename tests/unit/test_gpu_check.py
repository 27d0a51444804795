"""scripts/gpu_check.sh on a machine without a GPU: it says so in a sentence, writes its JSON to
$OUT and exits 3; and the pieces of its harness that need no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cluster import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def test_without_cuda_the_check_says_so_writes_its_json_and_exits_3(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == gpu_check.NO_CUDA, res.stderr
    assert "No CUDA device is visible here (torch.cuda.is_available() is False), so no GPU check ran" in res.stderr
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["env"]["cuda"] is False and written["env"]["torch"].startswith("2.")
    assert "no GPU check ran" in written["verdict"]
    assert json.loads(res.stdout.splitlines()[0]) == {"env": written["env"]}  # one JSON line per part


def test_an_unknown_part_is_refused_with_a_sentence(capsys: object) -> None:
    assert gpu_check.main(["--parts", "env,gloo,tpu"]) == 2


def test_the_training_scripts_final_lines_are_read_per_rank() -> None:
    text = (
        "step 10/60 loss 0.1\n"
        'rank 1 final: steps=60 params=abc123 optim=def456 versions={"world":2} devices=cuda:0 seconds=3.0\n'
        'rank 0 final: steps=60 params=abc123 optim=def456 versions={"world":1} devices=cuda:0 seconds=3.1\n'
    )
    assert gpu_check._finals(text) == {0: ("abc123", "def456", "cuda:0"), 1: ("abc123", "def456", "cuda:0")}


def test_the_summary_names_every_case_with_its_outcome_and_seconds() -> None:
    results = {
        "env": {"cuda": True},
        "gloo": {"ok": False, "drain": {"ok": True, "seconds": 30.1}, "replace": {"ok": False, "error": "x"}},
        "transfer": {"ok": True, "seconds": 9.5, "send": {"role": "send"}},
        "nccl": {"ok": True, "init": {"ok": True, "seconds": 4.0}},
        "nvml": {"ok": True},
        "verdict": "failed: gloo",
    }
    assert gpu_check.cases(results) == {
        "gloo.drain": {"ok": True, "seconds": 30.1},
        "gloo.replace": {"ok": False, "seconds": None},
        "transfer": {"ok": True, "seconds": 9.5},
        "nccl.init": {"ok": True, "seconds": 4.0},
        "nvml": {"ok": True, "seconds": None},
    }
