"""One rank's state copied into host memory: taken, verified, sent, received and put back.

A :class:`HostCopy` is what a host snapshot holds for one rank (see :mod:`rlaunch.runtime.snapshots`):
the transfer header a joiner reads (:mod:`rlaunch.runtime.transfer`), the ``weights_only`` blob of
the values that are not tensors, a CPU tensor per tracked tensor (a DTensor's local shard) and the
digest of each tracked object over exactly those bytes, computed by the copy's owner when it took
it (:func:`seal`). It is laid out as a move's stream, so a copy held for another rank is sent to
that rank's joiner with the joiner's own :func:`recv_state <rlaunch.runtime.transfer.recv_state>`,
and verified there, against its owner's digests, as every move is.

A copy received for another rank keeps its owner's digests and is checked against them only when
it is used (:func:`verify`, before it is sent to a joiner): most held copies are never used, and
the check is a pass over every byte, so it is not paid at every snapshot. The joiner checks what
lands against the same digests, end to end.

The CPU tensors are allocated once and reused by every later copy of the same shapes: a rank's
own copy and the copy it holds for its source are all the host memory snapshots take.

Between buddies a copy may be paced (:func:`send` with ``rate``): it then crosses in pieces of
:data:`PIECE_BYTES`, and the sender waits between pieces so that it never runs ahead of the rate,
leaving the link (and, on a machine with few cores, the CPU) to training.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch.distributed import ProcessGroup

from rlaunch.runtime import rng, shards, transfer


@dataclasses.dataclass
class HostCopy:
    """A rank's state at the start of ``step``, in host memory (see the module docstring)."""

    header: dict[str, Any]
    blob: torch.Tensor  # uint8
    tensors: list[torch.Tensor]
    #: each tracked object's digest over what this copy holds, as its owner computed it when it took
    #: the copy (empty until :func:`seal`; a received copy carries its sender's)
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    #: this copy's bytes were digested here and matched :attr:`digests` (an owner's sealed copy, or a
    #: received copy once :func:`verify` passed)
    checked: bool = False

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def nbytes(self) -> int:
        return self.blob.numel() + sum(t.nbytes for t in self.tensors)


def _buffers(entries: list[dict[str, Any]], into: HostCopy | None) -> list[torch.Tensor]:
    """CPU tensors for ``entries``: ``into``'s own when every shape and dtype is the same, else new ones
    (pinned where CUDA exists, so device copies into them run at full speed)."""
    if into is not None and len(into.tensors) == len(entries):
        same = all(
            list(t.shape) == list(e["shape"]) and str(t.dtype) == e["dtype"]
            for t, e in zip(into.tensors, entries, strict=True)
        )
        if same:
            return into.tensors
    pin = torch.cuda.is_available()
    out = []
    for e in entries:
        dtype = transfer.dtype_of(e, f"The snapshot's {e['name']}")
        out.append(torch.empty(tuple(e["shape"]), dtype=dtype, pin_memory=pin))
    return out


def capture(tracked: dict[str, Any], step: int, rng_state: rng.RngState, into: HostCopy | None = None) -> HostCopy:
    """Copy ``tracked`` (as a move would send it) into host memory, reusing ``into``'s buffers.

    The caller restores the RNG states afterwards: a tracked object's ``state_dict()`` may draw
    from them (a raw ``StatefulDataLoader``'s does). Not yet digested: see :func:`seal`.
    """
    pairs, kinds, values = transfer.tensors_of(tracked)
    entries = [{**transfer.describe(n, t), "wire": "whole", "device": "cpu"} for n, t in pairs]
    raw = transfer.dump_values(values)  # a deep copy: the live objects go on changing
    header = {
        "version": transfer.HEADER_VERSION, "step": step, "objects": kinds, "tensors": entries,
        "rng": rng.to_json(rng_state), "blob_bytes": len(raw), "runtime": {},
    }  # fmt: skip
    tensors = _buffers(entries, into)
    with torch.no_grad():
        for held, (_, t) in zip(tensors, pairs, strict=True):
            held.copy_(shards.local(t).detach(), non_blocking=held.is_pinned())
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # every device copy landed before the state changes
    return HostCopy(header, torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else _empty(), tensors)


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _digests(copy: HostCopy) -> dict[str, str]:
    h = copy.header
    values = transfer.load_blob(copy.blob.numpy().tobytes()) if copy.blob.numel() else {}
    pairs = [(e["name"], t) for e, t in zip(h["tensors"], copy.tensors, strict=True)]
    return transfer.digests_of(list(h["objects"]), pairs, h["objects"], values, copy.step, rng.from_json(h["rng"]))


def seal(copy: HostCopy) -> None:
    """(the copy's owner) Digest what ``copy`` holds (off the main thread: its bytes no longer change)."""
    copy.digests = _digests(copy)
    copy.checked = True


def verify(copy: HostCopy, what: str) -> None:
    """Digest what a received ``copy`` holds and compare it with its owner's digests, once (see the
    module docstring); :class:`TransferError` names the object that differs (``what``: whose copy)."""
    if copy.checked:
        return
    mine = _digests(copy)
    for name in sorted(set(mine) | set(copy.digests)):
        if mine.get(name) != copy.digests.get(name):
            raise transfer.TransferError(
                f"{what} of step {copy.step} holds {name!r} with digest {mine.get(name)}, but its owner computed "
                f"{copy.digests.get(name)} when it took the copy; it is never used"
            )
    copy.checked = True


