"""``torch.library`` custom ops: one forward and one backward op over the kernels and the reference.

Wrapping the computation in custom ops with fake (meta) implementations lets
``torch.compile(fullgraph=True)`` trace a model that calls :func:`flashmask.flashmask_attention`
without graph breaks; the mask travels as a tensor, so new mask *values* never recompile.

Inside each op the implementation is chosen per call: the Triton kernels for CUDA tensors they
support (:func:`flashmask.kernels.supports`), otherwise the exact chunked reference. FP8 inputs
(``float8_e4m3fn``) take a forward-only op of their own, :data:`attention_forward_fp8`, over the
FP8 dispatch :func:`flashmask.fp8.forward`.

:func:`attention` is the entry point: in eager mode on plain CUDA tensors it runs the same
computation through a ``torch.autograd.Function`` (:class:`_EagerAttention`), which skips the
dispatcher work a custom-op call costs (measured on the H200's host: a forward + backward over
stand-in kernels took 389 us of host time through a custom-op pair, 207 us through an
``autograd.Function``; ``docs/performance.md``); whenever
something may trace or intercept the call (``torch.compile``, a dispatch mode such as
``FakeTensorMode`` or ``FlopCounterMode``, a tensor subclass or functorch wrapper) it calls
the custom ops.
"""

from __future__ import annotations

import torch

from flashmask import fp8, reference
from flashmask.mask import ColumnIntervals, FlashMask

__all__ = [
    "attention",
    "attention_backward",
    "attention_forward",
    "attention_forward_fp8",
    "attention_fp8",
]


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


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])``; arguments are already validated
    (``softcap``: 0 or the logit cap; ``sinks``: ``None`` or ``[Hq]``, joined to every row's
    softmax). The kernels where they take the inputs, else the reference."""
    if _use_kernel(q, k, v):
        from flashmask import kernels

        return kernels.forward(
            q, k, v, startend_row_indices, causal, softmax_scale, deterministic=deterministic,
            softcap=softcap, sinks=sinks,
        )  # fmt: skip
    intervals = _intervals(startend_row_indices, causal, q.shape[1])
    out, lse = reference.reference_forward(
        q, k, v, intervals, causal, softmax_scale, softcap=softcap
    )
    if sinks is not None:
        out, lse = reference.fold_sinks(out, lse, sinks)
    return out, lse


def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_forward` as the custom op runs it: compiled code calls it, possibly inside a CUDA
    graph pool (cudagraph trees' warm-up), so the mask's preparation is not kept between calls
    (:func:`flashmask.kernels.preparation.uncached`)."""
    with _uncached():
        return _forward(
            q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap, sinks
        )


def _uncached():
    from flashmask.kernels import preparation

    return preparation.uncached()


# The ops over the plain functions, which the eager path (:class:`_EagerAttention`) calls
# directly.
attention_forward = torch.library.custom_op("flashmask::attention_forward", mutates_args=())(
    _forward_op
)


@attention_forward.register_fake
def _(q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap=0.0, sinks=None):
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=_lse_dtype(q))
    return out, lse


def _backward_grads(
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
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv, dsinks)``, the first three shaped and typed like ``(q, k, v)``,
    ``dsinks`` like ``sinks`` (empty without sinks; ``out`` and ``lse`` are then the folded
    ones): the kernels where they take the inputs, else the reference."""
    if _use_kernel(q, k, v):
        from flashmask import kernels

        grads = kernels.backward(
            dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
            deterministic, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        return grads if sinks is not None else (*grads, _no_sinks_grad(q))
    intervals = _intervals(startend_row_indices, causal, q.shape[1])
    grads = reference.reference_backward(
        dout, dlse, q, k, v, out, lse, intervals, causal, softmax_scale, softcap=softcap
    )
    if sinks is None:
        return (*grads, _no_sinks_grad(q))
    delta = reference.row_term(dout, out, dlse)
    return (*grads, reference.sink_gradient(lse, delta, sinks))


def _no_sinks_grad(q: torch.Tensor) -> torch.Tensor:
    """The backward op's ``dsinks`` for a call without sinks (an op returns tensors only)."""
    return q.new_empty(0, dtype=torch.float32)


