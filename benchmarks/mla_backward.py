"""The backward at multi-head latent attention's head dims (Q/K 192, V 128): the Gluon backward
(``gluon_kernels.backward_hd256``, Q and K zero-padded to 256) beside the Triton backward.

For the 12 masks of ``flashmask.masks.example`` (bf16, B x S = 32K tokens, 16 heads) it runs one
forward, then times ``kernels.backward`` with the tile configuration's ``bwd_gluon`` off and on
(``deterministic=False``, the mask prepared once and cached, as for every layer of a model),
and records the largest |difference| of the Gluon gradients from the Triton ones. TFLOP/s
count visible pairs only (``flashmask.bench.attention_flop``: ``2 (3 D + 2 Dv)`` per pair);
times are medians of ``flashmask.bench``'s timer (L2 flushed).

    PYTHONPATH=src python benchmarks/mla_backward.py --out mla_backward

writes ``PREFIX.json`` and ``PREFIX.md``. ``--device cpu`` runs the same cases on the CPU's
reference at small sizes, to test the script (its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

HEAD_DIM, HEAD_DIM_V = 192, 128


def measure(
    seqlens: list[int], names: list[str], tokens: int, heads: int, device: str
) -> list[dict]:
    """One row per (length, mask ``names``): the two backwards' median ms, TFLOP/s and the
    gradients' differences."""
    import torch

    from flashmask import kernels, masks
    from flashmask.bench import _bench, _wall_ms, attention_flop

    rows = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        for name in names:
            gen = torch.Generator().manual_seed(0)
            mask, causal = None, name == "causal"
            if name not in ("full", "causal"):
                mask_heads = heads if name == "random_eviction" else 1
                mask = masks.example(
                    name, seqlen, batch_size=batch, num_heads=mask_heads, generator=gen
                ).to(device)
                causal = mask.causal
            sri = None if mask is None else mask.startend_row_indices

            def randn(*shape):
                return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

            q = randn(batch, seqlen, heads, HEAD_DIM)
            k = randn(batch, seqlen, heads, HEAD_DIM)
            v = randn(batch, seqlen, heads, HEAD_DIM_V)
            dout = randn(batch, seqlen, heads, HEAD_DIM_V)
            scale = HEAD_DIM**-0.5
            out, lse = kernels.forward(q, k, v, sri, causal, scale)
            config = kernels.tile_config(HEAD_DIM, has_mask=sri is not None)
            row = {"seqlen": seqlen, "mask": name}
            grads = {}
            for label, gluon in (("triton", False), ("gluon", True)):
                cfg = replace(config, bwd_gluon=gluon)

                def step(cfg=cfg):
                    return kernels.backward(
                        dout, None, q, k, v, out, lse, sri, causal, scale, False, config=cfg
                    )

                grads[label] = step()
                timer = _bench(step, 100, 3) if device == "cuda" else _wall_ms(step, 1)
                row[f"{label}_ms"] = timer
            _, flop = attention_flop(mask, causal, seqlen, HEAD_DIM, heads, batch, HEAD_DIM_V)
            for label in ("triton", "gluon"):
                row[f"{label}_tflops"] = flop / row[f"{label}_ms"] / 1e9
            row["speedup"] = row["triton_ms"] / row["gluon_ms"]
            for grad, a, b in zip(("dq", "dk", "dv"), grads["triton"], grads["gluon"], strict=True):
                row[f"{grad}_diff"] = (a.float() - b.float()).abs().max().item()
            rows.append(row)
    return rows


def _length(seqlen: int) -> str:
    """``8K`` for 8192, the number itself below 1024."""
    return f"{seqlen // 1024}K" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def render(rows: list[dict]) -> str:
    """The Markdown table of :func:`measure`'s rows."""
    lines = [
        "| S | mask | Triton ms | Gluon ms | Gluon / Triton speed | Triton TFLOP/s | "
        "Gluon TFLOP/s | max diff dq / dk / dv |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diffs = " / ".join(f"{r[g + '_diff']:.3g}" for g in ("dq", "dk", "dv"))
        lines.append(
            f"| {_length(r['seqlen'])} | {r['mask']} | {r['triton_ms']:.2f} | {r['gluon_ms']:.2f} "
            f"| {r['speedup']:.2f}x | {r['triton_tflops']:.0f} | {r['gluon_tflops']:.0f} "
            f"| {diffs} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="8192,32768", help="comma-separated lengths")
    parser.add_argument("--masks", default="", help="comma-separated masks (all 12)")
    parser.add_argument("--tokens", type=int, default=32768, help="batch x seqlen")
    parser.add_argument("--heads", type=int, default=16, help="query and key/value heads")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="mla_backward", help="output path prefix")
    args = parser.parse_args(argv)
    from flashmask import masks

    names = args.masks.split(",") if args.masks else list(masks.MASK_TYPES)
    seqlens = [int(s) for s in args.seqlens.split(",")]
    rows = measure(seqlens, names, args.tokens, args.heads, args.device)
    Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1))
    Path(f"{args.out}.md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
