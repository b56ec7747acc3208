"""Versions of the Gluon forward in one run: the library's ``kernels.gluon_fwd`` (or other
``gluon_fwd.py`` files, each loaded as its own module) against a baseline ``gluon_fwd.py`` (an
earlier commit's), interleaved, on the 12 bench masks at 8K and 32K, hd128, with the library's
lists and launch order; the Triton forward is timed beside them (the library's route for
masks below ``kernels.GLUON_FWD_MIN_MASKED_SEQLEN`` keys).

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
from flashmask.kernels import gluon_fwd


def _load(path: str, option: str):
    name = "version_" + pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{option}: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forms(candidates: list[str]) -> dict[str, tuple]:
    """``label -> (module, PERSISTENT value or None)`` for each candidate and form."""
    modules = {}
    for path in candidates or ["library"]:
        if path == "library":
            modules["library"] = gluon_fwd
        else:
            modules[pathlib.Path(path).stem] = _load(path, "--candidates")
    forms = {}
    for label, module in modules.items():
        if hasattr(module, "PERSISTENT"):
            forms[f"{label}/per-tile"] = (module, 0)
            forms[f"{label}/persistent"] = (module, 1)
        else:
            forms[label] = (module, None)
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="path of the baseline gluon_fwd.py")
    parser.add_argument(
        "--candidates",
        default="",
        help="gluon_fwd.py files to time, 'library' for the library's (the default)",
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
    block_n, slots = kernels.gluon_forward_tiles(d)
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

            def run_form(module, flag, call=call, order=order):
                if flag is not None:
                    module.PERSISTENT = flag
                return module.forward(*call, order=order)

            want = run_base()
            same = all(
                torch.equal(x, y)
                for module, flag in forms.values()
                for x, y in zip(run_form(module, flag), want, strict=True)
            )
            runs = {"baseline": run_base, **{
                label: (lambda m=m, f=f: run_form(m, f)) for label, (m, f) in forms.items()
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
