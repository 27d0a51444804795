"""Figures bench_migration.py derives from its runs (scripts/migration_figures.py)."""

from __future__ import annotations

from scripts import migration_figures


def test_a_paired_overhead_has_the_95pct_interval_of_its_pairs_and_says_what_resolving_1pct_takes() -> None:
    tight = migration_figures.paired_overhead([(1.003, 1.0), (1.0, 1.0), (1.006, 1.0), (0.999, 1.0)])
    assert tight["runs_pct"] == [0.3, 0.0, 0.6, -0.1] and tight["resolves_1pct"] and "why" not in tight
    lo, hi = tight["ci95_pct"]
    assert lo < tight["mean_pct"] < hi and hi - lo < 2.0
    loose = migration_figures.paired_overhead([(1.05, 1.0), (0.97, 1.0), (1.10, 1.0)])
    assert not loose["resolves_1pct"] and loose["sd_pct"] > 5
    assert "+-1 % would take about" in loose["why"] and loose["ci95_pct"][0] < 0 < loose["ci95_pct"][1]
    assert migration_figures.paired_overhead([(1.02, 1.0)]) == {"median_pct": 2.0, "runs_pct": [2.0]}


def test_warm_against_cold_is_what_each_phase_saved() -> None:
    warm = {"transfer_s": 0.2, "first_step_s": 1.0, "downtime_s": 0.3, "params_s": None}
    cold = {"transfer_s": 0.25, "first_step_s": 1.4, "downtime_s": 0.7, "params_s": 0.1}
    fresh = {"first_step_excess_s": {"optimizer": 0.2}, "first_step_over_steady": 1.5}
    got = migration_figures.warm_vs_cold(warm, cold, fresh, "fsdp")
    assert got["saved_s"] == {"transfer_s": 0.05, "first_step_s": 0.4, "downtime_s": 0.4}
    assert got["fresh_process"] == fresh and "note" not in got
    assert "at least 2 sandbox steps" in migration_figures.warm_vs_cold(warm, cold, fresh, "ddp")["note"]


def test_memory_overhead_is_judged_without_the_host_snapshots_a_layout_with_no_replica_holds() -> None:
    def run(peak: int, rss: int) -> dict:
        stages = ("imported", "runtime_imported", "initialized", "model")
        memory = {s: {"rss": 100} for s in stages} | {"end": {"rss": rss, "peak": peak, "threads": 3}}
        worker = {"memory_kb": memory, "threads": ["MainThread"], "heavy_modules": []}
        return {"finals": {"0": worker, "1": worker}}

    plain = [run(1000, 900)]
    with_snapshots = [run(1510, 1405)]  # 500 kB of snapshots, 10 kB (1 %) of anything else
    got = migration_figures.memory_report(with_snapshots, plain, snapshots_kb=500)
    assert got["peak_overhead_pct"] == 51.0 and got["snapshots_pct"] == 50.0
    assert got["peak_overhead_less_snapshots_pct"] == 1.0 and got["steady_overhead_less_snapshots_pct"] == 0.56
    assert got["peak_overhead_worst_less_snapshots_pct"] == 1.0
    none = migration_figures.memory_report(with_snapshots, plain)
    assert none["peak_overhead_less_snapshots_pct"] == none["peak_overhead_pct"] == 51.0
