"""Forward loads through TMA against pointer loads on one GPU: bitwise equality and time.

For each head dim, mask and tile shape, the forward runs with pointer loads, with 4-D TMA
descriptors over ``[B, S, H, D]`` and with 2-D descriptors over ``[B * S, H * D]``
(``TileConfig.fwd_tma`` / ``fwd_tma_flat``); the TMA outputs and lse must equal the pointer
ones bit for bit (the loaded values are the same, so is the arithmetic). 4-D descriptors are
skipped at square tiles (``BLOCK_N == D``), which Triton 3.6 miscompiles (``benchmarks/NOTES.md``,
change 9); whether the 2-D ones compile right there is what this checks.

Usage: ``PYTHONPATH=src python benchmarks/tma_check.py [--seqlen 8192] [--head-dims 64,128]``;
prints one line per case and writes ``$OUT/tma_check_S{seqlen}_D{head dims}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
import triton

from flashmask import bench, kernels, masks
from flashmask.kernels import tensors

# (BLOCK_M, BLOCK_N, warps, stages) per head dim: the shipped shapes and the square ones.
SHAPES = {64: [(128, 64, 8, 3), (64, 64, 4, 3)], 128: [(128, 128, 8, 2), (64, 64, 4, 3)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--masks", default="full,causal,causal_document")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rep-ms", type=int, default=40)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows, start = [], time.time()
    for d in (int(x) for x in args.head_dims.split(",")):
        s, b, h = args.seqlen, max(1, args.tokens // args.seqlen), args.hidden // d
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for name in args.masks.split(","):
            if name in ("full", "causal"):
                sri, causal = None, name == "causal"
            else:
                m = masks.example(name, s, batch_size=b, generator=torch.Generator().manual_seed(0))
                sri, causal = m.startend_row_indices.to(dev), m.causal
            mask = None if sri is None else m
            pairs = bench.visible_pairs(None if mask is None else mask.to("cpu"), causal, s, s)
            flop = 4.0 * d * int(pairs.sum()) * h * (b // pairs.shape[0])
            for bm, bn, w, st in SHAPES[d]:
                base = replace(
                    kernels.tile_config(d, has_mask=sri is not None),
                    fwd_m=bm, fwd_n=bn, fwd_warps=w, fwd_stages=st,
                    fwd_gluon=False,  # the Triton forward's loads are what is compared
                )  # fmt: skip
                variants = {
                    "pointers": replace(base, fwd_tma=False),
                    "tma 4-D": replace(base, fwd_tma=True, fwd_tma_flat=False),
                    "tma 2-D": replace(base, fwd_tma=True, fwd_tma_flat=True),
                }
                ref = None
                if not tensors.tma_tiles_safe(bm, bn, d):
                    del variants["tma 4-D"]  # square tiles: the launcher keeps pointer loads
                for label, cfg in variants.items():
                    out, lse = kernels.forward(q, k, v, sri, causal, d**-0.5, config=cfg)
                    ms = triton.testing.do_bench(
                        lambda c=cfg: kernels.forward(q, k, v, sri, causal, d**-0.5, config=c),
                        rep=args.rep_ms,
                    )
                    if ref is None:
                        ref = (out, lse)
                    exact = bool(torch.equal(out, ref[0]) and torch.equal(lse, ref[1]))
                    err = float((out.float() - ref[0].float()).abs().max())
                    row = {
                        "head_dim": d, "mask": name, "tiles": f"{bm}x{bn}/{w}w/{st}s",
                        "loads": label, "ms": ms, "tflops": flop / ms / 1e9,
                        "bitwise_equal_to_pointers": exact, "max_abs_diff": err,
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"{time.time() - start:5.0f}s D={d} {name:16s} {row['tiles']:14s} "
                        f"{label:9s} {ms:7.3f} ms {row['tflops']:5.0f} TF/s exact={exact} "
                        f"diff={err:.2e}",
                        flush=True,
                    )
    name = f"tma_check_S{args.seqlen}_D{args.head_dims.replace(',', '-')}.json"
    path = os.path.join(os.environ.get("OUT", "."), name)
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "date": time.strftime("%F %T"), "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
