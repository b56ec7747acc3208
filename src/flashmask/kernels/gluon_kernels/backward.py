"""Warp-specialised backward for Hopper (sm_90), written in Gluon: dK, dV and dQ in one pass, dQ
added with fp32 atomics (not bit-reproducible: the launcher uses it only for
``deterministic=False``).

FlashAttention-3's backward shape; see ``benchmarks/NOTES.md`` (sixth session) for how it was
measured and why each part is there:

* grid ``(key tiles, kv heads, batch)``; one program owns ``BLOCK_N = 128`` keys, which its two
  consumer warpgroups split (64 keys each), and walks the column-major tile list of every query
  head that shares the kv head (GQA summed in registers, as the Triton dK/dV pass does);
* one producer warp loads K and V once, then each listed query tile's Q and dO into a ring of
  ``NUM_BUFFERS`` shared slots guarded by "ready"/"empty" mbarriers, and beside each slot the
  tile's lse and delta rows (``ROW_TERMS_SMEM``; the consumers read them from shared memory);
* the consumers compute, per 64-row query tile, ``S^T = K Q^T`` and ``dP^T = V dO^T``
  (asynchronous ``warpgroup_mma``, both issued before the first is awaited), ``P^T`` from the
  forward's lse, the element mask on the list's partial tiles (the column bounds belong to the
  program's keys, so they are loaded once per head), ``dV += P^T dO`` and ``dK += dS^T Q`` with
  ``P^T`` / ``dS^T`` as register operands, and ``dQ = dS K`` from ``dS^T`` stored in shared
  memory (two buffers alternate, one barrier per tile): five matmuls per tile where the Triton
  backward's separate dQ pass needs seven;
* the consumers leave each scaled fp32 dQ tile in a ring of two shared buffers ("dq_full" /
  "dq_empty" mbarriers); two writer warps add it to the fp32 dQ buffer with TMA reduce-adds
  (``cp.reduce.async.bulk.tensor``, one thread issuing each, as FlashAttention-3; ``DQ_TMA``),
  or, with ``DQ_TMA`` off (kept for measurement), with one 16-byte ``red.global.v4.f32.add``
  per four columns (inline PTX: Triton emits scalar atomics, scattered over the MMA layout). The
  producer and writer warps make one warpgroup, so the consumers keep 240 registers through
  ``setmaxnreg``;
* at the end the consumers stage dK and dV in the K/V tiles' buffers and store each with one
  TMA store (``DKDV_TMA``; plain causal and a query chunk's fp32 sums store from registers).

At head dim 256 ``kernels.gluon_bwd256`` splits the work differently and reuses this module's
partitions, helpers and launcher. Long full attention runs in chunks of query rows
(:func:`launch`, ``kernels.query_chunks``), so that a head's Q, dO and dQ stay in L2.

Measured on the H200 (hd128, bf16; ``results/gluon_backward_late_dq{,_precise}_s12.log``):
1.36x / 1.40x the Triton backward on full / causal at 32K (40.8 / 20.3 ms, 539 / 543 TFLOP/s),
1.08-1.33x on four interval masks at 32K, 1.03-1.08x on the two sparsest at 8K (the first
version, sixth session: 1.07-1.19x, ``results/gluon_backward_s6c.log``). Descriptors are 2-D
over ``[B * S, H * D]``, so it needs the inputs ``kernels.gluon_backward_eligible`` accepts.
Gluon has no CPU interpreter: the CPU suite compiles it for sm_90, the H200 check
(``benchmarks/gpu_check.py``, its ``det=False`` cases) proves its results. Import this module
only where the interpreter is off.
"""

from __future__ import annotations

import functools

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

from flashmask.kernels import query_chunks
from flashmask.kernels.config import GLUON_BWD_KEYS, GLUON_BWD_QUERIES
from flashmask.kernels.gluon_kernels.forward import (
    LOG2E,
    LOG2E_VALUE,
    hide_pairs,
    launched_program,
    load_column_bounds,
    publish_item,
    receive_item,
    require_form,
    shared_layout,
    sm_count,
    tma_load,
    tma_store,
    wgmma_layout,
    work_item,
)
from flashmask.kernels.gluon_kernels.forward import partition_barrier as _partition_barrier
from flashmask.kernels.launch import launch_kernel
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

