"""Exact work per chunk pair, from the column intervals in O(N + chunks^2).

``pair_counts`` returns ``W[a, b]`` = the number of visible (query, key) pairs with the query in
chunk ``a`` and the key in chunk ``b``, summed over batch and mask heads. Its row sums are the
per-chunk compute the balancers equalise, and ``W > 0`` is the chunk-level *need matrix* that
decides which key/value chunks a rank must receive (pruned exchange).

How: for a column with masked rows ``[lts, lte) ∪ [uts, ute)`` the number of masked rows below
``x`` is ``h(lts, lte) + h(uts, ute) - h(its, ite)`` with ``[its, ite)`` the intersection and
``h(a, b) = min(b', x) - min(a, x)``, ``b' = max(a, b)``. Each term is a sum of ``min(v_j, x)``
over the columns of a key chunk, evaluated at the query-chunk boundaries ``x = t * chunk_size``;
a histogram of ``v_j // chunk_size`` per key chunk plus prefix sums gives all of them at once.
"""

from __future__ import annotations

import torch

from flashmask.mask import FlashMask, TileClass

__all__ = ["pair_counts", "tile_counts"]


def _sum_min(values: torch.Tensor, key_chunk: torch.Tensor, n: int, cs: int) -> torch.Tensor:
    """``F[c, t] = sum over columns j of key chunk c of min(values_j, t * cs)``: int64 ``[n, n+1]``.

    ``values`` are int64 ``[BH, N]`` in ``[0, n * cs]``; ``key_chunk[j] = j // cs``.
    """
    bucket = values // cs  # v < t * cs  <=>  bucket < t
    flat = (key_chunk * (n + 1) + bucket).reshape(-1)
    counts = torch.bincount(flat, minlength=n * (n + 1)).view(n, n + 1)
    sums = torch.zeros(n * (n + 1), dtype=torch.int64, device=values.device)
    sums.index_add_(0, flat, values.reshape(-1))
    sums = sums.view(n, n + 1)
    zero = torch.zeros(n, 1, dtype=torch.int64, device=values.device)
    below_count = torch.cat([zero, counts.cumsum(1)], 1)[:, : n + 1]  # #{v < t*cs}
    below_sum = torch.cat([zero, sums.cumsum(1)], 1)[:, : n + 1]  # sum of those v
    total = counts.sum(1, keepdim=True)
    x = torch.arange(n + 1, dtype=torch.int64, device=values.device) * cs
    return below_sum + x.view(1, -1) * (total - below_count)


def pair_counts(global_intervals: torch.Tensor, seqlen: int, chunk_size: int) -> torch.Tensor:
    """Visible (query, key) pairs per (query chunk, key chunk): int64 ``[n, n]`` on the CPU.

    Args:
        global_intervals: :func:`~flashmask.distributed.localize.normal_form` output
            ``[B, Hm, N, 4]`` with ``N = n * chunk_size``.
        seqlen: ``S``, the number of real tokens; query rows ``>= S`` (padding) are not counted.
        chunk_size: tokens per chunk.
    """
    b, hm, n_tok, _ = global_intervals.shape
    if n_tok % chunk_size:
        raise ValueError(f"the padded length {n_tok} must be a multiple of chunk_size {chunk_size}")
    n = n_tok // chunk_size
    # Only rows < seqlen count: clamping every bound to seqlen drops the padding rows.
    v = global_intervals.to(torch.int64).clamp(0, seqlen).reshape(b * hm, n_tok, 4)
    lts, lte, uts, ute = v.unbind(-1)
    lte = torch.maximum(lts, lte)
    ute = torch.maximum(uts, ute)
    its = torch.maximum(lts, uts)
    ite = torch.maximum(its, torch.minimum(lte, ute))
    key_chunk = (torch.arange(n_tok, device=v.device) // chunk_size).expand(b * hm, n_tok)
    masked_below = torch.zeros(n, n + 1, dtype=torch.int64, device=v.device)
    for vals, sign in ((lte, 1), (lts, -1), (ute, 1), (uts, -1), (ite, -1), (its, 1)):
        masked_below += sign * _sum_min(vals, key_chunk, n, chunk_size)
    rows_below = (torch.arange(n + 1, device=v.device) * chunk_size).clamp(max=seqlen)
    visible_below = rows_below.view(1, -1) * (b * hm * chunk_size) - masked_below  # [key, t]
    return visible_below.diff(dim=1).T.contiguous().cpu()


def tile_counts(global_intervals: torch.Tensor, chunk_size: int, tile_size: int) -> torch.Tensor:
    """Non-skipped ``tile_size``-square tiles per (query chunk, key chunk): int64 ``[n, n]``.

    The kernels' own work measure (tiles they cannot skip, semantics §3.2), summed over batch and
    mask heads; ``chunk_size`` must be a multiple of ``tile_size``. Padding rows count like other
    rows here.
    """
    if chunk_size % tile_size:
        raise ValueError(
            f"chunk_size {chunk_size} must be a multiple of tile_size {tile_size} (tile workload)"
        )
    n_tok = global_intervals.shape[2]
    n = n_tok // chunk_size
    classes = FlashMask(global_intervals, False).classify_tiles(tile_size, tile_size, n_tok)
    live = (classes != TileClass.SKIP).to(torch.int64).sum((0, 1))  # [Tm, Tn]
    per = chunk_size // tile_size
    return live.view(n, per, n, per).sum((1, 3)).cpu()
