"""The state transfer over a real two-rank gloo channel: JSON header, safe loading, checks first."""

from __future__ import annotations

import datetime
import json
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed import HashStore, ProcessGroup
from torch.distributed.distributed_c10d import ProcessGroupGloo

from rlaunch.runtime import pending, rng, staging, transfer
from rlaunch.runtime.staging import Staging, chunks
from rlaunch.runtime.transfer import TransferError, recv_state, send_state
from tests.unit import gloo_groups as gloo


def _pair() -> tuple[Any, Any]:
    store = HashStore()
    out: dict[int, Any] = {}

    def build(rank: int) -> None:
        # as rlaunch.runtime.backend.build, whose builds are serialized (one process here holds both ends)
        backend = ProcessGroupGloo(store, rank, 2, timeout=datetime.timedelta(seconds=10))
        pg = ProcessGroup(store, rank, 2)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        out[rank] = pg

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gloo.kept(out[0]), gloo.kept(out[1])


def _objects(seed: int, width: int = 8) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    noise = torch.Generator().manual_seed(seed)  # a generator of the script's own
    if seed == 1:  # the sender has trained a little: optimizer state, buffers, scheduler, scaler
        torch.rand(7, generator=noise)
        for _ in range(3):
            scaler.scale(model(torch.randn(16, 4)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "noise": rng.ScriptGenerator(noise)}


def _move(sender: dict[str, Any], receiver: dict[str, Any], step: int = 5) -> tuple[int | None, Exception | None]:
    ch0, ch1 = _pair()
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            send_state(ch0, sender, step, rng.capture())
        except Exception as exc:  # noqa: BLE001 - the receiver's refusal ends the channel
            result["send_error"] = exc

    t = threading.Thread(target=send)
    t.start()
    try:
        got: int | None = recv_state(ch1, receiver).step
        error = None
    except TransferError as exc:
        got, error = None, exc
    t.join(60)
    assert not t.is_alive(), "the sender must not stay blocked"
    return got, error


def _state(objs: dict[str, Any]) -> list[Any]:
    return [
        {k: v.clone() for k, v in objs["model"].state_dict().items()},
        objs["opt"].state_dict(),
        objs["sched"].state_dict(),
        objs["scaler"].state_dict(),
        objs["noise"].generator.get_state().tolist(),
    ]


def test_the_joiner_ends_with_the_senders_state_and_rng() -> None:
    sender, receiver = _objects(1), _objects(0)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    expected = rng.capture()
    step, error = _move(sender, receiver)
    assert error is None and step == 5
    sent, got = _state(sender), _state(receiver)
    for name, t in sent[0].items():
        assert torch.equal(t, got[0][name]), name
    assert json.dumps(sent[2], default=str) == json.dumps(got[2], default=str)
    assert sent[3] == got[3]
    assert sent[4] == got[4], "the script's own generator continues the sender's stream"
    assert str(sent[1]) == str(got[1])
    assert rng.fingerprint(rng.capture()) == rng.fingerprint(expected)


def test_a_mismatched_tensor_is_refused_before_anything_is_written() -> None:
    sender, receiver = _objects(1), _objects(0, width=6)
    before = _state(receiver)
    step, error = _move(sender, receiver)
    assert step is None and error is not None
    assert "model.0.weight" in str(error) and "(6, 4)" in str(error) and "(8, 4)" in str(error)
    after = _state(receiver)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), "no tensor may be written"
    assert before[2] == after[2] and before[3] == after[3], "no stateful object may be loaded"


class Opaque:
    """A value only a free unpickler would rebuild (it runs code named by the bytes)."""


