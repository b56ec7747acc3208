"""``kernels.launch``'s cached launches against Triton's own launch path on the GPU: the same
results, and the host time each takes per forward + backward.

Three launch settings: ``triton`` (``launch.CACHED`` off: every launch through
``kernel[grid](...)``), ``cached`` (the cache on, tensors handed to the launcher as tensors:
``launch.RAW_POINTERS`` off) and ``raw`` (the cache on, tensors handed as their addresses). For
every case (mask, length, head dim, key/value heads) the forward + backward runs in each,
``deterministic`` both ways (the Triton and the Gluon backward): out, lse, dK and dV must be
bitwise equal to the ``triton`` setting's, and dQ too where deterministic (the Gluon backward's
dQ is summed by atomics in any order: within 1e-2 of its largest element). With the cache on
and warm, the number of launches per call that still took Triton's path (``JITFunction.run``)
is printed: 0 means every kernel of the call went through the cache.

Then the host time per call (mask prepared in every call, as ``flashmask bench`` times it) and
``do_bench``'s median, alternating the settings over three rounds (the best of each kept), the
GPU time with the host queued ahead, and FlexAttention's ``do_bench`` median in the same rounds
(its block mask built once, as ``flashmask bench`` times it), so that a slow host moves both.
Usage (H200): ``PYTHONPATH=src python benchmarks/cached_launch.py``; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import triton
from bench_cases import _comma_list, case_parser, mask_case
from eager_check import agree
from host_overhead import host_ms
from triton.runtime.jit import JITFunction

from flashmask import bench, flashmask_attention
from flashmask.kernels import clear_prepared, launch

_TRITON_PATH_CALLS = [0]
_triton_run = JITFunction.run


def _counting_run(self, *args, **kwargs):
    _TRITON_PATH_CALLS[0] += 1
    return _triton_run(self, *args, **kwargs)


JITFunction.run = _counting_run


def results(q, k, v, do, mask, causal, deterministic):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = flashmask_attention(
        q, k, v, mask, causal=causal, deterministic=deterministic, return_softmax_lse=True
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# Each setting: (launch.CACHED, launch.RAW_POINTERS).
SETTINGS = {"triton": (False, False), "cached": (True, False), "raw": (True, True)}


def use(setting: str) -> None:
    launch.CACHED, launch.RAW_POINTERS = SETTINGS[setting]


def main() -> None:
    parser = case_parser(
        __doc__.splitlines()[0], "sliding_window,share_question,causal_document,full,causal"
    )
    parser.set_defaults(seqlens="8192")
    parser.add_argument("--head-dims", type=_comma_list(int), default="128,64,256")
    parser.add_argument("--kv-heads", type=_comma_list(int), default="16,4")
    args = parser.parse_args()
    if args.compile_only:
        parser.error("--compile-only: this script compares launches on a GPU")
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    failures = 0
    print(
        f"{'S':>6} {'D':>4} {'kv':>3} {'mask':<18} {'same':<5} {'triton-path/call':>16} "
        + " ".join(f"{'host ' + n:>11}" for n in SETTINGS)
        + " "
        + " ".join(f"{'bench ' + n:>12}" for n in SETTINGS)
        + f" {'gpu':>7} {'flex':>7}  (ms)"
    )
    for s in args.seqlens:
        for d in args.head_dims:
            for kv in args.kv_heads:
                batch, heads = max(1, args.tokens // s), max(1, args.hidden // d)
                kv = min(kv, heads)
                for name in args.masks:
                    mask, _, causal = mask_case(name, s, batch)
                    mask = mask.to("cuda") if mask is not None else None
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    q, k, v, do = (
                        torch.randn(batch, s, n, d, device="cuda", dtype=torch.bfloat16,
                                    generator=gen)
                        for n in (heads, kv, kv, heads)
                    )  # fmt: skip
                    same, warm_triton_calls = True, 0
                    for deterministic in (True, False):
                        got = {}
                        # each cached setting twice: the first call may fill the cache (a
                        # kernel or key not seen before), the second is warm and is counted
                        runs = ("triton", "cached", "cached", "raw", "raw")
                        for i, setting in enumerate(runs):
                            use(setting)
                            clear_prepared()
                            _TRITON_PATH_CALLS[0] = 0
                            got[setting] = results(q, k, v, do, mask, causal, deterministic)
                            if setting in runs[:i]:
                                warm_triton_calls = max(warm_triton_calls, _TRITON_PATH_CALLS[0])
                        for setting in ("cached", "raw"):
                            for part in got["triton"]:
                                want = got["triton"][part]
                                ok = agree(part, got[setting][part], want, deterministic)
                                same &= ok
                                if not ok:
                                    print(f"FAIL {name} S={s} D={d} kv={kv} {setting} "
                                          f"deterministic={deterministic} {part}")  # fmt: skip
                    failures += not same
                    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

                    def call():
                        clear_prepared()
                        out = flashmask_attention(qg, kg, vg, mask, causal=causal)
                        bench.input_gradients(out, (qg, kg, vg), do)

                    block_mask = bench._flex_block_mask(mask, causal, batch, heads, s, "cuda")()
                    _, flex_total = bench.flex_calls(flex, block_mask, q, k, v, do)
                    host = {setting: [] for setting in SETTINGS}
                    bench_ms = {setting: [] for setting in SETTINGS}
                    flex_ms = []
                    for _ in range(3):
                        for setting in SETTINGS:
                            use(setting)
                            host[setting].append(host_ms(call))
                            bench_ms[setting].append(
                                triton.testing.do_bench(call, rep=100, return_mode="median")
                            )
                        flex_ms.append(
                            triton.testing.do_bench(flex_total, rep=100, return_mode="median")
                        )
                    use("raw")
                    gpu = bench._gpu_time(call)
                    print(
                        f"{s:>6} {d:>4} {kv:>3} {name:<18} {same!s:<5} {warm_triton_calls:>16} "
                        + " ".join(f"{min(host[n]):11.3f}" for n in SETTINGS)
                        + " "
                        + " ".join(f"{min(bench_ms[n]):12.3f}" for n in SETTINGS)
                        + f" {gpu:7.3f} {min(flex_ms):7.3f}",
                        flush=True,
                    )
    print(f"cached launch entries: {len(launch._PLANS)}; cases failed: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
