"""The training data as Lightning iterates it under rlaunch: each step begun before its first batch.

Lightning injects a ``DistributedSampler`` into the train ``DataLoader`` and then hands the loader
to the strategy (``Strategy.process_dataloader``). There, :func:`train_data` wraps it in
:class:`TrainData`, which Lightning iterates in its place:

- every read first calls ``before_read`` (the strategy begins the runtime step there, at the
  first batch of each step), so a step's boundary is a point both the rank that leaves and the
  rank that joins reach in the same code, before the batch is read;
- the batches come from ``rt.epochs`` over a torchdata ``StatefulDataLoader``: the position is
  the same on every rank, a redone step gets its batches again, and a joiner resumes at the
  same sample with its own partition. A plain ``torch.utils.data.DataLoader`` is made again as a
  ``StatefulDataLoader`` with the same arguments (its batches are the same);
- the order of a sampler Lightning wraps in its ``DistributedSamplerWrapper`` comes from a
  generator at each epoch's start (torchdata's ``RandomSampler`` holds one of its own; torch's
  ``RandomSampler`` without one draws from the global generator): that generator's state at the
  epoch's start goes with the position, so a joiner reads the same order.

What cannot be resumed at a sample (another loader class, a custom sampler or batch sampler, an
``IterableDataset``) is read as it is, and :func:`train_data` returns the sentence that refuses
live moves for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from rlaunch.lightning import packages

DistributedSamplerWrapper = packages.fabric("utilities.distributed").DistributedSamplerWrapper

if TYPE_CHECKING:
    from rlaunch.runtime.data import EpochLoader
    from rlaunch.runtime.runtime import Runtime

#: DataLoader arguments carried over when a plain DataLoader is made again as a StatefulDataLoader
_LOADER_ARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)  # fmt: skip


class TrainData:
    """What Lightning iterates for training (see the module docstring); sized like the loader."""

    def __init__(self, loader: Any, before_read: Callable[[], None]) -> None:
        self.loader = loader
        self.data: EpochLoader | None = None  # None: read as it is (live moves refused)
        self._before_read = before_read
        self._plain: Iterator[Any] | None = None
        self._settled = False

    def settle(self, loader: Any, data: EpochLoader | None) -> None:
        """What is read. Set at once, except for a loader Lightning set up before the strategy's setup
        (``estimated_stepping_batches`` read in ``configure_optimizers``): that one waits for the
        setup's end, and Lightning, which set it up once, keeps iterating this object."""
        self.loader, self.data, self._settled = loader, data, True
        if data is None:  # read as Lightning would: it sets the samplers' epoch itself (rt.epochs does otherwise)
            self.sampler, self.batch_sampler = loader.sampler, loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        # Not settled: Lightning's first iter(), during the setup; the epoch's iterator is made at its first read.
        self._plain = iter(self.loader) if self.data is None and self._settled else None
        return _Reads(self)

    def read(self) -> Any:
        self._before_read()
        if self.data is not None:
            return self.data.batch()
        if self._plain is None:
            self._plain = iter(self.loader)
        return next(self._plain)

    # Lightning's checkpoints save the train loader's state when it has one: the position (the
    # restart path resumes a checkpoint taken mid-epoch at the same sample, as with a StatefulDataLoader).
    def state_dict(self) -> dict[str, Any]:
        return dict(self.data.position) if self.data is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.data is not None and state:
            self.data.load_state_dict(state)


class _Reads(Iterator[Any]):
    """One epoch's iterator: Lightning reads exactly ``len(loader)`` batches from it."""

    def __init__(self, owner: TrainData) -> None:
        self._owner = owner

    def __next__(self) -> Any:
        return self._owner.read()


def train_data(rt: Runtime, train: TrainData, *, as_is: bool = False) -> str:
    """Settle the train loader Lightning prepared (``train.loader``); the sentence refusing live moves
    ("" when none).

    ``as_is``: live moves are refused already (``limit_train_batches`` cutting epochs short, say),
    so the loader is read as Lightning reads it, with nothing to resume.
    """
    _seed_workers(train.loader, max(rt.rank, 0))
    if as_is:
        train.settle(train.loader, None)
        return ""
    loader, data, why = resumable(rt, train.loader)
    train.settle(loader, data)
    return why


