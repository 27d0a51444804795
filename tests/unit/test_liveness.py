"""The liveness probe against real sockets on loopback, IPv4 and IPv6 alike."""

from __future__ import annotations

import asyncio

import pytest

from rlaunch.detectors.liveness import agent_gone, serve


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
