"""Several hosts for real: agents and a 3-member etcd in network namespaces (tests/netns.py).

Three jobs, each exercising several things at once to keep the suite short:

1. IPv4 with faults. Node a's host has two interfaces, its default route on a network that reaches
   no peer: it advertises the address of its route to etcd, and gloo binds that address, not the
   one its host name resolves to (loopback here). Standby d's host reaches etcd over a management
   network that only it and the etcd hosts share, so the route to etcd picks an address no peer
   can reach: d is given its data network's address (``--local-addr``) and takes a rank live over
   it. Node b is cut from etcd alone (its peers still reach it) for a while shorter than its
   lease: it trains on, and nobody replaces or fences it. Then b is cut from etcd alone again, past
   its lease: it trains on until etcd expires the lease, the standby c takes its rank live, and
   when the cut heals b hears that its lease is gone and is fenced. Then c's link goes down: its
   lease expires, d takes its rank live, and when the link comes back c is fenced.
2. IPv6 only (the hosts have no IPv4 address but loopback): join, train, a live drain, and a live
   replacement of a SIGKILLed node, bit-identical to an uninterrupted run.
3. Cuts between hosts that all still reach etcd (nobody's lease expires; every collective just
   waits): node b cut from its peers and the standbys is taken out by the agents' probe reports,
   replaced live and fenced; then a drop in one direction alone (c's packets to a are lost) is
   taken as a cut pair, and the pair's higher node rank (c) is replaced live and fenced.

In the jobs whose old holder outlives its replacement (1 and 3), "no two live holders of one rank":
the old holder's last applied step (its agent's progress samples, one a second) is never past the
step at which the survivors resumed with its replacement. (In 2 the leaver hands its ranks over
itself, and the lost node is SIGKILLed with its workers.)
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import AgentProc, Cluster, kill_leftovers, reap_zombies, wait_for
from tests.etcd_cluster import EtcdCluster
from tests.integration.test_migration import RESILIENT, _reference, assert_identical, finals, warm
from tests.netns import Hosts

STEPS = 400
ARGS = ("--step-time", "0.1", "--log-every", "5")
#: long enough that a cut from etcd of a few seconds ends well inside it (a renewal that finds no
#: member tries each of the three in turn, one second each)
TTL = 15
#: the least a lease can have left when its node is cut from etcd: it was renewed every TTL/3
LEASE_LEFT = TTL * 2 / 3 - 1
#: each node's last applied step sampled every second (the default, 30 s, could miss an old
#: holder's steps past its replacement's switch)
SAMPLED = {"RLAUNCH_PROGRESS_S": "1", "RLAUNCH_PROGRESS_BATCH": "1"}


class Job:
    """Hosts, etcd on the first three, and a job whose agents run on the others."""

    def __init__(self, tmp: Path, hosts: Hosts, family: int) -> None:
        self.hosts, self.family = hosts, family
        self.tag = uuid.uuid4().hex
        self.steps = STEPS
        places = [(h.addr(family), hosts.argv(h, [])) for h in hosts.hosts[:3]]
        self.etcd = EtcdCluster(tmp, self.tag, places=places)
        self.cluster = Cluster(self.etcd.endpoints, tmp, self.tag)

    def agent(
        self, name: str, host: int, flags: tuple[str, ...] = (), env: dict[str, str] | None = None, endpoint: str = ""
    ) -> AgentProc:
        """Start agent ``name`` on host ``host`` and wait until it registered (join order is node order);
        ``endpoint``: the etcd endpoints it is given, where not the ones on the hosts' first network."""
        agent = self.cluster.agent(
            name, RESILIENT, "--steps", str(self.steps), *ARGS, flags=("--lease-ttl", str(TTL), *flags),
            where=tuple(self.hosts.argv(self.hosts[host], [])), env=env, endpoint=endpoint,
        )  # fmt: skip
        self.cluster.registered(agent, 60)
        return agent

    def close(self) -> None:
        self.cluster.close()
        self.etcd.stop()


@pytest.fixture
def job_on_hosts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Job]:
    family = request.param
    hosts = Hosts(7, ipv4=family == 4)
    job = None
    try:
        hosts.start()
        job = Job(tmp_path, hosts, family)
        job.etcd.start()
        yield job
    finally:
        try:
            if job is not None:
                job.close()
        finally:
            killed = hosts.close()
            reap_zombies()
        left = kill_leftovers(job.tag) if job is not None else []
        assert not left and not killed, f"processes left running after the test: {left} {killed}"


def step(agent: AgentProc) -> int:
    """The last step rank 0 printed (only rank 0 prints them)."""
    return max((int(s) for s in re.findall(r"\] step (\d+)/", agent.output())), default=0)


def progress(agent: AgentProc, by: int, timeout: float, what: str) -> None:
    start = step(agent)
    wait_for(lambda: step(agent) >= start + by, timeout, f"{by} steps {what}")


