"""Compiling and launching the CuTe forward: one compiled kernel per
:class:`~.forward.ForwardVariant` and dtype, built from symbolic tensors (so that it compiles
without a GPU and serves every shape), called with the torch tensors' DLPack views. Also the
FP8 (e4m3) forward's launcher, :func:`forward_fp8`, with its V^T pre-pass."""

from __future__ import annotations

import functools
import os

import torch

from flashmask._tensor_cache import TensorKeyedCache
from flashmask.kernels import hardware, preparation
from flashmask.kernels.cute_kernels import fp8_layout
from flashmask.kernels.tiles import TileLists

# This family targets Hopper: compile for sm_90a, also on a machine without a GPU. CuTe DSL reads
# the variable when it is first imported, so set it before anything imports ``cutlass``.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# The forward's K/V ring slots per head dim at 128-key tiles (64-key at D = 256): K and V
# slots of 32 KB each at D = 128 plus the 32 KB Q tile fit the 227 KB in three; at D = 192
# (MLA, V's head dim 128) the 48 KB Q tile and two 48 + 32 KB slots take 208 KB.
KV_STAGES = {64: 4, 128: 3, 192: 2, 256: 2}

# The FP8 forward's K/V ring slots per head dim, at the bf16 forward's key tiles (``key_tile``:
# 128 keys, 64 at D = 256). Its K and V slots take half the bytes of bf16 ones, but its 16-bit
# O leaves through the Q region, which is therefore O's size, 128 x D x 2 bytes (the fp8 Q
# halves sit in its first and third quarters). D = 128: 32 KB + 6 x (16 + 16 KB) = 224 KB of
# the 227 KB; D = 256: 64 KB + 5 x (16 + 16 KB) = 224 KB; D = 64: 16 KB + 8 x (8 + 8 KB) =
# 144 KB (a tile's two products take a fraction of a microsecond at FP8 rates, so eight cover
# a load's latency several times over).
FP8_KV_STAGES = {64: 8, 128: 6, 256: 5}
# Full attention (no interval mask, not causal) at D = 128 takes 192-key tiles in 4 slots (32
# KB + 4 x (24 + 24 KB) = 224 KB), as FlashAttention-3's FP8 forward takes wider tiles (224
# keys) there: the per-tile softmax work (row max and sum, O's rescale, the turn barriers),
# which does not shrink with 8-bit products, spreads over 1.5x the keys. On an H100 that made
# full attention 3.2% / 2.9% faster at 8K / 32K and causal attention 2.3% slower / level (its
# diagonal tile, masked element by element, is 1.5x wider), so causal calls keep 128-key
# tiles. Spill-free unmasked (``ptxas -v``); with an interval mask the bounds and compares
# beside the wider accumulator spill (36 to 104 bytes). 256 keys would hold a 64 x 256 fp32
# score accumulator (128 registers per thread) beside O and spill 96 bytes even unmasked.
FP8_FULL_ATTENTION_TILES = {128: (192, 4)}
FP8_HEAD_DIMS = tuple(FP8_KV_STAGES)
# Query rows per program of both forwards (``forward.BLOCK_M``, here without importing cutlass).
QUERY_TILE = 128


def key_tile(head_dim: int) -> int:
    """Keys per tile of the CuTe forward at ``head_dim`` (Q/K's)."""
    return 64 if head_dim > 192 else 128


def fp8_tiles(head_dim: int, *, full_attention: bool) -> tuple[int, int]:
    """``(keys per tile, K/V ring slots)`` of the FP8 forward at ``head_dim``;
    ``full_attention``: the call has no interval mask and is not causal."""
    if head_dim not in FP8_KV_STAGES:
        raise ValueError(f"head_dim must be one of {FP8_HEAD_DIMS}, got {head_dim}")
    if full_attention and head_dim in FP8_FULL_ATTENTION_TILES:
        return FP8_FULL_ATTENTION_TILES[head_dim]
    return key_tile(head_dim), FP8_KV_STAGES[head_dim]


def fp8_tile_shape(head_dim: int, *, full_attention: bool) -> tuple[int, int, bool]:
    """The tile lists :func:`forward_fp8` reads at ``head_dim`` (``full_attention``: no
    interval mask, not causal), as ``preparation.prepare_cached``'s ``shapes`` entry:
    row-major ``(128, keys per tile, True)`` (query tiles of 128 rows, each listing its key
    tiles; :func:`fp8_tiles`)."""
    return QUERY_TILE, fp8_tiles(head_dim, full_attention=full_attention)[0], True


