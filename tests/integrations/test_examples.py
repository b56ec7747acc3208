"""The examples run end to end on CPU: the training ones (a few steps each) learn, the
generation one streams with a bounded cache."""

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


def test_generation_example_streams_with_a_bounded_cache(example, capsys):
    """examples/generate_window_sinks.py: ragged left-padded prompts (1 to 120 tokens) under a
    window of 32 plus 4 sinks; each row's cache is bounded and rows equal their solo runs."""
    summary = example("generate_window_sinks").main(["--device", "cpu", "--new-tokens", "16"])
    out = capsys.readouterr().out
    assert "generate_window_sinks [tiny, cpu, float32]" in out and "tokens/s" in out
    assert summary["tokens_per_s"] > 0
    # tiny config: 2 layers, 4 rows, k + v of 2 kv heads x 16 dims in float32 per key.
    per_key = 2 * 2 * 16 * 4
    assert summary["cache_bytes"] == 2 * 4 * (32 + 4) * per_key
    # Without eviction: the 120 padded prompt columns and 15 decoded tokens in the cache.
    assert summary["full_cache_bytes"] == 2 * 4 * (120 + 15) * per_key
    assert summary["rows_equal_alone"] == 4


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
