"""One backward call to profile: FlashMask's (the Gluon kernel on Hopper at hd64/hd128) or SDPA's
(cuDNN's flash backward on the H200), for Nsight Compute to read side by side.

Usage (H200; ``gpu_session.sh ncu-backward`` runs both under ``ncu``)::

    PYTHONPATH=src ncu --clock-control none -k regex:gluon_bwd -s 1 -c 1 --section SpeedOfLight \\
        python benchmarks/profile_backward.py --impl flashmask

The first backward compiles and warms up; the second is the one to profile (``-s 1 -c 1`` on
the kernel filter). The forward call before them can be profiled the same way (``-k
regex:gluon_fwd -s 0 -c 1``; ``--gluon-fwd-o-tma`` picks its O store form, ``gpu_session.sh
ncu-forward-o-tma``). Inputs as ``flashmask bench``: bf16, 16 heads of ``--head-dim``, batch x
seqlen = 32K tokens.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cases import add_o_tma_option, apply_o_tma_option, mask_case

from flashmask import flashmask_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("flashmask", "sdpa"), default="flashmask")
    parser.add_argument(
        "--mask",
        default="full",
        help="full, causal or any flashmask bench mask (FlashMask only: SDPA takes full/causal)",
    )
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument(
        "--gluon-bwd",
        default="",
        help="gluon_bwd launch constants for the profiled call, e.g. ROW_TERMS_SMEM=1 "
        "(as gluon_backward.py --variant)",
    )
    add_o_tma_option(parser, "the forward call")
    args = parser.parse_args()
    o_tma_label = apply_o_tma_option(args.gluon_fwd_o_tma)
    if args.gluon_bwd:
        from gluon_backward import apply_gluon_bwd_option

        apply_gluon_bwd_option(parser, args.gluon_bwd)
    if not torch.cuda.is_available():
        raise SystemExit("profile_backward.py needs a CUDA GPU")
    batch, heads = max(1, args.tokens // args.seqlen), args.hidden // args.head_dim
    if args.impl == "sdpa" and args.mask not in ("full", "causal"):
        parser.error(f"--mask: SDPA's flash backward takes full or causal, got {args.mask!r}")
    mask, _, causal = mask_case(args.mask, args.seqlen, batch)
    shape = (batch, args.seqlen, heads, args.head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if args.impl == "flashmask":
        out = flashmask_attention(
            q, k, v, mask.to("cuda") if mask is not None else None, causal=causal
        )
    else:  # SDPA takes [B, H, S, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)
    for _ in range(2):  # warm-up, then the profiled call
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    options = ", ".join(filter(None, [args.gluon_bwd, o_tma_label]))
    variant = f" ({options})" if options else ""
    shape_text = f"{args.mask} S={args.seqlen} D={args.head_dim}"
    print(f"{args.impl}{variant} {shape_text}: two backward calls done")


if __name__ == "__main__":
    main()
