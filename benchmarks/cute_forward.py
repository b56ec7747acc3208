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

``--source-ab FILE`` times, the same way, this tree's CuTe forward (off) against the one of
another ``forward.py`` (on: a lever's version of ``kernels/cute_kernels/forward.py``, e.g. from
``git show BRANCH:src/flashmask/kernels/cute_kernels/forward.py``), loaded beside this tree's
and compiled by this tree's launcher for the same launches (:func:`source_compiler`); in one
process the two builds see the same clocks and inputs, where separate processes
(``ab_trees.py``) drift by several percent. ``--softcap X`` runs both A/B modes with a logit
cap of X; ``--fp8`` runs them on the FP8 forward (``launch.forward_fp8``: the same random inputs
quantised per head by ``flashmask.quantize_fp8``, bf16 output, its own tile lists):

    PYTHONPATH=src python benchmarks/cute_forward.py --source-ab lever/forward.py --out lever_ab
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


def example_mask(name: str, s: int, b: int, heads: int, device):
    """``(startend_row_indices, causal)`` of mask ``name`` of ``flashmask.masks.example`` at
    length ``s`` and batch ``b`` on ``device`` (``None`` for full and causal attention),
    random_eviction with one mask per head, from a generator seeded 0. Shared with
    ``cute_backward.py``."""
    import torch

    from flashmask import masks

    if name in ("full", "causal"):
        return None, name == "causal"
    mask = masks.example(
        name, s, batch_size=b, num_heads=heads if name == "random_eviction" else 1,
        generator=torch.Generator().manual_seed(0),
    ).to(device)  # fmt: skip
    return mask.startend_row_indices, mask.causal


