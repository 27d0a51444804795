"""A redone step leaves no trace: what the step changes besides parameters is put back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from rlaunch.runtime import rng
from rlaunch.runtime.stepstate import StepSnapshots, fingerprint_value


def _objects() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "model": model,
        "opt": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1),
        "noise": rng.ScriptGenerator(torch.Generator().manual_seed(5)),  # the script's own generator
    }


def _step(objs: dict[str, Any]) -> list[float]:
    """One training step's side effects, and the random numbers it drew."""
    noise = torch.rand(1, generator=objs["noise"].generator).item()
    out = objs["model"](torch.randn(16, 4)).sum() * (1 + random.random() + float(np.random.rand()) + noise)
    objs["scaler"].scale(out).backward()
    objs["scaler"].unscale_(objs["opt"])
    objs["sched"].step()
    return [out.item(), random.random(), float(np.random.rand()), noise]


def _side_state(objs: dict[str, Any]) -> list[Any]:
    return [
        [b.clone() for b in objs["model"].buffers()],
        objs["sched"].state_dict(),
        objs["scaler"].state_dict(),
        objs["opt"].param_groups[0]["lr"],  # the scheduler's step changed it
        objs["noise"].generator.get_state().tolist(),
    ]


def test_a_redone_step_draws_and_ends_as_the_first_time() -> None:
    objs = _objects()
    snaps = StepSnapshots()
    _step(objs)  # the scaler and the buffers are in use
    objs["scaler"].update()
    start = snaps.take(1, objs)
    before = _side_state(objs)
    first = _step(objs)
    assert not torch.equal(before[0][0], objs["model"][1].running_mean), "the step moved the BatchNorm stats"
    snaps.restore(start, objs)
    after = _side_state(objs)
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0], strict=True))
    assert before[1:] == after[1:]
    assert not objs["scaler"]._per_optimizer_states, "the discarded step's unscale_ is forgotten"
    assert _step(objs) == first, "the redone step draws the same random numbers"


def test_a_scaler_not_yet_used_goes_back_to_its_lazy_start() -> None:
    objs = _objects()
    snaps = StepSnapshots()
    start = snaps.take(0, objs)
    before = objs["scaler"].state_dict()
    _step(objs)
    snaps.restore(start, objs)
    assert objs["scaler"].state_dict() == before
    _step(objs)
    objs["scaler"].update()  # usable again


def test_fingerprints_see_tensors_and_values() -> None:
    a = {"x": torch.zeros(3), "n": 1}
    assert fingerprint_value(a) == fingerprint_value({"x": torch.zeros(3), "n": 1})
    assert fingerprint_value(a) != fingerprint_value({"x": torch.tensor([0.0, 0.0, 1.0]), "n": 1})
    assert fingerprint_value(a) != fingerprint_value({"x": torch.zeros(3), "n": 2})
    # the same state merged in another key order (torchdata's workers add keys in a set's order)
    assert fingerprint_value({"n": 1, "x": torch.zeros(3)}) == fingerprint_value(a)
    assert fingerprint_value({"p": 1, "q": 2}) != fingerprint_value({"q": 1, "p": 2})
    torch.manual_seed(1)
    one = rng.fingerprint(rng.capture())
    torch.manual_seed(2)
    assert rng.fingerprint(rng.capture()) != one
