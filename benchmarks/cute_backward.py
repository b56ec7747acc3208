"""The CuTe backward beside the Gluon backward and FlashMask-4, on one Hopper GPU.

For the 12 masks of ``flashmask.masks.example`` at head dim 128 (bf16, B x S = 32K tokens, 16
heads) it times the backward kernels alone on the same inputs: ``cute``
(``kernels.cute_kernels.backward_launch``) and ``gluon`` (``gluon_kernels.backward``), each
given the forward's lse, the row terms, the mask's lists and launch order prepared once (as the
cache serves them to every layer), each zeroing its own dQ accumulator. ``fm4`` (FlashMask-4,
when ``fm4_torch`` imports) is timed forward and forward + backward through autograd; its
backward is the difference. TFLOP/s count visible pairs only (``flashmask.bench.visible_flop``,
2.5x the forward's for a backward); times are medians of ``flashmask.bench``'s timer (L2
flushed). Every cell records the largest |difference| of CuTe's dq, dk, dv from Gluon's.

    PYTHONPATH=src python benchmarks/cute_backward.py --out cute_backward
    python benchmarks/cute_backward.py --render cute_backward.json   # the table again

writes ``PREFIX.json`` and ``PREFIX.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Run as a script, this file's folder is on sys.path, and its tests put it there.
from cute_forward import comparison_columns

SEQLENS = (8192, 32768)
TOKENS, HEADS, HEAD_DIM = 32768, 16, 128
BACKWARD_FLOP = 2.5  # a backward's matmul work over its forward's


def measure(seqlens: list[int]) -> tuple[dict, list[dict]]:
    import torch

    from flashmask import masks
    from flashmask.bench import _bench, flashmask4, visible_flop
    from flashmask.kernels import forward_launcher, preparation
    from flashmask.kernels.backward_launcher import backward_delta
    from flashmask.kernels.cute_kernels import backward_launch
    from flashmask.kernels.gluon_kernels import backward as gluon_backward
    from flashmask.mask import FlashMask

    device = torch.device("cuda")
    fm4 = flashmask4()
    d, heads = HEAD_DIM, HEADS
    cells = []
    for s in seqlens:
        b = TOKENS // s
        for name in masks.MASK_TYPES:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16)
            k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
            sri, causal = None, name == "causal"
            if name not in ("full", "causal"):
                mask = masks.example(
                    name, s, batch_size=b, num_heads=heads if name == "random_eviction" else 1,
                    generator=gen,
                ).to(device)  # fmt: skip
                sri, causal = mask.startend_row_indices, mask.causal
            flop = visible_flop(
                FlashMask(sri, causal) if sri is not None else None, causal, s, d, heads, b
            )
            scale = d**-0.5
            out, lse = forward_launcher.forward(q, k, v, sri, causal, scale)
            delta = backward_delta(out, dout, None)
            bounds, (lists,) = preparation.prepare_cached(
                sri, causal, s, s, b, device, [(64, 128, False)]
            )
            order = None if sri is None else preparation.program_order(lists, heads, False)
            hm = 1 if sri is None else sri.shape[1]
            args = (dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale)
            calls = {
                "cute": lambda args=args, order=order: backward_launch.backward(*args, order=order),
                "gluon": lambda args=args, order=order: gluon_backward.backward(*args, order=order),
            }
            cell: dict = {"d": d, "s": s, "b": b, "mask": name}
            for impl, fn in calls.items():
                try:
                    ms = _bench(fn, 200)
                    cell[impl] = {"ms": ms, "tflops": BACKWARD_FLOP * flop / ms / 1e9}
                except Exception as exc:  # a failing kernel costs only its cell
                    cell[impl] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if fm4 is not None:
                try:
                    cell["fm4"] = _fm4_backward(fm4, q, k, v, dout, sri, causal, flop)
                except Exception as exc:
                    cell["fm4"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            try:
                ours = calls["cute"]()
                theirs = calls["gluon"]()
                cell["max_diff"] = max(
                    (a.float() - t.float()).abs().max().item()
                    for a, t in zip(ours, theirs, strict=True)
                )
            except Exception as exc:
                cell["max_diff"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    return meta, cells


def _fm4_backward(fm4, q, k, v, dout, sri, causal, flop) -> dict:
    """FlashMask-4's backward time: forward + backward through autograd minus the forward."""
    from flashmask.bench import _bench

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        return fm4(*leaves, sri, causal=causal)

    def forward_backward():
        out = fm4(*leaves, sri, causal=causal)
        out.backward(dout)

    fwd_ms = _bench(forward, 200)
    both_ms = _bench(forward_backward, 200)
    ms = both_ms - fwd_ms
    return {"ms": ms, "tflops": BACKWARD_FLOP * flop / ms / 1e9, "fwd_bwd_ms": both_ms}


def render(meta: dict, cells: list[dict]) -> str:
    """A markdown table: backward TFLOP/s of each implementation, CuTe over Gluon and fm4."""
    lines = [
        f"# CuTe backward ({meta.get('gpu', '?')}, torch {meta.get('torch', '?')})",
        "",
        f"Backward TFLOP/s (visible pairs), bf16, hd{HEAD_DIM}, {TOKENS // 1024}K tokens, "
        f"{HEADS} heads; fm4: its forward + backward minus its forward.",
        "",
        "| S | mask | cute | gluon | fm4 | cute/gluon | cute/fm4 | max diff |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    for c in cells:
        row = comparison_columns(c, ("gluon", "fm4"))
        lines.append(f"| {c['s']} | {c['mask']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="cute_backward", help="prefix of the .json and .md")
    parser.add_argument("--seqlens", default="8192,32768", help="comma-separated")
    parser.add_argument("--render", type=Path, help="only render an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        print(render(data["meta"], data["cells"]), end="")
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the CuTe backward needs a Hopper GPU (--render works anywhere)")
    meta, cells = measure([int(x) for x in args.seqlens.split(",")])
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(render(meta, cells))
    print(render(meta, cells), end="")


if __name__ == "__main__":
    main()
