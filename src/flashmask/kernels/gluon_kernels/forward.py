"""Warp-specialised forward for Hopper (sm_90), written in Gluon, on FlashAttention-3's
ping-pong schedule.

Triton does not split a ``tl.range`` loop into a load warp and compute warpgroups on sm_90;
Gluon, which ships with Triton, does. A 1-D grid of one program per SM takes the query tiles one
after another (heaviest first, from a counter in the launch order), so that the next tile's
first K/V loads run under this tile's last products and its O stores. Per program:

* one producer warp (24 registers after ``setmaxnreg``) loads each query tile's 128 rows of Q
  and the K/V tiles of its list (the row-major list ``preparation.prepare`` builds) into a ring of
  ``num_buffers`` shared-memory slots, each guarded by a "ready" and an "empty" mbarrier;
* two consumer warpgroups, each a partition of its own owning 64 of the tile's query rows, take
  turns at the tensor cores: warpgroup ``w`` waits for its turn (mbarrier ``turns[w]``), issues
  ``S_j = Q_w K_j^T`` and the previous tile's ``O += P_{j-1} V_{j-1}``, hands the turn over and
  then runs tile ``j``'s online softmax (the Triton forward's: hidden scores set to -inf, row max
  over unscaled scores, ``p = exp2(s * scale - m)``; with a logit cap, ``SOFTCAP > 0``, over the
  capped scores ``SOFTCAP * tanh(s * scale / SOFTCAP)`` in base 2, hidden after the cap) while
  the other warpgroup's products occupy the tensor cores. The turns alternate strictly
  (warpgroup 0 holds the first), so neither turn barrier runs two phases ahead of its waiter;
* the element mask applies on the list's partial tiles (every tile in the dense
  ``skip_tiles=False`` mode, where a fully masked tile adds exact zeros);
* a K/V slot is released when both warpgroups have finished its ``P V`` (``kv_empty`` counts two
  arrivals); three slots (224 KB at hd128) keep the producer ahead of the warpgroup that lags by
  half a step;
* the first iteration's "previous" product is ``0 · V_0`` (exact zeros into a zero accumulator),
  which keeps the loop free of a data-dependent branch around asynchronous tokens;
* each warpgroup's 64 rows of O leave through its half of the Q tile's buffer and one TMA store,
  except in full attention (no mask, not causal), where stores from registers measured faster.

Each choice was measured on the H200 against its alternative (``docs/performance.md``).
Descriptors are 2-D over ``[B * S, H * D]``, so it needs contiguous inputs, ``S`` divisible by
128 and ``D`` in {64, 128, 256} (``routing.gluon_forward_eligible``). Gluon has no CPU
interpreter: the CPU suite compiles this kernel for sm_90 (``benchmarks/sass_report.py``) and the
GPU tests (``tests/gpu``) prove its results. Import this module only where the
interpreter is off (Gluon refuses to load under it).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashmask.kernels.config import GLUON_FWD_TILE
from flashmask.kernels.launch import launch_kernel
from flashmask.kernels.tiles import TileLists
from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE

# Triton 3.6 (the H200's) names the TMA load async_copy_global_to_shared; later versions
# async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# The TMA store likewise: async_copy_shared_to_global in 3.6, async_store later (which keeps the
# old name only to raise).
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier of the partition's warps: ``thread_barrier`` in Triton 3.6 (the H200's), ``barrier``
# in later versions (what CI installs).
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
LOG2E = gl.constexpr(LOG2E_VALUE)

BLOCK_M = GLUON_FWD_TILE
# Warps per compute partition (one warpgroup); 12 warps in all with the second compute
# warpgroup and the producer's (padded) warpgroup: 168 registers each at launch, and the
# producer gives its registers back through setmaxnreg, so the compute warps can hold 240.
NUM_WARPS = 4
MAX_REGISTERS = 168
COMPUTE_REGISTERS = 240
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.constexpr_function
def wgmma_layout(warps, n):
    """The register layout of a ``warpgroup_mma`` result ``[rows, n]`` whose rows split over
    ``warps`` warps (64 rows per warpgroup)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16]
    )


