"""The agent's probe round during a stall, against real sockets on loopback.

Three peers: one whose agent answers (a real probe server), one whose agent is gone (a closed
port: refused, which is no cut), and one that is silent (a listening socket whose accept queue is
full, so the kernel drops further connection attempts: to a prober, a cut host).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from rlaunch.agent import reach
from rlaunch.agent.reach import Peer, PeerProbe, Reach
from rlaunch.detectors.hang import HangDetector
from rlaunch.detectors.liveness import serve
from rlaunch.store.embedded import free_port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes no connection and refuses none (its backlog is full)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        queued.append(client)
    yield port
    for s in (*queued, listener):
        s.close()


def test_a_stalled_node_reports_the_silent_peer_only_and_clears_the_report_once_steps_complete(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reach, "PROBE_TIMEOUT_S", 1.0)
    now = [0.0]
    hangs = HangDetector(300.0)

    async def go() -> tuple[bool, Reach, bool, bool, Reach]:
        server, port = await serve()
        peers = [
            Peer("me", "127.0.0.1", port),
            Peer("answers", "127.0.0.1", port),
            Peer("gone", "127.0.0.1", free_port()),
            Peer("cut", "127.0.0.1", silent_port),
        ]

        async def read() -> list[Peer]:
            return peers

        prober = PeerProbe("me", hangs, read, clock=lambda: 1000.0 + now[0], monotonic=lambda: now[0])
        hangs.heartbeat(0, 0.0, steps=5, step_s=0.5, waiting=True)
        now[0] = 2.0
        early = await prober.check(True)  # waiting, but within the stall limit
        now[0] = 10.0
        first = await prober.check(True)
        got = prober.current
        now[0] = 11.0
        again = await prober.check(True)  # the next round is not due yet
        hangs.heartbeat(0, 12.0, steps=6, step_s=0.5, waiting=False)
        now[0] = 12.0
        cleared = await prober.check(True)
        server.close()
        await server.wait_closed()
        return early or again, got, first, cleared, prober.current

    nothing, got, first, cleared, after = asyncio.run(go())
    assert not nothing, "no round before the stall limit, nor before the next round is due"
    assert first and got == Reach(1010.0, ("cut",)), "only the silent peer is unreachable; refused is no cut"
    assert cleared and after == Reach(), "steps complete again: the report goes"


def test_a_node_whose_workers_do_not_train_never_probes() -> None:
    hangs = HangDetector(300.0)
    hangs.heartbeat(0, 0.0, steps=5, step_s=0.5, waiting=True)
    asked = []

    async def read() -> list[Peer]:
        asked.append(1)
        return []

    prober = PeerProbe("me", hangs, read, monotonic=lambda: 100.0)
    assert not asyncio.run(prober.check(False)) and not asked and prober.current == Reach()
