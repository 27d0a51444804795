"""The per-step vote's contents, summed by hand as the allreduce would over two ranks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from rlaunch.runtime import rng
from rlaunch.runtime.carried import Carried, Kind, Reading
from rlaunch.runtime.stepstate import StepSnapshots, buffer_names, module_buffers
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
    reading = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(reading, Reading) and reading.kinds[0] is Kind.KEPT
    with votes[0].buffers_of(1, ranks[0], reading.sent()):
        assert torch.equal(live, torch.ones(4)), "rank 1's own statistics are sent"
    assert torch.equal(live, torch.zeros(4)), "and rank 0's are put back"
    why = votes[0].serving(9, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(why, str)
    assert (
        "needs its module buffers (BatchNorm statistics) as of step 9, but the replica on rank 0 holds step 5's" in why
    )
    assert "rt.seed(seed, per_rank=True)" in votes[0].refusal(set(), seeded=False)


def _averaged(seed: int, use_buffers: bool) -> dict[str, Any]:
    """A rank with BatchNorm statistics of its own and an average of its weights (tracked as ``ema``)."""
    tracked = _rank(seed, 7)
    decay = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    tracked["ema"] = torch.optim.swa_utils.AveragedModel(tracked["model"], multi_avg_fn=decay, use_buffers=use_buffers)
    tracked["ema"].update_parameters(tracked["model"])  # the first update copies; later ones average
    with torch.no_grad():
        tracked["model"][1].running_mean.add_(10.0)  # the model's statistics went on from the average's copy
    return tracked


def _voted(ranks: list[dict[str, Any]]) -> list[StepVote]:
    """Every rank's vote of step 5, completed and read."""
    votes, total, layout = _votes(ranks)
    for i, vote in enumerate(votes):
        vote.accept(total, layout, 5, ranks[i], i)
    return votes


def test_an_average_updated_after_the_vote_reaches_a_replacement_as_the_lost_rank_held_it() -> None:
    """An average updated after the vote (when rt.optimizer_step returned True): its count, which every
    rank's row held alike, is sent as the replica holds it now (the vote carried the one before the
    update); its statistics, copied from each rank's model by the update, are the lost rank's model's row."""
    ranks = [_averaged(0, use_buffers=False), _averaged(1, use_buffers=False)]
    votes = _voted(ranks)
    for tracked in ranks:
        tracked["ema"].update_parameters(tracked["model"])
    reading = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(reading, Reading), reading
    names = buffer_names(ranks[0])
    assert reading.kinds[names.index("'n_averaged' of the tracked module 'ema' (AveragedModel)")] is Kind.SHARED
    copied = names.index("'module.1.running_mean' of the tracked module 'ema' (AveragedModel)")
    assert reading.copies == {copied: names.index("'1.running_mean' of the tracked module 'model' (Sequential)")}
    ema = ranks[0]["ema"]
    with votes[0].buffers_of(1, ranks[0], reading.sent()):
        assert int(ema.n_averaged) == 2, "the count after the update (the vote carried 1)"
        assert torch.equal(ema.module[1].running_mean, torch.full((4,), 11.0)), "rank 1's model's statistics"
    assert torch.equal(ema.module[1].running_mean, torch.full((4,), 10.0)), "and rank 0's are put back"


def test_buffers_that_differ_by_rank_and_change_after_the_vote_refuse_a_replica() -> None:
    """No replica knows what the lost rank's statistics became after the vote: an average of them
    (use_buffers=True), or a forward in training mode. Compared by value: BatchNorm's kernel writes
    its running statistics without bumping their versions."""
    ranks = [_averaged(0, use_buffers=True), _averaged(1, use_buffers=True)]
    votes = _voted(ranks)
    ranks[0]["ema"].update_parameters(ranks[0]["model"])
    why = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(why, str) and "the buffer 'module.1.running_mean' of the tracked module 'ema' " in why, why
    assert "changed after step 5's vote" in why

    ranks = [_averaged(0, use_buffers=False), _averaged(1, use_buffers=False)]
    votes = _voted(ranks)
    with torch.no_grad():
        ranks[0]["model"](torch.randn(8, 3))  # training mode: the running statistics move
    why = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(why, str) and "'1.running_mean' of the tracked module 'model' (Sequential)" in why, why


def test_buffers_ddp_broadcast_from_rank_0_after_the_vote_are_sent_as_every_rank_holds_them() -> None:
    """An evaluation after the vote makes DDP broadcast rank 0's buffers: the lost rank held rank 0's
    too, so they are sent as held; rank 0 tells nothing apart, and takes the others' word."""
    ranks = [_rank(0, 7), _rank(1, 7), _rank(2, 7)]
    votes = _voted(ranks)
    for tracked in ranks[1:]:
        tracked["model"].load_state_dict(ranks[0]["model"].state_dict())
    seen = votes[1].serving(6, module_buffers(ranks[1]), {}, 1, ranks[1])
    assert isinstance(seen, Reading) and seen.kinds[0] is Kind.FROM_RANK0, seen  # the rest all ranks hold alike
    mine = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(mine, Reading) and mine.kinds[0] is Kind.KEPT
    live = ranks[0]["model"][1].running_mean
    with votes[0].buffers_of(2, ranks[0], {**seen.told(), **mine.sent()}):
        assert torch.equal(live, torch.zeros(4)), "rank 0's, as the lost rank 2 held them"
    with votes[0].buffers_of(2, ranks[0], mine.sent()):
        assert torch.equal(live, torch.full((4,), 2.0)), "without rank 1's word: rank 2's row"


