"""Two versions of the Gluon forward in one run: the library's ``kernels.gluon_fwd`` against
another ``gluon_fwd.py`` (an earlier commit's, loaded as a second module), interleaved, on all
12 bench masks at 8K and 32K, hd128, with the library's lists and launch order.

Across device calls the same kernel's time moves by up to ~5% (the twenty-second session's
runs), more than most kernel changes are worth; timing both versions in one process, A and B
alternating, is what separates them. Outputs are compared bitwise (a change to the schedule
must not change a bit). ``--persistent`` also times the library's module with its
``PERSISTENT`` flag at 0 and 1, where the version has one.

Usage (H200): ``git show COMMIT:src/flashmask/kernels/gluon_fwd.py > base_gluon_fwd.py``
(here: the device has no git history), then ``PYTHONPATH=src python
benchmarks/gluon_forward_versions.py --baseline base_gluon_fwd.py``. The twenty-second
session's logs ``gluon_forward_{persistent,dynamic}_vs_s21_s22.log`` came from this
comparison against commit 7cc4f74.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import triton
from bench_cases import mask_case
from gluon_forward import library_preparation

from flashmask import kernels, masks
from flashmask.kernels import gluon_fwd


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_gluon_fwd", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--baseline: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="path of the other gluon_fwd.py")
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument("--masks", default=",".join(masks.MASK_TYPES))
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args()
    base = _load(args.baseline)
    forms = {"library": None}
    if args.persistent:
        if not hasattr(gluon_fwd, "PERSISTENT"):
            parser.error("--persistent: this gluon_fwd has no PERSISTENT flag")
        forms = {"per-tile": 0, "persistent": 1}
    d, h = 128, 16
    block_n, slots = kernels.gluon_forward_tiles(d)
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 32768 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        for name in args.masks.split(","):
            _, sri, causal = mask_case(name, s, b)
            bounds, lists, hm, order = library_preparation(q, k, sri, causal, block_n)
            call = (q, k, v, bounds, lists, hm, causal, d**-0.5, True, block_n, slots)

            def run_base(call=call, order=order):
                return base.forward(*call, order=order)

            def run_form(flag, call=call, order=order):
                if flag is not None:
                    gluon_fwd.PERSISTENT = flag
                return gluon_fwd.forward(*call, order=order)

            want = run_base()
            same = all(
                torch.equal(x, y)
                for flag in forms.values()
                for x, y in zip(run_form(flag), want, strict=True)
            )
            best = {label: float("inf") for label in ("baseline", *forms)}
            for _ in range(2):  # interleaved, the best of two for each
                best["baseline"] = min(
                    best["baseline"], triton.testing.do_bench(run_base, rep=args.rep_ms)
                )
                for label, flag in forms.items():
                    ms = triton.testing.do_bench(lambda f=flag: run_form(f), rep=args.rep_ms)
                    best[label] = min(best[label], ms)
            line = f"S={s} {name:22s} baseline {best['baseline']:.3f} ms"
            for label in forms:
                line += f" | {label} {best[label]:.3f} ({best['baseline'] / best[label]:.3f}x)"
            print(f"{line} | bitwise {same}", flush=True)


if __name__ == "__main__":
    main()
