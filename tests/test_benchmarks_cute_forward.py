"""``benchmarks/cute_forward.py`` on CPU: the tables it renders from a run's JSON (rates, the
CuTe forward's ratios to the routed forward and FlashMask-4, dashes where a peer failed; the
persistent variant's A/B: off, on and their ratio), and ``--render`` picking the right one."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
from pathlib import Path

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
    table = script.render_ab({"gpu": "GPU X", "torch": "2.x", "rounds": 2}, AB_CELLS)
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


def test_render_ab_names_the_other_source_and_the_cap(script):
    meta = {"gpu": "GPU X", "kind": "source_ab", "source": "lever/forward.py", "rounds": 2}
    table = script.render_ab({**meta, "softcap": 30.0}, AB_CELLS)
    assert "this tree (off) against lever/forward.py (on)" in table
    assert "alternating rounds; logit cap 30." in table
    assert "logit cap" not in script.render_ab({**meta, "softcap": 0.0}, AB_CELLS)
    assert ", bf16, 32K tokens" in table
    assert ", FP8 (e4m3, per-head descales; bf16 out), 32K" in script.render_ab(
        {**meta, "fp8": True}, AB_CELLS
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--softcap", "30"], "--softcap: only with --persistent-ab or --source-ab"),
        (["--persistent-ab", "--softcap", "-1"], "--softcap must be positive"),
        (["--source-ab", "no/such/forward.py"], "--source-ab: no such file"),
        (["--source-ab", "f.py", "--persistent-ab"], "not allowed with argument"),
        (["--fp8"], "--fp8: only with --persistent-ab or --source-ab"),
        (["--persistent-ab", "--fp8", "--softcap", "30"], "--fp8: the FP8 forward takes no"),
    ],
)
def test_bad_ab_options_are_refused_naming_the_option(script, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["cute_forward.py", *argv])
    with pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err


# Appended to a copy of the tree's forward.py: every compiled HopperForward records its variant.
RECORDER = """

COMPILED = []
_compile_init = HopperForward.__init__


def _recording_init(self, variant):
    COMPILED.append(variant)
    _compile_init(self, variant)


HopperForward.__init__ = _recording_init
"""


def test_source_compiler_compiles_the_other_forward_with_its_own_variant(script, tmp_path):
    """The other ``forward.py`` is compiled, for this tree's variant rebuilt as its own, and
    this tree's module is back in place afterwards (CPU compile for sm_90a)."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the flashmask[cute] extra (nvidia-cutlass-dsl)")
    import torch

    # The launcher first: it sets CUTE_DSL_ARCH before cutlass is imported.
    from flashmask.kernels.cute_kernels import launch

    forward = importlib.import_module("flashmask.kernels.cute_kernels.forward")

    copy = tmp_path / "forward.py"
    copy.write_text(Path(forward.__file__).read_text() + RECORDER)
    compiled = script.source_compiler(copy)
    variant = forward.ForwardVariant(
        head_dim=128, block_n=launch.key_tile(128), kv_stages=launch.KV_STAGES[128],
        causal=True, has_mask=False, has_upper=False, mask_full_tiles=False, ordered=False,
    )  # fmt: skip
    assert compiled(variant, torch.bfloat16) is not None
    assert compiled(variant, torch.bfloat16) is compiled(variant, torch.bfloat16)  # cached
    theirs = sys.modules["flashmask.kernels.cute_kernels.forward_under_test"]
    (seen,) = theirs.COMPILED
    assert type(seen) is theirs.ForwardVariant and type(seen) is not forward.ForwardVariant
    assert dataclasses.asdict(seen) == dataclasses.asdict(variant)
    assert sys.modules["flashmask.kernels.cute_kernels.forward"] is forward


def test_example_mask_gives_the_bounds_of_both_benchmarks(script):
    """Full and causal attention have no bounds; random_eviction one mask per head, the other
    masks one for all heads (the same mask in every call: the generator is seeded)."""
    assert script.example_mask("full", 256, 2, 4, "cpu") == (None, False)
    assert script.example_mask("causal", 256, 2, 4, "cpu") == (None, True)
    sri, causal = script.example_mask("random_eviction", 256, 2, 4, "cpu")
    assert sri.shape[:2] == (2, 4) and sri.shape[2] == 256
    sri, causal = script.example_mask("document", 256, 2, 4, "cpu")
    again, _ = script.example_mask("document", 256, 2, 4, "cpu")
    assert sri.shape[:3] == (2, 1, 256) and not causal and sri.equal(again)
