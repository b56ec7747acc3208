"""``torch.library`` custom ops: one forward and one backward op over the kernels and the reference.

Wrapping the computation in custom ops with fake (meta) implementations lets
``torch.compile(fullgraph=True)`` trace a model that calls :func:`flashmask.flashmask_attention`
without graph breaks; the mask travels as a tensor, so new mask *values* never recompile.

Inside each op the implementation is chosen per call: the Triton kernels for CUDA tensors they
support (:func:`flashmask.kernels.supports`), otherwise the exact chunked reference.
"""

from __future__ import annotations

import torch

from flashmask import reference
from flashmask.mask import ColumnIntervals, FlashMask

__all__ = ["attention_backward", "attention_forward"]


def _intervals(
    startend_row_indices: torch.Tensor | None, causal: bool, seqlen_q: int
) -> ColumnIntervals | None:
    if startend_row_indices is None:
        return None
    return FlashMask(startend_row_indices, causal).intervals(seqlen_q)


def _use_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if not q.is_cuda:
        return False
    from flashmask import kernels

    return kernels.supports(q, k, v)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("flashmask::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])``; arguments are already validated."""
    if _use_kernel(q, k, v):
        from flashmask import kernels

        return kernels.forward(q, k, v, startend_row_indices, causal, softmax_scale)
    intervals = _intervals(startend_row_indices, causal, q.shape[1])
    return reference.reference_forward(q, k, v, intervals, causal, softmax_scale)


@attention_forward.register_fake
def _(q, k, v, startend_row_indices, causal, softmax_scale, deterministic):
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=_lse_dtype(q))
    return out, lse


@torch.library.custom_op("flashmask::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``."""
    if _use_kernel(q, k, v):
        from flashmask import kernels

        return kernels.backward(
            dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
            deterministic,
        )  # fmt: skip
    intervals = _intervals(startend_row_indices, causal, q.shape[1])
    return reference.reference_backward(
        dout, dlse, q, k, v, out, lse, intervals, causal, softmax_scale
    )


@attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, startend_row_indices, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, startend_row_indices)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, startend_row_indices = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attention_backward(
        dout.contiguous(), dlse, q, k, v, out, lse, startend_row_indices, ctx.causal,
        ctx.softmax_scale, ctx.deterministic,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
