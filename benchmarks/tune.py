"""Time the FlashMask kernels under several tile configurations (one GPU call, many variants).

Prints forward, backward (deterministic and atomic dQ) and mask-preparation milliseconds and
mask-aware TFLOP/s per (mask, config), so a tile choice is a measured decision.
Usage: ``PYTHONPATH=src python benchmarks/tune.py --seqlen 8192 --head-dim 128``
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch
import triton

from flashmask import kernels, masks
from flashmask.bench import visible_pairs
from flashmask.kernels import TileConfig


def configs(head_dim: int) -> dict[str, TileConfig]:
    base = kernels.tile_config(head_dim)
    out = {"default": base}
    if head_dim <= 128:
        out["fwd64x64s4"] = replace(base, fwd_stages=4)
        out["fwd128x64w8"] = replace(base, fwd_m=128, fwd_warps=8)
        out["bwd64x64s3"] = replace(base, bwd_stages=3)
        out["bwd64x64w8"] = replace(base, bwd_warps=8)
        out["bwd64x128w8"] = replace(base, bwd_n=128, bwd_warps=8)
        out["dq64x64s3"] = replace(base, dq_stages=3)
        out["dq128x64w8"] = replace(base, dq_m=128, dq_warps=8)
        out["dq64x128w8"] = replace(base, dq_n=128, dq_warps=8)
    else:
        out["fwd64x32"] = replace(base, fwd_m=64, fwd_n=32, fwd_warps=4, fwd_stages=2)
        out["fwd128x64"] = replace(base, fwd_m=128, fwd_n=64, fwd_warps=8, fwd_stages=2)
        out["bwd32x64"] = replace(base, bwd_m=32, bwd_n=64, bwd_warps=4, bwd_stages=1)
        out["bwd64x64w4s2"] = replace(base, bwd_warps=4, bwd_stages=2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument(
        "--masks", default="full,causal,causal_document,sliding_window,share_question"
    )
    args = parser.parse_args()
    s, d = args.seqlen, args.head_dim
    b, h = max(1, args.tokens // s), max(1, args.hidden // d)
    dev = torch.device("cuda")
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    scale = d**-0.5
    rows = []
    for name in args.masks.split(","):
        if name in ("full", "causal"):
            sri, causal, m = None, name == "causal", None
        else:
            m = masks.example(
                name, s, batch_size=b, num_heads=h if name == "random_eviction" else 1
            )
            sri, causal = m.startend_row_indices.to(dev), m.causal
        pairs = (
            int(visible_pairs(m, causal, s, s).sum())
            * (h // (m.num_heads if m else 1))
            * (b if m is None else 1)
        )
        flop = 4.0 * d * pairs
        for cname, cfg in configs(d).items():
            try:
                row = time_config(q, k, v, do, sri, causal, scale, cfg, b, s, flop)
            except Exception as exc:  # a config that does not fit (shared memory) is reported
                print(f"{name:18s} {cname:14s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            row.update(mask=name, config=cname)
            rows.append(row)
            print(
                f"{name:18s} {cname:14s} fwd {row['fwd_ms']:7.3f} ms "
                f"({row['fwd_tflops']:4.0f} TF/s)"
                f"  bwd det {row['bwd_det_ms']:7.3f} atomic {row['bwd_atomic_ms']:7.3f}"
                f"  total det {row['total_det_tflops']:4.0f} "
                f"atomic {row['total_atomic_tflops']:4.0f}"
                f" TF/s  prep {row['prep_ms']:.3f} ms",
                flush=True,
            )
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, f"tune_S{s}_D{d}.json"), "w") as f:
        json.dump(rows, f, indent=1)


def time_config(q, k, v, do, sri, causal, scale, cfg, b, s, flop) -> dict:
    """Forward, both backward paths and the (Triton) mask preparation of one tile config."""
    out, lse = kernels.forward(q, k, v, sri, causal, scale, config=cfg)
    fwd = triton.testing.do_bench(
        lambda: kernels.forward(q, k, v, sri, causal, scale, config=cfg), return_mode="median"
    )
    bwd = {}
    for det in (True, False):
        c = replace(cfg, atomic_dq=not det)
        bwd[det] = triton.testing.do_bench(
            lambda: kernels.backward(
                do, None, q, k, v, out, lse, sri, causal, scale, det, config=c
            ),
            return_mode="median",
        )
    shapes = [(cfg.fwd_m, cfg.fwd_n, True), (cfg.bwd_m, cfg.bwd_n, False)]
    prep_ms = triton.testing.do_bench(
        lambda: kernels.prepare(sri, causal, s, s, b, q.device, shapes), return_mode="median"
    )
    return dict(
        fwd_ms=fwd,
        bwd_det_ms=bwd[True],
        bwd_atomic_ms=bwd[False],
        prep_ms=prep_ms,
        fwd_tflops=flop / fwd / 1e9,
        total_det_tflops=3.5 * flop / (fwd + bwd[True]) / 1e9,
        total_atomic_tflops=3.5 * flop / (fwd + bwd[False]) / 1e9,
    )


if __name__ == "__main__":
    main()
