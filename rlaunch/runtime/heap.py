"""Live objects of a class, found by one scan of the heap: for rare, one-off checks, never per step."""

from __future__ import annotations

import gc
from typing import TypeVar, cast

T = TypeVar("T")


def instances(cls: type[T]) -> list[T]:
    """Every object of ``cls`` (or a subclass) that the garbage collector tracks."""
    # issubclass(type(o)) rather than isinstance: isinstance also reads o.__class__, which some of
    # torch's deprecated objects answer with a FutureWarning (torch.distributed.reduce_op)
    return cast("list[T]", [o for o in gc.get_objects() if issubclass(type(o), cls)])
