"""Where a launch's host time goes (H200 host, Triton 3.6): each phase of ``JITFunction.run``
(argument binding and specialisation, the cache key, the launch-metadata call, the C launcher,
which also encodes the TMA descriptors), per kernel, over cached FlashMask forward + backward
calls at 8K, hd128; next to it the host time of the library's Python layers with the kernels
replaced by stand-ins that only allocate their outputs (custom ops, autograd, validation), and a
pure-Python loop that calibrates this host against another machine's.

A synchronize follows every call, outside every timer, so no launch waits for room in the GPU's
queue. Usage: ``PYTHONPATH=src python benchmarks/host_costs.py --masks sliding_window,full``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from bench_cases import case_parser, mask_case
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction, compute_cache_key

from flashmask import bench, flashmask_attention, kernels
from flashmask.kernels import hardware, routing


def python_loop_us(n: int = 200_000) -> float:
    """Microseconds of a fixed pure-Python loop (the host's speed, comparable across machines)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(n):
        total += i % 7
    return (time.perf_counter() - t0) * 1e6


def phased_run(phases: dict[str, defaultdict]):
    """A replacement for Triton 3.6's ``JITFunction.run`` (cached kernels only; a kernel not yet
    compiled goes through the original) that adds each phase's time to ``phases[kernel name]``."""
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel_cache, kernel_key_cache, _, _, binder = self.device_caches[device]
        t1 = time.perf_counter()
        bound_args, specialization, options = binder(*args, **kwargs)
        t2 = time.perf_counter()
        key = compute_cache_key(kernel_key_cache, specialization, options)
        kernel = kernel_cache.get(key, None)
        t3 = time.perf_counter()
        if kernel is None or warmup or self.pre_run_hooks:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        values = bound_args.values()
        metadata = kernel.launch_metadata(grid, stream, *values)
        t4 = time.perf_counter()
        kernel.run(
            grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, metadata,
            knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values,
        )  # fmt: skip
        t5 = time.perf_counter()
        entry = phases[self.fn.__name__]
        for phase, dt in (
            ("device/stream", t1 - t0), ("bind+specialise", t2 - t1), ("cache key", t3 - t2),
            ("launch metadata", t4 - t3), ("C launcher", t5 - t4), ("count", 1),
        ):  # fmt: skip
            entry[phase] += dt
        return kernel

    return original, run


def dispatch_costs(repeats: int = 500, device: str = "cuda") -> None:
    """Host microseconds of a forward + backward through a ``torch.library`` custom-op pair (as
    :mod:`flashmask.ops`) against a plain ``torch.autograd.Function``, both over stand-in
    kernels that only allocate their outputs, and of ``autograd.grad`` through one multiply."""

    def fwd(q):
        return torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)

    @torch.library.custom_op("host_costs::fwd", mutates_args=())
    def op_fwd(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fwd(q)

    @torch.library.custom_op("host_costs::bwd", mutates_args=())
    def op_bwd(
        do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, do, dlse):
        return op_bwd(do, *ctx.saved_tensors)

    op_fwd.register_autograd(backward, setup_context=setup)

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return fwd(q)

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    q, k, v, do = (torch.randn(1, 256, 2, 64, device=device) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cases = (
        ("custom ops", lambda: torch.autograd.grad(op_fwd(q, k, v)[0], (q, k, v), do)),
        ("autograd.Function", lambda: torch.autograd.grad(Plain.apply(q, k, v)[0], (q, k, v), do)),
        ("autograd.grad of q * 2", lambda: torch.autograd.grad(q * 2, (q,), do)),
    )
    for label, fn in cases:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
        print(f"dispatch, {label}: {total * 1e6 / repeats:.1f} us per forward + backward")


def main() -> None:
    parser = case_parser(__doc__, masks_default="sliding_window,full")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    d, s = 128, args.seqlens[0]
    batch, heads = max(1, args.tokens // s), max(1, args.hidden // d)
    print(f"pure-Python loop: {python_loop_us():.0f} us")
    dispatch_costs()
    for name in args.masks:
        mask, _, causal = mask_case(name, s, batch)
        mask = mask.to("cuda") if mask is not None else None
        q, k, v, do = (
            torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def call():
            out = flashmask_attention(q, k, v, mask, causal=causal)
            bench.input_gradients(out, (q, k, v), do)
            torch.cuda.synchronize()

        for _ in range(3):
            call()
        phases: dict[str, defaultdict] = defaultdict(lambda: defaultdict(float))
        original, run = phased_run(phases)
        JITFunction.run = run
        try:
            t_total = 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = flashmask_attention(q, k, v, mask, causal=causal)
                bench.input_gradients(out, (q, k, v), do)
                t_total += time.perf_counter() - t0
                torch.cuda.synchronize()
        finally:
            JITFunction.run = original
        print(f"{s} {name}: cached fwd+bwd host {t_total * 1e6 / args.repeats:.1f} us per call")
        for kernel_name, entry in phases.items():
            n = entry.pop("count")
            parts = ", ".join(f"{p} {t * 1e6 / n:.1f}" for p, t in entry.items())
            print(f"    {kernel_name}: x{n / args.repeats:.0f} per call, us per launch: {parts}")

        # The library's Python layers alone: kernels replaced by output allocations.
        def fake_forward(q, k, v, sri, causal, scale, **_):
            b, sq, hq, _ = q.shape
            return torch.empty_like(q), torch.empty(b, hq, sq, device=q.device)

        def fake_backward(dout, dlse, q, k, v, *_, **__):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        real = kernels.forward, kernels.backward
        kernels.forward, kernels.backward = fake_forward, fake_backward
        try:
            times = {"forward": 0.0, "backward": 0.0}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = flashmask_attention(q, k, v, mask, causal=causal)
                t1 = time.perf_counter()
                bench.input_gradients(out, (q, k, v), do)
                times["forward"] += t1 - t0
                times["backward"] += time.perf_counter() - t1
                torch.cuda.synchronize()
        finally:
            kernels.forward, kernels.backward = real
        print(
            "    stand-in kernels (Python layers only), us per call: "
            + ", ".join(f"{p} {t * 1e6 / args.repeats:.1f}" for p, t in times.items())
        )
        sri = mask.startend_row_indices if mask is not None else None
        cfg = kernels.tile_config(
            d, has_mask=sri is not None, shared_memory=hardware.device_shared_memory(q.device)
        )
        shapes = routing.backward_list_shapes(q, k, v, do, sri, False, cfg)
        for label, fn in (
            ("torch.empty_like(q)", lambda: torch.empty_like(q)),
            ("torch.zeros like q, fp32", lambda: torch.zeros(q.shape, dtype=torch.float32,
                                                             device=q.device)),
            ("prepare_cached, prepared", lambda: kernels.prepare_cached(
                sri, causal, s, s, batch, q.device, shapes)),
        ):  # fmt: skip
            fn()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                fn()
            dt = (time.perf_counter() - t0) * 1e6 / args.repeats
            torch.cuda.synchronize()
            print(f"    {label}: {dt:.1f} us")


if __name__ == "__main__":
    main()
