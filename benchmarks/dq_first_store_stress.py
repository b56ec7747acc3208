"""Repeat the Gluon backward with ``gluon_bwd.DQ_FIRST_STORE`` on and compare every call's dQ
with the zeroed-accumulator form's: a lost update (a tile's reduce-add landing before its first
writer's store) shows as a relative difference of the order of one key tile's share of a dQ
row, far above the ~1e-4 that fp32 additions in another order give.

    PYTHONPATH=src python benchmarks/dq_first_store_stress.py --seqlens 8192 --repeats 30

Per case: the largest relative difference of dQ over the repeats, against the shipped form's
dQ and against its own first call, and whether dK/dV stayed bitwise equal (they do not depend
on the dQ writes). Exits non-zero if any difference exceeds ``--limit``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from bench_cases import backward_cases, relative_error
from gluon_backward import set_constants

from flashmask import kernels
from flashmask.kernels import routing
from flashmask.kernels.gluon_kernels import backward as gluon_bwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument(
        "--masks", default="sliding_window,share_question,causal_document,document,full,causal"
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--limit", type=float, default=5e-3)
    parser.add_argument("--form", type=int, choices=(1, 2), default=1, help="DQ_FIRST_STORE")
    args = parser.parse_args()
    routing.GLUON_BWD_MIN_MASKED_SEQLEN = {}
    failed = False
    seqlens = [int(s) for s in args.seqlens.split(",")]
    for case in backward_cases(seqlens, args.masks.split(","), 32768, 2048, 128):
        config = replace(kernels.tile_config(128, has_mask=case.sri is not None), bwd_gluon=True)
        shipped = case.run_backward(False, config)
        saved = set_constants(gluon_bwd, {"DQ_FIRST_STORE": args.form})
        try:
            first = case.run_backward(False, config)
            worst_vs_shipped = worst_vs_first = 0.0
            dkdv_equal = True
            for _ in range(args.repeats):
                got = case.run_backward(False, config)
                worst_vs_shipped = max(worst_vs_shipped, relative_error(got[0], shipped[0]))
                worst_vs_first = max(worst_vs_first, relative_error(got[0], first[0]))
                dkdv_equal &= all(
                    torch.equal(a, b) for a, b in zip(got[1:], shipped[1:], strict=True)
                )
        finally:
            set_constants(gluon_bwd, saved)
        bad = max(worst_vs_shipped, worst_vs_first) > args.limit or not dkdv_equal
        failed |= bad
        print(
            f"S={case.seqlen} {case.name:16s} form {args.form}, {args.repeats} calls: dq rel "
            f"diff max "
            f"{worst_vs_shipped:.1e} vs shipped, {worst_vs_first:.1e} vs its first call; "
            f"dk/dv bitwise {dkdv_equal}{'  FAIL' if bad else ''}",
            flush=True,
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
