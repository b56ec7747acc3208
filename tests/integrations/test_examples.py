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


@pytest.fixture
def e2e(monkeypatch):
    """benchmarks/e2e.py as a module."""
    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    return importlib.import_module("e2e")


# Short rows keep each smoke run to a few seconds on CPU.
E2E_SIZES = [
    "--seqlens",
    "64",
    "--dpo-seqlen",
    "96",
    "--longest-start",
    "64",
    "--longest-max",
    "128",
]


def test_e2e_benchmark_smoke_mode_writes_its_report(e2e, tmp_path):
    argv = ["--smoke", "--out", str(tmp_path), "--backends", "flashmask", "sdpa", *E2E_SIZES]
    assert e2e.main(argv) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["meta"]["model_style"] == "llama"
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
    assert abs(equality["loss_shared_flashmask"] - equality["loss_separate"]) < 1e-5
    assert [row["longest_seqlen"] for row in report["longest"]] == [128, 128]
    text = (tmp_path / "e2e.md").read_text()
    assert "tiny Llama-style model" in text and "| 64 | flashmask |" in text


def test_e2e_benchmark_gpt_oss_skips_the_backends_without_sinks(e2e, tmp_path, monkeypatch):
    """gpt-oss style: flashmask trains it with its sinks and sliding layers; transformers
    refuses sdpa and runs flex_attention's sinks on CUDA only, so those rows say why they were
    skipped, and the separate-rows DPO baseline falls back to eager."""
    # A window wider than the rows: the shared and separate DPO layouts are then the same
    # computation (a narrower one counts row indices, which differ between them).
    tiny = {**e2e.MODELS["gpt_oss"]["tiny"], "sliding_window": 4096}
    monkeypatch.setitem(e2e.MODELS["gpt_oss"], "tiny", tiny)
    argv = ["--smoke", "--model", "gpt_oss", "--out", str(tmp_path), *E2E_SIZES]
    assert e2e.main(argv) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    meta = report["meta"]
    assert (meta["model_style"], meta["model_class"]) == ("gpt_oss", "GptOssForCausalLM")
    assert meta["attention_sinks"] and meta["sliding_window"] == 4096
    assert meta["parameters_per_token"] < meta["parameters"]  # 2 of 4 experts per token
    assert meta["skipped_backends"].keys() == {"sdpa", "flex_attention"}
    sft = [(row["backend"], row["status"].split(":")[0]) for row in report["sft"]]
    assert sft == [
        ("flashmask", "ok"),
        ("sdpa", "skipped"),
        ("flex_attention", "skipped"),
        ("no_attention", "ok"),
    ]
    dpo = [(row["layout"], row["backend"], row["status"].split(":")[0]) for row in report["dpo"]]
    assert dpo == [
        ("shared prompt", "flashmask", "ok"),
        ("shared prompt", "sdpa", "skipped"),
        ("shared prompt", "flex_attention", "skipped"),
        ("separate sequences", "eager", "ok"),
    ]
    equality = report["dpo_equality"]
    assert equality["separate_backend"] == "eager"
    assert equality["max_rel_logp_diff"] < 1e-5
    assert abs(equality["loss_shared_flashmask"] - equality["loss_separate"]) < 1e-5
    assert [row["longest_seqlen"] for row in report["longest"]] == [128, None, None]
    text = (tmp_path / "e2e.md").read_text()
    assert "tiny gpt-oss-style model" in text and "Not run: `sdpa`, transformers refuses" in text


def test_e2e_benchmark_deepseek_v3_trains_mla(e2e, tmp_path):
    """MLA style (q/k head dim 24, v head dim 16 in the tiny model): flashmask and sdpa train
    it and agree on the DPO log-probs."""
    argv = ["--smoke", "--model", "deepseek_v3", "--out", str(tmp_path)]
    argv += ["--backends", "flashmask", "sdpa", *E2E_SIZES]
    assert e2e.main(argv) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    meta = report["meta"]
    assert (meta["model_style"], meta["model_class"]) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    assert meta["model"]["v_head_dim"] < meta["model"]["qk_nope_head_dim"] + 8
    sft = [(row["backend"], row["status"]) for row in report["sft"]]
    assert sft == [("flashmask", "ok"), ("sdpa", "ok"), ("no_attention", "ok")]
    assert [row["status"] for row in report["dpo"]] == ["ok"] * 3
    equality = report["dpo_equality"]
    assert equality["max_rel_logp_diff"] < 1e-5
    assert abs(equality["loss_shared_flashmask"] - equality["loss_separate"]) < 1e-5
    assert [row["longest_seqlen"] for row in report["longest"]] == [128, 128]
    assert "tiny MLA-style (DeepSeek-V3) model" in (tmp_path / "e2e.md").read_text()


def test_e2e_benchmark_models_are_about_1b(e2e, capsys):
    """--count-params: every ~1B config has 1.0 to 1.25 billion parameters."""
    assert e2e.main(["--count-params"]) == 0
    lines = capsys.readouterr().out.splitlines()
    counts = {line.split(":")[0]: int(line.split()[1].replace(",", "")) for line in lines}
    assert counts.keys() == set(e2e.MODELS)
    assert all(1.0e9 <= n <= 1.25e9 for n in counts.values()), counts