def last_trained(agent: AgentProc) -> int:
    """The last step a node's workers applied, from its agent's progress samples."""
    return max((int(s) for s in re.findall(r"'applied': (\d+)", agent.output())), default=0)


def resumed_at(survivor: AgentProc) -> int:
    """The step at which a survivor resumed after its last live replacement."""
    return resumes(survivor)[-1]


def resumes(survivor: AgentProc) -> list[int]:
    """The steps at which a survivor resumed after each live replacement, in order."""
    return [int(s) for s in re.findall(r"event recovered .*'resume_at': (\d+)", survivor.output())]


def holds_ranks(job: Job, node: str) -> bool:
    return bool((n := job.cluster.node(node)) and n["role"] == "active" and n["state"] == "running")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job_on_hosts", [4], indirect=True)
def test_across_hosts_etcd_cuts_are_ridden_out_until_the_lease_ends_and_lost_nodes_are_replaced_live_and_fenced(
    job_on_hosts: Job,
) -> None:
    job, hosts = job_on_hosts, job_on_hosts.hosts
    job.steps = 500  # the job trains on through two of its phases (a lease each)
    dead_end = hosts.add_interface(hosts[3])  # a's host: its default route reaches nobody
    # d's host reaches etcd over a management network of its own: the route to etcd picks an address
    # no peer can reach, so d is given its data network's address
    *etcd_mgmt, d_mgmt = hosts.add_network([*hosts.hosts[:3], hosts[6]])
    assert f"src {d_mgmt}" in hosts.route(hosts[6], etcd_mgmt[0])
    mgmt = ",".join(f"{x}:{m.client_port}" for x, m in zip(etcd_mgmt, job.etcd.members, strict=True))
    a = job.agent("a", 3, env=SAMPLED)
    b = job.agent("b", 4, env=SAMPLED)
    c = job.agent("c", 5, env=SAMPLED)
    d = job.agent("d", 6, flags=("--local-addr", hosts[6].v4), env=SAMPLED, endpoint=mgmt)
    wait_for(lambda: warm(job.cluster, "c") and warm(job.cluster, "d"), 120, "standbys c and d to be warm")
    addrs = {n["node_id"]: n["addr"] for n in job.cluster.status()["nodes"]}
    assert addrs == {"a": hosts[3].v4, "b": hosts[4].v4, "c": hosts[5].v4, "d": hosts[6].v4}, (addrs, dead_end)
    progress(a, 5, 60, "across hosts")

    # b cut from etcd alone, for less than its lease: it trains on; nobody replaces or fences it.
    etcd_addrs = [m.host for m in job.etcd.members]
    hosts.cut(hosts[4], etcd_addrs)
    wait_for(lambda: "etcd is unreachable" in b.output(), 30, "b to find etcd unreachable")
    progress(a, 10, 30, "while b is cut from etcd (every step needs b)")
    hosts.heal(hosts[4])
    wait_for(lambda: "etcd answers again" in b.output(), 30, "b to reach etcd again")
    progress(a, 5, 60, "after the cut healed")
    nodes = {n["node_id"]: n for n in job.cluster.status()["nodes"]}
    assert (nodes["b"]["role"], nodes["c"]["role"]) == ("active", "standby"), nodes
    assert "event fenced" not in b.output() and "'plan': 'replace'" not in a.output()

    # b cut from etcd alone again, now past its lease: it trains on until etcd expires the lease,
    # then c takes rank 1 live; b hears that its lease is gone once the cut heals, and is fenced.
    hosts.cut(hosts[4], etcd_addrs)
    cut_at = time.monotonic()
    progress(a, 20, 10, "while b is cut from etcd again")
    wait_for(lambda: holds_ranks(job, "c"), 90, "standby c to take b's rank")
    assert time.monotonic() - cut_at >= LEASE_LEFT, "replaced only once the lease was gone"
    progress(a, 10, 60, "after the replacement")
    hosts.heal(hosts[4])
    assert b.wait(60) == 1, b.output()[-3000:]
    assert "its lease" in b.output() and "event fenced" in b.output()

    # c's link goes down: its lease expires, d takes rank 1 live over the data network it was
    # told to advertise; c is fenced once its link is back.
    hosts.link_down(hosts[5])
    cut_at = time.monotonic()
    wait_for(lambda: holds_ranks(job, "d"), 90, "standby d to take c's rank")
    assert time.monotonic() - cut_at >= LEASE_LEFT, "replaced only once the lease was gone"
    # live: without --local-addr, a's probe cannot reach the address d advertises, d is not ready,
    # and after --standby-wait every worker restarts instead (a resumes once only)
    wait_for(lambda: len(resumes(a)) == 2, 10, "a to resume with d live")
    progress(a, 10, 60, "after the second replacement")
    hosts.link_up(hosts[5])
    assert c.wait(60) == 1, c.output()[-3000:]
    assert "its lease" in c.output() and "event fenced" in c.output()
    assert a.wait(180) == 0 and d.wait(60) == 0, (a.output()[-2000:], d.output()[-2000:])
    first, second = resumes(a)
    assert 0 < last_trained(b) <= first and first < last_trained(c) <= second, "no old holder trained past its switch"
    assert "workers_started" not in a.output().split("event workers_started", 1)[1], "a kept its process"
    got = finals(a, d)
    assert sorted(got) == [0, 1] and got[0][:2] == got[1][:2], "the replicas agree at the end"