def _backward_op(
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
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_backward_grads` as the custom op runs it (uncached, as :func:`_forward_op`)."""
    with _uncached():
        return _backward_grads(
            dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
            deterministic, softcap, sinks,
        )  # fmt: skip


attention_backward = torch.library.custom_op("flashmask::attention_backward", mutates_args=())(
    _backward_op
)


@attention_backward.register_fake
def _(
    dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale, deterministic,
    softcap=0.0, sinks=None,
):  # fmt: skip
    dsinks = _no_sinks_grad(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, startend_row_indices, causal, softmax_scale, deterministic, *rest = inputs
    # A call that left the defaults out.
    softcap = rest[0] if rest else 0.0
    sinks = rest[1] if len(rest) > 1 else None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, startend_row_indices, sinks)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic
    ctx.softcap = softcap


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, startend_row_indices, sinks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = attention_backward(
        dout.contiguous(), dlse, q, k, v, out, lse, startend_row_indices, ctx.causal,
        ctx.softmax_scale, ctx.deterministic, ctx.softcap, sinks,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None if sinks is None else dsinks


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' computation and autograd rule as a plain ``autograd.Function``:
    ``apply(q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap, sinks)``
    returns ``(out, lse)``, both differentiable, exactly as :func:`attention_forward` with its
    registered backward does."""

    @staticmethod
    def forward(
        ctx, q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap=0.0,
        sinks=None,
    ):  # fmt: skip
        inputs = (
            q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap, sinks
        )  # fmt: skip
        out, lse = _forward(*inputs)
        # An unused output's gradient arrives as None, as the custom op's backward gets it
        # (no zeros for dlse to subtract, no zero dout to multiply).
        ctx.set_materialize_grads(False)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, startend_row_indices, sinks = ctx.saved_tensors
        with torch.no_grad():
            if dout is None:
                dout = torch.zeros_like(out)
            *grads, dsinks = _backward_grads(
                dout.contiguous(), dlse, q, k, v, out, lse, startend_row_indices, ctx.causal,
                ctx.softmax_scale, ctx.deterministic, ctx.softcap, sinks,
            )  # fmt: skip
        if sinks is not None:
            grads.append(dsinks)
        needing = [t for t in (q, k, v, dout, dlse, sinks) if t is not None and t.requires_grad]
        if torch.is_grad_enabled() and needing:
            # create_graph=True: the gradients get a node that refuses a second backward, as
            # the custom backward op (no autograd rule) does, instead of none at all, which
            # would drop their second-order terms without a word.
            grads = _FirstOrderOnly.apply(needing[0], *grads)
        dq, dk, dv, *rest = grads
        return dq, dk, dv, None, None, None, None, None, (rest[0] if rest else None)


class _FirstOrderOnly(torch.autograd.Function):
    """``apply(anchor, *grads)``: copies of ``grads`` attached to a node whose backward raises
    (``anchor``, a tensor that requires grad, makes the copies require it too)."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "flashmask_attention has no second derivative: its gradients cannot be "
            "differentiated again (create_graph=True)"
        )


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether nothing may trace or intercept a call on ``tensors``: not compiling, no dispatch
    mode active, and every tensor a plain ``torch.Tensor`` (no subclass, no functorch wrapper)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(
        t is None
        or (type(t) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(t))
        for t in tensors
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`attention_forward`, differentiable (``sinks`` too): through
    :class:`_EagerAttention` for plain CUDA tensors in eager mode, else through the custom ops
    (see the module docstring). ``softcap``: 0, or the logit cap; ``sinks``: ``None`` or
    ``[Hq]``."""
    args = (q, k, v, startend_row_indices, causal, softmax_scale, deterministic, softcap, sinks)
    if q.is_cuda and _plain_eager(q, k, v, startend_row_indices, sinks):
        return _EagerAttention.apply(*args)
    return attention_forward(*args)


def _forward_fp8_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flashmask.fp8.forward` as the custom op runs it (uncached, as :func:`_forward_op`)."""
    with _uncached():
        return fp8.forward(
            q, k, v, startend_row_indices, causal, softmax_scale, softcap, sinks,
            q_descale, k_descale, v_descale, out_dtype,
        )  # fmt: skip


# Forward only: no autograd is registered, and flashmask_attention refuses FP8 calls whose
# inputs require grad before reaching it.
attention_forward_fp8 = torch.library.custom_op(
    "flashmask::attention_forward_fp8", mutates_args=()
)(_forward_fp8_op)


@attention_forward_fp8.register_fake
def _(
    q, k, v, startend_row_indices, causal, softmax_scale, softcap, sinks, q_descale, k_descale,
    v_descale, out_dtype,
):  # fmt: skip
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1], dtype=out_dtype)
    lse = q.new_empty(b, hq, sq, dtype=torch.float32)
    return out, lse


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of FP8 attention (:func:`flashmask.fp8.forward`, not differentiable):
    plain CUDA tensors in eager mode call the dispatch directly, anything that may be traced or
    intercepted the custom op :data:`attention_forward_fp8` (as :func:`attention` chooses)."""
    args = (
        q, k, v, startend_row_indices, causal, softmax_scale, softcap, sinks,
        q_descale, k_descale, v_descale, out_dtype,
    )  # fmt: skip
    descales = (q_descale, k_descale, v_descale)
    if q.is_cuda and _plain_eager(q, k, v, startend_row_indices, sinks, *descales):
        return fp8.forward(*args)
    return attention_forward_fp8(*args)
