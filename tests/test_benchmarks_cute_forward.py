"""``benchmarks/cute_forward.py`` on CPU: the tables it renders from a run's JSON (rates, the
CuTe forward's ratios to the routed forward and FlashMask-4, dashes where a peer failed; the
persistent variant's A/B: off, on and their ratio), and ``--render`` picking the right one."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("cute_forward")


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


AB_CELLS = [
    {"d": 128, "s": 8192, "b": 4, "mask": "document", "off": {"ms": 1.0, "tflops": 400.0},
     "on": {"ms": 0.9, "tflops": 432.0}, "max_diff": 0.0},
    {"d": 128, "s": 32768, "b": 1, "mask": "causal", "error": "RuntimeError: no"},
]  # fmt: skip


def test_render_persistent_ab_gives_off_on_and_their_ratio(script):
    table = script.render_persistent_ab({"gpu": "GPU X", "torch": "2.x", "rounds": 2}, AB_CELLS)
    assert "GPU X" in table and "best median of 2 alternating rounds" in table
    rows = [line for line in table.splitlines() if line.startswith("| 128")]
    assert rows[0] == "| 128 | 8192 | document | 400 | 432 | 1.080 | 0 |"
    assert rows[1] == "| 128 | 32768 | causal | — | — | — | error |"


def test_render_option_picks_the_table_of_the_run(script, tmp_path, monkeypatch, capsys):
    run = tmp_path / "ab.json"
    run.write_text(json.dumps({"meta": {"kind": "persistent_ab", "rounds": 2}, "cells": AB_CELLS}))
    monkeypatch.setattr(sys, "argv", ["cute_forward.py", "--render", str(run)])
    script.main()
    assert "| mask | off | on | on/off |" in capsys.readouterr().out
    run.write_text(json.dumps({"meta": {}, "cells": []}))
    script.main()
    assert "| cute | routed | fm4 |" in capsys.readouterr().out
