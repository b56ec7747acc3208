"""The CuTe forward beside the routed forward (Gluon/Triton) and FlashMask-4, on one Hopper GPU.

For the 12 masks of ``flashmask.masks.example`` (bf16, B x S = 32K tokens, heads x head dim =
2048) it times the forward of: ``cute`` (``kernels.cute_kernels``; the mask's lists and launch
order prepared once, as the cache serves them to every layer), ``routed`` (``kernels.forward``,
what ``flashmask_attention`` runs today, its preparation cached too) and ``fm4`` (FlashMask-4,
which builds its block lists in every call) when ``fm4_torch`` imports. TFLOP/s count visible
pairs only (``flashmask.bench.visible_flop``); times are medians of ``flashmask.bench``'s timer
(L2 flushed). Every cell also records the largest |difference| of the CuTe output from the
routed one.

    PYTHONPATH=src python benchmarks/cute_forward.py --out cute_forward
    python benchmarks/cute_forward.py --render cute_forward.json   # the table again

writes ``PREFIX.json`` and ``PREFIX.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CASES = ((128, (8192, 32768)), (256, (8192,)), (64, (8192,)))
TOKENS, HIDDEN = 32768, 2048


def measure(head_dims: list[int]) -> tuple[dict, list[dict]]:
    import torch

    from flashmask import masks
    from flashmask.bench import _bench, flashmask4, visible_flop
    from flashmask.kernels import forward_launcher, preparation
    from flashmask.kernels.cute_kernels import launch
    from flashmask.mask import FlashMask

    device = torch.device("cuda")
    fm4 = flashmask4()
    cells = []
    for d, seqlens in CASES:
        if d not in head_dims:
            continue
        heads = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            for name in masks.MASK_TYPES:
                gen = torch.Generator().manual_seed(0)
                q = torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16)
                k, v = torch.randn_like(q), torch.randn_like(q)
                sri, causal = None, name == "causal"
                if name not in ("full", "causal"):
                    mask = masks.example(
                        name, s, batch_size=b,
                        num_heads=heads if name == "random_eviction" else 1, generator=gen,
                    ).to(device)  # fmt: skip
                    sri, causal = mask.startend_row_indices, mask.causal
                flop = visible_flop(FlashMask(sri, causal) if sri is not None else None, causal,
                                    s, d, heads, b)  # fmt: skip
                scale = d**-0.5
                shape = (128, launch.key_tile(d), True)
                bounds, (lists,) = preparation.prepare_cached(sri, causal, s, s, b, device, [shape])
                order = None
                if sri is not None:
                    (order,) = preparation.program_orders([(lists, heads, True)])
                mask_heads = 1 if sri is None else sri.shape[1]

                def cute():
                    return launch.forward(q, k, v, bounds, lists, mask_heads, causal,
                                          not causal, scale, True, order)  # fmt: skip

                def routed():
                    return forward_launcher.forward(q, k, v, sri, causal, scale)

                calls = {"cute": cute, "routed": routed}
                if fm4 is not None:
                    calls["fm4"] = lambda: fm4(q, k, v, sri, causal=causal)
                cell: dict = {"d": d, "s": s, "b": b, "mask": name}
                for impl, fn in calls.items():
                    try:
                        ms = _bench(fn, 200)
                        cell[impl] = {"ms": ms, "tflops": flop / ms / 1e9}
                    except Exception as exc:  # a failing peer costs only its cell
                        cell[impl] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                try:
                    cell["max_diff"] = (cute()[0].float() - routed()[0].float()).abs().max().item()
                except Exception as exc:
                    cell["max_diff"] = f"{type(exc).__name__}: {exc}"[:200]
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    return meta, cells


def render(meta: dict, cells: list[dict]) -> str:
    """A markdown table: forward TFLOP/s of each implementation, CuTe over routed and fm4."""
    lines = [
        f"# CuTe forward ({meta.get('gpu', '?')}, torch {meta.get('torch', '?')})",
        "",
        "Forward TFLOP/s (visible pairs), bf16, 32K tokens, 2048 = heads x head dim.",
        "",
        "| D | S | mask | cute | routed | fm4 | cute/routed | cute/fm4 | max diff |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    def rate(cell, impl):
        return cell.get(impl, {}).get("tflops")

    for c in cells:
        cu, ro, f4 = rate(c, "cute"), rate(c, "routed"), rate(c, "fm4")
        row = [f"{x:.0f}" if x else "—" for x in (cu, ro, f4)]
        row += [f"{cu / x:.2f}" if cu and x else "—" for x in (ro, f4)]
        diff = c.get("max_diff")
        row.append(f"{diff:.3g}" if isinstance(diff, float) else "error")
        lines.append(f"| {c['d']} | {c['s']} | {c['mask']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="cute_forward", help="prefix of the .json and .md")
    parser.add_argument("--head-dims", default="128,256,64", help="comma-separated")
    parser.add_argument("--render", type=Path, help="only render an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        print(render(data["meta"], data["cells"]), end="")
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the CuTe forward needs a Hopper GPU (--render works anywhere)")
    meta, cells = measure([int(x) for x in args.head_dims.split(",")])
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(render(meta, cells))
    print(render(meta, cells), end="")


if __name__ == "__main__":
    main()
