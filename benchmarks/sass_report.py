"""Compile FlashMask's kernels for Hopper (sm_90a) without a GPU and report what their SASS holds.

Kernel families (``--family``):

* ``triton``: every kernel launch one forward + backward makes through the Triton kernels (mask
  preparation, forward, backward), per head dim, mask form and tile-configuration variant;
* ``gluon_fwd``: the Gluon forward as it ships (head dims 64, 128 and 256 at the launcher's key
  tiles; full, causal and masked; skipping and dense mode; bf16 and, once, fp16; and with a logit
  cap, ``softcap``, at head dim 128 causal and masked and at 256 masked);
* ``gluon_bwd``: the Gluon backward as it ships (head dims 64, 128 and 256; full, causal and
  masked; bf16 and, once, fp16; and long full attention's query chunks, whose first launch
  stores fp32 dK/dV sums and whose later ones add to them; and with a logit cap at head dim 128
  causal, masked and in query chunks and at 256 masked).

Each launch is captured from the library's own launchers (``kernels.forward`` /
``kernels.backward``, with the Gluon kernels routed in for the Gluon families; nothing runs),
specialised by Triton's own binder on the captured arguments, compiled with Triton's bundled
``ptxas`` and read with its bundled ``cuobjdump``: registers per thread, local-memory (spill)
bytes, shared memory, the ``setmaxnreg`` a warp-specialised kernel's partitions execute, static
counts of key instructions (``HGMMA``: Hopper warpgroup MMA, which the dot products must compile
to; ``HMMA``, the older per-warp MMA, which should not appear; ``MUFU.EX2``, ``MUFU.RCP`` and
``MUFU.TANH``, the special-function unit's exponentials, reciprocals and tanh; TMA loads, stores
and reduce-adds; global loads/stores; barriers; ``WARPGROUP.DEPBAR``, the waits on ``wgmma``),
and ``sass_sha256``, a digest of the SASS with which a change that must leave the kernels alone
proves it did.

Usage (from the repository root; a few minutes on a CPU)::

    PYTHONPATH=src python benchmarks/sass_report.py --family gluon_bwd --json  # JSON lines
    PYTHONPATH=src python benchmarks/sass_report.py [--family triton] [--out PATH]  # PATH.json/.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, never interpret

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flashmask import kernels
from flashmask.kernels import launch, mask_prep, preparation, query_chunks, routing, tensors
from flashmask.kernels.triton_kernels import backward as attention_bwd
from flashmask.kernels.triton_kernels import forward as attention_fwd

TARGET = GPUTarget("cuda", 90, 32)
OPCODES = (
    "HGMMA", "HMMA", "WARPGROUP.DEPBAR", "MUFU.EX2", "MUFU.RCP", "MUFU.TANH", "UTMALDG",
    "UTMASTG", "UTMAREDG", "LDGSTS", "LDG", "STG", "REDG", "ATOMG", "LDS", "STS", "LDL", "STL",
    "BAR",
)  # fmt: skip
FAMILIES = ("triton", "gluon_fwd", "gluon_bwd")
# Per-SM resources by compute capability: (shared memory per SM in bytes, 32-bit registers).
SM_RESOURCES = {80: (164 * 1024, 65536), 86: (100 * 1024, 65536), 89: (100 * 1024, 65536),
                90: (228 * 1024, 65536)}  # fmt: skip
MAX_WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64}
# The Triton family's tile-configuration variants (``--variants``), from the shipped one.
TRITON_VARIANTS: dict[str, Callable] = {
    "shipped": lambda cfg: cfg,
    # Does doubling the backward's warps take the dK/dV pass off its register cap?
    "8-warp backward": lambda cfg: replace(cfg, bwd_warps=8, dq_warps=8),
    "pointer forward": lambda cfg: replace(cfg, fwd_tma=False),
}


# ---------------------------------------------------------------------------------------------
# Capturing launches and compiling them as Triton would


def library_kernels() -> list:
    """Every ``triton.jit``/``gluon.jit`` function of the kernel modules (the Gluon modules
    import here: the interpreter is off)."""
    from flashmask.kernels.gluon_kernels import backward, backward_hd256
    from flashmask.kernels.gluon_kernels import forward as gluon_fwd

    modules = (mask_prep, preparation, attention_fwd, attention_bwd, gluon_fwd, backward,
               backward_hd256)  # fmt: skip
    functions = {id(v): v for m in modules for v in vars(m).values() if isinstance(v, JITFunction)}
    return list(functions.values())


@contextmanager
def captured_launches() -> Iterator[list[tuple[object, tuple, dict]]]:
    """Within the block, launching any of the library's kernels records ``(kernel, args,
    kwargs)`` in the yielded list instead of running; every launch takes Triton's path
    (``kernel[grid](...)``), not the cached one, which needs a GPU."""
    functions = library_kernels()
    launches: list[tuple[object, tuple, dict]] = []
    saved = [(fn, fn.__dict__.get("run")) for fn in functions]
    runtime_state = launch._runtime_state
    for fn in functions:

        def run(*args, grid, warmup, _fn=fn, **kwargs):
            launches.append((_fn, args, kwargs))

        fn.run = run
    launch._runtime_state = lambda kernel, triton: None
    try:
        yield launches
    finally:
        launch._runtime_state = runtime_state
        for fn, run in saved:
            if run is None:
                del fn.run
            else:
                fn.run = run


def compile_launch(fn, args: tuple, kwargs: dict):
    """``(compiled, constexprs)``: ``fn`` compiled for :data:`TARGET` as a launch with these
    arguments would compile it (Triton's binder and argument packing, so the same
    specialisation: 16-byte alignment, integers divisible by 16, integers equal to 1 folded),
    and its constexprs by name."""
    from triton.experimental.gluon._runtime import GluonASTSource

    backend = make_backend(TARGET)
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug}
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run adds
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=TARGET, options=options.__dict__)
    named = {fn.params[path[0]].name: value for path, value in constexprs.items()}
    return compiled, named


def inspect_cubin(compiled) -> dict:
    """``registers``, ``local_bytes`` (spills plus stack), the count of each of :data:`OPCODES`
    in the SASS and ``sass_sha256``, the first 16 hex digits of its digest."""
    cuobjdump = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.check_output([cuobjdump, "-res-usage", f.name], text=True)
        sass = subprocess.check_output([cuobjdump, "-sass", f.name], text=True)
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    instructions = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    return {
        "registers": int(fields.get("REG", -1)),
        "local_bytes": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
        **{op: len(re.findall(r"\b" + re.escape(op) + r"\b", sass)) for op in OPCODES},
        "sass_sha256": hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16],
    }


def blocks_per_sm(arch: int, registers: int, warps: int, shared_bytes: int) -> int:
    """How many programs of a kernel fit on one SM at once, limited by registers (allocated per
    warp in units of 256), shared memory (plus the 1 KB the driver reserves per block) and warps.
    """
    smem_per_sm, regs_per_sm = SM_RESOURCES[arch]
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_registers = regs_per_sm // (regs_per_warp * warps)
    by_shared = smem_per_sm // (shared_bytes + 1024)
    by_warps = MAX_WARPS_PER_SM[arch] // warps
    return min(by_registers, by_shared, by_warps)


def report(fn, args: tuple, kwargs: dict) -> dict:
    """Compile one captured launch and summarise its cubin."""
    compiled, constexprs = compile_launch(fn, args, kwargs)
    dump = inspect_cubin(compiled)
    warps = compiled.metadata.num_warps
    ptx = compiled.asm["ptx"]
    return {
        "kernel": fn.__name__,
        "warps": warps,
        "registers": dump["registers"],
        "spill_bytes": dump["local_bytes"],
        "shared_kb": compiled.metadata.shared / 1024,
        "blocks_per_sm": blocks_per_sm(
            TARGET.arch, dump["registers"], warps, compiled.metadata.shared
        ),
        "setmaxnreg": sorted(
            {" ".join(line.split()[:2]) for line in ptx.splitlines() if "setmaxnreg" in line}
        ),
        "constexprs": {
            name: value
            for name, value in constexprs.items()
            if name.isupper() and isinstance(value, (bool, int, str))
        },
        **{key: value for key, value in dump.items() if key not in ("registers", "local_bytes")},
    }


# ---------------------------------------------------------------------------------------------
# The families' launches


def _inputs(head_dim: int, form: str, seqlen: int, heads: int, kv_heads: int, dtype):
    """``(q, k, sri, causal)`` on the CPU: ``form`` is ``full``, ``causal``, ``causal-C1`` (a
    causal mask with one bound per column) or ``noncausal-C2`` (two)."""
    b = 2
    q = torch.empty(b, seqlen, heads, head_dim, dtype=dtype)
    k = torch.empty(b, seqlen, kv_heads, head_dim, dtype=dtype)
    columns = {"causal-C1": 1, "noncausal-C2": 2}.get(form)
    sri = None if columns is None else torch.zeros(b, 1, seqlen, columns, dtype=torch.int32)
    return q, k, sri, form in ("causal", "causal-C1")


@contextmanager
def _as_on_hopper(gluon: bool) -> Iterator[None]:
    """The launchers as on an H200, for CPU tensors: TMA usable, 132 SMs and, with ``gluon``,
    the Gluon kernels routed in wherever they apply (else never)."""
    from flashmask.kernels.gluon_kernels import forward as gluon_fwd

    saved = (
        tensors.tma_usable, routing.use_gluon_forward, routing.use_gluon_backward,
        gluon_fwd.sm_count,
    )  # fmt: skip
    tensors.tma_usable = lambda tensors: True
    routing.use_gluon_forward = lambda *args: gluon
    routing.use_gluon_backward = lambda *args: gluon
    gluon_fwd.sm_count = lambda device: 132
    try:
        yield
    finally:
        (
            tensors.tma_usable, routing.use_gluon_forward, routing.use_gluon_backward,
            gluon_fwd.sm_count,
        ) = saved  # fmt: skip


def triton_launches(head_dim: int, form: str, variant: str, shared_memory: int | None = None):
    """The Triton kernels' launches of one forward + backward (8K x 4, 2048 / D heads)."""
    heads = 2048 // head_dim
    q, _, sri, causal = _inputs(head_dim, form, 8192, heads, heads, torch.bfloat16)
    cfg = kernels.tile_config(head_dim, has_mask=sri is not None, shared_memory=shared_memory)
    cfg = TRITON_VARIANTS[variant](cfg)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    kernels.clear_prepared()  # every variant's own preparation launches
    with _as_on_hopper(False), captured_launches() as launches:
        kernels.forward(q, q, q, sri, causal, head_dim**-0.5, config=cfg)
        kernels.backward(q, None, q, q, q, q, lse, sri, causal, head_dim**-0.5, True, config=cfg)
    return launches


