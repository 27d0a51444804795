"""The random streams a loader's dataset draws from, carried in the loader's position.

A map-style dataset read in worker processes (``num_workers > 0``) that draws random numbers (a
random transform) draws them from the worker's own streams: torch's, Python's and NumPy's, seeded
when the worker starts (from the loader's base seed and the worker's id, or by the script's
``worker_init_fn``) and advanced by every sample the worker reads. torchdata's ``StatefulDataLoader``
saves each worker's position with its dataset's state (a dataset with ``state_dict``), taken in
the worker after the batches that position counts; it does not save the streams. A joiner's resumed
workers started theirs from the seeds again, so its batches' transforms differed from an
uninterrupted run's for the rest of the epoch, silently. The same holds for a generator the dataset
keeps in an attribute of its own (``self.rng = np.random.default_rng(seed)``), in worker processes
and in the loader's own process alike (:mod:`rlaunch.runtime.heldgenerators`).

:class:`CarryStreams`, put after the loader's own ``worker_init_fn``, gives each worker's copy of
the dataset that state: the worker's streams and the generators the dataset holds (as one JSON
string: it travels in the transfer's ``weights_only`` blob), beside the dataset's own state when it
has one. A worker resumed from a position takes them back before it reads. Streams that nothing
drew from since the worker seeded them are not put in the state, so a loader whose workers draw
nothing keeps the same position on every rank even when its workers are seeded per rank
(``seed_everything(workers=True)``). A loader without workers gets the same for the generators its
dataset holds (:func:`carry`; the global streams of that process are the runtime's own to carry).

Streams that are drawn from may differ by rank: workers seeded per rank, or a transform that draws
as many numbers as its sample asks for (a crop retried until it fits). A replica's position then
would not give a lost rank its own streams, so ``rt.epochs`` tracks such a loader's position as
state the same on every rank only while the script keeps it so (``rt.track_if_same``): once the vote
finds it differs, a drain still moves it and a live replacement is refused with a sentence.

An ``IterableDataset`` is resumed by torchdata in one of two ways. Without a state of its own, a
resumed worker reads again every sample since the epoch's start, from the same seeds, so its streams
come back by themselves. With one (the dataset's or its iterator's ``state_dict``), the dataset
resumes itself, and where its iteration draws is its own: the streams cannot be put back at the
right moment from outside (a shard order drawn when the iteration starts would be drawn again from
them). Such a dataset whose workers draw from the global streams is not moved live: its position
says so (:data:`NOT_CARRIED`) and ``rt.epochs`` refuses live moves with a sentence (:func:`not_carried`).
Only the dataset's own ``state_dict`` is watched: one on its iterator alone is not seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from rlaunch.runtime import heldgenerators, rng

#: the key of the streams in the state a dataset reports, and of its own state when that is not a dict
STREAMS, DATASET = "rlaunch_worker_streams", "rlaunch_dataset_state"
#: the key of a watched ``IterableDataset``'s state naming the global streams its worker drew from
NOT_CARRIED = "rlaunch_streams_not_carried"
#: in the streams' JSON: the generators the dataset holds, by attribute name
HELD = "held"


class CarryStreams:
    """A loader's ``worker_init_fn``: the script's own (``then``) runs first, then the worker's dataset
    is given the state described in the module docstring. Picklable (a spawned worker gets a copy)."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.then is not None:
            self.then(worker_id)
        info = get_worker_info()
        if info is None:
            return
        if isinstance(info.dataset, IterableDataset):
            _Watch(info.dataset).attach()
        else:
            _Streams(info.dataset, in_worker=True).attach()


def _own_state(dataset: Any) -> tuple[Any, Any]:
    """The dataset's own ``state_dict`` and ``load_state_dict`` (Nones unless it has both, as torchdata asks)."""
    own_state, own_load = getattr(dataset, "state_dict", None), getattr(dataset, "load_state_dict", None)
    return (own_state, own_load) if callable(own_state) and callable(own_load) else (None, None)


def _attach(dataset: Any, state_dict: Any, load_state_dict: Any) -> bool:
    try:
        dataset.state_dict = state_dict
        dataset.load_state_dict = load_state_dict
        return True
    except AttributeError:  # a dataset with __slots__ takes no attributes: its streams are not carried
        return False


