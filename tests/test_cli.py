"""The ``flashmask`` command line: ``show``, ``demo``, ``bench`` forwarding and ``--version``."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import flashmask
from flashmask import masks
from flashmask.cli import main

SHOW_NAMES = (*masks.MASK_TYPES, "hash_sparse")


def _example(name: str, seqlen: int):
    """The mask ``flashmask show NAME --seqlen SEQLEN`` draws (its default seed is 0)."""
    return masks.example(name, seqlen, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", SHOW_NAMES)
def test_show_prints_the_picture_and_a_summary(name, capsys):
    assert main(["show", name, "--seqlen", "24"]) == 0
    out = capsys.readouterr().out
    picture = _example(name, 24).to_string()
    assert out.startswith(picture + "\n")
    assert len(picture.splitlines()) == 24
    summary = out[len(picture) + 1 :].splitlines()[0]
    assert summary.startswith(f"{name}: causal=")
    assert "Sk=24" in summary
    assert "16x16 tiles" in summary


def test_show_summary_states_form_memory_and_tile_classes(capsys):
    assert main(["show", "causal_document", "--seqlen", "64", "--block", "16"]) == 0
    out = capsys.readouterr().out
    mask = _example("causal_document", 64)
    classes = mask.classify_tiles(16, 16)
    skipped = int((classes == flashmask.TileClass.SKIP).sum())
    summary = out.splitlines()[64]
    assert f"causal={mask.causal} C={mask.bounds} Sq=64 Sk=64" in summary
    assert f"| {mask.nbytes} bytes (dense bool mask: 4096 bytes)" in summary
    assert f"{skipped}/{classes.numel()} skipped" in summary


def test_show_seqlen_q_draws_that_many_rows(capsys):
    assert main(["show", "causal", "--seqlen", "32", "--seqlen-q", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:16] == _example("causal", 32).to_string(16).splitlines()
    assert all(len(line) == 32 for line in lines[:16])
    assert "Sq=16 Sk=32" in lines[16]


def test_show_draws_the_chosen_head_of_a_per_head_mask(capsys):
    assert main(["show", "random_eviction", "--seqlen", "24", "--head", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    mask = masks.example(
        "random_eviction", 24, num_heads=2, generator=torch.Generator().manual_seed(0)
    )
    assert lines[:24] == mask.to_string(head=1).splitlines()
    assert lines[24].endswith("drawn: batch 0, head 1")


def test_show_draws_large_masks_per_tile(capsys):
    assert main(["show", "causal", "--seqlen", "200"]) == 0
    assert capsys.readouterr().out.startswith("(tiles of")


def test_show_unknown_name_lists_the_valid_names(capsys):
    assert main(["show", "no_such_mask"]) == 2
    err = capsys.readouterr().err
    assert "unknown mask 'no_such_mask'" in err
    for name in SHOW_NAMES:
        assert name in err


@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "random_eviction"])
def test_show_png_writes_a_png(name, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{name}.png"
    assert main(["show", name, "--seqlen", "64", "--png", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


def test_demo_trains_with_flashmask_and_sdpa_to_equal_losses(capsys):
    pytest.importorskip("transformers")
    argv = ["demo", "--seqlen", "128", "--steps", "3", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "packed SFT, tiny Llama" in out
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("step ")))
    steps = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in steps] == ["1", "2", "3"]
    for _, loss_flashmask, loss_sdpa, _ in steps:
        assert float(loss_flashmask) == pytest.approx(float(loss_sdpa), rel=1e-4)
    for row in ("mask per step", "median step time", "peak RSS above step 1"):
        assert any(line.startswith(row) for line in lines), row
    mask_row = next(line for line in lines if line.startswith("mask per step"))
    # int32 [2, 1, 128, 1] against bool [2, 1, 128, 128]
    assert mask_row.split()[3:] == ["1.0", "KiB", "32.0", "KiB"]
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_demo_attention_only_matches_sdpa_and_prints_the_table(capsys):
    argv = ["demo", "--attention-only", "--seqlen", "256", "--heads", "2", "--head-dim", "16"]
    assert main([*argv, "--device", "cpu", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "packed into seqlen 256" in out
    for row in ("mask", "fwd+bwd time (median of 1)", "max |out diff|", "max |dq, dk, dv diff|"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "1,024 B (O(N))" in out  # [1, 1, 256, 1] int32
    assert "65,536 B (O(N^2))" in out  # [1, 1, 256, 256] bool
    assert out.rstrip().endswith("PASS")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_demo_on_missing_cuda_is_a_usage_error(capsys):
    assert main(["demo", "--seqlen", "64", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bench_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("flashmask.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "flashmask.bench", fake)
    assert main(["bench", "--seqlen", "128", "--help"]) == 0
    assert seen == [["--seqlen", "128", "--help"]]


def test_bench_without_the_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashmask.bench", None)  # makes the import fail
    assert main(["bench"]) == 2
    assert "flashmask.bench is not available" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "show" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashmask {flashmask.__version__}"


def test_python_m_flashmask_version():
    result = subprocess.run(
        [sys.executable, "-m", "flashmask", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == f"flashmask {flashmask.__version__}"
