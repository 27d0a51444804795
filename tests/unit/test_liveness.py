"""The liveness probe against real sockets on loopback, IPv4 and IPv6 alike, and a node's report of its
workers' lost peer (the controller probes on it)."""

from __future__ import annotations

import asyncio

import pytest

from rlaunch.agent.worker_link import SAME_LOSS_S, WorkerLink
from rlaunch.detectors.liveness import agent_gone, serve
from rlaunch.store.keys import JobKeys
from tests.unit.test_planner import gen as gen_of


@pytest.mark.parametrize("target", ["127.0.0.1", "::1"])
def test_a_listening_agent_answers_on_ipv4_and_ipv6_and_a_closed_port_is_gone(target: str) -> None:
    async def go() -> tuple[bool, bool]:
        server, port = await serve()
        gone_while_up = await agent_gone(target, port)
        server.close()
        await server.wait_closed()
        return gone_while_up, await agent_gone(target, port)

    gone_while_up, gone_after = asyncio.run(go())
    assert not gone_while_up, f"a live agent's probe port must answer on {target}"
    assert gone_after, "once the agent is gone the port refuses"


def test_a_nodes_workers_seeing_one_loss_report_it_once_and_a_later_one_again() -> None:
    """Eight local ranks that see a collective fail within milliseconds make one report (one record
    written), each its own event going with the record; a loss a second later is reported again, as is
    one in the next generation."""
    events: list[tuple[str, int]] = []
    woken: list[float] = []
    link = WorkerLink(None, JobKeys("j"), lambda: 0, lambda *a, **k: None, lambda: woken.append(0),  # type: ignore[arg-type]
                      emit_with_record=lambda kind, gen, **_: events.append((kind, gen)))  # fmt: skip
    link.generation = gen_of(4, {"a": 0, "b": 1})

    async def report(n: int) -> None:
        for local_rank in range(n):
            await link._recovering({"local_rank": local_rank, "step": 40})

    asyncio.run(report(8))
    first = link.state.peer_lost_at
    assert first > 0 and link.state.peer_lost_gen == 4 and len(woken) == 1
    assert events == [("recovering", 4)] * 8
    link.state.peer_lost_mono -= SAME_LOSS_S  # as if the first came a second ago
    asyncio.run(report(1))
    assert link.state.peer_lost_at > first and len(woken) == 2, "a later loss is reported again"
    link.generation = gen_of(5, {"a": 0, "c": 1})
    asyncio.run(report(1))
    assert link.state.peer_lost_gen == 5 and len(woken) == 3, "a loss in the next generation is reported"
