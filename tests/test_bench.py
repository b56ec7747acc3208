"""``flashmask.bench``'s CPU-side parts: the visible-pair count behind every mask-aware TFLOP/s
figure, and the Markdown table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmask import masks
from flashmask.bench import (
    Row,
    _markdown,
    attention_flop,
    input_gradients,
    visible_flop,
    visible_pairs,
)
from flashmask.kernels import hardware
from tests.strategies import FORM_IDS, FORMS, flashmasks, random_cases


def _dense_count(mask, seqlen_q: int) -> torch.Tensor:
    """Visible pairs per (batch, mask head) from the dense mask: ``[B, Hm]``."""
    return mask.to_dense(seqlen_q).sum((-1, -2)).to(torch.int64)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@settings(max_examples=random_cases(60), deadline=None)
@given(data=st.data())
def test_visible_pairs_counts_the_dense_mask(form, data):
    """Inclusion-exclusion over the causal prefix and both intervals equals counting the dense
    mask, for every form, Sq != Sk, empty/reversed/out-of-range intervals."""
    drawn = data.draw(flashmasks(form))
    expected = _dense_count(drawn.mask, drawn.seqlen_q)
    got = visible_pairs(drawn.mask, drawn.mask.causal, drawn.seqlen_q, drawn.mask.seqlen_k)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", masks.MASK_TYPES)
def test_visible_pairs_of_the_benchmark_masks(name):
    mask = masks.example(name, 256, batch_size=2, num_heads=2 if name == "random_eviction" else 1)
    assert torch.equal(visible_pairs(mask, mask.causal, 256, 256), _dense_count(mask, 256))


def test_visible_flop_counts_each_query_head_once_whatever_the_mask_heads():
    """A mask per key/value head (``Hm`` = 2 serving 8 query heads) counts each query head's
    visible pairs once, as a mask shared by all heads does; a batch-1 mask counts every row."""
    per_head = masks.example("random_eviction", 64, batch_size=2, num_heads=2)
    pairs = _dense_count(per_head, 64)  # [B, Hm]
    want = 4.0 * 16 * int(pairs.sum()) * (8 // 2)
    assert visible_flop(per_head, True, 64, 16, 8, 2) == want
    assert visible_flop(None, False, 64, 16, 8, 3, per_pair=10.0) == 10.0 * 16 * 64 * 64 * 8 * 3


@pytest.mark.parametrize(("causal", "expected"), [(False, 35), (True, 15)])
def test_visible_pairs_without_a_mask(causal, expected):
    """Full attention: Sq * Sk = 7 * 5 pairs. Causal with Sq=7 > Sk=5 is bottom-right aligned:
    key j is seen by rows j + 2 .. 6, i.e. 5 + 4 + 3 + 2 + 1 pairs."""
    assert int(visible_pairs(None, causal, 7, 5)) == expected


def test_markdown_reports_speedup_and_the_preparation_share():
    common = dict(mask="causal", seqlen=8192, batch=4, heads=16, head_dim=128, sparsity=0.5)
    rows = [
        Row(
            impl="flashmask",
            fwd_ms=2.0,
            total_ms=8.0,
            mask_prep_ms=0.08,
            mask_prep_gpu_ms=0.004,
            **common,
        ),
        Row(impl="flex", fwd_ms=2.5, total_ms=10.0, mask_prep_ms=2.0, **common),
        Row(impl="sdpa", fwd_ms=1.0, total_ms=5.0, **common),
    ]
    lines = _markdown(rows).splitlines()
    assert "prep % of fwd+bwd" in lines[0]
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    flashmask, flex, sdpa = lines[2:]
    # 0.08 ms of an 8 ms call (0.004 ms of device time), 10 / 8 faster
    assert flashmask.endswith("| 1.0 | 0.004 | 0.05 | — | 1.25x | — |")
    assert flex.endswith("| 20.0 | — | — | — | 1.00x | — |")
    assert sdpa.endswith("| — | — | — | — | 2.00x | — |")


def test_markdown_compares_with_flashmask4_when_it_ran():
    """With FlashMask-4 rows, each row also says how much faster than FlashMask-4 it is; an
    FlashMask-4 row that failed (a form it refuses) gives no ratio."""
    common = dict(mask="document", seqlen=8192, batch=4, heads=16, head_dim=128, sparsity=0.5)
    rows = [
        Row(impl="flashmask", fwd_ms=2.0, total_ms=8.0, **common),
        Row(impl="flex", fwd_ms=2.5, total_ms=10.0, **common),
        Row(impl="fm4", fwd_ms=2.2, total_ms=8.8, **common),
        Row(impl="fm4", note="error: ValueError: head dim", **{**common, "head_dim": 64}),
        Row(impl="flashmask", fwd_ms=1.0, total_ms=4.0, **{**common, "head_dim": 64}),
    ]
    lines = _markdown(rows).splitlines()
    assert "| vs flex (fwd+bwd) | vs fm4 (fwd+bwd) |" in lines[0]
    assert len({line.count("|") for line in lines}) == 1
    flashmask, flex, fm4, fm4_failed, flashmask_64 = lines[2:]
    assert flashmask.endswith("| 1.25x | 1.10x |")
    assert flex.endswith("| 1.00x | 0.88x |")
    assert fm4.endswith("| 1.14x | 1.00x |")
    assert "| fm4 (error: ValueError: head dim) |" in fm4_failed
    assert flashmask_64.endswith("| — | — |")


def test_flashmask4_is_timed_by_default_only_when_importable(monkeypatch):
    """FlashMask-4 (a peer outside flashmask) joins the default implementations only when its
    torch shim imports; asking for it when it does not is refused, naming the option."""
    from flashmask import bench

    monkeypatch.setattr(bench, "flashmask4", lambda: None)
    assert bench.default_impls() == "flashmask,flex,sdpa"
    monkeypatch.setattr(bench, "flashmask4", lambda: lambda *args, **kwargs: None)
    assert bench.default_impls() == "flashmask,flex,sdpa,fm4"


@pytest.mark.parametrize(
    ("impls", "message"),
    [
        ("flashmask,fa9", "--impls: unknown implementation(s) ['fa9']"),
        ("flashmask,fm4", "--impls fm4: fm4_torch is not importable"),
    ],
)
def test_impls_the_bench_cannot_run_are_refused(monkeypatch, capsys, impls, message):
    from flashmask import bench

    monkeypatch.setattr(bench, "flashmask4", lambda: None)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--impls", impls])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_feature_rows_are_known_implementations(capsys):
    """flashmask_sinks, flashmask_softcap and flashmask_deterministic pass the --impls check
    (and then need a GPU)."""
    from flashmask import bench

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the call would run the benchmark")
    impls = "flashmask,flashmask_sinks,flashmask_softcap,flashmask_deterministic"
    assert bench.main(["--impls", impls]) == 2
    err = capsys.readouterr().err
    assert "unknown implementation" not in err and "needs a CUDA GPU" in err


def test_markdown_marks_an_implementation_that_ran_out_of_memory():
    """An OOM row (e.g. Flex's create_block_mask at 128K) keeps its place in the table, says
    so, and leaves the others' speed-up column empty rather than dividing by nothing."""
    common = dict(mask="causal", seqlen=131072, batch=1, heads=16, head_dim=128, sparsity=0.5)
    rows = [
        Row(impl="flashmask", fwd_ms=20.0, total_ms=80.0, mask_prep_ms=0.1, **common),
        Row(impl="flex", note="OOM", **common),
    ]
    lines = _markdown(rows).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    flashmask, flex = lines[2:]
    assert "| flex (OOM) | — | — |" in flex
    assert flashmask.endswith("| — | — |")


def test_result_files_record_the_tile_configs_of_the_gpu(monkeypatch):
    """A bench result says which tiles produced it: the defaults for this GPU's shared memory."""
    from flashmask import kernels
    from flashmask.bench import _tile_configs

    # bench reads the shared memory through the package face (flashmask.kernels).
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "device_shared_memory", lambda device: 99 * 1024)
    configs = _tile_configs([128])
    assert set(configs) == {"D128/mask", "D128/no mask"}
    assert configs["D128/no mask"]["fwd_m"] == kernels.compact_tile_config(128).fwd_m
    monkeypatch.setattr(kernels, "device_shared_memory", lambda device: 227 * 1024)
    hopper = _tile_configs([64])["D64/no mask"]
    assert hopper["fwd_m"] == 128  # the H200's no-mask forward at hd64: taller tiles


