"""``flashmask cp-plan``: the planner report (Markdown table, per-rank detail, targets, PNG)."""

from __future__ import annotations

import pytest

from flashmask import masks
from flashmask.cli import main
from flashmask.distributed import BALANCERS, make_plan
from flashmask.distributed.report import plan_rows


def test_cp_plan_prints_one_row_per_world_size_and_balancer(capsys, tmp_path):
    png, md = tmp_path / "plan.png", tmp_path / "plan.md"
    argv = ["cp-plan", "causal_document", "--seqlen", "4096", "--world-sizes", "2,8",
            "--chunk-size", "64", "--png", str(png), "--output", str(md)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith(("| 2 |", "| 8 |"))]
    assert len(table) == 2 * len(BALANCERS)
    # The printed numbers are the plan's own.
    mask = masks.example("causal_document", 4096)
    plan = make_plan(mask, 8, chunk_size=64, balancer="document")
    row = next(line for line in table if line.startswith("| 8 | document |"))
    assert f"| {plan.imbalance:.3f} |" in row
    assert "Per-rank work at 8 ranks" in out
    assert "Targets at 8 ranks" in out and "document: pruned moves" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.read_text() in out


def test_plan_rows_bytes_follow_the_transfers():
    (row,) = plan_rows("sliding_window", 2048, [4], balancers=["contiguous"], chunk_size=64,
                       kv_heads=2, head_dim=64, dtype="bfloat16")  # fmt: skip
    kv_bytes = 2 * 2 * 64 * 2  # Hk * (D + Dv) * bf16
    # all_gather: every rank receives the 3 other ranks' 8 chunks of 64 tokens.
    assert row.all_gather_forward == 4 * 3 * 8 * 64 * kv_bytes
    assert row.all_gather_backward == 2 * row.all_gather_forward  # float32 gradients
    plan = make_plan(masks.example("sliding_window", 2048), 4, chunk_size=64,
                     balancer="contiguous")  # fmt: skip
    assert row.pruned_forward == int(plan.transfers("pruned").sum()) * 64 * kv_bytes
    assert 0 < row.forward_reduction < 1 and row.imbalance == pytest.approx(plan.imbalance)


def test_cp_plan_usage_errors(capsys):
    assert main(["cp-plan", "no_such_mask"]) == 2
    assert "unknown mask" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["cp-plan", "causal", "--balancers", "nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["cp-plan", "causal", "--world-sizes", "0"])


def test_cp_plan_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "cp-plan" in capsys.readouterr().out
