"""Moving a rank's state from the leaver to the joiner without a second copy.

The sender walks the tracked objects and sends each tensor as it lies in memory; the receiver
writes each one straight into its own live tensor (model parameters, optimizer state), so
neither side ever holds the model twice. A small pickled header goes first: names, shapes and
dtypes (checked before any tensor is received, so a mismatch fails loudly instead of
corrupting a model), optimizer hyperparameters, other objects' state, RNG states and the step.
"""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from rlaunch.runtime import shards

_TAG = 7


class TransferError(RuntimeError):
    """The joiner's objects do not match the leaver's."""


def _tensors_of(tracked: dict[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(name, live tensor) pairs to move, and the header describing everything else."""
    pairs: list[tuple[str, torch.Tensor]] = []
    header: dict[str, Any] = {"objects": {}}
    for name, obj in tracked.items():
        if isinstance(obj, nn.Module):
            for key, t in obj.state_dict(keep_vars=False).items():
                pairs.append((f"{name}.{key}", t))
            header["objects"][name] = ("module", None)
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            scalars: dict[str, Any] = {}
            for i, p in enumerate(params):
                for key, value in obj.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        pairs.append((f"{name}.state.{i}.{key}", value))
                    else:
                        scalars[f"{i}.{key}"] = value
            groups = [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]
            header["objects"][name] = ("optimizer", {"groups": groups, "scalars": scalars})
        elif hasattr(obj, "state_dict"):
            buf = io.BytesIO()
            torch.save(obj.state_dict(), buf)
            header["objects"][name] = ("stateful", buf.getvalue())
        else:
            raise TransferError(f"The tracked object {name!r} ({type(obj).__name__}) has no state_dict().")
    header["tensors"] = [(n, tuple(shards.local(t).shape), str(t.dtype), shards.describe(t)) for n, t in pairs]
    return pairs, header


def send_state(channel: ProcessGroup, tracked: dict[str, Any], step: int) -> int:
    """Send the state of ``tracked`` to rank 1 of ``channel``; return the bytes sent."""
    pairs, header = _tensors_of(tracked)
    header["step"] = step
    header["rng"] = (torch.get_rng_state(), random.getstate())
    raw = pickle.dumps(header)
    _send(channel, torch.tensor([len(raw)], dtype=torch.int64))
    _send(channel, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    total = 0
    for _, t in pairs:
        data = shards.local(t).detach().contiguous()
        _send(channel, data)
        total += data.numel() * data.element_size()
    return total


def recv_state(channel: ProcessGroup, tracked: dict[str, Any]) -> int:
    """Receive state from rank 0 of ``channel`` into ``tracked`` in place; return the next step."""
    size = torch.zeros(1, dtype=torch.int64)
    _recv(channel, size)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    _recv(channel, raw)
    header = pickle.loads(raw.numpy().tobytes())
    targets = _targets(tracked, header)
    with torch.no_grad():
        for t in targets:
            _recv(channel, t)
    torch.set_rng_state(header["rng"][0])
    random.setstate(header["rng"][1])
    return int(header["step"])


def _targets(tracked: dict[str, Any], header: dict[str, Any]) -> list[torch.Tensor]:
    """The joiner's live tensors in the sender's order, created where the joiner lacks one."""
    mine, _ = _tensors_of(tracked)
    live = dict(mine)
    out = []
    for name, shape, dtype, shard in header["tensors"]:
        t = live.get(name)
        if t is None:
            t = _create_optimizer_state(tracked, name, shape, dtype)
        why = shards.mismatch(name, shards.describe(t), shard)
        if why:
            raise TransferError(why)
        t = shards.local(t)
        if tuple(t.shape) != tuple(shape) or str(t.dtype) != dtype:
            raise TransferError(
                f"The joiner's {name} is {tuple(t.shape)} {t.dtype} but the leaver sends {shape} {dtype}; "
                "both must run the same script with the same model."
            )
        out.append(t)
    for name, (kind, extra) in header["objects"].items():
        obj = tracked.get(name)
        if obj is None:
            raise TransferError(f"The leaver tracks {name!r} but this joiner does not; call rt.track() alike.")
        if kind == "optimizer":
            for group, values in zip(obj.param_groups, extra["groups"], strict=True):
                group.update(values)
            params = [p for g in obj.param_groups for p in g["params"]]
            for key, value in extra["scalars"].items():
                i, k = key.split(".", 1)
                obj.state[params[int(i)]][k] = value
        elif kind == "stateful":
            obj.load_state_dict(torch.load(io.BytesIO(extra), weights_only=False))
    return out


def _create_optimizer_state(tracked: dict[str, Any], name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    obj_name, _, rest = name.partition(".state.")
    opt = tracked.get(obj_name)
    if not isinstance(opt, torch.optim.Optimizer) or not rest:
        raise TransferError(f"The joiner has no {name} to receive into; both must track the same objects.")
    index, key = rest.split(".", 1)
    params = [p for g in opt.param_groups for p in g["params"]]
    t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
    opt.state[params[int(index)]][key] = t
    return t


def _send(channel: ProcessGroup, t: torch.Tensor) -> None:
    channel.send([t], 1, _TAG).wait()


def _recv(channel: ProcessGroup, t: torch.Tensor) -> None:
    channel.recv([t], 0, _TAG).wait()
