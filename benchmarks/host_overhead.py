"""Is a call host-bound? Per call, the host's enqueue time against the GPU's time, for FlashMask
(with its mask prepared in every call, as ``flashmask bench`` times it, and with the mask
prepared once, as a model's later layers and the backward find it) and FlexAttention (its block
mask built once, as ``flashmask bench`` times it).

Columns, per implementation and pass (``fwd``, ``fwd+bwd``), all in ms per call:
* ``bench``: ``triton.testing.do_bench``'s median, which is what ``flashmask bench`` reports;
* ``host``: the host's time to enqueue one call (many calls back to back, one synchronize);
* ``gpu``: the device time with the host queued ahead (``bench._gpu_time``: the calls wait
  behind a GPU sleep, so launch gaps vanish), as in a training step whose host runs ahead.

``bench`` close to ``host`` and above ``gpu`` means the bench measured the host, not the kernels.

Usage (H200): ``PYTHONPATH=src python benchmarks/host_overhead.py --seqlens 8192``;
``--profile`` also prints where the host time of one forward + backward goes (cProfile, the
mask prepared in every call as the bench does, the first mask and length only);
``--breakdown`` the host time per call inside named library functions, timed by wrappers
(cProfile misattributes time under the custom ops' Dynamo-disabled frames); ``--kernels`` the
GPU time per call of each kernel of both implementations' forward + backward
(``torch.profiler``), for every case.
"""

from __future__ import annotations

import time

import torch
import triton
from bench_cases import case_parser, mask_case

from flashmask import bench, flashmask_attention
from flashmask.kernels import (
    clear_prepared,
    routing,
)


