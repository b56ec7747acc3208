"""Host microseconds of the pieces of a launch, on the GPU machine's host.

Four parts, all timed with the GPU idle (a synchronize outside every timer), median of rounds:

1. The driver query Triton's C launcher makes once per tensor argument
   (``cuPointerGetAttribute``, called through ctypes; a ctypes call of ``cuCtxGetCurrent``
   beside it for the ctypes overhead itself).
2. Torch and Triton host pieces a call uses: allocations, a tensor descriptor's construction
   (``TensorDescriptor.from_tensor``) and its encoding for the launcher (Triton's
   ``make_tensordesc_arg``, which fills the ``CUtensorMap``).
3. Every launch of one forward + backward (the mask prepared in the call, as ``flashmask bench``
   times it) replayed with its recorded arguments in each launch setting: Triton's path
   (``launch.CACHED`` off), cached with tensors (``RAW_POINTERS`` off) and cached with raw
   addresses (on).
4. Per launch, the compiled launcher called directly with every tensor as its address and with
   every tensor as a tensor; where the two differ by more than 3 us, what each tensor alone
   adds, beside the driver query on its address (to find a tensor whose handling is slow).

Usage (H200): ``PYTHONPATH=src python benchmarks/launch_costs.py --masks sliding_window``.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch
from bench_cases import case_parser, mask_case

from flashmask import bench, flashmask_attention
from flashmask.kernels import clear_prepared, launch
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
from flashmask.kernels.gluon_kernels import forward as gluon_fwd


def per_call_us(fn, repeats: int = 200, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host microseconds per call of ``fn`` (no GPU work)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / repeats)
    return statistics.median(times)


def idle_call_us(fn, repeats: int = 30) -> float:
    """Median host microseconds of ``fn`` (which launches GPU work), each call timed alone with
    the GPU idle: a synchronize after each, outside the timer."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def pointer_query(cuda: ctypes.CDLL, x: torch.Tensor):
    """A function asking the driver about ``x``'s address as Triton's C launcher does
    (``cuPointerGetAttribute`` for ``CU_POINTER_ATTRIBUTE_DEVICE_POINTER``)."""
    address, out = ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64()
    device_pointer_attribute = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    return lambda: cuda.cuPointerGetAttribute(ctypes.byref(out), device_pointer_attribute, address)


def driver_query_costs(x: torch.Tensor) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    query = pointer_query(cuda, x)
    context = ctypes.c_void_p()

    def ctypes_baseline():
        cuda.cuCtxGetCurrent(ctypes.byref(context))

    q_us, base_us = per_call_us(query, 2000), per_call_us(ctypes_baseline, 2000)
    print(f"cuPointerGetAttribute via ctypes     {q_us:8.2f} us")
    print(f"cuCtxGetCurrent via ctypes (baseline) {base_us:7.2f} us")
    print(f"  driver query alone, about           {q_us - base_us:7.2f} us per pointer")


def piece_costs(q: torch.Tensor) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, s, h, d = q.shape
    q2 = q.view(b * s, h * d)
    layout = gluon_fwd.shared_layout(128, d, q.dtype)
    pieces = {
        "torch.empty(1024, int32)": lambda: torch.empty(1024, dtype=torch.int32, device="cuda"),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.zeros(1, int32)": lambda: torch.zeros(1, dtype=torch.int32, device="cuda"),
        "torch.zeros(q.shape, float32)": lambda: torch.zeros(
            q.shape, dtype=torch.float32, device="cuda"
        ),
        "x.view(b * s, h * d)": lambda: q.view(b * s, h * d),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "gluon TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(
            q2, [128, d], layout
        ),
        "q.data_ptr()": q.data_ptr,
    }
    for label, fn in pieces.items():
        if label.startswith("torch.zeros"):
            print(f"{label:<42} {idle_call_us(fn):8.2f} us")
        else:
            print(f"{label:<42} {per_call_us(fn):8.2f} us")


def record_launches(call) -> list[tuple]:
    """``(kernel, grid, args, kwargs)`` of every ``launch_kernel`` of one ``call()``."""
    from flashmask import kernels

    recorded = []
    real = launch.launch_kernel

    def recording(kernel, grid, *args, **kwargs):
        recorded.append((kernel, grid, args, kwargs))
        return real(kernel, grid, *args, **kwargs)

    modules = (kernels, gluon_fwd, gluon_bwd)
    saved = [m.launch_kernel for m in modules]
    for m in modules:
        m.launch_kernel = recording
    try:
        call()
        torch.cuda.synchronize()
    finally:
        for m, original in zip(modules, saved, strict=True):
            m.launch_kernel = original
    return recorded


