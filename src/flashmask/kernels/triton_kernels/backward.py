"""Triton backward kernels.

* ``flashmask_bwd_dkdv_kernel``: key-tile stationary. One program owns ``BLOCK_N`` key columns of
  one (batch, kv head), loops over the query heads that share it (GQA reduced in registers, no
  atomics) and over the listed query tiles (partial ones, then unmasked ones in a second loop
  free of mask code), and accumulates dK and dV.
* ``flashmask_bwd_dq_kernel``: query-tile stationary, walks the row-major lists in the same two
  loops and writes dQ with no atomics, so the Triton backward is bit-reproducible.
* ``flashmask_bwd_fused_kernel``: both passes in one grid (the default): the first programs of
  each (kv head, batch) run the dK/dV program, the rest the dQ program, so neither pass's last
  wave leaves the GPU idle. Bitwise equal to the two launches.

Loads and stores drop their bounds masks along dimensions the tiles divide evenly (``EVEN_*``).

Unlike the forward, the backward splits its loop by tile class: measured on the H200 it is
10-20% faster on non-causal and document masks at 32K and equal elsewhere (the forward's split
was slower; ``docs/performance.md``, the lever table).

Both recompute ``P = exp2(S - lse)`` (one explicit fma, as in the forward) with the forward's
lse (natural log, converted to log2; a fully masked row's ``-inf`` becomes ``+inf`` so its P is
0) and use ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) - dlse``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashmask.kernels.triton_kernels.forward import (
    LOG2E,
    capped_tanh,
    element_mask,
    load_tile,
    store_tile,
)


@triton.jit
def _load_lse_log2(Lse, offs, row_ok):
    lse = tl.load(Lse + offs, mask=row_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dkdv_tile(
    k, v, dk, dv, m_tile, cols, q_base, do_base, Lse, Delta, row_base, bounds_ptr,
    offs_m0, offs_d, d_ok, offs_dv, dv_ok, stride_qs, stride_dos, seqlen_q, seqlen_k, qk_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_DV: tl.constexpr,
):  # fmt: skip
    """Add query tile ``m_tile``'s contribution to this key tile's ``(dk, dv)``."""
    offs_m = m_tile * offs_m0.shape[0] + offs_m0
    row_ok = offs_m < seqlen_q
    q = load_tile(
        q_base + offs_m[:, None] * stride_qs + offs_d[None, :],
        row_ok[:, None], d_ok[None, :], EVEN_M, EVEN_D,
    )  # fmt: skip
    lse = _load_lse_log2(Lse, row_base + offs_m, row_ok)
    # Transposed scores: [BLOCK_N keys, BLOCK_M queries].
    # fma as in the forward, so skipping and dense modes run the same arithmetic.
    if SOFTCAP > 0:
        tT = capped_tanh(tl.dot(k, tl.trans(q)), qk_scale, SOFTCAP)
        pT = tl.math.exp2(tT * (SOFTCAP * LOG2E) - lse[None, :])
    else:
        pT = tl.math.exp2(tl.fma(tl.dot(k, tl.trans(q)), qk_scale, -lse[None, :]))
    if APPLY_MASK:
        hidden = element_mask(
            bounds_ptr, offs_m[None, :], cols, seqlen_q, seqlen_k, CAUSAL, HAS_MASK, HAS_UPPER
        )
        pT = tl.where(hidden, 0.0, pT)
    do = load_tile(
        do_base + offs_m[:, None] * stride_dos + offs_dv[None, :],
        row_ok[:, None], dv_ok[None, :], EVEN_M, EVEN_DV,
    )  # fmt: skip
    dv += tl.dot(pT.to(do.dtype), do)
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    if SOFTCAP > 0:
        dsT = dsT * (1.0 - tT * tT)  # the cap's derivative
    dk += tl.dot(dsT.to(q.dtype), q)
    return dk, dv


@triton.jit
def _dkdv_program(
    n_tile, h_kv, b,
    Q, K, V, DO, Lse, Delta, DK, DV, Bounds, ListEntries, ListCounts, ListPartial,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    MASK_FULL_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """dK and dV of key tile ``n_tile`` of (batch ``b``, kv head ``h_kv``)."""
    b64 = b.to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m0 = tl.arange(0, BLOCK_M)
    col_ok = offs_n[:, None] < seqlen_k
    d_ok = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    k = load_tile(
        K + b64 * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
        col_ok, d_ok[None, :], EVEN_N, EVEN_D,
    )  # fmt: skip
    v = load_tile(
        V + b64 * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
        col_ok, dv_ok[None, :], EVEN_N, EVEN_DV,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    cols = offs_n[:, None]

    for g in range(0, heads_per_kv):
        h = h_kv * heads_per_kv + g
        h_mask = h // heads_per_mask_head
        mask_head = b64 * num_mask_heads + h_mask
        bounds_ptr = Bounds + mask_head * 4 * seqlen_k
        list_row = mask_head * num_n_tiles + n_tile
        count = tl.load(ListCounts + list_row)
        num_partial = tl.load(ListPartial + list_row)
        entries = ListEntries + list_row * num_m_tiles
        q_base = Q + b64 * stride_qb + h * stride_qh
        do_base = DO + b64 * stride_dob + h * stride_doh
        row_base = (b64 * num_heads_q + h) * seqlen_q
        # Partial query tiles (element mask), then unmasked ones (no mask code in the loop).
        for it in tl.range(0, num_partial, num_stages=NUM_STAGES):
            m_tile = tl.load(entries + it)
            dk, dv = _dkdv_tile(
                k, v, dk, dv, m_tile, cols, q_base, do_base, Lse, Delta, row_base, bounds_ptr,
                offs_m0, offs_d, d_ok, offs_dv, dv_ok, stride_qs, stride_dos, seqlen_q, seqlen_k,
                qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, True, EVEN_M, EVEN_D, SOFTCAP, EVEN_DV,
            )  # fmt: skip
        for it in tl.range(num_partial, count, num_stages=NUM_STAGES):
            m_tile = -tl.load(entries + it) - 1
            dk, dv = _dkdv_tile(
                k, v, dk, dv, m_tile, cols, q_base, do_base, Lse, Delta, row_base, bounds_ptr,
                offs_m0, offs_d, d_ok, offs_dv, dv_ok, stride_qs, stride_dos, seqlen_q, seqlen_k,
                qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, EVEN_M, EVEN_D, SOFTCAP,
                EVEN_DV,
            )  # fmt: skip

    dk = dk * softmax_scale
    store_tile(
        DK + b64 * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        dk.to(DK.dtype.element_ty), col_ok, d_ok[None, :], EVEN_N, EVEN_D,
    )  # fmt: skip
    store_tile(
        DV + b64 * stride_dvb + h_kv * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :],
        dv.to(DV.dtype.element_ty), col_ok, dv_ok[None, :], EVEN_N, EVEN_DV,
    )  # fmt: skip


@triton.jit
def _dq_tile(
    q, do, dq, lse, delta, n_tile, rows, k_base, v_base, bounds_ptr,
    offs_n0, offs_d, d_ok, offs_dv, dv_ok, stride_ks, stride_vs, seqlen_q, seqlen_k, qk_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_DV: tl.constexpr,
):  # fmt: skip
    """Add key tile ``n_tile``'s contribution to this query tile's (unscaled) ``dq``."""
    block_n: tl.constexpr = offs_n0.shape[0]
    offs_n = n_tile * block_n + offs_n0
    col_ok = offs_n[None, :] < seqlen_k
    kT = load_tile(
        k_base + offs_n[None, :] * stride_ks + offs_d[:, None],
        d_ok[:, None], col_ok, EVEN_D, EVEN_N,
    )  # fmt: skip
    vT = load_tile(
        v_base + offs_n[None, :] * stride_vs + offs_dv[:, None],
        dv_ok[:, None], col_ok, EVEN_DV, EVEN_N,
    )  # fmt: skip
    if SOFTCAP > 0:
        t = capped_tanh(tl.dot(q, kT), qk_scale, SOFTCAP)
        p = tl.math.exp2(t * (SOFTCAP * LOG2E) - lse[:, None])
    else:
        p = tl.math.exp2(tl.fma(tl.dot(q, kT), qk_scale, -lse[:, None]))
    if APPLY_MASK:
        hidden = element_mask(
            bounds_ptr, rows, offs_n[None, :], seqlen_q, seqlen_k, CAUSAL, HAS_MASK, HAS_UPPER
        )
        p = tl.where(hidden, 0.0, p)
    dp = tl.dot(do, vT)
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0:
        ds = ds * (1.0 - t * t)  # the cap's derivative
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def _dq_program(
    m_tile, h, b,
    Q, K, V, DO, Lse, Delta, DQ, Bounds, ListEntries, ListCounts, ListPartial,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    MASK_FULL_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """dQ of query tile ``m_tile`` of (batch ``b``, query head ``h``)."""
    bh = b * num_heads_q + h
    h_kv = h // heads_per_kv
    h_mask = h // heads_per_mask_head
    b64 = b.to(tl.int64)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    q = load_tile(
        Q + b64 * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        row_ok[:, None], d_ok[None, :], EVEN_M, EVEN_D,
    )  # fmt: skip
    do = load_tile(
        DO + b64 * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
        row_ok[:, None], dv_ok[None, :], EVEN_M, EVEN_DV,
    )  # fmt: skip
    row_base = bh.to(tl.int64) * seqlen_q
    lse = _load_lse_log2(Lse, row_base + offs_m, row_ok)
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + h_kv * stride_kh
    v_base = V + b64 * stride_vb + h_kv * stride_vh
    mask_head = b64 * num_mask_heads + h_mask
    bounds_ptr = Bounds + mask_head * 4 * seqlen_k
    list_row = mask_head * num_m_tiles + m_tile
    count = tl.load(ListCounts + list_row)
    num_partial = tl.load(ListPartial + list_row)
    entries = ListEntries + list_row * num_n_tiles
    rows = offs_m[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Partial key tiles (element mask), then unmasked ones (no mask code in the loop).
    for it in tl.range(0, num_partial, num_stages=NUM_STAGES):
        n_tile = tl.load(entries + it)
        dq = _dq_tile(
            q, do, dq, lse, delta, n_tile, rows, k_base, v_base, bounds_ptr,
            offs_n0, offs_d, d_ok, offs_dv, dv_ok, stride_ks, stride_vs, seqlen_q, seqlen_k,
            qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, True, EVEN_N, EVEN_D, SOFTCAP, EVEN_DV,
        )  # fmt: skip
    for it in tl.range(num_partial, count, num_stages=NUM_STAGES):
        n_tile = -tl.load(entries + it) - 1
        dq = _dq_tile(
            q, do, dq, lse, delta, n_tile, rows, k_base, v_base, bounds_ptr,
            offs_n0, offs_d, d_ok, offs_dv, dv_ok, stride_ks, stride_vs, seqlen_q, seqlen_k,
            qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, EVEN_N, EVEN_D, SOFTCAP,
            EVEN_DV,
        )  # fmt: skip

    dq = dq * softmax_scale
    store_tile(
        DQ + b64 * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), row_ok[:, None], d_ok[None, :], EVEN_M, EVEN_D,
    )  # fmt: skip


@triton.jit
def flashmask_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Bounds, ListEntries, ListCounts, ListPartial,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    MASK_FULL_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """dK/dV pass alone; grid ``(key tiles, kv heads, batch)``."""
    # (tile, head, batch) grid axes: heads and batch each stay under the 65535 limit of axes 1-2.
    _dkdv_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        Q, K, V, DO, Lse, Delta, DK, DV, Bounds, ListEntries, ListCounts, ListPartial,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
        num_mask_heads, num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
        CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, EVEN_M, EVEN_N,
        EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, NUM_STAGES, HEAD_DIM_V, BLOCK_DV, EVEN_DV, SOFTCAP,
    )  # fmt: skip


@triton.jit
def flashmask_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Bounds, ListEntries, ListCounts, ListPartial,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    MASK_FULL_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """dQ pass alone; grid ``(query tiles, query heads, batch)``, heaviest tiles first."""
    _dq_program(
        num_m_tiles - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2),
        Q, K, V, DO, Lse, Delta, DQ, Bounds, ListEntries, ListCounts, ListPartial,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_dqb, stride_dqs, stride_dqh,
        seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
        num_m_tiles, num_n_tiles, head_dim, qk_scale, softmax_scale,
        CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, EVEN_M, EVEN_N, EVEN_D,
        BLOCK_M, BLOCK_N, BLOCK_D, NUM_STAGES, HEAD_DIM_V, BLOCK_DV, EVEN_DV, SOFTCAP,
    )  # fmt: skip


@triton.jit
def flashmask_bwd_fused_kernel(
    Q, K, V, DO, Lse, Delta, DQ, DK, DV, Bounds,
    KvEntries, KvCounts, KvPartial, QEntries, QCounts, QPartial,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    kv_num_m_tiles, kv_num_n_tiles, q_num_m_tiles, q_num_n_tiles, head_dim, qk_scale,
    softmax_scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    MASK_FULL_TILES: tl.constexpr,
    KV_EVEN_M: tl.constexpr,
    KV_EVEN_N: tl.constexpr,
    Q_EVEN_M: tl.constexpr,
    Q_EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    KV_BLOCK_M: tl.constexpr,
    KV_BLOCK_N: tl.constexpr,
    KV_STAGES: tl.constexpr,
    Q_BLOCK_M: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_STAGES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """Both backward passes in one launch; grid ``(key tiles + G * query tiles, kv heads, batch)``.

    The first ``kv_num_n_tiles`` programs of each (kv head, batch) compute dK/dV of one key tile;
    the rest compute dQ of one query tile of one of the ``G = heads_per_kv`` query heads, heaviest
    tiles first. One grid lets the dQ programs fill the dK/dV pass's last wave (and vice versa)
    instead of each pass draining the GPU at its end.
    """
    pid = tl.program_id(0)
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    if pid < kv_num_n_tiles:
        _dkdv_program(
            pid, h_kv, b,
            Q, K, V, DO, Lse, Delta, DK, DV, Bounds, KvEntries, KvCounts, KvPartial,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
            stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
            num_mask_heads, kv_num_m_tiles, kv_num_n_tiles, head_dim, qk_scale, softmax_scale,
            CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, KV_EVEN_M, KV_EVEN_N, EVEN_D,
            KV_BLOCK_M, KV_BLOCK_N, BLOCK_D, KV_STAGES, HEAD_DIM_V, BLOCK_DV, EVEN_DV, SOFTCAP,
        )  # fmt: skip
    else:
        r = pid - kv_num_n_tiles
        m_tile = q_num_m_tiles - 1 - r // heads_per_kv
        h = h_kv * heads_per_kv + r % heads_per_kv
        _dq_program(
            m_tile, h, b,
            Q, K, V, DO, Lse, Delta, DQ, Bounds, QEntries, QCounts, QPartial,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
            stride_dqb, stride_dqs, stride_dqh,
            seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
            q_num_m_tiles, q_num_n_tiles, head_dim, qk_scale, softmax_scale,
            CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, Q_EVEN_M, Q_EVEN_N, EVEN_D,
            Q_BLOCK_M, Q_BLOCK_N, BLOCK_D, Q_STAGES, HEAD_DIM_V, BLOCK_DV, EVEN_DV, SOFTCAP,
        )  # fmt: skip


@triton.jit
def flashmask_bwd_delta_kernel(
    Out, DO, DLse, Delta, DQZero,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_zb, stride_zs, stride_zh,
    seqlen_q, num_heads_q, head_dim,
    HAS_DLSE: tl.constexpr,
    ZERO_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``delta[b, h, i] = sum_d O * dO - dlse`` in fp32 (the softmax backward's row term); with
    ``ZERO_DQ`` also zeros the same rows of the fp32 dQ accumulator ``DQZero`` (``[B, Sq, H,
    D]``), which saves the Gluon backward, which adds dQ into that accumulator, a launch of
    its own."""
    m_tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    bh = b * num_heads_q + h
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = bh.to(tl.int64) * seqlen_q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + rows, mask=row_ok, other=0.0)
    tl.store(Delta + rows, delta, mask=row_ok)
    if ZERO_DQ:
        zero_ptrs = (
            DQZero + b * stride_zb + h * stride_zh + offs_m[:, None] * stride_zs + offs_d[None, :]
        )
        tl.store(zero_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=mask)
