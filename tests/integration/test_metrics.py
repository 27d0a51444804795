"""Prometheus metrics, scraped over HTTP from real agents while their job is drained and faulted.

One job: a and b train (the runtime example), c is a warm standby; every agent serves
``--metrics-port``. a is drained live onto c, then b's worker is SIGKILLed and replaced in place
(no standby is left). Between the steps the test reads each agent's ``/metrics`` page with a
real HTTP client and the Prometheus text parser, and checks that the values moved as they should.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlaunch.store.embedded import free_port
from tests.cluster import Cluster, wait_for
from tests.integration.test_migration import RESILIENT, warm

pytestmark = pytest.mark.timeout(420)

# Long enough that the job is still training when the test has seen what it needs (it then stops it).
ARGS = ("--steps", "5000", "--step-time", "0.05")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("rlaunch_"), f"{family.name} lacks the rlaunch_ prefix"
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def get(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 when the series does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_follow_a_drain_and_a_killed_worker(cluster: Cluster) -> None:
    ports, agents = {}, {}
    for n in "abc":
        ports[n] = free_port()  # just before its agent binds it: one started earlier may take a port chosen earlier
        flags = ("--max-restarts", "1", "--metrics-port", str(ports[n]))
        agents[n] = cluster.agent(n, RESILIENT, *ARGS, flags=flags)
        cluster.registered(agents[n])
    a, b, c = agents["a"], agents["b"], agents["c"]
    wait_for(lambda: warm(cluster, "c"), 120, "standby c to be warm")
    wait_for(lambda: get(scrape(ports["b"]), "rlaunch_rank_steps_completed_total", node="b", rank="1") >= 20, 90,
             "b's rank 1 to report 20 steps")  # fmt: skip

    before = {n: scrape(ports[n]) for n in "abc"}
    bb = before["b"]
    assert get(bb, "rlaunch_rank_step_seconds", node="b", rank="1") >= 0.05, "a step sleeps 0.05 s at least"
    assert 0 < get(bb, "rlaunch_rank_goodput_ratio", node="b", rank="1") <= 1
    assert 0 < get(bb, "rlaunch_node_goodput_ratio", node="b") <= 1
    assert get(bb, "rlaunch_etcd_request_seconds_count") > 0, "the agent's etcd requests are timed"
    assert get(bb, "rlaunch_node_state", node="b", rlaunch_node_state="running") == 1
    assert get(before["c"], "rlaunch_node_state", node="c", rlaunch_node_state="standby") == 1
    assert sum(get(before[n], "rlaunch_controller_leading", node=n) for n in "abc") == 1, "one controller"
    assert get(bb, "rlaunch_migrations_total", node="b", role="survivor") == 0
    assert get(before["c"], "rlaunch_rank_steps_completed_total", node="c", rank="0") == 0, "a standby has no rank"

    # -- a planned migration: a's rank 0 moves to c; b survives ----------------------------------
    draining = subprocess.Popen(
        [sys.executable, "-m", "rlaunch", "drain", "a", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id",
         cluster.job_id], env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # while the drain runs: the survivor counts the migration as soon as it is offered
        wait_for(lambda: get(scrape(ports["b"]), "rlaunch_migrations_total", node="b", role="survivor") == 1, 90,
                 "b to count the migration it survives")  # fmt: skip
        out, _ = draining.communicate(timeout=120)
    finally:
        if draining.poll() is None:
            draining.kill()
            draining.wait(10)
    assert draining.returncode == 0 and "node a drained" in out, out
    assert a.wait(60) == 0, a.output()[-3000:]
    wait_for(lambda: get(scrape(ports["c"]), "rlaunch_rank_steps_completed_total", node="c", rank="0") > 0, 60,
             "c to report steps of rank 0")  # fmt: skip
    wait_for(lambda: get(scrape(ports["b"]), "rlaunch_rank_downtime_seconds_count", node="b", rank="1",
                         kind="migrate") == 1, 60, "b to report its downtime in the switch")  # fmt: skip
    after = {n: scrape(ports[n]) for n in "bc"}
    ab, ac = after["b"], after["c"]
    assert get(ab, "rlaunch_migrations_total", node="b", role="survivor") == 1
    assert get(ac, "rlaunch_migrations_total", node="c", role="joiner") == 1
    assert get(ab, "rlaunch_rank_downtime_seconds_count", node="b", rank="1", kind="migrate") == 1
    assert get(ab, "rlaunch_node_downtime_seconds_count", node="b", kind="migrate") == 1
    assert get(ab, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="migrate") >= 0
    steps_b = get(ab, "rlaunch_rank_steps_completed_total", node="b", rank="1")
    assert steps_b > get(bb, "rlaunch_rank_steps_completed_total", node="b", rank="1"), "b trained on"
    assert get(ab, "rlaunch_rank_applied_step", node="b", rank="1") > get(bb, "rlaunch_rank_applied_step",
                                                                           node="b", rank="1")  # fmt: skip
    assert 0 < get(ab, "rlaunch_rank_goodput_ratio", node="b", rank="1") <= 1
    assert get(ac, "rlaunch_node_state", node="c", rlaunch_node_state="running") == 1
    assert get(ab, "rlaunch_recoveries_total", node="b", role="survivor") == 0

    # -- a fault: b's worker is SIGKILLed; with no standby left, it is replaced in place ----------
    b.workers()[0].kill()

    def recovered() -> bool:
        sc, sb = scrape(ports["c"]), scrape(ports["b"])
        return (
            get(sc, "rlaunch_rank_downtime_seconds_count", node="c", rank="0", kind="replace") >= 1
            and get(sb, "rlaunch_rank_downtime_seconds_count", node="b", rank="1", kind="replace") >= 1
        )

    wait_for(recovered, 120, "the replacement's downtime to be observed on b and c")
    fc, fb = scrape(ports["c"]), scrape(ports["b"])
    assert get(fc, "rlaunch_recoveries_total", node="c", role="survivor") == 1
    assert get(fb, "rlaunch_recoveries_total", node="b", role="joiner") == 1
    assert get(fc, "rlaunch_rank_downtime_seconds_count", node="c", rank="0", kind="replace") == 1
    assert get(fc, "rlaunch_rank_downtime_seconds_sum", node="c", rank="0", kind="replace") > 0
    assert get(fb, "rlaunch_rank_downtime_seconds_sum", node="b", rank="1", kind="replace") > 0
    assert get(fc, "rlaunch_migrations_total", node="c", role="joiner") == 1, "no further migration"
    # b's replaced worker trains on: its steps and its rank's applied step move again
    applied = get(fb, "rlaunch_rank_applied_step", node="b", rank="1")
    wait_for(lambda: get(scrape(ports["b"]), "rlaunch_rank_applied_step", node="b", rank="1") > applied, 60,
             "b's new worker to apply steps")  # fmt: skip
    last = scrape(ports["b"])
    assert get(last, "rlaunch_rank_steps_completed_total", node="b", rank="1") > steps_b
    # its rank lost seconds to the kill (a new process, a sandbox, the state transfer): goodput fell below 1
    assert 0 < get(last, "rlaunch_rank_goodput_ratio", node="b", rank="1") < 1
    # c's window began when it took rank 0; it is credited with steps at its next heartbeats
    c_goodput = wait_for(lambda: get(scrape(ports["c"]), "rlaunch_rank_goodput_ratio", node="c", rank="0") > 0, 60,
                         "c's goodput to be known")  # fmt: skip
    assert c_goodput and get(scrape(ports["c"]), "rlaunch_rank_goodput_ratio", node="c", rank="0") <= 1
    assert b.proc.poll() is None and c.proc.poll() is None, "the job goes on"
