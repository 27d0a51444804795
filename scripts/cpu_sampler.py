"""Who used the CPU while an event ran: every process the benchmark started, sampled on a thread.

Each sample reads the user and system CPU seconds of the benchmark's descendants (psutil), each
named by its role: ``etcd`` (the server and its janitor), ``cli`` (an ``rlaunch`` command),
``agent:<node>`` and ``worker:<node>`` (a worker is named by its agent's ``--node-id``).
:meth:`CpuSampler.spent` charges a window of wall time to each name: the CPU seconds between the
last sample at or before its start and the first at or after its end, so a window is widened to
the samples around it (``interval``, 0.1 s by default; a sample of some twenty processes costs a
few milliseconds of CPU). A process that ends is charged up to its last reading.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

import psutil


def _node_of(cmdline: list[str]) -> str:
    return cmdline[cmdline.index("--node-id") + 1] if "--node-id" in cmdline[:-1] else "?"


def role_of(proc: Any, cmdline: list[str], parent: list[str]) -> str:
    """The name a process is charged under (see the module docstring)."""
    text = " ".join(cmdline)
    if "etcd" in text and ("etcdbin" in text or "janitor" in text):
        return "etcd"
    if "-m rlaunch" in text or "rlaunch/__main__" in text:
        return "cli" if "--node-id" not in cmdline else f"agent:{_node_of(cmdline)}"
    return f"worker:{_node_of(parent)}"


class CpuSampler:
    """Samples the benchmark's descendants every ``interval`` seconds between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.times: list[float] = []
        self.samples: list[dict[int, tuple[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._roles: dict[int, str] = {}

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        sample: dict[int, tuple[str, float]] = {}
        while not self._stop.is_set():
            sample = dict(sample)  # a process that ended keeps its last reading
            for proc in me.children(recursive=True):
                try:
                    if proc.pid not in self._roles:
                        parent = proc.parent()
                        self._roles[proc.pid] = role_of(proc, proc.cmdline(), parent.cmdline() if parent else [])
                    cpu = proc.cpu_times()
                    sample[proc.pid] = (self._roles[proc.pid], cpu.user + cpu.system)
                except psutil.Error:
                    continue  # it ended meanwhile: what it spent since its last reading is not charged
            self.times.append(time.time())
            self.samples.append(sample)
            self._stop.wait(self.interval)

    def spent(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per role between the samples around [start, end] (empty if none cover it)."""
        i = bisect.bisect_right(self.times, start) - 1
        j = bisect.bisect_left(self.times, end)
        if i < 0 or j >= len(self.times) or i >= j:
            return {}
        first, last = self.samples[i], self.samples[j]
        out: dict[str, float] = {}
        for pid, (role, cpu) in last.items():
            before = first[pid][1] if pid in first else 0.0  # started within the window: all of it counts
            out[role] = round(out.get(role, 0.0) + cpu - before, 4)
        out["wall_s"] = round(self.times[j] - self.times[i], 4)
        return out
