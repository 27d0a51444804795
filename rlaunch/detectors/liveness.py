"""Fast detection of a lost node: is its agent's process still there?

Every agent answers TCP connections on a port of its own (its record's ``probe_port``). When a
worker sees a collective fail, its agent notes the time on its node record (``peer_lost_at``; one
node's record soon, the others' later or not at all: see rlaunch.agent.loss); the controller then
probes the agents of the current generation (a round: :func:`probe_round`, at most one a second).
Its probes send a mark naming the generation (:func:`round_mark`), which tells each agent reached
that a loss its workers saw before needs no report of its own. A refused connection means nothing
listens on that port any more: the agent's process is gone, and its workers with it (they die
with their agent), so the controller revokes that node's lease at once instead of waiting up to
``--lease-ttl`` for it to expire. A probe that times out (a dead host, a network partition) proves
nothing, and the lease decides as before. Where a firewall rejects connections between live hosts,
a probe reads as "gone": the node's lease is revoked and its agent fences itself (stops its
workers), exactly as if the lease had expired, so a false alarm costs one replacement, never a
stale node training on.

The same port serves the agents among themselves: an agent whose workers wait on their peers for
too long probes the others (:mod:`rlaunch.agent.reach`), and one that does not answer at all (the
connection times out, or the network says it has no route) is reported as cut off from it.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import socket
from collections.abc import Callable, Sequence
from typing import Any

#: Longest wait for one probe's answer; a probe that times out counts as "alive or unknown". Also how
#: long an agent keeps a connection that sends nothing, and the longest wait of each probe of a round.
PROBE_TIMEOUT_S = 1.0
#: How a probe of the controller's round begins: then the generation it probed for, in decimal, and a
#: newline (the agents' own probes send nothing).
ROUND_MARK = b"r"
#: The longest mark read (the rest of a connection is not read).
MARK_MAX_BYTES = 24
#: Probes of one round open at once at most (each is a file descriptor of the controller's agent).
ROUND_CONCURRENCY = 512


async def serve(on_round: Callable[[int], None] | None = None) -> tuple[asyncio.Server, int]:
    """Start answering probes on a free port of every address of this machine, IPv4 and IPv6 alike
    (one dual-stack socket, so the port is the same for both); return the server and its port.
    ``on_round(generation)`` is called for each probe of the controller's rounds (see :func:`probe_round`)."""
    loop = asyncio.get_running_loop()
    sock = _listener()
    server = await loop.create_server(lambda: _Answer(on_round), sock=sock)
    # asyncio listened again with its backlog (100), which is also how many connections it accepts at
    # one wake-up: the kernel's queue is made long again (every agent of a stalled job, or the
    # controller's round, may connect at once), asyncio's batch stays short (a process out of file
    # descriptors retries and logs each connection of a batch)
    sock.listen(socket.SOMAXCONN)
    return server, int(server.sockets[0].getsockname()[1])


class _Answer(asyncio.Protocol):
    """One probe's connection: what it sends is read up to its end or ``MARK_MAX_BYTES`` (a round's
    mark, or nothing), and it is closed; one that stays open is closed after ``PROBE_TIMEOUT_S``.
    A protocol, not a stream: a controller's round connects to every agent, and a simulation of
    thousands of agents in one process answers them all."""

    def __init__(self, on_round: Callable[[int], None] | None) -> None:
        self._on_round = on_round
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sent = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(PROBE_TIMEOUT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._sent += data
        if b"\n" in self._sent or len(self._sent) >= MARK_MAX_BYTES:
            self._end()

    def eof_received(self) -> None:
        self._end()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _end(self) -> None:
        assert self._transport is not None
        if self._transport.is_closing():
            return
        self._transport.close()
        generation = round_mark_generation(self._sent)
        if generation is not None and self._on_round is not None:
            self._on_round(generation)


def round_mark(generation: int) -> bytes:
    """What a probe of the controller's round for ``generation`` sends."""
    return ROUND_MARK + str(generation).encode() + b"\n"


def round_mark_generation(sent: bytes) -> int | None:
    """The generation a round's mark names, or None where ``sent`` is no mark (an agent's own probe sends
    nothing; anything else is ignored)."""
    line = sent.split(b"\n", 1)[0]
    digits = line[len(ROUND_MARK) :]
    if not line.startswith(ROUND_MARK) or not digits.isdigit() or len(digits) > MARK_MAX_BYTES - 2:
        return None
    return int(digits)


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
    """Connect to ``addr:port`` (to each address of a host name in turn, until one answers) and say what
    came back (nothing is sent or read)."""
    try:
        return await asyncio.wait_for(_connect(addr, port, b""), timeout)
    except asyncio.TimeoutError:
        return Answer.SILENT


async def probe_round(
    generation: int, targets: Sequence[tuple[str, int]], on_gone: Callable[[int], None],
    timeout: float = PROBE_TIMEOUT_S,
) -> None:  # fmt: skip
    """The controller's round for ``generation``: probe every ``(addr, port)``, each sending
    :func:`round_mark`, ``ROUND_CONCURRENCY`` at a time and each for ``timeout`` at most (one that has
    not answered by then is let go: alive, or unknown, and its lease decides); ``on_gone(i)`` as soon
    as target ``i`` refuses (its agent is gone)."""
    room = asyncio.Semaphore(ROUND_CONCURRENCY)
    mark = round_mark(generation)

    async def one(i: int, addr: str, port: int) -> None:
        async with room:
            try:
                answer = await asyncio.wait_for(_connect(addr, port, mark), timeout)
            except asyncio.TimeoutError:
                return
        if answer is Answer.GONE:
            on_gone(i)

    tasks = [asyncio.ensure_future(one(i, addr, port)) for i, (addr, port) in enumerate(targets)]
    try:
        await asyncio.gather(*tasks)
    finally:  # (cancelled: the probes in flight end with the round)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _connect(addr: str, port: int, mark: bytes) -> Answer:
    """Connect to ``addr:port``, send ``mark`` and say what came back, however long it takes (the caller
    bounds it). A host name's addresses are tried in turn until one answers: it is gone only if every
    one refuses. A bare socket, not a stream: a controller's round makes one connection per node."""
    loop = asyncio.get_running_loop()
    try:
        ip = ipaddress.ip_address(addr)
        targets: list[tuple[int, tuple[Any, ...]]] = [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                                                       (addr, port))]  # fmt: skip
    except ValueError:  # a host name (or a scoped IPv6 address, which getaddrinfo reads)
        try:
            infos = await loop.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except OSError:
            return Answer.SILENT
        targets = [(family, target) for family, _, _, _, target in infos]
    refused = 0
    for family, target in targets:
        answer = await _connect_one(loop, family, target, mark)
        if answer is Answer.ANSWERS:
            return answer
        refused += answer is Answer.GONE
    return Answer.GONE if targets and refused == len(targets) else Answer.SILENT


async def _connect_one(loop: asyncio.AbstractEventLoop, family: int, target: tuple[Any, ...], mark: bytes) -> Answer:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no descriptor left, or no such address family on this host
        return Answer.SILENT
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, target)
        if mark:
            sock.send(mark)  # a few bytes into an empty send buffer: it never waits
    except ConnectionRefusedError:
        return Answer.GONE
    except OSError:
        return Answer.SILENT
    finally:
        sock.close()
    return Answer.ANSWERS
