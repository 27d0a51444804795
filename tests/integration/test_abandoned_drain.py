"""Controller loss during a drain: the move is abandoned and the job recovers by restart.

The lost node was a survivor of the move, which is still in flight (the joiner has not joined):
a live replacement is not safe then, so every worker restarts.
"""

from __future__ import annotations

import subprocess
import sys

from tests.cluster import Cluster, wait_for
from tests.integration.test_migration import FINAL, RESILIENT, _reference, warm


def test_losing_the_controllers_node_during_a_drain_abandons_the_move(cluster: Cluster) -> None:
    args = ("--steps", "200", "--step-time", "0.05")
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *args, flags=("--max-restarts", "2"))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 20/" in a.output(), 60, "training to make progress")
    assert cluster.status()["controller"] == "a"
    # Freeze a's workers so the move cannot finish before a's node is lost: b's workers stay blocked in
    # a training collective with a and never reach the step where they would hand their state over.
    for w in a.workers():
        w.suspend()
    drain = subprocess.Popen(
        [sys.executable, "-m", "rlaunch", "drain", "b", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id",
         cluster.job_id, "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env(),
    )  # fmt: skip
    wait_for(lambda: "migration_offered" in a.output(), 30, "the migration to be planned")
    a.kill_with_workers()
    out, err = drain.communicate(timeout=120)
    assert b.wait(180) == 0 and c.wait(180) == 0, (b.output()[-3000:], c.output()[-3000:])
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(b.output() + c.output())}
    assert got == _reference(2, ("--steps", "200")), "the job must end as if uninterrupted"
    assert drain.returncode == 1 and "'b'" in err and "drained" in err, (out, err)
    assert "event drained" not in b.output() and "state_sent" not in b.output(), "b never handed its state over"
    assert "migration_abandoned" in b.output() or "migration_failed" in b.output()
