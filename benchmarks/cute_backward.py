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

``--source-ab FILE`` times instead, in one process, this tree's CuTe backward (off) against the
one of another ``backward.py`` (on: a lever's, e.g. from ``git show
BRANCH:src/flashmask/kernels/cute_kernels/backward.py``), compiled by this tree's launcher for
the same launches (``cute_forward.source_compiler``), alternating for two rounds on the same
inputs, each keeping its best median; the table gives both TFLOP/s, on / off and the largest
|difference| of dq, dk, dv:

    PYTHONPATH=src python benchmarks/cute_backward.py --source-ab lever/backward.py --out ab

``--deterministic`` times instead the CuTe backward's deterministic variant (``cute det``: each
query tile's dQ added in a fixed order, launched in its own order) against the same kernel
without it (``cute``), both alone on the same inputs, alternating for two rounds, each keeping
its best median; per cell whether two deterministic runs gave the same bits and the largest
|difference| from the non-deterministic gradients. Two trees' deterministic launch orders
compare through ``ab_trees.py`` with ``--metric cute_det.tflops``:

    PYTHONPATH=src python benchmarks/cute_backward.py --deterministic --out det
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Run as a script, this file's folder is on sys.path, and its tests put it there.
from cute_forward import comparison_columns, example_mask, render_ab, source_compiler

SEQLENS = (8192, 32768)
TOKENS, HEADS, HEAD_DIM = 32768, 16, 128
BACKWARD_FLOP = 2.5  # a backward's matmul work over its forward's


def inputs(s: int, name: str) -> tuple[tuple, object, object, float]:
    """Random bf16 inputs of mask ``name`` at length ``s`` (batch ``TOKENS // s``), the forward
    run on them, and the lists and launch order prepared once: ``(args, order, sri, flop)``,
    the backward kernels' positional arguments, their launch order (``None`` without a mask),
    the mask's ``startend_row_indices`` (``None`` for full and causal) and the visible FLOP of
    the forward."""
    import torch

    from flashmask.bench import visible_flop
    from flashmask.kernels import forward_launcher, preparation
    from flashmask.kernels.backward_launcher import backward_delta
    from flashmask.mask import FlashMask

    device = torch.device("cuda")
    d, heads, b = HEAD_DIM, HEADS, TOKENS // s
    q = torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16)
    k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    sri, causal = example_mask(name, s, b, heads, device)
    flop = visible_flop(FlashMask(sri, causal) if sri is not None else None, causal, s, d, heads, b)
    scale = d**-0.5
    out, lse = forward_launcher.forward(q, k, v, sri, causal, scale)
    delta = backward_delta(out, dout, None)
    bounds, (lists,) = preparation.prepare_cached(sri, causal, s, s, b, device, [(64, 128, False)])
    order = None if sri is None else preparation.program_order(lists, heads, False)
    hm = 1 if sri is None else sri.shape[1]
    args = (dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale)
    return args, order, sri, flop


def largest_difference(ours, theirs) -> float:
    """The largest |difference| over the pairs of ``(dq, dk, dv)`` of two backwards."""
    return max(
        (a.float() - t.float()).abs().max().item() for a, t in zip(ours, theirs, strict=True)
    )


