"""The sink fold: learnable attention sinks (gpt-oss's) joined to a finished forward's rows.

A sink is one logit per query head that enters every row's softmax denominator and carries no
value. Given the forward's ``out`` and ``lse`` without it, the row's results with it are
``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``, whatever kernel produced
them; this kernel applies that in place, one read and one write of ``out``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def flashmask_sink_fold_kernel(
    Out, Lse, Sinks,
    stride_ob, stride_os, stride_oh,
    seqlen_q, num_heads_q, head_dim_v,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Rows ``BLOCK_M * program_id(0) ...`` of head ``program_id(1)``, batch ``program_id(2)``:
    ``Out [B, Sq, Hq, Dv]`` scaled by ``exp(lse - lse')``, ``Lse`` (float32 ``[B, Hq, Sq]``,
    natural log) replaced by ``lse' = logaddexp(lse, sinks[h])``.

    A row that sees no key (``lse = -inf``) keeps ``out = 0`` and gets ``lse' = sink``; with a
    ``-inf`` sink too, ``lse'`` stays ``-inf`` and the row is left as it is."""
    m_tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows = (b * num_heads_q + h) * seqlen_q + offs_m
    lse = tl.load(Lse + rows, mask=row_ok, other=float("-inf"))
    sink = tl.load(Sinks + h).to(tl.float32)
    top = tl.maximum(lse, sink)
    finite = top > float("-inf")
    safe_top = tl.where(finite, top, 0.0)
    total = safe_top + tl.log(tl.exp(lse - safe_top) + tl.exp(sink - safe_top))
    total = tl.where(finite, total, float("-inf"))
    keep = tl.where(finite, tl.exp(lse - total), 1.0)
    tl.store(Lse + rows, total, mask=row_ok)
    ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    mask = row_ok[:, None] & (offs_d[None, :] < head_dim_v)
    out = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (out.to(tl.float32) * keep[:, None]).to(out.dtype), mask=mask)


@triton.jit
def flashmask_sink_gradient_kernel(
    Lse, Delta, Sinks, DSinks,
    batch, seqlen_q, num_heads_q,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``DSinks[h] = -sum over batch and rows of exp(sinks[h] - lse') * delta`` for head
    ``program_id(0)``, from the folded ``Lse`` and the backward's row term ``Delta`` (both float32
    ``[B, Hq, Sq]``, contiguous): the sink's probability in a row times its score's gradient
    (``dP = 0``: the sink carries no value). A row with ``lse' = -inf`` adds nothing. One program
    per head sums its rows in a fixed order, so the result is deterministic."""
    h = tl.program_id(0)
    sink = tl.load(Sinks + h).to(tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(batch):
        base = (h + b * num_heads_q).to(tl.int64) * seqlen_q
        for start in range(0, seqlen_q, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < seqlen_q
            lse = tl.load(Lse + base + offs, mask=ok, other=float("-inf"))
            delta = tl.load(Delta + base + offs, mask=ok, other=0.0)
            seen = lse > float("-inf")
            p = tl.where(seen, tl.exp(sink - tl.where(seen, lse, 0.0)), 0.0)
            total += p * delta
    tl.store(DSinks + h, (-tl.sum(total, axis=0)).to(DSinks.dtype.element_ty))
