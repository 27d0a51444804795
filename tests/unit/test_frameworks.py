"""The framework integrations' version gate, the package extras that declare the same versions, and
the sentences the Lightning integration says at fit time for what it does not carry."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlaunch import frameworks
from rlaunch.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def test_the_extras_declare_the_versions_the_integrations_support() -> None:
    lines = (REPO / "pyproject.toml").read_text().splitlines()
    for distribution, wanted in frameworks.SUPPORTED.items():
        extra = next(line for line in lines if line.startswith(f"{frameworks.EXTRAS[distribution]} = ["))
        assert f'"{distribution}{wanted}"' in extra, (distribution, extra)


def test_an_unsupported_or_missing_version_is_refused_with_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"pytorch-lightning": "2.5.3"}

    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(UsageError) as err:
        frameworks.require("pytorch-lightning", "rlaunch.lightning.Strategy")
    assert str(err.value) == (
        "rlaunch.lightning.Strategy supports pytorch-lightning >=2.6,<2.7 (it reads that version's loop state to "
        "hand a rank over live), but 2.5.3 is installed: pip install 'rlaunch[lightning]' installs a supported one."
    )
    with pytest.raises(UsageError, match=r"needs accelerate >=1.15,<1.16, which is not installed: pip install"):
        frameworks.require("accelerate", "rlaunch.accelerate.prepare")
    versions["pytorch-lightning"] = "2.6.6"
    assert frameworks.require("pytorch-lightning", "x") == "2.6.6"


class Score:
    def __init__(self, value: float) -> None:
        self.value = value


def test_what_the_lightning_integration_does_not_carry_is_named_at_fit_time() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    import torch

    from rlaunch.lightning import checks

    class Module(pl.LightningModule):
        def training_step(self, dataloader_iter: object) -> None:
            return None

    class Keeps(pl.Callback):
        def state_dict(self) -> dict[str, object]:
            return {"best": Score(0.5)}  # an object of its own class: torch.load(weights_only=True) refuses it

    swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)
    trainer = pl.Trainer(
        limit_train_batches=5, reload_dataloaders_every_n_epochs=1, callbacks=[Keeps(), swa], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.strategy._lightning_module = Module()

    class Strategy:
        _ddp_comm_hook = None
        _model_averaging_period = 4

    found = checks.refusals(trainer, Strategy())
    assert any(s.startswith("Trainer(limit_train_batches=5) ends epochs before their loader does") for s in found)
    assert any("reload_dataloaders_every_n_epochs=1" in s for s in found)
    assert any(s.startswith("The training_step takes dataloader_iter and reads batches itself") for s in found)
    assert any("model averaging" in s for s in found)
    assert any(s.startswith("The callback Keeps keeps state that cannot travel to a joiner safely") for s in found)
    for sentence in found:  # each names the value and what to do instead, as a sentence
        assert sentence[0].isupper() and sentence.endswith(".") and "; " in sentence, sentence
    assert any(s.startswith("The callback StochasticWeightAveraging changes the model") for s in found)
    assert checks.carried_callbacks(trainer) == [], "a state that cannot travel is refused, not carried"
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))])
    assert checks.stepping(trainer, trainer.precision_plugin, [lbfgs]).startswith("The LBFGS optimizer")
    assert checks.stepping(trainer, trainer.precision_plugin, []) == ""


def test_a_weight_average_is_tracked_beside_the_model_with_what_decides_its_next_update() -> None:
    """Lightning's WeightAveraging builds its AveragedModel in its setup, before the strategy's: that model
    is tracked; the epoch of its last update, outside its state_dict(), travels beside it."""
    pl = pytest.importorskip("pytorch_lightning")
    import torch

    from rlaunch.lightning import checks
    from rlaunch.lightning.strategy import CallbackStates

    def fit_with(ema: Any) -> Any:
        trainer = pl.Trainer(callbacks=[ema], logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.strategy._lightning_module = pl.LightningModule()
        trainer.lightning_module.layer = torch.nn.Linear(2, 1)
        return trainer

    ema = pl.callbacks.EMAWeightAveraging(update_starting_at_epoch=1)
    trainer = fit_with(ema)
    assert [s for s in checks.refusals(trainer, _PlainDDP()) if "had no average model when the fit was set up" in s]
    ema.setup(trainer, trainer.lightning_module, "fit")
    assert checks.refusals(trainer, _PlainDDP()) == [] and checks.carried_callbacks(trainer) == [ema]
    tracked = checks.averaged_models(trainer)
    assert tracked == {"average": ema._average_model} and checks.average_replaced(trainer, tracked) == ""
    ema._latest_update_epoch, ema._latest_update_step = 2, 30  # the sender's, after epoch 2's end
    joiner = pl.callbacks.EMAWeightAveraging(update_starting_at_epoch=1)  # its sandbox ran no epoch's end
    CallbackStates([joiner]).load_state_dict(CallbackStates([ema]).state_dict())
    assert (joiner._latest_update_epoch, joiner._latest_update_step) == (2, 30)
    ema._average_model = torch.optim.swa_utils.AveragedModel(trainer.lightning_module)
    assert checks.average_replaced(trainer, tracked).startswith("A WeightAveraging callback replaced its average")


class _PlainDDP:
    _ddp_comm_hook = None
    _model_averaging_period = None


def _fresh_import(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> pytest.ExceptionInfo[UsageError]:
    """``import rlaunch.lightning`` afresh with only ``versions`` installed: Lightning's own modules cannot be
    imported (as when it is missing), so the sentence must come before anything imports them."""

    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    for name in [m for m in sys.modules if m == "rlaunch.lightning" or m.startswith("rlaunch.lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("pytorch_lightning", "lightning_fabric", "lightning", "lightning.pytorch", "lightning.fabric"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    with pytest.raises(UsageError) as err:
        importlib.import_module("rlaunch.lightning")
    return err


def test_a_missing_or_unsupported_lightning_is_refused_at_import_with_a_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = _fresh_import(monkeypatch, {"lightning-fabric": "2.6.6"})
    assert str(err.value).startswith("rlaunch.lightning needs pytorch-lightning >=2.6,<2.7, which is not installed")
    err = _fresh_import(monkeypatch, {"pytorch-lightning": "2.6.6", "lightning-fabric": "2.7.0"})
    assert str(err.value).startswith("rlaunch.lightning supports lightning-fabric >=2.6,<2.7")
    # The unified package alone: its version is the one checked.
    err = _fresh_import(monkeypatch, {"lightning": "2.7.1"})
    assert str(err.value).startswith("rlaunch.lightning supports lightning >=2.6,<2.7 (it reads that version's")


def _python(script: str) -> str:
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    return res.stdout + res.stderr


def test_the_unified_lightning_package_gets_strategies_of_its_own_whatever_the_order_of_the_imports() -> None:
    """L.Trainer takes only strategies of the unified package (lightning.pytorch): the integration is built
    on its modules when the script imported it, before or after rlaunch.lightning (isort puts
    ``import rlaunch.lightning`` before ``from lightning.pytorch import Trainer``)."""
    for imports in (
        "import lightning as L; import rlaunch.lightning",
        "import rlaunch.lightning; import lightning as L",
    ):
        said = _python(
            f"import sys; {imports}; from rlaunch.lightning import packages; from rlaunch import frameworks; "
            "assert packages.PACKAGING is frameworks.UNIFIED; "
            "assert issubclass(rlaunch.lightning.Strategy, L.pytorch.strategies.DDPStrategy); "
            "assert issubclass(rlaunch.lightning.FabricStrategy, L.fabric.strategies.DDPStrategy); "
            "assert 'pytorch_lightning' not in sys.modules and 'lightning_fabric' not in sys.modules; print('ok')"
        )
        assert said.strip() == "ok", (imports, said)


def test_a_script_that_imports_the_other_lightning_packaging_after_the_strategy_is_refused_with_a_sentence() -> None:
    """The strategy was first used before the unified package was imported, so it was built on pytorch_lightning
    (installed, or imported); the script then trains with the unified package, whose Trainer would refuse the
    strategy with a traceback from inside it."""
    for first in ("", "import pytorch_lightning; "):
        said = _python(
            f"{first}import rlaunch.lightning; strategy = rlaunch.lightning.Strategy; import lightning; strategy()"
        )
        assert (
            "rlaunch: error: rlaunch.lightning.Strategy was built on the pytorch_lightning and lightning_fabric "
            "packages, the Lightning found when the strategy was first used, and this script imported the unified "
            "lightning package after that"
        ) in said, (first, said)
        assert "Traceback" not in said, said


def test_what_accelerate_checkpoints_for_the_script_moves_with_it_or_refuses_moves_by_name() -> None:
    """A module given to accelerator.register_for_checkpointing() (a model average) is tracked at the
    next optimizer step; another object registered so and left untracked refuses live moves, naming it."""
    pytest.importorskip("accelerate", reason="the Accelerate adapter's tests need 'rlaunch[accelerate]'")
    import torch
    from accelerate import Accelerator

    import rlaunch.accelerate
    from tests.one_rank import plain_runtime

    class Counter:
        def state_dict(self) -> dict[str, int]:
            return {"n": 0}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    rt = plain_runtime()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    model, optimizer = rlaunch.accelerate.prepare(accelerator, rt, model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema, counter = torch.optim.swa_utils.AveragedModel(model), Counter()
    accelerator.register_for_checkpointing(ema, counter)
    assert not rt.tracks(ema)
    for _ in rt.steps(1):
        model(torch.ones(3, 2)).sum().backward()
        optimizer.step()
    assert rt.tracks(ema) and not rt.tracks(counter)
    said = "An object of type Counter was given to accelerator.register_for_checkpointing(), and a joiner would not"
    assert said in rt._s.refused


def test_a_standby_is_on_no_node_so_lightning_prepares_per_node_data_there_and_job_data_on_rank_0_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lightning runs prepare_data where local_rank == 0, and also node_rank == 0 unless it is per node."""
    from types import SimpleNamespace

    from rlaunch.lightning.environment import RuntimeEnvironment

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    runtime = SimpleNamespace(rank=-1, world_size=4)
    env = RuntimeEnvironment(lambda: runtime)  # type: ignore[arg-type,return-value]
    assert (env.global_rank(), env.local_rank(), env.node_rank()) == (-1, 0, -1), "a standby's sandbox"
    runtime.rank = 3  # it joined as rank 3, read afresh
    assert (env.global_rank(), env.node_rank()) == (3, 1)
    runtime.rank = 1
    assert env.node_rank() == 0