def descriptor_encoding_costs(recorded: list[tuple]) -> None:
    """Triton's per-launch encoding of each host descriptor of the recorded Gluon launches."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    for kernel, _, args, _ in recorded:
        plans = [p for p in launch._PLANS.values() if p.kernel is kernel]
        if not plans:
            continue
        meta = getattr(plans[0].compiled.metadata, "tensordesc_meta", None)
        descriptors = [a for a in args if hasattr(a, "block_shape") and hasattr(a, "base")]
        if not meta or not descriptors:
            continue
        us = per_call_us(lambda: make_tensordesc_arg(descriptors[0], meta[0]))
        name = getattr(kernel, "__name__", str(kernel))
        print(f"make_tensordesc_arg ({name}, first of {len(descriptors)}) {us:8.2f} us")


def _launcher_call(kernel, grid, a, kw):
    """The cached plan's direct launcher call for a recorded launch, as a function of the
    positional arguments it is handed (``None`` where the launch has no plan)."""
    triton = launch._triton()
    device = triton.current_device()
    state = launch._runtime_state(kernel, triton)
    plan = launch._PLANS.get(launch._key(kernel, device, state, a, kw))
    if plan is None:
        return None
    return lambda args: launch._run_plan(plan, grid, triton.current_stream(device), args, kw)


def per_tensor_costs(recorded: list[tuple], threshold_us: float = 3.0) -> None:
    """For each recorded launch whose tensors cost the launcher more than ``threshold_us``
    together: what each tensor adds when it alone is handed as a tensor (the others as
    addresses), beside the driver query on its address through ctypes. Finds a tensor whose
    handling is slow, if one is."""
    cuda = ctypes.CDLL("libcuda.so.1")
    for kernel, grid, a, kw in recorded:
        run = _launcher_call(kernel, grid, a, kw)
        if run is None:
            print(f"  {getattr(kernel, '__name__', kernel)}: no cached plan")
            continue
        raw = launch._raw_pointers(a)
        base = idle_call_us(lambda: run(raw))
        tensors = idle_call_us(lambda: run(a))
        name = getattr(kernel, "__name__", str(kernel))
        print(f"  {name}: launcher with addresses {base:.1f} us, with tensors {tensors:.1f} us")
        if tensors - base < threshold_us:
            continue
        for i, x in enumerate(a):
            if type(x) is not torch.Tensor:
                continue
            one = tuple(x if j == i else r for j, r in enumerate(raw))
            extra = idle_call_us(lambda: run(one)) - base
            print(
                f"    arg {i:>2} {x.dtype!s:<14} {tuple(x.shape)!s:<24} "
                f"{x.untyped_storage().nbytes() / 2**20:9.1f} MiB  +{extra:7.1f} us "
                f"(ctypes query {per_call_us(pointer_query(cuda, x), 500):.2f} us)"
            )


def main() -> None:
    parser = case_parser(__doc__.splitlines()[0], "sliding_window")
    parser.set_defaults(seqlens="8192")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    d = args.head_dim
    for s in args.seqlens:
        batch, heads = max(1, args.tokens // s), max(1, args.hidden // d)
        q, k, v, do = (
            torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        driver_query_costs(q)
        piece_costs(q)
        for name in args.masks:
            mask, _, causal = mask_case(name, s, batch)
            mask = mask.to("cuda") if mask is not None else None
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def call():
                clear_prepared()
                out = flashmask_attention(qg, kg, vg, mask, causal=causal)
                bench.input_gradients(out, (qg, kg, vg), do)

            call()
            recorded = record_launches(call)
            descriptor_encoding_costs(recorded)
            print(f"{s} {name}: the launcher's cost per tensor argument, the GPU idle")
            per_tensor_costs(recorded)
            print(f"{s} {name}: host us per launch, the GPU idle")
            print(f"  {'kernel':<34} {'grid':<16} {'tensors':>7} {'triton':>8} {'cached':>8} "
                  f"{'raw':>8}")  # fmt: skip
            totals = {"triton": 0.0, "cached": 0.0, "raw": 0.0}
            for kernel, grid, a, kw in recorded:
                row = {}
                for setting, (cached, raw) in (
                    ("triton", (False, False)),
                    ("cached", (True, False)),
                    ("raw", (True, True)),
                ):
                    launch.CACHED, launch.RAW_POINTERS = cached, raw
                    one = lambda: launch.launch_kernel(kernel, grid, *a, **kw)  # noqa: E731
                    row[setting] = idle_call_us(one)
                    totals[setting] += row[setting]
                launch.CACHED, launch.RAW_POINTERS = True, True
                tensors = sum(type(x) is torch.Tensor for x in a)
                label = getattr(kernel, "__name__", str(kernel))[:34]
                print(f"  {label:<34} {grid!s:<16} {tensors:>7} {row['triton']:8.1f} "
                      f"{row['cached']:8.1f} {row['raw']:8.1f}")  # fmt: skip
            print(f"  {'(all launches)':<34} {'':<16} {'':>7} {totals['triton']:8.1f} "
                  f"{totals['cached']:8.1f} {totals['raw']:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
