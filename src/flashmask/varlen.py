"""Packed variable-length attention (flash-attn's varlen convention) on FlashMask.

Sequences of different lengths are packed one after another along one token axis: query tokens
``[Tq, Hq, D]`` with cumulative lengths ``cu_seqlens_q [N + 1]`` (segment ``r`` holds tokens
``[cu_seqlens_q[r], cu_seqlens_q[r + 1])``), keys and values likewise with ``cu_seqlens_k``.
Each segment's queries attend to its own keys only. That is a FlashMask over the packed axis: a
key column of segment ``r`` hides every query row outside ``[cu_q[r], cu_q[r + 1])``, one
visible run per column, so any packing is a ``C <= 2`` mask built in O(T) on the device with no
value read back to the host; the kernels then skip every tile that crosses no segment's block,
as they do for packed documents.
"""

from __future__ import annotations

import torch

from flashmask.attention import flashmask_attention, window_sides
from flashmask.mask import FlashMask, intersect

__all__ = ["flashmask_varlen_attention", "segment_mask"]


def may_read_values() -> bool:
    """Whether tensor values may be read back to the host (data-dependent checks): not while
    ``torch.compile`` traces, nor while a CUDA graph is being captured (a read there would break
    the graph or fail the capture). The masks themselves never need a read."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def cumulative_lengths(cu_seqlens: torch.Tensor, name: str) -> torch.Tensor:
    """``cu_seqlens`` as a flat int64 tensor of at least two entries (a shape check only)."""
    cu = cu_seqlens.to(dtype=torch.int64).flatten()
    if cu.numel() < 2:
        raise ValueError(
            f"{name} must hold at least two cumulative lengths [0, ...], got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    return cu


def check_cumulative(name: str, cu: torch.Tensor, limit: int, limit_name: str) -> None:
    """``cu`` rises from 0 to at most ``limit`` (reads the values: eager mode only)."""
    if int(cu[0]) != 0 or int(cu[-1]) > limit or bool((cu.diff() < 0).any()):
        raise ValueError(
            f"{name} must rise from 0 to at most {limit_name} = {limit}, got "
            f"{cu.tolist() if cu.numel() <= 16 else tuple(cu.shape)}"
        )


def segment_bounds(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    names: tuple[str, str, str, str] = ("cu_seqlens_q", "cu_seqlens_k", "total_q", "total_k"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lts, ute, anchor)``, each int64 ``[1, Sk]``, of segments packed one after the other.

    Segment ``r`` has queries ``[cu_q[r], cu_q[r+1])`` and keys ``[cu_k[r], cu_k[r+1])``, its
    last query standing at its last key. Key column ``j`` of segment ``r`` is visible to query
    rows ``[cu_q[r], cu_q[r+1])`` only: masked rows ``[0, ute_j)`` and ``[lts_j, Sq)``.
    ``anchor_j = j - cu_k[r+1] + cu_q[r+1]`` is the query row at key ``j``'s position (causality
    and windows are relative to it). Keys past the last segment (padding) are hidden from every
    row. ``names`` name the two tensors and the two lengths in errors (the values are checked in
    eager mode)."""
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must describe the same segments, got "
            f"{cu_q.numel()} and {cu_k.numel()} boundaries"
        )
    if may_read_values():
        check_cumulative(names[0], cu_q, seqlen_q, names[2])
        check_cumulative(names[1], cu_k, seqlen_k, names[3])
    segments = cu_k.numel() - 1
    cols = torch.arange(seqlen_k, device=cu_k.device)
    # Segment of key j: the number of segment ends at or before j (empty segments never match).
    seg = torch.searchsorted(cu_k[1:].contiguous(), cols, right=True)
    inside = (seg < segments) & (cols >= cu_k[0])
    seg = seg.clamp(max=segments - 1)
    q_start, q_end, k_end = cu_q[seg], cu_q[seg + 1], cu_k[seg + 1]
    lts = torch.where(inside, q_end, 0)
    ute = torch.where(inside, q_start, 0)
    anchor = cols - k_end + q_end
    return lts.unsqueeze(0), ute.unsqueeze(0), anchor.unsqueeze(0)


def column_mask(lts: torch.Tensor, ute: torch.Tensor, causal: bool, seqlen_q: int) -> FlashMask:
    """FlashMask ``[B, 1, Sk, C]`` masking rows ``[lts_j, Sq)`` (plus ``[0, ute_j)`` and C = 2
    when not causal) of every key column ``j``; ``lts``/``ute`` are ``[B, Sk]``."""
    columns = [lts] if causal else [lts, ute]
    bounds = torch.stack([c.clamp(0, seqlen_q) for c in columns], dim=-1)
    return FlashMask(bounds.unsqueeze(1).to(torch.int32).contiguous(), causal, seqlen_q)


