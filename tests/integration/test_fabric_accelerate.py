"""Lightning Fabric and Hugging Face Accelerate under rlaunch: a drain and a lost node, each mid-epoch,
end bit-identical to an uninterrupted run and to the framework's own tutorial loop under plain torchrun.

Both frameworks leave the loop to the script, so the scripts (``tests/scripts/fabric_train.py``,
``tests/scripts/accelerate_train.py``) run their tutorial loop (``--loop epochs``) for the reference
and its port on ``rt.steps()`` (``--loop steps``) under rlaunch: BatchNorm, dropout, a shuffled
loader, an LR scheduler, gradient clipping, an evaluation loader set up with the train loader and
iterated as the tutorials do at each epoch's end (inside ``rt.steps()`` in the port: it passes
through, and a joiner evaluates its new rank's part), a second train loader set up with the others
and first read after the main epochs (a later phase); Fabric with fp16 AMP and a ``GradScaler`` on
CPU, Accelerate with gradient accumulation, bf16 autocast and an average of the weights registered
for checkpointing (``AveragedModel``, updated when ``optimizer.step_was_skipped`` is False). One job
per framework: a and b train, c and d are warm standbys; b is drained to c, then, in the later
phase, a's node is SIGKILLed and d (whose sandbox never read the later loader) takes rank 0 live.
The port also runs under plain torchrun, as the tutorial loop does, and ends as it does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import SCRIPTS, AgentProc, Cluster, wait_for
from tests.integration.test_migration import drain, warm
from tests.torch_teardown import both_finals, finals, launch

FINAL = re.compile(r"rank (\d+) final: params=(\w+) optim=(\w+) steps=(\d+)(?: eval=([-+0-9.e,]+))?")
pytestmark = pytest.mark.timeout(600)


def run(launcher: str, script: Path, *args: str) -> dict[int, tuple[str, ...]]:
    """Every rank's final digests from one uninterrupted 2-rank run on one node that ended well (a plain
    torchrun run that aborted in torch's teardown is run again, at most twice: see tests.torch_teardown)."""
    return both_finals(launch(launcher, [str(script), *args]), FINAL)


def drain_then_lose_a(cluster: Cluster, script: Path, *args: str, gate_at: int, die_at: int) -> list[AgentProc]:
    """a and b active, c and d warm standbys; b drained after step ``gate_at``, a's node killed at ``die_at``."""
    gates = cluster.tmp / "gate", cluster.tmp / "drained"
    agents = cluster.agents_in_order(
        ["a", "b", "c", "d"], script, *args, "--step-time", "0.1", "--gate", f"{gates[0]}:{gate_at}",
        "--gate", f"{gates[1]}:{die_at - 3}", "--die", f"0:{die_at}", flags=("--max-restarts", "1"),
    )  # fmt: skip
    wait_for(lambda: warm(cluster, "c") and warm(cluster, "d"), 240, "standbys c and d to be warm")
    gates[0].touch()
    drain(cluster, "b")
    gates[1].touch()
    a, b, c, d = agents
    assert [x.wait(240) for x in (b, c, d)] == [0, 0, 0], (c.output()[-3000:], d.output()[-3000:])
    assert a.proc.poll() is not None and "final" not in a.output() + b.output()
    assert f"'resume_at': {die_at}" in c.output(), "the step a was in is redone"
    assert "'sends_to': [0]" in c.output() and "event joined" in d.output(), "c sends rank 0 its state to d"
    assert "live moves are refused" not in c.output() + d.output()
    return agents


FABRIC = SCRIPTS / "fabric_train.py"
FABRIC_ARGS = ("--precision", "16-mixed", "--eval", "--phase2")  # 3 epochs of 20 steps, then 10 of the later phase
ACCELERATE = SCRIPTS / "accelerate_train.py"
ACCELERATE_ARGS = ("--accum", "2", "--mixed-precision", "bf16", "--eval", "--phase2", "--ema")  # 3 x 10 steps, then 5


