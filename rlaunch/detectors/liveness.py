"""Fast detection of a lost node: is its agent's process still there?

Every agent answers TCP connections on a port of its own (its record's ``probe_port``). When a
worker sees a collective fail, its agent notes the time on its node record (``peer_lost_at``);
the controller then probes the agents of the current generation. A refused connection means
nothing listens on that port any more: the agent's process is gone, and its workers with it
(they die with their agent), so the controller revokes that node's lease at once instead of
waiting up to ``--lease-ttl`` for it to expire. A probe that times out (a dead host, a network
partition) proves nothing, and the lease decides as before. Where a firewall rejects connections
between live hosts, a probe reads as "gone": the node's lease is revoked and its agent fences
itself (stops its workers), exactly as if the lease had expired, so a false alarm costs one
replacement, never a stale node training on.
"""

from __future__ import annotations

import asyncio

#: Longest wait for one probe's answer; a probe that times out counts as "alive or unknown".
PROBE_TIMEOUT_S = 1.0


async def serve(host: str = "0.0.0.0") -> tuple[asyncio.Server, int]:
    """Start answering probes on a free port of ``host``; return the server and its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(answer, host, 0)
    return server, int(server.sockets[0].getsockname()[1])


async def agent_gone(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when ``addr:port`` refuses the connection (nothing listens: the agent is gone)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(addr, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
