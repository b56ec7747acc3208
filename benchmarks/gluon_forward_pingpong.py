"""Experiment: FlashAttention-3's ping-pong schedule for the Gluon forward (Hopper).

Not part of the library. In ``flashmask.kernels.gluon_fwd`` the two consumer warpgroups run as
one 8-warp partition, in lockstep: both wait for their ``Q K^T``, both exponentiate while the
tensor cores idle, both issue ``P V``. Here each warpgroup is a partition of its own, owning 64
of the tile's 128 query rows, and the two take turns at the tensor cores:

* warpgroup ``w`` waits for its turn (mbarrier ``turns[w]``), issues ``S_j = Q_w K_j^T`` and the
  previous tile's ``O += P_{j-1} V_{j-1}``, then hands the turn over (arrives on
  ``turns[1 - w]``) and, once both products are in, runs tile ``j``'s softmax, while the other
  warpgroup's products occupy the tensor cores;
* the turns alternate strictly (warpgroup 1's first turn follows warpgroup 0's, whose first turn
  is granted at launch), so neither barrier ever runs two phases ahead of its waiter;
* a K/V slot is released when both warpgroups have finished its ``P V`` (``kv_empty`` counts two
  arrivals); ``NUM_BUFFERS`` slots (3 fit at hd128: 224 KB) keep the producer ahead of the
  warpgroup that lags by half a step;
* the first iteration's "previous" product is ``0 · V_0`` (exact zeros into a zero accumulator),
  which keeps the loop free of a data-dependent branch around asynchronous tokens.

Arithmetic, tile lists and masking are those of the library kernel (its helpers are reused), so
out/lse should match it to within the accumulation order (the same per row: bitwise is likely).

Usage:
* ``python benchmarks/gluon_forward_pingpong.py --compile-only`` (no GPU): compile for sm_90 and
  print registers, spills, shared memory, ``setmaxnreg`` and instruction counts per variant;
* ``PYTHONPATH=src python benchmarks/gluon_forward_pingpong.py`` (H200): out/lse against the
  library's Gluon forward and both timed, at 8K and 32K, on full, causal and two interval masks.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from bench_cases import forward_differences, mask_case, visible_flop
from cubin import compile_gluon_sm90, warp_specialized_report
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashmask import kernels
from flashmask.kernels import gluon_fwd
from flashmask.kernels.gluon_fwd import (
    LOG2E,
    LOG2E_VALUE,
    hide_pairs,
    load_column_bounds,
    load_partition,
    query_tile_program,
    query_tile_rows,
    shared_layout,
    wgmma_layout,
)

BLOCK_M, BLOCK_N, NUM_WARPS = 128, 128, 4
# 12 warps at launch: the two compute warpgroups and the producer's (padded) one.
MAX_REGISTERS = 168
COMPUTE_REGISTERS = 240


@gluon.jit
def _pingpong_compute(
    q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turns, entries, count, bounds_ptr,
    out_ptr, lse_ptr, out_row0, stride_os, lse_row0, m_tile, seqlen_q, seqlen_k, qk_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    WG: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup: query rows ``WG * 64 ...`` of the tile, taking turns at the
    tensor cores with the other one."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    half: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_half = q_smem.slice(WG * half, half)
    my_turn = turns.index(WG)
    other_turn = turns.index(1 - WG)
    m_i = gl.full([half], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([half], gl.float32, row_layout)
    acc = gl.zeros([half, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    p_prev = gl.convert_layout(zero_s.to(dtype), p_layout)
    rows = m_tile * BLOCK_M + WG * half + gl.arange(0, half, row_layout)
    offs_n = gl.arange(0, BLOCK_N, col_layout)

    mbarrier.wait(q_bar, 0)
    for it in range(count):
        entry = gl.load(entries + it)
        n_tile = gl.where(entry >= 0, entry, -entry - 1)
        slot = it % num_buffers
        prev = gl.maximum(it - 1, 0) % num_buffers
        mbarrier.wait(kv_ready.index(slot), (it // num_buffers) & 1)
        mbarrier.wait(my_turn, it & 1)
        s_token = warpgroup_mma(
            q_half, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True
        )
        # The previous tile's P V (0 · V_0 on the first iteration: exact zeros).
        acc_token = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        qk, acc, _ = warpgroup_mma_wait(0, deps=(s_token, acc_token, p_prev))
        if it > 0:
            mbarrier.arrive(kv_empty.index(prev), count=1)
        if entry >= 0:
            cols = n_tile * BLOCK_N + offs_n
            lts, lte, uts, ute = load_column_bounds(bounds_ptr, cols, seqlen_k, HAS_MASK, HAS_UPPER)
            hidden = hide_pairs(
                gl.zeros([half, BLOCK_N], gl.int1, s_layout), rows[:, None], cols[None, :],
                lts[None, :], lte[None, :], uts[None, :], ute[None, :], seqlen_k - seqlen_q,
                HAS_MASK, HAS_UPPER, CAUSAL,
            )  # fmt: skip
            qk = gl.where(hidden, float("-inf"), qk)
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(qk * qk_scale - m_shift[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        m_i = m_new

    if count > 0:
        last = (count - 1) % num_buffers
        acc = warpgroup_mma(p_prev, v_bufs.index(last), acc)
        mbarrier.arrive(kv_empty.index(last), count=1)

    visible = l_i > 0
    l_safe = gl.where(visible, l_i, 1.0)
    acc = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = WG * half + gl.arange(0, half, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    o_ptrs = out_ptr + (out_row0 + o_rows)[:, None] * stride_os + o_cols[None, :]
    gl.store(o_ptrs, acc.to(dtype))
    lse = gl.where(visible, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf"))
    gl.store(lse_ptr + lse_row0 + WG * half + gl.arange(0, half, row_layout), lse)


@gluon.jit
def pingpong_fwd_kernel(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, bounds_ptr, entries_ptr, counts_ptr,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, num_heads_q, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, qk_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    COMPUTE_REGISTERS: gl.constexpr,
):  # fmt: skip
    """Grid ``(query tiles, query heads, batch)``, heaviest query tiles first (as the library's)."""
    m_tile, h, b, h_kv, bounds, count, entries = query_tile_program(
        bounds_ptr, entries_ptr, counts_ptr, seqlen_k, heads_per_kv, heads_per_mask_head,
        num_mask_heads, num_m_tiles, num_n_tiles,
    )  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both warpgroups release a slot
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    # Warpgroup 0 has the first turn.
    mbarrier.arrive(turns.index(0), count=1)

    q_row0, out_head, out_row0, lse_row0 = query_tile_rows(
        m_tile, h, b, out_ptr, stride_ob, stride_os, stride_oh, seqlen_q, num_heads_q, BLOCK_M
    )
    gl.warp_specialize(
        [
            # gluon.jit takes no argument spreading: the two warpgroups' lists differ in WG only.
            (
                _pingpong_compute,
                (
                    q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turns, entries, count,
                    bounds, out_head, lse_ptr, out_row0, stride_os, lse_row0, m_tile, seqlen_q,
                    seqlen_k, qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, 0,
                ),
            ),
            (
                _pingpong_compute,
                (
                    q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turns, entries, count,
                    bounds, out_head, lse_ptr, out_row0, stride_os, lse_row0, m_tile, seqlen_q,
                    seqlen_k, qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, 1,
                ),
            ),
            (
                load_partition,
                (
                    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty,
                    entries, count, q_row0, b * seqlen_k, h * HEAD_DIM, h_kv * HEAD_DIM,
                    BLOCK_N,
                ),
            ),
        ],
        [4, 1],
        [COMPUTE_REGISTERS, 24],
    )  # fmt: skip


def pingpong_forward(q, k, v, sri, causal: bool, softmax_scale: float, num_buffers: int = 2):
    """``(out, lse)`` like the library's Gluon forward (same input conditions)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    bounds, (lists,) = kernels.prepare_cached(
        sri, causal, sq, sk, b, q.device, [(BLOCK_M, BLOCK_N, True)]
    )
    hm = 1 if sri is None else sri.shape[1]
    tm, tn = lists.entries.shape[-2:]
    q2, k2, v2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v))
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], shared_layout(BLOCK_M, d, q.dtype))
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, d], shared_layout(BLOCK_N, d, q.dtype))
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, d], shared_layout(BLOCK_N, d, q.dtype))
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    pingpong_fwd_kernel[(tm, hq, b)](
        q_desc, k_desc, v_desc, out, lse, lists.counts if bounds is None else bounds,
        lists.entries, lists.counts, out.stride(0), out.stride(1), out.stride(2),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, softmax_scale * LOG2E_VALUE,
        CAUSAL=causal, HAS_MASK=sri is not None, HAS_UPPER=not causal,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d, NUM_BUFFERS=num_buffers,
        COMPUTE_REGISTERS=COMPUTE_REGISTERS, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out, lse


OPCODES = ("HGMMA", "UTMALDG", "MUFU.EX2", "LDG", "SYNCS")


def compile_only(head_dim: int, causal: bool, has_mask: bool, num_buffers: int) -> dict:
    """Compile for sm_90 without a GPU; registers, spills, shared memory and key instructions."""

    def desc_type(rows):
        layout = shared_layout(rows, head_dim, torch.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"

    signature = {
        "q_desc": desc_type(BLOCK_M), "k_desc": desc_type(BLOCK_N), "v_desc": desc_type(BLOCK_N),
        "out_ptr": "*bf16", "lse_ptr": "*fp32", "bounds_ptr": "*i32", "entries_ptr": "*i32",
        "counts_ptr": "*i32", "stride_ob": "i32", "stride_os": "i32", "stride_oh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "heads_per_kv": "i32",
        "heads_per_mask_head": "i32", "num_mask_heads": "i32", "num_m_tiles": "i32",
        "num_n_tiles": "i32", "qk_scale": "fp32",
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_DIM": head_dim,
              "NUM_BUFFERS": num_buffers, "COMPUTE_REGISTERS": COMPUTE_REGISTERS}  # fmt: skip
    compiled = compile_gluon_sm90(
        pingpong_fwd_kernel, signature, values, {"num_warps": NUM_WARPS, "maxnreg": MAX_REGISTERS}
    )
    return {
        "head_dim": head_dim,
        "causal": causal,
        "has_mask": has_mask,
        "num_buffers": num_buffers,
        **warp_specialized_report(compiled, OPCODES),
    }


def check_and_time(seqlens: list[int], mask_names: list[str], tokens: int, hidden: int) -> None:
    """Out/lse against the library's Gluon forward, both timed, per length, mask and ring depth."""

    d = 128
    for s in seqlens:
        b, h = max(1, tokens // s), hidden // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        scale = d**-0.5
        for name in mask_names:
            mask, sri, causal = mask_case(name, s, b)
            flop = visible_flop(mask, causal, s, d, h, b, 4.0)
            tile = gluon_fwd.BLOCK_M
            bounds, (lists,) = kernels.prepare_cached(
                sri, causal, s, s, b, q.device, [(tile, tile, True)]
            )
            hm = 1 if sri is None else sri.shape[1]

            def library(bounds=bounds, lists=lists, hm=hm, causal=causal):
                return gluon_fwd.forward(q, k, v, bounds, lists, hm, causal, scale, True)

            ref_out, ref_lse = library()
            ms_ref = triton.testing.do_bench(library, rep=100)
            line = f"S={s} {name:16s} gluon {ms_ref:.3f} ms ({flop / ms_ref / 1e9:.0f} TF/s)"
            for buffers in (2, 3):
                label = f"ping-pong/{buffers} buffers"
                try:
                    out, lse = pingpong_forward(q, k, v, sri, causal, scale, buffers)
                    torch.cuda.synchronize()
                except Exception as exc:  # report and go on
                    line += f" | {label}: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
                same = torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
                err, _, dead_ok = forward_differences(out, lse, ref_out, ref_lse)
                ms = triton.testing.do_bench(
                    lambda n=buffers, sri=sri, c=causal: pingpong_forward(
                        q, k, v, sri, c, scale, n
                    ),
                    rep=100,
                )
                line += (
                    f" | {label} {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s) bitwise {same} "
                    f"max|out diff| {err:.1e} empty rows ok {dead_ok}"
                )
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument("--masks", default="full,causal,causal_document,document")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    if args.compile_only:
        for causal in (False, True):
            for has_mask in (False, True):
                for buffers in (2, 3):
                    print(json.dumps(compile_only(128, causal, has_mask, buffers)), flush=True)
        return
    check_and_time([int(x) for x in args.seqlens.split(",")], args.masks.split(","), args.tokens,
                   args.hidden)  # fmt: skip


if __name__ == "__main__":
    main()
