"""The launch order of the attention kernels' programs (``preparation.program_order``: longest
lists first, by bit length) against the grid's natural order (``preparation.PROGRAM_ORDER`` off),
on the H200, per mask, length and head layout (multi-head and grouped-query).

For each case: the forward and forward+backward of ``flashmask_attention`` with its mask
prepared (cached, as in a model's later layers), timed with ``do_bench`` in both orders; the
forward's out/lse and the backward's dK/dV must be bitwise equal between the orders (a program's
arithmetic does not depend on when it runs), dQ (fp32 atomics in another order) within 1e-2 of
each other relative to its largest value; and the GPU time of computing the orders themselves
(what a new mask pays once). Needs a CUDA GPU::

    PYTHONPATH=src python benchmarks/program_order.py --seqlens 8192,32768 --kv-heads 16,4
"""

from __future__ import annotations

import torch
import triton
from bench_cases import _comma_list, case_parser, mask_case, visible_flop

from flashmask import kernels, masks
from flashmask.attention import flashmask_attention
from flashmask.bench import input_gradients
from flashmask.kernels import preparation


def _run(q, k, v, do, mask, causal):
    out = flashmask_attention(q, k, v, mask, causal=causal)
    return (out, *input_gradients(out, (q, k, v), do))


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0], ",".join(masks.MASK_TYPES))
    parser.add_argument("--kv-heads", type=_comma_list(int), default="16,4")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    d = args.head_dim
    heads = args.hidden // d
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        for kv_heads in args.kv_heads:
            for name in args.masks:
                mask_heads = kv_heads if name == "random_eviction" else 1
                if name in ("full", "causal"):
                    mask, _, causal = mask_case(name, seqlen, batch)
                else:
                    mask = masks.example(
                        name, seqlen, batch_size=batch, num_heads=mask_heads,
                        generator=torch.Generator().manual_seed(0),
                    ).to("cuda")  # fmt: skip
                    causal = mask.causal
                gen = torch.Generator(device="cuda").manual_seed(0)

                def randn(h, gen=gen, batch=batch, seqlen=seqlen):
                    shape = (batch, seqlen, h, d)
                    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

                q, k, v, do = randn(heads), randn(kv_heads), randn(kv_heads), randn(heads)
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                flop = visible_flop(
                    mask.to("cpu") if mask is not None else None, causal, seqlen, d, heads,
                    batch, 4.0,
                )  # fmt: skip
                results = {}
                for ordered in (True, False):
                    preparation.PROGRAM_ORDER = ordered
                    kernels.clear_prepared()
                    got = _run(q, k, v, do, mask, causal)
                    fwd = triton.testing.do_bench(
                        lambda: flashmask_attention(q, k, v, mask, causal=causal), rep=args.rep_ms
                    )
                    total = triton.testing.do_bench(
                        lambda: _run(q, k, v, do, mask, causal), rep=args.rep_ms
                    )
                    results[ordered] = (got, fwd, total)
                preparation.PROGRAM_ORDER = True
                (a, fwd_a, tot_a), (b, fwd_b, tot_b) = results[True], results[False]
                pairs = zip((a[0], a[2], a[3]), (b[0], b[2], b[3]), strict=True)
                same = [torch.equal(x, y) for x, y in pairs]
                dq_diff = float((a[1] - b[1]).abs().max() / b[1].abs().max().clamp_min(1e-30))
                # The orders' own GPU time, as a new mask pays it (forward and backward grids).
                _, lists_f = kernels.prepare_cached(
                    mask.startend_row_indices if mask is not None else None, causal, seqlen,
                    seqlen, batch, q.device, [(128, 128, True)],
                )  # fmt: skip
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(10):
                    preparation._launch_program_orders([(lists_f[0], heads, True)])
                end.record()
                torch.cuda.synchronize()
                order_us = start.elapsed_time(end) / 10 * 1e3
                tag = f"{heads}:{kv_heads}" if kv_heads != heads else f"{heads}"
                print(
                    f"S={seqlen} heads {tag:5s} {name:22s} ordered fwd {fwd_a:.3f} ms "
                    f"({flop / fwd_a / 1e9:.0f} TF/s) fwd+bwd {tot_a:.3f} ms "
                    f"({3.5 * flop / tot_a / 1e9:.0f}) | natural fwd {fwd_b:.3f} fwd+bwd "
                    f"{tot_b:.3f} | speed-up fwd {fwd_b / fwd_a:.3f}x fwd+bwd "
                    f"{tot_b / tot_a:.3f}x | out/dk/dv bitwise {all(same)} dq rel diff "
                    f"{dq_diff:.1e} | one order {order_us:.0f} us",
                    flush=True,
                )


if __name__ == "__main__":
    main()
