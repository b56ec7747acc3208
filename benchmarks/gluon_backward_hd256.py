"""Experiment: a warp-specialised Gluon backward at head dim 256 (Hopper), against the Triton one.

The library's Gluon backward (``flashmask.kernels.gluon_bwd``) gives each of its two consumer
warpgroups 64 of a program's 128 keys with the whole head dim of dK and dV; at D = 256 those two
accumulators alone would take 256 registers per thread. Here a program owns 64 keys and the
warpgroups split the work the other way:

* ``S^T = K Q^T`` and ``dP^T = V dO^T`` ([64 keys, 64 queries], the head dim reduced): each
  warpgroup computes the columns of 32 queries, then ``P^T`` and ``dS^T`` (fp32, as the Triton
  kernels) for them, and stores both as bf16 into shared memory;
* after a barrier, each warpgroup owns half the head dim: ``dV_half += P^T dO_half``,
  ``dK_half += dS^T Q_half`` (64 + 64 accumulator registers) and ``dQ_half = dS K_half``, all
  with both operands in shared memory; dQ goes to the library's writer warps (16-byte
  ``red.global`` adds), dK/dV are stored at the end.

Shared memory: K and V 32 KB each, one Q/dO slot 64 KB (two would not fit), ``P^T``/``dS^T``
double-buffered 32 KB, one 64x256 fp32 dQ buffer 64 KB: 224 KB. The producer warp, the dQ
writer and the mbarrier protocol are the library kernel's (``gluon_bwd._bwd_load_partition``,
``_bwd_dq_writer_partition``); so is the tile-list walk (column-major lists at 64x64 tiles).

Usage:
* ``python benchmarks/gluon_backward_hd256.py --compile-only`` (no GPU): compile for sm_90 and
  print registers, spills, shared memory, ``setmaxnreg`` and HGMMA/TMA/atomic counts;
* ``PYTHONPATH=src python benchmarks/gluon_backward_hd256.py`` (H200): dQ/dK/dV against the
  Triton backward (max abs difference over max abs value) and both timed, at 8K and 32K; and
  the same kernel with dQ through TMA reduce-adds (``gluon_bwd.DQ_TMA``'s path) timed, its
  dK/dV compared bitwise.

Not yet run on a GPU (eighth session): the design's shared-memory budget and the reasoning are
in ``benchmarks/NOTES.md`` ("A Gluon backward at head dim 256").
"""

from __future__ import annotations

import json

import torch
import triton
from bench_cases import backward_cases, case_parser, relative_error
from cubin import compile_gluon_sm90, warp_specialized_report
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashmask import kernels
from flashmask.kernels import gluon_bwd
from flashmask.kernels.gluon_bwd import (
    _bwd_dq_writer_partition,
    _bwd_load_partition,
    _head_list,
    _partition_barrier,
    hand_dq_to_writer,
    row_terms,
    store_dk_dv,
    transposed_probabilities,
)
from flashmask.kernels.gluon_fwd import LOG2E_VALUE, load_column_bounds, shared_layout

OPCODES = ("HGMMA", "UTMALDG", "UTMAREDG", "MUFU.EX2", "LDG", "REDG", "BAR")
BLOCK_M = 64  # queries per tile
BLOCK_N = 64  # keys per program
HEAD_DIM = 256
NUM_WARPS = 8  # two consumer warpgroups
WRITER_WARPS = 2
MAX_REGISTERS = 168