class WorkerSeeds:
    """The ``worker_init_fn`` Lightning adds to a loader when ``seed_everything(workers=True)`` was
    called (each worker's streams from its base seed, worker id and global rank), with the rank a
    joiner takes: the strategy sets ``rank`` when it joins, before its workers start."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        pl_worker_init_function = packages.fabric("utilities.seed").pl_worker_init_function

        pl_worker_init_function(worker_id, rank=self.rank)


def _seed_workers(loader: Any, rank: int) -> None:
    """What Lightning does after the strategy wrapped the loader (it no longer sees a DataLoader there)."""
    if int(os.environ.get("PL_SEED_WORKERS", "0")) and getattr(loader, "worker_init_fn", 0) is None:
        loader.worker_init_fn = WorkerSeeds(rank)


def resumable(rt: Runtime, loader: Any, name: str = "data", track: bool = True) -> tuple[Any, EpochLoader | None, str]:
    """The loader to read (a plain DataLoader made a StatefulDataLoader), ``rt.epochs`` over it (tracked
    as ``name`` unless ``track`` is False), or None and the sentence that says why a joiner could not
    resume it at the same sample."""
    why = unmovable(loader)
    if why:
        return loader, None, why
    sampler = loader.batch_sampler.sampler
    if type(loader) is DataLoader:
        loader = _stateful(loader)
    order_rng = _order_rng(sampler)
    if order_rng is not None:
        sampler.__class__ = OneOrderPerEpoch  # the same object, drawing its order once per epoch
    return loader, rt.epochs(loader, sampler=sampler, order_rng=order_rng, name=name, track=track), ""


class OneOrderPerEpoch(DistributedSamplerWrapper):  # type: ignore[misc,valid-type]
    """Lightning's ``DistributedSamplerWrapper`` drawing the wrapped sampler's order once per
    ``set_epoch``: a resumed ``StatefulDataLoader`` iterates its sampler more than once while it finds
    its place, and each iteration of the wrapper draws another order (from the wrapped sampler's
    generator). The first draw after ``set_epoch`` is the epoch's, as in a run that iterates each
    epoch once."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._drawn = False

    def __iter__(self) -> Iterator[Any]:
        if not getattr(self, "_drawn", False):
            self.dataset.reset()
            self._drawn = True
        indices: Iterator[int] = DistributedSampler.__iter__(self)
        return (self.dataset[index] for index in indices)


def unmovable(loader: Any) -> str:
    """Why a joiner could not resume ``loader`` at the same sample ("" when it can)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    name = type(loader).__name__
    if type(loader) is not DataLoader and not isinstance(loader, StatefulDataLoader):
        return (
            f"The train loader is a {name}, which a joiner cannot resume at the same sample; use torch's "
            "DataLoader or torchdata's StatefulDataLoader."
        )
    if isinstance(loader.dataset, IterableDataset):
        return (
            "The train loader reads an IterableDataset, which splits its data by rank itself and which a joiner "
            "cannot resume at the same sample; use a map-style dataset."
        )
    batch_sampler: Any = loader.batch_sampler
    if type(batch_sampler) is not BatchSampler and not _is_torchdata_batch_sampler(batch_sampler):
        return (
            f"The train loader has a batch sampler of its own ({type(batch_sampler).__name__}), whose "
            "position a joiner cannot take; pass batch_size= and keep use_distributed_sampler=True (the default)."
        )
    sampler = batch_sampler.sampler  # Lightning passes a StatefulDataLoader's sampler in its batch sampler
    if not isinstance(sampler, DistributedSampler):
        return (
            f"The train loader's sampler is a {type(sampler).__name__}, not a DistributedSampler, so a joiner "
            "could not read its new rank's part; keep use_distributed_sampler=True (the default)."
        )
    if isinstance(sampler, DistributedSamplerWrapper):
        inner = sampler.dataset._sampler
        if _order_rng(sampler) is None:
            return (
                f"Lightning wrapped the sampler {type(inner).__name__} in its DistributedSamplerWrapper, whose "
                "order a joiner cannot reproduce; pass shuffle=True (or torch's RandomSampler) and let Lightning "
                "add its DistributedSampler, or pass your own DistributedSampler with use_distributed_sampler=False."
            )
    elif type(sampler) is not DistributedSampler:
        return (
            f"The train loader's sampler is a {type(sampler).__name__}, a DistributedSampler of its own whose order "
            "a joiner might not reproduce; use torch's DistributedSampler."
        )
    return ""


def _order_rng(sampler: Any) -> torch.Generator | None:
    """The generator a sampler's order comes from at each epoch's start: a ``DistributedSamplerWrapper``
    over a sampler whose order is drawn from its own generator or from the global one (None for
    torch's ``DistributedSampler``, whose order is seed and epoch, and for samplers it cannot know)."""
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    if not isinstance(sampler, DistributedSamplerWrapper):
        return None
    inner = sampler.dataset._sampler
    if type(inner) in (RandomSampler, WeightedRandomSampler, SubsetRandomSampler, StatefulRandomSampler):
        generator = getattr(inner, "generator", None)
        return generator if isinstance(generator, torch.Generator) else torch.default_generator
    return None


def _is_torchdata_batch_sampler(batch_sampler: Any) -> bool:
    from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler

    return type(batch_sampler) is StatefulBatchSampler


def _stateful(loader: DataLoader[Any]) -> Any:
    """The same loader as a torchdata ``StatefulDataLoader`` (same dataset, sampler, batches, workers)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    if not loader.num_workers:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return StatefulDataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **kwargs
    )
