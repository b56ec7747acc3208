"""The CuTe forward beside the routed forward (Gluon/Triton) and FlashMask-4, on one Hopper GPU.

For the 12 masks of ``flashmask.masks.example`` (bf16, B x S = 32K tokens, heads x head dim =
2048) it times the forward of: ``cute`` (``kernels.cute_kernels``; the mask's lists and launch
order prepared once, as the cache serves them to every layer; persistent programs for a
non-causal mask, as ``launch.forward`` picks), ``routed`` (``kernels.forward``,
what ``flashmask_attention`` runs today, its preparation cached too) and ``fm4`` (FlashMask-4,
which builds its block lists in every call) when ``fm4_torch`` imports. TFLOP/s count visible
pairs only (``flashmask.bench.visible_flop``); times are medians of ``flashmask.bench``'s timer
(L2 flushed). Every cell also records the largest |difference| of the CuTe output from the
routed one.

    PYTHONPATH=src python benchmarks/cute_forward.py --out cute_forward
    python benchmarks/cute_forward.py --render cute_forward.json   # the table again

writes ``PREFIX.json`` and ``PREFIX.md``.

``--persistent-ab`` times instead, in one process, the CuTe forward with its persistent variant
off and on (``launch.forward(..., persistent=False / True)``) on the same inputs of each of the
12 masks, head dim 128 at 8K and 32K unless ``--head-dims`` says otherwise: the two alternate
(off, on, off, on) and each keeps the better of its two medians. The table gives both TFLOP/s,
on / off and the largest |difference| of the outputs:

    PYTHONPATH=src python benchmarks/cute_forward.py --persistent-ab --out cute_persistent_ab
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CASES = ((128, (8192, 32768)), (256, (8192,)), (64, (8192,)), (192, (8192, 32768)))
TOKENS, HIDDEN = 32768, 2048
# V's head dim where it is not Q/K's: 192 is multi-head latent attention's (DeepSeek-V2/V3),
# whose V has 128.
VALUE_HEAD_DIM = {192: 128}


def cases(head_dims: list[int]):
    """``(d, s, b, heads, name)`` of each timed cell: ``CASES`` at ``head_dims``, the 12 masks
    (``--head-dims 192``: MLA's 192 / 128, :data:`VALUE_HEAD_DIM`)."""
    from flashmask import masks

    for d, seqlens in CASES:
        if d not in head_dims:
            continue
        for s in seqlens:
            for name in masks.MASK_TYPES:
                yield d, s, TOKENS // s, HIDDEN // d, name


def inputs(d: int, s: int, b: int, heads: int, name: str):
    """Random bf16 ``q, k, v``, the mask's ``sri`` and ``causal``, its visible FLOP, and a call
    of the CuTe forward on them (its lists, bounds and launch order prepared once, as the cache
    serves them to every layer) that takes ``persistent`` (``None``: the launcher's rule)."""
    import torch

    from flashmask import masks
    from flashmask.bench import attention_flop
    from flashmask.kernels import preparation, tiles
    from flashmask.kernels.cute_kernels import launch
    from flashmask.mask import FlashMask

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    dv = VALUE_HEAD_DIM.get(d, d)
    q = torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(b, s, heads, dv, device=device, dtype=torch.bfloat16)
    sri, causal = None, name == "causal"
    if name not in ("full", "causal"):
        mask = masks.example(
            name, s, batch_size=b, num_heads=heads if name == "random_eviction" else 1,
            generator=gen,
        ).to(device)  # fmt: skip
        sri, causal = mask.startend_row_indices, mask.causal
    mask = FlashMask(sri, causal) if sri is not None else None
    flop = attention_flop(mask, causal, s, d, heads, b, dv)[0]
    scale = d**-0.5
    shape = (128, launch.key_tile(d), True)
    bounds, (lists,) = preparation.prepare_cached(sri, causal, s, s, b, device, [shape])
    order = None
    if sri is not None:
        (order,) = preparation.program_orders([(lists, heads, True)])
    mask_heads = 1 if sri is None else sri.shape[1]

    def cute(persistent: bool | None = None):
        return launch.forward(
            q, k, v, bounds, lists, mask_heads, causal, not causal, scale, True, order,
            persistent=persistent, edge_intervals=tiles.edge_intervals(sri, causal),
        )  # fmt: skip

    return q, k, v, sri, causal, scale, flop, cute


def measure(head_dims: list[int]) -> tuple[dict, list[dict]]:
    import torch

    from flashmask.bench import _bench, flashmask4
    from flashmask.kernels import forward_launcher

    fm4 = flashmask4()
    cells = []
    for d, s, b, heads, name in cases(head_dims):
        q, k, v, sri, causal, scale, flop, cute = inputs(d, s, b, heads, name)

        def routed():
            return forward_launcher.forward(q, k, v, sri, causal, scale)

        calls = {"cute": cute, "routed": routed}
        if fm4 is not None:
            calls["fm4"] = lambda: fm4(q, k, v, sri, causal=causal)
        cell: dict = {"d": d, "dv": VALUE_HEAD_DIM.get(d, d), "s": s, "b": b, "mask": name}
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


def measure_persistent_ab(head_dims: list[int], rounds: int = 2) -> tuple[dict, list[dict]]:
    """Per mask, the CuTe forward with the persistent variant off and on, alternating for
    ``rounds`` rounds on the same inputs, each keeping its best median."""
    import torch

    from flashmask.bench import _bench

    cells = []
    for d, s, b, heads, name in cases(head_dims):
        _, _, _, _, _, _, flop, cute = inputs(d, s, b, heads, name)
        cell: dict = {"d": d, "s": s, "b": b, "mask": name}
        times: dict[str, list[float]] = {"off": [], "on": []}
        try:
            for _ in range(rounds):
                for key, persistent in (("off", False), ("on", True)):
                    times[key].append(_bench(lambda p=persistent: cute(p), 200))
            for key, ms in times.items():
                cell[key] = {"ms": min(ms), "tflops": flop / min(ms) / 1e9}
            diff = (cute(True)[0].float() - cute(False)[0].float()).abs().max().item()
            cell["max_diff"] = diff
        except Exception as exc:  # a failing mask costs only its row
            cell["error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(json.dumps(cell), flush=True)
        cells.append(cell)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kind": "persistent_ab",
        "rounds": rounds,
    }
    return meta, cells


def render_persistent_ab(meta: dict, cells: list[dict]) -> str:
    """A markdown table: the CuTe forward's TFLOP/s with the persistent variant off and on."""
    lines = [
        f"# CuTe forward, persistent variant off / on ({meta.get('gpu', '?')}, "
        f"torch {meta.get('torch', '?')})",
        "",
        "Forward TFLOP/s (visible pairs), bf16, 32K tokens, 2048 = heads x head dim; each the "
        f"best median of {meta.get('rounds', '?')} alternating rounds.",
        "",
        "| D | S | mask | off | on | on/off | max diff |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for c in cells:
        off, on = c.get("off", {}).get("tflops"), c.get("on", {}).get("tflops")
        row = [f"{x:.0f}" if x else "—" for x in (off, on)]
        row.append(f"{on / off:.3f}" if on and off else "—")
        diff = c.get("max_diff")
        row.append(f"{diff:.3g}" if isinstance(diff, float) else "error")
        lines.append(f"| {c['d']} | {c['s']} | {c['mask']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


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

    for c in cells:
        row = comparison_columns(c, ("routed", "fm4"))
        dims = f"{c['d']}" if c.get("dv", c["d"]) == c["d"] else f"{c['d']}/{c['dv']}"
        lines.append(f"| {dims} | {c['s']} | {c['mask']} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def comparison_columns(cell: dict, peers: tuple[str, str]) -> list[str]:
    """A table row's columns for one cell: TFLOP/s of ``cute`` and the two ``peers`` (a dash
    where one did not run), ``cute``'s ratio to each, and the largest output difference
    (``error`` where it could not be taken). Shared with ``cute_backward.py``."""
    cute, *others = (cell.get(impl, {}).get("tflops") for impl in ("cute", *peers))
    row = [f"{x:.0f}" if x else "—" for x in (cute, *others)]
    row += [f"{cute / x:.2f}" if cute and x else "—" for x in others]
    diff = cell.get("max_diff")
    row.append(f"{diff:.3g}" if isinstance(diff, float) else "error")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="cute_forward", help="prefix of the .json and .md")
    parser.add_argument(
        "--head-dims",
        help="comma-separated (default 128,256,64; 128 with --persistent-ab; 192 is MLA's Q/K "
        "head dim with V's 128)",
    )
    parser.add_argument("--render", type=Path, help="only render an earlier run's JSON")
    parser.add_argument(
        "--persistent-ab", action="store_true",
        help="time the CuTe forward with its persistent variant off and on instead",
    )  # fmt: skip
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        show = render_persistent_ab if data["meta"].get("kind") == "persistent_ab" else render
        print(show(data["meta"], data["cells"]), end="")
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the CuTe forward needs a Hopper GPU (--render works anywhere)")
    head_dims = args.head_dims or ("128" if args.persistent_ab else "128,256,64")
    head_dims = [int(x) for x in head_dims.split(",")]
    if args.persistent_ab:
        meta, cells = measure_persistent_ab(head_dims)
        table = render_persistent_ab(meta, cells)
    else:
        meta, cells = measure(head_dims)
        table = render(meta, cells)
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
