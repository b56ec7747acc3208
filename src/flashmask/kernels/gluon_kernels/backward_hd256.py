"""Warp-specialised backward for Hopper (sm_90) at head dim 256, and at multi-head latent
attention's 192 (Q/K) with 128 (V), written in Gluon: dK, dV and dQ in one pass, dQ added
through TMA reduce-adds (fp32, not bit-reproducible: the launcher uses it only for
``deterministic=False``).

The head-dim-128 kernel's layout (``backward``: each of two consumer warpgroups owns 64 of a
program's 128 keys with the whole head dim of dK and dV) does not carry over: at D = 256 those
two accumulators alone would take 256 registers per thread. Here a program owns ``BLOCK_N = 64``
keys and the warpgroups split the work the other way:

* ``S^T = K Q^T`` and ``dP^T = V dO^T`` ([64 keys, 64 queries], the head dim reduced): each
  warpgroup computes the columns of 32 queries, then ``P^T`` and ``dS^T`` (fp32, as the Triton
  kernels) for them, and stores both as bf16/fp16 into shared memory;
* after a barrier, each warpgroup owns half the head dim: ``dV_half += P^T dO_half``,
  ``dK_half += dS^T Q_half`` (64 + 64 accumulator registers) and ``dQ_half = dS K_half``, all
  with both operands in shared memory; the dQ tile goes to the writer warps, dK/dV are stored
  at the end (through the K/V buffers and TMA stores with a mask, from registers without one).

A logit cap (``SOFTCAP > 0``) is ``backward``'s: ``P^T`` from the capped scores, ``dS^T`` times
the cap's derivative.

Shared memory: K and V 32 KB each, one Q/dO slot 64 KB (two would not fit), ``P^T``/``dS^T``
double-buffered 32 KB, one 64x256 fp32 dQ buffer 64 KB: 224 KB.

At 192 / 128 the kernel runs with Q and K zero-padded to 256 columns (TMA tiles and Gluon's
descriptors take powers of two; the zero columns add nothing to the scores, and dQ's and dK's
extra columns are dropped) and V, dO and dV 128 wide (each warpgroup's dV half 64 columns):
23% more products than 192 would need, 20% fewer than 256 / 256. The producer warp (here staging
each tile's lse ready to use), the dQ writer, the barrier protocol and the tile-list walk
(column-major lists at 64x64 tiles) are ``backward``'s, and so is the launcher
(``backward_launch``); this backward never splits the query rows.

Measured on the H200 against the Triton hd256 backward: 1.43-1.69x on full, causal and four
interval masks at 8K and 32K (``docs/performance.md``). Import this module only where the
interpreter is off (Gluon has none).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashmask.kernels.config import GLUON_BWD256_KEYS
from flashmask.kernels.gluon_kernels import backward_launch
from flashmask.kernels.gluon_kernels.backward import (
    _bwd_dq_writer_partition,
    _bwd_load_partition,
    _partition_barrier,
    allocate_operands,
    allocate_rings,
    await_tile,
    consumer_head,
    hand_dq_to_writer,
    issue_scores,
    transposed_probabilities,
    write_dk_dv,
)
from flashmask.kernels.gluon_kernels.forward import launched_program
from flashmask.kernels.tiles import TileLists

BLOCK_M = backward_launch.BLOCK_M  # queries per tile
BLOCK_N = GLUON_BWD256_KEYS  # keys per program
# One Q/dO slot and one fp32 dQ buffer: 224 KB with K, V and the P^T/dS^T buffers.
NUM_BUFFERS = 1
DQ_BUFFERS = 1
# The Q/K head dim the kernel runs at: 192 (MLA) pads to it, as TMA tiles take powers of two.
KERNEL_HEAD_DIM = 256


@gluon.jit
def _tile_products(
    k_smem, q_smem, do_smem, pt_bufs, ds_bufs, st, dpt, entry, rows, keys, lse, delta_row, lts,
    lte, uts, ute, causal_offset, dk, dv, zero_dq, it, qk_scale,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
):  # fmt: skip
    """One tile (list ``entry``, query rows ``rows`` with their ``lse``) from its issued scores
    ``st``/``dpt``: ``P^T`` and ``dS^T`` (fp32, this warpgroup's query columns) into shared
    memory, then ``dV += P^T dO``, ``dK += dS^T Q`` and ``dQ = dS K`` issued (asynchronous, not
    awaited): ``(dv, dk, dq)`` pending. The rows' delta is read from the producer's staged
    ``delta_row`` where it is used; ``SOFTCAP > 0``: the forward's logit cap."""
    dtype: gl.constexpr = k_smem.dtype
    query_layout: gl.constexpr = rows.type.layout
    scores = warpgroup_mma_wait(1, deps=(st,))
    pt, gt = transposed_probabilities(
        scores, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, causal_offset, HAS_MASK,
        HAS_UPPER, CAUSAL, SOFTCAP,
    )  # fmt: skip
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    delta = delta_row.load(query_layout)
    dst = gt * (dpt - delta[None, :])
    # Each warpgroup's query columns of P^T and dS^T; the buffer written here was last read two
    # tiles ago, before the previous tile's barrier.
    pt_smem = pt_bufs.index(it % 2)
    ds_smem = ds_bufs.index(it % 2)
    pt_smem.store(pt.to(dtype))
    ds_smem.store(dst.to(dtype))
    fence_async_shared()
    _partition_barrier()  # both warpgroups' columns in place
    dv = warpgroup_mma(pt_smem, do_smem, dv, is_async=True)
    dk = warpgroup_mma(ds_smem, q_smem, dk, is_async=True)
    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
    return dv, dk, dq


@gluon.jit
def _bwd256_compute_partition(
    k_smem, v_smem, q_bufs, do_bufs, pt_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full,
    dq_empty, entries_ptr, counts_ptr, bounds_ptr, dk_ptr, dv_ptr, b, h_kv, n_tile, seqlen_q,
    seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    stride_kb, stride_ks, stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs, dk_desc,
    dv_desc,
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
    """Consumer warpgroups: scores and softmax gradients split by queries, the three
    accumulating products split by head dim (module docstring); ``lse_bufs``/``delta_bufs``
    hold the producer's rows (the lse ready to use); dK/dV stored through
    ``dk_desc``/``dv_desc`` with ``DKDV_TMA``, else from registers (added to what they hold with
    ``ADD_DKDV``); ``SOFTCAP > 0``: the forward's logit cap."""
    groups: gl.constexpr = gl.num_warps() // 4
    # [BLOCK_N keys, BLOCK_M queries]: one warpgroup's 64 rows; the warpgroups split the queries.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, BLOCK_M // groups, 16]
    )
    # dK [BLOCK_N, HEAD_DIM], dQ [BLOCK_M, HEAD_DIM] and dV [BLOCK_N, V's head dim]: the
    # warpgroups split the head dims.
    head_dim_v: gl.constexpr = v_smem.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, HEAD_DIM // groups, 16]
    )
    acc_v_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, head_dim_v // groups, 16]
    )
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    keys = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    offs_m = gl.arange(0, BLOCK_M, query_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, head_dim_v], gl.float32, acc_v_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    causal_offset = seqlen_k - seqlen_q

    mbarrier.wait(kv_bar, 0)
    it = 0
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
            rows = m_tile * BLOCK_M + offs_m
            # Read before the tile's products are issued: the first use of its registers is the
            # exponent, after the scores' wait.
            lse = lse_bufs.index(slot).load(query_layout)
            delta_row = delta_bufs.index(slot)
            st, dpt = issue_scores(k_smem, v_smem, q_smem, do_smem, zero_st)
            dv, dk, dq = _tile_products(
                k_smem, q_smem, do_smem, pt_bufs, ds_bufs, st, dpt, entry, rows, keys, lse,
                delta_row, lts, lte, uts, ute, causal_offset, dk, dv, zero_dq, it, qk_scale,
                HAS_MASK, HAS_UPPER, CAUSAL, SOFTCAP,
            )  # fmt: skip
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            mbarrier.arrive(empty.index(slot), count=1)
            hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale)
            it += 1

    # With DKDV_TMA each warpgroup overwrites only its own head-dim half of K and V, which only
    # its own (awaited) dQ product still read after the last tile's barrier; the TMA form's
    # meeting before the stores is one barrier more than this needs.
    write_dk_dv(
        dk, dv, k_smem, v_smem, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_k,
        stride_kb, stride_ks, stride_kh, softmax_scale, ADD_DKDV, DKDV_TMA,
    )  # fmt: skip


