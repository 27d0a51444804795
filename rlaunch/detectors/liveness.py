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
import collections
import contextlib
import enum
import errno
import functools
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

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
    return await _bounded(addr, port, b"", timeout)


async def probe_round(
    generation: int, targets: Sequence[tuple[str, int]], on_gone: Callable[[int], None],
    timeout: float = PROBE_TIMEOUT_S,
) -> None:  # fmt: skip
    """The controller's round for ``generation``: probe every ``(addr, port)``, each sending
    :func:`round_mark`, ``ROUND_CONCURRENCY`` at a time and each for ``timeout`` at most (one that has
    not answered by then is let go: alive, or unknown, and its lease decides); ``on_gone(i)`` as soon
    as target ``i`` refuses (its agent is gone)."""
    loop = asyncio.get_running_loop()
    probes = _Round(loop, round_mark(generation), targets, on_gone, timeout)
    try:
        await probes.done
    finally:  # (cancelled: the probes in flight end with the round)
        await asyncio.gather(*probes.close(), return_exceptions=True)


class _Round:
    """A round's probes: an address is probed by callbacks on the event loop (:class:`_Probe`), a host
    name by a task (it is resolved first); as one ends the next begins, and ``done`` is set when the
    last one has ended. A round connects to every agent of the job: at 4,096 agents a task, a timeout
    and a semaphore's turn for each cost the controller about 0.5 s of CPU per round, callbacks a
    fraction of it (see docs/benchmarks.md)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, mark: bytes, targets: Sequence[tuple[str, int]],
        on_gone: Callable[[int], None], timeout: float,
    ) -> None:  # fmt: skip
        self._loop, self._mark, self._on_gone, self._timeout = loop, mark, on_gone, timeout
        self._queue = collections.deque(enumerate(targets))
        self._open: dict[int, _Probe | asyncio.Task[Answer]] = {}  # by target
        self.done: asyncio.Future[None] = loop.create_future()
        self._next()

    def _next(self) -> None:
        while len(self._open) < ROUND_CONCURRENCY and self._queue:
            i, (addr, port) = self._queue.popleft()
            family = _family(addr)
            if family is None:
                task = self._loop.create_task(_bounded(addr, port, self._mark, self._timeout))
                task.add_done_callback(functools.partial(self._resolved, i, addr))
                self._open[i] = task
            else:
                then = functools.partial(self._ended, i)
                self._open[i] = _Probe(self._loop, family, (addr, port), self._mark, self._timeout, then)
        if not self._open and not self.done.done():
            self.done.set_result(None)

    def _resolved(self, i: int, host: str, task: asyncio.Task[Answer]) -> None:
        if task.cancelled():
            return  # (the round was closed)
        failed = task.exception()
        if failed is not None:  # (a bug: counted as silent, so that the round ends and the lease decides)
            log.warning("The probe of %s failed: %r", host, failed)
        self._ended(i, Answer.SILENT if failed is not None else task.result())

    def _ended(self, i: int, answer: Answer) -> None:
        if self._open.pop(i, None) is None:
            return  # (the round was closed)
        try:
            if answer is Answer.GONE:
                self._on_gone(i)
        except Exception as exc:  # (the caller's: the round ends with it, as a task's would)
            if not self.done.done():
                self.done.set_exception(exc)
            return
        self._next()

    def close(self) -> list[asyncio.Task[Answer]]:
        """End the probes still open (the round was cancelled, or has ended); the tasks cancelled, to
        await."""
        self._queue.clear()
        opened, self._open = self._open, {}
        tasks = []
        for probe in opened.values():
            if isinstance(probe, _Probe):
                probe.close()
            else:
                probe.cancel()
                tasks.append(probe)
        return tasks


class _Probe:
    """One connection to an address, made by callbacks on the event loop: ``then(answer)`` once it is
    made (``mark`` is then sent), refused, failed, or ``timeout`` has passed (None: no limit), unless
    :meth:`close` came first. Its socket is closed before ``then`` is called."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, family: int, target: tuple[Any, ...], mark: bytes,
        timeout: float | None, then: Callable[[Answer], None],
    ) -> None:  # fmt: skip
        self._loop, self._mark, self._then = loop, mark, then
        self._open = True  # until it ends or is closed
        self._sock: socket.socket | None = None
        self._timer: asyncio.TimerHandle | None = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no descriptor left, or no such address family on this host
            loop.call_soon(self._end, Answer.SILENT)
            return
        self._sock = sock
        sock.setblocking(False)
        try:
            err = sock.connect_ex(target)
        except (OSError, OverflowError):  # an address this family cannot take, or no such port
            err = errno.EINVAL
        if err in (errno.EINPROGRESS, errno.EINTR):  # (interrupted: it still goes on)
            loop.add_writer(sock.fileno(), self._connected)
            if timeout is not None:
                self._timer = loop.call_later(timeout, self._end, Answer.SILENT)
        else:  # made or failed at once (no route, say)
            loop.call_soon(self._end, _answer_of(err))

    def _connected(self) -> None:
        assert self._sock is not None
        self._end(_answer_of(self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)))

    def _end(self, answer: Answer) -> None:
        if not self._open:
            return
        if answer is Answer.ANSWERS and self._mark and self._sock is not None:
            with contextlib.suppress(OSError):  # (a few bytes into an empty send buffer: it never waits)
                self._sock.send(self._mark)
        self.close()
        self._then(answer)

    def close(self) -> None:
        """Close its socket and stop its timer (``then`` is not called after this)."""
        self._open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sock, self._sock = self._sock, None
        if sock is not None:
            self._loop.remove_writer(sock.fileno())
            sock.close()


