"""What a new mask's preparation costs on the GPU with the kernels' launch orders, as
``flashmask bench`` measures it (``bench._gpu_time``: device time with the host queued ahead):
the lists alone, the lists and both orders in one launch (``preparation.program_orders``, what a
forward that a Gluon backward follows does), and the lists and the orders in two launches; and
whether the kernel's orders equal ``tiles.program_order``'s (the oracle) at these sizes.
Needs a CUDA GPU::

    PYTHONPATH=src python benchmarks/order_cost.py --seqlens 8192,32768
"""

from __future__ import annotations

import torch
from bench_cases import case_parser

from flashmask import kernels, masks
from flashmask.bench import _gpu_time
from flashmask.kernels import preparation, routing


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0], "sliding_window,global_sliding_window")
    parser.add_argument("--kv-heads", type=int, default=16)
    args = parser.parse_args()
    d = 128
    heads = args.hidden // d
    device = torch.device("cuda")
    fwd_shape = (routing.GLUON_FWD_TILE, routing.GLUON_FWD_TILE, True)
    bwd_shape = (routing.GLUON_BWD_QUERIES, routing.gluon_backward_keys(d), False)
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        for name in args.masks:
            mask = masks.example(name, seqlen, batch_size=batch).to(device)
            sri = mask.startend_row_indices

            def lists():
                kernels.clear_prepared()
                return kernels.prepare_cached(
                    sri, mask.causal, seqlen, seqlen, batch, device, [fwd_shape, bwd_shape]
                )[1]

            def one_launch():
                rows, cols = lists()
                preparation.program_orders([(rows, heads, True), (cols, args.kv_heads, False)])

            def two_launches():
                rows, cols = lists()
                preparation.program_order(rows, heads, True)
                preparation.program_order(cols, args.kv_heads, False)

            # The kernel's orders against the oracle's (torch ops) at this size.
            rows, cols = lists()
            got = preparation.program_orders([(rows, heads, True), (cols, args.kv_heads, False)])
            want = [
                kernels.tiles.program_order(rows.counts, heads, True),
                kernels.tiles.program_order(cols.counts, args.kv_heads, False),
            ]
            exact = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            times = {f.__name__: _gpu_time(f) * 1e3 for f in (lists, one_launch, two_launches)}
            print(
                f"S={seqlen} {name:22s} lists {times['lists']:.1f} us | lists + orders in one "
                f"launch {times['one_launch']:.1f} us | in two {times['two_launches']:.1f} us | "
                f"orders equal the oracle's: {exact}",
                flush=True,
            )


if __name__ == "__main__":
    main()
