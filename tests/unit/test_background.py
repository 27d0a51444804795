"""The agent's background tasks are kept running: one that ends by an error is said and started again
(rlaunch.agent.background), with real asyncio tasks and a real event loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rlaunch.agent import background
from rlaunch.agent.background import FIRST_PAUSE_S, MAX_PAUSE_S, keep_running, next_pause, worth_saying


def test_the_pause_doubles_after_short_runs_up_to_its_most_and_starts_again_after_a_long_run() -> None:
    assert next_pause(0.0, 0.0) == FIRST_PAUSE_S
    assert next_pause(FIRST_PAUSE_S, 0.1) == 2 * FIRST_PAUSE_S
    assert next_pause(MAX_PAUSE_S, 0.1) == MAX_PAUSE_S
    assert next_pause(0.75 * MAX_PAUSE_S, 0.1) == MAX_PAUSE_S
    assert next_pause(MAX_PAUSE_S, MAX_PAUSE_S) == FIRST_PAUSE_S, "a task that ran a long while failed afresh"
    assert next_pause(0.0, 0.0, most=0.5) == 0.5 and next_pause(0.5, 0.1, most=0.5) == 0.5, "the lease renewal's"


def test_a_run_of_one_error_is_said_in_full_at_its_1st_2nd_4th_8th_failure() -> None:
    assert [n for n in range(1, 20) if worth_saying(n)] == [1, 2, 4, 8, 16]


def test_each_run_of_one_error_counts_afresh_and_an_error_is_its_type_and_place_not_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A, A, A, then B five times: B is said at its 1st, 2nd and 4th failure, whatever came before; B's
    messages differ (a value in them) but it is one error."""
    monkeypatch.setattr(background, "FIRST_PAUSE_S", 0.001)
    monkeypatch.setattr(background, "MAX_PAUSE_S", 0.002)  # (the pauses; no run lasts that long here)
    runs: list[int] = []
    said: list[int] = []

    async def body() -> None:
        runs.append(len(runs) + 1)
        if len(runs) <= 3:
            raise KeyError("a")
        if len(runs) <= 8:
            raise ValueError(f"revision {len(runs)}")

    asyncio.run(keep_running("x", body, asyncio.Event(), lambda _n, _e, failures: said.append(failures), "a",
                             clock=lambda: 0.0))  # fmt: skip
    assert said == [1, 2, 4, 5, 7]  # A: 1st, 2nd; B (failures 4 to 8): 1st, 2nd, 4th


def test_a_task_that_fails_is_said_with_its_traceback_and_started_again_until_it_ends_by_itself(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a background task of the agent that raised what it did not expect (a finished keepalive
    stream's InvalidStateError, once) ended for good: its lease renewals stopped, with one log line."""
    monkeypatch.setattr(background, "FIRST_PAUSE_S", 0.01)
    runs: list[int] = []
    said: list[tuple[str, str, int]] = []

    async def renew() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise asyncio.InvalidStateError("RPC already finished.")
        if len(runs) == 2:
            raise KeyError()  # an error with no message is named by its type

    async def go() -> None:
        stop = asyncio.Event()
        await asyncio.wait_for(keep_running("the lease renewal", renew, stop, lambda *a: said.append(a), "a"), 5)

    with caplog.at_level(logging.ERROR, logger="rlaunch.agent.background"):
        asyncio.run(go())
    assert runs == [0, 1, 2], "started again after each error, and not after it ended by itself"
    assert said == [("the lease renewal", "InvalidStateError: RPC already finished.", 1),
                    ("the lease renewal", "KeyError", 2)]  # fmt: skip
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and errors[0].exc_info is not None, "each failure at ERROR, with its traceback"
    assert "[a] the lease renewal ended by an error (InvalidStateError: RPC already finished.; 1 failure(s)" in (
        errors[0].getMessage()
    )


def test_a_report_that_fails_does_not_end_the_task_and_an_error_as_the_agent_stops_starts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(background, "FIRST_PAUSE_S", 0.01)
    runs: list[int] = []
    stop = asyncio.Event()

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) == 3:
            stop.set()  # the agent stops while this run fails: no pause, no report, no new start
        raise RuntimeError("boom")

    def report(*_: object) -> None:
        raise OSError("the event log is closed")

    async def go() -> None:
        await asyncio.wait_for(keep_running("x", body, stop, report, "a"), 5)

    asyncio.run(go())
    assert runs == [0, 1, 2]


def test_a_stop_during_the_pause_ends_it_and_a_cancel_ends_it_as_any_task() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def go() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(keep_running("x", fails, stop, lambda *a: None, "a"))
        await asyncio.sleep(0.05)  # failed once; waits its first pause (1 s)
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, 0.2)  # at once, not at the pause's end

        never = asyncio.Event()

        async def waits() -> None:
            await never.wait()

        task = asyncio.ensure_future(keep_running("y", waits, asyncio.Event(), lambda *a: None, "a"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