def _settle(future: asyncio.Future[Answer], answer: Answer) -> None:
    """Give ``future`` its answer, unless it was cancelled meanwhile (its socket's answer and the
    cancellation came in one pass of the event loop)."""
    if not future.done():
        future.set_result(answer)


def _answer_of(err: int) -> Answer:
    """What a connection's outcome (0 or an errno) says of the agent."""
    if err == 0:
        return Answer.ANSWERS
    return Answer.GONE if err == errno.ECONNREFUSED else Answer.SILENT


def _family(addr: str) -> int | None:
    """The address family of an IP address; None for a host name, or a scoped IPv6 address
    (``fe80::1%eth0``): getaddrinfo reads its scope, which a connection to the bare address would
    lose."""
    if "%" in addr:
        return None
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


async def _bounded(addr: str, port: int, mark: bytes, timeout: float) -> Answer:
    try:
        return await asyncio.wait_for(_connect(addr, port, mark), timeout)
    except asyncio.TimeoutError:
        return Answer.SILENT


async def _connect(addr: str, port: int, mark: bytes) -> Answer:
    """Connect to ``addr:port``, send ``mark`` and say what came back, however long it takes (the caller
    bounds it). A host name's addresses are tried in turn until one answers: it is gone only if every
    one refuses."""
    loop = asyncio.get_running_loop()
    family = _family(addr)
    if family is not None:
        targets: list[tuple[int, tuple[Any, ...]]] = [(family, (addr, port))]
    else:
        try:
            infos = await loop.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except OSError:
            return Answer.SILENT
        targets = [(family, target) for family, _, _, _, target in infos]
    refused = 0
    for family, target in targets:
        answered: asyncio.Future[Answer] = loop.create_future()
        one = _Probe(loop, family, target, mark, None, functools.partial(_settle, answered))
        try:
            answer = await answered
        finally:  # (cancelled by the caller's bound: its socket is closed)
            one.close()
        if answer is Answer.ANSWERS:
            return answer
        refused += answer is Answer.GONE
    return Answer.GONE if targets and refused == len(targets) else Answer.SILENT
