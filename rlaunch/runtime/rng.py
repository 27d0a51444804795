"""Random number generator states: captured, restored, encoded as JSON, and fingerprinted.

A step that is redone after a fault must draw the same random numbers as the first time, and a
rank that joins must continue its predecessor's streams. The streams that matter are those of
``torch`` (CPU, and CUDA when initialised), Python's ``random`` and NumPy's legacy global
generator (only when the script imported NumPy: the runtime never imports it itself).

:func:`capture` takes the states in memory (for a redone step), :func:`to_json` and
:func:`from_json` encode them for the transfer header (JSON: no pickle on network bytes), and
:func:`fingerprint` is a small integer of the states that the per-step vote sums over ranks: when
every rank holds the same streams, the replica that serves a lost rank holds its streams too;
when they differ (a seed per rank), it does not (see ``Runtime.seed``).

CUDA states are taken for every GPU (``torch.cuda.get_rng_state_all``) when CUDA is initialised,
with the index of the GPU the rank uses. A joiner's GPU may have another index than the
leaver's: the leaver's GPU's state goes to the joiner's GPU (:func:`cuda_targets`).
"""

from __future__ import annotations

import base64
import hashlib
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

#: Fingerprints are taken modulo this, so that sums of fingerprints and of their squares over
#: up to 8192 ranks stay exact in a float64 vote.
FINGERPRINT_MOD = 1 << 20


@dataclass(frozen=True)
class RngState:
    """The generators' states at one moment (``numpy``/``cuda`` are None when not in use);
    ``cuda_device`` is the index of the GPU this rank used (its current device)."""

    torch_cpu: torch.Tensor
    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None
    cuda: tuple[torch.Tensor, ...] | None
    cuda_device: int | None = None


class RngError(RuntimeError):
    """RNG states that cannot be restored in this process."""


def numpy_module() -> Any:
    """NumPy, where the script imported it (the runtime never imports it itself), else None."""
    return sys.modules.get("numpy")


def capture() -> RngState:
    """The current states of every generator in use."""
    np = numpy_module()
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return RngState(
        torch_cpu=torch.get_rng_state(),
        python=random.getstate(),
        numpy=np.random.get_state() if np is not None else None,
        cuda=tuple(torch.cuda.get_rng_state_all()) if on_gpu else None,
        cuda_device=torch.cuda.current_device() if on_gpu else None,
    )