@pytest.mark.parametrize("job_on_hosts", [6], indirect=True)
def test_an_ipv6_only_job_joins_trains_drains_and_replaces_a_lost_node_live(job_on_hosts: Job) -> None:
    job, hosts = job_on_hosts, job_on_hosts.hosts
    assert all(":" in m.host for m in job.etcd.members)
    a = job.agent("a", 3)
    b = job.agent("b", 4)
    c = job.agent("c", 5)
    d = job.agent("d", 6)
    wait_for(lambda: warm(job.cluster, "d"), 120, "standby d to be warm")
    addrs = {n["node_id"]: n["addr"] for n in job.cluster.status()["nodes"]}
    assert addrs == {"a": hosts[3].v6, "b": hosts[4].v6, "c": hosts[5].v6, "d": hosts[6].v6}, addrs
    progress(a, 5, 60, "over IPv6")
    res = job.cluster.cli("drain", "b", "--rdzv-endpoint", job.cluster.endpoint, "--rdzv-id", job.cluster.job_id,
                          timeout=120)  # fmt: skip
    assert res.returncode == 0 and "node b drained" in res.stdout, (res.stdout, res.stderr)
    assert b.wait(60) == 0
    progress(a, 5, 60, "after the drain")
    wait_for(lambda: warm(job.cluster, "d"), 60, "standby d to be warm still")
    c.kill_with_workers()  # c took rank 1 from b; d takes it from c
    wait_for(
        lambda: (n := job.cluster.node("d")) and n["role"] == "active" and n["state"] == "running",
        90, "standby d to replace c live",
    )  # fmt: skip
    assert a.wait(180) == 0 and d.wait(60) == 0, (a.output()[-2000:], d.output()[-2000:])
    assert "event node_dead" in a.output(), "the controller's probe over IPv6 found c's agent gone (no TTL wait)"
    assert "workers_started" not in a.output().split("event workers_started", 1)[1], "a kept its process"
    assert resumed_at(a) > 0
    assert_identical(finals(a, d), _reference(2, ("--steps", str(STEPS))))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job_on_hosts", [4], indirect=True)
def test_hosts_cut_from_their_peers_but_not_from_etcd_are_replaced_live_and_fenced(job_on_hosts: Job) -> None:
    job, hosts = job_on_hosts, job_on_hosts.hosts
    a, b, c, d = (job.agent(name, 3 + i, env=SAMPLED) for i, name in enumerate("abcd"))
    wait_for(lambda: warm(job.cluster, "c") and warm(job.cluster, "d"), 120, "standbys c and d to be warm")
    progress(a, 5, 60, "across hosts")
    everyone = [h.v4 for h in hosts.hosts[3:7]]

    # b cut from a and from the standbys, not from etcd: its lease stays, every step waits on it.
    hosts.cut(hosts[4], [x for x in everyone if x != hosts[4].v4])
    wait_for(lambda: holds_ranks(job, "c"), 90, "standby c to take b's rank")
    assert b.wait(60) == 1, b.output()[-3000:]
    assert "event fenced" in b.output() and "its lease" in b.output()
    said = "".join(x.output() for x in (a, b, c, d))
    assert "event node_cut_off" in said and "node b and ['a'] cannot reach each other" in said, said[-3000:]
    assert "these did not answer a probe: ['a', 'c', 'd']" in b.output(), b.output()[-3000:]
    progress(a, 10, 60, "after b was replaced")

    # c's packets to a are lost, a's to c still arrive: TCP breaks both ways, a cut pair; c has the
    # higher node rank, so c leaves and d takes its rank.
    hosts.cut(hosts[5], [hosts[3].v4], direction="out")
    wait_for(lambda: holds_ranks(job, "d"), 90, "standby d to take c's rank")
    assert c.wait(60) == 1 and "event fenced" in c.output(), c.output()[-3000:]
    assert a.wait(180) == 0 and d.wait(60) == 0, (a.output()[-2000:], d.output()[-2000:])
    assert "node c and ['a'] cannot reach each other" in "".join(x.output() for x in (a, d))

    first, second = resumes(a)
    assert 0 < last_trained(b) <= first and first < last_trained(c) <= second, "no old holder trained past its switch"
    assert "workers_started" not in a.output().split("event workers_started", 1)[1], "a kept its process"
    assert_identical(finals(a, d), _reference(2, ("--steps", str(STEPS))))
