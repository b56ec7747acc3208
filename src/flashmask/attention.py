"""``flashmask_attention``: argument checks, mask normalisation and dispatch to the custom ops."""

from __future__ import annotations

import math

import torch

from flashmask import fp8, ops
from flashmask.mask import FlashMask, check_seqlen_q

__all__ = ["flashmask_attention", "window_mask_indices"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, fp8.FP8_DTYPE)


def flashmask_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    startend_row_indices: torch.Tensor | FlashMask | None = None,
    *,
    causal: bool = False,
    window_size: int | tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention under a FlashMask column-interval mask.

    Args:
        query: ``[B, Sq, Hq, D]``.
        key: ``[B, Sk, Hk, D]`` with ``Hq % Hk == 0`` (GQA/MQA: query head ``h`` reads key/value
            head ``h // (Hq // Hk)``).
        value: ``[B, Sk, Hk, Dv]``.
        startend_row_indices: int32 ``[B, Hm, Sk, C]`` (``Hm`` in ``{1, Hk, Hq}``: one mask for
            all heads, one per key/value head, or one per query head), or ``[B, Hm, Sk]``
            read as ``C = 1``, or a :class:`FlashMask` (which carries its own ``causal`` and the
            ``seqlen_q`` it was built for: another ``Sq`` raises ``ValueError``, see
            :meth:`FlashMask.with_seqlen_q`), or ``None`` for plain full/causal attention. Entry
            meanings are in :mod:`flashmask.mask`.
        causal: add the causal mask, bottom-right aligned when ``Sq != Sk`` (key ``j`` is hidden
            from query ``i`` when ``j > i + Sk - Sq``).
        window_size: ``w`` or ``(left, right)``: query ``i`` sees keys
            ``[i' - left, i' + right]`` with ``i' = i + Sk - Sq`` (``right`` is ignored when causal;
            ``-1`` leaves a side unbounded). Cannot be combined with ``startend_row_indices``.
        softmax_scale: score scale, default ``D ** -0.5``.
        return_softmax_lse: also return the natural-log sum of exponentials of the scaled,
            masked scores, float32 ``[B, Hq, Sq]`` (float64 for float64 inputs), ``-inf`` for
            fully masked rows. It is differentiable.
        deterministic: make the backward bit-reproducible (the GPU kernels add each dQ in a
            fixed order instead of racing floating-point atomics).
        sinks: learnable attention sinks (gpt-oss's), a floating tensor ``[Hq]`` of finite
            logits in the units of the scaled scores: query head ``h``'s sink joins every row's
            softmax denominator as ``exp(sinks[h])`` and carries no value, so each row's output
            is scaled by ``1 - p_sink``. Differentiable (its gradient has ``sinks``' dtype). The
            returned lse includes the sink, so a row that sees no key then has lse
            ``sinks[h]`` (its output is still 0). Works with every mask and kernel.
        softcap: Gemma's logit soft-capping: each scaled score ``s`` becomes
            ``softcap * tanh(s / softcap)`` before the mask and softmax (gradients through the
            cap's derivative). ``None`` or 0 (flash-attn's "off") leave the scores; on the GPU a
            capped call routes as an uncapped one (the MLA backward of a capped call runs the
            Triton kernel; a capped decode step takes the training forward, not split-KV).
        q_descale: FP8 only (``query``, ``key`` and ``value`` all ``torch.float8_e4m3fn``):
            float32 ``[B, Hk]``, query head ``h`` of batch ``b`` is dequantised as
            ``query.float() * q_descale[b, h // (Hq // Hk)]`` (FlashAttention-3's convention);
            ``None``: 1.0. :func:`flashmask.quantize_fp8` returns it (``group=Hq // Hk``).
        k_descale: FP8 only: float32 ``[B, Hk]``, one per batch and key head; ``None``: 1.0.
        v_descale: FP8 only: float32 ``[B, Hk]``, one per batch and value head; ``None``: 1.0.
        out_dtype: FP8 only: the output's dtype, ``torch.bfloat16`` (``None``),
            ``torch.float16`` or ``torch.float32``.

    Returns:
        ``out`` ``[B, Sq, Hq, Dv]`` in the input dtype (FP8 inputs: ``out_dtype``), or
        ``(out, lse)``. Query rows that see no key get output 0, lse ``-inf`` and zero gradients.

    FP8 inputs (``float8_e4m3fn`` query, key and value, all three or none) compute attention over
    the dequantised inputs, ``x.float() * descale`` per batch and head, with every mask form,
    ``window_size``, grouped-query heads, ``Sq != Sk``, ``sinks`` and ``softcap`` as above; lse is
    float32. Forward only: a call in which one of ``query``, ``key``, ``value``, a descale or
    ``sinks`` requires grad raises ``ValueError`` (unless autograd is off, ``torch.no_grad()``).
    On Hopper the CuTe FP8 forward runs the calls ``kernels.routing.use_cute_fp8_forward``
    accepts (head dims 64, 128, 256, ``Dv == D``, 16-bit ``out_dtype``, no cap); every other
    FP8 call runs the exact reference in float32 on the dequantised inputs
    (:func:`flashmask.fp8.forward` dispatches). Descales and ``out_dtype`` given with other
    dtypes raise ``ValueError``.

    Non-finite values: on the exact reference (CPU, float32/float64), a NaN or infinity in
    ``key`` or ``value`` at a key that a query row cannot see never reaches that row's output,
    lse or ``dq``, nor the ``dk``/``dv`` of a key that only rows not seeing it see; a
    non-finite value at a visible key propagates as in any attention. The Triton kernels (CUDA
    fp16/bf16) never read a tile they skip, so the same holds there for rows that meet the value
    only in fully masked tiles; inside a partially masked tile it can reach the tile's rows that
    cannot see it (their output and ``dq``, and the ``dk`` of keys they see): zero such values
    (e.g. in padding) before the call.

    CUDA fp16/bf16 inputs run the Triton, Gluon or CuTe kernels (``flashmask.kernels.routing``
    picks per call); everything else (CPU, float32/float64, FP8 off Hopper) runs the exact
    chunked reference in :mod:`flashmask.reference`.
    """
    _check_qkv(query, key, value)
    fp8_inputs = fp8.is_fp8(query)
    if fp8_inputs:
        out_dtype = fp8.check_fp8_arguments(
            query, key, value, q_descale, k_descale, v_descale, out_dtype
        )
    else:
        _check_no_fp8_arguments(query, q_descale, k_descale, v_descale, out_dtype)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(
            f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}"
        )
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    batch, seqlen_q, _, head_dim = query.shape
    seqlen_k, heads_k = key.shape[1], key.shape[2]

    if window_size is not None:
        if startend_row_indices is not None:
            raise ValueError("can't use window_size with startend_row_indices")
        startend_row_indices = window_mask_indices(
            window_size, seqlen_q, seqlen_k, causal=causal, device=query.device
        ).expand(batch, -1, -1, -1)
    indices, causal = _normalize_mask(startend_row_indices, causal, query, key)
    _check_indices(indices, batch, seqlen_k, heads_k, query.shape[2], query.device)

    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")

    if sinks is not None:
        _check_sinks(sinks, query)
    cap = _check_softcap(softcap)
    if fp8_inputs:
        fp8.check_no_grad(
            query=query, key=key, value=value, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, sinks=sinks,
        )  # fmt: skip
        out, lse = ops.attention_fp8(
            query, key, value, indices, causal, float(softmax_scale), cap, sinks,
            q_descale, k_descale, v_descale, out_dtype,
        )  # fmt: skip
    else:
        out, lse = ops.attention(
            query, key, value, indices, causal, float(softmax_scale), deterministic, cap, sinks
        )
    return (out, lse) if return_softmax_lse else out


def _check_no_fp8_arguments(
    query: torch.Tensor,
    q_descale: object,
    k_descale: object,
    v_descale: object,
    out_dtype: object,
) -> None:
    """The descales and ``out_dtype`` belong to FP8 inputs: refuse them with any other dtype."""
    for name, arg in (("q_descale", q_descale), ("k_descale", k_descale),
                      ("v_descale", v_descale), ("out_dtype", out_dtype)):  # fmt: skip
        if arg is not None:
            raise ValueError(
                f"{name} applies to FP8 inputs only (query, key and value float8_e4m3fn); "
                f"query, key and value are {query.dtype}: leave {name} as None"
            )


def _check_softcap(softcap: object) -> float:
    """``softcap`` as the ops take it: 0.0 for off (``None`` or 0), else the positive cap."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap}")
    return float(softcap)


def _check_sinks(sinks: object, query: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor, got {sinks.dtype}")
    heads_q = query.shape[2]
    if sinks.shape != (heads_q,):
        raise ValueError(
            f"sinks must have shape [Hq] = [{heads_q}] (one logit per query head), got "
            f"{list(sinks.shape)}"
        )
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device}, query on {query.device}")


def window_sides(window_size: object) -> tuple[int, int]:
    """``(left, right)`` of a ``window_size`` (``w`` or ``(left, right)``, ``-1``: unbounded),
    checked."""
    if isinstance(window_size, bool):
        raise TypeError("window_size must be an int or a (left, right) pair of ints")
    if isinstance(window_size, int):
        window_size = (window_size, window_size)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(
            f"window_size must be an int or a (left, right) pair of ints, got {window_size!r}"
        )
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size}")
    return left, right


def window_mask_indices(
    window_size: int | tuple[int, int],
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Paddle's ``window_size`` conversion, generalised to bottom-right alignment: int32
    ``[1, 1, Sk, C]`` (C = 1 when causal, else 2).

    Query ``i`` sees keys ``[i' - left, i' + right]`` with ``i' = i + Sk - Sq``; ``-1`` leaves a
    side unbounded.
    """
    left, right = window_sides(window_size)
    offset = seqlen_k - seqlen_q
    cols = torch.arange(seqlen_k, device=device, dtype=torch.int64)
    # Key j is visible to rows i with j - right <= i + offset <= j + left.
    lts = cols + left + 1 - offset if left >= 0 else torch.full_like(cols, seqlen_q)
    lts = lts.clamp(0, seqlen_q)
    if causal:
        return lts.to(torch.int32).view(1, 1, seqlen_k, 1)
    ute = (cols - right - offset).clamp(0, seqlen_q) if right >= 0 else torch.zeros_like(cols)
    return torch.stack([lts, ute], dim=-1).to(torch.int32).view(1, 1, seqlen_k, 2)


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name}.dtype must be float16, bfloat16, float32 or float64 (or float8_e4m3fn, "
                f"the one FP8 format taken), got {t.dtype}"
            )
    named = (("query", query), ("key", key), ("value", value))
    fp8_names = [name for name, t in named if fp8.is_fp8(t)]
    if fp8_names and len(fp8_names) < 3:
        others = [f"{name} is {t.dtype}" for name, t in named if not fp8.is_fp8(t)]
        raise TypeError(
            "FP8 attention needs query, key and value all float8_e4m3fn: "
            f"{' and '.join(fp8_names)} {'is' if len(fp8_names) == 1 else 'are'} "
            f"float8_e4m3fn, {', '.join(others)}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, "
            f"{value.device}"
        )
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError(
            f"query, key and value must share the batch size, got {query.shape[0]}, "
            f"{key.shape[0]}, {value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            f"key and value must share seqlen_k, got {key.shape[1]} and {value.shape[1]}"
        )
    if key.shape[2] != value.shape[2]:
        raise ValueError(
            f"key and value must share the number of heads, got {key.shape[2]} and {value.shape[2]}"
        )
    if query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query and key must share head_dim, got {query.shape[3]} and {key.shape[3]}"
        )
    if query.shape[2] % key.shape[2] != 0:
        raise ValueError(
            "Number of heads in key/value must divide number of heads in query, got "
            f"{key.shape[2]} and {query.shape[2]}"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if min(t.shape) == 0:
            raise ValueError(f"{name} must not have an empty dimension, got shape {tuple(t.shape)}")


def _normalize_mask(
    startend_row_indices: torch.Tensor | FlashMask | None,
    causal: bool,
    query: torch.Tensor,
    key: torch.Tensor,
) -> tuple[torch.Tensor | None, bool]:
    if startend_row_indices is None:
        return None, causal
    if isinstance(startend_row_indices, FlashMask):
        if causal and not startend_row_indices.causal:
            raise ValueError(
                "causal=True conflicts with a non-causal FlashMask passed as startend_row_indices;"
                " a FlashMask carries its own causal flag"
            )
        check_seqlen_q(startend_row_indices, query.shape[1])
        return startend_row_indices.startend_row_indices, startend_row_indices.causal
    if not isinstance(startend_row_indices, torch.Tensor):
        raise TypeError(
            "startend_row_indices must be a torch.Tensor, a FlashMask or None, got "
            f"{type(startend_row_indices).__name__}"
        )
    if startend_row_indices.dim() == 3:
        startend_row_indices = startend_row_indices.unsqueeze(-1)
    # Constructing the FlashMask runs the dtype, rank and (causal, C) checks.
    FlashMask(startend_row_indices, causal)
    return startend_row_indices, causal


def _check_indices(
    indices: torch.Tensor | None,
    batch: int,
    seqlen_k: int,
    heads_k: int,
    heads_q: int,
    device: torch.device,
) -> None:
    if indices is None:
        return
    if indices.shape[0] != batch:
        raise ValueError(
            "startend_row_indices.shape[0] must be equal to batch_size, but got "
            f"{indices.shape[0]} and {batch}"
        )
    if indices.shape[2] != seqlen_k:
        raise ValueError(
            "startend_row_indices.shape[2] must be equal to seqlen_k, but got "
            f"{indices.shape[2]} and {seqlen_k}"
        )
    if indices.shape[1] not in (1, heads_k, heads_q):
        raise ValueError(
            "startend_row_indices.shape[1] (mask heads) must be 1 (broadcast), the number of "
            f"key/value heads {heads_k} or of query heads {heads_q}, but got {indices.shape[1]}"
        )
    if indices.device != device:
        raise ValueError(
            f"startend_row_indices must be on the query's device {device}, got {indices.device}"
        )