def _dtype(torch_dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[torch_dtype]


def _symbolic(dtype, rank: int, divisibility: int):
    """A symbolic tensor of ``rank`` modes, every extent and stride dynamic except a unit last
    stride (what ``from_dlpack(...).mark_layout_dynamic`` of a tensor with a contiguous last
    dimension gives)."""
    import cutlass.cute as cute

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = (*(cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)), 1)
    return cute.runtime.make_fake_tensor(
        dtype, shape, stride=stride, assumed_align=divisibility * dtype.width // 8
    )


@functools.cache
def compiled_forward(variant, torch_dtype: torch.dtype):
    """The compiled :class:`~.forward.HopperForward` of ``variant`` for ``torch_dtype``, O's
    dtype (for sm_90a, with or without a GPU). The inputs have O's dtype, or, in an FP8
    variant (``variant.fp8``), float8 e4m3 (V as the pre-pass's V^T) with the descale tensor
    after the stream; a ``variant.sinks`` variant takes the sinks (float32 ``[Hq]``) after the
    descales (a bf16 one after a descale tensor it never reads, :func:`_unread_scales`)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from flashmask.kernels.cute_kernels.forward import HopperForward

    dtype = _dtype(torch_dtype)
    extra = ()
    if variant.fp8 or variant.sinks:
        extra = (_symbolic(cutlass.Float32, 3, 1),)  # descales [B, Hk, 2] (read in FP8 only)
    if variant.sinks:
        extra = (*extra, _symbolic(cutlass.Float32, 1, 1))  # sinks [Hq]
    if variant.fp8:
        # 16-byte strides and bases (TMA's), in one-byte elements.
        fp8 = cutlass.Float8E4M3FN
        inputs = (_symbolic(fp8, 4, 16), _symbolic(fp8, 4, 16), _symbolic(fp8, 4, 16))
    else:
        inputs = (_symbolic(dtype, 4, 8), _symbolic(dtype, 4, 8), _symbolic(dtype, 4, 8))
    tensors = (
        *inputs,  # q, k, v
        _symbolic(dtype, 4, 8),  # out
        _symbolic(cutlass.Float32, 3, 1),  # lse
        _symbolic(cutlass.Int32, 4, 4),  # bounds, column-major: 16-byte columns
        _symbolic(cutlass.Int32, 4, 1),  # entries
        _symbolic(cutlass.Int32, 3, 1),  # counts
        _symbolic(cutlass.Int32, 1, 1),  # order
        _symbolic(cutlass.Int32, 1, 1),  # next item counter (persistent)
    )
    stream = cuda.CUstream(0)
    return cute.compile(
        HopperForward(variant),
        *tensors,
        cutlass.Int32(1),  # programs (persistent)
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        stream,
        *extra,
    )


# Column-major bounds of each row-major bounds tensor, kept while that tensor lives unchanged
# (the preparation's cache hands every layer the same one).
_COLUMN_MAJOR: TensorKeyedCache[torch.Tensor] = TensorKeyedCache(capacity=8)


def column_major_bounds(bounds: torch.Tensor, seqlen_q: int, columns: int) -> torch.Tensor:
    """The CuTe forward's form of ``bounds [B, Hm, 4, Sk]``: int32 ``[B, Hm, columns, 4]``,
    contiguous, so that a key column's ``(LTS, LTE, UTS, UTE)`` is one 16-byte load. The
    ``columns - Sk`` columns past the keys (``columns``: the key tiles' width) hide every row,
    ``(0, seqlen_q, 0, 0)``, so that the kernel needs no range check. Cached per ``bounds``
    tensor where the preparation caches (not under graph capture or ``torch.compile``)."""

    def build() -> torch.Tensor:
        b, hm, _, sk = bounds.shape
        out = torch.zeros(b, hm, columns, 4, dtype=torch.int32, device=bounds.device)
        out[:, :, :sk] = bounds.transpose(2, 3)
        out[:, :, sk:, 1] = seqlen_q
        return out

    if not preparation.may_cache(bounds.device):
        return build()
    return _COLUMN_MAJOR.get(bounds, (seqlen_q, columns), build)


@functools.cache
def _unread_bounds(device: torch.device) -> torch.Tensor:
    """A 16-byte aligned stand-in for the bounds of an unmasked call (the kernel reads none)."""
    return torch.zeros(1, 1, 1, 4, dtype=torch.int32, device=device)


@functools.cache
def _unread_scales(device: torch.device) -> torch.Tensor:
    """A stand-in for the FP8 descales ``[B, Hk, 2]`` ahead of a bf16 forward's sinks (the
    kernel reads none)."""
    return torch.ones(1, 1, 2, dtype=torch.float32, device=device)


def _after_stream(
    scales: torch.Tensor | None, sinks: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The tensors a compiled forward takes after the stream, in :func:`compiled_forward`'s
    order: the FP8 descales ``scales`` (a stand-in never read where a bf16 forward has sinks),
    then the sinks as float32; nothing for a bf16 forward without sinks."""
    if sinks is None:
        return () if scales is None else (scales,)
    if scales is None:
        scales = _unread_scales(device)
    return scales, sinks.to(torch.float32).contiguous()