BLOCK_M = GLUON_BWD_QUERIES
BLOCK_N = GLUON_BWD_KEYS
# Q/dO slots and fp32 dQ buffers (32 KB each at D = 128; 224 KB in all with K, V and dS^T).
# Read when a call launches, so a benchmark can try 3 + 1 (``gluon_backward.py --buffers``).
NUM_BUFFERS = 2
DQ_BUFFERS = 2
NUM_WARPS = 8
WRITER_WARPS = 2
WRITER_REGISTERS = 24
# The dQ writer adds each tile with TMA reduce-adds (the fp32 tile in an NVMMA-swizzled shared
# buffer, ``cp.reduce.async.bulk.tensor``: four per 64x128 tile, each issued by one thread)
# instead of 16-byte ``red.global`` adds from two warps (2048 per tile, 32 per thread):
# FlashAttention-3's dQ path. Measured on the H200 (``results/gluon_backward_variants_s9.log``):
# 2.0-3.6% faster at 32K on full, causal and four masks, 1.5-2.0% at 8K on the two sparsest;
# checked with ``gpu_check.py --gluon-bwd DQ_TMA=1`` (``results/gpu_check_dq_tma_s9.json``).
# False (the ``red.global`` writer) is kept for measurement (``--variant DQ_TMA=0``).
DQ_TMA = True
# 12 warps at launch (8 consumers; producer + writers + one idle warp as one warpgroup).
MAX_REGISTERS = 168
# The producer also loads each listed query tile's lse and delta rows (``BLOCK_M`` fp32 each)
# while the tile's TMA copies run and leaves them in shared memory beside its Q/dO slot; a
# second arrival on the slot's "ready" barrier releases them. The consumers read them there
# instead of with 32 scalar global loads per thread and tile issued right after the tile's
# score products, which the ninth session's profile showed as 38% of stall cycles on L1TEX
# loads. Same values, same arithmetic: dK/dV bitwise equal to the unstaged kernel's. Measured
# on the H200 (``results/gluon_backward_row_terms{,_modes}_s11.log``): 1.06-1.12x the unstaged
# kernel at hd128 on six masks at 8K and 32K (full 32K: 46.3-46.5 -> 42.2-42.6 ms). Forms: 0 off
# (kept for measurement), 1 (default) lse read with ``LDS`` after the tile's products are
# issued and converted by the consumers, 2 lse staged ready to use and read before they are
# issued (``gluon_bwd256``'s default; at hd128 3.5% slower than 1 on causal, equal elsewhere).
# Reading delta once the scores are in as well (a third form) lost up to 10% (document 32K).
ROW_TERMS_SMEM = 1
# Each query chunk's launch (``kernels.query_chunks``) after the first adds its dK/dV into the
# first chunk's fp32 sums in the kernel (``ADD_DKDV``: a load and an add before each program's
# final store) instead of storing fp32 partial sums that the launcher then adds: 2 GB less peak
# memory at 128K hd128 with 16 heads. Measured on the H200
# (``results/gluon_backward_chunks_add{,_128k}_s12.log``): 128K full 647.2 -> 645.7 ms, the same
# error against the Triton backward as the launcher's sums (dK 2.3e-3, dV 3.3e-3; not bitwise
# equal to them: the scale and the add fuse into one rounding). False: the launcher's sums.
CHUNKS_ADD_IN_KERNEL = True
# Each tile's dQ is stored for the writer as soon as the tile's products are in, but handed
# over (fence, barrier, arrive) only after the next tile's ``S^T``/``dP^T`` products are issued,
# so that the barrier runs under them instead of with the tensor pipe drained (``LATE_DQ``; 0:
# in place, kept for measurement; 1: the hand-off late; 2, the default: the tile's Q/dO slot
# released there too, sharing that barrier, so the loop's tail has none). Same values, same
# order of the writer's adds: dK/dV bitwise equal. Measured on the H200 against 0
# (``results/gluon_backward_late_dq_s12.log``): form 2 at hd128 1.003-1.04x on six masks at 8K
# and 32K (causal 32K 20.92 -> 20.06 ms), except share_question 32K (0.99x); at hd64 1.05-1.11x
# except full 32K (0.99x). Carrying the dQ tile itself in registers into the next tile (its
# stores under the products too) made ptxas serialise every wgmma and spill at hd128 (offline,
# Triton 3.6). Releasing the slot through the dQ hand-off itself (one consumer barrier fewer at
# the top of the tile step) was neutral at hd128 (-0.9% to +1.2%) and mixed at hd64 (causal 32K
# +2.8%, full 32K -4.1%); moving that hand-off to the dS^T barrier lost 5-12% (the producer
# waits for slots released later in the tile). Measured and removed in the nineteenth session
# (``results/gluon_backward_release_with_dq{,_hd64}_s19.log``).
LATE_DQ_HANDOFF = 2
# dK's product issued after dQ's (``_bwd_compute_partition``), so that the dQ tile is stored for
# the writer while dK runs: FlashAttention-3's and -4's order. dK/dV are the same products in
# the same order (bitwise equal to the other order's). Measured on the H200 against dK before
# dQ (``results/gluon_backward_dq_before_dk_s18.log``, hd128): full 32K 40.00 -> 38.94 ms,
# causal 32K 19.73 -> 19.46, document 32K 5.90 -> 5.80; within +-0.6% on the sparse 8K/32K
# masks. In the eighth session, before dQ went through TMA reduce-adds and before the late
# hand-off, the same order had lost 6% on 32K full (change 18). False: dK first (measurement).
DQ_BEFORE_DK = True
# dK and dV leave through shared memory and two TMA stores (``store_dk_dv_tma``, into the K/V
# tiles' buffers, free once both warpgroups' last products are in) instead of 2- or 4-byte
# stores of one or two elements from the MMA layout: on 8K sliding_window (lists of ~10 tiles)
# those stores held 10% of the backward's warp samples, most throttled on the store queue
# (``results/ncu_backward_source_sw8k_s19.csv.gz``). Where dK/dV are in the inputs' dtype and
# not added to (a query chunk's fp32 partial sums keep the stores). The same values: bitwise
# equal. Measured on the H200 against the stores from registers
# (``results/gluon_backward_dkdv_tma{,_hd64}_s19.log``): hd128 8K sliding_window 1.213 ->
# 1.116 ms, 32K share_question 2.254 -> 2.116, causal_document 3.211 -> 3.096, sliding_window
# 3.068 -> 2.958; hd64 2-7% on the sparse masks; full +0.4% / +0.9% (hd128 / hd64, 1 s per
# measurement). Plain causal (no mask) lost 1.2-1.6% at hd128 in three runs
# (``results/gluon_backward_dkdv_tma{,_precise_hd128,_long}_s19.log``), so it keeps the stores
# from registers: 2 (the default) is TMA stores except for plain causal, 1 everywhere, 0 nowhere
# (both for measurement).
DKDV_TMA = 2
# Programs per launch: 0, one per work item (a key tile of a kv head and batch), the grid
# ``(key tiles, kv heads, batch)``; 1, one per SM, each looping over items taken from a
# counter in the launch order, so that an item's first Q/dO tiles load while the previous
# item's last compute and no program is launched, set up and torn down per item (the
# persistent forward's saving, ``gluon_fwd.PERSISTENT``). The next item's K and V still load
# only after the previous item's dK/dV are stored out of their buffers (shared memory has no
# room for a second K/V pair at hd128: 225.5 of 227 KB). The same products in the same order
# per item: dK/dV bitwise equal to the other form's. Measured on the H200 against one program
# per item (twenty-fifth session, ``results/gluon_backward_persistent{,_32k}_s25.log``):
# 0.97-1.03x on 12 masks at 8K and five at 32K, inside the A/B noise (hd64 8K: 0.98-1.04x,
# ``results/gluon_backward_persistent_hd64_s25.log``): the ~6 us an item costs
# beyond its tiles is its serial fill and drain, which this form still serialises, not the
# launch. Off; kept as the base for overlapping the next item's K/V where shared memory allows.
# A form 2 that also converted dQ in the kernel (conversion units as slots among the items,
# each waiting on its kv head's count of finished items) was correct but, at its best lag,
# 3-7% slower than this one at 8K on sliding_window, share_question and causal_document, 12%
# on global_sliding_window (47-59% at the shortest lag), -1% to +6% on document between two
# runs, level on full and the dense masks (twenty-ninth session,
# ``results/gluon_backward_convert*_s29.log``): removed, last version in commit 89db9b2.
PERSISTENT = 0
# With PERSISTENT, at most this many programs (0: one per SM). For checks: the GPU check's
# cases have fewer key tiles than the H200 has SMs, so only a smaller grid makes them loop
# (``benchmarks/gpu_check.py --gluon-bwd PERSISTENT=1,MAX_PROGRAMS=3``).
MAX_PROGRAMS = 0
# With PERSISTENT: release an item's K/V buffers as soon as its last products are in, and stage
# its dK/dV for their TMA stores in the dQ buffer the writer has freed and the dS^T buffers
# instead of in the K/V buffers, so that the next item's K/V load during this item's drain; the
# producer also loads the next item's first Q/dO tile before its K/V and takes the next item
# before an item's loads. The phase stamps (TIMELINE, ``results/bwd_timeline_s30.log``) put an
# 8K sliding-window item's K/V wait, after the drain, at ~1.2 us of ~29.5. Measured on the H200
# (thirtieth session, ``results/gluon_backward_early_kv*_s30.log``, dK/dV bitwise equal;
# ``results/gpu_check_gluon_bwd_early_kv_s30.json``: 243/243): the K/V wait went (1.08 ->
# 0.33 us) and the drain shortened (2.15 -> 1.28), but the gap before the next item grew (0.34
# -> 0.90), so the time outside an item's loop fell from 4.2 to 3.0 us and the backward only
# 1.5-2.5% on 8K sliding_window, within the A/B noise elsewhere. Off (it needs PERSISTENT).
# Needs two dQ buffers. A second form, the dQ writer warps issuing the staged dK/dV stores,
# took the gap back to 0.35 us but moved the time into the next K/V wait (1.8-2.0 us): from an
# item's last products to its successor's K/V in stays ~2.6 us whoever issues the stores, and
# 32K document lost 16-19% in two runs (thirty-first session,
# ``results/{gluon_backward,bwd_timeline}_early_kv2_s31.log``): removed, last in commit b78e2d4.
EARLY_KV_RELEASE = 0
# 1: no zeroed fp32 dQ accumulator. Each dQ tile's first writer claims it (a compare-and-swap
# on a per-tile flag, ``[B, H, query tiles]`` int32, which the row-term kernel zeroes instead of
# the accumulator's 268 MB at 8K x 16 heads x batch 4) and stores its tile; the others wait for
# that store to complete (flag 2) and add theirs; the conversion writes zeros for tiles nobody
# wrote (flag 0). The row-term kernel was 135 us of an 8K sliding-window call's 1.55 ms against
# flex's 65 (``results/kernel_times_s31.log``). Only where one launch covers all query rows
# (:func:`one_launch`) and dQ goes through TMA (``DQ_TMA``). 2: the same, each tile claimed
# before the consumers hand it to the writer (the claim's round trip under their compute).
# Measured on the H200 (thirty-first session, ``results/gluon_backward_first_store*_s31.log``;
# GPU check with form 1 243/243, ``results/gpu_check_gluon_bwd_first_store_s31.json``; 240
# repeated calls per form without a lost update, ``results/dq_first_store_stress*_s31.log``):
# within the A/B's +-3% on 12 cases in three runs, 8K sliding_window -1.5% (form 1) and -3%
# (form 2), 32K document +9% once (form 2). Off.
DQ_FIRST_STORE = 0
# A diagnostic (``benchmarks/bwd_timeline.py``): an int64 tensor of at least ``[items,
# TIMELINE_FIELDS]`` into which each work item's consumers write when its phases end (see
# :func:`_stamp`); ``None`` (the default) compiles none of it, so the kernel is the same.
TIMELINE: torch.Tensor | None = None
# Per item: SM clock (``%clock64``) at the item's start, once its K/V are in, once its first
# Q/dO tile is in, after its last tile's products, after its dK/dV stores; the SM's index; the
# item's tile count; the global nanosecond timer (``%globaltimer``) at its start and its end;
# with PERSISTENT, the SM clock once the consumers have the program's next item (0 without).
TIMELINE_FIELDS = 10
_TIMELINE_FIELDS = gl.constexpr(TIMELINE_FIELDS)


@gluon.jit
def _stamp(record, field: gl.constexpr, value):
    """With ``TIMELINE``: ``value`` (a ``[1]`` tensor of :func:`_clock` and kin) into
    ``record[field]``, the item's row of the timeline."""
    layout: gl.constexpr = value.type.layout
    gl.store(record + field + gl.arange(0, 1, layout), value)


@gluon.jit
def _stamp_operand():
    """A ``[1]`` int32 zero, the operand the special-register reads below take (inline PTX is
    elementwise over its operands' shape)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.zeros([1], gl.int32, layout)


@gluon.jit
def _as_row(x):
    """The scalar ``x`` as a ``[1]`` int64 tensor for :func:`_stamp`."""
    return _stamp_operand().to(gl.int64) + x.to(gl.int64)


@gluon.jit
def _special_register_u64(ASM: gl.constexpr):
    """A 64-bit special register read by the inline PTX ``ASM`` (a ``mov``), ``[1]`` int64;
    not pure, so that each read stays where it is written."""
    return gl.inline_asm_elementwise(
        ASM, "=l,r", [_stamp_operand()], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _clock():
    """The SM's cycle counter (``%clock64``; comparable within one SM only), ``[1]`` int64."""
    return _special_register_u64("mov.u64 $0, %clock64;")


@gluon.jit
def _global_time():
    """The GPU's nanosecond timer (``%globaltimer``; comparable across SMs), ``[1]`` int64."""
    return _special_register_u64("mov.u64 $0, %globaltimer;")


@gluon.jit
def _sm_index():
    """The index of the SM the program runs on (``%smid``), ``[1]`` int64."""
    smid = gl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [_stamp_operand()], dtype=gl.int32, is_pure=False, pack=1
    )
    return smid.to(gl.int64)


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


