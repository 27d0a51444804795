"""Unplanned faults with the runtime: failed ranks are replaced live, survivors keep their processes.

Each test injects a real fault (SIGKILL of a worker, of a whole node) into a running job and
checks that the job ends with final weights and optimizer state bit-identical to an
uninterrupted run, that the survivors' workers were never restarted, and that the replaced
ranks got their state from a replica.
"""

from __future__ import annotations

import re

from tests.cluster import AgentProc, Cluster, wait_for
from tests.integration.test_migration import FINAL, RESILIENT, _reference, warm

ARGS = ("--steps", "120", "--step-time", "0.05")


def _finals(*agents: AgentProc) -> dict[int, tuple[str, str]]:
    return {int(m.group(1)): (m.group(2), m.group(3)) for a in agents for m in FINAL.finditer(a.output())}


def _starts(agent: AgentProc) -> int:
    return len(re.findall(r"event workers_started", agent.output()))


def _reference_run() -> dict[int, tuple[str, str]]:
    return _reference(2, ("--steps", "120", "--step-time", "0"))


def test_a_killed_worker_is_replaced_by_the_warm_standby_live(cluster: Cluster) -> None:
    a, b, c = cluster.agents_in_order(["a", "b", "c"], RESILIENT, *ARGS, flags=("--max-restarts", "1"))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 30/" in a.output(), 60, "training to make progress")
    survivor = a.workers()[0].pid
    b.workers()[0].kill()
    assert a.wait(180) == 0 and c.wait(180) == 0 and b.wait(60) == 0, (a.output()[-3000:], c.output()[-3000:])
    assert _finals(a, b, c) == _reference_run(), "the job must end as if uninterrupted"
    assert _starts(a) == 1 and f"pids': [{survivor}]" in a.output(), "the survivor's worker must never restart"
    assert "event recovered" in a.output() and "'sent_to': [1]" in a.output(), "rank 0 sends rank 1 its state"
    assert "event joined" in c.output() and "'plan': 'replace'" in a.output()
