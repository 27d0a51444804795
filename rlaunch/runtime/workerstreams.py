"""The random streams of a loader's worker processes, carried in the loader's position.

A map-style dataset read in worker processes (``num_workers > 0``) that draws random numbers (a
random transform) draws them from the worker's own streams: torch's, Python's and NumPy's, seeded
when the worker starts (from the loader's base seed and the worker's id, or by the script's
``worker_init_fn``) and advanced by every sample the worker reads. torchdata's ``StatefulDataLoader``
saves each worker's position with its dataset's state (a dataset with ``state_dict``), taken in
the worker after the batches that position counts; it does not save the streams. A joiner's resumed
workers started theirs from the seeds again, so its batches' transforms differed from an
uninterrupted run's for the rest of the epoch, silently.

:class:`CarryStreams`, put after the loader's own ``worker_init_fn``, gives each worker's copy of
the dataset that state: the worker's streams (as a JSON string: it travels in the transfer's
``weights_only`` blob), beside the dataset's own state when it has one. A worker resumed from a
position takes them back before it reads. Streams that nothing drew from since the worker seeded
them are not put in the state, so a loader whose workers draw nothing keeps the same position on
every rank even when its workers are seeded per rank (``seed_everything(workers=True)``).

Streams that are drawn from may differ by rank: workers seeded per rank, or a transform that draws
as many numbers as its sample asks for (a crop retried until it fits). A replica's position then
would not give a lost rank its own streams, so ``rt.epochs`` tracks such a loader's position as
state the same on every rank only while the script keeps it so (``rt.track_if_same``): once the vote
finds it differs, a drain still moves it and a live replacement is refused with a sentence.

Generators a dataset holds itself (a ``torch.Generator``, NumPy's ``default_rng``) are its own
state: a dataset carries them through its own ``state_dict``, which this keeps beside the streams.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from rlaunch.runtime import rng

#: the keys of the state a worker's dataset reports
STREAMS, DATASET = "rlaunch_worker_streams", "dataset"


class CarryStreams:
    """A loader's ``worker_init_fn``: the script's own (``then``) runs first, then the worker's dataset
    is given the state described in the module docstring. Picklable (a spawned worker gets a copy)."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.then is not None:
            self.then(worker_id)
        info = get_worker_info()
        if info is not None:
            _Streams(info.dataset).attach()


class _Streams:
    """The ``state_dict`` and ``load_state_dict`` one worker's dataset is given (its own, if it has
    them, are called inside)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        own_state, own_load = getattr(dataset, "state_dict", None), getattr(dataset, "load_state_dict", None)
        stateful = callable(own_state) and callable(own_load)  # what torchdata asks of a dataset's own state
        self.own_state, self.own_load = (own_state, own_load) if stateful else (None, None)
        self.seeded = rng.fingerprints(_streams())
        self.drawn: set[str] = set()  # the streams drawn from since they were seeded: always reported

    def attach(self) -> None:
        try:
            self.dataset.state_dict = self.state_dict
            self.dataset.load_state_dict = self.load_state_dict
        except AttributeError:  # a dataset with __slots__ takes no attributes: its streams are not carried
            pass

    def state_dict(self) -> dict[str, Any]:
        now = _streams()
        self.drawn.update(name for name, print_ in rng.fingerprints(now).items() if print_ != self.seeded.get(name))
        own = self.own_state() if self.own_state is not None else None
        return {STREAMS: _encode(now, self.drawn), DATASET: own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if STREAMS not in state:  # a position saved without the streams (a checkpoint from before them)
            if self.own_load is not None:
                self.own_load(state)
            return
        if self.own_load is not None and state.get(DATASET) is not None:
            self.own_load(state[DATASET])
        if state.get(STREAMS) is not None:
            carried = json.loads(state[STREAMS])
            rng.restore(rng.from_json({**rng.to_json(_streams()), **carried}))
            self.drawn.update(name for name, key in _KEYS.items() if key in carried)


#: each stream's name in rng.fingerprints, and its key in rng.to_json
_KEYS = {"torch": "torch_cpu", "python": "python", "numpy": "numpy"}


def _streams() -> rng.RngState:
    """This worker's streams (a loader's worker never uses the GPU's)."""
    return dataclasses.replace(rng.capture(), cuda=None, cuda_device=None)


def _encode(streams: rng.RngState, drawn: set[str]) -> str | None:
    """The streams drawn from, as one string (None when none was). One string: torchdata merges a
    worker's successive states key by key, and keys it adds come out in an order of its own in each
    process (a set's), which would make the same position fingerprint differently on two ranks."""
    if not drawn:
        return None
    values = rng.to_json(streams)
    return json.dumps({_KEYS[name]: values[_KEYS[name]] for name in sorted(drawn)}, sort_keys=True)


def carry(loader: Any) -> None:
    """Make ``loader``'s worker processes report their streams (see the module docstring): a loader
    with workers over a map-style dataset, before it starts them. Nothing changes for the batches."""
    if not getattr(loader, "num_workers", 0) or isinstance(getattr(loader, "dataset", None), IterableDataset):
        return
    if isinstance(loader.worker_init_fn, CarryStreams):
        return
    loader.worker_init_fn = CarryStreams(loader.worker_init_fn)


def carried(loader: Any) -> bool:
    """Whether ``loader``'s workers put their streams in its position (see :func:`carry`)."""
    return isinstance(getattr(loader, "worker_init_fn", None), CarryStreams)


def script_init(fn: Any) -> Any:
    """The script's own ``worker_init_fn`` under :class:`CarryStreams` (``fn`` itself otherwise)."""
    return fn.then if isinstance(fn, CarryStreams) else fn
