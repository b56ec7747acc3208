"""``benchmarks/fp8_accuracy.py``: FP8 attention's error on FlashAttention-3's outlier inputs.
At a small size on the CPU: every method has its row, FP8 is coarser than bf16, and rotating q
and k before quantising lowers the error where outlier channels are present (what the
published figure it is compared with shows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("fp8_accuracy")


def test_rotation_lowers_the_error_on_outlier_inputs(script, tmp_path):
    out = tmp_path / "acc"
    script.main(["--seqlen", "256", "--heads", "2", "--fraction", "0.01", "--out", str(out)])
    rows = {r["method"]: r["rmse"] for r in json.loads(Path(f"{out}.json").read_text())["rows"]}
    assert len(rows) == 5
    bf16 = rows["bf16 inputs, float32 compute"]
    for granularity in ("tensor", "head"):
        plain = rows[f"FP8, per {granularity}"]
        rotated = rows[f"FP8, per {granularity}, q and k rotated"]
        assert bf16 < rotated < plain
    assert Path(f"{out}.md").read_text().count("| FP8") == 4


def test_outliers_are_the_requested_share_and_spread(script):
    q, k, v = script.outlier_inputs(1, 512, 4, 64, 0.01, 10.0, seed=1)
    assert q.shape == k.shape == v.shape == (1, 512, 4, 64)
    large = (q.abs() > 6).double().mean().item()  # N(0, 1) almost never exceeds 6
    assert 0.004 < large < 0.012
