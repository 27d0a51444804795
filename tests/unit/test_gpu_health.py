"""GPU health detection against a fake pynvml module (the NVML boundary), and the file source."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Any

import pytest

from rlaunch.detectors.gpu import CRITICAL_XIDS, FileHealth, GpuFaultKind, NvmlHealth, make_gpu_health, watch_gpus


class Handle:
    """A device handle as pynvml's: ``c_nvmlDevice_t = POINTER(struct_c_nvmlDevice_t)`` (nvidia-ml-py's
    pynvml.py), and an event's ``c_nvmlEventData_t.device`` is a new such pointer. ctypes pointers are
    equal only to themselves, so an event's device never equals the handle listed for the same GPU;
    ``nvmlDeviceGetIndex(handle)`` says which GPU it is."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml(types.SimpleNamespace):
    """The pynvml calls NvmlHealth makes, over a hand-built GPU state.

    ``nvmlEventSetWait`` answers as NVML's API reference says it returns: ``NVML_ERROR_TIMEOUT`` if no
    event arrived in the time given, ``NVML_ERROR_GPU_IS_LOST`` if a GPU has fallen off the bus or is
    otherwise inaccessible, ``NVML_ERROR_UNKNOWN`` on any unexpected error (pynvml raises each as its
    ``NVMLError`` subclass); a lost GPU's device queries raise ``NVMLError_GpuIsLost`` likewise."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's names
        pass

    class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: int = 2, present: bool = True) -> None:
        super().__init__()
        self.present = present
        self.ecc = [0] * gpus
        self.pending = [0] * gpus
        self.lost: set[int] = set()
        self.xids: list[tuple[int, int]] = []  # (gpu, xid)
        self.gpus = gpus
        self.unlisted = False  # the GPUs cannot be listed
        self.event_error: Exception | None = None  # what waiting for an event raises, if anything,
        self.good_waits = 0  # after this many waits that return an event
        self.event_sets = 0

    def nvmlInit(self) -> None:  # noqa: N802
        if not self.present:
            raise self.NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        if self.unlisted:
            raise self.NVMLError("Insufficient Permissions")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Handle:  # noqa: N802
        return Handle(i)

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:  # noqa: N802
        return handle.index

    def nvmlEventSetCreate(self) -> str:  # noqa: N802
        self.event_sets += 1
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: Handle, kinds: int, events: str) -> None:  # noqa: N802
        assert kinds == self.nvmlEventTypeXidCriticalError

    def _index(self, handle: Handle) -> int:
        if handle.index in self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return handle.index

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, kind: int, counter: int) -> int:  # noqa: N802
        return self.ecc[self._index(handle)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Handle) -> int:  # noqa: N802
        return self.pending[self._index(handle)]

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> Any:  # noqa: N802
        if self.event_error is not None and self.good_waits == 0:
            raise self.event_error
        if not self.xids:
            raise self.NVMLError_Timeout("timeout")
        self.good_waits -= 1
        gpu, xid = self.xids.pop(0)
        return types.SimpleNamespace(eventData=xid, device=Handle(gpu))  # a new pointer, as pynvml's


def started(nvml: FakeNvml) -> NvmlHealth:
    health = NvmlHealth(nvml)
    assert health.start() is None
    return health


def test_no_gpu_turns_the_checks_off_with_a_reason() -> None:
    reason = NvmlHealth(FakeNvml(present=False)).start()
    assert reason is not None and "GPU health checks are off" in reason and "Library Not Found" in reason
    assert "no GPU" in (NvmlHealth(FakeNvml(gpus=0)).start() or "")


def test_gpus_nvml_cannot_list_turn_the_checks_off_with_a_reason() -> None:
    """Before, the error ended the agent's GPU task (and so, now, would start it again and again)."""
    nvml = FakeNvml()
    nvml.unlisted = True
    reason = NvmlHealth(nvml).start()
    assert reason == "GPU health checks are off: NVML could not list this machine's GPUs (Insufficient Permissions)."


def test_a_gpu_lost_while_waiting_for_events_keeps_the_faults_the_device_checks_found() -> None:
    """NVML's event wait answers GPU_IS_LOST when a GPU fell off the bus; that error used to throw away the
    fault the device checks had just found (and end the GPU task)."""
    nvml = FakeNvml(gpus=2)
    health = started(nvml)
    nvml.lost.add(1)
    nvml.event_error = nvml.NVMLError_GpuIsLost("GPU is lost")
    assert [(f.kind, f.gpu) for f in health.check()] == [(GpuFaultKind.FELL_OFF_BUS, 1)]


