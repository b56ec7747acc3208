"""Mask preparation: normalised bounds, per-key-tile summaries, tile lists and launch orders,
built by the Triton kernels of :mod:`.mask_prep` in O(N) + O(tiles) and cached per mask tensor
(see ``docs/design.md``, "Preparation and its cache")."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashmask._tensor_cache import TensorKeyedCache
from flashmask.kernels import tiles
from flashmask.kernels.launch import launch_kernel


def check_mask_shape(sri: torch.Tensor, batch: int, seqlen_k: int) -> None:
    """Raise ``ValueError`` unless ``sri`` is ``[batch, Hm, seqlen_k, 1 | 2 | 4]``: the kernels
    index the mask by batch entry and key column without bounds checks, so a broadcast batch-1
    mask or a shorter one would be read past its end. (The public API checks this with friendlier
    words; this guards direct ``flashmask.kernels`` callers.)"""
    if (
        sri.dim() != 4
        or sri.shape[0] != batch
        or sri.shape[2] != seqlen_k
        or sri.shape[3] not in (1, 2, 4)
    ):
        raise ValueError(
            f"startend_row_indices must be [batch={batch}, mask heads, seqlen_k={seqlen_k}, 1, 2 "
            f"or 4] (one row per batch entry: expand a shared mask), got {tuple(sri.shape)}"
        )


def prepare(
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
    shapes: list[tuple[int, int, bool]],
    skip_tiles: bool = True,
) -> tuple[torch.Tensor | None, list[tiles.TileLists]]:
    """Mask preparation with the Triton kernels of :mod:`.mask_prep`.

    Returns the normalised bounds ``[B, Hm, 4, Sk]`` (``None`` without a mask: the kernels then
    read no bounds) and one :class:`tiles.TileLists` per ``(block_m, block_n, row_major)`` in
    ``shapes``: row-major lists give each query tile its key tiles (forward, dQ), column-major
    ones each key tile its query tiles (dK/dV). Equal to :func:`tiles.column_bounds` +
    :func:`tiles.tile_classes` + :func:`tiles.compact`. Launches: one summary per key-tile width
    (none without a mask) and one list kernel per two lists (the launch latency, not the O(N)
    work, is what this costs on a GPU).
    """
    sri = startend_row_indices
    bounds = None
    if sri is not None:
        check_mask_shape(sri, batch, seqlen_k)
        bounds = torch.empty(batch, sri.shape[1], 4, seqlen_k, dtype=torch.int32, device=device)
    lists: dict[tuple[int, int, bool], tiles.TileLists] = {}
    _add_lists(
        sri, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles, bounds, {}, lists
    )
    return bounds, [lists[shape] for shape in shapes]


def _add_lists(
    sri: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
    shapes: list[tuple[int, int, bool]],
    skip_tiles: bool,
    bounds: torch.Tensor | None,
    summaries: dict[int, torch.Tensor],
    lists: dict[tuple[int, int, bool], tiles.TileLists],
) -> None:
    """Add to ``lists`` those of ``shapes`` it lacks, first adding the summaries they need (and,
    with the first summary, the normalised ``bounds``) to ``summaries``."""
    missing = [shape for shape in shapes if shape not in lists]
    if not missing:
        return
    if sri is not None:
        _summarize(sri, causal, seqlen_q, seqlen_k, bounds, summaries, [bn for _, bn, _ in missing])
    hm = 1 if sri is None else sri.shape[1]
    lists.update(
        _build_lists(summaries, causal, seqlen_q, seqlen_k, batch, hm, device, missing, skip_tiles)
    )


def _summarize(
    sri: torch.Tensor,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    bounds: torch.Tensor,
    summaries: dict[int, torch.Tensor],
    widths: list[int],
) -> None:
    """Add the per-key-tile summaries of the key-tile ``widths`` missing from ``summaries``; the
    first summary ever built for ``bounds`` also writes the normalised bounds. Two missing
    widths of which the narrower divides the wider (the forward's 64 and the Gluon backward's
    128) take one launch."""
    from flashmask.kernels.mask_prep import summarize_kernel

    batch, hm = bounds.shape[:2]
    todo = sorted({bn for bn in widths if bn not in summaries}, reverse=True)
    while todo:
        bn = todo.pop(0)
        sub = next((w for w in todo if bn % w == 0), 0)
        if sub:
            todo.remove(sub)
        tn = -(-seqlen_k // bn)
        summary = torch.empty(batch, hm, 8, tn, dtype=torch.int32, device=bounds.device)
        sub_tiles = -(-seqlen_k // sub) if sub else 1
        sub_summary = (
            torch.empty(batch, hm, 8, sub_tiles, dtype=torch.int32, device=bounds.device)
            if sub
            else summary  # never written without SUB_N
        )
        launch_kernel(
            summarize_kernel, (tn, hm, batch),
            sri, bounds, summary, sub_summary, *sri.stride(), hm, seqlen_q, seqlen_k, tn,
            sub_tiles,
            CAUSAL=causal,
            BOUNDS_PER_COLUMN=sri.shape[-1],
            HAS_MASK=True,
            WRITE_BOUNDS=not summaries,
            BLOCK_N=bn,
            SUB_N=sub,
        )  # fmt: skip
        summaries[bn] = summary
        if sub:
            summaries[sub] = sub_summary


def _build_lists(
    summaries: dict[int, torch.Tensor],
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    hm: int,
    device: torch.device,
    shapes: list[tuple[int, int, bool]],
    skip_tiles: bool,
) -> dict[tuple[int, int, bool], tiles.TileLists]:
    """The tile lists of the distinct ``shapes``, two per launch (``summaries`` empty: no mask)."""
    from flashmask.kernels.mask_prep import tile_list_kernel

    built: dict[tuple[int, int, bool], tiles.TileLists] = {}
    todo = list(dict.fromkeys(shapes))  # each distinct list once
    for pair in (todo[i : i + 2] for i in range(0, len(todo), 2)):
        args, flags, outers = [], {}, []
        for slot, (bm, bn, row_major) in zip("AB", pair, strict=False):
            tm, tn = -(-seqlen_q // bm), -(-seqlen_k // bn)
            outer, inner = (tm, tn) if row_major else (tn, tm)
            lists = tiles.TileLists(
                torch.empty(batch, hm, outer, inner, dtype=torch.int32, device=device),
                torch.empty(batch, hm, outer, dtype=torch.int32, device=device),
                torch.empty(batch, hm, outer, dtype=torch.int32, device=device),
            )
            built[(bm, bn, row_major)] = lists
            # Without a mask no summary exists or is read: any int32 pointer fills the slot.
            args += [summaries.get(bn, lists.counts), *lists, tm, tn]
            outers.append(outer)
            flags |= {
                f"ROW_MAJOR_{slot}": row_major,
                f"BLOCK_M_{slot}": bm,
                f"BLOCK_N_{slot}": bn,
                f"CHUNK_{slot}": min(256, max(16, 1 << (inner - 1).bit_length())),
            }
        if len(pair) == 1:  # slot B unused: a copy of A's arguments that no program reads
            args += args
            flags |= {k.replace("_A", "_B"): v for k, v in flags.items()}
        launch_kernel(
            tile_list_kernel, (sum(outers), hm, batch),
            *args, outers[0], seqlen_q, seqlen_k,
            CAUSAL=causal,
            HAS_MASK=bool(summaries),
            SKIP_TILES=skip_tiles,
            HAS_B=len(pair) == 2,
            **flags,
        )  # fmt: skip
    return built


@dataclass
class _Prepared:
    """What one mask tensor has been prepared into so far (see :func:`prepare_cached`)."""

    bounds: torch.Tensor
    summaries: dict[int, torch.Tensor]
    lists: dict[tuple[int, int, bool], tiles.TileLists]


# Recently prepared masks; a few suffice (one per training step is typical) and a bound keeps
# masks a caller holds on to (a dataset on the GPU) from pinning their lists.
PREPARED_CAPACITY = 4
_PREPARED: TensorKeyedCache[_Prepared] = TensorKeyedCache(PREPARED_CAPACITY)


# Without a mask the lists depend on the call's parameters alone: those of the last few
# parameter sets are kept (a list launch costs ~100 us of host time on the H200's host; an 8K
# full-attention call made two of them).
UNMASKED_CAPACITY = 8
_UNMASKED: OrderedDict[tuple, dict[tuple[int, int, bool], tiles.TileLists]] = OrderedDict()
_UNMASKED_LOCK = threading.Lock()


# Launch orders (tiles.program_order) of recently used lists. Each is stored with its lists'
# counts tensor and found by that tensor's identity: the reference held keeps the id from being
# reused by another tensor while the entry lives.
ORDER_CAPACITY = 16
_ORDERS: OrderedDict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_ORDERS_LOCK = threading.Lock()


_UNCACHED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flashmask_uncached", default=False
)


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Within the block, every call prepares its mask afresh and keeps nothing (see
    :func:`may_cache`)."""
    token = _UNCACHED.set(True)
    try:
        yield
    finally:
        _UNCACHED.reset(token)


