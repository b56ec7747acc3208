"""The Gluon backward (``flashmask.kernels.gluon_kernels.backward``; ``gluon_bwd256`` at head
dim 256) against the Triton backward.

The kernel began here as an experiment (sixth session) with four ways to add dQ: none (the
Triton dQ pass), scalar atomics from the consumers, 16-byte vector atomics from the consumers,
and a dQ writer partition of 4 or 2 warps. Measured on the H200 (``results/gluon_backward_s6*.log``,
``benchmarks/NOTES.md``), the 2-warp writer was fastest and moved into the library; the other
variants are in this file's history (commit 362ef02).

Usage:
* ``python benchmarks/gluon_backward.py --compile-only`` (no GPU): compile the library kernels
  (head dims 64, 128, 256) for sm_90 and print registers, spills, shared memory,
  ``setmaxnreg``, HGMMA/TMA/atomic counts;
* ``PYTHONPATH=src python benchmarks/gluon_backward.py`` (H200): dQ/dK/dV against the Triton
  backward (max abs difference over max abs value) and both timed, with a profiler split of the
  Triton backward's kernels, at 8K and 32K on full, causal and four interval masks
  (``--head-dim 256``: the head-dim-256 kernel, ninth session);
* ``... gluon_backward.py --no-dq-writes`` (H200, a diagnostic): the Gluon backward timed with its
  dQ writer's atomic adds compiled out (dQ is then wrong): how much of the time the dQ writes
  cost at most, the gain a cheaper reduction (TMA bulk reduce-add) could bring. Run it as its
  own process: the kernel compiles with the writer patched before anything else is compiled.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import triton
from bench_cases import backward_cases, case_parser, relative_error
from cubin import compile_gluon_sm90, warp_specialized_report
from triton.experimental import gluon

from flashmask import kernels
from flashmask.kernels import query_chunks, routing
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256
from flashmask.kernels.gluon_kernels.forward import shared_layout

OPCODES = (
    "HGMMA", "WARPGROUP.DEPBAR", "UTMALDG", "UTMAREDG", "UTMASTG", "MUFU.EX2", "LDG", "REDG",
    "STG", "BAR", "ATOMG",
)  # fmt: skip


def _kernel(module):
    if module is gluon_bwd256:
        return gluon_bwd256.gluon_bwd256_kernel
    return gluon_bwd.gluon_bwd_kernel


def compile_only(
    head_dim: int, causal: bool, has_mask: bool, dtype: torch.dtype = torch.bfloat16,
    dq_tma: bool | None = None, row_terms_smem: int | None = None, dkdv_fp32: bool = False,
    add_dkdv: bool = False, late_dq: int | None = None, dq_before_dk: bool | None = None,
    dkdv_tma: bool | None = None, persistent: bool | None = None, timeline: bool = False,
    early_kv: bool | None = None, first_store: int = 0,
) -> dict:  # fmt: skip
    """Compile for sm_90 without a GPU (``dq_tma``, ``row_terms_smem``: the module's ``DQ_TMA``
    and ``ROW_TERMS_SMEM`` unless given; ``dkdv_fp32``: dK/dV stored as fp32, a query chunk's
    partial sums, ``kernels.query_chunks``; ``add_dkdv``: added to what they hold, D = 64/128;
    ``late_dq``: ``gluon_bwd.LATE_DQ_HANDOFF`` unless given, D = 64/128; ``dq_before_dk``:
    ``gluon_bwd.DQ_BEFORE_DK`` unless given, D = 64/128; ``dkdv_tma``: as the module's
    ``dkdv_by_tma`` unless given, never with fp32 dK/dV, as the launcher takes it;
    ``persistent``: ``gluon_bwd.PERSISTENT`` unless given, D = 64/128; ``timeline``: with
    ``gluon_bwd.TIMELINE``'s stamps, D = 64/128; ``early_kv``: ``gluon_bwd.EARLY_KV_RELEASE``
    unless given, persistent only; ``first_store``: ``gluon_bwd.DQ_FIRST_STORE``'s form, D =
    64/128); registers, spills, shared memory and key instructions."""
    module = routing.gluon_backward_module(head_dim)
    if row_terms_smem is None:
        row_terms_smem = module.ROW_TERMS_SMEM
    if dq_tma is None:
        dq_tma = module.DQ_TMA
    if late_dq is None:
        late_dq = gluon_bwd.LATE_DQ_HANDOFF
    if dq_before_dk is None:
        dq_before_dk = gluon_bwd.DQ_BEFORE_DK
    if dkdv_tma is None:
        dkdv_tma = module.dkdv_by_tma(causal, has_mask)
    if persistent is None:
        persistent = bool(gluon_bwd.PERSISTENT)
    persistent = persistent and module is gluon_bwd
    if early_kv is None:
        early_kv = bool(gluon_bwd.EARLY_KV_RELEASE)
    early_kv = early_kv and persistent
    dkdv_tma = dkdv_tma and not dkdv_fp32
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc_type(rows):
        layout = shared_layout(rows, head_dim, dtype)
        return f"tensordesc<{short}[{rows}, {head_dim}],{layout!r}>"

    rows_q, rows_k = module.BLOCK_M, module.BLOCK_N
    signature = {
        "q_desc": desc_type(rows_q), "k_desc": desc_type(rows_k), "v_desc": desc_type(rows_k),
        "do_desc": desc_type(rows_q), "lse_ptr": "*fp32", "delta_ptr": "*fp32",
        "dq_ptr": "*fp32",
        **({"dq_desc": f"tensordesc<fp32[{rows_q}, {head_dim}],"
                       f"{gluon_bwd.dq_shared_layout(head_dim)!r}>"} if dq_tma else {}),
        "dk_ptr": "*fp32" if dkdv_fp32 else f"*{short}",
        "dv_ptr": "*fp32" if dkdv_fp32 else f"*{short}",
        **({"dk_desc": desc_type(rows_k), "dv_desc": desc_type(rows_k)} if dkdv_tma else {}),
        "bounds_ptr": "*i32",
        "entries_ptr": "*i32", "counts_ptr": "*i32", "order_ptr": "*i32", "stride_dqb": "i32",
        "stride_dqs": "i32",
        "stride_dqh": "i32", "stride_kb": "i32", "stride_ks": "i32", "stride_kh": "i32",
        "seqlen_q": "i32", "seqlen_k": "i32", "num_heads_q": "i32", "heads_per_kv": "i32",
        "heads_per_mask_head": "i32", "num_mask_heads": "i32", "num_m_tiles": "i32",
        "num_n_tiles": "i32", "qk_scale": "fp32", "softmax_scale": "fp32",
        **({"num_items": "i32", "next_item_ptr": "*i32"} if module is gluon_bwd else {}),
        **({"timeline_ptr": "*i64"} if module is gluon_bwd and timeline else {}),
        **({"dq_flags": "*i32"} if module is gluon_bwd and first_store else {}),
    }  # fmt: skip
    values = {"CAUSAL": causal, "HAS_MASK": has_mask, "HAS_UPPER": not causal,
              "BLOCK_M": rows_q, "BLOCK_N": rows_k, "HEAD_DIM": head_dim,
              "NUM_BUFFERS": module.NUM_BUFFERS, "WRITER_WARPS": gluon_bwd.WRITER_WARPS,
              "WRITER_REGISTERS": gluon_bwd.WRITER_REGISTERS, "DQ_TMA": dq_tma,
              "DQ_BUFFERS": module.DQ_BUFFERS,
              **({} if dq_tma else {"dq_desc": None}),
              **({} if dkdv_tma else {"dk_desc": None, "dv_desc": None}),
              **({"timeline_ptr": None} if module is gluon_bwd and not timeline else {}),
              **({"dq_flags": None} if module is gluon_bwd and not first_store else {}),
              "ROW_TERMS_SMEM": row_terms_smem, "ORDERED": True,
              "DKDV_TMA": dkdv_tma,
              **({"ADD_DKDV": add_dkdv, "LATE_DQ": late_dq, "DQ_BEFORE_DK": dq_before_dk,
                  "PERSISTENT": persistent, "EARLY_KV": early_kv,
                  "FIRST_STORE": first_store}
                 if module is gluon_bwd else {})}  # fmt: skip
    compiled = compile_gluon_sm90(
        _kernel(module), signature, values,
        {"num_warps": gluon_bwd.NUM_WARPS, "maxnreg": gluon_bwd.MAX_REGISTERS},
    )  # fmt: skip
    return {
        "head_dim": head_dim,
        "causal": causal,
        "has_mask": has_mask,
        "dtype": short,
        "dq_tma": dq_tma,
        "row_terms_smem": row_terms_smem,
        "dkdv_fp32": dkdv_fp32,
        "add_dkdv": add_dkdv,
        "late_dq": late_dq if module is gluon_bwd else 0,
        "dq_before_dk": bool(dq_before_dk) if module is gluon_bwd else False,
        "dkdv_tma": dkdv_tma,
        "persistent": persistent,
        "timeline": timeline and module is gluon_bwd,
        "early_kv": early_kv,
        "first_store": first_store if module is gluon_bwd else 0,
        **warp_specialized_report(compiled, OPCODES),
    }


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


# The launch constants of ``gluon_bwd`` (``gluon_bwd256`` at D = 256) a ``--variant`` may set
# (read when a call launches).
VARIANT_CONSTANTS = (
    "DQ_TMA",
    "NUM_BUFFERS",
    "DQ_BUFFERS",
    "ROW_TERMS_SMEM",
    "CHUNKS_ADD_IN_KERNEL",
    "LATE_DQ_HANDOFF",
    "DQ_BEFORE_DK",
    "DKDV_TMA",
    "QUERY_CHUNK_BYTES",
    "QUERY_SPLIT_FROM_BYTES",
    "PERSISTENT",
    "MAX_PROGRAMS",
    "EARLY_KV_RELEASE",
    "DQ_FIRST_STORE",
)


def _owner(module, name: str):
    """The module that holds launch constant ``name`` (``kernels.query_chunks`` for the query
    split, else the backward ``module``)."""
    return query_chunks if name.startswith("QUERY_") else module


def set_constants(module, settings: dict[str, int]) -> dict[str, int]:
    """Set ``settings`` (as :func:`parse_variant` returns them) on ``module`` (the query split's
    on ``kernels.query_chunks``), each in the type of the value it replaces; returns the values
    replaced."""
    previous = {name: getattr(_owner(module, name), name) for name in settings}
    for name, value in settings.items():
        setattr(_owner(module, name), name, type(previous[name])(value))
    return previous


def apply_gluon_bwd_option(
    parser: argparse.ArgumentParser, text: str, module=gluon_bwd, option: str = "--gluon-bwd"
) -> None:
    """A script's ``option`` (``--gluon-bwd``; ``--gluon-bwd256`` with ``module`` the hd256
    backward): ``text`` parsed and set on ``module``; bad text, or a constant the module does
    not have, is the parser's error."""
    try:
        settings = parse_variant(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{option}: {exc}")
    missing = [name for name in settings if not hasattr(_owner(module, name), name)]
    if missing:
        parser.error(f"{option}: {module.__name__} has no {missing}")
    set_constants(module, settings)


def parse_variant(text: str) -> dict[str, int]:
    """``"DQ_TMA=1,NUM_BUFFERS=3"`` -> ``{"DQ_TMA": 1, "NUM_BUFFERS": 3}`` (names from
    :data:`VARIANT_CONSTANTS`, integer values)."""
    settings = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in VARIANT_CONSTANTS or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"expected NAME=INT[,NAME=INT...] with NAME in {VARIANT_CONSTANTS}, got {item!r}"
            )
        settings[name] = int(value)
    return settings


