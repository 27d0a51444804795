"""The liveness probe against real sockets on loopback, IPv4 and IPv6 alike, and which peer loss a node
record reports (the controller probes on it)."""

from __future__ import annotations

import asyncio

import pytest

from rlaunch.detectors.liveness import agent_gone, loss_to_report, serve


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


def test_a_record_reports_a_peer_loss_only_at_the_generation_it_was_seen_in_or_a_later_one() -> None:
    lost_at = 1_700_000_000.5
    assert loss_to_report(lost_at, 4, 4) == lost_at, "the survivor's report while it runs the generation"
    assert loss_to_report(lost_at, 5, 4) == lost_at, "a loss its workers saw in a plan the record has not reached"
    assert loss_to_report(lost_at, 4, 5) == 0.0, "its record at the generation planned after the loss does not carry it"
    assert loss_to_report(0.0, 0, 0) == 0.0
