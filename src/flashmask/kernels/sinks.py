"""Learnable attention sinks on the GPU: the forward's fold and the sinks' gradient.

Every kernel family computes attention without sinks; :func:`fold_sinks` joins them to the
finished rows in place (one pass over ``out``, ``triton_kernels.sinks``), so the backward kernels
receive the folded ``out`` and ``lse`` and need nothing else: with the sink in the denominator,
``P`` recomputed from ``lse'`` is the sink-aware probability, and ``rowsum(dO * O')`` is still
the softmax's row term because the sink carries no value. The sinks' gradient needs only that
row term (:func:`flashmask.reference.sink_gradient`), which the backward computes anyway.
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