GLUON_FORMS = ("full", "causal", "causal-C1", "noncausal-C2")
# The capped variants' logit cap (Gemma 2's on attention scores); any positive value compiles
# the same code but for the constant.
GLUON_SOFTCAP = 50.0


def _gluon_variants(family: str) -> list[tuple[int, str, torch.dtype, float]]:
    """``(head dim, mask form, dtype, softcap)`` of the Gluon family's variants: the uncapped
    ones, then the capped ones (head dim 128 causal and masked, 256 masked: the largest
    accumulators); the backward's also at multi-head latent attention's 192 (V's head dim
    128), capped where masked."""
    shipped = [(d, form, torch.bfloat16, 0.0) for d in (64, 128, 256) for form in GLUON_FORMS]
    capped = [
        (d, form, torch.bfloat16, GLUON_SOFTCAP)
        for d, form in ((128, "causal"), (128, "noncausal-C2"), (256, "noncausal-C2"))
    ]
    variants = [*shipped, (128, "causal-C1", torch.float16, 0.0), *capped]
    if family == "gluon_bwd":
        variants += [(192, form, torch.bfloat16, 0.0) for form in GLUON_FORMS]
        variants.append((192, "noncausal-C2", torch.bfloat16, GLUON_SOFTCAP))
    return variants