def test_statistics_alike_at_the_vote_that_an_average_makes_differ_are_known_by_their_source() -> None:
    """An average built before training copies statistics every rank holds alike; its first update after
    the vote copies each rank's own (a copy of the model's row: the lost rank's is known), a later one
    averages them (no replica knows the lost rank's: refused, not sent as the replica's own)."""
    for use_buffers in (False, True):
        ranks = []
        for seed in (0, 1):
            tracked = _rank(0, 7)  # statistics alike on every rank, as at the start of training
            decay = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
            tracked["ema"] = torch.optim.swa_utils.AveragedModel(
                tracked["model"], multi_avg_fn=decay, use_buffers=use_buffers
            )
            with torch.no_grad():
                tracked["model"][1].running_mean.fill_(float(seed + 3))  # the model's own, by rank, from here
            ranks.append(tracked)
        votes = _voted(ranks)
        ranks[0]["ema"].update_parameters(ranks[0]["model"])  # the first update copies
        reading = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
        assert isinstance(reading, Reading), reading
        names = buffer_names(ranks[0])
        ema_mean = names.index("'module.1.running_mean' of the tracked module 'ema' (AveragedModel)")
        assert reading.copies[ema_mean] == names.index("'1.running_mean' of the tracked module 'model' (Sequential)")
        with votes[0].buffers_of(1, ranks[0], reading.sent()):
            assert torch.equal(ranks[0]["ema"].module[1].running_mean, torch.full((4,), 4.0)), "rank 1's model's"
    ranks[1]["ema"].update_parameters(ranks[1]["model"])
    for tracked in ranks:
        with torch.no_grad():
            tracked["model"][1].running_mean.add_(10.0)  # the model's statistics move on
    votes = _voted(ranks)  # use_buffers=True, one update made on every rank: the next averages
    ranks[0]["ema"].update_parameters(ranks[0]["model"])
    why = votes[0].serving(6, module_buffers(ranks[0]), {}, 0, ranks[0])
    assert isinstance(why, str) and "'module.1.running_mean' of the tracked module 'ema'" in why, why


def test_rank_0_reads_ddps_broadcast_from_its_count_and_asks_the_others_about_copies_of_it() -> None:
    """Rank 0 holds its own row after DDP broadcast it: by value it sees nothing. The count of DDP's
    broadcasts, taken at the vote and again now, says so; a copy rank 0 made of such a buffer may be
    from before or after the broadcast, which only the other ranks can tell."""
    rows = torch.tensor([[1.0, 1.0, 5.0, 1.0], [2.0, 2.0, 5.0, 2.0]], dtype=torch.float64)  # model a, b, n; ema
    carried = Carried(5, rows, (1, 1, 1, 1), (("model", 7),))
    owners = ("model", "model", "model", "ema")
    now = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([1.0])]
    assert carried.broadcast({"model": 7}, owners) == frozenset()
    assert carried.compare(now, 0).kinds == [Kind.KEPT, Kind.KEPT, Kind.SHARED, Kind.KEPT], "no broadcast"
    reading = carried.compare(now, 0, carried.broadcast({"model": 8}, owners))
    assert reading.kinds[:3] == [Kind.FROM_RANK0] * 3
    assert reading.kinds[3] is Kind.KEPT, "the average's own row: nothing moved"
    rows[:, 3] = torch.tensor([7.0, 8.0], dtype=torch.float64)  # the average then copied the model's a
    reading = carried.compare(now, 0, carried.broadcast({"model": 8}, owners))
    assert reading.kinds[3] is Kind.UNSURE and reading.unsure == {3}
    assert carried.compare(now, 0).copies == {3: 0}, "without a broadcast: a copy of its own row"
    before = carried.compare([torch.tensor([2.0])] * 2 + [torch.tensor([5.0]), torch.tensor([2.0])], 1)
    assert before.copies == {3: 0}, "rank 1 copied its own row of a: before the broadcast"
    after = carried.compare([torch.tensor([1.0])] * 2 + [torch.tensor([5.0]), torch.tensor([1.0])], 1)
    assert after.kinds == [Kind.FROM_RANK0, Kind.FROM_RANK0, Kind.SHARED, Kind.FROM_RANK0], "after it: rank 0's"


def test_the_vote_after_a_late_change_remembers_it_for_a_replacement() -> None:
    """The next vote compares each rank's buffers at the step's start with its row of the last vote:
    a change after the vote is remembered on every rank (a replacement then rolls back to a host
    snapshot or is refused); a step without one adds nothing."""
    for late in (False, True):
        ranks = [_averaged(0, use_buffers=True), _averaged(1, use_buffers=True)]
        votes = _voted(ranks)
        if late:
            ranks[1]["ema"].update_parameters(ranks[1]["model"])
        tensors, layout = [], None
        for i, tracked in enumerate(ranks):
            start = StepSnapshots().take(6, tracked)
            t, layout = _tensor(votes[i], i, start, tracked, set())
            tensors.append(t)
        votes[0].accept(sum(tensors), layout, 6, ranks[0], 0)
        said = votes[0].refusal(set(), seeded=True)
        label = "the buffer 'module.1.running_mean' of the tracked module 'ema' (AveragedModel), which changes after "
        if late:
            assert f"{label}rt.optimizer_step, after the vote that carries every rank's since step 6" in said, said
        else:
            assert label not in said, said


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
