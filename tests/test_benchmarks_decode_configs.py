"""``benchmarks/decode_configs.py`` on CPU: the table it renders from a run's JSON (each time
over SDPA's better time of its two, a dash where a cell lacks a configuration) and its refusal
to time anything without CUDA."""

from __future__ import annotations

import json
import sys

import pytest
import torch


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("decode_configs")


CELLS = [
    {"sk": 8192, "b": 1, "sdpa": 22.0, "default": 22.0, "n128": 21.0, "sdpa2": 20.0},
    {"sk": 131072, "b": 1, "sdpa": 140.0, "default": 147.0, "n128": 140.0, "sw_n128": 14.0,
     "sdpa2": 141.0},
]  # fmt: skip


def test_render_divides_by_sdpas_better_time_and_marks_missing_cells(script):
    table = script.render({"gpu": "GPU X", "torch": "2.x", "default": "n64"}, CELLS)
    assert "GPU X" in table and "`default`: n64" in table
    rows = [line for line in table.splitlines() if line.startswith("| 8192") or "131072" in line]
    assert rows[0] == "| 8192 | 1 | 20.0 | 1.100 | 1.050 | — |"
    assert rows[1] == "| 131072 | 1 | 140.0 | 1.050 | 1.000 | 0.100 |"


def test_render_flag_prints_an_earlier_runs_table(script, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "GPU X"}, "cells": CELLS}))
    monkeypatch.setattr(sys, "argv", ["decode_configs.py", "--render", str(run)])
    script.main()
    assert "| 131072 | 1 | 140.0 |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_timing_without_cuda_exits_with_a_message(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode_configs.py", "--out", "x"])
    with pytest.raises(SystemExit):
        script.main()
    assert "needs a CUDA GPU" in capsys.readouterr().err
