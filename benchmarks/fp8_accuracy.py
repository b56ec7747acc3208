"""FP8 attention's error on FlashAttention-3's outlier inputs, against exact attention on the
original (unquantised) inputs.

The inputs of FlashAttention-3's accuracy check: q, k, v drawn from N(0, 1) with a fraction of
their entries (0.1%) drawn from N(0, 10) instead. Each row of the table quantises them with
``flashmask.quantize_fp8`` (per tensor or per batch and head), optionally rotating q and k first
(``flashmask.hadamard_rotate``, FlashAttention-3's "incoherent processing"), and runs
``flashmask.fp8.emulate_fp8_forward`` (P rounded to e4m3 before ``P V``: on an H100 the CuTe FP8
kernel's RMSE equalled it, ``benchmarks/results/fp8_2026-12-06.md``); the bf16 row rounds the
inputs to bf16 and computes in float32. Outputs are fp16, as FlashAttention-3's; the RMSE is
over every output element against float64 attention on the original inputs. CPU only.

    PYTHONPATH=src python benchmarks/fp8_accuracy.py --out fp8_accuracy

writes ``PREFIX.json`` and ``PREFIX.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def outlier_inputs(
    batch: int, seqlen: int, heads: int, head_dim: int, fraction: float, std: float, seed: int
):
    """``(q, k, v)`` float64 ``[B, S, H, D]``: N(0, 1) entries, a ``fraction`` of them N(0, std)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw():
        x = torch.randn(batch, seqlen, heads, head_dim, generator=gen, dtype=torch.float64)
        outliers = torch.rand(x.shape, generator=gen, dtype=torch.float64) < fraction
        return torch.where(outliers, std * x, x)

    return draw(), draw(), draw()


def measure(args: argparse.Namespace) -> list[dict]:
    """One row per method: its name and output RMSE against exact attention."""
    import torch

    from flashmask import fp8, hadamard_rotate, quantize_fp8
    from flashmask.reference import reference_forward

    q, k, v = outlier_inputs(
        args.batch, args.seqlen, args.heads, args.head_dim, args.fraction, args.std, args.seed
    )
    scale = args.head_dim**-0.5
    exact, _ = reference_forward(q, k, v, None, args.causal, scale)

    def rmse(out: torch.Tensor) -> float:
        return (out.double() - exact).pow(2).mean().sqrt().item()

    low = [x.to(torch.bfloat16).float() for x in (q, k, v)]
    bf16, _ = reference_forward(*low, None, args.causal, scale)
    rows = [{"method": "bf16 inputs, float32 compute", "rmse": rmse(bf16.to(torch.float16))}]
    rotated = {False: (q, k), True: (hadamard_rotate(q), hadamard_rotate(k))}
    for granularity in ("tensor", "head"):
        for rotate, (qr, kr) in rotated.items():
            (q8, qd), (k8, kd), (v8, vd) = (
                quantize_fp8(x.float(), granularity=granularity) for x in (qr, kr, v)
            )
            out, _ = fp8.emulate_fp8_forward(
                q8, k8, v8, causal=args.causal, softmax_scale=scale, q_descale=qd,
                k_descale=kd, v_descale=vd, out_dtype=torch.float16,
            )  # fmt: skip
            method = f"FP8, per {granularity}" + (", q and k rotated" if rotate else "")
            rows.append({"method": method, "rmse": rmse(out)})
    return rows


def render(rows: list[dict], args: argparse.Namespace) -> str:
    """The Markdown table of :func:`measure`'s rows, with the inputs it measured."""
    lines = [
        f"B = {args.batch}, S = {args.seqlen}, {args.heads} heads of {args.head_dim}, "
        f"{'causal' if args.causal else 'full'} attention, {args.fraction:g} of the entries "
        f"N(0, {args.std:g}), seed {args.seed}.",
        "",
        "| method | output RMSE |",
        "|---|---|",
    ]
    lines += [f"| {r['method']} | {r['rmse']:.3g} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=1e-3, help="share of outlier entries")
    parser.add_argument("--std", type=float, default=10.0, help="the outliers' std")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fp8_accuracy", help="output path prefix")
    args = parser.parse_args(argv)
    rows = measure(args)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    Path(f"{args.out}.md").write_text(render(rows, args))
    print(render(rows, args))


if __name__ == "__main__":
    main()