class Evil:
    def state_dict(self) -> dict[str, Any]:
        return {"x": Opaque()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("must never be loaded")


def test_values_a_restricted_loader_refuses_are_refused() -> None:
    sender = {**_objects(1), "evil": Evil()}
    receiver = {**_objects(0), "evil": Evil()}
    step, error = _move(sender, receiver)
    assert step is None and error is not None and "cannot be loaded safely" in str(error)


def test_rng_states_round_trip_through_json() -> None:
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    state = rng.capture()
    decoded = rng.from_json(json.loads(json.dumps(rng.to_json(state))))
    draws = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    rng.restore(decoded)
    assert (torch.rand(3).tolist(), random.random(), float(np.random.rand())) == draws


@pytest.mark.parametrize("values", [[5, 5, 5], [0, 0], [2**20 - 1] * 7])
def test_uniform_fingerprints_are_recognised(values: list[int]) -> None:
    from rlaunch.runtime.stepstate import uniform, vote_terms

    summed = [sum(x) for x in zip(*(vote_terms([v]) for v in values), strict=True)]
    assert uniform(len(values), summed) == [True]
    summed = [sum(x) for x in zip(*(vote_terms([v + i]) for i, v in enumerate(values)), strict=True)]
    assert uniform(len(values), summed) == [False]


def test_optimizer_state_the_sender_never_had_is_dropped_on_the_joiner() -> None:
    """A fault in step 0 (or a GradScaler still skipping steps): the sender's Adam has no state yet,
    but the joiner's sandbox stepped its own. It must not keep it: the next step would differ."""
    sender, receiver = _objects(0), _objects(0)
    opt = receiver["opt"]
    receiver["model"](torch.randn(16, 4)).sum().backward()
    opt.step()  # the sandbox's own step: moments the sender does not have
    assert opt.state and not sender["opt"].state
    step, error = _move(sender, receiver)
    assert error is None and step == 5
    assert not opt.state, "the joiner holds exactly the sender's (empty) optimizer state"
    # and the next step is the same on both
    for objs in (sender, receiver):
        objs["opt"].zero_grad(set_to_none=True)
        torch.manual_seed(11)
        objs["model"](torch.randn(16, 4)).sum().backward()
        objs["opt"].step()
    pairs = zip(sender["model"].parameters(), receiver["model"].parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


class _Tampering:
    """A channel that flips one bit of the n-th tensor it sends (a copy: the sender's state is intact)."""

    def __init__(self, inner: ProcessGroup, nth: int) -> None:
        self._inner, self._nth, self._sent = inner, nth, 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._sent += 1
        if self._sent == self._nth:
            copy = tensors[0].clone()
            copy.view(torch.uint8).view(-1)[3] ^= 1 << 5
            tensors = [copy]
        return self._inner.send(tensors, dst, tag)


def test_a_tampered_transfer_is_refused_naming_the_object_and_both_digests() -> None:
    sender, receiver = _objects(1), _objects(0)
    ch0, ch1 = _pair()
    # frames: header size, header, blob, then tensors in tensors_of order: model.0.weight is the 4th
    tamper = _Tampering(ch0, 4)
    t = threading.Thread(target=lambda: send_state(tamper, sender, 5, rng.capture()))  # type: ignore[arg-type]
    t.start()
    with pytest.raises(TransferError) as refused:
        recv_state(ch1, receiver, rank=1)
    t.join(60)
    text = str(refused.value)
    assert "rank 1: the state of 'model' that landed on this joiner has digest 0x" in text
    assert "but its sender computed 0x" in text and "refused before any step is applied" in text
    mine, theirs = (text.split("digest ")[1].split()[0], text.split("computed ")[1].split()[0])
    assert mine != theirs


def _on_both_ends(send: Callable[[], None], recv: Callable[[], None]) -> None:
    failure: list[BaseException] = []

    def run() -> None:
        try:
            send()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    t = threading.Thread(target=run)
    t.start()
    recv()
    t.join(60)
    assert not t.is_alive() and not failure, failure


def test_staged_tensors_cross_in_chunks_through_two_host_buffers_and_land_bit_identical() -> None:
    torch.manual_seed(0)
    sent = [
        torch.randn(1000),  # 4,000 bytes: four chunks, the last one short
        torch.randn(33, 7).to(torch.bfloat16),
        torch.rand(999) > 0.5,
        torch.randint(-(2**62), 2**62, (65,), dtype=torch.int64),
        torch.empty(0),
        torch.randn(40, 30),  # lands in a transposed (non-contiguous) view
    ]
    targets = [torch.zeros_like(t) for t in sent[:-1]] + [torch.zeros(30, 40).t()]
    ch0, ch1 = _pair()
    out, into = Staging(pin=False, chunk=1024), Staging(pin=False, chunk=1024)
    _on_both_ends(
        lambda: [out.send(ch0, t, 1, 3) for t in sent],  # type: ignore[func-returns-value]
        lambda: [into.recv(ch1, t, 0, 3) for t in targets],  # type: ignore[func-returns-value]
    )
    for t, got in zip(sent, targets, strict=True):
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert out.held_bytes == into.held_bytes == 2 * 1024, "two chunk buffers per end, whatever the tensor sizes"
    assert chunks(4000, 1024) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4000)] and chunks(0, 1024) == []


