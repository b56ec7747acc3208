"""Triton kernels for FlashMask attention and their launchers.

``forward``/``backward`` take validated inputs in the public layout (``[B, S, H, D]``) and the raw
``startend_row_indices``; mask preparation (normalised bounds, tile classes, tile lists) happens
here once per call and costs O(N) plus O(tiles).

On a CPU-only machine the same kernels run through Triton's interpreter (``TRITON_INTERPRET=1``),
which is how CI tests them; the public API only routes CUDA tensors here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashmask.kernels import tiles

__all__ = ["TileConfig", "backward", "forward", "supports", "tile_config"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes, warps and pipeline stages of the three kernels."""

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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_config(head_dim: int) -> TileConfig:
    """The tile configuration for a head dimension (small tiles under the interpreter)."""
    if _interpreting():
        return TileConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
    if head_dim <= 64:
        return TileConfig(128, 64, 4, 3, 64, 128, 8, 2, 128, 64, 8, 2)
    if head_dim <= 128:
        return TileConfig(128, 64, 8, 3, 64, 128, 8, 2, 128, 64, 8, 2)
    return TileConfig(64, 64, 4, 2, 64, 64, 8, 1, 64, 64, 8, 1)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: fp16/bf16, ``D == Dv``, ``D % 8 == 0``, ``D <= 256``.

    Other inputs (float32/float64, other head dims) run the exact reference instead.
    """
    d = q.shape[-1]
    return (
        q.dtype in _KERNEL_DTYPES
        and v.shape[-1] == d
        and d % 8 == 0
        and 16 <= d <= MAX_HEAD_DIM
        and (q.is_cuda or _interpreting())
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _s3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel: ``(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq])``.

    ``skip_tiles=False`` treats every tile as partial (dense mode; for the bit-exactness check).
    """
    from flashmask.kernels.attention_fwd import LOG2E_VALUE, flashmask_fwd_kernel

    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    cfg = config or tile_config(d)
    bounds = tiles.column_bounds(startend_row_indices, causal, sq, sk, b, q.device)
    hm = bounds.shape[1]
    classes = tiles.tile_classes(bounds, causal, sq, cfg.fwd_m, cfg.fwd_n, skip_tiles)
    lists = tiles.forward_lists(classes)
    tm, tn = classes.shape[-2:]
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    flashmask_fwd_kernel[(tm, b * hq)](
        q, k, v, out, lse, bounds, lists.entries, lists.counts,
        *_s3(q), *_s3(k), *_s3(v), *_s3(out),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, softmax_scale * LOG2E_VALUE,
        CAUSAL=causal,
        HAS_MASK=startend_row_indices is not None,
        HAS_UPPER=not causal,
        BLOCK_M=cfg.fwd_m,
        BLOCK_N=cfg.fwd_n,
        BLOCK_D=_block_d(d),
        NUM_STAGES=cfg.fwd_stages,
        num_warps=cfg.fwd_warps,
    )  # fmt: skip
    return out, lse


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

    ``deterministic=True`` computes dQ in a separate query-stationary pass (bit-reproducible);
    otherwise the key-stationary pass adds dQ with fp32 atomics.
    """
    from flashmask.kernels.attention_bwd import flashmask_bwd_dkdv_kernel, flashmask_bwd_dq_kernel
    from flashmask.kernels.attention_fwd import LOG2E_VALUE

    q, k, v, dout = (_last_dim_contiguous(x) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    cfg = config or tile_config(d)
    bounds = tiles.column_bounds(startend_row_indices, causal, sq, sk, b, q.device)
    hm = bounds.shape[1]
    lse = lse.float().contiguous()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    flags = dict(CAUSAL=causal, HAS_MASK=startend_row_indices is not None, HAS_UPPER=not causal)
    block_d = _block_d(d)
    qk_scale = softmax_scale * LOG2E_VALUE

    bwd_classes = tiles.tile_classes(bounds, causal, sq, cfg.bwd_m, cfg.bwd_n, skip_tiles)
    kv_lists = tiles.backward_lists(bwd_classes)
    tm, tn = bwd_classes.shape[-2:]
    dq_accum = None
    if not deterministic:
        dq_accum = torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
    dq_target = dq_accum if dq_accum is not None else dk  # unused pointer when deterministic
    flashmask_bwd_dkdv_kernel[(tn, b * hk)](
        q, k, v, dout, lse, delta, dk, dv, dq_target, bounds, kv_lists.entries, kv_lists.counts,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv), *_s3(dq_target),
        sq, sk, hq, hk, hq // hk, hq // hm, hm, tm, tn, d, qk_scale, softmax_scale,
        **flags,
        ACCUMULATE_DQ=not deterministic,
        BLOCK_M=cfg.bwd_m,
        BLOCK_N=cfg.bwd_n,
        BLOCK_D=block_d,
        NUM_STAGES=cfg.bwd_stages,
        num_warps=cfg.bwd_warps,
    )  # fmt: skip
    if dq_accum is not None:
        return dq_accum.to(q.dtype), dk, dv

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq_classes = tiles.tile_classes(bounds, causal, sq, cfg.dq_m, cfg.dq_n, skip_tiles)
    q_lists = tiles.forward_lists(dq_classes)
    tm, tn = dq_classes.shape[-2:]
    flashmask_bwd_dq_kernel[(tm, b * hq)](
        q, k, v, dout, lse, delta, dq, bounds, q_lists.entries, q_lists.counts,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, qk_scale, softmax_scale,
        **flags,
        BLOCK_M=cfg.dq_m,
        BLOCK_N=cfg.dq_n,
        BLOCK_D=block_d,
        NUM_STAGES=cfg.dq_stages,
        num_warps=cfg.dq_warps,
    )  # fmt: skip
    return dq, dk, dv
