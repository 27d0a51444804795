"""A node that computes far slower than the others is moved to the warm standby, live."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.cluster import REPO, Cluster, wait_for
from tests.integration.test_migration import FINAL, warm

CHAOS_TRAIN = REPO / "scripts" / "chaos_train.py"
ARGS = ("--steps", "150", "--step-time", "0.01")


def test_a_straggling_node_is_moved_to_the_standby_and_the_job_ends_bit_identical(cluster: Cluster) -> None:
    flags = ("--straggler-window", "3")
    a = cluster.agent("a", CHAOS_TRAIN, *ARGS, flags=flags)
    wait_for(lambda: cluster.node("a"), 30, "a to join")
    b = cluster.agent("b", CHAOS_TRAIN, *ARGS, flags=flags, env={"CHAOS_SLOW": "0.1"})
    wait_for(lambda: cluster.node("b"), 30, "b to join")
    c = cluster.agent("c", CHAOS_TRAIN, *ARGS, flags=(*flags, "--standby"))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    assert a.wait(240) == 0 and b.wait(60) == 0 and c.wait(60) == 0, (a.output()[-3000:], b.output()[-3000:])
    assert "event straggler" in a.output() and "straggler b: c takes node rank 1 live" in a.output()
    assert "event drained" in b.output(), "the straggler left with a drained mark"
    got = {int(m.group(1)): (m.group(2), m.group(3)) for x in (a, c) for m in FINAL.finditer(x.output())}
    ref = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(CHAOS_TRAIN), *ARGS],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert got == {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(ref.stdout)}
