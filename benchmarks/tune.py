"""Sweep the tile shapes of the three FlashMask kernels on one GPU, next to FlexAttention.

The forward, the dK/dV pass and the dQ pass are tuned independently (the backward is timed with
one pass's candidate and the other pass at the default), every candidate is checked against the
default's result, each measurement is repeated in interleaved rounds (the H200's clock drifts by
~10% between back-to-back runs of the same kernel), and FlexAttention's forward and backward on
the same inputs are timed in the same run as the yardstick.

Usage: ``PYTHONPATH=src python benchmarks/tune.py --seqlen 8192 --head-dims 128``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace

import torch
import triton

from flashmask import bench, kernels, masks
from flashmask.kernels import TileConfig

# (BLOCK_M, BLOCK_N, warps, stages) candidates per pass and head dim.
FWD = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    128: [
        (64, 64, 4, 3),
        (64, 64, 4, 2),
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (64, 128, 4, 3),
    ],
    256: [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
}
DKDV = {
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (128, 128, 8, 2)],
    128: [
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 128, 8, 2),
        (64, 128, 8, 3),
        (32, 128, 4, 3),
        (32, 64, 4, 3),
        (128, 64, 8, 2),
    ],
    # (64, 32, 8, 2): the one hd256 dK/dV shape that compiles without spills for sm_90 (184
    # registers, 100 KB shared; the shipped 64x64 spills 232 bytes), found offline.
    256: [
        (64, 64, 8, 1),
        (64, 64, 4, 2),
        (32, 64, 4, 2),
        (64, 64, 8, 2),
        (32, 128, 8, 1),
        (64, 32, 8, 2),
    ],
}
DQ = {
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2)],
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3)],
    # 64x32 and 32x64 at 4 warps compile without spills (the shipped 64x64 spills 216 bytes).
    256: [(64, 64, 8, 1), (64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2), (32, 64, 4, 2)],
}


def _time_ms(fn, rep: int, return_mode: str = "median") -> float:
    """``triton.testing.do_bench`` on a GPU; one wall-clock run under the CPU interpreter."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, rep=rep, return_mode=return_mode)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _launch_set(base: TileConfig) -> list[tuple[str, str, TileConfig]]:
    """``--set launch``: whole-config variants around the default: the forward with and without
    TMA loads at several tile shapes, and the default backward as the yardstick."""
    fwd = [("fwd default", base)]
    for tma in (False, True):
        label = "tma" if tma else "pointers"
        fwd.append((f"fwd {label}", replace(base, fwd_tma=tma)))
        for m, n, w, st in ((128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)):
            cfg = _with(replace(base, fwd_tma=tma), "fwd", (m, n, w, st))
            fwd.append((f"fwd {label} {m}x{n}/{w}w/{st}s", cfg))
    return [("fwd", label, cfg) for label, cfg in fwd] + [("bwd", "bwd default", base)]


def _dq_set(base: TileConfig, head_dim: int) -> list[tuple[str, str, TileConfig]]:
    """``--set dq``: the default backward (deterministic, separate dQ pass), the same with the dQ
    pass's K/V tiles loaded through TMA (``dq_tma``), and dQ added inside the dK/dV pass
    (``atomic_dq``: five matmuls per tile instead of seven), per element or by TMA reduce-add, at
    several dK/dV tile shapes. At hd256 (where the atomic forms spill heavily offline) the
    candidates are instead one-grid backwards at 8 warps (benchmarks/NOTES.md, plan)."""
    cands = [("bwd", "bwd default", base), ("bwd", "dq pass tma", replace(base, dq_tma=True))]
    if head_dim > 128:
        one_grid = replace(base, dq_warps=8)
        cands.append(("bwd", "one grid, dq 64x64/8w", one_grid))
        cands.append(("bwd", "one grid, dq 64x64/8w, dq tma", replace(one_grid, dq_tma=True)))
        cands.append(("bwd", "one grid, dkdv 32x64/8w", replace(one_grid, bwd_m=32)))
        return cands
    atomic = replace(base, atomic_dq=True)
    cands.append(("bwd", "atomic element", replace(atomic, atomic_dq_tma=False)))
    cands.append(("bwd", "atomic tma", atomic))
    for shape in ((64, 64, 4, 3), (64, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3),
                  (128, 64, 8, 2), (64, 128, 8, 1)):  # fmt: skip
        label = "atomic tma {}x{}/{}w/{}s".format(*shape)
        cands.append(("bwd", label, _with(atomic, "dkdv", shape)))
    return cands


def _with(base: TileConfig, kind: str, shape: tuple[int, int, int, int]) -> TileConfig:
    m, n, w, s = shape
    if kind == "fwd":
        return replace(base, fwd_m=m, fwd_n=n, fwd_warps=w, fwd_stages=s)
    if kind == "dkdv":
        return replace(base, bwd_m=m, bwd_n=n, bwd_warps=w, bwd_stages=s)
    return replace(base, dq_m=m, dq_n=n, dq_warps=w, dq_stages=s)


