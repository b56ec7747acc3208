"""``flashmask bench --decode``'s CPU-side parts: its options, the cases and their masks, the
visible-bytes accounting, and the baselines' masks (SDPA's dense mask, flex's ``mask_mod``)
agreeing with FlashMask on small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmask import bench, bench_decode, cli, flashmask_attention, masks
from flashmask.bench_decode import (
    CASES,
    Case,
    DecodeRow,
    build_case,
    dense_mask,
    flashmask_call,
    flex_call,
    flex_mask_mod,
    parse_config,
    plan_shapes,
    ragged_lengths,
    reference_attention,
    sdpa_call,
    sdpa_mask,
    set_flex_mask,
    visible_kv_bytes,
    visible_rows_per_key,
)
from tests.strategies import FORM_IDS, FORMS, flashmasks, random_cases

KV_BYTES_PER_KEY = 8 * 128 * 2 * 2  # 8 key/value heads x head dim 128 x (K, V) x bf16


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--decode", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------- options
def test_the_default_grid_is_the_issues_h200_targets():
    config = parse_config([])
    assert config.batches == (1, 8, 32)
    assert config.cache_lens == (8192, 32768, 131072)
    assert config.query_lens == (1,)
    assert config.cases == ("causal", "sliding_window", "causal_document", "ragged")
    assert (config.chunk_lens, config.chunk_cache_lens) == ((2048,), (32768, 131072))
    assert config.chunk_cases == ("causal", "causal_document")
    assert (config.heads, config.kv_heads, config.head_dim) == (32, 8, 128)
    assert (config.window, config.sink_tokens) == (4096, 4)
    assert config.impls == ("flashmask", "sdpa", "sdpa-best", "flex")
    assert config.out == "benchmarks/results/decode"


def test_quick_shrinks_the_grid_but_explicit_options_win():
    quick = parse_config(["--quick"])
    assert quick.batches == (1, 8) and quick.cache_lens == (8192, 32768)
    assert quick.chunk_cache_lens == (32768,) and quick.rep_ms == 20
    mixed = parse_config(["--quick", "--batches", "4", "--rep-ms", "7"])
    assert mixed.batches == (4,) and mixed.rep_ms == 7 and mixed.cache_lens == (8192, 32768)


def test_the_plan_runs_decode_shapes_then_batch_one_chunks():
    """Every cache length x batch x query length, then the chunks (batch 1) with their own
    cases; ``--chunk-lens none`` runs no chunk."""
    shapes = plan_shapes(parse_config([]))
    decode = [s for s in shapes if not s.chunk]
    chunks = [s for s in shapes if s.chunk]
    assert len(decode) == 9 and {s.seqlen_q for s in decode} == {1}
    assert {(s.batch, s.seqlen_k) for s in decode} == {
        (b, sk) for b in (1, 8, 32) for sk in (8192, 32768, 131072)
    }
    assert [(s.batch, s.seqlen_q, s.seqlen_k) for s in chunks] == [
        (1, 2048, 32768),
        (1, 2048, 131072),
    ]
    assert all(s.cases == ("causal", "causal_document") for s in chunks)
    assert not any(s.chunk for s in plan_shapes(parse_config(["--chunk-lens", "none"])))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batches", "1,x"], "--batches must be comma-separated positive integers, got '1,x'"),
        (["--batches", "0"], "--batches must be comma-separated positive integers"),
        (["--cache-lens", ""], "--cache-lens must be comma-separated positive integers"),
        (["--query-lens", "8192"], "--query-lens must stay below every --cache-lens value"),
        (["--chunk-lens", "32768"], "--chunk-lens must stay below every --chunk-cache-lens"),
        (["--cases", "causal,nope"], "--cases: unknown 'nope'"),
        (["--chunk-cases", "full"], "--chunk-cases: unknown 'full'"),
        (["--impls", "flashmask,xformers"], "--impls: unknown 'xformers'"),
        (["--kv-heads", "3"], "--kv-heads must divide --heads (32), got 3"),
        (["--head-dim", "0"], "--head-dim must be at least 1, got 0"),
        (["--rep-ms", "0"], "--rep-ms must be at least 1, got 0"),
        (["--sink-tokens", "-1"], "--sink-tokens must be at least 0, got -1"),
    ],
)
def test_bad_options_are_refused_naming_the_option(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_without_a_gpu_the_command_exits_2_saying_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--decode", "--quick"]) == 2
    assert "flashmask bench --decode needs a CUDA GPU" in capsys.readouterr().err


def test_bench_help_names_the_decode_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--decode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--decode", "--help"])
    out = capsys.readouterr().out
    assert "flashmask bench --decode" in out and "--cache-lens" in out


# ---------------------------------------------------------------------- cases and accounting
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_cases_are_bottom_right_masks_of_the_queries_over_the_cache(name, seqlen_q):
    case = build_case(name, 3, seqlen_q, 256, window=32, sink_tokens=4)
    mask = case.mask
    assert (mask.seqlen_q, mask.seqlen_k, mask.num_heads) == (seqlen_q, 256, 1)
    assert mask.batch_size == 3
    # FlashMask gets no mask for plain causal attention, the case's mask otherwise.
    assert (case.flashmask_mask is None) == (name == "causal")
    assert case.causal == (name != "ragged")
    dense = mask.to_dense()
    assert dense.any(-1).all()  # every query sees some key
    if name != "ragged":  # ... and its own position, at the end of the cache
        own = torch.arange(seqlen_q) + 256 - seqlen_q
        assert dense[..., torch.arange(seqlen_q), own].all()


def test_causal_document_steps_see_only_the_last_document():
    full = masks.example(
        "causal_document", 512, batch_size=2, generator=torch.Generator().manual_seed(0)
    )
    case = build_case("causal_document", 2, 1, 512)
    torch.testing.assert_close(case.mask.to_dense(), full.to_dense()[:, :, -1:])


@pytest.mark.parametrize("name", ["causal", "sliding_window", "causal_document"])
def test_a_chunk_is_the_last_rows_of_the_training_mask_it_is_compared_with(name):
    """The training forward that a chunk's TFLOP/s is measured against runs the square mask
    whose last rows the chunk attends with (the same documents, window and sinks)."""
    chunk = build_case(name, 1, 8, 512, window=64, sink_tokens=4)
    square, causal = bench_decode.training_mask(name, 512, window=64, sink_tokens=4)
    square = square if square is not None else masks.causal(512)
    assert causal and square.causal
    assert torch.equal(chunk.mask.to_dense(), square.to_dense()[:, :, -8:])
    assert bench_decode.training_mask("ragged", 512) is None


def test_ragged_lengths_are_seeded_draws_in_a_quarter_to_all_of_the_cache():
    lengths = ragged_lengths(64, 1, 1024, seed=0)
    assert lengths.min() >= 256 and lengths.max() <= 1024
    assert len(set(lengths.tolist())) > 10  # drawn, not constant
    assert torch.equal(lengths, ragged_lengths(64, 1, 1024, seed=0))
    assert ragged_lengths(8, 300, 1000, seed=1).min() >= 300  # room for the queries


@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_a_ragged_sequence_sees_its_own_keys_up_to_each_querys_position(seqlen_q):
    case = build_case("ragged", 4, seqlen_q, 40, seed=3)
    dense = case.mask.to_dense()
    for b, length in enumerate(case.lengths):
        rows = torch.arange(seqlen_q).view(-1, 1)
        cols = torch.arange(40).view(1, -1)
        assert torch.equal(dense[b, 0], cols <= length - seqlen_q + rows)


def test_a_sliding_window_step_over_128k_reads_4096_keys_and_4_sinks():
    case = build_case("sliding_window", 1, 1, 131072)
    assert visible_kv_bytes(case.mask, 1, 1, 8, 128) == 4100 * KV_BYTES_PER_KEY
    # At batch 8 (the mask shared by the sequences) every sequence reads its own cache.
    assert visible_kv_bytes(case.mask, 1, 8, 8, 128) == 8 * 4100 * KV_BYTES_PER_KEY


def test_visible_bytes_of_the_other_cases():
    causal = build_case("causal", 2, 1, 8192)
    assert visible_kv_bytes(causal.mask, 1, 2, 8, 128) == 2 * 8192 * KV_BYTES_PER_KEY
    ragged = build_case("ragged", 4, 1, 8192)
    assert visible_kv_bytes(ragged.mask, 1, 4, 8, 128) == sum(ragged.lengths) * KV_BYTES_PER_KEY
    # A chunk of 2048 causal queries over 32K keys reads every key.
    chunk = build_case("causal", 1, 2048, 32768)
    assert visible_kv_bytes(chunk.mask, 2048, 1, 8, 128) == 32768 * KV_BYTES_PER_KEY
    # A mask per key/value head counts each head's own keys.
    per_head = masks.example("random_eviction", 64, num_heads=2).last_rows(1)
    keys = per_head.to_dense().any(-2).sum()
    assert visible_kv_bytes(per_head, 1, 1, 2, 128) == int(keys) * 128 * 2 * 2


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@settings(max_examples=random_cases(30), deadline=None)
@given(data=st.data())
def test_visible_rows_per_key_counts_the_dense_mask(form, data):
    drawn = data.draw(flashmasks(form))
    got = visible_rows_per_key(drawn.mask, drawn.seqlen_q)
    expected = drawn.mask.to_dense(drawn.seqlen_q).sum(-2).to(torch.int64)
    assert torch.equal(got, expected)
    pairs = bench.visible_pairs(drawn.mask, drawn.mask.causal, drawn.seqlen_q, drawn.mask.seqlen_k)
    assert torch.equal(got.sum(-1), pairs)


# ---------------------------------------------------------------------- the baselines' masks
def _inputs(batch: int, seqlen_q: int, seqlen_k: int, heads: int = 4, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, 16, generator=gen)
    k = torch.randn(batch, seqlen_k, kv_heads, 16, generator=gen)
    v = torch.randn(batch, seqlen_k, kv_heads, 16, generator=gen)
    return (q, k, v), tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))


def _small(name: str, seqlen_q: int) -> Case:
    return build_case(name, 2, seqlen_q, 48, window=7, sink_tokens=2, seed=1)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_flex_mask_mod_and_sdpa_dense_mask_equal_the_flashmask(name, seqlen_q):
    from torch.nn.attention.flex_attention import create_mask

    case = _small(name, seqlen_q)
    expected = case.mask.to_dense().expand(2, 4, -1, -1)
    assert torch.equal(dense_mask(case).expand(2, 4, -1, -1), expected)
    set_flex_mask(case, heads=4)
    assert torch.equal(create_mask(flex_mask_mod, 2, 4, seqlen_q, 48, device="cpu"), expected)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_every_implementation_computes_the_same_attention(name, seqlen_q):
    """On CPU in float32: FlashMask (its exact reference), SDPA with the row's mask, flex
    (eager) with the BlockMask and the float32 reference of the benchmark's error check all
    agree, grouped-query heads and bottom-right alignment included."""
    case = _small(name, seqlen_q)
    (q, k, v), (qh, kh, vh) = _inputs(2, seqlen_q, 48)
    from torch.nn.attention.flex_attention import flex_attention

    expected = flashmask_call(case, q, k, v)()
    ref = flashmask_attention(q, k, v, case.mask)  # the case's mask spelt out for causal too
    torch.testing.assert_close(expected, ref)
    torch.testing.assert_close(reference_attention(case, q, k, v, max_scores=200), expected)
    sdpa = sdpa_call(qh, kh, vh, sdpa_mask(case))()
    torch.testing.assert_close(sdpa.transpose(1, 2), expected)
    block_mask = bench_decode.build_block_mask(case, 4, "cpu")
    flex = flex_call(flex_attention, block_mask, qh, kh, vh)()
    torch.testing.assert_close(flex.transpose(1, 2), expected)


def test_markdown_reports_every_column_and_marks_wrong_rows():
    common = dict(
        case="causal", batch=8, seqlen_q=1, seqlen_k=32768, heads=32, kv_heads=8, head_dim=128
    )
    nbytes = 8 * 32768 * KV_BYTES_PER_KEY
    rows = [
        DecodeRow(impl="flashmask", visible_kv_bytes=nbytes, gpu_us=200.0, prep_ms=0.01, **common),
        DecodeRow(impl="sdpa", visible_kv_bytes=nbytes, gpu_us=300.0, **common),
        DecodeRow(
            impl="flex", visible_kv_bytes=nbytes, gpu_us=250.0, note="WRONG", max_err=1.0, **common
        ),
    ]
    lines = bench_decode.markdown(rows).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    flashmask, sdpa, flex = lines[2:]
    assert "| 1024.0 |" in flashmask  # 1 GiB of K and V
    assert sdpa.endswith("| 1.50x |  |")
    assert flex.endswith("| 1.0e+00 | 1.25x | WRONG |")


# ---------------------------------------------------------------------- the run, on CPU
@pytest.fixture
def cpu_run(monkeypatch):
    """``bench_decode.run`` on CPU: fixed timings and kernel names, flex eager, no JSON."""
    monkeypatch.setattr(
        bench_decode,
        "time_call",
        lambda fn, rep_ms, min_repeats=5: bench_decode.Timing(0.1, 0.12, 0.05),
    )
    monkeypatch.setattr(bench_decode, "_kernels", lambda fn: ["kernel"])
    monkeypatch.setattr(bench, "_cuda_time", lambda fn, repeats=5: (fn(), 0.5)[1])
    monkeypatch.setattr(bench_decode, "_write_json", lambda out, rows, config: {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    argv = (
        "--batches 2 --cache-lens 64 --chunk-lens 8 --chunk-cache-lens 64 --heads 4 --kv-heads 2 "
        "--head-dim 16 --window 8"
    )
    return lambda extra="": bench_decode.run(parse_config((argv + extra).split()), "cpu")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_run_reports_every_implementation_of_every_case(cpu_run):
    """Decode steps of the four cases with every implementation (``sdpa-best`` for causal only),
    then the chunks, then flashmask's training forward that the chunks are measured against."""
    rows = cpu_run()
    assert not [r for r in rows if r.note]  # all right, none failed
    decode = [(r.case, r.impl) for r in rows if r.seqlen_q == 1]
    assert decode == [
        ("causal", "flashmask"), ("causal", "sdpa"), ("causal", "sdpa-best"), ("causal", "flex"),
        ("sliding_window", "flashmask"), ("sliding_window", "sdpa"), ("sliding_window", "flex"),
        ("causal_document", "flashmask"), ("causal_document", "sdpa"),
        ("causal_document", "flex"),
        ("ragged", "flashmask"), ("ragged", "sdpa"), ("ragged", "flex"),
    ]  # fmt: skip
    chunks = [r for r in rows if r.seqlen_q == 8]
    train = {r.case: r for r in rows if r.impl == "flashmask-train-fwd"}
    assert set(train) == {"causal", "causal_document"} and train["causal"].seqlen_q == 64
    for r in chunks:
        assert r.tflops and r.pct_of_train_fwd == pytest.approx(
            100 * r.tflops / train[r.case].tflops
        )
    best = next(r for r in rows if r.impl == "sdpa-best")
    assert best.extra["backend"] in best.extra["candidates_us"]
    assert all(r.max_err is not None and r.max_err <= r.tolerance for r in rows if r.seqlen_q < 64)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_wrong_result_is_marked_and_fails_the_command(cpu_run, monkeypatch, tmp_path, capsys):
    """SDPA without its sliding-window mask attends to the whole cache: its row says WRONG, and
    the command writes its results and exits 1 naming it."""
    real = bench_decode.sdpa_mask
    monkeypatch.setattr(
        bench_decode,
        "sdpa_mask",
        lambda case, device=None: None if case.name == "sliding_window" else real(case, device),
    )
    rows = cpu_run(" --cases sliding_window --chunk-lens none --impls flashmask,sdpa")
    assert [(r.impl, r.note) for r in rows] == [("flashmask", ""), ("sdpa", "WRONG")]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_decode, "run", lambda config: rows)
    monkeypatch.setattr(
        bench_decode,
        "_write_json",
        lambda out, rows, config, elapsed_s=None: dict(
            gpu="GPU", torch="t", triton="t", date="d", git_commit="c"
        ),
    )
    out = tmp_path / "decode"
    assert bench_decode.main(["--out", str(out)]) == 1
    assert "WRONG: sdpa on sliding_window B=2 Sq=1 Sk=64" in capsys.readouterr().err
    report = out.with_suffix(".md").read_text()
    assert "`flashmask bench --decode --out" in report and "| WRONG |" in report