@gluon.jit
def _compute_partition(
    k_smem, v_smem, q_bufs, do_bufs, pt_bufs, ds_bufs, dq_bufs, kv_bar, ready, empty, dq_full,
    dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, b, h_kv,
    n_tile, seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, stride_kb, stride_ks, stride_kh, qk_scale, softmax_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DQ_TMA: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroups: scores and softmax gradients split by queries, the three
    accumulating products split by head dim (module docstring)."""
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    groups: gl.constexpr = gl.num_warps() // 4
    dtype: gl.constexpr = k_smem.dtype
    # [BLOCK_N keys, BLOCK_M queries]: one warpgroup's 64 rows; the warpgroups split the queries.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, BLOCK_M // groups, 16]
    )
    # dK, dV [BLOCK_N, HEAD_DIM] and dQ [BLOCK_M, HEAD_DIM]: the warpgroups split the head dim.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, HEAD_DIM // groups, 16]
    )
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    keys = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    offs_m = gl.arange(0, BLOCK_M, query_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)

    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(heads_per_kv):
        h, mask_head, count, entries = _head_list(
            g, b, h_kv, n_tile, entries_ptr, counts_ptr, heads_per_kv, heads_per_mask_head,
            num_mask_heads, num_m_tiles, num_n_tiles,
        )  # fmt: skip
        lts, lte, uts, ute = load_column_bounds(
            bounds_ptr + mask_head.to(gl.int64) * 4 * seqlen_k, keys, seqlen_k, HAS_MASK, HAS_UPPER
        )
        row_base = (b * num_heads_q + h).to(gl.int64) * seqlen_q
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
            lse, delta = row_terms(lse_ptr, delta_ptr, row_base, rows)
            st = warpgroup_mma_wait(1, deps=(st_token,))
            pt = transposed_probabilities(
                st, lse, qk_scale, entry, rows, keys, lts, lte, uts, ute, seqlen_k - seqlen_q,
                HAS_MASK, HAS_UPPER, CAUSAL,
            )  # fmt: skip
            dpt = warpgroup_mma_wait(0, deps=(dpt_token,))
            dst = pt * (dpt - delta[None, :])
            # Each warpgroup's query columns of P^T and dS^T; the buffer written here was last
            # read two tiles ago, before the previous tile's barrier.
            pt_smem = pt_bufs.index(it % 2)
            ds_smem = ds_bufs.index(it % 2)
            pt_smem.store(pt.to(dtype))
            ds_smem.store(dst.to(dtype))
            fence_async_shared()
            _partition_barrier()  # both warpgroups' columns in place
            dv_token = warpgroup_mma(pt_smem, do_smem, dv, is_async=True)
            dk_token = warpgroup_mma(ds_smem, q_smem, dk, is_async=True)
            dq_token = warpgroup_mma(
                ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True
            )
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_token, dk_token, dq_token))
            mbarrier.arrive(empty.index(slot), count=1)
            hand_dq_to_writer(dq, dq_bufs, dq_full, dq_empty, it, softmax_scale, DQ_TMA)
            it += 1

    store_dk_dv(dk, dv, dk_ptr, dv_ptr, b, h_kv, n_tile, stride_kb, stride_ks, stride_kh,
                softmax_scale)  # fmt: skip


@gluon.jit
def bwd256_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_ptr, dq_desc, dk_ptr, dv_ptr,
    bounds_ptr,
    entries_ptr, counts_ptr, stride_dqb, stride_dqs, stride_dqh, stride_kb, stride_ks, stride_kh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, qk_scale, softmax_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    WRITER_WARPS: gl.constexpr,
    DQ_TMA: gl.constexpr,
):  # fmt: skip
    """Grid ``(key tiles, kv heads, batch)``: dK and dV (sharing K's strides) and dQ added to the
    fp32 ``dq_ptr``, like ``gluon_bwd.gluon_bwd_kernel`` (with ``DQ_TMA`` through ``dq_desc``
    and TMA reduce-adds, ``gluon_bwd.DQ_TMA``)."""
    dtype: gl.constexpr = q_desc.dtype
    n_tile = gl.program_id(0)
    h_kv = gl.program_id(1)
    b = gl.program_id(2)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], do_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    pt_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    if DQ_TMA:
        dq_bufs = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, HEAD_DIM], dq_desc.layout)
    else:
        dq_bufs = gl.allocate_shared_memory(
            gl.float32, [1, BLOCK_M, HEAD_DIM], gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        )
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(empty.index(0), count=1)
    mbarrier.init(dq_full.index(0), count=1)
    mbarrier.init(dq_empty.index(0), count=1)
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    k_smem, v_smem, q_bufs, do_bufs, pt_bufs, ds_bufs, dq_bufs, kv_bar, ready,
                    empty, dq_full, dq_empty, entries_ptr, counts_ptr, bounds_ptr, lse_ptr,
                    delta_ptr, dk_ptr, dv_ptr, b, h_kv, n_tile, seqlen_q, seqlen_k, num_heads_q,
                    heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
                    stride_kb, stride_ks, stride_kh, qk_scale, softmax_scale, CAUSAL, HAS_MASK,
                    HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_TMA,
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
                    dq_bufs, dq_full, dq_empty, entries_ptr, counts_ptr, dq_ptr, dq_desc, b,
                    h_kv, n_tile, seqlen_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
                    num_m_tiles, num_n_tiles, stride_dqb, stride_dqs, stride_dqh, BLOCK_M,
                    HEAD_DIM, DQ_TMA,
                ),
            ),
        ],
        [1, WRITER_WARPS],
        [24, 24],
    )  # fmt: skip


def backward256(
    dout, q, k, v, out, lse, sri, causal: bool, softmax_scale: float, dq_tma: bool = False
):
    """``(dq, dk, dv)`` for ``[B, S, H, 256]`` bf16/fp16 inputs with lengths divisible by 64;
    ``dq_tma``: dQ through TMA reduce-adds instead of the writer's vector atomics."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = 1 if sri is None else sri.shape[1]
    bounds, (lists,) = kernels.prepare_cached(
        sri, causal, sq, sk, b, q.device, [(BLOCK_M, BLOCK_N, False)]
    )
    tn, tm = lists.entries.shape[-2:]
    q, k, v, dout = (kernels.tma_ready(x) for x in (q, k, v, dout))
    delta = kernels.backward_delta(out, dout, None)
    q2, k2, v2, do2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v, dout))
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], shared_layout(BLOCK_M, d, q.dtype))
    do_desc = TensorDescriptor.from_tensor(do2, [BLOCK_M, d], shared_layout(BLOCK_M, d, q.dtype))
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, d], shared_layout(BLOCK_N, d, q.dtype))
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, d], shared_layout(BLOCK_N, d, q.dtype))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_desc = None
    if dq_tma:
        dq_desc = TensorDescriptor.from_tensor(
            dq_accum.view(b * sq, hq * d), [BLOCK_M, d], gluon_bwd.dq_shared_layout(d)
        )
    bwd256_kernel[(tn, hk, b)](
        q_desc, k_desc, v_desc, do_desc, lse.float().contiguous(), delta, dq_accum, dq_desc,
        dk, dv,
        lists.counts if bounds is None else bounds, lists.entries, lists.counts,
        dq_accum.stride(0), dq_accum.stride(1), dq_accum.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, softmax_scale * LOG2E_VALUE, softmax_scale,
        CAUSAL=causal, HAS_MASK=bounds is not None, HAS_UPPER=not causal,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d, WRITER_WARPS=WRITER_WARPS, DQ_TMA=dq_tma,
        num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return dq_accum.to(q.dtype), dk, dv


def compile_only(causal: bool, has_mask: bool, dq_tma: bool = False) -> dict:
    """Compile for sm_90 without a GPU; registers, spills, shared memory and key instructions."""

    def desc_type(rows):
        layout = shared_layout(rows, HEAD_DIM, torch.bfloat16)
        return f"tensordesc<bf16[{rows}, {HEAD_DIM}],{layout!r}>"

    signature = {
        "q_desc": desc_type(BLOCK_M), "k_desc": desc_type(BLOCK_N), "v_desc": desc_type(BLOCK_N),
        "do_desc": desc_type(BLOCK_M), "lse_ptr": "*fp32", "delta_ptr": "*fp32",
        "dq_ptr": "*fp32",
        **({"dq_desc": f"tensordesc<fp32[{BLOCK_M}, {HEAD_DIM}],"
                       f"{gluon_bwd.dq_shared_layout(HEAD_DIM)!r}>"} if dq_tma else {}),
        "dk_ptr": "*bf16", "dv_ptr": "*bf16", "bounds_ptr": "*i32",
        "entries_ptr": "*i32", "counts_ptr": "*i32", "stride_dqb": "i32", "stride_dqs": "i32",
        "stride_dqh": "i32", "stride_kb": "i32", "stride_ks": "i32", "stride_kh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "heads_per_kv": "i32",
        "heads_per_mask_head": "i32", "num_mask_heads": "i32", "num_m_tiles": "i32",
        "num_n_tiles": "i32", "qk_scale": "fp32", "softmax_scale": "fp32",
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_DIM": HEAD_DIM,
              "WRITER_WARPS": WRITER_WARPS, "DQ_TMA": dq_tma,
              **({} if dq_tma else {"dq_desc": None})}  # fmt: skip
    compiled = compile_gluon_sm90(
        bwd256_kernel, signature, values, {"num_warps": NUM_WARPS, "maxnreg": MAX_REGISTERS}
    )
    report = warp_specialized_report(compiled, OPCODES)
    return {"causal": causal, "has_mask": has_mask, "dq_tma": dq_tma, **report}


def check_and_time(seqlens: list[int], mask_names: list[str], tokens: int, hidden: int) -> None:
    """dQ/dK/dV against the Triton backward (the library's at hd256) and both timed; then the
    same kernel with dQ through TMA reduce-adds, its dK/dV compared bitwise."""
    for case in backward_cases(seqlens, mask_names, tokens, hidden, HEAD_DIM):
        flop = case.flop
        args = (case.dout, case.q, case.k, case.v, case.out, case.lse)
        args += (case.sri, case.causal, case.scale)
        ref = case.run_backward(True)
        ms = triton.testing.do_bench(lambda case=case: case.run_backward(True), rep=100)
        line = (
            f"S={case.seqlen} {case.name:16s} triton bwd {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s)"
        )
        try:
            got = backward256(*args)
            torch.cuda.synchronize()
        except Exception as exc:  # report and go on
            print(f"{line} | gluon: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        errs = [f"d{n} {relative_error(g, w):.1e}" for g, w, n in zip(got, ref, "qkv", strict=True)]
        g_ms = triton.testing.do_bench(lambda args=args: backward256(*args), rep=100)
        line += (
            f" | gluon hd256 {g_ms:.3f} ms ({flop / g_ms / 1e9:.0f} TF/s) rel err {' '.join(errs)}"
        )
        try:
            alt = backward256(*args, dq_tma=True)
            same = all(torch.equal(a, c) for a, c in zip(alt[1:], got[1:], strict=True))
            t_ms = triton.testing.do_bench(
                lambda args=args: backward256(*args, dq_tma=True), rep=100
            )
            line += (
                f" | dQ by TMA {t_ms:.3f} ms ({flop / t_ms / 1e9:.0f} TF/s) dk/dv bitwise "
                f"{same} dq rel diff {relative_error(alt[0], got[0]):.1e}"
            )
        except Exception as exc:  # report and go on
            line += f" | dQ by TMA: {type(exc).__name__}: {str(exc)[:200]}"
        print(line, flush=True)


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args()
    if args.compile_only:
        for causal in (False, True):
            for has_mask in (False, True):
                print(json.dumps(compile_only(causal, has_mask)), flush=True)
        print(json.dumps(compile_only(True, True, dq_tma=True)), flush=True)
        return
    check_and_time(args.seqlens, args.masks, args.tokens, args.hidden)


if __name__ == "__main__":
    main()
