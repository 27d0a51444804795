"""A loop the script writes over a framework's objects: where the vote goes, and what refuses moves."""

from __future__ import annotations

import datetime

import torch
from torch.distributed import HashStore

from rlaunch.runtime.groups import SandboxComm
from rlaunch.runtime.runtime import Runtime
from rlaunch.userloop import LOOP_REFUSAL, UserLoop


def _runtime() -> Runtime:
    return Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_vote_is_cast_inside_rt_steps_and_an_optimizer_stepped_outside_refuses_moves() -> None:
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    stepped: list[int] = []
    for step in rt.steps(2):
        model(torch.ones(1, 2)).sum().backward()
        assert loop.vote(opt, None, lambda s=step: stepped.append(s)) is True
    assert stepped == [] and rt._s.refused == "", "voted and applied by the runtime"
    loop.vote(opt, None, lambda: stepped.append(9))
    assert stepped == [9], "outside rt.steps() the step is applied as the framework would"
    assert rt._s.refused.startswith("rlaunch.test: the optimizer stepped outside rt.steps()")


def test_an_accumulation_window_spanning_two_steps_refuses_moves() -> None:
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    for step in rt.steps(3):
        model(torch.ones(1, 2)).sum().backward()
        if step == 0:
            loop.micro_step()
            loop.micro_step()
            loop.vote(opt, None, opt.step)  # a window inside one step: carried
            assert rt._s.refused == ""
        elif step == 1:
            loop.micro_step()  # its optimizer step comes in the next step
        else:
            loop.vote(opt, None, opt.step)
    assert "a gradient-accumulation window spans several steps of rt.steps()" in rt._s.refused


def test_a_loop_over_the_loaders_epochs_refuses_moves_and_drives_the_steps() -> None:
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    data = loop.data(None, [torch.ones(1, 2)] * 3, lambda b: b, 3, "unused")
    seen = 0
    for batch in data:
        assert rt.in_step, "each read after a vote begins a runtime step"
        model(batch).sum().backward()
        loop.vote(opt, None, opt.step)
        seen += 1
    assert seen == 3 and rt._s.refused == f"rlaunch.test: {LOOP_REFUSAL}"
    loop.end()
