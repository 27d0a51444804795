"""The lease verdict: only etcd's answer that a lease is gone makes it lost, never its silence."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rlaunch.agent.lease import LeaseKeeper, LeaseState, Renewal, first_pause, judge

HELD, UNREACHABLE, LOST = LeaseState.HELD, LeaseState.UNREACHABLE, LeaseState.LOST
SILENT = Renewal(error="etcd at 127.0.0.1:2379 is unreachable (request timeout 2.5 s).")


def test_silence_never_loses_the_lease_however_long_it_lasts() -> None:
    state = HELD
    for _ in range(1000):
        state = judge(state, SILENT)
        assert state is UNREACHABLE


def test_an_answer_brings_the_lease_back_or_loses_it() -> None:
    assert judge(UNREACHABLE, Renewal(5)) is HELD
    assert judge(HELD, Renewal(-1)) is LOST
    assert judge(UNREACHABLE, Renewal(-1)) is LOST


def test_a_lease_in_its_last_second_is_decided_by_the_next_round() -> None:
    assert judge(HELD, Renewal(0)) is HELD
    assert judge(UNREACHABLE, Renewal(0)) is UNREACHABLE


def test_lost_is_final() -> None:
    assert judge(LOST, Renewal(5)) is LOST
    assert judge(LOST, SILENT) is LOST


def test_the_first_renewal_comes_at_a_random_part_of_a_third_of_the_ttl_never_at_once() -> None:
    assert first_pause(30, lambda: 0.0) == 10.0
    assert 0 < first_pause(30, lambda: 0.999999) < 0.001
    drawn = [first_pause(30) for _ in range(400)]
    assert all(0 < p <= 10.0 for p in drawn)
    assert min(drawn) < 1.0 and max(drawn) > 9.0, "leases taken together renew anywhere in the period"


def test_a_renewal_that_fails_by_an_unexpected_error_counts_as_no_answer(caplog: pytest.LogCaptureFixture) -> None:
    """Before, it ended the keeper's task: renewals stopped and the lease expired under a healthy node
    (a finished keepalive stream raised InvalidStateError once). Now etcd's silence, which never fences."""

    class FailingStore:
        async def refresh_lease(self, lease_id: int) -> int:
            raise asyncio.InvalidStateError("RPC already finished.")

    store = FailingStore()
    keeper = LeaseKeeper(store, 0x1F, 5, "a", sleep=lambda _s: asyncio.sleep(0, True))  # type: ignore[arg-type]

    async def twice() -> list[Renewal]:
        return [await keeper.renew(), await keeper.renew()]

    with caplog.at_level(logging.ERROR, logger="rlaunch.agent.lease"):
        renewals = asyncio.run(twice())
    assert renewals == [Renewal(error="InvalidStateError: RPC already finished.")] * 2
    assert judge(HELD, renewals[0]) is UNREACHABLE
    (record,) = caplog.records  # its traceback once, not at every renewal of the outage
    assert "renewing lease 1f failed by an unexpected error" in record.getMessage() and record.exc_info