@gluon.jit
def load_column_bounds(bounds_ptr, cols, seqlen_k, HAS_MASK: gl.constexpr, HAS_UPPER: gl.constexpr):
    """``(LTS, LTE, UTS, UTE)`` of key columns ``cols`` from one mask head's normalised bounds
    ``[4, Sk]`` (``cols`` itself stands in for the intervals a mask does not have)."""
    lts = cols
    lte = cols
    uts = cols
    ute = cols
    if HAS_MASK:
        lts = gl.load(bounds_ptr + cols)
        lte = gl.load(bounds_ptr + seqlen_k + cols)
        if HAS_UPPER:
            uts = gl.load(bounds_ptr + 2 * seqlen_k + cols)
            ute = gl.load(bounds_ptr + 3 * seqlen_k + cols)
    return lts, lte, uts, ute


@gluon.jit
def hide_pairs(
    hidden, query, key, lts, lte, uts, ute, causal_offset,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    CAUSAL: gl.constexpr,
):  # fmt: skip
    """``hidden`` (bool, the tile's shape) or-ed with the element mask: query row ``query`` is
    hidden from key column ``key`` when it lies in the column's lower interval ``[lts, lte)``,
    its upper one ``[uts, ute)``, or (causal) when ``key > query + causal_offset``. The index and
    bound operands come broadcast to the tile, in either orientation (forward: queries down;
    backward: keys down)."""
    if HAS_MASK:
        hidden = hidden | ((query >= lts) & (query < lte))
        if HAS_UPPER:
            hidden = hidden | ((query >= uts) & (query < ute))
    if CAUSAL:
        hidden = hidden | (key > query + causal_offset)
    return hidden


@gluon.jit
def capped_tanh(products, qk_scale, SOFTCAP: gl.constexpr):
    """``tanh(scale * products / SOFTCAP)`` of dot products (``qk_scale = scale * log2(e)``):
    Gemma's logit cap is ``SOFTCAP`` times it, its derivative ``1 - tanh^2``. The Triton
    kernels' formula (``triton_kernels.forward.capped_tanh``: ``1 - 2 / (e^(2x) + 1)``, +-1
    where the exponential overflows or vanishes), so that both families' capped scores agree to
    fp32 rounding: its quotient is ``2 * rcp.approx.ftz.f32(e^(2x) + 1)``, which is what
    Triton's ``div.approx.f32`` computes, bit for bit, below 2^126 (above it, 1 either way),
    without the division's range check."""
    # Not PTX's tanh.approx.f32 (one MUFU op where this takes two): its 2^-11 relative error
    # moves a capped score by up to SOFTCAP * 2^-11, and lse by as much, beyond the float32
    # accuracy the GPU tests hold lse to. The range check, where the division kept it, made the
    # forward's dense masked variant spill 272 bytes at D = 128 (none without).
    x = products * (qk_scale / (SOFTCAP * LOG2E))
    denominator = gl.exp2(x * (2.0 * LOG2E)) + 1.0
    reciprocal = gl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [denominator], dtype=gl.float32, is_pure=True,
        pack=1,
    )  # fmt: skip
    return 1.0 - 2.0 * reciprocal


