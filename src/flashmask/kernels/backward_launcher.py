"""The backward launcher: the row-term kernel, then the Gluon backward (one pass, dQ through
fp32 reduce-adds) or the Triton backward (dK/dV and dQ passes, fused into one grid where their
warps agree)."""

from __future__ import annotations

import torch

from flashmask.kernels import preparation, routing, tensors, tiles
from flashmask.kernels.config import TileConfig, with_fitting_config
from flashmask.kernels.launch import launch_kernel


def backward_delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    dq_accumulator: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta = rowsum(dO * O) - dlse``, float32 ``[B, H, Sq]`` (``out``/``dout``
    ``[B, Sq, H, D]``, ``dlse`` ``[B, H, Sq]`` or ``None``): the backward's per-row term.

    ``dq_accumulator`` (float32, contiguous, shaped like ``out``), where given, is zeroed in the
    same launch: the Gluon backward adds dQ into it."""
    from flashmask.kernels.triton_kernels.backward import flashmask_bwd_delta_kernel

    out = tensors.last_dim_contiguous(out)
    b, sq, hq, d = out.shape
    if dq_accumulator is not None and (
        dq_accumulator.shape != out.shape
        or dq_accumulator.dtype != torch.float32
        or not dq_accumulator.is_contiguous()
    ):
        raise ValueError(
            "dq_accumulator must be a contiguous float32 tensor shaped like out "
            f"{tuple(out.shape)}, got {dq_accumulator.dtype} {tuple(dq_accumulator.shape)}"
        )
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=out.device)
    dlse_arg = delta if dlse is None else dlse.float().contiguous()
    zero = delta if dq_accumulator is None else dq_accumulator  # unread without ZERO_DQ
    zero_strides = (0, 0, 0) if dq_accumulator is None else tensors.strides3(dq_accumulator)
    launch_kernel(
        flashmask_bwd_delta_kernel, (tensors.cdiv(sq, 64), hq, b),
        out, dout, dlse_arg, delta, zero,
        *tensors.strides3(out), *tensors.strides3(dout), *zero_strides, sq, hq, d,
        HAS_DLSE=dlse is not None, ZERO_DQ=dq_accumulator is not None,
        BLOCK_M=64, BLOCK_D=tensors.padded_head_dim(d),
    )  # fmt: skip
    return delta


def backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    *,
    skip_tiles: bool = True,
    config: TileConfig | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward kernels: ``(dq, dk, dv)`` like ``(q, k, v)``. A logit cap (``softcap > 0``, as
    the forward took it) runs the Gluon or Triton backward by the uncapped rules, never the CuTe
    one. With ``sinks`` (``[Hq]``; ``out`` and ``lse`` are then the forward's after
    :func:`~.sinks.fold_sinks`), ``(dq, dk, dv, dsinks)``: the kernels need nothing else, and
    ``dsinks`` comes from their row term.

    With ``deterministic=False`` on Hopper, where ``config.bwd_gluon`` and
    :func:`~.routing.use_gluon_backward` allow, one warp-specialised Gluon pass computes dK, dV
    and dQ (dQ through fp32 reduce-adds: not bit-reproducible). Deterministic, where
    :func:`~.routing.use_cute_deterministic_backward` allows, the CuTe backward's variant that
    adds each query tile's dQ in a fixed order (bit-reproducible). Otherwise the Triton
    kernels: a key-stationary dK/dV pass and a query-stationary dQ pass (bit-reproducible).
    Without ``config`` the tiles are chosen as in :func:`~.forward_launcher.forward`.
    """
    if config is None:
        return with_fitting_config(
            lambda cfg: backward(
                dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
                deterministic, skip_tiles=skip_tiles, config=cfg, softcap=softcap, sinks=sinks,
            ),
            q.device, max(q.shape[-1], v.shape[-1]), startend_row_indices is not None,
        )  # fmt: skip
    q, k, v, dout = (tensors.last_dim_contiguous(x) for x in (q, k, v, dout))
    d = q.shape[-1]
    masked = startend_row_indices is not None
    use_gluon = routing.use_gluon_backward(
        q, k, v, dout, deterministic, skip_tiles, masked, config, softcap
    )
    cute_deterministic = not use_gluon and routing.use_cute_deterministic_backward(
        q, k, v, dout, deterministic, masked, softcap
    )
    shapes = routing.backward_shapes(use_gluon or cute_deterministic, d, config)
    bounds, lists = preparation.prepare_cached(
        startend_row_indices, causal, q.shape[1], k.shape[1], q.shape[0], q.device, shapes,
        skip_tiles,
    )  # fmt: skip
    hm = 1 if startend_row_indices is None else startend_row_indices.shape[1]
    if use_gluon or cute_deterministic:
        grads, delta = _gluon_backward(
            dout, dlse, q, k, v, out, lse, bounds, lists[0], hm, causal, softmax_scale, softcap,
            deterministic=cute_deterministic,
        )  # fmt: skip
    else:
        grads, delta = _triton_backward(
            dout, dlse, q, k, v, out, lse, bounds, lists, hm, causal, softmax_scale, skip_tiles,
            config, softcap,
        )  # fmt: skip
    if sinks is None:
        return grads
    from flashmask.kernels.sinks import sink_gradient

    return *grads, sink_gradient(lse.float().contiguous(), delta, sinks)