def gluon_launches(family: str) -> Iterator[tuple[dict, object, tuple, dict]]:
    """``(what, kernel, args, kwargs)`` of each Gluon kernel launch of ``family``, ``what``
    naming its variant (GQA shapes, 1024 rows: 8 query heads over 2 kv heads)."""
    variants = _gluon_variants(family)
    cases = [(*variant, mode) for variant in variants for mode in ("skip", "dense")]
    if family == "gluon_bwd":
        cases = [(*variant, "skip") for variant in variants]
        cases += [(d, "full", torch.bfloat16, 0.0, "chunks") for d in (64, 128)]
        cases.append((128, "full", torch.bfloat16, GLUON_SOFTCAP, "chunks"))
    for head_dim, form, dtype, softcap, mode in cases:
        q, k, sri, causal = _inputs(head_dim, form, 1024, 8, 2, dtype)
        # V (and O, dO) with V's own head dim where the backward takes one.
        head_dim_v = routing.GLUON_BWD_VALUE_HEAD_DIMS.get(head_dim, head_dim)
        v = k.new_empty(*k.shape[:-1], head_dim_v)
        out = q.new_empty(*q.shape[:-1], head_dim_v)
        cfg = kernels.tile_config(head_dim, has_mask=sri is not None)
        what = {
            "head_dim": head_dim, "head_dim_v": head_dim_v, "causal": causal,
            "has_mask": sri is not None, "dtype": str(dtype).removeprefix("torch."),
            "softcap": softcap,
        }  # fmt: skip
        chunk_bytes = query_chunks.QUERY_SPLIT_FROM_BYTES, query_chunks.QUERY_CHUNK_BYTES
        if mode == "chunks":  # two chunks of 512 rows
            query_chunks.QUERY_SPLIT_FROM_BYTES = 0
            query_chunks.QUERY_CHUNK_BYTES = query_chunks.working_set_bytes(512, head_dim, 4)
        kernels.clear_prepared()
        try:
            with _as_on_hopper(True), captured_launches() as launches:
                if family == "gluon_fwd":
                    kernels.forward(q, k, k, sri, causal, 0.125, skip_tiles=mode == "skip",
                                    config=cfg, softcap=softcap)  # fmt: skip
                else:
                    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
                    kernels.backward(out, None, q, k, v, out, lse, sri, causal, 0.125, False,
                                     config=cfg, softcap=softcap)  # fmt: skip
        finally:
            query_chunks.QUERY_SPLIT_FROM_BYTES, query_chunks.QUERY_CHUNK_BYTES = chunk_bytes
        seen = set()
        for fn, args, kwargs in launches:
            if not fn.is_gluon():  # the mask preparation's and the row terms' kernels
                continue
            key = (fn, kwargs.get("ADD_DKDV"), kwargs.get("DKDV_TMA"))
            if key not in seen:  # a query chunk's later launches repeat the second
                seen.add(key)
                if family == "gluon_fwd":
                    yield {**what, "dense": mode == "dense"}, fn, args, kwargs
                else:
                    yield {**what, "chunk": mode == "chunks"}, fn, args, kwargs


