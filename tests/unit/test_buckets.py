"""DDP's one-time bucket rebuild, read from a real DDP (one gloo rank): ahead until its second
synced forward (its third with a static graph), never with find_unused_parameters (torch's Reducer
does not rebuild then), and awaited by moves only within the first votes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import buckets
from tests.unit import gloo_groups as gloo


def _step(*models: nn.Module) -> None:
    for model in models:
        model(torch.ones(4, 8)).sum().backward()


def _ddp(module: nn.Module, **options: bool) -> DistributedDataParallel:
    return DistributedDataParallel(module, process_group=gloo.one_rank(), **options)


def test_the_rebuild_is_ahead_until_ddps_second_forward_its_third_with_a_static_graph() -> None:
    torch.manual_seed(0)
    model = _ddp(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    static = _ddp(nn.Linear(8, 1), static_graph=True)
    unused = _ddp(nn.Linear(8, 1), find_unused_parameters=True)
    tracked = {"model": model, "static": static, "unused": unused, "opt": torch.optim.SGD(model.parameters())}
    assert buckets.pending(tracked) == ["model", "static"]
    assert "'model', 'static'" in buckets.refusal(tracked, 1)
    assert buckets.sandbox_iterations(tracked, 0) == 3, "a static graph rebuilds at its third step"
    assert buckets.sandbox_iterations({"model": model}, 0) == 2 and buckets.sandbox_iterations({}, 0) == 0
    _step(model, static, unused)
    assert buckets.pending(tracked) == ["model", "static"], "the first backward only records the gradients' order"
    _step(model, static, unused)
    assert buckets.pending(tracked) == ["static"]
    _step(model, static, unused)
    assert buckets.pending(tracked) == [] and buckets.refusal(tracked, 3) == ""


def test_a_rebuild_still_ahead_after_the_first_votes_is_not_awaited() -> None:
    """A DDP that never runs a synced backward (a teacher under no_grad) never rebuilds: a drain must
    not wait for it for ever (a joiner's sandbox, running the same code, did not rebuild it either)."""
    teacher = _ddp(nn.Linear(8, 1))
    for _ in range(5):
        with torch.no_grad():
            teacher(torch.ones(4, 8))
    tracked = {"teacher": teacher}
    assert buckets.pending(tracked) == ["teacher"]
    assert buckets.awaited(tracked, buckets.VOTES) == ["teacher"]
    assert buckets.awaited(tracked, buckets.VOTES + 1) == [] and buckets.refusal(tracked, buckets.VOTES + 1) == ""
