"""Zero-communication mask localization: global FlashMask -> the mask of one rank's rows.

Context parallelism needs, on every rank, the mask of *its* query rows against some set of key
columns. FlashMask stores one row-interval pair per key column, which makes this pure arithmetic
on the replicated O(N) global mask (semantics §6, design notes §A.7.1-A.7.3):

1. :func:`normal_form` rewrites every ``(causal, C)`` form as the non-causal 4-bound form
   ``(LTS, LTE, UTS, UTE)`` over global row indices. The causal triangle becomes the upper
   interval ``[0, j)``: after re-sharding there is no local diagonal, so the kernels run with
   ``causal=False`` on localized masks (Paddle's CP paths make the same choice).
2. *Columns* need no change: any subset of key columns, in any order, is still a valid FlashMask
   (gather the rows of ``startend_row_indices``).
3. *Rows*: a rank owns query chunks ``c_0 < c_1 < ...`` of ``chunk_size`` rows and lays them out
   in that order. :func:`localize_rows` maps a global row bound ``v`` to
   ``loc(v) = sum_c clamp(v - c * chunk_size, 0, chunk_size)`` = the number of owned rows below
   ``v`` (Paddle's "clip-shift-max" for two chunks). ``loc`` is non-decreasing and sends owned
   row ``g`` to its local index, so for owned ``g``: ``a <= g < b`` iff
   ``loc(a) <= loc(g) < loc(b)``; every masked interval stays an interval.

Everything here is a pure function of the replicated global mask, so every rank computes the same
results without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashmask.mask import FlashMask

__all__ = ["chunk_columns", "local_mask", "localize_rows", "normal_form"]


def normal_form(mask: FlashMask, padded_seqlen: int | None = None) -> torch.Tensor:
    """The mask as non-causal 4-bound global intervals, optionally padded: int32 ``[B, Hm, N, 4]``.

    Args:
        mask: a self-attention mask (``Sq == Sk == S``) in any ``(causal, C)`` form.
        padded_seqlen: ``N >= S`` (default ``S``). The ``N - S`` padding tokens appended at the
            end are fully masked: padding key columns are hidden from every row, and padding
            query rows are hidden from every column whose intervals can absorb them (an interval
            that already ends at ``S`` is extended to ``N``, otherwise an empty one becomes
            ``[S, N)``). A column with two non-empty intervals that both end before ``S`` cannot
            hide the padding rows; :func:`~flashmask.distributed.context_parallel_attention`
            zeroes padding rows after the fact, so results stay exact either way.

    Returns:
        ``(LTS, LTE, UTS, UTE)`` per column, all in ``[0, N]``, with non-causal C=4 meaning:
        row ``i`` is masked for column ``j`` iff ``LTS <= i < LTE`` or ``UTS <= i < UTE``.
    """
    if not isinstance(mask, FlashMask):
        raise TypeError(f"mask must be a FlashMask, got {type(mask).__name__}")
    s = mask.seqlen_k
    n = s if padded_seqlen is None else padded_seqlen
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"padded_seqlen must be an int, got {type(n).__name__}")
    if n < s:
        raise ValueError(f"padded_seqlen must be >= seqlen {s}, got {n}")
    lts, lte, uts, ute = (x.to(torch.int32) for x in mask.intervals(s))
    if mask.causal:
        # Key j is hidden from rows i < j: the causal triangle is the upper interval [0, j).
        cols = torch.arange(s, dtype=torch.int32, device=mask.device)
        uts = torch.zeros_like(lts)
        ute = cols.expand_as(lts).contiguous()
    if n > s:
        lts, lte, uts, ute = _mask_padding_rows(lts, lte, uts, ute, s, n)
    g = torch.stack([lts, lte, uts, ute], dim=-1)
    if n > s:
        pad = torch.tensor([0, n, 0, 0], dtype=torch.int32, device=g.device)
        g = torch.cat([g, pad.expand(*g.shape[:2], n - s, 4)], dim=2)
    return g.contiguous()


def _mask_padding_rows(
    lts: torch.Tensor, lte: torch.Tensor, uts: torch.Tensor, ute: torch.Tensor, s: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hide rows ``[s, n)`` in every column that has a spare or extendable interval."""
    lt_reaches_end = lte >= s  # values are clamped to [0, s], so this means lte == s
    ut_reaches_end = ~lt_reaches_end & (ute >= s)
    lt_empty = ~lt_reaches_end & ~ut_reaches_end & (lts >= lte)
    ut_empty = ~lt_reaches_end & ~ut_reaches_end & ~lt_empty & (uts >= ute)
    lte = torch.where(lt_reaches_end, n, lte)
    ute = torch.where(ut_reaches_end, n, ute)
    lts, lte = torch.where(lt_empty, s, lts), torch.where(lt_empty, n, lte)
    uts, ute = torch.where(ut_empty, s, uts), torch.where(ut_empty, n, ute)
    return lts, lte, uts, ute


