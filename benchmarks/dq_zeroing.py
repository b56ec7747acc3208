"""Change 31 against what it replaced, in one run: the Gluon backward's fp32 dQ accumulator
zeroed by the delta kernel (the library's code) or by a zeroing launch of its own after it (the
code before: ``torch.zeros`` in the launcher, here ``zero_()`` on the same buffer). Per mask and
key/value head count, forward+backward with the mask prepared in every call, as ``flashmask
bench`` times it: ``do_bench``'s median (what the bench reports) and the GPU time with the host
queued ahead (``bench._gpu_time``), the two forms alternating over ``--rounds`` rounds. Also
checks that both give bitwise equal dK/dV. Needs a CUDA GPU::

    PYTHONPATH=src python benchmarks/dq_zeroing.py --seqlens 8192 --kv-heads 16,4
"""

from __future__ import annotations

import statistics

import torch
import triton
from bench_cases import _comma_list, case_parser, mask_case

from flashmask import bench, flashmask_attention
from flashmask.kernels import backward_launcher, clear_prepared

_delta_with_zeros = backward_launcher.backward_delta


def _delta_then_zero_launch(out, dout, dlse, dq_accumulator=None):
    """The form before change 31: delta alone, then one more launch zeroing the accumulator."""
    delta = _delta_with_zeros(out, dout, dlse)
    if dq_accumulator is not None:
        dq_accumulator.zero_()
    return delta


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0], "sliding_window,share_question,document")
    parser.add_argument("--kv-heads", type=_comma_list(int), default="16,4")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.compile_only:
        parser.error("--compile-only: this script times the two forms on a GPU")
    d = 128
    heads = args.hidden // d
    forms = {"delta kernel zeros": _delta_with_zeros, "separate zeroing": _delta_then_zero_launch}
    for s in args.seqlens:
        batch = max(1, args.tokens // s)
        for kv_heads in args.kv_heads:
            for name in args.masks:
                mask, _, causal = mask_case(name, s, batch)
                mask = mask.to("cuda") if mask is not None else None
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (
                    torch.randn(batch, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for n in (heads, kv_heads, kv_heads, heads)
                )
                inputs = tuple(x.requires_grad_() for x in (q, k, v))

                def call():
                    clear_prepared()
                    out = flashmask_attention(*inputs, mask, causal=causal)
                    return bench.input_gradients(out, inputs, do)

                times = {form: ([], []) for form in forms}
                grads = {}
                for _ in range(args.rounds):
                    for form, delta_fn in forms.items():
                        backward_launcher.backward_delta = delta_fn
                        try:
                            grads[form] = call()
                            med = triton.testing.do_bench(call, rep=100, return_mode="median")
                            times[form][0].append(float(med))
                            times[form][1].append(bench._gpu_time(call))
                        finally:
                            backward_launcher.backward_delta = _delta_with_zeros
                first, second = (grads[form] for form in forms)
                same = all(torch.equal(a, b) for a, b in zip(first[1:], second[1:], strict=True))
                dq_err = (first[0].float() - second[0].float()).abs().max().item()
                cells = " | ".join(
                    f"{form}: bench {statistics.median(b):.3f} ms, GPU {statistics.median(g):.3f}"
                    for form, (b, g) in times.items()
                )
                print(
                    f"S={s} kv_heads={kv_heads:<2} {name:<16} {cells} | dK/dV bitwise equal: "
                    f"{same}, max|dq diff| {dq_err:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
