"""rt.epochs' loader: a redone step takes the same random draws, and a joiner the same sample order."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from rlaunch.runtime.data import EpochLoader


class Noisy(Dataset[torch.Tensor]):
    """A map-style dataset whose items draw from the global torch generator (a random transform)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


def _loader(order_rng: torch.Generator | None = None) -> tuple[EpochLoader, Any]:
    dataset = Noisy()
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset))
    return EpochLoader(loader, None, lambda: 0, order_rng), loader


def test_a_redone_step_gets_its_batch_again_not_a_new_read() -> None:
    torch.manual_seed(0)
    data, _ = _loader()
    data.batch()
    before = data.state_dict()  # a step's start
    first = data.batch()
    data.load_state_dict(before)  # the step is redone
    assert data.batch() is first, "the same batch, not a new read"
    assert not torch.equal(data.batch(), first), "and the next step reads on"


def test_a_redone_read_leaves_the_streams_where_the_first_read_left_them() -> None:
    torch.manual_seed(1)
    data, _ = _loader()
    data.batch()
    before = data.state_dict()
    at_start = torch.get_rng_state()
    data.batch()  # draws: the dataset's transform (and the sampler's seed at an epoch's start)
    after = torch.get_rng_state()
    assert not torch.equal(at_start, after), "the read drew from the global generator"
    data.load_state_dict(before)
    torch.set_rng_state(at_start)  # the runtime puts the step start's streams back
    data.batch()
    assert torch.equal(torch.get_rng_state(), after), "the redone read takes the same draw"


def _joined_reads(order_rng: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three reads on one rank, then a joiner (other global streams) takes its position: both read on."""
    torch.manual_seed(2)
    leaver, _ = _loader(torch.default_generator if order_rng else None)
    for _ in range(3):
        leaver.batch()
    position = leaver.state_dict()
    streams = torch.get_rng_state()
    expected = [leaver.batch().clone() for _ in range(3)]
    torch.manual_seed(99)  # the joiner's sandbox left its streams elsewhere
    joiner, _ = _loader(torch.default_generator if order_rng else None)
    joiner.batch()
    joiner.load_state_dict(position)
    torch.set_rng_state(streams)  # the transfer gives it the leaver's streams
    return expected, [joiner.batch().clone() for _ in range(3)]


def test_a_joiner_reads_the_order_a_sampler_drew_from_the_global_generator_at_the_epochs_start() -> None:
    expected, got = _joined_reads(order_rng=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    expected, got = _joined_reads(order_rng=False)
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (
        "without the epoch's generator state a RandomSampler draws another order: the test can fail"
    )
