"""The liveness probe against real sockets on loopback, IPv4 and IPv6 alike (the controller's rounds
marked), and a node's report of its workers' lost peer (the controller probes on it): when it is said,
and when a probe round makes it needless."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from rlaunch.agent.loss import SAME_LOSS_S, SPREAD_PER_NODE_S, LossReport
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.detectors import liveness
from rlaunch.detectors.liveness import (
    PROBE_TIMEOUT_S,
    Answer,
    probe,
    probe_round,
    round_mark,
    round_mark_generation,
    serve,
)
from rlaunch.store.keys import JobKeys
from tests.unit.test_planner import gen as gen_of


@pytest.mark.parametrize("target", ["127.0.0.1", "::1"])
def test_a_listening_agent_answers_on_ipv4_and_ipv6_and_a_closed_port_is_gone(target: str) -> None:
    async def go() -> tuple[bool, bool]:
        server, port = await serve()
        gone_while_up = await probe(target, port) is Answer.GONE
        server.close()
        await server.wait_closed()
        return gone_while_up, await probe(target, port) is Answer.GONE

    gone_while_up, gone_after = asyncio.run(go())
    assert not gone_while_up, f"a live agent's probe port must answer on {target}"
    assert gone_after, "once the agent is gone the port refuses"


def test_only_the_controllers_rounds_mark_an_agent_and_a_round_says_which_are_gone_as_they_answer() -> None:
    """The controller's round sends the mark with its generation and names the agents whose ports refuse,
    at once (not after the slowest probe); the agents' own probes (rlaunch.agent.reach) send nothing and
    mark nothing; a connection that sends nothing and stays open is closed in time; a host name is gone
    only where every address of it refuses."""

    async def go() -> dict[str, Any]:
        rounds: list[int] = []
        server, port = await serve(rounds.append)
        closed_port = await _closed_port()
        silent = _silent_listener()
        try:
            assert await probe("127.0.0.1", port) is Answer.ANSWERS
            await asyncio.sleep(0.1)
            out: dict[str, Any] = {"after_plain": list(rounds)}
            gone: list[tuple[int, float]] = []
            began = time.monotonic()
            targets = [("127.0.0.1", port), ("::1", closed_port)] + [("127.0.0.1", silent.getsockname()[1])] * 8
            await probe_round(7, targets, lambda i: gone.append((i, time.monotonic() - began)), timeout=1.5)
            out["round_s"] = time.monotonic() - began
            await asyncio.wait_for(_until(lambda: bool(rounds)), 5)
            out["after_round"], out["gone"], out["gone_after"] = list(rounds), [i for i, _ in gone], gone[0][1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            out["read"] = await asyncio.wait_for(reader.read(), PROBE_TIMEOUT_S + 2)  # the server closes it
            writer.close()
            out["names"] = (await probe("localhost", port), await probe("localhost", closed_port))
            return out
        finally:
            await _close(server, silent)

    out = asyncio.run(go())
    assert out["after_plain"] == [], "an agent's own probe is no round"
    assert out["after_round"] == [7], "the controller's probe marks the agent with the round's generation"
    assert out["gone"] == [1], "the closed port is gone; the live and the silent ones are not"
    assert 0 <= out["gone_after"] < 1.0, f"a gone agent is said at once ({out['gone_after']:.2f} s)"
    assert 1.4 <= out["round_s"] < 3.0, "the round lets the silent ones go after its wait"
    assert out["read"] == b"", "nothing is sent back, and a silent connection is closed"
    assert out["names"] == (Answer.ANSWERS, Answer.GONE)


def test_a_burst_of_a_rounds_probes_is_accepted_and_marks_every_agent() -> None:
    """A round connects to every agent at once, and every agent of a stalled job probes every other: the
    listen queue takes them all (asyncio would listen with 100 unless told), none reads as silent."""

    async def go() -> tuple[int, int, float]:
        marked: list[int] = []
        server, port = await serve(marked.append)
        gone: list[int] = []
        try:
            began = time.monotonic()
            await probe_round(2, [("127.0.0.1", port)] * 500, gone.append, timeout=5.0)
            took = time.monotonic() - began
            await asyncio.wait_for(_until(lambda: len(marked) >= 500), 5)
            return len(marked), len(gone), took
        finally:
            await _close(server)

    marked, gone, took = asyncio.run(go())
    assert (marked, gone) == (500, 0), f"{marked} of 500 probes marked, {gone} gone"
    assert took < 1.0, f"the round took {took:.2f} s: connections were dropped and retried"


def test_silent_hosts_do_not_hold_a_rounds_probes_from_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """More silent hosts than a round opens probes at once: each probe gives up after the timeout, so the
    agents after them are still reached and a gone one found."""
    monkeypatch.setattr(liveness, "ROUND_CONCURRENCY", 4)

    async def go() -> tuple[list[int], list[int], float]:
        marked: list[int] = []
        server, port = await serve(marked.append)
        closed_port = await _closed_port()
        silent = _silent_listener()
        silent_target = ("127.0.0.1", silent.getsockname()[1])
        gone: list[int] = []
        try:
            began = time.monotonic()
            targets = [silent_target] * 6 + [("127.0.0.1", port), ("127.0.0.1", closed_port)]
            await probe_round(9, targets, gone.append, timeout=0.5)
            took = time.monotonic() - began
            await asyncio.wait_for(_until(lambda: bool(marked)), 5)
            return marked, gone, took
        finally:
            await _close(server, silent)

    marked, gone, took = asyncio.run(go())
    assert marked == [9] and gone == [7], (marked, gone)
    assert took < 3.0, f"the round took {took:.2f} s"


def test_a_host_name_answers_at_its_first_address_that_does_and_is_gone_only_if_all_refuse() -> None:
    async def go() -> list[Answer]:
        server, port = await serve()
        closed = await _closed_port()
        silent = _silent_listener()
        quiet = silent.getsockname()[1]
        loop = asyncio.get_running_loop()
        addresses: list[int] = []

        async def resolve(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p)) for p in addresses]

        loop.getaddrinfo = resolve  # type: ignore[method-assign]
        try:
            answers = []
            for ports in ([port, quiet, quiet], [closed, port], [closed, closed]):
                addresses[:] = ports  # what the name resolves to, in order
                answers.append(await probe("node.example", 0, timeout=1.0))
            return answers
        finally:
            await _close(server, silent)

    assert asyncio.run(go()) == [Answer.ANSWERS, Answer.ANSWERS, Answer.GONE]


def test_a_rounds_host_names_and_addresses_answer_alike_and_a_cancelled_round_closes_its_probes() -> None:
    """A round probes an address by callbacks and a host name by a task: both are marked and found gone
    alike. A round cancelled while its probes wait leaves no socket open."""

    async def go() -> dict[str, Any]:
        marked: list[int] = []
        server, port = await serve(marked.append)
        closed = await _closed_port()
        silent = _silent_listener()
        quiet = silent.getsockname()[1]
        gone: list[int] = []
        try:
            targets = [("localhost", port), ("127.0.0.1", closed), ("localhost", closed), ("127.0.0.1", port)]
            await probe_round(3, targets, gone.append, timeout=2.0)
            await asyncio.wait_for(_until(lambda: len(marked) >= 2), 5)
            out: dict[str, Any] = {"gone": sorted(gone), "marked": list(marked)}
            before = len(os.listdir("/proc/self/fd"))
            waiting = [("127.0.0.1", quiet)] * 6 + [("localhost", quiet)] * 2
            round_ = asyncio.ensure_future(probe_round(4, waiting, gone.append, timeout=30.0))
            await asyncio.sleep(0.5)
            out["open_while_waiting"] = len(os.listdir("/proc/self/fd")) - before
            round_.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await round_
            out["open_after"] = len(os.listdir("/proc/self/fd")) - before
            return out
        finally:
            await _close(server, silent)

    out = asyncio.run(go())
    assert out["gone"] == [1, 2] and out["marked"] == [3, 3], out
    assert out["open_while_waiting"] >= 5, f"the silent listener's probes wait: {out}"
    assert out["open_after"] <= 0, f"the cancelled round left sockets open: {out}"


def test_a_scoped_ipv6_address_is_resolved_with_its_scope() -> None:
    """``fe80::1%eth0`` goes through getaddrinfo, which keeps its scope (a connection to the bare address
    would go nowhere): here the resolver is faked to send it to a live port."""

    async def go() -> tuple[Answer, list[str]]:
        server, port = await serve()
        asked: list[str] = []

        async def resolve(host: str, port_: int, **_: Any) -> list[tuple[Any, ...]]:
            asked.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

        asyncio.get_running_loop().getaddrinfo = resolve  # type: ignore[method-assign]
        try:
            return await probe("fe80::1%eth0", port, timeout=1.0), asked
        finally:
            await _close(server)

    assert asyncio.run(go()) == (Answer.ANSWERS, ["fe80::1%eth0"])


def test_a_round_whose_caller_raises_ends_with_the_error_and_a_probe_cancelled_as_it_answers_logs_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``on_gone`` raising ends the round with its error (it would otherwise wait forever); a probe whose
    task is cancelled in the same pass of the event loop as its socket answers says nothing more."""

    async def go() -> tuple[str, list[str]]:
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        loop.set_exception_handler(lambda _, context: errors.append(context["message"]))
        closed = await _closed_port()

        def refuse(i: int) -> None:
            raise RuntimeError(f"caller's bug at {i}")

        try:
            await asyncio.wait_for(probe_round(1, [("127.0.0.1", closed)] * 3, refuse), 5)
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        made = liveness._Probe
        task: list[asyncio.Future[Answer]] = []

        class CancelledAtOnce(made):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                loop.call_soon(task[0].cancel)  # handled before the socket's answer, in the same pass

        monkeypatch.setattr(liveness, "_Probe", CancelledAtOnce)
        try:
            task.append(asyncio.ensure_future(liveness._connect("127.0.0.1", listener.getsockname()[1], b"")))
            with contextlib.suppress(asyncio.CancelledError):
                await task[0]
            await asyncio.sleep(0.05)
        finally:
            listener.close()
        return raised, errors

    raised, errors = asyncio.run(go())
    assert raised == "caller's bug at 0", raised
    assert errors == [], errors