def gluon_rows(family: str) -> Iterator[dict]:
    """The report rows of a Gluon family: its variant, the form the launcher chose (forward:
    key tile, K/V slots, O through TMA; backward: dK/dV in fp32, added to, through TMA) and
    :func:`report`'s fields."""
    for what, fn, args, kwargs in gluon_launches(family):
        row = report(fn, args, kwargs)
        c = row["constexprs"]
        named = dict(zip([p.name for p in fn.params], args, strict=False))
        if family == "gluon_fwd":
            what |= {"block_n": c["BLOCK_N"], "num_buffers": c["NUM_BUFFERS"],
                     "o_tma": named["o_desc"] is not None}  # fmt: skip
        else:
            what |= {"dkdv_fp32": named["dk_ptr"].dtype == torch.float32,
                     "add_dkdv": c["ADD_DKDV"], "dkdv_tma": c["DKDV_TMA"]}  # fmt: skip
        yield {"family": family, **what, **row}


def triton_rows(head_dims, forms, variants, shared_memory) -> Iterator[dict]:
    """The Triton family's rows, a binary listed once per head dim and form (the first variant
    that compiled to it)."""
    seen = set()
    for d in head_dims:
        for form in forms:
            for variant in variants:
                for fn, args, kwargs in triton_launches(d, form, variant, shared_memory):
                    if fn.is_gluon():
                        continue
                    row = report(fn, args, kwargs)
                    key = (d, form, row["kernel"], row["sass_sha256"])
                    if key not in seen:
                        seen.add(key)
                        yield {"family": "triton", "head_dim": d, "form": form,
                               "variant": variant, **row}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Output


