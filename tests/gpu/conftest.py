"""The GPU tests' matrix size and their JSON summary.

Environment variables:

* ``FLASHMASK_GPU_FULL=1``: the full matrix (every head dim the kernels take); otherwise the
  quick one (head dims 64, 128, 256).
* ``FLASHMASK_GPU_REPORT=PATH``: after the run, write a JSON summary of ``tests/gpu`` to
  ``PATH`` (case counts, pass/fail, the largest errors, which kernels ran, GPU name, torch and
  triton versions, date, git commit; ``FLASHMASK_GIT_COMMIT`` names the commit where the
  checkout has no ``.git``). Written by the process that ran ``pytest tests/gpu ...`` (with
  pytest-xdist, by the controller, from the workers' reports).
"""

from __future__ import annotations

import collections
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import pytest
import torch

FULL = os.environ.get("FLASHMASK_GPU_FULL", "") not in ("", "0")
REPORT_ENV = "FLASHMASK_GPU_REPORT"
# The user property a test records its case under (see ``test_kernels.record``).
CASE_PROPERTY = "flashmask_gpu_case"

# The CuTe kernels' test modules: a Hopper GPU and the ``flashmask[cute]`` extra.
HOPPER_CUTE_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="needs the flashmask[cute] extra"
    ),
]

ROOT = Path(__file__).resolve().parents[2]

_records: list[dict] = []
_start = time.time()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep one record per test of this folder: its call's outcome (or its setup's, when the
    setup failed or skipped) with what the test recorded about its case."""
    if "tests/gpu/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when != "call" and (report.when != "setup" or report.passed):
        return
    record = dict(dict(report.user_properties).get(CASE_PROPERTY, {}))
    record.setdefault("case", report.nodeid.split("::", 1)[-1])
    record["outcome"] = report.outcome
    if report.failed:
        record["message"] = report.longreprtext[-1500:]
    _records.append(record)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Write the summary once the run is over (``FLASHMASK_GPU_REPORT``)."""
    path = os.environ.get(REPORT_ENV)
    if not path or hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        return
    report = {"summary": summary(_records, time.time() - _start), "cases": _records}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def summary(records: list[dict], seconds: float) -> dict:
    """Counts, the worst errors per tensor, the kernels' paths and the environment."""
    outcomes = collections.Counter(r["outcome"] for r in records)
    worst_ratio: dict[str, float] = {}
    worst_error: dict[str, float] = {}
    for r in records:
        for name, err in r.get("errors", {}).items():
            worst_error[name] = max(worst_error.get(name, 0.0), err["max_err"])
            if err.get("ratio_vs_lowp") is not None:
                worst_ratio[name] = max(worst_ratio.get(name, 0.0), err["ratio_vs_lowp"])
    kinds = collections.Counter(r.get("kind", "?") for r in records)
    paths = collections.Counter(r["kernels"] for r in records if "kernels" in r)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "matrix": "full" if FULL else "quick",
        "cases": len(records),
        "passed": outcomes["passed"],
        "failed": outcomes["failed"],
        "skipped": outcomes["skipped"],
        "cases_by_kind": dict(sorted(kinds.items())),
        # max |result - reference| over every case, and the largest ratio of that error to the
        # error of PyTorch's own attention in the same dtype (the tolerance rule allows 2 plus
        # the rounding noise of the output dtype: up to ~1.5 where both are one rounding).
        "max_abs_error": worst_error,
        "max_error_ratio_vs_lowp": worst_ratio,
        "kernel_paths": dict(sorted(paths.items())),
        "seconds": round(seconds, 1),
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _commit() -> str | None:
    """``FLASHMASK_GIT_COMMIT``, else ``git rev-parse HEAD`` (``+dirty`` with local changes)."""
    if os.environ.get("FLASHMASK_GIT_COMMIT"):
        return os.environ["FLASHMASK_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")