def test_only_a_mark_names_a_generation() -> None:
    assert round_mark_generation(round_mark(12)) == 12
    assert round_mark_generation(round_mark(0)) == 0
    for sent in (b"", b"r", b"rx\n", b"x12\n", b"r-1\n", b"r" + b"9" * 40):
        assert round_mark_generation(sent) is None, sent


async def _close(server: asyncio.Server, *socks: socket.socket) -> None:
    """End a test's probe server and its bare sockets."""
    for sock in socks:
        sock.close()
    server.close()
    await server.wait_closed()


async def _closed_port() -> int:
    """A port where an agent's probe server listened and no longer does: it refuses."""
    server, port = await serve()
    await _close(server)
    return port


def _silent_listener() -> socket.socket:
    """A listener that never accepts: its queue holds one connection, the others get no answer."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    return sock


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.01)


def test_a_loss_is_said_after_a_spread_that_grows_with_the_job_and_once_for_a_nodes_workers() -> None:
    loss = LossReport()
    assert loss.seen(4, 4096, 100.0, 10.0, 0.5) == pytest.approx(0.5 * SPREAD_PER_NODE_S * 4096)
    assert loss.seen(4, 4096, 100.001, 10.001, 0.9) is None, "another local rank's report of the same loss"
    assert not loss.to_say(10.0 + 2.047), "not before it is due"
    assert loss.to_say(10.0 + 2.048) and loss.said_at == 100.0
    assert not loss.to_say(20.0), "said once"
    assert loss.seen(4, 4, 101.0, 11.0, 0.5) == pytest.approx(0.002), "a second later: a new loss"
    assert loss.seen(5, 4, 101.1, 11.1, 0.0) == 0.0, "the next generation's loss is a new one"
    assert loss.to_say(11.1) and loss.said_at == 101.1


def test_a_probe_round_that_reaches_the_node_after_the_loss_drops_its_report_and_one_before_does_not() -> None:
    loss = LossReport()
    loss.probed(9.0, 4)
    assert loss.seen(4, 1000, 100.0, 10.0, 1.0) == pytest.approx(1.0)
    assert loss.to_say(11.0) and loss.said_at == 100.0, "a round before the loss does not cover it"
    assert loss.seen(5, 1000, 101.0, 11.0, 1.0) is not None
    loss.probed(11.5, 4)
    assert loss.waiting() and loss.to_say(12.0) and loss.said_at == 101.0, (
        "a round for an earlier generation did not probe the nodes that joined since: the loss is said"
    )
    assert loss.seen(5, 1000, 102.0, 12.0, 1.0) is not None and loss.waiting()
    loss.probed(12.5, 5)
    loss.probed(12.6, 4)  # a late probe of an earlier round
    assert not loss.waiting(), "nothing to wake the agent's loop for"
    assert not loss.to_say(13.0) and loss.said_at == 101.0, "the round covered the loss: no report"
    assert loss.due is None, "and none waits"


def test_a_nodes_workers_seeing_one_loss_report_it_once_when_due_and_a_later_one_again() -> None:
    """Eight local ranks that see a collective fail within milliseconds make one report (one record
    written), each its own event going with the record; the agent's loop is woken once it is due; a loss
    a second later is reported again, as is one in the next generation."""
    events: list[tuple[str, int]] = []
    woken: list[float] = []
    link = WorkerLink(None, JobKeys("j"), lambda: 0, lambda *a, **k: None, lambda: woken.append(time.monotonic()),  # type: ignore[arg-type]
                      emit_with_record=lambda kind, gen, **_: events.append((kind, gen)), draw=lambda: 0.5)  # fmt: skip
    link.generation = gen_of(4, {n: i for i, n in enumerate("abcdefghijklmnopqrst")})  # 20 nodes: 10 ms

    async def report(n: int) -> float:
        began = time.monotonic()
        for local_rank in range(n):
            await link._recovering({"local_rank": local_rank, "step": 40})
        await asyncio.sleep(0.1)
        return began

    began = asyncio.run(report(8))
    loss = link.state.loss
    assert loss.generation == 4 and len(woken) == 1 and woken[0] - began >= 0.01, "woken once, when due"
    assert events == [("recovering", 4)] * 8
    assert loss.to_say(time.monotonic()) and loss.said_at > 0
    first = loss.said_at
    loss.seen_mono -= SAME_LOSS_S  # as if the first came a second ago
    asyncio.run(report(1))
    assert len(woken) == 2 and loss.to_say(time.monotonic()) and loss.said_at > first, "a later loss: again"
    link.generation = gen_of(5, {"a": 0, "c": 1})
    asyncio.run(report(1))
    assert loss.generation == 5 and len(woken) == 3, "a loss in the next generation is reported"

    async def probed_before_due() -> None:
        loss.seen_mono -= SAME_LOSS_S
        await link._recovering({"local_rank": 0, "step": 41})
        loss.probed(time.monotonic(), 5)  # the controller's round reached the node within its wait
        await asyncio.sleep(0.1)

    link.generation = gen_of(5, {n: i for i, n in enumerate("abcdefghijklmnopqrst")})
    asyncio.run(probed_before_due())
    assert len(woken) == 3 and not loss.to_say(time.monotonic()), "covered by the round: not woken, not said"
