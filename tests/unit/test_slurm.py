"""The scontrol parser and the drain watcher's decisions, on output captured from real Slurm daemons.

The files in tests/slurm/scontrol/ are what ``scontrol show node -o`` printed (Slurm 22.05.8, the
cluster tests/slurm/start_slurm.sh starts): idle nodes, nodes in a job, a node drained and one
failed while the job ran (ALLOCATED+DRAIN, ALLOCATED+FAIL), the same after the job (IDLE+DRAIN,
IDLE+FAIL), and a node down beside one in a maintenance reservation.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from rlaunch.integrations.slurm import SlurmError, SlurmNode, maintenance, parse_fields, parse_node, parse_nodes
from rlaunch.integrations.slurm_watch import (
    RELEASE_GRACE_S,
    Mark,
    Outcome,
    Releaser,
    SlurmDrainWatch,
    decide,
    read_nodes,
    release_node,
)

CAPTURED = Path(__file__).resolve().parent.parent / "slurm" / "scontrol"


def captured(name: str) -> dict[str, SlurmNode]:
    return parse_nodes((CAPTURED / f"{name}.txt").read_text())


def test_idle_and_allocated_nodes_are_in_service() -> None:
    for name in ("idle", "allocated"):
        nodes = captured(name)
        assert sorted(nodes) == ["n1", "n2", "n3"]
        for node in nodes.values():
            assert node.state == ("IDLE" if name == "idle" else "ALLOCATED") and node.flags == frozenset()
            assert node.addr == "127.0.0.1" and node.reason is None
            assert maintenance(node) is None


def test_a_node_drained_during_a_job_is_marked_with_its_reason() -> None:
    n2 = captured("draining")["n2"]
    assert (n2.state, n2.flags, n2.state_text) == ("ALLOCATED", frozenset({"DRAIN"}), "ALLOCATED+DRAIN")
    assert n2.reason == "maintenance window (ticket 42)"
    assert n2.reason_by == "root" and n2.reason_at == "2026-11-30T15:59:59"
    assert maintenance(n2) == (
        "Slurm marks node n2 ALLOCATED+DRAIN with reason 'maintenance window (ticket 42)' "
        "(set by root at 2026-11-30T15:59:59)."
    )


def test_a_failing_node_is_marked_and_a_reason_with_equals_signs_is_read_whole() -> None:
    n3 = captured("draining")["n3"]
    assert n3.flags == frozenset({"FAIL"})
    assert n3.reason == "ECC errors, replace DIMM=3", "the reason is read by its [user@time] suffix, not split at '='"
    assert maintenance(n3) is not None and "ALLOCATED+FAIL" in maintenance(n3)  # type: ignore[operator]


def test_drained_and_failed_idle_nodes_stay_marked() -> None:
    nodes = captured("drained")
    assert nodes["n2"].state_text == "IDLE+DRAIN" and maintenance(nodes["n2"]) is not None
    assert nodes["n3"].state_text == "IDLE+FAIL" and maintenance(nodes["n3"]) is not None
    assert maintenance(nodes["n1"]) is None


def test_a_down_node_is_not_maintenance_but_a_maintenance_reservation_is() -> None:
    nodes = captured("down_and_maint")
    assert nodes["n1"].state == "DOWN" and nodes["n1"].reason == "power loss"
    assert maintenance(nodes["n1"]) is None, "a lost node is the lease's business, not a drain"
    assert nodes["n2"].flags == frozenset({"MAINTENANCE", "RESERVED"})
    assert maintenance(nodes["n2"]) == "Slurm marks node n2 IDLE+MAINTENANCE+RESERVED."


def test_values_with_spaces_and_equals_signs_stay_whole() -> None:
    line = (CAPTURED / "idle.txt").read_text().splitlines()[0]
    fields = parse_fields(line)
    assert fields["OS"].startswith("Linux ") and "#1 SMP" in fields["OS"], fields["OS"]
    assert fields["CfgTRES"] == "cpu=1,mem=1M,billing=1"
    assert fields["AllocTRES"] == "" and fields["Partitions"] == "debug"
    assert fields["ExtSensorsTemp"] == "n/s", "the last field ends at the end of the line"


def test_a_line_without_node_name_or_state_is_refused_with_the_line() -> None:
    with pytest.raises(SlurmError, match=r"no NodeName or no State field: 'Node nX not found'"):
        parse_node("Node nX not found")
    with pytest.raises(SlurmError, match="no NodeName or no State"):
        parse_node("NodeName=n1 Arch=x86_64")
    assert parse_nodes("\n\n") == {}


def node(name: str, state: str) -> SlurmNode:
    base, *flags = state.split("+")
    return SlurmNode(name=name, state=base, flags=frozenset(flags), reason="r", reason_by="root", reason_at="t")


def test_decide_walks_the_marks() -> None:
    assert decide(Mark.IN_SERVICE, node("a", "ALLOCATED")) == (Mark.IN_SERVICE, None)
    mark, why = decide(Mark.IN_SERVICE, node("a", "ALLOCATED+DRAIN"))
    assert mark is Mark.MARKED and why is not None and "node a ALLOCATED+DRAIN" in why
    assert decide(Mark.MARKED, node("a", "ALLOCATED+DRAIN"))[0] is Mark.MARKED, "asked again until accepted"
    assert decide(Mark.MARKED, node("a", "ALLOCATED")) == (Mark.IN_SERVICE, None), "resumed before the drain"
    assert decide(Mark.DRAINED, node("a", "IDLE+DRAIN")) == (Mark.DRAINED, None), "drained once, never again"
    assert decide(Mark.RELEASED, node("a", "IDLE+DRAIN")) == (Mark.RELEASED, None)
    assert decide(Mark.MARKED, None) == (Mark.IN_SERVICE, None), "a node Slurm no longer reports is left alone"


class Fakes:
    """Slurm's answers poll by poll, and the drain outcomes rlaunch gives, in order."""

    def __init__(self, polls: list[dict[str, SlurmNode] | SlurmError], outcomes: list[Outcome]) -> None:
        self.polls = polls
        self.outcomes = outcomes
        self.drains: list[str] = []
        self.announced: list[str] = []
        self.releases: list[str] = []
        self.release_outcomes: list[Outcome] = []

    async def read(self) -> dict[str, SlurmNode]:
        answer = self.polls.pop(0)
        if isinstance(answer, SlurmError):
            raise answer
        return answer

    async def drain(self, name: str) -> Outcome:
        self.drains.append(name)
        return self.outcomes.pop(0)

    async def announce(self, n: SlurmNode, why: str) -> None:
        self.announced.append(n.name)

    async def release(self, name: str) -> Outcome:
        self.releases.append(name)
        return self.release_outcomes.pop(0)


