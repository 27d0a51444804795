"""Loop patterns users write, each bit-identical to an uninterrupted run after a drain and after a
live replacement, and the loud refusals where no replica can stand in.

One script (``tests/scripts/train_loops.py``) combines the patterns by flags, so a few jobs cover
them all: BatchNorm buffers, dropout, two optimizers, CPU AMP with a GradScaler (inf-skip
included), gradient accumulation under ``no_sync()``, clipping, an LR scheduler, an evaluation
``all_reduce`` every 5 steps, draws from ``random``, NumPy and a ``torch.Generator`` of the
script's own, an average of the weights (``AveragedModel``), and three ways of seeding. Every job
compares each rank's final model state (parameters and buffers) and optimizer, scheduler and
scaler state with an uninterrupted run of the same script.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.cluster import SCRIPTS, AgentProc, Cluster, after_a_scheduled_snapshot, wait_for
from tests.integration.test_migration import drain, warm

LOOPS = SCRIPTS / "train_loops.py"
STEPS = ("--steps", "120")
EVERY = (
    "--bn", "--dropout", "0.1", "--optimizers", "2", "--scaler", "--accum", "2", "--clip", "--sched",
    "--eval-every", "5", "--own-gen", "--ema", "guarded",
)  # fmt: skip
FINAL = re.compile(r"rank (\d+) final: steps=\d+ params=(\w+) optim=(\w+)")
pytestmark = pytest.mark.timeout(600)


def finals(*agents: AgentProc) -> dict[int, tuple[str, str]]:
    return {int(m.group(1)): (m.group(2), m.group(3)) for a in agents for m in FINAL.finditer(a.output())}


@functools.cache  # the two DDP-first-step jobs compare with the same run
def reference(*extra: str) -> dict[int, tuple[str, str]]:
    """Digests of an uninterrupted 2-rank run of the same script."""
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(LOOPS), *STEPS, *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(res.stdout)}
    assert sorted(got) == [0, 1], res.stdout[-2000:]
    return got


def start(cluster: Cluster, *extra: str, flags: tuple[str, ...] = ()) -> list[AgentProc]:
    """Agents a, b (active) and c (standby); training waits at step 20 until c is warm."""
    gate = cluster.tmp / "gate"
    agents = cluster.agents_in_order(
        ["a", "b", "c"], LOOPS, *STEPS, "--step-time", "0.05", "--gate", str(gate), *extra, flags=flags
    )
    wait_for(lambda: warm(cluster, "c"), 180, "standby c to be warm")
    gate.touch()
    wait_for(lambda: "step 30/" in agents[0].output() or "step 30/" in agents[1].output(), 90, "training to progress")
    return agents


def test_every_pattern_survives_the_loss_of_the_rank0_node_live(cluster: Cluster, tmp_path: Path) -> None:
    """The node holding rank 0 is SIGKILLed at the start of step 90; the standby takes rank 0 live.

    Step 90 follows an evaluation under no_grad, so DDP does not broadcast rank 0's buffers in
    it: every rank's own BatchNorm statistics matter. The step is discarded and redone: buffers,
    RNG states, the scheduler, the scaler and the loader's batches must be put back, and the
    joiner must get rank 0's own buffers, the step start's RNG and the loader position.
    Every standby ran sandbox steps with a rank-0 checkpoint in the script: none may write it.
    """
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    extra = (*EVERY, *os.environ.get("LOOPS_EXTRA", "--loader").split())
    a, b, c = start(cluster, *extra, "--die", "0:90", "--ckpt", str(ckpt))
    assert b.wait(240) == 0 and c.wait(240) == 0, (b.output()[-3000:], c.output()[-3000:])
    assert a.proc.poll() is not None and "rank 0 final" not in a.output()
    assert finals(b, c) == reference(*extra), "the job must end as if uninterrupted"
    assert "'resume_at': 90" in b.output(), "step 90 is redone"
    assert "event recovered" in b.output() and "'sends_to': [0]" in b.output(), "rank 1 sends rank 0 its state"
    assert "rank 0 final" in c.output(), "the standby holds rank 0 now"
    # The survivor never said restarting: running at generation 1, then at 2 once its worker recovered.
    of_b = [e for e in cluster.written_events() if e.node_id == "b" and e.generation == 2]
    assert {"replacement_offered", "recovered"} <= {e.kind for e in of_b}, of_b
    assert [e.data["state"] for e in of_b if e.kind == "node_state"] == ["succeeded"], of_b
    writers = (ckpt / "writers.txt").read_text().splitlines()
    assert writers and all("standby=False rank=0" in w for w in writers), writers
    assert any(w.startswith("standby ") for w in writers), "the joiner, now rank 0, writes the checkpoint"


def test_every_pattern_with_a_seed_per_rank_survives_a_drain(cluster: Cluster) -> None:
    """nanoGPT's seeding (seed + rank, once): a drain moves the leaver's own streams; the joiner's
    loader resumes at the leaver's sample, in the leaver's partition."""
    extra = (*EVERY, "--seed-mode", "rank-once", "--loader")
    a, b, c = start(cluster, *extra)
    drain(cluster, "b")
    assert [x.wait(240) for x in (a, b, c)] == [0, 0, 0], (a.output()[-3000:], c.output()[-3000:])
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"


def test_per_rank_streams_from_rt_seed_survive_a_live_replacement(cluster: Cluster) -> None:
    """rt.seed(seed, per_rank=True): the replacement re-derives the lost rank's streams."""
    extra = ("--bn", "--dropout", "0.2", "--sched", "--seed-mode", "rt")
    a, b, c = start(cluster, *extra, flags=("--max-restarts", "1"))
    b.workers()[0].kill()
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"
    assert "event joined" in c.output() and "'plan': 'replace'" in a.output()