@gluon.constexpr_function
def _vec4_layout(head_dim, warps):
    """Each thread four adjacent dQ columns, a warp whole rows (``32 * 4 // head_dim`` of them;
    above D = 128, 128 columns repeated along the row: ``gluon_bwd256``)."""
    lanes_d = min(head_dim // 4, 32)
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
def _bwd_load_partition(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, lse_bufs, delta_bufs, lse_ptr,
    delta_ptr, num_heads_q,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
):  # fmt: skip
    """Producer warp of a program that owns one key tile: :func:`_bwd_load_item` once."""
    _bwd_load_item(
        q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
        entries_ptr, counts_ptr, b, h_kv, n_tile, 0, seqlen_q, seqlen_k, heads_per_kv,
        heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, lse_bufs, delta_bufs,
        lse_ptr, delta_ptr, num_heads_q, kv_bar, 0, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_TERMS_SMEM,
        False,
    )  # fmt: skip


@gluon.jit
def _bwd_load_partition_persistent(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, kv_empty, ready,
    empty, items, item_ready, item_empty, next_item_ptr, order_ptr, num_items, entries_ptr,
    counts_ptr, seqlen_q, seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q,
    ORDERED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    EARLY_KV: gl.constexpr,
):  # fmt: skip
    """Producer warp of a persistent program (``PERSISTENT``): :func:`_bwd_load_item` for each
    of its work items (its own first, then each next one from the launch's counter
    ``next_item_ptr``, handed to the consumers and the dQ writer through the item ring), each
    item's K and V once the consumers have released the previous item's (``kv_empty``: read,
    and its dK/dV stored out of those buffers). The Q/dO ring's steps run on across items, so
    the next item's first tiles load while this one's last compute."""
    programs = gl.num_programs(0)
    # One program per item (the grid has them all): no counter to take the next from.
    dynamic = programs < num_items
    num_kv_heads = num_heads_q // heads_per_kv
    w = gl.program_id(0)
    t = 0
    it = 0
    while w < num_items:
        n_tile, h_kv, b = work_item(w, order_ptr, num_n_tiles, num_kv_heads, ORDERED)
        if EARLY_KV:
            # The next item first, published before this item's loads (the consumers, done
            # sooner with the K/V buffers released before the drain, had begun to wait ~1 us
            # before their next item; the later split, NOTES thirtieth session section 4,
            # showed that wait is not for this publication, which this order rules out). The
            # producer waits for the atomic before this item's first load, which waits for a
            # slot the previous item frees a tile before its end anyway.
            nxt = w + programs
            if dynamic:
                nxt = gl.atomic_add(next_item_ptr, 1, sem="relaxed") + programs
            publish_item(items, item_ready, item_empty, nxt, t)
        else:
            mbarrier.wait(kv_empty, (t & 1) ^ 1)
        it = _bwd_load_item(
            q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready,
            empty, entries_ptr, counts_ptr, b, h_kv, n_tile, it, seqlen_q, seqlen_k,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q, kv_empty, (t & 1) ^ 1, BLOCK_M,
            BLOCK_N, HEAD_DIM, ROW_TERMS_SMEM, EARLY_KV,
        )  # fmt: skip
        if not EARLY_KV:
            # The next item once this one's loads are issued (the last of them waited for a
            # slot the consumers release two tiles before the item's end, so the atomic's round
            # trip runs under those tiles).
            nxt = w + programs
            if dynamic:
                nxt = gl.atomic_add(next_item_ptr, 1, sem="relaxed") + programs
            publish_item(items, item_ready, item_empty, nxt, t)
        t += 1
        w = nxt


@gluon.jit
def _bwd_load_item(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    entries_ptr, counts_ptr, b, h_kv, n_tile, it, seqlen_q, seqlen_k, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, lse_bufs, delta_bufs, lse_ptr,
    delta_ptr, num_heads_q, kv_empty, kv_empty_phase,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    FIRST_TILE_BEFORE_KV: gl.constexpr,
):  # fmt: skip
    """Producer, one work item (key tile ``n_tile`` of kv head ``h_kv``, batch ``b``): K and V
    (``kv_bar``), then Q and dO of every listed query tile of every head sharing the kv head,
    the first into ring step ``it`` (with ``ROW_TERMS_SMEM`` also the tile's lse and delta rows
    into ``lse_bufs[slot]`` and ``delta_bufs[slot]``, loaded while the tile's copies run and
    released by a second arrival on its "ready" barrier). With ``FIRST_TILE_BEFORE_KV``
    (``EARLY_KV_RELEASE``) the first tile's Q/dO load first (its slot frees a tile before the
    previous item ends), then K and V once the consumers release their buffers (phase
    ``kv_empty_phase`` of ``kv_empty``). Returns the next item's first step."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    if not FIRST_TILE_BEFORE_KV:
        # :func:`_load_kv_tiles`'s work, written out: calling it computes the row before the
        # expect, which reorders the shipped kernel's SASS (checked on the H200 as it is).
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        kv_row = b * seqlen_k + n_tile * BLOCK_N
        tma_load(k_desc, [kv_row, h_kv * HEAD_DIM], kv_bar, k_smem)
        tma_load(v_desc, [kv_row, h_kv * HEAD_DIM], kv_bar, v_smem)
    tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    it = gl.to_tensor(it)  # a loop-carried value, also where the caller passes a literal
    first = it
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
            tma_load(do_desc, [row, h * HEAD_DIM], bar, do_bufs.index(slot))
            if ROW_TERMS_SMEM:
                # While the copies run: the rows, then the slot's second arrival ("ready"
                # counts two with ROW_TERMS_SMEM), lowered as a barrier of this warp and one
                # release-arrive, so the consumers' wait sees every lane's stores.
                rows = (b * num_heads_q + h).to(gl.int64) * seqlen_q + m_tile * BLOCK_M
                offs = rows + gl.arange(0, BLOCK_M, row_layout)
                lse = gl.load(lse_ptr + offs)
                if ROW_TERMS_SMEM == 2:
                    # Staged ready to use (base 2, +inf for a fully masked row): the consumers'
                    # first use of their registers is the exponent, after the scores' wait.
                    lse = base2_lse(lse)
                lse_bufs.index(slot).store(lse)
                delta_bufs.index(slot).store(gl.load(delta_ptr + offs))
                mbarrier.arrive(bar, count=1)
            # Two tests: the first is decided at compile time, the second at run time.
            if FIRST_TILE_BEFORE_KV:  # noqa: SIM102
                if it == first:
                    mbarrier.wait(kv_empty, kv_empty_phase)
                    _load_kv_tiles(
                        k_desc,
                        v_desc,
                        k_smem,
                        v_smem,
                        kv_bar,
                        b * seqlen_k + n_tile * BLOCK_N,
                        h_kv * HEAD_DIM,
                    )
            it += 1
    if FIRST_TILE_BEFORE_KV:  # noqa: SIM102
        if it == first:  # an item without tiles: its K/V only
            mbarrier.wait(kv_empty, kv_empty_phase)
            _load_kv_tiles(
                k_desc,
                v_desc,
                k_smem,
                v_smem,
                kv_bar,
                b * seqlen_k + n_tile * BLOCK_N,
                h_kv * HEAD_DIM,
            )
    return it


@gluon.jit
def _load_kv_tiles(k_desc, v_desc, k_smem, v_smem, kv_bar, row, col):
    """The work item's K and V tiles (rows ``row ...``, columns ``col ...`` of the 2-D views)
    into their buffers, completing ``kv_bar``."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [row, col], kv_bar, k_smem)
    tma_load(v_desc, [row, col], kv_bar, v_smem)


@gluon.jit
def _ptx_fence(ASM: gl.constexpr):
    """Run the fence or wait ``ASM`` (inline PTX without operands) in every thread of the
    partition (inline PTX in Triton is elementwise: a ``[1]`` dummy carries it)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    gl.inline_asm_elementwise(
        ASM + "\n\tmov.u32 $0, 0;", "=r,r", [gl.zeros([1], gl.int32, layout)],
        dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _claim_dq_tile(flag):
    """``DQ_FIRST_STORE``'s claim of a dQ tile: its ``flag``'s value before (0: this writer is
    the tile's first and now holds it, 1)."""
    return gl.atomic_cas(flag, 0, 1, sem="acq_rel", scope="gpu")


@gluon.jit
def _dq_first_store_or_add(dq_desc, coord, dq_smem, flag, old):
    """``DQ_FIRST_STORE``'s write of one dQ tile ``dq_smem`` at ``coord``, ``old`` the value
    :func:`_claim_dq_tile` found in ``flag``: the tile's first writer (0) stores it and, once
    the store has completed in global memory, publishes it (-> 2, release); every later writer
    waits for 2 (acquire; bounded: the first writer is running) and adds to it. Only the first
    writer waits on nothing, so no cycle of waits can form."""
    if old == 0:
        tma_store(dq_desc, coord, dq_smem)
        # Complete, not only read (``store_wait``'s ``.read``): the next writer adds to it.
        _ptx_fence("cp.async.bulk.wait_group 0;")
        _ptx_fence("fence.proxy.async.global;")
        _partition_barrier()  # the issuing thread's wait is behind every thread's release
        gl.atomic_xchg(flag, 2, sem="release", scope="gpu")
    else:
        while old != 2:
            old = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        # The async proxy's reduce is ordered after the generic acquire.
        _ptx_fence("fence.proxy.async.global;")
        tma_reduce_add(dq_desc, coord, dq_smem)


@gluon.jit
def _bwd_dq_writer_partition(
    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b, h_kv, n_tile,
    seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    stride_dqb, stride_dqs, stride_dqh, dq_flags, num_heads_q,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    FIRST_STORE: gl.constexpr,
):  # fmt: skip
    """dQ writer warps of a program that owns one key tile: :func:`_bwd_dq_writer_item` once."""
    _bwd_dq_writer_item(
        dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b, h_kv, n_tile, 0,
        seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
        stride_dqb, stride_dqs, stride_dqh, dq_flags, num_heads_q, BLOCK_M, HEAD_DIM, DQ_TMA,
        FIRST_STORE,
    )  # fmt: skip


@gluon.jit
def _bwd_dq_writer_partition_persistent(
    dq_bufs, dq_full, dq_empty, items, item_ready, item_empty, order_ptr, num_items,
    entries_ptr, counts_ptr, dq_ptr, dq_desc, seqlen_q, num_heads_q, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_dqb, stride_dqs,
    stride_dqh, dq_flags,
    ORDERED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    FIRST_STORE: gl.constexpr,
):  # fmt: skip
    """dQ writer warps of a persistent program: :func:`_bwd_dq_writer_item` for each of its
    work items (its own first, each next one from the producer's item ring)."""
    num_kv_heads = num_heads_q // heads_per_kv
    w = gl.program_id(0)
    t = 0
    it = 0
    while w < num_items:
        n_tile, h_kv, b = work_item(w, order_ptr, num_n_tiles, num_kv_heads, ORDERED)
        it = _bwd_dq_writer_item(
            dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b, h_kv,
            n_tile, it, seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
            num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, dq_flags, num_heads_q,
            BLOCK_M, HEAD_DIM, DQ_TMA, FIRST_STORE,
        )  # fmt: skip
        w = receive_item(items, item_ready, item_empty, t)
        t += 1


@gluon.jit
def _bwd_dq_writer_item(
    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b, h_kv, n_tile, it,
    seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    stride_dqb, stride_dqs, stride_dqh, dq_flags, num_heads_q,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    FIRST_STORE: gl.constexpr,
):  # fmt: skip
    """dQ writer, one work item: walk the producer's tile sequence from ring step ``it`` and add
    each tile's scaled dQ, which the consumers leave in the ``dq_bufs`` ring, to the fp32 buffer
    (with ``DQ_TMA`` through ``dq_desc``, its 2-D view ``[B * Sq, H * D]``; with
    ``FIRST_STORE`` stored by a tile's first writer, :func:`_dq_first_store_or_add`, its flags
    ``dq_flags`` ``[B, num_heads_q, num_m_tiles]``). Returns the next item's first step."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    layout: gl.constexpr = _vec4_layout(HEAD_DIM, gl.num_warps())
    # Eight rows at a time (one period of the buffer's swizzle): few registers per thread.
    step: gl.constexpr = 8
    it = gl.to_tensor(it)  # a loop-carried value, also where the caller passes a literal
    for g in range(heads_per_kv):
        h, _, count, entries = _head_list(
            g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
            num_mask_heads, num_m_tiles, num_n_tiles,
        )  # fmt: skip
        dq_head = dq_ptr + b.to(gl.int64) * stride_dqb + h * stride_dqh
        for j in range(count):
            entry = gl.load(entries + j)
            m_tile = gl.where(entry >= 0, entry, -entry - 1)
            buf = it % num_dq_buffers
            dq_smem = dq_bufs.index(buf)
            if FIRST_STORE:
                flag = dq_flags + (b * num_heads_q + h) * num_m_tiles + m_tile
                if FIRST_STORE == 2:
                    # Claimed before the consumers hand the tile over: the atomic's round trip
                    # runs while they compute it.
                    old = _claim_dq_tile(flag)
            mbarrier.wait(dq_full.index(buf), (it // num_dq_buffers) & 1)
            if FIRST_STORE:
                if FIRST_STORE == 1:
                    old = _claim_dq_tile(flag)
                _dq_first_store_or_add(
                    dq_desc, [b * seqlen_q + m_tile * BLOCK_M, h * HEAD_DIM], dq_smem, flag, old
                )
                tma.store_wait(0)
            elif DQ_TMA:
                tma_reduce_add(dq_desc, [b * seqlen_q + m_tile * BLOCK_M, h * HEAD_DIM], dq_smem)
                # The reduce has read the buffer (not necessarily finished adding) before it is
                # handed back.
                tma.store_wait(0)
            else:
                for r in gl.static_range(0, BLOCK_M, step):
                    values = dq_smem.slice(r, step).load(layout)
                    _red_add_v4(dq_head, m_tile * BLOCK_M + r, stride_dqs, values)
            # Lowered as a barrier of the writer warps, then one arrive: all reads are done.
            mbarrier.arrive(dq_empty.index(buf), count=1)
            it += 1
    return it


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
def base2_lse(lse):
    """The forward's lse in base-2 units, +inf for a fully masked row (-inf), so that its
    ``P = exp2(S * qk_scale - lse)`` is zero."""
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@gluon.jit
def row_terms(lse_ptr, delta_ptr, row_base, rows):
    """``(lse, delta)`` of query rows ``rows`` (offset ``row_base`` into ``[B * H, Sq]``): the
    forward's lse in base-2 units, +inf for a fully masked row (-inf) so that its P is zero."""
    lse = base2_lse(gl.load(lse_ptr + row_base + rows))
    delta = gl.load(delta_ptr + row_base + rows)
    return lse, delta


@gluon.jit
def staged_lse(lse_bufs, slot, layout: gl.constexpr):
    """:func:`row_terms`'s lse of the tile in Q/dO slot ``slot`` from the rows the producer
    left in ``lse_bufs`` (``ROW_TERMS_SMEM``), in ``layout``: the same values. Its delta is read
    where it is used (``delta_bufs.index(slot).load``), so that it does not hold registers
    through ``P^T``."""
    return base2_lse(lse_bufs.index(slot).load(layout))


@gluon.jit
def transposed_probabilities(
    st, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, causal_offset,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    CAUSAL: gl.constexpr,
):  # fmt: skip
    """``P^T`` from the transposed scores ``st [keys, queries]`` and the rows' ``lse``, with the
    element mask of the keys' bounds applied on a partial tile (list ``entry >= 0``)."""
    num_keys: gl.constexpr = st.type.shape[0]
    num_queries: gl.constexpr = st.type.shape[1]
    layout: gl.constexpr = st.type.layout
    pt = gl.exp2(st * qk_scale - lse[None, :])
    if entry >= 0:
        hidden = hide_pairs(
            gl.zeros([num_keys, num_queries], gl.int1, layout), rows[None, :], keys[:, None],
            lts[:, None], lte[:, None], uts[:, None], ute[:, None], causal_offset, HAS_MASK,
            HAS_UPPER, CAUSAL,
        )  # fmt: skip
        pt = gl.where(hidden, 0.0, pt)
    return pt


@gluon.jit
def hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale, DQ_TMA: gl.constexpr):
    """Leave tile ``it``'s scaled dQ in the writer's ring once the writer has read what was left
    in that buffer before (``_bwd_dq_writer_partition``)."""
    stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale)
    publish_dq(dq_full, it, DQ_TMA)


