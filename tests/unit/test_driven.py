"""rt.drive(): the runtime's steps begun, redone and ended from a framework's hooks; rt.refuse_moves()."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn
from torch.distributed import HashStore

from rlaunch.runtime.groups import SandboxComm
from rlaunch.runtime.moves import Moves
from rlaunch.runtime.runtime import Runtime
from rlaunch.runtime.vote import RefusedError


def _runtime() -> Runtime:
    """A one-rank runtime with no agent link (as under plain torchrun)."""
    return Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def test_steps_begin_and_a_discarded_step_is_begun_again_from_its_start() -> None:
    rt = _runtime()
    model, counter = nn.BatchNorm1d(2), Counter()
    rt.track(model=model, counter=counter)
    driven = rt.drive()
    assert rt._host.every == 0, "a framework's loop cannot roll back several steps: no host snapshots"
    assert driven.begin() is False and driven.step == 0
    assert driven.begin() is False and driven.step == 1
    at_start = torch.get_rng_state()
    counter.value = 9  # what the step changed, then the vote discards it (a fault)
    model(torch.randn(4, 2))
    rt._s.resume_at = 1
    driven.redo()
    assert driven.step == 1, "the same step again"
    assert counter.value == 0 and torch.equal(model.running_mean, torch.zeros(2)), "its start is put back"
    assert torch.equal(torch.get_rng_state(), at_start), "and the random streams as the step found them"
    rt._s.resume_at = 0  # a rollback to an earlier step: the framework's loop cannot go there
    with pytest.raises(RefusedError, match="can redo only the step it is in"):
        driven.redo()


def test_ending_the_driven_steps_closes_the_runtimes_loop() -> None:
    rt = _runtime()
    rt.track(counter=Counter())
    driven = rt.drive()
    driven.begin()
    driven.end()
    with pytest.raises(StopIteration):
        driven.begin()


def test_refused_moves_name_the_reason_first_and_the_first_reason_stands() -> None:
    rt = _runtime()
    rt.track(counter=Counter())
    moves: Moves = rt._moves
    assert moves.drain_refusal() == ""
    rt.refuse_moves("rlaunch.lightning: the LBFGS optimizer evaluates its closure several times")
    rt.refuse_moves("something else")
    assert moves.drain_refusal() == "rlaunch.lightning: the LBFGS optimizer evaluates its closure several times"
    assert moves.replace_refusal() == moves.drain_refusal()
