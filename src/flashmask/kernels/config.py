"""Tile shapes, warps and pipeline stages of the Triton kernels, per head dim and GPU, and the
shrinking that keeps a default configuration within a GPU's shared memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from flashmask.kernels import hardware

# The Gluon forward (``gluon_kernels.forward``): its query tile (which also divides every length
# it takes) and the head dims it compiles for.
GLUON_FWD_TILE = 128
GLUON_FWD_HEAD_DIMS = (64, 128, 256)


# The Gluon forward's K/V slots up to D = 128 (224 KB of shared memory with its Q tile).
GLUON_FWD_SLOTS = 3


# The Gluon backward (``gluon_kernels.backward``; ``backward_hd256`` at D = 256): its query
# tiles, its key tiles (per program) at D = 64 and 128, and the head dims it compiles for.
GLUON_BWD_QUERIES = 64
GLUON_BWD_KEYS = 128
GLUON_BWD_HEAD_DIMS = (64, 128, 256)
# At D = 256 a program owns 64 keys (two 128-key dK/dV accumulators would not fit the registers).
GLUON_BWD256_KEYS = 64
# Q/K head dims whose V has a head dim of its own in the Gluon backward (``backward_hd256``'s
# layout, 64 keys a program): multi-head latent attention's 192 with V's 128.
GLUON_BWD_VALUE_HEAD_DIMS = {192: 128}


def gluon_backward_hd256_layout(head_dim: int) -> bool:
    """Whether the Gluon backward at Q/K head dim ``head_dim`` is ``backward_hd256``'s layout:
    at 256, and at the head dims whose V has its own (:data:`GLUON_BWD_VALUE_HEAD_DIMS`)."""
    return head_dim == 256 or head_dim in GLUON_BWD_VALUE_HEAD_DIMS


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
    # The Triton forward loads its Q/K/V tiles through TMA tensor descriptors on GPUs that have
    # TMA (compute capability >= 9.0) when the tensors' strides allow it (16-byte aligned) and
    # no tile is square (``tensors.tma_tiles_safe``). Same values as the pointer loads.
    fwd_tma: bool = False
    # Route the forward to the warp-specialised Gluon kernel where it applies
    # (``routing.use_gluon_forward``): on by default at D = 128, and at D = 64 without a mask.
    fwd_gluon: bool = False
    # Route the non-deterministic backward to the Gluon kernel where it applies
    # (``routing.use_gluon_backward``): on by default at D = 64, 128 and 256.
    bwd_gluon: bool = False


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the split-KV kernels (``triton_kernels.decode``) for few queries over many keys.

    ``block_n``: keys per tile (the mask's lists are built at this width); ``warps``, ``stages``:
    the split kernel's warps and pipeline stages (fewer where the GPU's shared memory cannot hold
    them, see :func:`~.decode_launcher.forward`); ``max_rows``: the most packed rows (queries x
    query heads per key/value head) one program holds, which also bounds which calls route here
    (:func:`~.routing.use_decode`); ``programs_per_sm``: the programs that run at once on a
    streaming multiprocessor; splits fill one wave of them; ``max_splits``: at most this many
    splits per row tile.
    """

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    max_rows: int = 128
    programs_per_sm: int = 2
    max_splits: int = 128


def decode_config(head_dim: int, *, shared_memory: int | None = None) -> DecodeConfig:
    """The split-KV tiles for a head dimension (16-key tiles under the interpreter, so that the
    CPU tests' short caches still split into several tiles).

    Up to head dim 128 on a GPU with Hopper's shared memory (``shared_memory``: bytes per block):
    128-key tiles, 8 warps, 3 stages, one program per multiprocessor. On the H200 and H100 they
    decoded within 2% of SDPA's time on causal caches of 8K-128K at batch 1, 8 and 32, where the
    64-key tiles two to a multiprocessor were up to 2% (H200) and 3% (H100) slower
    (``docs/performance.md``). Elsewhere the 64-key tiles, whose two programs fit 100 KB each.
    """
    if hardware.interpreting():
        return DecodeConfig(block_n=16, warps=4, stages=1)
    if head_dim > 128:
        return DecodeConfig(block_n=32, stages=2)
    if shared_memory is not None and shared_memory >= _HOPPER_SHARED_MEMORY:
        return DecodeConfig(block_n=128, warps=8, stages=3, programs_per_sm=1)
    return DecodeConfig()


