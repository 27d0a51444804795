"""Two scripts written as Lightning's and Accelerate's own tutorials write them, not for these tests
(``tests/scripts/lightning_tutorial.py``, ``tests/scripts/accelerate_tutorial.py``), run as a user would:
uninterrupted under plain torchrun, and under rlaunch in a job where one node is drained and then
another is SIGKILLed mid-epoch; every rank must end bit-identical to the framework alone under torchrun.
(An uninterrupted rlaunch run would repeat what the job shows: the same script, its ranks' finals and no
refusal of live moves.)

The faults come from outside, as a user's would: the scripts print ``epoch E batch B`` at each batch
(and sleep); the test drains b once the standbys are warm (the active ranks wait at batch 4 until then)
and SIGKILLs a's agent and workers when a's log reaches batch 5 of the last epoch (in the Accelerate port: inside
an accumulation window).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster import SCRIPTS, Cluster, wait_for
from tests.integration.test_migration import drain, warm
from tests.torch_teardown import TORCHRUN, both_finals, finals, launch

FINAL = re.compile(r"rank (\d+) final: (params=\w+ optim=\w+ sched=\w+ steps=\d+(?: eval=[0-9.,]+)?)")
LIGHTNING = SCRIPTS / "lightning_tutorial.py"
ACCELERATE = SCRIPTS / "accelerate_tutorial.py"
pytestmark = pytest.mark.timeout(900)


def run(script: Path, *args: str) -> dict[int, tuple[str, ...]]:
    """Every rank's final digests from one uninterrupted 2-rank run under plain torchrun that ended well
    (one that aborted in torch's teardown is run again, at most twice: see tests.torch_teardown)."""
    return both_finals(launch(TORCHRUN, [str(script), *args]), FINAL)


def drain_then_kill(cluster: Cluster, script: Path, *args: str) -> dict[int, tuple[str, ...]]:
    """a and b active, c and d warm standbys: b is drained at the start, a's node is SIGKILLed in epoch 2."""
    hold = cluster.tmp / "hold"
    a, b, c, d = cluster.agents_in_order(
        ["a", "b", "c", "d"], script, *args, "--step-time", "0.5", "--hold", str(hold), flags=("--max-restarts", "1")
    )  # fmt: skip
    wait_for(lambda: warm(cluster, "c") and warm(cluster, "d"), 300, "standbys c and d to be warm")
    hold.touch()
    drain(cluster, "b")
    assert "epoch 2 batch" not in a.output(), "the drain must end before the epoch the kill is planned in"
    wait_for(lambda: "epoch 2 batch 5" in a.output(), 120, "a to reach batch 5 of epoch 2")
    a.kill_with_workers()
    assert [x.wait(240) for x in (b, c, d)] == [0, 0, 0], (c.output()[-3000:], d.output()[-3000:])
    assert "final" not in a.output() + b.output()
    assert "[c/1] rank 1 final" in c.output() and "[d/0] rank 0 final" in d.output()
    assert "event joined" in d.output() and "live moves are refused" not in c.output() + d.output()
    return finals(FINAL, c.output() + d.output())


def test_a_lightning_tutorial_script_survives_a_drain_and_a_lost_node(cluster: Cluster, tmp_path: Path) -> None:
    """The OneCycleLR is sized by self.trainer.estimated_stepping_batches in configure_optimizers, as
    Lightning's docs do, which sets up the train loader from inside the strategy's setup. The data
    module's prepare_data runs behind Lightning's barrier on a group torch makes (before the sandbox
    served torch's new_group, the standbys' sandboxes stopped there: "'int' object has no attribute
    'monitored_barrier'", and the wait for warm standbys timed out). An EMAWeightAveraging callback
    keeps an average of the weights, updated after each step, which ends as the model. The train set
    is read by two loader workers, which draw a random jitter for each sample from their global streams
    and a scale from a NumPy generator each makes at its first read (without their streams in the
    loader's position, the node lost mid-epoch left its replacement's batches jittered differently:
    params fe99c79f... against 82fc36f5...)."""
    options = ("--workers", "2", "--augment", "--ema")
    ddp = run(LIGHTNING, "--strategy", "ddp", "--root", str(tmp_path / "ddp"), *options)
    assert ddp[0] == ddp[1]
    tr = run(LIGHTNING, "--root", str(tmp_path / "tr"), *options)
    assert tr == ddp, "rlaunch's strategy"
    job = drain_then_kill(
        cluster, LIGHTNING, "--devices", "1", "--nodes", "2", "--root", str(tmp_path / "job"), *options
    )  # fmt: skip
    assert job == ddp, "the job must end as Lightning's DDP does, on every rank"


def test_an_accelerate_tutorial_port_survives_a_drain_and_a_lost_node(cluster: Cluster) -> None:
    tutorial = run(ACCELERATE, "--loop", "tutorial")
    assert tutorial[0] == tutorial[1]
    assert run(ACCELERATE) == tutorial, "the port trains as the tutorial's loop"
    assert drain_then_kill(cluster, ACCELERATE) == tutorial, "the job must end as the tutorial's loop does"
