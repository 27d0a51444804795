"""A redone step leaves no trace: what the step changes besides parameters is put back."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from rlaunch.runtime import rng
from rlaunch.runtime.stepstate import DiscardedParams, StepSnapshots, broadcasts, fingerprint_value, touched
from rlaunch.runtime.vote import RefusedError
from tests.one_rank import plain_runtime
from tests.unit import gloo_groups as gloo


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


def _averaged() -> dict[str, Any]:
    """A model with BatchNorm, its optimizer and an average of its weights, tracked as a script tracks them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "ema": ema}


def _averaged_steps(objs: dict[str, Any], steps: int, discard: int, guarded: bool, link: Any = None) -> None:
    """``steps`` steps of ``rt.steps()`` with step ``discard`` discarded once, as a recovery discards one;
    the average is updated after the step's optimizer step, when it applied (``guarded``) or whatever it said."""
    rt = plain_runtime()
    rt.track(**objs)
    model, opt, ema = objs["model"], objs["opt"], objs["ema"]
    redone = False
    for step in rt.steps(steps):
        opt.zero_grad()
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        applied = step != discard or redone
        if applied:
            opt.step()
        else:  # what rt.optimizer_step does when its recovery discards the step
            redone, rt._s.resume_at, rt._s.link = True, step, link
            rt._discarded = DiscardedParams(step, rt._s.tracked)
        if applied or not guarded:
            ema.update_parameters(model)


def test_a_model_average_updated_after_a_discarded_step_refuses_the_redo() -> None:
    """The update the discarded step's script made whatever rt.optimizer_step returned is not put back
    (no copy of the parameters is kept): the redo would update the average a second time. The job
    restarts with a sentence instead; updated only when the step applied, the redo ends as a run
    with no fault does."""

    class Link:
        calls: list[str] = []

        def call(self, op: str, **fields: Any) -> dict[str, Any]:
            self.calls.append(op)
            return {}

    link = Link()
    with pytest.raises(RefusedError) as refused:
        _averaged_steps(_averaged(), 4, discard=2, guarded=False, link=link)
    said = str(refused.value)
    assert re.search(r"step 2 was discarded and is redone, but \d+ parameters changed after rt.optimizer_step", said)
    assert "returned False, first 'module.0.weight' of the tracked module 'ema' (AveragedModel): the redone" in said
    assert "if rt.optimizer_step(opt): ema.update_parameters(model)" in said and link.calls == ["unrecoverable"]

    reference, redone = _averaged(), _averaged()
    _averaged_steps(reference, 4, discard=-1, guarded=True)
    _averaged_steps(redone, 4, discard=2, guarded=True)
    for a, b in zip(reference["ema"].state_dict().values(), redone["ema"].state_dict().values(), strict=True):
        assert torch.equal(a, b), "guarded: the redone run ends as the run with no fault"


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ("lerp", True),  # AveragedModel's own update (a foreach lerp)
        ("data", True),  # an average written through .data, which no version counter sees
        ("clamp", False),  # a projection that leaves parameters already in range as they are
    ],
)
def test_parameters_changed_after_a_discard_are_told_by_value(change: str, refused: bool) -> None:
    objs = _averaged()
    with torch.no_grad():
        for p in objs["model"].parameters():
            p.clamp_(-0.1, 0.1)
    discarded = DiscardedParams(7, objs)
    model, ema = objs["model"], objs["ema"]
    if change == "lerp":
        ema.update_parameters(model)
    elif change == "data":
        for e, p in zip(ema.module.parameters(), model.parameters(), strict=True):
            e.data.mul_(0.9).add_(p.data, alpha=0.1)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.1, 0.1)
    assert bool(discarded.changed()) is refused, discarded.changed()


def test_parameters_written_before_the_vote_are_seen_by_their_versions() -> None:
    """An average updated at the top of a step writes its parameters in place before the vote: if the
    step is discarded, its redo would update it again. A step's own forward and backward write none,
    and parameters an optimizer steps are left out (an embedding with max_norm renormalises its rows
    in place at every forward, alike every time)."""
    objs = _averaged()
    embedding = nn.Embedding(5, 4, max_norm=1.0)
    objs["words"], objs["opt2"] = embedding, torch.optim.SGD(embedding.parameters(), lr=0.1)
    start = StepSnapshots().take(3, objs)
    objs["model"](torch.randn(16, 4)).sum().backward()
    embedding(torch.tensor([1, 2])).sum().backward()
    assert touched(start, objs) == ""
    objs["ema"].update_parameters(objs["model"])
    said = touched(start, objs)
    assert said.startswith("6 parameters that no optimizer steps changed in step 3 before its vote, first ")
    assert "'module.0.weight' of the tracked module 'ema' (AveragedModel)" in said


def test_ddps_broadcasts_of_rank_0s_buffers_are_counted_with_or_without_gradients() -> None:
    """A forward after a synchronised one broadcasts rank 0's buffers: an evaluation's under no_grad (which
    clears DDP's flag) and one with gradients (which leaves it set, so the flag is no witness); a second
    forward under no_grad does not."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), process_group=gloo.one_rank())
    tracked = {"model": model}
    counts = [broadcasts(tracked)["model"]]
    model(torch.randn(8, 3)).sum().backward()  # the first forward broadcasts too
    counts.append(broadcasts(tracked)["model"])
    model.eval()
    model(torch.randn(8, 3))  # an evaluation with gradients on
    counts.append(broadcasts(tracked)["model"])
    with torch.no_grad():
        model(torch.randn(8, 3))
        counts.append(broadcasts(tracked)["model"])
        model(torch.randn(8, 3))
        counts.append(broadcasts(tracked)["model"])
    assert counts == [0, 1, 2, 3, 3], counts
