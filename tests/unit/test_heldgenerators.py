"""Generators a dataset holds in its own attributes move with the loader's position.

Real torchdata ``StatefulDataLoader``s, read in two worker processes or in the loader's own
process. A joiner's loader, resumed from a position taken partway through an epoch (sent through
a ``weights_only`` blob), must read the batches the sender goes on to read, random transforms drawn
from the dataset's own generator included.
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, random_split
from torchdata.stateful_dataloader import StatefulDataLoader

from rlaunch.runtime import heldgenerators
from rlaunch.runtime.data import EpochLoader
from tests.one_rank import plain_runtime


class OwnNumpy(Dataset[torch.Tensor]):
    """A transform drawn from a NumPy generator each worker makes at its first read (the usual way to
    give each worker a stream of its own), seeded from the worker's torch seed."""

    def __init__(self) -> None:
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            self.rng = np.random.default_rng(torch.initial_seed() % 2**32)
        return torch.tensor([float(i) + self.rng.random()])


class SeedThenNumpy(OwnNumpy):
    """Keeps its seed in the attribute its generator takes at the first read."""

    def __init__(self) -> None:
        self.rng: Any = 1234

    def __getitem__(self, i: int) -> torch.Tensor:
        if isinstance(self.rng, int):
            self.rng = np.random.default_rng(self.rng)
        return torch.tensor([float(i) + self.rng.random()])


class OwnTorch(Dataset[torch.Tensor]):
    """A transform drawn from a torch generator made with the dataset (read in the loader's process)."""

    def __init__(self, seed: int = 7) -> None:
        self.noise = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1, generator=self.noise)


def _through_the_wire(state: dict[str, Any]) -> dict[str, Any]:
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)  # type: ignore[no-any-return]


def _resumed(make: Any, workers: int, carried: bool = True, sandbox_reads: int = 0) -> tuple[list[Any], list[Any]]:
    """Five batches read on after a position taken at batch 3, by the loader itself and by a joiner's
    (whose sandbox first read ``sandbox_reads`` batches of its own from the same dataset object)."""
    torch.manual_seed(0)
    sender = EpochLoader(StatefulDataLoader(make(), batch_size=4, num_workers=workers), None, lambda: 0)
    for _ in range(3):
        sender.batch()
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(5)]
    torch.manual_seed(1)
    dataset = make()
    joiner = EpochLoader(StatefulDataLoader(dataset, batch_size=4, num_workers=workers), None, lambda: 0)
    if not carried:  # as rt.epochs was before held generators were carried
        del dataset.state_dict, dataset.load_state_dict
    for _ in range(sandbox_reads):
        joiner.batch()
    joiner.load_state_dict(position)
    return expected, [joiner.batch() for _ in range(5)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("make", [OwnNumpy, SeedThenNumpy], ids=["none-until-made", "seed-until-made"])
def test_a_generator_each_worker_makes_at_its_first_read_is_carried_to_a_joiners_workers(make: Any) -> None:
    expected, got = _resumed(make, workers=2)
    assert _same(expected, got)


def test_a_cold_joiner_makes_the_generator_whose_seed_its_dataset_still_holds() -> None:
    expected, got = _resumed(SeedThenNumpy, workers=0)
    assert _same(expected, got)


def test_a_generator_the_dataset_holds_is_carried_in_the_loaders_own_process() -> None:
    expected, got = _resumed(OwnTorch, workers=0, sandbox_reads=2)
    assert _same(expected, got), "the joiner's sandbox drew from the same dataset object first"


def test_a_generator_the_dataset_makes_at_its_first_read_is_carried_in_the_loaders_own_process() -> None:
    expected, got = _resumed(OwnNumpy, workers=0, sandbox_reads=2)
    assert _same(expected, got)


@pytest.mark.parametrize("make", [OwnTorch, OwnNumpy], ids=["built", "made-at-first-read"])
def test_a_joiner_given_the_position_from_before_the_first_read_reads_what_the_sender_read(make: Any) -> None:
    """Nothing in that position says where the generators stand: they are put back as the dataset was
    built, whatever the joiner's sandbox drew from the same dataset object."""
    torch.manual_seed(0)
    sender = EpochLoader(StatefulDataLoader(make(), batch_size=4), None, lambda: 0)
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(3)]
    joiner = EpochLoader(StatefulDataLoader(make(), batch_size=4), None, lambda: -1)  # a sandbox reads for -1
    joiner.batch()
    joiner.batch()
    joiner._rank = lambda: 0  # the rank it joins as
    joiner.load_state_dict(position)
    assert _same(expected, [joiner.batch() for _ in range(3)])