def watch_polls(fakes: Fakes, polls: int, release: bool = False, keep: frozenset[str] = frozenset()) -> SlurmDrainWatch:
    async def go() -> SlurmDrainWatch:
        watch = SlurmDrainWatch(
            fakes.read, fakes.drain, fakes.announce, interval=1.0, stop=asyncio.Event(),
            release=fakes.release if release else None, keep=keep,
        )  # fmt: skip
        for _ in range(polls):
            await watch.poll()
        return watch

    return asyncio.run(go())


def test_the_watch_drains_a_marked_node_once_and_retries_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    ok = {"n1": node("n1", "ALLOCATED"), "n2": node("n2", "ALLOCATED")}
    marked = {**ok, "n2": node("n2", "ALLOCATED+DRAIN")}
    refused = Outcome(False, "Job 'j' has no ready standby to take node 'n2's ranks.")
    fakes = Fakes([ok, marked, marked, marked, marked, marked], [refused, refused, Outcome(True, "n2 drained.")])
    with caplog.at_level(logging.INFO):
        watch = watch_polls(fakes, 6)
    assert fakes.drains == ["n2", "n2", "n2"], "refused twice, asked again at each poll, then never again"
    assert fakes.announced == ["n2"], "the mark goes to the event stream once"
    assert watch.marks == {"n1": Mark.IN_SERVICE, "n2": Mark.DRAINED}
    said = [r.getMessage() for r in caplog.records]
    assert sum("no ready standby" in m for m in said) == 1, "a refusal that repeats is logged once"
    assert "n2 drained." in said


def test_the_watch_forgets_a_node_resumed_before_its_drain_and_survives_slurm_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    marked = {"n1": node("n1", "MIXED+DRAIN")}
    ok = {"n1": node("n1", "MIXED")}
    refused = Outcome(False, "Node 'n1' holds no ranks.")
    error = SlurmError("`scontrol show node -o n1` exited with code 1: slurm_load_node error: timeout.")
    fakes = Fakes([marked, error, error, ok, ok], [refused])
    with caplog.at_level(logging.INFO):
        watch = watch_polls(fakes, 5)
    assert fakes.drains == ["n1"] and watch.marks == {"n1": Mark.IN_SERVICE}
    said = [r.getMessage() for r in caplog.records]
    assert sum("slurm_load_node error" in m for m in said) == 1, said
    assert "Slurm put node n1 back in service before it was drained." in said


def test_a_drained_node_is_released_from_the_slurm_job_once_its_agent_is_gone() -> None:
    marked = {"n1": node("n1", "ALLOCATED"), "n2": node("n2", "ALLOCATED+DRAIN")}
    fakes = Fakes([marked] * 4, [Outcome(True, "n2 drained.")])
    fakes.release_outcomes = [Outcome(False, "agent still there"), Outcome(True, "n2 released.")]
    watch = watch_polls(fakes, 4, release=True)
    assert fakes.drains == ["n2"] and fakes.releases == ["n2", "n2"], "asked until released, then never again"
    assert watch.marks["n2"] is Mark.RELEASED


def test_a_kept_node_is_drained_but_never_released(caplog: pytest.LogCaptureFixture) -> None:
    marked = {"n1": node("n1", "ALLOCATED+DRAIN")}
    fakes = Fakes([marked] * 3, [Outcome(True, "n1 drained.")])
    with caplog.at_level(logging.INFO):
        watch = watch_polls(fakes, 3, release=True, keep=frozenset({"n1"}))
    assert fakes.drains == ["n1"] and fakes.releases == [] and watch.marks["n1"] is Mark.DRAINED
    said = [r.getMessage() for r in caplog.records]
    assert said.count("Node n1 stays in the Slurm job until it ends: it runs the batch script.") == 1, said