@gluon.jit
def stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale):
    """Store tile ``it``'s scaled dQ into its buffer of the writer's ring once the writer has
    read what was left there before; :func:`publish_dq` hands it over."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    dq_buf = it % num_dq_buffers
    mbarrier.wait(dq_empty.index(dq_buf), ((it // num_dq_buffers) & 1) ^ 1)
    dq_bufs.index(dq_buf).store(dq * softmax_scale)


@gluon.jit
def publish_dq(dq_full, it, DQ_TMA: gl.constexpr, pred=True):
    """Hand tile ``it``'s dQ, stored by :func:`stage_dq`, to the writer (if ``pred``: a
    predicate rather than a branch, so that no branch sits between a product's issue and its
    wait)."""
    if DQ_TMA:
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
    hold (a query chunk's partial sums into the previous chunks', fp32: each program owns its
    keys, so no other program writes them during the launch)."""
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
def store_dk_dv_tma(dk, dv, k_smem, v_smem, dk_desc, dv_desc, row, col, softmax_scale):
    """:func:`store_dk_dv` without ``ADD`` through shared memory: the consumers' ``dk``
    (scaled) and ``dv`` into the K/V tiles' buffers, then one TMA store each to ``[row, col]`` of
    ``dk_desc``/``dv_desc`` (2-D ``[B * Sk, Hk * D]`` views, K's tile and layout)."""
    # The other warpgroup's last dQ product reads all of K (and its dV/dK products V's and
    # K's rows of its own keys only, but dQ's spans both halves): overwrite only once both
    # warpgroups' products are in.
    _partition_barrier()
    k_smem.store((dk * softmax_scale).to(k_smem.dtype))
    v_smem.store(dv.to(v_smem.dtype))
    fence_async_shared()
    _partition_barrier()  # every thread's rows are in place before the copies read them
    tma_store(dk_desc, [row, col], k_smem)
    tma_store(dv_desc, [row, col], v_smem)
    tma.store_wait(0)  # the copies have read the buffers before the program exits


