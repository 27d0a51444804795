"""The sandbox communicator: what a standby's collectives return before it holds ranks.

A standby runs the training script before it knows which rank it will take (see
:mod:`rlaunch.runtime.runtime`). Its groups are :class:`rlaunch.runtime.groups.SwitchableGroup` s
whose communicator is a :class:`SandboxComm`: every collective completes at once, locally, with
outputs shaped as a real one leaves them and no traffic, so the real ``torch.distributed``
functions, DDP, FSDP2, DTensor and functional collectives run unchanged. "This rank" below is the
rank the sandbox lays out as: its communicator's rank (0 in the world group and in a group of
``rt.new_group``; rank 0's place in a mesh group), while ``dist.get_rank()`` stays -1 (see
``Runtime.__init__``). What each call gives, as if every rank held this rank's data:

=============================================  ==========================================================
call                                           result in the sandbox
=============================================  ==========================================================
``all_reduce``, ``reduce``, coalesced forms    the tensor as it is (this rank's own data)
``broadcast`` from another rank                the tensor as it is, as if this rank were the source
``all_gather`` (list, tensor, coalesced)       the input in every slot
``gather``                                     on the destination the input in every slot; elsewhere nothing
``reduce_scatter`` (list, tensor)              this rank's piece of its own input
``all_to_all``, ``all_to_all_single``          the input laid out as the output (uneven splits: what fits,
                                               zeros after it)
``scatter`` from another rank                  the output as it is
``barrier``, ``monitored_barrier``             return at once
``all_gather_object``                          the object in every slot
``gather_object``                              on the destination the object in every slot; elsewhere
                                               nothing (as torch)
``broadcast_object_list`` from another rank    the objects the caller passed, as if it were the source
``scatter_object_list`` from another rank      this rank's piece of the input list the caller passed, or
                                               without one, what it passed in the output
``send``, ``recv`` and every point-to-point    refused: :class:`rlaunch.errors.SandboxError`, a sentence
call (``isend``, ``batch_isend_irecv``,
``send_object_list``, ``recv_object_list``)
=============================================  ==========================================================

A group the script makes with torch's own ``new_group`` is served too (see
:mod:`rlaunch.runtime.sandboxgroups`).

Object collectives need more than shapes. torch sends an object as its pickled size, then its
bytes; a receiver allocates both with ``torch.empty`` and reads what the source wrote. In a
sandbox no source writes, so a receiver would read an uninitialized size (and try to allocate
petabytes). The sandbox therefore recognizes those receive buffers: it finds torch's own function
up the call stack (by its code object), and the tensor it is given as that function's local
variable, and writes what the receiver gets had it been the source: its own objects, as pickled
references to them (see :class:`_ObjectReceives`; never bytes from elsewhere). A receive inside an
object collective that it does not recognize (a torch whose functions changed) raises a sentence
instead of reading garbage.

The sandbox serves CUDA tensors as it serves CPU ones: its copies run on the current CUDA stream,
and the futures it hands back are CUDA-aware (see :mod:`rlaunch.runtime.works`).
"""

from __future__ import annotations

import inspect
import itertools
import pickle
import sys
from collections.abc import Sequence
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlaunch.errors import SandboxError
from rlaunch.runtime.works import done, flat

#: The global rank a standby lays its model and groups out as until it joins (see rlaunch.runtime.mesh).
SANDBOX_RANK = 0
#: How far up the stack an object collective is looked for (torch's wrappers sit in between).
FRAME_DEPTH = 12
_BROADCAST_OBJECTS: CodeType = inspect.unwrap(c10d.broadcast_object_list).__code__
_SCATTER_OBJECTS: CodeType = inspect.unwrap(c10d.scatter_object_list).__code__
_OBJECT_COLLECTIVES = {_BROADCAST_OBJECTS: "broadcast_object_list", _SCATTER_OBJECTS: "scatter_object_list"}
#: Every object collective of torch: each receives sizes and bytes that a peer writes.
_ALL_OBJECT_COLLECTIVES = frozenset(
    inspect.unwrap(f).__code__
    for f in (c10d.broadcast_object_list, c10d.scatter_object_list, c10d.all_gather_object, c10d.gather_object)
)


def _fill(output: torch.Tensor, source: torch.Tensor) -> None:
    """Copy as much of ``source`` as fits into ``output`` (flat order) and zero the rest."""
    flat_out, flat_in = output.view(-1), source.reshape(-1)
    n = min(flat_out.numel(), flat_in.numel())
    flat_out[:n].copy_(flat_in[:n])
    flat_out[n:].zero_()