def may_cache(device: torch.device) -> bool:
    """Whether preparations made on ``device`` now may be kept for later calls: not during CUDA
    graph capture (the tensors belong to the graph's pool), nor while ``torch.compile`` traces,
    nor inside :func:`uncached` (the custom ops' calls: compiled code may run in a CUDA graph
    pool, as cudagraph trees' warm-up does, where a kept preparation would be a live allocation
    the graph does not own)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return not (capturing or torch.compiler.is_compiling() or _UNCACHED.get())


def program_order(
    lists: tiles.TileLists, grid_heads: int, reverse_tiles: bool
) -> torch.Tensor | None:
    """:func:`tiles.program_order` of ``lists`` for a grid over ``grid_heads`` heads, computed
    once per lists; see
    :func:`program_orders`."""
    return program_orders([(lists, grid_heads, reverse_tiles)])[0]


def program_orders(
    requests: list[tuple[tiles.TileLists, int, bool]],
) -> list[torch.Tensor | None]:
    """:func:`program_order` of each ``(lists, grid_heads, reverse_tiles)`` of ``requests`` (at
    most two, of one mask), those not computed yet in one launch of
    ``mask_prep.program_order_kernel``: a forward computes its backward's with its own."""
    caching = may_cache(requests[0][0].counts.device)
    keys = [(id(lists.counts), heads, reverse) for lists, heads, reverse in requests]
    found: list[torch.Tensor | None] = [None] * len(requests)
    if caching:
        with _ORDERS_LOCK:
            for i, ((lists, _, _), key) in enumerate(zip(requests, keys, strict=True)):
                hit = _ORDERS.get(key)
                if hit is not None and hit[0] is lists.counts:
                    _ORDERS.move_to_end(key)
                    found[i] = hit[1]
    missing = [i for i, order in enumerate(found) if order is None]
    if missing:
        pending = [_per_grid_head(*requests[i]) for i in missing]
        if len({lists.counts.shape[:2] for lists, _, _ in pending}) == 1:
            computed = _launch_program_orders(pending)
        else:  # one mask per query head: the backward's counts were summed per kv head
            computed = [_launch_program_orders([request])[0] for request in pending]
        for i, order in zip(missing, computed, strict=True):
            found[i] = order
        if caching:
            with _ORDERS_LOCK:
                for i in missing:
                    _ORDERS[keys[i]] = (requests[i][0].counts, found[i])
                while len(_ORDERS) > ORDER_CAPACITY:
                    _ORDERS.popitem(last=False)
    return found