def _view(x: torch.Tensor, align: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(x.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=x.ndim - 1)


def persistent_programs(
    num_items: int, device: torch.device, persistent: bool, unread: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``(counter, programs)`` of a launch over ``num_items`` (query tile, query head, batch)
    items: for the persistent variant ``min(num_items, SMs)`` programs and a zeroed int32
    counter they take the items past the first ``programs`` from, allocated only when some
    program takes more than one; otherwise ``unread`` (an int32 tensor the kernel never
    reads)."""
    if not persistent:
        return unread, 1
    programs = min(num_items, hardware.multiprocessor_count(device))
    if programs < num_items:
        return torch.zeros(1, dtype=torch.int32, device=device), programs
    return unread, programs


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    mask_heads: int,
    causal: bool,
    has_upper: bool,
    softmax_scale: float,
    skip_tiles: bool,
    order: torch.Tensor | None = None,
    persistent: bool | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    edge_intervals: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, Hq, Dv], lse float32 [B, Hq, Sq])`` of the CuTe forward over ``lists``
    (row-major, ``(128, key_tile(D))`` tiles) and ``bounds [B, Hm, 4, Sk]`` (``None``: no
    interval mask). ``q``/``k`` ``[..., D]``, ``v [..., Dv]`` (``Dv <= D``) contiguous, 16-byte
    aligned, bf16 or fp16.

    ``persistent``: launch the persistent variant (one program per SM, at most one per query
    tile, taking the (query tile, head, batch) items in ``order`` from a counter) instead of
    one program per item. ``None`` (the default) takes it exactly for a non-causal interval
    mask (``bounds`` given, ``causal`` false); ``True``/``False`` force either on any call, so
    that a benchmark or a test can compare both on the same inputs. ``softcap > 0`` caps the
    scaled scores at ``softcap * tanh(score / softcap)`` (then any nonzero scale runs).
    ``sinks`` (``[Hq]``, finite, any floating dtype): each query head's learnable sink joins
    its rows' softmax in the kernel, so that ``(out, lse)`` are those of
    ``kernels.sinks.fold_sinks`` after the call without sinks. ``edge_intervals``: the
    bounds' lower intervals all run to the last row and the upper ones start at row 0
    (``tiles.edge_intervals`` of the mask), which the element mask then tests in two compares."""
    from flashmask.kernels.cute_kernels.forward import LOG2E

    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    variant = _variant(
        d, KV_STAGES[d], bounds, causal, has_upper, skip_tiles, order, persistent,
        head_dim_v=dv if dv != d else None, softcap=float(softcap), sinks=sinks is not None,
        edge_intervals=edge_intervals,
    )  # fmt: skip
    kernel = compiled_forward(variant, q.dtype)
    out = q.new_empty(b, sq, hq, dv)
    return _launch(
        kernel, q, k, v, out, bounds, lists, mask_heads, softmax_scale * LOG2E, order,
        variant, *_after_stream(None, sinks, q.device),
    )  # fmt: skip


def _variant(
    head_dim: int,
    kv_stages: int,
    bounds: torch.Tensor | None,
    causal: bool,
    has_upper: bool,
    skip_tiles: bool,
    order: torch.Tensor | None,
    persistent: bool | None,
    block_n: int | None = None,
    **fields,
):
    """The :class:`~.forward.ForwardVariant` of a launch (both forwards'): the mask's form from
    ``bounds`` and the flags, persistent programs by default exactly for a non-causal interval
    mask (``persistent=None``), ``block_n`` keys per tile (``None``: :func:`key_tile`), and the
    family's own ``fields``."""
    from flashmask.kernels.cute_kernels.forward import ForwardVariant

    has_mask = bounds is not None
    fields["edge_intervals"] = has_mask and fields.get("edge_intervals", False)
    if persistent is None:
        persistent = has_mask and not causal
    return ForwardVariant(
        head_dim=head_dim,
        block_n=key_tile(head_dim) if block_n is None else block_n,
        kv_stages=kv_stages,
        causal=causal,
        has_mask=has_mask,
        has_upper=has_mask and has_upper,
        mask_full_tiles=not skip_tiles,
        ordered=order is not None,
        persistent=persistent,
        **fields,
    )


def _launch(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    mask_heads: int,
    qk_scale: float,
    order: torch.Tensor | None,
    variant,
    *extra: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel``, compiled for :class:`~.forward.ForwardVariant` ``variant``, writing
    ``out [B, Sq, Hq, Dv]``: ``(out, lse)``, with the bounds in the kernel's column-major form
    (whole tiles of ``variant.block_n`` keys), the persistent launch's programs and counter,
    and ``extra`` tensors after the stream (the FP8 forward's descales, the sinks)."""
    import cuda.bindings.driver as cuda

    b, sq, hq = q.shape[:3]
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if order is None:
        order = lists.counts.view(-1)  # never read
    if bounds is None:
        bounds = _unread_bounds(q.device)
    else:
        bounds = column_major_bounds(bounds, sq, lists.entries.shape[-1] * variant.block_n)
    num_items = -(-sq // QUERY_TILE) * hq * b
    next_item, programs = persistent_programs(num_items, q.device, variant.persistent, order)
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel(
        _view(q, 16), _view(k, 16), _view(v, 16), _view(out, 16), _view(lse, 4),
        _view(bounds, 16), _view(lists.entries, 4), _view(lists.counts, 4), _view(order, 4),
        _view(next_item, 4), programs, k.shape[1], hq // k.shape[2], hq // mask_heads,
        qk_scale, stream, *(_view(x, 4) for x in extra),
    )  # fmt: skip
    return out, lse


def fp8_values_transposed(v: torch.Tensor, block_n: int) -> torch.Tensor:
    """The FP8 forward's form of ``v [B, Sk, Hk, D]`` (float8 e4m3, any strides): V^T, float8
    ``[B, Hk, D, Sk padded to a multiple of block_n]``, contiguous (8-bit ``wgmma`` operands
    must be K-major, and the keys are ``P V``'s k mode), its keys permuted within each group of
    16 so that k index ``p`` holds key ``16 (p // 16) + fp8_layout.KEY_ORDER[p % 16]`` (what the
    kernel's P fragment reads there), and zeros past Sk (TMA then reads whole tiles, and a
    hidden key's zero probability meets a zero value, never NaN).

    ``KEY_ORDER`` is an axis swap: a group's key ``8 a + 2 t + c`` (``a`` < 2, ``t`` < 4, ``c``
    < 2) sits at k index ``4 t + 2 a + c``, so the keys viewed as ``(group, a, t, c)`` are read
    as ``(group, t, a, c)``. On a GPU one tiled kernel does both
    (``triton_kernels.fp8_values``); elsewhere :func:`fp8_values_transposed_by_copy`."""
    if block_n % fp8_layout.KEY_GROUP:
        raise ValueError(f"block_n must be a multiple of {fp8_layout.KEY_GROUP}, got {block_n}")
    if not v.is_cuda:
        return fp8_values_transposed_by_copy(v, block_n)
    return fp8_values_transposed_by_kernel(v, block_n)


def fp8_values_transposed_by_kernel(v: torch.Tensor, block_n: int) -> torch.Tensor:
    """:func:`fp8_values_transposed` by one Triton launch (any device Triton runs on: a GPU, or
    the CPU through its interpreter)."""
    from flashmask.kernels.launch import launch_kernel
    from flashmask.kernels.triton_kernels.fp8_values import (
        flashmask_fp8_values_transposed_kernel,
    )

    b, sk, hk, d = v.shape
    padded = -(-sk // block_n) * block_n
    raw = v.view(torch.uint8)
    out = torch.empty(b, hk, d, padded, dtype=torch.uint8, device=v.device)
    block_p, block_d = 128, 64
    grid = (-(-padded // block_p), b * hk, -(-d // block_d))
    launch_kernel(
        flashmask_fp8_values_transposed_kernel, grid, raw, out, sk, padded, hk, d,
        *raw.stride(), BLOCK_P=block_p, BLOCK_D=block_d,
    )  # fmt: skip
    return out.view(torch.float8_e4m3fn)


def fp8_values_transposed_by_copy(v: torch.Tensor, block_n: int) -> torch.Tensor:
    """:func:`fp8_values_transposed` as one strided torch copy (the permutation and the
    transposition at once; a second copy, the padding, only where ``block_n`` does not divide
    Sk)."""
    b, sk, hk, d = v.shape
    padded = -(-sk // block_n) * block_n
    # Bytes: padding and copies of every dtype, the same bits.
    raw = v.view(torch.uint8)
    if padded != sk:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, padded - sk))
    groups = raw.view(b, padded // fp8_layout.KEY_GROUP, 2, 4, 2, hk, d)
    # (b, group, a, t, c, hk, d) -> (b, hk, d, group, t, a, c)
    transposed = groups.permute(0, 5, 6, 1, 3, 2, 4).contiguous()
    return transposed.view(b, hk, d, padded).view(torch.float8_e4m3fn)


def _check_fp8_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    mask_heads: int,
    softmax_scale: float,
    order: torch.Tensor | None,
    descales: dict[str, torch.Tensor],
    out_dtype: torch.dtype,
    full_attention: bool,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument :func:`forward_fp8` cannot run
    (shapes, dtypes, layouts and devices; the device last, so that the rest is checked
    anywhere)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} must be torch.float8_e4m3fn, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, S, H, D], got shape {tuple(x.shape)}")
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    if d not in FP8_KV_STAGES:
        raise ValueError(f"q's head dim must be one of {FP8_HEAD_DIMS}, got {d}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be [B, Sk, Hk, D] = [{b}, Sk, Hk, {d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"k's heads ({hk}) must divide q's ({hq})")
    if sq == 0 or sk == 0:
        raise ValueError(f"q and k need at least one row, got Sq = {sq}, Sk = {sk}")
    for name, x in (("q", q), ("k", k)):
        # TMA: unit stride along D, 16-byte aligned base and strides.
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous with a 16-byte aligned start")
    if mask_heads not in {1, hk, hq}:
        raise ValueError(f"mask_heads must be 1, Hk ({hk}) or Hq ({hq}), got {mask_heads}")
    if bounds is not None and (
        bounds.dtype != torch.int32 or tuple(bounds.shape) != (b, mask_heads, 4, sk)
    ):
        raise ValueError(
            f"bounds must be int32 [B, Hm, 4, Sk] = [{b}, {mask_heads}, 4, {sk}], got "
            f"{bounds.dtype} {tuple(bounds.shape)}"
        )
    shape = fp8_tile_shape(d, full_attention=full_attention)
    tiles_m, tiles_n = -(-sq // QUERY_TILE), -(-sk // shape[1])
    lists_heads = mask_heads if bounds is not None else 1
    expected = (b, lists_heads, tiles_m, tiles_n)
    if (
        lists.entries.dtype != torch.int32
        or tuple(lists.entries.shape) != expected
        or tuple(lists.counts.shape) != expected[:3]
    ):
        raise ValueError(
            f"lists must be int32 row-major lists of {shape[:2]} tiles, entries "
            f"[B, Hm, Tm, Tn] = {list(expected)}, got {tuple(lists.entries.shape)}"
        )
    if order is not None and (order.dtype != torch.int32 or order.numel() != b * hq * tiles_m):
        raise ValueError(f"order must be int32 with B * Hq * Tm = {b * hq * tiles_m} entries")
    if not softmax_scale > 0:
        # The running row max is taken over unscaled scores.
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    for name, x in descales.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {x.dtype}")
        if tuple(x.shape) != (b, hk):
            raise ValueError(f"{name} must be [B, Hk] = [{b}, {hk}], got {tuple(x.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    named = {"q": q, "k": k, "v": v, **descales, "lists": lists.entries}
    if bounds is not None:
        named["bounds"] = bounds
    if order is not None:
        named["order"] = order
    _check_devices(named, q.device)


def _check_devices(named: dict[str, torch.Tensor], device: torch.device) -> None:
    """Raise ``ValueError`` naming the first of ``named`` (name: tensor) that is not on
    ``device``, a CUDA device."""
    for name, x in named.items():
        if x.device.type != "cuda" or x.device != device:
            raise ValueError(f"{name} must be on q's CUDA device, got {x.device}")


def forward_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    lists: TileLists,
    mask_heads: int,
    causal: bool,
    has_upper: bool,
    softmax_scale: float,
    skip_tiles: bool,
    order: torch.Tensor | None,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    persistent: bool | None = None,
    sinks: torch.Tensor | None = None,
    edge_intervals: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, Hq, D] out_dtype, lse float32 [B, Hq, Sq])`` of the FP8 (e4m3) CuTe
    forward, on the same lists, bounds, launch order and schedules as :func:`forward`.

    ``q [B, Sq, Hq, D]``, ``k``/``v [B, Sk, Hk, D]`` float8 e4m3 (``Hq % Hk == 0``; D 64, 128
    or 256; q and k contiguous, v any strides: a pre-pass copies it transposed,
    :func:`fp8_values_transposed`); ``q_descale``, ``k_descale``, ``v_descale`` float32
    ``[B, Hk]``, positive: the dequantised inputs are ``q * q_descale`` and so on, query head
    ``h`` taking K/V head ``h // (Hq / Hk)``'s. The scores ``Q K^T`` accumulate in fp32 and are
    scaled by ``softmax_scale * q_descale * k_descale``; the online softmax runs as in the
    bf16 forward, with the row sum over the fp32 probabilities, while ``P`` (in ``[0, 1]``
    after the running max) is rounded to e4m3 for ``P V`` (fp32 accumulation); O is divided by
    the row sum and multiplied by ``v_descale``. Fully masked rows give ``lse = -inf``, O = 0.

    ``lists``: row-major, of ``fp8_tile_shape(D, full_attention=bounds is None and not
    causal)`` tiles (``preparation.prepare_cached``; wider key tiles for full attention at D =
    128, :func:`fp8_tiles`);
    ``bounds [B, Hm, 4, Sk]`` int32 (``None``: no interval mask), ``mask_heads`` Hm (1, Hk or
    Hq); ``order``: the lists' launch order (``preparation.program_orders``) or ``None``;
    ``skip_tiles=False``: the dense mode (every listed tile masked). ``persistent``: as
    :func:`forward` (``None``: persistent programs exactly for a non-causal interval mask).
    ``sinks`` (``[Hq]``, finite): as :func:`forward`'s, joined in the kernel's epilogue (a
    fully masked row then gives O = 0 and lse = its sink); ``edge_intervals``: as
    :func:`forward`'s."""
    from flashmask.kernels.cute_kernels.forward import LOG2E

    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    full_attention = bounds is None and not causal
    _check_fp8_inputs(
        q, k, v, bounds, lists, mask_heads, softmax_scale, order, descales, out_dtype,
        full_attention,
    )  # fmt: skip
    b, sq, hq, d = q.shape
    block_n, stages = fp8_tiles(d, full_attention=full_attention)
    variant = _variant(
        d, stages, bounds, causal, has_upper, skip_tiles, order, persistent, block_n=block_n,
        fp8=True, sinks=sinks is not None, edge_intervals=edge_intervals,
    )  # fmt: skip
    kernel = compiled_forward(variant, out_dtype)
    values = fp8_values_transposed(v, variant.block_n)
    # Per (batch, K/V head): the score scale's factor and O's.
    scales = torch.stack((q_descale * k_descale, v_descale), dim=-1).contiguous()
    out = torch.empty(b, sq, hq, d, dtype=out_dtype, device=q.device)
    return _launch(
        kernel, q, k, values, out, bounds, lists, mask_heads, softmax_scale * LOG2E, order,
        variant, *_after_stream(scales, sinks, q.device),
    )  # fmt: skip
