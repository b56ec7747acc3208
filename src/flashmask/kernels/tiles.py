"""Mask preparation for the kernels: normalised column bounds and per-tile work lists.

The kernels never look at ``(causal, C)`` forms: every mask is first turned into four int32 row
bounds per key column, ``[B, Hm, 4, Sk]`` = (LTS, LTE, UTS, UTE) clamped to ``[0, Sq]`` (absent
intervals empty). Tiles are then classified (skip / partial / full) and compacted into lists:

* forward and dQ: for every query tile, the ascending list of key tiles to visit;
* dK/dV: for every key tile, the ascending list of query tiles to visit.

A list entry ``e >= 0`` is a partial tile ``e`` (apply the element mask); ``e < 0`` is the
unmasked tile ``-e - 1``. Skipped tiles are not listed. Keeping one ascending list (rather than a
list of partial tiles and another of full ones) makes the accumulation order independent of the
classification, so skipping a tile never changes a bit of the result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashmask.mask import (
    ColumnIntervals,
    FlashMask,
    TileClass,
    classify_tiles,
    summarize_blocks,
)


class TileLists(NamedTuple):
    """Compacted tile lists: ``entries`` int32 ``[B, Hm, T_outer, T_inner]``, ``counts`` int32
    ``[B, Hm, T_outer]`` (only the first ``counts`` entries of a row are meaningful)."""

    entries: torch.Tensor
    counts: torch.Tensor


def column_bounds(
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
) -> torch.Tensor:
    """Normalised bounds int32 ``[B, Hm, 4, Sk]`` (no mask: ``Hm = 1``, all intervals empty)."""
    if startend_row_indices is None:
        lts = torch.full((batch, 1, seqlen_k), seqlen_q, dtype=torch.int32, device=device)
        zero = torch.zeros_like(lts)
        return torch.stack([lts, lts, zero, zero], dim=2)
    iv = FlashMask(startend_row_indices, causal).intervals(seqlen_q)
    return torch.stack(list(iv), dim=2).contiguous()


def tile_classes(
    bounds: torch.Tensor,
    causal: bool,
    seqlen_q: int,
    block_m: int,
    block_n: int,
    skip_tiles: bool = True,
) -> torch.Tensor:
    """Tile classes int8 ``[B, Hm, Tm, Tn]`` as the kernels need them.

    Differs from :meth:`FlashMask.classify_tiles` in one way: a key tile that runs past ``Sk``
    is never ``FULL`` (its out-of-range columns need the element mask). With
    ``skip_tiles=False`` every tile is ``PARTIAL`` (the dense mode used to prove skipping exact).
    """
    seqlen_k = bounds.shape[-1]
    classes = classify_tiles(
        summarize_blocks(ColumnIntervals(*bounds.unbind(2)), block_n),
        causal,
        seqlen_q,
        seqlen_k,
        block_m,
        block_n,
    )
    if not skip_tiles:
        return torch.full_like(classes, TileClass.PARTIAL)
    if seqlen_k % block_n:
        last = classes[..., -1]
        classes[..., -1] = torch.where(last == TileClass.FULL, TileClass.PARTIAL, last)
    return classes


def compact(classes: torch.Tensor) -> TileLists:
    """Ascending lists of the non-skipped inner tiles of every outer tile (last axis = inner)."""
    inner = classes.shape[-1]
    idx = torch.arange(inner, device=classes.device, dtype=torch.int32)
    keep = classes != TileClass.SKIP
    encoded = torch.where(classes == TileClass.FULL, -idx - 1, idx)
    # Skipped tiles sort after every kept one; kept ones stay ascending.
    order = torch.where(keep, idx, idx + inner).argsort(dim=-1)
    entries = encoded.gather(-1, order).to(torch.int32).contiguous()
    return TileLists(entries, keep.sum(-1, dtype=torch.int32).contiguous())


def forward_lists(classes: torch.Tensor) -> TileLists:
    """Per query tile, the key tiles to visit."""
    return compact(classes)


def backward_lists(classes: torch.Tensor) -> TileLists:
    """Per key tile, the query tiles to visit."""
    return compact(classes.transpose(-1, -2))
