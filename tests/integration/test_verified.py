"""Correctness the runtime proves while the job runs: silent data corruption caught and its node
replaced live, and a move whose replicas differ afterwards stopped before its step is applied.

The loop script flips one bit of one rank's parameter (``--flip RANK:STEP``, ``--flip-after-move``):
what a faulty device does to a model without any error. Every job is compared with an
uninterrupted run of the same script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.cluster import SCRIPTS, Cluster, wait_for
from tests.integration.test_loops import FINAL, LOOPS, finals
from tests.integration.test_migration import drain, warm

pytestmark = pytest.mark.timeout(600)
STEPS = ("--steps", "100")
PATTERNS = ("--bn", "--dropout", "0.1", "--sched", "--optimizers", "2", "--own-gen")


def _reference(nproc: int, *extra: str) -> dict[int, tuple[str, str]]:
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", str(nproc), str(LOOPS), *STEPS, *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(res.stdout)}
    assert sorted(got) == list(range(nproc)), res.stdout[-2000:]
    return got


def test_a_flipped_bit_is_named_by_majority_and_its_node_replaced_live(cluster: Cluster) -> None:
    """DDP over 3 nodes and a standby; rank 1's weight gets one flipped bit at the start of step 40.

    The vote of step 40 compares the replicas' digests (``--verify-every 1``): ranks 0 and 2 agree,
    rank 1 does not, so rank 1 is the suspect. No rank applies step 40 (its gradients carry rank 1's
    corrupt weight); rank 1's node is taken out and the standby takes rank 1 live from a healthy
    replica; the step is redone, and the job ends as if nothing happened.
    """
    extra = (*PATTERNS, "--step-time", "0.05", "--flip", "1:40")
    gate = cluster.tmp / "gate"
    agents = cluster.agents_in_order(
        ["a", "b", "c", "d"], LOOPS, *STEPS, *extra, "--gate", str(gate), nnodes=3,
        flags=("--verify-every", "1"),
    )  # fmt: skip
    a, b, c, d = agents
    wait_for(lambda: warm(cluster, "d"), 180, "standby d to be warm")
    gate.touch()
    for agent in (a, c, d):
        assert agent.wait(300) == 0, agent.output()[-4000:]
    assert "rank 1: flipped a bit of its first weight at step 40" in b.output()
    suspect = "rank 1's copy of 'model'"
    assert suspect in b.output() and "named by majority: silent data corruption is suspected" in b.output()
    assert "event sdc_suspected" in b.output(), b.output()[-3000:]
    assert "event joined" in d.output() and "'resume_at': 40" in a.output(), "step 40 is redone, live"
    assert "Traceback" not in a.output() + c.output() + d.output()
    got = finals(a, c, d)
    assert got == _reference(3, *PATTERNS), "the job ends as if the bit never flipped"


def test_replicas_that_differ_after_a_drain_stop_the_job_before_the_step_is_applied(cluster: Cluster) -> None:
    """Right after a drain, rank 0 (a survivor) gets a flipped bit: the first vote of the new
    generation compares the replicas and finds rank 0 and rank 1 apart. With two replicas no one
    can be named, and a move must never be trained on when its replicas differ: every rank stops
    with the sentence, and the job restarts (``--max-restarts 1``) from the start."""
    extra = (*PATTERNS, "--step-time", "0.05", "--flip-after-move", "0")
    gate = cluster.tmp / "gate"
    agents = cluster.agents_in_order(
        ["a", "b", "c"], LOOPS, *STEPS, *extra, "--gate", str(gate), flags=("--max-restarts", "1")
    )
    a, b, c = agents
    wait_for(lambda: warm(cluster, "c"), 180, "standby c to be warm")
    gate.touch()
    wait_for(lambda: "step 30/" in a.output(), 120, "training to progress")
    res = cluster.cli("drain", "b", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, timeout=120)
    assert res.returncode == 0 and "node b drained" in res.stdout, res.stdout + res.stderr  # its step never ends
    for agent in (a, c):
        assert agent.wait(300) == 0, agent.output()[-4000:]
    out = a.output() + c.output()
    assert "flipped a bit of its first weight" in a.output()
    assert "after the move to generation" in out and "ranks that must hold equal state do not" in out, out[-4000:]
    assert "The step is not applied: this worker stops and the job takes the restart path" in out
    assert "restarting every node" in out, "the restart path"
    assert "Traceback" not in out
    assert finals(a, c) == _reference(2, *extra), "the restart from step 0 ends as an uninterrupted run"


EXPERT = SCRIPTS / "expert_train.py"
EXPERT_FINAL = re.compile(r"rank (\d+) final: params=(\w+) optim=(\w+)")


def _expert_run(*extra: str) -> tuple[int, str]:
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "4", str(EXPERT), *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return res.returncode, res.stdout + res.stderr


def test_parameters_that_differ_by_rank_refuse_a_live_replacement_unless_declared() -> None:
    """Expert parallelism built on rt.new_group: the first vote finds the parameters differ by rank,
    so the job says it can drain but not replace live (a replacement would copy another expert);
    with rt.declare_replicas the replica sets are compared one by one and both moves are possible."""
    code, out = _expert_run("--steps", "6")
    assert code == 0, out[-3000:]
    assert "live moves: drain only: the tracked 'model' and 'optimizer' differ from rank to rank since step 0" in out
    assert "rt.declare_replicas" in out
    code, out = _expert_run("--steps", "6", "--declare")
    assert code == 0 and "live moves: drain and replacement" in out, out[-3000:]
    code, out = _expert_run("--steps", "6", "--declare", "--torch-groups")
    assert code == 0 and "live moves: none: the group(s)" in out and "made by torch.distributed" in out, out[-3000:]


def test_declared_replicas_serve_a_replacement_and_a_drain_bit_identically(cluster: Cluster) -> None:
    """With the replica sets declared: node a (ranks 0 and 1) is drained onto c, then a worker of b
    (rank 2 or 3) is killed and restarted in place, taking its state from a rank of its own set."""
    args = ("--steps", "250", "--step-time", "0.05", "--declare")
    a, b, c = cluster.agents_in_order(
        ["a", "b", "c"], EXPERT, *args, flags=("--nproc-per-node", "2", "--max-restarts", "1")
    )
    wait_for(lambda: warm(cluster, "c"), 180, "standby c to be warm")
    wait_for(lambda: "step 20/" in a.output(), 120, "training to progress")
    drain(cluster, "a")
    wait_for(lambda: "event joined" in c.output(), 120, "c to take ranks 0 and 1")
    b.workers()[1].kill()
    for agent in (b, c):
        assert agent.wait(300) == 0, agent.output()[-4000:]
    assert "event recovered" in c.output() and "'plan': 'replace'" in c.output() + b.output()
    sent = [line for line in c.output().splitlines() if "'sends_to': [3]" in line]
    assert sent, "rank 3 (expert 1) gets its state from rank 1, the other rank of its set"
    got = {int(m.group(1)): (m.group(2), m.group(3)) for x in (b, c) for m in EXPERT_FINAL.finditer(x.output())}
    code, out = _expert_run(*args[:2], "--declare")
    ref = {int(m.group(1)): (m.group(2), m.group(3)) for m in EXPERT_FINAL.finditer(out)}
    assert code == 0 and got == ref, "the job ends as if uninterrupted"
