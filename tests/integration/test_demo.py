"""The README's first quick-start command, ``scripts/demo.sh``, run as a user runs it (past the setup,
which ``.ci/run`` has done on the clean clone: ``--no-setup``, so the test reaches nothing beyond
loopback): an embedded etcd, a 2-node job with two warm standbys, a live drain and a SIGKILLed
worker replaced live; it ends with both ranks on the same weights and exits 0, with no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"\[node-(\w)/(\d)\] rank \d final: steps=600 params=(\w+) optim=(\w+)")
pytestmark = pytest.mark.timeout(400)


def test_the_demo_drains_a_node_and_replaces_a_crashed_one_live(tmp_path: Path) -> None:
    # the demo's logs go to a directory of its own under TMPDIR: the test's
    demo = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "demo.sh"), "--no-setup"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = demo.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGTERM)  # its trap ends the agents and the etcd it started
        try:
            out, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            out, _ = demo.communicate()
        pytest.fail(f"the demo did not end within 360 s:\n{out[-4000:]}")
    assert demo.returncode == 0, out[-4000:]
    assert re.search(r"node node-b drained: its ranks moved to node-c \(generation 2\); downtime \d+ ms", out), out
    assert "replaced by node-d; survivors ['node-c'] keep their" in out, out[-4000:]
    assert re.search(r"node-c +recovered .*sends_to=\[0\]", out) and re.search(r"node-d +joined", out), out[-4000:]
    finals = {(m.group(1), m.group(2)): m.group(3, 4) for m in FINAL.finditer(out)}
    assert set(finals) == {("c", "1"), ("d", "0")}, out[-4000:]
    assert finals["c", "1"] == finals["d", "0"], "the two ranks end on the same weights and optimizer state"
    assert "Traceback" not in out and "node-c and node-d end" in out, out[-4000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rlaunch-demo-")], "the demo kept its logs"