def test_another_error_of_the_event_wait_keeps_what_this_check_found_before_it() -> None:
    """The XIDs already taken off NVML's queue, and the device checks' faults, are reported; the error
    is raised only where nothing was found (next test)."""
    nvml = FakeNvml(gpus=2)
    health = started(nvml)
    nvml.xids += [(1, 79), (1, 48)]
    nvml.event_error, nvml.good_waits = nvml.NVMLError("Unknown Error"), 1
    assert [(f.kind, f.gpu, f.detail) for f in health.check()] == [(GpuFaultKind.XID, 1, "79")]
    nvml.ecc[0] = 3
    assert [(f.kind, f.gpu) for f in health.check()] == [(GpuFaultKind.ECC_UNCORRECTABLE, 0)]


def test_another_error_of_the_event_wait_is_raised_and_a_second_start_keeps_the_queued_events() -> None:
    """The GPU task then starts again (rlaunch.agent.background), and its second start keeps the event
    set NVML queued the XIDs in: a new one would lose them."""
    nvml = FakeNvml(gpus=1)
    health = started(nvml)
    nvml.xids.append((0, 79))
    nvml.event_error = nvml.NVMLError("Unknown Error")
    with pytest.raises(nvml.NVMLError, match="Unknown Error"):
        health.check()
    nvml.event_error = None
    assert health.start() is None and nvml.event_sets == 1
    assert [(f.kind, f.gpu, f.detail) for f in health.check()] == [(GpuFaultKind.XID, 0, "79")]


def test_healthy_gpus_report_nothing() -> None:
    assert started(FakeNvml()).check() == []


def test_each_fault_kind_is_detected_on_its_gpu() -> None:
    nvml = FakeNvml(gpus=3)
    health = started(nvml)
    nvml.ecc[1] = 2
    nvml.pending[2] = 1
    nvml.lost.add(0)
    nvml.xids += [(2, 79), (1, 13)]  # 13 (a graphics engine exception) is not critical
    faults = {(f.kind, f.gpu, f.detail) for f in health.check()}
    assert faults == {
        (GpuFaultKind.FELL_OFF_BUS, 0, ""),
        (GpuFaultKind.ECC_UNCORRECTABLE, 1, "2"),
        (GpuFaultKind.RETIRED_PAGES_PENDING, 2, ""),
        (GpuFaultKind.XID, 2, "79"),
    }
    assert health.check() == [f for f in health.check() if f.kind is not GpuFaultKind.XID]  # XIDs are events


@pytest.mark.parametrize("xid", sorted(CRITICAL_XIDS))
def test_every_critical_xid_is_a_fault(xid: int) -> None:
    nvml = FakeNvml(gpus=1)
    health = started(nvml)
    nvml.xids.append((0, xid))
    (fault,) = health.check()
    assert fault.kind is GpuFaultKind.XID and f"critical XID {xid}" in fault.sentence()


def test_file_source_injects_faults(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    health = make_gpu_health({"RLAUNCH_FAKE_NVML": str(path)})
    assert isinstance(health, FileHealth) and health.start() is None
    assert health.check() == []
    path.write_text(json.dumps([{"kind": "fell_off_bus", "gpu": 3}]))
    (fault,) = health.check()
    assert fault.sentence() == "GPU 3 fell off the bus"


def test_watch_returns_the_first_faults_or_the_off_reason(tmp_path: Path) -> None:
    async def go() -> None:
        stop = asyncio.Event()
        assert "off" in str(await watch_gpus(NvmlHealth(FakeNvml(present=False)), stop, 0.01))
        nvml = FakeNvml(gpus=1)
        health = NvmlHealth(nvml)
        task = asyncio.ensure_future(watch_gpus(health, stop, 0.01))
        await asyncio.sleep(0.05)
        assert not task.done()
        nvml.ecc[0] = 1
        faults = await asyncio.wait_for(task, 2)
        assert isinstance(faults, list) and faults[0].kind is GpuFaultKind.ECC_UNCORRECTABLE

    asyncio.run(go())