class _Streams:
    """The ``state_dict`` and ``load_state_dict`` a map-style dataset is given (its own, if it has
    them, are called inside): in a worker, the worker's streams and the generators the dataset holds,
    once drawn from; in the loader's own process, the generators it holds, always (the dataset object
    there is the one a standby's sandbox read from too). With nothing to carry, the state is the
    dataset's own, as without rlaunch; with something, its own with one key more (:func:`_merged`)."""

    def __init__(self, dataset: Any, *, in_worker: bool) -> None:
        self.dataset, self.in_worker = dataset, in_worker
        self.own_state, self.own_load = _own_state(dataset)
        self.seeded = self._prints(self._held())
        self.drawn: set[str] = set()  # the streams drawn from since they were seeded: always reported
        # in the loader's process, the generators and the attributes as the loader's first read found
        # them: what a position from before that read stands for (see rewind; set by first_read)
        self.built: dict[str, Any] = {}
        self.attributes: dict[str, Any] = {}
        self.settled = False

    def attach(self) -> bool:
        return _attach(self.dataset, self.state_dict, self.load_state_dict)

    def _held(self) -> dict[str, Any]:
        return {name: heldgenerators.encode(g) for name, g in heldgenerators.held(self.dataset).items()}

    def _prints(self, held: dict[str, Any]) -> dict[str, int]:
        prints = {name: _digest(value) for name, value in held.items()}
        if self.in_worker:
            prints.update({f"global.{name}": value for name, value in rng.fingerprints(_streams()).items()})
        return prints

    def first_read(self) -> None:
        """The loader's first iterator (not a resumed one) is about to read, or a position is loaded before
        any read here (then as this process's first read would find them: draws every rank made alike
        stand): remember where things stand, once."""
        if not self.settled:
            self.built, self.attributes = self._held(), heldgenerators.attributes(self.dataset)
            self.settled = True

    def state_dict(self) -> Any:
        held = self._held()
        if self.in_worker:
            now = self._prints(held)
            self.drawn.update(name for name, print_ in now.items() if print_ != self.seeded.get(name))
        else:
            self.drawn.update(held)
        own = self.own_state() if self.own_state is not None else None
        return _merged(own, STREAMS, _encode(_streams() if self.in_worker else None, held, self.drawn))

    def load_state_dict(self, state: Any) -> None:
        value, own = _split(state, STREAMS)
        if self.own_load is not None and own is not None:
            self.own_load(own)
        carried = json.loads(value) if value is not None else {}
        held = carried.pop(HELD, {})
        for name, generator in held.items():
            heldgenerators.restore(self.dataset, name, generator)
        self.drawn.update(held)
        if carried and self.in_worker:
            rng.restore(rng.from_json({**rng.to_json(_streams()), **carried}))
            self.drawn.update(f"global.{name}" for name, key in _KEYS.items() if key in carried)

    def rewind(self, keep: set[str]) -> None:
        """Put the generators the dataset holds, but those in ``keep``, back as the loader's first read
        found them (one made since then is unmade): in this process, a standby's sandbox read from the
        same dataset object."""
        self.first_read()
        for name in set(heldgenerators.held(self.dataset)) - keep:
            if name in self.built:
                heldgenerators.restore(self.dataset, name, self.built[name])
                continue
            obj, attribute = heldgenerators.owner(self.dataset, name)
            if name in self.attributes:
                setattr(obj, attribute, self.attributes[name])  # what it held then (a seed, None)
            else:
                delattr(obj, attribute)


def _merged(own: Any, key: str, value: Any) -> Any:
    """The dataset's own state with ``key``: ``value`` added (its own as it is when ``value`` is None), so
    that a position saved under rlaunch still loads into the dataset without it."""
    if value is None:
        return own
    if own is None:
        return {key: value}
    if isinstance(own, dict) and key not in own:
        return {**own, key: value}
    return {key: value, DATASET: own}


def _split(state: Any, key: str) -> tuple[Any, Any]:
    """``key``'s value and the dataset's own state, from a state :func:`_merged` made (or one saved
    without rlaunch, or before it carried anything: all the dataset's own)."""
    if not isinstance(state, dict) or key not in state:
        return None, state
    rest = {k: v for k, v in state.items() if k != key}
    if set(rest) == {DATASET}:
        return state[key], rest[DATASET]
    return state[key], rest or None


class _Watch:
    """The ``state_dict`` an ``IterableDataset`` with a state of its own is given in a worker: its own,
    with the global streams the worker drew from (:data:`NOT_CARRIED`; see the module docstring). A
    dataset without one keeps none, so torchdata still resumes it by reading again."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.own_state, self.own_load = _own_state(dataset)
        self.seeded = rng.fingerprints(_streams())

    def attach(self) -> None:
        if self.own_state is not None:
            _attach(self.dataset, self.state_dict, self.load_state_dict)

    def state_dict(self) -> Any:
        now = rng.fingerprints(_streams())
        drawn = sorted(name for name, print_ in now.items() if print_ != self.seeded.get(name))
        return _merged(self.own_state(), NOT_CARRIED, ", ".join(drawn) or None)

    def load_state_dict(self, state: Any) -> None:
        self.own_load(_split(state, NOT_CARRIED)[1])


#: each stream's name in rng.fingerprints, and its key in rng.to_json
_KEYS = {"torch": "torch_cpu", "python": "python", "numpy": "numpy"}


def _streams() -> rng.RngState:
    """This process's global streams (a loader's worker never uses the GPU's)."""
    return dataclasses.replace(rng.capture(), cuda=None, cuda_device=None)


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(json.dumps(value).encode(), digest_size=8).digest(), "little")


