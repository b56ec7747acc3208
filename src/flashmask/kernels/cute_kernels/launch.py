"""Compiling and launching the CuTe forward: one compiled kernel per
:class:`~.forward.ForwardVariant` and dtype, built from symbolic tensors (so that it compiles
without a GPU and serves every shape), called with the torch tensors' DLPack views."""

from __future__ import annotations

import functools
import os

import torch

from flashmask._tensor_cache import TensorKeyedCache
from flashmask.kernels import hardware, preparation
from flashmask.kernels.tiles import TileLists

# This family targets Hopper: compile for sm_90a, also on a machine without a GPU. CuTe DSL reads
# the variable when it is first imported, so set it before anything imports ``cutlass``.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# The forward's K/V ring slots per head dim at 128-key tiles (64-key at D = 256): K and V
# slots of 32 KB each at D = 128 plus the 32 KB Q tile fit the 227 KB in three; at D = 192
# (MLA, V's head dim 128) the 48 KB Q tile and two 48 + 32 KB slots take 208 KB.
KV_STAGES = {64: 4, 128: 3, 192: 2, 256: 2}


def key_tile(head_dim: int) -> int:
    """Keys per tile of the CuTe forward at ``head_dim`` (Q/K's)."""
    return 64 if head_dim > 192 else 128


def _dtype(torch_dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[torch_dtype]


def _symbolic(dtype, rank: int, divisibility: int):
    """A symbolic tensor of ``rank`` modes, every extent and stride dynamic except a unit last
    stride (what ``from_dlpack(...).mark_layout_dynamic`` of a tensor with a contiguous last
    dimension gives)."""
    import cutlass.cute as cute

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = (*(cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)), 1)
    return cute.runtime.make_fake_tensor(
        dtype, shape, stride=stride, assumed_align=divisibility * dtype.width // 8
    )


