"""Where a Gluon backward work item's time goes: the consumers' phase stamps
(``flashmask.kernels.gluon_kernels.backward.TIMELINE``) of every item of one launch, summed over
the SMs.

An item (128 keys of one kv head) is, as its consumer warpgroups see it: waiting for its K/V
tiles (``kv``), then for its first Q/dO tile (``first``), its tile loop (``loop``, from the
first tile's data to the last tile's products), then the last dQ hand-off and the dK/dV stores
(``drain``); between two items on one SM, the time no item's consumers run (``gap``: a
program's exit, the next one's launch and set-up, or the persistent loop's item hand-over, of
which the part until the consumers hold the next item is stamped too);
before an SM's first and after its last item, ``ramp`` and ``tail``. Each is given as a share
of the launch's SM time (SMs x the launch's span), and the loop is fitted as ``a + b * tiles``
over the items, so ``a`` is what a loop costs beyond its tiles (the first tile's products with
nothing before them to overlap, the last one's with nothing after).

Usage (H200): ``PYTHONPATH=src python benchmarks/bwd_timeline.py --seqlens 8192 --masks
sliding_window,full --variant PERSISTENT=1 --out benchmarks/results/bwd_timeline.json``. The
stamps cost a few stores per item; the script times each form with and without them.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

# Columns of a timeline row (gluon_bwd.TIMELINE_FIELDS of them).
(START, KV_READY, FIRST_TILE, LOOP_END, END, SM, TILES, GLOBAL_START, GLOBAL_END,
 RECEIVED) = range(10)  # fmt: skip
PHASES = ("kv", "first", "loop", "drain", "gap", "ramp", "tail")


def clock_rate_ghz(rows: np.ndarray) -> float:
    """SM cycles per nanosecond: each item's clock span against its global-timer span, the
    median over the longer half of the items (the global timer's resolution is coarse)."""
    cycles = (rows[:, END] - rows[:, START]).astype(np.float64)
    nanos = (rows[:, GLOBAL_END] - rows[:, GLOBAL_START]).astype(np.float64)
    usable = nanos > 0
    if not usable.any():
        raise ValueError("timeline: no item has a positive global-timer span")
    cycles, nanos = cycles[usable], nanos[usable]
    longer = nanos >= np.median(nanos)
    return float(np.median(cycles[longer] / nanos[longer]))


def item_phases(rows: np.ndarray, ghz: float) -> dict[str, np.ndarray]:
    """Per item, in microseconds: ``kv``, ``first``, ``loop``, ``drain`` (an item with no
    tiles has no first-tile stamp: its loop and first-tile wait are zero)."""
    us = 1e-3 / ghz
    has_tiles = rows[:, TILES] > 0
    first = np.where(has_tiles, rows[:, FIRST_TILE], rows[:, KV_READY])
    return {
        "kv": (rows[:, KV_READY] - rows[:, START]) * us,
        "first": (first - rows[:, KV_READY]) * us,
        "loop": (rows[:, LOOP_END] - first) * us,
        "drain": (rows[:, END] - rows[:, LOOP_END]) * us,
    }


def sm_gaps(rows: np.ndarray, ghz: float) -> tuple[np.ndarray, np.ndarray]:
    """The time between consecutive items on each SM (microseconds; SM clocks, which are
    comparable within an SM), over all SMs, and of it the part until the consumers had the next
    item (``RECEIVED``, stamped by the persistent form; zeros without it)."""
    gaps, waits = [], []
    for sm in np.unique(rows[:, SM]):
        on_sm = rows[rows[:, SM] == sm]
        on_sm = on_sm[np.argsort(on_sm[:, START])]
        gaps.append((on_sm[1:, START] - on_sm[:-1, END]) * (1e-3 / ghz))
        received = on_sm[:-1, RECEIVED] if rows.shape[1] > RECEIVED else np.zeros(len(on_sm) - 1)
        waits.append(np.where(received > 0, received - on_sm[:-1, END], 0) * (1e-3 / ghz))
    if not gaps:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(gaps), np.concatenate(waits)


def summarize(rows: np.ndarray, num_sms: int) -> dict:
    """The launch's time split by phase (:data:`PHASES`, shares of ``num_sms`` x its span,
    which sum to 1 up to the clocks' disagreement) and per item (medians, microseconds), with
    the loop's fit ``a + b * tiles``. ``rows``: the timeline ``[items, 9 or 10]`` of one launch."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] < 9:
        raise ValueError(f"timeline: expected rows of 9 stamps, got shape {rows.shape}")
    if (rows[:, END] == 0).any():
        raise ValueError("timeline: some items were not stamped (did the launch run them all?)")
    ghz = clock_rate_ghz(rows)
    phases = item_phases(rows, ghz)
    gaps, receive_waits = sm_gaps(rows, ghz)
    begin, finish = rows[:, GLOBAL_START].min(), rows[:, GLOBAL_END].max()
    span_us = (finish - begin) * 1e-3
    ramp = tail = 0.0
    for sm in np.unique(rows[:, SM]):
        on_sm = rows[rows[:, SM] == sm]
        ramp += (on_sm[:, GLOBAL_START].min() - begin) * 1e-3
        tail += (finish - on_sm[:, GLOBAL_END].max()) * 1e-3
    idle_sms = num_sms - len(np.unique(rows[:, SM]))
    sm_time = num_sms * span_us
    totals = {name: float(values.sum()) for name, values in phases.items()}
    totals["gap"] = float(gaps.sum())
    totals["ramp"] = ramp + idle_sms * span_us / 2
    totals["tail"] = tail + idle_sms * span_us / 2
    tiles = rows[:, TILES].astype(np.float64)
    fit = {"loop_fixed_us": float("nan"), "loop_per_tile_us": float("nan")}
    if len(np.unique(tiles)) > 1:
        per_tile, fixed = np.polyfit(tiles, phases["loop"], 1)
        fit = {"loop_fixed_us": float(fixed), "loop_per_tile_us": float(per_tile)}
    busy = tiles > 0
    return {
        "items": len(rows),
        "sms": num_sms,
        "clock_ghz": ghz,
        "span_us": float(span_us),
        "share": {name: totals[name] / sm_time for name in PHASES},
        "median_us": {
            **{name: float(np.median(values)) for name, values in phases.items()},
            "gap": float(np.median(gaps)) if len(gaps) else 0.0,
            "gap_until_received": float(np.median(receive_waits)) if len(gaps) else 0.0,
            "per_tile": float(np.median(phases["loop"][busy] / tiles[busy])) if busy.any() else 0.0,
        },
        "tiles_per_item": float(tiles.mean()),
        **fit,
    }


def _format(label: str, summary: dict, ms: float, stamped_ms: float) -> str:
    share = " ".join(f"{n} {summary['share'][n] * 100:4.1f}%" for n in PHASES)
    med = summary["median_us"]
    return (
        f"{label}: {ms:.3f} ms ({stamped_ms:.3f} stamped), span {summary['span_us'] / 1e3:.3f} ms"
        f", {summary['items']} items of {summary['tiles_per_item']:.1f} tiles | {share} | "
        f"median us: kv {med['kv']:.2f} first {med['first']:.2f} loop {med['loop']:.2f} "
        f"drain {med['drain']:.2f} gap {med['gap']:.2f} (received after "
        f"{med['gap_until_received']:.2f}) per tile {med['per_tile']:.3f} | loop "
        f"fit {summary['loop_fixed_us']:.2f} + {summary['loop_per_tile_us']:.3f} x tiles us"
    )


def main() -> None:
    import torch
    import triton
    from bench_cases import backward_cases, case_parser
    from gluon_backward import parse_variant, set_constants

    from flashmask import kernels
    from flashmask.kernels import routing
    from flashmask.kernels.gluon_kernels import backward as gluon_bwd

    parser = case_parser(__doc__.split("\n\n")[0], "sliding_window,share_question,full")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument(
        "--variant", type=parse_variant, action="append", default=[],
        help="also these gluon_bwd constants, e.g. PERSISTENT=1 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--out", default=None, help="write the summaries as JSON here")
    args = parser.parse_args()
    routing.GLUON_BWD_MIN_MASKED_SEQLEN = {}  # every case on the Gluon backward
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for case in backward_cases(args.seqlens, args.masks, args.tokens, args.hidden, args.head_dim):
        base = replace(kernels.tile_config(args.head_dim, has_mask=case.sri is not None),
                       bwd_gluon=True)  # fmt: skip
        items = case.k.shape[0] * case.k.shape[2] * (case.k.shape[1] // gluon_bwd.BLOCK_N)
        for settings in [{}, *args.variant]:
            defaults = set_constants(gluon_bwd, settings)
            try:
                run = lambda: case.run_backward(False, base)  # noqa: E731
                ms = triton.testing.do_bench(run, rep=args.rep_ms)
                timeline = torch.zeros(
                    items, gluon_bwd.TIMELINE_FIELDS, dtype=torch.int64, device="cuda"
                )
                gluon_bwd.TIMELINE = timeline
                stamped_ms = triton.testing.do_bench(run, rep=args.rep_ms)
                timeline.zero_()
                run()
                torch.cuda.synchronize()
                rows = timeline.cpu().numpy()
            finally:
                gluon_bwd.TIMELINE = None
                set_constants(gluon_bwd, defaults)
            summary = summarize(rows, num_sms)
            label = ",".join(f"{n}={v}" for n, v in settings.items()) or "shipped"
            print(_format(f"S={case.seqlen} {case.name} {label}", summary, ms, stamped_ms),
                  flush=True)  # fmt: skip
            results.append({"seqlen": case.seqlen, "mask": case.name, "form": label, "ms": ms,
                            "stamped_ms": stamped_ms, **summary})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
