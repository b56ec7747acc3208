"""Profile one FlashMask attention call (forward + backward) on a CUDA GPU.

``--fp8`` profiles the FP8 forward instead (forward only: the inputs quantised once with
``flashmask.quantize_fp8``, per head, so that the table shows the call's own kernels, the V^T
pre-pass among them). ``--impl fm4`` profiles FlashMask-4's call on the same inputs instead
(``fm4_torch``, as ``flashmask bench``'s fm4 column imports it), so that its kernels' times sit
beside ours kernel by kernel: its block-list builder, forward, backward pre- and postprocessing
and backward against our preparation, forward, row terms, backward and dQ conversion.

Warms the call up (compiles its kernels), then runs it ``--repeats`` times under
``torch.profiler`` and prints the GPU time per kernel (``--trace PATH`` also writes a Chrome
trace for Perfetto or chrome://tracing). ``--ncu`` prints instead the Nsight Compute command
that profiles the kernels of one warmed-up call (marked by the NVTX range ``flashmask``) and
runs nothing.

Inputs as ``flashmask bench``'s: bf16, ``--hidden / --head-dim`` heads, batch x seqlen =
``--tokens``, a bench mask by name (``flashmask.masks.example``; full and causal without a
mask). Run from the repository root::

    PYTHONPATH=src python benchmarks/profile_call.py --mask causal_document --seqlen 8192
    PYTHONPATH=src python benchmarks/profile_call.py --mask full --seqlen 32768 --ncu
    PYTHONPATH=src python benchmarks/profile_call.py --mask causal --seqlen 8192 --impl fm4
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from flashmask import flashmask_attention, masks, quantize_fp8
from flashmask.mask import FlashMask

NVTX_RANGE = "flashmask"
# The attention kernels (Triton: flashmask_*; Gluon: gluon_*; CuTe DSL: kernel_cutlass_kernel_
# and our module's path) and the mask preparation's. FlashMask-4's call is profiled whole (its
# NVTX range holds only its own kernels).
NCU_KERNELS = (
    "regex:flashmask_|gluon_|kernel_cutlass_kernel_flashmask|summarize_kernel|tile_list_kernel"
    "|program_order_kernel"
)
IMPLS = ("flashmask", "fm4")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask", default="causal_document", help="a flashmask bench mask name")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32768, help="batch x seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head dim")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: all)")
    p.add_argument("--deterministic", action="store_true", help="the bit-reproducible backward")
    p.add_argument(
        "--impl", choices=IMPLS, default="flashmask",
        help="whose call: flashmask's, or FlashMask-4's through fm4_torch (flashmask)",
    )  # fmt: skip
    p.add_argument("--fp8", action="store_true", help="the FP8 (e4m3) forward alone")
    p.add_argument(
        "--prepare-each-call",
        action="store_true",
        help="a fresh mask tensor per call, so that every call prepares its mask (as the bench "
        "times it); default: the mask is prepared once and reused, as in a model's later layers",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=20, help="kernels listed")
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--ncu", action="store_true", help="print the Nsight Compute command")
    p.add_argument("--under-ncu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mask not in (*masks.MASK_TYPES, "hash_sparse"):
        p.error(f"--mask must be one of {', '.join(masks.MASK_TYPES)}, hash_sparse")
    if args.hidden % args.head_dim or args.seqlen < 1:
        p.error("--hidden must be a multiple of --head-dim and --seqlen positive")
    if args.impl == "fm4" and (args.fp8 or args.deterministic or args.kv_heads):
        p.error("--impl fm4 times FlashMask-4's bf16 call: no --fp8, --deterministic, --kv-heads")
    return args


def ncu_command(args: argparse.Namespace, argv: list[str]) -> str:
    """The Nsight Compute command that profiles one warmed-up call of this configuration."""
    rerun = [a for a in argv if a != "--ncu"] + ["--under-ncu"]
    kernels = ["-k", NCU_KERNELS] if args.impl == "flashmask" else []
    return shlex.join(
        ["ncu", "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/", *kernels, "--set", "full", "-o",
         f"{args.impl}_{args.mask}_{args.seqlen}", "python", "benchmarks/profile_call.py",
         *rerun]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.ncu:
        print(f"PYTHONPATH=src {ncu_command(args, argv)}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("profile_call.py needs a CUDA GPU (--ncu prints the command without one)")
    fm4_attention = None
    if args.impl == "fm4":
        from flashmask.bench import flashmask4

        fm4_attention = flashmask4()
        if fm4_attention is None:
            raise SystemExit("--impl fm4: fm4_torch and its CuTe DSL wheels are not importable")
    batch = max(1, args.tokens // args.seqlen)
    heads = args.hidden // args.head_dim
    kv_heads = args.kv_heads or heads

    def randn(h: int) -> torch.Tensor:
        return torch.randn(
            batch, args.seqlen, h, args.head_dim, device="cuda", dtype=torch.bfloat16
        )

    q, k, v = (randn(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    dout = randn(heads)
    mask, causal = None, args.mask == "causal"
    if args.mask not in ("full", "causal"):
        mask = masks.example(args.mask, args.seqlen, batch_size=batch).to("cuda")
    if args.fp8:
        (q8, q_descale), (k8, k_descale), (v8, v_descale) = (
            quantize_fp8(x.detach(), group=group)
            for x, group in ((q, heads // kv_heads), (k, 1), (v, 1))
        )
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}

    def call() -> None:
        m = mask
        if m is not None and args.prepare_each_call:
            m = FlashMask(m.startend_row_indices.clone(), m.causal)
        if args.fp8:
            flashmask_attention(q8, k8, v8, m, causal=causal, **descales)
            return
        if fm4_attention is not None:
            sri = None if m is None else m.startend_row_indices
            out = fm4_attention(q, k, v, sri, causal=causal if m is None else m.causal)
        else:
            out = flashmask_attention(q, k, v, m, causal=causal, deterministic=args.deterministic)
        torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    if args.under_ncu:
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return 0
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.repeats):
            call()
        torch.cuda.synchronize()
    kind = "fp8, forward" if args.fp8 else "bf16, forward+backward"
    print(
        f"{args.impl}: {args.mask}, B={batch} S={args.seqlen} H={heads}:{kv_heads} "
        f"D={args.head_dim}, {kind}, {args.repeats} calls:"
    )
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print("wrote", args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
