"""Mask preparation for the kernels: normalised column bounds and per-tile work lists.

The kernels never look at ``(causal, C)`` forms: every mask is first turned into four int32 row
bounds per key column, ``[B, Hm, 4, Sk]`` = (LTS, LTE, UTS, UTE) clamped to ``[0, Sq]`` (absent
intervals empty). Tiles are then classified (skip / partial / full) and compacted into lists:

* forward and dQ: for every query tile, the ascending list of key tiles to visit;
* dK/dV: for every key tile, the ascending list of query tiles to visit.

Each row lists its partial tiles first, then its unmasked ones, each group ascending; skipped
tiles are not listed. A partial entry is the tile index ``e >= 0`` (apply the element mask), an
unmasked one is encoded ``-e - 1`` (no mask work), and ``num_partial`` says where the groups meet,
so the kernels walk two loops, the second one free of any mask code.

The dense mode (``skip_tiles=False``, for the proof that skipping is exact) lists fully masked
tiles among the partial ones and makes the kernels mask the unmasked group too: every tile is then
visited and masked, in the same order for every tile that holds a visible pair. A fully masked
tile adds exact zeros (forward: ``alpha = 1``, ``p = 0``; backward: ``P = dS = 0``), so both modes
must agree bit for bit.
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
    """Compacted tile lists: ``entries`` int32 ``[B, Hm, T_outer, T_inner]``; ``counts`` int32
    ``[B, Hm, T_outer]`` (only the first ``counts`` entries of a row are meaningful), of which the
    first ``num_partial`` (int32 ``[B, Hm, T_outer]``) are partial tiles."""

    entries: torch.Tensor
    counts: torch.Tensor
    num_partial: torch.Tensor


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


def edge_intervals(startend_row_indices: torch.Tensor | None, causal: bool) -> bool:
    """Whether every key column's lower masked interval runs to the last row and its upper one
    starts at row 0: ``startend_row_indices`` ``[B, Hm, Sk, C]`` with ``C = 1`` when causal
    (LTS alone) or ``C = 2`` when not (LTS and UTE), where the normalised bounds hold LTE = Sq
    and UTS = 0 (``FlashMask.intervals``)."""
    if startend_row_indices is None:
        return False
    return startend_row_indices.shape[-1] == (1 if causal else 2)


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
    ``skip_tiles=False`` no tile is ``SKIP`` (skipped tiles become ``PARTIAL``; the dense mode used
    to prove skipping exact, in which the kernels mask ``FULL`` tiles as well).
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
        classes = torch.where(classes == TileClass.SKIP, TileClass.PARTIAL, classes)
    if seqlen_k % block_n:
        last = classes[..., -1]
        classes[..., -1] = torch.where(last == TileClass.FULL, TileClass.PARTIAL, last)
    return classes


def compact(classes: torch.Tensor) -> TileLists:
    """Lists of the non-skipped inner tiles of every outer tile (last axis = inner): partial
    tiles ascending, then full tiles ascending (encoded ``-i - 1``)."""
    inner = classes.shape[-1]
    idx = torch.arange(inner, device=classes.device, dtype=torch.int32)
    partial = classes == TileClass.PARTIAL
    full = classes == TileClass.FULL
    encoded = torch.where(full, -idx - 1, idx)
    # Sort key: partial tiles, then full ones, then skipped ones, each group ascending.
    key = torch.where(partial, idx, torch.where(full, idx + inner, idx + 2 * inner))
    entries = encoded.gather(-1, key.argsort(dim=-1)).to(torch.int32).contiguous()
    num_partial = partial.sum(-1, dtype=torch.int32).contiguous()
    counts = (num_partial + full.sum(-1, dtype=torch.int32)).contiguous()
    return TileLists(entries, counts, num_partial)


def forward_lists(classes: torch.Tensor) -> TileLists:
    """Per query tile, the key tiles to visit."""
    return compact(classes)


def backward_lists(classes: torch.Tensor) -> TileLists:
    """Per key tile, the query tiles to visit."""
    return compact(classes.transpose(-1, -2))


def program_order(counts: torch.Tensor, grid_heads: int, reverse_tiles: bool) -> torch.Tensor:
    """The launch order of a kernel over lists with ``counts`` int32 ``[B, Hm, T]``, whose grid
    ``(T, grid_heads, B)`` runs one list per program (the forward: query tiles and query heads;
    the dK/dV pass: key tiles and key/value heads, each program walking the lists of the query
    heads that share its key/value head, which the mask heads, 1 or ``Hkv``, never split).

    Returns int32 ``[B * grid_heads * T]``: the ``i``-th program launched (in the grid's linear
    order, its first index fastest) runs the program whose natural linear index is entry ``i``,
    ``(b * grid_heads + h) * T + p``, where grid head ``h`` reads mask head
    ``h // (grid_heads // Hm)`` and runs tile ``p`` (``T - 1 - p`` with ``reverse_tiles``).

    Programs run heaviest first by the bit length of their list's length (powers of two of
    work), each such class in natural order. A GPU starts programs in launch order as it has
    room, so a long list launched late decides the kernel's end: packed documents' global or
    shared-prompt tokens give a few key (or query) tiles lists many times the typical one, and
    with grouped-query heads a dK/dV program walks several of them. Within a class the natural
    order keeps programs that run at the same time on neighbouring tiles of one head (sharing
    its K/V or Q/dO tiles in L2): sorting by exact length would spread them over all heads.
    The order changes which SM runs a program and when, never a program's arithmetic."""
    mask_heads = counts.shape[1]
    work = counts.repeat_interleave(grid_heads // mask_heads, dim=1)
    if reverse_tiles:
        work = work.flip(-1)
    # frexp's exponent of n > 0 is n's bit length (1 for 1, 2 for 2-3, 3 for 4-7, ...), 0 for 0.
    _, length_class = torch.frexp(work.float())
    order = torch.argsort(length_class.flatten(), descending=True, stable=True)
    return order.to(torch.int32)
