"""Random generators a dataset holds in its own attributes, as JSON values.

A dataset that draws its transforms from a generator of its own (``self.rng =
np.random.default_rng(seed)``, a ``torch.Generator``, a ``random.Random``) keeps that stream
outside the global ones the runtime carries, and outside the loader's position unless its own
``state_dict`` holds it. :func:`held` finds such generators among an object's attributes (not
inside other objects, but through torch's ``Subset``), :func:`encode` gives their states as plain
JSON values (they travel as a string in the transfer's ``weights_only`` blob, so no pickle on
network bytes), and :func:`restore` puts states back, making the generator when the attribute is
still empty (a dataset that creates its generator at its first read, in each worker).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Subset

from rlaunch.runtime import rng


def _kind(value: Any) -> str | None:
    """The kind of generator ``value`` is, as :func:`encode` names it (None: not a generator of the
    dataset's own: a global one the runtime carries, held by reference, is not)."""
    if _is_global(value):
        return None
    if isinstance(value, torch.Generator):
        return "torch" if value.device.type == "cpu" else None
    if isinstance(value, random.Random):
        return None if isinstance(value, random.SystemRandom) else "python"  # SystemRandom has no state
    np = rng.numpy_module()
    if np is not None:
        if isinstance(value, np.random.Generator):
            return "numpy"
        if isinstance(value, np.random.RandomState):
            return "numpy_legacy"
    return None


def attributes(obj: Any) -> dict[str, Any]:
    """``obj``'s own attributes by name, and, under torch's ``Subset`` (``random_split``'s parts), the
    dataset's below it as ``dataset.<name>``."""
    out = dict(getattr(obj, "__dict__", None) or {})
    if isinstance(obj, Subset):
        out.update({f"dataset.{name}": value for name, value in attributes(obj.dataset).items()})
    return out


def _is_global(value: Any) -> bool:
    """Whether ``value`` is one of the global generators (``torch.default_generator``, ``random``'s and
    NumPy's module-level ones), which :mod:`rlaunch.runtime.rng` carries."""
    np = rng.numpy_module()
    numpy_global = getattr(getattr(getattr(np, "random", None), "mtrand", None), "_rand", None)
    return value is torch.default_generator or value is random._inst or (np is not None and value is numpy_global)  # type: ignore[attr-defined]


def _seed(value: Any) -> bool:
    """Whether ``value`` is a seed, which a dataset may keep where its generator goes at its first read."""
    np = rng.numpy_module()
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        np is not None and isinstance(value, np.integer)
    )


def held(obj: Any) -> dict[str, Any]:
    """The generators among ``obj``'s :func:`attributes`, by name."""
    return {name: value for name, value in attributes(obj).items() if _kind(value) is not None}


def owner(obj: Any, name: str) -> tuple[Any, str]:
    """The object that holds attribute ``name`` (as :func:`attributes` names it) and its own name there.
    ``name`` may have come over the network: anything :func:`attributes` could not have named is refused."""
    *path, last = name.split(".")
    unknown = not last.isidentifier() or last.startswith("__")
    for part in path:
        unknown = unknown or part != "dataset" or not isinstance(obj, Subset)
        if unknown:
            break
        obj = obj.dataset
    if unknown:
        raise ValueError(f"A carried generator state names the attribute {name!r}, which no dataset's generator has.")
    return obj, last


def _plain(value: Any) -> Any:
    """A NumPy bit generator's state as JSON values (its arrays as dtype and list)."""
    np = rng.numpy_module()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if np is not None and isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    return value


def _unplain(value: Any) -> Any:
    np = rng.numpy_module()
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            if value["dtype"] not in ("uint32", "uint64") or len(value["ndarray"]) > _MAX_WORDS:
                raise ValueError(f"A carried NumPy state holds an array no NumPy generator has ({value['dtype']}).")
            return np.array(value["ndarray"], dtype=value["dtype"])
        return {k: _unplain(v) for k, v in value.items()}
    return value


#: the most words a NumPy bit generator's state array holds (MT19937's key: 624)
_MAX_WORDS = 1024


def encode(generator: Any) -> dict[str, Any]:
    """``generator``'s state as JSON values, with its kind."""
    kind = _kind(generator)
    if kind == "torch":
        return {"kind": kind, "state": rng.b64(generator.get_state())}
    if kind == "python":
        return {"kind": kind, "state": rng.python_to_json(generator.getstate())}
    if kind == "numpy":
        return {"kind": kind, "state": _plain(generator.bit_generator.state)}
    if kind == "numpy_legacy":
        return {"kind": kind, "state": rng.numpy_to_json(generator.get_state())}
    raise TypeError(f"{type(generator).__name__} is not a random generator whose state can be carried.")


def restore(obj: Any, name: str, value: dict[str, Any]) -> None:
    """Put state ``value`` (from :func:`encode`) into ``obj``'s generator ``name``, made when the
    attribute is missing or None. The value came over the network: anything else is refused."""
    kind = value.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"A carried generator state names an unknown kind {kind!r}.")
    obj, name = owner(obj, name)
    generator: Any = getattr(obj, name, None)
    if _seed(generator):  # not made yet (its seed is there): made here, as the dataset would at its first read
        generator = None
    if generator is not None and _kind(generator) != kind:
        raise ValueError(
            f"A carried {kind} generator state is for {type(obj).__name__}.{name}, which here holds a "
            f"{type(generator).__name__}: the joiner's dataset is not built as the sender's."
        )
    try:
        fresh = _make(kind, value["state"]) if generator is None else None
        _set(fresh if fresh is not None else generator, kind, value["state"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise ValueError(f"A carried {kind} generator state for {name!r} is malformed: {e}") from None
    if fresh is not None:
        setattr(obj, name, fresh)


def _set(generator: Any, kind: str, state: Any) -> None:
    if kind == "torch":
        generator.set_state(rng.unb64(state))
    elif kind == "python":
        generator.setstate(rng.python_from_json(state))
    elif kind == "numpy":
        generator.bit_generator.state = _unplain(state)
    else:
        if len(state[1]) != 624:  # MT19937's key, the legacy generator's only kind
            raise ValueError(f"a legacy NumPy state holds {len(state[1])} key words, not 624")
        generator.set_state(rng.numpy_from_json(state))


def _make(kind: str, state: Any) -> Any:
    """A fresh generator of ``kind`` (its state is set by the caller)."""
    if kind == "torch":
        return torch.Generator()
    if kind == "python":
        return random.Random()
    np = rng.numpy_module()
    if np is None:
        raise RuntimeError(f"A carried NumPy generator ({kind}) cannot be restored where NumPy was never imported.")
    if kind == "numpy":
        if state.get("bit_generator") not in _BIT_GENERATORS:
            raise ValueError(f"A carried NumPy state names an unknown bit generator {state.get('bit_generator')!r}.")
        return np.random.Generator(getattr(np.random, state["bit_generator"])())
    return np.random.RandomState()


#: the kinds :func:`encode` gives
_KINDS = frozenset({"torch", "python", "numpy", "numpy_legacy"})
#: the bit generators NumPy ships, which a carried state may name
_BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})
