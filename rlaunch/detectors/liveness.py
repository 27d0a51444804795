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

The same port serves the agents among themselves: an agent whose workers wait on their peers for
too long probes the others (:mod:`rlaunch.agent.reach`), and one that does not answer at all (the
connection times out, or the network says it has no route) is reported as cut off from it.
"""

from __future__ import annotations

import asyncio
import enum
import socket

#: Longest wait for one probe's answer; a probe that times out counts as "alive or unknown".
PROBE_TIMEOUT_S = 1.0


async def serve() -> tuple[asyncio.Server, int]:
    """Start answering probes on a free port of every address of this machine, IPv4 and IPv6 alike
    (one dual-stack socket, so the port is the same for both); return the server and its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(answer, sock=_listener())
    return server, int(server.sockets[0].getsockname()[1])


def _listener() -> socket.socket:
    """A listening TCP socket on a free port of every address: IPv6's wildcard taking IPv4 too, or
    IPv4's alone on a machine without IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
        except OSError:
            sock.close()
            raise
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))  # noqa: S104 - the controller probes it from any host of the job
    # Every agent of a stalled job may probe this one at once: a full accept queue would drop their
    # connections, which a prober takes for a cut. The kernel caps the backlog at net.core.somaxconn.
    sock.listen(socket.SOMAXCONN)
    sock.setblocking(False)
    return sock


class Answer(str, enum.Enum):
    """What one probe of an agent's port found."""

    ANSWERS = "answers"  # the connection was made: the host and its agent are there
    GONE = "gone"  # refused: the host is there, nothing listens (the agent's process is gone)
    SILENT = "silent"  # no answer in time, or no route: a dead host, or a network cut


async def probe(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Answer:
    """Connect to ``addr:port`` once and say what came back (nothing is sent or read)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(addr, port), timeout)
    except ConnectionRefusedError:
        return Answer.GONE
    except (OSError, asyncio.TimeoutError):
        return Answer.SILENT
    writer.close()
    return Answer.ANSWERS


async def agent_gone(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when ``addr:port`` refuses the connection (nothing listens: the agent is gone)."""
    return await probe(addr, port, timeout) is Answer.GONE
