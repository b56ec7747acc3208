"""What a new mask's preparation costs on the GPU with the kernels' launch orders, as
``flashmask bench`` measures it (``bench._gpu_time``: device time with the host queued ahead):
the lists alone, the lists with both orders computed in their own launch (what a new mask's
forward before the Gluon backward does: ``prepare_cached(orders=...)``), and the lists followed
by one launch of the separate order kernel (``kernels.program_orders`` on lists built without
orders); and whether the orders equal ``tiles.program_order``'s (the oracle) at these sizes,
over repeated preparations (the in-launch orders wait on counters that other programs set).
Needs a CUDA GPU::

    PYTHONPATH=src python benchmarks/order_cost.py --seqlens 8192,32768
"""

from __future__ import annotations

import torch
from bench_cases import case_parser

from flashmask import kernels, masks
from flashmask.bench import _gpu_time


def main() -> None:
    parser = case_parser(__doc__.split("\n\n")[0], "sliding_window,global_sliding_window")
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20, help="preparations checked per case")
    args = parser.parse_args()
    d = 128
    heads = args.hidden // d
    device = torch.device("cuda")
    fwd_shape = (kernels.GLUON_FWD_TILE, kernels.GLUON_FWD_TILE, True)
    bwd_shape = (kernels.GLUON_BWD_QUERIES, kernels.gluon_backward_keys(d), False)
    shapes = [fwd_shape, bwd_shape]
    requests = {fwd_shape: (heads, True), bwd_shape: (args.kv_heads, False)}
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        for name in args.masks:
            mask = masks.example(name, seqlen, batch_size=batch).to(device)
            sri = mask.startend_row_indices

            def prepare(orders=None, sri=sri, seqlen=seqlen, batch=batch):
                kernels.clear_prepared()
                return kernels.prepare_cached(
                    sri, mask.causal, seqlen, seqlen, batch, device, shapes, orders=orders
                )[1]

            def lists_alone():
                prepare()

            def orders_in_list_launch():
                rows, cols = prepare(requests)
                kernels.program_orders([(rows, heads, True), (cols, args.kv_heads, False)])

            def order_launch_after():
                rows, cols = prepare()
                kernels.program_orders([(rows, heads, True), (cols, args.kv_heads, False)])

            # Both forms against the oracle (torch ops), each preparation anew.
            exact = {"in the list launch": True, "separate": True}
            for _ in range(args.repeats):
                for form, orders in (("in the list launch", requests), ("separate", None)):
                    rows, cols = prepare(orders)
                    got = kernels.program_orders(
                        [(rows, heads, True), (cols, args.kv_heads, False)]
                    )
                    want = [
                        kernels.tiles.program_order(rows.counts, heads, True),
                        kernels.tiles.program_order(cols.counts, args.kv_heads, False),
                    ]
                    exact[form] &= all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            times = {
                f.__name__: _gpu_time(f) * 1e3
                for f in (lists_alone, orders_in_list_launch, order_launch_after)
            }
            print(
                f"S={seqlen} {name:22s} lists {times['lists_alone']:.1f} us | with both orders in "
                f"their launch {times['orders_in_list_launch']:.1f} us | orders launched after "
                f"{times['order_launch_after']:.1f} us | orders equal the oracle's over "
                f"{args.repeats} preparations: in the list launch {exact['in the list launch']}, "
                f"separate {exact['separate']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
