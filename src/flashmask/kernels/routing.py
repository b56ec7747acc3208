"""Which kernel family runs a call: the Gluon kernels' eligibility and length thresholds, and
the tile lists each routed kernel needs (see ``docs/design.md``, "Kernel families and
routing")."""

from __future__ import annotations

import functools
import warnings

import torch

from flashmask.kernels import hardware
from flashmask.kernels.config import (
    GLUON_BWD256_KEYS,
    GLUON_BWD_HEAD_DIMS,
    GLUON_BWD_KEYS,
    GLUON_BWD_QUERIES,
    GLUON_BWD_VALUE_HEAD_DIMS,
    GLUON_FWD_HEAD_DIMS,
    GLUON_FWD_SLOTS,
    GLUON_FWD_TILE,
    DecodeConfig,
    TileConfig,
    gluon_backward_hd256_layout,
)


def gluon_forward_tiles(head_dim: int) -> tuple[int, int]:
    """``(key tile, K/V slots)`` of the Gluon forward at ``head_dim``: 128-key tiles in
    :data:`GLUON_FWD_SLOTS` (three) slots up to D = 128 (224 KB of shared memory at 128); at
    D = 256 64-key tiles in two slots, the largest that fit (192 KB). D = 256 is not routed by
    default: measured 0.87-0.98x the Triton forward on the H200."""
    return (64, 2) if head_dim > 128 else (GLUON_FWD_TILE, GLUON_FWD_SLOTS)


def gluon_forward_eligible(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, capability: tuple[int, int]
) -> bool:
    """Whether the Gluon forward can take ``q [B, Sq, H, D]``, ``k``/``v [B, Sk, Hk, D]`` on a
    GPU of compute capability ``capability``: Hopper (9.x: ``warpgroup_mma`` and TMA; Blackwell
    has no wgmma), one fp16/bf16 dtype, ``D`` in :data:`GLUON_FWD_HEAD_DIMS`, both lengths
    divisible by the tile (its 2-D descriptors over ``[B * S, H * D]`` must not cross a
    sequence). Any layout: the launcher hands the kernel contiguous, 16-byte aligned copies of
    tensors that are not (:func:`~.tensors.tma_ready`; e.g. the ``[B, H, S, D]`` transposes that
    transformers passes)."""
    d = q.shape[-1]
    return (
        capability[0] == 9
        and q.dtype in hardware.KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and d in GLUON_FWD_HEAD_DIMS
        and k.shape[-1] == d
        and v.shape[-1] == d
        and q.shape[1] % GLUON_FWD_TILE == 0
        and k.shape[1] % GLUON_FWD_TILE == 0
    )


# The routing thresholds: with an interval mask, the Gluon kernels run only from this many keys
# (without a mask, at every length). Their 128-key tiles skip less finely than the Triton
# kernels' 64-key ones, so short sparse masks can lose. Measured on the H200 against the Triton
# kernels (docs/performance.md, "Routing"):
# * backward, per head dim (absent: every length): D = 128 from 4K keys (at 4K 1.01-1.31x on ten
#   of 12 masks, 0.91-0.98x on sliding_window and share_question; at 8K 1.01-1.31x on all);
#   D = 64 from 8K (1.01-1.20x on eleven, 0.99x on sliding_window); D = 256 at every length
#   (1.43-1.69x at 8K and 32K);
# * forward: from 8K keys (at 8K 1.04-1.22x on seven of ten masks and 0.93-0.97x on the three
#   sparsest, 11% less forward time summed; at 4K 0.86-0.94x on four). The launcher decides on
#   the length alone: a mask's tile lists live on the GPU and are not read on the host.
# * backward at MLA's 192 / 128 (``backward_hd256`` with Q/K padded to 256), H100: without a mask
#   1.15-1.44x at 8K and 32K; with one from 32K keys (1.02-1.42x on nine of ten masks at 32K,
#   share_question 0.88x; at 8K 0.73-0.97x on five of ten, sliding_window the least).
GLUON_BWD_MIN_MASKED_SEQLEN: dict[int, int] = {64: 8192, 128: 4096, 192: 32768}
GLUON_FWD_MIN_MASKED_SEQLEN = 8192