def _per_grid_head(
    lists: tiles.TileLists, grid_heads: int, reverse_tiles: bool
) -> tuple[tiles.TileLists, int, bool]:
    """``(lists, grid_heads, reverse_tiles)`` as the order kernel takes it: where there are more
    mask heads than grid heads (one mask per query head, a grid over key/value heads whose
    programs walk the lists of all the query heads of their group), each grid head's work is the
    sum of its group's list lengths."""
    batch, mask_heads, tiles_ = lists.counts.shape
    if mask_heads <= grid_heads:
        return lists, grid_heads, reverse_tiles
    if mask_heads % grid_heads:
        raise ValueError(f"{mask_heads} mask heads do not split into {grid_heads} grid heads")
    group = mask_heads // grid_heads
    summed = lists.counts.view(batch, grid_heads, group, tiles_).sum(2, dtype=torch.int32)
    return (
        tiles.TileLists(lists.entries, summed.contiguous(), lists.num_partial),
        grid_heads,
        reverse_tiles,
    )


# Mask items counted per step of the order's sort (every program counts all of a mask's
# B * Hm * T lists: one step up to 2048, e.g. one mask head over 128K tokens of 64-row tiles),
# and items placed per step of its row.
ORDER_COUNT_CHUNK = 2048
ORDER_PLACE_CHUNK = 128