def test_a_seed_per_rank_set_once_is_replaced_live_by_a_rollback_to_a_host_snapshot(cluster: Cluster) -> None:
    """nanoGPT's seeding (seed + rank, once) with dropout: no replica holds the lost rank's streams,
    so the job takes host snapshots once the vote finds them differ. The lost rank's joiner gets
    its copy (its streams included) from its buddy, the survivor rolls back to its own, and the
    steps since are redone: the job ends as if uninterrupted."""
    extra = ("--dropout", "0.2", "--seed-mode", "rank-once")
    a, b, c = start(cluster, *extra, flags=("--max-restarts", "1"))
    after_a_scheduled_snapshot(a)  # the fault comes outside a snapshot's window
    b.workers()[0].kill()
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert "'rolled_back_to': " in a.output() and "'steps_redone': " in a.output(), a.output()[-3000:]
    assert "event joined" in c.output() and "would diverge" not in a.output()
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"


def test_a_model_average_updated_whatever_the_vote_said_is_replaced_live_by_a_rollback(cluster: Cluster) -> None:
    """An EMA of the weights and of the BatchNorm statistics (``AveragedModel(use_buffers=True)``),
    updated after every ``rt.optimizer_step`` whatever it returned. Its statistics differ by rank and
    change after the vote that carries them, so no replica holds the lost rank's: the first votes see
    it, the job takes host snapshots, and b's loss rolls back to one. (Before: the joiner got its
    statistics as of the vote, the redone step updated the average a second time, and the job ended
    diverged without a word.)"""
    extra = ("--bn", "--dropout", "0.1", "--ema", "ignored")
    a, b, c = start(cluster, *extra, flags=("--max-restarts", "1"))
    after_a_scheduled_snapshot(a)  # taken once the votes saw the change; the fault comes outside its window
    b.workers()[0].kill()
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert "'rolled_back_to': " in a.output() and "event joined" in c.output(), a.output()[-3000:]
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"


