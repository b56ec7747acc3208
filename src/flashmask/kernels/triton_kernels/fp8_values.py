"""The FP8 forward's V^T pre-pass: V transposed to ``[B, Hk, D, Sk padded]`` with its keys
permuted within each group of 16 (``cute_kernels.fp8_layout.KEY_ORDER``), in one tiled pass.

As a strided torch copy the same transposition ran at about a tenth of the memory bandwidth (0.44
ms for a 64 MB V on an H100, a quarter of an 8K causal FP8 call): each output row gathers one byte
from every key row. Here a program reads a block of keys whole (contiguous along D) and writes
the block transposed (contiguous along the keys), Triton's layout conversion between the two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def flashmask_fp8_values_transposed_kernel(
    V, Out,
    seqlen_k, padded_k, num_heads_k, head_dim,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """k indices ``BLOCK_P * program_id(0) ...`` and columns ``BLOCK_D * program_id(2) ...`` of
    (batch, K/V head) ``program_id(1)``: ``Out [B, Hk, D, padded_k]`` (contiguous, one byte
    each) at ``[b, h, d, p]`` gets ``V [B, Sk, Hk, D]`` (bytes, any strides) at ``[b, key(p),
    h, d]``, 0 where ``key(p) >= seqlen_k``. ``key(p) = 16 (p // 16) + 8 a + 2 t + c`` for ``p %
    16 = 4 t + 2 a + c`` (``KEY_ORDER``: the key each k index of the FP8 P fragment holds)."""
    bh = tl.program_id(1)
    b = (bh // num_heads_k).to(tl.int64)
    h = (bh % num_heads_k).to(tl.int64)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = p % 16
    key = p - r + 8 * ((r // 2) % 2) + 2 * (r // 4) + r % 2
    source = V + b * stride_vb + h * stride_vh
    source = source + key.to(tl.int64)[:, None] * stride_vs + d[None, :] * stride_vd
    inside = (key[:, None] < seqlen_k) & (d[None, :] < head_dim)
    tile = tl.load(source, mask=inside, other=0)
    target = Out + (bh.to(tl.int64) * head_dim + d[None, :]) * padded_k + p[:, None]
    tl.store(target, tile, mask=(p[:, None] < padded_k) & (d[None, :] < head_dim))