def _gluon_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: tiles.TileLists,
    mask_heads: int,
    causal: bool,
    softmax_scale: float,
    softcap: float = 0.0,
    *,
    deterministic: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One warp-specialised pass (``routing.gluon_backward_module``, or the CuTe backward where
    ``routing.use_cute_backward`` holds or ``deterministic`` asks for it) computing dK, dV and,
    into an fp32 accumulator through TMA reduce-adds, dQ: ``((dq, dk, dv), delta)`` with the row
    term it used. ``softcap``: the forward's logit cap (the Gluon kernels' alone; 0.0: none).
    ``deterministic``: the CuTe backward's variant that adds each query tile's dQ in a fixed
    order (``routing.use_cute_deterministic_backward`` chose it)."""
    q, k, v, dout = (tensors.tma_ready(x) for x in (q, k, v, dout))
    # The CuTe backward takes the order flag and no cap; the Gluon kernels take the cap.
    options: dict[str, float | bool]
    if deterministic or routing.use_cute_backward(q, softcap):
        from flashmask.kernels.cute_kernels import backward_launch as module

        options = {"deterministic": deterministic}
    else:
        module = routing.gluon_backward_module(q.shape[-1])
        options = {"softcap": softcap}
    dq_accumulator = None
    if module.one_launch(q, k, bounds is not None, causal) and v.shape[-1] == q.shape[-1]:
        # Zeroed by the row-term kernel (one launch fewer than ``torch.zeros``), which walks O's
        # rows and so zeros Q's only where the head dims agree (else the launcher zeros it); a
        # backward in query chunks zeros one per chunk.
        dq_accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    delta = backward_delta(out, dout, dlse, dq_accumulator)
    # The deterministic variant launches in its own order.
    heaviest_first = bounds is not None and not deterministic
    order = preparation.program_order(lists, k.shape[2], False) if heaviest_first else None
    grads = module.backward(
        dout, q, k, v, lse.float().contiguous(), delta, bounds, lists, mask_heads, causal,
        softmax_scale, order=order, dq_accumulator=dq_accumulator, **options,
    )  # fmt: skip
    return grads, delta


def _triton_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: list[tiles.TileLists],
    mask_heads: int,
    causal: bool,
    softmax_scale: float,
    skip_tiles: bool,
    config: TileConfig,
    softcap: float = 0.0,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The Triton passes (bit-reproducible): dK/dV over the column-major ``lists[0]`` and dQ
    over the row-major ``lists[1]``, in one grid where their warp counts agree (so neither
    pass's last wave leaves the GPU half idle), else in two launches. ``((dq, dk, dv), delta)``
    with the row term they used."""
    from flashmask.kernels.triton_kernels.backward import (
        flashmask_bwd_dkdv_kernel,
        flashmask_bwd_dq_kernel,
        flashmask_bwd_fused_kernel,
    )
    from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = mask_heads
    kv_lists, q_lists = lists
    masked = bounds is not None
    if bounds is None:
        bounds = kv_lists.counts  # never read without a mask
    lse = lse.float().contiguous()
    delta = backward_delta(out, dout, dlse)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # V's (and dO's, dV's) head dim, which may differ from Q's and K's.
    head_dim_v = v.shape[-1]
    block_dv = tensors.padded_head_dim(head_dim_v)
    flags = dict(
        CAUSAL=causal,
        HAS_MASK=masked,
        HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles,
        SOFTCAP=float(softcap),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=block_dv,
        EVEN_DV=head_dim_v == block_dv,
    )
    block_d = tensors.padded_head_dim(d)
    qk_scale = softmax_scale * LOG2E_VALUE
    kv_tn, kv_tm = kv_lists.entries.shape[-2:]
    q_tm, q_tn = q_lists.entries.shape[-2:]
    strides = tensors.strides3
    if config.bwd_warps == config.dq_warps:
        launch_kernel(
            flashmask_bwd_fused_kernel, (kv_tn + q_tm * (hq // hk), hk, b),
            q, k, v, dout, lse, delta, dq, dk, dv, bounds,
            kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
            q_lists.entries, q_lists.counts, q_lists.num_partial,
            *strides(q), *strides(k), *strides(v), *strides(dout),
            *strides(dq), *strides(dk), *strides(dv),
            sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, q_tm, q_tn, d, qk_scale,
            softmax_scale,
            **flags,
            KV_EVEN_M=sq % config.bwd_m == 0,
            KV_EVEN_N=sk % config.bwd_n == 0,
            Q_EVEN_M=sq % config.dq_m == 0,
            Q_EVEN_N=sk % config.dq_n == 0,
            EVEN_D=d == block_d,
            KV_BLOCK_M=config.bwd_m,
            KV_BLOCK_N=config.bwd_n,
            KV_STAGES=config.bwd_stages,
            Q_BLOCK_M=config.dq_m,
            Q_BLOCK_N=config.dq_n,
            Q_STAGES=config.dq_stages,
            BLOCK_D=block_d,
            num_warps=config.bwd_warps,
        )  # fmt: skip
        return (dq, dk, dv), delta
    launch_kernel(
        flashmask_bwd_dkdv_kernel, (kv_tn, hk, b),
        q, k, v, dout, lse, delta, dk, dv, bounds,
        kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
        *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk), *strides(dv),
        sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, d, qk_scale, softmax_scale,
        **flags,
        EVEN_M=sq % config.bwd_m == 0,
        EVEN_N=sk % config.bwd_n == 0,
        EVEN_D=d == block_d,
        BLOCK_M=config.bwd_m,
        BLOCK_N=config.bwd_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.bwd_stages,
        num_warps=config.bwd_warps,
    )  # fmt: skip
    launch_kernel(
        flashmask_bwd_dq_kernel, (q_tm, hq, b),
        q, k, v, dout, lse, delta, dq, bounds,
        q_lists.entries, q_lists.counts, q_lists.num_partial,
        *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dq),
        sq, sk, hq, hq // hk, hq // hm, hm, q_tm, q_tn, d, qk_scale, softmax_scale,
        **flags,
        EVEN_M=sq % config.dq_m == 0,
        EVEN_N=sk % config.dq_n == 0,
        EVEN_D=d == block_d,
        BLOCK_M=config.dq_m,
        BLOCK_N=config.dq_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.dq_stages,
        num_warps=config.dq_warps,
    )  # fmt: skip
    return (dq, dk, dv), delta
