"""Time one benchmark command against two source trees, alternating, and compare their medians.

A change to a kernel is judged by the same benchmark run on the tree with it (``--new``, default
``src``) and on the tree without it (``--old``, e.g. ``git archive REV src | tar -x -C old``).
Runs in separate processes drift (clocks, temperature, a neighbour): on one H100 the Gluon
backward, the same kernel in every run, moved by up to 11% between runs of the two trees. So the
trees take turns in ABBA order (new, old, old, new, new, old, ...) for ``--rounds`` runs each, and
each cell is read as the median of its runs, its range beside it::

    python benchmarks/ab_trees.py --old old/src --rounds 3 --out ab_backward \\
        --key s,mask --metric cute.tflops --peer gluon.tflops \\
        -- python benchmarks/cute_backward.py --out {out}

The command runs with the tree first on ``PYTHONPATH`` and must write ``{out}.json`` (``{out}``
replaced by a prefix of this run's own): ``{"cells": [...]}`` (``cute_forward.py``,
``cute_backward.py``) or ``{"rows": [...]}`` (``flashmask bench``). ``--key`` names the fields
that identify a cell, ``--metric`` the number compared (a dotted path into the cell), ``--peer``
optionally one measured beside it in the same run (each tree's median ratio to it is shown).
Writes ``PREFIX.json`` (every run's values) and ``PREFIX.md`` (the table); ``--render
PREFIX.json`` reprints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TREES = ("new", "old")


def abba_order(rounds: int) -> list[str]:
    """The trees' turns: ``new, old, old, new, new, old, ...``, ``rounds`` runs of each."""
    pairs = [TREES if i % 2 == 0 else TREES[::-1] for i in range(rounds)]
    return [tree for pair in pairs for tree in pair]


def value_at(cell: dict, path: str) -> float | None:
    """The number at dotted ``path`` in ``cell`` (``"cute.tflops"``), ``None`` where a step of
    it is missing or the value is not a number (a failed peer's cell holds an error)."""
    value: object = cell
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) else None


def cells_of(result: dict) -> list[dict]:
    """The cells of a benchmark's JSON result (``cells`` or ``rows``)."""
    for name in ("cells", "rows"):
        if isinstance(result.get(name), list):
            return result[name]
    raise ValueError("the result has neither 'cells' nor 'rows'")


def collect(runs: list[dict], keys: list[str], metrics: list[str]) -> dict[tuple, dict]:
    """Per cell key (the values of ``keys``, in first-seen order): per tree and metric, the
    list of its runs' values. ``runs``: ``{"tree": ..., "result": ...}`` each."""
    table: dict[tuple, dict] = {}
    for run in runs:
        for cell in cells_of(run["result"]):
            key = tuple(cell.get(k) for k in keys)
            entry = table.setdefault(key, {t: {m: [] for m in metrics} for t in TREES})
            for metric in metrics:
                value = value_at(cell, metric)
                if value is not None:
                    entry[run["tree"]][metric].append(value)
    return table


def render(data: dict) -> str:
    """The markdown table of a comparison: per cell, each tree's median (range) of the metric,
    new over old, and with a peer each tree's median over the peer's median in its own runs."""
    keys, metric, peer = data["keys"], data["metric"], data.get("peer")
    metrics = [metric] + ([peer] if peer else [])
    table = collect(data["runs"], keys, metrics)
    order = " ".join(run["tree"] for run in data["runs"])
    lines = [
        f"# A/B of two trees: {metric}, median of {data['rounds']} runs each ({order})",
        "",
        f"Command: `{' '.join(data['command'])}`; new: `{data['trees']['new']}`, old: "
        f"`{data['trees']['old']}`.",
        "",
    ]
    head = [*keys, "new", "old", "new / old"]
    if peer:
        head += [f"new / {peer}", f"old / {peer}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for key, entry in table.items():
        row = [str(k) for k in key]
        medians = {}
        for tree in TREES:
            values = entry[tree][metric]
            if values:
                medians[tree] = statistics.median(values)
                row.append(f"{medians[tree]:.4g} ({min(values):.4g}-{max(values):.4g})")
            else:
                row.append("—")
        if len(medians) == 2 and medians["old"]:
            ratio = medians["new"] / medians["old"]
            ratios.append(ratio)
            row.append(f"{ratio:.3f}")
        else:
            row.append("—")
        if peer:
            for tree in TREES:
                peers = entry[tree][peer]
                if tree in medians and peers and statistics.median(peers):
                    row.append(f"{medians[tree] / statistics.median(peers):.3f}")
                else:
                    row.append("—")
        lines.append("| " + " | ".join(row) + " |")
    if ratios:
        geo = statistics.geometric_mean(ratios)
        lines += [
            "",
            f"new / old over {len(ratios)} cells: {min(ratios):.3f}-{max(ratios):.3f}, "
            f"median {statistics.median(ratios):.3f}, geometric mean {geo:.3f}.",
        ]
    return "\n".join(lines) + "\n"


def run_command(command: list[str], tree: str, prefix: str) -> dict:
    """Run ``command`` (``{out}`` replaced by ``prefix``) with ``tree`` first on PYTHONPATH and
    return the JSON it wrote to ``prefix.json``; a failure raises with the command's output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    args = [part.replace("{out}", prefix) for part in command]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed ({done.returncode}) on {tree}:\n{done.stdout[-2000:]}"
            f"\n{done.stderr[-2000:]}"
        )
    return json.loads(Path(f"{prefix}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="the tree without the change (a folder holding flashmask)")
    parser.add_argument("--new", default="src", help="the tree with it (default: src)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree (default 3)")
    parser.add_argument("--out", default="ab_trees", help="prefix of the .json and .md")
    parser.add_argument("--key", default="s,mask", help="comma-separated fields naming a cell")
    parser.add_argument("--metric", default="cute.tflops", help="the number compared")
    parser.add_argument("--peer", help="a number measured beside it in the same run")
    parser.add_argument("--render", type=Path, help="only reprint an earlier comparison's table")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())), end="")
        return
    if not args.old or not command:
        parser.error("give --old and, after --, the benchmark command (with {out})")
    if not any("{out}" in part for part in command):
        parser.error("the command must write {out}.json: put {out} where its output prefix goes")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    trees = {"new": args.new, "old": args.old}
    runs = []
    for i, tree in enumerate(abba_order(args.rounds)):
        prefix = f"{args.out}_run{i}_{tree}"
        runs.append({"tree": tree, "result": run_command(command, trees[tree], prefix)})
        print(f"run {i + 1}/{2 * args.rounds}: {tree} done", flush=True)
    data = {
        "keys": args.key.split(","),
        "metric": args.metric,
        "peer": args.peer,
        "rounds": args.rounds,
        "command": command,
        "trees": trees,
        "runs": runs,
    }
    table = render(data)
    Path(f"{args.out}.json").write_text(json.dumps(data, indent=1))
    Path(f"{args.out}.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
