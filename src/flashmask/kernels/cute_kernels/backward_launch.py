"""Compiling and launching the CuTe backward (``backward.HopperBackward``): one compiled kernel
per :class:`~.backward.BackwardVariant` and dtype, built from symbolic tensors (it compiles
without a GPU and serves every shape), called with the torch tensors' DLPack views."""

from __future__ import annotations

import functools

import torch

# launch sets CUTE_DSL_ARCH before anything imports cutlass.
from flashmask.kernels.cute_kernels import launch
from flashmask.kernels.tiles import TileLists

# Head dims the kernel is written for: its shared memory (224 KB at D = 128) leaves no room
# for D = 256, and D = 64 would want other tiles.
HEAD_DIMS = (128,)


@functools.cache
def compiled_backward(variant, torch_dtype: torch.dtype):
    """The compiled :class:`~.backward.HopperBackward` of ``variant`` for ``torch_dtype`` (for
    sm_90a, with or without a GPU)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from flashmask.kernels.cute_kernels.backward import HopperBackward

    dtype = launch._dtype(torch_dtype)
    symbolic = launch._symbolic
    tensors = (
        *(symbolic(dtype, 4, 8) for _ in range(4)),  # q, k, v, dout
        symbolic(cutlass.Float32, 3, 1),  # lse
        symbolic(cutlass.Float32, 3, 1),  # delta
        symbolic(cutlass.Float32, 4, 4),  # dq accumulator
        symbolic(dtype, 4, 8),  # dk
        symbolic(dtype, 4, 8),  # dv
        symbolic(cutlass.Int32, 4, 4),  # bounds, column-major: 16-byte columns
        symbolic(cutlass.Int32, 4, 1),  # entries
        symbolic(cutlass.Int32, 3, 1),  # counts
        symbolic(cutlass.Int32, 1, 1),  # order
    )
    return cute.compile(
        HopperBackward(variant),
        *tensors,
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cuda.CUstream(0),
    )


def one_launch(q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool) -> bool:
    """Always: :func:`backward` runs all of ``q``'s rows in one launch (as the Gluon modules'
    ``one_launch`` answers for theirs), so one dQ accumulator spans them."""
    return True


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    skip_tiles: bool = True,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``(q, k, v)`` of the CuTe backward.

    ``dout``, ``q``: ``[B, Sq, Hq, D]``; ``k``, ``v``: ``[B, Sk, Hk, D]``; contiguous, 16-byte
    aligned, one fp16/bf16 dtype, ``D`` in :data:`HEAD_DIMS`. ``lse`` (the forward's) and
    ``delta`` (``backward_launcher.backward_delta``): float32 ``[B, Hq, Sq]``. ``bounds``
    (``[B, Hm, 4, Sk]``, ``None`` without a mask) and ``lists`` (column-major at 64 x 128 tiles)
    from ``preparation.prepare_cached``; ``order`` (``preparation.program_order`` over the grid
    ``(key tiles, Hk, B)``, ``None``: the grid's order). ``dq_accumulator``: a zeroed float32
    tensor like ``q`` that dQ is added into (``None``: zeroed here). Any lengths: TMA reads past
    a sequence as zeros and clips the stores."""
    import cuda.bindings.driver as cuda

    from flashmask.kernels.cute_kernels.backward import BLOCK_N, BackwardVariant
    from flashmask.kernels.cute_kernels.forward import LOG2E

    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"q: the CuTe backward takes head dims {HEAD_DIMS}, got {d}")
    has_mask = bounds is not None
    variant = BackwardVariant(
        head_dim=d,
        causal=causal,
        has_mask=has_mask,
        has_upper=has_mask and not causal,
        mask_full_tiles=not skip_tiles,
        ordered=order is not None,
    )
    kernel = compiled_backward(variant, q.dtype)
    if dq_accumulator is None:
        dq_accumulator = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if order is None:
        order = lists.counts.view(-1)  # never read
    if bounds is None:
        bounds = launch._unread_bounds(q.device)
    else:
        bounds = launch.column_major_bounds(bounds, q.shape[1], lists.entries.shape[-2] * BLOCK_N)
    view = launch._view
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel(
        view(q, 16), view(k, 16), view(v, 16), view(dout, 16), view(lse, 4), view(delta, 4),
        view(dq_accumulator, 16), view(dk, 16), view(dv, 16), view(bounds, 16),
        view(lists.entries, 4), view(lists.counts, 4), view(order, 4), k.shape[1],
        q.shape[2] // k.shape[2], q.shape[2] // num_mask_heads, softmax_scale * LOG2E,
        softmax_scale, stream,
    )  # fmt: skip
    return dq_accumulator.to(q.dtype), dk, dv