def inputs(d: int, s: int, b: int, heads: int, name: str, fp8: bool = False):
    """Random bf16 ``q, k, v``, the mask's ``sri`` and ``causal``, its visible FLOP, and a call
    of the CuTe forward on them (its lists, bounds and launch order prepared once, as the cache
    serves them to every layer) that takes ``persistent`` (``None``: the launcher's rule);
    ``fp8``: the call is the FP8 forward's on the inputs quantised per head, with its tiles."""
    import torch

    from flashmask.bench import attention_flop
    from flashmask.kernels import preparation, tiles
    from flashmask.kernels.cute_kernels import launch
    from flashmask.mask import FlashMask

    device = torch.device("cuda")
    dv = VALUE_HEAD_DIM.get(d, d)
    q = torch.randn(b, s, heads, d, device=device, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(b, s, heads, dv, device=device, dtype=torch.bfloat16)
    sri, causal = example_mask(name, s, b, heads, device)
    mask = FlashMask(sri, causal) if sri is not None else None
    flop = attention_flop(mask, causal, s, d, heads, b, dv)[0]
    scale = d**-0.5
    shape = (128, launch.key_tile(d), True)
    if fp8:
        shape = launch.fp8_tile_shape(d, full_attention=sri is None and not causal)
    bounds, (lists,) = preparation.prepare_cached(sri, causal, s, s, b, device, [shape])
    order = None
    if sri is not None:
        (order,) = preparation.program_orders([(lists, heads, True)])
    mask_heads = 1 if sri is None else sri.shape[1]

    edge = tiles.edge_intervals(sri, causal)

    def cute(persistent: bool | None = None):
        return launch.forward(
            q, k, v, bounds, lists, mask_heads, causal, not causal, scale, True, order,
            persistent=persistent, edge_intervals=edge,
        )  # fmt: skip

    if fp8:
        from flashmask import quantize_fp8

        # Descales per (batch, K/V head), the queries' shared by each head's group.
        q8, q_descale = quantize_fp8(q, group=heads // k.shape[2])
        (k8, k_descale), (v8, v_descale) = (quantize_fp8(x) for x in (k, v))

        def cute(persistent: bool | None = None):
            return launch.forward_fp8(
                q8, k8, v8, bounds, lists, mask_heads, causal, not causal, scale, True, order,
                q_descale, k_descale, v_descale, persistent=persistent, edge_intervals=edge,
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


# Per CuTe kernel: its launcher module, the launcher's cached compile function and the variant
# class of the kernel's module (``kernels/cute_kernels/<kernel>.py``).
KERNEL_SOURCES = {
    "forward": ("launch", "compiled_forward", "ForwardVariant"),
    "backward": ("backward_launch", "compiled_backward", "BackwardVariant"),
}


def source_compiler(path: Path, kernel: str = "forward"):
    """A stand-in for the launcher's compile function of CuTe ``kernel`` (``forward``:
    ``launch.compiled_forward``, ``backward``: ``backward_launch.compiled_backward``) that
    compiles the kernel of another ``<kernel>.py`` at ``path``: the file is loaded as a module
    of its own beside this tree's, each variant (this tree's variant class) is rebuilt as that
    module's from the same fields, and this tree's launcher compiles it with that module
    standing in for ``cute_kernels.<kernel>`` during the compile. The other file may add
    variant fields with defaults; it must keep this tree's fields and the kernel's launch
    arguments. Shared with ``cute_backward.py``."""
    import dataclasses
    import functools
    import importlib
    import importlib.util
    import sys

    launcher_name, compile_name, variant_name = KERNEL_SOURCES[kernel]
    # The launcher first: it sets CUTE_DSL_ARCH before cutlass is first imported.
    launcher = importlib.import_module(f"flashmask.kernels.cute_kernels.{launcher_name}")
    ours = importlib.import_module(f"flashmask.kernels.cute_kernels.{kernel}")
    name = f"{ours.__name__}_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--source-ab: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    compile_ours = getattr(launcher, compile_name).__wrapped__

    @functools.cache
    def compiled(variant, torch_dtype):
        fields = {f.name: getattr(variant, f.name) for f in dataclasses.fields(variant)}
        theirs = getattr(module, variant_name)(**fields)
        sys.modules[ours.__name__] = module
        try:
            return compile_ours(theirs, torch_dtype)
        finally:
            sys.modules[ours.__name__] = ours

    return compiled


def measure_ab(
    head_dims: list[int], kind: str, source: Path | None = None, softcap: float = 0.0,
    rounds: int = 2, fp8: bool = False,
) -> tuple[dict, list[dict]]:  # fmt: skip
    """Per mask, the CuTe forward in two builds, off and on, alternating for ``rounds`` rounds
    on the same inputs, each keeping its best median: ``kind`` ``"persistent_ab"``, the
    persistent variant off and on; ``"source_ab"``, this tree's kernel against ``source``'s
    (:func:`source_compiler`). ``softcap``: both builds with that logit cap; ``fp8``: the FP8
    forward (:func:`inputs`)."""
    import functools

    import torch

    from flashmask.bench import _bench
    from flashmask.kernels.cute_kernels import launch

    ours_compiled, ours_forward = launch.compiled_forward, launch.forward
    theirs_compiled = source_compiler(source) if kind == "source_ab" else ours_compiled
    if softcap:
        launch.forward = functools.partial(ours_forward, softcap=softcap)

    def build(key, cute):
        """The call of build ``key`` (``off``/``on``) on one mask's inputs."""
        if kind == "persistent_ab":
            return lambda: cute(key == "on")

        def call():
            launch.compiled_forward = theirs_compiled if key == "on" else ours_compiled
            try:
                return cute()
            finally:
                launch.compiled_forward = ours_compiled

        return call

    cells = []
    try:
        for d, s, b, heads, name in cases(head_dims):
            _, _, _, _, _, _, flop, cute = inputs(d, s, b, heads, name, fp8)
            cell: dict = {"d": d, "s": s, "b": b, "mask": name}
            calls = {key: build(key, cute) for key in ("off", "on")}
            times: dict[str, list[float]] = {"off": [], "on": []}
            try:
                for _ in range(rounds):
                    for key, fn in calls.items():
                        times[key].append(_bench(fn, 200))
                for key, ms in times.items():
                    cell[key] = {"ms": min(ms), "tflops": flop / min(ms) / 1e9}
                off, on = calls["off"](), calls["on"]()
                cell["max_diff"] = (on[0].float() - off[0].float()).abs().max().item()
            except Exception as exc:  # a failing mask costs only its row
                cell["error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    finally:
        launch.compiled_forward, launch.forward = ours_compiled, ours_forward
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kind": kind,
        "rounds": rounds,
        "softcap": softcap,
        "fp8": fp8,
    }
    if source is not None:
        meta["source"] = str(source)
    return meta, cells


def render_ab(meta: dict, cells: list[dict]) -> str:
    """A markdown table of an off / on A/B (:func:`measure_ab`, or ``cute_backward.py``'s for
    ``meta["kernel"] == "backward"``): the CuTe kernel's TFLOP/s off and on."""
    kernel = meta.get("kernel", "forward")
    if meta.get("kind") == "source_ab":
        what = f"this tree (off) against {meta.get('source', '?')} (on)"
    else:
        what = "persistent variant off / on"
    cap = f"; logit cap {meta['softcap']:g}" if meta.get("softcap") else ""
    dtype = "FP8 (e4m3, per-head descales; bf16 out)" if meta.get("fp8") else "bf16"
    lines = [
        f"# CuTe {kernel}, {what} ({meta.get('gpu', '?')}, torch {meta.get('torch', '?')})",
        "",
        f"{kernel.capitalize()} TFLOP/s (visible pairs), {dtype}, 32K tokens, 2048 = heads x "
        f"head dim; each the best median of {meta.get('rounds', '?')} alternating rounds{cap}.",
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
        help="comma-separated (default 128,256,64; 128 with an A/B; 192 is MLA's Q/K "
        "head dim with V's 128)",
    )
    parser.add_argument("--render", type=Path, help="only render an earlier run's JSON")
    ab = parser.add_mutually_exclusive_group()
    ab.add_argument(
        "--persistent-ab", action="store_true",
        help="time the CuTe forward with its persistent variant off and on instead",
    )  # fmt: skip
    ab.add_argument(
        "--source-ab", type=Path, metavar="FILE",
        help="time this tree's CuTe forward against the one of another forward.py instead",
    )  # fmt: skip
    parser.add_argument(
        "--softcap", type=float, default=0.0, help="a logit cap for both A/B builds (0: none)"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="run the A/B on the FP8 forward (quantised inputs)"
    )
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        ab_kinds = ("persistent_ab", "source_ab")
        show = render_ab if data["meta"].get("kind") in ab_kinds else render
        print(show(data["meta"], data["cells"]), end="")
        return
    kind = "persistent_ab" if args.persistent_ab else "source_ab" if args.source_ab else None
    if args.softcap and kind is None:
        parser.error("--softcap: only with --persistent-ab or --source-ab")
    if args.fp8 and kind is None:
        parser.error("--fp8: only with --persistent-ab or --source-ab")
    if args.fp8 and args.softcap:
        parser.error("--fp8: the FP8 forward takes no logit cap (--softcap)")
    if args.softcap < 0:
        parser.error(f"--softcap must be positive (or 0 for none), got {args.softcap}")
    if args.source_ab is not None and not args.source_ab.is_file():
        parser.error(f"--source-ab: no such file {args.source_ab}")
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the CuTe forward needs a Hopper GPU (--render works anywhere)")
    head_dims = args.head_dims or ("128" if kind else "128,256,64")
    head_dims = [int(x) for x in head_dims.split(",")]
    if kind:
        meta, cells = measure_ab(head_dims, kind, args.source_ab, args.softcap, fp8=args.fp8)
        table = render_ab(meta, cells)
    else:
        meta, cells = measure(head_dims)
        table = render(meta, cells)
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
