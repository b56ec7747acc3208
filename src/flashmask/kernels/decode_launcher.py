"""The split-KV launcher: few queries over many keys (decoding, short chunked prefill), with GQA
packing and the keys split over several programs, merged by lse (see
:mod:`.triton_kernels.decode`). Routed by :func:`~.routing.use_decode`.

Nothing here reads a tensor's values on the host: the number of splits follows from the shapes
and the GPU's multiprocessor count, and the mask's tile counts are read by the kernel, so a call
whose mask was prepared (or that has none) can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from flashmask.kernels import hardware, preparation, tensors
from flashmask.kernels.config import DecodeConfig
from flashmask.kernels.launch import launch_kernel

# The combine kernel merges this many splits per step (a [SPLIT_CHUNK, D] float32 tile).
SPLIT_CHUNK = 16

# Pipeline stages that fit a split kernel's shared memory, where fewer than its config asks.
_FITTED_STAGES: dict[tuple, int] = {}


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_tile(seqlen_q: int, group: int, decode: DecodeConfig) -> tuple[int, int]:
    """``(queries, block_m)``: the queries per row tile (a power of two, at most ``Sq`` rounded
    up, with ``queries * group <= decode.max_rows``) and the tile's rows (``queries * group``
    rounded up to a power of two, at least 16 for the tensor-core dot)."""
    queries = 1
    while queries * 2 * group <= decode.max_rows and queries < seqlen_q:
        queries *= 2
    return queries, max(16, _next_power_of_2(queries * group))


def num_splits(programs: int, key_tiles: int, device: torch.device, decode: DecodeConfig) -> int:
    """Splits per row tile: as many as keep ``programs`` row tiles times the splits within one
    wave of ``decode.programs_per_sm`` programs per multiprocessor (rounded down: the programs
    that spill into a second wave leave most multiprocessors idle while they run),
    at most one per key tile and at most ``decode.max_splits``; at least one."""
    slots = decode.programs_per_sm * hardware.multiprocessor_count(device)
    return max(1, min(slots // programs, key_tiles, decode.max_splits))


def _launch_fitting_stages(
    kernel, grid: tuple[int, ...], args: tuple, shape: dict, decode: DecodeConfig
) -> None:
    """Launch ``kernel`` with ``decode.stages`` pipeline stages, or with fewer where a program
    would need more shared memory than the GPU has (the 3-stage 128-key tiles at head dim 128
    with 128 packed rows). Triton raises ``OutOfResources`` when it compiles, before anything
    runs, so a retry is safe; the count that fits is remembered per shape, so each shape
    compiles (and fails) once."""
    from triton.runtime.errors import OutOfResources

    q = args[0]
    # What a program's shared memory depends on, beyond ``decode``'s tiles.
    key = (q.device.index, q.dtype, decode, shape["BLOCK_M"], shape["BLOCK_D"])
    stages = _FITTED_STAGES.get(key, decode.stages)
    while True:
        try:
            launch_kernel(kernel, grid, *args, NUM_STAGES=stages, **shape)
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages = _FITTED_STAGES[key] = stages - 1


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    decode: DecodeConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV forward: ``(out [B, Sq, Hq, D], lse float32 [B, Hq, Sq])``, the values of
    :func:`~.forward_launcher.forward` (bottom-right alignment; fully masked rows give 0 and
    ``-inf``). With a mask, its row-major lists of ``(queries, decode.block_n)`` tiles are
    prepared (and cached) as every kernel's are."""
    from flashmask.kernels.triton_kernels.decode import decode_combine_kernel, decode_split_kernel
    from flashmask.kernels.triton_kernels.forward import LOG2E_VALUE

    q, k, v = (tensors.last_dim_contiguous(x) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    queries, block_m = row_tile(sq, group, decode)
    q_tiles = tensors.cdiv(sq, queries)
    key_tiles = tensors.cdiv(sk, decode.block_n)
    masked = startend_row_indices is not None
    if masked:
        bounds, (lists,) = preparation.prepare_cached(
            startend_row_indices, causal, sq, sk, b, q.device, [(queries, decode.block_n, True)]
        )
        hm = startend_row_indices.shape[1]
        mask_args = (bounds, lists.entries, lists.counts)
    else:
        hm = 1
        # Never read without a mask: any int32 tensor fills the slots.
        placeholder = torch.empty(1, dtype=torch.int32, device=q.device)
        mask_args = (placeholder, placeholder, placeholder)
    splits = num_splits(b * hk * q_tiles, key_tiles, q.device, decode)
    block_d = tensors.padded_head_dim(d)
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if splits > 1:
        part_out = torch.empty(b, hq, sq, splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, hq, sq, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = lse  # never written with one split
    split_args = (
        q, k, v, out, lse, part_out, part_lse, *mask_args,
        *tensors.strides3(q), *tensors.strides3(k), *tensors.strides3(v), *tensors.strides3(out),
        sq, sk, hk, hk // hm, hm, q_tiles, key_tiles, d, softmax_scale * LOG2E_VALUE, splits,
    )  # fmt: skip
    shape = dict(
        CAUSAL=causal,
        HAS_MASK=masked,
        HAS_UPPER=not causal,
        POSITIVE_SCALE=softmax_scale > 0,
        SPLIT=splits > 1,
        EVEN_D=d == block_d,
        GROUP=group,
        QUERIES=queries,
        BLOCK_M=block_m,
        BLOCK_N=decode.block_n,
        BLOCK_D=block_d,
        num_warps=decode.warps,
    )
    _launch_fitting_stages(
        decode_split_kernel, (splits, q_tiles * hk, b), split_args, shape, decode
    )
    if splits > 1:
        launch_kernel(
            decode_combine_kernel, (sq * hq, b),
            out, lse, part_out, part_lse, *tensors.strides3(out), sq, hq, d, splits,
            SPLITS_PAD=_next_power_of_2(splits),
            SPLIT_CHUNK=SPLIT_CHUNK,
            BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip
    return out, lse