def test_a_standby_serves_every_collective_in_its_sandbox_then_takes_ranks_in_a_drain(cluster: Cluster) -> None:
    """The script calls every collective and object collective (``tests/scripts/collective_checks.py``:
    broadcast_object_list, all_gather_object, gather_object, scatter_object_list, barriers, and the
    tensor collectives) on the default group and on a group of ``rt.new_group``, before its steps,
    in steps 0 to 2 and at the end, and checks what each returned. The standby calls them in its
    sandbox (before and inside its sandbox steps), then takes b's ranks in a drain and calls them
    for real at the end; the job ends bit-identical to an uninterrupted run of the same script."""
    extra = ("--collectives", "--bn", "--dropout", "0.1", "--sched")
    a, b, c = start(cluster, *extra)
    drain(cluster, "b")
    assert [x.wait(240) for x in (a, b, c)] == [0, 0, 0], (a.output()[-3000:], c.output()[-3000:])
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"
    for where in ("setup", "step 0", "step 1", "step 2"):
        assert f"collectives ok ({where}) standby=True rank=-1" in c.output(), f"the sandbox served them ({where})"
        assert f"collectives ok ({where}) standby=False rank=0" in a.output(), where
    assert "collectives ok (end) standby=False rank=1" in c.output(), "the joiner calls them for real"
    assert "collectives ok (end) standby=False rank=0" in a.output()


def _held_at_step_0(cluster: Cluster, gate: Path, *extra: str, flags: tuple[str, ...] = ()) -> list[AgentProc]:
    """Agents a, b (active, held at the start of step 0 until ``gate`` exists) and c (warm standby)."""
    agents = cluster.agents_in_order(
        ["a", "b", "c"], LOOPS, *STEPS, "--step-time", "0.05", "--gate", str(gate), "--gate-at", "0", *extra,
        flags=flags,
    )  # fmt: skip
    wait_for(lambda: warm(cluster, "c"), 180, "standby c to be warm")
    return agents


def test_a_drain_in_ddps_first_step_waits_for_its_bucket_rebuild(cluster: Cluster) -> None:
    """DDP rebuilds its gradient buckets once, with a collective, at its second step; a standby's DDP
    already has (its sandbox ran two steps). b is drained while the active ranks hold at step 0: the
    ranks vote ready only after the rebuild, so c joins ranks whose buckets match its own. (Switched
    after step 0, a waited in the rebuild's broadcast and c in the gradients' allreduce: a hang.)"""
    gate = cluster.tmp / "gate"
    extra = ("--bn", "--sched")
    a, b, c = _held_at_step_0(cluster, gate, *extra)
    said: list[str] = []
    asked = threading.Thread(target=lambda: said.append(drain(cluster, "b")))
    asked.start()
    wait_for(lambda: "event prepared (generation 2)" in a.output(), 60, "a to prepare the drain")
    gate.touch()
    asked.join(180)
    assert said and "node b drained" in said[0], "the drain ended"
    assert [x.wait(240) for x in (a, b, c)] == [0, 0, 0], (a.output()[-3000:], c.output()[-3000:])
    assert "event joined (generation 2)" in c.output()
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"


def test_a_node_lost_after_a_votes_evaluation_fed_a_scheduler_restarts_instead_of_diverging(
    cluster: Cluster, tmp_path: Path
) -> None:
    """b's node is lost right after its vote in step 44, where an evaluation follows the vote: a's
    all_reduce of the metric hands a its own value, which steps a ReduceLROnPlateau, and no redone
    step runs it again. A replica standing in for b would go on from that scheduler (the job would end
    diverged from an uninterrupted run), so the replacement is refused with a sentence and the job
    restarts, c in b's place, and ends as an uninterrupted run does."""
    extra = ("--eval-every", "5", "--plateau")
    a, _, c = start(cluster, *extra, "--die-after-vote", f"{tmp_path / 'died'}:1:44", flags=("--max-restarts", "1"))
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    said = "a live replacement of ranks [1] would diverge silently: a collective issued after step 44's vote"
    assert said in a.output() and "event replacement_refused" in a.output(), a.output()[-3000:]
    assert "Traceback" not in a.output() + c.output()
    assert finals(a, c) == reference(*extra), "the restart trains from step 0, as an uninterrupted run does"


