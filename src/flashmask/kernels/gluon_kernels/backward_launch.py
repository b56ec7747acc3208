"""Host side of the Gluon backward kernels (``backward.gluon_bwd_kernel`` at head dims 64 and
128, ``backward_hd256.gluon_bwd256_kernel`` at 256): TMA descriptors, outputs, the grid
``(key tiles, kv heads, batch)``, and long full attention over chunks of query rows
(``kernels.query_chunks``). Both kernels take the same arguments.

Descriptors are 2-D over ``[B * S, H * D]``, so the inputs must be contiguous with 16-byte
aligned bases (``tensors.tma_ready``). Import only where Triton's interpreter is off (Gluon has
none).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

from flashmask.kernels import query_chunks
from flashmask.kernels.config import GLUON_BWD_QUERIES
from flashmask.kernels.gluon_kernels.forward import shared_layout
from flashmask.kernels.launch import launch_kernel
from flashmask.kernels.tiles import TileLists
from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE

BLOCK_M = GLUON_BWD_QUERIES  # query rows per tile
# 12 warps at launch, 168 registers each: two consumer warpgroups (``NUM_WARPS``) and one
# warpgroup of the producer warp, the ``WRITER_WARPS`` dQ writer warps and one idle warp. The
# producer and the writers give registers back (``setmaxnreg``), so the consumers hold 240.
NUM_WARPS = 8
MAX_REGISTERS = 168
WRITER_WARPS = 2
WRITER_REGISTERS = 24


@functools.cache  # frozen: one object per head dim serves every launch (host time)
def dq_shared_layout(head_dim: int):
    """The NVMMA shared layout of a ``[BLOCK_M, head_dim]`` fp32 dQ tile, which the dQ writer's
    TMA reduce-add reads."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, head_dim], gl.float32)


def one_launch(
    q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool, split_queries: bool
) -> bool:
    """Whether :func:`launch` runs all of ``q``'s rows (``[B, Sq, H, D]``) in one launch, so
    that one dQ accumulator spans them (else full attention runs in query chunks, each with an
    accumulator of its own); ``split_queries`` as :func:`launch` takes it."""
    return not _chunk_rows(q, k, masked, causal, split_queries)