def _tiles(row: dict) -> str:
    """``64x64/2`` from a Triton kernel's BLOCK_M/BLOCK_N/NUM_STAGES constexprs (both passes'
    shapes for the fused backward); empty for kernels without a pipelined loop."""
    c = row["constexprs"]
    shapes = []
    for prefix, stages in (("", "NUM_STAGES"), ("KV_", "KV_STAGES"), ("Q_", "Q_STAGES")):
        if f"{prefix}BLOCK_M" in c and stages in c:
            shapes.append(f"{c[prefix + 'BLOCK_M']}x{c[prefix + 'BLOCK_N']}/{c[stages]}")
    return ", ".join(shapes)


def markdown(rows: list[dict]) -> str:
    """A table of ``rows``: the variant's columns (they differ per family), then the cubin's."""
    head = [
        "family",
        "variant",
        "kernel",
        "tiles",
        "warps",
        "regs",
        "spill bytes",
        "smem KB",
        "programs/SM",
        "HGMMA",
        "HMMA",
        "MUFU.EX2",
        "MUFU.RCP",
        "UTMALDG",
        "UTMASTG",
        "LDG",
        "STG",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    skip = {"family", "kernel", "constexprs", "setmaxnreg", "sass_sha256", "warps", "registers",
            "spill_bytes", "shared_kb", "blocks_per_sm", *OPCODES}  # fmt: skip
    for r in rows:
        variant = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        cells = [
            r["family"],
            variant,
            r["kernel"],
            _tiles(r),
            r["warps"],
            r["registers"],
            r["spill_bytes"],
            f"{r['shared_kb']:.0f}",
            r["blocks_per_sm"],
            r["HGMMA"],
            r["HMMA"],
            r["MUFU.EX2"],
            r["MUFU.RCP"],
            r["UTMALDG"],
            r["UTMASTG"],
            r["LDG"],
            r["STG"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=(*FAMILIES, "all"), default="triton")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout, no files")
    parser.add_argument("--head-dims", default="64,128,256", help="the Triton family's")
    parser.add_argument("--forms", default="full,causal,causal-C1,noncausal-C2")
    parser.add_argument(
        "--variants",
        default="shipped;8-warp backward",
        help=f"the Triton family's, ';'-separated, of {list(TRITON_VARIANTS)}",
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability (Triton: 80-90)")
    parser.add_argument(
        "--shared-memory-kb",
        type=int,
        default=None,
        help="the GPU's shared memory per block, for the launchers' tile choice (default: Hopper)",
    )
    parser.add_argument("--out", default="benchmarks/results/sass_report")
    args = parser.parse_args()
    global TARGET
    TARGET = GPUTarget("cuda", args.arch, 32)
    families = FAMILIES if args.family == "all" else (args.family,)
    if args.arch != 90 and set(families) - {"triton"}:
        parser.error("the Gluon kernels compile for sm_90 only")
    shared = None if args.shared_memory_kb is None else args.shared_memory_kb * 1024
    rows = []
    start = time.time()
    for family in families:
        if family == "triton":
            head_dims = [int(x) for x in args.head_dims.split(",")]
            variants = [v.strip() for v in args.variants.split(";")]
            produced = triton_rows(head_dims, args.forms.split(","), variants, shared)
        else:
            produced = gluon_rows(family)
        for row in produced:
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{time.time() - start:6.0f} s  {row['kernel']} regs {row['registers']} "
                      f"spill {row['spill_bytes']} HGMMA {row['HGMMA']}", flush=True)  # fmt: skip
    if args.json:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"triton": triton.__version__, "target": f"sm_{args.arch}",
            "shared_memory_kb": args.shared_memory_kb, "date": time.strftime("%F %T")}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(
        f"# SASS report (Triton {meta['triton']}, {meta['target']}, compiled offline, "
        f"{meta['date']})\n\n`python benchmarks/sass_report.py {' '.join(sys.argv[1:])}`\n\n"
        + markdown(rows)
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
