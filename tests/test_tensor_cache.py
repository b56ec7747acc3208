"""``TensorKeyedCache``: values derived from a tensor are reused exactly while that tensor object
is alive and unchanged, per key, within a bounded number of entries."""

from __future__ import annotations

import gc

import pytest
import torch

from flashmask._tensor_cache import TensorKeyedCache


class Counter:
    """A ``compute`` that returns how often it was called."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls


def test_reused_while_the_tensor_is_alive_and_unchanged_per_key():
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    compute = Counter()
    t = torch.zeros(3)
    assert cache.get(t, "a", compute) == 1
    assert cache.get(t, "a", compute) == 1
    assert cache.get(t, "b", compute) == 2  # another key: its own entry
    assert cache.get(t, "a", compute) == 1
    assert cache.get(torch.zeros(3), "a", compute) == 3  # an equal tensor is not the same one


def test_an_in_place_edit_invalidates():
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    compute = Counter()
    t = torch.zeros(3)
    cache.get(t, None, compute)
    t.add_(1)
    assert cache.get(t, None, compute) == 2
    assert cache.get(t, None, compute) == 2


def test_a_freed_tensor_s_entries_go_with_it_and_never_match_a_successor():
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    compute = Counter()
    t = torch.zeros(3)
    cache.get(t, "a", compute)
    cache.get(t, "b", compute)
    assert len(cache) == 2
    del t
    gc.collect()
    assert len(cache) == 0
    # Whatever reuses the freed tensor's id or memory is computed afresh.
    assert cache.get(torch.zeros(3), "a", compute) == 3


def test_the_least_recently_used_entries_are_dropped_beyond_capacity():
    cache: TensorKeyedCache[int] = TensorKeyedCache(2)
    tensors = [torch.zeros(1) for _ in range(3)]
    compute = Counter()
    cache.get(tensors[0], None, compute)
    cache.get(tensors[1], None, compute)
    cache.get(tensors[0], None, compute)  # now the most recent
    cache.get(tensors[2], None, compute)
    assert list(cache.tensor_ids()) == [id(tensors[0]), id(tensors[2])]
    cache.clear()
    assert len(cache) == 0


def test_nothing_is_cached_while_torch_compile_traces(monkeypatch):
    cache: TensorKeyedCache[int] = TensorKeyedCache(2)
    compute = Counter()
    t = torch.zeros(1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [cache.get(t, None, compute) for _ in range(2)] == [1, 2]
    assert len(cache) == 0


def test_nothing_is_reused_or_cached_while_a_cuda_graph_captures(monkeypatch):
    """A value computed before a capture would leave its kernels out of the graph."""
    import flashmask._tensor_cache as tensor_cache

    cache: TensorKeyedCache[int] = TensorKeyedCache(2)
    compute = Counter()
    t = torch.zeros(1)
    assert cache.get(t, None, compute) == 1
    monkeypatch.setattr(tensor_cache, "_capturing", lambda tensor: True)
    assert [cache.get(t, None, compute) for _ in range(2)] == [2, 3]
    assert len(cache) == 1
    monkeypatch.undo()
    assert cache.get(t, None, compute) == 1


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        TensorKeyedCache(0)
