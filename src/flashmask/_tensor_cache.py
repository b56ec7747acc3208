"""A small cache of values derived from tensors, valid while the tensor is alive and unchanged.

Two places need one: the kernels' mask preparation (every layer of a model, and each backward,
gets the same ``startend_row_indices`` object) and the transformers integration (every layer of
a forward gets the same ``position_ids`` / ``cu_seq_lens`` / padding-mask object).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import torch

_Value = TypeVar("_Value")


class TensorKeyedCache(Generic[_Value]):
    """Values keyed by ``(tensor, key)``, most recently used last, at most ``capacity`` of them.

    An entry matches only the same tensor object (held through a weak reference, so a freed
    tensor whose memory or ``id`` is reused never matches), at the same ``_version`` (an in-place
    edit invalidates it), with an equal ``key`` (the caller's parameters). An entry goes when its
    tensor is freed (so what it holds, e.g. GPU memory, goes too) or when newer entries push it
    out. Values are computed outside the lock (two threads may both compute one; the last one
    stays). Nothing is cached while ``torch.compile`` traces (the value would be a fake), and
    nothing is looked up or cached while a CUDA graph captures on the tensor's device: a value
    computed before the capture would leave its kernels out of the graph (a replay after the
    tensor's contents change would reuse it), and one computed in the capture lives in the graph's
    memory pool.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, Hashable], tuple[weakref.ref, int, _Value]] = (
            OrderedDict()
        )
        # Reentrant: a tensor's weakref callback may fire inside the locked section (a tensor
        # freed by an eviction).
        self._lock = threading.RLock()

    def get(self, tensor: torch.Tensor, key: Hashable, compute: Callable[[], _Value]) -> _Value:
        """The cached value of ``(tensor, key)``, or ``compute()``'s, then cached."""
        if torch.compiler.is_compiling() or _capturing(tensor):
            return compute()
        full_key = (id(tensor), key)
        with self._lock:
            entry = self._entries.get(full_key)
            if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
                self._entries.move_to_end(full_key)
                return entry[2]
        value = compute()
        ref = weakref.ref(tensor, functools.partial(self._forget, full_key))
        with self._lock:
            self._entries[full_key] = (ref, tensor._version, value)
            self._entries.move_to_end(full_key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value

    def _forget(self, full_key: tuple[int, Hashable], ref: weakref.ref) -> None:
        """Drop the entry of a tensor that was freed (unless a newer tensor took its key)."""
        with self._lock:
            entry = self._entries.get(full_key)
            if entry is not None and entry[0] is ref:
                del self._entries[full_key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def tensor_ids(self) -> Iterator[int]:
        """The ``id`` of each entry's tensor, least recently used first."""
        with self._lock:
            keys = list(self._entries)
        return (tensor_id for tensor_id, _ in keys)


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether the current stream of ``tensor``'s CUDA device is capturing a CUDA graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
