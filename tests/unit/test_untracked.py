"""State a script forgot to track is named before the first step (rlaunch.runtime.untracked)."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import LinearLR, ReduceLROnPlateau, SequentialLR, StepLR

from rlaunch.runtime.untracked import live_schedulers, untracked_state


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def test_an_optimizer_without_a_scheduler_needs_nothing_more() -> None:
    opt = _opt()
    assert untracked_state({"optimizer": opt}, [opt], None, live_schedulers()) == ""


def test_an_untracked_scheduler_is_named() -> None:
    opt = _opt()
    sched = StepLR(opt, step_size=3)
    why = untracked_state({"optimizer": opt}, [opt], None, live_schedulers())
    assert "The tracked optimizer 'optimizer' (SGD) has an LR scheduler (StepLR) that is not tracked" in why
    assert "rt.track(sched=...)" in why
    del sched
    assert untracked_state({"optimizer": opt}, [opt], None, live_schedulers()) == "", "a freed one steps nothing"
    holder: dict[str, object] = {"sched": StepLR(opt, step_size=3)}
    holder["self"] = holder  # discarded inside a reference cycle: garbage, not state
    del holder
    assert untracked_state({"optimizer": opt}, [opt], None, live_schedulers()) == ""


def test_a_second_scheduler_and_reduce_on_plateau_are_seen_on_the_heap() -> None:
    """Neither leaves a mark on the optimizer that a tracked one has not left already."""
    opt = _opt()
    first, second = StepLR(opt, step_size=3), LinearLR(opt, total_iters=4)
    why = untracked_state({"optimizer": opt, "sched": first}, [opt], None, live_schedulers())
    assert "has an LR scheduler (LinearLR) that is not tracked" in why
    del second
    assert untracked_state({"optimizer": opt, "sched": first}, [opt], None, live_schedulers()) == ""
    opt2 = _opt()
    plateau = ReduceLROnPlateau(opt2)
    why = untracked_state({"optimizer": opt2}, [opt2], None, live_schedulers())
    assert "has an LR scheduler (ReduceLROnPlateau) that is not tracked" in why
    assert untracked_state({"optimizer": opt2, "plateau": plateau}, [opt2], None, live_schedulers()) == ""


def test_a_tracked_scheduler_and_a_tracked_chain_count() -> None:
    opt = _opt()
    sched = StepLR(opt, step_size=3)
    assert untracked_state({"optimizer": opt, "sched": sched}, [opt], None, live_schedulers()) == ""
    opt2 = _opt()
    chain = SequentialLR(opt2, [LinearLR(opt2, total_iters=2), StepLR(opt2, step_size=3)], milestones=[2])
    assert untracked_state({"optimizer": opt2, "sched": chain}, [opt2], None, live_schedulers()) == ""


def test_a_scheduler_of_another_optimizer_does_not_count() -> None:
    opt, other = _opt(), _opt()
    mine = StepLR(opt, step_size=3)
    tracked = {"optimizer": opt, "other": other, "sched": StepLR(other, step_size=2)}
    assert "'optimizer'" in untracked_state(tracked, [opt], None, [mine, tracked["sched"]])
    assert untracked_state(tracked, [opt], None, [tracked["sched"]]) == ""


def test_an_untracked_optimizer_or_scaler_is_named() -> None:
    opt = _opt()
    assert "The optimizer SGD passed to rt.optimizer_step() is not tracked" in untracked_state({}, [opt], None, [])
    scaler = torch.amp.GradScaler("cpu")
    why = untracked_state({"optimizer": opt}, [opt], scaler, [])
    assert "The GradScaler passed to rt.optimizer_step(scaler=...) is not tracked" in why
    assert untracked_state({"optimizer": opt, "scaler": scaler}, [opt], scaler, []) == ""


class AppState:
    """A Stateful wrapper as DCP users write it: the model and optimizer are its attributes."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sched: object = None) -> None:
        self.model, self.optimizer, self.sched = model, optimizer, sched

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass


def test_objects_inside_a_tracked_wrapper_and_a_disabled_scaler_count_as_tracked() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = StepLR(opt, step_size=3)
    assert untracked_state({"app": AppState(model, opt, sched)}, [opt], None, [sched]) == ""
    assert "that is not tracked" in untracked_state({"app": AppState(model, opt)}, [opt], None, [sched])
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert untracked_state({"app": AppState(model, opt, sched)}, [opt], off, [sched]) == ""