def measure(seqlens: list[int]) -> tuple[dict, list[dict]]:
    import torch

    from flashmask import masks
    from flashmask.bench import _bench, flashmask4
    from flashmask.kernels.cute_kernels import backward_launch
    from flashmask.kernels.gluon_kernels import backward as gluon_backward

    fm4 = flashmask4()
    d = HEAD_DIM
    cells = []
    for s in seqlens:
        b = TOKENS // s
        for name in masks.MASK_TYPES:
            args, order, sri, flop = inputs(s, name)
            dout, q, k, v, *_, causal, _ = args
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
                cell["max_diff"] = largest_difference(calls["cute"](), calls["gluon"]())
            except Exception as exc:
                cell["max_diff"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    return meta, cells


def measure_source_ab(seqlens: list[int], source: Path, rounds: int = 2) -> tuple[dict, list[dict]]:
    """Per mask, this tree's CuTe backward (``off``) and ``source``'s (``on``), alternating for
    ``rounds`` rounds on the same inputs, each keeping its best median."""
    import torch

    from flashmask import masks
    from flashmask.bench import _bench
    from flashmask.kernels.cute_kernels import backward_launch

    ours = backward_launch.compiled_backward
    builds = {"off": ours, "on": source_compiler(source, "backward")}
    cells = []
    try:
        for s in seqlens:
            for name in masks.MASK_TYPES:
                args, order, _, flop = inputs(s, name)
                cell: dict = {"d": HEAD_DIM, "s": s, "b": TOKENS // s, "mask": name}

                def call(key, args=args, order=order):
                    backward_launch.compiled_backward = builds[key]
                    try:
                        return backward_launch.backward(*args, order=order)
                    finally:
                        backward_launch.compiled_backward = ours

                times: dict[str, list[float]] = {"off": [], "on": []}
                try:
                    for _ in range(rounds):
                        for key in times:
                            times[key].append(_bench(lambda key=key: call(key), 200))
                    for key, ms in times.items():
                        cell[key] = {"ms": min(ms), "tflops": BACKWARD_FLOP * flop / min(ms) / 1e9}
                    cell["max_diff"] = largest_difference(call("on"), call("off"))
                except Exception as exc:  # a failing mask costs only its row
                    cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    finally:
        backward_launch.compiled_backward = ours
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kind": "source_ab",
        "kernel": "backward",
        "source": str(source),
        "rounds": rounds,
    }
    return meta, cells


def measure_deterministic(seqlens: list[int], rounds: int = 2) -> tuple[dict, list[dict]]:
    """Per mask, the CuTe backward (``cute``) and its deterministic variant (``cute_det``),
    alternating for ``rounds`` rounds on the same inputs, each keeping its best median;
    ``repeats``: two deterministic runs gave the same dq, dk and dv bits; ``max_diff``: their
    largest |difference| from the non-deterministic gradients."""
    import torch

    from flashmask import masks
    from flashmask.bench import _bench
    from flashmask.kernels.cute_kernels import backward_launch

    cells = []
    for s in seqlens:
        for name in masks.MASK_TYPES:
            args, order, _, flop = inputs(s, name)
            cell: dict = {"d": HEAD_DIM, "s": s, "b": TOKENS // s, "mask": name}
            calls = {
                "cute": lambda args=args, order=order: backward_launch.backward(*args, order=order),
                "cute_det": lambda args=args: backward_launch.backward(*args, deterministic=True),
            }
            times: dict[str, list[float]] = {impl: [] for impl in calls}
            try:
                for _ in range(rounds):
                    for impl, fn in calls.items():
                        times[impl].append(_bench(fn, 200))
                for impl, ms in times.items():
                    cell[impl] = {"ms": min(ms), "tflops": BACKWARD_FLOP * flop / min(ms) / 1e9}
                first, second = calls["cute_det"](), calls["cute_det"]()
                cell["repeats"] = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
                cell["max_diff"] = largest_difference(first, calls["cute"]())
            except Exception as exc:  # a failing mask costs only its row
                cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kind": "deterministic",
        "rounds": rounds,
    }
    return meta, cells


def render_deterministic(meta: dict, cells: list[dict]) -> str:
    """A markdown table of a :func:`measure_deterministic` run: both TFLOP/s, the deterministic
    variant's speed over the plain kernel's, whether it repeated bit for bit, and its largest
    difference from the plain gradients."""
    lines = [
        f"# CuTe backward, deterministic variant against the plain kernel "
        f"({meta.get('gpu', '?')}, torch {meta.get('torch', '?')})",
        "",
        f"Backward TFLOP/s (visible pairs), bf16, hd{HEAD_DIM}, {TOKENS // 1024}K tokens, "
        f"{HEADS} heads; each the best median of {meta.get('rounds', '?')} alternating rounds.",
        "",
        "| S | mask | cute | cute det | det/cute | repeats | max diff |",
        "|---:|---|---:|---:|---:|---|---:|",
    ]
    for c in cells:
        plain, det = (c.get(impl, {}).get("tflops") for impl in ("cute", "cute_det"))
        row = [f"{x:.0f}" if x else "—" for x in (plain, det)]
        row.append(f"{det / plain:.2f}" if det and plain else "—")
        repeats = c.get("repeats")
        row.append("—" if repeats is None else "yes" if repeats else "**no**")
        diff = c.get("max_diff")
        row.append(f"{diff:.3g}" if isinstance(diff, float) else "error")
        lines.append(f"| {c['s']} | {c['mask']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--source-ab", type=Path, metavar="FILE",
        help="time this tree's CuTe backward against the one of another backward.py instead",
    )  # fmt: skip
    mode.add_argument(
        "--deterministic", action="store_true",
        help="time the CuTe backward's deterministic variant against the plain kernel instead",
    )  # fmt: skip
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        shows = {"source_ab": render_ab, "deterministic": render_deterministic}
        show = shows.get(data["meta"].get("kind"), render)
        print(show(data["meta"], data["cells"]), end="")
        return
    if args.source_ab is not None and not args.source_ab.is_file():
        parser.error(f"--source-ab: no such file {args.source_ab}")
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the CuTe backward needs a Hopper GPU (--render works anywhere)")
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.source_ab is not None:
        meta, cells = measure_source_ab(seqlens, args.source_ab)
        table = render_ab(meta, cells)
    elif args.deterministic:
        meta, cells = measure_deterministic(seqlens)
        table = render_deterministic(meta, cells)
    else:
        meta, cells = measure(seqlens)
        table = render(meta, cells)
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
