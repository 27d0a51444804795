"""Replicas compared in the vote: first-vote layouts, faults, and the verdict that names a suspect.

Each "rank" is a model (DDP over a one-rank gloo group of its own: DDP is what keeps replicas equal)
and optimizer in this process; the vote's allreduce is the sum of their sections, and the gather
that names suspects is the stack of their rows.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import HashStore
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import digest, verify
from rlaunch.runtime.replicas import declare
from rlaunch.runtime.verify import Verifier
from tests.unit import gloo_groups as gloo


def _ddp(module: nn.Module) -> DistributedDataParallel:
    return DistributedDataParallel(module, process_group=gloo.one_rank())


def _rank(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = _ddp(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(99)  # the same batch on every replica: gradients as after DDP's allreduce
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt}


def _compare(ranks: list[dict[str, Any]], verifiers: list[Verifier], step: int, declared: Any = None) -> Any:
    world = len(ranks)
    prints = verifiers[0].prints(ranks[0], None, (), declared)
    digests = [v.digests(r, prints, (), declared) for v, r in zip(verifiers, ranks, strict=True)]
    summed = sum(v.section(i, prints, d, 0.1) for i, (v, d) in enumerate(zip(verifiers, digests, strict=True)))
    rows = torch.tensor([verify.rows_of(d, [0.0] * len(prints)) for d in digests], dtype=torch.float64)
    found = []
    for v in verifiers:
        differing = v.differing(summed, prints)
        found.append(v.settle(step, summed, prints, differing))
    assert all(f == found[0] for f in found), "every rank reads the same faults"
    assert world == len(verifiers)
    return prints, found[0], rows


def test_replicas_that_agree_are_remembered_good_and_a_flip_is_named_by_majority() -> None:
    ranks, verifiers = [_rank() for _ in range(3)], [Verifier(1, 3) for _ in range(3)]
    prints, faults, _ = _compare(ranks, verifiers, 0)
    assert faults == [] and {p.obj for p in prints} == {"model", "opt"}
    assert verifiers[0].good == {("model", ()), ("opt", ())} and not verifiers[0].differs
    with torch.no_grad():
        ranks[1]["model"].module[0].weight.view(-1).view(torch.int32)[5] ^= 1 << 20  # one bit, on rank 1
    prints, faults, rows = _compare(ranks, verifiers, 1)
    assert [prints[i].obj for i, _ in faults] == ["model"]
    found = verify.verdict(prints, faults, rows, None, 1)
    assert found.unnamed == [] and list(found.suspects) == [1]
    evidence = found.suspects[1]
    assert evidence["method"] == "majority" and evidence["replicas"] == [0, 1, 2] and evidence["object"] == "model"
    assert evidence["digest"] != evidence["replica_digest"]
    assert "rank 1's copy of 'model'" in verify.describe_suspect(1, evidence)


def test_two_replicas_cannot_be_told_apart_unless_a_second_reading_changes() -> None:
    ranks, verifiers = [_rank() for _ in range(2)], [Verifier(1, 2) for _ in range(2)]
    _compare(ranks, verifiers, 0)
    with torch.no_grad():
        ranks[0]["opt"].state[ranks[0]["model"].module[2].bias]["exp_avg"].view(torch.int32)[0] ^= 1
    prints, faults, rows = _compare(ranks, verifiers, 1)
    found = verify.verdict(prints, faults, rows, None, 1)
    assert not found.suspects and "no one can be named" in found.unnamed[0] and "'opt'" in found.unnamed[0]
    # a second reading: rank 0's changed (a flaky device), rank 1's did not
    again = rows.clone()
    again[0] += 1
    found = verify.verdict(prints, faults, rows, again, 1)
    assert list(found.suspects) == [0] and found.suspects[0]["method"] == "reread"
    # rank 0's own witness: its state changed since its own last update, rank 1's did not
    flagged = rows.clone()
    flagged[0, len(prints) * 4 + [p.obj for p in prints].index("opt")] = 1.0
    found = verify.verdict(prints, faults, flagged, None, 1)
    assert list(found.suspects) == [0] and found.suspects[0]["method"] == "self-check"
    assert "changed since its own last optimizer step" in verify.describe_suspect(0, found.suspects[0])


def test_parameters_that_differ_at_the_first_comparison_are_a_layout_not_a_fault() -> None:
    """Tensor parallelism built by hand: each rank holds its own shard from the start."""
    ranks, verifiers = [_rank(seed) for seed in (0, 1)], [Verifier(1, 2) for _ in range(2)]
    prints, faults, _ = _compare(ranks, verifiers, 0)
    assert faults == [] and ("model", ()) in verifiers[0].differs
    assert "the tracked 'model' and 'opt' differ from rank to rank since step 0" in verifiers[0].refusal()
    assert "rt.declare_replicas" in verifiers[1].refusal()
    later = verifiers[0].prints(ranks[0], None, (), None)
    assert "model" not in {p.obj for p in later}, "a layout is not compared again"


def test_declared_replica_sets_are_compared_set_by_set() -> None:
    """2-way tensor parallelism over 4 ranks: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1."""
    declared = declare([[0, 2], [1, 3]], 4)
    ranks = [_rank(0), _rank(1), _rank(0), _rank(1)]
    verifiers = [Verifier(1, 4) for _ in range(4)]
    prints, faults, _ = _compare(ranks, verifiers, 0, declared)
    assert faults == [] and not verifiers[0].differs, "each set agrees within itself"
    assert prints[0].slots.of_rank == (0, 1, 0, 1)
    for bad in ([[0, 1], [1, 2, 3]], [0, 1, 2, 3], "0,1", [[0, 0, 1], [2, 3]], [[0.5, 1], [2, 3]], [[0, 1, 2, 3], []]):
        with pytest.raises(ValueError, match=r"must be a list of lists of ranks naming every rank 0..3 exactly once"):
            declare(bad, 4)  # type: ignore[arg-type]


def test_auto_interval_keeps_the_cost_under_the_budget() -> None:
    v = Verifier(None, 2)
    summed = torch.zeros(2, dtype=torch.float64)
    summed[-2], summed[-1] = 2 * 20_000.0, 2 * 400_000.0  # 20 ms of digests, 400 ms steps, on 2 ranks
    v.settle(10, summed, [], [])
    assert v.next_step == 10 + 10, "20 ms every 10 steps of 400 ms is 0.5 %"
    fixed = Verifier(7, 2)
    fixed.settle(10, summed, [], [])
    assert fixed.next_step == 17 and not Verifier(0, 2).due(10**6, move=False) and Verifier(0, 2).due(5, move=True)


@pytest.mark.parametrize(("value", "expected"), [("auto", None), ("", None), ("0", 0), ("25", 25)])
def test_the_interval_is_read_from_the_agent(value: str, expected: int | None) -> None:
    assert verify.interval(value) == expected


def test_a_bad_interval_is_a_sentence() -> None:
    with pytest.raises(Exception, match=r"RLAUNCH_VERIFY_EVERY is 'often'; use a number of steps, 0 \(off\) or 'auto'"):
        verify.interval("often")


def test_state_that_first_appears_later_is_a_fault_unless_it_follows_a_layout() -> None:
    """The optimizer has no state at the first vote (before any step): when its moments first appear
    they must agree across replicas, unless they belong to parameters that differ by layout."""

    def fresh(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = _ddp(nn.Linear(4, 2))
        return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-2)}

    def step(ranks: list[dict[str, Any]], seeds: list[int]) -> None:
        for r, seed in zip(ranks, seeds, strict=True):
            torch.manual_seed(seed)
            r["model"](torch.randn(3, 4)).sum().backward()
            r["opt"].step()

    ranks, verifiers = [fresh(0), fresh(0)], [Verifier(1, 2) for _ in range(2)]
    prints, faults, _ = _compare(ranks, verifiers, 0)
    assert [p.obj for p in prints] == ["model"] and faults == []
    step(ranks, [5, 6])  # different gradients on the two replicas (as if one sync were corrupt)
    prints, faults, _ = _compare(ranks, verifiers, 1)
    assert {prints[i].obj for i, _ in faults} == {"model", "opt"}, "the new moments differ: a fault, not a layout"

    ranks, verifiers = [fresh(0), fresh(1)], [Verifier(1, 2) for _ in range(2)]
    _compare(ranks, verifiers, 0)  # different from the start: a layout
    step(ranks, [5, 6])
    prints, faults, _ = _compare(ranks, verifiers, 1)
    assert faults == [] and ("opt", ()) in verifiers[0].differs, "the experts' moments follow their layout"


def test_a_plain_module_that_drifts_apart_is_a_layout_not_silent_data_corruption() -> None:
    """An EMA updated on rank 0 only, or experts of a hand-built layout that started alike: the
    runtime does not keep plain modules equal, so a later difference is the script's own doing."""
    torch.manual_seed(0)
    ranks = [{"ema": nn.Linear(4, 2)} for _ in range(3)]
    for r in ranks[1:]:
        r["ema"].load_state_dict(ranks[0]["ema"].state_dict())
    verifiers = [Verifier(1, 3) for _ in range(3)]
    _, faults, _ = _compare(ranks, verifiers, 0)
    assert faults == [] and ("ema", ()) in verifiers[0].good
    with torch.no_grad():
        ranks[0]["ema"].weight.mul_(0.9)  # rank 0 alone updates it
    _, faults, _ = _compare(ranks, verifiers, 5)
    assert faults == [], "not a suspect"
    assert "the tracked 'ema' differ from rank to rank since step 5" in verifiers[0].refusal()


