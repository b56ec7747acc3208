"""Compile reports of the kernels for sm_90, without a GPU (shared by their tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_reports(family: str) -> list[dict]:
    """Run ``benchmarks/sass_report.py --family <family> --json`` and return its JSON lines
    (one per compiled variant).

    A process of its own: Gluon cannot be imported where Triton's interpreter is on, as the
    kernel tests turn it on for the whole test process."""
    return json_lines([str(ROOT / "benchmarks" / "sass_report.py"), "--family", family, "--json"])


def json_lines(args: list[str]) -> list[dict]:
    """Run ``python *args`` with ``src`` importable and Triton's interpreter off (so that Gluon
    modules import) and return the JSON lines it prints; a failure raises with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=900
    )
    if run.returncode != 0:
        raise AssertionError(run.stderr[-2000:])
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