#: the pieces a paced copy crosses in (the rate is kept between pieces)
PIECE_BYTES = 8 << 20


def _pieces(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``t`` (a contiguous host buffer) as consecutive views of at most ``size`` bytes."""
    flat = t.view(-1)
    n = max(1, size // max(1, t.element_size()))
    return [flat[i : i + n] for i in range(0, flat.numel(), n)] or [flat]


def send(channel: ProcessGroup, copy: HostCopy, knowledge: dict[str, Any] | None = None, rate: float = 0.0) -> int:
    """Send ``copy`` to rank 1 of ``channel``; return the bytes sent.

    Without ``rate`` it goes as a move's stream, every tensor posted at once (what a joiner's
    ``recv_state`` reads); with ``rate`` (bytes per second, to a buddy's :func:`receive`) in paced
    pieces. ``knowledge``: what the runtime knows now (a joiner learns it; see ``Moves.knowledge``).
    """
    size = PIECE_BYTES if rate else 0
    transfer.send_json(channel, {**copy.header, "runtime": knowledge or {}, "pieces": size})
    if copy.blob.numel():
        transfer.send_host(channel, copy.blob)
    if rate:
        began, sent = time.monotonic(), 0
        for t in copy.tensors:
            for piece in _pieces(t, size):
                channel.send([piece], 1, transfer.TAG).wait()
                sent += piece.nbytes
                ahead = sent / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
    else:
        works = [channel.send([t], 1, transfer.TAG) for t in copy.tensors]  # posted at once: the wire never idles
        for work in works:
            work.wait()
    transfer.send_json(channel, {"digests": copy.digests})
    return copy.nbytes


def receive(channel: ProcessGroup, into: HostCopy | None = None) -> HostCopy:
    """Receive a copy from rank 0 of ``channel`` into host memory (``into``'s buffers where they fit).

    It keeps its sender's digests, unchecked: :func:`verify` checks it when it is used.
    """
    header = transfer.recv_json(channel, "snapshot header")
    if not isinstance(header, dict) or header.get("version") != transfer.HEADER_VERSION:
        raise transfer.TransferError(
            f"A snapshot arrived with header version {header.get('version') if isinstance(header, dict) else None!r}, "
            f"this rank reads version {transfer.HEADER_VERSION}; run the same rlaunch everywhere."
        )
    entries = header["tensors"]
    blob = torch.empty(int(header["blob_bytes"]), dtype=torch.uint8)
    if blob.numel():
        transfer.recv_host(channel, blob)
    tensors = _buffers(entries, into)
    size = header.pop("pieces", 0)  # the sender's piece size (0: whole tensors)
    if not isinstance(size, int) or size < 0:
        raise transfer.TransferError(f"A snapshot announces pieces of {size!r} bytes; is the sender another version?")
    works = [channel.recv([p], 0, transfer.TAG) for t in tensors for p in (_pieces(t, size) if size else [t])]
    for work in works:
        work.wait()
    trailer = transfer.recv_json(channel, "snapshot digests")
    theirs = trailer.get("digests") if isinstance(trailer, dict) else None
    if not isinstance(theirs, dict) or not theirs or not all(isinstance(v, str) for v in theirs.values()):
        raise transfer.TransferError(
            f"The snapshot of step {header.get('step')} ended without its sender's digests; is the sender another "
            "version? It is not kept."
        )
    return HostCopy({**header, "runtime": {}}, blob, tensors, {str(k): v for k, v in theirs.items()})


def restore(copy: HostCopy, tracked: dict[str, Any], rank: int) -> None:
    """Put ``copy`` back into ``tracked`` in place (the rank rolls back to ``copy.step``), RNG states too.

    Checked as a joiner checks a move: every tensor's shape first, and afterwards the digests of
    what ``tracked`` holds must equal the copy's, or :class:`TransferError` names the object.
    """
    header = copy.header
    targets = transfer.live_targets(tracked, header)
    values = transfer.load_blob(copy.blob.numpy().tobytes()) if copy.blob.numel() else {}
    transfer.load_values(tracked, header, values)
    for obj in tracked.values():
        if isinstance(obj, torch.amp.GradScaler):
            # the failed step may have unscaled gradients (clipping): forget that, as update() would
            obj._per_optimizer_states.clear()
    with torch.no_grad():
        for t, held in zip(targets, copy.tensors, strict=True):
            t.copy_(held)
    state = rng.from_json(header["rng"])
    rng.restore(state)
    mine = transfer.state_digests(tracked, copy.step, state)
    rng.restore(state)  # state_dict() may have drawn from them
    for name in sorted(set(mine) | set(copy.digests)):
        if mine.get(name) != copy.digests.get(name):
            raise transfer.TransferError(
                f"rank {rank}: after rolling back to the snapshot of step {copy.step}, {name!r} has digest "
                f"{mine.get(name)} but the snapshot holds {copy.digests.get(name)}; this worker stops rather "
                "than train on it."
            )