@gluon.jit
def gluon_bwd256_kernel(
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
    """Grid ``(key tiles, kv heads, batch)``, arguments as ``backward.gluon_bwd_kernel``'s
    (``stride_dq*`` unused likewise): dK and dV (sharing K's strides; with ``DKDV_TMA`` through
    ``dk_desc``/``dv_desc``, else stored from registers and ``None``) and dQ added to the fp32
    accumulator through ``dq_desc``."""
    dtype: gl.constexpr = q_desc.dtype
    n_tile, h_kv, b = launched_program(order_ptr, num_n_tiles, num_heads_q // heads_per_kv, ORDERED)

    k_smem, v_smem, q_bufs, do_bufs = allocate_operands(
        q_desc, k_desc, v_desc, do_desc, BLOCK_N, NUM_BUFFERS
    )
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    pt_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    kv_bar, ready, empty, dq_bufs, dq_full, dq_empty, lse_bufs, delta_bufs = allocate_rings(
        dq_desc, BLOCK_M, HEAD_DIM, NUM_BUFFERS, DQ_BUFFERS
    )
    # The consumers are the default partition; the producer warp and the dQ writer warps the
    # workers (``backward``'s).
    gl.warp_specialize(
        [
            (
                _bwd256_compute_partition,
                (
                    k_smem, v_smem, q_bufs, do_bufs, pt_bufs, ds_bufs, dq_bufs, kv_bar, ready,
                    empty, dq_full, dq_empty, entries_ptr, counts_ptr, bounds_ptr, dk_ptr,
                    dv_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, heads_per_kv,
                    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_kb,
                    stride_ks, stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs,
                    dk_desc, dv_desc, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM,
                    ADD_DKDV, DKDV_TMA, SOFTCAP,
                ),
            ),
            (
                _bwd_load_partition,
                (
                    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                    ready, empty, entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k,
                    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
                    lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q, BLOCK_M, BLOCK_N,
                    HEAD_DIM, True,
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
    """``(dq, dk, dv)`` as ``backward.backward``, at head dim 256, or 192 with V's 128
    (``lists``: column-major at ``BLOCK_M x BLOCK_N`` = 64x64 tiles; ``softcap``: the forward's
    logit cap, 0.0 for none; ``dq_accumulator`` at 256 only: at 192 the kernel adds dQ into a
    padded one of its own)."""
    head_dim = q.shape[-1]
    if head_dim != KERNEL_HEAD_DIM:
        if dq_accumulator is not None:
            raise ValueError(f"dq_accumulator: none at head dim {head_dim} (padded to 256)")
        pad = (0, KERNEL_HEAD_DIM - head_dim)
        q, k = torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad)
    # dK/dV through TMA stores with a mask only: without one they measured mixed at 256. With
    # V's own head dim always (the stores from registers share dK's offsets).
    dkdv_tma = bounds is not None or v.shape[-1] != q.shape[-1]
    dq, dk, dv = backward_launch.launch(
        gluon_bwd256_kernel, BLOCK_N, NUM_BUFFERS, DQ_BUFFERS,
        dout, q, k, v, lse, delta, bounds, lists, num_mask_heads, causal, softmax_scale,
        dkdv_tma=dkdv_tma, order=order, dq_accumulator=dq_accumulator,
        softcap=softcap,
    )  # fmt: skip
    if head_dim != KERNEL_HEAD_DIM:
        dq, dk = dq[..., :head_dim].contiguous(), dk[..., :head_dim].contiguous()
    return dq, dk, dv


def one_launch(q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool) -> bool:
    """Always: this backward never splits the query rows (``backward.one_launch``)."""
    return True