def test_a_gather_that_failed_names_nobody_and_sends_the_step_to_recovery() -> None:
    """A peer gone between the completed vote and the gather that names suspects: the group hands
    the gather its own input back (one row and zeros). Read as a table, the zeros would outvote
    this rank and it would report itself as the suspect."""
    from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
    from rlaunch.runtime.grouptable import GroupTable
    from rlaunch.runtime.rankstate import RankState
    from rlaunch.runtime.snapshots import HostSnapshots
    from rlaunch.runtime.vote import StepVote
    from rlaunch.runtime.voting import Voting

    class Link:
        calls: list[str] = []

        def call(self, op: str, **fields: Any) -> dict[str, Any]:
            self.calls.append(op)
            return {}

    ranks = [_rank() for _ in range(3)]
    verifiers = [Verifier(1, 3) for _ in range(3)]
    _compare(ranks, verifiers, 0)  # equal: known good
    with torch.no_grad():
        ranks[1]["model"].module[0].weight.view(-1).view(torch.int32)[5] ^= 1 << 20
    prints = verifiers[0].prints(ranks[0], None, (), None)
    digests = [v.digests(r, prints, (), None) for v, r in zip(verifiers, ranks, strict=True)]
    summed = sum(v.section(i, prints, d, 0.1) for i, (v, d) in enumerate(zip(verifiers, digests, strict=True)))
    group = SwitchableGroup("world", [0, 1, 2], 0, SandboxComm(0, 3), 1)
    group.failed = "rank 2 is gone"
    link = Link()
    state = RankState(
        rank=0, world_size=3, generation=1, standby=False, link=link, store=HashStore(),
        timeout=datetime.timedelta(seconds=5), groups=GroupTable(None, datetime.timedelta(seconds=5)),
        vote=StepVote(3),
    )  # type: ignore[arg-type]  # fmt: skip
    off = HostSnapshots(state, 0, 1, bool)
    voting = Voting(state, group, verifiers[0], lambda: 0, lambda gen: None, lambda: 0.1, off)
    assert voting._compare(summed, prints, digests[0], move=False) is False
    assert "sdc_suspected" not in link.calls, "rank 0 (healthy) must not report itself"