def gluon_backward_eligible(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    capability: tuple[int, int],
) -> bool:
    """Whether the Gluon backward can take these inputs: Hopper, one fp16/bf16 dtype, lengths
    divisible by 128 (as :func:`gluon_forward_eligible`), ``D`` in :data:`GLUON_BWD_HEAD_DIMS`
    with V's head dim equal, or a ``(D, Dv)`` pair of :data:`GLUON_BWD_VALUE_HEAD_DIMS`
    (multi-head latent attention), and a ``dout`` like ``v``'s head dim over ``q``'s rows."""
    d, dv = q.shape[-1], v.shape[-1]
    head_dims = (d in GLUON_BWD_HEAD_DIMS and dv == d) or GLUON_BWD_VALUE_HEAD_DIMS.get(d) == dv
    return (
        capability[0] == 9
        and q.dtype in hardware.KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and head_dims
        and k.shape[-1] == d
        and q.shape[1] % GLUON_FWD_TILE == 0
        and k.shape[1] % GLUON_FWD_TILE == 0
        and dout.shape == (*q.shape[:-1], dv)
        and dout.dtype == q.dtype
    )


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton ships the Gluon Hopper API the Gluon kernels are written against
    (Triton 3.6 and later; checked by importing the kernels' modules once). Without it the
    Triton kernels run, with one warning."""
    try:
        from flashmask.kernels.gluon_kernels import (  # noqa: F401
            backward,
            backward_hd256,
            forward,
        )
    except (ImportError, AttributeError) as exc:
        warnings.warn(
            f"flashmask: the Gluon kernels are unavailable with this Triton ({exc}); using the "
            "Triton kernels",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def use_gluon_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    masked: bool,
    config: TileConfig,
    softcap: float = 0.0,
) -> bool:
    """``config.fwd_gluon`` and inputs the Gluon forward takes, on a GPU (Gluon has no
    interpreter) and with a positive scale (its row max is taken over unscaled scores) or a
    logit cap (``softcap > 0``: the row max of the capped scores, whatever the scale); with an
    interval mask (``masked``) also at least :data:`GLUON_FWD_MIN_MASKED_SEQLEN` keys."""
    if not config.fwd_gluon or (softmax_scale <= 0 and not softcap):
        return False
    if masked and k.shape[1] < GLUON_FWD_MIN_MASKED_SEQLEN:
        return False
    capability = hardware.gpu_capability(q)
    return (
        capability is not None and gluon_forward_eligible(q, k, v, capability) and gluon_available()
    )


# The CuTe forward (``cute_kernels``) runs where it measured faster than the kernel routed before
# it, from 8K keys (forward time on the 12 masks; ``benchmarks/results/cute_2026-12-06.md``):
# * head dim 256, every mask form: 1.07-1.20x the Triton forward on all 12 masks at 8K (H100,
#   run of ada1f30);
# * head dim 128, without a mask or with a causal one: 1.01-1.06x the Gluon forward on all nine
#   such masks at 32K, 1.00-1.05x on eight of nine at 8K (random_eviction 0.99x) (H200);
# * head dim 128 with a non-causal mask (upper intervals): with persistent programs (its
#   ``launch.forward`` default for that form) 1.00-1.05x the Gluon forward on all four such
#   masks at 8K and 32K (H100); one query tile per program had measured 0.87-0.97x on three.
# * head dims 192 (Q/K) and 128 (V), multi-head latent attention: 1.52-2.06x the Triton forward
#   (the only other kernel with V's own head dim) on all 12 masks at 8K and 32K (H100,
#   ``benchmarks/results/cute_2026-12-06.md``).
# * head dim 64 with a mask from 32K keys: 1.05-1.37x the Triton forward on nine of the ten
#   masked masks at 32K, share_question 0.99x; at 8K 0.82-0.91x on sliding_window,
#   share_question and global_sliding_window (1.01-1.24x on the other seven). Without a mask
#   1.00-1.02x the Gluon forward, which keeps those calls (H100, 2026-12-07,
#   ``benchmarks/results/cute_2026-12-06.md``).
# The table keeps the form: a head dim routed later may not take non-causal masks.
CUTE_FWD_HEAD_DIMS = (64, 128, 192, 256)
CUTE_FWD_NONCAUSAL_MASK_HEAD_DIMS = (64, 128, 192, 256)
CUTE_FWD_MIN_SEQLEN = 8192
# Head dims the CuTe forward takes only with a mask (``startend_row_indices``), from these keys.
CUTE_FWD_MASKED_ONLY: dict[int, int] = {64: 32768}
# V's head dim per Q/K head dim (the same where absent): the kernel takes Dv <= D.
CUTE_FWD_VALUE_HEAD_DIMS = {192: 128}


@functools.cache
def cute_available() -> bool:
    """Whether the CuTe DSL (the ``flashmask[cute]`` extra) imports; checked once."""
    try:
        from flashmask.kernels.cute_kernels import forward  # noqa: F401
    except ImportError:
        return False
    return True


def use_cute_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    masked: bool,
    causal: bool,
    softcap: float = 0.0,
) -> bool:
    """Whether the CuTe forward runs this call: a Hopper GPU, the ``cute`` extra, one fp16/bf16
    dtype, ``D`` in :data:`CUTE_FWD_HEAD_DIMS` for q and k (with a non-causal mask, in
    :data:`CUTE_FWD_NONCAUSAL_MASK_HEAD_DIMS`) and V's head dim that of
    :data:`CUTE_FWD_VALUE_HEAD_DIMS` (``D`` where absent), at least :data:`CUTE_FWD_MIN_SEQLEN`
    keys (at a head dim of :data:`CUTE_FWD_MASKED_ONLY`, a mask and the keys it names) and a
    positive scale (its row max is taken over unscaled scores) or a logit cap
    (``softcap > 0``: the row max of the capped scores, whatever the scale). ``masked``: the
    call has a ``startend_row_indices``; ``causal``: the causal flag. Any lengths: its TMA loads
    read past a sequence as zeros and its stores clip."""
    d = q.shape[-1]
    if softmax_scale <= 0 and not softcap:
        return False
    if d not in CUTE_FWD_HEAD_DIMS or k.shape[1] < CUTE_FWD_MIN_SEQLEN:
        return False
    if masked and not causal and d not in CUTE_FWD_NONCAUSAL_MASK_HEAD_DIMS:
        return False
    if d in CUTE_FWD_MASKED_ONLY and not (masked and k.shape[1] >= CUTE_FWD_MASKED_ONLY[d]):
        return False
    capability = hardware.gpu_capability(q)
    return (
        capability is not None
        and capability[0] == 9
        and q.dtype in hardware.KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and k.shape[-1] == d
        and v.shape[-1] == CUTE_FWD_VALUE_HEAD_DIMS.get(d, d)
        and cute_available()
    )


def use_gluon_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    deterministic: bool,
    skip_tiles: bool,
    masked: bool,
    config: TileConfig,
    softcap: float = 0.0,
) -> bool:
    """``config.bwd_gluon``, ``deterministic=False`` and no
    ``torch.use_deterministic_algorithms(True)`` (its dQ atomics are not bit-reproducible), the
    skipping mode, inputs the Gluon backward takes, on a GPU; with an interval mask
    (``masked``) also at least the keys :data:`GLUON_BWD_MIN_MASKED_SEQLEN` asks at its head dim.
    A logit cap (``softcap > 0``) changes nothing where ``Dv == D``: the Gluon backward takes
    it. At MLA's head dims capped calls run the Triton backward: one GPU check case, the cap
    with sinks on causal_document, failed there (dq, dk, dv far off) while the cap alone and
    sinks alone passed, and no MLA model caps its logits."""
    if not config.bwd_gluon or deterministic or not skip_tiles:
        return False
    if softcap and v.shape[-1] != q.shape[-1]:
        return False
    if torch.are_deterministic_algorithms_enabled():  # the atomics are not reproducible
        return False
    if masked and k.shape[1] < GLUON_BWD_MIN_MASKED_SEQLEN.get(q.shape[-1], 0):
        return False
    return _one_pass_backward_inputs(q, k, v, dout) and gluon_available()


def _one_pass_backward_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor
) -> bool:
    """Whether the one-pass backwards (Gluon's and CuTe's, which share their inputs' rules and
    tile lists) take these inputs on their GPU (:func:`gluon_backward_eligible`)."""
    capability = hardware.gpu_capability(q)
    return capability is not None and gluon_backward_eligible(q, k, v, dout, capability)


# The CuTe backward (``cute_kernels.backward``) would take the Gluon backward's calls at these
# head dims (it walks the same 64 x 128 lists). None yet: at head dim 128 it measured 0.93-1.05x
# the Gluon backward over the 12 masks at 8K and 32K, level or ahead on 7 of 24 cells, 0.95x on
# full attention at 32K (H100, 2026-12-07, ``benchmarks/results/cute_2026-12-06.md``).
CUTE_BWD_HEAD_DIMS: tuple[int, ...] = ()


# The CuTe backward's deterministic variant (``BackwardVariant.deterministic``: each query tile's
# dQ added over its key tiles from the highest down, in turn) takes the deterministic calls
# without a mask from 8K keys at head dim 128, where the Triton passes ran them: 1.16-1.27x
# their backward on full, causal at 8K and 32K (H100, 2026-12-07, ``flashmask bench --impls
# flashmask_deterministic``, ``benchmarks/results/cute_2026-12-06.md``). With a mask it measured
# 1.02-1.26x on the dense masks (qk_sparse, random_eviction, prefix_lm_causal) but 0.31x / 0.35x /
# 0.67x on sliding_window, share_question and global_sliding_window at 8K and 0.61x on
# share_question at 32K (causes in ``docs/performance.md``: the turns for global_sliding_window,
# still open for the other two), so masked calls keep the Triton passes. Head dim 64 compiles
# and passes the GPU check but was not timed.
CUTE_DETERMINISTIC_BWD_HEAD_DIMS: tuple[int, ...] = (128,)
CUTE_DETERMINISTIC_BWD_MIN_SEQLEN = 8192
# Whether calls with a mask (``startend_row_indices``) take it too.
CUTE_DETERMINISTIC_BWD_MASKED = False


def use_cute_deterministic_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    deterministic: bool,
    masked: bool,
    softcap: float = 0.0,
) -> bool:
    """Whether a deterministic backward (``deterministic=True`` or
    ``torch.use_deterministic_algorithms(True)``) runs the CuTe backward's deterministic variant:
    the inputs the Gluon backward would take (:func:`gluon_backward_eligible`), ``D`` in
    :data:`CUTE_DETERMINISTIC_BWD_HEAD_DIMS`, at least :data:`CUTE_DETERMINISTIC_BWD_MIN_SEQLEN`
    keys, no mask (``masked``: the call has a ``startend_row_indices``) unless
    :data:`CUTE_DETERMINISTIC_BWD_MASKED`, no logit cap (the CuTe backward has none) and the
    ``cute`` extra installed."""
    if not (deterministic or torch.are_deterministic_algorithms_enabled()) or softcap:
        return False
    if q.shape[-1] not in CUTE_DETERMINISTIC_BWD_HEAD_DIMS:
        return False
    if k.shape[1] < CUTE_DETERMINISTIC_BWD_MIN_SEQLEN or (
        masked and not CUTE_DETERMINISTIC_BWD_MASKED
    ):
        return False
    return _one_pass_backward_inputs(q, k, v, dout) and cute_available()


def use_cute_backward(q: torch.Tensor, softcap: float = 0.0) -> bool:
    """Whether a call that :func:`use_gluon_backward` gives the Gluon backward runs the CuTe
    backward instead: no logit cap (``softcap``: the CuTe backward has none), ``D`` in
    :data:`CUTE_BWD_HEAD_DIMS` and the ``cute`` extra installed."""
    return not softcap and q.shape[-1] in CUTE_BWD_HEAD_DIMS and cute_available()


# The CuTe FP8 forward (``cute_kernels.launch.forward_fp8``: float8_e4m3fn q/k/v with
# per-(batch, key/value head) descales, FlashAttention-3's FP8 scheme) takes FP8 calls at these
# head dims; other FP8 calls run the float32 reference on the dequantised inputs. No length
# threshold, unlike CUTE_FWD_MIN_SEQLEN (where the bf16 CuTe forward beat the Gluon and Triton
# forwards): FP8 inputs have no other kernel. Like the bf16 CuTe forward it takes any lengths
# (TMA reads past a sequence as zeros, stores clip). On an H100 (benchmarks/results/
# fp8_2026-12-06.md) its outputs were as close to the float32 reference as the e4m3 emulation's
# on the 213 of 221 cases whose lse met a flat 1e-3 (the other 8 were off by up to 2.2e-3, the
# FP8 tensor cores' accumulation error), and it ran 1.01x the bf16 forward on full attention,
# 0.62-0.86x with a mask at 8K.
CUTE_FP8_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
# The output dtypes the FP8 kernel writes (16-bit, as FlashAttention-3's FP8 forward does);
# float32 outputs run the reference.
CUTE_FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)


def use_cute_fp8_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    softcap: float = 0.0,
    out_dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """Whether the CuTe FP8 forward runs this FP8 call (``flashmask.fp8.forward`` asks): a
    Hopper GPU (not the interpreter), the ``cute`` extra, float8_e4m3fn q, k and v, ``D`` in
    :data:`CUTE_FP8_HEAD_DIMS` for q and k and the same head dim for v (``Dv == D``),
    ``out_dtype`` in :data:`CUTE_FP8_OUT_DTYPES`, a positive scale (its row max is taken over
    unscaled scores) and no logit cap (``softcap``; the FP8 variant has none)."""
    d = q.shape[-1]
    if d not in CUTE_FP8_HEAD_DIMS or softmax_scale <= 0 or softcap:
        return False
    if out_dtype not in CUTE_FP8_OUT_DTYPES:
        return False
    capability = hardware.gpu_capability(q)
    fp8 = torch.float8_e4m3fn
    return (
        capability is not None
        and capability[0] == 9
        and q.dtype == fp8
        and k.dtype == fp8
        and v.dtype == fp8
        and k.shape[-1] == d
        and v.shape[-1] == d
        and cute_available()
    )


def use_decode(q: torch.Tensor, k: torch.Tensor, skip_tiles: bool, decode: DecodeConfig) -> bool:
    """Whether a forward runs the split-KV kernels (``triton_kernels.decode``): more keys than
    queries (a cache: decoding or chunked prefill), and few enough queries that all of them,
    times the query heads of a key/value head, fit one program's ``decode.max_rows`` rows. The
    training forward reads each K/V tile once per query head and, for a short query tile, runs
    too few programs to fill the GPU; the split-KV kernels read it once per key/value head and
    split the keys. Only the skipping mode (the dense mode is the training kernels' proof)."""
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    group = heads_q // k.shape[2]
    return skip_tiles and k.shape[1] > seqlen_q and seqlen_q * group <= decode.max_rows


def forward_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    masked: bool,
    causal: bool,
    config: TileConfig,
    softcap: float = 0.0,
) -> tuple[bool, bool]:
    """``(use_cute, use_gluon)``: which forward runs the call, the CuTe one first, then the
    Gluon one (neither: the Triton forward). A logit cap (``softcap > 0``) routes as the
    uncapped call, whatever the scale's sign (every family takes the cap)."""
    use_cute = use_cute_forward(q, k, v, softmax_scale, masked, causal, softcap)
    use_gluon = not use_cute and use_gluon_forward(q, k, v, softmax_scale, masked, config, softcap)
    return use_cute, use_gluon


def forward_shapes(
    use_gluon: bool, head_dim: int, config: TileConfig, use_cute: bool = False
) -> list[tuple[int, int, bool]]:
    """The tile lists of the forward: the CuTe or Gluon forward's 128-row lists, or the Triton
    forward's."""
    if use_cute:
        from flashmask.kernels.cute_kernels.launch import key_tile

        return [(GLUON_FWD_TILE, key_tile(head_dim), True)]
    if use_gluon:
        return [(GLUON_FWD_TILE, gluon_forward_tiles(head_dim)[0], True)]
    return [(config.fwd_m, config.fwd_n, True)]


def gluon_backward_keys(head_dim: int) -> int:
    """Keys per program (the key tile) of the Gluon backward at ``head_dim``."""
    return GLUON_BWD256_KEYS if gluon_backward_hd256_layout(head_dim) else GLUON_BWD_KEYS


def gluon_backward_module(head_dim: int):
    """The module of the Gluon backward at ``head_dim`` (``gluon_kernels.backward_hd256`` at 256
    and at MLA's 192, else ``gluon_kernels.backward``); imports it, so only where the
    interpreter is off."""
    if gluon_backward_hd256_layout(head_dim):
        from flashmask.kernels.gluon_kernels import backward_hd256

        return backward_hd256
    from flashmask.kernels.gluon_kernels import backward

    return backward


def backward_shapes(
    use_gluon: bool, head_dim: int, config: TileConfig
) -> list[tuple[int, int, bool]]:
    """The tile lists of the backward: the Gluon backward's column-major lists, or the Triton
    dK/dV pass's column-major and the dQ pass's row-major ones."""
    if use_gluon:
        return [(GLUON_BWD_QUERIES, gluon_backward_keys(head_dim), False)]
    return [(config.bwd_m, config.bwd_n, False), (config.dq_m, config.dq_n, True)]


def forward_list_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    config: TileConfig,
    softcap: float = 0.0,
) -> list[tuple[int, int, bool]]:
    """The tile lists (``prepare``'s ``(tile_m, tile_n, row_major)`` shapes) that
    the forward prepares for these inputs with ``config`` (and logit cap ``softcap``): those of
    the kernel it routes them to."""
    masked = startend_row_indices is not None
    use_cute, use_gluon = forward_kernel(q, k, v, softmax_scale, masked, causal, config, softcap)
    return forward_shapes(use_gluon, q.shape[-1], config, use_cute)


def backward_list_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    startend_row_indices: torch.Tensor | None,
    deterministic: bool,
    config: TileConfig,
    softcap: float = 0.0,
) -> list[tuple[int, int, bool]]:
    """The tile lists the backward prepares for these inputs with ``config`` (skipping mode)
    and logit cap ``softcap``, like :func:`forward_list_shapes`."""
    masked = startend_row_indices is not None
    use_gluon = use_gluon_backward(q, k, v, dout, deterministic, True, masked, config, softcap)
    cute = use_cute_deterministic_backward(q, k, v, dout, deterministic, masked, softcap)
    return backward_shapes(use_gluon or cute, q.shape[-1], config)