@gluon.jit
def load_kv(k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, entries, it, step, kv_row_base,
            kv_col, BLOCK_N: gl.constexpr):  # fmt: skip
    """Key tile ``it`` of a query tile's list into the slot of the program's ring step
    ``step``, once both warpgroups have released that slot's previous round."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    entry = gl.load(entries + it)
    n_tile = gl.where(entry >= 0, entry, -entry - 1)
    slot = step % num_buffers
    # A slot's "empty" barrier starts in the completed phase, so the first round never waits.
    mbarrier.wait(kv_empty.index(slot), ((step // num_buffers) & 1) ^ 1)
    ready = kv_ready.index(slot)
    mbarrier.expect(ready, kv_bytes)
    row = kv_row_base + n_tile * BLOCK_N
    tma_load(k_desc, [row, kv_col], ready, k_bufs.index(slot))
    tma_load(v_desc, [row, kv_col], ready, v_bufs.index(slot))


@gluon.jit
def publish_item(items, item_ready, item_empty, w, t):
    """Producer: work item ``w`` as the program's ``t``-th, into slot ``t % 2`` of the item
    ring once both warpgroups have read what it held (``item_empty``)."""
    slot = t % 2
    mbarrier.wait(item_empty.index(slot), ((t // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], w, gl.int32, layout))
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def receive_item(items, item_ready, item_empty, t):
    """A consumer warpgroup: the program's ``t``-th work item, from the producer's item ring."""
    slot = t % 2
    mbarrier.wait(item_ready.index(slot), (t // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    w = gl.max(items.index(slot).load(layout), 0)
    mbarrier.arrive(item_empty.index(slot), count=1)
    return w


@gluon.jit
def load_partition(
    q_desc, k_desc, v_desc, q_buf, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty,
    items, item_ready, item_empty, next_item_ptr,
    bounds_ptr, entries_ptr, counts_ptr, order_ptr, num_items, seqlen_q, seqlen_k, num_heads_q,
    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    ORDERED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Producer warp: the program's work items (its own first, then each next one from the
    launch's counter ``next_item_ptr``, handed to the consumers through the item ring), and for
    each query tile the first key tiles of its list, its Q tile once both warpgroups have
    stored the previous tile's O, then the rest; the K/V ring's steps run on across tiles."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    programs = gl.num_programs(0)
    # One program per item (the grid has them all): no counter to take the next from.
    dynamic = programs < num_items
    w = gl.program_id(0)
    t = 0
    step = 0
    while w < num_items:
        m_tile, h, b, h_kv, _, count, entries = query_tile_program(
            bounds_ptr, entries_ptr, counts_ptr, order_ptr, w, seqlen_k, num_heads_q,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            ORDERED,
        )  # fmt: skip
        kv_row_base = b * seqlen_k
        kv_col = h_kv * HEAD_DIM
        # After the program's first tile, key tiles first: their slots free as the previous
        # tile's products finish, the Q buffer only after its O is stored, so these loads run
        # under that tile's epilogue. On the first tile, Q first.
        first = gl.minimum(count, num_buffers)
        early = gl.where(t == 0, 0, first)
        for it in range(early):
            load_kv(
                k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, entries, it, step + it,
                kv_row_base, kv_col, BLOCK_N,
            )  # fmt: skip
        mbarrier.wait(q_empty.index(0), (t & 1) ^ 1)
        q_bar = q_ready.index(0)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        q_row = b * seqlen_q + m_tile * BLOCK_M
        tma_load(q_desc, [q_row, h * HEAD_DIM], q_bar, q_buf.index(0))
        for it in range(early, first):
            load_kv(
                k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, entries, it, step + it,
                kv_row_base, kv_col, BLOCK_N,
            )  # fmt: skip
        # The next item once the first loads are in flight: a scalar atomic in a partition
        # waits for its result's broadcast, which must not hold up this tile's loads.
        nxt = w + programs
        if dynamic:
            nxt = gl.atomic_add(next_item_ptr, 1, sem="relaxed") + programs
        for it in range(first, count):
            load_kv(
                k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, entries, it, step + it,
                kv_row_base, kv_col, BLOCK_N,
            )  # fmt: skip
        publish_item(items, item_ready, item_empty, nxt, t)
        step += count
        t += 1
        w = nxt


@gluon.jit
def pingpong_tile(
    q_half, k_bufs, v_bufs, kv_ready, kv_empty, my_turn, other_turn, zero_s, entries, it, step,
    prev, bounds_ptr, rows, offs_n, m_i, l_i, acc, p_prev, seqlen_q, seqlen_k, qk_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    MASK_FULL_TILES: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup's step ``it`` over a query tile's list: wait for the key tile's
    slot (the program's ring step ``step``) and this warpgroup's turn, issue ``S = Q K^T`` and
    the previous tile's ``O += P V`` (from slot ``prev``; ``0 · V`` on the first step), hand the
    turn over, release the previous slot, then the online softmax of this tile (with
    ``SOFTCAP > 0`` over the capped scores). Returns the updated ``(m_i, l_i, acc, p)``; the
    last tile's ``P V`` is :func:`finish_rows`'s."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    block_n: gl.constexpr = k_bufs.type.shape[1]
    s_layout: gl.constexpr = zero_s.type.layout
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = p_prev.type.layout
    entry = gl.load(entries + it)
    n_tile = gl.where(entry >= 0, entry, -entry - 1)
    slot = step % num_buffers
    mbarrier.wait(kv_ready.index(slot), (step // num_buffers) & 1)
    # The turns alternate over the program's steps, across its query tiles.
    mbarrier.wait(my_turn, step & 1)
    s_token = warpgroup_mma(
        q_half, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    acc_token = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
    mbarrier.arrive(other_turn, count=1)
    qk, acc, _ = warpgroup_mma_wait(0, deps=(s_token, acc_token, p_prev))
    if it > 0:
        mbarrier.arrive(kv_empty.index(prev), count=1)
    if SOFTCAP > 0:
        # The cap needs the scaled scores, so it comes first, and the mask after it: a hidden
        # score becomes -inf whatever its cap. Capped scores in base 2 (the Triton forward's).
        qk = capped_tanh(qk, qk_scale, SOFTCAP) * (SOFTCAP * LOG2E)
    if MASK_FULL_TILES or entry >= 0:
        # A partial tile (the list's first group), or every tile in the dense mode: the
        # element mask, as the Triton forward's element_mask (Sk divides the tiles here).
        cols = n_tile * block_n + offs_n
        lts, lte, uts, ute = load_column_bounds(bounds_ptr, cols, seqlen_k, HAS_MASK, HAS_UPPER)
        hidden = hide_pairs(
            gl.zeros(zero_s.shape, gl.int1, s_layout), rows[:, None], cols[None, :],
            lts[None, :], lte[None, :], uts[None, :], ute[None, :], seqlen_k - seqlen_q,
            HAS_MASK, HAS_UPPER, CAUSAL,
        )  # fmt: skip
        qk = gl.where(hidden, float("-inf"), qk)
    if SOFTCAP > 0:
        # Capped scores carry their scale already: the row max and exponent take them as they
        # are.
        m_new = gl.maximum(m_i, gl.max(qk, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    # Uncapped scores scaled in the exponent (one fma per element).
    p = gl.exp2((qk if SOFTCAP > 0 else qk * qk_scale) - m_shift[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return m_new, l_i, acc, gl.convert_layout(p.to(p_prev.dtype), p_layout)


@gluon.jit
def finish_rows(
    v_bufs, kv_empty, count, last, m_i, l_i, acc, p_prev, out_ptr, out_row0, stride_os,
    lse_ptr, lse_row0, q_half, o_desc, o_row, o_col, WG: gl.constexpr,
):  # fmt: skip
    """A consumer warpgroup's end of a query tile: the last tile's ``P V`` (from slot ``last``,
    which it then releases; none for an empty list) and its 64 rows of O (``out_ptr``: the
    head's output, rows ``out_row0 + WG * 64 ...``; with an ``o_desc``, through its
    Q rows' buffer ``q_half`` and one TMA store to ``[o_row, o_col]`` of ``o_desc``) and lse
    (from ``lse_row0 + WG * 64``)."""
    o_layout: gl.constexpr = acc.type.layout
    row_layout: gl.constexpr = m_i.type.layout
    half: gl.constexpr = acc.type.shape[0]
    head_dim: gl.constexpr = acc.type.shape[1]
    if count > 0:
        acc = warpgroup_mma(p_prev, v_bufs.index(last), acc)
        mbarrier.arrive(kv_empty.index(last), count=1)
    visible = l_i > 0
    l_safe = gl.where(visible, l_i, 1.0)
    acc = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    if o_desc is None:
        o_rows = WG * half + gl.arange(0, half, gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, head_dim, gl.SliceLayout(0, o_layout))
        o_ptrs = out_ptr + (out_row0 + o_rows)[:, None] * stride_os + o_cols[None, :]
        gl.store(o_ptrs, acc.to(p_prev.dtype))
    else:
        # This warpgroup's products that read its Q rows are all in (the last P V above is
        # awaited), and the other warpgroup reads only its own half.
        q_half.store(acc.to(p_prev.dtype))
        fence_async_shared()
        partition_barrier()  # the warpgroup's rows are in place before the copy reads them
        tma_store(o_desc, [o_row, o_col], q_half)
    lse = gl.where(visible, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf"))
    gl.store(lse_ptr + lse_row0 + WG * half + gl.arange(0, half, row_layout), lse)
    if o_desc is not None:
        tma.store_wait(0)  # the copy has read the buffer before the program exits


@gluon.jit
def _compute_partition(
    q_buf, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turns, items, item_ready,
    item_empty, bounds_ptr, entries_ptr, counts_ptr, order_ptr, num_items, out_ptr, lse_ptr,
    stride_ob, stride_os, stride_oh, seqlen_q, seqlen_k, num_heads_q, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, qk_scale, o_desc,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    MASK_FULL_TILES: gl.constexpr,
    ORDERED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    WG: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``WG``, for each query tile of the program: rows ``WG * 64 ...`` of
    the tile; online softmax over the listed key tiles (capped at ``SOFTCAP`` where it is
    positive), taking turns at the tensor cores with the other warpgroup; then O and lse of its
    rows (O through ``o_desc`` where given), after which its Q rows are the producer's again."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    half: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_buf.dtype
    s_layout: gl.constexpr = wgmma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    my_turn = turns.index(WG)
    other_turn = turns.index(1 - WG)
    zero_s = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    offs_n = gl.arange(0, BLOCK_N, col_layout)
    step = 0
    t = 0
    # The program's first item is its index; each next one comes from the producer.
    w = gl.program_id(0)
    while w < num_items:
        m_tile, h, b, _, bounds, count, entries = query_tile_program(
            bounds_ptr, entries_ptr, counts_ptr, order_ptr, w, seqlen_k, num_heads_q,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            ORDERED,
        )  # fmt: skip
        q_row0, out_head, out_row0, lse_row0 = query_tile_rows(
            m_tile, h, b, out_ptr, stride_ob, stride_os, stride_oh, seqlen_q, num_heads_q, BLOCK_M
        )
        m_i = gl.full([half], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([half], gl.float32, row_layout)
        acc = gl.zeros([half, HEAD_DIM], gl.float32, o_layout)
        p_prev = gl.convert_layout(zero_s.to(dtype), p_layout)
        rows = m_tile * BLOCK_M + WG * half + gl.arange(0, half, row_layout)
        q_half = q_buf.index(0).slice(WG * half, half)
        mbarrier.wait(q_ready.index(0), t & 1)
        for it in range(count):
            # The previous tile's slot (the first tile's own: 0 · V_0, exact zeros).
            prev = gl.maximum(step + it - 1, step) % num_buffers
            m_i, l_i, acc, p_prev = pingpong_tile(
                q_half, k_bufs, v_bufs, kv_ready, kv_empty, my_turn, other_turn, zero_s,
                entries, it, step + it, prev, bounds, rows, offs_n, m_i, l_i, acc, p_prev,
                seqlen_q, seqlen_k, qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES,
                SOFTCAP,
            )  # fmt: skip
        finish_rows(
            v_bufs, kv_empty, count, (step + count - 1) % num_buffers, m_i, l_i, acc, p_prev,
            out_head, out_row0, stride_os, lse_ptr, lse_row0, q_half, o_desc,
            q_row0 + WG * half, h * HEAD_DIM, WG,
        )  # fmt: skip
        # Its Q rows are read (and, with o_desc, stored from): another tile's may load.
        mbarrier.arrive(q_empty.index(0), count=1)
        w = receive_item(items, item_ready, item_empty, t)
        step += count
        t += 1


@gluon.jit
def query_tile_list(
    m_tile, h, b, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles,
):  # fmt: skip
    """Query tile ``m_tile`` of head ``h``, batch ``b``: its mask head's normalised bounds, its
    list's length and its entries (row-major lists, one row per mask head and query tile)."""
    mask_head = b * num_mask_heads + h // heads_per_mask_head
    list_row = mask_head * num_m_tiles + m_tile
    bounds = bounds_ptr + mask_head.to(gl.int64) * 4 * seqlen_k
    count = gl.load(counts_ptr + list_row)
    entries = entries_ptr + list_row.to(gl.int64) * num_n_tiles
    return bounds, count, entries


@gluon.jit
def launched_program(order_ptr, tiles, heads, ORDERED: gl.constexpr):
    """``(p, h, b)``: the grid position ``(tiles, heads, batch)`` this program runs, its own or,
    with ``ORDERED``, the one that ``order_ptr`` (``kernels.tiles.program_order``) gives its
    launch index (the Triton kernels' ``attention_fwd.launched_program``)."""
    p = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    if ORDERED:
        item = gl.load(order_ptr + p + tiles * (h + heads * b))
        p = item % tiles
        h = (item // tiles) % heads
        b = item // (tiles * heads)
    return p, h, b


@gluon.jit
def work_item(w, order_ptr, tiles, heads, ORDERED: gl.constexpr):
    """``(p, h, b)``: the position in the grid ``(tiles, heads, batch)`` of work item ``w``
    (its linear index there or, with ``ORDERED``, the item ``order_ptr`` gives it:
    ``kernels.tiles.program_order``, decoded as :func:`launched_program` decodes it)."""
    item = w
    if ORDERED:
        item = gl.load(order_ptr + w)
    return item % tiles, (item // tiles) % heads, item // (tiles * heads)


@gluon.jit
def query_tile_program(
    bounds_ptr, entries_ptr, counts_ptr, order_ptr, w, seqlen_k, num_heads_q, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    ORDERED: gl.constexpr,
):  # fmt: skip
    """Work item ``w`` of the items ``(query tiles, query heads, batch)``, heaviest query tiles
    first (in the order ``order_ptr`` gives with ``ORDERED``): ``(query tile, query head,
    batch, kv head, its mask head's bounds, the tile's list length and entries)``."""
    p, h, b = work_item(w, order_ptr, num_m_tiles, num_heads_q, ORDERED)
    m_tile = num_m_tiles - 1 - p
    bounds, count, entries = query_tile_list(
        m_tile, h, b, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, heads_per_mask_head,
        num_mask_heads, num_m_tiles, num_n_tiles,
    )  # fmt: skip
    return m_tile, h, b, h // heads_per_kv, bounds, count, entries


@gluon.jit
def query_tile_rows(
    m_tile, h, b, out_ptr, stride_ob, stride_os, stride_oh, seqlen_q, num_heads_q,
    BLOCK_M: gl.constexpr,
):  # fmt: skip
    """Where query tile ``m_tile`` of head ``h``, batch ``b`` lives: its first row in Q's 2-D
    ``[B * Sq, H * D]`` view, its head's output pointer and first output row, its first lse
    element."""
    q_row0 = b * seqlen_q + m_tile * BLOCK_M
    out_row0 = b.to(gl.int64) * (stride_ob // stride_os) + m_tile * BLOCK_M
    lse_row0 = (b * num_heads_q + h).to(gl.int64) * seqlen_q + m_tile * BLOCK_M
    return q_row0, out_ptr + h * stride_oh, out_row0, lse_row0


@gluon.jit
def gluon_fwd_kernel(
    q_desc, k_desc, v_desc, out_ptr, o_desc, lse_ptr, bounds_ptr, entries_ptr, counts_ptr,
    order_ptr,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, qk_scale, num_items, next_item_ptr,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    MASK_FULL_TILES: gl.constexpr,
    ORDERED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    COMPUTE_REGISTERS: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """A 1-D grid over the ``num_items = query tiles x query heads x batch`` work items,
    heaviest query tiles first (with ``ORDERED``, in the order of ``order_ptr``:
    ``kernels.tiles.program_order``): program ``i`` takes item ``i`` and then, while the grid
    has fewer programs than items, each next one from the zeroed counter ``next_item_ptr``
    (unread when the grid has them all). Q in one tile's buffer, K/V in ``NUM_BUFFERS`` slots.
    O is stored through ``o_desc`` (a ``[64, D]``-block descriptor of ``out_ptr``'s 2-D view)
    unless it is ``None``. ``SOFTCAP > 0``: Gemma's logit cap on the scaled scores (0.0: none).
    """
    dtype: gl.constexpr = q_desc.dtype

    q_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], v_desc.layout)
    # The Q tile loaded (q_ready) and free for the next (q_empty: both warpgroups). The Q tile
    # and these barriers are arrays of one (``.index(0)``): shared memory keeps the layout the
    # kernel was measured with.
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    # The producer's work items for the consumers: two slots, each read by both warpgroups.
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    mbarrier.init(q_empty.index(0), count=2)  # both warpgroups release the Q tile
    for i in gl.static_range(2):
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=2)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both warpgroups release a slot
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # warpgroup 0 has the first turn

    gl.warp_specialize(
        [
            # gluon.jit takes no argument spreading: the two warpgroups' lists differ in WG only.
            (
                _compute_partition,
                (
                    q_buf, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turns, items,
                    item_ready, item_empty, bounds_ptr, entries_ptr, counts_ptr, order_ptr,
                    num_items, out_ptr, lse_ptr,
                    stride_ob, stride_os, stride_oh, seqlen_q, seqlen_k, num_heads_q,
                    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
                    qk_scale, o_desc, CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, ORDERED,
                    BLOCK_M, BLOCK_N, HEAD_DIM, 0, SOFTCAP,
                ),
            ),
            (
                _compute_partition,
                (
                    q_buf, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turns, items,
                    item_ready, item_empty, bounds_ptr, entries_ptr, counts_ptr, order_ptr,
                    num_items, out_ptr, lse_ptr,
                    stride_ob, stride_os, stride_oh, seqlen_q, seqlen_k, num_heads_q,
                    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
                    qk_scale, o_desc, CAUSAL, HAS_MASK, HAS_UPPER, MASK_FULL_TILES, ORDERED,
                    BLOCK_M, BLOCK_N, HEAD_DIM, 1, SOFTCAP,
                ),
            ),
            (
                load_partition,
                (
                    q_desc, k_desc, v_desc, q_buf, k_bufs, v_bufs, q_ready, q_empty, kv_ready,
                    kv_empty, items, item_ready, item_empty, next_item_ptr, bounds_ptr,
                    entries_ptr, counts_ptr, order_ptr, num_items,
                    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
                    num_mask_heads, num_m_tiles, num_n_tiles, ORDERED, BLOCK_M, BLOCK_N,
                    HEAD_DIM,
                ),
            ),
        ],
        [4, 1],
        [COMPUTE_REGISTERS, 24],
    )  # fmt: skip


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (a CUDA device), asked once per device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache  # frozen: one object per shape serves every launch (host time)
def shared_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The NVMMA (wgmma-operand) shared layout of a ``[rows, head_dim]`` tile."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPES[dtype])


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    skip_tiles: bool,
    block_n: int,
    num_buffers: int,
    *,
    order: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` for inputs that
    ``routing.gluon_forward_eligible`` accepts, with a positive ``softmax_scale`` or a logit
    cap: ``softcap > 0`` caps the scaled scores at ``softcap * tanh(score / softcap)`` (Gemma's
    logit soft-capping; its row max is taken over the capped scores, so any scale).

    ``bounds`` (``[B, Hm, 4, Sk]`` normalised column bounds, ``None`` without a mask) and
    ``lists`` (row-major :class:`~flashmask.kernels.tiles.TileLists` at ``BLOCK_M x block_n``
    tiles) come from ``preparation.prepare_cached``; ``num_mask_heads`` is ``Hm`` (1 without a
    mask).
    ``block_n`` (dividing Sk) is the key tile and ``num_buffers`` the K/V slots:
    ``routing.gluon_forward_tiles(D)`` (128 and 3 up to D = 128, 64 and 2 at D = 256).
    ``order`` (``preparation.program_order``, ``None``: the grid's natural order) is the order in
    which the programs, one per SM, take the query tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    tm, tn = lists.entries.shape[-2:]
    q2, k2, v2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v))
    half = BLOCK_M // 2  # O stores move each warpgroup's 64 rows
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], shared_layout(BLOCK_M, d, q.dtype))
    kv_layout = shared_layout(block_n, d, q.dtype)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, d], kv_layout)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    o_desc = None
    if causal or bounds is not None:  # O through TMA stores, but for full attention
        o_desc = TensorDescriptor.from_tensor(
            out.view(b * sq, hq * d), [half, d], shared_layout(half, d, q.dtype)
        )
    num_items = tm * hq * b
    programs = min(num_items, sm_count(q.device))
    # Items past the first ``programs`` are taken from this counter, one at a time.
    next_item = lists.counts  # not read with one program per item
    if programs < num_items:
        next_item = torch.zeros(1, dtype=torch.int32, device=q.device)
    launch_kernel(
        gluon_fwd_kernel, (programs,),
        q_desc, k_desc, v_desc, out, o_desc, lse, lists.counts if bounds is None else bounds,
        lists.entries, lists.counts, lists.counts if order is None else order,
        out.stride(0), out.stride(1), out.stride(2),
        sq, sk, hq, hq // hk, hq // num_mask_heads, num_mask_heads, tm, tn,
        softmax_scale * LOG2E_VALUE, num_items, next_item,
        CAUSAL=causal, HAS_MASK=bounds is not None, HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles, ORDERED=order is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, HEAD_DIM=d, NUM_BUFFERS=num_buffers,
        COMPUTE_REGISTERS=COMPUTE_REGISTERS, SOFTCAP=float(softcap), num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out, lse