def test_with_two_replicas_a_bit_flipped_at_rest_names_its_rank_by_its_own_witness() -> None:
    """Each rank digests what its update produced right after the step before a scheduled check; at
    the check, the rank whose state changed since then (and only it) is the suspect."""
    ranks, verifiers = [_rank() for _ in range(2)], [Verifier(1, 2) for _ in range(2)]
    _compare(ranks, verifiers, 0)  # known good; the next check is at step 1
    for v, r in zip(verifiers, ranks, strict=True):
        v.after_update(0, r, None, (), None)  # right after step 0's optimizer step
    with torch.no_grad():
        ranks[1]["model"].module[0].weight.view(-1).view(torch.int32)[2] ^= 1 << 9  # at rest, on rank 1
    prints = verifiers[0].prints(ranks[0], None, (), None)
    digests = [v.digests(r, prints, (), None) for v, r in zip(verifiers, ranks, strict=True)]
    summed = sum(v.section(i, prints, d, 0.1) for i, (v, d) in enumerate(zip(verifiers, digests, strict=True)))
    faults = [v.settle(1, summed, prints, v.differing(summed, prints)) for v in verifiers][0]
    rows = torch.tensor(
        [verify.rows_of(d, v.changed(1, prints, d)) for v, d in zip(verifiers, digests, strict=True)],
        dtype=torch.float64,
    )
    found = verify.verdict(prints, faults, rows, None, 1)
    assert list(found.suspects) == [1] and found.suspects[1]["method"] == "self-check" and not found.unnamed


def test_terms_a_joiner_primed_serve_its_first_vote_alone() -> None:
    """The terms read as the state landed describe the tensors' memory as it was then: they serve the
    vote they were taken for, once; any other (a step that went to recovery never reached it, and the
    recovery may write the state in place) reads the state afresh."""
    rank = _rank()
    bits = rank["model"].module[0].weight.view(-1).view(torch.int32)
    v = Verifier(1, 2)
    as_landed = v.prepare(0, rank, None, (), None, 0.1, at=(0, 0))[1]

    def prime(at: tuple[int, int]) -> None:
        known = digest.Terms()
        v.digests(rank, v.prints(rank, None, (), None), (), None, known)
        v.prime(known, at)
        with torch.no_grad():
            bits[5] ^= 1 << 20  # written in place after the terms were read: the memory they are keyed on

    prime((3, 40))
    changed = v.prepare(0, rank, None, (), None, 0.1, at=(4, 40))[1]  # another generation's vote: read afresh
    assert changed != as_landed
    with torch.no_grad():
        bits[5] ^= 1 << 20
    prime((4, 40))
    assert v.prepare(0, rank, None, (), None, 0.1, at=(4, 41))[1] == changed  # another step's: read afresh too
    with torch.no_grad():
        bits[5] ^= 1 << 20
    prime((4, 41))
    assert v.prepare(0, rank, None, (), None, 0.1, at=(4, 41))[1] == as_landed  # the primed vote: as landed
    assert v.prepare(0, rank, None, (), None, 0.1, at=(4, 41))[1] == changed  # used once
