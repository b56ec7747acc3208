"""``benchmarks/cute_forward.py`` on CPU: the table it renders from a run's JSON (rates, the
CuTe forward's ratios to the routed forward and FlashMask-4, dashes where a peer failed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("cute_forward")


def test_render_gives_rates_and_ratios_and_marks_failed_peers(script):
    cells = [
        {"d": 128, "s": 8192, "mask": "full", "cute": {"tflops": 600.0},
         "routed": {"tflops": 500.0}, "fm4": {"tflops": 650.0}, "max_diff": 0.0078125},
        {"d": 256, "s": 8192, "mask": "causal", "cute": {"tflops": 400.0},
         "routed": {"tflops": 400.0}, "fm4": {"error": "RuntimeError: no"}, "max_diff": "x"},
    ]  # fmt: skip
    table = script.render({"gpu": "GPU X", "torch": "2.x"}, cells)
    assert "GPU X" in table
    rows = [line for line in table.splitlines() if line.startswith("| 128") or "| 256" in line]
    assert rows[0] == "| 128 | 8192 | full | 600 | 500 | 650 | 1.20 | 0.92 | 0.00781 |"
    assert rows[1] == "| 256 | 8192 | causal | 400 | 400 | — | 1.00 | — | error |"
