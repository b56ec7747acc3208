"""``flashmask bench``: FlashMask against FlexAttention and SDPA on the paper's 12 masks.

For every (sequence length, head dim, mask) it times forward and forward+backward of

* ``flashmask``: :func:`flashmask.flashmask_attention` (mask preparation included in every call);
* ``flex``: ``torch.compile(flex_attention)`` with a ``BlockMask`` built from the same mask
  (``create_block_mask`` once, outside the timing, its cost reported separately);
* ``sdpa``: ``scaled_dot_product_attention(is_causal=...)`` for full/causal, and with a dense
  boolean mask (what "FlashAttention with a dense mask" costs) where it fits in memory;

and reports wall time, mask-aware TFLOP/s (4·D per visible (query, key) pair and query head
forward, 2.5x that backward), mask-preparation time and peak memory. ``--kv-heads`` runs
grouped-query attention (fewer key/value heads than query heads) in each implementation's own
form. ``--dtype fp8`` adds a forward-only row, ``flashmask_fp8``: the same inputs quantised to
float8_e4m3fn (per batch and head, once, outside the timing), timed beside the bf16 rows, with
its error against the float32 reference on the dequantised inputs and that of
:func:`flashmask.fp8.emulate_fp8_forward`. Results go to JSON, Markdown and a PNG chart. Needs a
CUDA GPU (``--device cpu`` runs the same code on the CPU with wall-clock timings, for tests).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from flashmask import fp8, masks
from flashmask.attention import flashmask_attention
from flashmask.mask import FlashMask

__all__ = ["main", "visible_flop", "visible_pairs"]


# The implementations `flashmask bench --impls` knows: flashmask_sinks, flashmask_softcap and
# flashmask_deterministic are flashmask with learnable sinks (one random logit per head, their
# gradient included), with a logit cap of SOFTCAP and with deterministic=True (a bit-reproducible
# backward), timed beside the plain flashmask row to price each feature.
IMPLS = (
    "flashmask", "flex", "sdpa", "fm4", "flashmask_sinks", "flashmask_softcap",
    "flashmask_deterministic",
)  # fmt: skip
SOFTCAP = 30.0
# --dtype: the inputs of every row are bf16; fp8 adds the FP8 forward's row (FP8_IMPL).
DTYPES = ("bf16", "fp8")
FP8_IMPL = "flashmask_fp8"


def visible_pairs(
    mask: FlashMask | None, causal: bool, seqlen_q: int, seqlen_k: int
) -> torch.Tensor:
    """Visible (query, key) pairs per (batch, mask head), int64 ``[B, Hm]``, in O(N).

    Masked rows of a column are the union of ``[lts, lte)``, ``[uts, ute)`` and the causal
    prefix ``[0, j - (Sk - Sq))``; inclusion-exclusion over the three intervals counts it.
    """
    if mask is None:
        cols = torch.arange(seqlen_k, dtype=torch.int64)
        hidden = (cols - (seqlen_k - seqlen_q)).clamp(0, seqlen_q) if causal else cols * 0
        return (seqlen_q - hidden).sum().view(1, 1)
    iv = [x.to(torch.int64) for x in mask.intervals(seqlen_q)]
    cols = torch.arange(seqlen_k, dtype=torch.int64, device=iv[0].device)
    zero = torch.zeros_like(iv[0])
    causal_end = (cols - (seqlen_k - seqlen_q)).clamp(0, seqlen_q) + zero if mask.causal else zero
    spans = [(zero, causal_end), (iv[0], iv[1]), (iv[2], iv[3])]

    def length(parts):
        start = torch.stack([p[0] for p in parts]).amax(0)
        end = torch.stack([p[1] for p in parts]).amin(0)
        return (end - start).clamp(min=0)

    a, l, u = spans
    union = (
        length([a]) + length([l]) + length([u])
        - length([a, l]) - length([a, u]) - length([l, u])
        + length([a, l, u])
    )  # fmt: skip
    return (seqlen_q - union).sum(-1)


def visible_flop(
    mask: FlashMask | None,
    causal: bool,
    seqlen: int,
    head_dim: int,
    heads: int,
    batch: int,
    per_pair: float = 4.0,
) -> float:
    """FLOPs over the visible query-key pairs of a ``[batch, seqlen]`` self-attention call with
    ``heads`` query heads: ``per_pair * head_dim`` per pair and query head (4 for a forward, 10
    for a five-matmul backward). Each of ``mask``'s ``Hm`` mask heads serves ``heads // Hm``
    query heads, and a batch-1 mask all ``batch`` rows."""
    pairs = visible_pairs(mask.to("cpu") if mask is not None else None, causal, seqlen, seqlen)
    per_mask_head = heads // pairs.shape[1]
    return per_pair * head_dim * int(pairs.sum()) * per_mask_head * (batch // pairs.shape[0])


def attention_flop(
    mask: FlashMask | None,
    causal: bool,
    seqlen: int,
    head_dim: int,
    heads: int,
    batch: int,
    head_dim_v: int | None = None,
) -> tuple[float, float]:
    """``(forward, backward)`` FLOPs over the visible pairs (:func:`visible_flop`'s count) with
    Q/K's ``head_dim`` and V's ``head_dim_v`` (``None``: ``head_dim``): the forward's two matmuls
    ``2 (D + Dv)`` per pair and query head, the backward's five (S and dQ, dK at ``D``; dP and
    dV at ``Dv``) ``2 (3 D + 2 Dv)``; 4 D and 10 D where the two are equal."""
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = visible_flop(mask, causal, seqlen, 1, heads, batch, per_pair=1.0)
    return 2 * (head_dim + dv) * pairs, 2 * (3 * head_dim + 2 * dv) * pairs


@dataclass
class Row:
    mask: str
    seqlen: int
    batch: int
    heads: int
    head_dim: int
    impl: str
    sparsity: float
    fwd_ms: float | None = None
    total_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    total_tflops: float | None = None
    bwd_tflops: float | None = None
    mask_prep_ms: float | None = None
    # Device time alone (the host's launch latency hidden, as when the host runs ahead).
    mask_prep_gpu_ms: float | None = None
    peak_gb: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    # Key/value heads (grouped-query attention when fewer than ``heads``); None: ``heads``.
    kv_heads: int | None = None
    # V's head dim where it differs from Q/K's (MLA: 192 / 128); None: ``head_dim``.
    head_dim_v: int | None = None
    # FP8 rows: RMSE of the output against the float32 reference on the dequantised inputs, and
    # that of flashmask.fp8.emulate_fp8_forward (the yardstick of an FP8 kernel's error).
    rmse: float | None = None
    emulation_rmse: float | None = None


def _bench(fn: Callable[[], object], rep_ms: int, min_repeats: int = 5) -> float:
    """Median ms per call of ``fn``, the L2 flushed before each timed call: over ``rep_ms``
    (``triton.testing.do_bench``), or over ``min_repeats`` calls where ``rep_ms`` holds fewer
    (a 56 ms call got 3 timed calls in 100 ms and a 900 ms one a single call, whose median moved
    by up to 4% between runs of the same kernel on the H200). One warm-up call and one timed
    call decide which: a long call is then timed ``min_repeats`` times with nothing else (do_bench
    would first spend five calls estimating it again: ~20 calls per 128K measurement, not 7)."""
    import triton

    fn()
    (estimate,) = _timed_calls_ms(fn, 1)
    if estimate * min_repeats <= rep_ms:
        ms = triton.testing.do_bench(
            fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"
        )
        return float(ms)
    return float(statistics.median(_timed_calls_ms(fn, min_repeats)))


def _timed_calls_ms(fn: Callable[[], object], calls: int) -> list[float]:
    """The GPU time (ms, CUDA events) of each of ``calls`` calls of ``fn``, back to back, the L2
    flushed before each by zeroing 256 MB (as ``do_bench`` does)."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(calls)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def input_gradients(
    out: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The gradients of ``inputs`` for ``out``'s gradient ``grad``, returned as autograd hands
    them to the layer below. The timed calls use this rather than ``out.backward(grad)``, which
    adds every call's gradients into the inputs' ``.grad`` after the first: three elementwise
    adds, 0.28 ms of a 1.9 ms call at 8K (B x H = 64, D = 128, measured on the H200) for every
    implementation alike, which are not attention's work (flash-attention's benchmarks clear
    ``.grad`` before each timed backward for the same reason)."""
    return torch.autograd.grad(out, inputs, grad)


def _kernel_names(fn: Callable[[], object], limit: int = 8, width: int = 80) -> list[str]:
    """The distinct GPU kernels one call of ``fn`` launches (names cut to ``width``, at most
    ``limit`` of them, by GPU time): which backend an implementation ran (SDPA's flash / cuDNN /
    efficient kernels, FlashMask's Gluon or Triton ones) goes into each row's ``extra``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [e.key[:width] for e in events[:limit]]


def _wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time (ms) of ``repeats`` calls of ``fn`` after one warm-up call: the CPU's
    timing (``--device cpu``), where there are no CUDA events to read."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _cuda_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time (ms) of a host-synchronous call such as mask construction."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _gpu_time(fn: Callable[[], object], repeats: int = 50) -> float:
    """Device time (ms) per call of ``fn`` without its host-side launch latency: the calls are
    queued behind a GPU sleep longer than their enqueueing, so the GPU runs them back to back,
    as in a training step where the host runs ahead of the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    host_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Sleep twice the measured enqueue time (at <= 2 GHz a cycle is >= 0.5 ns).
    torch.cuda._sleep(int(2 * host_s * 2e9) + 2_000_000)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


# FlexAttention compiles its kernels per mask_mod; module-level mask_mods reading the bounds from
# module state keep one compiled kernel per (causal, shape) instead of one per mask.
_FLEX_STATE: dict = {}


def _flex_hidden(b, h, q_idx, kv_idx):
    bounds = _FLEX_STATE["bounds"]
    hh = h // _FLEX_STATE["group"]
    lts = bounds[b, hh, 0, kv_idx]
    lte = bounds[b, hh, 1, kv_idx]
    uts = bounds[b, hh, 2, kv_idx]
    ute = bounds[b, hh, 3, kv_idx]
    return ((q_idx >= lts) & (q_idx < lte)) | ((q_idx >= uts) & (q_idx < ute))


def _flex_mask_mod(b, h, q_idx, kv_idx):
    return ~_flex_hidden(b, h, q_idx, kv_idx)


def _flex_causal_mask_mod(b, h, q_idx, kv_idx):
    return ~_flex_hidden(b, h, q_idx, kv_idx) & (kv_idx <= q_idx)


def _flex_block_mask(mask: FlashMask | None, causal: bool, b: int, hq: int, s: int, device):
    """A builder of the BlockMask equal to ``mask`` (Sq == Sk), for FlexAttention."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashmask.kernels.tiles import column_bounds

    is_causal = mask.causal if mask is not None else causal
    sri = None if mask is None else mask.startend_row_indices
    bounds = column_bounds(sri, is_causal, s, s, b, device)
    hm = bounds.shape[1]
    _FLEX_STATE.update(bounds=bounds, group=hq // hm)
    mask_mod = _flex_causal_mask_mod if is_causal else _flex_mask_mod
    heads = None if hm == 1 else hq

    def build():
        _FLEX_STATE.update(bounds=bounds, group=hq // hm)
        return create_block_mask(mask_mod, b, heads, s, s, device=device, _compile=True)

    return build


def flex_calls(
    flex: Callable,
    block_mask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
) -> tuple[Callable[[], object], Callable[[], None]]:
    """``(forward, forward + backward)`` calls of a compiled ``flex_attention`` with a built
    ``block_mask``, on copies of ``q, do [B, S, H, D]`` and ``k, v [B, S, Hkv, D]`` laid out as
    flex takes them (``[B, H, S, D]``, contiguous; q/k/v requiring grad); with fewer key/value
    heads than query heads, flex's grouped-query form (``enable_gqa=True``)."""
    qf, kf, vf, dof = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qf, kf, vf = (x.requires_grad_() for x in (qf, kf, vf))
    gqa = kf.shape[1] != qf.shape[1]

    def forward():
        return flex(qf, kf, vf, block_mask=block_mask, enable_gqa=gqa)

    def forward_backward():
        out = flex(qf, kf, vf, block_mask=block_mask, enable_gqa=gqa)
        input_gradients(out, (qf, kf, vf), dof)

    return forward, forward_backward


def run_case(
    name: str,
    seqlen: int,
    batch: int,
    heads: int,
    head_dim: int,
    impls: list[str],
    rep_ms: int,
    dense_limit_gb: float,
    min_repeats: int = 5,
    kv_heads: int | None = None,
    head_dim_v: int | None = None,
    dtype_name: str = "bf16",
    device: str = "cuda",
) -> list[Row]:
    """Rows of every implementation in ``impls`` for one mask, length and head dim: Q and K
    ``[batch, seqlen, heads | kv_heads, head_dim]``, V and dO with ``head_dim_v`` (``None``:
    ``head_dim``; MLA's 192 / 128), K and V with ``kv_heads`` heads (``None``: ``heads``; fewer:
    grouped-query attention, each implementation's own form of it). FLOPs count the five
    matmuls at their own widths: ``2 (D + Dv)`` per visible pair and query head forward,
    ``2 (3 D + 2 Dv)`` backward (:func:`attention_flop`).

    ``dtype_name`` ``"fp8"`` (one of :data:`DTYPES`) adds the :data:`FP8_IMPL` row after the
    others (:func:`fp8_row`). ``device`` ``"cpu"`` times wall clock, without memory, kernel
    names or the preparation's own timing (the CPU runs the reference, which prepares nothing):
    for tests of the bench itself."""
    from torch.nn.attention.flex_attention import flex_attention

    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype_name must be one of {DTYPES}, got {dtype_name!r}")
    group = heads // kv_heads
    dv = head_dim if head_dim_v is None else head_dim_v

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    # random_eviction has a mask per key/value head (FlashMask's mask heads are 1 or Hkv).
    mask_heads = kv_heads if name == "random_eviction" else 1
    if name == "full":
        mask, causal = None, False
    elif name == "causal":
        mask, causal = None, True
    else:
        mask = masks.example(
            name, seqlen, batch_size=batch, num_heads=mask_heads, generator=gen
        ).to(device)
        causal = mask.causal
    ref_mask = (
        mask if mask is not None else (masks.causal(seqlen) if causal else masks.full(seqlen))
    )
    sparsity = ref_mask.to(device).sparsity(128, 128)
    fwd_flop, bwd_flop = attention_flop(mask, causal, seqlen, head_dim, heads, batch, dv)
    q = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, seqlen, kv_heads, dv, device=device, dtype=dtype)
    do = torch.randn(batch, seqlen, heads, dv, device=device, dtype=dtype)
    rows: list[Row] = []

    def timed(fn: Callable) -> float:
        return _bench(fn, rep_ms, min_repeats) if on_gpu else _wall_ms(fn, min_repeats)

    def finish(row: Row, fwd: Callable, total: Callable | None) -> Row:
        """Time ``fwd`` and ``total`` (``None``: a forward-only row, its fwd+bwd columns
        empty) into ``row``."""
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        row.fwd_ms = timed(fwd)
        row.fwd_tflops = fwd_flop / row.fwd_ms / 1e9
        if total is not None:
            row.total_ms = timed(total)
            row.bwd_ms = max(row.total_ms - row.fwd_ms, 1e-9)
            row.total_tflops = (fwd_flop + bwd_flop) / row.total_ms / 1e9
            row.bwd_tflops = bwd_flop / row.bwd_ms / 1e9
        if not on_gpu:
            return row
        row.peak_gb = torch.cuda.max_memory_allocated() / 2**30
        try:
            row.extra["kernels"] = _kernel_names(total or fwd)
        except Exception as exc:  # a profiler problem must not cost the timings
            row.extra["kernels"] = [f"unavailable: {type(exc).__name__}: {exc}"[:120]]
        return row

    def base(impl: str) -> Row:
        return Row(
            name, seqlen, batch, heads, head_dim, impl, sparsity, kv_heads=kv_heads,
            head_dim_v=head_dim_v if dv != head_dim else None,
        )  # fmt: skip

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def run_flashmask(impl: str = "flashmask", **features) -> None:
        """One flashmask row; ``features``: ``sinks``, ``softcap`` or ``deterministic`` for the
        feature rows."""
        from flashmask.kernels import clear_prepared, device_shared_memory, tile_config
        from flashmask.kernels.forward_launcher import plan_forward, prepare_plan

        sri = mask.startend_row_indices if mask is not None else None
        cfg = tile_config(
            head_dim, has_mask=sri is not None, shared_memory=device_shared_memory(device)
        )
        # What one forward + backward of a new mask prepares, as the launchers do it (the lists
        # of the kernels they route to: Triton's or, on Hopper, Gluon's): the forward's lists
        # and the backward's in one call, then the launch orders in one launch.
        plan = plan_forward(
            q, k, v, sri, causal, head_dim**-0.5, features.get("deterministic", False), cfg,
            softcap=features.get("softcap", 0.0),
        )  # fmt: skip
        sinks = features.get("sinks")
        grads_of = (qg, kg, vg) if sinks is None else (qg, kg, vg, sinks)

        def prep():
            clear_prepared()
            prepare_plan(plan, sri, causal, seqlen, seqlen, batch, device)

        # Each timed call prepares its mask, as a model's first layer does (later layers and
        # the backward reuse it: kernels.prepare_cached); the cache is cleared before each.
        def fm_fwd():
            clear_prepared()
            return flashmask_attention(qg, kg, vg, mask, causal=causal, **features)

        def fm_total():
            clear_prepared()
            out = flashmask_attention(qg, kg, vg, mask, causal=causal, **features)
            input_gradients(out, grads_of, do)

        row = finish(base(impl), fm_fwd, fm_total)
        if on_gpu:  # off the GPU the reference runs, which prepares nothing
            row.mask_prep_ms = _bench(prep, max(50, rep_ms // 4))
            row.mask_prep_gpu_ms = _gpu_time(prep)
        rows.append(row)

    def run_flex() -> None:
        # Static shapes: after a first length Dynamo would compile the next one dynamic.
        flex = torch.compile(flex_attention, dynamic=False)
        build = _flex_block_mask(mask, causal, batch, heads, seqlen, device)
        block_mask = build()
        prep_ms = _cuda_time(build)
        row = finish(base("flex"), *flex_calls(flex, block_mask, q, k, v, do))
        row.mask_prep_ms = prep_ms
        rows.append(row)

    def run_sdpa() -> None:
        import torch.nn.functional as F

        qs, ks, vs, dos = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
        qs, ks, vs = (x.requires_grad_() for x in (qs, ks, vs))
        gqa = group > 1
        if mask is None:

            def sd_fwd():
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)

            def sd_total():
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
                input_gradients(out, (qs, ks, vs), dos)

            rows.append(finish(base("sdpa"), sd_fwd, sd_total))
        dense_gb = batch * mask.num_heads * seqlen * seqlen / 2**30 if mask is not None else 0
        if mask is not None and dense_gb <= dense_limit_gb:
            t0 = time.perf_counter()
            dense = mask.to_dense(seqlen)
            if on_gpu:
                torch.cuda.synchronize()
            dense_prep = (time.perf_counter() - t0) * 1e3
            if mask.num_heads > 1:
                dense = dense.repeat_interleave(heads // mask.num_heads, dim=1)

            # With a mask, grouped K/V heads are repeated per query head inside the call, as
            # transformers' SDPA attention does (it passes enable_gqa only without a mask);
            # the repeat's time counts as this implementation's.
            def expanded(x):
                return x.repeat_interleave(group, dim=1) if gqa else x

            def sdd_fwd():
                return F.scaled_dot_product_attention(
                    qs, expanded(ks), expanded(vs), attn_mask=dense
                )

            def sdd_total():
                out = F.scaled_dot_product_attention(
                    qs, expanded(ks), expanded(vs), attn_mask=dense
                )
                input_gradients(out, (qs, ks, vs), dos)

            row = finish(base("sdpa_dense_mask"), sdd_fwd, sdd_total)
            row.mask_prep_ms = dense_prep
            rows.append(row)
            del dense

    def run_fm4() -> None:
        fm4_attention = flashmask4()
        if fm4_attention is None:
            rows.append(replace(base("fm4"), note="fm4_torch not importable"))
            return
        sri = mask.startend_row_indices if mask is not None else None

        # FlashMask-4 builds its block lists inside each call, as flashmask prepares its mask.
        def f4_fwd():
            return fm4_attention(qg, kg, vg, sri, causal=causal)

        def f4_total():
            input_gradients(fm4_attention(qg, kg, vg, sri, causal=causal), (qg, kg, vg), do)

        try:
            rows.append(finish(base("fm4"), f4_fwd, f4_total))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a form or head dim the peer refuses costs only its row
            rows.append(replace(base("fm4"), note=f"error: {type(exc).__name__}: {exc}"[:160]))

    def run_sinks() -> None:
        sinks = torch.randn(heads, device=device).requires_grad_()
        run_flashmask("flashmask_sinks", sinks=sinks)

    def run_fp8() -> None:
        row = base(FP8_IMPL)
        call, row.extra = fp8_row(q, k, v, mask, causal, timed)
        finish(row, call, None)
        row.rmse, row.emulation_rmse = row.extra.pop("rmse"), row.extra.pop("emulation_rmse")
        row.note = row.extra["path"] + f"; quantize {row.extra['quantize_ms']:.3f} ms, untimed"
        rows.append(row)

    runners = {
        "flashmask": run_flashmask,
        "flex": run_flex,
        "sdpa": run_sdpa,
        "fm4": run_fm4,
        "flashmask_sinks": run_sinks,
        "flashmask_softcap": lambda: run_flashmask("flashmask_softcap", softcap=SOFTCAP),
        "flashmask_deterministic": lambda: run_flashmask(
            "flashmask_deterministic", deterministic=True
        ),
        FP8_IMPL: run_fp8,
    }
    wanted = [*impls, FP8_IMPL] if dtype_name == "fp8" else impls
    for impl, run in runners.items():
        if impl not in wanted:
            continue
        try:
            run()
        except torch.OutOfMemoryError:
            # One implementation running out of memory (e.g. Flex's create_block_mask at 128K)
            # must not cost the others' rows of the same case.
            rows.append(replace(base(impl), note="OOM"))
            torch.cuda.empty_cache()
    return rows


# Query rows (the last ones) over which the FP8 row's errors are measured.
ACCURACY_ROWS = 1024


def fp8_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask | None,
    causal: bool,
    timed: Callable[[Callable[[], object]], float],
) -> tuple[Callable[[], torch.Tensor], dict]:
    """The FP8 row's forward call and facts, from the bf16 ``q [B, S, Hq, D]``, ``k``, ``v [B, S,
    Hk, D | Dv]`` of the other rows: the inputs quantised once per batch and head
    (:func:`flashmask.quantize_fp8`, queries one descale per key/value head's group), ``timed``
    (the bench's timer) pricing the quantisation, which stays out of the call.

    Returns ``(call, facts)``: ``call()`` runs :func:`flashmask.flashmask_attention` on the FP8
    inputs (bf16 output); ``facts`` holds ``quantize_ms``, ``path`` (the FP8 kernel, or the
    reference where :func:`flashmask.kernels.routing.use_cute_fp8_forward` does not take the
    call), and the RMSE of the call's output (``rmse``) and of
    :func:`flashmask.fp8.emulate_fp8_forward` (``emulation_rmse``), each against
    :func:`flashmask.flashmask_attention` in float32 on the dequantised inputs, over the last
    :data:`ACCURACY_ROWS` query rows."""
    from flashmask.kernels import routing

    heads_k = k.shape[2]
    group = q.shape[2] // heads_k

    def quantize():
        return (
            fp8.quantize_fp8(q, group=group),
            fp8.quantize_fp8(k),
            fp8.quantize_fp8(v),
        )

    (q8, qd), (k8, kd), (v8, vd) = quantize()
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)

    def call() -> torch.Tensor:
        return flashmask_attention(q8, k8, v8, mask, causal=causal, **descales)

    scale = q.shape[-1] ** -0.5
    kernel = routing.use_cute_fp8_forward(q8, k8, v8, scale)
    # The errors over the last ACCURACY_ROWS query rows (rows are independent, and a mask's last
    # rows are FlashMask.last_rows): the float32 reference and the emulation are dense in the
    # keys, and over every row they would cost more than the whole timed run at 32K.
    rows = min(q.shape[1], ACCURACY_ROWS)
    q8_last = q8[:, -rows:]
    mask_last = None if mask is None else mask.last_rows(rows)
    with torch.no_grad():
        exact = flashmask_attention(
            fp8.dequantize(q8_last, qd, heads_k), fp8.dequantize(k8, kd, heads_k),
            fp8.dequantize(v8, vd, heads_k), mask_last, causal=causal,
        )  # fmt: skip
        emulated, _ = fp8.emulate_fp8_forward(q8_last, k8, v8, mask_last, causal=causal, **descales)
        out = call()[:, -rows:]

    def rmse(x: torch.Tensor) -> float:
        return float((x.float() - exact).square().mean().sqrt())

    facts = {
        "quantize_ms": timed(quantize),
        "path": "FP8 kernel" if kernel else "reference: no FP8 kernel",
        "rmse": rmse(out),
        "emulation_rmse": rmse(emulated),
    }
    return call, facts


@functools.cache
def flashmask4() -> Callable | None:
    """FlashMask-4's attention (``fm4_torch.fm4_attention``: Paddle's CuTe DSL kernels for
    Hopper behind a thin torch shim, a benchmark peer that is not part of flashmask) when
    ``fm4_torch`` and its CuTe DSL wheels are importable, else ``None``."""
    try:
        from fm4_torch import fm4_attention
    except Exception:  # absent, or its cutlass-dsl wheels missing or broken
        return None
    return fm4_attention


def default_impls() -> str:
    """The implementations timed by default: flashmask, flex and sdpa, and FlashMask-4 (fm4)
    when it is importable."""
    return "flashmask,flex,sdpa" + (",fm4" if flashmask4() is not None else "")


def _markdown(rows: list[Row]) -> str:
    # The FP8 rows' accuracy columns appear only in runs that have FP8 rows (--dtype fp8).
    accuracy = any(r.rmse is not None or r.emulation_rmse is not None for r in rows)
    lines = [
        "| S | D | heads | mask | sparsity | impl | fwd ms | fwd+bwd ms | fwd TF/s | fwd+bwd TF/s "
        "| mask prep ms | prep % of fwd+bwd | prep GPU ms | GPU prep % | peak GB "
        "| vs flex (fwd+bwd) | vs fm4 (fwd+bwd) |"
        + (" RMSE vs fp32 | emulation RMSE |" if accuracy else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if accuracy else ""),
    ]

    def case(r: Row) -> tuple:
        return (r.mask, r.seqlen, r.head_dim, r.head_dim_v, r.heads, r.kv_heads or r.heads)

    flex_total = {case(r): r.total_ms for r in rows if r.impl == "flex" and r.total_ms}
    fm4_total = {case(r): r.total_ms for r in rows if r.impl == "fm4" and r.total_ms}

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    for r in rows:
        ref = flex_total.get(case(r))
        kv = r.kv_heads or r.heads
        heads = f"{r.heads}" if kv == r.heads else f"{r.heads}:{kv}"
        dims = f"{r.head_dim}" if r.head_dim_v is None else f"{r.head_dim}/{r.head_dim_v}"
        speedup = f"{ref / r.total_ms:.2f}x" if ref and r.total_ms else "—"
        fm4 = fm4_total.get(case(r))
        vs_fm4 = f"{fm4 / r.total_ms:.2f}x" if fm4 and r.total_ms else "—"
        # FlashMask prepares inside every call; Flex's BlockMask is built once, outside the timing.
        share = 100 * r.mask_prep_ms / r.total_ms if r.mask_prep_ms and r.total_ms else None
        gpu_ms = r.mask_prep_gpu_ms
        gpu_share = 100 * gpu_ms / r.total_ms if gpu_ms and r.total_ms else None
        lines.append(
            f"| {r.seqlen // 1024}K | {dims} | {heads} | {r.mask} | {r.sparsity:.2f} "
            f"| {r.impl}{f' ({r.note})' if r.note else ''} "
            f"| {f(r.fwd_ms)} | {f(r.total_ms)} | {f(r.fwd_tflops, '{:.0f}')} "
            f"| {f(r.total_tflops, '{:.0f}')} | {f(r.mask_prep_ms, '{:.3f}')} "
            f"| {f(share, '{:.1f}')} | {f(gpu_ms, '{:.3f}')} | {f(gpu_share, '{:.2f}')} "
            f"| {f(r.peak_gb)} "
            f"| {speedup} | {vs_fm4} |"
            + (f" {f(r.rmse, '{:.2e}')} | {f(r.emulation_rmse, '{:.2e}')} |" if accuracy else "")
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart written", file=sys.stderr)
        return
    groups = sorted({(r.seqlen, r.head_dim) for r in rows})
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.2 * len(groups)), squeeze=False)
    impls = ["flashmask", "flex", "sdpa", "sdpa_dense_mask"]
    for ax, (s, d) in zip(axes[:, 0], groups, strict=True):
        sub = [r for r in rows if r.seqlen == s and r.head_dim == d]
        names = list(dict.fromkeys(r.mask for r in sub))
        width = 0.2
        for i, impl in enumerate(impls):
            vals = [
                next((r.total_tflops or 0 for r in sub if r.mask == n and r.impl == impl), 0)
                for n in names
            ]
            ax.bar([x + i * width for x in range(len(names))], vals, width, label=impl)
        ax.set_xticks([x + 1.5 * width for x in range(len(names))], names, rotation=30, ha="right")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.set_title(f"S={s // 1024}K, head dim {d}, bf16 (mask-aware FLOPs)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr)
    except ImportError:

        class Plain:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"[{self.n}/{total}]", file=sys.stderr, flush=True)

            def set_description(self, s: str) -> None:
                print(s, file=sys.stderr, flush=True)

            def close(self) -> None:
                pass

        return Plain()


def main(argv: list[str] | None = None) -> int:
    # ``flashmask bench --decode`` runs flashmask.bench_decode instead (dispatched by the
    # command, flashmask.cli); the option is declared here for --help.
    parser = argparse.ArgumentParser(
        prog="flashmask bench",
        description=__doc__.split("\n\n")[0]
        + " With --decode: decoding steps and chunked prefill over a KV cache instead "
        "(see flashmask bench --decode --help).",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="run the decode-step and chunked-prefill benchmark (flashmask.bench_decode) "
        "instead; its own options follow (flashmask bench --decode --help)",
    )
    parser.add_argument(
        "--seqlens",
        default="8192,32768",
        help="comma-separated sequence lengths, e.g. 8192,32768,131072 (8192,32768)",
    )
    parser.add_argument(
        "--head-dims", default="128", help="comma-separated head dimensions, e.g. 64,128 (128)"
    )
    parser.add_argument(
        "--head-dim-v",
        type=int,
        default=0,
        help="V's head dim where it differs from Q/K's, e.g. --head-dims 192 --head-dim-v 128 "
        "for DeepSeek's MLA (0: each head dim's own)",
    )
    parser.add_argument(
        "--masks",
        default=",".join(masks.MASK_TYPES),
        help="comma-separated mask types of flashmask.masks.example (all 12 of the paper)",
    )
    parser.add_argument(
        "--tokens", type=int, default=32768, help="batch x seqlen, fixed over lengths (32768)"
    )
    parser.add_argument(
        "--hidden", type=int, default=2048, help="heads x head_dim, fixed over head dims (2048)"
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="key/value heads (grouped-query attention when fewer than the query heads; "
        "0: as many as the query heads)",
    )
    parser.add_argument(
        "--impls",
        default=None,
        help="comma-separated implementations to time: flashmask, flex, sdpa (sdpa includes "
        "SDPA with a dense mask where it fits --dense-limit-gb), fm4 (FlashMask-4 through "
        "fm4_torch, when importable), flashmask_sinks, flashmask_softcap and "
        "flashmask_deterministic (flashmask with learnable sinks / a logit cap of 30 / "
        "deterministic=True, to price them) (flashmask,flex,sdpa, and fm4 when importable)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="bf16: every implementation on bf16 inputs; fp8: also the FP8 forward on the same "
        f"inputs quantised to float8_e4m3fn (the {FP8_IMPL} row: forward only, quantised once "
        "outside the timing, with its RMSE and that of the FP8 emulation against the float32 "
        "reference on the dequantised inputs, over the last 1024 query rows) (bf16)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda; cpu runs the same cases on the CPU with wall-clock timings, to test the "
        "bench itself (its times mean nothing) (cuda)",
    )
    parser.add_argument(
        "--rep-ms",
        type=int,
        default=200,
        help="milliseconds of timed calls per measurement, median reported (200)",
    )
    parser.add_argument(
        "--min-repeats",
        type=int,
        default=5,
        help="time at least this many calls per measurement (beyond --rep-ms for long calls)",
    )
    parser.add_argument(
        "--dense-limit-gb",
        type=float,
        default=4.0,
        help="largest dense boolean mask (GiB) built for SDPA with a dense mask; larger cases "
        "skip it (4.0)",
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results/bench",
        help="output path prefix of the .json, .md and .png (benchmarks/results/bench)",
    )
    args = parser.parse_args(argv)
    if args.decode:
        parser.error("--decode: run it as `flashmask bench --decode` (flashmask.bench_decode)")
    if args.head_dim_v < 0:
        parser.error(f"--head-dim-v must be 0 or a head dim, got {args.head_dim_v}")
    if args.min_repeats < 1:
        parser.error(f"--min-repeats must be at least 1, got {args.min_repeats}")
    seqlens = [int(x) for x in args.seqlens.split(",")]
    head_dims = [int(x) for x in args.head_dims.split(",")]
    for d in head_dims:
        heads = max(1, args.hidden // d)
        if args.kv_heads < 0 or (args.kv_heads and heads % args.kv_heads):
            parser.error(
                f"--kv-heads must be 0 or divide the query heads ({heads} at head dim {d}), "
                f"got {args.kv_heads}"
            )
    impls = (args.impls or default_impls()).split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown implementation(s) {unknown}; choose from {list(IMPLS)}")
    if "fm4" in impls and flashmask4() is None:
        parser.error(
            "--impls fm4: fm4_torch is not importable (put ../shared/anchors and FlashMask-4's "
            "CuTe DSL wheels on PYTHONPATH; benchmarks/README.md says how)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        print("flashmask bench needs a CUDA GPU (--device cpu: a test run)", file=sys.stderr)
        return 2
    # One compiled flex kernel per shape and causal flag; never fall back to eager flex.
    torch._dynamo.config.cache_size_limit = 64
    names = args.masks.split(",")
    cases = [(s, d, n) for s in seqlens for d in head_dims for n in names]
    bar = _progress(len(cases))
    rows: list[Row] = []
    shape = None
    for s, d, n in cases:
        bar.set_description(f"{n} S={s} D={d}")
        if (s, d) != shape:
            # FlexAttention as a one-shape run compiles it: Dynamo marks a dimension dynamic once
            # it has seen two sizes, and flex's kernels (and create_block_mask's) compiled with
            # a symbolic length ran 17-24% slower at 32K after an 8K case in one process.
            torch._dynamo.reset()
            shape = (s, d)
        batch = max(1, args.tokens // s)
        heads = max(1, args.hidden // d)
        kv_heads = args.kv_heads or heads
        try:
            rows += run_case(
                n, s, batch, heads, d, impls, args.rep_ms, args.dense_limit_gb,
                args.min_repeats, kv_heads, args.head_dim_v or None, args.dtype, args.device,
            )  # fmt: skip
        except torch.OutOfMemoryError as exc:  # report and carry on with the next case
            note = f"OOM: {exc}"[:200]
            rows.append(Row(n, s, batch, heads, d, "error", math.nan, note=note, kv_heads=kv_heads))
            torch.cuda.empty_cache()
        bar.update(1)
        _write_json(Path(args.out), rows, args)  # partial results survive an interrupted run
    bar.close()
    out = Path(args.out)
    meta = _write_json(out, rows, args)
    table = _markdown(rows)
    out.with_suffix(".md").write_text(
        f"# flashmask bench ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"{meta['date']})\n\n`flashmask bench {' '.join(argv or sys.argv[1:])}`\n\n" + table
    )
    _plot(rows, out.with_suffix(".png"))
    print(table)
    return 0


def _tile_configs(head_dims: list[int]) -> dict[str, dict]:
    """The kernels' default tiles on this GPU per head dim, with and without an interval mask
    (so a result file says which configuration produced it)."""
    from flashmask.kernels import device_shared_memory, tile_config

    shared = device_shared_memory(torch.device("cuda"))
    return {
        f"D{d}/{'mask' if has_mask else 'no mask'}": asdict(
            tile_config(d, has_mask=has_mask, shared_memory=shared)
        )
        for d in head_dims
        for has_mask in (True, False)
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # a CPU run on a platform without Triton
        return None
    return triton.__version__


def _write_json(out: Path, rows: list[Row], args: argparse.Namespace) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    on_gpu = args.device == "cuda"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "args": vars(args),
        "tile_configs": _tile_configs(head_dims) if on_gpu else {},
    }
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    return meta


if __name__ == "__main__":
    sys.exit(main())