@pytest.fixture(scope="module")
def fabric_reference() -> dict[int, tuple[str, ...]]:
    """Fabric's own loop and DDP under plain torchrun; the port with the FabricStrategy ends the same there."""
    pytest.importorskip("lightning_fabric", reason="the Fabric strategy's tests need 'rlaunch[lightning]'")
    args = ("torch.distributed.run", FABRIC, "--devices", "2", *FABRIC_ARGS)
    reference = run(*args, "--strategy", "ddp", "--loop", "epochs")
    assert run(*args, "--loop", "steps") == reference, "the port under plain torchrun trains as Fabric's own loop"
    return reference


@pytest.fixture(scope="module")
def accelerate_reference() -> dict[int, tuple[str, ...]]:
    """Accelerate's tutorial loop on accelerator.prepare under plain torchrun; the port on rlaunch's prepare
    ends the same there."""
    pytest.importorskip("accelerate", reason="the Accelerate adapter's tests need 'rlaunch[accelerate]'")
    args = ("torch.distributed.run", ACCELERATE, *ACCELERATE_ARGS)
    reference = run(*args, "--prepare", "accelerate", "--loop", "epochs")
    assert run(*args, "--loop", "steps") == reference, "the port under plain torchrun trains as the tutorial loop"
    return reference


def test_a_fabric_loop_on_rt_steps_survives_a_drain_and_a_lost_node(
    cluster: Cluster, fabric_reference: dict[int, tuple[str, ...]]
) -> None:
    """The moved job imports Fabric from the unified package (``import lightning as L``), the reference from
    ``lightning_fabric``: the strategy is built on the packaging the script imported, and both train alike."""
    _, _, c, d = drain_then_lose_a(
        cluster, FABRIC, "--devices", "1", "--nodes", "2", *FABRIC_ARGS, "--loop", "steps", "--package", "lightning",
        gate_at=2, die_at=65,
    )  # fmt: skip
    assert finals(FINAL, c.output() + d.output()) == fabric_reference, (
        "the port ends as Fabric's own loop under torchrun"
    )
    assert run("rlaunch", FABRIC, "--devices", "2", *FABRIC_ARGS, "--loop", "steps") == fabric_reference


def test_an_accelerate_loop_on_rt_steps_survives_a_drain_and_a_lost_node(
    cluster: Cluster, accelerate_reference: dict[int, tuple[str, ...]]
) -> None:
    _, _, c, d = drain_then_lose_a(cluster, ACCELERATE, *ACCELERATE_ARGS, "--loop", "steps", gate_at=2, die_at=32)
    assert finals(FINAL, c.output() + d.output()) == accelerate_reference, (
        "the port ends as the tutorial loop under torchrun"
    )
    assert run("rlaunch", ACCELERATE, *ACCELERATE_ARGS, "--loop", "steps") == accelerate_reference


def test_a_loop_over_the_loaders_epochs_trains_as_the_framework_does_and_refuses_moves_by_name(
    fabric_reference: dict[int, tuple[str, ...]], accelerate_reference: dict[int, tuple[str, ...]]
) -> None:
    """The tutorial loops themselves under rlaunch: where they stand lives in the script's variables, so
    live moves are refused with a sentence (a fault takes the restart path); they train as before, the
    later phase's loader driving the steps from its first optimizer step. Their steps end where the
    framework's training does (Accelerate's end_training(), Fabric's at exit): the agent learns that
    each rank is done stepping (what follows is not a hang) and publishes its verification."""
    for script, args, reference, name in (
        (FABRIC, ("--devices", "2", *FABRIC_ARGS), fabric_reference, "rlaunch.lightning.FabricStrategy"),
        (ACCELERATE, ACCELERATE_ARGS, accelerate_reference, "rlaunch.accelerate"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(script), *args,
             "--loop", "epochs"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        out = res.stdout + res.stderr
        assert res.returncode == 0 and finals(FINAL, out) == reference, out[-3000:]
        why = f"{name}: The training loop iterates the loader's epochs itself (for batch in loader)"
        assert f"live moves are refused: {why}" in out and f"live moves: none: {why}" in out, out[-3000:]
        done = re.findall(r"event verification \(generation 1\) \{'rank': (\d+)", out)
        assert sorted(done) == ["0", "1"], out[-3000:]
