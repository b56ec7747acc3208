"""The ``flashmask`` command line: ``show``, ``demo``, ``bench`` forwarding and ``--version``."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import flashmask
from flashmask import cli, masks
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
    # The example is built for Sq = Sk; --seqlen-q reads its indices at 16 queries.
    assert lines[:16] == _example("causal", 32).with_seqlen_q(16).to_string().splitlines()
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


def test_show_png_of_a_long_mask_is_drawn_per_tile_in_bounded_memory(tmp_path, monkeypatch):
    """At 65536 tokens the PNG holds one byte per 64x64 tile, not an int64 per element (which
    took 6.1 GB at 8192 tokens and crashed at 65536)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn = []
    imshow = Axes.imshow
    monkeypatch.setattr(Axes, "imshow", lambda ax, x, **kw: drawn.append(x) or imshow(ax, x, **kw))
    path = tmp_path / "long.png"
    assert main(["show", "causal_document", "--seqlen", "65536", "--png", str(path)]) == 0
    (image,) = drawn
    assert image.shape == (1024, 1024) and image.nbytes == 1024 * 1024
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("seqlen", "tile"), [(2048, 16), (5000, 16), (40000, 48)])
def test_png_image_per_tile_holds_the_tile_classes(seqlen, tile):
    mask = masks.example("causal_document", seqlen)
    image, drawn_tile = cli.png_image(mask, seqlen, 0, 0, 16)
    assert drawn_tile == tile and max(image.shape) <= 1024 and image.dtype == torch.uint8
    classes = mask.classify_tiles(tile, tile)[0, 0]
    expected = torch.where(
        classes == flashmask.TileClass.PARTIAL,
        2,
        torch.where(classes == flashmask.TileClass.SKIP, 0, 3),
    )
    assert torch.equal(image, expected.to(torch.uint8))


def test_png_image_per_element_marks_visible_elements_of_partial_tiles():
    mask = masks.example("causal_document", 64)
    image, tile = cli.png_image(mask, 64, 0, 0, 16)
    assert tile == 1 and image.shape == (64, 64) and image.dtype == torch.uint8
    visible = mask.to_dense()[0, 0]
    partial = (image == 1) | (image == 2)
    assert torch.equal(image[partial] == 2, visible[partial])
    assert not visible[image == 0].any() and visible[image == 3].all()


def test_show_summary_of_a_long_mask_counts_tiles_in_chunks(monkeypatch, capsys):
    """The summary's tile counts are the same when counted a few query tiles at a time."""
    mask = masks.example("share_question", 1024)
    expected = mask.classify_tiles(16, 16)
    monkeypatch.setattr(cli, "_TILES_PER_CHUNK", 3 * 64)  # 3 query tiles of 64 per chunk
    skipped, partial, total = cli._tile_counts(mask, 1024, 16)
    assert total == expected.numel()
    assert skipped == int((expected == flashmask.TileClass.SKIP).sum())
    assert partial == int((expected == flashmask.TileClass.PARTIAL).sum())


@pytest.mark.parametrize("command", ["show", "cp-plan"])
def test_png_without_matplotlib_is_a_one_line_error(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    path = tmp_path / "mask.png"
    argv = [command, "causal", "--seqlen", "256", "--png", str(path)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"flashmask {command}: error: --png needs matplotlib: pip install 'flashmask[plots]'"
    ]
    assert captured.out == "" and not path.exists()


def _parsers(argv: list[str], monkeypatch) -> list:
    """The argument parsers ``main(argv)`` builds, caught when it parses."""
    import argparse

    class Parsed(Exception):
        pass

    seen = []

    def catch(self, *args, **kwargs):
        seen.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Parsed):
        main(argv)
    return seen


def test_every_option_of_every_subcommand_has_help(monkeypatch):
    import argparse

    pytest.importorskip("flashmask.bench")
    parsers = []
    for argv in (["show", "causal"], ["bench"], ["cp-plan", "causal"]):
        parsers += _parsers(argv, monkeypatch)
    (top,) = parsers[:1]
    subcommands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subcommands.choices) == {"show", "demo", "bench", "cp-plan"}
    # bench and cp-plan hand their arguments to parsers of their own (caught above).
    parsers += [subcommands.choices["show"], subcommands.choices["demo"]]
    missing = [
        f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
        for parser in parsers
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert len(parsers) == 5 and missing == []


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
    # One progress line per training step of each backend, printed before the tables.
    progress = [line for line in lines[:header] if line.startswith("  ... ")]
    assert [line.split(":")[0] for line in progress] == ["  ... flashmask"] * 3 + [
        "  ... sdpa + dense mask"
    ] * 3
    assert progress[0].startswith("  ... flashmask: step 1/3, loss ")
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


def test_demo_attention_only_reports_each_phase_before_running_it(monkeypatch, capsys):
    """``flashmask demo --seqlen 8192`` ran ~24 s on a CPU without a word: every phase now
    prints (and flushes) a line before it runs."""
    seen = []
    forward_backward = cli._forward_backward

    def recording(*args):
        printed = capsys.readouterr().out.splitlines()  # what was printed since the last call
        seen.append(printed[-1] if printed else None)
        return forward_backward(*args)

    monkeypatch.setattr(cli, "_forward_backward", recording)
    argv = ["demo", "--attention-only", "--seqlen", "64", "--heads", "1", "--head-dim", "8"]
    assert main([*argv, "--device", "cpu", "--repeats", "1"]) == 0
    assert seen == [
        "  ... forward + backward: flashmask_attention",
        "  ... forward + backward: SDPA with the dense mask",
        "  ... timing flashmask_attention (2 runs, the first a warm-up)",
        None,
        "  ... timing SDPA with the dense mask (2 runs, the first a warm-up)",
        None,
    ]


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
