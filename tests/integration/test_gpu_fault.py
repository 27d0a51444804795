"""A GPU fault found through NVML (injected through the file source) hands the node's rank to a standby,
also when the GPU checks failed before and were started again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.cluster import TRAIN, AgentProc, Cluster, checksums, wait_for

XID_79 = json.dumps([{"kind": "xid", "gpu": 0, "detail": "79"}])


def test_an_injected_xid_moves_the_rank_to_the_standby(cluster: Cluster, reference_checksum: str) -> None:
    (a, b, c), faults = _start(cluster, step_time=0.15)
    faults.write_text(XID_79)
    node_b = _standby_took_bs_rank(cluster)
    assert node_b["state"] == "failed" and node_b["role"] == "standby"
    assert a.wait(120) == 0 and c.wait(120) == 0 and b.wait(30) == 0
    assert "gpu_fault" in b.output() and "this node gives up its ranks" in b.output()
    assert checksums(a.output() + c.output()) == {reference_checksum}


def test_gpu_checks_that_end_by_an_error_start_again_and_still_find_the_fault(
    cluster: Cluster, reference_checksum: str
) -> None:
    """NVML answers what the checks do not expect (here: a fault of a kind they do not know), so node b's
    GPU-health task ends by an error. Before, it ended for good (one log line) and the XID that follows
    was never seen; now it is said (``agent_task_failed``), started again, and finds it."""
    # (slow steps: after the first checkpoint the job trains 14 s more, while the checks fail and start again)
    (a, b, c), faults = _start(cluster, step_time=0.8)
    faults.write_text(json.dumps([{"kind": "melted", "gpu": 0}]))
    wait_for(lambda: "agent_task_failed" in b.output(), 30, "node b to say its GPU checks failed")
    faults.write_text(XID_79)
    _standby_took_bs_rank(cluster)
    assert a.wait(120) == 0 and c.wait(120) == 0 and b.wait(30) == 0
    out = b.output()
    assert "the GPU health checks ended by an error (ValueError: 'melted' is not a valid GpuFaultKind; 1 failure" in out
    assert "Traceback" in out and "gpu_fault" in out
    assert checksums(a.output() + c.output()) == {reference_checksum}


def _start(cluster: Cluster, step_time: float) -> tuple[list[AgentProc], Path]:
    """a, b, c in join order, the example training with a checkpoint every 6 steps, once the first is
    written; only b reads its GPU faults, from the file returned (empty until the test writes it)."""
    ckpt = cluster.tmp / "ckpt.pt"
    faults = cluster.tmp / "faults.json"
    faults.write_text("[]")
    args = ("--steps", "24", "--step-time", str(step_time), "--ckpt", str(ckpt), "--ckpt-every", "6")
    started = []
    for node in ("a", "b", "c"):
        env = {"RLAUNCH_FAKE_NVML": str(faults)} if node == "b" else None
        started.append(cluster.agent(node, TRAIN, *args, flags=("--max-restarts", "3"), env=env))
        cluster.registered(started[-1])
    wait_for(ckpt.exists, 90, "the first checkpoint")
    return started, faults


def _standby_took_bs_rank(cluster: Cluster) -> dict[str, Any]:
    """Wait until the standby c runs node b's rank; b's status row, which names the XID as its fault."""
    node_c = wait_for(
        lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running" and n,
        60, "the standby to take node b's rank",
    )  # fmt: skip
    assert node_c["node_rank"] == 1
    node_b = cluster.node("b")
    assert node_b is not None and node_b["fault"] == "GPU 0 reported critical XID 79"
    return node_b
