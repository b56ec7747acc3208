"""Experiment: a warp-specialised FlashMask dK/dV backward in Gluon (Hopper).

Not part of the library. The Triton backward (``flashmask.kernels.backward``) runs 64-key tiles
on one warpgroup and cannot overlap its loads with its matmuls through warp specialisation on
sm_90 (NOTES.md, change 12). This kernel takes FA3's backward shape:

* grid ``(key tiles, kv heads, batch)``; one program owns ``BLOCK_N = 128`` keys, which its two
  consumer warpgroups split (64 keys each), and walks the column-major tile list of every query
  head that shares the kv head (GQA summed in registers, as the Triton dK/dV pass does);
* one producer warp loads K and V once, then each listed query tile's Q and dO into a ring of
  ``NUM_BUFFERS`` shared slots guarded by "ready"/"empty" mbarriers;
* the consumers compute, per 64-row query tile, ``S^T = K Q^T`` and ``dP^T = V dO^T``
  (asynchronous ``warpgroup_mma``, both issued before the first is awaited), ``P^T`` from the
  forward's lse, the element mask on the list's partial tiles (the column bounds belong to the
  program's keys, so they are loaded once per head, not per tile), ``dV += P^T dO`` and
  ``dK += dS^T Q`` with ``P^T`` / ``dS^T`` as register operands;
* ``ACCUMULATE_DQ``: ``dS^T`` also goes to shared memory (two buffers alternate, so one barrier
  per tile suffices), ``dQ = dS K`` runs as one more ``warpgroup_mma`` split over the head dim
  between the two warpgroups, and is added to an fp32 buffer with atomics (FA2/FA3's scheme:
  five matmuls per tile instead of the separate dQ pass's seven; not bit-reproducible).
  Without it, dQ comes from the Triton dQ pass. The consumers issue the atomics themselves:
  Triton's scalar ``atomic_add`` or (``DQ_VEC4``) one ``red.global.v4.f32.add`` per four columns;
* ``DQ_WRITER`` (FA3's scheme, with ``ACCUMULATE_DQ``): the consumers only store the scaled fp32
  dQ tile into a ring of two shared buffers and arrive on its "dq_full" mbarrier; a third
  partition of ``WRITER_WARPS`` warps walks the same tile sequence, waits on "dq_full", issues
  the ``red.global.v4.f32.add`` atomics from shared memory and arrives on "dq_empty", which the
  consumers wait on before reusing the buffer. With 4 writer warps the launch has 16 warps (the
  workers padded to two warpgroups), so the launch registers drop to 128 per thread and
  ``setmaxnreg`` moves the workers' surplus to the consumers (232; producer and writer 24).

Descriptors are 2-D over ``[B * S, H * D]``, so the experiment needs bf16, ``S`` divisible by
128 and ``D`` in {64, 128}.

Usage:
* ``python benchmarks/gluon_backward.py --compile-only`` (no GPU): compile for sm_90 and print
  registers, spills, shared memory, ``setmaxnreg``, HGMMA/TMA counts per variant;
* ``PYTHONPATH=src python benchmarks/gluon_backward.py`` (H200): dQ/dK/dV against the Triton
  backward (max abs difference over max abs value), and times: the Triton backward, the Gluon
  kernel with atomic dQ (vector and scalar atomics, and with the dQ writer partition), the Gluon
  dK/dV kernel plus the Triton dQ pass, and a profiler split of the Triton backward's kernels,
  at 8K and 32K on full, causal and four interval masks.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from cubin import inspect_cubin
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
LOG2E_VALUE = 1.4426950408889634
LOG2E = gl.constexpr(LOG2E_VALUE)


@gluon.jit
def _list_of(g, b, h_kv, n_tile, heads_per_kv, heads_per_mask_head, num_mask_heads, num_n_tiles):
    """Query head, mask head and list row of the ``g``-th query head sharing kv head ``h_kv``."""
    h = h_kv * heads_per_kv + g
    mask_head = b * num_mask_heads + h // heads_per_mask_head
    return h, mask_head, mask_head * num_n_tiles + n_tile


@gluon.constexpr_function
def _vec4_layout(head_dim, warps):
    """Each thread four adjacent dQ columns, a warp whole rows (``32 * 4 // head_dim`` of them)."""
    lanes_d = head_dim // 4
    return gl.BlockedLayout([1, 4], [32 // lanes_d, lanes_d], [warps, 1], [1, 0])


@gluon.jit
def _red_add_v4(dq_head, row0, stride_dqs, values):
    """Add ``values`` (a ``_vec4_layout`` tile of dQ rows ``row0 ...``) with one 16-byte
    ``red.global.v4.f32.add`` per four columns."""
    layout: gl.constexpr = values.type.layout
    num_rows: gl.constexpr = values.type.shape[0]
    num_cols: gl.constexpr = values.type.shape[1]
    rows = row0 + gl.arange(0, num_rows, gl.SliceLayout(1, layout))
    cols = gl.arange(0, num_cols, gl.SliceLayout(0, layout))
    addresses = (dq_head + rows[:, None].to(gl.int64) * stride_dqs + cols[None, :]).to(gl.int64)
    gl.inline_asm_elementwise(
        "red.global.v4.f32.add [$4], {$8, $9, $10, $11};\n"
        "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r",
        [addresses, values],
        dtype=gl.int32,
        is_pure=False,
        pack=4,
    )


@gluon.jit
def _add_dq_vec4(dq, dq_head, row0, stride_dqs, HEAD_DIM: gl.constexpr):
    """Add a dQ tile from the consumers' registers with ``_red_add_v4``: the tile is first laid
    out so that each thread holds four adjacent columns and a warp whole rows (Triton emits one
    scalar atomic per element, scattered over the MMA layout's row pairs)."""
    layout: gl.constexpr = _vec4_layout(HEAD_DIM, gl.num_warps())
    _red_add_v4(dq_head, row0, stride_dqs, gl.convert_layout(dq, layout))


@gluon.jit
def _bwd_load_partition(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Producer warp: K and V once, then Q and dO of every listed query tile of every head."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    kv_row = b * seqlen_k + n_tile * BLOCK_N
    tma_load(k_desc, [kv_row, h_kv * HEAD_DIM], kv_bar, k_smem)
    tma_load(v_desc, [kv_row, h_kv * HEAD_DIM], kv_bar, v_smem)
    tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    it = 0
    for g in range(heads_per_kv):
        h, _, list_row = _list_of(
            g, b, h_kv, n_tile, heads_per_kv, heads_per_mask_head, num_mask_heads, num_n_tiles
        )
        count = gl.load(counts_ptr + list_row)
        entries = entries_ptr + list_row.to(gl.int64) * num_m_tiles
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            slot = it % num_buffers
            mbarrier.wait(empty.index(slot), ((it // num_buffers) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, tile_bytes)
            row = b * seqlen_q + m_tile * BLOCK_M
            tma_load(q_desc, [row, h * HEAD_DIM], bar, q_bufs.index(slot))
            tma_load(do_desc, [row, h * HEAD_DIM], bar, do_bufs.index(slot))
            it += 1


@gluon.jit
def _bwd_dq_writer_partition(
    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, b, h_kv, n_tile, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_dqb, stride_dqs,
    stride_dqh,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """dQ writer warps (``DQ_WRITER``): walk the producer's tile sequence and add each tile's
    scaled dQ, which the consumers leave in the ``dq_bufs`` ring, to the fp32 buffer."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    layout: gl.constexpr = _vec4_layout(HEAD_DIM, gl.num_warps())
    # Eight rows at a time (one period of the buffer's swizzle): few registers per thread.
    step: gl.constexpr = 8
    it = 0
    for g in range(heads_per_kv):
        h, _, list_row = _list_of(
            g, b, h_kv, n_tile, heads_per_kv, heads_per_mask_head, num_mask_heads, num_n_tiles
        )
        count = gl.load(counts_ptr + list_row)
        entries = entries_ptr + list_row.to(gl.int64) * num_m_tiles
        dq_head = dq_ptr + b.to(gl.int64) * stride_dqb + h * stride_dqh
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            buf = it % num_dq_buffers
            dq_smem = dq_bufs.index(buf)
            mbarrier.wait(dq_full.index(buf), (it // num_dq_buffers) & 1)
            for r in gl.static_range(0, BLOCK_M, step):
                values = dq_smem.slice(r, step).load(layout)
                _red_add_v4(dq_head, m_tile * BLOCK_M + r, stride_dqs, values)
            # Lowered as a barrier of the writer warps, then one arrive: all reads are done.
            mbarrier.arrive(dq_empty.index(buf), count=1)
            it += 1


@gluon.jit
def _bwd_compute_partition(
    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full, dq_empty,
    entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, b, h_kv,
    n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, stride_kb, stride_ks, stride_kh,
    qk_scale, softmax_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    ACCUMULATE_DQ: gl.constexpr,
    DQ_VEC4: gl.constexpr,
    DQ_WRITER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups: dK and dV of the program's keys (and dQ by atomics, or handed to the
    dQ writer warps through ``dq_bufs`` with ``DQ_WRITER``)."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    warps: gl.constexpr = gl.num_warps()
    # Transposed scores [BLOCK_N keys, BLOCK_M queries]; the keys split over the warpgroups.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # dQ [BLOCK_M, HEAD_DIM]: 64 rows are one warpgroup's M, so the warpgroups split the columns.
    groups: gl.constexpr = warps // 4
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, HEAD_DIM // groups, 16]
    )
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    keys = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    offs_m = gl.arange(0, BLOCK_M, query_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dq_rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, dq_layout))
    lts = keys
    lte = keys
    uts = keys
    ute = keys

    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(heads_per_kv):
        h, mask_head, list_row = _list_of(
            g, b, h_kv, n_tile, heads_per_kv, heads_per_mask_head, num_mask_heads, num_n_tiles
        )
        if HAS_MASK:
            # This program's keys are fixed, so their bounds are loaded once per head.
            bounds = bounds_ptr + mask_head.to(gl.int64) * 4 * seqlen_k
            lts = gl.load(bounds + keys)
            lte = gl.load(bounds + seqlen_k + keys)
            if HAS_UPPER:
                uts = gl.load(bounds + 2 * seqlen_k + keys)
                ute = gl.load(bounds + 3 * seqlen_k + keys)
        count = gl.load(counts_ptr + list_row)
        entries = entries_ptr + list_row.to(gl.int64) * num_m_tiles
        row_base = (b * num_heads_q + h).to(gl.int64) * seqlen_q
        dq_head = dq_ptr + b.to(gl.int64) * stride_dqb + h * stride_dqh
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            slot = it % num_buffers
            q_smem = q_bufs.index(slot)
            do_smem = do_bufs.index(slot)
            mbarrier.wait(ready.index(slot), (it // num_buffers) & 1)
            st_token = warpgroup_mma(
                k_smem, q_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True
            )
            dpt_token = warpgroup_mma(
                v_smem, do_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True
            )
            rows = m_tile * BLOCK_M + offs_m
            lse = gl.load(lse_ptr + row_base + rows)
            # A fully masked row's lse is -inf; +inf makes its P zero.
            lse = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            delta = gl.load(delta_ptr + row_base + rows)
            st = warpgroup_mma_wait(1, deps=(st_token,))
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if entry >= 0:
                hidden = gl.zeros([BLOCK_N, BLOCK_M], gl.int1, st_layout)
                if HAS_MASK:
                    hidden = (rows[None, :] >= lts[:, None]) & (rows[None, :] < lte[:, None])
                    if HAS_UPPER:
                        upper = (rows[None, :] >= uts[:, None]) & (rows[None, :] < ute[:, None])
                        hidden = hidden | upper
                if CAUSAL:
                    hidden = hidden | (keys[:, None] > rows[None, :] + (seqlen_k - seqlen_q))
                pt = gl.where(hidden, 0.0, pt)
            pt_op = gl.convert_layout(pt.to(gl.bfloat16), a_layout)
            dv_token = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt_token,))
            dst = (pt * (dpt - delta[None, :])).to(gl.bfloat16)
            dst_op = gl.convert_layout(dst, a_layout)
            dk_token = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
            if ACCUMULATE_DQ:
                ds_smem = ds_bufs.index(it % 2)
                ds_smem.store(dst)
                fence_async_shared()
                # Both warpgroups' halves of dS^T are in place (and the buffer written here was
                # last read two tiles ago, before the previous tile's barrier).
                gl.thread_barrier()
                dq_token = warpgroup_mma(
                    ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True
                )
                dv, dk, dq, _, _ = warpgroup_mma_wait(
                    0, deps=(dv_token, dk_token, dq_token, pt_op, dst_op)
                )
                mbarrier.arrive(empty.index(slot), count=1)
                dq = dq * softmax_scale
                if DQ_WRITER:
                    dq_buf = it % dq_bufs.type.shape[0]
                    dq_smem = dq_bufs.index(dq_buf)
                    # Wait until the writer has read what was left here two tiles ago.
                    mbarrier.wait(dq_empty.index(dq_buf), ((it // dq_bufs.type.shape[0]) & 1) ^ 1)
                    dq_smem.store(dq)
                    # Lowered as a barrier of the consumer warps (both warpgroups' columns are
                    # stored), then one arrive.
                    mbarrier.arrive(dq_full.index(dq_buf), count=1)
                elif DQ_VEC4:
                    _add_dq_vec4(dq, dq_head, m_tile * BLOCK_M, stride_dqs, HEAD_DIM)
                else:
                    dq_ptrs = (
                        dq_head
                        + (m_tile * BLOCK_M + dq_rows)[:, None].to(gl.int64) * stride_dqs
                        + dq_cols[None, :]
                    )
                    gl.atomic_add(dq_ptrs, dq, sem="relaxed")
            else:
                dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dv_token, dk_token, pt_op, dst_op))
                mbarrier.arrive(empty.index(slot), count=1)
            it += 1

    out_rows = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
    offs = (
        b.to(gl.int64) * stride_kb
        + h_kv * stride_kh
        + out_rows[:, None].to(gl.int64) * stride_ks
        + out_cols[None, :]
    )
    gl.store(dk_ptr + offs, (dk * softmax_scale).to(gl.bfloat16))
    gl.store(dv_ptr + offs, dv.to(gl.bfloat16))


@gluon.jit
def gluon_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, bounds_ptr,
    entries_ptr, counts_ptr, stride_dqb, stride_dqs, stride_dqh, stride_kb, stride_ks, stride_kh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, qk_scale, softmax_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    ACCUMULATE_DQ: gl.constexpr,
    DQ_VEC4: gl.constexpr,
    DQ_WRITER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    WRITER_WARPS: gl.constexpr,
    WRITER_REGISTERS: gl.constexpr,
):  # fmt: skip
    """Grid ``(key tiles, kv heads, batch)``; dK, dV (``dk_ptr``/``dv_ptr`` share K's strides).
    ``DQ_WRITER`` (with ``ACCUMULATE_DQ``) adds a partition of ``WRITER_WARPS`` warps with
    ``WRITER_REGISTERS`` registers that issues the dQ atomics."""
    n_tile = gl.program_id(0)
    h_kv = gl.program_id(1)
    b = gl.program_id(2)

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUFFERS, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [NUM_BUFFERS, BLOCK_M, HEAD_DIM], do_desc.layout
    )
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    ds_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_M], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if DQ_WRITER:
        # 16-byte vectors swizzled over eight rows: the consumers' 8-byte stores from the MMA
        # layout (eight rows per instruction) and the writer's 16-byte row loads both take the
        # minimum number of shared-memory wavefronts.
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_layout)
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        # The dQ writer is a second worker (hence two warp_specialize calls).
        gl.warp_specialize(
            [
                (
                    _bwd_compute_partition,
                    (
                        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty,
                        dq_full, dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr,
                        delta_ptr, dq_ptr, dk_ptr, dv_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k,
                        num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                        num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, stride_kb,
                        stride_ks, stride_kh, qk_scale, softmax_scale, CAUSAL, HAS_MASK,
                        HAS_UPPER, ACCUMULATE_DQ, DQ_VEC4, DQ_WRITER, BLOCK_M, BLOCK_N, HEAD_DIM,
                    ),
                ),
                (
                    _bwd_load_partition,
                    (
                        q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                        ready, empty, entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q,
                        seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, BLOCK_M, BLOCK_N, HEAD_DIM,
                    ),
                ),
                (
                    _bwd_dq_writer_partition,
                    (
                        dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, b, h_kv,
                        n_tile, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, stride_dqb, stride_dqs, stride_dqh, BLOCK_M, HEAD_DIM,
                    ),
                ),
            ],
            [1, WRITER_WARPS],
            [24, WRITER_REGISTERS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (
                    _bwd_compute_partition,
                    (
                        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, None, kv_bar, ready, empty,
                        None, None, entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr,
                        dq_ptr, dk_ptr, dv_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q,
                        heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, stride_dqb, stride_dqs, stride_dqh, stride_kb, stride_ks,
                        stride_kh, qk_scale, softmax_scale, CAUSAL, HAS_MASK, HAS_UPPER,
                        ACCUMULATE_DQ, DQ_VEC4, DQ_WRITER, BLOCK_M, BLOCK_N, HEAD_DIM,
                    ),
                ),
                (
                    _bwd_load_partition,
                    (
                        q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                        ready, empty, entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q,
                        seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, BLOCK_M, BLOCK_N, HEAD_DIM,
                    ),
                ),
            ],
            [1],
            [24],
        )  # fmt: skip


BLOCK_M, BLOCK_N, NUM_BUFFERS, NUM_WARPS = 64, 128, 2, 8
WRITER_WARPS, WRITER_REGISTERS = 4, 24


def _max_registers(writer_warps: int) -> int:
    """Launch registers per thread: the 64K registers over the consumer warps and the workers'
    warpgroups (the producer warp, plus the dQ writer warps, padded to whole warpgroups);
    ``setmaxnreg`` then gives the workers' surplus to the consumers."""
    worker_warps = 1 + writer_warps
    warps = NUM_WARPS + 4 * -(-worker_warps // 4)
    return 65536 // (32 * warps) // 8 * 8


MAX_REGISTERS = _max_registers(0)


def _layout(rows: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)


def gluon_backward(
    dout, q, k, v, out, lse, startend_row_indices, causal: bool, softmax_scale: float,
    accumulate_dq: bool = True, dq_vec4: bool = True, num_buffers: int = NUM_BUFFERS,
    dq_writer: int = 0,
):  # fmt: skip
    """``(dq, dk, dv)`` like ``flashmask.kernels.backward`` (``dq`` is None without
    ``accumulate_dq``): bf16, ``S`` divisible by 128, ``D`` in {64, 128}, contiguous
    ``[B, S, H, D]`` inputs, any FlashMask (or none). ``dq_writer`` > 0 (implies
    ``accumulate_dq``; ``dq_vec4`` is then unused) leaves the dQ atomics to a dQ writer partition
    of that many warps."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashmask import kernels
    from flashmask.kernels.attention_bwd import flashmask_bwd_delta_kernel

    accumulate_dq = accumulate_dq or dq_writer > 0
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if sq % BLOCK_N or sk % BLOCK_N or d not in (64, 128) or q.dtype != torch.bfloat16:
        raise ValueError("gluon_backward: needs bf16, S divisible by 128 and D in {64, 128}")
    sri = startend_row_indices
    bounds, (lists,) = kernels.prepare_cached(
        sri, causal, sq, sk, b, q.device, [(BLOCK_M, BLOCK_N, False)]
    )
    hm = 1 if sri is None else sri.shape[1]
    tn, tm = lists.entries.shape[-2:]
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    flashmask_bwd_delta_kernel[(triton.cdiv(sq, 64), hq, b)](
        out, dout, delta, delta, *out.stride()[:3], *dout.stride()[:3], sq, hq, d,
        HAS_DLSE=False, BLOCK_M=64, BLOCK_D=d,
    )  # fmt: skip
    q2, k2, v2, do2 = (x.reshape(x.shape[0] * x.shape[1], -1) for x in (q, k, v, dout))
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], _layout(BLOCK_M, d))
    do_desc = TensorDescriptor.from_tensor(do2, [BLOCK_M, d], _layout(BLOCK_M, d))
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, d], _layout(BLOCK_N, d))
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, d], _layout(BLOCK_N, d))
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if accumulate_dq else dk
    gluon_bwd_kernel[(tn, hk, b)](
        q_desc, k_desc, v_desc, do_desc, lse, delta, dq_accum, dk, dv,
        lists.counts if bounds is None else bounds, lists.entries, lists.counts,
        dq_accum.stride(0), dq_accum.stride(1), dq_accum.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, softmax_scale * LOG2E_VALUE, softmax_scale,
        CAUSAL=causal, HAS_MASK=sri is not None, HAS_UPPER=not causal,
        ACCUMULATE_DQ=accumulate_dq, DQ_VEC4=dq_vec4, DQ_WRITER=dq_writer > 0,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d, NUM_BUFFERS=num_buffers,
        WRITER_WARPS=dq_writer or WRITER_WARPS,
        WRITER_REGISTERS=WRITER_REGISTERS, num_warps=NUM_WARPS, maxnreg=_max_registers(dq_writer),
    )  # fmt: skip
    dq = dq_accum.to(q.dtype) if accumulate_dq else None
    return dq, dk, dv


OPCODES = ("HGMMA", "UTMALDG", "MUFU.EX2", "LDG", "REDG", "BAR")


def compile_only(
    head_dim: int,
    causal: bool,
    has_mask: bool,
    accumulate_dq: bool,
    dq_vec4: bool,
    dq_writer: int = 0,
) -> dict:
    """Compile for sm_90 without a GPU; registers, spills, shared memory and key instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc_type(rows):
        return f"tensordesc<bf16[{rows}, {head_dim}],{_layout(rows, head_dim)!r}>"

    signature = {
        "q_desc": desc_type(BLOCK_M), "k_desc": desc_type(BLOCK_N), "v_desc": desc_type(BLOCK_N),
        "do_desc": desc_type(BLOCK_M), "lse_ptr": "*fp32", "delta_ptr": "*fp32",
        "dq_ptr": "*fp32", "dk_ptr": "*bf16", "dv_ptr": "*bf16", "bounds_ptr": "*i32",
        "entries_ptr": "*i32", "counts_ptr": "*i32", "stride_dqb": "i32", "stride_dqs": "i32",
        "stride_dqh": "i32", "stride_kb": "i32", "stride_ks": "i32", "stride_kh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "heads_per_kv": "i32",
        "heads_per_mask_head": "i32", "num_mask_heads": "i32", "num_m_tiles": "i32",
        "num_n_tiles": "i32", "qk_scale": "fp32", "softmax_scale": "fp32",
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "ACCUMULATE_DQ": accumulate_dq or dq_writer > 0, "DQ_VEC4": dq_vec4,
              "DQ_WRITER": dq_writer > 0, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N,
              "HEAD_DIM": head_dim, "NUM_BUFFERS": NUM_BUFFERS,
              "WRITER_WARPS": dq_writer or WRITER_WARPS,
              "WRITER_REGISTERS": WRITER_REGISTERS}  # fmt: skip
    names = [p.name for p in gluon_bwd_kernel.params]
    signature.update({name: "constexpr" for name in values})
    constexprs = {(names.index(name),): value for name, value in values.items()}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options(
        {"num_warps": NUM_WARPS, "maxnreg": _max_registers(dq_writer)}
    )
    src = GluonASTSource(gluon_bwd_kernel, signature, constexprs, {})
    compiled = triton.compile(src, target=target, options=options.__dict__)
    dump = inspect_cubin(compiled, OPCODES)
    return {
        "head_dim": head_dim,
        "causal": causal,
        "has_mask": has_mask,
        "accumulate_dq": accumulate_dq or dq_writer > 0,
        "dq_vec4": dq_vec4,
        "dq_writer": dq_writer,
        "warps": compiled.metadata.num_warps,
        "registers": dump["registers"],
        "spill_bytes": dump["local_bytes"],
        "shared_kb": compiled.metadata.shared / 1024,
        "setmaxnreg": sorted(set(_setmaxnreg_values(compiled.asm["ptx"]))),
        **{op: dump[op] for op in OPCODES},
    }


def _setmaxnreg_values(ptx: str) -> list[str]:
    return [
        line.split()[0] + " " + line.split()[1] for line in ptx.splitlines() if "setmaxnreg" in line
    ]


def _kernel_times(fn, names: tuple[str, ...]) -> dict[str, float]:
    """Mean CUDA time (ms) per call of the kernels whose names contain each of ``names``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    calls = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = dict.fromkeys(names, 0.0)
    for event in prof.key_averages():
        for name in names:
            if name in event.key:
                times[name] += event.device_time_total / 1000 / calls
    return times


def check_and_time(seqlens: list[int], mask_names: list[str], tokens: int, hidden: int) -> None:
    """dQ/dK/dV against the Triton backward and the timings, per sequence length and mask."""
    from dataclasses import replace

    from flashmask import bench, kernels, masks

    d = 128
    for s in seqlens:
        b, h = max(1, tokens // s), hidden // d
        q, k, v, dout = (
            torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        scale = d**-0.5
        for name in mask_names:
            if name in ("full", "causal"):
                mask, sri, causal = None, None, name == "causal"
            else:
                gen = torch.Generator().manual_seed(0)
                mask = masks.example(name, s, batch_size=b, generator=gen)
                sri, causal = mask.startend_row_indices.to("cuda"), mask.causal
            pairs = bench.visible_pairs(mask, causal, s, s)
            flop = 10.0 * d * int(pairs.sum()) * h * (b // pairs.shape[0])  # 5 matmuls
            out, lse = kernels.forward(q, k, v, sri, causal, scale)

            def triton_bwd(cfg=None):
                return kernels.backward(
                    dout, None, q, k, v, out, lse, sri, causal, scale, True, config=cfg
                )

            ref = triton_bwd()
            ms = triton.testing.do_bench(triton_bwd, rep=100)
            line = f"S={s} {name:16s} triton bwd {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s)"
            unfused = replace(
                kernels.tile_config(d, has_mask=sri is not None), fused_backward=False
            )
            split = _kernel_times(
                lambda c=unfused: triton_bwd(c),
                ("dkdv_kernel", "dq_kernel", "delta_kernel"),
            )
            line += " [unfused: " + ", ".join(f"{n} {t:.3f}" for n, t in split.items()) + "]"
            variants = (
                ("gluon +atomic dq v4", True, True, 0),
                ("gluon +dq writer 4w", True, False, 4),
                ("gluon +dq writer 2w", True, False, 2),
                ("gluon dkdv", False, False, 0),
            )
            for label, acc_dq, vec4, writer in variants:
                try:
                    grads = gluon_backward(
                        dout, q, k, v, out, lse, sri, causal, scale, acc_dq, vec4, dq_writer=writer
                    )
                except Exception as exc:  # report and go on
                    line += f" | {label}: {type(exc).__name__}: {str(exc)[:300]}"
                    continue
                errs = []
                for got, want, n in zip(grads, ref, "qkv", strict=True):
                    if got is None:
                        continue
                    scale_ref = float(want.float().abs().max()) or 1.0
                    errs.append(
                        f"d{n} {float((got.float() - want.float()).abs().max()) / scale_ref:.1e}"
                    )
                g_ms = triton.testing.do_bench(
                    lambda a=acc_dq, v4=vec4, w=writer: gluon_backward(
                        dout, q, k, v, out, lse, sri, causal, scale, a, v4, dq_writer=w
                    ),
                    rep=100,
                )
                tflops = flop / g_ms / 1e9
                line += f" | {label} {g_ms:.3f} ms ({tflops:.0f} TF/s) rel err {' '.join(errs)}"
                if not acc_dq:
                    kt = _kernel_times(
                        lambda: gluon_backward(dout, q, k, v, out, lse, sri, causal, scale, False),
                        ("gluon_bwd_kernel",),
                    )["gluon_bwd_kernel"]
                    line += f" (kernel {kt:.3f} ms; + triton dq {kt + split['dq_kernel']:.3f})"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument(
        "--masks", default="full,causal,causal_document,share_question,document,sliding_window"
    )
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    if args.compile_only:
        for d in (64, 128):
            for causal in (False, True):
                for has_mask in (False, True):
                    for acc_dq, vec4, writer in (
                        (True, True, 0),
                        (True, False, 0),
                        (False, False, 0),
                        (True, False, 4),
                        (True, False, 2),
                    ):
                        report = compile_only(d, causal, has_mask, acc_dq, vec4, writer)
                        print(json.dumps(report), flush=True)
        return
    seqlens = [int(x) for x in args.seqlens.split(",")]
    check_and_time(seqlens, args.masks.split(","), args.tokens, args.hidden)


if __name__ == "__main__":
    main()
