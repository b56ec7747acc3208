"""Compile the FlashMask kernels for Hopper (sm_90) without a GPU and report what the SASS holds.

For each kernel launch that a forward + backward makes (mask preparation, forward, backward), the
script captures the launch arguments from the real launchers (``flashmask.kernels.forward`` /
``backward``; nothing runs), compiles the kernel for ``sm_90`` with Triton's bundled ``ptxas``,
and reads the cubin with the bundled ``cuobjdump``: registers per thread, local-memory (spill)
bytes and instructions, shared memory, and instruction counts — ``HGMMA`` (Hopper warpgroup
matrix multiply; the dot products must compile to it), ``HMMA`` (the older per-warp MMA, which
should not appear), ``MUFU.EX2`` (exp2), global loads (``LDG``) and asynchronous copies
(``LDGSTS``). Counts are static (instructions in the binary, not executed ones).

Usage: ``PYTHONPATH=src python benchmarks/sass_report.py [--head-dims 64,128,256] [--out PATH]``
(writes ``PATH.json`` and ``PATH.md``; a few minutes on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, never interpret

import torch
import triton
from cubin import inspect_cubin
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from flashmask import kernels
from flashmask.kernels import mask_prep, tensors
from flashmask.kernels.triton_kernels import backward as attention_bwd
from flashmask.kernels.triton_kernels import forward as attention_fwd

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
OPCODES = (
    "HGMMA", "HMMA", "MUFU.EX2", "UTMALDG", "LDGSTS", "LDG", "STG", "LDS", "STS", "LDL", "STL",
    "BAR.SYNC",
)  # fmt: skip
KERNELS = {
    attention_fwd: ["flashmask_fwd_kernel"],
    attention_bwd: [
        "flashmask_bwd_fused_kernel",
        "flashmask_bwd_dkdv_kernel",
        "flashmask_bwd_dq_kernel",
        "flashmask_bwd_delta_kernel",
    ],
    mask_prep: ["summarize_kernel", "tile_list_kernel"],
}


class Capture:
    """Replaces the kernels' ``run`` so that launching records ``(kernel, args, kwargs)``."""

    def __init__(self) -> None:
        self.launches: list[tuple[object, tuple, dict]] = []
        self._saved: list[tuple[object, object]] = []

    def __enter__(self) -> Capture:
        for module, names in KERNELS.items():
            for name in names:
                fn = getattr(module, name)
                self._saved.append((fn, fn.__dict__.get("run")))

                def run(*args, grid, warmup, _fn=fn, **kwargs):
                    self.launches.append((_fn, args, kwargs))

                fn.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        for fn, saved in self._saved:
            if saved is None:
                del fn.run
            else:
                fn.run = saved


def _specialise(fn, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """The ASTSource and options Triton's launcher would build for these arguments (pointers
    16-byte aligned, integers divisible by 16 marked so, integers equal to 1 folded)."""
    names = [p.name for p in fn.params]
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        folded_one = isinstance(v, int) and not isinstance(v, bool) and v == 1
        if p.is_constexpr or v is None or folded_one:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, TensorDescriptor):
            signature[p.name] = mangle_type(v)  # "tensordesc<bf16[1, 64, 1, 128]>"
        elif isinstance(v, torch.Tensor):
            signature[p.name] = POINTER_TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v).__name__}")
    return ASTSource(fn, signature, constexprs, attrs), options


# Per-SM resources by compute capability: (shared memory per SM in bytes, 32-bit registers).
SM_RESOURCES = {80: (164 * 1024, 65536), 86: (100 * 1024, 65536), 89: (100 * 1024, 65536),
                90: (228 * 1024, 65536)}  # fmt: skip
MAX_WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64}


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


def inspect_launch(fn, args: tuple, kwargs: dict) -> dict:
    """Compile one captured launch for ``TARGET`` and summarise its cubin."""
    backend = make_backend(TARGET)
    src, opts = _specialise(fn, args, kwargs)
    options = backend.parse_options(opts)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    dump = inspect_cubin(compiled, OPCODES)
    registers = dump["registers"]
    return {
        "kernel": fn.__name__,
        "num_warps": options.num_warps,
        "registers": registers,
        "blocks_per_sm": blocks_per_sm(
            TARGET.arch, registers, options.num_warps, compiled.metadata.shared
        ),
        "local_bytes": dump["local_bytes"],
        "shared_bytes": compiled.metadata.shared,
        "constexprs": {
            fn.params[k[0]].name: v
            for k, v in src.constants.items()
            if fn.params[k[0]].name.isupper()
        },
        **{op: dump[op] for op in OPCODES},
    }