def device_decode_config(head_dim: int, device: torch.device) -> DecodeConfig:
    """:func:`decode_config` for ``device``'s shared memory: the split-KV tiles a call on it
    runs by default."""
    return decode_config(head_dim, shared_memory=hardware.device_shared_memory(device))


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
    Measured on the H200, bf16, 8K tokens per sequence (``docs/performance.md``).
    ``shared_memory`` (bytes per block the GPU allows) below Hopper's selects
    :func:`compact_tile_config` instead.
    """
    if hardware.interpreting():
        return TileConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
    if shared_memory is not None and shared_memory < _HOPPER_SHARED_MEMORY:
        return compact_tile_config(head_dim)
    if head_dim <= 64:
        # At D = 64 the Gluon backward (with a mask from 8K keys) and, without a mask, the
        # Gluon forward: on the H200 the backward measured 1.03-1.18x the Triton one on full,
        # causal and four masks at 32K, and the forward 1.15x / 1.07x on full / causal, but
        # 0.83-1.0x on masks at 32K, where it stays off (docs/performance.md).
        gluon = head_dim == 64
        cfg = TileConfig(64, 64, 4, 3, 32, 128, 4, 3, 64, 64, 4, 2, bwd_gluon=gluon)
        return cfg if has_mask else replace(cfg, fwd_m=128, fwd_warps=8, fwd_gluon=gluon)
    if head_dim <= 128:
        # At D = 128 the forward's 64x64 tiles load through TMA, with or without a mask (the
        # measured and GPU-checked case: 7-21% faster on masks at 8K, and 4-11% faster than the
        # pointer-loaded 128x128 tiles on full/causal at 8K/32K). Padded head dims (80, 96, 112)
        # keep pointer loads until checked on a GPU, and without a mask the 128x128 tiles.
        # At D = 128 the Gluon forward and backward where they apply (``use_gluon_forward``,
        # ``use_gluon_backward``), else these Triton tiles.
        gluon = head_dim == 128
        cfg = TileConfig(
            64, 64, 4, 3, 64, 64, 4, 2, 64, 64, 4, 2,
            fwd_tma=head_dim == 128, fwd_gluon=gluon, bwd_gluon=gluon,
        )  # fmt: skip
        if has_mask or cfg.fwd_tma:
            return cfg
        return replace(cfg, fwd_m=128, fwd_n=128, fwd_warps=8)
    # At D = 256 the Gluon backward (``gluon_kernels.backward_hd256``): 1.43-1.69x the Triton
    # backward on the H200 on full, causal and four masks at 8K and 32K (docs/performance.md);
    # also at MLA's 192 (with V's 128: ``routing.gluon_backward_eligible``).
    return TileConfig(
        128, 64, 8, 2, 64, 64, 8, 2, 64, 64, 4, 2, bwd_gluon=gluon_backward_hd256_layout(head_dim)
    )


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


def with_fitting_config(
    launch: Callable[[TileConfig], _Result], device: torch.device, head_dim: int, has_mask: bool
) -> _Result:
    """Run ``launch(cfg)`` with the device's default tile configuration, shrinking it
    (:func:`shrink_tile_config`) while a kernel needs more shared memory than the GPU has.
    Only default configurations come here: an explicit ``config`` is never changed."""
    from triton.runtime.errors import OutOfResources

    key = (hardware.cuda_index(device) if device.type == "cuda" else -1, head_dim, has_mask)
    cfg = _FITTED.get(key) or tile_config(
        head_dim, has_mask=has_mask, shared_memory=hardware.device_shared_memory(device)
    )
    while True:
        try:
            return launch(cfg)
        except OutOfResources:
            smaller = shrink_tile_config(cfg)
            if smaller is None:
                raise
            cfg = _FITTED[key] = smaller
