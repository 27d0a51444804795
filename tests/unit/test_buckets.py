"""DDP's one-time bucket rebuild, read from a real DDP (one gloo rank): ahead until its second
synced forward, never with find_unused_parameters (torch's Reducer does not rebuild then)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import buckets


def _step(model: nn.Module) -> None:
    model(torch.ones(4, 8)).sum().backward()


def test_the_rebuild_is_ahead_until_ddps_second_forward_and_never_with_find_unused_parameters(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
        unused = DistributedDataParallel(nn.Linear(8, 1), find_unused_parameters=True)
        tracked = {"model": model, "unused": unused, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
        assert buckets.pending(tracked) == ["model"]
        assert "'model'" in buckets.refusal(tracked) and "second step" in buckets.refusal(tracked)
        _step(model)
        _step(unused)
        assert buckets.pending(tracked) == ["model"], "the first backward only records the gradients' order"
        _step(model)
        _step(unused)
        assert buckets.pending(tracked) == [] and buckets.refusal(tracked) == ""
    finally:
        dist.destroy_process_group()
