"""Host staging of the tensors a channel cannot carry itself (CUDA tensors over a gloo channel).

A staged tensor crosses in chunks of at most :data:`CHUNK_BYTES` through two host buffers, used
in turn: while one chunk is on the wire the next is copied between the GPU and the other buffer,
so the device copies overlap the network. Where CUDA is in use the buffers are pinned
(page-locked), so those copies run by DMA at the link's rate instead of through the CUDA
driver's pageable bounce buffer. A :class:`Staging` makes its buffers once, at the first staged
tensor of a transfer, and keeps them for the whole transfer: staging never holds more than two
chunks of host memory, whatever the size of the model's largest tensor.

Both ends cut a tensor into the same chunks, from its byte size alone (:func:`chunks`), which the
transfer's header has already made both ends agree on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

#: The largest piece of a staged tensor on the wire (two such buffers are held per transfer).
CHUNK_BYTES = 32 << 20


def chunks(nbytes: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The (start, end) byte ranges a tensor of ``nbytes`` crosses in, in order."""
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Staging:
    """The two host buffers of one transfer's staged tensors, made at their first use.

    ``pin``: page-lock them (default: where CUDA is available; pinning needs a CUDA context).
    ``chunk``: the chunk size (default :data:`CHUNK_BYTES`; tests use small ones).
    """

    def __init__(self, *, pin: bool | None = None, chunk: int | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._chunk = chunk or CHUNK_BYTES
        self._buffers: list[torch.Tensor] = []

    @property
    def held_bytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() for b in self._buffers)

    def _buffer(self, i: int) -> torch.Tensor:
        if not self._buffers:
            self._buffers = [torch.empty(self._chunk, dtype=torch.uint8, pin_memory=self._pin) for _ in range(2)]
        return self._buffers[i % 2]

    def send(self, channel: ProcessGroup, t: torch.Tensor, dst: int, tag: int) -> None:
        """Send ``t`` (any device) to ``dst`` chunk by chunk; returns once every chunk is sent."""
        data = _bytes(t.detach().contiguous())
        pending = None
        for i, (a, b) in enumerate(chunks(data.numel(), self._chunk)):
            host = self._buffer(i)[: b - a]
            host.copy_(data[a:b])  # the other buffer is on the wire meanwhile
            if pending is not None:
                pending.wait()
            pending = channel.send([host], dst, tag)
        if pending is not None:
            pending.wait()

    def recv(self, channel: ProcessGroup, t: torch.Tensor, src: int, tag: int) -> None:
        """Receive into ``t`` (any device, written in place) chunk by chunk from ``src``."""
        target = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        data = _bytes(target)
        ranges = chunks(data.numel(), self._chunk)

        def post(i: int) -> Any:
            a, b = ranges[i]
            return channel.recv([self._buffer(i)[: b - a]], src, tag)

        pending = [post(0)] if ranges else []
        for i, (a, b) in enumerate(ranges):
            if i + 1 < len(ranges):  # the next chunk lands in the other buffer while this one is copied
                pending.append(post(i + 1))
            pending.pop(0).wait()
            data[a:b].copy_(self._buffer(i)[: b - a])
        if target is not t:
            t.copy_(target)
