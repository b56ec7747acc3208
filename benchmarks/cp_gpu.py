"""Context parallelism on GPUs in one call: correctness against one GPU, then scaling.

Run on a multi-GPU machine (NCCL, bf16, Triton kernels) from the repository root::

    PYTHONPATH=src torchrun --nproc_per_node=8 benchmarks/cp_gpu.py --out DIR [--quick]

1. Correctness, per mask (causal document, share question, sliding window, prefix-LM document) x
   mode x balancer, at ``--check-tokens`` tokens per GPU: the context-parallel out, lse, dq, dk, dv
   (gathered to the full sequence) against a float32 reference, judged by the tolerance rule with
   the single-GPU FlashMask kernel on the full sequence, same bf16 inputs, as the low-precision
   baseline: ``max err <= 2 x max err(single GPU) + 2 x noise`` and
   ``mean err <= 1.1 x mean err(single GPU) + mean noise`` (``tests/tolerance.py``).
2. Scaling at ``--tokens`` tokens per GPU for sub-groups of 1, 2, 4, ... ranks: median
   forward+backward step time (slowest rank), mask-aware TFLOP/s per GPU (visible pairs; backward
   = 2.5 x forward), bytes each mode actually moved (every rank's logs, summed) next to the
   planner's prediction, and the plan's imbalance.

Writes ``DIR/cp_gpu.json`` and ``DIR/cp_gpu.md`` (rank 0; ``--out`` defaults to ``$OUT`` or
the current folder). Every piece takes a device and a
backend, so ``tests/distributed/test_cp_gpu_script.py`` runs it on CPU/gloo at toy sizes.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import flashmask
from flashmask import masks
from flashmask.distributed import (
    BALANCERS,
    MODES,
    context_parallel_attention,
    dispatch,
    make_plan,
    track_communication,
    undispatch,
)

CHECK_MASKS = ("causal_document", "share_question", "sliding_window", "prefix_lm_document")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Config:
    """What to run: sizes, masks, balancers and repeats (the command line's defaults)."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    masks: tuple[str, ...] = CHECK_MASKS
    modes: tuple[str, ...] = MODES
    balancers: tuple[str, ...] = BALANCERS
    overlaps: tuple[bool, ...] = (True, False)
    batch: int = 1
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    chunk_size: int = 1024
    check_tokens: int = 2048  # per GPU, correctness
    tokens: int = 8192  # per GPU, scaling
    scaling_world_sizes: tuple[int, ...] = ()  # default: 1, 2, 4, ... up to the world size
    warmup: int = 2
    iters: int = 10
    seed: int = 0


@dataclass
class Check:
    mask: str
    mode: str
    balancer: str
    overlap: bool
    world_size: int
    seqlen: int
    passed: bool
    errors: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Timing:
    mask: str
    mode: str
    balancer: str
    overlap: bool
    world_size: int
    seqlen: int
    step_ms: float
    tflops_per_gpu: float
    imbalance: float
    bytes_moved: int
    bytes_predicted: int


# ---------------------------------------------------------------------- tolerance rule
def rule(actual: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor) -> dict[str, float]:
    """The rule of ``tests/tolerance.py``, as numbers: ``ok`` is 1.0 when both bounds hold."""
    hi = ref_hi.double()
    err = (actual.double() - hi).abs()
    base = (ref_lo.double() - hi).abs()
    low = ref_hi.to(actual.dtype)
    noise = ((low + 0.3) - 0.3 - low).abs().double()
    if err.numel() == 0:
        return {"ok": 1.0, "max_err": 0.0, "max_bound": 0.0, "mean_err": 0.0, "mean_bound": 0.0}
    max_bound = 2 * base.max().item() + 2 * noise.max().item()
    mean_bound = 1.1 * base.mean().item() + noise.mean().item()
    finite = bool(torch.isfinite(actual).all())
    ok = finite and err.max().item() <= max_bound and err.mean().item() <= mean_bound
    return {
        "ok": float(ok),
        "max_err": err.max().item(),
        "max_bound": max_bound,
        "mean_err": err.mean().item(),
        "mean_bound": mean_bound,
    }


# ---------------------------------------------------------------------- pieces
def global_inputs(cfg: Config, seqlen: int, device: torch.device, seed: int):
    """Identical full-sequence q, k, v, dout on every rank (seeded CPU draws, then moved)."""
    g = torch.Generator().manual_seed(seed)
    dtype = _DTYPES[cfg.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    q = randn(cfg.batch, seqlen, cfg.heads, cfg.head_dim)
    k = randn(cfg.batch, seqlen, cfg.kv_heads, cfg.head_dim)
    v = randn(cfg.batch, seqlen, cfg.kv_heads, cfg.head_dim)
    dout = randn(cfg.batch, seqlen, cfg.heads, cfg.head_dim)
    return q, k, v, dout


def example_mask(name: str, seqlen: int, cfg: Config, device: torch.device):
    generator = torch.Generator().manual_seed(cfg.seed)
    return masks.example(name, seqlen, batch_size=cfg.batch, generator=generator, device=device)


def single_device(mask, q, k, v, dout, dtype=None):
    """``flashmask_attention`` on the full sequence (optionally upcast): out, lse, grads."""
    leaves = [(t if dtype is None else t.to(dtype)).detach().requires_grad_() for t in (q, k, v)]
    out, lse = flashmask.flashmask_attention(*leaves, mask, return_softmax_lse=True)
    out.backward(dout if dtype is None else dout.to(dtype))
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def context_parallel_step(plan, mode, overlap, group, q, k, v, dout):
    """Dispatch, fwd+bwd with ``context_parallel_attention``, and the local results."""
    local = [dispatch(t, plan, 1, group=group).requires_grad_() for t in (q, k, v)]
    out, lse = context_parallel_attention(*local, plan, mode=mode, group=group, overlap=overlap,
                                          return_softmax_lse=True)  # fmt: skip
    out.backward(dispatch(dout, plan, 1, group=group))
    return out.detach(), lse.detach(), [t.grad for t in local]


def check_mask(cfg: Config, name: str, group, device: torch.device) -> list[Check]:
    """Correctness of every mode x balancer for one mask on ``group``."""
    world = dist.get_world_size(group)
    seqlen = cfg.check_tokens * world
    mask = example_mask(name, seqlen, cfg, device)
    q, k, v, dout = global_inputs(cfg, seqlen, device, cfg.seed)
    hi_dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref_hi = single_device(mask, q, k, v, dout, hi_dtype)
    ref_lo = single_device(mask, q, k, v, dout)
    results = []
    for balancer in cfg.balancers:
        plan = make_plan(mask, world, chunk_size=cfg.chunk_size, balancer=balancer)
        for mode, overlap in itertools.product(cfg.modes, cfg.overlaps):
            out, lse, grads = context_parallel_step(plan, mode, overlap, group, q, k, v, dout)
            full = [undispatch(out, plan, 1, group=group), undispatch(lse, plan, 2, group=group)]
            full += [undispatch(g, plan, 1, group=group) for g in grads]
            errors = {}
            names = ("out", "lse", "dq", "dk", "dv")
            his = [ref_hi[0], ref_hi[1], *ref_hi[2]]
            los = [ref_lo[0], ref_lo[1], *ref_lo[2]]
            for label, a, h, lo in zip(names, full, his, los, strict=True):
                if label == "lse":
                    # Fully masked rows are -inf in all three; compare the finite ones.
                    same = torch.equal(torch.isinf(a), torch.isinf(h))
                    keep = torch.isfinite(h)
                    a, h, lo = a[keep], h[keep], lo[keep]
                    errors[label] = rule(a, h, lo)
                    errors[label]["ok"] *= float(same)
                else:
                    errors[label] = rule(a, h, lo)
            passed = all(e["ok"] == 1.0 for e in errors.values())
            results.append(Check(name, mode, balancer, overlap, world, seqlen, passed, errors))
    return results


def time_mask(cfg: Config, name: str, group, device: torch.device) -> list[Timing]:
    """Step time, TFLOP/s per GPU and bytes of every mode x balancer at ``cfg.tokens``/GPU."""
    world = dist.get_world_size(group)
    seqlen = cfg.tokens * world
    mask = example_mask(name, seqlen, cfg, device)
    q, k, v, dout = global_inputs(cfg, seqlen, device, cfg.seed + 1)
    results = []
    for balancer in cfg.balancers:
        plan = make_plan(mask, world, chunk_size=cfg.chunk_size, balancer=balancer)
        local = [dispatch(t, plan, 1, group=group).requires_grad_() for t in (q, k, v)]
        dout_local = dispatch(dout, plan, 1, group=group)
        # Visible pairs per query head: the plan counts per mask head.
        pairs = int(plan.pairs.sum()) * (cfg.heads // mask.num_heads)
        flops = pairs * 4 * cfg.head_dim * 3.5  # forward 4*D per pair, backward 2.5x forward
        for mode, overlap in itertools.product(cfg.modes, cfg.overlaps):
            times = []
            for i in range(cfg.warmup + cfg.iters):
                _sync(device)
                dist.barrier(group)
                with track_communication() as log:
                    start = time.perf_counter()
                    out = context_parallel_attention(
                        *local, plan, mode=mode, group=group, overlap=overlap
                    )
                    out.backward(dout_local)
                    _sync(device)
                    elapsed = time.perf_counter() - start
                for t in local:
                    t.grad = None
                if i >= cfg.warmup:
                    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                    times.append(slowest.item())
            moved = torch.tensor(
                [log.forward_bytes + log.backward_bytes], dtype=torch.float64, device=device
            )
            dist.all_reduce(moved, group=group)
            step = statistics.median(times) if times else float("nan")
            item = _DTYPES[cfg.dtype].itemsize
            kv_bytes = cfg.batch * cfg.kv_heads * 2 * cfg.head_dim * item
            # all_gather reduce-scatters 16-bit gradients in float32 (exchange.py).
            grad_bytes = kv_bytes * 4 // item if mode == "all_gather" and item < 4 else kv_bytes
            chunks = int(plan.transfers(mode).sum()) * plan.chunk_size
            results.append(
                Timing(
                    name,
                    mode,
                    balancer,
                    overlap,
                    world,
                    seqlen,
                    step * 1e3,
                    flops / step / world / 1e12 if times else float("nan"),
                    plan.imbalance,
                    int(moved.item()),
                    chunks * (kv_bytes + grad_bytes),
                )
            )
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- driver
def run(cfg: Config, device: torch.device) -> dict:
    """Every check and timing on the already initialised default group; rank 0's dict."""
    world, rank = dist.get_world_size(), dist.get_rank()
    checks = []
    for name in cfg.masks:
        checks += check_mask(cfg, name, None, device)
    powers = tuple(2**i for i in range(world.bit_length()))
    sizes = cfg.scaling_world_sizes or (powers if world in powers else (*powers, world))
    timings = []
    for p in sizes:
        # new_group is collective over the whole world, even for ranks outside it.
        group = dist.new_group(list(range(p))) if p < world else None
        if rank < p:
            for name in cfg.masks:
                timings += time_mask(cfg, name, group, device)
        dist.barrier()
    return {
        "meta": metadata(world, device),
        "config": asdict(cfg),
        "checks": [asdict(c) for c in checks],
        "timings": [asdict(t) for t in timings],
        "passed": all(c.passed for c in checks),
    }


def metadata(world: int, device: torch.device) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        import triton

        meta["triton"] = triton.__version__
    return meta


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Context parallelism on {meta.get('gpu', meta['device'])} x {meta['world_size']}",
        "",
        f"{meta['date']}, torch {meta['torch']}, triton {meta.get('triton', '-')}; "
        f"config: {result['config']}",
        "",
        "## Correctness (tolerance rule vs the single-GPU kernel on the full sequence)",
        "",
        "| mask | mode | balancer | overlap | ranks | tokens | pass | worst max err / bound |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for c in result["checks"]:
        worst = max(
            c["errors"].items(), key=lambda kv: kv[1]["max_err"] / (kv[1]["max_bound"] or 1)
        )
        lines.append(
            f"| {c['mask']} | {c['mode']} | {c['balancer']} | {c['overlap']} | {c['world_size']} | "
            f"{c['seqlen']} | "
            f"{'yes' if c['passed'] else 'NO'} | {worst[0]} {worst[1]['max_err']:.2e} / "
            f"{worst[1]['max_bound']:.2e} |"
        )
    lines += [
        "",
        "## Scaling (forward + backward per attention call)",
        "",
        "| mask | ranks | tokens | mode | balancer | overlap | step ms | TFLOP/s/GPU | imbalance | "
        "GiB moved | GiB predicted |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in result["timings"]:
        lines.append(
            f"| {t['mask']} | {t['world_size']} | {t['seqlen']} | {t['mode']} | {t['balancer']} | "
            f"{t['overlap']} | {t['step_ms']:.2f} | {t['tflops_per_gpu']:.1f} | "
            f"{t['imbalance']:.3f} | "
            f"{t['bytes_moved'] / 2**30:.3f} | {t['bytes_predicted'] / 2**30:.3f} |"
        )
    lines += ["", f"All correctness checks passed: {result['passed']}"]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "cp_gpu.json")
    md_path = os.path.join(out_dir, "cp_gpu.md")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    with open(md_path, "w") as f:
        f.write(markdown(result))
    return json_path, md_path


def parse(argv: list[str] | None = None) -> tuple[Config, str, str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="document balancer, 2 masks, 3 iters")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="nccl on cuda (default), gloo on cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU for scaling")
    p.add_argument("--check-tokens", type=int, default=2048, help="tokens per GPU for checks")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    if a.iters < 1:
        p.error("--iters must be >= 1")
    cfg = Config(
        device=a.device,
        dtype=a.dtype,
        chunk_size=a.chunk_size,
        check_tokens=a.check_tokens,
        tokens=a.tokens,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        iters=a.iters,
    )
    if a.quick:
        cfg.masks, cfg.balancers, cfg.iters = CHECK_MASKS[:2], ("document",), 3
    backend = a.backend or ("nccl" if a.device.startswith("cuda") else "gloo")
    return cfg, backend, a.out


def main(argv: list[str] | None = None) -> int:
    cfg, backend, out_dir = parse(argv)
    dist.init_process_group(backend)  # torchrun's environment
    try:
        device = torch.device(cfg.device)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        result = run(cfg, device)
        if dist.get_rank() == 0:
            paths = write(result, out_dir)
            print(markdown(result))
            print("wrote", *paths)
        return 0 if result["passed"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