def _inputs(name: str, s: int, b: int, h: int, d: int, dev: torch.device):
    gen = torch.Generator().manual_seed(0)
    if name in ("full", "causal"):
        mask, causal = None, name == "causal"
    else:
        heads = h if name == "random_eviction" else 1
        mask = masks.example(name, s, batch_size=b, num_heads=heads, generator=gen).to(dev)
        causal = mask.causal
    pairs = bench.visible_pairs(mask.to("cpu") if mask is not None else None, causal, s, s)
    flop = 4.0 * d * int(pairs.sum()) * (h // pairs.shape[1]) * (b // pairs.shape[0])
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    return mask, causal, flop, q, k, v, do


def _flex_ms(mask, causal, q, k, v, do, rep_ms: int) -> tuple[float, float]:
    from torch.nn.attention.flex_attention import flex_attention

    b, s, h, _ = q.shape
    block_mask = bench._flex_block_mask(mask, causal, b, h, s, q.device)()
    flex = torch.compile(flex_attention, dynamic=False)  # static shapes, as flashmask bench
    qf, kf, vf = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dof = do.transpose(1, 2).contiguous()
    fwd = bench._bench(lambda: flex(qf, kf, vf, block_mask=block_mask), rep_ms)
    total = bench._bench(
        lambda: bench.input_gradients(flex(qf, kf, vf, block_mask=block_mask), (qf, kf, vf), dof),
        rep_ms,
    )
    return fwd, total - fwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument(
        "--masks", default="full,causal,prefix_lm_causal,qk_sparse,causal_document,share_question"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a TRITON_INTERPRET=1 smoke run")
    parser.add_argument(
        "--set",
        default="tiles",
        choices=("tiles", "launch", "dq"),
        help="tiles: per-pass tile shapes; launch: whole-config variants (_launch_set); "
        "dq: dQ inside the dK/dV pass (_dq_set)",
    )
    args = parser.parse_args()
    dev = torch.device(args.device)
    out_dir = os.environ.get("OUT", ".")
    results = []
    for d in (int(x) for x in args.head_dims.split(",")):
        s = args.seqlen
        b, h = max(1, args.tokens // s), max(1, args.hidden // d)
        for name in args.masks.split(","):
            mask, causal, flop, q, k, v, do = _inputs(name, s, b, h, d, dev)
            sri = None if mask is None else mask.startend_row_indices
            # The Triton kernels' tiles are what is tuned: the Gluon kernels stay out (at hd128
            # on Hopper they would take the unmasked, long masked and deterministic=False calls).
            base = replace(
                kernels.tile_config(d, has_mask=sri is not None), fwd_gluon=False, bwd_gluon=False
            )
            scale = d**-0.5
            ref_out, ref_lse = kernels.forward(q, k, v, sri, causal, scale, config=base)
            ref_grads = kernels.backward(
                do, None, q, k, v, ref_out, ref_lse, sri, causal, scale, True, config=base
            )
            flex_fwd, flex_bwd = (
                _flex_ms(mask, causal, q, k, v, do, args.rep_ms)
                if dev.type == "cuda"
                else (float("nan"), float("nan"))
            )
            row = {"mask": name, "head_dim": d, "seqlen": s, "flop_fwd": flop}
            row["base"] = asdict(base)
            row["flex"] = {"fwd_ms": flex_fwd, "bwd_ms": flex_bwd}
            times: dict[str, dict] = {}
            if args.set == "tiles":
                cands = [(kind, f"{kind} {c}", _with(base, kind, c))
                         for kind, table in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ))
                         for c in table[d]]  # fmt: skip
            elif args.set == "launch":
                cands = _launch_set(base)
            else:
                cands = _dq_set(base, d)
            for _ in range(args.rounds):
                for kind, key, cfg in cands:
                    try:
                        if kind == "fwd":
                            out, _ = kernels.forward(q, k, v, sri, causal, scale, config=cfg)
                            err = float((out.float() - ref_out.float()).abs().max())
                            ms = _time_ms(
                                lambda c=cfg: kernels.forward(
                                    q, k, v, sri, causal, scale, config=c
                                ),
                                rep=args.rep_ms,
                                return_mode="median",
                            )
                        else:
                            det = not cfg.atomic_dq
                            grads = kernels.backward(
                                do, None, q, k, v, ref_out, ref_lse, sri, causal, scale, det,
                                config=cfg,
                            )  # fmt: skip
                            err = max(
                                float((g.float() - r.float()).abs().max())
                                for g, r in zip(grads, ref_grads, strict=True)
                            )
                            ms = _time_ms(
                                lambda c=cfg, det=det: kernels.backward(
                                    do, None, q, k, v, ref_out, ref_lse, sri, causal, scale, det,
                                    config=c,
                                ),
                                rep=args.rep_ms,
                                return_mode="median",
                            )  # fmt: skip
                    except Exception as exc:  # shared memory overflow etc.: report, go on
                        times[key] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
                        continue
                    entry = times.setdefault(key, {"ms": [], "max_abs_diff": 0.0})
                    entry["ms"].append(ms)
                    entry["max_abs_diff"] = max(entry["max_abs_diff"], err)
            for entry in times.values():
                if "ms" in entry:
                    entry["median_ms"] = statistics.median(entry["ms"])
            row["candidates"] = times
            results.append(row)
            _print(row)
            torch.cuda.empty_cache()
        suffix = "" if args.set == "tiles" else f"_{args.set}"
        name = f"tune_S{args.seqlen}_D{args.head_dims.replace(',', '-')}{suffix}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(results, f, indent=1)


def _print(row: dict) -> None:
    flex = row["flex"]
    print(
        f"== {row['mask']} D={row['head_dim']} S={row['seqlen']}: flex fwd {flex['fwd_ms']:.3f} "
        f"bwd {flex['bwd_ms']:.3f} ms",
        flush=True,
    )
    for key, entry in row["candidates"].items():
        if "error" in entry:
            print(f"   {key:24s} {entry['error']}", flush=True)
            continue
        ms = entry["median_ms"]
        ref = flex["fwd_ms"] if key.startswith("fwd") else flex["bwd_ms"]
        print(
            f"   {key:24s} {ms:8.3f} ms  (flex/this {ref / ms:5.2f})  "
            f"rounds {[round(x, 3) for x in entry['ms']]}  diff {entry['max_abs_diff']:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
