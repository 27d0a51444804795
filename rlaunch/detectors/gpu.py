"""GPU health through NVML: critical XID events, uncorrectable ECC errors, retired pages
pending, and a GPU that fell off the bus.

:class:`NvmlHealth` reads NVML through the ``pynvml`` module of nvidia-ml-py, passed in so that
tests can hand it a fake. On a machine without a GPU (or driver) :meth:`GpuHealth.start` returns
the reason the checks are off, once. :class:`FileHealth` reads faults from a JSON file: the
fault-injection source for tests on machines without a GPU (``RLAUNCH_FAKE_NVML=<file>``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlaunch.waiting import wait_event

#: NVIDIA's XIDs that mean the GPU can no longer be trusted with training: double-bit ECC (48),
#: row remapping / page retirement failures (63, 64), NVLink (74), fell off the bus (79),
#: contained/uncontained ECC (92, 94, 95), GSP errors (119, 120).
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})

FAKE_ENV = "RLAUNCH_FAKE_NVML"


class GpuFaultKind(str, enum.Enum):
    XID = "xid"
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    FELL_OFF_BUS = "fell_off_bus"


@dataclasses.dataclass(frozen=True)
class GpuFault:
    kind: GpuFaultKind
    gpu: int
    detail: str = ""

    def sentence(self) -> str:
        what = {
            GpuFaultKind.XID: f"reported critical XID {self.detail}",
            GpuFaultKind.ECC_UNCORRECTABLE: f"has {self.detail} uncorrectable ECC error(s)",
            GpuFaultKind.RETIRED_PAGES_PENDING: "has retired memory pages pending (a reset is needed)",
            GpuFaultKind.FELL_OFF_BUS: "fell off the bus",
        }[self.kind]
        return f"GPU {self.gpu} {what}"


class GpuHealth(Protocol):
    def start(self) -> str | None:
        """Begin watching; return None, or a sentence saying why the checks are off."""

    def check(self) -> list[GpuFault]:
        """Faults seen since the last check (empty when healthy)."""


class NvmlHealth:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._handles: list[Any] = []
        self._events: Any = None

    def start(self) -> str | None:
        nvml = self._nvml
        if self._handles:
            return None  # started already (the GPU task started again): its event set keeps the XIDs queued
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return f"GPU health checks are off: NVML is not available here ({exc})."
        try:
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nvml.NVMLError as exc:  # (no permission, a GPU lost before the agent started...)
            return f"GPU health checks are off: NVML could not list this machine's GPUs ({exc})."
        if count == 0:
            return "GPU health checks are off: NVML sees no GPU on this machine."
        try:
            self._events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError:
            self._events = None  # XID events unsupported here; the other checks still run
        return None

    def check(self) -> list[GpuFault]:
        nvml = self._nvml
        faults: list[GpuFault] = []
        for index, handle in enumerate(self._handles):
            try:
                ecc = nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
                if ecc > 0:
                    faults.append(GpuFault(GpuFaultKind.ECC_UNCORRECTABLE, index, str(ecc)))
            except nvml.NVMLError_GpuIsLost:
                faults.append(GpuFault(GpuFaultKind.FELL_OFF_BUS, index))
                continue
            except nvml.NVMLError_NotSupported:
                pass
            try:
                if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                    faults.append(GpuFault(GpuFaultKind.RETIRED_PAGES_PENDING, index))
            except nvml.NVMLError_GpuIsLost:
                faults.append(GpuFault(GpuFaultKind.FELL_OFF_BUS, index))
            except nvml.NVMLError_NotSupported:
                pass
        self._xids(faults)
        return faults

    def _xids(self, faults: list[GpuFault]) -> None:
        """Add the critical XIDs NVML has queued to ``faults`` (this check's, the device checks' first)."""
        nvml = self._nvml
        while self._events is not None:
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except (nvml.NVMLError_Timeout, nvml.NVMLError_GpuIsLost):
                # No event waits, or a GPU fell off the bus (NVML answers GPU_IS_LOST to the wait): the
                # device checks before this have reported it.
                break
            except nvml.NVMLError:
                if faults:
                    break  # what this check found is reported; an error that lasts comes back at the next
                raise  # the GPU task starts again (rlaunch.agent.background); the set keeps the events queued
            xid = int(data.eventData)
            if xid in CRITICAL_XIDS:
                faults.append(GpuFault(GpuFaultKind.XID, self._index(data.device), str(xid)))

    def _index(self, device: Any) -> int:
        """The index of an event's GPU; -1 if NVML cannot say. (pynvml's handles are ctypes pointers,
        which compare equal only to themselves, never to another pointer to the same device.)"""
        try:
            return int(self._nvml.nvmlDeviceGetIndex(device))
        except self._nvml.NVMLError:
            return -1


class FileHealth:
    """Faults listed in a JSON file: ``[{"kind": "xid", "gpu": 0, "detail": "79"}, ...]``."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def start(self) -> str | None:
        return None

    def check(self) -> list[GpuFault]:
        try:
            raw = json.loads(self._path.read_text() or "[]")
        except FileNotFoundError:
            return []
        except json.JSONDecodeError:
            return []  # being written; read it at the next check
        return [GpuFault(GpuFaultKind(f["kind"]), int(f.get("gpu", 0)), str(f.get("detail", ""))) for f in raw]


def make_gpu_health(env: Mapping[str, str] = os.environ) -> GpuHealth:
    fake = env.get(FAKE_ENV)
    if fake:
        return FileHealth(Path(fake))
    import pynvml

    return NvmlHealth(pynvml)


async def watch_gpus(health: GpuHealth, stop: asyncio.Event, every_s: float) -> list[GpuFault] | str:
    """Check ``health`` every ``every_s`` until a fault (returned) or ``stop``; a string: the checks are off."""
    off = await asyncio.to_thread(health.start)
    if off is not None:
        return off
    while not stop.is_set():
        faults = await asyncio.to_thread(health.check)
        if faults:
            return faults
        await wait_event(stop, every_s)
    return []