def launches(
    head_dim: int, form: str, variant: str, shared_memory: int | None = None
) -> list[tuple[object, tuple, dict]]:
    """The kernel launches of one forward + backward (bench shapes: 8K x 4, 2048 / D heads)."""
    b, s = 4, 8192
    h = 2048 // head_dim
    q = torch.empty(b, s, h, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(b, h, s, dtype=torch.float32)
    causal = form in ("causal", "causal-C1")
    sri = None
    if form.endswith("C1"):
        sri = torch.zeros(b, 1, s, 1, dtype=torch.int32)
    elif form.endswith("C2"):
        sri = torch.zeros(b, 1, s, 2, dtype=torch.int32)
    cfg = kernels.tile_config(head_dim, has_mask=sri is not None, shared_memory=shared_memory)
    cfg = {
        "shipped": cfg,
        "masked loads": replace(cfg, even_fast_path=False),
        "two launches": replace(cfg, fused_backward=False),
        "two launches, masked loads": replace(cfg, fused_backward=False, even_fast_path=False),
        # Not shipped: does doubling the backward's warps take the dK/dV pass off its register
        # cap (fewer accumulator registers per thread)?
        "8-warp backward": replace(cfg, bwd_warps=8, dq_warps=8),
        "pointer forward": replace(cfg, fwd_tma=False),
        # dQ added inside the dK/dV pass (five matmuls per tile instead of seven), per element
        # or by TMA reduce-add, at the shipped and at two-warpgroup tile shapes.
        "dQ pass TMA": replace(cfg, dq_tma=True),
        "dQ pass TMA, two launches": replace(cfg, dq_tma=True, fused_backward=False),
        "atomic dQ (element)": replace(cfg, atomic_dq=True, atomic_dq_tma=False),
        "atomic dQ (TMA)": replace(cfg, atomic_dq=True),
        "atomic dQ (TMA) 64x128/8w": replace(cfg, atomic_dq=True, bwd_n=128, bwd_warps=8),
        "atomic dQ (TMA) 128x64/8w": replace(cfg, atomic_dq=True, bwd_m=128, bwd_warps=8),
        "atomic dQ (TMA) 64x64/8w": replace(cfg, atomic_dq=True, bwd_warps=8),
        "atomic dQ (TMA) 32x64/4w": replace(cfg, atomic_dq=True, bwd_m=32),
        "atomic dQ (TMA) 32x128/4w": replace(cfg, atomic_dq=True, bwd_m=32, bwd_n=128),
        # hd256 one-grid candidates (tune.py --set dq): the dQ pass at 8 warps, with the dK/dV
        # pass at 64x64 or 32x64; and the dQ pass at 32x64 / 4 warps (two programs per SM).
        "one grid, dK/dV 32x64/8w": replace(cfg, bwd_m=32, bwd_warps=8, dq_warps=8),
        "dQ 32x64/4w": replace(cfg, dq_m=32),
    }[variant]
    deterministic = not cfg.atomic_dq
    # The launchers' TMA check looks at the device (these are CPU tensors): compile as if on Hopper.
    tensors.tma_usable = lambda tensors: True
    # Every variant's own preparation launches (the launchers keep no-mask lists between calls).
    kernels.clear_prepared()
    with Capture() as cap:
        kernels.forward(q, q, q, sri, causal, head_dim**-0.5, config=cfg)
        kernels.backward(
            q, None, q, q, q, q, lse, sri, causal, head_dim**-0.5, deterministic, config=cfg
        )
    return cap.launches


def _tiles(row: dict) -> str:
    """``64x64/2`` from a kernel's BLOCK_M/BLOCK_N/NUM_STAGES constexprs (both passes' shapes for
    the fused backward); empty for kernels without a pipelined loop."""
    c = row["constexprs"]
    shapes = []
    for prefix, stages in (("", "NUM_STAGES"), ("KV_", "KV_STAGES"), ("Q_", "Q_STAGES")):
        if f"{prefix}BLOCK_M" in c and stages in c:
            shapes.append(f"{c[prefix + 'BLOCK_M']}x{c[prefix + 'BLOCK_N']}/{c[stages]}")
    return ", ".join(shapes)


def markdown(rows: list[dict]) -> str:
    head = (
        "| D | mask form | variant | kernel | tiles (M x N / stages) | warps | regs | spill bytes "
        "| LDL/STL | smem KB | programs/SM | HGMMA | HMMA | MUFU.EX2 | UTMALDG | LDGSTS | LDG |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['head_dim']} | {r['form']} | {r['variant']} | {r['kernel']} | {_tiles(r)} "
            f"| {r['num_warps']} | {r['registers']} | {r['local_bytes']} | {r['LDL']}/{r['STL']} "
            f"| {r['shared_bytes'] / 1024:.0f} | {r['blocks_per_sm']} | {r['HGMMA']} "
            f"| {r['HMMA']} | {r['MUFU.EX2']} | {r.get('UTMALDG', '—')} "
            f"| {r['LDGSTS']} | {r['LDG']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--forms", default="full,causal,causal-C1,noncausal-C2")
    parser.add_argument(
        "--variants",
        default="shipped;masked loads;two launches;two launches, masked loads;8-warp backward",
        help="';'-separated",
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 86, 90")
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
    shared = None if args.shared_memory_kb is None else args.shared_memory_kb * 1024
    variants = [v.strip() for v in args.variants.split(";")]
    rows, seen = [], set()
    start = time.time()
    for d in (int(x) for x in args.head_dims.split(",")):
        for form in args.forms.split(","):
            for variant in variants:
                for fn, fargs, fkwargs in launches(d, form, variant, shared):
                    info = inspect_launch(fn, fargs, fkwargs)
                    key = (d, form, json.dumps(info, sort_keys=True))
                    if key in seen:  # the same binary as an earlier variant's: listed once
                        continue
                    seen.add(key)
                    rows.append({"head_dim": d, "form": form, "variant": variant, **info})
                    print(
                        f"{time.time() - start:6.0f} s  D={d} {form} {variant}: {info['kernel']} "
                        f"regs {info['registers']} spill {info['local_bytes']} "
                        f"HGMMA {info['HGMMA']}",
                        flush=True,
                    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "triton": triton.__version__,
        "target": f"sm_{args.arch}",
        "shared_memory_kb": args.shared_memory_kb,
        "date": time.strftime("%F %T"),
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(
        f"# SASS report (Triton {meta['triton']}, {meta['target']}, compiled offline, "
        f"{meta['date']})\n\n`python benchmarks/sass_report.py {' '.join(sys.argv[1:])}`\n\n"
        + markdown(rows)
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
