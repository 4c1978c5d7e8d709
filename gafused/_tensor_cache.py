"""A cache keyed by tensor identity that holds its keys weakly, for the backends' per-buffer tables and views.

torch's ``WeakTensorKeyDictionary`` does the same job, but each lookup builds a weak reference object and compares
it (a few microseconds); the backends look one up per op call, where gafused's whole host work on a small layout is
a few tens of microseconds. Here a lookup is a plain dict access by ``id(tensor)`` and one weak reference call.
An entry goes when its tensor is freed (the weak reference's callback), before the id can be reused.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

__all__ = ["TensorKeyCache"]

V = TypeVar("V")


class TensorKeyCache(Generic[V]):
    """``cache[tensor] = value``, ``cache.get(tensor)``, ``tensor in cache``, ``len(cache)``, ``cache.items()``: by
    the tensor object's identity, never by value; a key does not keep its tensor alive."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, tensor: torch.Tensor) -> V | None:
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return None

    def __getitem__(self, tensor: torch.Tensor) -> V:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            raise KeyError(f"no entry for this tensor (id {id(tensor)})")
        return entry[1]

    def __setitem__(self, tensor: torch.Tensor, value: V) -> None:
        key = id(tensor)
        entries = self._entries

        def forget(ref: weakref.ref, key: int = key) -> None:
            # Only this tensor's own entry: a later one under the same id was made for another tensor.
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        self._entries[key] = (weakref.ref(tensor, forget), value)

    def __contains__(self, tensor: object) -> bool:
        entry = self._entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Iterator[tuple[torch.Tensor, V]]:
        """The live entries (a snapshot: the cache may change while the caller iterates)."""
        for ref, value in list(self._entries.values()):
            tensor = ref()
            if tensor is not None:
                yield tensor, value
