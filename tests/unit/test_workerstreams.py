"""A loader's worker processes carry their random streams in its position (rlaunch.runtime.workerstreams).

Real torchdata ``StatefulDataLoader``s with two worker processes each. A joiner's loader, resumed
from a position taken partway through an epoch, must read the same batches, random transforms
drawn in its workers included, as the loader it replaces goes on to read.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from rlaunch.runtime import workerstreams
from rlaunch.runtime.data import EpochLoader
from rlaunch.runtime.stepstate import StepSnapshots, fingerprint_value
from rlaunch.runtime.vote import StepVote
from tests.one_rank import plain_runtime


class Counting(Dataset[torch.Tensor]):
    """A dataset with a state of its own (the samples it read) and no randomness."""

    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        self.read += 1
        return torch.tensor([float(self.read)])

    def state_dict(self) -> dict[str, Any]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.read = state["read"]


class Jittered(Counting):
    """Each sample drawn with a random transform in whichever process reads it (torch's and Python's
    streams), beside the count of samples read."""

    def __getitem__(self, i: int) -> torch.Tensor:
        super().__getitem__(i)
        return torch.tensor([float(i)]) + torch.rand(1) + random.random()


class Plain(Dataset[torch.Tensor]):
    """Samples with no randomness in them."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _data(
    dataset: Dataset[torch.Tensor], carried: bool = True, seed_by: Any = None, persistent: bool = False
) -> EpochLoader:
    loader = StatefulDataLoader(
        dataset, batch_size=4, num_workers=2, worker_init_fn=seed_by, persistent_workers=persistent
    )  # fmt: skip
    data = EpochLoader(loader, None, lambda: 0)
    assert isinstance(loader.worker_init_fn, workerstreams.CarryStreams)
    if not carried:  # as rt.epochs was before the streams were carried
        loader.worker_init_fn = workerstreams.script_init(loader.worker_init_fn)
    return data


def _through_the_wire(state: dict[str, Any]) -> dict[str, Any]:
    """What a joiner receives: the transfer's blob, loaded with weights_only=True."""
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)  # type: ignore[no-any-return]


def _resumed_reads(carried: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Five batches read on after a position taken at batch 3, by the loader itself and by a joiner's."""
    torch.manual_seed(0)
    sender = _data(Jittered(), carried)
    for _ in range(3):
        sender.batch()
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(5)]
    torch.manual_seed(1)  # the joiner's own global streams differ (its sandbox drew on its own)
    joiner = _data(Jittered(), carried)
    joiner.load_state_dict(position)
    return expected, [joiner.batch() for _ in range(5)]


def test_a_joiner_resumed_mid_epoch_draws_the_transforms_the_sender_would_have() -> None:
    expected, got = _resumed_reads(carried=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_without_the_streams_a_resumed_worker_would_draw_other_transforms() -> None:
    expected, got = _resumed_reads(carried=False)
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), "the test could not fail"


def test_persistent_workers_resumed_mid_epoch_carry_their_streams_into_the_next_epochs() -> None:
    """With ``persistent_workers=True`` an uninterrupted run's workers go on drawing from the streams
    they ended an epoch with, while a joiner's were started at the move (its sandbox's workers before
    them): the streams the position carried must hold for the epochs after the move's too."""
    for carried in (True, False):
        torch.manual_seed(0)
        sender = _data(Jittered(), carried, persistent=True)
        for _ in range(3):
            sender.batch()
        position, main_streams = _through_the_wire(sender.state_dict()), torch.get_rng_state()
        expected = [sender.batch() for _ in range(30)]  # 12 batches an epoch: into the third
        torch.manual_seed(1)
        joiner = _data(Jittered(), carried, persistent=True)
        joiner.batch()  # its sandbox read, and started its workers
        torch.set_rng_state(main_streams)  # the loader's process's streams: the runtime's, carried apart
        joiner.load_state_dict(position)
        got = [joiner.batch() for _ in range(30)]
        same = [torch.equal(a, b) for a, b in zip(expected, got, strict=True)]
        assert all(same) if carried else not any(same[:9]), f"carried={carried}: {same}"


