"""A GPU fault found through NVML (injected through the file source) hands the node's rank to a standby,
also when the GPU checks failed before and were started again."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cluster import TRAIN, AgentProc, Cluster, checksums, wait_for


def test_an_injected_xid_moves_the_rank_to_the_standby(cluster: Cluster, reference_checksum: str) -> None:
    ckpt = cluster.tmp / "ckpt.pt"
    faults = cluster.tmp / "faults.json"
    faults.write_text("[]")
    args = ("--steps", "24", "--step-time", "0.15", "--ckpt", str(ckpt), "--ckpt-every", "6")
    a, b, c = _start(cluster, args, faults)
    wait_for(ckpt.exists, 90, "the first checkpoint")
    faults.write_text(json.dumps([{"kind": "xid", "gpu": 0, "detail": "79"}]))
    node_c = wait_for(
        lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running" and n,
        60, "the standby to take node b's rank",
    )  # fmt: skip
    assert node_c["node_rank"] == 1
    node_b = cluster.node("b")
    assert node_b is not None and node_b["state"] == "failed" and node_b["role"] == "standby"
    assert node_b["fault"] == "GPU 0 reported critical XID 79"
    assert a.wait(120) == 0 and c.wait(120) == 0 and b.wait(30) == 0
    assert "gpu_fault" in b.output() and "this node gives up its ranks" in b.output()
    assert checksums(a.output() + c.output()) == {reference_checksum}


def test_gpu_checks_that_end_by_an_error_start_again_and_still_find_the_fault(
    cluster: Cluster, reference_checksum: str
) -> None:
    """NVML answers what the checks do not expect (here: a fault of a kind they do not know), so node b's
    GPU-health task ends by an error. Before, it ended for good (one log line) and the XID that follows
    was never seen; now it is said (``agent_task_failed``), started again, and finds it."""
    ckpt = cluster.tmp / "ckpt.pt"
    faults = cluster.tmp / "faults.json"
    faults.write_text("[]")
    # (slow steps: after the first checkpoint the job trains 14 s more, while the checks fail and start again)
    args = ("--steps", "24", "--step-time", "0.8", "--ckpt", str(ckpt), "--ckpt-every", "6")
    a, b, c = _start(cluster, args, faults)
    wait_for(ckpt.exists, 90, "the first checkpoint")
    faults.write_text(json.dumps([{"kind": "melted", "gpu": 0}]))
    wait_for(lambda: "agent_task_failed" in b.output(), 30, "node b to say its GPU checks failed")
    faults.write_text(json.dumps([{"kind": "xid", "gpu": 0, "detail": "79"}]))
    node_c = wait_for(
        lambda: (n := cluster.node("c")) and n["role"] == "active" and n["state"] == "running" and n,
        60, "the standby to take node b's rank",
    )  # fmt: skip
    assert node_c["node_rank"] == 1
    node_b = cluster.node("b")
    assert node_b is not None and node_b["fault"] == "GPU 0 reported critical XID 79"
    assert a.wait(120) == 0 and c.wait(120) == 0 and b.wait(30) == 0
    out = b.output()
    assert "the GPU health checks ended by an error (ValueError: 'melted' is not a valid GpuFaultKind; 1 failure" in out
    assert "Traceback" in out and "gpu_fault" in out
    assert checksums(a.output() + c.output()) == {reference_checksum}


def _start(cluster: Cluster, args: tuple[str, ...], faults: Path) -> list[AgentProc]:
    """a, b, c in join order; only b reads its GPU faults from ``faults``."""
    started = []
    for node in ("a", "b", "c"):
        env = {"RLAUNCH_FAKE_NVML": str(faults)} if node == "b" else None
        started.append(cluster.agent(node, TRAIN, *args, flags=("--max-restarts", "3"), env=env))
        cluster.registered(started[-1])
    return started
