"""gafused._tensor_cache.TensorKeyCache: by identity, weakly, and never handing one tensor another's entry."""

from __future__ import annotations

import gc

import pytest
import torch

from gafused._tensor_cache import TensorKeyCache


def test_entries_are_by_identity_not_value():
    cache: TensorKeyCache[str] = TensorKeyCache()
    a, b = torch.zeros(3), torch.zeros(3)  # equal values, two tensors
    cache[a] = "a"
    assert cache.get(a) == "a" and cache[a] == "a" and a in cache
    assert cache.get(b) is None and b not in cache
    with pytest.raises(KeyError):
        cache[b]
    assert cache.get(a.view(3)) is None  # a view is another tensor object
    assert "a" not in cache and None not in cache


def test_an_entry_goes_with_its_tensor_and_is_never_found_by_a_reused_id():
    cache: TensorKeyCache[int] = TensorKeyCache()
    kept = torch.zeros(1)
    cache[kept] = 0
    ids = []
    for index in range(200):
        tensor = torch.zeros(2)
        assert tensor not in cache, "a tensor at a freed tensor's id must not find that tensor's entry"
        ids.append(id(tensor))
        cache[tensor] = index + 1
        del tensor  # freed here (no cycle holds it): its id may be the next tensor's
    assert len(set(ids)) < len(ids), "no id was reused: the test checked nothing"
    gc.collect()
    assert len(cache) == 1 and list(cache.items()) == [(kept, 0)]


def test_replacing_an_entry_keeps_it_until_the_tensor_goes():
    cache: TensorKeyCache[str] = TensorKeyCache()
    tensor = torch.zeros(1)
    cache[tensor] = "first"
    cache[tensor] = "second"  # the first entry's weak reference still fires when the tensor goes: harmless
    assert cache[tensor] == "second" and len(cache) == 1
    del tensor
    assert len(cache) == 0


def test_a_cached_value_does_not_keep_its_tensor_alive():
    cache: TensorKeyCache[list] = TensorKeyCache()
    tensor = torch.zeros(4)
    cache[tensor] = [tensor.detach().view(2, 2)]  # views of a detached alias, as the foreach backend keeps
    del tensor
    gc.collect()
    assert len(cache) == 0