def test_the_datasets_own_state_is_kept_beside_the_streams() -> None:
    torch.manual_seed(0)
    data = _data(Jittered())
    for _ in range(3):
        data.batch()
    workers = data.state_dict()["loader"]["_snapshot"]["_worker_snapshots"]
    states = [w["dataset_state"] for w in workers.values()]
    assert sorted(s["read"] for s in states) == [4, 8], "worker 0 read 2 batches, worker 1 one"
    assert all(isinstance(s[workerstreams.STREAMS], str) for s in states), "one key more, beside its own"


class SeedByRank:
    """A script's worker_init_fn seeding each worker by rank (as Lightning's workers=True does)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        torch.manual_seed(1000 * (self.rank + 1) + worker_id)


def test_workers_that_draw_nothing_keep_the_position_alike_whatever_their_seeds() -> None:
    """Two ranks' loaders whose workers are seeded apart, over a dataset that draws nothing: the same
    position, so a replica still serves a lost rank."""
    positions = []
    for rank in (0, 1):  # SeedByRank seeds their workers 1000 and 1001, then 2000 and 2001
        torch.manual_seed(0)
        data = _data(Plain(), seed_by=SeedByRank(rank))
        data.batch()
        data.batch()
        workers = data.state_dict()["loader"]["_snapshot"]["_worker_snapshots"]
        assert all(w["dataset_state"] is None for w in workers.values()), "nothing carried, no state added"
        positions.append(workers)
    assert fingerprint_value(positions[0]) == fingerprint_value(positions[1])


class Cropped(Dataset[torch.Tensor]):
    """A transform that draws as many numbers as its sample asks for (a crop retried until it fits)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return (torch.rand(1 + i % 3).sum() + i).reshape(1)


def test_rt_epochs_holds_a_loader_with_workers_to_the_same_state_only_while_it_is() -> None:
    rt = plain_runtime()
    rt.epochs(StatefulDataLoader(Plain(), batch_size=4, num_workers=2))
    assert rt._s.vote.lenient == {"data"}, "its workers' streams may come to differ by rank"
    rt.epochs(StatefulDataLoader(Plain(), batch_size=4), name="plain")
    assert "plain" not in rt._s.vote.lenient, "a loader without workers is held to the same state on every rank"


def _rank_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    dataset = Cropped()
    sampler = DistributedSampler(dataset, 2, rank, shuffle=False)
    data = EpochLoader(StatefulDataLoader(dataset, batch_size=4, num_workers=2, sampler=sampler), sampler, lambda: rank)
    for _ in range(3):
        data.batch()
    torch.manual_seed(0)
    return {"model": nn.Linear(2, 2), "data": data}


def test_streams_that_differ_by_rank_refuse_a_live_replacement_and_the_job_goes_on() -> None:
    """Two ranks whose workers drew different amounts: their positions differ, and the vote, which holds
    such a loader to the same state only while it is (above), remembers it instead of stopping the job
    (a drain still moves the position) and refuses a replica."""
    ranks = [_rank_state(0), _rank_state(1)]
    assert fingerprint_value(ranks[0]["data"].position) != fingerprint_value(ranks[1]["data"].position)
    votes, tensors, layout = [], [], None
    for i, tracked in enumerate(ranks):
        start = StepSnapshots().take(5, tracked)
        vote = StepVote(2)
        vote.lenient.add("data")
        tensor, layout = vote.tensor(
            ready=0, group_rank=i, start=start, tracked=tracked, per_rank=set(), seeded=False, sections=(),
            contract_of=lambda layout: 7,
        )  # fmt: skip
        votes.append(vote)
        tensors.append(tensor)
    votes[0].accept(sum(tensors), layout, 5, ranks[0], 0)
    assert votes[0].differs == {"data": 5}
    assert "data since step 5" in votes[0].refusal(set(), seeded=False)


