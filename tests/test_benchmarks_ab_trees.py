"""``benchmarks/ab_trees.py`` on the CPU: the trees take turns in ABBA order, each cell is read
as the median of its runs (range beside it) with new over old and each tree's ratio to a peer,
and a whole comparison runs a real command against two trees that differ in one module."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.fixture
def script(import_benchmark):
    return import_benchmark("ab_trees")


def test_trees_take_turns_in_abba_order(script):
    assert script.abba_order(1) == ["new", "old"]
    assert script.abba_order(3) == ["new", "old", "old", "new", "new", "old"]


def test_value_at_follows_a_dotted_path_and_skips_what_is_not_a_number(script):
    cell = {"cute": {"tflops": 500}, "fm4": {"error": "RuntimeError"}, "mask": "full"}
    assert script.value_at(cell, "cute.tflops") == 500.0
    assert script.value_at(cell, "fm4.tflops") is None
    assert script.value_at(cell, "mask") is None
    assert script.value_at(cell, "gluon.tflops") is None


def _run(tree: str, cute: float | None, gluon: float, mask: str = "full") -> dict:
    cell = {"s": 8192, "mask": mask, "gluon": {"tflops": gluon}}
    cell["cute"] = {"tflops": cute} if cute is not None else {"error": "RuntimeError: no"}
    return {"tree": tree, "result": {"meta": {}, "cells": [cell]}}


def test_render_gives_medians_ranges_ratios_and_a_summary(script):
    runs = [
        _run("new", 530, 556), _run("old", 510, 561), _run("old", 514, 556),
        _run("new", 541, 550), _run("new", 534, 556), _run("old", 510, 560),
    ]  # fmt: skip
    data = {
        "keys": ["s", "mask"], "metric": "cute.tflops", "peer": "gluon.tflops", "rounds": 3,
        "command": ["python", "b.py", "--out", "{out}"], "trees": {"new": "src", "old": "o"},
        "runs": runs,
    }  # fmt: skip
    table = script.render(data)
    assert "median of 3 runs each (new old old new new old)" in table
    row = next(line for line in table.splitlines() if line.startswith("| 8192 | full"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[2] == "534 (530-541)" and cols[3] == "510 (510-514)"
    assert cols[4] == f"{534 / 510:.3f}"
    assert cols[5] == f"{534 / 556:.3f}" and cols[6] == f"{510 / 560:.3f}"
    assert "over 1 cells" in table


def test_render_marks_a_cell_that_failed_in_one_tree(script):
    runs = [_run("new", None, 500, "causal"), _run("old", 480, 500, "causal")]
    data = {
        "keys": ["s", "mask"], "metric": "cute.tflops", "peer": None, "rounds": 1,
        "command": ["x"], "trees": {"new": "src", "old": "o"}, "runs": runs,
    }  # fmt: skip
    row = next(line for line in script.render(data).splitlines() if "causal" in line)
    assert row == "| 8192 | causal | — | 480 (480-480) | — |"


def test_rows_results_are_read_like_cells(script):
    assert script.cells_of({"rows": [{"a": 1}]}) == [{"a": 1}]
    with pytest.raises(ValueError, match="neither"):
        script.cells_of({"meta": {}})


BENCH = """
import json, sys
from tree_marker import VALUE
out = sys.argv[sys.argv.index("--out") + 1]
cells = [{"s": 64, "mask": "full", "rate": {"v": VALUE}, "peer": {"v": 10.0}}]
open(out + ".json", "w").write(json.dumps({"cells": cells}))
"""


def test_a_comparison_runs_the_command_on_each_tree_in_turn(script, tmp_path, monkeypatch):
    for tree, value in (("new", 12.0), ("old", 10.0)):
        (tmp_path / tree).mkdir()
        (tmp_path / tree / "tree_marker.py").write_text(f"VALUE = {value}\n")
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    out = tmp_path / "ab"
    monkeypatch.delenv("PYTHONPATH", raising=False)
    script.main([
        "--new", str(tmp_path / "new"), "--old", str(tmp_path / "old"), "--rounds", "2",
        "--out", str(out), "--key", "s,mask", "--metric", "rate.v", "--peer", "peer.v",
        "--", sys.executable, str(bench), "--out", "{out}",
    ])  # fmt: skip
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [run["tree"] for run in data["runs"]] == ["new", "old", "old", "new"]
    row = next(line for line in (tmp_path / "ab.md").read_text().splitlines() if "| 64 |" in line)
    assert row == "| 64 | full | 12 (12-12) | 10 (10-10) | 1.200 | 1.200 | 1.000 |"
    assert script.render(data) == (tmp_path / "ab.md").read_text()


def test_a_failing_command_is_reported_with_its_tree(script, tmp_path):
    with pytest.raises(RuntimeError, match=r"failed \(3\) on old"):
        script.run_command([sys.executable, "-c", "raise SystemExit(3)", "{out}"], "old", "p")


def test_the_command_must_name_its_output(script, tmp_path):
    with pytest.raises(SystemExit):
        script.main(["--old", "o", "--", sys.executable, "bench.py"])
