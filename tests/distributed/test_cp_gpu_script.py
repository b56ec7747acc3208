"""Smoke test of ``benchmarks/cp_gpu.py`` (the multi-GPU script) on CPU/gloo at toy sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.workers import exit_without_teardown

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("cp_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cp_gpu"] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, world: int, path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        cp_gpu = _load()
        cfg = cp_gpu.Config(device="cpu", dtype="float32", balancers=("heap", "document"),
                            heads=2, kv_heads=1, head_dim=8, chunk_size=8, check_tokens=32,
                            tokens=32, warmup=0, iters=1)  # fmt: skip
        result = cp_gpu.run(cfg, torch.device("cpu"))
        if rank == 0:
            cp_gpu.write(result, out_dir)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_without_teardown()


def test_cp_gpu_script_runs_on_gloo_and_checks_pass(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "cp_gpu.json").read_text())
    cp_gpu = _load()
    assert result["passed"], [c for c in result["checks"] if not c["passed"]]
    # masks x balancers x modes x overlap
    assert len(result["checks"]) == len(cp_gpu.CHECK_MASKS) * 2 * 2 * 2
    assert {t["world_size"] for t in result["timings"]} == {1, 2}
    # The bytes every rank logged add up to the planner's prediction.
    for t in result["timings"]:
        assert t["bytes_moved"] == t["bytes_predicted"], t
        assert t["step_ms"] > 0 and t["tflops_per_gpu"] > 0
    md = (tmp_path / "cp_gpu.md").read_text()
    assert "## Correctness" in md and "## Scaling" in md


def test_cp_gpu_script_arguments():
    cp_gpu = _load()
    cfg, backend, _ = cp_gpu.parse(["--quick", "--device", "cpu", "--dtype", "float32"])
    assert backend == "gloo" and cfg.balancers == ("document",) and cfg.iters == 3
    _, backend, _ = cp_gpu.parse([])
    assert backend == "nccl"
    ok = cp_gpu.rule(torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(3))
    assert ok["ok"] == 1.0
    bad = cp_gpu.rule(torch.full((3,), 2.0), torch.ones(3, dtype=torch.float64), torch.ones(3))
    assert bad["ok"] == 0.0
