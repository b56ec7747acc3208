"""Warp-specialised forward for Hopper (sm_90a), written in CuTe DSL, on our tile lists.

One program per (query tile of 128 rows, query head, batch), launched heaviest first when the
preparation gives a launch order. Per program, 384 threads in three warpgroups:

* warpgroup 0, the producer: after ``setmaxnreg`` gives its registers back, one thread loads the
  two 64-row halves of the Q tile (one mbarrier) and then, for each entry of the query tile's
  list (``tiles.forward_lists``: partial tiles first, then unmasked ones encoded ``-e - 1``),
  the K tile and the V tile into two rings of ``kv_stages`` slots (``PipelineTmaAsync``: a
  "full" barrier the copy completes, an "empty" one both consumer warpgroups release);
* warpgroups 1 and 2, the consumers, each owning 64 of the tile's query rows: at list step
  ``j`` a consumer waits for its turn at the tensor cores (a named barrier the other warpgroup
  signals), issues ``S_j = Q K_j^T`` and the previous step's ``O += P_{j-1} V_{j-1}`` together,
  hands the turn over, waits for ``S_j`` alone and releases ``K_j``, applies the element mask
  on a partial tile (every tile in the dense mode) and runs the online softmax of ``S_j`` (row
  max over unscaled scores, ``p = exp2(s * scale - m)``) while its own ``P V`` and the other
  warpgroup's products run; then it waits for its ``P V``, releases ``V_{j-1}`` and rescales
  O where a warp's rows raised their max (one vote; in the ``ForwardVariant.lazy_rescale``
  variants the max rises only when a tile passes it by more than ``RESCALE_SLACK``).
  After the list: the last ``P V``, ``O / l`` through the warpgroup's Q half in shared memory
  and one TMA store, and the lse of its rows (``-inf`` and ``O = 0`` on a fully masked row).

The element mask of a partial tile reads the four normalised row bounds ``(LTS, LTE, UTS, UTE)``
of each of its key columns in one 16-byte load from the column-major bounds
``[B, Hm, Sk padded, 4]`` (``launch.column_major_bounds`` of ``tiles.column_bounds``): query
row ``r`` is hidden from column ``c`` when ``LTS <= r < LTE`` or ``UTS <= r < UTE``, when causal
and ``c > r + Sk - Sq``, and when ``c >= Sk`` (the padding columns hide every row; without a
mask the kernel compares ``c`` with ``Sk``). TMA reads past a sequence's end as zeros and clips the
O store, so any ``Sq`` and ``Sk`` run.

The persistent variant (``ForwardVariant.persistent``; the launcher's choice for non-causal
interval masks) launches one program per SM instead, each taking work items (query tile, query
head, batch) in turn: its own first (its program index), then each next one from a global counter
that the producer bumps and hands to the consumers through a two-slot ring in shared memory. The
K/V rings run on from one item to the next (the producer loads an item's first K/V tiles before
its Q, which waits until both consumer warpgroups' O stores of the previous item have left the
Q tile), and the consumers' turns at the tensor cores alternate across items as within one. The
other variants compile exactly as before (their PTX is unchanged).

The FP8 variant (``ForwardVariant.fp8``, ``launch.forward_fp8``) runs the same schedule on
e4m3 Q, K and V^T (8-bit MMA operands are K-major: the launcher's pre-pass transposes V and
permutes its keys within groups of 16, ``fp8_layout``), scales the scores by ``q_descale *
k_descale`` and O by ``v_descale`` per (batch, K/V head), rounds P to e4m3 for ``P V`` (row sums
over the fp32 probabilities), and stores a bf16/fp16 O through a Q region of O's size; every
other variant compiles to the same code as before it existed.

The kernel compiles on a machine without a GPU (``CUTE_DSL_ARCH=sm_90a``): the CPU suite builds
every variant (``tests/kernels/cute_kernels``); ``tests/gpu`` proves its results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from flashmask.kernels.cute_kernels import fp8_layout

LOG2E = math.log2(math.e)
# How far (base 2) a tile's top score may pass its row's running max before the max rises and O
# is rescaled: P then reaches at most 2^8 = 256 (bf16, fp16 and e4m3 hold it), and after a
# row's first tiles most tiles leave O alone (the variants ``ForwardVariant.lazy_rescale``
# names; the others raise the max on every larger tile top).
RESCALE_SLACK = 8.0

# Threads of a warpgroup, rows of Q per consumer warpgroup, query rows per program.
WARPGROUP_THREADS = 128
HALF_ROWS = 64
BLOCK_M = 2 * HALF_ROWS
# Registers per thread after setmaxnreg: the producer gives back what the consumers take
# (3 x 128 threads x 168 = 64K registers at launch).
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
# Named barrier ids (0 is __syncthreads): the consumers' turns at the tensor cores, and each
# consumer warpgroup's own barrier before its O store.
TURN_BARRIER = (1, 2)
EPILOGUE_BARRIER = (3, 4)


@dataclass(frozen=True)
class ForwardVariant:
    """The static parameters one compiled forward specialises on.

    ``head_dim``: D (64, 128, 192 or 256); ``block_n``: keys per tile (the lists' tile width);
    ``kv_stages``: K/V ring slots; ``causal``, ``has_mask``, ``has_upper``: the mask's form;
    ``mask_full_tiles``: the dense mode (every tile masked); ``ordered``: the grid follows a
    launch order; ``persistent``: one program per SM takes query tiles from a counter (needs
    the launch's program count and a zeroed counter); ``head_dim_v``: V's (and O's) head dim
    where it differs from D, at most D (MLA's 192 / 128), ``None`` where equal; ``softcap``:
    Gemma's logit cap (0: none), a compile-time constant like the Gluon kernels' ``SOFTCAP``
    (a model uses one); ``fp8``: q, k and v are float8 e4m3, v given transposed with its keys
    permuted (``launch.forward_fp8``'s pre-pass), O in the compile's dtype, and the score and
    O scales per (batch, K/V head) from a descale tensor (the FP8 forward, below); ``sinks``:
    one learnable logit per query head (gpt-oss's, from a float32 ``[Hq]`` tensor) joins every
    row's softmax denominator at the end of the row, so that O and lse leave the kernel
    folded, without ``kernels.sinks.fold_sinks``' pass over O; ``edge_intervals``: every
    column's lower interval runs to the last row and its upper one (non-causal) starts at row
    0 (``startend_row_indices`` of one column per key when causal, two when not: the bounds'
    LTE is Sq and UTS is 0), so a row is hidden where ``row >= LTS`` or ``row < UTE``."""

    head_dim: int
    block_n: int
    kv_stages: int
    causal: bool
    has_mask: bool
    has_upper: bool
    mask_full_tiles: bool
    ordered: bool
    persistent: bool = False
    head_dim_v: int | None = None
    softcap: float = 0.0
    fp8: bool = False
    sinks: bool = False
    edge_intervals: bool = False

    @property
    def lazy_rescale(self) -> bool:
        """Whether a row's max rises only past ``RESCALE_SLACK`` rather than on every larger
        tile top. Measured on an H100 (``docs/performance.md``):
        4.5% faster on the one-item variants and 2% on the capped persistent one (whose spills
        fall from 56/80 to 16/20 bytes), but 2.7% slower on the plain persistent one (whose
        spills grow from 40/64 to 104/112 bytes). FP8 keeps the exact max: a row's top P of up
        to 2^8 rounds in e4m3 (2^-4) where the exact max makes it 1, which tripled the error on
        peaked rows."""
        if self.fp8:
            return False
        return not self.persistent or self.softcap != 0.0

    @property
    def value_dim(self) -> int:
        """V's and O's head dim (``head_dim`` unless ``head_dim_v`` says otherwise)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def row_col_view(layout: cute.Layout) -> cute.Layout:
    """The ``(rows, columns)`` view of a Hopper warpgroup MMA accumulator fragment
    ``((2, 2, V), M, N)``: per thread, values ``(column pair, row half, column group)`` of each
    ``M x N`` atom, regrouped as ``((row half, M), ((column pair, column group), N))``."""
    shape, stride = layout.shape, layout.stride
    return cute.make_layout(
        ((shape[0][1], shape[1]), ((shape[0][0], shape[0][2]), shape[2])),
        stride=((stride[0][1], stride[1]), ((stride[0][0], stride[0][2]), stride[2])),
    )


def probabilities_layout(block_n: int) -> cute.Layout:
    """The register layout of ``P [64, block_n]`` as the ``P V`` product's A operand, over the
    same registers as the score accumulator ``((2, 2, block_n / 8), 1, 1)``: k-block ``kb``'s
    values ``(column pair, row half, column half)`` sit at ``c + 2 r + 4 h + 8 kb``."""
    return cute.make_layout(((2, 2, 2), 1, block_n // 16), stride=((1, 2, 4), 0, 8))


def fp8_layout_of(spec: tuple[tuple, tuple]) -> cute.Layout:
    """The CuTe layout of one of ``fp8_layout``'s ``(shape, stride)`` pairs."""
    shape, stride = spec
    return cute.make_layout(shape, stride=stride)


def consumer_state(stages: int, n) -> pipeline.PipelineState:
    """A consumer's state of a ``stages``-slot ring at its ``n``-th tile (slot ``n % stages``,
    phase bit ``n // stages`` mod 2): what ``n`` advances of a fresh state give."""
    return pipeline.PipelineState(stages, n, n % stages, (n // stages) % 2)


def grid_position(item, tiles, heads) -> tuple:
    """``(tile, head, batch)`` of linear work item ``item`` of a ``(tiles, heads, batch)`` grid,
    tiles fastest (how a launch order names programs)."""
    return item % tiles, (item // tiles) % heads, item // (tiles * heads)


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None) -> cutlass.Float32:
    """PTX's ``tanh.approx.f32`` of ``x`` (one MUFU operation; 2^-11 relative error)."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
            "tanh.approx.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def listed_tile(entry):
    """The tile of a list entry: a partial tile ``e >= 0`` is itself, an unmasked one is
    encoded ``-e - 1`` (``tiles.compact``)."""
    tile = entry
    if entry < 0:
        tile = -entry - 1
    return tile


def tma_tiles(atom, tensor: cute.Tensor, smem_tensor: cute.Tensor, tile, coord=(None, 0)):
    """``(shared, global)`` TMA partitions of ``smem_tensor``'s slots and of ``tensor``'s tiles
    of ``tile`` (``coord``: which of its modes runs over the tiles; by default the first), one
    copy per call."""
    tiles = cute.local_tile(tensor, tile, coord)
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem_tensor, 0, 2),
        cute.group_modes(tiles, 0, 2),
    )  # fmt: skip


@dataclass(frozen=True)
class WorkItems:
    """A persistent launch's work items, one per (query tile, query head, batch): ``num_items``
    of them over ``num_m_tiles`` tiles and ``num_heads`` heads; the head ratios that map a query
    head to its K/V head and mask head."""

    num_m_tiles: cutlass.Int32
    num_heads: cutlass.Int32
    num_items: cutlass.Int32
    heads_per_kv: cutlass.Int32
    heads_per_mask_head: cutlass.Int32


class HopperForward:
    """The CuTe forward of one :class:`ForwardVariant`; call it through ``cute.compile``."""

    def __init__(self, variant: ForwardVariant):
        self.v = variant
        self.qk_tiler = (HALF_ROWS, variant.block_n, variant.head_dim)
        self.pv_tiler = (HALF_ROWS, variant.value_dim, variant.block_n)
        # O's 64-row halves leave through Q's shared memory, in their own layout where V's
        # head dim is not Q's (the M x K view of an (M, N, K) tiler).
        self.o_tiler = (HALF_ROWS, variant.block_n, variant.value_dim)
        # Q half h sits in Q slot h * q_spread. FP8: an O half (16-bit) takes the bytes of two
        # fp8 Q slots, so Q has four slots with its halves in slots 0 and 2, and warpgroup
        # h's O half covers exactly slots 2h and 2h + 1: its own Q half and an unused one,
        # never the other warpgroup's Q half (which that warpgroup may still be reading).
        self.q_spread = 2 if variant.fp8 else 1

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mBounds: cute.Tensor,
        mEntries: cute.Tensor,
        mCounts: cute.Tensor,
        mOrder: cute.Tensor,
        mNextItem: cute.Tensor,
        num_programs: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        heads_per_mask_head: cutlass.Int32,
        qk_scale: cutlass.Float32,
        stream,
        mScales: cute.Tensor | None = None,
        mSinks: cute.Tensor | None = None,
    ):
        """``mQ [B, Sq, Hq, D]``, ``mK [B, Sk, Hk, D]``, ``mV [B, Sk, Hk, Dv]``, ``mO [B, Sq, Hq,
        Dv]`` (unit stride along the head dim; ``Dv``: the variant's ``value_dim``; FP8: ``mV``
        is V^T ``[B, Hk, D, Sk padded]``, unit stride along the keys, which are permuted within
        each group of 16 as ``fp8_layout.KEY_ORDER`` says, and ``mScales`` float32
        ``[B, Hk, 2]`` holds each (batch, K/V head)'s ``q_descale * k_descale``, which
        multiplies ``qk_scale``, and ``v_descale``, which multiplies O; the others pass none,
        or, with sinks, a tensor never read), ``mSinks`` float32 ``[Hq]`` (a ``sinks`` variant
        only: the sinks' logits, natural log),
        ``mLse`` float32 ``[B, Hq, Sq]``, ``mBounds`` int32 column-major ``[B, Hm, Sk padded, 4]``
        (read only with a mask), ``mEntries`` int32 ``[B, Hm, Tm, Tn]``, ``mCounts`` int32
        ``[B, Hm, Tm]``, ``mOrder`` int32 ``[B * Hq * Tm]`` (read only when ordered);
        persistent only (the others ignore both): ``mNextItem`` int32 ``[1]``, zero at launch,
        the counter the programs take items from, and ``num_programs``, the grid's size;
        ``seqlen_k``: Sk; ``qk_scale`` = softmax scale x log2(e), positive unless the variant
        caps the scores (``softcap``: any sign)."""
        # The inputs' dtype and O's (the same but in the FP8 forward).
        dtype = mQ.element_type
        out_dtype = mO.element_type
        self.out_dtype = out_dtype
        # (S, D, H, B) views: the sequence first, as the MMA's M/N mode, D as its K mode.
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        k = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        o = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        # V as the P V product's B operand, (D, Sk, H, B): D (its N mode) contiguous, or, FP8
        # (8-bit operands must be K-major), the keys: V^T [B, Hk, D, Sk padded].
        if cutlass.const_expr(self.v.fp8):
            v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
        else:
            v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        # Two copies of the Q K^T MMA: one for a tile's first k-block (it overwrites S), one
        # for the rest (it accumulates). Each has its accumulate field set once, outside any
        # staged branch or loop: a field set under a branch does not reach uses after it.
        def mma(b_major, tiler, a_source=warpgroup.OperandSource.SMEM):
            """A one-warpgroup MMA over ``tiler``'s (M, N), A K-major, fp32 accumulator."""
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, cute.nvgpu.OperandMajorMode.K, b_major, cutlass.Float32, (1, 1, 1),
                tiler[:2], a_source,
            )  # fmt: skip

        qk_mma_init, qk_mma = (mma(cute.nvgpu.OperandMajorMode.K, self.qk_tiler) for _ in range(2))
        # P V: P from registers (the score accumulator's values), V MN-major (FP8: K-major).
        v_major, v_layout = cute.nvgpu.OperandMajorMode.MN, tensor_utils.LayoutEnum.COL_MAJOR
        if cutlass.const_expr(self.v.fp8):
            v_major, v_layout = cute.nvgpu.OperandMajorMode.K, tensor_utils.LayoutEnum.ROW_MAJOR
        pv_mma = mma(v_major, self.pv_tiler, warpgroup.OperandSource.RMEM)
        q_layout = tensor_utils.LayoutEnum.ROW_MAJOR
        q_smem = sm90_utils.make_smem_layout_a(q_layout, self.qk_tiler, dtype, 2 * self.q_spread)
        k_smem = sm90_utils.make_smem_layout_b(q_layout, self.qk_tiler, dtype, self.v.kv_stages)
        v_smem = sm90_utils.make_smem_layout_b(v_layout, self.pv_tiler, dtype, self.v.kv_stages)
        o_smem = sm90_utils.make_smem_layout_a(q_layout, self.o_tiler, out_dtype, 2)
        q_one = cute.slice_(q_smem, (None, None, 0))
        o_one = cute.slice_(o_smem, (None, None, 0))
        k_one = cute.slice_(k_smem, (None, None, 0))
        v_one = cute.slice_(v_smem, (None, None, 0))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(
            load, q, q_one, (HALF_ROWS, self.v.head_dim)
        )
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(
            load, k, k_one, (self.v.block_n, self.v.head_dim)
        )
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(
            load, v, v_one, (self.v.value_dim, self.v.block_n)
        )
        tma_o, tma_o_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, o_one, (HALF_ROWS, self.v.value_dim)
        )
        # Q's slots also hold the O halves (no larger than Q's where Dv <= D; FP8: as large as
        # its four slots), counted in Q's elements.
        q_elements = max(cute.cosize(q_smem), cute.cosize(o_smem) * out_dtype.width // dtype.width)
        self.q_bytes = cute.size_in_bytes(dtype, q_one)
        self.k_bytes = cute.size_in_bytes(dtype, k_one)
        self.v_bytes = cute.size_in_bytes(dtype, v_one)

        stages = self.v.kv_stages
        if cutlass.const_expr(self.v.persistent):
            # Also the Q tile's "empty" barrier and the item ring: two slots of an item index,
            # each with a "ready" and an "empty" barrier.
            @cute.struct
            class PersistentStorage:
                q_full: cute.struct.MemRange[cutlass.Int64, 1]
                q_empty: cute.struct.MemRange[cutlass.Int64, 1]
                item_ready: cute.struct.MemRange[cutlass.Int64, 2]
                item_empty: cute.struct.MemRange[cutlass.Int64, 2]
                k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                items: cute.struct.MemRange[cutlass.Int32, 2]
                sQ: cute.struct.Align[cute.struct.MemRange[dtype, q_elements], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(v_smem)], 1024]

            self.shared_storage = PersistentStorage
        else:

            @cute.struct
            class SharedStorage:
                q_full: cute.struct.MemRange[cutlass.Int64, 1]
                k_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sQ: cute.struct.Align[cute.struct.MemRange[dtype, q_elements], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(v_smem)], 1024]

            self.shared_storage = SharedStorage
        if cutlass.const_expr(self.v.persistent):
            self.persistent_kernel(
                qk_mma_init, qk_mma, pv_mma, tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v,
                tma_v_tensor, tma_o, tma_o_tensor, mLse, mBounds, mEntries, mCounts, mOrder,
                mNextItem, q_smem, k_smem, v_smem, o_smem, seqlen_k, heads_per_kv,
                heads_per_mask_head, qk_scale, mScales, mSinks,
            ).launch(
                grid=[num_programs, 1, 1],
                block=[3 * WARPGROUP_THREADS, 1, 1],
                smem=self.shared_storage.size_in_bytes(),
                stream=stream,
                # As below; the launcher starts at most one program per SM.
                min_blocks_per_mp=1,
            )  # fmt: skip
        else:
            num_m_tiles = cute.ceil_div(mQ.shape[1], BLOCK_M)
            self.kernel(
                qk_mma_init, qk_mma, pv_mma, tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v,
                tma_v_tensor, tma_o, tma_o_tensor, mLse, mBounds, mEntries, mCounts, mOrder,
                q_smem, k_smem, v_smem, o_smem, seqlen_k, heads_per_kv, heads_per_mask_head,
                qk_scale, mScales, mSinks,
            ).launch(
                grid=[num_m_tiles, mQ.shape[2], mQ.shape[0]],
                block=[3 * WARPGROUP_THREADS, 1, 1],
                smem=self.shared_storage.size_in_bytes(),
                stream=stream,
                # 384 threads, one program per SM: 168 registers each at launch (setmaxnreg
                # moves them from the producer to the consumers).
                min_blocks_per_mp=1,
            )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        qk_mma_init: cute.TiledMma,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mBounds: cute.Tensor,
        mEntries: cute.Tensor,
        mCounts: cute.Tensor,
        mOrder: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        o_smem: cute.ComposedLayout,
        seqlen_k: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        heads_per_mask_head: cutlass.Int32,
        qk_scale: cutlass.Float32,
        mScales: cute.Tensor | None,
        mSinks: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        storage, sQ, sK, sV, sO = self.shared_tiles(q_smem, k_smem, v_smem, o_smem)
        q_full = storage.q_full.data_ptr()

        # The program's work: (query tile, query head, batch), heaviest first.
        num_m_tiles, num_heads, _ = cute.arch.grid_dim()
        p, h, b = cute.arch.block_idx()
        if cutlass.const_expr(self.v.ordered):
            item = mOrder[p + num_m_tiles * (h + num_heads * b)]
            p, h, b = grid_position(item, num_m_tiles, num_heads)
        m_tile = num_m_tiles - 1 - p
        mask_head = h // heads_per_mask_head
        count = mCounts[b, mask_head, m_tile]
        k_pipe, v_pipe = self.init_barriers(storage, q_full, warp)

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.produce(
                    tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_full, k_pipe, v_pipe,
                    mEntries, count, m_tile, h, b, h // heads_per_kv, mask_head,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            item_qk_scale, out_scale = self.item_scales(mScales, qk_scale, b, h // heads_per_kv)
            self.consume(
                qk_mma_init, qk_mma, pv_mma, tma_o, mO, mLse, mBounds, mEntries, sQ, sK, sV, sO,
                q_full, k_pipe, v_pipe, count, m_tile, h, b, mask_head, role - 1,
                tidx % WARPGROUP_THREADS, warp, seqlen_k, item_qk_scale, 0, 0, out_scale, mSinks,
            )  # fmt: skip

    @cute.kernel
    def persistent_kernel(
        self,
        qk_mma_init: cute.TiledMma,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mBounds: cute.Tensor,
        mEntries: cute.Tensor,
        mCounts: cute.Tensor,
        mOrder: cute.Tensor,
        mNextItem: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        o_smem: cute.ComposedLayout,
        seqlen_k: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        heads_per_mask_head: cutlass.Int32,
        qk_scale: cutlass.Float32,
        mScales: cute.Tensor | None,
        mSinks: cute.Tensor | None,
    ):
        """The persistent variant: the program's work items, its own (its index) first, then
        each next one from ``mNextItem``."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        storage, sQ, sK, sV, sO = self.shared_tiles(q_smem, k_smem, v_smem, o_smem)
        q_full = storage.q_full.data_ptr()
        q_empty = storage.q_empty.data_ptr()
        items = storage.items.get_tensor(cute.make_layout(2))
        item_ready = storage.item_ready.data_ptr()
        item_empty = storage.item_empty.data_ptr()
        k_pipe, v_pipe = self.init_barriers(storage, q_full, warp)

        # mO is the (S, D, H, B) view.
        num_m_tiles = cute.ceil_div(mO.shape[0], BLOCK_M)
        work = WorkItems(
            num_m_tiles=num_m_tiles,
            num_heads=mO.shape[2],
            num_items=num_m_tiles * mO.shape[2] * mO.shape[3],
            heads_per_kv=heads_per_kv,
            heads_per_mask_head=heads_per_mask_head,
        )
        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.produce_items(
                    tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_full, q_empty, items,
                    item_ready, item_empty, k_pipe, v_pipe, mEntries, mCounts, mOrder, mNextItem,
                    work,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume_items(
                qk_mma_init, qk_mma, pv_mma, tma_o, mO, mLse, mBounds, mEntries, mCounts, mOrder,
                sQ, sK, sV, sO, q_full, q_empty, items, item_ready, item_empty, k_pipe, v_pipe,
                work, role - 1, tidx % WARPGROUP_THREADS, warp, seqlen_k, qk_scale, mScales,
                mSinks,
            )  # fmt: skip

    def item_scales(self, mScales, qk_scale, b, kv_head):
        """``(score scale, O scale)`` of a work item of batch ``b``, K/V head ``kv_head``: the
        launch's ``qk_scale`` and none, or, FP8, ``qk_scale * q_descale * k_descale`` and
        ``v_descale`` from ``mScales [B, Hk, 2]``."""
        if cutlass.const_expr(self.v.fp8):
            return qk_scale * mScales[b, kv_head, 0], mScales[b, kv_head, 1]
        return qk_scale, None

    def row_sink(self, mSinks, h):
        """Query head ``h``'s sink in base 2 (``mSinks[h] * log2(e)``, the unit of the running
        row max), or ``None`` in a variant without sinks."""
        if cutlass.const_expr(self.v.sinks):
            return mSinks[h] * LOG2E
        return None

    @cute.jit
    def shared_tiles(self, q_smem, k_smem, v_smem, o_smem):
        """The program's shared memory and its Q, K and V tiles in it, and the O halves' view
        of Q's slots."""
        smem = memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)
        if cutlass.const_expr(self.v.fp8):
            sO = storage.sQ.get_tensor(o_smem.outer, swizzle=o_smem.inner, dtype=self.out_dtype)
        else:
            sO = storage.sQ.get_tensor(o_smem.outer, swizzle=o_smem.inner)
        return storage, sQ, sK, sV, sO

    @cute.jit
    def init_barriers(self, storage, q_full, warp):
        """The K and V rings and the Q tile's barrier (with the persistent variant's Q "empty"
        and item ring barriers), initialised before any thread goes on."""
        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # One arrival per consumer warp (the pipeline signals from each warp's first lane).
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 8)

        def ring(barriers, tile_bytes):
            """A ring of ``kv_stages`` slots of one tile each (K or V)."""
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers.data_ptr(),
                num_stages=self.v.kv_stages,
                producer_group=producers,
                consumer_group=consumers,
                tx_count=tile_bytes,
                defer_sync=True,
            )

        k_pipe = ring(storage.k_barriers, self.k_bytes)
        v_pipe = ring(storage.v_barriers, self.v_bytes)
        if warp == 0 and cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_init(q_full, 1)
            if cutlass.const_expr(self.v.persistent):
                # Each consumer warpgroup's epilogue frees the Q tile (one arrival each); both
                # read every item slot before it is refilled.
                cute.arch.mbarrier_init(storage.q_empty.data_ptr(), 2)
                for slot in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.item_ready.data_ptr() + slot, 1)
                    cute.arch.mbarrier_init(storage.item_empty.data_ptr() + slot, 2)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return k_pipe, v_pipe

    @cute.jit
    def produce(
        self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_full, k_pipe, v_pipe,
        mEntries, count, m_tile, h, b, kv_head, mask_head,
    ):  # fmt: skip
        """The producer warp: both Q halves, then K and V of every listed key tile."""
        tQsQ, tQgQ = tma_tiles(tma_q, mQ[None, None, h, b], sQ, (HALF_ROWS, self.v.head_dim))
        kv = self.kv_partitions(tma_k, mK, tma_v, mV, sK, sV, kv_head, b)
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, 2 * self.q_bytes)
        for half in cutlass.range_constexpr(2):
            cute.copy(
                tma_q, tQgQ[None, 2 * m_tile + half], tQsQ[None, half * self.q_spread],
                tma_bar_ptr=q_full,
            )  # fmt: skip
        # K and V advance together: one state walks both rings.
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.v.kv_stages)
        for it in cutlass.range(count, unroll=1):
            self.load_kv(
                tma_k, tma_v, kv, k_pipe, v_pipe, state, mEntries[b, mask_head, m_tile, it]
            )
            state.advance()

    @cute.jit
    def kv_partitions(self, tma_k, mK, tma_v, mV, sK, sV, kv_head, b):
        """The TMA views ``(tKsK, tKgK, tVsV, tVgV)`` of K/V head ``kv_head`` of batch ``b``:
        the ring slots and the key tiles."""
        d, dv, n = self.v.head_dim, self.v.value_dim, self.v.block_n
        tKsK, tKgK = tma_tiles(tma_k, mK[None, None, kv_head, b], sK, (n, d))
        # V's tiles run over its second mode (D-major: its keys are the columns).
        tVsV, tVgV = tma_tiles(tma_v, mV[None, None, kv_head, b], sV, (dv, n), (0, None))
        return tKsK, tKgK, tVsV, tVgV

    @cute.jit
    def load_kv(self, tma_k, tma_v, kv, k_pipe, v_pipe, state, entry):
        """K and V of list entry ``entry``'s key tile into ring slot ``state.index``, each
        once the consumers have released that slot."""
        tKsK, tKgK, tVsV, tVgV = kv
        n_tile = listed_tile(entry)
        k_pipe.producer_acquire(state)
        cute.copy(
            tma_k, tKgK[None, n_tile], tKsK[None, state.index],
            tma_bar_ptr=k_pipe.producer_get_barrier(state),
        )  # fmt: skip
        v_pipe.producer_acquire(state)
        cute.copy(
            tma_v, tVgV[None, n_tile], tVsV[None, state.index],
            tma_bar_ptr=v_pipe.producer_get_barrier(state),
        )  # fmt: skip

    @cute.jit
    def locate(self, work, mOrder, w):
        """``(m_tile, h, b)`` of persistent work item ``w``: its place in the launch order
        (the items' own order unless ordered), a head's query tiles counted from the last
        (as the one-item grid's)."""
        item = w
        if cutlass.const_expr(self.v.ordered):
            item = mOrder[w]
        p, h, b = grid_position(item, work.num_m_tiles, work.num_heads)
        return work.num_m_tiles - 1 - p, h, b

    @cute.jit
    def produce_items(
        self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_full, q_empty, items, item_ready,
        item_empty, k_pipe, v_pipe, mEntries, mCounts, mOrder, mNextItem, work,
    ):  # fmt: skip
        """The persistent producer warp: for each of the program's work items (its own first,
        then each next one from the launch's counter, handed to the consumers through the item
        ring), K and V of every listed key tile and both Q halves. An item's first K/V tiles
        go out before its Q, which waits for the consumers' epilogue of the previous item
        (their O leaves through the Q tile): the rings refill under that epilogue."""
        programs, _, _ = cute.arch.grid_dim()
        w, _, _ = cute.arch.block_idx()
        # K and V advance together: one state walks both rings, across items.
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.v.kv_stages)
        u = cutlass.Int32(0)
        while w < work.num_items:
            m_tile, h, b = self.locate(work, mOrder, w)
            mask_head = h // work.heads_per_mask_head
            count = mCounts[b, mask_head, m_tile]
            kv = self.kv_partitions(tma_k, mK, tma_v, mV, sK, sV, h // work.heads_per_kv, b)
            q_after = cutlass.min(count, self.v.kv_stages)
            for it in cutlass.range(count, unroll=1):
                if it == q_after:
                    self.load_q(tma_q, mQ, sQ, q_full, q_empty, m_tile, h, b, u)
                entry = mEntries[b, mask_head, m_tile, it]
                self.load_kv(tma_k, tma_v, kv, k_pipe, v_pipe, state, entry)
                state.advance()
            if q_after == count:
                self.load_q(tma_q, mQ, sQ, q_full, q_empty, m_tile, h, b, u)
            # The next item (past the last: the consumers' signal to stop), into slot u % 2
            # once both consumer warpgroups have read what it held.
            nxt = w + programs
            if programs < work.num_items:
                if cute.arch.lane_idx() == 0:
                    nxt = cute.arch.atomic_add(mNextItem.iterator, cutlass.Int32(1)) + programs
                nxt = cute.arch.shuffle_sync(nxt, 0)
            slot = u % 2
            cute.arch.mbarrier_wait(item_empty + slot, ((u // 2) % 2) ^ 1)
            if cute.arch.lane_idx() == 0:
                items[slot] = nxt
                cute.arch.mbarrier_arrive(item_ready + slot)
            w = nxt
            u += 1

    @cute.jit
    def load_q(self, tma_q, mQ, sQ, q_full, q_empty, m_tile, h, b, u):
        """Both Q halves of the program's ``u``-th item, once the consumers' epilogue of the
        item before has left the Q tile (persistent variant)."""
        if u > 0:
            cute.arch.mbarrier_wait(q_empty, (u - 1) % 2)
        tQsQ, tQgQ = tma_tiles(tma_q, mQ[None, None, h, b], sQ, (HALF_ROWS, self.v.head_dim))
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, 2 * self.q_bytes)
        for half in cutlass.range_constexpr(2):
            cute.copy(
                tma_q, tQgQ[None, 2 * m_tile + half], tQsQ[None, half * self.q_spread],
                tma_bar_ptr=q_full,
            )  # fmt: skip

    @cute.jit
    def consume_items(
        self, qk_mma_init, qk_mma, pv_mma, tma_o, mO, mLse, mBounds, mEntries, mCounts, mOrder,
        sQ, sK, sV, sO, q_full, q_empty, items, item_ready, item_empty, k_pipe, v_pipe, work,
        wg, thread, warp, seqlen_k, qk_scale, mScales, mSinks,
    ):  # fmt: skip
        """Persistent consumer warpgroup ``wg``: rows ``wg * 64 ...`` of each of the program's
        query tiles, the program's own item first, then each one the producer hands over."""
        # Fields are set once, here: one set inside a staged loop or branch would not reach
        # the uses after it. O accumulates from the first P V on.
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_mma_init.set(warpgroup.Field.ACCUMULATE, False)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        w, _, _ = cute.arch.block_idx()
        u = cutlass.Int32(0)
        # K/V tiles consumed by the program's earlier items (the rings run on across items).
        consumed = cutlass.Int32(0)
        # The turns at the tensor cores alternate across items as within one: warpgroup 0
        # holds the first, warpgroup 1 hands it over once per program (here), and warpgroup 0
        # takes warpgroup 1's last hand-over once, after the last item. Balanced: each list
        # step of every item is, for warpgroup 0, "wait TURN[0], issue, arrive TURN[1]" and,
        # for warpgroup 1, "wait TURN[1], issue, arrive TURN[0]"; both run the same items with
        # the same counts, N steps in all. TURN[0] gets N + 1 arrivals (warpgroup 1: the
        # opening one and one per step) and N + 1 waits (warpgroup 0: one per step and the
        # closing one); TURN[1] gets N arrivals (warpgroup 0) and N waits (warpgroup 1). Each
        # barrier is 2 x 128 threads: one warpgroup's arrival and the other's wait complete a
        # phase. No arrival can run ahead of the wait it pairs with: warpgroup 1's arrival
        # after its step s follows its wait on TURN[1] at step s, which needs warpgroup 0's
        # arrival at step s, which follows warpgroup 0's wait on TURN[0] at step s (the phase
        # the previous arrival opened); symmetrically for TURN[1]. Item boundaries break no
        # link of that chain, so the N steps behave as one list. (A hand-over per item would
        # not: warpgroup 1 could make the next item's opening arrival before warpgroup 0
        # took the closing turn of this one, and TURN[0] would complete on warpgroup 1's two
        # arrivals alone.)
        if wg == 1:
            cute.arch.barrier_arrive(
                barrier_id=TURN_BARRIER[0], number_of_threads=2 * WARPGROUP_THREADS
            )
        while w < work.num_items:
            m_tile, h, b = self.locate(work, mOrder, w)
            mask_head = h // work.heads_per_mask_head
            count = mCounts[b, mask_head, m_tile]
            item_qk_scale, out_scale = self.item_scales(
                mScales, qk_scale, b, h // work.heads_per_kv
            )
            self.consume(
                qk_mma_init, qk_mma, pv_mma, tma_o, mO, mLse, mBounds, mEntries, sQ, sK, sV, sO,
                q_full, k_pipe, v_pipe, count, m_tile, h, b, mask_head, wg, thread, warp,
                seqlen_k, item_qk_scale, u, consumed, out_scale, mSinks,
            )  # fmt: skip
            if thread == 0:
                # The warpgroup's O store has read its Q half: the producer may load the next
                # Q once both have.
                cute.arch.mbarrier_arrive(q_empty)
            slot = u % 2
            cute.arch.mbarrier_wait(item_ready + slot, (u // 2) % 2)
            w = items[slot]
            # All the warpgroup's threads have read the slot before the producer refills it.
            cute.arch.barrier(
                barrier_id=EPILOGUE_BARRIER[0] + wg, number_of_threads=WARPGROUP_THREADS
            )
            if thread == 0:
                cute.arch.mbarrier_arrive(item_empty + slot)
            consumed += count
            u += 1
        if wg == 0:
            cute.arch.barrier(barrier_id=TURN_BARRIER[0], number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def consume(
        self, qk_mma_init, qk_mma, pv_mma, tma_o, mO, mLse, mBounds, mEntries, sQ, sK, sV, sO,
        q_full, k_pipe, v_pipe, count, m_tile, h, b, mask_head, wg, thread, warp, seqlen_k,
        qk_scale, u, consumed, out_scale=None, mSinks=None,
    ):  # fmt: skip
        """Consumer warpgroup ``wg``: rows ``m_tile * 128 + wg * 64 ...`` of the query tile. In
        the persistent variant the program's ``u``-th item, after ``consumed`` K/V tiles of its
        earlier items (:meth:`consume_items` sets the MMA fields and opens and closes the
        turns); the other variants pass ``u = consumed = 0``, unused. ``out_scale``: what O
        is multiplied by at the end (FP8: ``v_descale``; ``None``: nothing); ``mSinks``: the
        sinks of a ``sinks`` variant, read in the epilogue (:meth:`finish_rows`)."""
        qk_thr = qk_mma.get_slice(thread)
        pv_thr = pv_mma.get_slice(thread)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C(self.pv_tiler[:2]))
        acc_o.fill(0.0)
        if cutlass.const_expr(not self.v.persistent):
            # O accumulates from the first P V on. Fields are set once, here: one set inside a
            # staged loop or branch would not reach the uses after it.
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            qk_mma_init.set(warpgroup.Field.ACCUMULATE, False)
            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        s_shape = qk_thr.partition_shape_C(self.qk_tiler[:2])
        # Coordinates (row, column) of each score the thread holds, within the 64 x N tile.
        tScS = qk_thr.partition_C(cute.make_identity_tensor(self.qk_tiler[:2]))
        tScS_mn = cute.make_tensor(tScS.iterator, row_col_view(tScS.layout))
        num_rows = cute.size(tScS_mn, mode=[0])
        row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), cutlass.Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # Each row's O rescaling factor of the current step, applied once P_{j-1} V_{j-1} lands.
        o_scale = cute.make_rmem_tensor(cute.make_layout(num_rows), cutlass.Float32)
        # P in the score accumulator's order, read as the P V product's A operand (the 8-bit
        # operand's fragment takes other keys per thread: fp8_layout).
        p_layout = probabilities_layout(self.v.block_n)
        if cutlass.const_expr(self.v.fp8):
            p_layout = fp8_layout_of(fp8_layout.fragment_layout(self.v.block_n))
        p_prev = cute.make_rmem_tensor(p_layout, sQ.element_type)
        seqlen_q = mO.shape[0]
        row0 = m_tile * BLOCK_M + wg * HALF_ROWS
        my_turn = TURN_BARRIER[0]
        other_turn = TURN_BARRIER[1]
        if wg == 1:
            my_turn = TURN_BARRIER[1]
            other_turn = TURN_BARRIER[0]
        if cutlass.const_expr(self.v.persistent):
            cute.arch.mbarrier_wait(q_full, u % 2)
        else:
            # Warpgroup 0 holds the first turn: warpgroup 1 hands it over once.
            if wg == 1:
                cute.arch.barrier_arrive(
                    barrier_id=other_turn, number_of_threads=2 * WARPGROUP_THREADS
                )
            cute.arch.mbarrier_wait(q_full, 0)
        q_slot = wg
        if cutlass.const_expr(self.v.fp8):
            q_slot = wg * self.q_spread
        q_stage = tSrQ[None, None, None, q_slot]
        stages = self.v.kv_stages
        # Slot 0 holds step 0's K and V (persistent: the ring's tile number ``consumed``). The
        # loop's states start one step on; V is waited for at the end of a step and used (then
        # released) at the next one, so v_release lags v_wait by one and its index is the slot
        # of the previous step's V.
        first_index = 0
        if cutlass.const_expr(self.v.persistent):
            first_slot = consumer_state(stages, consumed)
            first_index = first_slot.index
            k_state = consumer_state(stages, consumed + 1)
            v_wait = consumer_state(stages, consumed + 1)
            v_release = consumer_state(stages, consumed)
        else:
            first_slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            k_state.advance()
            v_wait = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            v_wait.advance()
            v_release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # Step 0 has no P V to overlap; peeled, so that no warpgroup MMA is issued under a
        # branch (ptxas then closes its commit group on every path, and the wait for S_j
        # would also wait for P_{j-1} V_{j-1}). It binds no name the loop uses.
        if count > 0:
            k_pipe.consumer_wait(first_slot)
            cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * WARPGROUP_THREADS)
            s_first = self.issue_scores(
                qk_mma_init, qk_mma, qk_thr, s_shape, q_stage, tSrK, first_index
            )
            cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * WARPGROUP_THREADS)
            warpgroup.wait_group(0)
            k_pipe.consumer_release(first_slot)
            self.scores_to_probabilities(
                s_first, p_prev, mEntries[b, mask_head, m_tile, 0], tScS_mn, mBounds, b,
                mask_head, row0, seqlen_q, seqlen_k, row_max, row_sum, o_scale, qk_scale,
            )  # fmt: skip
            v_pipe.consumer_wait(first_slot)
        for it in cutlass.range(1, count, unroll=1):
            entry = mEntries[b, mask_head, m_tile, it]
            k_pipe.consumer_wait(k_state)
            cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * WARPGROUP_THREADS)
            acc_s = self.issue_scores(
                qk_mma_init, qk_mma, qk_thr, s_shape, q_stage, tSrK, k_state.index
            )
            self.issue_pv(pv_mma, acc_o, p_prev, tOrV, v_release.index)
            cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * WARPGROUP_THREADS)
            # Only S_j is awaited here: the softmax of S_j runs while P_{j-1} V_{j-1} is still
            # on the tensor cores; O is rescaled, and P_j overwrites P_{j-1}, once that
            # product has landed.
            warpgroup.wait_group(1)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            s_mn = cute.make_tensor(acc_s.iterator, row_col_view(acc_s.layout))
            self.mask_and_softmax(
                s_mn, tScS_mn, mBounds, entry, b, mask_head, row0, seqlen_q, seqlen_k, row_max,
                row_sum, o_scale, qk_scale,
            )  # fmt: skip
            warpgroup.wait_group(0)
            v_pipe.consumer_release(v_release)
            v_release.advance()
            self.rescale(acc_o, o_scale)
            self.store_probabilities(acc_s, p_prev)
            v_pipe.consumer_wait(v_wait)
            v_wait.advance()
        if count > 0:
            self.issue_pv(pv_mma, acc_o, p_prev, tOrV, v_release.index)
            warpgroup.wait_group(0)
            v_pipe.consumer_release(v_release)
        # A static condition does not combine with a dynamic one in one ``if``.
        if cutlass.const_expr(not self.v.persistent):  # noqa: SIM102
            if wg == 0:
                # Balance warpgroup 1's opening hand-over: its last arrival has no taker.
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * WARPGROUP_THREADS)
        self.finish_rows(
            pv_thr, acc_o, row_max, row_sum, qk_scale, tma_o, mO, mLse, sO, m_tile, h, b, wg,
            thread, warp, row0, seqlen_q, out_scale, mSinks,
        )  # fmt: skip

    @cute.jit
    def issue_scores(self, qk_mma_init, qk_mma, qk_thr, s_shape, q_stage, tSrK, k_index):
        """Issue ``S = Q K^T`` against K slot ``k_index`` and commit it; returns the score
        accumulator (valid once the group completes)."""
        acc_s = qk_thr.make_fragment_C(s_shape)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(q_stage, mode=[2])):
            mma = qk_mma if kb > 0 else qk_mma_init
            cute.gemm(mma, acc_s, q_stage[None, None, kb], tSrK[None, None, kb, k_index], acc_s)
        warpgroup.commit_group()
        return acc_s

    @cute.jit
    def mask_and_softmax(
        self, s_mn, tScS_mn, mBounds, entry, b, mask_head, row0, seqlen_q, seqlen_k, row_max,
        row_sum, o_scale, qk_scale,
    ):  # fmt: skip
        """Hide the scores of list entry ``entry``'s tile (a partial tile, ``entry >= 0``,
        takes the element mask, an unmasked one, ``-tile - 1``, none; in the dense mode every
        tile does), then :meth:`online_softmax`. The softmax sits in each branch, not after
        them: in one block with the wait that follows, ptxas would hoist that wait above it
        to interleave the P conversion with the exponentials, and the overlap of the
        softmax with ``P V`` would be lost."""
        n_tile = listed_tile(entry)
        if cutlass.const_expr(self.v.softcap > 0):
            # The cap needs the scaled scores, so it comes first and the mask after it (a hidden
            # score is -inf whatever its cap); the softmax then takes the capped scores in base
            # 2, ``tanh * softcap * log2(e)``, whatever the sign of the scale.
            self.cap_scores(s_mn, qk_scale)
            qk_scale = cutlass.Float32(self.v.softcap * LOG2E)
        if cutlass.const_expr(self.v.mask_full_tiles):
            self.hide(s_mn, tScS_mn, mBounds, b, mask_head, row0, n_tile, seqlen_q, seqlen_k)
            self.online_softmax(s_mn, row_max, row_sum, o_scale, qk_scale)
        else:
            if entry >= 0:
                self.hide(s_mn, tScS_mn, mBounds, b, mask_head, row0, n_tile, seqlen_q, seqlen_k)
                self.online_softmax(s_mn, row_max, row_sum, o_scale, qk_scale)
            else:
                self.online_softmax(s_mn, row_max, row_sum, o_scale, qk_scale)

    @cute.jit
    def cap_scores(self, s_mn, qk_scale):
        """``tanh(s * scale / softcap)`` of the dot products ``s_mn`` in place (``qk_scale`` =
        scale x log2(e)) with PTX's ``tanh.approx.f32``: one MUFU op per score where the Gluon
        and Triton kernels' ``1 - 2 / (e^(2x) + 1)`` takes two (EX2 and RCP), beside the
        softmax's EX2. Its error (2^-11 relative at most) moved lse by 3.5e-4 at a cap of 50
        with scores up to about 100, 5.8e-6 at a cap of 2, and the outputs by no more than
        their bf16 rounding (H100, ``docs/performance.md``)."""
        # x = s * scale / softcap = s * qk_scale / (softcap * log2(e)): one multiply.
        unscaled = qk_scale * (1.0 / (self.v.softcap * LOG2E))
        for i in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[i, j] = tanh_approx(s_mn[i, j] * unscaled)

    @cute.jit
    def issue_pv(self, pv_mma, acc_o, p, tOrV, v_index):
        """Issue ``O += P V`` from V slot ``v_index`` and commit it (asynchronous)."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(p, mode=[2])):
            cute.gemm(pv_mma, acc_o, p[None, None, kb], tOrV[None, None, kb, v_index], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def hide(self, s_mn, tScS_mn, mBounds, b, mask_head, row0, n_tile, seqlen_q, seqlen_k):
        """Set the hidden scores of ``s_mn`` (the thread's ``(rows, columns)``) to -inf.

        With a mask, each column's ``(LTS, LTE, UTS, UTE)`` is one 16-byte load from
        ``mBounds`` (``column_major_bounds``: padded to whole tiles, whose extra columns hide
        every row, so no column needs a range check). Without one, only the columns past
        ``Sk`` and the causal triangle are hidden."""
        col0 = n_tile * self.v.block_n
        rows = cute.size(s_mn, mode=[0])
        # The thread's rows, and the last column each may see under the causal triangle.
        row = [row0 + tScS_mn[i, 0][0] for i in range(rows)]
        last_col = [r + seqlen_k - seqlen_q for r in row]
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            col = col0 + tScS_mn[0, j][1]
            lts = cutlass.Int32(0)
            lte = cutlass.Int32(0)
            uts = cutlass.Int32(0)
            ute = cutlass.Int32(0)
            if cutlass.const_expr(self.v.has_mask):
                offset = ((b * mBounds.shape[1] + mask_head) * mBounds.shape[2] + col) * 4
                # A causal mask of edge intervals reads LTS alone; the others the whole column.
                width = 1 if self.v.edge_intervals and not self.v.has_upper else 4
                column = cute.make_tensor(
                    mBounds.iterator + cute.assume(offset, divby=4), cute.make_layout(width)
                )
                bound = cute.make_rmem_tensor(cute.make_layout(width), cutlass.Int32)
                cute.autovec_copy(column, bound)
                lts = bound[0]
                if cutlass.const_expr(width == 4):
                    lte = bound[1]
                    uts = bound[2]
                    ute = bound[3]
            for i in cutlass.range_constexpr(rows):
                hidden = False
                if cutlass.const_expr(self.v.has_mask and self.v.edge_intervals):
                    # LTE is Sq and UTS 0: two compares where the general form takes four.
                    hidden = row[i] >= lts
                    if cutlass.const_expr(self.v.has_upper):
                        hidden = hidden or row[i] < ute
                elif cutlass.const_expr(self.v.has_mask):
                    hidden = row[i] >= lts and row[i] < lte
                    if cutlass.const_expr(self.v.has_upper):
                        hidden = hidden or (row[i] >= uts and row[i] < ute)
                else:
                    hidden = col >= seqlen_k
                if cutlass.const_expr(self.v.causal):
                    hidden = hidden or col > last_col[i]
                if hidden:
                    s_mn[i, j] = -cutlass.Float32.inf

    @cute.jit
    def scores_to_probabilities(
        self, acc_s, p, entry, tScS_mn, mBounds, b, mask_head, row0, seqlen_q, seqlen_k,
        row_max, row_sum, o_scale, qk_scale,
    ):  # fmt: skip
        """Step 0 of the list: mask and softmax the first scores into ``p`` (O is still
        zero: nothing to rescale)."""
        s_mn = cute.make_tensor(acc_s.iterator, row_col_view(acc_s.layout))
        self.mask_and_softmax(
            s_mn, tScS_mn, mBounds, entry, b, mask_head, row0, seqlen_q, seqlen_k, row_max,
            row_sum, o_scale, qk_scale,
        )  # fmt: skip
        self.store_probabilities(acc_s, p)

    @cute.jit
    def store_probabilities(self, acc_s, p):
        """The probabilities in ``acc_s`` (the score accumulator) rounded to ``p``'s dtype into
        ``p``, the ``P V`` product's A operand: value for value (16-bit P shares the
        accumulator's order), or, FP8, each value to the A byte ``fp8_layout.scatter_layout``
        gives it (the MMA reads its register fragment in memory order, whatever its layout's
        strides, so the permutation happens here, at the store)."""
        if cutlass.const_expr(self.v.fp8):
            n = self.v.block_n
            s_split = cute.make_tensor(
                acc_s.iterator, fp8_layout_of(fp8_layout.accumulator_split(n))
            )
            p_split = cute.make_tensor(p.iterator, fp8_layout_of(fp8_layout.scatter_layout(n)))
            # Pair by pair: one cvt to e4m3x2 each. (One store of the whole tile leaves LLVM
            # a byte shuffle on one register.)
            for i in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(n // 8):
                    pair = (None, i, (j % 2, (j // 2) % 2, j // 4))
                    p_split[pair, 0, 0].store(s_split[pair, 0, 0].load().to(p.element_type))
        else:
            p_as_s = cute.make_tensor(p.iterator, acc_s.layout)
            p_as_s.store(acc_s.load().to(p.element_type))

    @cute.jit
    def online_softmax(self, s_mn, row_max, row_sum, o_scale, qk_scale):
        """Fold the scores ``s_mn`` into the running row max and sum, leave
        ``p = exp2(s * qk_scale - m)`` in ``s_mn`` and each row's O rescaling factor in
        ``o_scale`` (O itself is untouched: its last product may still be running)."""
        for i in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            tile_max = s_mn[i, 0]
            for j in cutlass.range_constexpr(1, cute.size(s_mn, mode=[1])):
                tile_max = cute.arch.fmax(tile_max, s_mn[i, j])
            # The four threads of a quad hold a row's columns.
            tile_max = cute.arch.fmax(tile_max, cute.arch.shuffle_sync_bfly(tile_max, offset=2))
            tile_max = cute.arch.fmax(tile_max, cute.arch.shuffle_sync_bfly(tile_max, offset=1))
            tile_top = tile_max * qk_scale
            if cutlass.const_expr(self.v.lazy_rescale):
                # The row's max rises only when a score passes it by more than RESCALE_SLACK:
                # below that, P stays under 2^RESCALE_SLACK and O keeps its scale (alpha = 1).
                m_new = row_max[i]
                alpha = cutlass.Float32(1.0)
                if tile_top > row_max[i] + RESCALE_SLACK:
                    m_new = tile_top
                    alpha = cute.math.exp2(row_max[i] - m_new, fastmath=True)
            else:
                m_new = cute.arch.fmax(row_max[i], tile_top)
            m_shift = m_new
            if m_new == -cutlass.Float32.inf:
                m_shift = 0.0
            if cutlass.const_expr(not self.v.lazy_rescale):
                alpha = cute.math.exp2(row_max[i] - m_shift, fastmath=True)
            row_max[i] = m_new
            tile_sum = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[i, j] = cute.math.exp2(s_mn[i, j] * qk_scale - m_shift, fastmath=True)
                tile_sum += s_mn[i, j]
            row_sum[i] = row_sum[i] * alpha + tile_sum
            o_scale[i] = alpha

    @cute.jit
    def rescale(self, acc_o, o_scale):
        """Multiply each row of the O accumulator by its factor in ``o_scale``, skipped (one
        warp vote) where no row of the warp's threads raised its max on this tile: every factor
        is then exactly 1 (``exp2(0)``, with the exact max as in the ``lazy_rescale``
        variants), so the skip changes no bit of O. After a row's first tiles its max rarely
        rises."""
        raised = False
        for i in cutlass.range_constexpr(cute.size(o_scale)):
            raised = raised or o_scale[i] != 1.0
        if cute.arch.vote_any_sync(raised):
            self.scale_rows(acc_o, o_scale)

    @cute.jit
    def scale_rows(self, acc_o, o_scale):
        """``acc_o``'s row ``i`` times ``o_scale[i]``, in place."""
        o_mn = cute.make_tensor(acc_o.iterator, row_col_view(acc_o.layout))
        for i in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[i, j] = o_mn[i, j] * o_scale[i]

    @cute.jit
    def finish_rows(
        self, pv_thr, acc_o, row_max, row_sum, qk_scale, tma_o, mO, mLse, sO, m_tile, h, b, wg,
        thread, warp, row0, seqlen_q, out_scale=None, mSinks=None,
    ):  # fmt: skip
        """``O / l`` of the warpgroup's 64 rows through its Q half (``sO``: the O halves' view
        of Q's slots) and one TMA store, and their lse (natural log; ``-inf`` with ``O = 0``
        where no key is visible). ``out_scale`` (FP8: ``v_descale``) multiplies O. A ``sinks``
        variant's sink (:meth:`row_sink` of ``mSinks``, base 2, finite; loaded here, not before
        the tile loop, where its register spilled in the persistent variant) joins each row's
        denominator: with ``top = max(m, sink)`` the sum
        becomes ``l * 2^(m - top) + 2^(sink - top)``, O is ``2^(m - top)`` over it and lse
        ``top + log2`` of it (a row that sees no key: O = 0, lse = the sink)."""
        sink = self.row_sink(mSinks, h)
        o_mn = cute.make_tensor(acc_o.iterator, row_col_view(acc_o.layout))
        tOcO = pv_thr.partition_C(cute.make_identity_tensor(self.pv_tiler[:2]))
        tOcO_mn = cute.make_tensor(tOcO.iterator, row_col_view(tOcO.layout))
        for i in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            total = row_sum[i]
            total += cute.arch.shuffle_sync_bfly(total, offset=2)
            total += cute.arch.shuffle_sync_bfly(total, offset=1)
            visible = total > 0.0
            top = row_max[i]
            inv = cutlass.Float32(1.0)
            if cutlass.const_expr(sink is not None):
                # Where no key is visible, row_max is -inf and O is 0: the sum is the sink's
                # alone, 2^(sink - sink) = 1, and lse the sink.
                top = cute.arch.fmax(top, sink)
                kept = cute.math.exp2(row_max[i] - top, fastmath=True)
                total = total * kept + cute.math.exp2(sink - top, fastmath=True)
                inv = kept / total
            else:
                if visible:
                    inv = 1.0 / total
            if cutlass.const_expr(out_scale is not None):
                inv = inv * out_scale
            for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[i, j] = o_mn[i, j] * inv
            lse = -cutlass.Float32.inf
            if cutlass.const_expr(sink is not None):
                lse = (top + cute.math.log2(total, fastmath=True)) * (1.0 / LOG2E)
            else:
                if visible:
                    lse = (top + cute.math.log2(total, fastmath=True)) * (1.0 / LOG2E)
            row = row0 + tOcO_mn[i, 0][0]
            if thread % 4 == 0 and row < seqlen_q:
                mLse[b, h, row] = lse
        # O through this warpgroup's Q half (its last Q K^T has completed).
        tOsO = pv_thr.partition_C(sO[None, None, wg])
        out = cute.make_rmem_tensor_like(acc_o, sO.element_type)
        out.store(acc_o.load().to(sO.element_type))
        for i in cutlass.range_constexpr(cute.size(out)):
            tOsO[i] = out[i]
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER[0] + wg, number_of_threads=WARPGROUP_THREADS)
        tOsO_tma, tOgO_tma = tma_tiles(
            tma_o, mO[None, None, h, b], sO, (HALF_ROWS, self.v.value_dim)
        )
        if thread == 0:
            cute.copy(tma_o, tOsO_tma[None, wg], tOgO_tma[None, 2 * m_tile + wg])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
