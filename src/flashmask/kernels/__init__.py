"""Triton kernels for FlashMask attention and their launchers.

``forward``/``backward`` take validated inputs in the public layout (``[B, S, H, D]``) and the raw
``startend_row_indices``; mask preparation (normalised bounds, tile classes, tile lists) happens
here once per call and costs O(N) plus O(tiles).

On a CPU-only machine the same kernels run through Triton's interpreter (``TRITON_INTERPRET=1``),
which is how CI tests them; the public API only routes CUDA tensors here.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from flashmask._tensor_cache import TensorKeyedCache
from flashmask.kernels import tiles
from flashmask.kernels.launch import launch_kernel

__all__ = [
    "TileConfig",
    "backward",
    "clear_prepared",
    "compact_tile_config",
    "device_shared_memory",
    "device_supported",
    "forward",
    "prepare",
    "prepare_cached",
    "shrink_tile_config",
    "supports",
    "tile_config",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes, warps and pipeline stages of the three kernels.

    ``*_m`` is the query-tile height and ``*_n`` the key-tile width of the forward (``fwd_``),
    the key-stationary dK/dV pass (``bwd_``) and the query-stationary dQ pass (``dq_``); the
    mask preparation builds its tile lists at the same shapes.
    """

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    fwd_stages: int
    bwd_m: int
    bwd_n: int
    bwd_warps: int
    bwd_stages: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dq_stages: int
    # Non-deterministic backward: add dQ with fp32 atomics in the dK/dV pass instead of a
    # separate dQ pass. Off by default: the separate pass measured faster on the H200.
    atomic_dq: bool = False
    # With ``atomic_dq``, on a GPU with TMA: add each tile's dQ through one TMA bulk reduce-add
    # (``cp.reduce.async.bulk.tensor``) instead of one fp32 atomic per element. Triton's
    # interpreter has no descriptor reductions, so there the element atomics run.
    atomic_dq_tma: bool = True
    # Launch the dK/dV and dQ passes as one grid (when their warp counts agree), so neither
    # pass's last wave leaves the GPU half idle. False: two launches (kept for measurement).
    fused_backward: bool = True
    # Drop the bounds masks of Q/K/V/dO loads and stores along the dimensions that divide the
    # tile evenly. False: every access masked (kept for measurement).
    even_fast_path: bool = True
    # The forward loads its Q/K/V tiles through TMA tensor descriptors on GPUs that have TMA
    # (compute capability >= 9.0) when the tensors' strides allow it (16-byte aligned) and no
    # tile is square (see ``_tma_tiles_safe``). Same values as the pointer loads: rows and
    # columns past the tensor read as zeros.
    fwd_tma: bool = False
    # With ``fwd_tma``: 2-D descriptors over ``[B * S, H * D]`` where no tile crosses a sequence
    # or head boundary (lengths divisible by the tiles, ``D`` a power of two, dense layout), else
    # the 4-D ones over ``[B, S, H, D]``. Off by default: measured on the H200 the 2-D loads are
    # exact even on square tiles (where the 4-D ones are miscompiled) but no faster than pointer
    # loads there, and 1-5% slower than the 4-D ones elsewhere (benchmarks/NOTES.md, change 13).
    fwd_tma_flat: bool = False
    # The dQ pass loads its K/V tiles through 4-D TMA descriptors (same conditions as
    # ``fwd_tma``: a TMA GPU, aligned strides, no tile side equal to the padded head dim). Off by
    # default: not yet measured (TMA in both backward passes at once was 1.3x slower, change 9).
    dq_tma: bool = False
    # The forward runs the warp-specialised Gluon kernel (``kernels.gluon_fwd``: a TMA producer
    # warp and two wgmma warpgroups taking turns at the tensor cores over 128x128 tiles) where
    # it applies: Hopper, a positive scale, inputs ``gluon_forward_eligible`` accepts and, with a
    # mask, the length limit of ``_use_gluon_forward``. On by default at D = 128, where the H200
    # measured it 1.22-1.31x the Triton forward on full/causal and 1.04-1.28x on 11 of 12 masks
    # at 32K (benchmarks/NOTES.md, seventh session; from 8K keys since the twenty-third); at
    # D = 64 without a mask only.
    fwd_gluon: bool = False
    # With ``deterministic=False``, the backward runs the warp-specialised Gluon kernel
    # (``kernels.gluon_bwd``: 128 keys over two wgmma warpgroups, dQ in the same pass through
    # fp32 TMA reduce-adds; ``kernels.gluon_bwd256`` at D = 256) where it applies (Hopper,
    # ``gluon_backward_eligible``, and the limits of ``_use_gluon_backward``). On by default at
    # D = 128: on the H200 1.15-1.19x the Triton backward without a mask, 0.98-1.13x with masks
    # at 32K (benchmarks/NOTES.md, sixth session); at D = 64 (1.03-1.18x at 32K, eighth
    # session); at D = 256 (1.43-1.69x at 8K and 32K, ninth session).
    bwd_gluon: bool = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Shared memory per block from which the H200-tuned tiles fit (Hopper offers 227 KB; the largest
# forward tile, 128x128 with 3 stages at D = 128, needs 224 KB).
_HOPPER_SHARED_MEMORY = 200 * 1024


def tile_config(
    head_dim: int, *, has_mask: bool = True, shared_memory: int | None = None
) -> TileConfig:
    """The tile configuration for a head dimension (small tiles under the interpreter).

    ``has_mask=False`` (no ``startend_row_indices``: full or causal attention) picks larger
    forward tiles (except at head dim 128, where TMA-loaded 64x64 tiles are faster): with
    nothing to skip but the causal triangle, bigger tiles only add matmul efficiency, while with
    an interval mask they would skip less.
    Measured on the H200, bf16, 8K tokens per sequence (``benchmarks/results/tune_S8192_*``,
    ``benchmarks/NOTES.md``). ``shared_memory`` (bytes per block the GPU allows) below Hopper's
    selects :func:`compact_tile_config` instead.
    """
    if _interpreting():
        return TileConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
    if shared_memory is not None and shared_memory < _HOPPER_SHARED_MEMORY:
        return compact_tile_config(head_dim)
    if head_dim <= 64:
        # At D = 64 the Gluon backward (with a mask from 8K keys) and, without a mask, the
        # Gluon forward: on the H200 the backward measured 1.03-1.18x the Triton one on full,
        # causal and four masks at 32K, and the forward 1.15x / 1.07x on full / causal, but
        # 0.83-1.0x on masks at 32K, where it stays off (benchmarks/NOTES.md, eighth session).
        gluon = head_dim == 64
        cfg = TileConfig(64, 64, 4, 3, 32, 128, 4, 3, 64, 64, 4, 2, bwd_gluon=gluon)
        return cfg if has_mask else replace(cfg, fwd_m=128, fwd_warps=8, fwd_gluon=gluon)
    if head_dim <= 128:
        # At D = 128 the forward's 64x64 tiles load through TMA, with or without a mask (the
        # measured and GPU-checked case: 7-21% faster on masks at 8K, and 4-11% faster than the
        # pointer-loaded 128x128 tiles on full/causal at 8K/32K). Padded head dims (80, 96, 112)
        # keep pointer loads until checked on a GPU, and without a mask the 128x128 tiles.
        # At D = 128 the Gluon forward and backward where they apply (``_use_gluon_forward``,
        # ``_use_gluon_backward``), else these Triton tiles.
        gluon = head_dim == 128
        cfg = TileConfig(
            64, 64, 4, 3, 64, 64, 4, 2, 64, 64, 4, 2,
            fwd_tma=head_dim == 128, fwd_gluon=gluon, bwd_gluon=gluon,
        )  # fmt: skip
        if has_mask or cfg.fwd_tma:
            return cfg
        return replace(cfg, fwd_m=128, fwd_n=128, fwd_warps=8)
    # At D = 256 the Gluon backward (``kernels.gluon_bwd256``): 1.43-1.69x the Triton backward
    # on the H200 on full, causal and four masks at 8K and 32K (benchmarks/NOTES.md, ninth
    # session).
    return TileConfig(128, 64, 8, 2, 64, 64, 8, 2, 64, 64, 4, 2, bwd_gluon=head_dim == 256)


def compact_tile_config(head_dim: int) -> TileConfig:
    """Tiles for GPUs with less shared memory per block than Hopper (A100: 163 KB; consumer
    Ampere/Ada such as the RTX 3090/4090, A10, L4: 99 KB).

    Compiled offline for sm_80 and sm_86 (``benchmarks/sass_report.py``'s machinery, bf16) they
    need at most 72 KB (D <= 128) and 80 KB (D = 256) of shared memory, where the Hopper tiles
    need up to 224 KB. Not timed on such GPUs (none was available); correctness does not depend
    on the tile shapes (the CPU suite runs 16x16 tiles, the H200 check the Hopper ones).
    """
    if head_dim <= 128:
        return TileConfig(64, 64, 4, 2, 64, 64, 4, 2, 64, 64, 4, 2)
    return TileConfig(64, 32, 4, 2, 32, 32, 4, 1, 32, 32, 4, 1)


def shrink_tile_config(cfg: TileConfig) -> TileConfig | None:
    """The next smaller configuration after a launch ran out of shared memory: one pipeline stage
    fewer in every kernel first, then (at one stage) every tile halved down to 16 and 4 warps;
    ``None`` when nothing is left to shrink."""
    if max(cfg.fwd_stages, cfg.bwd_stages, cfg.dq_stages) > 1:
        return replace(
            cfg,
            fwd_stages=max(1, cfg.fwd_stages - 1),
            bwd_stages=max(1, cfg.bwd_stages - 1),
            dq_stages=max(1, cfg.dq_stages - 1),
        )
    sizes = ("fwd_m", "fwd_n", "bwd_m", "bwd_n", "dq_m", "dq_n")
    if max(getattr(cfg, name) for name in sizes) <= 16:
        return None
    halved = {name: max(16, getattr(cfg, name) // 2) for name in sizes}
    return replace(cfg, **halved, fwd_warps=4, bwd_warps=4, dq_warps=4)


# Default configurations that had to shrink on a device, so later calls start from them.
_FITTED: dict[tuple[int, int, bool], TileConfig] = {}
_Result = TypeVar("_Result")


@functools.cache
def _shared_memory_of(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


def device_shared_memory(device: torch.device) -> int | None:
    """Shared memory per block (bytes) a kernel may opt into on ``device``; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return _shared_memory_of(_cuda_index(device))


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _with_fitting_config(
    launch: Callable[[TileConfig], _Result], device: torch.device, head_dim: int, has_mask: bool
) -> _Result:
    """Run ``launch(cfg)`` with the device's default tile configuration, shrinking it
    (:func:`shrink_tile_config`) while a kernel needs more shared memory than the GPU has.
    Only default configurations come here: an explicit ``config`` is never changed."""
    from triton.runtime.errors import OutOfResources

    key = (_cuda_index(device) if device.type == "cuda" else -1, head_dim, has_mask)
    cfg = _FITTED.get(key) or tile_config(
        head_dim, has_mask=has_mask, shared_memory=device_shared_memory(device)
    )
    while True:
        try:
            return launch(cfg)
        except OutOfResources:
            smaller = shrink_tile_config(cfg)
            if smaller is None:
                raise
            cfg = _FITTED[key] = smaller


# Triton compiles the kernels' fp16/bf16 tensor-core dots and asynchronous copies for compute
# capability 8.0 (Ampere) and newer; older GPUs (V100, T4) run the reference instead.
MIN_CAPABILITY = (8, 0)


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_supported(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: a CUDA GPU of compute capability >= 8.0, or any
    device under Triton's interpreter."""
    if device.type == "cuda":
        return _capability_of(_cuda_index(device)) >= MIN_CAPABILITY
    return _interpreting()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: fp16/bf16, ``D == Dv``, ``D % 8 == 0``, ``D <= 256``,
    on a GPU of compute capability >= 8.0.

    Other inputs (float32/float64, other head dims, older GPUs) run the exact reference instead.
    """
    d = q.shape[-1]
    return (
        q.dtype in _KERNEL_DTYPES
        and v.shape[-1] == d
        and d % 8 == 0
        and 16 <= d <= MAX_HEAD_DIM
        and device_supported(q.device)
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
# parameter sets are kept (a list launch costs ~100 us of host time on the H200's host,
# thirteenth session; an 8K full-attention call made two of them).
UNMASKED_CAPACITY = 8
_UNMASKED: OrderedDict[tuple, dict[tuple[int, int, bool], tiles.TileLists]] = OrderedDict()
_UNMASKED_LOCK = threading.Lock()


# Launch orders (tiles.program_order) of recently used lists. Each is stored with its lists'
# counts tensor and found by that tensor's identity: the reference held keeps the id from being
# reused by another tensor while the entry lives.
ORDER_CAPACITY = 16
_ORDERS: OrderedDict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_ORDERS_LOCK = threading.Lock()
# Heaviest programs first (tiles.program_order) in the forward kernels and the Gluon backward,
# with a mask; off: the grid's natural order (for measurement).
PROGRAM_ORDER = True


def _may_cache(device: torch.device) -> bool:
    """Whether preparations made on ``device`` now may be kept for later calls: not during CUDA
    graph capture (the tensors belong to the graph's pool) nor while ``torch.compile`` traces."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return not (capturing or torch.compiler.is_compiling())


def program_order(
    lists: tiles.TileLists, grid_heads: int, reverse_tiles: bool
) -> torch.Tensor | None:
    """:func:`tiles.program_order` of ``lists`` for a grid over ``grid_heads`` heads, computed
    once per lists (``None``: the natural order, with :data:`PROGRAM_ORDER` off); see
    :func:`program_orders`."""
    return program_orders([(lists, grid_heads, reverse_tiles)])[0]


def program_orders(
    requests: list[tuple[tiles.TileLists, int, bool]],
) -> list[torch.Tensor | None]:
    """:func:`program_order` of each ``(lists, grid_heads, reverse_tiles)`` of ``requests`` (at
    most two, of one mask), those not computed yet in one launch of
    ``mask_prep.program_order_kernel``: a forward computes its backward's with its own."""
    if not PROGRAM_ORDER:
        return [None] * len(requests)
    caching = _may_cache(requests[0][0].counts.device)
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
        computed = _launch_program_orders([requests[i] for i in missing])
        for i, order in zip(missing, computed, strict=True):
            found[i] = order
        if caching:
            with _ORDERS_LOCK:
                for i in missing:
                    _ORDERS[keys[i]] = (requests[i][0].counts, found[i])
                while len(_ORDERS) > ORDER_CAPACITY:
                    _ORDERS.popitem(last=False)
    return found


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
    if not _may_cache(device):
        return prepare(sri, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    params = (causal, seqlen_q, seqlen_k, batch, device, stream, skip_tiles)
    if sri is None:
        lists = _unmasked_lists(params, shapes)
        return None, [lists[shape] for shape in shapes]
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


# TMA (the tensor memory accelerator) arrived with Hopper.
TMA_CAPABILITY = (9, 0)


def _tma_usable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether TMA descriptors can describe ``tensors``: a GPU with TMA (or the interpreter),
    16-byte aligned base addresses and strides, unit stride along the head dimension."""
    device = tensors[0].device
    if device.type == "cuda":
        if _capability_of(_cuda_index(device)) < TMA_CAPABILITY:
            return False
    elif not _interpreting():
        return False
    return all(
        x.data_ptr() % 16 == 0
        and x.stride(-1) == 1
        and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])
        for x in tensors
    )


# The Gluon forward (``kernels.gluon_fwd``): its query tile (which also divides every length
# it takes) and the head dims it compiles for.
GLUON_FWD_TILE = 128
GLUON_FWD_HEAD_DIMS = (64, 128, 256)


# The Gluon forward's K/V slots up to D = 128 (a check with ``gluon_fwd.Q_BUFFERS = 2``, which
# fits beside two at D = 128, sets 2: ``benchmarks/gpu_check.py --gluon-fwd-slots 2``).
GLUON_FWD_SLOTS = 3


def gluon_forward_tiles(head_dim: int) -> tuple[int, int]:
    """``(key tile, K/V slots)`` of the Gluon forward at ``head_dim``: 128-key tiles in
    :data:`GLUON_FWD_SLOTS` (three) slots up to D = 128 (224 KB of shared memory at 128); at
    D = 256 64-key tiles in two slots, the largest that fit (192 KB). D = 256 is not routed by
    default: measured 0.87-0.98x the Triton forward on the H200
    (benchmarks/results/gluon_forward_hd256_s8.log)."""
    return (64, 2) if head_dim > 128 else (GLUON_FWD_TILE, GLUON_FWD_SLOTS)


def gluon_forward_eligible(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, capability: tuple[int, int]
) -> bool:
    """Whether the Gluon forward can take ``q [B, Sq, H, D]``, ``k``/``v [B, Sk, Hk, D]`` on a
    GPU of compute capability ``capability``: Hopper (9.x: ``warpgroup_mma`` and TMA; Blackwell
    has no wgmma), one fp16/bf16 dtype, ``D`` in :data:`GLUON_FWD_HEAD_DIMS`, both lengths
    divisible by the tile (its 2-D descriptors over ``[B * S, H * D]`` must not cross a
    sequence). Any layout: the launcher hands the kernel contiguous, 16-byte aligned copies of
    tensors that are not (:func:`tma_ready`; e.g. the ``[B, H, S, D]`` transposes that
    transformers passes)."""
    d = q.shape[-1]
    return (
        capability[0] == 9
        and q.dtype in _KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and d in GLUON_FWD_HEAD_DIMS
        and k.shape[-1] == d
        and v.shape[-1] == d
        and q.shape[1] % GLUON_FWD_TILE == 0
        and k.shape[1] % GLUON_FWD_TILE == 0
    )


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous at a 16-byte aligned address (what the Gluon kernels' 2-D TMA
    descriptors need): ``x`` itself when it is, else a copy."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


# The Gluon backward (``kernels.gluon_bwd``; ``kernels.gluon_bwd256`` at D = 256): its query
# tiles, its key tiles (per program) at D = 64 and 128, and the head dims it compiles for.
GLUON_BWD_QUERIES = 64
GLUON_BWD_KEYS = 128
GLUON_BWD_HEAD_DIMS = (64, 128, 256)
# At D = 256 a program owns 64 keys (two 128-key dK/dV accumulators would not fit the registers).
GLUON_BWD256_KEYS = 64
# With an interval mask, the Gluon backward only from this many keys, per head dim (absent: at
# every length). Its 128-key tiles skip less finely than the Triton backward's 64-key ones, so
# short sparse masks can lose. With the row terms staged in shared memory
# (``gluon_bwd.ROW_TERMS_SMEM``, eleventh session), on all 12 masks against the Triton backward:
# at D = 128 and 4K 1.01-1.31x on ten, 0.98x on share_question and 0.91x on sliding_window
# (``results/gluon_backward_hd128_4k_s11.log``; at 8K 1.01-1.31x on every mask measured,
# ``gluon_backward_row_terms_modes_s11.log``); at D = 64 and 8K 1.01-1.20x on eleven, 0.99x on
# sliding_window (``gluon_backward_hd64_8k_s11.log``). Below these lengths, unmeasured, the
# Triton backward (tenth session, unstaged: from 8K at D = 128, 16K at D = 64). At D = 256 (64-key
# tiles, as the Triton backward's) at every length: 1.43-1.69x the Triton backward on every mask
# measured at 8K and 32K (``results/gluon_backward_hd256_s9.log``). Without a mask at every
# length (full/causal 1.15-1.2x at 8K). ``benchmarks/gpu_check.py --gluon-everywhere`` lifts
# these limits and the forward's to check both kernels on its short masked cases.
GLUON_BWD_MIN_MASKED_SEQLEN: dict[int, int] = {64: 8192, 128: 4096}
# The same for the Gluon forward. With one program per query tile it lost at 8K to the Triton
# forward's 64x64 tiles on the sparse masks (sliding_window 0.92x, share_question 0.94x,
# global_sliding_window 0.83x; ``results/gluon_forward_routing_s21.log``): each program paid
# ~7 us besides its tiles (``program_overhead_s22.log``). With one program per SM taking the
# query tiles dynamically (``gluon_fwd.PERSISTENT``, twenty-third session), against the Triton
# forward (``results/gluon_forward_short_s23.log``): at 8K 1.04-1.22x on seven of ten masks and
# 0.93-0.97x on sliding_window, share_question and global_sliding_window, 11% less forward
# time summed over the ten; at 16K 1.03-1.23x on nine, share_question 0.88x; at 4K 0.86-0.94x
# on four. Used from 8K keys (the launcher knows a mask only as a GPU tensor: its lists'
# lengths, which decide, are not read on the host).
GLUON_FWD_MIN_MASKED_SEQLEN = 8192


def gluon_backward_eligible(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    capability: tuple[int, int],
) -> bool:
    """Whether the Gluon backward can take these inputs: those of :func:`gluon_forward_eligible`
    (its tiles divide lengths divisible by 128 too) with ``D`` in :data:`GLUON_BWD_HEAD_DIMS`,
    and a ``dout`` like ``q``."""
    return (
        gluon_forward_eligible(q, k, v, capability)
        and q.shape[-1] in GLUON_BWD_HEAD_DIMS
        and dout.shape == q.shape
        and dout.dtype == q.dtype
    )


def _gpu_capability(q: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of ``q``'s GPU, or ``None`` off the GPU or under the interpreter."""
    if q.device.type != "cuda" or _interpreting():
        return None
    return _capability_of(_cuda_index(q.device))


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton ships the Gluon Hopper API the Gluon kernels are written against
    (Triton 3.6 and later; checked by importing the kernels' modules once). Without it the
    Triton kernels run, with one warning."""
    try:
        from flashmask.kernels import gluon_bwd, gluon_bwd256, gluon_fwd  # noqa: F401
    except (ImportError, AttributeError) as exc:
        warnings.warn(
            f"flashmask: the Gluon kernels are unavailable with this Triton ({exc}); using the "
            "Triton kernels",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _use_gluon_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    masked: bool,
    config: TileConfig,
) -> bool:
    """``config.fwd_gluon`` and inputs the Gluon forward takes, on a GPU (Gluon has no
    interpreter) and with a positive scale (its row max is taken over unscaled scores); with an
    interval mask (``masked``) also at least :data:`GLUON_FWD_MIN_MASKED_SEQLEN` keys."""
    if not config.fwd_gluon or softmax_scale <= 0:
        return False
    if masked and k.shape[1] < GLUON_FWD_MIN_MASKED_SEQLEN:
        return False
    capability = _gpu_capability(q)
    return (
        capability is not None and gluon_forward_eligible(q, k, v, capability) and gluon_available()
    )


def _use_gluon_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    deterministic: bool,
    skip_tiles: bool,
    masked: bool,
    config: TileConfig,
) -> bool:
    """``config.bwd_gluon``, ``deterministic=False`` and no
    ``torch.use_deterministic_algorithms(True)`` (its dQ atomics are not bit-reproducible), the
    skipping mode, inputs the Gluon backward takes, on a GPU; with an interval mask
    (``masked``) also at least the keys :data:`GLUON_BWD_MIN_MASKED_SEQLEN` asks at its head dim."""
    if not config.bwd_gluon or deterministic or not skip_tiles:
        return False
    if torch.are_deterministic_algorithms_enabled():  # the atomics are not reproducible
        return False
    if masked and k.shape[1] < GLUON_BWD_MIN_MASKED_SEQLEN.get(q.shape[-1], 0):
        return False
    capability = _gpu_capability(q)
    return (
        capability is not None
        and gluon_backward_eligible(q, k, v, dout, capability)
        and gluon_available()
    )


def _tma_tiles_safe(block_m: int, block_n: int, block_d: int) -> bool:
    """Whether the forward's TMA tiles ``[block_m, block_d]`` (Q) and ``[block_n, block_d]``
    (K, V) avoid the shape Triton 3.6 miscompiles on the H200: with ``block_n == block_d``
    (hd128 at 128x128 tiles, hd64 at 64x64) the TMA forward returned wrong outputs (max error
    0.2-2.8 in every such case, exact in every other; ``benchmarks/NOTES.md``, change 9). Square
    tiles keep the pointer loads."""
    return block_n != block_d and block_m != block_d


def _row_descriptor(x: torch.Tensor, rows: int, block_d: int):
    """A TMA descriptor over ``x [B, S, H, D]`` loading ``[1, rows, 1, block_d]`` blocks (one
    head's ``rows`` consecutive sequence positions); out-of-range elements read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, block_d])


def _flat_descriptor(x: torch.Tensor, rows: int, block_d: int):
    """A 2-D TMA descriptor over a contiguous ``x [B, S, H, D]`` seen as ``[B * S, H * D]``,
    loading ``[rows, block_d]`` blocks; exact only for tiles that stay inside one sequence and
    one head (see ``attention_fwd.load_rows_tma``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, s, h, d = x.shape
    return TensorDescriptor(x, [b * s, h * d], [h * d, 1], [rows, block_d])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _s3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _forward_shapes(
    use_gluon: bool, head_dim: int, config: TileConfig
) -> list[tuple[int, int, bool]]:
    if use_gluon:
        return [(GLUON_FWD_TILE, gluon_forward_tiles(head_dim)[0], True)]
    return [(config.fwd_m, config.fwd_n, True)]


def gluon_backward_keys(head_dim: int) -> int:
    """Keys per program (the key tile) of the Gluon backward at ``head_dim``."""
    return GLUON_BWD256_KEYS if head_dim == 256 else GLUON_BWD_KEYS


def gluon_backward_module(head_dim: int):
    """The module of the Gluon backward at ``head_dim`` (``kernels.gluon_bwd256`` at 256, else
    ``kernels.gluon_bwd``); imports it, so only where the interpreter is off."""
    if head_dim == 256:
        from flashmask.kernels import gluon_bwd256

        return gluon_bwd256
    from flashmask.kernels import gluon_bwd

    return gluon_bwd


def _backward_shapes(
    use_gluon: bool, deterministic: bool, head_dim: int, config: TileConfig
) -> list[tuple[int, int, bool]]:
    if use_gluon:
        return [(GLUON_BWD_QUERIES, gluon_backward_keys(head_dim), False)]
    shapes = [(config.bwd_m, config.bwd_n, False)]
    if not (config.atomic_dq and not deterministic):  # the separate dQ pass has its own lists
        shapes.append((config.dq_m, config.dq_n, True))
    return shapes


def forward_list_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    softmax_scale: float,
    config: TileConfig,
) -> list[tuple[int, int, bool]]:
    """The tile lists (``prepare``'s ``(tile_m, tile_n, row_major)`` shapes) that
    :func:`forward` prepares for these inputs with ``config``: those of the kernel it routes
    them to (for a benchmark that times mask preparation alone, as ``flashmask bench`` does)."""
    masked = startend_row_indices is not None
    use_gluon = _use_gluon_forward(q, k, v, softmax_scale, masked, config)
    return _forward_shapes(use_gluon, q.shape[-1], config)


def backward_list_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    deterministic: bool,
    config: TileConfig,
) -> list[tuple[int, int, bool]]:
    """The tile lists :func:`backward` prepares for these inputs with ``config`` (skipping
    mode), like :func:`forward_list_shapes`."""
    masked = startend_row_indices is not None
    use_gluon = _use_gluon_backward(q, k, v, dout, deterministic, True, masked, config)
    return _backward_shapes(use_gluon, deterministic, q.shape[-1], config)


def _forward_preparation(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    use_gluon: bool,
    deterministic: bool,
    backward_follows: bool,
    config: TileConfig,
) -> tuple[list[tuple[int, int, bool]], list[tuple[tuple[int, int, bool], tuple[int, bool]]]]:
    """:func:`forward_preparation` for a forward routed to Gluon (``use_gluon``) or not."""
    shapes = _forward_shapes(use_gluon, q.shape[-1], config)
    if backward_follows:
        # The backward's (its dout is shaped and typed like q), to be built in one go.
        shapes += [
            shape
            for shape in backward_list_shapes(
                q, k, v, q, startend_row_indices, deterministic, config
            )
            if shape not in shapes
        ]
    # The launch orders, with a mask only: without one the grid's own order stays (full
    # attention's lists are all alike, and causal's already launch longest first per head;
    # sorted, it measured 2.8% slower at 32K, results/program_order_precise_s15.log).
    orders = []
    if startend_row_indices is not None:
        orders.append((shapes[0], (q.shape[2], True)))
        if backward_follows and _use_gluon_backward(q, k, v, q, deterministic, True, True, config):
            # The Gluon backward's order too, in the same launch (the backward then finds it).
            gluon_shape = _backward_shapes(True, deterministic, q.shape[-1], config)[0]
            orders.append((gluon_shape, (k.shape[2], False)))
    return shapes, orders


def forward_preparation(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    softmax_scale: float,
    deterministic: bool,
    config: TileConfig,
    backward_follows: bool = True,
) -> tuple[list[tuple[int, int, bool]], list[tuple[tuple[int, int, bool], tuple[int, bool]]]]:
    """What :func:`forward` prepares for these inputs with ``config``: the list shapes of its
    one :func:`prepare_cached` call (its kernel's, then, when a backward follows, the
    backward's that it lacks) and the launch orders it then asks :func:`program_orders` for, in
    one launch (``(shape, (grid_heads, reverse_tiles))``: with a mask, the forward's and,
    before the Gluon backward, that one's, which the backward then finds cached);
    :func:`prepare_forward` prepares them. For a benchmark that times the preparation alone,
    as ``flashmask bench`` does."""
    masked = startend_row_indices is not None
    use_gluon = _use_gluon_forward(q, k, v, softmax_scale, masked, config)
    return _forward_preparation(
        q, k, v, startend_row_indices, use_gluon, deterministic, backward_follows, config
    )


def prepare_forward(
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
    shapes: list[tuple[int, int, bool]],
    order_requests: list[tuple[tuple[int, int, bool], tuple[int, bool]]],
    skip_tiles: bool = True,
) -> tuple[torch.Tensor | None, list[tiles.TileLists], list[torch.Tensor | None]]:
    """Prepare what :func:`forward_preparation` names, as :func:`forward` does: ``(bounds,
    lists, orders)``, the lists of ``shapes`` (one :func:`prepare_cached` call) and the launch
    orders of ``order_requests`` (one :func:`program_orders` call; ``[]`` without requests)."""
    bounds, lists = prepare_cached(
        startend_row_indices, causal, seqlen_q, seqlen_k, batch, device, shapes, skip_tiles
    )
    orders = []
    if order_requests:
        orders = program_orders(
            [(lists[shapes.index(shape)], *request) for shape, request in order_requests]
        )
    return bounds, lists, orders


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    *,
    skip_tiles: bool = True,
    config: TileConfig | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel: ``(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq])``.

    ``skip_tiles=False`` treats every tile as partial (dense mode; for the bit-exactness check).
    Without ``config`` the tiles are :func:`tile_config`'s for the device, made smaller if a
    kernel needs more shared memory than the GPU has. When ``q``, ``k`` or ``v`` requires grad,
    the lists of the backward that ``deterministic`` will choose are prepared with the
    forward's, in the same launches (a new mask's summaries and lists in two launches rather
    than four), so that its backward finds them prepared.
    """
    if config is None:
        return _with_fitting_config(
            lambda cfg: forward(
                q, k, v, startend_row_indices, causal, softmax_scale,
                skip_tiles=skip_tiles, config=cfg, deterministic=deterministic,
            ),
            q.device, q.shape[-1], startend_row_indices is not None,
        )  # fmt: skip
    from flashmask.kernels.attention_fwd import LOG2E_VALUE, flashmask_fwd_kernel

    backward_follows = skip_tiles and (q.requires_grad or k.requires_grad or v.requires_grad)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = 1 if startend_row_indices is None else startend_row_indices.shape[1]
    use_gluon = _use_gluon_forward(q, k, v, softmax_scale, startend_row_indices is not None, config)
    shapes, order_requests = _forward_preparation(
        q, k, v, startend_row_indices, use_gluon, deterministic, backward_follows, config
    )
    bounds, all_lists, orders = prepare_forward(
        startend_row_indices, causal, sq, sk, b, q.device, shapes, order_requests, skip_tiles
    )
    lists = all_lists[0]
    order = orders[0] if orders else None
    if use_gluon:
        from flashmask.kernels import gluon_fwd

        q, k, v = (tma_ready(x) for x in (q, k, v))
        key_tile, slots = gluon_forward_tiles(d)
        return gluon_fwd.forward(
            q, k, v, bounds, lists, hm, causal, softmax_scale, skip_tiles, key_tile, slots,
            order=order,
        )  # fmt: skip
    if bounds is None:
        bounds = lists.counts  # never read without a mask
    tm, tn = lists.entries.shape[-2:]
    block_d = _block_d(d)
    even = config.even_fast_path
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    even_m = even and sq % config.fwd_m == 0
    even_n = even and sk % config.fwd_n == 0
    even_d = even and d == block_d
    use_tma = config.fwd_tma and _tma_usable((q, k, v))
    flat = (
        use_tma
        and config.fwd_tma_flat
        and even_m
        and even_n
        and even_d
        and all(x.is_contiguous() for x in (q, k, v))
    )
    use_tma = use_tma and (flat or _tma_tiles_safe(config.fwd_m, config.fwd_n, block_d))
    descs = (None, None, None)
    if use_tma:
        describe = _flat_descriptor if flat else _row_descriptor
        descs = (
            describe(q, config.fwd_m, block_d),
            describe(k, config.fwd_n, block_d),
            describe(v, config.fwd_n, block_d),
        )
    launch_kernel(
        flashmask_fwd_kernel, (tm, hq, b),
        q, k, v, out, lse, bounds, lists.entries, lists.counts,
        lists.counts if order is None else order, *descs,
        *_s3(q), *_s3(k), *_s3(v), *_s3(out),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, softmax_scale * LOG2E_VALUE,
        CAUSAL=causal,
        HAS_MASK=startend_row_indices is not None,
        HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles,
        POSITIVE_SCALE=softmax_scale > 0,
        EVEN_M=even_m,
        EVEN_N=even_n,
        EVEN_D=even_d,
        USE_TMA=use_tma,
        TMA_FLAT=use_tma and flat,
        ORDERED=order is not None,
        BLOCK_M=config.fwd_m,
        BLOCK_N=config.fwd_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.fwd_stages,
        num_warps=config.fwd_warps,
    )  # fmt: skip
    return out, lse


def backward_delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    dq_accumulator: torch.Tensor | None = None,
    dq_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta = rowsum(dO * O) - dlse``, float32 ``[B, H, Sq]`` (``out``/``dout``
    ``[B, Sq, H, D]``, ``dlse`` ``[B, H, Sq]`` or ``None``): the backward's per-row term.

    ``dq_accumulator`` (float32, contiguous, shaped like ``out``), where given, is zeroed in the
    same launch: the Gluon backward adds dQ into it. ``dq_flags`` (int32, contiguous, ``[B, H,
    cdiv(Sq, 64)]``), where given, is zeroed instead: the Gluon backward's per-tile flags
    (``gluon_bwd.DQ_FIRST_STORE``)."""
    from flashmask.kernels.attention_bwd import flashmask_bwd_delta_kernel

    out = _last_dim_contiguous(out)
    b, sq, hq, d = out.shape
    if dq_accumulator is not None and (
        dq_accumulator.shape != out.shape
        or dq_accumulator.dtype != torch.float32
        or not dq_accumulator.is_contiguous()
    ):
        raise ValueError(
            "dq_accumulator must be a contiguous float32 tensor shaped like out "
            f"{tuple(out.shape)}, got {dq_accumulator.dtype} {tuple(dq_accumulator.shape)}"
        )
    row_tiles = triton_cdiv(sq, 64)
    if dq_flags is not None and (
        dq_flags.shape != (b, hq, row_tiles)
        or dq_flags.dtype != torch.int32
        or not dq_flags.is_contiguous()
    ):
        raise ValueError(
            f"dq_flags must be a contiguous int32 tensor of shape {(b, hq, row_tiles)}, got "
            f"{dq_flags.dtype} {tuple(dq_flags.shape)}"
        )
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=out.device)
    dlse_arg = delta if dlse is None else dlse.float().contiguous()
    zero = delta if dq_accumulator is None else dq_accumulator  # unread without ZERO_DQ
    zero_strides = (0, 0, 0) if dq_accumulator is None else _s3(dq_accumulator)
    flags = delta if dq_flags is None else dq_flags  # unread without ZERO_FLAGS
    launch_kernel(
        flashmask_bwd_delta_kernel, (row_tiles, hq, b),
        out, dout, dlse_arg, delta, zero, flags, *_s3(out), *_s3(dout), *zero_strides, sq, hq, d,
        HAS_DLSE=dlse is not None, ZERO_DQ=dq_accumulator is not None,
        ZERO_FLAGS=dq_flags is not None, BLOCK_M=64, BLOCK_D=_block_d(d),
    )  # fmt: skip
    return delta


def backward(
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
    *,
    skip_tiles: bool = True,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels: ``(dq, dk, dv)`` like ``(q, k, v)``.

    With ``deterministic=False`` on Hopper, where ``config.bwd_gluon`` and
    :func:`gluon_backward_eligible` allow, one warp-specialised Gluon pass computes dK, dV and dQ
    (dQ through fp32 atomics: not bit-reproducible). Otherwise the Triton kernels: dQ from a
    separate query-stationary pass (bit-reproducible); only when ``deterministic=False`` and
    ``config.atomic_dq`` does the key-stationary pass add dQ with fp32 atomics instead: per
    element, or one TMA reduce-add per tile with ``config.atomic_dq_tma`` on Hopper; both
    measured slower on the H200 than the separate pass and kept for measurement. The tiles are
    chosen as in :func:`forward`.
    """
    if config is None:
        return _with_fitting_config(
            lambda cfg: backward(
                dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
                deterministic, skip_tiles=skip_tiles, config=cfg,
            ),
            q.device, q.shape[-1], startend_row_indices is not None,
        )  # fmt: skip
    from flashmask.kernels.attention_bwd import (
        flashmask_bwd_dkdv_kernel,
        flashmask_bwd_dq_kernel,
        flashmask_bwd_fused_kernel,
    )
    from flashmask.kernels.attention_fwd import LOG2E_VALUE

    q, k, v, dout = (_last_dim_contiguous(x) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = 1 if startend_row_indices is None else startend_row_indices.shape[1]
    masked = startend_row_indices is not None
    use_gluon = _use_gluon_backward(q, k, v, dout, deterministic, skip_tiles, masked, config)
    shapes = _backward_shapes(use_gluon, deterministic, d, config)
    if use_gluon:
        bounds, (lists,) = prepare_cached(startend_row_indices, causal, sq, sk, b, q.device, shapes)
        q, k, v, dout = (tma_ready(x) for x in (q, k, v, dout))
        module = gluon_backward_module(d)
        dq_accumulator = dq_flags = None
        extra = {}
        if module.one_launch(q, k, masked, causal):
            # Zeroed by the delta kernel (one launch fewer than ``torch.zeros``); a backward in
            # query chunks zeros one per chunk. With the first-store writes only the per-tile
            # flags are zeroed.
            dq_accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            if module.first_store_dq():
                tiles_q = triton_cdiv(sq, 64)
                dq_flags = torch.empty(b, hq, tiles_q, dtype=torch.int32, device=q.device)
                extra["dq_flags"] = dq_flags
        delta = backward_delta(
            out, dout, dlse, None if dq_flags is not None else dq_accumulator, dq_flags
        )
        order = None if bounds is None else program_order(lists, hk, False)
        return module.backward(
            dout, q, k, v, lse.float().contiguous(), delta, bounds, lists, hm, causal,
            softmax_scale, order=order, dq_accumulator=dq_accumulator, **extra,
        )  # fmt: skip
    use_atomics = config.atomic_dq and not deterministic
    bounds, lists = prepare_cached(
        startend_row_indices, causal, sq, sk, b, q.device, shapes, skip_tiles
    )
    if bounds is None:
        bounds = lists[0].counts  # never read without a mask
    lse = lse.float().contiguous()
    delta = backward_delta(out, dout, dlse)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    flags = dict(
        CAUSAL=causal,
        HAS_MASK=startend_row_indices is not None,
        HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles,
    )
    block_d = _block_d(d)
    qk_scale = softmax_scale * LOG2E_VALUE
    even = config.even_fast_path
    even_d = even and d == block_d

    kv_lists = lists[0]
    kv_tn, kv_tm = kv_lists.entries.shape[-2:]
    kv_even_m = even and sq % config.bwd_m == 0
    kv_even_n = even and sk % config.bwd_n == 0
    dq_even_m = even and sq % config.dq_m == 0
    dq_even_n = even and sk % config.dq_n == 0
    dq_descs = (None, None)
    dq_tma = (
        not use_atomics
        and config.dq_tma
        and _tma_tiles_safe(config.dq_m, config.dq_n, block_d)
        and _tma_usable((k, v))
    )
    if dq_tma:
        dq_descs = (
            _row_descriptor(k, config.dq_n, block_d),
            _row_descriptor(v, config.dq_n, block_d),
        )
    dq_accum = None
    if use_atomics:
        dq_accum = torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
    if not use_atomics and config.fused_backward and config.bwd_warps == config.dq_warps:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_lists = lists[1]
        q_tm, q_tn = q_lists.entries.shape[-2:]
        launch_kernel(
            flashmask_bwd_fused_kernel, (kv_tn + q_tm * (hq // hk), hk, b),
            q, k, v, dout, lse, delta, dq, dk, dv, *dq_descs, bounds,
            kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
            q_lists.entries, q_lists.counts, q_lists.num_partial,
            *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq), *_s3(dk), *_s3(dv),
            sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, q_tm, q_tn, d, qk_scale,
            softmax_scale,
            **flags,
            KV_EVEN_M=kv_even_m,
            KV_EVEN_N=kv_even_n,
            Q_EVEN_M=dq_even_m,
            Q_EVEN_N=dq_even_n,
            Q_TMA=dq_tma,
            EVEN_D=even_d,
            KV_BLOCK_M=config.bwd_m,
            KV_BLOCK_N=config.bwd_n,
            KV_STAGES=config.bwd_stages,
            Q_BLOCK_M=config.dq_m,
            Q_BLOCK_N=config.dq_n,
            Q_STAGES=config.dq_stages,
            BLOCK_D=block_d,
            num_warps=config.bwd_warps,
        )  # fmt: skip
        return dq, dk, dv

    dq_target = dq_accum if dq_accum is not None else dk  # unused pointer when deterministic
    dq_desc = None
    if (
        dq_accum is not None
        and config.atomic_dq_tma
        and not _interpreting()
        and _tma_usable((dq_accum,))
    ):
        dq_desc = _row_descriptor(dq_accum, config.bwd_m, block_d)
    launch_kernel(
        flashmask_bwd_dkdv_kernel, (kv_tn, hk, b),
        q, k, v, dout, lse, delta, dk, dv, dq_target, dq_desc, bounds,
        kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv), *_s3(dq_target),
        sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, d, qk_scale, softmax_scale,
        **flags,
        ACCUMULATE_DQ=use_atomics,
        DQ_TMA=dq_desc is not None,
        EVEN_M=kv_even_m,
        EVEN_N=kv_even_n,
        EVEN_D=even_d,
        BLOCK_M=config.bwd_m,
        BLOCK_N=config.bwd_n,
        BLOCK_D=block_d,
        # The atomic-dQ matmul needs shared memory that a second pipeline stage leaves no room
        # for at D > 128 (measured: 263 KB needed, 227 KB on the H200).
        NUM_STAGES=1 if use_atomics and d > 128 else config.bwd_stages,
        num_warps=config.bwd_warps,
    )  # fmt: skip
    if dq_accum is not None:
        return dq_accum.to(q.dtype), dk, dv

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q_lists = lists[1]
    tm, tn = q_lists.entries.shape[-2:]
    launch_kernel(
        flashmask_bwd_dq_kernel, (tm, hq, b),
        q, k, v, dout, lse, delta, dq, *dq_descs, bounds,
        q_lists.entries, q_lists.counts, q_lists.num_partial,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, qk_scale, softmax_scale,
        **flags,
        EVEN_M=dq_even_m,
        EVEN_N=dq_even_n,
        EVEN_D=even_d,
        USE_TMA=dq_tma,
        BLOCK_M=config.dq_m,
        BLOCK_N=config.dq_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.dq_stages,
        num_warps=config.dq_warps,
    )  # fmt: skip
    return dq, dk, dv