def _object_call() -> tuple[CodeType, dict[str, Any]] | None:
    """The object collective of torch this collective was issued from, and its local variables."""
    frame: FrameType | None = sys._getframe(1).f_back  # above the sandbox's method (none: called from C++)
    for _ in range(FRAME_DEPTH):
        if frame is None:
            return None
        if frame.f_code in _OBJECT_COLLECTIVES:
            return frame.f_code, dict(frame.f_locals)
        frame = frame.f_back
    return None


def in_object_collective() -> bool:
    """Whether the collective being issued comes from one of torch's object collectives."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(FRAME_DEPTH):
        if frame is None:
            return False
        if frame.f_code in _ALL_OBJECT_COLLECTIVES:
            return True
        frame = frame.f_back
    return False


def _point_to_point(call: str) -> SandboxError:
    return SandboxError(
        f"{call} cannot run in a standby's sandbox: the standby holds no rank yet, so there is no peer to send to "
        "or receive from, and point-to-point traffic cannot be served locally. Skip the call while rt.standby is "
        "true (the sandbox warms up the rest of the step)."
    )


#: The objects a receiver passed, by key, until torch unpickles the references written in their place.
_HELD: dict[int, Any] = {}
_keys = itertools.count()


def _held(key: int) -> Any:
    """The object held under ``key``, handed back once (torch's unpickler calls this in a receiver)."""
    return _HELD.pop(key)


class _Reference:
    """Pickles as a call of :func:`_held`: a reference to an object of this process, not its bytes."""

    def __init__(self, key: int) -> None:
        self.key = key

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _held, (self.key,)


class _ObjectReceives:
    """Fills the buffers torch's object collectives receive into, when the source is another rank.

    What is written is a pickled reference to the object the receiver gets (the caller's own,
    held in :data:`_HELD`), so that torch's unpickling hands back that very object: the caller's
    objects are never pickled (one that cannot be, a placeholder, still works), and nothing but
    these references is ever unpickled. The references are made at a collective's size message and
    written again at its bytes message, so the sizes and the bytes agree.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._payloads: list[bytes] = []
        self._keys: list[int] = []

    def broadcast(self, code: CodeType, names: dict[str, Any], tensor: torch.Tensor) -> None:
        if self._is_source(code, names, "broadcast"):
            return  # what it sends is its own, already in place
        if code is _BROADCAST_OBJECTS and tensor is names.get("object_sizes_tensor"):
            _write_sizes(tensor, self._hold(list(names["object_list"])))
        elif code is _BROADCAST_OBJECTS and tensor is names.get("object_tensor") and self._keys:
            _write_bytes(tensor, b"".join(self._payloads))
        elif code is _SCATTER_OBJECTS and tensor is names.get("max_tensor_size"):
            _write_sizes(tensor, self._hold([self._piece(names)]))
        else:
            raise self._unknown(code, "broadcast")

    def scatter(self, code: CodeType, names: dict[str, Any], output: torch.Tensor) -> None:
        if self._is_source(code, names, "scatter"):
            return
        if code is _SCATTER_OBJECTS and output is names.get("output_tensor") and self._keys:
            _write_bytes(output, self._payloads[0])
        elif code is _SCATTER_OBJECTS and output is names.get("obj_tensor_size") and self._keys:
            _write_sizes(output, self._payloads)
        else:
            raise self._unknown(code, "scatter")

    def _is_source(self, code: CodeType, names: dict[str, Any], op: str) -> bool:
        """torch's own decision: whether this rank is the collective's source."""
        if "my_group_rank" not in names or "group_src" not in names:
            raise self._unknown(code, op)
        return bool(names["my_group_rank"] == names["group_src"])

    def _hold(self, objects: list[Any]) -> list[bytes]:
        """References to ``objects``, to be written in their place (those of an earlier collective
        that torch never unpickled, as when it failed in between, are let go of)."""
        for key in self._keys:
            _HELD.pop(key, None)
        self._keys = [next(_keys) for _ in objects]
        _HELD.update(zip(self._keys, objects, strict=True))
        self._payloads = [pickle.dumps(_Reference(key)) for key in self._keys]
        return self._payloads

    def _piece(self, names: dict[str, Any]) -> Any:
        """What scatter_object_list gives this rank as if it were the source: its piece of the
        input list it passed, else (receivers usually pass None) what it passed in the output."""
        inputs = names.get("scatter_object_input_list")
        if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)) and len(inputs) > self._rank:
            return inputs[self._rank]
        return names["scatter_object_output_list"][0]

    @staticmethod
    def _unknown(code: CodeType, op: str) -> SandboxError:
        return SandboxError(
            f"torch {torch.__version__}'s {_OBJECT_COLLECTIVES[code]} issued a {op} that rlaunch's sandbox does not "
            "recognize, so it cannot give this standby the objects a source would send (rlaunch knows torch 2.13's). "
            "Skip the call while rt.standby is true, or use the torch version rlaunch supports."
        )


def _write_sizes(tensor: torch.Tensor, payloads: list[bytes]) -> None:
    tensor.copy_(torch.tensor([len(p) for p in payloads], dtype=tensor.dtype).reshape(tensor.shape))


def _write_bytes(tensor: torch.Tensor, data: bytes) -> None:
    if data:  # (torch.frombuffer refuses an empty buffer)
        tensor.view(-1)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class SandboxComm:
    """Serves every collective locally: outputs get this rank's own data, shaped as expected.

    See the module docstring for what each call gives. ``rank`` and ``size`` are the group rank
    the sandbox lays out as and the group's size.
    """

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size
        self._objects = _ObjectReceives(rank)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _same(self, *args: Any, **kwargs: Any) -> dist.Work:
        return done(flat(args))

    allreduce = allreduce_coalesced = reduce = barrier = _same

    def broadcast(self, tensors: list[torch.Tensor], *rest: Any) -> dist.Work:
        call = _object_call()
        if call is not None:
            for t in tensors:
                self._objects.broadcast(*call, t)
        return done(tensors)

    def send(self, tensors: list[torch.Tensor], dst: int, *rest: Any) -> dist.Work:
        raise _point_to_point(f"A send to rank {dst} of the group")

    def recv(self, tensors: list[torch.Tensor], src: int, *rest: Any) -> dist.Work:
        raise _point_to_point(f"A receive from rank {src} of the group")

    def recv_anysource(self, tensors: list[torch.Tensor], *rest: Any) -> dist.Work:
        raise _point_to_point("A receive from any rank")

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *rest: Any) -> dist.Work:
        for outs, inp in zip(outputs, inputs, strict=False):
            for o in outs:
                o.copy_(inp)
        return done(outputs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], *rest: Any
    ) -> dist.Work:
        # output_lists[r][i] receives rank r's input i; here every rank's inputs are ours
        for outs in output_lists:
            for o, inp in zip(outs, inputs, strict=False):
                o.copy_(inp)
        return done(output_lists)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, *rest: Any) -> dist.Work:
        output.copy_(inp.reshape(1, -1).expand(self._size, -1).reshape(output.shape))
        return done([output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *rest: Any
    ) -> dist.Work:
        for o, i in zip(outputs, inputs, strict=False):
            self._allgather_base(o, i)
        return done(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *rest: Any) -> dist.Work:
        for o, ins in zip(outputs, inputs, strict=False):
            o.copy_(ins[self._rank])
        return done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, *rest: Any) -> dist.Work:
        output.copy_(inp.reshape(self._size, -1)[self._rank].reshape(output.shape))
        return done([output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *rest: Any
    ) -> dist.Work:
        for o, i in zip(outputs, inputs, strict=False):
            self._reduce_scatter_base(o, i)
        return done(outputs)

    def alltoall_base(self, output: torch.Tensor, inp: torch.Tensor, *rest: Any) -> dist.Work:
        _fill(output, inp)  # split sizes may be uneven: fill what fits, zero the rest
        return done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *rest: Any) -> dist.Work:
        for o, i in zip(outputs, inputs, strict=False):
            _fill(o, i)
        return done(outputs)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, *rest: Any) -> dist.Work:
        return self.alltoall_base(output, inp)

    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *rest: Any) -> dist.Work:
        return self.allgather(outputs, inputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *rest: Any) -> dist.Work:
        call = _object_call()
        for o, ins in zip(outputs, inputs if inputs else [[]] * len(outputs), strict=False):
            if ins:
                o.copy_(ins[self._rank])
            elif call is not None:
                self._objects.scatter(*call, o)
        return done(outputs)
