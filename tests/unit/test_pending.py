"""Optimizer state still landing: reads wait for it however the script reaches the optimizer."""

from __future__ import annotations

import copy
import io

import torch

from rlaunch.runtime import pending


def _adam() -> torch.optim.Adam:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    return opt


def _hold(optimizers: list[torch.optim.Optimizer]) -> tuple[pending.Held, list[int]]:
    lands: list[int] = []

    def land() -> None:
        lands.append(1)
        held.release()

    held = pending.hold(optimizers, land)
    return held, lands


def test_an_optimizer_tracked_under_two_names_is_held_once_and_its_state_reads() -> None:
    opt = _adam()
    _, lands = _hold([opt, opt])
    assert type(opt) is not torch.optim.Adam
    assert len(opt.state) == 1  # recursed forever when it was held twice: its class stayed guarded
    assert type(opt) is torch.optim.Adam and lands == [1]


def test_a_copy_or_a_save_made_while_held_waits_for_the_landing_and_is_of_the_original_class() -> None:
    opt = _adam()
    _, lands = _hold([opt])
    twin = copy.deepcopy(opt)
    assert lands == [1] and type(twin) is torch.optim.Adam and type(opt) is torch.optim.Adam
    assert str(twin.state_dict()) == str(opt.state_dict())
    other = _adam()
    _, lands = _hold([other])
    buf = io.BytesIO()
    torch.save(other, buf)  # a PicklingError when the guarded class went to pickle
    assert lands == [1] and type(other) is torch.optim.Adam and buf.tell() > 0


def test_setting_the_state_while_held_lands_first_and_keeps_the_value() -> None:
    opt = _adam()
    _, lands = _hold([opt])
    fresh: dict = {}
    opt.state = fresh  # type: ignore[assignment]
    assert lands == [1] and opt.state is fresh and type(opt) is torch.optim.Adam


class _BrokenLanding:
    """A landing whose sender went away with the optimizer state on the wire."""

    landed_at = 0.0

    def finish(self) -> None:
        raise RuntimeError("Connection closed by peer")


def test_a_landing_that_failed_once_fails_every_later_read_and_vote() -> None:
    """A script that catches the first failure (a retry loop, a logging hook) must not train on the
    partial state: the next read, and the next vote, fail too."""
    import datetime

    import pytest
    from torch.distributed import HashStore

    from rlaunch.errors import RlaunchError, TransferBrokenError
    from rlaunch.runtime.groups import SandboxComm
    from rlaunch.runtime.phases import MovePhases
    from rlaunch.runtime.runtime import Runtime

    rt = Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    opt = _adam()
    rt._s.after_move = MovePhases(generation=2, role="joiner")
    joining = rt._joining
    joining._held = (_BrokenLanding(), SandboxComm(0, 1), pending.hold([opt], joining.land))  # type: ignore[assignment]
    with pytest.raises(TransferBrokenError):
        opt.state_dict()
    with pytest.raises(RlaunchError, match="did not land whole"):
        opt.state_dict()  # still partial: a checkpoint of it would be garbage
    with pytest.raises(RlaunchError, match="did not land whole"):
        rt.optimizer_step(opt)


def test_a_read_that_interrupts_its_own_landing_fails_with_a_sentence_instead_of_waiting_forever() -> None:
    """A signal handler that saves a checkpoint runs on the thread that is landing the state: waiting
    for the landing there would wait for itself."""
    import datetime

    import pytest
    from torch.distributed import HashStore

    from rlaunch.errors import RlaunchError
    from rlaunch.runtime.groups import SandboxComm
    from rlaunch.runtime.phases import MovePhases
    from rlaunch.runtime.runtime import Runtime

    rt = Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    opt = _adam()

    class _Interrupted:
        """A landing during which the same thread reads the optimizer state (as a signal handler would)."""

        landed_at = 0.0

        def finish(self) -> None:
            opt.state_dict()

    rt._s.after_move = MovePhases(generation=2, role="joiner")
    joining = rt._joining
    joining._held = (_Interrupted(), SandboxComm(0, 1), pending.hold([opt], joining.land))  # type: ignore[assignment]
    with pytest.raises(RlaunchError, match="interrupted its own landing"):
        opt.state_dict()
    assert not joining._lock.locked() and joining._owner is None, "the landing let go of its lock"
    with pytest.raises(RlaunchError, match="did not land whole"):
        opt.state_dict()  # the state never landed: every later read says so