@pytest.mark.parametrize(
    ("call_ms", "timed", "do_bench_reps"),
    [(2.0, [1], [100]), (56.0, [1, 5], []), (900.0, [1, 5], [])],
)
def test_a_measurement_times_at_least_min_repeats_calls(monkeypatch, call_ms, timed, do_bench_reps):
    """One timed call estimates a call's length: within ``rep_ms`` for ``min_repeats`` calls,
    do_bench times it over ``rep_ms``; a longer call is timed ``min_repeats`` times on its own
    (the median of those), without do_bench's own five-call estimate."""
    import triton.testing

    from flashmask import bench

    asked, counts = [], []

    def fake_do_bench(fn, warmup, rep, return_mode):
        asked.append(rep)
        return call_ms

    def fake_timed_calls(fn, calls):
        counts.append(calls)
        return [call_ms * (1 + 0.01 * i) for i in range(calls)]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(bench, "_timed_calls_ms", fake_timed_calls)
    expected = call_ms if do_bench_reps else call_ms * 1.02  # the median of five
    assert bench._bench(lambda: None, 100, min_repeats=5) == pytest.approx(expected)
    assert counts == timed and asked == do_bench_reps


def test_min_repeats_below_one_is_refused_naming_the_option(capsys):
    from flashmask import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--min-repeats", "0"])
    assert exc.value.code == 2
    assert "--min-repeats must be at least 1, got 0" in capsys.readouterr().err