class ScriptGenerator:
    """A ``torch.Generator`` the script made itself, tracked by its state (``rt.track(noise=g)``).

    The runtime's RNG handling covers the global generators only. Wrapped in this, a generator
    of the script's own is tracked state like any other: put back when a step is redone, moved
    by a drain, and served by a replica after a fault when every rank holds the same state (the
    vote checks that; one seeded per rank is tracked with ``rt.track_per_rank``).
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["state"])


def cuda_targets(count: int, sender_device: int | None, my_device: int, my_count: int) -> list[tuple[int, int]]:
    """(GPU index here, index of the state to put there) for ``count`` CUDA states taken on a
    rank that used GPU ``sender_device``, restored on a rank that uses ``my_device`` of ``my_count``.

    Each GPU gets the state of the same index (as ``set_rng_state_all``), except this rank's own
    GPU, which gets the state of the sender's own GPU: the stream the rank was drawing from.
    """
    if my_count < 1:
        raise RngError(
            f"The sender's CUDA random states ({count} GPU(s)) cannot be restored here: this process sees no GPU; "
            "run the joiner on a machine with GPUs, as the rest of the job."
        )
    pairs = {i: i for i in range(min(count, my_count))}
    if sender_device is not None and 0 <= sender_device < count:
        pairs[my_device] = sender_device
    return sorted(pairs.items())


def restore(state: RngState) -> None:
    """Put every generator back to ``state``."""
    torch.set_rng_state(state.torch_cpu)
    random.setstate(state.python)
    np = numpy_module()
    if state.numpy is not None and np is not None:
        np.random.set_state(state.numpy)
    if state.cuda is not None:
        here = torch.cuda.device_count()
        mine = torch.cuda.current_device() if here else 0
        for device, index in cuda_targets(len(state.cuda), state.cuda_device, mine, here):
            torch.cuda.set_rng_state(state.cuda[index], device)


def seed_all(seed: int) -> None:
    """Seed every generator in use from one integer (torch, CUDA, ``random``, NumPy)."""
    torch.manual_seed(seed)  # CUDA too, when present
    random.seed(seed)
    np = numpy_module()
    if np is not None:
        np.random.seed(seed % (1 << 32))


def fingerprints(state: RngState) -> dict[str, int]:
    """A small integer per generator in use; equal states give equal fingerprints on every rank."""

    def digest(*parts: bytes) -> int:
        h = hashlib.blake2b(digest_size=8)
        for part in parts:
            h.update(part)
        return int.from_bytes(h.digest(), "little") % FINGERPRINT_MOD

    version, internal, gauss = state.python
    out = {
        "torch": digest(state.torch_cpu.numpy().tobytes()),
        # ints hash alike in every process (only str and bytes hashes are salted)
        "python": digest(repr((version, gauss)).encode(), hash(internal).to_bytes(8, "little", signed=True)),
    }
    if state.numpy is not None:
        kind, keys, pos, has_gauss, cached = state.numpy
        out["numpy"] = digest(keys.tobytes(), repr((kind, int(pos), int(has_gauss), float(cached))).encode())
    if state.cuda is not None:
        # the rank's own GPU's stream: another GPU's state is untouched by this rank (each rank
        # draws on its own GPU), so it would differ between ranks that hold the same stream
        own = (
            state.cuda[state.cuda_device]
            if state.cuda_device is not None and state.cuda_device < len(state.cuda)
            else None
        )
        out["cuda"] = (
            digest(own.numpy().tobytes()) if own is not None else digest(*(t.numpy().tobytes() for t in state.cuda))
        )
    return out


def fingerprint(state: RngState) -> int:
    """One small integer of every generator's state."""
    return hash(tuple(sorted(fingerprints(state).items()))) % FINGERPRINT_MOD


def b64(t: torch.Tensor) -> str:
    """A generator's state tensor (bytes) as base64 text, for JSON."""
    return base64.b64encode(t.numpy().tobytes()).decode()


def unb64(s: str) -> torch.Tensor:
    """The inverse of :func:`b64`."""
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def python_to_json(state: tuple[Any, ...]) -> list[Any]:
    """A ``random.Random`` state (``getstate()``) as JSON values."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def python_from_json(value: list[Any]) -> tuple[Any, ...]:
    """The inverse of :func:`python_to_json` (for ``setstate()``)."""
    version, internal, gauss = value
    return (int(version), tuple(int(x) for x in internal), gauss)


def numpy_to_json(state: tuple[Any, ...]) -> list[Any]:
    """A NumPy ``RandomState`` state (``get_state()``) as JSON values."""
    kind, keys, pos, has_gauss, cached = state
    return [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def numpy_from_json(value: list[Any]) -> tuple[Any, ...]:
    """The inverse of :func:`numpy_to_json` (for ``set_state()``; NumPy must be imported)."""
    kind, keys, pos, has_gauss, cached = value
    np = numpy_module()
    return (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)


def to_json(state: RngState) -> dict[str, Any]:
    """``state`` as plain JSON values."""
    out: dict[str, Any] = {
        "torch_cpu": b64(state.torch_cpu),
        "python": python_to_json(state.python),
        "numpy": numpy_to_json(state.numpy) if state.numpy is not None else None,
        "cuda": None,
        "cuda_device": state.cuda_device,
    }
    if state.cuda is not None:
        out["cuda"] = [b64(t) for t in state.cuda]
    return out


def from_json(value: dict[str, Any]) -> RngState:
    """The inverse of :func:`to_json` (NumPy's state is dropped where NumPy is not imported)."""
    numpy_state = None
    if value.get("numpy") is not None and numpy_module() is not None:
        numpy_state = numpy_from_json(value["numpy"])
    cuda = tuple(unb64(s) for s in value["cuda"]) if value.get("cuda") is not None else None
    return RngState(
        torch_cpu=unb64(value["torch_cpu"]),
        python=python_from_json(value["python"]),
        numpy=numpy_state,
        cuda=cuda,
        cuda_device=int(value["cuda_device"]) if value.get("cuda_device") is not None else None,
    )
