"""The training examples run end to end on CPU (a few steps each) and learn."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        return importlib.import_module(name)

    return load


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("sft_packed", []),
        ("sft_packed", ["--attn", "sdpa"]),
        ("sft_lora", ["--checkpointing"]),
        ("dpo_shared_prompt", []),
        ("reward_model", []),
    ],
)
def test_example_trains(example, name, argv, capsys):
    if name == "sft_lora":
        pytest.importorskip("peft")
    summary = example(name).main(["--steps", "6", "--device", "cpu", *argv])
    out = capsys.readouterr().out
    assert f"{name} [tiny," in out and "tokens/s" in out and "peak RSS" in out
    assert summary["tokens_per_s"] > 0
    assert summary["last_loss"] < summary["first_loss"]


def test_examples_agree_across_backends(example):
    """Same data, same initial weights: flashmask and SDPA (dense mask) give the same losses."""
    sft = example("sft_packed")
    losses = {
        attn: sft.main(["--steps", "3", "--device", "cpu", "--attn", attn])["last_loss"]
        for attn in ("flashmask", "sdpa")
    }
    assert losses["flashmask"] == pytest.approx(losses["sdpa"], rel=1e-4)


def test_e2e_benchmark_smoke_mode_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    e2e = importlib.import_module("e2e")
    argv = ["--smoke", "--out", str(tmp_path), "--backends", "flashmask", "sdpa"]
    argv += [
        "--seqlens",
        "64",
        "--dpo-seqlen",
        "96",
        "--longest-start",
        "64",
        "--longest-max",
        "128",
    ]
    assert e2e.main(argv) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    sft = [(row["backend"], row["status"]) for row in report["sft"]]
    assert sft == [("flashmask", "ok"), ("sdpa", "ok"), ("no_attention", "ok")]
    dpo = [(row["layout"], row["backend"], row["status"]) for row in report["dpo"]]
    assert dpo == [
        ("shared prompt", "flashmask", "ok"),
        ("shared prompt", "sdpa", "ok"),
        ("separate sequences", "sdpa", "ok"),
    ]
    # float32 on CPU: both layouts give the same log-probs and loss.
    equality = report["dpo_equality"]
    assert equality["max_rel_logp_diff"] < 1e-5
    assert abs(equality["loss_shared_flashmask"] - equality["loss_separate_sdpa"]) < 1e-5
    assert [row["longest_seqlen"] for row in report["longest"]] == [128, 128]
    assert "| 64 | flashmask |" in (tmp_path / "e2e.md").read_text()