@builtin
def _reinterpret(buffer, dtype, shape, layout, _semantic=None):
    """``buffer``'s shared memory seen as ``dtype`` ``shape`` in ``layout``: ``_reinterpret`` in
    Triton 3.6 (the H200's), ``reinterpret`` in later versions (what CI installs)."""
    method = getattr(buffer, "reinterpret", None) or buffer._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def stage_dk_dv_for_tma(
    dk, dv, dq_bufs, dq_empty, ds_bufs, k_smem, dk_desc, dv_desc, it, row, col, softmax_scale,
):  # fmt: skip
    """``EARLY_KV_RELEASE``'s :func:`store_dk_dv_tma`: the consumers' scaled ``dk`` and ``dv``
    staged, in the layout of K's tile ``k_smem``, in the dQ ring's buffer of step ``it`` (the next
    item's first: not the one holding this item's last dQ, and once the writer has read what it
    held, as that step's :func:`stage_dq` waits) and in the two dS^T buffers (free: every dQ
    product of the item is in), then one TMA store each to ``[row, col]``. Not awaited here: the
    next item waits for the copies to read the buffers before its first tile writes them."""
    num_dq_buffers: gl.constexpr = dq_bufs.type.shape[0]
    block_n: gl.constexpr = dk.type.shape[0]
    head_dim: gl.constexpr = dk.type.shape[1]
    dtype: gl.constexpr = ds_bufs.dtype
    kv_layout: gl.constexpr = k_smem.type.layout
    slot = it % num_dq_buffers
    mbarrier.wait(dq_empty.index(slot), ((it // num_dq_buffers) & 1) ^ 1)
    dk_smem = _reinterpret(dq_bufs.index(slot), dtype, [block_n, head_dim], kv_layout)
    dv_smem = _reinterpret(ds_bufs, dtype, [block_n, head_dim], kv_layout)
    dk_smem.store((dk * softmax_scale).to(dtype))
    dv_smem.store(dv.to(dtype))
    fence_async_shared()
    _partition_barrier()  # every thread's rows are in place before the copies read them
    tma_store(dk_desc, [row, col], dk_smem)
    tma_store(dv_desc, [row, col], dv_smem)


@gluon.jit
def write_dk_dv(
    dk, dv, k_smem, v_smem, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_k,
    stride_kb, stride_ks, stride_kh, softmax_scale,
    ADD: gl.constexpr,
    TMA: gl.constexpr,
):  # fmt: skip
    """The program's dK/dV leave: with ``TMA`` through :func:`store_dk_dv_tma` (its tile at
    row ``b * seqlen_k + n_tile * keys``, columns ``h_kv * D`` of the descriptors' 2-D views),
    else :func:`store_dk_dv` (``ADD`` as there)."""
    if TMA:
        block_n: gl.constexpr = dk.type.shape[0]
        head_dim: gl.constexpr = dk.type.shape[1]
        store_dk_dv_tma(
            dk, dv, k_smem, v_smem, dk_desc, dv_desc, b * seqlen_k + n_tile * block_n,
            h_kv * head_dim, softmax_scale,
        )  # fmt: skip
    else:
        store_dk_dv(dk, dv, dk_ptr, dv_ptr, b, h_kv, n_tile, stride_kb, stride_ks, stride_kh,
                    softmax_scale, ADD)  # fmt: skip


@gluon.jit
def _bwd_compute_partition(
    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full, dq_empty,
    entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc,
    b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles, stride_kb, stride_ks, stride_kh,
    qk_scale, softmax_scale, lse_bufs, delta_bufs, timeline_ptr,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    LATE_DQ: gl.constexpr,
    DQ_BEFORE_DK: gl.constexpr,
    DKDV_TMA: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups of a program that owns one key tile: :func:`_bwd_compute_item`
    once (with a ``timeline_ptr``, its row is the program's launch index)."""
    record = timeline_ptr
    if timeline_ptr is not None:
        launch_index = gl.program_id(0) + gl.num_programs(0) * (
            gl.program_id(1) + gl.num_programs(1) * gl.program_id(2)
        )
        record = timeline_ptr + launch_index.to(gl.int64) * _TIMELINE_FIELDS
    _bwd_compute_item(
        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full,
        dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        dk_desc, dv_desc, b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv,
        heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_kb, stride_ks,
        stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs,
        0, 0, kv_bar, record, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_TMA,
        ROW_TERMS_SMEM, ADD_DKDV, LATE_DQ, DQ_BEFORE_DK, DKDV_TMA, False, False,
    )  # fmt: skip


@gluon.jit
def _bwd_compute_partition_persistent(
    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, kv_empty, ready, empty, dq_full,
    dq_empty, items, item_ready, item_empty, order_ptr, num_items, entries_ptr, counts_ptr,
    bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc, seqlen_q, seqlen_k,
    num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
    stride_kb, stride_ks, stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs,
    timeline_ptr,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    LATE_DQ: gl.constexpr,
    DQ_BEFORE_DK: gl.constexpr,
    DKDV_TMA: gl.constexpr,
    ORDERED: gl.constexpr,
    EARLY_KV: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups of a persistent program: :func:`_bwd_compute_item` for each of its
    work items (its own first, each next one from the producer's item ring), the ``t``-th
    waiting for phase ``t & 1`` of the K/V barrier (with a ``timeline_ptr``, item ``w``'s row
    is ``w``)."""
    num_kv_heads = num_heads_q // heads_per_kv
    w = gl.program_id(0)
    t = 0
    it = 0
    while w < num_items:
        n_tile, h_kv, b = work_item(w, order_ptr, num_n_tiles, num_kv_heads, ORDERED)
        record = timeline_ptr
        if timeline_ptr is not None:
            record = timeline_ptr + w.to(gl.int64) * _TIMELINE_FIELDS
        it = _bwd_compute_item(
            k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full,
            dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
            dk_desc, dv_desc, b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv,
            heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, stride_kb, stride_ks,
            stride_kh, qk_scale, softmax_scale, lse_bufs, delta_bufs,
            it, t & 1, kv_empty, record, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM,
            DQ_TMA, ROW_TERMS_SMEM, ADD_DKDV, LATE_DQ, DQ_BEFORE_DK, DKDV_TMA, True, EARLY_KV,
        )  # fmt: skip
        w = receive_item(items, item_ready, item_empty, t)
        if record is not None:
            _stamp(record, 9, _clock())
        t += 1
    if EARLY_KV and DKDV_TMA:
        tma.store_wait(0)  # the last item's dK/dV stores have read their buffers


@gluon.jit
def _bwd_compute_item(
    k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full, dq_empty,
    entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc,
    b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head,
    num_mask_heads, num_m_tiles, num_n_tiles, stride_kb, stride_ks, stride_kh,
    qk_scale, softmax_scale, lse_bufs, delta_bufs, it, kv_phase, kv_empty, record,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    LATE_DQ: gl.constexpr,
    DQ_BEFORE_DK: gl.constexpr,
    DKDV_TMA: gl.constexpr,
    PERSISTENT: gl.constexpr,
    EARLY_KV: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups, one work item (key tile ``n_tile`` of kv head ``h_kv``, batch
    ``b``; its K/V barrier's phase ``kv_phase``; its first tile's ring step ``it``): dK and dV
    of its keys (with ``ADD_DKDV`` added to what ``dk_ptr``/``dv_ptr`` hold; with ``DKDV_TMA``
    stored through ``dk_desc``/``dv_desc``); each tile's dQ goes to the writer warps through
    ``dq_bufs`` (``lse_bufs``/``delta_bufs``: the producer's rows with ``ROW_TERMS_SMEM``). All
    five products of a tile are awaited within the tile: with ``DQ_BEFORE_DK`` (the default) dK's
    product is issued after dQ's and runs while dQ is stored for the writer; leaving dK running
    into the next tile lost on the H200 (benchmarks/NOTES.md, change 16). With ``LATE_DQ`` the
    stored dQ is handed over only once the next tile's score products are issued (see
    ``LATE_DQ_HANDOFF``). With ``PERSISTENT`` the item's last Q/dO slot is released too and, once
    dK/dV are stored, its K/V buffers (``kv_empty``), for the next item; with ``EARLY_KV`` as
    soon as its products are in (:func:`stage_dk_dv_for_tma`). With a ``record``
    (``TIMELINE``'s row of the item) the item's phases are stamped there. Returns the next
    item's first step."""
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

    keys = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    offs_m = gl.arange(0, BLOCK_M, query_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)

    if record is not None:
        _stamp(record, 0, _clock())
        _stamp(record, 7, _global_time())
    mbarrier.wait(kv_bar, kv_phase)
    if EARLY_KV and DKDV_TMA:
        # The previous item's dK/dV stores have read the dQ and dS^T buffers they were staged
        # in (long since: the K/V load took longer) before this item's first tile writes them.
        tma.store_wait(0)
        _partition_barrier()
    if record is not None:
        _stamp(record, 1, _clock())
    it = gl.to_tensor(it)  # a loop-carried value, also where the caller passes a literal
    first = it  # the item's first tile: no previous tile of its own to hand over
    for g in range(heads_per_kv):
        h, mask_head, count, entries = _head_list(
            g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
            num_mask_heads, num_m_tiles, num_n_tiles,
        )  # fmt: skip
        # This program's keys are fixed, so their bounds are loaded once per head.
        lts, lte, uts, ute = load_column_bounds(
            bounds_ptr + mask_head.to(gl.int64) * 4 * seqlen_k, keys, seqlen_k, HAS_MASK, HAS_UPPER
        )
        row_base = (b * num_heads_q + h).to(gl.int64) * seqlen_q
        for j in range(count):
            entry, m_tile, slot, q_smem, do_smem = await_tile(
                entries, j, it, q_bufs, do_bufs, ready
            )
            # Two tests: the first is decided at compile time, the second at run time.
            if record is not None:  # noqa: SIM102
                if it == first:
                    _stamp(record, 2, _clock())
            if ROW_TERMS_SMEM == 2:
                # Read before the tile's products are issued (the form gluon_bwd256 uses).
                lse = lse_bufs.index(slot).load(query_layout)
            st_token = warpgroup_mma(
                k_smem, q_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True
            )
            dpt_token = warpgroup_mma(
                v_smem, do_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True
            )
            if LATE_DQ:
                # The previous tile's; nothing to hand over before the first (``it`` + the ring
                # size keeps the buffer index in range there).
                if LATE_DQ == 2:
                    num_slots: gl.constexpr = q_bufs.type.shape[0]
                    mbarrier.arrive(empty.index((it + num_slots - 1) % num_slots), pred=it > first)
                publish_dq(dq_full, it + dq_full.type.shape[0] - 1, DQ_TMA, pred=it > first)
            rows = m_tile * BLOCK_M + offs_m
            if ROW_TERMS_SMEM == 1:
                lse = staged_lse(lse_bufs, slot, query_layout)
            elif ROW_TERMS_SMEM == 0:
                lse, delta = row_terms(lse_ptr, delta_ptr, row_base, rows)
            st = warpgroup_mma_wait(1, deps=(st_token,))
            pt = transposed_probabilities(
                st, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, seqlen_k - seqlen_q,
                HAS_MASK, HAS_UPPER, CAUSAL,
            )  # fmt: skip
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv_token = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt_token,))
            if ROW_TERMS_SMEM:
                delta = delta_bufs.index(slot).load(query_layout)
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            dst_op = gl.convert_layout(dst, a_layout)
            if not DQ_BEFORE_DK:
                dk_token = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
            ds_smem = ds_bufs.index(it % 2)
            ds_smem.store(dst)
            fence_async_shared()
            # Both warpgroups' halves of dS^T are in place (and the buffer written here was last
            # read two tiles ago, before the previous tile's barrier).
            _partition_barrier()
            dq_token = warpgroup_mma(
                ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True
            )
            if DQ_BEFORE_DK:
                # FlashAttention-3/4's order: dK after dQ, so that dQ is stored for the writer
                # while dK's product runs (products complete in issue order).
                dk_token = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
                dv, dq, _ = warpgroup_mma_wait(1, deps=(dv_token, dq_token, pt_op))
                if LATE_DQ:
                    stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale)
                else:
                    hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale, DQ_TMA)
                dk, _ = warpgroup_mma_wait(0, deps=(dk_token, dst_op))
                if LATE_DQ != 2:
                    mbarrier.arrive(empty.index(slot), count=1)
            else:
                dv, dk, dq, _, _ = warpgroup_mma_wait(
                    0, deps=(dv_token, dk_token, dq_token, pt_op, dst_op)
                )
                if LATE_DQ != 2:
                    mbarrier.arrive(empty.index(slot), count=1)
                if LATE_DQ:
                    stage_dq(dq, dq_bufs, dq_empty, it, softmax_scale)
                else:
                    hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale, DQ_TMA)
            it += 1
    if record is not None:
        _stamp(record, 3, _clock())
    if LATE_DQ:
        # The last tile's dQ; its Q/dO slot only where another item's tiles load after it.
        publish_dq(dq_full, it + dq_full.type.shape[0] - 1, DQ_TMA, pred=it > first)
        if PERSISTENT and LATE_DQ == 2:
            last_slots: gl.constexpr = q_bufs.type.shape[0]
            mbarrier.arrive(empty.index((it + last_slots - 1) % last_slots), pred=it > first)

    if EARLY_KV:
        # Every product that read K and V is in (each tile's are awaited within it), in both
        # warpgroups (lowered as a barrier of the consumer warps, then one arrive): the producer
        # may load the next item's K/V while dK/dV leave.
        mbarrier.arrive(kv_empty, count=1)
        if DKDV_TMA:
            stage_dk_dv_for_tma(
                dk, dv, dq_bufs, dq_empty, ds_bufs, k_smem, dk_desc, dv_desc, it,
                b * seqlen_k + n_tile * BLOCK_N, h_kv * HEAD_DIM, softmax_scale,
            )  # fmt: skip
        else:
            store_dk_dv(dk, dv, dk_ptr, dv_ptr, b, h_kv, n_tile, stride_kb, stride_ks, stride_kh,
                        softmax_scale, ADD_DKDV)  # fmt: skip
    else:
        write_dk_dv(
            dk, dv, k_smem, v_smem, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_k,
            stride_kb, stride_ks, stride_kh, softmax_scale, ADD_DKDV, DKDV_TMA,
        )  # fmt: skip
    if PERSISTENT and not EARLY_KV:
        # Every product that read K and V is in and, with DKDV_TMA, the stores that staged dK
        # and dV in their buffers have read them (lowered as a barrier of the consumer warps,
        # then one arrive): the producer may load the next item's.
        mbarrier.arrive(kv_empty, count=1)
    if record is not None:
        _stamp(record, 4, _clock())
        _stamp(record, 8, _global_time())
        _stamp(record, 5, _sm_index())
        _stamp(record, 6, _as_row(it - first))
    return it


@gluon.jit
def allocate_operands(q_desc, k_desc, v_desc, do_desc, BLOCK_N: gl.constexpr,
                      NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """``(k_smem, v_smem, q_bufs, do_bufs)``: a program's K and V tiles (``BLOCK_N`` keys) and
    ``NUM_BUFFERS`` Q/dO slots in shared memory, in the descriptors' layouts."""
    dtype: gl.constexpr = q_desc.dtype
    block_m: gl.constexpr = q_desc.block_type.shape[0]
    head_dim: gl.constexpr = q_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, head_dim], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, head_dim], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, block_m, head_dim], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, block_m, head_dim], do_desc.layout)
    return k_smem, v_smem, q_bufs, do_bufs


