"""The Gluon backward experiment (``benchmarks/gluon_backward.py``) compiles for Hopper without a
GPU into a warp-specialised kernel: register reallocation between its partitions, warpgroup MMAs
(four per tile for dK/dV, a fifth for dQ), TMA loads, and dQ atomics in the modes that add dQ.
Spills are reported by the script, not asserted: they depend on the Triton version and variant.
Whether the kernel computes the right result is for the GPU session to check (its log in
``benchmarks/results/``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_backward.py"


def test_gluon_backward_compiles_warp_specialised_for_sm90():
    # A process of its own: Gluon cannot be imported where Triton's interpreter is on, as the
    # kernel tests turn it on for the whole test process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--compile-only"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    variants = {
        (
            r["head_dim"],
            r["causal"],
            r["has_mask"],
            r["accumulate_dq"],
            r["dq_vec4"],
            r["dq_writer"],
        )
        for r in reports
    }
    assert len(variants) == 40 and {v[0] for v in variants} == {64, 128}
    for report in reports:
        assert report["setmaxnreg"], report  # producer and consumers hold different registers
        assert report["warps"] == (16 if report["dq_writer"] == 4 else 12), report
        assert report["UTMALDG"] > 0, report
        matmuls = 5 if report["accumulate_dq"] else 4
        # One wgmma per 64-row warpgroup tile and k-step group: at least one HGMMA per matmul.
        assert report["HGMMA"] >= matmuls * 4, report
        assert (report["REDG"] > 0) == report["accumulate_dq"], report