def test_a_position_saved_under_rlaunch_loads_into_a_loader_without_it() -> None:
    """Back to plain torchrun with a checkpoint of the loader: the dataset's own load_state_dict gets
    its own keys (and one more it does not read)."""
    torch.manual_seed(0)
    data = _data(Jittered())
    for _ in range(3):
        data.batch()
    plain = StatefulDataLoader(Counting(), batch_size=4, num_workers=2)
    plain.load_state_dict(_through_the_wire(data.state_dict())["loader"])
    reads = iter(plain)
    assert next(reads).flatten().tolist() == [5.0, 6.0, 7.0, 8.0], "worker 1 read one batch before: it counts on from 4"
    del reads


def test_a_position_saved_before_the_streams_were_carried_keeps_the_datasets_own_state() -> None:
    """A checkpoint taken by a loader whose workers did not carry their streams, resumed by one that does."""
    old = StatefulDataLoader(Counting(), batch_size=2, num_workers=2)
    reads = iter(old)
    for _ in range(3):
        next(reads)
    position = old.state_dict()
    expected = [next(reads).flatten().tolist() for _ in range(2)]
    resumed = StatefulDataLoader(Counting(), batch_size=2, num_workers=2)
    workerstreams.carry(resumed)
    resumed.load_state_dict(position)
    again = iter(resumed)
    assert [next(again).flatten().tolist() for _ in range(2)] == expected == [[3.0, 4.0], [5.0, 6.0]]


class Stream(IterableDataset[torch.Tensor]):
    """An iterable dataset split between the workers, each sample drawn with a random jitter (``jitter``)."""

    def __init__(self, jitter: bool = True) -> None:
        self.jitter = jitter

    def _mine(self) -> list[int]:
        info = get_worker_info()
        return list(range(info.id, 48, info.num_workers)) if info is not None else list(range(48))

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in self._mine():
            yield torch.tensor([float(i)]) + (torch.rand(1) if self.jitter else 0.0)


class ResumingStream(Stream):
    """The same, resuming from a position of its own (so torchdata does not read it again to resume)."""

    def __init__(self, jitter: bool = True) -> None:
        super().__init__(jitter)
        self.done = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        mine = self._mine()
        while self.done < len(mine):
            self.done += 1
            yield torch.tensor([float(mine[self.done - 1])]) + (torch.rand(1) if self.jitter else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = state["done"]


def test_an_iterable_dataset_that_resumes_itself_and_draws_in_its_workers_refuses_live_moves() -> None:
    rt = plain_runtime()
    data = rt.epochs(StatefulDataLoader(ResumingStream(), batch_size=4, num_workers=2))
    quiet = rt.epochs(StatefulDataLoader(ResumingStream(jitter=False), batch_size=4, num_workers=2), name="quiet")
    for _ in range(3):
        quiet.batch()
    assert not rt._s.refused, "workers that draw nothing are moved live"
    data.batch()
    assert "IterableDataset ResumingStream" in rt._s.refused and "global torch random stream" in rt._s.refused
    assert "data" in rt._s.vote.lenient, "which streams its workers drew from may differ by rank: not a reason to stop"


def test_an_iterable_dataset_torchdata_reads_again_to_resume_keeps_its_streams_and_moves_live() -> None:
    """Without a state of its own, a resumed worker reads every sample again from the same seed: the
    watch must leave it so (a state of any kind would stop torchdata from reading again)."""
    rt = plain_runtime()
    torch.manual_seed(0)
    sender = rt.epochs(StatefulDataLoader(Stream(), batch_size=4, num_workers=2))
    for _ in range(3):
        sender.batch()
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(5)]
    torch.manual_seed(1)
    joiner = rt.epochs(StatefulDataLoader(Stream(), batch_size=4, num_workers=2), name="joiner")
    joiner.load_state_dict(position)
    assert all(torch.equal(a, b) for a, b in zip(expected, [joiner.batch() for _ in range(5)], strict=True))
    assert not rt._s.refused