@gluon.jit
def allocate_rings(
    dq_desc,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    DQ_BUFFERS: gl.constexpr,
    DQ_TMA: gl.constexpr,
    READY_ARRIVALS: gl.constexpr,
):
    """``(kv_bar, ready, empty, dq_bufs, dq_full, dq_empty)``, initialised: the K/V barrier, the
    Q/dO slots' "ready"/"empty" barriers ("ready" completing after ``READY_ARRIVALS`` arrivals
    and the copies' bytes) and the ring of ``DQ_BUFFERS`` fp32 dQ tiles with its
    "dq_full"/"dq_empty" barriers (see :func:`_bwd_dq_writer_partition`)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=1)
    if DQ_TMA:
        # The layout the TMA reduce reads (NVMMA, 128-byte swizzle).
        dq_bufs = gl.allocate_shared_memory(
            gl.float32, [DQ_BUFFERS, BLOCK_M, HEAD_DIM], dq_desc.layout
        )
    else:
        # 16-byte vectors swizzled over eight rows: the consumers' 8-byte stores from the MMA
        # layout (eight rows per instruction) and the writer's 16-byte row loads both take the
        # minimum number of shared-memory wavefronts.
        dq_bufs = gl.allocate_shared_memory(
            gl.float32, [DQ_BUFFERS, BLOCK_M, HEAD_DIM], gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        )
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    return kv_bar, ready, empty, dq_bufs, dq_full, dq_empty


@gluon.jit
def allocate_row_terms(lse_ptr, delta_ptr, BLOCK_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                       ROW_TERMS_SMEM: gl.constexpr):  # fmt: skip
    """``(lse_bufs, delta_bufs)``: with ``ROW_TERMS_SMEM`` one fp32 row of ``BLOCK_M`` per Q/dO
    slot for each; without, the pointers as stand-ins that no partition reads
    (``warp_specialize`` captures values only)."""
    lse_bufs = lse_ptr
    delta_bufs = delta_ptr
    if ROW_TERMS_SMEM:
        row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, BLOCK_M], row_layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, BLOCK_M], row_layout)
    return lse_bufs, delta_bufs


@gluon.jit
def gluon_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_ptr, dq_desc, dk_ptr, dv_ptr,
    dk_desc, dv_desc, bounds_ptr,
    entries_ptr, counts_ptr, order_ptr, stride_dqb, stride_dqs, stride_dqh, stride_kb,
    stride_ks, stride_kh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, qk_scale, softmax_scale, num_items, next_item_ptr, timeline_ptr,
    dq_flags,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    WRITER_WARPS: gl.constexpr,
    WRITER_REGISTERS: gl.constexpr,
    DQ_TMA: gl.constexpr,
    DQ_BUFFERS: gl.constexpr,
    ROW_TERMS_SMEM: gl.constexpr,
    ORDERED: gl.constexpr,
    ADD_DKDV: gl.constexpr,
    LATE_DQ: gl.constexpr,
    DQ_BEFORE_DK: gl.constexpr,
    DKDV_TMA: gl.constexpr,
    PERSISTENT: gl.constexpr,
    EARLY_KV: gl.constexpr,
    FIRST_STORE: gl.constexpr,
):  # fmt: skip
    """Grid ``(key tiles, kv heads, batch)``, run in the order of ``order_ptr`` with
    ``ORDERED`` (``kernels.tiles.program_order``): dK and dV (``dk_ptr``/``dv_ptr`` share K's
    strides; with ``ADD_DKDV`` added to their fp32 contents; with ``DKDV_TMA`` stored through
    ``dk_desc``/``dv_desc``, descriptors of the same buffers, ``None`` without) and dQ added to
    the fp32 ``dq_ptr`` (with ``DQ_TMA`` through ``dq_desc``, a descriptor of the same buffer;
    ``None`` without). With ``PERSISTENT`` the grid is 1-D and its programs loop over the
    ``num_items`` work items ``(key tiles, kv heads, batch)`` in that order, taking each next
    one from the counter ``next_item_ptr`` (zeroed; not read when the grid has every item).
    ``timeline_ptr``: ``TIMELINE``'s tensor, or ``None`` (no stamps compiled). With
    ``FIRST_STORE`` (``DQ_FIRST_STORE``) ``dq_ptr`` is not zeroed: each tile's first writer
    stores it, claimed through the zeroed int32 flags ``dq_flags`` (``None`` without)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem, v_smem, q_bufs, do_bufs = allocate_operands(
        q_desc, k_desc, v_desc, do_desc, BLOCK_N, NUM_BUFFERS
    )
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    kv_bar, ready, empty, dq_bufs, dq_full, dq_empty = allocate_rings(
        dq_desc, BLOCK_M, HEAD_DIM, NUM_BUFFERS, DQ_BUFFERS, DQ_TMA, 1 + (ROW_TERMS_SMEM > 0)
    )
    lse_bufs, delta_bufs = allocate_row_terms(
        lse_ptr, delta_ptr, BLOCK_M, NUM_BUFFERS, ROW_TERMS_SMEM
    )
    if PERSISTENT:
        # The K/V buffers free for the next item's (consumers: read, and dK/dV stored).
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=1)
        # The producer's next work items for the consumers and the dQ writer: two slots, each
        # read by both.
        items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_empty.index(i), count=2)
        gl.warp_specialize(
            [
                (
                    _bwd_compute_partition_persistent,
                    (
                        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, kv_empty,
                        ready, empty, dq_full, dq_empty, items, item_ready, item_empty,
                        order_ptr, num_items, entries_ptr, counts_ptr, bounds_ptr, lse_ptr,
                        delta_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc, seqlen_q, seqlen_k,
                        num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                        num_m_tiles, num_n_tiles, stride_kb, stride_ks, stride_kh, qk_scale,
                        softmax_scale, lse_bufs, delta_bufs, timeline_ptr, CAUSAL, HAS_MASK,
                        HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_TMA, ROW_TERMS_SMEM, ADD_DKDV,
                        LATE_DQ, DQ_BEFORE_DK, DKDV_TMA, ORDERED, EARLY_KV,
                    ),
                ),
                (
                    _bwd_load_partition_persistent,
                    (
                        q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                        kv_empty, ready, empty, items, item_ready, item_empty, next_item_ptr,
                        order_ptr, num_items, entries_ptr, counts_ptr, seqlen_q, seqlen_k,
                        heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q,
                        ORDERED, BLOCK_M, BLOCK_N, HEAD_DIM, ROW_TERMS_SMEM, EARLY_KV,
                    ),
                ),
                (
                    _bwd_dq_writer_partition_persistent,
                    (
                        dq_bufs, dq_full, dq_empty, items, item_ready, item_empty, order_ptr,
                        num_items, entries_ptr, counts_ptr, dq_ptr, dq_desc, seqlen_q,
                        num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                        num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, dq_flags,
                        ORDERED, BLOCK_M, HEAD_DIM, DQ_TMA, FIRST_STORE,
                    ),
                ),
            ],
            [1, WRITER_WARPS],
            [24, WRITER_REGISTERS],
        )  # fmt: skip
    else:
        n_tile, h_kv, b = launched_program(
            order_ptr, num_n_tiles, num_heads_q // heads_per_kv, ORDERED
        )
        # The dQ writer is a second worker (hence two warp_specialize calls).
        gl.warp_specialize(
            [
                (
                    _bwd_compute_partition,
                    (
                        k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty,
                        dq_full, dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr,
                        delta_ptr, dk_ptr, dv_ptr, dk_desc, dv_desc, b, h_kv, n_tile, seqlen_q,
                        seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                        num_m_tiles, num_n_tiles, stride_kb, stride_ks, stride_kh, qk_scale,
                        softmax_scale, lse_bufs, delta_bufs, timeline_ptr, CAUSAL, HAS_MASK,
                        HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_TMA, ROW_TERMS_SMEM, ADD_DKDV,
                        LATE_DQ, DQ_BEFORE_DK, DKDV_TMA,
                    ),
                ),
                (
                    _bwd_load_partition,
                    (
                        q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                        ready, empty, entries_ptr, counts_ptr, b, h_kv, n_tile, seqlen_q,
                        seqlen_k, heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles,
                        num_n_tiles, lse_bufs, delta_bufs, lse_ptr, delta_ptr, num_heads_q, BLOCK_M,
                        BLOCK_N, HEAD_DIM, ROW_TERMS_SMEM,
                    ),
                ),
                (
                    _bwd_dq_writer_partition,
                    (
                        dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b,
                        h_kv, n_tile, seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                        num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, dq_flags,
                        num_heads_q, BLOCK_M, HEAD_DIM, DQ_TMA, FIRST_STORE,
                    ),
                ),
            ],
            [1, WRITER_WARPS],
            [24, WRITER_REGISTERS],
        )  # fmt: skip


