"""Warp-specialised backward for Hopper (sm_90) at head dims 64 and 128, written in Gluon: dK, dV
and dQ in one pass, dQ added with fp32 TMA reduce-adds (not bit-reproducible: the launcher uses
it only for ``deterministic=False``).

FlashAttention-3's backward shape:

* grid ``(key tiles, kv heads, batch)``; one program owns ``BLOCK_N = 128`` keys, which its two
  consumer warpgroups split (64 keys each), and walks the column-major tile list of every query
  head that shares the kv head (GQA summed in registers);
* one producer warp loads K and V once, then each listed query tile's Q and dO into a ring of
  ``NUM_BUFFERS`` shared slots guarded by "ready"/"empty" mbarriers, and beside each slot the
  tile's lse and delta rows (the consumers read them from shared memory, not with scalar global
  loads);
* the consumers compute, per 64-row query tile, ``S^T = K Q^T`` and ``dP^T = V dO^T`` (both
  issued before the first is awaited), ``P^T`` from the forward's lse, the element mask on the
  list's partial tiles, ``dV += P^T dO``, ``dQ = dS K`` (from ``dS^T`` in shared memory, two
  buffers alternating) and then ``dK += dS^T Q``, so that dQ is stored for the writer while dK
  runs: five matmuls per tile where the Triton backward's separate dQ pass needs seven. Each
  tile's dQ is handed to the writer, and its Q/dO slot released, after the next tile's score
  products are issued, so that the barrier runs under them;
* with a logit cap (``SOFTCAP > 0``) ``P^T`` comes from the capped scores (``t = tanh(s * scale /
  SOFTCAP)``, ``P = exp2(t * SOFTCAP * log2(e) - lse)``) and ``dS`` takes the cap's derivative
  ``1 - t^2``, as in the Triton backward; dQ and dK keep their ``scale`` factor;
* two writer warps add each scaled fp32 dQ tile, left in a ring of ``DQ_BUFFERS`` shared buffers,
  to the fp32 dQ accumulator with TMA reduce-adds (``cp.reduce.async.bulk.tensor``, one thread
  issuing each). The producer and writer warps make one warpgroup, so the consumers keep 240
  registers through ``setmaxnreg``;
* at the end dK and dV leave through the K/V tiles' buffers and one TMA store each (plain
  causal attention and a query chunk's fp32 sums store from registers).

Each choice above was measured on the H200 against its alternative (``docs/performance.md``).
At head dim 256 ``backward_hd256`` splits the work differently and reuses this module's producer,
dQ writer and helpers; ``backward_launch`` holds the host side of both. Gluon has no CPU
interpreter: the CPU suite compiles the kernels for sm_90 (``benchmarks/sass_report.py``), the
GPU tests (``tests/gpu``, their non-deterministic cases) prove their results. Import
this module only where the interpreter is off.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashmask.kernels.config import GLUON_BWD_KEYS
from flashmask.kernels.gluon_kernels import backward_launch
from flashmask.kernels.gluon_kernels.forward import (
    LOG2E,
    capped_tanh,
    hide_pairs,
    launched_program,
    load_column_bounds,
    tma_load,
    tma_store,
    wgmma_layout,
)
from flashmask.kernels.gluon_kernels.forward import partition_barrier as _partition_barrier
from flashmask.kernels.tiles import TileLists


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared tile ``src`` into global memory at ``coord`` of
    ``tensor_desc`` (``cp.reduce.async.bulk.tensor ... .add``): Triton 3.6's Gluon builder has the
    operation but no Python function for it; later versions call it ``tma.async_atomic_add``."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36

BLOCK_M = backward_launch.BLOCK_M  # query rows per tile
BLOCK_N = GLUON_BWD_KEYS  # keys per program
# Q/dO slots and fp32 dQ buffers: 32 KB each at D = 128, 224 KB in all with K, V and dS^T.
NUM_BUFFERS = 2
DQ_BUFFERS = 2


@gluon.jit
def _head_list(
    g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles,
):  # fmt: skip
    """``(query head, mask head, count, entries)`` of the ``g``-th query head sharing kv head
    ``h_kv``: the column-major list of query tiles that key tile ``n_tile`` visits for it."""
    h = h_kv * heads_per_kv + g
    mask_head = b * num_mask_heads + h // heads_per_mask_head
    list_row = mask_head * num_n_tiles + n_tile
    count = gl.load(counts_ptr + list_row)
    return h, mask_head, count, entries_ptr + list_row.to(gl.int64) * num_m_tiles


@gluon.jit
def consumer_head(
    g, b, h_kv, n_tile, keys, entries_ptr, counts_ptr, bounds_ptr, seqlen_k, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
):  # fmt: skip
    """The consumers' ``(count, entries, lts, lte, uts, ute)`` for the ``g``-th query head of
    kv head ``h_kv``: its tile list (:func:`_head_list`) and the column bounds of the program's
    ``keys`` under its mask head (the keys are fixed, so the bounds load once per head)."""
    _, mask_head, count, entries = _head_list(
        g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
        num_mask_heads, num_m_tiles, num_n_tiles,
    )  # fmt: skip
    lts, lte, uts, ute = load_column_bounds(
        bounds_ptr + mask_head.to(gl.int64) * 4 * seqlen_k, keys, seqlen_k, HAS_MASK, HAS_UPPER
    )
    return count, entries, lts, lte, uts, ute


@gluon.jit
def _bwd_load_partition(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, lse_bufs, delta_bufs, lse_ptr,
    delta_ptr, num_heads_q,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    LSE_BASE2: gl.constexpr,
):  # fmt: skip
    """Producer warp of the program that owns key tile ``n_tile`` of kv head ``h_kv``, batch
    ``b``: K and V (``kv_bar``), then Q and dO of every listed query tile of every head sharing
    the kv head into the slots' ring, and beside each the tile's lse and delta rows in
    ``lse_bufs[slot]``/``delta_bufs[slot]`` (with ``LSE_BASE2`` the lse ready to use:
    :func:`base2_lse`). ``HEAD_DIM`` is Q's and K's; V and dO have their descriptors' own
    (multi-head latent attention's 128 beside 192)."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    head_dim_v: gl.constexpr = v_desc.block_type.shape[1]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    kv_row = b * seqlen_k + n_tile * BLOCK_N
    tma_load(k_desc, [kv_row, h_kv * HEAD_DIM], kv_bar, k_smem)
    tma_load(v_desc, [kv_row, h_kv * head_dim_v], kv_bar, v_smem)
    tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    it = 0
    for g in range(heads_per_kv):
        h, _, count, entries = _head_list(
            g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
            num_mask_heads, num_m_tiles, num_n_tiles,
        )  # fmt: skip
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            slot = it % num_buffers
            mbarrier.wait(empty.index(slot), ((it // num_buffers) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, tile_bytes)
            row = b * seqlen_q + m_tile * BLOCK_M
            tma_load(q_desc, [row, h * HEAD_DIM], bar, q_bufs.index(slot))
            tma_load(do_desc, [row, h * head_dim_v], bar, do_bufs.index(slot))
            # While the copies run: the rows, then the slot's second arrival ("ready" counts
            # two), lowered as a barrier of this warp and one release-arrive, so the
            # consumers' wait sees every lane's stores.
            rows = (b * num_heads_q + h).to(gl.int64) * seqlen_q + m_tile * BLOCK_M
            offs = rows + gl.arange(0, BLOCK_M, row_layout)
            lse = gl.load(lse_ptr + offs)
            if LSE_BASE2:
                lse = base2_lse(lse)
            lse_bufs.index(slot).store(lse)
            delta_bufs.index(slot).store(gl.load(delta_ptr + offs))
            mbarrier.arrive(bar, count=1)
            it += 1


@gluon.jit
def _bwd_dq_writer_partition(
    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_desc, b, h_kv, n_tile, seqlen_q,
    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """dQ writer warps: walk the producer's tile sequence and add each tile's scaled dQ, which
    the consumers leave in the ``dq_bufs`` ring, to the fp32 accumulator through ``dq_desc``
    (its 2-D view ``[B * Sq, H * D]``) with one TMA reduce-add."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    it = 0
    for g in range(heads_per_kv):
        h, _, count, entries = _head_list(
            g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
            num_mask_heads, num_m_tiles, num_n_tiles,
        )  # fmt: skip
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            buf = it % num_dq_buffers
            dq_smem = dq_bufs.index(buf)
            mbarrier.wait(dq_full.index(buf), (it // num_dq_buffers) & 1)
            tma_reduce_add(dq_desc, [b * seqlen_q + m_tile * BLOCK_M, h * HEAD_DIM], dq_smem)
            # The reduce has read the buffer (not necessarily finished adding) before it is
            # handed back.
            tma.store_wait(0)
            # Lowered as a barrier of the writer warps, then one arrive: all reads are done.
            mbarrier.arrive(dq_empty.index(buf), count=1)
            it += 1


@gluon.jit
def await_tile(entries, j, it, q_bufs, do_bufs, ready):
    """``(entry, m_tile, slot, q_smem, do_smem)`` of a consumer's ``j``-th listed tile of this
    head (its ``it``-th in all): the list entry (``>= 0``: a partial tile), its query tile, and
    the Q/dO slot the producer loads it into, once that slot's "ready" barrier has completed."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    entry = gl.load(entries + j)
    m_tile = gl.where(entry >= 0, entry, -entry - 1)
    slot = it % num_buffers
    q_smem = q_bufs.index(slot)
    do_smem = do_bufs.index(slot)
    mbarrier.wait(ready.index(slot), (it // num_buffers) & 1)
    return entry, m_tile, slot, q_smem, do_smem


@gluon.jit
def issue_scores(k_smem, v_smem, q_smem, do_smem, zero_st):
    """``S^T = K Q^T`` and ``dP^T = V dO^T`` of one tile issued (asynchronous, not awaited)."""
    st = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    return st, dpt


@gluon.jit
def base2_lse(lse):
    """The forward's lse in base-2 units, +inf for a fully masked row (-inf), so that its
    ``P = exp2(S * qk_scale - lse)`` is zero."""
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@gluon.jit
def transposed_probabilities(
    st, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, causal_offset,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """``(P^T, G^T)`` from the transposed scores ``st [keys, queries]`` (dot products) and the
    rows' ``lse``, with the element mask of the keys' bounds applied on a partial tile (list
    ``entry >= 0``): ``G^T`` is ``P^T`` times the logit cap's derivative ``1 - t^2`` with
    ``SOFTCAP > 0`` (``t``: :func:`~.forward.capped_tanh` of the scores), ``P^T`` itself without
    a cap, so that ``dS^T = G^T * (dP^T - delta)``."""
    num_keys: gl.constexpr = st.type.shape[0]
    num_queries: gl.constexpr = st.type.shape[1]
    layout: gl.constexpr = st.type.layout
    if SOFTCAP > 0:
        # The mask first, then t, P^T and G^T element by element: masking P^T after t kept
        # both in registers across the mask (72 bytes of spills at D = 128 with a mask; 24 this
        # way, all but one load outside the tile loop).
        hidden = gl.zeros([num_keys, num_queries], gl.int1, layout)
        if entry >= 0:
            hidden = hide_pairs(
                hidden, rows[None, :], keys[:, None], lts[:, None], lte[:, None], uts[:, None],
                ute[:, None], causal_offset, HAS_MASK, HAS_UPPER, CAUSAL,
            )  # fmt: skip
        tt = capped_tanh(st, qk_scale, SOFTCAP)
        pt = gl.where(hidden, 0.0, gl.exp2(tt * (SOFTCAP * LOG2E) - lse[None, :]))
        # The derivative folds into P^T here, so that t need not stay in registers until dP^T
        # arrives: the Triton backward's (P * (dP - delta)) * (1 - t^2) in another order, equal
        # up to fp32 rounding.
        return pt, pt * (1.0 - tt * tt)
    pt = gl.exp2(st * qk_scale - lse[None, :])
    if entry >= 0:
        hidden = hide_pairs(
            gl.zeros([num_keys, num_queries], gl.int1, layout), rows[None, :], keys[:, None],
            lts[:, None], lte[:, None], uts[:, None], ute[:, None], causal_offset, HAS_MASK,
            HAS_UPPER, CAUSAL,
        )  # fmt: skip
        pt = gl.where(hidden, 0.0, pt)
    return pt, pt


@gluon.jit
def hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale):
    """Leave tile ``it``'s scaled dQ in the writer's ring once the writer has read what was left
    in that buffer before (``_bwd_dq_writer_partition``)."""
    stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale)
    publish_dq(dq_full, it)


@gluon.jit
def stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale):
    """Store tile ``it``'s scaled dQ into its buffer of the writer's ring once the writer has
    read what was left there before; :func:`publish_dq` hands it over."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    dq_buf = it % num_dq_buffers
    mbarrier.wait(dq_empty.index(dq_buf), ((it // num_dq_buffers) & 1) ^ 1)
    dq_bufs.index(dq_buf).store(dq * softmax_scale)


@gluon.jit
def publish_dq(dq_full, it, pred=True):
    """Hand tile ``it``'s dQ, stored by :func:`stage_dq`, to the writer (if ``pred``: a
    predicate rather than a branch, so that no branch sits between a product's issue and its
    wait)."""
    # The writer's TMA reads the buffer through the async proxy.
    fence_async_shared()
    # Lowered as a barrier of the consumer warps (both warpgroups' columns are stored), then
    # one arrive.
    mbarrier.arrive(dq_full.index(it % dq_full.type.shape[0]), count=1, pred=pred)


@gluon.jit
def store_dk_dv(dk, dv, dk_ptr, dv_ptr, b, h_kv, n_tile, stride_kb, stride_ks, stride_kh,
                softmax_scale, ADD: gl.constexpr):  # fmt: skip
    """Store the program's ``dK * softmax_scale`` and ``dV`` (fp32 ``[keys, D]`` accumulators;
    ``dk_ptr``/``dv_ptr`` share K's strides) in their dtype; with ``ADD`` added to what they
    hold (a query chunk's fp32 sums: each program owns its keys, so no other program writes
    them during the launch). Equal head dims only (dV shares dK's offsets)."""
    gl.static_assert(dk.type.shape[1] == dv.type.shape[1], "dK/dV stores from registers: D == Dv")
    layout: gl.constexpr = dk.type.layout
    block_n: gl.constexpr = dk.type.shape[0]
    head_dim: gl.constexpr = dk.type.shape[1]
    dtype: gl.constexpr = dk_ptr.dtype.element_ty
    out_rows = n_tile * block_n + gl.arange(0, block_n, gl.SliceLayout(1, layout))
    out_cols = gl.arange(0, head_dim, gl.SliceLayout(0, layout))
    offs = (
        b.to(gl.int64) * stride_kb
        + h_kv * stride_kh
        + out_rows[:, None].to(gl.int64) * stride_ks
        + out_cols[None, :]
    )
    dk = dk * softmax_scale
    if ADD:
        dk += gl.load(dk_ptr + offs)
        dv += gl.load(dv_ptr + offs)
    gl.store(dk_ptr + offs, dk.to(dtype))
    gl.store(dv_ptr + offs, dv.to(dtype))


@gluon.jit
def store_dk_dv_tma(dk, dv, k_smem, v_smem, dk_desc, dv_desc, row, h_kv, softmax_scale):
    """:func:`store_dk_dv` without ``ADD`` through shared memory: the consumers' ``dk``
    (scaled) and ``dv`` into the K/V tiles' buffers, then one TMA store each to row ``row``,
    kv head ``h_kv``'s columns of ``dk_desc``/``dv_desc`` (2-D ``[B * Sk, Hk * D]`` and
    ``[B * Sk, Hk * Dv]`` views, K's and V's tiles and layouts)."""
    # The other warpgroup's last dQ product reads all of K (and its dV/dK products V's and
    # K's rows of its own keys only, but dQ's spans both halves): overwrite only once both
    # warpgroups' products are in.
    _partition_barrier()
    k_smem.store((dk * softmax_scale).to(k_smem.dtype))
    v_smem.store(dv.to(v_smem.dtype))
    fence_async_shared()
    _partition_barrier()  # every thread's rows are in place before the copies read them
    tma_store(dk_desc, [row, h_kv * dk.type.shape[1]], k_smem)
    tma_store(dv_desc, [row, h_kv * dv.type.shape[1]], v_smem)
    tma.store_wait(0)  # the copies have read the buffers before the program exits


@gluon.jit
def write_dk_dv(
    dk, dv, k_smem, v_smem, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_k,
    stride_kb, stride_ks, stride_kh, softmax_scale,
    ADD: gl.constexpr,
    TMA: gl.constexpr,
):  # fmt: skip
    """The program's dK/dV leave: with ``TMA`` through :func:`store_dk_dv_tma` (its tile at
    row ``b * seqlen_k + n_tile * keys``, kv head ``h_kv``'s columns of the descriptors' 2-D
    views), else :func:`store_dk_dv` (``ADD`` as there; equal head dims only)."""
    if TMA:
        block_n: gl.constexpr = dk.type.shape[0]
        store_dk_dv_tma(
            dk, dv, k_smem, v_smem, dk_desc, dv_desc, b * seqlen_k + n_tile * block_n, h_kv,
            softmax_scale,
        )  # fmt: skip
    else:
        store_dk_dv(dk, dv, dk_ptr, dv_ptr, b, h_kv, n_tile, stride_kb, stride_ks, stride_kh,
                    softmax_scale, ADD)  # fmt: skip


@gluon.jit
def _bwd_compute_partition(
    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full, dq_empty,
    entries_ptr, counts_ptr, bounds_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile,
    seqlen_q, seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
    num_n_tiles, stride_kb, stride_ks, stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    DKDV_TMA: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups of the program that owns key tile ``n_tile`` of kv head ``h_kv``,
    batch ``b``: dK and dV of its keys (with ``ADD_DKDV`` added to what ``dk_ptr``/``dv_ptr``
    hold; with ``DKDV_TMA`` stored through ``dk_desc``/``dv_desc``); each tile's dQ goes to the
    writer warps through ``dq_bufs``; ``lse_bufs``/``delta_bufs`` hold the producer's rows;
    ``SOFTCAP > 0``: the logit cap the forward took. All five products of a tile are awaited
    within the tile (dK left running into the next tile measured slower)."""
    # The tile step: first among the loops' carried values (their order steers ptxas).
    it = 0
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = k_smem.dtype
    # Transposed scores [BLOCK_N keys, BLOCK_M queries]; the keys split over the warpgroups.
    st_layout: gl.constexpr = wgmma_layout(warps, BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(warps, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # dQ [BLOCK_M, HEAD_DIM]: 64 rows are one warpgroup's M, so the warpgroups split the columns.
    groups: gl.constexpr = warps // 4
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, HEAD_DIM // groups, 16]
    )
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    num_slots: gl.constexpr = q_bufs.type.shape[0]

    keys = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    offs_m = gl.arange(0, BLOCK_M, query_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)

    mbarrier.wait(kv_bar, 0)
    for g in range(heads_per_kv):
        count, entries, lts, lte, uts, ute = consumer_head(
            g, b, h_kv, n_tile, keys, entries_ptr, counts_ptr, bounds_ptr, seqlen_k,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            HAS_MASK, HAS_UPPER,
        )  # fmt: skip
        for j in range(count):
            entry, m_tile, slot, q_smem, do_smem = await_tile(
                entries, j, it, q_bufs, do_bufs, ready
            )
            st_token, dpt_token = issue_scores(k_smem, v_smem, q_smem, do_smem, zero_st)
            # Under these products: the previous tile's Q/dO slot released and its dQ handed
            # to the writer (none before the first tile; ``it`` + the ring size keeps the
            # buffer index in range there).
            mbarrier.arrive(empty.index((it + num_slots - 1) % num_slots), pred=it > 0)
            publish_dq(dq_full, it + dq_full.type.shape[0] - 1, pred=it > 0)
            rows = m_tile * BLOCK_M + offs_m
            lse = base2_lse(lse_bufs.index(slot).load(query_layout))
            st = warpgroup_mma_wait(1, deps=(st_token,))
            pt, gt = transposed_probabilities(
                st, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, seqlen_k - seqlen_q,
                HAS_MASK, HAS_UPPER, CAUSAL, SOFTCAP,
            )  # fmt: skip
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv_token = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt_token,))
            # Read where it is used, so that it does not hold registers through P^T.
            delta = delta_bufs.index(slot).load(query_layout)
            dst = (gt * (dpt - delta[None, :])).to(dtype)
            dst_op = gl.convert_layout(dst, a_layout)
            ds_smem = ds_bufs.index(it % 2)
            ds_smem.store(dst)
            fence_async_shared()
            # Both warpgroups' halves of dS^T are in place (and the buffer written here was last
            # read two tiles ago, before the previous tile's barrier).
            _partition_barrier()
            dq_token = warpgroup_mma(
                ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True
            )
            # dK after dQ, so that dQ is stored for the writer while dK's product runs
            # (products complete in issue order).
            dk_token = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
            dv, dq, _ = warpgroup_mma_wait(1, deps=(dv_token, dq_token, pt_op))
            stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale)
            dk, _ = warpgroup_mma_wait(0, deps=(dk_token, dst_op))
            it += 1
    # The last tile's dQ (its Q/dO slot needs no release: nothing loads after it).
    publish_dq(dq_full, it + dq_full.type.shape[0] - 1, pred=it > 0)
    write_dk_dv(
        dk, dv, k_smem, v_smem, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_k,
        stride_kb, stride_ks, stride_kh, softmax_scale, ADD_DKDV, DKDV_TMA,
    )  # fmt: skip


@gluon.jit
def allocate_operands(q_desc, k_desc, v_desc, do_desc, BLOCK_N: gl.constexpr,
                      NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """``(k_smem, v_smem, q_bufs, do_bufs)``: a program's K and V tiles (``BLOCK_N`` keys) and
    ``NUM_BUFFERS`` Q/dO slots in shared memory, in the descriptors' layouts and head dims (V's
    and dO's may differ from Q's and K's)."""
    dtype: gl.constexpr = q_desc.dtype
    block_m: gl.constexpr = q_desc.block_type.shape[0]
    head_dim: gl.constexpr = q_desc.block_type.shape[1]
    head_dim_v: gl.constexpr = v_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, head_dim], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, head_dim_v], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, block_m, head_dim], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, block_m, head_dim_v], do_desc.layout)
    return k_smem, v_smem, q_bufs, do_bufs


@gluon.jit
def allocate_rings(
    dq_desc,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    DQ_BUFFERS: gl.constexpr,
):
    """``(kv_bar, ready, empty, dq_bufs, dq_full, dq_empty, lse_bufs, delta_bufs)``,
    initialised: the K/V barrier, the Q/dO slots' "ready"/"empty" barriers ("ready" completing
    after the copies' bytes and the producer's arrival with the row terms), the ring of
    ``DQ_BUFFERS`` fp32 dQ tiles (in the layout ``dq_desc``'s reduce reads) with its
    "dq_full"/"dq_empty" barriers, and one fp32 lse and one delta row of ``BLOCK_M`` per Q/dO
    slot."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=2)
        mbarrier.init(empty.index(i), count=1)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS, BLOCK_M, HEAD_DIM], dq_desc.layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, BLOCK_M], row_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, BLOCK_M], row_layout)
    return kv_bar, ready, empty, dq_bufs, dq_full, dq_empty, lse_bufs, delta_bufs


@gluon.jit
def gluon_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_desc, dk_ptr, dv_ptr, dk_desc,
    dv_desc, bounds_ptr, entries_ptr, counts_ptr, order_ptr, stride_dqb, stride_dqs, stride_dqh,
    stride_kb, stride_ks, stride_kh, seqlen_q, seqlen_k, num_heads_q, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, qk_scale, softmax_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    DQ_BUFFERS: gl.constexpr,
    WRITER_WARPS: gl.constexpr,
    WRITER_REGISTERS: gl.constexpr,
    ORDERED: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    DKDV_TMA: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """Grid ``(key tiles, kv heads, batch)``, run in the order of ``order_ptr`` with
    ``ORDERED`` (``kernels.tiles.program_order``): dK and dV (``dk_ptr``/``dv_ptr`` share K's
    strides; with ``ADD_DKDV`` added to their fp32 contents; with ``DKDV_TMA`` stored through
    ``dk_desc``/``dv_desc``, descriptors of the same buffers, ``None`` without) and dQ added to
    the fp32 accumulator through ``dq_desc``. ``stride_dq*``, the accumulator's strides, are
    unused: they keep the later parameters' offsets, and so the compiled kernel, as measured
    (without them ptxas schedules the kernel differently). ``SOFTCAP > 0``: the logit cap the
    forward took (0.0: none)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem, v_smem, q_bufs, do_bufs = allocate_operands(
        q_desc, k_desc, v_desc, do_desc, BLOCK_N, NUM_BUFFERS
    )
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    kv_bar, ready, empty, dq_bufs, dq_full, dq_empty, lse_bufs, delta_bufs = allocate_rings(
        dq_desc, BLOCK_M, HEAD_DIM, NUM_BUFFERS, DQ_BUFFERS
    )
    n_tile, h_kv, b = launched_program(order_ptr, num_n_tiles, num_heads_q // heads_per_kv, ORDERED)
    # The consumers are the default partition; the producer warp and the dQ writer warps the
    # workers.
    gl.warp_specialize(
        [
            (
                _bwd_compute_partition,
                (
                    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty,
                    dq_full, dq_empty, entries_ptr, counts_ptr, bounds_ptr, dk_ptr, dv_ptr,
                    dk_desc, dv_desc, b, h_kv, n_tile, seqlen_q, seqlen_k, heads_per_kv,
                    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_kb,
                    stride_ks, stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs, CAUSAL,
                    HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, ADD_DKDV, DKDV_TMA, SOFTCAP,
                ),
            ),
            (
                _bwd_load_partition,
                (
                    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                    ready, empty, entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k,
                    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
                    lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q, BLOCK_M, BLOCK_N,
                    HEAD_DIM, False,
                ),
            ),
            (
                _bwd_dq_writer_partition,
                (
                    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_desc, b, h_kv, n_tile,
                    seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                    num_n_tiles, BLOCK_M, HEAD_DIM,
                ),
            ),
        ],
        [1, WRITER_WARPS],
        [24, WRITER_REGISTERS],
    )  # fmt: skip


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``(q, k, v)`` for inputs ``routing.gluon_backward_eligible`` accepts
    at D = 64 or 128, contiguous at 16-byte aligned addresses (``tensors.tma_ready``); the
    arguments as ``backward_launch.launch`` takes them (``lists`` at ``BLOCK_M x BLOCK_N`` =
    64x128 tiles; ``softcap``: the forward's logit cap, 0.0 for none). Long full attention runs
    in chunks of query rows (:func:`one_launch`)."""
    # dK/dV through TMA stores except for plain causal attention, where they measured slower.
    return backward_launch.launch(
        gluon_bwd_kernel, BLOCK_N, NUM_BUFFERS, DQ_BUFFERS,
        dout, q, k, v, lse, delta, bounds, lists, num_mask_heads, causal, softmax_scale,
        dkdv_tma=bounds is not None or not causal, order=order, split_queries=True,
        dq_accumulator=dq_accumulator, softcap=softcap,
    )  # fmt: skip


def one_launch(q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool) -> bool:
    """Whether :func:`backward` runs all of ``q``'s rows in one launch, so that one dQ
    accumulator spans them; long full attention runs in query chunks instead."""
    return backward_launch.one_launch(q, k, masked, causal, split_queries=True)
