"""Unplanned faults with the runtime: failed ranks are replaced live, survivors keep their processes.

Each test injects a real fault (SIGKILL of a worker, of a whole node) into a running job and
checks that the job ends with final weights and optimizer state bit-identical to an
uninterrupted run, that the survivors' workers were never restarted, and that the replaced
ranks got their state from a replica.
"""

from __future__ import annotations

import re

from psutil import Process as psutil_process

from tests.cluster import SCRIPTS, AgentProc, Cluster, wait_for
from tests.integration.test_migration import FINAL, RESILIENT, _reference, warm

ARGS = ("--steps", "200", "--step-time", "0.05")  # >= 10 s: the standby is warm before the job ends


def _finals(*agents: AgentProc) -> dict[int, tuple[str, str]]:
    return {int(m.group(1)): (m.group(2), m.group(3)) for a in agents for m in FINAL.finditer(a.output())}


def _starts(agent: AgentProc) -> int:
    return len(re.findall(r"event workers_started", agent.output()))


def _reference_run() -> dict[int, tuple[str, str]]:
    return _reference(2, ("--steps", "200"))


def test_a_killed_worker_is_replaced_by_the_warm_standby_live(cluster: Cluster) -> None:
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *ARGS, flags=("--max-restarts", "1"))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 30/" in a.output(), 60, "training to make progress")
    survivor = a.workers()[0].pid
    b.workers()[0].kill()
    assert a.wait(180) == 0 and c.wait(180) == 0 and b.wait(60) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert _finals(a, b, c) == _reference_run(), "the job must end as if uninterrupted"
    assert _starts(a) == 1 and f"pids': [{survivor}]" in a.output(), "the survivor's worker must never restart"
    assert "event recovered" in a.output() and "'sends_to': [1]" in a.output(), "rank 0 sends rank 1 its state"
    assert "event joined" in c.output() and "'plan': 'replace'" in a.output()


def test_without_a_standby_the_failed_workers_restart_in_place(cluster: Cluster) -> None:
    a, b = cluster.agents_in_order(["a", "b"], RESILIENT, *ARGS, flags=("--max-restarts", "1"))
    wait_for(lambda: "step 30/" in a.output(), 90, "training to make progress")
    b.workers()[0].kill()
    assert a.wait(180) == 0 and b.wait(180) == 0, (a.output()[-3000:], b.output()[-3000:])
    assert _finals(a, b) == _reference_run(), "the job must end as if uninterrupted"
    assert _starts(a) == 1 and "b (workers failed) restarted in place" in a.output()
    assert "event sandbox_started" in b.output() and "event joined" in b.output()


def test_a_frozen_node_is_abandoned_by_the_survivors_and_fenced_when_it_wakes(cluster: Cluster) -> None:
    """SIGSTOP of a whole node: gloo would wait for its timeout; the survivors drop the step instead."""
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *ARGS)
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 30/" in a.output(), 60, "training to make progress")
    frozen = [psutil_process(b.pid), *b.workers()]
    for p in frozen:
        p.suspend()
    wait_for(lambda: "event joined" in c.output(), 60, "the standby to take the frozen node's rank")
    for p in frozen:
        p.resume()
    assert b.wait(60) == 1 and "lease" in b.output(), b.output()[-2000:]
    assert a.wait(180) == 0 and c.wait(180) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert _finals(a, c) == _reference_run(), "the job must end as if uninterrupted"
    assert _starts(a) == 1 and "rank 1 final" not in b.output(), "the frozen node never trained on"


def test_a_lost_node_with_no_standby_falls_back_to_a_full_restart(cluster: Cluster) -> None:
    flags = ("--standby-wait", "2")
    a, b = cluster.agents_in_order(["a", "b"], RESILIENT, *ARGS, flags=flags)
    wait_for(lambda: "step 30/" in a.output(), 90, "training to make progress")
    b.kill_with_workers()
    wait_for(lambda: "no standby is ready" in a.output(), 60, "the survivors to wait for a standby")
    wait_for(lambda: "waiting for a node to take node rank" in a.output(), 60, "the fallback to a restart")
    d = cluster.agent("d", RESILIENT, *ARGS, flags=flags)
    assert a.wait(180) == 0 and d.wait(180) == 0, (a.output()[-3000:], d.output()[-3000:])
    assert _finals(a, d) == _reference_run(), "a restart from step 0 ends bit-identical too"
    assert _starts(a) == 2, "the survivor's workers were restarted"


def test_a_hung_worker_is_killed_by_its_agent_and_replaced_while_its_peer_waits(cluster: Cluster) -> None:
    """SIGSTOP of one worker: its agent sees no heartbeat; the peer blocked on it is not blamed."""
    flags = ("--hang-timeout", "5", "--max-restarts", "1")
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *ARGS, flags=flags)
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 30/" in a.output(), 60, "training to make progress")
    b.workers()[0].suspend()
    assert a.wait(180) == 0 and c.wait(180) == 0 and b.wait(60) == 0, (a.output()[-3000:], b.output()[-3000:])
    assert _finals(a, c) == _reference_run(), "the job must end as if uninterrupted"
    assert "event worker_hung" in b.output() and "sent no heartbeat" in b.output()
    assert "worker_hung" not in a.output() and _starts(a) == 1, "the survivor waited on its peer; it is not hung"


def test_a_collective_after_the_loop_fails_as_under_torchrun_when_a_peer_died(cluster: Cluster) -> None:
    """After ``rt.steps()`` no vote is left to redo a collective a fault hit: rank 0's final sum with a
    rank that died must fail the worker (and the job, without restarts), not print its own value."""
    a, b = cluster.agents_in_order(["a", "b"], SCRIPTS / "after_loop.py", flags=("--max-restarts", "0"))
    assert a.wait(120) != 0, a.output()[-3000:]
    b.wait(60)
    out = a.output()
    assert "rank 1 dies after the loop" in b.output()
    assert "final metric summed over the ranks" not in out, "rank 0 went on with its own value as the sum"
    assert any(s in out for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")), out[-3000:]
