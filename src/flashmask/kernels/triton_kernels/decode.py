"""Triton split-KV kernels for few queries over many keys (decoding, short chunked prefill).

The training forward runs one program per (query tile, query head): with one query row and a
128K cache that is 32 programs at batch 1, each walking every key, and each K/V tile is read once
per query head of its group. Here one program takes all the query heads of one key/value head
(GQA packing: ``GROUP`` heads x ``QUERIES`` queries as the rows of one tile, so each K/V tile is
read once) and one share of the key tiles its query tile must visit (split-KV: ``num_splits``
programs per row tile, so a short query tile still fills the GPU). The shares are cut from the
mask's tile list (partial and unmasked key tiles, skipped ones never listed), so a sliding window
with sink tokens spreads its few visible tiles over all splits whatever the cache length.

Each split writes its normalised partial output and its lse; :func:`decode_combine_kernel`
merges the splits of a row by their lse. With one split the partial kernel writes the final
output itself.

Packed row ``r`` of row tile ``t`` of key/value head ``hk`` is query ``t * QUERIES + r // GROUP``
of query head ``hk * GROUP + r % GROUP``; rows past ``QUERIES * GROUP`` (padding up to the
power-of-two tile) or past ``Sq`` are computed on zeros and never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashmask.kernels.triton_kernels.forward import LN2, element_mask, load_tile


@triton.jit
def decode_split_kernel(
    Q, K, V, Out, Lse, PartOut, PartLse, Bounds, ListEntries, ListCounts,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, num_heads_k, kv_per_mask_head, num_mask_heads, num_q_tiles, num_n_tiles,
    head_dim, qk_scale, num_splits,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_D: tl.constexpr,
    GROUP: tl.constexpr,
    QUERIES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_splits, num_q_tiles * Hk, B)``. ``Out [B, Sq, Hq, D]`` / ``Lse [B, Hq, Sq]``
    are written when ``SPLIT`` is off; otherwise ``PartOut`` float32 ``[B, Hq, Sq, num_splits,
    BLOCK_D]`` (normalised) and ``PartLse`` float32 ``[B, Hq, Sq, num_splits]`` (log2 units,
    ``-inf`` for a split that saw no visible key). With ``HAS_MASK`` the key tiles come from the
    row-major lists of ``(QUERIES, BLOCK_N)`` tiles; without, every key tile up to the causal
    limit is visited."""
    split = tl.program_id(0)
    q_tile = tl.program_id(1) % num_q_tiles
    h_kv = tl.program_id(1) // num_q_tiles
    b = tl.program_id(2)
    b64 = b.to(tl.int64)

    offs_r = tl.arange(0, BLOCK_M)
    queries = q_tile * QUERIES + offs_r // GROUP
    heads = h_kv * GROUP + offs_r % GROUP
    row_ok = (offs_r < QUERIES * GROUP) & (queries < seqlen_q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    offs_n0 = tl.arange(0, BLOCK_N)

    q_ptrs = (
        Q + b64 * stride_qb + queries[:, None] * stride_qs + heads[:, None] * stride_qh
        + offs_d[None, :]
    )  # fmt: skip
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b64 * stride_kb + h_kv * stride_kh
    v_base = V + b64 * stride_vb + h_kv * stride_vh

    # The key tiles this query tile visits: the mask's list, or without a mask every tile up to
    # the last key the tile's last query may see (bottom-right aligned causal).
    first_query = q_tile * QUERIES
    if HAS_MASK:
        mask_head = b64 * num_mask_heads + h_kv // kv_per_mask_head
        bounds_ptr = Bounds + mask_head * 4 * seqlen_k
        list_row = mask_head * num_q_tiles + q_tile
        count = tl.load(ListCounts + list_row)
        entries = ListEntries + list_row * num_n_tiles
        unmasked_from = seqlen_k  # unused: the list says which tiles need the mask
    else:
        bounds_ptr = Bounds
        entries = ListEntries
        if CAUSAL:
            last_query = tl.minimum(first_query + QUERIES, seqlen_q) - 1
            visible_end = tl.minimum(last_query + seqlen_k - seqlen_q + 1, seqlen_k)
            count = tl.maximum(tl.cdiv(visible_end, BLOCK_N), 0)
            # Tiles wholly at or below the first query's causal limit need no mask.
            unmasked_from = tl.minimum(first_query + seqlen_k - seqlen_q + 1, seqlen_k)
        else:
            count = num_n_tiles
            unmasked_from = seqlen_k
    per_split = tl.cdiv(count, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, count)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    rows = queries[:, None]
    for it in tl.range(start, end, num_stages=NUM_STAGES):
        if HAS_MASK:
            entry = tl.load(entries + it)
            n_tile = tl.where(entry >= 0, entry, -entry - 1)
            partial = entry >= 0
        else:
            n_tile = it
            partial = (it + 1) * BLOCK_N > unmasked_from
        offs_n = n_tile * BLOCK_N + offs_n0
        col_ok = offs_n < seqlen_k
        kT = load_tile(
            k_base + offs_n[None, :] * stride_ks + offs_d[:, None],
            d_ok[:, None], col_ok[None, :], EVEN_D, False,
        )  # fmt: skip
        qk = tl.dot(q, kT)
        if not POSITIVE_SCALE:
            qk = tl.fma(qk, qk_scale, 0.0)
        if partial:
            hidden = element_mask(
                bounds_ptr, rows, offs_n[None, :], seqlen_q, seqlen_k, CAUSAL, HAS_MASK, HAS_UPPER
            )
            qk = tl.where(hidden, float("-inf"), qk)
        if POSITIVE_SCALE:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        if POSITIVE_SCALE:
            p = tl.math.exp2(tl.fma(qk, qk_scale, -m_shift[:, None]))
        else:
            p = tl.math.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(
            v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
            col_ok[:, None], d_ok[None, :], False, EVEN_D,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    visible = l_i > 0
    acc = acc / tl.where(visible, l_i, 1.0)[:, None]
    lse2 = tl.where(visible, m_i + tl.math.log2(tl.where(visible, l_i, 1.0)), float("-inf"))
    # Row (query, head) -> its flat index in [B, Hq, Sq] (the layout of Lse and the partials).
    num_heads_q = num_heads_k * GROUP
    row_index = (b64 * num_heads_q + heads) * seqlen_q + queries
    if SPLIT:
        part = row_index * num_splits + split
        tl.store(PartOut + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PartLse + part, lse2, mask=row_ok)
    else:
        o_ptrs = (
            Out + b64 * stride_ob + queries[:, None] * stride_os + heads[:, None] * stride_oh
            + offs_d[None, :]
        )  # fmt: skip
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + row_index, lse2 * LN2, mask=row_ok)


@triton.jit
def decode_combine_kernel(
    Out, Lse, PartOut, PartLse,
    stride_ob, stride_os, stride_oh,
    seqlen_q, num_heads_q, head_dim, num_splits,
    SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid ``(Sq * Hq, B)``: merge the ``num_splits`` partial outputs of one (batch, head,
    query) row by their lse. Splits that saw nothing (lse ``-inf``) weigh 0; a row no split saw
    gets output 0 and lse ``-inf``."""
    row = tl.program_id(0)
    b = tl.program_id(1)
    h = row // seqlen_q
    query = row % seqlen_q
    row_index = (b.to(tl.int64) * num_heads_q + h) * seqlen_q + query
    offs_s = tl.arange(0, SPLITS_PAD)
    lse2 = tl.load(
        PartLse + row_index * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    top = tl.max(lse2, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.math.exp2(lse2 - top), 0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        s = s0 + offs_c
        s_ok = s < num_splits
        weight = tl.math.exp2(
            tl.load(PartLse + row_index * num_splits + s, mask=s_ok, other=float("-inf")) - top
        )
        part = tl.load(
            PartOut + (row_index * num_splits + s)[:, None] * BLOCK_D + offs_d[None, :],
            mask=s_ok[:, None],
            other=0.0,
        )
        acc += tl.sum(part * weight[:, None], 0)
    seen = total > 0
    acc = acc / tl.where(seen, total, 1.0)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + query * stride_os + h * stride_oh + offs_d
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    lse = tl.where(seen, (top + tl.math.log2(tl.where(seen, total, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + row_index, lse)