@pytest.mark.parametrize(
    ("make", "peek"), [(SeedThenNumpy, False), (OwnTorch, True)], ids=["seed-in-the-attribute", "drawn-before-reading"]
)
def test_a_position_from_before_the_first_read_stands_for_the_generators_as_that_read_found_them(
    make: Any, peek: bool
) -> None:
    """``peek``: the script looks at a sample (drawing from the generator) after rt.epochs, before its
    loader reads, on every rank alike."""
    torch.manual_seed(0)
    sender = EpochLoader(StatefulDataLoader(make(), batch_size=4), None, lambda: 0)
    if peek:
        sender._loader.dataset[0]
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(3)]
    joiner = EpochLoader(StatefulDataLoader(make(), batch_size=4), None, lambda: -1)
    if peek:
        joiner._loader.dataset[0]
    joiner.batch()
    joiner.batch()
    joiner._rank = lambda: 0
    joiner.load_state_dict(position)
    assert _same(expected, [joiner.batch() for _ in range(3)])


class LateNumpy(OwnNumpy):
    """Makes its generator, with a seed of its own, at the first sample that needs one (from sample 8 on)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i < 8:
            return torch.tensor([float(i)])
        if self.rng is None:
            self.rng = np.random.default_rng(1234)
        return torch.tensor([float(i) + self.rng.random()])


def test_a_generator_the_sender_had_not_made_yet_is_unmade_in_the_joiner() -> None:
    torch.manual_seed(0)
    sender = EpochLoader(StatefulDataLoader(LateNumpy(), batch_size=4), None, lambda: 0)
    sender.batch()
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(3)]
    torch.manual_seed(1)
    joiner = EpochLoader(StatefulDataLoader(LateNumpy(), batch_size=4), None, lambda: -1)
    for _ in range(3):  # its sandbox made the generator from its own seed
        joiner.batch()
    joiner._rank = lambda: 0
    joiner.load_state_dict(position)
    assert _same(expected, [joiner.batch() for _ in range(3)])


def test_a_joiner_holds_a_received_position_with_generators_to_the_same_state_only_while_it_is() -> None:
    """Before its first read, as the ranks that sent the position do."""
    rt = plain_runtime()
    sender = EpochLoader(StatefulDataLoader(OwnTorch(), batch_size=4), None, lambda: 0)
    sender.batch()
    joiner = rt.epochs(StatefulDataLoader(OwnTorch(), batch_size=4))
    assert not rt._s.vote.lenient
    joiner.load_state_dict(_through_the_wire(sender.state_dict()))
    assert rt._s.vote.lenient == {"data"}


@pytest.mark.parametrize(("make", "workers"), [(OwnNumpy, 2), (OwnTorch, 0)], ids=["workers", "no-workers"])
def test_a_generator_under_random_splits_parts_is_carried(make: Any, workers: int) -> None:
    def part() -> Dataset[torch.Tensor]:
        return random_split(make(), [40, 8], generator=torch.Generator().manual_seed(0))[0]

    expected, got = _resumed(part, workers=workers, sandbox_reads=2)
    assert _same(expected, got)


def test_a_generator_another_loader_draws_from_between_reads_refuses_live_moves() -> None:
    """random_split's train and validation parts share the dataset and its generator: the train loader's
    position, taken at its own reads, cannot say where the generator stands after the validation's."""
    rt = plain_runtime()
    train_part, val_part = random_split(OwnTorch(), [40, 8], generator=torch.Generator().manual_seed(0))
    train = rt.epochs(StatefulDataLoader(train_part, batch_size=4))
    for _ in range(3):
        train.batch()
        train.state_dict()  # a step's start
    assert not rt._s.refused, "nothing else drew from it yet"
    next(iter(StatefulDataLoader(val_part, batch_size=4)))
    train.state_dict()
    assert "holds a random generator that something besides its loader drew from" in rt._s.refused


def test_a_generator_a_loader_without_workers_draws_from_under_one_with_workers_refuses_live_moves() -> None:
    """The train part read in workers, the validation part in this process: each train epoch's workers
    start from this process's copy of the generator, which the validation moved."""
    rt = plain_runtime()
    train_part, val_part = random_split(OwnTorch(), [40, 8], generator=torch.Generator().manual_seed(0))
    train = rt.epochs(StatefulDataLoader(train_part, batch_size=4, num_workers=2))
    train.batch()
    train.state_dict()
    assert not rt._s.refused
    next(iter(StatefulDataLoader(val_part, batch_size=4)))
    train.state_dict()
    assert "read it in loader worker processes too" in rt._s.refused


def test_a_position_from_before_the_first_read_leaves_what_every_rank_drew_alike_to_a_cold_joiner() -> None:
    """A script that looks at a sample after rt.epochs, before reading; a standby whose sandbox never read."""
    torch.manual_seed(0)
    sender = EpochLoader(StatefulDataLoader(OwnTorch(), batch_size=4), None, lambda: 0)
    sender._loader.dataset[0]
    position = _through_the_wire(sender.state_dict())
    expected = [sender.batch() for _ in range(3)]
    joiner = EpochLoader(StatefulDataLoader(OwnTorch(), batch_size=4), None, lambda: -1)
    joiner._loader.dataset[0]
    joiner._rank = lambda: 0
    joiner.load_state_dict(position)
    assert _same(expected, [joiner.batch() for _ in range(3)])