@functools.cache
def compiled_forward(variant, torch_dtype: torch.dtype):
    """The compiled :class:`~.forward.HopperForward` of ``variant`` for ``torch_dtype``
    (for sm_90a, with or without a GPU)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from flashmask.kernels.cute_kernels.forward import HopperForward

    dtype = _dtype(torch_dtype)
    tensors = (
        _symbolic(dtype, 4, 8),  # q
        _symbolic(dtype, 4, 8),  # k
        _symbolic(dtype, 4, 8),  # v
        _symbolic(dtype, 4, 8),  # out
        _symbolic(cutlass.Float32, 3, 1),  # lse
        _symbolic(cutlass.Int32, 4, 4),  # bounds, column-major: 16-byte columns
        _symbolic(cutlass.Int32, 4, 1),  # entries
        _symbolic(cutlass.Int32, 3, 1),  # counts
        _symbolic(cutlass.Int32, 1, 1),  # order
        _symbolic(cutlass.Int32, 1, 1),  # next item counter (persistent)
    )
    stream = cuda.CUstream(0)
    return cute.compile(
        HopperForward(variant),
        *tensors,
        cutlass.Int32(1),  # programs (persistent)
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        stream,
    )


# Column-major bounds of each row-major bounds tensor, kept while that tensor lives unchanged
# (the preparation's cache hands every layer the same one).
_COLUMN_MAJOR: TensorKeyedCache[torch.Tensor] = TensorKeyedCache(capacity=8)


def column_major_bounds(bounds: torch.Tensor, seqlen_q: int, columns: int) -> torch.Tensor:
    """The CuTe forward's form of ``bounds [B, Hm, 4, Sk]``: int32 ``[B, Hm, columns, 4]``,
    contiguous, so that a key column's ``(LTS, LTE, UTS, UTE)`` is one 16-byte load. The
    ``columns - Sk`` columns past the keys (``columns``: the key tiles' width) hide every row,
    ``(0, seqlen_q, 0, 0)``, so that the kernel needs no range check. Cached per ``bounds``
    tensor where the preparation caches (not under graph capture or ``torch.compile``)."""

    def build() -> torch.Tensor:
        b, hm, _, sk = bounds.shape
        out = torch.zeros(b, hm, columns, 4, dtype=torch.int32, device=bounds.device)
        out[:, :, :sk] = bounds.transpose(2, 3)
        out[:, :, sk:, 1] = seqlen_q
        return out

    if not preparation.may_cache(bounds.device):
        return build()
    return _COLUMN_MAJOR.get(bounds, (seqlen_q, columns), build)


@functools.cache
def _unread_bounds(device: torch.device) -> torch.Tensor:
    """A 16-byte aligned stand-in for the bounds of an unmasked call (the kernel reads none)."""
    return torch.zeros(1, 1, 1, 4, dtype=torch.int32, device=device)


def _view(x: torch.Tensor, align: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(x.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=x.ndim - 1)


def persistent_programs(
    num_items: int, device: torch.device, persistent: bool, unread: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``(counter, programs)`` of a launch over ``num_items`` (query tile, query head, batch)
    items: for the persistent variant ``min(num_items, SMs)`` programs and a zeroed int32
    counter they take the items past the first ``programs`` from, allocated only when some
    program takes more than one; otherwise ``unread`` (an int32 tensor the kernel never
    reads)."""
    if not persistent:
        return unread, 1
    programs = min(num_items, hardware.multiprocessor_count(device))
    if programs < num_items:
        return torch.zeros(1, dtype=torch.int32, device=device), programs
    return unread, programs


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    mask_heads: int,
    causal: bool,
    has_upper: bool,
    softmax_scale: float,
    skip_tiles: bool,
    order: torch.Tensor | None = None,
    persistent: bool | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, Hq, Dv], lse float32 [B, Hq, Sq])`` of the CuTe forward over ``lists``
    (row-major, ``(128, key_tile(D))`` tiles) and ``bounds [B, Hm, 4, Sk]`` (``None``: no
    interval mask). ``q``/``k`` ``[..., D]``, ``v [..., Dv]`` (``Dv <= D``) contiguous, 16-byte
    aligned, bf16 or fp16.

    ``persistent``: launch the persistent variant (one program per SM, at most one per query
    tile, taking the (query tile, head, batch) items in ``order`` from a counter) instead of
    one program per item. ``None`` (the default) takes it exactly for a non-causal interval
    mask (``bounds`` given, ``causal`` false); ``True``/``False`` force either on any call, so
    that a benchmark or a test can compare both on the same inputs. ``softcap > 0`` caps the
    scaled scores at ``softcap * tanh(score / softcap)`` (then any nonzero scale runs)."""
    import cuda.bindings.driver as cuda

    from flashmask.kernels.cute_kernels.forward import BLOCK_M, LOG2E, ForwardVariant

    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    has_mask = bounds is not None
    if persistent is None:
        persistent = has_mask and not causal
    variant = ForwardVariant(
        head_dim=d,
        block_n=key_tile(d),
        kv_stages=KV_STAGES[d],
        causal=causal,
        has_mask=has_mask,
        has_upper=has_mask and has_upper,
        mask_full_tiles=not skip_tiles,
        ordered=order is not None,
        persistent=persistent,
        head_dim_v=dv if dv != d else None,
        softcap=float(softcap),
    )
    kernel = compiled_forward(variant, q.dtype)
    out = q.new_empty(b, sq, hq, dv)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if order is None:
        order = lists.counts.view(-1)  # never read
    if bounds is None:
        bounds = _unread_bounds(q.device)
    else:
        bounds = column_major_bounds(bounds, sq, lists.entries.shape[-1] * key_tile(d))
    num_items = -(-sq // BLOCK_M) * hq * b
    next_item, programs = persistent_programs(num_items, q.device, persistent, order)
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel(
        _view(q, 16), _view(k, 16), _view(v, 16), _view(out, 16), _view(lse, 4),
        _view(bounds, 16), _view(lists.entries, 4), _view(lists.counts, 4), _view(order, 4),
        _view(next_item, 4), programs, k.shape[1], hq // k.shape[2], hq // mask_heads,
        softmax_scale * LOG2E, stream,
    )  # fmt: skip
    return out, lse