def segment_mask(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    total_q: int,
    total_k: int,
    *,
    causal: bool,
    window_size: int | tuple[int, int] | None = None,
) -> FlashMask:
    """The FlashMask ``[1, 1, total_k, C]`` over packed tokens under which each segment's
    queries see only its own keys (causally, with each segment's last query at its last key,
    when ``causal``). ``cu_seqlens_k=None``: the keys are the query tokens themselves (then
    ``total_k == total_q``), and a causal mask takes the one-interval causal form. Tokens past
    the last boundary are padding: no query sees those keys, and those queries see no key.
    ``window_size`` (``w`` or ``(left, right)``, ``-1``: unbounded) also limits each query to
    the keys ``[i' - left, i' + right]`` around its own position ``i'`` in its segment, as
    :func:`flashmask.flashmask_attention`'s ``window_size`` does for one sequence."""
    cu_q = cumulative_lengths(cu_seqlens_q, "cu_seqlens_q")
    same = cu_seqlens_k is None
    if same and total_q != total_k:
        raise ValueError(
            f"cu_seqlens_k is needed when queries and keys differ in number ({total_q} query "
            f"and {total_k} key tokens)"
        )
    cu_k = cu_q if same else cumulative_lengths(cu_seqlens_k, "cu_seqlens_k").to(cu_q.device)
    lts, ute, anchor = segment_bounds(cu_q, cu_k, total_q, total_k)
    if window_size is not None:
        left, right = window_sides(window_size)
        # Key j (at query row anchor_j) is visible to rows anchor_j - right .. anchor_j + left.
        if left >= 0:
            lts = torch.minimum(lts, anchor + left + 1)
        if right >= 0 and not causal:
            ute = torch.maximum(ute, anchor - right)
    if causal and same:
        # Every key's anchor is the key itself: the packed axis' own diagonal.
        return column_mask(lts, ute, True, total_q)
    if causal:
        # Each segment's diagonal is its own, not the packed axis': key j is hidden from the
        # rows above its anchor.
        ute = torch.maximum(ute, anchor)
    return column_mask(lts, ute, False, total_q)


def flashmask_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window_size: int | tuple[int, int] | None = None,
    mask: FlashMask | None = None,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (flash-attn's ``varlen`` call).

    Args:
        query: ``[Tq, Hq, D]``, the segments' query tokens one after another.
        key: ``[Tk, Hk, D]``; value: ``[Tk, Hk, Dv]`` (``Hq % Hk == 0``).
        cu_seqlens_q: integer ``[N + 1]``, cumulative query lengths rising from 0 (segment
            ``r``: tokens ``[cu_seqlens_q[r], cu_seqlens_q[r + 1])``); tokens past the last
            entry are padding (their output is 0).
        cu_seqlens_k: integer ``[N + 1]``, the same segments' cumulative key lengths, or
            ``None`` when the keys are the query tokens (self-attention over one packing).
        max_seqlen_q: accepted for flash-attn's signature; unused (the mask is built on the
            device from the cumulative lengths, and the kernels skip by it).
        max_seqlen_k: likewise.
        causal: causal within each segment, bottom-right aligned (a segment's last query sees
            its last key; with more keys than queries, as in chunked prefill, the earlier keys
            are its cache).
        window_size: ``w`` or ``(left, right)`` (``-1``: unbounded): each query sees only the
            keys ``[i' - left, i' + right]`` around its position ``i'`` in its segment
            (``right`` is ignored when causal), as in flash-attn's varlen call.
        mask: an optional :class:`FlashMask` over the packed axis (``[1, Hm, Tk, C]``, built
            for ``Tq`` queries), intersected with the segments': a query sees a key only where
            both allow (e.g. a sliding window or a shared prompt inside the packing).
        softmax_scale: as in :func:`flashmask.flashmask_attention`.
        return_softmax_lse: as there (the lse's layout is below).
        deterministic: as there.
        sinks: as there, ``[Hq]``.

    Returns:
        ``out [Tq, Hq, Dv]``, or ``(out, lse)`` with ``lse [Hq, Tq]`` (flash-attn's varlen
        layout), ``-inf`` on rows that see no key (without sinks).

    The cumulative lengths are checked (rising from 0, within the tokens) in eager mode only:
    under ``torch.compile`` or CUDA graph capture no value is read back.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype == torch.float8_e4m3fn:
            # FP8 descales are per (batch, head): a packing is one batch row of many sequences.
            raise TypeError(
                f"{name} is float8_e4m3fn: packed sequences take no FP8 inputs; call "
                "flashmask_attention with a [B, S, H, D] batch and its descales"
            )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None and name == "cu_seqlens_k":
            continue
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {cu.dtype}")
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D [N + 1], got shape {tuple(cu.shape)}")
    for name, value_ in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value_ is not None and (
            isinstance(value_, bool) or not isinstance(value_, int) or value_ < 0
        ):
            raise TypeError(f"{name} must be a non-negative int or None, got {value_!r}")
    if mask is not None and not isinstance(mask, FlashMask):
        raise TypeError(f"mask must be a FlashMask or None, got {type(mask).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    total_q, total_k = query.shape[0], key.shape[0]
    cu_q = cu_seqlens_q.to(query.device)
    cu_k = None if cu_seqlens_k is None else cu_seqlens_k.to(query.device)
    packed = segment_mask(cu_q, cu_k, total_q, total_k, causal=causal, window_size=window_size)
    if mask is not None:
        packed = intersect(packed, mask, seqlen_q=total_q)
    result = flashmask_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), packed,
        softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse,
        deterministic=deterministic, sinks=sinks,
    )  # fmt: skip
    if return_softmax_lse:
        out, lse = result
        return out.squeeze(0), lse.squeeze(0)
    return result.squeeze(0)