def test_timed_backwards_return_gradients_without_accumulating_into_grad():
    """Each timed backward hands its gradients back as autograd passes them to the layer below;
    a leaf's ``.grad`` (which ``.backward()`` would add every call into) stays untouched."""
    q = torch.randn(3, 4, requires_grad=True)
    k = torch.randn(4, 5, requires_grad=True)
    grad = torch.randn(3, 5)
    for _ in range(2):
        dq, dk = input_gradients(q @ k, (q, k), grad)
        torch.testing.assert_close(dq, grad @ k.detach().T)
        torch.testing.assert_close(dk, q.detach().T @ grad)
    assert q.grad is None and k.grad is None


def test_markdown_shows_grouped_query_heads_and_compares_within_one_head_layout():
    """A grouped-query row reads ``query:key/value`` heads, and its speed-up is against flex
    with the same heads, not against a multi-head row of the same mask."""
    common = dict(mask="document", seqlen=8192, batch=4, heads=16, head_dim=128, sparsity=0.7)
    rows = [
        Row(impl="flashmask", fwd_ms=1.0, total_ms=4.0, **common),
        Row(impl="flex", fwd_ms=1.5, total_ms=6.0, **common),
        Row(impl="flashmask", fwd_ms=1.0, total_ms=3.0, kv_heads=4, **common),
        Row(impl="flex", fwd_ms=1.5, total_ms=6.0, kv_heads=4, **common),
    ]
    lines = _markdown(rows).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    mha, _, gqa, _ = lines[2:]
    assert mha.startswith("| 8K | 128 | 16 | document |") and mha.endswith("| 1.50x | — |")
    assert gqa.startswith("| 8K | 128 | 16:4 | document |") and gqa.endswith("| 2.00x | — |")


@pytest.mark.parametrize("kv_heads", ["3", "-1"])
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused(capsys, kv_heads):
    """16 query heads at head dim 128 (hidden 2048): 3 key/value heads cannot group them."""
    from flashmask import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--kv-heads", kv_heads])
    assert exc.value.code == 2
    assert (
        f"--kv-heads must be 0 or divide the query heads (16 at head dim 128), got {kv_heads}"
        in (capsys.readouterr().err)
    )


def test_a_case_refuses_kv_heads_that_do_not_divide_its_heads():
    from flashmask import bench

    with pytest.raises(ValueError, match=r"kv_heads must divide heads \(4\), got 3"):
        bench.run_case("full", 128, 1, 4, 16, ["flashmask"], 1, 0.0, kv_heads=3)


def test_attention_flop_counts_each_matmul_at_its_own_head_dim():
    pairs = 64 * 64 * 8 * 2  # full attention: every pair, 8 query heads, batch 2
    assert attention_flop(None, False, 64, 16, 8, 2) == (4 * 16 * pairs, 10 * 16 * pairs)
    # MLA: Q/K 192, V 128; S, dQ and dK at 192, O, dP and dV at 128.
    fwd, bwd = attention_flop(None, False, 64, 192, 8, 2, head_dim_v=128)
    assert (fwd, bwd) == (2 * (192 + 128) * pairs, 2 * (3 * 192 + 2 * 128) * pairs)


def test_markdown_shows_both_head_dims_and_compares_within_one_shape():
    common = dict(mask="causal", seqlen=8192, batch=4, heads=16, head_dim=192, sparsity=0.5)
    rows = [
        Row(impl="flashmask", fwd_ms=1.0, total_ms=4.0, head_dim_v=128, **common),
        Row(impl="flex", fwd_ms=1.5, total_ms=6.0, head_dim_v=128, **common),
        Row(impl="flex", fwd_ms=1.5, total_ms=12.0, **common),
    ]
    lines = _markdown(rows).splitlines()
    assert "| 192/128 |" in lines[2] and "| 1.50x |" in lines[2]
    assert "| 192 |" in lines[4]


