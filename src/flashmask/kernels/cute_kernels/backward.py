"""Warp-specialised backward for Hopper (sm_90a), written in CuTe DSL, on our tile lists.

One program per (key tile of 128 keys, key/value head, batch), launched heaviest first when the
preparation gives a launch order. It owns dK and dV of its keys: for every query head sharing its
key/value head it walks that head's column-major list (``tiles.backward_lists`` at 64 x 128
tiles: the query tiles of 64 rows to visit, partial ones first, unmasked ones encoded
``-e - 1``), so grouped-query heads are summed in registers. Per program, 384 threads in three
warpgroups:

* warpgroup 0, the producer: after ``setmaxnreg`` gives its registers back, one warp loads the
  two 64-key halves of K and of V (one mbarrier), then each listed query tile's Q and dO into a
  ring of :data:`QDO_STAGES` slots, and beside each the tile's 64 rows of the forward's lse (in
  base 2, ``+inf`` for a fully masked row or one past ``Sq``, so that its probabilities are
  zero) and of ``delta = rowsum(dO * O) - dlse``. A slot's "full" barrier completes with the
  copies' bytes and the warp's arrival after its row stores; its "empty" barrier takes one
  arrival per consumer warp. A second warp, the dQ writer, adds each tile's two dQ halves to
  the fp32 dQ accumulator ``[B, Sq, Hq, D]`` with one TMA reduce-add each (the other two warps
  idle);
* warpgroups 1 and 2, the consumers, each owning 64 of the program's keys: per listed tile,
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` (issued together), ``P^T = exp2(S^T * scale * log2 e -
  lse)`` with the element mask on a partial tile, ``dV += P^T dO`` (issued before ``dP^T`` is
  awaited), ``dS^T = P^T (dP^T - delta)``, stored into one of two shared ``dS`` buffers; once
  both warpgroups' halves are in, ``dQ = dS K`` over all 128 keys for one 64-column half of D
  per warpgroup, then ``dK += dS^T Q``. Each warpgroup leaves its dQ half (scaled) in one of
  its two fp32 shared buffers for the writer ("dq_full"/"dq_empty" mbarriers), so no consumer
  waits on a copy. After the lists, dK (scaled) and dV leave through the K and V tiles'
  buffers and one TMA store each.

The shared-memory stores of dS and dQ are vectorised (``autovec_copy``: column pairs); each
group of 8 dQ columns is stored from one swizzled base address (:func:`swizzled_at_first`).

Q and dO serve as K-major B operands (for ``S^T`` and ``dP^T``) and, through transposed views
of the same shared tiles, as MN-major ones (for ``dK`` and ``dV``); K likewise for ``dQ``.

Keys past ``Sk`` need no mask: TMA reads their K and V rows as zeros, so they add nothing to dQ,
and their dK/dV rows are clipped by the stores. Rows past ``Sq`` get ``lse = +inf``.

The kernel compiles on a machine without a GPU (``CUTE_DSL_ARCH=sm_90a``): the CPU suite builds
every variant (``tests/kernels/cute_kernels``); ``tests/gpu`` proves its results.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from flashmask.kernels.cute_kernels.forward import (
    LOG2E,
    WARPGROUP_THREADS,
    grid_position,
    listed_tile,
    probabilities_layout,
    row_col_view,
    tma_tiles,
)

# Query rows per listed tile, keys per program (two consumer warpgroups of 64 keys each).
BLOCK_M = 64
HALF_KEYS = 64
BLOCK_N = 2 * HALF_KEYS
# Q/dO ring slots, and fp32 dQ buffers per consumer warpgroup. At D = 128: K, V 32 KB each,
# Q and dO 32 KB each, dS 32 KB, dQ 64 KB: 224 KB of the 227 KB.
QDO_STAGES = 2
DQ_BUFFERS = 2
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
# Named barrier ids (0 is __syncthreads): both consumer warpgroups (their dS halves stored;
# their last dQ products done before dK/dV overwrite K and V), and each warpgroup's own (its
# dK/dV rows stored before one thread's TMA stores read them).
CONSUMERS_BARRIER = 1
OWN_BARRIER = (2, 3)
CONSUMER_THREADS = 2 * WARPGROUP_THREADS


@dataclass(frozen=True)
class BackwardVariant:
    """The static parameters one compiled backward specialises on.

    ``head_dim``: D (128); ``causal``, ``has_mask``, ``has_upper``: the mask's form;
    ``mask_full_tiles``: the dense mode (every tile masked); ``ordered``: the grid follows a
    launch order; ``deterministic``: each query tile's dQ is added in a fixed order (its key
    tiles' programs from the highest down, ``backward_launch.dq_tickets``)."""

    head_dim: int
    causal: bool
    has_mask: bool
    has_upper: bool
    mask_full_tiles: bool
    ordered: bool
    deterministic: bool = False


