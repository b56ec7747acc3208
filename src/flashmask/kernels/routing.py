"""Which kernel family runs a call: the Gluon kernels' eligibility and length thresholds, and
the tile lists each routed kernel needs (see ``docs/design.md``, "Kernel families and
routing")."""

from __future__ import annotations

import functools
import warnings

import torch

from flashmask.kernels import hardware
from flashmask.kernels.config import (
    GLUON_BWD256_KEYS,
    GLUON_BWD_HEAD_DIMS,
    GLUON_BWD_KEYS,
    GLUON_BWD_QUERIES,
    GLUON_FWD_HEAD_DIMS,
    GLUON_FWD_SLOTS,
    GLUON_FWD_TILE,
    TileConfig,
)


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
        and q.dtype in hardware.KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and d in GLUON_FWD_HEAD_DIMS
        and k.shape[-1] == d
        and v.shape[-1] == d
        and q.shape[1] % GLUON_FWD_TILE == 0
        and k.shape[1] % GLUON_FWD_TILE == 0
    )


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


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton ships the Gluon Hopper API the Gluon kernels are written against
    (Triton 3.6 and later; checked by importing the kernels' modules once). Without it the
    Triton kernels run, with one warning."""
    try:
        from flashmask.kernels.gluon_kernels import backward as gluon_bwd  # noqa: F401
        from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256  # noqa: F401
        from flashmask.kernels.gluon_kernels import forward as gluon_fwd  # noqa: F401
    except (ImportError, AttributeError) as exc:
        warnings.warn(
            f"flashmask: the Gluon kernels are unavailable with this Triton ({exc}); using the "
            "Triton kernels",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def use_gluon_forward(
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
    capability = hardware.gpu_capability(q)
    return (
        capability is not None and gluon_forward_eligible(q, k, v, capability) and gluon_available()
    )


def use_gluon_backward(
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
    capability = hardware.gpu_capability(q)
    return (
        capability is not None
        and gluon_backward_eligible(q, k, v, dout, capability)
        and gluon_available()
    )


def forward_shapes(
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
        from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256

        return gluon_bwd256
    from flashmask.kernels.gluon_kernels import backward as gluon_bwd

    return gluon_bwd


def backward_shapes(
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
    use_gluon = use_gluon_forward(q, k, v, softmax_scale, masked, config)
    return forward_shapes(use_gluon, q.shape[-1], config)


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
    use_gluon = use_gluon_backward(q, k, v, dout, deterministic, True, masked, config)
    return backward_shapes(use_gluon, deterministic, q.shape[-1], config)
