"""The benchmark's reading of a drain around its switch (scripts/drain_windows.py)."""

from __future__ import annotations

from typing import Any

from scripts import drain_windows

T0 = 1000.0


def _timeline(periods: list[float]) -> list[tuple[int, float, float, str]]:
    """Rank 0's rows: step i ends once the periods up to it have passed (a step takes 0.9 of it)."""
    rows, end = [], T0
    for step, period in enumerate(periods):
        end += period
        rows.append((step, end - 0.9 * period, end, "real"))
    return rows


def _move(rows: list[tuple[int, float, float, str]], seen_after: int, switch: int) -> list[dict[str, Any]]:
    """A drain's reports: the plan seen during the step after ``seen_after``, the boundary right after
    step ``switch - 1`` ended, the first step ending with step ``switch``."""
    end = {s: e for s, _, e, _ in rows}
    boundary = end[switch - 1] + 0.001
    return [
        {"rank": 0, "role": "survivor", "bytes": 0, "marks": {
            "plan_seen": end[seen_after] + 0.3, "prepared": end[seen_after] + 0.4, "boundary": boundary,
            "groups_swapped": boundary, "first_step_start": boundary + 0.001, "first_step_end": end[switch]}},
        {"rank": 1, "role": "leaver", "bytes": 100, "marks": {
            "plan_seen": end[seen_after] + 0.3, "boundary": boundary - 0.01, "transfer_start": boundary - 0.01,
            "transfer_end": boundary + 0.1}},
    ]  # fmt: skip


def test_a_drain_is_read_before_at_and_after_its_switch_against_the_steady_period() -> None:
    periods = [1.0] * 30
    periods[11], periods[12], periods[13] = 1.1, 1.3, 1.05  # phase 1, the switch, the step after it
    rows = _timeline(periods)
    got = drain_windows.read(rows, {2: _move(rows, seen_after=10, switch=12)})
    assert got["steady_period_s"] == 1.0 and got["steady_period_sd_s"] == 0.0
    (drain,) = got["drains"]
    assert (drain["bench_before_s"], drain["bench_switch_s"], drain["bench_after_s"]) == (0.1, 0.3, 0.05)
    assert drain["bench_s"] == 0.45 and drain["bench_periods"] == 4
    # the runtime's span: from the earliest boundary (the leaver's) to the first step's end, less a period
    assert drain["downtime_s"] == 0.309
    out = drain_windows.summary(got)
    assert out["switch_agrees_within_10pct"] and not out["agree_within_10pct"]
    assert "before the boundary (phase 1 and the vote's wait) read +0.100 s" in out["why_not"]
    assert "the 2 after the switch's +0.050 s" in out["why_not"]


def test_the_steady_period_leaves_out_every_window_and_the_start() -> None:
    periods = [3.0, 3.0, 3.0] + [1.0] * 27  # a slow start-up
    periods[11], periods[12] = 9.0, 9.0  # a drain's window, however slow, is not steady
    rows = _timeline(periods)
    got = drain_windows.read(rows, {2: _move(rows, seen_after=10, switch=12)})
    assert got["steady_period_s"] == 1.0


def test_a_window_past_the_timeline_is_not_read_and_too_few_steady_periods_say_so() -> None:
    rows = _timeline([1.0] * 30)
    got = drain_windows.read(rows, {2: _move(rows, seen_after=10, switch=12), 3: _move(rows, seen_after=26, switch=28)})
    assert "bench_s" in got["drains"][0] and "bench_s" not in got["drains"][1]
    short = _timeline([1.0] * 8)
    assert "too few" in drain_windows.read(short, {2: _move(short, seen_after=4, switch=5)})["why_not"]
