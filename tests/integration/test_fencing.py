"""Fencing: an agent that cannot renew its lease stops its workers; the job goes on without it."""

from __future__ import annotations

import re
import signal

from tests.cluster import TRAIN, Cluster, checksums, wait_for


def test_a_sigstopped_agent_is_fenced_and_the_standby_takes_over(cluster: Cluster, reference_checksum: str) -> None:
    ckpt = cluster.tmp / "ckpt.pt"
    args = ("--steps", "24", "--step-time", "0.15", "--ckpt", str(ckpt), "--ckpt-every", "6")
    a, b, c = cluster.agents_in_order(["a", "b", "c"], TRAIN, *args, flags=("--max-restarts", "3"))
    wait_for(ckpt.exists, 90, "the first checkpoint")
    b.signal(signal.SIGSTOP)  # the agent freezes; its lease (TTL 3 s) runs out
    try:
        wait_for(
            lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running",
            60, "the standby to take node b's rank",
        )  # fmt: skip
    finally:
        b.signal(signal.SIGCONT)
    assert b.wait(30) == 1, "a fenced agent exits non-zero"
    out = b.output()
    assert "stops its workers and exits because" in out and "lease" in out
    started = [int(g) for g in re.findall(r"event workers_started \(generation (\d+)\)", out)]
    assert started == [1], f"the fenced node must never start workers in a later generation: {started}"
    assert a.wait(120) == 0 and c.wait(120) == 0
    assert checksums(a.output() + c.output()) == {reference_checksum}