def host_ms(fn, repeats: int = 50) -> float:
    """Host enqueue time per call (ms): ``repeats`` calls timed before the one synchronize that
    follows them (the launch queue holds far more than ``repeats`` calls' kernels, so the host
    does not wait for the GPU unless the call itself synchronizes)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / repeats


def measure(fn, rep_ms: int) -> tuple[float, float, float]:
    b = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    return float(b), host_ms(fn), bench._gpu_time(fn)


def main() -> None:
    parser = case_parser(__doc__)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--kv-heads", type=int, default=0, help="key/value heads (0: as many as query heads)"
    )
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also print the host time per call inside named library functions, every case",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also print the GPU time per call of each kernel of every case's forward+backward",
    )
    parser.add_argument(
        "--fwd-masked-limits",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="time FlashMask once per value of routing.GLUON_FWD_MIN_MASKED_SEQLEN, e.g. "
        "8192,32768 (masked calls on the Gluon forward from that many keys, else the Triton one)",
    )
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    shipped_limit = routing.GLUON_FWD_MIN_MASKED_SEQLEN
    limits = args.fwd_masked_limits or [shipped_limit]

    # Static shapes, as flashmask bench compiles it (a dynamic-length compile runs slower).
    flex = torch.compile(flex_attention, dynamic=False)
    d = args.head_dim
    print(f"{'S':>6} {'mask':<22} {'impl':<18} {'pass':<8} {'bench':>7} {'host':>7} {'gpu':>7}")
    for s in args.seqlens:
        batch, heads = max(1, args.tokens // s), max(1, args.hidden // d)
        for name in args.masks:
            mask, _, causal = mask_case(name, s, batch)
            mask = mask.to("cuda") if mask is not None else None
            kv_heads = args.kv_heads or heads
            q, k, v, do = (
                torch.randn(batch, s, n, d, device="cuda", dtype=torch.bfloat16)
                for n in (heads, kv_heads, kv_heads, heads)
            )
            qg, kg, vg = (x.requires_grad_() for x in (q.clone(), k.clone(), v.clone()))

            def fm_fwd(fresh: bool):
                def call():
                    if fresh:
                        clear_prepared()
                    return flashmask_attention(qg, kg, vg, mask, causal=causal)

                return call

            def fm_total(fresh: bool):
                def call():
                    if fresh:
                        clear_prepared()
                    out = flashmask_attention(qg, kg, vg, mask, causal=causal)
                    bench.input_gradients(out, (qg, kg, vg), do)

                return call

            block_mask = bench._flex_block_mask(mask, causal, batch, heads, s, "cuda")()
            fx_fwd, fx_total = bench.flex_calls(flex, block_mask, q, k, v, do)
            cases = [
                ("flashmask prep/call", "fwd", fm_fwd(True)),
                ("flashmask prep/call", "fwd+bwd", fm_total(True)),
                ("flashmask cached", "fwd", fm_fwd(False)),
                ("flashmask cached", "fwd+bwd", fm_total(False)),
            ]
            for limit in limits:
                routing.GLUON_FWD_MIN_MASKED_SEQLEN = limit
                if args.fwd_masked_limits:
                    print(f"== GLUON_FWD_MIN_MASKED_SEQLEN = {limit}")
                for impl, part, fn in cases:
                    b, h, g = measure(fn, args.rep_ms)
                    print(f"{s:>6} {name:<22} {impl:<18} {part:<8} {b:7.3f} {h:7.3f} {g:7.3f}")
                if args.breakdown:  # on each route
                    for impl, fresh in (("prep/call", True), ("cached", False)):
                        print(f"{s:>6} {name:<22} flashmask {impl} fwd+bwd, host us per call:")
                        for label, count, us in host_breakdown(qg, kg, vg, do, mask, causal, fresh):
                            print(f"{'':>8}{us:9.1f} us  x{count:<3} {label}")
                clear_prepared()  # the next limit's route prepares other lists
            routing.GLUON_FWD_MIN_MASKED_SEQLEN = shipped_limit
            for impl, part, fn in (("flex", "fwd", fx_fwd), ("flex", "fwd+bwd", fx_total)):
                b, h, g = measure(fn, args.rep_ms)
                print(f"{s:>6} {name:<22} {impl:<18} {part:<8} {b:7.3f} {h:7.3f} {g:7.3f}")
            if args.kernels:
                for impl, fn in (("flashmask", fm_total(True)), ("flex", fx_total)):
                    print(f"{s:>6} {name:<22} {impl} fwd+bwd, GPU time per call by kernel:")
                    for kernel, count, us in kernel_times(fn):
                        print(f"{'':>8}{us:9.1f} us  x{count:<3} {kernel}")
            if args.profile:
                args.profile = False
                profile_host(fm_total(True))
            clear_prepared()


def kernel_times(fn, repeats: int = 20, width: int = 90) -> list[tuple[str, int, float]]:
    """``(kernel name, launches per call, GPU microseconds per call)`` of every kernel ``fn``
    launches, longest first, from ``torch.profiler`` over ``repeats`` calls (after one warm-up
    call), the last row their total."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    rows = [(e.key[:width], e.count // repeats, e.device_time_total / repeats) for e in events]
    rows.append(("(all kernels)", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    return rows


def host_breakdown(q, k, v, do, mask, causal, fresh: bool, repeats: int = 50):
    """``(label, calls per call, host microseconds per call)`` of one forward + backward
    (``fresh``: the mask prepared in the call), inclusive times of the wrapped functions below,
    with a synchronize after each call so that no launch waits for room in the GPU's queue
    (the synchronize itself is outside every timer)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import JITFunction

    from flashmask import kernels
    from flashmask.kernels.gluon_kernels import backward as gluon_bwd
    from flashmask.kernels.gluon_kernels import forward as gluon_fwd

    totals: dict[str, list[float]] = {}
    active: set[str] = set()

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            if label in active:  # a recursive call (kernels.forward through its config fitting)
                return fn(*args, **kwargs)
            active.add(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                active.discard(label)
                entry = totals.setdefault(label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

        return wrapper

    patches = [
        (kernels, "forward", "kernels.forward"),
        (kernels, "backward", "kernels.backward"),
        (kernels, "prepare_cached", "kernels.prepare_cached"),
        (kernels, "prepare_forward", "forward_launcher.prepare_plan"),
        (kernels, "program_orders", "preparation.program_orders"),
        (kernels, "backward_delta", "backward_launcher.backward_delta (incl. launch)"),
        (gluon_bwd, "launch", "gluon_bwd.launch"),
        (gluon_fwd, "forward", "gluon_fwd.forward"),
        (kernels, "_summarize", "preparation._summarize"),
        (kernels, "_build_lists", "preparation._build_lists"),
        (kernels, "_launch_program_orders", "preparation._launch_program_orders"),
        # Each launch: kernels.launch's cached path, and Triton's own where it falls back. The
        # modules call launch_kernel through their own global, so each is wrapped there.
        *(
            (m, "launch_kernel", "launch_kernel (each launch)")
            for m in (kernels, gluon_fwd, gluon_bwd)
        ),
        (JITFunction, "run", "JITFunction.run (Triton's launch path)"),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, timed(label, getattr(owner, name)))
    saved.append((TensorDescriptor, "from_tensor", TensorDescriptor.__dict__["from_tensor"]))
    TensorDescriptor.from_tensor = staticmethod(
        timed("TensorDescriptor.from_tensor", TensorDescriptor.from_tensor)
    )
    try:
        for timing in (False, True):
            totals.clear()
            for _ in range(repeats if timing else 3):
                if fresh:
                    clear_prepared()
                t0 = time.perf_counter()
                out = flashmask_attention(q, k, v, mask, causal=causal)
                t1 = time.perf_counter()
                bench.input_gradients(out, (q, k, v), do)
                t2 = time.perf_counter()
                del out
                torch.cuda.synchronize()
                for label, dt in (("forward call", t1 - t0), ("backward call", t2 - t1)):
                    entry = totals.setdefault(label, [0, 0.0])
                    entry[0] += 1
                    entry[1] += dt
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    return [(label, n // repeats, t * 1e6 / repeats) for label, (n, t) in totals.items()]


def profile_host(fn, repeats: int = 20) -> None:
    """cProfile of ``repeats`` calls (the GPU runs behind; one synchronize at the end): the
    host-side functions by their own time, then by cumulative time. Few calls, so that their
    launches stay within the GPU's launch queue: 200 calls filled it in the tenth session, and
    the host's wait for room then showed up as the own time of whatever Python frame launched."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