def _moved_bit_identical() -> dict[str, Any]:
    """Move a trained sender's state into a fresh joiner; both must then hold the same model and
    optimizer state. Returns the sender's objects."""
    sender, receiver = _objects(1, width=16), _objects(0, width=16)
    step, error = _move(sender, receiver)
    assert error is None and step == 5
    sent, got = _state(sender), _state(receiver)
    assert all(torch.equal(t, got[0][name]) for name, t in sent[0].items())
    assert str(sent[1]) == str(got[1])
    return sender


def test_a_transfer_whose_tensors_are_all_staged_lands_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a CUDA model's state crosses a gloo channel: every tensor through the host buffers, in
    chunks smaller than most tensors, and the digests still agree."""
    monkeypatch.setattr(transfer, "_staged", lambda channel, t: True)
    monkeypatch.setattr(staging, "CHUNK_BYTES", 48)
    _moved_bit_identical()


@pytest.mark.parametrize("mismatch", ["sender_stages", "devices_differ"])
def test_the_joiner_receives_each_tensor_as_the_sender_sent_it(monkeypatch: pytest.MonkeyPatch, mismatch: str) -> None:
    """The two ends need not hold a tensor alike: the header says how and from which device type
    each tensor was sent, and the joiner follows it. ``sender_stages``: the sender's tensors go
    through its staging chunks (a CUDA model over gloo) into CPU ones. ``devices_differ``: a
    whole tensor sent from one device type lands there first, then in a target on another (Adam's
    CPU ``step`` for state a joiner created on its GPU), here standing in as a CPU landing."""
    if mismatch == "sender_stages":
        receiving = threading.main_thread()  # _move receives on the test's thread, sends on another
        monkeypatch.setattr(transfer, "_staged", lambda channel, t: threading.current_thread() is not receiving)
        monkeypatch.setattr(staging, "CHUNK_BYTES", 40)
    else:
        landed_apart: list[torch.Tensor] = []

        def lands_in_place(entry: dict[str, Any], t: torch.Tensor) -> bool:
            landed_apart.append(t)
            return False

        monkeypatch.setattr(transfer, "_lands_in_place", lands_in_place)
    sender = _moved_bit_identical()
    if mismatch == "devices_differ":
        assert len(landed_apart) == len(transfer.tensors_of(sender)[0]), "every tensor landed apart, then in place"


class _Holding:
    """A channel that holds back every tensor after the first ``n`` until ``go`` is set (a slow
    wire for the optimizer state), as a sender whose bytes are still on their way."""

    def __init__(self, inner: ProcessGroup, n: int) -> None:
        self._inner, self._n, self._sent = inner, n, 0
        self.go = threading.Event()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._sent += 1
        if self._sent > self._n:
            assert self.go.wait(30), "the joiner never asked for the rest"
        return self._inner.send(tensors, dst, tag)


def _frames_before_the_optimizer_state(objs: dict[str, Any]) -> int:
    """The sender's frames up to its last tensor before the optimizer state: header size, header,
    blob, then the tensors in tensors_of order."""
    pairs, _, _ = transfer.tensors_of(objs)
    return 3 + sum(1 for name, _ in pairs if not name.startswith("opt.state."))


def test_the_first_step_starts_on_the_parameters_and_a_read_of_the_optimizer_state_waits_for_it() -> None:
    """The joiner gets control once the model's tensors landed, while its optimizer state is still on
    the wire; its script reading ``opt.state`` then (a checkpoint at a step's top) waits for the whole
    state, verified, and the optimizer is its own class again."""
    sender, receiver = _objects(1), _objects(0)
    assert [n for n, _ in transfer.tensors_of(sender)[0]][-1].startswith("opt.state."), "optimizer state last"
    ch0, ch1 = _pair()
    slow = _Holding(ch0, _frames_before_the_optimizer_state(sender))
    t = threading.Thread(target=lambda: send_state(slow, sender, 5, rng.capture()))  # type: ignore[arg-type]
    t.start()
    landing = transfer.receive_state(ch1, receiver, rank=1)
    assert landing.step == 5
    sent = _state(sender)
    assert all(torch.equal(v, receiver["model"].state_dict()[k]) for k, v in sent[0].items()), "the model landed"
    opt = receiver["opt"]
    exp_avg = next(iter(opt.state.values()))["exp_avg"]  # read before the hold: the tensor the rest lands in
    assert not torch.equal(exp_avg, next(iter(sender["opt"].state.values()))["exp_avg"]), "still on the wire"
    landed: list[transfer.Landed] = []

    def land() -> None:
        slow.go.set()
        try:
            landed.append(landing.finish())
        finally:
            held.release()

    held = pending.hold([opt], land)
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "AdamW" and type(opt) is not torch.optim.AdamW
    state = opt.state_dict()  # the script's read: it waits for the landing
    assert landed and type(opt) is torch.optim.AdamW
    t.join(60)
    assert str(state) == str(sent[1]) and str(opt.state_dict()) == str(sent[1])


def test_optimizer_state_that_lands_tampered_is_refused_at_the_finish() -> None:
    """The first step may run on the parameters, but the move is refused before its vote: the
    optimizer's state that landed differs from what was sent."""
    sender, receiver = _objects(1), _objects(0)
    ch0, ch1 = _pair()
    tamper = _Tampering(ch0, _frames_before_the_optimizer_state(sender) + 2)  # an optimizer tensor
    t = threading.Thread(target=lambda: send_state(tamper, sender, 5, rng.capture()))  # type: ignore[arg-type]
    t.start()
    landing = transfer.receive_state(ch1, receiver, rank=1)
    with pytest.raises(TransferError) as refused:
        landing.finish()
    t.join(60)
    assert "rank 1: the state of 'opt' that landed on this joiner has digest 0x" in str(refused.value)


def test_a_sender_that_sends_the_optimizer_state_first_still_lands_whole() -> None:
    """A joiner does not rely on the order: the first part runs up to the last tensor that is not
    optimizer state, wherever the sender put it."""
    entries = [{"name": n} for n in ("opt.state.0.exp_avg", "model.w", "opt.state.0.step", "model.b", "opt.state.1.s")]
    assert transfer.first_needs(entries, {"model": "module", "opt": "optimizer"}) == 4
    assert transfer.first_needs(entries[:1], {"opt": "optimizer"}) == 0
    assert transfer.first_needs(entries, {"model": "module", "opt": "module"}) == 5


def test_the_sender_hears_once_the_part_a_first_step_waits_for_is_sent() -> None:
    """A leaver lowers its priority then (the joiner's first step comes first); the rest still lands."""
    sender, receiver = _objects(1), _objects(0)
    ch0, ch1 = _pair()
    heard: list[bool] = []
    landing: list[transfer.Landing] = []
    t = threading.Thread(target=lambda: landing.append(transfer.receive_state(ch1, receiver, rank=1)))
    t.start()
    send_state(ch0, sender, 5, rng.capture(), first_sent=lambda: heard.append(bool(landing) or t.is_alive()))
    t.join(60)
    assert heard == [True] and landing[0].finish().step == 5
    assert str(_state(sender)[1]) == str(_state(receiver)[1])
