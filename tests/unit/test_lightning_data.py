"""The train loaders the Lightning strategy can resume on a joiner, and the sentence for each it cannot
(``rlaunch.lightning.data.unmovable``): the loaders as Lightning hands them to the strategy, its
samplers put in by hand (``num_replicas`` and ``rank`` given: no process group here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402 - after the skip

from rlaunch.lightning.data import DistributedSamplerWrapper, unmovable  # noqa: E402 - it imports Lightning

DATA = TensorDataset(torch.arange(32.0).reshape(16, 2))


class EveryOther(Sampler[int]):
    """A sampler of the script's own, with an order no generator makes."""

    def __iter__(self) -> Iterator[int]:
        return iter([*range(0, 16, 2), *range(1, 16, 2)])

    def __len__(self) -> int:
        return 16


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(8.0))


class MyLoader(DataLoader):  # type: ignore[type-arg]
    pass


class MySampler(DistributedSampler):  # type: ignore[type-arg]
    pass


def distributed(sampler: Sampler[int]) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(DATA, batch_size=4, sampler=sampler)


@pytest.mark.parametrize(
    "loader",
    [
        distributed(DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=3)),
        StatefulDataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=1)),
        distributed(DistributedSamplerWrapper(RandomSampler(DATA), num_replicas=2, rank=0)),
        distributed(
            DistributedSamplerWrapper(RandomSampler(DATA, generator=torch.Generator()), num_replicas=2, rank=1)
        ),
    ],
    ids=["DistributedSampler", "StatefulDataLoader", "wrapped RandomSampler", "wrapped with its own generator"],
)
def test_the_loaders_a_joiner_resumes_are_accepted(loader: DataLoader) -> None:  # type: ignore[type-arg]
    assert unmovable(loader) == ""


@pytest.mark.parametrize(
    ("loader", "sentence"),
    [
        (
            MyLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=0)),
            "The train loader is a MyLoader, which a joiner cannot resume at the same sample; use torch's "
            "DataLoader or torchdata's StatefulDataLoader.",
        ),
        (
            DataLoader(Stream(), batch_size=4),
            "The train loader reads an IterableDataset, which splits its data by rank itself",
        ),
        (
            DataLoader(DATA, batch_sampler=[[0, 1], [2, 3]]),
            "The train loader has a batch sampler of its own (list), whose position a joiner cannot take; pass "
            "batch_size= and keep use_distributed_sampler=True (the default).",
        ),
        (
            DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 4, drop_last=False)),
            "The train loader's sampler is a SequentialSampler, not a DistributedSampler, so a joiner could not "
            "read its new rank's part; keep use_distributed_sampler=True (the default).",
        ),
        (
            distributed(DistributedSamplerWrapper(EveryOther(), num_replicas=2, rank=0)),
            "Lightning wrapped the sampler EveryOther in its DistributedSamplerWrapper, whose order a joiner "
            "cannot reproduce; pass shuffle=True (or torch's RandomSampler) and let Lightning add its "
            "DistributedSampler, or pass your own DistributedSampler with use_distributed_sampler=False.",
        ),
        (
            distributed(MySampler(DATA, num_replicas=2, rank=0)),
            "The train loader's sampler is a MySampler, a DistributedSampler of its own whose order a joiner "
            "might not reproduce; use torch's DistributedSampler.",
        ),
    ],
    ids=[
        "loader subclass",
        "IterableDataset",
        "own batch sampler",
        "not distributed",
        "wrapped own sampler",
        "DistributedSampler subclass",
    ],  # fmt: skip
)
def test_each_loader_a_joiner_cannot_resume_is_named_in_a_sentence(
    loader: DataLoader,  # type: ignore[type-arg]
    sentence: str,
) -> None:
    assert unmovable(loader).startswith(sentence), unmovable(loader)
