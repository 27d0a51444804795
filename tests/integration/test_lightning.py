"""PyTorch Lightning under rlaunch: a drain and a lost node, each mid-epoch, end bit-identical to an
uninterrupted run and to Lightning's own DDP under plain torchrun.

The script (``tests/scripts/lightning_train.py``) is written as Lightning's tutorials write one:
BatchNorm, dropout, ``self.log``, a step-interval LR scheduler, validation every epoch, a shuffled
loader, checkpointing and logging left on. One job covers several patterns at once: gradient
accumulation scheduled by epoch (a ``GradientAccumulationScheduler``: 2 batches per step in epoch 0,
4 from epoch 1, so a joiner's sandbox has another window than the epoch it joins), fp16 AMP with a
``GradScaler`` on CPU, and torchdata's ``StatefulDataLoader(shuffle=True)``, whose sampler Lightning
wraps in its ``DistributedSamplerWrapper`` (its order comes from the sampler's own generator at each
epoch's start). A fault after a step's vote that reached what no redone step runs again (validation,
a value synced in on_train_batch_end) takes the restart path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster import SCRIPTS, Cluster, wait_for
from tests.integration.test_migration import drain, warm
from tests.torch_teardown import TORCHRUN, both_finals, finals
from tests.torch_teardown import launch as launch_2_ranks

pytest.importorskip("pytorch_lightning", reason="the Lightning integration's tests need 'rlaunch[lightning]'")

SCRIPT = SCRIPTS / "lightning_train.py"
PATTERNS = ("--accum-schedule", "0:2,1:4", "--precision", "16-mixed", "--loader", "stateful")
NUMBER = r"None|[-+0-9.e]+"  # not \S+: two ranks' lines may reach the output unseparated
FINAL = re.compile(
    rf"rank (\d+) final: params=(\w+) optim=(\w+) steps=(\d+) val_loss=({NUMBER})(?: plateau=([-+0-9.e,]+))?"
)
JOINED = re.compile(r"rank \d+ joined at epoch (\d+) batch (\d+)")
pytestmark = pytest.mark.timeout(600)


def launch(launcher: str, *args: str, root: Path) -> subprocess.CompletedProcess[str]:
    """One uninterrupted 2-rank run of the script on one node under ``launcher``, writing under ``root``
    (a torchrun run that aborted in torch's teardown is run again: see tests.torch_teardown)."""
    return launch_2_ranks(
        launcher, [str(SCRIPT), "--devices", "2", "--root", str(root), *args],
        fresh=lambda: shutil.rmtree(root, ignore_errors=True),
    )  # fmt: skip


def run(*args: str, root: Path, launcher: str = TORCHRUN) -> dict[int, tuple[str, ...]]:
    """Every rank's final digests from one uninterrupted 2-rank run on one node, with the patterns."""
    return both_finals(launch(launcher, *PATTERNS, *args, root=root), FINAL)


def test_a_drain_and_a_lost_node_mid_epoch_end_as_lightnings_own_ddp_does(cluster: Cluster, tmp_path: Path) -> None:
    """a and b train on one rank each, c and d are warm standbys. b is drained to c early on; at
    global step 17 (mid-epoch 2: epoch 0 has 10 steps of 2 batches, epochs 1 and 2 have 5 of 4) a's
    node is SIGKILLed and d takes rank 0 live: the step is redone inside Lightning's optimizer step,
    and d takes a's loop position (the window of 4 included: its sandbox ran epoch 0's 2), data
    position and callbacks from c. Both must end as Lightning's DDP does under torchrun, and as an
    uninterrupted run."""
    ddp = run("--strategy", "ddp", root=tmp_path / "ddp")
    assert ddp[0] == ddp[1], "Lightning's DDP keeps its replicas equal"
    gates = cluster.tmp / "gate", cluster.tmp / "drained"
    root = tmp_path / "job"
    agents = cluster.agents_in_order(
        ["a", "b", "c", "d"], SCRIPT, "--devices", "1", "--nodes", "2", "--root", str(root), *PATTERNS,
        "--step-time", "0.1", "--gate", f"{gates[0]}:2", "--gate", f"{gates[1]}:14", "--die", "0:17",
        flags=("--max-restarts", "1"),
    )  # fmt: skip
    a, b, c, d = agents
    wait_for(lambda: warm(cluster, "c") and warm(cluster, "d"), 240, "standbys c and d to be warm")
    gates[0].touch()
    drain(cluster, "b")
    gates[1].touch()
    assert [x.wait(240) for x in (b, c, d)] == [0, 0, 0], (c.output()[-3000:], d.output()[-3000:])
    assert a.proc.poll() is not None and "final" not in a.output() + b.output()
    got = finals(FINAL, c.output() + d.output())
    assert got == ddp, "the job must end as Lightning's DDP does, on every rank"
    assert "[d/0] rank 0 final" in d.output() and "[c/1] rank 1 final" in c.output()
    assert JOINED.search(c.output()), "c joined where the drain switched (the test does not choose where)"
    d_joined = JOINED.search(d.output())
    assert d_joined and d_joined.groups() == ("2", "8"), "d joined mid-epoch: global step 17 is epoch 2, batch 8"
    assert "'resume_at': 17" in c.output(), "step 17 is discarded and redone inside Lightning's optimizer step"
    assert "event recovered" in c.output() and "'sends_to': [0]" in c.output(), "c sends rank 0 its state"
    assert "event joined" in d.output() and "live moves are refused" not in c.output() + d.output()
    # The checkpoint callback's state moved: d, now rank 0, saved the last epoch's checkpoint where a
    # saved the others, and removed the one before it as a would have (save_top_k=1).
    kept = sorted(p.name for p in root.glob("lightning_logs/version_*/checkpoints/*.ckpt"))
    assert kept == ["epoch=2-step=20.ckpt"], kept
    assert run(root=tmp_path / "uninterrupted", launcher="rlaunch") == ddp
    # The same script, rlaunch's strategy and all, under plain torchrun: it trains as Lightning's DDP.
    assert run(root=tmp_path / "torchrun") == ddp


def test_manual_optimization_drains_and_reruns_the_training_step_after_a_lost_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With manual optimization the vote is in the training_step's own optimizer.step(): a and b train,
    c and d are warm standbys; b is drained to c early on, then a's node is SIGKILLed at global step 25
    (mid-epoch 1) and d takes rank 0 live, c reruns the discarded training_step whole. Both end as
    Lightning's DDP does."""
    manual = ("--manual", "--loader", "plain")
    ddp = both_finals(launch(TORCHRUN, "--strategy", "ddp", *manual, root=tmp_path / "ddp"), FINAL)
    gates = cluster.tmp / "gate", cluster.tmp / "drained"
    a, b, c, d = cluster.agents_in_order(
        ["a", "b", "c", "d"], SCRIPT, "--devices", "1", "--nodes", "2", "--root", str(tmp_path / "job"), *manual,
        "--step-time", "0.05", "--gate", f"{gates[0]}:2", "--gate", f"{gates[1]}:22", "--die", "0:25",
        flags=("--max-restarts", "1"),
    )  # fmt: skip
    wait_for(lambda: warm(cluster, "c") and warm(cluster, "d"), 240, "standbys c and d to be warm")
    gates[0].touch()
    drain(cluster, "b")
    gates[1].touch()
    assert [x.wait(240) for x in (b, c, d)] == [0, 0, 0], (b.output()[-3000:], c.output()[-3000:], d.output()[-3000:])
    assert a.proc.poll() is not None and "final" not in a.output() + b.output()
    assert JOINED.search(c.output()), "b's rank moved to c"
    assert "'resume_at': 25" in c.output() and "event joined" in d.output()
    assert finals(FINAL, c.output() + d.output()) == ddp, "the job must end as Lightning's DDP does, on every rank"


def test_a_fault_after_a_steps_vote_takes_the_restart_path(cluster: Cluster, tmp_path: Path) -> None:
    """What runs after a step's vote is not redone, and two ReduceLROnPlateau schedulers step on values
    synced there: one on val_loss (validation), one every step on end_loss, logged with sync_dist=True in
    on_train_batch_end. A failed group hands back each rank's own input, which the plateau scheduler then
    takes. In the first run a's worker is SIGKILLed in epoch 0's validation; in the restarted one, right
    after step 4's vote, before it syncs end_loss. Each time b refuses the live replacement with a
    sentence, and the job restarts (the script keeps no checkpoint: from the start; each refused
    replacement counts as a restart too), ending as Lightning's DDP does."""
    args = ("--plateau", "--step-plateau", "--epochs", "2")
    ddp = run("--strategy", "ddp", *args, root=tmp_path / "ddp")
    a, b = cluster.agents_in_order(
        ["a", "b"], SCRIPT, "--devices", "1", "--nodes", "2", "--root", str(tmp_path / "job"), *PATTERNS, *args,
        "--crash-in-validation", "0:0", "--crash-after-vote", "0:4:1", flags=("--max-restarts", "4"),
    )  # fmt: skip
    assert [x.wait(300) for x in (a, b)] == [0, 0], (a.output()[-3000:], b.output()[-3000:])
    why = "rlaunch.lightning: A fault was seen after an epoch's end ran past step 9's vote"
    assert f"live moves are refused: {why}" in b.output(), b.output()[-3000:]
    why = "rlaunch.lightning: A fault was seen after step 4's vote, and a collective issued since"
    assert f"live moves are refused: {why}" in b.output(), b.output()[-3000:]
    assert b.output().count("event replacement_refused") == 2 and "event recovered" not in b.output()
    assert finals(FINAL, a.output() + b.output()) == ddp, "the restarted job ends as Lightning's DDP does"


def test_what_cannot_move_is_named_at_start_and_the_job_trains_as_lightnings_ddp(tmp_path: Path) -> None:
    """limit_train_batches cuts epochs short, which the data position does not follow: the worker and its
    agent say so at start (live moves refused: the job would take the restart path), and it trains on."""
    args = ("--limit", "0.5", "--epochs", "2")
    ddp = run("--strategy", "ddp", *args, root=tmp_path / "ddp")
    res = launch("rlaunch", *PATTERNS, *args, root=tmp_path / "rl")
    out = res.stdout + res.stderr
    assert res.returncode == 0 and finals(FINAL, out) == ddp, out[-3000:]
    why = "rlaunch.lightning: Trainer(limit_train_batches=0.5) ends epochs before their loader does"
    assert f"live moves are refused: {why}" in out, out[-3000:]
    assert f"live moves: none: {why}" in out, "the agent publishes it: rlaunch status shows it"
