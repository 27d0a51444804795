"""The per-step vote's contents, summed by hand as the allreduce would over two ranks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from rlaunch.runtime import rng
from rlaunch.runtime.stepstate import StepSnapshots
from rlaunch.runtime.vote import RefusedError, StepVote, generator_label


class Position:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _rank(seed: int, position: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].running_mean.fill_(float(seed))  # each rank's own statistics
    torch.manual_seed(seed)
    return {"model": model, "pos": Position(position)}


def _tensor(vote: StepVote, rank: int, start: Any, tracked: dict[str, Any], per_rank: set[str]) -> Any:
    """One rank's vote of step 5 (ready for nothing, no sections, a contract every rank shares)."""
    return vote.tensor(
        ready=0, group_rank=rank, start=start, tracked=tracked, per_rank=per_rank, seeded=False, sections=(),
        contract_of=lambda layout: 7,
    )  # fmt: skip


def _votes(ranks: list[dict[str, Any]], per_rank: set[str] = frozenset()) -> tuple[list[StepVote], Any, Any]:
    votes, tensors, layout = [], [], None
    for i, tracked in enumerate(ranks):
        torch.manual_seed(int(tracked["model"][1].running_mean[0].item()))
        start = StepSnapshots().take(5, tracked)
        torch.rand(1)  # the step draws from torch's generator (seeded per rank above)
        vote = StepVote(len(ranks))
        t, layout = _tensor(vote, i, start, tracked, set(per_rank))
        votes.append(vote)
        tensors.append(t)
    return votes, sum(tensors), layout


def test_every_rank_reads_every_ranks_buffers_and_a_replacement_gets_its_own() -> None:
    ranks = [_rank(0, 7), _rank(1, 7)]
    votes, total, layout = _votes(ranks)
    for i, vote in enumerate(votes):
        vote.accept(total, layout, 5, ranks[i], i)
    assert generator_label("torch") in votes[0].differs, "seeds differ by rank: remembered, not refused"
    assert generator_label("python") not in votes[0].differs, "the same on both ranks here"
    live = ranks[0]["model"][1].running_mean
    with votes[0].buffers_of(1, 6, ranks[0], 0):
        assert torch.equal(live, torch.ones(4)), "rank 1's own statistics are sent"
    assert torch.equal(live, torch.zeros(4)), "and rank 0's are put back"
    stale = "needs its module buffers .* as of step 9, but this replica holds step 5's"
    with pytest.raises(RefusedError, match=stale), votes[0].buffers_of(1, 9, ranks[0], 0):
        pass
    assert "rt.seed(seed, per_rank=True)" in votes[0].refusal(set(), seeded=False)


def test_a_tracked_object_that_differs_by_rank_is_refused_by_name() -> None:
    ranks = [_rank(0, 1), _rank(0, 2)]
    votes, total, layout = _votes(ranks)
    with pytest.raises(
        RefusedError, match=r"'pos' \(Position\) holds a different state .* rt.track_per_rank\(pos=...\)"
    ):
        votes[0].accept(total, layout, 5, ranks[0], 0)
    votes, total, layout = _votes(ranks, per_rank={"pos"})
    votes[0].accept(total, layout, 5, ranks[0], 0)  # declared: accepted
    assert "declared per rank" in votes[0].refusal({"pos"}, seeded=False)
    assert votes[0].refusal(set(), seeded=False) == "", "same seeds, same state: a replica can stand in"


def test_state_tracked_if_same_that_differs_is_remembered_and_refuses_only_a_replacement() -> None:
    """rt.track_if_same: a checkpoint callback's scores from an unsynced metric differ by rank; the job
    goes on, a drain still moves them, and a live replacement is refused naming them."""
    ranks = [_rank(0, 1), _rank(0, 2)]
    votes, total, layout = _votes(ranks)
    for vote in votes:
        vote.lenient.add("pos")
    votes[0].accept(total, layout, 5, ranks[0], 0)  # not refused
    assert votes[0].differs == {"pos": 5}
    assert "these differ from rank to rank and no replica holds them: pos since step 5" in votes[0].refusal(
        set(), seeded=False
    )
    ranks = [_rank(0, 3), _rank(0, 3)]
    votes, total, layout = _votes(ranks)
    votes[0].lenient.add("pos")
    votes[0].accept(total, layout, 5, ranks[0], 0)
    assert votes[0].differs == {} and votes[0].refusal(set(), seeded=False) == "", "the same: a replica holds it"