def check_and_time(
    seqlens: list[int], mask_names: list[str], tokens: int, hidden: int, d: int,
    variants: list[dict[str, int]] = (), rep_ms: int = 100,
) -> None:  # fmt: skip
    """dQ/dK/dV against the Triton backward and the timings (``do_bench`` over ``rep_ms``), per
    sequence length and mask; each of ``variants`` (constants of
    ``routing.gluon_backward_module(d)`` to set, e.g. ``{"DQ_TMA": 0}``) also timed, with its
    dK/dV compared bitwise against the default's (the same products in the same order; where
    they differ, also their error against the Triton backward's, as the default's) and its
    dQ's relative difference (fp32 additions in another order)."""

    module = routing.gluon_backward_module(d)
    for settings in variants:
        missing = [name for name in settings if not hasattr(_owner(module, name), name)]
        if missing:
            raise SystemExit(f"--variant: {module.__name__} (D = {d}) has no {missing}")
    # Every case through the Gluon backward: lift the library's routing limit (with a mask it
    # takes the Gluon backward only from routing.GLUON_BWD_MIN_MASKED_SEQLEN's keys).
    routing.GLUON_BWD_MIN_MASKED_SEQLEN = {}
    for case in backward_cases(seqlens, mask_names, tokens, hidden, d):
        flop = case.flop
        # The Gluon backward forced on (the defaults use it at D = 128 only).
        base = replace(kernels.tile_config(d, has_mask=case.sri is not None), bwd_gluon=True)
        run = case.run_backward
        ref = run(True, base)
        ms = triton.testing.do_bench(lambda: run(True, base), rep=rep_ms)
        line = (
            f"S={case.seqlen} {case.name:16s} triton bwd {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s)"
        )
        split = _kernel_times(
            lambda: run(True, replace(base, fused_backward=False)),
            ("dkdv_kernel", "dq_kernel", "delta_kernel"),
        )
        line += " [unfused: " + ", ".join(f"{n} {t:.3f}" for n, t in split.items()) + "]"
        got = run(False, base)  # bwd_gluon: the Gluon kernel
        errs = [f"d{n} {relative_error(g, w):.1e}" for g, w, n in zip(got, ref, "qkv", strict=True)]
        g_ms = triton.testing.do_bench(lambda: run(False, base), rep=rep_ms)
        line += f" | gluon {g_ms:.3f} ms ({flop / g_ms / 1e9:.0f} TF/s) rel err {' '.join(errs)}"
        for settings in variants:
            defaults = set_constants(module, settings)
            try:
                alt = run(False, base)
                same = all(torch.equal(a, c) for a, c in zip(alt[1:], got[1:], strict=True))
                dq_rel = relative_error(alt[0], got[0])
                t_ms = triton.testing.do_bench(lambda: run(False, base), rep=rep_ms)
            finally:
                set_constants(module, defaults)
            label = ",".join(f"{n}={v}" for n, v in settings.items())
            line += (
                f" | {label} {t_ms:.3f} ms ({flop / t_ms / 1e9:.0f} TF/s) dk/dv bitwise "
                f"{same} dq rel diff {dq_rel:.1e}"
            )
            if not same:
                line += (
                    " (vs triton: "
                    + " ".join(
                        f"d{n} {relative_error(a, w):.1e}"
                        for a, w, n in zip(alt, ref, "qkv", strict=True)
                    )
                    + ")"
                )
        print(line, flush=True)


