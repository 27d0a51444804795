"""TorchNccl over a fake ``ProcessGroupNCCL`` that behaves as torch 2.13's (``tests/fake_nccl.py``):
when a communicator is ready, which mode it is built in, what torch is told about it, and how
errors and the GPU's completion are read."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch._C._distributed_c10d import ErrorType
from torch.distributed import HashStore

from rlaunch.runtime.nccl import NcclSetupError, TorchNccl
from tests.fake_nccl import FakeCuda, FakeProcessGroupNCCL

GPU = torch.device("cuda", 3)  # not device 0: a new thread starts on device 0
TIMEOUT = datetime.timedelta(seconds=20)


def _api(version: tuple[int, ...] = (2, 21, 5), env: dict[str, str] | None = None) -> tuple[TorchNccl, FakeCuda]:
    cuda = FakeCuda()
    FakeProcessGroupNCCL.reset(cuda)
    return TorchNccl(FakeProcessGroupNCCL, version=version, cuda=cuda, env=env or {}), cuda


def _create(api: TorchNccl, blocking: bool = False) -> FakeProcessGroupNCCL:
    comm: FakeProcessGroupNCCL = api.create(
        HashStore(), 1, 2, name="g2.world", device=GPU, timeout=TIMEOUT, blocking=blocking, ranks=[4, 5]
    )
    return comm


def _eventually(check: Callable[[], bool]) -> bool:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return False


def test_a_non_blocking_communicator_is_ready_once_nccl_ends_its_setup_though_torch_marks_it_lazily() -> None:
    api, _ = _api()
    comm = _create(api)
    assert comm.options.config.blocking == 0 and comm.eager
    assert not api.ready(comm) and not comm._is_initialized()  # NCCL still in progress
    comm.finish_setup()
    # torch's flag turns only when something asks for the ncclComm_t (on the communicator's GPU)
    assert _eventually(lambda: api.ready(comm)), "a non-blocking communicator must become ready"
    assert comm._is_initialized()


def test_torch_is_told_the_members_global_ranks() -> None:
    api, _ = _api()
    comm = _create(api)
    assert comm.options.global_ranks_in_group == [4, 5] and comm.options.group_name == "g2.world"
    comm.finish_setup()


@pytest.mark.parametrize(
    ("version", "env"),
    [((2, 26, 2), {}), ((2, 21, 5), {"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"})],
    ids=["nccl-2.26", "user-said-blocking"],
)
def test_where_non_blocking_mode_hangs_or_is_turned_off_communicators_are_built_blocking(
    version: tuple[int, ...], env: dict[str, str]
) -> None:
    api, _ = _api(version, env)
    got: list[FakeProcessGroupNCCL] = []
    maker = threading.Thread(target=lambda: got.append(_create(api)), name="rlaunch-prepare", daemon=True)
    maker.start()
    assert _eventually(lambda: bool(FakeProcessGroupNCCL.made))
    comm = FakeProcessGroupNCCL.made[0]
    assert comm.options.config.blocking == 1
    maker.join(0.2)
    assert maker.is_alive(), "a blocking build returns only once NCCL is done"
    comm.finish_setup()
    maker.join(10)
    assert got == [comm] and api.ready(comm)


def test_an_abort_during_the_setup_never_blocks_and_is_made_once_torch_lets_go() -> None:
    """Torch holds the communicator's lock while its setup waits for a peer that never comes: an
    abort asked for then (the plan was abandoned) returns at once and is made by the setup thread
    when the wait ends (here: TORCH_NCCL_NONBLOCKING_TIMEOUT); the setup is never ready, and says why."""
    api, _ = _api()
    comm = _create(api)
    assert _eventually(comm.waiting.is_set)
    aborting = threading.Thread(target=api.abort, args=(comm,), daemon=True)
    aborting.start()
    aborting.join(5)
    assert not aborting.is_alive(), "the abort must not wait for the setup"
    assert not comm.aborted and not api.ready(comm)
    comm.finish_setup(error="ncclInProgress past TORCH_NCCL_NONBLOCKING_TIMEOUT")
    assert _eventually(lambda: comm.aborted)
    with pytest.raises(NcclSetupError, match=r"The NCCL communicator g2\.world failed its setup: NCCL error in"):
        api.ready(comm)


def test_an_abort_after_the_setup_is_made_at_once() -> None:
    api, _ = _api()
    comm = _create(api)
    comm.finish_setup()
    assert _eventually(lambda: api.ready(comm))
    api.abort(comm)
    assert comm.aborted


def test_the_watchdogs_error_is_read_from_the_backend() -> None:
    api, _ = _api()
    comm = _create(api)
    comm.finish_setup()
    assert api.error(comm) == ""
    comm.watchdog_found(ErrorType.COMM_ERROR)
    assert api.error(comm) == "COMM_ERROR"


def test_synchronize_waits_for_the_gpu_of_the_communicators_device() -> None:
    api, cuda = _api()
    comm = _create(api)
    comm.finish_setup()
    assert _eventually(lambda: api.ready(comm))
    with cuda.device(GPU):
        work = comm.send(0)
    assert work.wait() and not work.is_completed(), "NCCL work is done for the host when queued, not on the GPU"
    assert comm.p2p_comms == [], "after eager init, point to point reuses the group's communicator"
    api.synchronize(comm)
    assert cuda.synchronized == [GPU] and work.is_completed()