def _chunk_rows(
    q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool, split_queries: bool
) -> int:
    """The query rows per chunk :func:`launch` splits ``q`` into (0: one launch): only full
    attention is split (``query_chunks.query_chunk_rows``)."""
    if masked or causal or not split_queries:
        return 0
    sq, hq, d = q.shape[1:]
    return query_chunks.query_chunk_rows(sq, d, hq // k.shape[2])


def launch(
    kernel,
    block_n: int,
    num_buffers: int,
    dq_buffers: int,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    dkdv_tma: bool,
    order: torch.Tensor | None = None,
    split_queries: bool = False,
    dq_accumulator: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``(q, k, v)`` from ``kernel`` with ``block_n`` keys per program,
    ``num_buffers`` Q/dO slots and ``dq_buffers`` fp32 dQ buffers; dK/dV stored through TMA if
    ``dkdv_tma``.

    ``q``: ``[B, Sq, H, D]``; ``k``: ``[B, Sk, Hk, D]``; ``v``: ``[B, Sk, Hk, Dv]``; ``dout``:
    ``[B, Sq, H, Dv]`` (``Dv != D`` only where the kernel takes it); ``lse`` (the
    forward's) and ``delta`` (``backward_launcher.backward_delta``): float32 ``[B, H, Sq]``;
    ``bounds`` (``[B, Hm, 4, Sk]``, ``None`` without a mask) and ``lists`` (column-major at
    ``BLOCK_M x block_n`` tiles) from ``preparation.prepare_cached``; ``order``
    (``preparation.program_order`` over the grid, ``None``: the grid's order) is the order the
    programs run in; ``dq_accumulator``, where :func:`one_launch` holds, a zeroed float32 tensor
    like ``q`` that dQ is added into (``None``: zeroed here); ``softcap``: the logit cap the
    forward took (0.0: none).

    With ``split_queries``, full attention that ``query_chunks.query_chunk_rows`` splits runs
    once per chunk of query rows (a head's Q, dO and dQ then stay in L2): the first chunk stores
    fp32 dK/dV sums, every later one adds into them in the kernel."""
    rows = _chunk_rows(q, k, bounds is not None, causal, split_queries)
    if not rows:
        return _launch_once(
            kernel, block_n, num_buffers, dq_buffers, dout, q, k, v, lse, delta, bounds, lists,
            num_mask_heads, causal, softmax_scale, dkdv_tma=dkdv_tma, order=order,
            dq_accumulator=dq_accumulator, softcap=softcap,
        )  # fmt: skip
    if dq_accumulator is not None:
        raise ValueError("dq_accumulator: a backward in query chunks zeros one per chunk")
    key_tiles = lists.entries.shape[-2]

    def run_chunk(q_c, dout_c, lse_c, delta_c, dk_sums, dv_sums):
        lists_c = TileLists(
            *query_chunks.full_attention_lists(
                q.shape[0], key_tiles, q_c.shape[1] // BLOCK_M, q.device
            )
        )
        return _launch_once(
            kernel, block_n, num_buffers, dq_buffers, dout_c, q_c, k, v, lse_c, delta_c, None,
            lists_c, num_mask_heads, False, softmax_scale, dkdv_tma=False, fp32_sums=True,
            dk_sums=dk_sums, dv_sums=dv_sums, softcap=softcap,
        )  # fmt: skip

    return query_chunks.backward_by_query_chunks(run_chunk, q, dout, lse, delta, rows, k.dtype)


def _launch_once(
    kernel,
    block_n: int,
    num_buffers: int,
    dq_buffers: int,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    num_mask_heads: int,
    causal: bool,
    softmax_scale: float,
    *,
    dkdv_tma: bool,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    fp32_sums: bool = False,
    dk_sums: torch.Tensor | None = None,
    dv_sums: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of :func:`launch`'s ``kernel`` over all of ``q``'s rows (arguments as
    there). With ``fp32_sums`` (a query chunk) dK and dV are float32 sums, stored from registers
    into new tensors, or added into ``dk_sums``/``dv_sums`` where given (the kernel's
    ``ADD_DKDV``: each program owns its keys, so nothing else writes them during the launch)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, sq, hq, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v.shape[-1]
    tn, tm = lists.entries.shape[-2:]
    q2, k2, v2, do2 = (x.view(x.shape[0] * x.shape[1], -1) for x in (q, k, v, dout))
    q_layout = shared_layout(BLOCK_M, d, q.dtype)
    k_layout = shared_layout(block_n, d, q.dtype)
    # V, dO and dV have V's head dim (Dv != D: multi-head latent attention).
    do_layout = shared_layout(BLOCK_M, d_v, q.dtype)
    v_layout = shared_layout(block_n, d_v, q.dtype)
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, d], q_layout)
    do_desc = TensorDescriptor.from_tensor(do2, [BLOCK_M, d_v], do_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, d], k_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, d_v], v_layout)
    dkdv_dtype = torch.float32 if fp32_sums else None
    dk = torch.empty_like(k, dtype=dkdv_dtype) if dk_sums is None else dk_sums
    dv = torch.empty_like(v, dtype=dkdv_dtype) if dv_sums is None else dv_sums
    dq_accum = dq_accumulator
    if dq_accum is None:
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_desc = TensorDescriptor.from_tensor(
        dq_accum.view(b * sq, hq * d), [BLOCK_M, d], dq_shared_layout(d)
    )
    # The kernel stages dK/dV in the K/V tiles' buffers: 16-bit tiles, so fp32 sums keep the
    # stores from registers.
    dkdv_tma = dkdv_tma and not fp32_sums
    dk_desc = dv_desc = None
    if dkdv_tma:
        dk_desc = TensorDescriptor.from_tensor(dk.view(b * sk, hk * d), [block_n, d], k_layout)
        dv_desc = TensorDescriptor.from_tensor(dv.view(b * sk, hk * d_v), [block_n, d_v], v_layout)
    launch_kernel(
        kernel, (tn, hk, b),
        q_desc, k_desc, v_desc, do_desc, lse, delta, dq_desc, dk, dv, dk_desc, dv_desc,
        lists.counts if bounds is None else bounds, lists.entries, lists.counts,
        lists.counts if order is None else order,
        dq_accum.stride(0), dq_accum.stride(1), dq_accum.stride(2),  # unread (see the kernel)
        dk.stride(0), dk.stride(1), dk.stride(2),
        sq, sk, hq, hq // hk, hq // num_mask_heads, num_mask_heads, tm, tn,
        softmax_scale * LOG2E_VALUE, softmax_scale,
        CAUSAL=causal, HAS_MASK=bounds is not None, HAS_UPPER=not causal,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=d, NUM_BUFFERS=num_buffers,
        DQ_BUFFERS=dq_buffers, WRITER_WARPS=WRITER_WARPS, WRITER_REGISTERS=WRITER_REGISTERS,
        ORDERED=order is not None, ADD_DKDV=dk_sums is not None, DKDV_TMA=dkdv_tma,
        SOFTCAP=float(softcap), num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return dq_accum.to(q.dtype), dk, dv