def _encode(streams: rng.RngState | None, held: dict[str, Any], drawn: set[str]) -> str | None:
    """The streams drawn from, as one string (None when none was). One string: torchdata merges a
    worker's successive states key by key, and keys it adds come out in an order of its own in each
    process (a set's), which would make the same position fingerprint differently on two ranks."""
    out: dict[str, Any] = {}
    if streams is not None and any(name.startswith("global.") for name in drawn):
        values = rng.to_json(streams)
        out = {key: values[key] for name, key in _KEYS.items() if f"global.{name}" in drawn}
    kept = {name: value for name, value in held.items() if name in drawn}
    if kept:
        out[HELD] = kept
    return json.dumps(out, sort_keys=True) if out else None


def carry(loader: Any) -> None:
    """Make ``loader``'s dataset report the streams it draws from (see the module docstring), before
    the loader reads: its workers' streams and the generators the dataset holds, or, without
    workers, the generators the dataset holds (now or once it made them); an ``IterableDataset``'s
    workers are watched instead. Nothing changes for the batches."""
    if getattr(loader, "num_workers", 0):
        if not isinstance(loader.worker_init_fn, CarryStreams):
            loader.worker_init_fn = CarryStreams(loader.worker_init_fn)
        return
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset) or _attached(loader) is not None:
        return
    _Streams(dataset, in_worker=False).attach()


def _attached(loader: Any) -> _Streams | None:
    """The state :func:`carry` gave ``loader``'s dataset in this process (None: none)."""
    owner = getattr(getattr(getattr(loader, "dataset", None), "state_dict", None), "__self__", None)
    return owner if isinstance(owner, _Streams) else None


def carried(loader: Any) -> bool:
    """Whether ``loader``'s position holds streams that may differ by rank (see :func:`carry`): its
    workers' (or, over an ``IterableDataset`` with a state of its own, which of them its workers drew
    from), from the start; or generators its dataset holds in this process, once it reported one."""
    if isinstance(getattr(loader, "worker_init_fn", None), CarryStreams):
        return not isinstance(loader.dataset, IterableDataset) or _own_state(loader.dataset)[0] is not None
    streams = _attached(loader)
    return streams is not None and bool(streams.drawn)


def carries(position: Any) -> bool:
    """Whether a loader's ``position`` holds any streams (:func:`carried` for a position received)."""
    return any(True for _ in _found(position, STREAMS))


def held_print(loader: Any) -> int | None:
    """A print of the generators ``loader``'s map-style dataset holds in this process (None: none).
    With workers, each epoch's workers start from this process's copy."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    held = {name: heldgenerators.encode(g) for name, g in heldgenerators.held(dataset).items()}
    return _digest(held) if held else None


def first_read(loader: Any) -> None:
    """``loader``'s first iterator (not a resumed one) is about to read (see :func:`settle`)."""
    streams = _attached(loader)
    if streams is not None:
        streams.first_read()


def settle(loader: Any, position: Any) -> None:
    """``loader`` was given ``position`` (in this process, its dataset's held generators are set from
    it when its next iterator starts): the generators the dataset holds that the position does not
    are put back as the loader's first read found them (a standby's sandbox drew from them, or made
    them). A position from before the first read holds none."""
    streams = _attached(loader)
    if streams is None:
        return
    keep: set[str] = set()
    for value in _found(position, STREAMS):
        keep.update(json.loads(value).get(HELD, {}))
    streams.rewind(keep)


def watched(loader: Any) -> bool:
    """Whether ``loader``'s positions may say that its workers' streams are not carried (:func:`not_carried`)."""
    return isinstance(getattr(loader, "worker_init_fn", None), CarryStreams) and isinstance(
        getattr(loader, "dataset", None), IterableDataset
    )


def not_carried(position: Any) -> str:
    """The global streams a watched ``IterableDataset``'s workers drew from, as the loader's
    ``position`` names them ("" when none did)."""
    names = sorted({name for found in _found(position, NOT_CARRIED) for name in found.split(", ")})
    return ", ".join(names)


def _found(value: Any, key: str) -> Iterator[Any]:
    """The values under ``key`` that are not None, anywhere in ``value``."""
    if isinstance(value, dict):
        if value.get(key) is not None:
            yield value[key]
        for v in value.values():
            yield from _found(v, key)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _found(v, key)


def script_init(fn: Any) -> Any:
    """The script's own ``worker_init_fn`` under :class:`CarryStreams` (``fn`` itself otherwise)."""
    return fn.then if isinstance(fn, CarryStreams) else fn