def test_a_negative_value_head_dim_is_refused_naming_the_option(capsys):
    from flashmask import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--head-dim-v", "-1"])
    assert exc.value.code == 2
    assert "--head-dim-v must be 0 or a head dim, got -1" in capsys.readouterr().err


def test_the_fp8_run_times_the_fp8_forward_beside_the_bf16_rows_on_the_cpu(tmp_path):
    """``--dtype fp8`` (here on the CPU, tiny): after each case's bf16 rows, a forward-only
    ``flashmask_fp8`` row with mask-aware TFLOP/s over the same visible pairs, empty fwd+bwd
    columns, where the FP8 call ran and the untimed quantisation in its note, and its RMSE
    against the float32 reference on the dequantised inputs beside the FP8 emulation's."""
    import json

    from flashmask import bench

    out = tmp_path / "fp8"
    argv = [
        "--dtype", "fp8", "--device", "cpu", "--impls", "flashmask", "--seqlens", "64",
        "--head-dims", "16", "--tokens", "128", "--hidden", "32", "--kv-heads", "1",
        "--masks", "causal_document", "--rep-ms", "1", "--min-repeats", "1", "--out", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["flashmask", bench.FP8_IMPL]
    bf16, fp8_row = rows
    assert fp8_row["fwd_ms"] > 0 and fp8_row["total_ms"] is None and fp8_row["bwd_ms"] is None
    assert fp8_row["fwd_tflops"] == pytest.approx(
        bf16["fwd_tflops"] * bf16["fwd_ms"] / fp8_row["fwd_ms"]
    )
    assert fp8_row["note"].startswith("reference: no FP8 kernel; quantize ")
    # The reference path's only error is the bf16 output's rounding; the emulation's P
    # rounding adds more.
    assert 0 < fp8_row["rmse"] < fp8_row["emulation_rmse"] < 0.05
    lines = out.with_suffix(".md").read_text().splitlines()
    table = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line[:1] == "|"]
    assert len({len(cells) for cells in table}) == 1
    header = table[0]
    assert header[-2:] == ["RMSE vs fp32", "emulation RMSE"]
    bf16_cells, fp8_cells = (dict(zip(header, cells, strict=True)) for cells in table[2:])
    assert fp8_cells["impl"].startswith(f"{bench.FP8_IMPL} (reference: no FP8 kernel; quantize ")
    assert fp8_cells["fwd ms"] != "—" and fp8_cells["fwd TF/s"] != "—"
    assert fp8_cells["fwd+bwd ms"] == fp8_cells["fwd+bwd TF/s"] == "—"
    assert fp8_cells["RMSE vs fp32"] == f"{fp8_row['rmse']:.2e}"
    assert bf16_cells["RMSE vs fp32"] == bf16_cells["emulation RMSE"] == "—"


def test_a_dtype_the_bench_does_not_know_is_refused(capsys):
    from flashmask import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--dtype", "fp16"])
    assert exc.value.code == 2
    assert "argument --dtype: invalid choice: 'fp16'" in capsys.readouterr().err


def test_a_case_refuses_an_unknown_dtype():
    from flashmask import bench

    with pytest.raises(ValueError, match=r"dtype_name must be one of \('bf16', 'fp8'\)"):
        bench.run_case("full", 128, 1, 4, 16, ["flashmask"], 1, 0.0, dtype_name="fp16")


def test_the_fp8_errors_are_measured_over_the_last_query_rows(monkeypatch):
    """The FP8 row's RMSE covers the last ``ACCURACY_ROWS`` query rows, with the mask's last
    rows (``FlashMask.last_rows``): the same numbers as the full reference sliced there."""
    import flashmask
    from flashmask import bench, fp8

    monkeypatch.setattr(bench, "ACCURACY_ROWS", 16)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 64, 2, 16) for _ in range(3))
    mask = masks.causal_document([[24, 40], [40, 24]])
    _, facts = bench.fp8_row(q, k, v, mask, False, lambda fn: 0.0)
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(x) for x in (q, k, v))
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    exact = flashmask.flashmask_attention(
        fp8.dequantize(q8, qd, 2), fp8.dequantize(k8, kd, 2), fp8.dequantize(v8, vd, 2), mask
    )[:, -16:]
    emulated = fp8.emulate_fp8_forward(q8, k8, v8, mask, **descales)[0][:, -16:]
    expected = float((emulated.float() - exact).square().mean().sqrt())
    assert facts["emulation_rmse"] == pytest.approx(expected, rel=1e-5)
    assert 0 < facts["rmse"] < facts["emulation_rmse"]
