"""Tensor and state digests: any flipped bit or moved block changes them; where a tensor lies does not."""

from __future__ import annotations

import pytest
import torch

from rlaunch.runtime import digest


def _d(t: torch.Tensor) -> int:
    return digest.of_items([("t", t)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.bool, torch.complex64, torch.int64])  # fmt: skip
def test_one_flipped_bit_changes_the_digest_for_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.randn(4099) * 5).to(dtype)
    assert _d(t) == _d(t.clone())
    for byte in (0, 7, t.numel() * t.element_size() - 1):
        flipped = t.clone()
        flipped.view(torch.uint8).view(-1)[byte] ^= 1 << 3
        assert _d(flipped) != _d(t), byte


def test_a_view_at_an_odd_offset_digests_as_its_values() -> None:
    t = torch.randn(10_001)
    view = t[1:]
    assert view.data_ptr() % 8 and _d(view) == _d(view.clone())


def test_blocks_in_another_order_change_the_digest() -> None:
    t = torch.arange(3 * digest.BLOCK * 2, dtype=torch.float32)
    swapped = t.view(3, -1)[[1, 0, 2]].reshape(-1)
    assert _d(swapped) != _d(t) and sorted(swapped.tolist()) == sorted(t.tolist())


def test_names_shapes_and_other_values_are_part_of_a_state_digest() -> None:
    t = torch.zeros(6)
    base = digest.of_items([("a", t), ("lr", 0.1)])
    assert base == digest.of_items([("a", t.clone()), ("lr", 0.1)])
    assert base != digest.of_items([("b", t), ("lr", 0.1)])
    assert base != digest.of_items([("a", t.view(2, 3)), ("lr", 0.1)])
    assert base != digest.of_items([("a", t), ("lr", 0.2)])
    assert digest.hexed(base).startswith("0x") and len(digest.hexed(base)) == 18


def test_shared_terms_read_each_tensor_once_and_know_a_detached_view_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A move's transfer check and its first replica check read the same tensors: once."""
    params = [torch.randn(300), torch.randn(7, 5)]
    read: list[int] = []
    real = digest.terms
    monkeypatch.setattr(digest, "terms", lambda t: (read.append(t.numel()), real(t))[1])
    known = digest.Terms()
    first = digest.of_items([("model.w", params[0]), ("model.b", params[1])], known)
    assert sorted(read) == [35, 300]
    again = digest.of_items([("w", params[0].detach()), ("b", params[1])], known)  # as state_dict() gives them
    assert sorted(read) == [35, 300], "no second pass"
    assert again == digest.of_items([("w", params[0]), ("b", params[1])]) and first != again