def test_a_script_generator_seeded_per_rank_is_refused_under_the_name_and_type_the_script_gave() -> None:
    ranks = [_rank(0, 1), _rank(0, 1)]
    for seed, tracked in enumerate(ranks):
        tracked["noise"] = rng.ScriptGenerator(torch.Generator().manual_seed(seed))
    votes, total, layout = _votes(ranks)
    with pytest.raises(RefusedError, match=r"'noise' \(Generator\) holds a different state .* rt.track_per_rank"):
        votes[0].accept(total, layout, 5, ranks[0], 0)
    for tracked in ranks:
        tracked["noise"].generator.manual_seed(7)
    votes, total, layout = _votes(ranks)
    votes[0].accept(total, layout, 5, ranks[0], 0)  # one seed everywhere: a replica holds it


def test_a_generator_that_differs_but_is_never_drawn_from_is_not_held_against_a_replacement() -> None:
    """Python's random is seeded per process at import: most scripts never draw from it."""
    ranks = [_rank(0, 7), _rank(0, 7)]
    tensors, layout, votes = [], None, []
    for i, tracked in enumerate(ranks):
        random.seed(i)  # differs by rank, never drawn from during the step
        torch.manual_seed(0)
        start = StepSnapshots().take(5, tracked)
        vote = StepVote(2)
        t, layout = _tensor(vote, i, start, tracked, set())
        tensors.append(t)
        votes.append(vote)
    votes[0].accept(sum(tensors), layout, 5, ranks[0], 0)
    assert votes[0].differs == {} and votes[0].refusal(set(), seeded=False) == ""
    start = StepSnapshots().take(6, ranks[0])
    random.random()  # the next step draws from it before a fault: now it matters
    assert "the python random number generator since step 6" in votes[0].refusal(set(), False, start)


def _three_rank_vote(ready: list[int]) -> tuple[list[Any], Any, Any]:
    ranks = [_rank(0, 7) for _ in ready]
    votes, tensors, layout = [], [], None
    for i, tracked in enumerate(ranks):
        vote = StepVote(len(ranks))
        t, layout = vote.tensor(
            ready=ready[i], group_rank=i, start=StepSnapshots().take(5, tracked), tracked=tracked, per_rank=set(),
            seeded=True, sections=(), contract_of=lambda lay: 11,
        )  # fmt: skip
        votes.append(vote)
        tensors.append(t)
    return votes, tensors, layout


def test_a_vote_whose_ring_failed_midway_is_not_complete_even_with_a_full_head() -> None:
    """A failed gloo ring can finish the segment holding the head while later ones stay partly
    summed: only the allreduce's own success, with head and trailer full, counts as complete."""
    votes, tensors, layout = _three_rank_vote([0, 0, 0])
    full = sum(tensors)
    assert votes[0].complete(full, layout, succeeded=True)
    partial = full.clone()
    partial[len(partial) // 2 :] = tensors[0][len(partial) // 2 :]  # the back half has only this rank's input
    assert partial[0].item() == 3, "the head reads the world size: the old test took this for complete"
    assert not votes[0].complete(partial, layout, succeeded=True), "the trailer is not full"
    assert not votes[0].complete(full, layout, succeeded=False), "the allreduce itself failed here"


def test_ranks_switch_only_when_all_are_ready_for_the_same_generation() -> None:
    votes, tensors, _ = _three_rank_vote([4, 4, 4])
    assert votes[0].ready_for(sum(tensors)) == 4
    votes, tensors, _ = _three_rank_vote([4, 5, 4])  # one rank took a newer plan first
    assert votes[0].ready_for(sum(tensors)) == 0
    votes, tensors, _ = _three_rank_vote([4, 4, 0])
    assert votes[0].ready_for(sum(tensors)) == 0
    assert votes[0].contract_agrees(sum(tensors)), "every rank gave the same contract digest"


def test_module_buffers_on_a_gpu_ride_in_the_host_vote() -> None:
    """The vote is a host tensor (its group carries CPU tensors over gloo); BatchNorm statistics on
    a GPU are copied into it. CUDA is faked by torch's FakeTensorMode, which checks devices as a
    real GPU run does (no GPU here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = nn.Sequential(nn.BatchNorm1d(4, device="cuda"))
        vote, layout = _tensor(StepVote(2), 1, None, {"model": model}, set())
        assert vote.device.type == "cpu" and layout.row == 4 + 4 + 1  # running mean, variance, batches
