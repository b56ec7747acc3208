"""Learnable attention sinks on the GPU: the forward's fold and the sinks' gradient.

The CuTe forward joins the sinks to each row in its epilogue; after every other kernel family
:func:`fold_sinks` joins them to the finished rows in place (one pass over ``out``,
``triton_kernels.sinks``). Either way the backward kernels receive the folded ``out`` and ``lse``
and need nothing else: with the sink in the denominator, ``P`` recomputed from ``lse'`` is the
sink-aware probability, and ``rowsum(dO * O')`` is still the softmax's row term because the
sink carries no value. The sinks' gradient needs only that row term
(:func:`flashmask.reference.sink_gradient`), which the backward computes anyway;
:func:`sink_gradient` sums it in one launch.
"""

from __future__ import annotations

import torch

from flashmask.kernels import tensors
from flashmask.kernels.launch import launch_kernel


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Join ``sinks`` (``[Hq]``, any floating dtype) to a forward's rows in place: ``lse`` (float32
    ``[B, Hq, Sq]``, contiguous) becomes ``logaddexp(lse, sink)`` and ``out`` (``[B, Sq, Hq, Dv]``,
    last dim contiguous) is scaled by ``exp(lse - lse')``."""
    from flashmask.kernels.triton_kernels.sinks import flashmask_sink_fold_kernel

    b, sq, hq, dv = out.shape
    if lse.dtype != torch.float32 or not lse.is_contiguous() or out.stride(-1) != 1:
        raise ValueError("fold_sinks takes a contiguous float32 lse and out of unit last stride")
    launch_kernel(
        flashmask_sink_fold_kernel, (tensors.cdiv(sq, 64), hq, b),
        out, lse, sinks.contiguous(), *tensors.strides3(out), sq, hq, dv,
        BLOCK_M=64, BLOCK_DV=tensors.padded_head_dim(dv),
    )  # fmt: skip


def sink_gradient(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """:func:`flashmask.reference.sink_gradient` in one launch (one program per head, a fixed
    summation order: deterministic): ``dsinks`` shaped and typed like ``sinks [Hq]`` from the
    folded ``lse`` and the row term ``delta`` (float32 ``[B, Hq, Sq]``, contiguous)."""
    from flashmask.kernels.triton_kernels.sinks import flashmask_sink_gradient_kernel

    b, hq, sq = lse.shape
    for name, x in (("lse", lse), ("delta", delta)):
        if x.dtype != torch.float32 or not x.is_contiguous() or tuple(x.shape) != (b, hq, sq):
            raise ValueError(f"{name} must be contiguous float32 [B, Hq, Sq] = {[b, hq, sq]}")
    dsinks = torch.empty_like(sinks)
    launch_kernel(
        flashmask_sink_gradient_kernel, (hq,), lse, delta, sinks.contiguous(), dsinks, b, sq, hq,
        BLOCK=1024,
    )  # fmt: skip
    return dsinks
