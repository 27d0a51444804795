"""The reap race: reaping orphans must never reap a worker, so a crash is never recorded as a success.

``Popen.poll()`` on a pid that someone else has already waited for gets ECHILD and reports exit
code 0. The agent reaps zombie children (descendants reparented to it) on its event loop while
its workers are polled there and stopped on another thread; these tests force the interleaving
(a worker is a zombie when orphans are reaped) and stress it (reaping in a tight loop while
workers crash), with real processes, and end with a real agent whose worker crashes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from rlaunch.agent.config import Std
from rlaunch.agent.logs import LogPolicy
from rlaunch.agent.workers import WorkerGroup, reap_orphans
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(180)


def group(cmd: list[str], n: int) -> WorkerGroup:
    policy = LogPolicy(
        node_id="reap", redirects=dict.fromkeys(range(n), Std.NONE), tee=dict.fromkeys(range(n), Std.NONE),
        local_ranks_filter=None, attempt_dir=None,
    )  # fmt: skip
    env = {**os.environ}
    return WorkerGroup(cmd, [env] * n, list(range(n)), policy)


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_crashed_worker_that_is_a_zombie_when_orphans_are_reaped_keeps_its_exit_code() -> None:
    g = group(["/bin/sh", "-c", "exit 3"], 4)
    g.start()
    for pid in g.pids:
        wait_for(lambda p=pid: zombie(p), 30, f"worker {pid} to exit")
    assert reap_orphans() == []
    assert g.poll() == [3, 3, 3, 3]
    g.stop(1.0)


def test_a_sigkilled_worker_is_reported_as_killed_after_orphans_are_reaped() -> None:
    g = group(["/bin/sh", "-c", "exec sleep 60"], 2)
    g.start()
    for pid in g.pids:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda p=pid: zombie(p), 30, f"worker {pid} to die")
    assert reap_orphans() == []
    assert g.poll() == [-signal.SIGKILL, -signal.SIGKILL]
    g.stop(1.0)


def test_orphans_of_a_worker_are_still_reaped() -> None:
    """The fix must not stop reaping what it is for: a worker's child that outlives it."""
    g = group(["/bin/sh", "-c", "sleep 0.2 & exit 0"], 1)
    g.start()
    assert g.procs[0].wait(30) == 0
    me = psutil.Process()
    orphans = wait_for(lambda: [c for c in me.children() if "sleep 0.2" in _name(c)], 30, "the orphan to be ours")
    reaped: list[int] = []
    wait_for(lambda: reaped.extend(reap_orphans()) or orphans[0].pid in reaped, 30, "the orphan to be reaped")
    assert not zombie(orphans[0].pid)
    g.stop(1.0)


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.NoSuchProcess:
        return ""


def test_crashes_are_never_recorded_as_successes_while_orphans_are_reaped_in_a_tight_loop() -> None:
    """The agent's shape: spawn, poll and reap on one thread, stop (wait) on another, many times."""
    rounds = 40
    bad: list[str] = []
    for i in range(rounds):
        # Half the rounds crash with exit 3, half are SIGKILLed (by the shell itself).
        script = "exit 3" if i % 2 == 0 else "kill -9 $$"
        expected = 3 if i % 2 == 0 else -signal.SIGKILL
        g = group(["/bin/sh", "-c", script], 3)
        g.start()
        stopped: list[list[int | None]] = []
        # Local rank 0 is collected by a stop() on another thread, as the agent does.
        waiter = threading.Thread(target=lambda g=g, out=stopped: out.append([g.procs[0].wait()]))
        waiter.start()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            reap_orphans()
            codes = g.poll()
            if all(c is not None for c in codes):
                break
        waiter.join(30)
        codes = g.poll()
        if codes != [expected] * 3 or stopped != [[expected]]:
            bad.append(f"round {i}: poll {codes}, other thread {stopped}")
        g.stop(1.0)
    assert not bad, "crashes recorded wrongly:\n" + "\n".join(bad)


def test_an_agent_whose_worker_crashes_exits_with_failure(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import os, signal, time\ntime.sleep(0.5)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    agent = cluster.agent("a", script, nnodes=1, flags=("--max-restarts", "0"))
    code = agent.wait(90)
    out = agent.output()
    assert code != 0, out[-3000:]
    assert "-9" in out, out[-3000:]