def test_read_nodes_runs_scontrol_and_reports_its_failures(tmp_path: Path) -> None:
    fake = tmp_path / "scontrol"
    fake.write_text(
        f"#!{sys.executable}\nimport sys\nsys.stdout.write(open({str(CAPTURED / 'draining.txt')!r}).read())\n"
    )
    fake.chmod(0o755)
    nodes = asyncio.run(read_nodes("n[1-3]", str(fake)))
    assert nodes["n2"].state_text == "ALLOCATED+DRAIN"

    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'Node nX not found' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(SlurmError, match=r"`.*failing show node -o nX` exited with code 1: Node nX not found"):
        asyncio.run(read_nodes("nX", str(failing)))
    with pytest.raises(SlurmError, match="could not be run"):
        asyncio.run(read_nodes("n1", str(tmp_path / "missing")))


FAKE_SCONTROL = """#!{python}
import sys
args = sys.argv[1:]
open({log!r}, "a").write(" ".join(args) + "\\n")
if args[:2] == ["show", "job"]:
    print("JobId=7 JobName=rlaunch JobState=RUNNING NodeList={nodelist} BatchHost=n1 NumNodes=3")
elif args[:2] == ["show", "hostnames"]:
    print({hostnames!r})
"""


def fake_scontrol(tmp_path: Path, nodelist: str, hostnames: str) -> tuple[str, Path]:
    log = tmp_path / "calls.txt"
    fake = tmp_path / "scontrol"
    fake.write_text(FAKE_SCONTROL.format(python=sys.executable, log=str(log), nodelist=nodelist, hostnames=hostnames))
    fake.chmod(0o755)
    return str(fake), log


def test_release_node_shrinks_the_job_to_the_other_nodes(tmp_path: Path) -> None:
    scontrol, log = fake_scontrol(tmp_path, "n[1-3]", "n1\nn2\nn3")
    assert asyncio.run(release_node("7", "n2", scontrol)) is True
    assert log.read_text().splitlines() == ["show job -o 7", "show hostnames n[1-3]", "update JobId=7 NodeList=n1,n3"]


def test_release_node_leaves_a_job_without_the_node_alone(tmp_path: Path) -> None:
    scontrol, log = fake_scontrol(tmp_path, "n[1,3]", "n1\nn3")
    assert asyncio.run(release_node("7", "n2", scontrol)) is False
    assert not any(line.startswith("update") for line in log.read_text().splitlines())
    with pytest.raises(SlurmError, match="Node n1 is the last node of Slurm job 7"):
        asyncio.run(release_node("7", "n1", fake_scontrol(tmp_path, "n1", "n1")[0]))


def test_the_releaser_waits_for_the_agent_to_be_gone_a_grace_period() -> None:
    now = [100.0]
    present = [True, False, False, False]
    shrunk: list[str] = []

    async def is_present(node: str) -> bool:
        return present.pop(0)

    async def shrink(node: str) -> bool:
        shrunk.append(node)
        return True

    releaser = Releaser("7", is_present, shrink, clock=lambda: now[0])

    async def go() -> list[Outcome]:
        outcomes = [await releaser("n2")]  # the agent still runs
        outcomes.append(await releaser("n2"))  # gone, since 100.0
        now[0] += RELEASE_GRACE_S - 0.5
        outcomes.append(await releaser("n2"))  # gone, but not long enough
        now[0] += 1.0
        outcomes.append(await releaser("n2"))
        return outcomes

    outcomes = asyncio.run(go())
    assert [o.done for o in outcomes] == [False, False, False, True]
    assert outcomes[0].message == "Node n2 leaves Slurm job 7 once its rlaunch agent has exited."
    assert outcomes[3].message == "Node n2 released from Slurm job 7: Slurm may take it for maintenance."
    assert shrunk == ["n2"], "Slurm is asked once, after the grace period"


def test_the_releaser_reports_a_slurm_refusal_and_a_node_already_gone() -> None:
    async def gone(node: str) -> bool:
        return False

    async def refuse(node: str) -> bool:
        raise SlurmError("`scontrol update JobId=7 NodeList=n1` exited with code 1: Invalid node name.")

    async def absent(node: str) -> bool:
        return False

    def after_grace(shrink: Callable[[str], Awaitable[bool]]) -> Outcome:
        times = [0.0, RELEASE_GRACE_S]
        releaser = Releaser("7", gone, shrink, clock=lambda: times.pop(0))

        async def go() -> Outcome:
            await releaser("n2")
            return await releaser("n2")

        return asyncio.run(go())

    refusal = "`scontrol update JobId=7 NodeList=n1` exited with code 1: Invalid node name."
    assert after_grace(refuse) == Outcome(False, refusal)
    assert after_grace(absent) == Outcome(True, "Node n2 is no longer in Slurm job 7.")