def transposed(tensor: cute.Tensor) -> cute.Tensor:
    """The view of shared ``tensor`` with its first two modes swapped (the same memory, e.g. a
    K-major operand tile seen as an MN-major one)."""
    shape = (tensor.shape[1], tensor.shape[0], *tensor.shape[2:])
    order = (1, 0, *range(2, cute.rank(tensor)))
    return cute.composition(tensor, cute.make_ordered_layout(shape, order=order))


def halves(tensor: cute.Tensor) -> cute.Tensor:
    """The view of ``tensor`` with its first mode split into two halves, the half index added
    as a mode after the first two: ``(a, b, ...) -> (a / 2, b, 2, ...)``."""
    split = cute.flat_divide(tensor, (cute.size(tensor, mode=[0]) // 2,))
    order = [0, 2, 1, *range(3, cute.rank(split))]
    return cute.make_tensor(split.iterator, cute.select(split.layout, mode=order))


@cute.jit
def swizzled_at_first(plain: cute.Tensor, swizzle) -> cute.Tensor:
    """A thread's partition ``plain`` of the unswizzled view of a shared buffer that is
    ``swizzle``-d (on byte addresses), as a tensor at the swizzled address of its first element
    with ``plain``'s (static) layout: every element at that address plus a constant.

    Right where each element's offset from the first leaves the bits the swizzle reads and
    writes alone, carries included: so for a group of 8 columns of a thread's dQ (the 128-byte
    swizzle XORs address bits 4-6 with bits 7-9), whose column pair lies 4 bytes and whose
    second row 1 KB (8 rows) from its first element, at an 8-byte aligned address. Through the
    swizzled pointer itself, each of the 16 stores' addresses was computed apart, and the
    compiler kept them across the tile loop, where they spilled (56 bytes) in the unmasked
    variant."""
    addr = plain.iterator.toint()
    read = ((1 << swizzle.num_bits) - 1) << (swizzle.num_base + swizzle.num_shift)
    addr = addr ^ ((addr & read) >> swizzle.num_shift)
    first = cute.make_ptr(plain.element_type, addr, cute.AddressSpace.smem, assumed_align=8)
    return cute.make_tensor(first, plain.layout)


@dsl_user_op
def load_acquire(ptr, *, loc=None, ip=None) -> cutlass.Int32:
    """The int32 at global ``ptr``, read with acquire semantics at GPU scope."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [ptr.toint(loc=loc, ip=ip).ir_value()],
            "ld.global.acquire.gpu.b32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def release_increment(ptr, *, loc=None, ip=None) -> None:
    """Add 1 to the int32 at global ``ptr`` with release semantics at GPU scope."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value()],
        "red.release.gpu.global.add.s32 [$0], 1;",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class HopperBackward:
    """The CuTe backward of one :class:`BackwardVariant`; call it through ``cute.compile``."""

    def __init__(self, variant: BackwardVariant):
        self.v = variant
        d = variant.head_dim
        # S^T, dP^T: (64 keys, 64 queries, D); dK, dV: (64 keys, D, 64 queries); dQ: (64
        # queries, 64 columns of D, 128 keys).
        self.sdp_tiler = (HALF_KEYS, BLOCK_M, d)
        self.dkv_tiler = (HALF_KEYS, d, BLOCK_M)
        self.dq_tiler = (BLOCK_M, d // 2, BLOCK_N)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLse: cute.Tensor,
        mDelta: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mBounds: cute.Tensor,
        mEntries: cute.Tensor,
        mCounts: cute.Tensor,
        mOrder: cute.Tensor,
        mTurns: cute.Tensor,
        mTickets: cute.Tensor,
        seqlen_k: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        heads_per_mask_head: cutlass.Int32,
        qk_scale: cutlass.Float32,
        softmax_scale: cutlass.Float32,
        stream,
    ):
        """``mQ``/``mdO [B, Sq, Hq, D]``, ``mK``/``mV``/``mdK``/``mdV [B, Sk, Hk, D]`` (unit
        stride along D), ``mLse`` (the forward's, natural log) and ``mDelta`` float32 ``[B, Hq,
        Sq]``, ``mdQ`` the zeroed float32 accumulator ``[B, Sq, Hq, D]``, ``mBounds`` int32
        column-major ``[B, Hm, Sk padded, 4]`` (read only with a mask), ``mEntries`` int32
        ``[B, Hm, Tn, Tm]``, ``mCounts`` int32 ``[B, Hm, Tn]``, ``mOrder`` int32 ``[B * Hk *
        Tn]`` (read only when ordered); deterministic only: ``mTurns`` int32 ``[B, Hq, Tm]``
        zeroed, one counter per query tile of the dQ adds done, and ``mTickets`` int32 ``[B,
        Hm, Tn, Tm]``, beside each list entry the count its add waits for (:func:`~.backward_launch
        .dq_tickets`); ``qk_scale`` = softmax scale x log2(e) > 0."""
        dtype = mQ.element_type
        d = self.v.head_dim

        # (S, D, H, B) views: the sequence first, D second.
        def seq_first(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))

        q, k, v, do, dq, dk, dv = (seq_first(t) for t in (mQ, mK, mV, mdO, mdQ, mdK, mdV))

        def mma(a_major, b_major, tiler, a_source=warpgroup.OperandSource.SMEM):
            """A one-warpgroup MMA over ``tiler``'s (M, N), fp32 accumulator."""
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, a_major, b_major, cutlass.Float32, (1, 1, 1), tiler[:2], a_source
            )

        k_major = cute.nvgpu.OperandMajorMode.K
        mn_major = cute.nvgpu.OperandMajorMode.MN
        # Two copies of each product that overwrites its accumulator: one for the first
        # k-block, one (accumulating) for the rest; each field is set once, outside any staged
        # branch or loop.
        sdp_mma_init, sdp_mma = (mma(k_major, k_major, self.sdp_tiler) for _ in range(2))
        dkv_mma = mma(k_major, mn_major, self.dkv_tiler, warpgroup.OperandSource.RMEM)
        dq_mma_init, dq_mma = (mma(mn_major, mn_major, self.dq_tiler) for _ in range(2))

        row_major = tensor_utils.LayoutEnum.ROW_MAJOR
        # K, V: two 64-key halves (one per consumer warpgroup), K-major A operands.
        kv_smem = sm90_utils.make_smem_layout_a(row_major, self.sdp_tiler, dtype, 2)
        # Q, dO: the ring's slots, K-major B operands.
        q_smem = sm90_utils.make_smem_layout_b(row_major, self.sdp_tiler, dtype, QDO_STAGES)
        # dS (64 queries, 128 keys): dQ's A operand, queries contiguous; two buffers.
        ds_smem = sm90_utils.make_smem_layout_a(
            tensor_utils.LayoutEnum.COL_MAJOR, self.dq_tiler, dtype, 2
        )
        # fp32 dQ halves (64 queries, 64 columns): two buffers per consumer warpgroup.
        dq_smem = sm90_utils.make_smem_layout_a(
            row_major, (BLOCK_M, 8, d // 2), cutlass.Float32, 2 * DQ_BUFFERS
        )
        kv_one = cute.slice_(kv_smem, (None, None, 0))
        q_one = cute.slice_(q_smem, (None, None, 0))
        dq_one = cute.slice_(dq_smem, (None, None, 0))
        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(load, k, kv_one, (HALF_KEYS, d))
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(load, v, kv_one, (HALF_KEYS, d))
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(load, q, q_one, (BLOCK_M, d))
        tma_do, tma_do_tensor = cpasync.make_tiled_tma_atom(load, do, q_one, (BLOCK_M, d))
        tma_dk, tma_dk_tensor = cpasync.make_tiled_tma_atom(store, dk, kv_one, (HALF_KEYS, d))
        tma_dv, tma_dv_tensor = cpasync.make_tiled_tma_atom(store, dv, kv_one, (HALF_KEYS, d))
        tma_dq, tma_dq_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), dq, dq_one, (BLOCK_M, d // 2)
        )
        self.kv_bytes = cute.size_in_bytes(dtype, kv_one)
        self.q_bytes = cute.size_in_bytes(dtype, q_one)

        @cute.struct
        class SharedStorage:
            kv_full: cute.struct.MemRange[cutlass.Int64, 1]
            full: cute.struct.MemRange[cutlass.Int64, QDO_STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, QDO_STAGES]
            dq_full: cute.struct.MemRange[cutlass.Int64, 2 * DQ_BUFFERS]
            dq_empty: cute.struct.MemRange[cutlass.Int64, 2 * DQ_BUFFERS]
            lse: cute.struct.MemRange[cutlass.Float32, QDO_STAGES * BLOCK_M]
            delta: cute.struct.MemRange[cutlass.Float32, QDO_STAGES * BLOCK_M]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(kv_smem)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(kv_smem)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(ds_smem)], 1024]
            sdQ: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, cute.cosize(dq_smem)], 1024
            ]

        self.shared_storage = SharedStorage
        num_n_tiles = cute.ceil_div(mK.shape[1], BLOCK_N)
        self.kernel(
            sdp_mma_init, sdp_mma, dkv_mma, dq_mma_init, dq_mma, tma_k, tma_k_tensor, tma_v,
            tma_v_tensor, tma_q, tma_q_tensor, tma_do, tma_do_tensor, tma_dq, tma_dq_tensor,
            tma_dk, tma_dk_tensor, tma_dv, tma_dv_tensor, mLse, mDelta, mBounds, mEntries,
            mCounts, mOrder, mTurns, mTickets, kv_smem, q_smem, ds_smem, dq_smem, seqlen_k,
            heads_per_kv, heads_per_mask_head, qk_scale, softmax_scale,
        ).launch(
            grid=[num_n_tiles, mK.shape[2], mK.shape[0]],
            block=[3 * WARPGROUP_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        sdp_mma_init: cute.TiledMma,
        sdp_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        dq_mma_init: cute.TiledMma,
        dq_mma: cute.TiledMma,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_dq: cute.CopyAtom,
        mdQ: cute.Tensor,
        tma_dk: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_dv: cute.CopyAtom,
        mdV: cute.Tensor,
        mLse: cute.Tensor,
        mDelta: cute.Tensor,
        mBounds: cute.Tensor,
        mEntries: cute.Tensor,
        mCounts: cute.Tensor,
        mOrder: cute.Tensor,
        mTurns: cute.Tensor,
        mTickets: cute.Tensor,
        kv_smem: cute.ComposedLayout,
        q_smem: cute.ComposedLayout,
        ds_smem: cute.ComposedLayout,
        dq_smem: cute.ComposedLayout,
        seqlen_k: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        heads_per_mask_head: cutlass.Int32,
        qk_scale: cutlass.Float32,
        softmax_scale: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        smem = memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sK = storage.sK.get_tensor(kv_smem.outer, swizzle=kv_smem.inner)
        sV = storage.sV.get_tensor(kv_smem.outer, swizzle=kv_smem.inner)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sdO = storage.sdO.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sdS = storage.sdS.get_tensor(ds_smem.outer, swizzle=ds_smem.inner)
        sdQ = storage.sdQ.get_tensor(dq_smem.outer, swizzle=dq_smem.inner)
        sdQ_plain = storage.sdQ.get_tensor(dq_smem.outer)
        kv_full = storage.kv_full.data_ptr()
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        dq_full = storage.dq_full.data_ptr()
        dq_empty = storage.dq_empty.data_ptr()
        rows = cute.make_layout((BLOCK_M, QDO_STAGES))
        sLse = storage.lse.get_tensor(rows)
        sDelta = storage.delta.get_tensor(rows)

        # The program's work: (key tile, kv head, batch), heaviest first.
        num_n_tiles, num_kv_heads, _ = cute.arch.grid_dim()
        n_tile, h_kv, b = cute.arch.block_idx()
        if cutlass.const_expr(self.v.ordered):
            item = mOrder[n_tile + num_n_tiles * (h_kv + num_kv_heads * b)]
            n_tile, h_kv, b = grid_position(item, num_n_tiles, num_kv_heads)

        if warp == 0 and cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_init(kv_full, 1)
            for s in cutlass.range_constexpr(QDO_STAGES):
                # The copies' arrival (with their bytes) and the producer's after its rows.
                cute.arch.mbarrier_init(full + s, 2)
                # One arrival per consumer warp.
                cute.arch.mbarrier_init(empty + s, 8)
            for s in cutlass.range_constexpr(2 * DQ_BUFFERS):
                # One arrival per warp of the consumer warpgroup whose dQ half it holds; the
                # writer's once the reduce-add has read it.
                cute.arch.mbarrier_init(dq_full + s, 4)
                cute.arch.mbarrier_init(dq_empty + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.produce(
                    tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, mLse, mDelta, sK, sV, sQ, sdO,
                    sLse, sDelta, kv_full, full, empty, mEntries, mCounts, n_tile, h_kv, b,
                    heads_per_kv, heads_per_mask_head,
                )  # fmt: skip
            if warp == 1:
                self.write_dq(
                    tma_dq, mdQ, sdQ, dq_full, dq_empty, mEntries, mCounts, mTurns, mTickets,
                    n_tile, h_kv, b, heads_per_kv, heads_per_mask_head,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(
                sdp_mma_init, sdp_mma, dkv_mma, dq_mma_init, dq_mma, tma_dk, mdK, tma_dv, mdV,
                mBounds, mEntries, mCounts, sK, sV, sQ, sdO, sdS, sdQ, sdQ_plain, dq_smem.inner,
                sLse, sDelta, kv_full, full, empty, dq_full, dq_empty, n_tile, h_kv, b, role - 1,
                tidx % WARPGROUP_THREADS, mQ.shape[0], seqlen_k, heads_per_kv,
                heads_per_mask_head, qk_scale, softmax_scale,
            )  # fmt: skip

    @cute.jit
    def produce(
        self, tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, mLse, mDelta, sK, sV, sQ, sdO, sLse,
        sDelta, kv_full, full, empty, mEntries, mCounts, n_tile, h_kv, b, heads_per_kv,
        heads_per_mask_head,
    ):  # fmt: skip
        """The producer warp: K and V of the program's keys, then Q, dO, lse and delta of every
        listed query tile of every query head sharing the kv head."""
        d = self.v.head_dim
        lane = cute.arch.lane_idx()
        seqlen_q = mQ.shape[0]
        tKsK, tKgK = tma_tiles(tma_k, mK[None, None, h_kv, b], sK, (HALF_KEYS, d))
        tVsV, tVgV = tma_tiles(tma_v, mV[None, None, h_kv, b], sV, (HALF_KEYS, d))
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(kv_full, 4 * self.kv_bytes)
        for half in cutlass.range_constexpr(2):
            cute.copy(tma_k, tKgK[None, 2 * n_tile + half], tKsK[None, half], tma_bar_ptr=kv_full)
            cute.copy(tma_v, tVgV[None, 2 * n_tile + half], tVsV[None, half], tma_bar_ptr=kv_full)
        it = cutlass.Int32(0)
        for g in cutlass.range(heads_per_kv, unroll=1):
            h = h_kv * heads_per_kv + g
            mask_head = h // heads_per_mask_head
            count = mCounts[b, mask_head, n_tile]
            tQsQ, tQgQ = tma_tiles(tma_q, mQ[None, None, h, b], sQ, (BLOCK_M, d))
            tOsO, tOgO = tma_tiles(tma_do, mdO[None, None, h, b], sdO, (BLOCK_M, d))
            for j in cutlass.range(count, unroll=1):
                entry = mEntries[b, mask_head, n_tile, j]
                m_tile = listed_tile(entry)
                slot = it % QDO_STAGES
                phase = (it // QDO_STAGES) % 2
                cute.arch.mbarrier_wait(empty + slot, phase ^ 1)
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(full + slot, 2 * self.q_bytes)
                cute.copy(tma_q, tQgQ[None, m_tile], tQsQ[None, slot], tma_bar_ptr=full + slot)
                cute.copy(tma_do, tOgO[None, m_tile], tOsO[None, slot], tma_bar_ptr=full + slot)
                # While the copies run: the tile's 64 lse and delta rows, two per lane.
                for r in cutlass.range_constexpr(BLOCK_M // 32):
                    i = lane + 32 * r
                    row = m_tile * BLOCK_M + i
                    lse = cutlass.Float32.inf
                    delta = cutlass.Float32(0.0)
                    if row < seqlen_q:
                        forward_lse = mLse[b, h, row]
                        if forward_lse != -cutlass.Float32.inf:
                            lse = forward_lse * LOG2E
                        delta = mDelta[b, h, row]
                    sLse[i, slot] = lse
                    sDelta[i, slot] = delta
                # Every lane's rows are stored before the slot's second arrival.
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(full + slot)
                it += 1

    @cute.jit
    def consume(
        self, sdp_mma_init, sdp_mma, dkv_mma, dq_mma_init, dq_mma, tma_dk, mdK, tma_dv, mdV,
        mBounds, mEntries, mCounts, sK, sV, sQ, sdO, sdS, sdQ, sdQ_plain, dq_swizzle, sLse,
        sDelta, kv_full, full, empty, dq_full, dq_empty, n_tile, h_kv, b, wg, thread, seqlen_q,
        seqlen_k, heads_per_kv, heads_per_mask_head, qk_scale, softmax_scale,
    ):  # fmt: skip
        """Consumer warpgroup ``wg``: dK and dV of keys ``n_tile * 128 + wg * 64 ...``, and its
        half of D of every listed tile's dQ (left for the writer warp)."""
        sdp_thr = sdp_mma.get_slice(thread)
        dkv_thr = dkv_mma.get_slice(thread)
        dq_thr = dq_mma.get_slice(thread)
        # A operands of S^T and dP^T: this warpgroup's half of K and of V.
        tSrK = sdp_thr.make_fragment_A(sdp_thr.partition_A(sK))[None, None, None, wg]
        tSrV = sdp_thr.make_fragment_A(sdp_thr.partition_A(sV))[None, None, None, wg]
        # B operands: Q and dO K-major (S^T, dP^T) and MN-major (dK, dV), per ring slot.
        tSrQ = sdp_thr.make_fragment_B(sdp_thr.partition_B(sQ))
        tSrdO = sdp_thr.make_fragment_B(sdp_thr.partition_B(sdO))
        tKrQt = dkv_thr.make_fragment_B(dkv_thr.partition_B(transposed(sQ)))
        tVrdOt = dkv_thr.make_fragment_B(dkv_thr.partition_B(transposed(sdO)))
        # dQ: dS (all 128 keys) times this warpgroup's half of the columns of K^T, whose keys
        # lie in K's two halves: (D / 2, 64 keys, column half, key half).
        tQrdS = dq_thr.make_fragment_A(dq_thr.partition_A(sdS))
        tQrKt = dq_thr.make_fragment_B(dq_thr.partition_B(halves(transposed(sK))))
        # This warpgroup's keys of dS^T (its stores), per buffer: (64 keys, 64 queries, buffer).
        sdSt_own = halves(transposed(sdS))
        tSsdSt = sdp_thr.partition_C(sdSt_own)

        acc_dk = dkv_thr.make_fragment_C(dkv_thr.partition_shape_C(self.dkv_tiler[:2]))
        acc_dv = dkv_thr.make_fragment_C(dkv_thr.partition_shape_C(self.dkv_tiler[:2]))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        dkv_mma.set(warpgroup.Field.ACCUMULATE, True)
        sdp_mma_init.set(warpgroup.Field.ACCUMULATE, False)
        sdp_mma.set(warpgroup.Field.ACCUMULATE, True)
        dq_mma_init.set(warpgroup.Field.ACCUMULATE, False)
        dq_mma.set(warpgroup.Field.ACCUMULATE, True)
        st_shape = sdp_thr.partition_shape_C(self.sdp_tiler[:2])
        dq_shape = dq_thr.partition_shape_C(self.dq_tiler[:2])
        # Coordinates (key, query) of each transposed score the thread holds, in a 64 x 64 tile.
        tScS = sdp_thr.partition_C(cute.make_identity_tensor(self.sdp_tiler[:2]))
        tScS_mn = cute.make_tensor(tScS.iterator, row_col_view(tScS.layout))
        num_keys = cute.size(tScS_mn, mode=[0])
        num_queries = cute.size(tScS_mn, mode=[1])
        key0 = n_tile * BLOCK_N + wg * HALF_KEYS
        keys = [key0 + tScS_mn[i, 0][0] for i in range(num_keys)]
        # Each key's last visible query row below the causal diagonal: row >= key - (Sk - Sq).
        first_row = [key - seqlen_k + seqlen_q for key in keys]
        p_frag = cute.make_rmem_tensor(probabilities_layout(BLOCK_M), sQ.element_type)
        ds_frag = cute.make_rmem_tensor(probabilities_layout(BLOCK_M), sQ.element_type)
        bounds = cute.make_rmem_tensor(cute.make_layout((4, num_keys)), cutlass.Int32)
        my_barrier = OWN_BARRIER[0]
        if wg == 1:
            my_barrier = OWN_BARRIER[1]

        cute.arch.mbarrier_wait(kv_full, 0)
        it = cutlass.Int32(0)
        for g in cutlass.range(heads_per_kv, unroll=1):
            h = h_kv * heads_per_kv + g
            mask_head = h // heads_per_mask_head
            count = mCounts[b, mask_head, n_tile]
            if cutlass.const_expr(self.v.has_mask):
                self.load_bounds(mBounds, b, mask_head, keys, bounds)
            for j in cutlass.range(count, unroll=1):
                entry = mEntries[b, mask_head, n_tile, j]
                m_tile = listed_tile(entry)
                slot = it % QDO_STAGES
                buf = it % 2
                cute.arch.mbarrier_wait(full + slot, (it // QDO_STAGES) % 2)
                acc_st = sdp_thr.make_fragment_C(st_shape)
                acc_dpt = sdp_thr.make_fragment_C(st_shape)
                warpgroup.fence()
                self.gemm_kblocks(sdp_mma_init, sdp_mma, acc_st, tSrK, tSrQ[None, None, None, slot])
                warpgroup.commit_group()
                self.gemm_kblocks(
                    sdp_mma_init, sdp_mma, acc_dpt, tSrV, tSrdO[None, None, None, slot]
                )
                warpgroup.commit_group()
                # The tile's rows: base-2 lse and delta of the thread's query columns.
                row0 = m_tile * BLOCK_M
                warpgroup.wait_group(1)
                st_mn = cute.make_tensor(acc_st.iterator, row_col_view(acc_st.layout))
                self.probabilities(
                    st_mn, entry, tScS_mn, sLse, slot, row0, bounds, first_row, qk_scale
                )
                p_as_st = cute.make_tensor(p_frag.iterator, acc_st.layout)
                p_as_st.store(acc_st.load().to(sQ.element_type))
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(p_frag, mode=[2])):
                    cute.gemm(
                        dkv_mma, acc_dv, p_frag[None, None, kb],
                        tVrdOt[None, None, kb, slot], acc_dv,
                    )  # fmt: skip
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                dpt_mn = cute.make_tensor(acc_dpt.iterator, row_col_view(acc_dpt.layout))
                for c in cutlass.range_constexpr(num_queries):
                    delta = sDelta[tScS_mn[0, c][1], slot]
                    for r in cutlass.range_constexpr(num_keys):
                        dpt_mn[r, c] = st_mn[r, c] * (dpt_mn[r, c] - delta)
                ds_as_st = cute.make_tensor(ds_frag.iterator, acc_dpt.layout)
                ds_as_st.store(acc_dpt.load().to(sQ.element_type))
                # dS^T into this warpgroup's keys of the buffer (last read by the dQ products
                # of two tiles ago, which both warpgroups awaited before the last barrier).
                ds_own = tSsdSt[None, None, None, wg, buf]
                cute.autovec_copy(ds_as_st, ds_own)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=CONSUMER_THREADS)
                acc_dq = dq_thr.make_fragment_C(dq_shape)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tQrdS, mode=[2])):
                    keys_per_half = cute.size(tQrKt, mode=[2])
                    cute.gemm(
                        dq_mma if kb > 0 else dq_mma_init, acc_dq, tQrdS[None, None, kb, buf],
                        tQrKt[None, None, kb % keys_per_half, wg, kb // keys_per_half], acc_dq,
                    )  # fmt: skip
                warpgroup.commit_group()
                # dS^T's registers are final before the product that reads them (else ptxas
                # inserts the fence itself, after its own choice of instructions).
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(ds_frag, mode=[2])):
                    cute.gemm(
                        dkv_mma, acc_dk, ds_frag[None, None, kb], tKrQt[None, None, kb, slot],
                        acc_dk,
                    )  # fmt: skip
                warpgroup.commit_group()
                # dV and dQ are in (dK still runs): dQ's half through its buffer to the
                # accumulator.
                warpgroup.wait_group(1)
                dq_stage = wg * DQ_BUFFERS + buf
                # The writer has read what this buffer held two tiles ago.
                cute.arch.mbarrier_wait(dq_empty + dq_stage, ((it // DQ_BUFFERS) % 2) ^ 1)
                dq_scaled = cute.make_rmem_tensor_like(acc_dq, cutlass.Float32)
                dq_scaled.store(acc_dq.load() * softmax_scale)
                if cutlass.const_expr(self.v.causal or self.v.has_mask):
                    cute.autovec_copy(dq_scaled, dq_thr.partition_C(sdQ[None, None, dq_stage]))
                else:
                    # Unmasked, the stores' 16 addresses, each computed apart through the
                    # swizzled pointer, spilled: one swizzled base per group of 8 columns
                    # instead (its pair on two rows). The other variants do not spill, and
                    # there the bases' work per tile measured 2-3% slower.
                    tDQsC = dq_thr.partition_C(sdQ_plain[None, None, dq_stage])
                    for j in cutlass.range_constexpr(cute.size(dq_scaled, mode=[0, 2])):
                        group = ((None, None, j), 0, 0)
                        bases = swizzled_at_first(tDQsC[group], dq_swizzle)
                        cute.autovec_copy(dq_scaled[group], bases)
                # Handed to the writer warp: the stores seen by the async proxy, each warp's
                # lanes done, one arrival per warp.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                if cute.arch.lane_idx() == 0:
                    cute.arch.mbarrier_arrive(dq_full + dq_stage)
                warpgroup.wait_group(0)
                # Every product reading the slot is done: one arrival per warp.
                cute.arch.sync_warp()
                if cute.arch.lane_idx() == 0:
                    cute.arch.mbarrier_arrive(empty + slot)
                it += 1
        self.store_dk_dv(
            dkv_thr, acc_dk, acc_dv, tma_dk, mdK, tma_dv, mdV, sK, sV, n_tile, h_kv, b, wg,
            thread, my_barrier, softmax_scale,
        )  # fmt: skip

    @cute.jit
    def write_dq(
        self, tma_dq, mdQ, sdQ, dq_full, dq_empty, mEntries, mCounts, mTurns, mTickets, n_tile,
        h_kv, b, heads_per_kv, heads_per_mask_head,
    ):  # fmt: skip
        """The dQ writer warp: walks the consumers' tile sequence and adds each tile's two dQ
        halves, left in the consumers' buffers, to the fp32 accumulator with one TMA reduce-add
        each (the copy elects one lane of the warp). Deterministic, a tile's adds wait for its
        turn: until the query tile's counter in ``mTurns`` reaches the entry's ticket (the adds
        of every higher key tile listing it are done), and then advance it."""
        d = self.v.head_dim
        lane = cute.arch.lane_idx()
        it = cutlass.Int32(0)
        for g in cutlass.range(heads_per_kv, unroll=1):
            h = h_kv * heads_per_kv + g
            mask_head = h // heads_per_mask_head
            count = mCounts[b, mask_head, n_tile]
            tDQsDQ, tDQgDQ = cpasync.tma_partition(
                tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                cute.group_modes(
                    cute.local_tile(mdQ[None, None, h, b], (BLOCK_M, d // 2), (None, None)), 0, 2
                ),
            )  # fmt: skip
            for j in cutlass.range(count, unroll=1):
                entry = mEntries[b, mask_head, n_tile, j]
                m_tile = listed_tile(entry)
                buf = it % DQ_BUFFERS
                phase = (it // DQ_BUFFERS) % 2
                if cutlass.const_expr(self.v.deterministic):
                    # This query tile's counter (a trace-time branch: also read below).
                    turn = mTurns[b, h, None].iterator + m_tile
                    if lane == 0:
                        ticket = mTickets[b, mask_head, n_tile, j]
                        seen = load_acquire(turn)
                        while seen != ticket:
                            seen = load_acquire(turn)
                    cute.arch.sync_warp()
                    # The adds (async proxy) after the acquire that saw the turn come.
                    cute.arch.fence_proxy("async.global")
                for wg in cutlass.range_constexpr(2):
                    stage = wg * DQ_BUFFERS + buf
                    cute.arch.mbarrier_wait(dq_full + stage, phase)
                    cute.copy(tma_dq, tDQsDQ[None, stage], tDQgDQ[None, m_tile, wg])
                cute.arch.cp_async_bulk_commit_group()
                # The reduce-adds have read both buffers (not necessarily added yet); every
                # lane waits, so the electing lane's wait is in before the arrivals.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                if lane == 0:
                    for wg in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_arrive(dq_empty + wg * DQ_BUFFERS + buf)
                if cutlass.const_expr(self.v.deterministic):
                    # The adds are done, and ordered before the counter's release, which the
                    # next key tile's acquire pairs with.
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_proxy("async.global")
                    cute.arch.sync_warp()
                    if lane == 0:
                        release_increment(turn)
                it += 1

    @cute.jit
    def gemm_kblocks(self, mma_init, mma, acc, a, b):
        """``acc = A B^T`` over the k-blocks of fragments ``a`` and ``b`` (issued, not
        committed)."""
        for kb in cutlass.range_constexpr(cute.size(a, mode=[2])):
            cute.gemm(mma if kb > 0 else mma_init, acc, a[None, None, kb], b[None, None, kb], acc)

    @cute.jit
    def load_bounds(self, mBounds, b, mask_head, keys, bounds):
        """The ``(LTS, LTE, UTS, UTE)`` of each of the thread's keys, one 16-byte load each from
        the column-major bounds (padded to whole tiles: no range check)."""
        for i in cutlass.range_constexpr(len(keys)):
            offset = ((b * mBounds.shape[1] + mask_head) * mBounds.shape[2] + keys[i]) * 4
            column = cute.make_tensor(
                mBounds.iterator + cute.assume(offset, divby=4), cute.make_layout(4)
            )
            cute.autovec_copy(column, bounds[None, i])

    @cute.jit
    def probabilities(self, st_mn, entry, tScS_mn, sLse, slot, row0, bounds, first_row, qk_scale):
        """``P^T = exp2(S^T * qk_scale - lse)`` in place of the thread's transposed scores
        ``st_mn`` (keys, queries), hidden pairs set to 0 on a partial tile (list ``entry >=
        0``; every tile in the dense mode)."""
        for c in cutlass.range_constexpr(cute.size(st_mn, mode=[1])):
            lse = sLse[tScS_mn[0, c][1], slot]
            for r in cutlass.range_constexpr(cute.size(st_mn, mode=[0])):
                st_mn[r, c] = cute.math.exp2(st_mn[r, c] * qk_scale - lse, fastmath=True)
        masks = self.v.has_mask or self.v.causal
        if cutlass.const_expr(masks and self.v.mask_full_tiles):
            self.hide(st_mn, tScS_mn, row0, bounds, first_row)
        elif cutlass.const_expr(masks):  # noqa: SIM102
            # Two ifs: a compile-time condition cannot share a test with a run-time one.
            if entry >= 0:
                self.hide(st_mn, tScS_mn, row0, bounds, first_row)

    @cute.jit
    def hide(self, st_mn, tScS_mn, row0, bounds, first_row):
        """Zero the probabilities of the hidden (key, query row) pairs: row in ``[LTS, LTE)``
        or ``[UTS, UTE)`` of the key's bounds, or (causal) above the key's first visible row."""
        for c in cutlass.range_constexpr(cute.size(st_mn, mode=[1])):
            row = row0 + tScS_mn[0, c][1]
            for r in cutlass.range_constexpr(cute.size(st_mn, mode=[0])):
                hidden = False
                if cutlass.const_expr(self.v.has_mask):
                    hidden = row >= bounds[0, r] and row < bounds[1, r]
                    if cutlass.const_expr(self.v.has_upper):
                        hidden = hidden or (row >= bounds[2, r] and row < bounds[3, r])
                if cutlass.const_expr(self.v.causal):
                    hidden = hidden or row < first_row[r]
                if hidden:
                    st_mn[r, c] = 0.0

    @cute.jit
    def store_dk_dv(
        self, dkv_thr, acc_dk, acc_dv, tma_dk, mdK, tma_dv, mdV, sK, sV, n_tile, h_kv, b, wg,
        thread, my_barrier, softmax_scale,
    ):  # fmt: skip
        """dK (scaled) and dV of the warpgroup's 64 keys through its halves of the K and V
        tiles and one TMA store each."""
        d = self.v.head_dim
        # Both warpgroups' last dQ products (which read all of K) are done.
        cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=CONSUMER_THREADS)
        self.stage_rows(dkv_thr, acc_dk, sK, wg, softmax_scale)
        self.stage_rows(dkv_thr, acc_dv, sV, wg, 1.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=my_barrier, number_of_threads=WARPGROUP_THREADS)
        if thread == 0:
            tKs, tKg = tma_tiles(tma_dk, mdK[None, None, h_kv, b], sK, (HALF_KEYS, d))
            tVs, tVg = tma_tiles(tma_dv, mdV[None, None, h_kv, b], sV, (HALF_KEYS, d))
            cute.copy(tma_dk, tKs[None, wg], tKg[None, 2 * n_tile + wg])
            cute.copy(tma_dv, tVs[None, wg], tVg[None, 2 * n_tile + wg])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def stage_rows(self, dkv_thr, acc, s, wg, scale):
        """``acc * scale`` (the warpgroup's 64 rows) into its half ``wg`` of the tile ``s``."""
        out = cute.make_rmem_tensor_like(acc, s.element_type)
        out.store((acc.load() * scale).to(s.element_type))
        tCs = dkv_thr.partition_C(s[None, None, wg])
        for i in cutlass.range_constexpr(cute.size(out)):
            tCs[i] = out[i]
