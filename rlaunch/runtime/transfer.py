"""Moving a rank's state from the leaver (or a replica) to the joiner without a second copy.

The sender walks the tracked objects and sends each tensor as it lies in memory; the receiver
writes each one straight into its own live tensor (model parameters and buffers, optimizer
state), so neither side ever holds the model twice. A small JSON header goes first: each
tensor's name, shape and dtype (checked against the joiner's live tensor before any tensor is
received, so a mismatch fails loudly instead of corrupting a model), the RNG states and the
step. Python values that are not tensors (optimizer hyperparameters, a scheduler's or a
GradScaler's ``state_dict()``) travel as one ``torch.save`` blob loaded with
``weights_only=True``: nothing received is ever unpickled freely.

CUDA tensors move into the joiner's live CUDA tensors. Over a channel whose backend is NCCL they
go GPU to GPU (NCCL send/recv); over a gloo channel each is staged through host memory
(:func:`wire`), in chunks through two pinned buffers (:mod:`rlaunch.runtime.staging`), so the
staging never holds more than two chunks.

The optimizer state travels last (:func:`tensors_of`), and the joiner does not wait for it: once
the other tensors have landed it starts its first step while the rest lands (:class:`Landing`).

Every move is verified end to end: after the tensors, the sender sends a digest of each tracked
object's state as it sent it (and of the RNG states and the step), computed on the tensors' own
device (:mod:`rlaunch.runtime.digest`); the joiner digests what landed and refuses the move,
before any step is applied (before its first vote), if one differs. State the joiner holds that
the sender did not send (optimizer state a sandbox made for a parameter the sender's optimizer
never stepped) is dropped when the state is loaded, and would show in the joiner's digest if
it were not.

Two functions are the extension points: :func:`tensors_of` builds the (name, live tensor) list
and the header entry of each tensor; :func:`check_tensor` compares one incoming entry with the
joiner's live tensor.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import backend as backends
from rlaunch.runtime import digest, rng, shards
from rlaunch.runtime.groups import READY_TIMEOUT_S
from rlaunch.runtime.staging import Staging

TAG = 7
#: Version of the header and of the stream after it (3: staged tensors cross in chunks); a joiner
#: refuses a version it does not know.
HEADER_VERSION = 3


class TransferError(RuntimeError):
    """The joiner's objects do not match the sender's."""


def tensors_of(tracked: dict[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
    """(name, live tensor) pairs to move, the kind of each tracked object, and their other values.

    The kinds go into the JSON header; the other values (optimizer hyperparameters and scalar
    state, other objects' ``state_dict()``) into the ``weights_only`` blob. Every optimizer's
    state comes after all other tensors: a joiner starts its first step once those have landed
    (see :class:`Landing`).
    """
    pairs: list[tuple[str, torch.Tensor]] = []
    later: list[tuple[str, torch.Tensor]] = []  # optimizer state: after every other object's tensors
    kinds: dict[str, str] = {}
    values: dict[str, Any] = {}
    for name, obj in tracked.items():
        if isinstance(obj, nn.Module):
            for key, t in obj.state_dict(keep_vars=False).items():
                pairs.append((f"{name}.{key}", t))
            kinds[name] = "module"
            if isinstance(obj, DistributedDataParallel):
                # whether DDP's next forward broadcasts rank 0's buffers: every rank must agree
                values[name] = {"require_forward_param_sync": bool(obj.require_forward_param_sync)}
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            scalars: dict[str, Any] = {}
            for i, p in enumerate(params):
                for key, value in obj.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        later.append((f"{name}.state.{i}.{key}", value))
                    else:
                        scalars[f"{i}.{key}"] = value
            groups = [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]
            kinds[name] = "optimizer"
            values[name] = {"groups": groups, "scalars": scalars}
        elif hasattr(obj, "state_dict"):
            kinds[name] = "stateful"
            values[name] = obj.state_dict()
        else:
            raise TransferError(f"The tracked object {name!r} ({type(obj).__name__}) has no state_dict().")
    return pairs + later, kinds, values


def describe(name: str, t: torch.Tensor) -> dict[str, Any]:
    """The header entry of one tensor: what the joiner checks before receiving it.

    A DTensor moves as its local shard; its entry also says which shard it is (see
    :mod:`rlaunch.runtime.shards`), since every rank's shard has the same name and shape.
    """
    return {"name": name, "shape": list(shards.local(t).shape), "dtype": str(t.dtype), "shard": shards.describe(t)}


def check_tensor(entry: dict[str, Any], live: torch.Tensor) -> None:
    """Refuse (before any byte is received) an incoming tensor that does not fit ``live``."""
    why = shards.mismatch(entry["name"], shards.describe(live), entry.get("shard"))
    if why:
        raise TransferError(why)
    live = shards.local(live)
    if list(live.shape) != list(entry["shape"]) or str(live.dtype) != entry["dtype"]:
        raise TransferError(
            f"The joiner's {entry['name']} is {tuple(live.shape)} {live.dtype} but the sender sends "
            f"{tuple(entry['shape'])} {entry['dtype']}; both must run the same script with the same model."
        )


def dump_values(values: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(values, buf)
    return buf.getvalue()


def load_blob(raw: bytes) -> dict[str, Any]:
    try:
        loaded = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the restricted unpickler refuses
        raise TransferError(
            f"The sender's tracked state holds a value that cannot be loaded safely ({exc}); tracked objects' "
            "state_dict() must hold only tensors, numbers, strings, lists, tuples and dicts."
        ) from exc
    if not isinstance(loaded, dict):
        raise TransferError(f"The sender's state blob is a {type(loaded).__name__}, not a dict.")
    return loaded


def state_digests(
    tracked: dict[str, Any], step: int, rng_state: rng.RngState, known: digest.Terms | None = None
) -> dict[str, str]:
    """A digest of each tracked object's state as :func:`tensors_of` sees it (its tensors and its
    other values), of the RNG states and of the step: what a move must carry unchanged."""
    return digests_of(list(tracked), *tensors_of(tracked), step, rng_state, known)


def digests_of(
    names: list[str], pairs: list[tuple[str, torch.Tensor]], kinds: dict[str, str], values: dict[str, Any],
    step: int, rng_state: rng.RngState, known: digest.Terms | None = None,
) -> dict[str, str]:  # fmt: skip
    known = known or digest.Terms()
    out = {}
    for name in names:
        prefix = f"{name}."
        items = [(n, t) for n, t in pairs if n.startswith(prefix)]
        entries = [("kind", kinds[name]), ("values", values.get(name)), *items]
        out[name] = digest.hexed(digest.of_items(entries, known))
    out["rng"] = digest.hexed(digest.of_items(sorted(rng.fingerprints(rng_state).items())))
    out["step"] = str(step)
    return out


def send_state(
    channel: ProcessGroup, tracked: dict[str, Any], step: int, rng_state: rng.RngState,
    knowledge: dict[str, Any] | None = None, first_sent: Callable[[], None] | None = None,
) -> int:  # fmt: skip
    """Send the state of ``tracked`` to rank 1 of ``channel``; return the bytes sent.

    ``knowledge``: what the runtime knows that the joiner must know too (JSON values; see
    ``Runtime._knowledge``). The digests of what was sent follow the tensors. ``first_sent`` is
    called once the tensors the joiner's first step waits for are sent (all but the optimizer
    state, see :func:`first_needs`).
    """
    pairs, kinds, values = tensors_of(tracked)
    blob = dump_values(values)
    backends.current().wait_ready(channel, READY_TIMEOUT_S)  # its first use: its NCCL setup must be done
    header = {
        "version": HEADER_VERSION,
        "step": step,
        "objects": kinds,
        "tensors": [_entry(channel, n, t) for n, t in pairs],
        "rng": rng.to_json(rng_state),
        "blob_bytes": len(blob),
        "runtime": knowledge or {},
    }
    send_json(channel, header)
    if blob:
        send_host(channel, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    total, staging, on_the_wire = 0, Staging(), []
    first = first_needs(header["tensors"], kinds)
    early = waited = 0  # the posted sends among the first ``first`` tensors; those waited for (once each:
    # a gloo send's second wait waits for another send's completion)
    try:
        for i, (_, t) in enumerate(pairs):  # every whole tensor's send is posted at once: the wire never idles
            data = shards.local(t).detach().contiguous()
            if _staged(channel, data):
                staging.send(channel, data, 1, TAG)
            else:
                on_the_wire.append((data, channel.send([data], 1, TAG)))
                early += i < first
            total += data.numel() * data.element_size()
        if first_sent is not None:
            for _, work in on_the_wire[:early]:
                work.wait()
                waited += 1
            first_sent()
        # over what is sent, read while it is on the wire (no second state_dict() call: some draw
        # from the RNG, as a loader's does)
        digests = digests_of(list(tracked), pairs, kinds, values, step, rng_state)
    except BaseException:
        # nothing the posted sends still read may change before they end (a caller restores buffers next)
        for _, work in on_the_wire[waited:]:
            with contextlib.suppress(RuntimeError):
                work.wait()
        raise
    for _, work in on_the_wire[waited:]:
        work.wait()
    send_json(channel, {"digests": digests})
    backends.current().settle(channel)  # sent means done on the GPU, not queued: the sender may exit next
    return total


def send_json(channel: ProcessGroup, value: dict[str, Any]) -> None:
    raw = json.dumps(value, separators=(",", ":")).encode()
    send_host(channel, torch.tensor([len(raw)], dtype=torch.int64))
    send_host(channel, torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def recv_json(channel: ProcessGroup, what: str) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    recv_host(channel, size)
    if not 0 < int(size.item()) <= MAX_JSON_BYTES:
        raise TransferError(f"The transfer {what} announces {int(size.item())} bytes; is the sender another version?")
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    recv_host(channel, raw)
    try:
        return json.loads(raw.numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransferError(f"The transfer {what} is not valid JSON ({exc}); is the sender another version?") from exc


#: A joiner reads the digest terms of what landed in batches of about this many bytes (one host
#: read each), while the next tensors land.
DIGEST_BATCH_BYTES = 64 << 20
#: The largest JSON header or trailer a joiner accepts (a corrupt size must not allocate gigabytes).
MAX_JSON_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Landed:
    """What a joiner received: the step it goes on with, the seconds its digests took, and the
    digest terms of its tensors as they landed (the first vote's replica check reuses them)."""

    step: int
    verify_s: float
    terms: digest.Terms


def recv_state(
    channel: ProcessGroup, tracked: dict[str, Any], *, rank: int = -1,
    learn: Callable[[dict[str, Any]], None] | None = None,
) -> Landed:  # fmt: skip
    """Receive state from rank 0 of ``channel`` into ``tracked`` in place, all of it, and verify it
    (:func:`receive_state`, then :meth:`Landing.finish`)."""
    return receive_state(channel, tracked, rank=rank, learn=learn).finish()


def receive_state(
    channel: ProcessGroup, tracked: dict[str, Any], *, rank: int = -1,
    learn: Callable[[dict[str, Any]], None] | None = None, on_landed: Callable[[Landing], None] | None = None,
) -> Landing:  # fmt: skip
    """Receive state from rank 0 of ``channel`` into ``tracked`` in place; return once every tensor
    but the optimizer state has landed, while that goes on landing (:class:`Landing`; ``on_landed``
    is called on its thread once every byte is here, before the digests are compared).

    Every tensor is checked before the first one is received; ``learn`` is given the sender's
    runtime knowledge before any object's state is loaded; the RNG states are restored. What has
    landed is digested here, before the caller's first step can change it (buffers, a loader's
    position); the optimizer state's digests, and the comparison with the sender's, come in
    :meth:`Landing.finish`.
    """
    backends.current().wait_ready(channel, READY_TIMEOUT_S)  # its first use: its NCCL setup must be done
    header = recv_json(channel, "header")
    if not isinstance(header, dict) or header.get("version") != HEADER_VERSION:
        raise TransferError(
            f"The transfer header has version {header.get('version') if isinstance(header, dict) else None!r}, "
            f"this joiner reads version {HEADER_VERSION}; run the same rlaunch everywhere."
        )
    blob = torch.empty(int(header["blob_bytes"]), dtype=torch.uint8)
    if blob.numel():
        recv_host(channel, blob)
    values = load_blob(blob.numpy().tobytes()) if blob.numel() else {}
    targets = live_targets(tracked, header)
    if learn is not None:
        learn(dict(header.get("runtime") or {}))
    load_values(tracked, header, values)
    entries = header["tensors"]
    reader = _Reader()
    arrivals = _receive(channel, entries, targets)
    with torch.no_grad():
        for arrived in itertools.islice(arrivals, first_needs(entries, header["objects"])):
            reader.add(arrived)
        reader.flush()
    rng_state = rng.from_json(header["rng"])
    rng.restore(rng_state)
    step = int(header["step"])
    # What landed, digested as the sender digested what it sent; calling state_dict() may draw
    # from the global generator (a raw StatefulDataLoader's does): put the sender's streams back.
    began = time.perf_counter()
    restored = rng.capture()
    pairs, kinds, now = tensors_of(tracked)  # ``now`` is a copy: the optimizers' values as loaded
    rng.restore(restored)
    early = [n for n in tracked if kinds[n] != "optimizer"]
    mine = digests_of(early, pairs, kinds, now, step, restored, reader.terms)
    reader.spent += time.perf_counter() - began
    late = [n for n in tracked if kinds[n] == "optimizer"]
    return Landing(channel, rank, step, arrivals, reader, mine, lambda: digests_of(
        late, pairs, kinds, now, step, restored, reader.terms), on_landed)  # fmt: skip


def first_needs(entries: list[dict[str, Any]], objects: dict[str, str]) -> int:
    """How many of the header's tensors come before the optimizer state: the ones a step needs
    first (its forward and backward read parameters and buffers; only the optimizer step reads
    the optimizer's state). Counted up to the last other tensor, whatever order a sender used."""
    late = tuple(f"{name}.state." for name, kind in objects.items() if kind == "optimizer")
    needed = [i for i, e in enumerate(entries) if not str(e["name"]).startswith(late)] if late else []
    return (needed[-1] + 1 if needed else 0) if late else len(entries)


class _Reader:
    """The digest terms of tensors as they land, read in batches of :data:`DIGEST_BATCH_BYTES`
    (one host read each) while the next ones arrive, and the seconds that took."""

    def __init__(self) -> None:
        self.terms = digest.Terms()
        self.spent = 0.0
        self._batch: list[torch.Tensor] = []
        self._bytes = 0

    def add(self, arrived: torch.Tensor) -> None:
        self._batch.append(arrived)
        self._bytes += arrived.nbytes
        if self._bytes >= DIGEST_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._batch:
            began = time.perf_counter()
            self.terms.read(self._batch)
            self.spent += time.perf_counter() - began
        self._batch, self._bytes = [], 0


class Landing:
    """A transfer whose tensors a step needs first have landed, while the optimizer state lands.

    The optimizer state is two thirds of the bytes with Adam, and only the optimizer step reads
    it: the joiner runs its first forward and backward meanwhile. A thread waits for the rest
    (and takes staged tensors' chunks through the staging buffers), reads its digest terms and
    receives the sender's digests.
    :meth:`finish` must come before anything reads the optimizer state (the runtime calls it
    before the first vote, so a transfer that does not verify is never committed anywhere), and
    it is where a broken channel's error surfaces. ``landed_at``: when the last tensor landed
    (``time.time()``).
    """

    def __init__(
        self, channel: ProcessGroup, rank: int, step: int, rest: Iterator[torch.Tensor], reader: _Reader,
        early: dict[str, str], late: Callable[[], dict[str, str]], on_landed: Callable[[Landing], None] | None,
    ) -> None:  # fmt: skip
        self.step = step
        self.landed_at = 0.0
        self._channel, self._rank, self._rest, self._reader = channel, rank, rest, reader
        self._early, self._late, self._on_landed = early, late, on_landed
        self._trailer: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._land, name="rlaunch-landing", daemon=True)
        self._thread.start()

    def _land(self) -> None:
        try:
            with torch.no_grad():
                for arrived in self._rest:
                    self._reader.add(arrived)
                self._reader.flush()
            backends.current().settle(self._channel)  # every tensor written on the GPU before the channel is retired
            self.landed_at = time.time()
            # at once: the sender's last send (this trailer) ends only when it is received, and the
            # sender exits then (a leaver's process, freeing its memory, is better gone before the vote)
            self._trailer = recv_json(self._channel, "digests")
        except BaseException as exc:  # noqa: BLE001 - raised by finish, on the caller's thread
            self._error = exc
            return
        if self._on_landed is not None:
            self._on_landed(self)

    @property
    def verify_s(self) -> float:
        """The seconds spent on digests so far."""
        return self._reader.spent

    def finish(self) -> Landed:
        """Wait for the rest to land, then compare every digest with the sender's: the move stands,
        or :class:`TransferError` says which object differs (the caller's step must not be applied)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        began = time.perf_counter()
        mine = {**self._early, **self._late()}
        self._reader.spent += time.perf_counter() - began
        trailer = self._trailer
        theirs = trailer.get("digests") if isinstance(trailer, dict) else None
        if not isinstance(theirs, dict):
            raise TransferError(
                "The transfer ended without the digests of what was sent; is the sender another version?"
            )
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name) != theirs.get(name):
                raise TransferError(
                    f"rank {self._rank}: the state of {name!r} that landed on this joiner has digest {mine.get(name)} "
                    f"but its sender computed {theirs.get(name)} over what it sent, so the move is refused before any "
                    "step is applied; this joiner stops rather than train on it."
                )
        return Landed(self.step, self._reader.spent, self._reader.terms)


def live_targets(tracked: dict[str, Any], header: dict[str, Any]) -> list[torch.Tensor]:
    """The joiner's live tensors in the sender's order (created where the joiner lacks optimizer
    state), each checked against its header entry."""
    for name in header["objects"]:
        if name not in tracked:
            raise TransferError(f"The sender tracks {name!r} but this joiner does not; call rt.track() alike.")
    for name in tracked:
        if name not in header["objects"]:
            raise TransferError(f"This joiner tracks {name!r} but the sender does not; call rt.track() alike.")
    live = dict(tensors_of(tracked)[0])
    for entry in header["tensors"]:  # every check first: nothing is written before all pass
        if entry["name"] in live:
            check_tensor(entry, live[entry["name"]])
    return [
        shards.local(live[e["name"]]) if e["name"] in live else _create_optimizer_state(tracked, e)
        for e in header["tensors"]
    ]


def load_values(tracked: dict[str, Any], header: dict[str, Any], values: dict[str, Any]) -> None:
    for name, kind in header["objects"].items():
        obj = tracked[name]
        if kind == "optimizer":
            extra = values[name]
            for group, hyper in zip(obj.param_groups, extra["groups"], strict=True):
                group.update(hyper)
            params = [p for g in obj.param_groups for p in g["params"]]
            _drop_unsent_state(obj, params, name, header, extra["scalars"])
            for key, value in extra["scalars"].items():
                i, k = key.split(".", 1)
                obj.state[params[int(i)]][k] = value
        elif kind == "stateful":
            obj.load_state_dict(values[name])
        elif kind == "module" and isinstance(obj, DistributedDataParallel) and name in values:
            obj.require_forward_param_sync = bool(values[name]["require_forward_param_sync"])
        elif kind != "module":
            raise TransferError(f"The sender describes {name!r} as a {kind!r}, which this joiner does not know.")


def _drop_unsent_state(
    opt: torch.optim.Optimizer, params: list[Any], name: str, header: dict[str, Any], scalars: dict[str, Any]
) -> None:
    """Forget the joiner's optimizer state the sender does not have (a sandbox stepped its own
    Adam; the sender's had not stepped yet, or a GradScaler skipped its steps)."""
    sent: dict[int, set[str]] = {}
    prefix = f"{name}.state."
    for entry in header["tensors"]:
        if entry["name"].startswith(prefix):
            i, key = entry["name"][len(prefix) :].split(".", 1)
            sent.setdefault(int(i), set()).add(key)
    for key in scalars:
        i, k = key.split(".", 1)
        sent.setdefault(int(i), set()).add(k)
    for i, p in enumerate(params):
        state = opt.state.get(p)
        if not state:
            continue
        keep = sent.get(i, set())
        if not keep:
            del opt.state[p]
            continue
        for key in [k for k in state if k not in keep]:
            del state[key]


