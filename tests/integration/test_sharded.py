"""Sharded layouts on rt.device_mesh (FSDP2, HSDP, tensor x data parallel) through live moves.

Each job runs 2 nodes x 2 ranks plus warm standbys and is compared, rank by rank, with an
uninterrupted 4-rank run of the same script: the local shards of every parameter and of the
optimizer state must be bit-identical. HSDP holds a replica of every shard, so a node taken out
(here: for a flipped bit) is replaced live from it. Pure FSDP and tensor x data parallel hold none, so they take host
snapshots (every 20 steps): a lost node's ranks roll back live, the survivors to their own
copies and the joiner to the copy its buddy held, and the steps since are redone. A node lost
with the node that held its snapshots leaves only the restart, with a sentence naming both.

Every job trains the uneven model (``--model uneven``: a 50,257-row embedding and a one-row head),
so ranks hold shards of different shapes: a standby laid out as rank 0 must re-lay its shards out
for the rank it takes (rlaunch.runtime.reshard), or the transfer refuses them. Every move below
gives a joiner at least one rank whose shapes differ from rank 0's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from tests.cluster import SCRIPTS, AgentProc, Cluster, after_a_scheduled_snapshot, wait_for
from tests.integration.test_migration import drain, warm

SHARDED = SCRIPTS / "sharded_train.py"
FINAL = re.compile(r"rank (\d+) final: params=(\w+) optim=(\w+)(?: reduced=(\S+))?")
FLAGS = ("--nproc-per-node", "2")
pytestmark = pytest.mark.timeout(600)  # each test runs a job and its 4-rank reference: minutes under load


#: what each layout's jobs add: tensor x data parallel reads its batches through rt.epochs, with a
#: sampler over the dp dimension, and averages its loss on a group made after the mesh; HSDP builds
#: its mesh as torchtitan does (a 1-D world mesh unflattened) and flattens it for its batches and loss
EXTRA = {"tp_dp": ("--loader", "--metrics-group"), "hsdp": ("--unflatten",)}


def _args(layout: str, step_time: str = "0.1", extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    more = (*EXTRA.get(layout, ()), *extra)
    return ("--layout", layout, "--model", "uneven", "--steps", "200", "--step-time", step_time, *more)


def _finals(*agents: AgentProc) -> dict[int, tuple[str, ...]]:
    return {int(m.group(1)): m.groups("")[1:] for a in agents for m in FINAL.finditer(a.output())}


@functools.cache  # one per layout for the module: two FSDP jobs share theirs
def _reference(layout: str, extra: tuple[str, ...] = (), nproc: int = 4) -> dict[int, tuple[str, ...]]:
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", str(nproc), str(SHARDED),
         *_args(layout, "0", extra)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = {int(m.group(1)): m.groups("")[1:] for m in FINAL.finditer(res.stdout)}
    assert sorted(got) == list(range(nproc)), res.stdout[-2000:]
    return got


def _start(
    cluster: Cluster, layout: str, names: list[str], flags: tuple[str, ...] = (), extra: tuple[str, ...] = (),
    nnodes: int = 2, env: dict[str, str] | None = None,
) -> list[AgentProc]:  # fmt: skip
    """Start the job; its active ranks wait at step 10 until its standbys are warm, so that its faults
    come early in its 200 steps however long the standbys take."""
    gate = cluster.tmp / "standbys-warm"
    agents = cluster.agents_in_order(
        names,
        SHARDED,
        *_args(layout, extra=extra),
        "--gate",
        f"{gate}:10",
        flags=(*FLAGS, *flags),
        nnodes=nnodes,
        env=env,
    )
    for standby in names[nnodes:]:
        wait_for(lambda s=standby: warm(cluster, s), 180, f"standby {standby} to be warm")
    wait_for(lambda: "step 10/" in agents[0].output(), 120, "training to make progress")
    assert "final" not in agents[0].output(), "the job must still run when its standbys are warm"
    gate.touch()
    return agents


def test_tensor_x_data_parallel_drain_onto_a_cold_standby_then_a_loss_rolls_back_live(cluster: Cluster) -> None:
    # --sandbox-steps 0: the joiner never ran a step, so it has no optimizer state yet and creates
    # the DTensor moments of its sharded parameters as the state arrives. Ranks 2 and 3 sit on dp
    # coordinate 1: their embedding and head shards (FSDP over dp) are smaller than rank 0's. Their
    # sampler reads dp part 1, not part 2 or 3 (which crashed DistributedSampler), and the group
    # made after the mesh keeps its place in the joiners' build order (it went last: a hang).
    # No replica holds a tensor-parallel shard: when a (ranks 0 and 1) is then lost, c (ranks 2 and
    # 3, their buddies) rolls back to its host snapshots and sends a's copies to the cold d.
    a, b, c, d = _start(cluster, "tp_dp", ["a", "b", "c", "d"], flags=("--sandbox-steps", "0"))
    assert "drained" in drain(cluster, "b")
    wait_for(lambda: "event joined" in c.output(), 60, "c to take b's ranks")
    after_a_scheduled_snapshot(c)  # c's, after the drain: the fault comes outside a snapshot's window
    a.kill_with_workers()
    for agent in (b, c, d):
        assert agent.wait(300) == 0, agent.output()[-3000:]
    assert _finals(c, d) == _reference("tp_dp"), "every shard must end as in an uninterrupted run"
    assert "event state_sent" in b.output() and "event joined" in d.output()
    assert "'rolled_back_to': " in c.output() and "'sends_to': [0]" in c.output(), c.output()[-3000:]
    rolls_back = "live moves: drain and replacement: a fault rolls back to the last committed host snapshot (one"
    assert rolls_back in a.output(), "no replica of a tensor-parallel shard: a fault rolls back"


def test_fsdp_drain_hands_the_host_snapshot_over_and_a_loss_rolls_back_across_the_drain(cluster: Cluster) -> None:
    """Snapshots every 50 steps. a is drained after one committed: every rank held it whole when the
    drain was agreed, so the job keeps it, nobody takes a new one at the first step, and a hands its
    copies of ranks 0 and 1 (and those it held of ranks 2 and 3) to c. b is SIGKILLed before the next
    snapshot: c rolls back to the copies a handed over, to a step before the drain, which other
    processes ran, and sends b's copies to d; the steps since are redone. Over 4 shards only rank 0
    holds the head's row and rank 3 holds 3 embedding rows fewer: both joiners (laid out as rank 0)
    re-lay out the shards of ranks 1, 2 and 3."""
    every = {"RLAUNCH_SNAPSHOT_EVERY": "50"}
    a, b, c, d = _start(cluster, "fsdp", ["a", "b", "c", "d"], env=every)
    kept = after_a_scheduled_snapshot(a, every=50)  # the drain comes well before the next one
    assert "drained" in drain(cluster, "a")
    wait_for(lambda: "event snapshot_handed_over" in c.output(), 60, "c to hold a's snapshot copies")
    assert "rank 0 final" not in a.output() and "event snapshot_committed" not in c.output()
    b.kill_with_workers()
    for agent in (c, d):
        assert agent.wait(300) == 0, agent.output()[-3000:]
    assert _finals(c, d) == _reference("fsdp"), "every shard must end as in an uninterrupted run"
    assert f"'rolled_back_to': {kept}," in c.output() and "'steps_redone': " in c.output(), c.output()[-3000:]
    assert "'sends_to': [2]" in c.output() and "'sends_to': [3]" in c.output(), "each buddy serves its lost rank"
    handed = re.findall(r"event snapshot_handed_over \(generation \d+\) \{'rank': (\d+), 'step': (\d+),", c.output())
    assert sorted(handed) == [("0", str(kept)), ("1", str(kept))], c.output()[-3000:]
    assert "event joined" in d.output() and "no live move" not in c.output() + d.output()
    assert "Traceback" not in a.output() + c.output() + d.output()
    # No rank of the drain took a snapshot in its first step: the kept one covered the new generation.
    res = cluster.cli("events", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, "--json")
    assert res.returncode == 0, res.stderr
    moves = [ev for ev in map(json.loads, res.stdout.splitlines()) if ev["kind"] == "move_phases"]
    drained = {ev["generation"] for ev in moves if ev["data"]["role"] == "leaver"}
    assert len(drained) == 1, moves
    ranks = [ev["data"] for ev in moves if ev["generation"] in drained and ev["data"]["role"] != "leaver"]
    assert len(ranks) == 4 and not any("snapshot_taken" in r["marks"] for r in ranks), ranks


def test_fsdp_over_two_ranks_loses_a_node_and_rolls_back_live(cluster: Cluster) -> None:
    """One rank per node, FSDP over ranks 0 and 1 (nodes a and b), each the other's buddy: b is
    SIGKILLed, a rolls back to its own copy in its own process and sends its copy of rank 1 to the
    standby c, and the steps since the snapshot are redone (issue 16's first layout)."""
    a, b, c = _start(cluster, "fsdp", ["a", "b", "c"], flags=("--nproc-per-node", "1"))
    after_a_scheduled_snapshot(a)  # the fault comes outside a snapshot's window
    b.kill_with_workers()
    for agent in (a, c):
        assert agent.wait(300) == 0, agent.output()[-3000:]
    assert _finals(a, c) == _reference("fsdp", nproc=2), "every shard must end as in an uninterrupted run"
    assert "'rolled_back_to': " in a.output() and "'sends_to': [1]" in a.output(), a.output()[-3000:]
    assert a.output().count("event workers_started") == 1, "the survivor kept its process"
    assert "event joined" in c.output() and "Traceback" not in a.output() + c.output()


def test_fsdp_ranks_lost_with_their_buddy_restart_with_a_sentence_naming_both(cluster: Cluster) -> None:
    """One rank per node, FSDP over 3 ranks: a and b are lost at once. Rank 1 held rank 0's
    snapshot, so only the restart is left, and its reason says so."""
    one = ("--nproc-per-node", "1", "--max-restarts", "1")
    e, f, g, h, i = _start(cluster, "fsdp", ["e", "f", "g", "h", "i"], flags=one, nnodes=3)
    after_a_scheduled_snapshot(g)
    e.kill_with_workers()
    f.kill_with_workers()
    for agent in (g, h, i):
        agent.wait(300)
    together = "rank 0 and rank 1, which held its snapshot, were lost together"
    assert "event replacement_refused" in g.output() and together in g.output(), g.output()[-3000:]
    refused = "no live move: a live replacement of ranks [0, 1] would diverge silently: rank 0"
    assert any(refused in x.output() and together in x.output() for x in (g, h, i)), "the restart's reason says why"
    assert "Traceback" not in g.output()
    # the restart starts over from step 0 (the script keeps no checkpoint) and ends as the reference
    assert _finals(g, h, i) == _reference("fsdp", nproc=3)


def test_hsdp_drain_then_a_flipped_bit_named_by_its_own_witness_and_replaced_live_from_replicas(
    cluster: Cluster,
) -> None:
    """HSDP 2 x 2: each shard has two replicas, so a difference cannot be outvoted. a is drained
    first (c takes ranks 0 and 1). Rank 2 (node b) then gets one flipped bit in its first weight
    shard at the start of step 150. With ``--verify-every 1`` every rank digests what its update
    produced after each step; at step 150's vote rank 2's state differs from its replica's (rank 0,
    now on c) and from its own witness, rank 0's from neither: rank 2 is named, and d takes b's
    ranks live from their replicas on c (ranks 1 and 3 hold the smaller shards). Step 150 is
    redone: the job ends bit-identical to an uninterrupted run."""
    a, b, c, d = _start(cluster, "hsdp", ["a", "b", "c", "d"], flags=("--verify-every", "1"), extra=("--flip", "2:150"))
    assert "drained" in drain(cluster, "a")
    wait_for(lambda: "event joined" in c.output(), 60, "c to take a's ranks")
    for agent in (a, c, d):
        assert agent.wait(300) == 0, agent.output()[-3000:]
    assert "rank 2: flipped a bit of its first weight shard at step 150" in b.output()
    assert "rank 2's copy of 'model' (digest" in b.output() and "ranks [0]" in b.output(), b.output()[-3000:]
    assert "changed since its own last optimizer step" in b.output() and "event sdc_suspected" in b.output()
    assert "event joined" in d.output() and "'resume_at': 150" in c.output()
    assert "'sends_to': [2]" in c.output() and "'sends_to': [3]" in c.output(), c.output()[-3000:]
    assert "event replica_sent" in c.output() and "Traceback" not in c.output() + d.output()
    # the controller (b, c or d: whichever holds the election after a left) logs the plan
    assert any("'plan': 'replace'" in x.output() for x in (b, c, d))
    assert _finals(c, d) == _reference("hsdp"), "the job ends as if the bit never flipped"
