"""``benchmarks/cute_backward.py`` on CPU: the table it renders from a run's JSON (rates, the
CuTe backward's ratios to the Gluon backward and FlashMask-4, dashes where one failed), and
that it refuses to time without a GPU."""

from __future__ import annotations

import sys

import pytest
import torch


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("cute_backward")


def test_render_gives_rates_and_ratios_and_marks_failures(script):
    cells = [
        {"s": 8192, "mask": "full", "cute": {"tflops": 500.0}, "gluon": {"tflops": 550.0},
         "fm4": {"tflops": 600.0}, "max_diff": 0.000244140625},
        {"s": 32768, "mask": "causal", "cute": {"error": "RuntimeError: no"},
         "gluon": {"tflops": 570.0}, "max_diff": "RuntimeError: no"},
    ]  # fmt: skip
    table = script.render({"gpu": "GPU X", "torch": "2.x"}, cells)
    assert "GPU X" in table and "hd128" in table
    rows = [line for line in table.splitlines() if line.startswith(("| 8192", "| 32768"))]
    assert rows[0] == "| 8192 | full | 500 | 550 | 600 | 0.91 | 0.83 | 0.000244 |"
    assert rows[1] == "| 32768 | causal | — | 570 | — | — | — | error |"


def test_it_refuses_to_time_without_a_gpu(script, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(sys, "argv", ["cute_backward.py"])
    with pytest.raises(SystemExit):
        script.main()
    assert "needs a Hopper GPU" in capsys.readouterr().err
