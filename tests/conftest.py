"""Test configuration: Triton interpreter on CPU-only machines, hypothesis profiles, GPU skips.

Environment variables:

* ``FLASHMASK_RANDOM_CASES``: multiplier for every random-case count (hypothesis examples and
  seeded loops), default 1; e.g. ``FLASHMASK_RANDOM_CASES=10`` for a long fuzzing run.
* ``HYPOTHESIS_PROFILE``: ``ci`` (default: derandomized, reproducible) or ``dev`` (random seeds).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch  # importing torch does not import triton

# Must run before anything imports triton: kernel tests on a machine without CUDA run through
# Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

from tests.strategies import random_cases

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    max_examples=random_cases(25),
    suppress_health_check=_HEALTH,
)
settings.register_profile(
    "dev",
    deadline=None,
    print_blob=True,
    max_examples=random_cases(100),
    suppress_health_check=_HEALTH,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist, share the cores between workers: oversubscribed intra-op threads spin and
# make the many tiny tensor ops of this suite several times slower.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def import_benchmark(monkeypatch):
    """``import_benchmark(name)`` imports the script ``benchmarks/<name>.py`` as a module, with
    the folder on ``sys.path`` for the test only (as the scripts import their siblings)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module
