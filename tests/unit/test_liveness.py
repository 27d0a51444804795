"""The liveness probe against real sockets on loopback."""

from __future__ import annotations

import asyncio

from rlaunch.detectors.liveness import agent_gone, serve


def test_a_listening_agent_is_alive_and_a_closed_port_is_gone() -> None:
    async def go() -> tuple[bool, bool]:
        server, port = await serve("127.0.0.1")
        alive = await agent_gone("127.0.0.1", port)
        server.close()
        await server.wait_closed()
        return alive, await agent_gone("127.0.0.1", port)

    assert asyncio.run(go()) == (False, True)
