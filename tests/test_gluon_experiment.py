"""The Gluon forward experiment (``benchmarks/gluon_forward.py``) compiles for Hopper without a
GPU into a warp-specialised kernel: register reallocation between its partitions, warpgroup MMAs,
TMA loads, bounds loads where there is a mask. Spills are reported by the script, not asserted:
they depend on the Triton version and variant (0-8 bytes).
Whether the kernel computes the right result is for the GPU session to check."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_forward.py"


def test_gluon_forward_compiles_warp_specialised_for_sm90():
    # A process of its own: Gluon cannot be imported where Triton's interpreter is on, as the
    # kernel tests turn it on for the whole test process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--compile-only"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    variants = {(r["head_dim"], r["causal"], r["has_mask"], r["pipeline"]) for r in reports}
    assert len(variants) == 16 and {v[0] for v in variants} == {64, 128}
    for report in reports:
        assert report["setmaxnreg"] > 0, report  # producer and consumers hold different registers
        assert report["warps"] == 12, report  # 8 compute warps + the producer's warpgroup
        assert report["HGMMA"] > 0 and report["UTMALDG"] > 0, report
        if report["has_mask"]:  # partial tiles read the column bounds
            assert report["LDG"] > 16, report
