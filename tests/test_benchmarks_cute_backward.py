"""``benchmarks/cute_backward.py`` on CPU: the table it renders from a run's JSON (rates, the
CuTe backward's ratios to the Gluon backward and FlashMask-4, dashes where one failed), that it
refuses to time without a GPU, its ``--source-ab`` mode (the off / on table, a missing file
refused, another ``backward.py`` compiled in its own module) and its ``--deterministic`` table
(the variant's rate beside the plain kernel's, a run that did not repeat marked)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

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


def rendered(script, tmp_path, monkeypatch, capsys, meta: dict, cells: list[dict]) -> str:
    """The table ``--render`` prints for a run's JSON of ``meta`` and ``cells``."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": meta, "cells": cells}))
    monkeypatch.setattr(sys, "argv", ["cute_backward.py", "--render", str(run)])
    script.main()
    return capsys.readouterr().out


def test_a_source_ab_run_renders_as_the_backward_table(script, tmp_path, monkeypatch, capsys):
    cells = [
        {"d": 128, "s": 8192, "b": 4, "mask": "full", "off": {"ms": 1.0, "tflops": 530.0},
         "on": {"ms": 0.95, "tflops": 557.9}, "max_diff": 0.000244140625},
    ]  # fmt: skip
    meta = {"kind": "source_ab", "kernel": "backward", "source": "lever/backward.py", "rounds": 2}
    table = rendered(script, tmp_path, monkeypatch, capsys, meta, cells)
    assert "# CuTe backward, this tree (off) against lever/backward.py (on)" in table
    assert "Backward TFLOP/s" in table
    assert "| 128 | 8192 | full | 530 | 558 | 1.053 | 0.000244 |" in table


def test_a_deterministic_run_renders_both_rates_and_whether_it_repeated(
    script, tmp_path, monkeypatch, capsys
):
    cells = [
        {"d": 128, "s": 8192, "b": 4, "mask": "full", "cute": {"ms": 1.0, "tflops": 500.0},
         "cute_det": {"ms": 1.1, "tflops": 450.0}, "repeats": True, "max_diff": 0.000244140625},
        {"d": 128, "s": 8192, "b": 4, "mask": "causal", "cute": {"ms": 1.0, "tflops": 480.0},
         "cute_det": {"ms": 1.2, "tflops": 400.0}, "repeats": False, "max_diff": 0.00048828125},
        {"d": 128, "s": 32768, "b": 1, "mask": "document", "error": "RuntimeError: no"},
    ]  # fmt: skip
    meta = {"kind": "deterministic", "rounds": 2}
    table = rendered(script, tmp_path, monkeypatch, capsys, meta, cells)
    assert "deterministic variant against the plain kernel" in table
    assert "| 8192 | full | 500 | 450 | 0.90 | yes | 0.000244 |" in table
    assert "| 8192 | causal | 480 | 400 | 0.83 | **no** | 0.000488 |" in table
    assert "| 32768 | document | — | — | — | — | error |" in table


def test_the_deterministic_mode_and_a_source_ab_exclude_each_other(script, monkeypatch, capsys):
    argv = ["cute_backward.py", "--deterministic", "--source-ab", "lever/backward.py"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        script.main()
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_missing_source_is_refused_naming_the_option(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cute_backward.py", "--source-ab", "no/such/backward.py"])
    with pytest.raises(SystemExit):
        script.main()
    assert "--source-ab: no such file" in capsys.readouterr().err


def test_the_backward_source_compiler_compiles_the_other_file(script, tmp_path):
    """The other ``backward.py`` compiles for this tree's variant rebuilt as its own, and this
    tree's module is back in place afterwards (CPU compile for sm_90a)."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the flashmask[cute] extra (nvidia-cutlass-dsl)")
    # The launcher first: it sets CUTE_DSL_ARCH before cutlass is imported.
    from flashmask.kernels.cute_kernels import backward_launch  # noqa: F401

    backward = importlib.import_module("flashmask.kernels.cute_kernels.backward")
    copy = tmp_path / "backward.py"
    copy.write_text(Path(backward.__file__).read_text() + "\nMARK = 1\n")
    compiled = script.source_compiler(copy, "backward")
    variant = backward.BackwardVariant(128, True, False, False, False, False)
    assert compiled(variant, torch.bfloat16) is not None
    theirs = sys.modules["flashmask.kernels.cute_kernels.backward_under_test"]
    assert theirs.MARK == 1 and theirs is not backward
    assert sys.modules["flashmask.kernels.cute_kernels.backward"] is backward
