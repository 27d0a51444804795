"""64-bit digests of tensors and of whole states, computed on the tensors' own device.

A move is verified by digesting, on both sides, what was sent and what landed; replicas are
compared by digesting their parameters and optimizer state. Both must be cheap enough to run on
every move and every few steps, so a tensor's digest is two integer reductions over its bytes
read as 64-bit words, on its own device (no copy to the host, no second copy of the tensor):

- the sum of the words (mod 2^64): any flipped bit changes it;
- the sum of each block of :data:`BLOCK` words, weighted by the block's position: reordered or
  misplaced blocks change it.

Measured here (torch 2.13, one CPU thread): 5 ms per 100 MB, as fast as a plain float sum. The
few bytes after the last whole word are read at their own width. A whole state's digest
(:func:`of_items`) mixes the tensors' digests, their names, dtypes and shapes, and the ``repr``
of every other value in one BLAKE2b.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

#: words per block of the position-weighted sum
BLOCK = 4096
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard (its live storage)
    return local if isinstance(local, torch.Tensor) else t


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s bytes as 64-bit words, and the tail that does not fill one as int64 values.

    A view that does not start on an 8-byte boundary (a slice at an odd offset; rare: fresh
    storage is aligned) is copied first, so that the words never depend on where it lies.
    """
    flat = _local(t).detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.data_ptr() % 8:
        flat = flat.clone()
    size = flat.element_size()
    ints = flat.view(_INTS[size]) if size in _INTS else flat.view(torch.uint8)
    per_word = 8 // ints.element_size()
    body = ints.numel() // per_word * per_word
    words = ints[:body].view(torch.int64) if body else ints.new_zeros(0, dtype=torch.int64)
    return words, ints[body:].to(torch.int64)


def terms(t: torch.Tensor) -> torch.Tensor:
    """The two int64 terms of ``t``'s digest, on ``t``'s device (no host sync)."""
    words, rest = _words(t)
    n = words.numel() // BLOCK * BLOCK
    blocks = words[:n].view(-1, BLOCK).sum(dim=1)
    weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=words.device)
    tail = words[n:].sum() + rest.sum() * 31
    weighted = (blocks * weights).sum() + tail * (blocks.numel() + 1)
    return torch.stack([blocks.sum() + tail, weighted])


class Terms:
    """Each tensor's two terms, read once and shared by every digest that mixes them.

    A move digests the same tensors twice over: per tracked object for the transfer, per replica
    pattern for the first vote after it. One :class:`Terms` serves both with one pass over the
    bytes. A tensor is known by the memory it views (device, address, dtype, shape, strides: a
    parameter and the detached view ``state_dict()`` gives of it are one), so it holds while the
    tensors are not written to: make a new one for each moment digested.
    """

    def __init__(self) -> None:
        #: memory -> (a tensor viewing it, kept so the address is not reused, its terms)
        self._known: dict[tuple[Any, ...], tuple[torch.Tensor, list[int]]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())

    def read(self, tensors: list[torch.Tensor]) -> list[list[int]]:
        """The terms of ``tensors`` (in their order); the ones not read yet with one transfer per device."""
        local = [_local(t) for t in tensors]
        missing = {self._key(t): t for t in local if self._key(t) not in self._known}
        by_device: dict[torch.device, list[tuple[tuple[Any, ...], torch.Tensor]]] = {}
        for key, t in missing.items():
            by_device.setdefault(t.device, []).append((key, t))
        for group in by_device.values():
            read = torch.stack([terms(t) for _, t in group]).cpu().tolist()
            for (key, t), values in zip(group, read, strict=True):
                self._known[key] = (t, values)
        return [self._known[self._key(t)][1] for t in local]


def of_items(items: Iterable[tuple[str, Any]], known: Terms | None = None) -> int:
    """One 64-bit digest of named values: tensors by their bytes (and dtype, shape), the rest by ``repr``.

    Nested dicts (in key order), lists and tuples are walked. Tensors' terms come from ``known``
    when given (read there if missing), each device's read back with one host transfer.
    """
    described: list[str] = []
    tensors: list[torch.Tensor] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            local = _local(value)
            described.append(f"{prefix}:T{len(tensors)}:{local.dtype}:{tuple(local.shape)}")
            tensors.append(value)
        elif isinstance(value, dict):  # in key order: the same state built in another order digests alike
            for k in sorted(value, key=repr):
                walk(f"{prefix}/{k!r}", value[k])
        elif isinstance(value, (list, tuple)):
            described.append(f"{prefix}:{type(value).__name__}{len(value)}")
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        else:
            described.append(f"{prefix}={value!r}")

    for name, value in items:
        walk(name, value)
    h = hashlib.blake2b(digest_size=8)
    h.update("\n".join(described).encode())
    for values in (known or Terms()).read(tensors):
        h.update(repr(values).encode())
    return int.from_bytes(h.digest(), "little")


def hexed(value: int) -> str:
    """How a digest is shown in sentences: ``0x`` and 16 hex digits."""
    return f"0x{value:016x}"
