"""Before a step's vote, a rank with NCCL groups waits for its GPU and reads what torch's watchdog
recorded on each communicator: an error there sends the step to recovery instead of its vote, and
a failed wait stops it before it is applied."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from rlaunch.runtime import backend as backends
from rlaunch.runtime import devicework
from rlaunch.runtime.backend import Backend
from rlaunch.runtime.groups import SwitchableGroup
from tests.unit.test_backend import TIMEOUT, FakeNccl


def _group(label: str) -> SwitchableGroup:
    comm = backends.build(HashStore(), f"g1/{label}/", 0, 1, TIMEOUT, Backend.NCCL)
    return SwitchableGroup(label, [0], 0, comm, 1, guarded=True, backend=Backend.NCCL)


def test_a_clean_step_waits_for_the_gpu_and_finds_nothing(fake: FakeNccl) -> None:
    synced: list[bool] = []
    found = devicework.finish([_group("world")], sync=lambda: synced.append(True))
    assert synced == [True] and found == devicework.Found()


def test_an_error_the_watchdog_recorded_is_found_after_the_wait(fake: FakeNccl) -> None:
    """A peer spent minutes saving a checkpoint (or died): the watchdog timed the next allreduce
    out and aborted it, every future had long completed, and every rank would vote healthy."""
    world, tp = _group("world"), _group("tp")
    fake.errors["g1.tp"] = "TIMEOUT"
    found = devicework.finish([world, tp], sync=lambda: None)
    assert found.wait == "" and found.errors == ((tp, "TIMEOUT"),)
    assert found.describe() == "group 'tp' recorded TIMEOUT"


def test_a_failed_wait_for_the_gpu_is_a_sentence_that_stops_the_step(fake: FakeNccl) -> None:
    def sync() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    found = devicework.finish([_group("world")], sync=sync)
    assert found.wait == "CUDA error: an illegal memory access was encountered"
    error = str(devicework.refusal(3, 41, found.wait))
    assert error.startswith("rank 3: waiting for the GPU work of step 41 failed (CUDA error: an illegal memory")
    assert "the step is not applied" in error and "the job takes the restart path" in error


def test_without_nccl_groups_the_gloo_path_needs_no_wait() -> None:
    def sync() -> None:
        raise AssertionError("gloo's operations end on the host: no GPU to wait for")

    assert devicework.finish([], sync=sync) == devicework.Found()


class _AbortedComm:
    """A communicator torch's watchdog aborted: issuing on it raises (``getNcclComm``)."""

    def allreduce(self, tensors: Any, *args: Any) -> Any:
        raise RuntimeError("NCCL communicator was aborted on rank 0.\ndetails")


def test_a_collective_issued_on_a_communicator_the_watchdog_aborted_fails_the_step_not_the_script(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-backward, the watchdog aborted the communicator (it recorded COMM_ERROR): the next
    bucket's allreduce raises when issued. The group fails as a failed collective does (the
    caller gets its inputs back, the step goes to recovery) instead of backward() raising."""
    comm = _AbortedComm()
    monkeypatch.setattr(backends.current(), "error", lambda c: "COMM_ERROR" if c is comm else "")
    group = SwitchableGroup("world", [0], 0, comm, 1, guarded=True, backend=Backend.NCCL)
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert group.failed.startswith("its NCCL communicator recorded COMM_ERROR (NCCL communicator was aborted")
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_an_error_at_issue_that_torch_did_not_record_is_the_callers(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = _AbortedComm()
    monkeypatch.setattr(backends.current(), "error", lambda c: "")
    group = SwitchableGroup("world", [0], 0, comm, 1, guarded=True, backend=Backend.NCCL)
    with pytest.raises(RuntimeError, match="NCCL communicator was aborted"):
        group.allreduce([torch.ones(3)])
    assert not group.failed
