"""rt.track(): what it accepts, and a torch.Generator of the script's own tracked by its state."""

from __future__ import annotations

import pytest
import torch

from rlaunch.runtime import rng
from tests.one_rank import plain_runtime


def test_a_generator_is_tracked_by_its_state_once_under_its_name() -> None:
    rt, g = plain_runtime(), torch.Generator().manual_seed(3)
    rt.track(noise=g)
    held = rt._s.tracked["noise"]
    assert isinstance(held, rng.ScriptGenerator) and held.generator is g
    start = held.state_dict()
    torch.rand(4, generator=g)
    held.load_state_dict(start)
    assert torch.equal(g.get_state(), start["state"]), "its state is put back through the wrapper"
    rt.track(noise=g)  # tracking it again (a script that calls rt.track twice) keeps it
    assert rt._s.tracked["noise"] is held
    with pytest.raises(ValueError, match="already tracks another object named 'noise'"):
        rt.track(noise=torch.Generator())
    rt.track_per_rank(mine=torch.Generator().manual_seed(4))
    assert "mine" in rt._s.per_rank and isinstance(rt._s.tracked["mine"], rng.ScriptGenerator)


def test_an_object_without_state_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"rt.track\(step=...\) needs .* \(or a torch.Generator\); got int"):
        plain_runtime().track(step=3)