def test_a_node_lost_before_the_vote_of_an_evaluation_step_is_replaced_live(cluster: Cluster) -> None:
    """b's node is lost at the start of step 44, whose evaluation (an all_reduce stepping a
    ReduceLROnPlateau) follows the vote. a's recovery rebuilds the world group with c and discards
    the step; the evaluation after it is not issued on the rebuilt group (c waits at the step's
    boundary for its state and would never meet it), and the redone step evaluates again: live, and
    bit-identical to an uninterrupted run."""
    extra = ("--eval-every", "5", "--plateau")
    a, _, c = start(cluster, *extra, "--die", "1:44", flags=("--max-restarts", "1"))
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert "event joined" in c.output() and "'resume_at': 44" in a.output(), a.output()[-3000:]
    assert "would diverge" not in a.output() and "workers_started (generation 2)" not in a.output()
    assert finals(a, c) == reference(*extra), "the job must end as if uninterrupted"


def test_a_node_lost_in_ddps_first_step_takes_the_restart_path_with_a_sentence(cluster: Cluster) -> None:
    """b is lost while the active ranks hold at step 0, before DDP's bucket rebuild: a redone step 0
    would rebuild a's buckets (a broadcast) while c's, rebuilt in its sandbox, would not. The
    replacement is refused with a sentence that says so, and the job restarts, c in b's place."""
    gate = cluster.tmp / "gate"
    extra = ("--bn", "--sched")
    a, b, c = _held_at_step_0(cluster, gate, *extra, flags=("--max-restarts", "1"))
    b.kill_with_workers()
    gate.touch()
    assert a.wait(240) == 0 and c.wait(240) == 0, (a.output()[-3000:], c.output()[-3000:])
    early = "a live replacement of ranks [1] cannot be made this early: DDP has not rebuilt the gradient buckets"
    assert early in a.output() and "event replacement_refused" in a.output(), a.output()[-3000:]
    assert "Traceback" not in a.output() + c.output()
    assert finals(a, c) == reference(*extra), "the restart trains from step 0, as an uninterrupted run does"


def _standalone(*args: str) -> tuple[int, str]:
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(LOOPS), "--steps", "5", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return res.returncode, res.stdout + res.stderr


def test_a_second_optimizer_step_in_a_step_is_refused_before_it_steps() -> None:
    code, out = _standalone("--optimizers", "2", "--misuse", "two-votes")
    assert code != 0
    assert "rt.optimizer_step() was called a second time in step 0 (first for SGD, now for AdamW)" in out
    assert "rt.optimizer_step(opt1, opt2)" in out and " final: " not in out


def test_tracked_state_that_differs_by_rank_undeclared_is_refused_at_the_first_vote() -> None:
    code, out = _standalone("--misuse", "rank-state")
    assert code != 0
    assert "The tracked object 'counter' (Counter) holds a different state on different ranks at step 0" in out
    assert "rt.track_per_rank(counter=...)" in out and " final: " not in out


def test_an_untracked_lr_scheduler_is_refused_before_the_first_step() -> None:
    """A joiner's own scheduler would follow another schedule: the replicas would drift apart silently."""
    code, out = _standalone("--sched", "--misuse", "untracked-sched")
    assert code != 0
    assert "The tracked optimizer 'opt0' (AdamW) has an LR scheduler (StepLR) that is not tracked" in out
    assert "rt.track(sched=...)" in out and " final: " not in out
    # two optimizers, the scheduled one first stepped in step 1: checked then
    code, out = _standalone("--optimizers", "2", "--sched", "--misuse", "late-untracked-sched")
    assert code != 0
    assert "The tracked optimizer 'opt0' (SGD) has an LR scheduler (StepLR) that is not tracked" in out
