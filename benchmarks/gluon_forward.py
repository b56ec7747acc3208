"""The Gluon forward (``flashmask.kernels.gluon_kernels.forward``) against the Triton forward.

The kernel began here as an experiment (fifth session) and moved into the library once the H200
showed it exact and faster without a mask (sixth session, ``benchmarks/NOTES.md``). Its first
version also had an FA3-style schedule (the next tile's ``Q K^T`` issued before this tile's
softmax); measured 11-35% slower than the plain one (``results/gluon_forward_s6.log``), it was
dropped. FA3's ping-pong schedule (the two compute warpgroups taking turns at the tensor cores)
measured bit-identical to the lockstep kernel and 5-22% faster (``results/gluon_pingpong_s7.log``)
and replaced it in the seventh session.

Usage:
* ``python benchmarks/gluon_forward.py --compile-only`` (no GPU): compile the library kernel for
  sm_90 and print one JSON line per variant: registers, spills, shared memory, ``setmaxnreg``,
  HGMMA and TMA counts;
* ``PYTHONPATH=src python benchmarks/gluon_forward.py`` (H200): compare out and lse with the
  Triton forward (max abs difference; exact equality is not expected, the two kernels' tiles
  and accumulation orders differ) and time both, at 8K and 32K, on full, causal and four
  interval masks (TFLOP/s over visible pairs, as ``flashmask bench`` counts them).
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import triton
from bench_cases import case_parser, forward_differences, mask_case, visible_flop
from cubin import compile_gluon_sm90, warp_specialized_report

from flashmask import kernels
from flashmask.kernels import preparation, routing
from flashmask.kernels.gluon_kernels import forward as gluon_fwd

OPCODES = ("HGMMA", "UTMALDG", "UTMASTG", "MUFU.EX2", "LDG", "STG")


def compile_only(
    head_dim: int, causal: bool, has_mask: bool, dense: bool, block_n: int = gluon_fwd.BLOCK_N,
    dtype: torch.dtype = torch.bfloat16, num_buffers: int = gluon_fwd.NUM_BUFFERS,
    o_tma: bool | None = None, q_buffers: int = gluon_fwd.Q_BUFFERS,
) -> dict:  # fmt: skip
    """Compile for sm_90 without a GPU (``o_tma``: as ``gluon_fwd.o_by_tma`` unless given);
    registers, spills, shared memory and key instructions."""
    if o_tma is None:
        o_tma = gluon_fwd.o_by_tma(causal, has_mask)
    block = gluon_fwd.BLOCK_M
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc_type(rows=block):
        layout = gluon_fwd.shared_layout(rows, head_dim, dtype)
        return f"tensordesc<{short}[{rows}, {head_dim}],{layout!r}>"

    signature = {
        "q_desc": desc_type(), "k_desc": desc_type(block_n), "v_desc": desc_type(block_n),
        "out_ptr": f"*{short}", **({"o_desc": desc_type(block // 2)} if o_tma else {}),
        "lse_ptr": "*fp32", "bounds_ptr": "*i32", "entries_ptr": "*i32",
        "counts_ptr": "*i32", "order_ptr": "*i32", "stride_ob": "i32", "stride_os": "i32",
        "stride_oh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "heads_per_kv": "i32",
        "heads_per_mask_head": "i32", "num_mask_heads": "i32", "num_m_tiles": "i32",
        "num_n_tiles": "i32", "qk_scale": "fp32", "num_items": "i32",
        "next_item_ptr": "*i32",
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "MASK_FULL_TILES": dense, "ORDERED": True, "BLOCK_M": block, "BLOCK_N": block_n,
              "HEAD_DIM": head_dim, "NUM_BUFFERS": num_buffers, "Q_BUFFERS": q_buffers,
              "COMPUTE_REGISTERS": gluon_fwd.COMPUTE_REGISTERS,
              **({} if o_tma else {"o_desc": None})}  # fmt: skip
    compiled = compile_gluon_sm90(
        gluon_fwd.gluon_fwd_kernel, signature, values,
        {"num_warps": gluon_fwd.NUM_WARPS, "maxnreg": gluon_fwd.MAX_REGISTERS},
    )  # fmt: skip
    return {
        "head_dim": head_dim,
        "causal": causal,
        "has_mask": has_mask,
        "dense": dense,
        "block_n": block_n,
        "dtype": short,
        "num_buffers": num_buffers,
        "q_buffers": q_buffers,
        "o_tma": o_tma,
        **warp_specialized_report(compiled, OPCODES),
    }


def library_preparation(q, k, sri, causal, block_n):
    """``(bounds, lists, mask heads, order)`` that the library prepares for the Gluon forward
    at key tile ``block_n``: its row lists and, with a mask, its launch order (the longest
    lists first)."""
    b, sq = q.shape[:2]
    bounds, (lists,) = kernels.prepare_cached(
        sri, causal, sq, k.shape[1], b, q.device, [(gluon_fwd.BLOCK_M, block_n, True)]
    )
    hm = 1 if sri is None else sri.shape[1]
    order = None if sri is None else preparation.program_order(lists, q.shape[2], True)
    return bounds, lists, hm, order


def _gluon(q, k, v, sri, causal, scale, block_n, buffers):
    """The Gluon forward on any mask and length, in the library's launch order (the library
    routes masked calls to it only from ``routing.GLUON_FWD_MIN_MASKED_SEQLEN`` keys; the
    twenty-first session's and earlier logs of this script ran it in the grid's order)."""
    bounds, lists, hm, order = library_preparation(q, k, sri, causal, block_n)
    return gluon_fwd.forward(
        q, k, v, bounds, lists, hm, causal, scale, True, block_n, buffers, order=order
    )


def _flipped_form(name: str, value: int, run, out, lse, flop: float) -> str:
    """The Gluon forward with its constant ``name`` set to ``value`` for the calls of ``run``:
    its time and TFLOP/s, and whether its out/lse equal ``out``/``lse`` (the shipped form's)
    bit for bit, as a fragment of a result line."""
    shipped = getattr(gluon_fwd, name)
    setattr(gluon_fwd, name, value)
    try:
        alt_out, alt_lse = run()
        same = torch.equal(alt_out, out) and torch.equal(alt_lse, lse)
        ms = triton.testing.do_bench(run)
    finally:
        setattr(gluon_fwd, name, shipped)
    return f" | {name}={value} {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s) out/lse bitwise {same}"


def check_and_time(
    seqlens: list[int], mask_names: list[str], tokens: int, hidden: int, d: int,
    block_ns: list[int], buffer_counts: list[int], o_tma_ab: bool = False,
    persistent_ab: bool = False,
) -> None:  # fmt: skip
    """Out/lse against the Triton forward and both timed, per sequence length and mask; the
    Gluon forward once per key tile in ``block_ns`` and K/V ring depth in ``buffer_counts``;
    with ``o_tma_ab`` also with O stored the other way than ``gluon_fwd.o_by_tma`` ships for
    the case (``O_TMA`` 0 or 1), its out/lse compared bitwise with the shipped setting's (the
    same values, stored another way); with ``persistent_ab`` also with ``gluon_fwd.PERSISTENT``
    flipped (one program per SM looping over the query tiles, or one per tile), bitwise as
    well (each tile's arithmetic is the same)."""

    for s in seqlens:
        b, h = max(1, tokens // s), hidden // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        scale = d**-0.5
        for name in mask_names:
            mask, sri, causal = mask_case(name, s, b)
            cfg = replace(kernels.tile_config(d, has_mask=mask is not None), fwd_gluon=False)
            flop = visible_flop(mask, causal, s, d, h, b, 4.0)

            def run_triton(sri=sri, causal=causal, cfg=cfg):
                return kernels.forward(q, k, v, sri, causal, scale, config=cfg)

            ref_out, ref_lse = run_triton()
            ms_triton = triton.testing.do_bench(run_triton, rep=100)
            line = f"S={s} {name:16s} triton {ms_triton:.3f} ms ({flop / ms_triton / 1e9:.0f} TF/s)"
            for bn, nb in ((bn, nb) for bn in block_ns for nb in buffer_counts):

                def run(sri=sri, c=causal, bn=bn, nb=nb):
                    return _gluon(q, k, v, sri, c, scale, bn, nb)

                out, lse = run()
                err, lse_err, dead_ok = forward_differences(out, lse, ref_out, ref_lse)
                ms = triton.testing.do_bench(run)
                line += (
                    f" | gluon 128x{bn}/{nb} buffers {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s) "
                    f"max|out diff| {err:.1e} max|lse diff| {lse_err:.1e} empty rows ok {dead_ok}"
                )
                if o_tma_ab:
                    flipped = 0 if gluon_fwd.o_by_tma(causal, sri is not None) else 1
                    line += _flipped_form("O_TMA", flipped, run, out, lse, flop)
                if persistent_ab:
                    line += _flipped_form(
                        "PERSISTENT", 1 - gluon_fwd.PERSISTENT, run, out, lse, flop
                    )
            print(line, flush=True)


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--head-dim",
        type=int,
        default=128,
        choices=routing.GLUON_FWD_HEAD_DIMS,
        help="256 is not routed to the kernel by default (measured slower than the Triton forward)",
    )
    parser.add_argument(
        "--block-n", default="", help="key tiles to time, e.g. 128,64 (default: the launcher's)"
    )
    parser.add_argument(
        "--buffers", default="", help="K/V ring depths to time, e.g. 2,3 (default: the launcher's)"
    )
    parser.add_argument(
        "--o-tma-ab",
        action="store_true",
        help="also time the Gluon forward with O stored the other way than shipped for each case "
        "(gluon_fwd.O_TMA 0 or 1; bitwise out/lse check)",
    )
    parser.add_argument(
        "--persistent-ab",
        action="store_true",
        help="also time the Gluon forward with gluon_fwd.PERSISTENT flipped (bitwise check)",
    )
    args = parser.parse_args()
    if args.compile_only:
        for d in (64, 128):
            for causal in (False, True):
                for has_mask in (False, True):
                    for dense in (False, True):
                        print(json.dumps(compile_only(d, causal, has_mask, dense)), flush=True)
                    if has_mask:  # the 64-key tiles measured for interval masks
                        print(json.dumps(compile_only(d, causal, True, False, 64)), flush=True)
        # fp16 (the launcher takes it as well as bf16), one variant
        print(json.dumps(compile_only(128, True, True, False, dtype=torch.float16)), flush=True)
        # a two-slot K/V ring (measured against the default three by the GPU script's --buffers)
        print(json.dumps(compile_only(128, False, False, False, num_buffers=2)), flush=True)
        # two Q buffers beside two K/V slots (gluon_fwd.Q_BUFFERS, prepared, off), with a mask
        report = compile_only(128, True, True, False, num_buffers=2, q_buffers=2)
        print(json.dumps(report), flush=True)
        # head dim 256 at the launcher's tiles for it, with a mask (the variant that spills most)
        block_n, slots = routing.gluon_forward_tiles(256)
        print(json.dumps(compile_only(256, True, True, False, block_n, num_buffers=slots)))
        # O stored the other way than shipped (TMA stores against stores from registers)
        for d in (64, 128):
            for causal, has_mask in ((False, False), (True, True)):
                flipped = not gluon_fwd.o_by_tma(causal, has_mask)
                report = compile_only(d, causal, has_mask, False, o_tma=flipped)
                print(json.dumps(report), flush=True)
        return
    default_block_n, default_slots = routing.gluon_forward_tiles(args.head_dim)
    block_ns = [int(x) for x in (args.block_n or str(default_block_n)).split(",")]
    buffer_counts = [int(x) for x in (args.buffers or str(default_slots)).split(",")]
    check_and_time(
        args.seqlens, args.masks, args.tokens, args.hidden, args.head_dim, block_ns,
        buffer_counts, args.o_tma_ab, args.persistent_ab,
    )  # fmt: skip


if __name__ == "__main__":
    main()