def dtype_of(entry: dict[str, Any], what: str) -> torch.dtype:
    """The torch dtype a header entry names ("torch.float32"); ``what`` names the tensor in the refusal."""
    dtype = getattr(torch, str(entry["dtype"]).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"{what} has dtype {entry['dtype']!r}, which this rank does not know.")
    return dtype


def _create_optimizer_state(tracked: dict[str, Any], entry: dict[str, Any]) -> torch.Tensor:
    name = entry["name"]
    obj_name, _, rest = name.partition(".state.")
    opt = tracked.get(obj_name)
    if not isinstance(opt, torch.optim.Optimizer) or not rest:
        raise TransferError(f"The joiner has no {name} to receive into; both must track the same objects.")
    index, key = rest.split(".", 1)
    params = [p for g in opt.param_groups for p in g["params"]]
    dtype = dtype_of(entry, f"The sender's {name}")
    param = params[int(index)]
    # the moments live where the parameter does (a GPU for a CUDA model)
    t = torch.empty(tuple(entry["shape"]), dtype=dtype, device=shards.local(param).device)
    # A sharded parameter's moments are DTensors with its layout; the joiner receives into the shard.
    state = shards.like(t, param) if entry.get("shard") is not None else t
    why = shards.mismatch(name, shards.describe(state), entry.get("shard"))
    if why:
        raise TransferError(why)
    opt.state[param][key] = state
    return t