def _launch_program_orders(requests: list[tuple[tiles.TileLists, int, bool]]) -> list:
    """:func:`tiles.program_order` of one or two ``(lists, grid_heads, reverse_tiles)`` (of one
    mask: the same batch and mask heads) by one launch of ``mask_prep.program_order_kernel``."""
    from flashmask.kernels.mask_prep import program_order_kernel

    if not 1 <= len(requests) <= 2:
        raise ValueError(f"one or two orders per launch, got {len(requests)}")
    args, flags, orders, rows = [], {}, [], 0
    batch, mask_heads, _ = requests[0][0].counts.shape
    for slot, (lists, grid_heads, reverse) in zip("AB", requests, strict=False):
        counts = lists.counts.contiguous()
        b, heads_m, num_tiles = counts.shape
        if (b, heads_m) != (batch, mask_heads):
            raise ValueError("the orders of one launch must share their batch and mask heads")
        if grid_heads % mask_heads:
            raise ValueError(
                f"grid_heads={grid_heads} is not a multiple of the {mask_heads} mask heads"
            )
        order = torch.empty(batch * grid_heads * num_tiles, dtype=torch.int32, device=counts.device)
        orders.append(order)
        rows += batch * grid_heads
        args.append([counts, order, num_tiles, grid_heads, grid_heads // mask_heads])
        flags[f"REVERSE_TILES_{slot}"] = reverse
    if len(requests) == 1:  # slot B unused: a copy of A's arguments that no program reads
        args.append(args[0])
        flags["REVERSE_TILES_B"] = flags["REVERSE_TILES_A"]
    launch_kernel(
        program_order_kernel, (rows,),
        *args[0], *args[1], batch, mask_heads, HAS_B=len(requests) == 2,
        COUNT_CHUNK=ORDER_COUNT_CHUNK, PLACE_CHUNK=ORDER_PLACE_CHUNK, **flags,
    )  # fmt: skip
    return orders


def clear_prepared() -> None:
    """Forget every cached preparation (:func:`prepare_cached`, :func:`program_order`); the
    next call of each mask (or without one) prepares it again. For benchmarks that time a call
    with its preparation."""
    _PREPARED.clear()
    with _UNMASKED_LOCK:
        _UNMASKED.clear()
    with _ORDERS_LOCK:
        _ORDERS.clear()


def _unmasked_lists(
    params: tuple, shapes: list[tuple[int, int, bool]]
) -> dict[tuple[int, int, bool], tiles.TileLists]:
    """The cached no-mask lists of ``params`` (those of :func:`prepare_cached`'s key), with
    the missing ``shapes`` built; least recently used parameter sets beyond
    :data:`UNMASKED_CAPACITY` are dropped."""
    with _UNMASKED_LOCK:
        lists = _UNMASKED.setdefault(params, {})
        _UNMASKED.move_to_end(params)
        while len(_UNMASKED) > UNMASKED_CAPACITY:
            _UNMASKED.popitem(last=False)
    causal, seqlen_q, seqlen_k, batch, device, _, skip_tiles = params
    _add_lists(None, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles, None, {}, lists)
    return lists


def prepare_cached(
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
    shapes: list[tuple[int, int, bool]],
    skip_tiles: bool = True,
) -> tuple[torch.Tensor | None, list[tiles.TileLists]]:
    """:func:`prepare`, reusing what an earlier call prepared from the same mask tensor.

    Every layer of a model, and the backward of each, gets the same ``startend_row_indices``
    object, so the bounds, summaries and lists are built on the mask's first use and reused
    while that tensor is alive and unchanged (:class:`~flashmask._tensor_cache.TensorKeyedCache`:
    the tensor's identity and ``_version``), for the same lengths, batch, device, current stream
    and mode. Lists of shapes not seen yet are added to the entry. Without a mask the lists of
    the last :data:`UNMASKED_CAPACITY` parameter sets are kept. Nothing is cached during CUDA
    graph capture or while ``torch.compile`` traces.
    """
    sri = startend_row_indices
    if not may_cache(device):
        return prepare(sri, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    params = (causal, seqlen_q, seqlen_k, batch, device, stream, skip_tiles)
    if sri is None:
        lists = _unmasked_lists(params, shapes)
        return None, [lists[shape] for shape in shapes]
    check_mask_shape(sri, batch, seqlen_k)
    entry = _PREPARED.get(
        sri,
        params,
        lambda: _Prepared(
            torch.empty(batch, sri.shape[1], 4, seqlen_k, dtype=torch.int32, device=device), {}, {}
        ),
    )
    _add_lists(
        sri, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles,
        entry.bounds, entry.summaries, entry.lists,
    )  # fmt: skip
    return entry.bounds, [entry.lists[shape] for shape in shapes]