@functools.cache  # frozen: one object per head dim serves every launch (host time)
def dq_shared_layout(head_dim: int):
    """The shared layout of a ``[BLOCK_M, head_dim]`` fp32 dQ tile that ``DQ_TMA``'s reduce
    reads (NVMMA)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, head_dim], gl.float32)


def dkdv_by_tma(causal: bool, masked: bool) -> bool:
    """Whether a backward launch with these flags stores dK/dV through TMA (``DKDV_TMA``;
    a query chunk's fp32 partial sums never do)."""
    return DKDV_TMA == 1 or (DKDV_TMA == 2 and (masked or not causal))


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    dq_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``(q, k, v)`` for inputs ``kernels.gluon_backward_eligible`` accepts
    at D = 64 or 128, contiguous at 16-byte aligned addresses (``kernels.tma_ready``).

    ``lse`` (the forward's) and ``delta`` (``kernels.backward_delta``) are float32 ``[B, H, Sq]``;
    ``bounds`` (``[B, Hm, 4, Sk]``, ``None`` without a mask) and ``lists`` (column-major
    :class:`~flashmask.kernels.tiles.TileLists` at ``BLOCK_M x BLOCK_N`` tiles) come from
    ``kernels.prepare_cached``; ``order`` (``kernels.program_order`` over the grid ``(key
    tiles, kv heads, batch)``, ``None``: the natural order) is the order the programs run in.
    ``dq_accumulator``: where :func:`one_launch` holds, a zeroed float32 tensor like ``q`` that
    dQ is added into (``None``: zeroed here). ``dq_flags``: with :func:`first_store_dq`, zeroed
    int32 ``[B, H, cdiv(Sq, BLOCK_M)]`` flags, and ``dq_accumulator`` then need not be zeroed
    (``DQ_FIRST_STORE``)."""
    require_form("gluon_bwd.ROW_TERMS_SMEM", ROW_TERMS_SMEM)
    require_form("gluon_bwd.LATE_DQ_HANDOFF", LATE_DQ_HANDOFF)
    require_form("gluon_bwd.DKDV_TMA", DKDV_TMA)
    if PERSISTENT not in (0, 1):
        raise ValueError(f"gluon_bwd.PERSISTENT must be 0 or 1, got {PERSISTENT}")
    if EARLY_KV_RELEASE not in (0, 1):
        raise ValueError(f"gluon_bwd.EARLY_KV_RELEASE must be 0 or 1, got {EARLY_KV_RELEASE}")
    if EARLY_KV_RELEASE and DQ_BUFFERS != 2:
        raise ValueError(
            f"gluon_bwd.EARLY_KV_RELEASE stages dK in the dQ buffer the next tile takes: it "
            f"needs DQ_BUFFERS = 2, got {DQ_BUFFERS}"
        )
    if DQ_FIRST_STORE not in (0, 1, 2):
        raise ValueError(f"gluon_bwd.DQ_FIRST_STORE must be 0, 1 or 2, got {DQ_FIRST_STORE}")
    if dq_flags is not None and (dq_accumulator is None or not first_store_dq()):
        raise ValueError(
            "dq_flags: only with gluon_bwd.DQ_FIRST_STORE (and DQ_TMA) and a dq_accumulator"
        )
    if not isinstance(MAX_PROGRAMS, int) or MAX_PROGRAMS < 0:
        raise ValueError(f"gluon_bwd.MAX_PROGRAMS must be an int >= 0, got {MAX_PROGRAMS!r}")
    return launch(
        gluon_bwd_kernel, BLOCK_N, NUM_BUFFERS, DQ_BUFFERS, DQ_TMA,
        dout, q, k, v, lse, delta, bounds, lists, num_mask_heads, causal, softmax_scale,
        order=order, split_queries=True, dq_accumulator=dq_accumulator, dq_flags=dq_flags,
        ROW_TERMS_SMEM=ROW_TERMS_SMEM, ADD_DKDV=False, LATE_DQ=LATE_DQ_HANDOFF,
        DQ_BEFORE_DK=DQ_BEFORE_DK, DKDV_TMA=dkdv_by_tma(causal, bounds is not None),
        PERSISTENT=bool(PERSISTENT), EARLY_KV=bool(PERSISTENT and EARLY_KV_RELEASE),
    )  # fmt: skip


def first_store_dq() -> bool:
    """Whether :func:`backward` takes per-tile flags instead of a zeroed dQ accumulator where
    :func:`one_launch` holds (``DQ_FIRST_STORE``, which needs ``DQ_TMA``)."""
    return bool(DQ_FIRST_STORE) and bool(DQ_TMA)


def one_launch(
    q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool, split_queries: bool = True
) -> bool:
    """Whether :func:`launch` runs all of ``q``'s rows (``[B, Sq, H, D]``) in one launch, so
    that one dQ accumulator spans them (else full attention runs in query chunks, each with an
    accumulator of its own)."""
    return not _chunk_rows(q, k, masked, causal, split_queries)


def _chunk_rows(
    q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool, split_queries: bool
) -> int:
    """The query rows per chunk :func:`launch` splits ``q`` into (0: one launch): only full
    attention is split (``query_chunks.query_chunk_rows``)."""
    if masked or causal or not split_queries:
        return 0
    sq, hq, d = q.shape[1:]
    return query_chunks.query_chunk_rows(sq, d, hq // k.shape[2])


def launch(
    kernel,
    block_n: int,
    num_buffers: int,
    dq_buffers: int,
    dq_tma: bool,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    order: torch.Tensor | None = None,
    split_queries: bool = False,
    dq_accumulator: torch.Tensor | None = None,
    dq_flags: torch.Tensor | None = None,
    **constants,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``kernel`` (``gluon_bwd_kernel`` or a kernel with its arguments, such as
    ``gluon_bwd256.gluon_bwd256_kernel``) with ``block_n`` keys per program, ``num_buffers``
    Q/dO slots, ``dq_buffers`` dQ buffers, dQ through TMA reduce-adds if ``dq_tma`` and the
    kernel's further ``constants``; the other arguments (``order``, ``dq_accumulator`` too) and
    the result as :func:`backward`'s.

    With ``split_queries``, full attention (no mask, not causal) that
    ``query_chunks.query_chunk_rows`` splits runs once per chunk of query rows
    (``kernels.query_chunks``: a head's Q, dO and dQ then stay in L2), its dK/dV partial sums
    added in fp32."""
    rows = _chunk_rows(q, k, bounds is not None, causal, split_queries)
    if not rows:
        return _launch_once(
            kernel, block_n, num_buffers, dq_buffers, dq_tma, dout, q, k, v, lse, delta,
            bounds, lists, num_mask_heads, causal, softmax_scale, None, order=order,
            dq_accumulator=dq_accumulator, dq_flags=dq_flags, **constants,
        )  # fmt: skip
    if dq_accumulator is not None:
        raise ValueError("dq_accumulator: a backward in query chunks zeros one per chunk")
    key_tiles = lists.entries.shape[-2]
    accumulators = []  # with CHUNKS_ADD_IN_KERNEL: the first chunk's fp32 dK, dV

    def run_chunk(q_c, dout_c, lse_c, delta_c):
        lists_c = TileLists(
            *query_chunks.full_attention_lists(
                q.shape[0], key_tiles, q_c.shape[1] // BLOCK_M, q.device
            )
        )
        add = CHUNKS_ADD_IN_KERNEL and bool(accumulators)
        result = _launch_once(
            kernel, block_n, num_buffers, dq_buffers, dq_tma, dout_c, q_c, k, v, lse_c,
            delta_c, None, lists_c, num_mask_heads, False, softmax_scale, torch.float32,
            *(accumulators if add else (None, None)), **{**constants, "ADD_DKDV": add},
        )  # fmt: skip
        if CHUNKS_ADD_IN_KERNEL and not accumulators:
            accumulators.extend(result[1:])
        return result

    return query_chunks.backward_by_query_chunks(run_chunk, q, dout, lse, delta, rows, k.dtype)


def _launch_once(
    kernel,
    block_n: int,
    num_buffers: int,
    dq_buffers: int,
    dq_tma: bool,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    dkdv_dtype: torch.dtype | None,
    dk_out: torch.Tensor | None = None,
    dv_out: torch.Tensor | None = None,
    *,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    dq_flags: torch.Tensor | None = None,
    **constants,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of :func:`launch`'s ``kernel`` over all of ``q``'s rows; dK and dV in
    ``dkdv_dtype`` (``None``: K's dtype; float32 for a chunk's partial sums), into ``dk_out``
    and ``dv_out`` where given (the kernel's ``ADD_DKDV`` adds to them); the programs in
    ``order`` (``None``: the grid's); dQ added into ``dq_accumulator`` (zeroed, float32 like
    ``q``; ``None``: a new zeroed one; with ``dq_flags``, the zeroed per-tile flags of
    ``DQ_FIRST_STORE``, not zeroed)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    tn, tm = lists.entries.shape[-2:]
    q2, k2, v2, do2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v, dout))
    q_layout = shared_layout(BLOCK_M, d, q.dtype)
    kv_layout = shared_layout(block_n, d, q.dtype)
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], q_layout)
    do_desc = TensorDescriptor.from_tensor(do2, [BLOCK_M, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, d], kv_layout)
    dk = torch.empty_like(k, dtype=dkdv_dtype) if dk_out is None else dk_out
    dv = torch.empty_like(v, dtype=dkdv_dtype) if dv_out is None else dv_out
    if dq_flags is not None and (
        dq_flags.shape != (b, hq, tm) or dq_flags.dtype != torch.int32 or dq_accumulator is None
    ):
        raise ValueError(
            f"dq_flags must be int32 of shape {(b, hq, tm)} (one per {BLOCK_M}-row dQ tile), "
            f"with a dq_accumulator; got {dq_flags.dtype} {tuple(dq_flags.shape)}"
        )
    dq_accum = dq_accumulator
    if dq_accum is None:
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_desc = None
    if dq_tma:
        dq_desc = TensorDescriptor.from_tensor(
            dq_accum.view(b * sq, hq * d), [BLOCK_M, d], dq_shared_layout(d)
        )
    # Stored in K's tiles (the kernel stages them in the K/V buffers); a chunk's fp32 partial
    # sums, added to or not, keep the plain stores.
    dkdv_tma = bool(constants.get("DKDV_TMA")) and dkdv_dtype is None
    if "DKDV_TMA" in constants:
        constants["DKDV_TMA"] = dkdv_tma
    dk_desc = dv_desc = None
    if dkdv_tma:
        dk_desc, dv_desc = (
            TensorDescriptor.from_tensor(x.view(b * sk, hk * d), [block_n, d], kv_layout)
            for x in (dk, dv)
        )
    grid = (tn, hk, b)
    if "PERSISTENT" in constants:  # gluon_bwd_kernel's 1-D grid and item counter
        num_items = tn * hk * b
        programs = num_items
        if constants["PERSISTENT"]:
            programs = min(num_items, MAX_PROGRAMS or sm_count(q.device))
            grid = (programs,)
        # Items past the first ``programs`` are taken from this counter, one at a time.
        next_item = lists.counts  # not read with one program per item
        if programs < num_items:
            next_item = torch.zeros(1, dtype=torch.int32, device=q.device)
        timeline = TIMELINE
        if timeline is not None and (
            timeline.dtype != torch.int64
            or timeline.device != q.device
            or timeline.numel() < num_items * TIMELINE_FIELDS
        ):
            raise ValueError(
                f"gluon_bwd.TIMELINE must be an int64 tensor on {q.device} of at least "
                f"{num_items} x {TIMELINE_FIELDS} elements, got {timeline.dtype} "
                f"{tuple(timeline.shape)} on {timeline.device}"
            )
        constants = {
            **constants, "num_items": num_items, "next_item_ptr": next_item,
            "timeline_ptr": timeline, "dq_flags": dq_flags,
            "FIRST_STORE": DQ_FIRST_STORE if dq_flags is not None else 0,
        }  # fmt: skip
    launch_kernel(
        kernel, grid,
        q_desc, k_desc, v_desc, do_desc, lse, delta, dq_accum, dq_desc, dk, dv, dk_desc, dv_desc,
        lists.counts if bounds is None else bounds, lists.entries, lists.counts,
        lists.counts if order is None else order,
        dq_accum.stride(0), dq_accum.stride(1), dq_accum.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        sq, sk, hq, hq // hk, hq // num_mask_heads, num_mask_heads, tm, tn,
        softmax_scale * LOG2E_VALUE, softmax_scale,
        CAUSAL=causal, HAS_MASK=bounds is not None, HAS_UPPER=not causal,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=d, NUM_BUFFERS=num_buffers,
        WRITER_WARPS=WRITER_WARPS, WRITER_REGISTERS=WRITER_REGISTERS, DQ_TMA=dq_tma,
        DQ_BUFFERS=dq_buffers, ORDERED=order is not None, **constants,
        num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    if dq_flags is None:
        return dq_accum.to(q.dtype), dk, dv
    from flashmask.kernels.triton_kernels.backward import flashmask_dq_convert_kernel

    dq = torch.empty_like(q)
    launch_kernel(
        flashmask_dq_convert_kernel, (tm, hq, b), dq_accum, dq_flags, dq, sq, hq,
        HEAD_DIM=d, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return dq, dk, dv