def wire(device_type: str, carried: bool) -> str:
    """How a tensor on ``device_type`` crosses a channel: ``direct`` when the channel's backend
    carries that device's tensors (CPU always; CUDA over NCCL), else ``staged`` through the CPU."""
    return "direct" if device_type == "cpu" or carried else "staged"


def _staged(channel: ProcessGroup, t: torch.Tensor) -> bool:
    return wire(t.device.type, backends.current().carries(channel, t.device.type)) == "staged"


def _entry(channel: ProcessGroup, name: str, t: torch.Tensor) -> dict[str, Any]:
    """A tensor's header entry with how the sender sends it: in staging chunks or whole, from which
    device type (the joiner receives it as it was sent, whatever its own tensor's device)."""
    local = shards.local(t)
    return {**describe(name, t), "wire": "chunked" if _staged(channel, local) else "whole", "device": local.device.type}


def _lands_in_place(entry: dict[str, Any], t: torch.Tensor) -> bool:
    """Whether a whole tensor can be received straight into ``t``: sent from ``t``'s device type, so
    through the backend ``t`` itself would use (else it lands on the sender's device type first)."""
    return entry["device"] == t.device.type


def _receive(
    channel: ProcessGroup, entries: list[dict[str, Any]], targets: list[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """Receive the tensors into ``targets`` as the sender sent them (each entry's ``wire``), and
    yield each target once it landed, in order.

    The receives are posted in the sender's order (gloo pairs them in posting order). Every whole
    tensor's receive up to the next chunked one is posted before the first is waited for, so the
    wire never idles between tensors, and the caller reads each one as it lands while the next
    ones arrive. A whole tensor sent from another device type than its target's (Adam's CPU
    ``step`` for state this joiner created on the GPU) lands on the sender's device type first,
    through the backend the sender used. Chunked tensors come through the staging buffers.
    """
    staging = Staging()
    posted: collections.deque[tuple[Any, torch.Tensor, torch.Tensor | None]] = collections.deque()

    def landed(work: Any, t: torch.Tensor, landing: torch.Tensor | None) -> torch.Tensor:
        work.wait()
        if landing is not None:
            t.copy_(landing)
        return t

    for entry, t in zip(entries, targets, strict=True):
        if entry["wire"] == "chunked":
            while posted:  # the whole tensors posted before it land first
                yield landed(*posted.popleft())
            staging.recv(channel, t, 0, TAG)
            yield t
        elif _lands_in_place(entry, t):
            posted.append((channel.recv([t], 0, TAG), t, None))
        else:
            landing = torch.empty(t.shape, dtype=t.dtype, device=entry["device"])
            posted.append((channel.recv([landing], 0, TAG), t, landing))
    while posted:
        yield landed(*posted.popleft())


def send_host(channel: ProcessGroup, t: torch.Tensor) -> None:
    """Send a tensor the channel carries itself (a CPU one, or a CUDA one over NCCL)."""
    channel.send([t], 1, TAG).wait()


def recv_host(channel: ProcessGroup, t: torch.Tensor) -> None:
    channel.recv([t], 0, TAG).wait()
