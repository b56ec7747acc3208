"""Versions of the Gluon forward in one run: the library's ``kernels.gluon_fwd`` (or other
``gluon_fwd.py`` files, each loaded as its own module) against a baseline ``gluon_fwd.py`` (an
earlier commit's), interleaved, on the 12 bench masks at 8K and 32K, hd128, with the library's
lists and launch order; the Triton forward is timed beside them (the library's route for
masks below ``routing.GLUON_FWD_MIN_MASKED_SEQLEN`` keys).

Across device calls the same kernel's time moves by up to ~5% (the twenty-second session's
runs), more than most kernel changes are worth; timing the versions in one process, in turn,
is what separates them. Outputs are compared bitwise with the baseline's (a change to the
schedule must not change a bit). The version timed first in a round rotates: in the first
A/B (twenty-third session) the baseline, always first after a case's setup, was up to 9%
faster than the candidates on full 8K. A copy of the baseline's file among the candidates
measures the noise. A version with a ``PERSISTENT`` flag is timed with it at 0
(one program per query tile) and at 1 (one program per SM).

Usage (H200): ``git show COMMIT:src/flashmask/kernels/gluon_fwd.py > base_gluon_fwd.py``
(here: the device has no git history), then ``PYTHONPATH=src python
benchmarks/gluon_forward_versions.py --baseline base_gluon_fwd.py [--candidates a.py,library]``.
The twenty-second session's logs ``gluon_forward_{persistent,dynamic}_vs_s21_s22.log`` came
from this comparison (one candidate, the library's) against commit 7cc4f74.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
from dataclasses import replace

import torch
import triton
from bench_cases import mask_case
from gluon_forward import library_preparation

from flashmask import kernels, masks
from flashmask.kernels import routing
from flashmask.kernels.gluon_kernels import forward as gluon_fwd


def _load(path: str, option: str):
    name = "version_" + pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{option}: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(text: str) -> tuple[dict[str, int], int | None]:
    """``"Q_BUFFERS=2+slots=2"`` -> ``({"Q_BUFFERS": 2}, 2)``: module constants to set for a
    candidate's calls, and the K/V slots to launch it with (``slots``; ``None``: the
    launcher's)."""
    settings, slots = {}, None
    for item in filter(None, text.split("+")):
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise ValueError(f"--candidates: expected NAME=INT after '@', got {item!r}")
        if name == "slots":
            slots = int(value)
        else:
            settings[name] = int(value)
    return settings, slots


def _forms(candidates: list[str]) -> dict[str, tuple]:
    """``label -> (module, constants to set, K/V slots or None)`` for each candidate and form:
    a candidate is a ``gluon_fwd.py`` path or ``library``, optionally followed by
    ``@NAME=INT+...`` (module constants for its calls, ``slots=N`` for its K/V slots); one with
    a ``PERSISTENT`` flag that the candidate does not set is timed with it at 0 and at 1."""
    forms = {}
    for candidate in candidates or ["library"]:
        path, _, extra = candidate.partition("@")
        settings, slots = _settings(extra)
        if path == "library":
            module, label = gluon_fwd, "library"
        else:
            module, label = _load(path, "--candidates"), pathlib.Path(path).stem
        missing = [name for name in settings if not hasattr(module, name)]
        if missing:
            raise ValueError(f"--candidates: {label} has no {missing}")
        label += f"@{extra}" if extra else ""
        if hasattr(module, "PERSISTENT") and "PERSISTENT" not in settings:
            forms[f"{label}/per-tile"] = (module, {**settings, "PERSISTENT": 0}, slots)
            forms[f"{label}/persistent"] = (module, {**settings, "PERSISTENT": 1}, slots)
        else:
            forms[label] = (module, settings, slots)
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="path of the baseline gluon_fwd.py")
    parser.add_argument(
        "--candidates",
        default="",
        help="gluon_fwd.py files to time, 'library' for the library's (the default); each may "
        "end in @NAME=INT+... (module constants for its calls; slots=N: its K/V slots)",
    )
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument("--masks", default=",".join(masks.MASK_TYPES))
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument(
        "--rounds", type=int, default=3, help="timings of each version (the first rotating)"
    )
    args = parser.parse_args()
    base = _load(args.baseline, "--baseline")
    forms = _forms([p for p in args.candidates.split(",") if p])
    d, h = 128, 16
    block_n, slots = routing.gluon_forward_tiles(d)
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 32768 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        for name in args.masks.split(","):
            mask, sri, causal = mask_case(name, s, b)
            bounds, lists, hm, order = library_preparation(q, k, sri, causal, block_n)
            call = (q, k, v, bounds, lists, hm, causal, d**-0.5, True, block_n, slots)
            cfg = replace(kernels.tile_config(d, has_mask=mask is not None), fwd_gluon=False)

            def run_triton(sri=sri, causal=causal, cfg=cfg):
                return kernels.forward(q, k, v, sri, causal, d**-0.5, config=cfg)

            def run_base(call=call, order=order):
                return base.forward(*call, order=order)

            def run_form(module, settings, slots, call=call, order=order):
                previous = {name: getattr(module, name) for name in settings}
                for name, value in settings.items():
                    setattr(module, name, value)
                try:
                    launch = call if slots is None else (*call[:-1], slots)
                    return module.forward(*launch, order=order)
                finally:
                    for name, value in previous.items():
                        setattr(module, name, value)

            want = run_base()
            same = all(
                torch.equal(x, y)
                for form in forms.values()
                for x, y in zip(run_form(*form), want, strict=True)
            )
            runs = {"baseline": run_base, **{
                label: (lambda form=form: run_form(*form)) for label, form in forms.items()
            }}  # fmt: skip
            best = dict.fromkeys(runs, float("inf"))
            labels = list(runs)
            for r in range(args.rounds):  # in turn, the first one rotating; the best of each
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    ms = triton.testing.do_bench(runs[label], rep=args.rep_ms)
                    best[label] = min(best[label], ms)
            triton_ms = triton.testing.do_bench(run_triton, rep=args.rep_ms)
            line = f"S={s} {name:22s} triton {triton_ms:.3f} ms | baseline {best['baseline']:.3f}"
            for label in forms:
                line += f" | {label} {best[label]:.3f} ({best['baseline'] / best[label]:.3f}x)"
            print(f"{line} | bitwise {same}", flush=True)


if __name__ == "__main__":
    main()
