"""The backward launcher: the row-term kernel, then the Gluon backward (one pass, dQ through
fp32 reduce-adds) or the Triton backward (dK/dV and dQ passes, fused into one grid where their
warps agree)."""

from __future__ import annotations

import torch

from flashmask.kernels import hardware, preparation, routing, tensors
from flashmask.kernels.config import TileConfig, with_fitting_config
from flashmask.kernels.launch import launch_kernel


def backward_delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    dq_accumulator: torch.Tensor | None = None,
    dq_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta = rowsum(dO * O) - dlse``, float32 ``[B, H, Sq]`` (``out``/``dout``
    ``[B, Sq, H, D]``, ``dlse`` ``[B, H, Sq]`` or ``None``): the backward's per-row term.

    ``dq_accumulator`` (float32, contiguous, shaped like ``out``), where given, is zeroed in the
    same launch: the Gluon backward adds dQ into it. ``dq_flags`` (int32, contiguous, ``[B, H,
    tensors.cdiv(Sq, 64)]``), where given, is zeroed instead: the Gluon backward's per-tile flags
    (``gluon_bwd.DQ_FIRST_STORE``)."""
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
    row_tiles = tensors.cdiv(sq, 64)
    if dq_flags is not None and (
        dq_flags.shape != (b, hq, row_tiles)
        or dq_flags.dtype != torch.int32
        or not dq_flags.is_contiguous()
    ):
        raise ValueError(
            f"dq_flags must be a contiguous int32 tensor of shape {(b, hq, row_tiles)}, got "
            f"{dq_flags.dtype} {tuple(dq_flags.shape)}"
        )
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=out.device)
    dlse_arg = delta if dlse is None else dlse.float().contiguous()
    zero = delta if dq_accumulator is None else dq_accumulator  # unread without ZERO_DQ
    zero_strides = (0, 0, 0) if dq_accumulator is None else tensors.strides3(dq_accumulator)
    flags = delta if dq_flags is None else dq_flags  # unread without ZERO_FLAGS
    launch_kernel(
        flashmask_bwd_delta_kernel, (row_tiles, hq, b),
        out, dout, dlse_arg, delta, zero, flags, *tensors.strides3(out), *tensors.strides3(dout), *zero_strides,
        sq, hq, d,
        HAS_DLSE=dlse is not None, ZERO_DQ=dq_accumulator is not None,
        ZERO_FLAGS=dq_flags is not None, BLOCK_M=64, BLOCK_D=tensors.padded_head_dim(d),
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels: ``(dq, dk, dv)`` like ``(q, k, v)``.

    With ``deterministic=False`` on Hopper, where ``config.bwd_gluon`` and
    :func:`gluon_backward_eligible` allow, one warp-specialised Gluon pass computes dK, dV and dQ
    (dQ through fp32 atomics: not bit-reproducible). Otherwise the Triton kernels: dQ from a
    separate query-stationary pass (bit-reproducible); only when ``deterministic=False`` and
    ``config.atomic_dq`` does the key-stationary pass add dQ with fp32 atomics instead: per
    element, or one TMA reduce-add per tile with ``config.atomic_dq_tma`` on Hopper; both
    measured slower on the H200 than the separate pass and kept for measurement. The tiles are
    chosen as in :func:`forward`.
    """
    if config is None:
        return with_fitting_config(
            lambda cfg: backward(
                dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale,
                deterministic, skip_tiles=skip_tiles, config=cfg,
            ),
            q.device, q.shape[-1], startend_row_indices is not None,
        )  # fmt: skip
    from flashmask.kernels.triton_kernels.backward import (
        flashmask_bwd_dkdv_kernel,
        flashmask_bwd_dq_kernel,
        flashmask_bwd_fused_kernel,
    )
    from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE

    q, k, v, dout = (tensors.last_dim_contiguous(x) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    hm = 1 if startend_row_indices is None else startend_row_indices.shape[1]
    masked = startend_row_indices is not None
    use_gluon = routing.use_gluon_backward(q, k, v, dout, deterministic, skip_tiles, masked, config)
    shapes = routing.backward_shapes(use_gluon, deterministic, d, config)
    if use_gluon:
        bounds, (lists,) = preparation.prepare_cached(
            startend_row_indices, causal, sq, sk, b, q.device, shapes
        )
        q, k, v, dout = (tensors.tma_ready(x) for x in (q, k, v, dout))
        module = routing.gluon_backward_module(d)
        dq_accumulator = None
        if module.one_launch(q, k, masked, causal):
            # Zeroed by the row-term kernel (one launch fewer than ``torch.zeros``); a backward
            # in query chunks zeros one per chunk.
            dq_accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        delta = backward_delta(out, dout, dlse, dq_accumulator)
        order = None if bounds is None else preparation.program_order(lists, hk, False)
        return module.backward(
            dout, q, k, v, lse.float().contiguous(), delta, bounds, lists, hm, causal,
            softmax_scale, order=order, dq_accumulator=dq_accumulator,
        )  # fmt: skip
    use_atomics = config.atomic_dq and not deterministic
    bounds, lists = preparation.prepare_cached(
        startend_row_indices, causal, sq, sk, b, q.device, shapes, skip_tiles
    )
    if bounds is None:
        bounds = lists[0].counts  # never read without a mask
    lse = lse.float().contiguous()
    delta = backward_delta(out, dout, dlse)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    flags = dict(
        CAUSAL=causal,
        HAS_MASK=startend_row_indices is not None,
        HAS_UPPER=not causal,
        MASK_FULL_TILES=not skip_tiles,
    )
    block_d = tensors.padded_head_dim(d)
    qk_scale = softmax_scale * LOG2E_VALUE
    even = config.even_fast_path
    even_d = even and d == block_d

    kv_lists = lists[0]
    kv_tn, kv_tm = kv_lists.entries.shape[-2:]
    kv_even_m = even and sq % config.bwd_m == 0
    kv_even_n = even and sk % config.bwd_n == 0
    dq_even_m = even and sq % config.dq_m == 0
    dq_even_n = even and sk % config.dq_n == 0
    dq_descs = (None, None)
    dq_tma = (
        not use_atomics
        and config.dq_tma
        and tensors.tma_tiles_safe(config.dq_m, config.dq_n, block_d)
        and tensors.tma_usable((k, v))
    )
    if dq_tma:
        dq_descs = (
            tensors.row_descriptor(k, config.dq_n, block_d),
            tensors.row_descriptor(v, config.dq_n, block_d),
        )
    dq_accum = None
    if use_atomics:
        dq_accum = torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
    if not use_atomics and config.fused_backward and config.bwd_warps == config.dq_warps:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_lists = lists[1]
        q_tm, q_tn = q_lists.entries.shape[-2:]
        launch_kernel(
            flashmask_bwd_fused_kernel, (kv_tn + q_tm * (hq // hk), hk, b),
            q, k, v, dout, lse, delta, dq, dk, dv, *dq_descs, bounds,
            kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
            q_lists.entries, q_lists.counts, q_lists.num_partial,
            *tensors.strides3(q), *tensors.strides3(k), *tensors.strides3(v), *tensors.strides3(dout),
            *tensors.strides3(dq), *tensors.strides3(dk), *tensors.strides3(dv),
            sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, q_tm, q_tn, d, qk_scale,
            softmax_scale,
            **flags,
            KV_EVEN_M=kv_even_m,
            KV_EVEN_N=kv_even_n,
            Q_EVEN_M=dq_even_m,
            Q_EVEN_N=dq_even_n,
            Q_TMA=dq_tma,
            EVEN_D=even_d,
            KV_BLOCK_M=config.bwd_m,
            KV_BLOCK_N=config.bwd_n,
            KV_STAGES=config.bwd_stages,
            Q_BLOCK_M=config.dq_m,
            Q_BLOCK_N=config.dq_n,
            Q_STAGES=config.dq_stages,
            BLOCK_D=block_d,
            num_warps=config.bwd_warps,
        )  # fmt: skip
        return dq, dk, dv

    dq_target = dq_accum if dq_accum is not None else dk  # unused pointer when deterministic
    dq_desc = None
    if (
        dq_accum is not None
        and config.atomic_dq_tma
        and not hardware.interpreting()
        and tensors.tma_usable((dq_accum,))
    ):
        dq_desc = tensors.row_descriptor(dq_accum, config.bwd_m, block_d)
    launch_kernel(
        flashmask_bwd_dkdv_kernel, (kv_tn, hk, b),
        q, k, v, dout, lse, delta, dk, dv, dq_target, dq_desc, bounds,
        kv_lists.entries, kv_lists.counts, kv_lists.num_partial,
        *tensors.strides3(q), *tensors.strides3(k), *tensors.strides3(v), *tensors.strides3(dout),
        *tensors.strides3(dk), *tensors.strides3(dv), *tensors.strides3(dq_target),
        sq, sk, hq, hq // hk, hq // hm, hm, kv_tm, kv_tn, d, qk_scale, softmax_scale,
        **flags,
        ACCUMULATE_DQ=use_atomics,
        DQ_TMA=dq_desc is not None,
        EVEN_M=kv_even_m,
        EVEN_N=kv_even_n,
        EVEN_D=even_d,
        BLOCK_M=config.bwd_m,
        BLOCK_N=config.bwd_n,
        BLOCK_D=block_d,
        # The atomic-dQ matmul needs shared memory that a second pipeline stage leaves no room
        # for at D > 128 (measured: 263 KB needed, 227 KB on the H200).
        NUM_STAGES=1 if use_atomics and d > 128 else config.bwd_stages,
        num_warps=config.bwd_warps,
    )  # fmt: skip
    if dq_accum is not None:
        return dq_accum.to(q.dtype), dk, dv

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q_lists = lists[1]
    tm, tn = q_lists.entries.shape[-2:]
    launch_kernel(
        flashmask_bwd_dq_kernel, (tm, hq, b),
        q, k, v, dout, lse, delta, dq, *dq_descs, bounds,
        q_lists.entries, q_lists.counts, q_lists.num_partial,
        *tensors.strides3(q), *tensors.strides3(k), *tensors.strides3(v), *tensors.strides3(dout), *tensors.strides3(dq),
        sq, sk, hq, hq // hk, hq // hm, hm, tm, tn, d, qk_scale, softmax_scale,
        **flags,
        EVEN_M=dq_even_m,
        EVEN_N=dq_even_n,
        EVEN_D=even_d,
        USE_TMA=dq_tma,
        BLOCK_M=config.dq_m,
        BLOCK_N=config.dq_n,
        BLOCK_D=block_d,
        NUM_STAGES=config.dq_stages,
        num_warps=config.dq_warps,
    )  # fmt: skip
    return dq, dk, dv