def localize_rows(
    values: torch.Tensor, row_chunks: Sequence[int] | torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Map global row bounds to local ones: ``sum_c clamp(values - c * chunk_size, 0, chunk_size)``.

    Args:
        values: any integer tensor of global row indices (interval bounds).
        row_chunks: the query chunks a rank owns, **ascending** (their rows are laid out in this
            order locally).
        chunk_size: rows per chunk.

    Returns:
        Tensor like ``values`` (same dtype): the number of owned rows whose global index is below
        each value.
    """
    chunks = torch.as_tensor(row_chunks, dtype=torch.int64, device=values.device)
    if chunks.dim() != 1:
        raise ValueError(f"row_chunks must be 1-D, got shape {tuple(chunks.shape)}")
    if chunks.numel() > 1 and bool((chunks[1:] <= chunks[:-1]).any()):
        raise ValueError(f"row_chunks must be strictly ascending, got {chunks.tolist()}")
    if chunks.numel() == 0:
        return torch.zeros_like(values)
    # Equivalent to summing the clamp over all chunks, in O(values * log chunks): every owned
    # chunk before the last one starting at or below v lies entirely below v.
    v = values.to(torch.int64)
    starts = chunks * chunk_size
    below = torch.searchsorted(starts, v.reshape(-1), right=True).view(v.shape)
    last = starts[(below - 1).clamp(min=0)]
    local = (below - 1).clamp(min=0) * chunk_size + (v - last).clamp(0, chunk_size)
    return torch.where(below > 0, local, 0).to(values.dtype)


def chunk_columns(
    chunks: Sequence[int] | torch.Tensor, chunk_size: int, device=None
) -> torch.Tensor:
    """Global column (token) indices of ``chunks``, concatenated in the given order: int64."""
    c = torch.as_tensor(chunks, dtype=torch.int64, device=device).view(-1, 1)
    return (c * chunk_size + torch.arange(chunk_size, device=c.device)).reshape(-1)


def local_mask(
    global_intervals: torch.Tensor,
    row_chunks: Sequence[int],
    key_chunks: Sequence[int],
    chunk_size: int,
) -> torch.Tensor:
    """The non-causal C=4 mask of (owned query chunks) x (``key_chunks``): int32 ``[B, Hm, K, 4]``.

    Args:
        global_intervals: :func:`normal_form` output ``[B, Hm, N, 4]``.
        row_chunks: the query chunks of the rank, ascending.
        key_chunks: the key chunks in the order their keys are laid out (any order).
        chunk_size: tokens per chunk.

    Returns:
        ``startend_row_indices`` for ``flashmask_attention(q_local, k_sel, v_sel, ., causal=False)``
        with ``K = len(key_chunks) * chunk_size`` columns and ``len(row_chunks) * chunk_size``
        query rows.
    """
    cols = chunk_columns(key_chunks, chunk_size, global_intervals.device)
    selected = global_intervals.index_select(2, cols)
    return localize_rows(selected, row_chunks, chunk_size).to(torch.int32).contiguous()