def test_the_global_generators_a_dataset_refers_to_are_not_its_own() -> None:
    """The runtime carries those with the step: a dataset holding one (``generator or
    torch.default_generator``) would otherwise see every draw of the training step as another reader's."""

    class Defaults:
        def __init__(self) -> None:
            self.gen = torch.default_generator
            self.py = random._inst  # type: ignore[attr-defined]
            self.np = np.random.mtrand._rand

    assert heldgenerators.held(Defaults()) == {}


def test_without_carrying_a_joiner_would_draw_other_transforms() -> None:
    expected, got = _resumed(OwnTorch, workers=0, carried=False)
    assert not _same(expected, got), "the test could not fail"


def test_rt_epochs_holds_a_loader_whose_dataset_holds_generators_to_the_same_state_only_while_it_is() -> None:
    """A generator seeded per rank makes the position differ by rank: a loader whose position carries
    one is remembered by the vote when it differs, not refused (a drain still moves it)."""
    rt = plain_runtime()
    loaders = {
        "own": rt.epochs(StatefulDataLoader(OwnTorch(), batch_size=4), name="own"),
        "lazy": rt.epochs(StatefulDataLoader(OwnNumpy(), batch_size=4), name="lazy"),
        "plain": rt.epochs(StatefulDataLoader(range(48), batch_size=4), name="plain"),  # type: ignore[arg-type]
    }
    assert not rt._s.vote.lenient, "nothing carried before the first read"
    for data in loaders.values():
        data.batch()
    assert rt._s.vote.lenient == {"own", "lazy"}, "the lazy one made its generator at its first read"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.Generator().manual_seed(3),
        lambda: random.Random(3),
        lambda: np.random.default_rng(3),
        lambda: np.random.Generator(np.random.MT19937(3)),
        lambda: np.random.Generator(np.random.Philox(3)),
        lambda: np.random.RandomState(3),
    ],
    ids=["torch", "python", "numpy", "numpy-mt19937", "numpy-philox", "numpy-legacy"],
)
def test_every_kind_of_generator_goes_through_json_and_continues_its_stream(make: Any) -> None:
    class Holder:
        pass

    sender, joiner = Holder(), Holder()
    sender.g = make()  # type: ignore[attr-defined]
    _draw(sender.g)  # type: ignore[attr-defined]
    assert list(heldgenerators.held(sender)) == ["g"]
    state = json.loads(json.dumps(heldgenerators.encode(sender.g)))  # type: ignore[attr-defined]
    heldgenerators.restore(joiner, "g", state)  # made where the attribute is missing
    assert _draw(joiner.g) == _draw(sender.g)  # type: ignore[attr-defined]


def _draw(g: Any) -> float:
    if isinstance(g, torch.Generator):
        return float(torch.rand(1, generator=g))
    return float(g.random() if not isinstance(g, np.random.RandomState) else g.random_sample())


def test_a_carried_state_naming_an_unknown_bit_generator_is_refused() -> None:
    state = heldgenerators.encode(np.random.default_rng(0))
    state["state"]["bit_generator"] = "seed"  # np.random.seed would reseed the global stream

    class Holder:
        pass

    with pytest.raises(ValueError, match="unknown bit generator 'seed'"):
        heldgenerators.restore(Holder(), "g", state)


def test_generators_nobody_can_carry_are_not_held() -> None:
    class Holder:
        def __init__(self) -> None:
            self.system = random.SystemRandom()  # no state
            self.count = 3

    assert heldgenerators.held(Holder()) == {}


class Built:
    def __init__(self) -> None:
        self.data = [1, 2, 3]
        self.flag = True
        self.rng = np.random.default_rng(0)


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("__class__", {"kind": "torch", "state": ""}, "names the attribute '__class__'"),
        ("dataset.rng", {"kind": "torch", "state": ""}, "names the attribute 'dataset.rng'"),  # not a Subset
        ("data", {"kind": "torch", "state": ""}, "Built.data, which here holds a list"),
        ("rng", {"kind": "pickle", "state": ""}, "unknown kind 'pickle'"),
        (
            "rng",
            {"kind": "numpy", "state": {"bit_generator": "PCG64", "state": {"ndarray": [0], "dtype": "U200000000"}}},
            "an array no NumPy generator has (U200000000)",
        ),
        ("other", {"kind": "numpy_legacy", "state": ["MT19937", [1, 2], 0, 0, 0.0]}, "holds 2 key words, not 624"),
        ("other", {"kind": "python"}, "state for 'other' is malformed"),
        ("flag", {"kind": "torch", "state": ""}, "Built.flag, which here holds a bool"),  # a bool is no seed
    ],
    ids=["dunder", "path", "not-a-generator", "kind", "dtype", "legacy-keys", "no-state", "bool"],
)
def test_a_received_generator_state_no_dataset_could_have_sent_is_refused(name: str, value: Any, said: str) -> None:
    """The state arrives over the network: it may set only a generator, of the kind the dataset holds."""
    built = Built()
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        heldgenerators.restore(built, name, value)
    assert built.data == [1, 2, 3]
