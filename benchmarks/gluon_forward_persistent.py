"""Experiment: a persistent grid for the Gluon forward (Hopper).

Not part of the library. The library's Gluon forward (``flashmask.kernels.gluon_fwd``) launches
one program per (query tile, head, batch); with 224 KB of shared memory each program holds an
SM alone, so its prologue (barrier set-up, the Q load, the first K/V loads) and epilogue (O and
lse stores) leave the tensor cores idle. Where the tile lists are short (sliding_window at 8K,
share_question) that idle time is a large share, and the Triton forward, whose smaller tiles
run several programs per SM, wins (``benchmarks/NOTES.md``, seventh session). Here one program
per SM walks work items ``(query tile, head, batch)``, heaviest query tiles first over all heads
and batches, and

* the producer warp loads the next item's Q as soon as both warpgroups have issued the current
  item's last ``Q K^T`` (mbarrier ``q_empty``, two arrivals) and keeps filling the K/V ring across
  items, so the next item's loads overlap the current item's last products and its epilogue;
* the two compute warpgroups run the library's ping-pong schedule unchanged, with the K/V ring
  and the turn barriers counted over the program's whole sequence of tiles (``base + it``), so
  the turns keep alternating strictly across items.

Each query row sees the library kernel's arithmetic in the same order, so out/lse should match
it bit for bit (the script reports it).

Usage:
* ``python benchmarks/gluon_forward_persistent.py --compile-only`` (no GPU): compile for sm_90 and
  print registers, spills, shared memory and key instruction counts per variant;
* ``PYTHONPATH=src python benchmarks/gluon_forward_persistent.py`` (H200): out/lse against the
  library's Gluon forward, both timed and the Triton forward timed, at 8K and 32K.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import triton
from bench_cases import case_parser, forward_differences, mask_case, visible_flop
from cubin import compile_gluon_sm90, warp_specialized_report
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
)

from flashmask import kernels
from flashmask.kernels import gluon_fwd
from flashmask.kernels.gluon_fwd import (
    LOG2E_VALUE,
    finish_rows,
    pingpong_tile,
    query_tile_list,
    shared_layout,
    tma_load,
    wgmma_layout,
)

BLOCK_M = gluon_fwd.BLOCK_M
NUM_WARPS = gluon_fwd.NUM_WARPS
MAX_REGISTERS = gluon_fwd.MAX_REGISTERS
COMPUTE_REGISTERS = gluon_fwd.COMPUTE_REGISTERS
OPCODES = ("HGMMA", "UTMALDG", "MUFU.EX2", "LDG", "SYNCS")


@gluon.jit
def _work_item(
    item, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, num_heads_q, batch, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """Work item ``item``: ``(query tile, query head, batch index, kv head, its mask head's
    bounds, the tile's list length and entries)``. ``HEAD_MAJOR``: head by head, heaviest (last)
    query tiles first within each, the order the library's grid launches in, so that the
    programs running at once read the same head's K/V (L2 reuse); else heaviest query tiles
    first over every head and batch (longest-processing-time order, but concurrent programs
    read different heads' K/V)."""
    if HEAD_MAJOR:
        m_tile = num_m_tiles - 1 - item % num_m_tiles
        rest = item // num_m_tiles
    else:
        heads_batches = num_heads_q * batch
        m_tile = num_m_tiles - 1 - item // heads_batches
        rest = item % heads_batches
    h = rest % num_heads_q
    b = rest // num_heads_q
    bounds, count, entries = query_tile_list(
        m_tile, h, b, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, heads_per_mask_head,
        num_mask_heads, num_m_tiles, num_n_tiles,
    )  # fmt: skip
    return m_tile, h, b, h // heads_per_kv, bounds, count, entries


@gluon.jit
def _persistent_load_partition(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_full, q_empty, kv_ready, kv_empty,
    bounds_ptr, entries_ptr, counts_ptr, seqlen_q, seqlen_k, num_heads_q, batch, heads_per_kv,
    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, num_items,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """Producer warp: per item, Q once the previous item's Q is free, then its K/V tiles into
    the ring, whose slots and phases run on over the program's items."""
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    base = 0
    items_done = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        m_tile, h, b, h_kv, _, count, entries = _work_item(
            item, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, num_heads_q, batch,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            HEAD_MAJOR,
        )  # fmt: skip
        # Both warpgroups have issued (and awaited) the previous item's last Q K^T.
        mbarrier.wait(q_empty, (items_done & 1) ^ 1)
        mbarrier.expect(q_full, q_desc.block_type.nbytes)
        tma_load(q_desc, [b * seqlen_q + m_tile * BLOCK_M, h * HEAD_DIM], q_full, q_smem)
        for it in range(count):
            entry = gl.load(entries + it)
            n_tile = gl.where(entry >= 0, entry, -entry - 1)
            g = base + it
            slot = g % num_buffers
            mbarrier.wait(kv_empty.index(slot), ((g // num_buffers) & 1) ^ 1)
            ready = kv_ready.index(slot)
            mbarrier.expect(ready, kv_bytes)
            row = b * seqlen_k + n_tile * BLOCK_N
            tma_load(k_desc, [row, h_kv * HEAD_DIM], ready, k_bufs.index(slot))
            tma_load(v_desc, [row, h_kv * HEAD_DIM], ready, v_bufs.index(slot))
        base += count
        items_done += 1  # noqa: SIM113 (no enumerate in a Gluon loop)


@gluon.jit
def _persistent_compute(
    q_smem, k_bufs, v_bufs, q_full, q_empty, kv_ready, kv_empty, turns, bounds_ptr,
    entries_ptr, counts_ptr, out_ptr, lse_ptr, stride_ob, stride_os, stride_oh, seqlen_q,
    seqlen_k, num_heads_q, batch, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, num_items, qk_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    WG: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``WG`` (query rows ``WG * 64 ...`` of every item's tile): the
    library's ping-pong loop per item, with ring slots and turn phases counted over the
    program's whole tile sequence."""
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
    zero_s = gl.zeros([half, BLOCK_N], gl.float32, s_layout)
    offs_n = gl.arange(0, BLOCK_N, col_layout)
    base = 0
    items_done = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        m_tile, h, b, _h_kv, bounds, count, entries = _work_item(
            item, bounds_ptr, entries_ptr, counts_ptr, seqlen_k, num_heads_q, batch,
            heads_per_kv, heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles,
            HEAD_MAJOR,
        )  # fmt: skip
        m_i = gl.full([half], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([half], gl.float32, row_layout)
        acc = gl.zeros([half, HEAD_DIM], gl.float32, o_layout)
        p_prev = gl.convert_layout(zero_s.to(dtype), p_layout)
        rows = m_tile * BLOCK_M + WG * half + gl.arange(0, half, row_layout)
        mbarrier.wait(q_full, items_done & 1)
        for it in range(count):
            g = base + it
            # The previous tile's slot; on an item's first tile its own (0 · V, exact zeros).
            prev = gl.where(it > 0, (g - 1) % num_buffers, g % num_buffers)
            m_i, l_i, acc, p_prev = pingpong_tile(
                q_half, k_bufs, v_bufs, kv_ready, kv_empty, my_turn, other_turn, zero_s,
                entries, it, g, prev, bounds, rows, offs_n, m_i, l_i, acc, p_prev, seqlen_q,
                seqlen_k, qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, False,
            )  # fmt: skip
        # This warpgroup's last Q K^T is done: the producer may load the next item's Q once
        # the other warpgroup says so too.
        mbarrier.arrive(q_empty, count=1)
        out_row0 = b.to(gl.int64) * (stride_ob // stride_os) + m_tile * BLOCK_M
        lse_row0 = (b * num_heads_q + h).to(gl.int64) * seqlen_q + m_tile * BLOCK_M
        finish_rows(
            v_bufs, kv_empty, count, (base + count - 1) % num_buffers, m_i, l_i, acc, p_prev,
            out_ptr + h * stride_oh, out_row0, stride_os, lse_ptr, lse_row0, WG,
        )  # fmt: skip
        base += count
        items_done += 1  # noqa: SIM113 (no enumerate in a Gluon loop)


@gluon.jit
def persistent_fwd_kernel(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, bounds_ptr, entries_ptr, counts_ptr,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, num_heads_q, batch, heads_per_kv, heads_per_mask_head, num_mask_heads,
    num_m_tiles, num_n_tiles, num_items, qk_scale,
    CAUSAL: gl.constexpr,
    HAS_MASK: gl.constexpr,
    HAS_UPPER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    COMPUTE_REGISTERS: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """Grid ``(programs,)`` (one per SM); program ``p`` takes items ``p, p + programs, ...``."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=2)  # both warpgroups
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # warpgroup 0 has the first turn

    gl.warp_specialize(
        [
            (
                _persistent_compute,
                (
                    q_smem, k_bufs, v_bufs, q_full, q_empty, kv_ready, kv_empty, turns,
                    bounds_ptr, entries_ptr, counts_ptr, out_ptr, lse_ptr, stride_ob, stride_os,
                    stride_oh, seqlen_q, seqlen_k, num_heads_q, batch, heads_per_kv,
                    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, num_items,
                    qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, 0,
                    HEAD_MAJOR,
                ),
            ),
            (
                _persistent_compute,
                (
                    q_smem, k_bufs, v_bufs, q_full, q_empty, kv_ready, kv_empty, turns,
                    bounds_ptr, entries_ptr, counts_ptr, out_ptr, lse_ptr, stride_ob, stride_os,
                    stride_oh, seqlen_q, seqlen_k, num_heads_q, batch, heads_per_kv,
                    heads_per_mask_head, num_mask_heads, num_m_tiles, num_n_tiles, num_items,
                    qk_scale, CAUSAL, HAS_MASK, HAS_UPPER, BLOCK_M, BLOCK_N, HEAD_DIM, 1,
                    HEAD_MAJOR,
                ),
            ),
            (
                _persistent_load_partition,
                (
                    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_full, q_empty, kv_ready,
                    kv_empty, bounds_ptr, entries_ptr, counts_ptr, seqlen_q, seqlen_k,
                    num_heads_q, batch, heads_per_kv, heads_per_mask_head, num_mask_heads,
                    num_m_tiles, num_n_tiles, num_items, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_MAJOR,
                ),
            ),
        ],
        [4, 1],
        [COMPUTE_REGISTERS, 24],
    )  # fmt: skip


def persistent_forward(
    q, k, v, sri, causal: bool, softmax_scale: float, programs: int, head_major: bool = True
):
    """``(out, lse)`` like the library's Gluon forward (same input conditions, hd64/hd128);
    ``head_major`` picks the work-item order (``_work_item``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    block_n, slots = kernels.gluon_forward_tiles(d)
    bounds, (lists,) = kernels.prepare_cached(
        sri, causal, sq, sk, b, q.device, [(BLOCK_M, block_n, True)]
    )
    hm = 1 if sri is None else sri.shape[1]
    tm, tn = lists.entries.shape[-2:]
    q2, k2, v2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v))
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], shared_layout(BLOCK_M, d, q.dtype))
    kv_layout = shared_layout(block_n, d, q.dtype)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, d], kv_layout)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    items = tm * hq * b
    persistent_fwd_kernel[(min(programs, items),)](
        q_desc, k_desc, v_desc, out, lse, lists.counts if bounds is None else bounds,
        lists.entries, lists.counts, out.stride(0), out.stride(1), out.stride(2),
        sq, sk, hq, b, hq // hk, hq // hm, hm, tm, tn, items, softmax_scale * LOG2E_VALUE,
        CAUSAL=causal, HAS_MASK=sri is not None, HAS_UPPER=not causal,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=d, NUM_BUFFERS=slots,
        COMPUTE_REGISTERS=COMPUTE_REGISTERS, HEAD_MAJOR=head_major, num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out, lse


def compile_only(head_dim: int, causal: bool, has_mask: bool) -> dict:
    """Compile for sm_90 without a GPU; registers, spills, shared memory and key instructions."""
    block_n, slots = kernels.gluon_forward_tiles(head_dim)

    def desc_type(rows):
        layout = shared_layout(rows, head_dim, torch.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"

    signature = {
        "q_desc": desc_type(BLOCK_M), "k_desc": desc_type(block_n), "v_desc": desc_type(block_n),
        "out_ptr": "*bf16", "lse_ptr": "*fp32", "bounds_ptr": "*i32", "entries_ptr": "*i32",
        "counts_ptr": "*i32", "stride_ob": "i32", "stride_os": "i32", "stride_oh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "batch": "i32",
        "heads_per_kv": "i32", "heads_per_mask_head": "i32", "num_mask_heads": "i32",
        "num_m_tiles": "i32", "num_n_tiles": "i32", "num_items": "i32", "qk_scale": "fp32",
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "BLOCK_M": BLOCK_M, "BLOCK_N": block_n, "HEAD_DIM": head_dim,
              "NUM_BUFFERS": slots, "COMPUTE_REGISTERS": COMPUTE_REGISTERS,
              "HEAD_MAJOR": True}  # fmt: skip
    compiled = compile_gluon_sm90(
        persistent_fwd_kernel, signature, values, {"num_warps": NUM_WARPS, "maxnreg": MAX_REGISTERS}
    )
    return {
        "head_dim": head_dim,
        "causal": causal,
        "has_mask": has_mask,
        **warp_specialized_report(compiled, OPCODES),
    }


def check_and_time(seqlens: list[int], mask_names: list[str], tokens: int, hidden: int) -> None:
    """Out/lse against the library's Gluon forward; the persistent, library Gluon and Triton
    forwards timed, per length and mask."""
    d = 128
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for s in seqlens:
        b, h = max(1, tokens // s), hidden // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        scale = d**-0.5
        for name in mask_names:
            mask, sri, causal = mask_case(name, s, b)
            flop = visible_flop(mask, causal, s, d, h, b, 4.0)
            block_n, slots = kernels.gluon_forward_tiles(d)
            bounds, (lists,) = kernels.prepare_cached(
                sri, causal, s, s, b, q.device, [(BLOCK_M, block_n, True)]
            )
            hm = 1 if sri is None else sri.shape[1]

            def library(bounds=bounds, lists=lists, hm=hm, causal=causal):
                return gluon_fwd.forward(
                    q, k, v, bounds, lists, hm, causal, scale, True, block_n, slots
                )

            cfg = replace(kernels.tile_config(d, has_mask=sri is not None), fwd_gluon=False)

            def run_triton(sri=sri, causal=causal, cfg=cfg):
                return kernels.forward(q, k, v, sri, causal, scale, config=cfg)

            ref_out, ref_lse = library()
            line = f"S={s} {name:16s}"
            for label, fn in (("triton", run_triton), ("gluon", library)):
                ms = triton.testing.do_bench(fn, rep=100)
                line += f" {label} {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s) |"
            for order, head_major in (("head-major", True), ("tile-major", False)):
                try:
                    out, lse = persistent_forward(q, k, v, sri, causal, scale, programs, head_major)
                    torch.cuda.synchronize()
                except Exception as exc:  # report and go on
                    line += f" {order}: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
                same = torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
                err, _, dead_ok = forward_differences(out, lse, ref_out, ref_lse)
                ms = triton.testing.do_bench(
                    lambda sri=sri, c=causal, hm=head_major: persistent_forward(
                        q, k, v, sri, c, scale, programs, hm
                    ),
                    rep=100,
                )
                line += (
                    f" {order} {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s) bitwise {same} "
                    f"max|out diff| {err:.1e} empty rows ok {dead_ok} |"
                )
            print(line, flush=True)


def main() -> None:
    parser = case_parser(
        __doc__.split("\n\n")[0],
        "full,causal,sliding_window,causal_document,document,share_question,"
        "global_sliding_window,prefix_lm_document,random_eviction",
    )
    args = parser.parse_args()
    if args.compile_only:
        for causal in (False, True):
            for has_mask in (False, True):
                print(json.dumps(compile_only(128, causal, has_mask)), flush=True)
        return
    check_and_time(args.seqlens, args.masks, args.tokens, args.hidden)


if __name__ == "__main__":
    main()
