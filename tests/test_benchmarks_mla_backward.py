"""``benchmarks/mla_backward.py`` on the CPU (the Triton interpreter runs both backwards
there, so two masks at 64 tokens): one row per (length, mask) with both timings, their ratio
and the gradients' differences, and its Markdown table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("mla_backward")


def test_cpu_run_writes_a_row_per_mask_with_equal_gradients(script, tmp_path):
    out = tmp_path / "mla"
    args = ["--seqlens", "64", "--tokens", "64", "--heads", "2", "--device", "cpu"]
    script.main([*args, "--masks", "full,causal_document", "--out", str(out)])
    rows = json.loads(Path(f"{out}.json").read_text())
    assert [r["mask"] for r in rows] == ["full", "causal_document"]
    for row in rows:
        assert row["triton_ms"] > 0 and row["gluon_ms"] > 0
        assert row["speedup"] == row["triton_ms"] / row["gluon_ms"]
        # On the CPU both configurations run the same reference.
        assert row["dq_diff"] == row["dk_diff"] == row["dv_diff"] == 0.0
    table = Path(f"{out}.md").read_text()
    assert table.count("\n") == 4 and "| 64 | full |" in table
