"""What a forward or backward program costs besides its key tiles: the Gluon and the Triton
kernels on sliding windows of growing width, hd128.

A sliding window of ``w`` keys gives every query tile a list of about ``(w + tile) / tile`` key
tiles, so the forward's time over the tiles it computes is close to a line,
``programs / concurrency * (fixed + per_tile * tiles)``. Fitting ``time = a + b * tiles`` over
the widths separates what a program costs whatever its list (``a``: launching it, loading its
Q tile, filling and draining its pipeline, storing O and lse; divided by the waves of programs,
its cost per wave) from what each listed tile adds (``b``). The Gluon kernels run one program
per SM (their shared memory), so a program's fixed cost cannot overlap another's tiles; the
Triton kernels' programs share an SM. A backward's intercept also holds the call's fixed
kernels (delta with dQ's zeroing, dQ's conversion). This is the measurement behind a persistent
Gluon kernel (one program per SM looping over tiles, the next tile's loads under this one's
epilogue).

Usage (H200): ``PYTHONPATH=src python benchmarks/program_overhead.py [--seqlen 8192]``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import triton
from bench_cases import visible_flop

from flashmask import kernels, masks
from flashmask.kernels import routing


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: ``(a, b)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def _lists_of(sri, s, b, shape, heads) -> tuple[float, int]:
    """``(mean list length, programs)`` of the lists at ``shape`` for ``heads`` grid heads."""
    _, (lists,) = kernels.prepare_cached(sri, True, s, s, b, sri.device, [shape])
    return lists.counts.float().mean().item(), lists.counts.numel() * heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--windows", default="127,255,511,1023,2047,4095")
    args = parser.parse_args()
    s, d, h = args.seqlen, 128, 16
    b = max(1, args.tokens // s)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkvd")
    scale = d**-0.5
    cfg = kernels.tile_config(d, has_mask=True)
    triton_bwd = replace(cfg, bwd_gluon=False)
    limit = routing.GLUON_FWD_MIN_MASKED_SEQLEN
    # Each kernel's own list shape (row lists for a forward, column lists for a backward).
    gluon_fwd_shape = (routing.GLUON_FWD_TILE, routing.gluon_forward_tiles(d)[0], True)
    gluon_bwd_shape = (routing.GLUON_BWD_QUERIES, routing.GLUON_BWD_KEYS, False)
    variants = {
        "triton fwd": (cfg.fwd_m, cfg.fwd_n, True),
        "gluon fwd": gluon_fwd_shape,
        "triton bwd": (cfg.bwd_m, cfg.bwd_n, False),
        "gluon bwd": gluon_bwd_shape,
    }
    points: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    programs_of: dict[str, int] = {}
    for window in (int(w) for w in args.windows.split(",")):
        mask = masks.sliding_window(s, window, batch_size=b)
        sri = mask.startend_row_indices.cuda()
        flop = visible_flop(mask, True, s, d, h, b, 4.0)
        line = f"S={s} window {window + 1:5d}"
        routing.GLUON_FWD_MIN_MASKED_SEQLEN = 1 << 30
        out, lse = kernels.forward(q, k, v, sri, True, scale, config=cfg)
        for name, shape in variants.items():
            tile_rows, tile_cols, _ = shape
            routing.GLUON_FWD_MIN_MASKED_SEQLEN = 0 if name == "gluon fwd" else 1 << 30
            if name.endswith("fwd"):

                def run(sri=sri):
                    return kernels.forward(q, k, v, sri, True, scale, config=cfg)

                pass_flop = flop
            else:
                config = cfg if name == "gluon bwd" else triton_bwd

                def run(sri=sri, config=config):
                    return kernels.backward(
                        do, None, q, k, v, out, lse, sri, True, scale, False, config=config
                    )

                pass_flop = flop * 2.5
            run()
            tiles, programs = _lists_of(sri, s, b, shape, h)
            programs_of[name] = programs
            ms = triton.testing.do_bench(run, rep=100)
            # Work in 128x128 tile equivalents, so all kernels share one axis.
            work = tiles * tile_rows * tile_cols / (128 * 128)
            points[name].append((work, ms))
            line += (
                f" | {name} {ms:.3f} ms ({pass_flop / ms / 1e9:.0f} TF/s) {programs} programs of "
                f"{tiles:.1f} {tile_rows}x{tile_cols} tiles"
            )
        routing.GLUON_FWD_MIN_MASKED_SEQLEN = limit
        print(line, flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, pts in points.items():
        a, slope = _fit([p[0] for p in pts], [p[1] for p in pts])
        waves = programs_of[name] / sms
        print(
            f"{name}: time = {a * 1e3:.0f} us + {slope * 1e3:.1f} us per 128x128 tile of work "
            f"per program; {programs_of[name]} programs, {waves:.1f} per SM: "
            f"{a * 1e3 / waves:.2f} us fixed and {slope * 1e3 / waves:.2f} us per tile, per "
            "program at one program per SM at a time",
            flush=True,
        )


if __name__ == "__main__":
    main()
