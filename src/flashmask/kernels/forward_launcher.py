"""The forward launcher: routes a call to the CuTe, Gluon or Triton forward, prepares the mask
(and, when a backward follows, the backward's lists in the same launches) and launches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmask.kernels import decode_launcher, preparation, routing, tensors, tiles
from flashmask.kernels.config import (
    DecodeConfig,
    TileConfig,
    device_decode_config,
    with_fitting_config,
)
from flashmask.kernels.launch import launch_kernel

ListShape = tuple[int, int, bool]
OrderRequest = tuple[ListShape, tuple[int, bool]]


@dataclass(frozen=True)
class ForwardPlan:
    """What :func:`forward` prepares for a call before it launches.

    ``use_gluon``: the call runs the Gluon forward (``use_cute``: the CuTe forward).
    ``shapes``: the ``(tile_m, tile_n, row_major)`` tile lists of its one
    :func:`~.preparation.prepare_cached` call (its kernel's, then, when a backward follows, the
    backward's it lacks, so that a new mask's summaries and lists are built in two launches
    rather than four). ``orders``: the launch orders asked of
    :func:`~.preparation.program_orders` in one launch, as ``(shape, (grid_heads,
    reverse_tiles))``: with a mask, the forward's and, before the Gluon backward, that one's,
    which the backward then finds cached."""

    use_gluon: bool
    shapes: list[ListShape]
    orders: list[OrderRequest]
    use_cute: bool = False


def plan_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    config: TileConfig,
    backward_follows: bool = True,
    softcap: float = 0.0,
) -> ForwardPlan:
    """The :class:`ForwardPlan` of a forward with these inputs and ``config`` (``flashmask
    bench`` times :func:`prepare_plan` of it as a new mask's preparation). A logit cap
    (``softcap > 0``) routes as :func:`~.routing.forward_kernel` and
    :func:`~.routing.use_gluon_backward` take it (as the uncapped call)."""
    masked = startend_row_indices is not None
    use_cute, use_gluon = routing.forward_kernel(
        q, k, v, softmax_scale, masked, causal, config, softcap
    )
    shapes = routing.forward_shapes(use_gluon, q.shape[-1], config, use_cute)
    # The backward's lists (its dout is shaped and typed like q), to be built in one go.
    gluon_backward = backward_follows and routing.use_gluon_backward(
        q, k, v, q, deterministic, True, masked, config, softcap
    )
    # The CuTe backward's deterministic variant reads the Gluon backward's lists (its own
    # launch order).
    gluon_lists = gluon_backward or (
        backward_follows
        and routing.use_cute_deterministic_backward(q, k, v, q, deterministic, masked, softcap)
    )
    if backward_follows:
        backward_shapes = routing.backward_shapes(gluon_lists, q.shape[-1], config)
        shapes += [shape for shape in backward_shapes if shape not in shapes]
    # The launch orders, with a mask only: without one the grid's own order stays (full
    # attention's lists are all alike, and causal's already launch longest first per head;
    # sorted, it measured 2.8% slower at 32K: docs/performance.md, "Launch order").
    orders: list[OrderRequest] = []
    if masked:
        orders.append((shapes[0], (q.shape[2], True)))
        if gluon_backward:
            # The Gluon backward's order too, in the same launch (the backward then finds it).
            orders.append((backward_shapes[0], (k.shape[2], False)))
    return ForwardPlan(use_gluon, shapes, orders, use_cute)


def prepare_plan(
    plan: ForwardPlan,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    batch: int,
    device: torch.device,
    skip_tiles: bool = True,
) -> tuple[torch.Tensor | None, list[tiles.TileLists], list[torch.Tensor | None]]:
    """Prepare what ``plan`` names, as :func:`forward` does: ``(bounds, lists, orders)``, the
    lists of ``plan.shapes`` (one :func:`~.preparation.prepare_cached` call) and the launch
    orders of ``plan.orders`` (one :func:`~.preparation.program_orders` call; ``[]`` without)."""
    bounds, lists = preparation.prepare_cached(
        startend_row_indices, causal, seqlen_q, seqlen_k, batch, device, plan.shapes, skip_tiles
    )
    orders: list[torch.Tensor | None] = []
    if plan.orders:
        orders = preparation.program_orders(
            [(lists[plan.shapes.index(shape)], *request) for shape, request in plan.orders]
        )
    return bounds, lists, orders


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    *,
    skip_tiles: bool = True,
    config: TileConfig | None = None,
    deterministic: bool = False,
    decode: DecodeConfig | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel: ``(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq])``.

    ``sinks`` (``[Hq]``, finite): each query head's learnable sink joins its rows' softmax, in
    the CuTe forward's epilogue where that forward runs, else by :func:`~.sinks.fold_sinks`
    after the kernel (one more pass over ``out``).

    ``softcap > 0`` caps the scaled scores at ``softcap * tanh(score / softcap)`` (Gemma's logit
    soft-capping); such calls run the training forward that
    :func:`~.routing.forward_kernel` chooses, as uncapped ones (never the split-KV kernels).

    Few queries over many keys (:func:`~.routing.use_decode`) run the split-KV kernels of
    :mod:`.decode_launcher` with ``decode`` (default :func:`~.config.device_decode_config`); other
    calls the training forward.

    ``skip_tiles=False`` treats every tile as partial (dense mode; for the bit-exactness check).
    Without ``config`` the tiles are :func:`tile_config`'s for the device, made smaller if a
    kernel needs more shared memory than the GPU has. When ``q``, ``k`` or ``v`` requires grad,
    the lists of the backward that ``deterministic`` will choose are prepared with the
    forward's, in the same launches (a new mask's summaries and lists in two launches rather
    than four), so that its backward finds them prepared.
    """
    decode = decode or device_decode_config(q.shape[-1], q.device)
    # The split-KV kernels pack a key/value head's query heads into one program: one mask per
    # query head (more mask heads than key/value heads) runs the training forward, and so do a
    # value head dim other than the query's and a logit cap, which they do not take.
    per_query_head = startend_row_indices is not None and startend_row_indices.shape[1] > k.shape[2]
    plain = not softcap and not per_query_head and v.shape[-1] == q.shape[-1]
    if plain and routing.use_decode(q, k, skip_tiles, decode):
        return _with_sinks(
            decode_launcher.forward(q, k, v, startend_row_indices, causal, softmax_scale, decode),
            sinks,
        )
    if config is None:
        return with_fitting_config(
            lambda cfg: forward(
                q, k, v, startend_row_indices, causal, softmax_scale,
                skip_tiles=skip_tiles, config=cfg, deterministic=deterministic, decode=decode,
                softcap=softcap, sinks=sinks,
            ),
            # The tiles of the larger head dim (Q/K's or V's) fit both.
            q.device, max(q.shape[-1], v.shape[-1]), startend_row_indices is not None,
        )  # fmt: skip
    from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE, flashmask_fwd_kernel

    backward_follows = skip_tiles and (q.requires_grad or k.requires_grad or v.requires_grad)
    q, k, v = (tensors.last_dim_contiguous(x) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = 1 if startend_row_indices is None else startend_row_indices.shape[1]
    plan = plan_forward(
        q, k, v, startend_row_indices, causal, softmax_scale, deterministic, config,
        backward_follows, softcap,
    )  # fmt: skip
    bounds, all_lists, orders = prepare_plan(
        plan, startend_row_indices, causal, sq, sk, b, q.device, skip_tiles
    )
    lists = all_lists[0]
    order = orders[0] if orders else None
    if plan.use_cute:
        from flashmask.kernels.cute_kernels import launch as cute_launch

        q, k, v = (tensors.tma_ready(x) for x in (q, k, v))
        return cute_launch.forward(
            q, k, v, bounds, lists, hm, causal, not causal, softmax_scale, skip_tiles, order,
            softcap=softcap, sinks=sinks,
            edge_intervals=tiles.edge_intervals(startend_row_indices, causal),
        )  # fmt: skip
    if plan.use_gluon:
        from flashmask.kernels.gluon_kernels import forward as gluon_forward

        q, k, v = (tensors.tma_ready(x) for x in (q, k, v))
        key_tile, slots = routing.gluon_forward_tiles(d)
        return _with_sinks(
            gluon_forward.forward(
                q, k, v, bounds, lists, hm, causal, softmax_scale, skip_tiles, key_tile, slots,
                order=order, softcap=softcap,
            ),
            sinks,
        )  # fmt: skip
    if bounds is None:
        bounds = lists.counts  # never read without a mask
    tm, tn = lists.entries.shape[-2:]
    block_d = tensors.padded_head_dim(d)
    dv = v.shape[-1]
    block_dv = tensors.padded_head_dim(dv)
    out = torch.empty(b, sq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    use_tma = (
        dv == d
        and config.fwd_tma
        and tensors.tma_usable((q, k, v))
        and tensors.tma_tiles_safe(config.fwd_m, config.fwd_n, block_d)
    )
    descs = (None, None, None)
    if use_tma:
        descs = (
            tensors.row_descriptor(q, config.fwd_m, block_d),
            tensors.row_descriptor(k, config.fwd_n, block_d),
            tensors.row_descriptor(v, config.fwd_n, block_d),
        )
    launch_kernel(
        flashmask_fwd_kernel, (tm, hq, b),
        q, k, v, out, lse, bounds, lists.entries, lists.counts,
        lists.counts if order is None else order, *descs,
        *tensors.strides3(q), *tensors.strides3(k), *tensors.strides3(v), *tensors.strides3(out),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, softmax_scale * LOG2E_VALUE,
        CAUSAL=causal,
        HAS_MASK=startend_row_indices is not None,
        HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles,
        # A cap's tanh needs the scaled scores: it takes the scale-first path.
        POSITIVE_SCALE=softmax_scale > 0 and not softcap,
        SOFTCAP=float(softcap),
        EVEN_M=sq % config.fwd_m == 0,
        EVEN_N=sk % config.fwd_n == 0,
        EVEN_D=d == block_d,
        USE_TMA=use_tma,
        ORDERED=order is not None,
        BLOCK_M=config.fwd_m,
        BLOCK_N=config.fwd_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.fwd_stages,
        HEAD_DIM_V=dv,
        BLOCK_DV=block_dv,
        EVEN_DV=dv == block_dv,
        num_warps=config.fwd_warps,
    )  # fmt: skip
    return _with_sinks((out, lse), sinks)


def _with_sinks(
    result: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's ``(out, lse)`` with ``sinks`` folded in (in place; as is without sinks)."""
    if sinks is not None:
        from flashmask.kernels.sinks import fold_sinks

        fold_sinks(*result, sinks)
    return result