@gluon.jit
def _discard_dq(dq_head, row0, stride_dqs, values):
    """Stands in for ``gluon_bwd._red_add_v4`` under ``--no-dq-writes``: adds nothing."""
    pass


def time_without_dq_writes(
    seqlens: list[int], mask_names: list[str], tokens: int, hidden: int, d: int
) -> None:
    """The Gluon backward timed with its dQ atomics compiled out (``--no-dq-writes``; the
    ``red.global`` writer's, so ``DQ_TMA`` is turned off: the bound of both writers)."""
    gluon_bwd._red_add_v4 = _discard_dq  # before the kernel's first compile in this process
    routing.gluon_backward_module(d).DQ_TMA = False
    routing.GLUON_BWD_MIN_MASKED_SEQLEN = {}
    for case in backward_cases(seqlens, mask_names, tokens, hidden, d):
        cfg = replace(kernels.tile_config(d, has_mask=case.sri is not None), bwd_gluon=True)
        ms = triton.testing.do_bench(
            lambda case=case, cfg=cfg: case.run_backward(False, cfg),
            rep=100,
        )
        print(
            f"S={case.seqlen} {case.name:16s} gluon without dQ writes {ms:.3f} ms "
            f"({case.flop / ms / 1e9:.0f} TF/s; dQ discarded)",
            flush=True,
        )


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=routing.GLUON_BWD_HEAD_DIMS)
    parser.add_argument(
        "--no-dq-writes",
        action="store_true",
        help="time the Gluon backward with its dQ atomics compiled out (a diagnostic)",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help="also time the Gluon backward with these gluon_bwd constants, e.g. DQ_TMA=0 or "
        "NUM_BUFFERS=3,DQ_BUFFERS=1 (repeatable)",
    )
    parser.add_argument(
        "--rep-ms", type=int, default=100, help="do_bench's time per measurement (ms)"
    )
    args = parser.parse_args()
    if args.no_dq_writes:
        time_without_dq_writes(args.seqlens, args.masks, args.tokens, args.hidden, args.head_dim)
        return
    if args.compile_only:
        for d in routing.GLUON_BWD_HEAD_DIMS:
            for causal in (False, True):
                for has_mask in (False, True):
                    print(json.dumps(compile_only(d, causal, has_mask)), flush=True)
        # fp16 (the launcher takes it as well as bf16), one variant
        print(json.dumps(compile_only(128, True, True, torch.float16)), flush=True)
        for d in routing.GLUON_BWD_HEAD_DIMS:  # the red.global writer (DQ_TMA off)
            print(json.dumps(compile_only(d, True, True, dq_tma=False)), flush=True)
        for d in routing.GLUON_BWD_HEAD_DIMS:  # full attention's query chunks: fp32 dK/dV
            print(json.dumps(compile_only(d, False, False, dkdv_fp32=True)), flush=True)
        for d in (64, 128):  # ... added in the kernel (CHUNKS_ADD_IN_KERNEL)
            report = compile_only(d, False, False, dkdv_fp32=True, add_dkdv=True)
            print(json.dumps(report), flush=True)
        # Forms kept for measurement at D = 64/128: the dQ hand-off before the next tile's
        # products (LATE_DQ_HANDOFF=0), dK's product before dQ's (DQ_BEFORE_DK off), dK/dV
        # stored from registers (DKDV_TMA off; these forms ship with TMA stores).
        forms = ({"late_dq": 0}, {"dq_before_dk": False}, {"dkdv_tma": False})
        for form in forms:
            for d in (64, 128):
                for causal, has_mask in ((False, False), (True, True)):
                    report = compile_only(d, causal, has_mask, **form)
                    print(json.dumps(report), flush=True)
        # D = 256's dK/dV in the form not shipped: through TMA without a mask, from registers
        # with one (gluon_bwd256.DKDV_TMA = 2)
        for causal, has_mask in ((False, False), (True, True)):
            report = compile_only(256, causal, has_mask, dkdv_tma=not has_mask)
            print(json.dumps(report), flush=True)
        # The persistent programs (gluon_bwd.PERSISTENT, D = 64/128): full, plain causal and
        # masked, in the form not shipped.
        for d in (64, 128):
            for causal, has_mask in ((False, False), (True, False), (True, True)):
                report = compile_only(d, causal, has_mask, persistent=not gluon_bwd.PERSISTENT)
                print(json.dumps(report), flush=True)
        # Persistent with the K/V buffers released before the drain (EARLY_KV_RELEASE)
        for d in (64, 128):
            for causal, has_mask in ((False, False), (True, False), (True, True)):
                report = compile_only(d, causal, has_mask, persistent=True, early_kv=True)
                print(json.dumps(report), flush=True)
        # dQ tiles stored by their first writer, claimed through flags (DQ_FIRST_STORE)
        for d in (64, 128):
            for causal, has_mask in ((False, False), (True, True)):
                for form in (1, 2):
                    report = compile_only(d, causal, has_mask, first_store=form)
                    print(json.dumps(report), flush=True)
        # With gluon_bwd.TIMELINE's stamps (a diagnostic, bwd_timeline.py), both forms
        for persistent in (False, True):
            for causal, has_mask in ((False, False), (True, True)):
                report = compile_only(128, causal, has_mask, persistent=persistent, timeline=True)
                print(json.dumps(report), flush=True)
        # lse/delta read by the consumers from global memory (ROW_TERMS_SMEM=0, measurement)
        for d in routing.GLUON_BWD_HEAD_DIMS:
            for causal, has_mask in ((False, False), (True, True), (False, True)):
                report = compile_only(d, causal, has_mask, row_terms_smem=0)
                print(json.dumps(report), flush=True)
        return
    check_and_time(
        args.seqlens, args.masks, args.tokens, args.hidden, args.head_dim, args.variant,
        args.rep_ms,
    )  # fmt: skip


if __name__ == "__main__":
    main()
