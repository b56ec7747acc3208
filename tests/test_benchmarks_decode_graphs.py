"""``benchmarks/decode_graphs.py`` on CPU: its command line, its exit without CUDA, and the
static-cache decode step it captures on the GPU, run eagerly on a tiny random Llama (the
tokens of ``model.generate``)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("decode_graphs")


@pytest.fixture
def tiny(script):
    """The script's tiny float32 Llama on CPU (hidden 64, 2 layers, vocabulary 256)."""
    return script.build_model(script.MODEL_TINY, torch.device("cpu"), torch.float32, 0, 64)


def test_help_describes_the_benchmark(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "CUDA graphs" in out
    for option in ("--out", "--quick", "--batches", "--new-tokens", "--budget-s"):
        assert option in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--batches", "0"], "--batches"),
        (["--compile-batches", "-1"], "--compile-batches"),
        (["--prompt-len", "0"], "--prompt-len"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--reps", "0"], "--reps"),
        (["--window", "0"], "--window"),
        (["--sinks", "-1"], "--sinks"),
        (["--budget-s", "0"], "--budget-s"),
        (["--vocab", "3"], "--vocab"),
        (["--backends", "eager"], "--backends"),
        (["--methods", "graph"], "--methods"),
        (["--batches", "x"], "--batches"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(script, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_defaults_are_the_1b_run_and_quick_shortens_it(script):
    full = script.parse_args([])
    assert (full.batches, full.prompt_len, full.new_tokens) == ([1, 8], 512, 256)
    assert full.compile_batches == [1, 8]
    assert full.config["hidden_size"] == 2048 and full.config["num_hidden_layers"] == 16
    quick = script.parse_args(["--quick"])
    assert quick.new_tokens == 64 and quick.reps == 1
    assert quick.compile_batches == [1]
    assert quick.budget_s < full.budget_s
    assert script.parse_args(["--vocab", "32000"]).config["vocab_size"] == 32000


def test_without_cuda_it_exits_2_with_a_message(script, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main(["--out", str(tmp_path / "r")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["flashmask", "sdpa"])
def test_static_decode_step_gives_the_tokens_of_generate(script, tiny, backend):
    """Prefill, then N - 1 fixed-shape steps over a StaticCache of generate's size: the greedy
    tokens of ``generate(cache_implementation="static")``; a rewind replays them exactly."""
    script.set_backend(tiny, backend)
    prompts = script.make_prompts(2, 9, 256, seed=1, device=torch.device("cpu"))
    expected = script.generate_tokens(tiny, prompts, 6)
    decoder = script.StaticDecoder(tiny, prompts, 6, max_cache_len=9 + 6 - 1)
    decoder.prefill()
    decoder.decode()
    assert decoder.generated.shape == (2, 6)
    assert torch.equal(decoder.generated, expected)
    decoder.rewind()
    decoder.tokens[:, 1:].zero_()
    decoder.decode()
    assert torch.equal(decoder.generated, expected)


def test_generate_over_a_reused_static_cache_gives_the_same_tokens(script, tiny):
    """The benchmark reuses one StaticCache of generate's size for every call (reset first):
    the tokens of a fresh ``cache_implementation="static"`` each time."""
    script.set_backend(tiny, "flashmask")
    prompts = script.make_prompts(2, 7, 256, seed=3, device=torch.device("cpu"))
    expected = script.generate_tokens(tiny, prompts, 5)
    cache = script.static_cache(tiny, 7 + 5 - 1)
    for new_tokens in (5, 2, 5):
        tokens = script.generate_tokens(tiny, prompts, new_tokens, cache)
        assert torch.equal(tokens, expected[:, :new_tokens])


def test_capture_needs_cuda(script, tiny):
    prompts = script.make_prompts(1, 4, 256, seed=2, device=torch.device("cpu"))
    decoder = script.StaticDecoder(tiny, prompts, 3)
    decoder.prefill()
    with pytest.raises(RuntimeError, match="CUDA"):
        decoder.capture()


def test_token_agreement_reports_the_first_differing_step(script):
    reference = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens = reference.clone()
    assert script.token_agreement(tokens, reference) == {
        "equal": True,
        "match": 1.0,
        "first_mismatch": None,
    }
    tokens[1, 2] = 0
    tokens[0, 3] = 0
    assert script.token_agreement(tokens, reference) == {
        "equal": False,
        "match": 0.75,
        "first_mismatch": 2,
    }
    assert script.token_agreement(tokens, None)["equal"] is None


def test_smoke_run_writes_its_json_and_markdown(script, tmp_path):
    out = tmp_path / "decode"
    argv = ["--smoke", "--out", str(out), "--batches", "2", "--prompt-len", "10"]
    argv += ["--new-tokens", "4", "--methods", "static step", "static step+graph"]
    argv += ["stream_generate", "generate+compile"]
    assert script.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    meta = report["meta"]
    for key in ("gpu", "torch", "transformers", "date", "git_commit", "command"):
        assert key in meta
    rows = [(r["backend"], r["method"], r["status"].split(":")[0]) for r in report["rows"]]
    assert rows == [
        ("flashmask", "generate", "ok"),
        ("flashmask", "static step", "ok"),
        ("flashmask", "static step+graph", "skipped"),
        ("flashmask", "stream_generate", "ok"),
        ("sdpa", "generate", "ok"),
        ("sdpa", "static step", "ok"),
        ("sdpa", "static step+graph", "skipped"),
        ("sdpa", "stream_generate", "ok"),
        ("flashmask", "generate+compile", "skipped"),
        ("sdpa", "generate+compile", "skipped"),
    ]
    # float32 on CPU: the step and stream_generate give generate's tokens, on both backends.
    for row in report["rows"]:
        if row["method"] in ("static step", "stream_generate"):
            assert row["equal"] is True, row
            assert "decode_tokens_per_s" in row  # (4 tokens on a busy CPU: no rate to check)
    text = out.with_suffix(".md").read_text()
    assert "| 2 | flashmask | static step | no |" in text
    assert "decode_graphs.py --smoke" in text
