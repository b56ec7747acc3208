"""``flashmask bench --decode``: decoding steps and chunked prefill over a KV cache.

A decoding step runs ``Sq`` new queries (1 by default) against a cache of ``Sk`` keys; chunked
prefill runs a chunk of ``Sq`` = 2048 queries at the end of a long cache. Both read the whole
visible cache once, so a decode step is memory bound (reported in TB/s of the K/V bytes it must
read) and a chunk is compute bound (reported in mask-aware TFLOP/s, beside FlashMask's own
training forward over the square mask at ``Sk``). Masks are bottom-right aligned (query ``i``
stands at key position ``i + Sk - Sq``). Cases:

* ``causal``: at ``Sq = 1`` full attention over the cache;
* ``sliding_window``: the last ``--window`` keys (the query's own included) plus
  ``--sink-tokens`` attention sinks at the start of the cache;
* ``causal_document``: ``masks.example``'s packed documents over the cache, each sequence its
  own draw (the queries see their own document only);
* ``ragged``: per-sequence cache lengths within the batch, drawn uniformly in ``[Sk/4, Sk]``
  (seeded): each sequence's queries end at its own length, the columns past it are hidden
  (the padding mask of a right-padded batched cache).

Implementations, on the same inputs in each one's own layout:

* ``flashmask``: :func:`flashmask.flashmask_attention` (the split-KV decode kernel where it
  routes, the training forward otherwise); the mask is prepared by a first call outside the
  timing, as a model's first layer does for all its layers; the preparation's cost is reported
  separately (the first call's extra wall time);
* ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)``: no mask for causal at ``Sq = 1``,
  ``causal_lower_right`` for causal chunks, else a dense boolean ``[B, 1, Sq, Sk]`` mask
  broadcast over the heads (its build cost reported);
* ``sdpa-best``: causal only: the fastest of SDPA's flash / efficient / cuDNN backends (for a
  chunk: ``causal_lower_right`` against the dense bottom-right mask under each backend);
* ``flex``: ``torch.compile(flex_attention)`` with a ``BlockMask`` from the same mask (its build
  reported), ``enable_gqa=True`` (flex picks its split-KV decoding kernel itself below 128
  queries).

Every output is checked against a float32 reference: an error above 2% of the reference's
largest magnitude marks the row ``WRONG`` and the command exits 1. Results go to JSON and
Markdown. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flashmask import masks
from flashmask.attention import flashmask_attention
from flashmask.mask import FlashMask

__all__ = [
    "CASES",
    "IMPLS",
    "Case",
    "DecodeRow",
    "Shape",
    "build_case",
    "dense_mask",
    "flex_bounds",
    "main",
    "plan_shapes",
    "ragged_mask",
    "reference_attention",
    "training_mask",
    "visible_kv_bytes",
    "visible_rows_per_key",
]

CASES: tuple[str, ...] = ("causal", "sliding_window", "causal_document", "ragged")
IMPLS: tuple[str, ...] = ("flashmask", "sdpa", "sdpa-best", "flex")
# An output is wrong when it is this far from the float32 reference, relative to the
# reference's largest magnitude: bf16 rounds to 2^-9 relative, so a correct kernel stays below
# 0.5%, while a mask off by one visible key out of 4K moves the output by ~1e-3 of |v|.
ERROR_TOLERANCE = 0.02
_ITEMSIZE = 2  # bf16

_DEFAULTS = dict(
    batches="1,8,32",
    cache_lens="8192,32768,131072",
    chunk_cache_lens="32768,131072",
    rep_ms=50,
)
# --quick: a few minutes less of compiling and timing; options given explicitly still win.
_QUICK = dict(batches="1,8", cache_lens="8192,32768", chunk_cache_lens="32768", rep_ms=20)


# ---------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One benchmark case: ``Sq`` queries of ``batch`` sequences over ``Sk`` cached keys.

    ``mask`` is the case's mask for the ``Sq`` queries (``seqlen_q = Sq``, bottom-right
    aligned), ``[batch, 1, Sk, C]`` (one mask head); ``flashmask_mask``
    and ``causal`` are what :func:`flashmask.flashmask_attention` gets (``None`` with
    ``causal=True`` for plain causal attention, the fastest form); ``lengths`` are the ragged
    case's per-sequence cache lengths."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    mask: FlashMask
    flashmask_mask: FlashMask | None
    causal: bool
    lengths: tuple[int, ...] | None = None


def ragged_mask(lengths: torch.Tensor, seqlen_k: int, seqlen_q: int) -> FlashMask:
    """The mask of ``Sq`` queries at the end of each sequence's own cache length.

    Sequence ``b`` holds ``lengths[b]`` keys (``Sq <= lengths[b] <= Sk``); its query ``i``
    stands at key position ``lengths[b] - Sq + i`` and sees keys up to it. Non-causal, C = 2,
    ``[B, 1, Sk, 2]``: columns past the length are hidden from every row (``LTS = 0``), column
    ``j`` below it from rows ``[0, j - (lengths[b] - Sq))`` (``UTE``). At ``Sq = 1`` this is the
    padding mask of a right-padded cache (``UTE = 0`` everywhere)."""
    lengths = lengths.to(torch.int64).view(-1, 1)
    cols = torch.arange(seqlen_k, dtype=torch.int64, device=lengths.device).view(1, -1)
    inside = cols < lengths
    lts = torch.where(inside, seqlen_q, 0)
    ute = torch.where(inside, (cols - (lengths - seqlen_q)).clamp(0, seqlen_q), 0)
    sri = torch.stack([lts, ute], dim=-1).unsqueeze(1).to(torch.int32).contiguous()
    return FlashMask(sri, False, seqlen_q)


def ragged_lengths(batch: int, seqlen_q: int, seqlen_k: int, seed: int) -> torch.Tensor:
    """Cache lengths int64 ``[batch]``, uniform in ``[max(Sk // 4, Sq), Sk]`` (seeded)."""
    low = max(seqlen_k // 4, seqlen_q)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, seqlen_k + 1, (batch,), generator=gen)


def build_case(
    name: str,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    window: int = 4096,
    sink_tokens: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Case:
    """The case ``name`` (one of :data:`CASES`) with its masks on ``device``.

    ``sliding_window``: the last ``window`` keys of each query (its own included; Mistral's
    ``sliding_window``) and the first ``sink_tokens`` keys. ``causal_document``:
    ``masks.example("causal_document", Sk, batch_size=batch)``'s last ``Sq`` rows. ``ragged``:
    :func:`ragged_mask` over :func:`ragged_lengths` drawn with ``seed``."""
    if name not in CASES:
        raise ValueError(f"name must be one of {', '.join(CASES)}, got {name!r}")
    if not 1 <= seqlen_q <= seqlen_k:
        raise ValueError(f"seqlen_q must be in [1, seqlen_k={seqlen_k}], got {seqlen_q}")
    lengths = None
    if name == "causal":
        mask = masks.causal(seqlen_k, seqlen_q=seqlen_q)
    elif name == "sliding_window":
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        mask = masks.sliding_window(
            seqlen_k, window - 1, sink_tokens=sink_tokens, seqlen_q=seqlen_q
        )
    elif name == "causal_document":
        gen = torch.Generator().manual_seed(seed)
        full = masks.example("causal_document", seqlen_k, batch_size=batch, generator=gen)
        mask = full.last_rows(seqlen_q)
    else:
        drawn = ragged_lengths(batch, seqlen_q, seqlen_k, seed)
        lengths = tuple(int(x) for x in drawn)
        mask = ragged_mask(drawn, seqlen_k, seqlen_q)
    if mask.batch_size != batch:  # flashmask_attention takes a mask per sequence
        sri = mask.startend_row_indices.expand(batch, -1, -1, -1).contiguous()
        mask = FlashMask(sri, mask.causal, mask.seqlen_q)
    mask = mask.to(device) if device is not None else mask
    if name == "causal":
        return Case(name, batch, seqlen_q, seqlen_k, mask, None, True)
    return Case(name, batch, seqlen_q, seqlen_k, mask, mask, mask.causal, lengths)


def training_mask(
    name: str, seqlen: int, *, window: int = 4096, sink_tokens: int = 4, seed: int = 0
) -> tuple[FlashMask | None, bool] | None:
    """``(mask, causal)`` of the square ``[seqlen, seqlen]`` training forward whose last rows a
    batch-1 chunk of case ``name`` attends with (``None`` mask: plain causal), or ``None`` for
    ``ragged`` (no square counterpart)."""
    if name == "causal":
        return None, True
    if name == "sliding_window":
        return masks.sliding_window(seqlen, window - 1, sink_tokens=sink_tokens), True
    if name == "causal_document":
        gen = torch.Generator().manual_seed(seed)
        return masks.example("causal_document", seqlen, batch_size=1, generator=gen), True
    return None


# ---------------------------------------------------------------------- accounting
def visible_rows_per_key(mask: FlashMask, seqlen_q: int) -> torch.Tensor:
    """How many of the ``Sq`` query rows see each key: int64 ``[B, Hm, Sk]``, in O(N).

    The masked rows of a column are the union of ``[lts, lte)``, ``[uts, ute)`` and the causal
    prefix ``[0, j - (Sk - Sq))``, counted by inclusion-exclusion."""
    iv = [x.to(torch.int64) for x in mask.intervals(seqlen_q)]
    sk = mask.seqlen_k
    cols = torch.arange(sk, dtype=torch.int64, device=iv[0].device)
    zero = torch.zeros_like(iv[0])
    causal_end = (cols - (sk - seqlen_q)).clamp(0, seqlen_q) + zero if mask.causal else zero
    spans = [(zero, causal_end), (iv[0], iv[1]), (iv[2], iv[3])]

    def length(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        start = torch.stack([p[0] for p in parts]).amax(0)
        end = torch.stack([p[1] for p in parts]).amin(0)
        return (end - start).clamp(min=0)

    a, lower, upper = spans
    union = (
        length([a]) + length([lower]) + length([upper])
        - length([a, lower]) - length([a, upper]) - length([lower, upper])
        + length([a, lower, upper])
    )  # fmt: skip
    return seqlen_q - union


def visible_kv_bytes(
    mask: FlashMask, seqlen_q: int, batch: int, kv_heads: int, head_dim: int
) -> int:
    """Bytes of K and V (bf16) of the keys that at least one query of a sequence sees, summed
    over the ``batch`` sequences and the ``kv_heads`` key/value heads: what a step must read
    from the cache at the least. A batch-1 mask serves every sequence; each of the mask's
    ``Hm`` heads serves ``kv_heads // Hm`` key/value heads."""
    keys = (visible_rows_per_key(mask.to("cpu"), seqlen_q) > 0).sum(-1)  # [Bm, Hm]
    per_mask_head = kv_heads // keys.shape[1]
    sequences = batch // keys.shape[0]
    return int(keys.sum()) * per_mask_head * sequences * head_dim * 2 * _ITEMSIZE


def visible_flop(mask: FlashMask, seqlen_q: int, batch: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs over the visible (query, key) pairs: ``4 * head_dim`` per pair and query
    head."""
    pairs = visible_rows_per_key(mask.to("cpu"), seqlen_q).sum(-1)  # [Bm, Hm]
    per_mask_head = heads // pairs.shape[1]
    return 4.0 * head_dim * int(pairs.sum()) * per_mask_head * (batch // pairs.shape[0])


# ---------------------------------------------------------------------- masks of the baselines
def dense_mask(case: Case, device: torch.device | str | None = None) -> torch.Tensor:
    """SDPA's boolean mask ``[B, 1, Sq, Sk]`` (True = may attend) of ``case``, broadcast over the
    heads by SDPA (a batch-1 mask is expanded over the batch as a view)."""
    mask = case.mask if device is None else case.mask.to(device)
    dense = mask.to_dense(case.seqlen_q)
    return dense.expand(case.batch, -1, -1, -1)


def flex_bounds(mask: FlashMask, batch: int) -> torch.Tensor:
    """The bounds :func:`flex_mask_mod` reads: int32 ``[batch, Hm, 5, Sk]``, contiguous.

    Rows 0-3 are the mask's ``(lts, lte, uts, ute)`` at its ``Sq`` (query row ``i`` of the call
    is row ``i`` of the mask); row 4 the causal limit: column ``j`` is hidden from rows below
    ``j - (Sk - Sq)`` (bottom-right alignment), 0 for a non-causal mask. Folding the causal flag
    into the bounds gives every case one ``mask_mod``, so flex compiles once per shape. Batch-1
    masks are repeated over the batch: flex's kernels call the ``mask_mod`` with the real batch
    index even when the ``BlockMask`` broadcasts."""
    sq, sk = mask.seqlen_q or mask.seqlen_k, mask.seqlen_k
    iv = mask.intervals(sq)
    cols = torch.arange(sk, dtype=torch.int32, device=mask.device)
    if mask.causal:
        limit = (cols - (sk - sq)).clamp(0, sq).expand_as(iv.lts)
    else:
        limit = torch.zeros_like(iv.lts)
    bounds = torch.stack([iv.lts, iv.lte, iv.uts, iv.ute, limit], dim=2).to(torch.int32)
    return bounds.expand(batch, -1, -1, -1).contiguous()


# FlexAttention compiles per mask_mod; one module-level mask_mod reading its bounds from module
# state keeps one compiled kernel per shape for every case.
_FLEX_STATE: dict = {}


def flex_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention's ``mask_mod`` over ``_FLEX_STATE["bounds"]`` (:func:`flex_bounds`) with
    ``_FLEX_STATE["group"]`` query heads per mask head: True where query ``q_idx`` sees key
    ``kv_idx``."""
    bounds = _FLEX_STATE["bounds"]
    hh = h // _FLEX_STATE["group"]
    lts = bounds[b, hh, 0, kv_idx]
    lte = bounds[b, hh, 1, kv_idx]
    uts = bounds[b, hh, 2, kv_idx]
    ute = bounds[b, hh, 3, kv_idx]
    limit = bounds[b, hh, 4, kv_idx]
    hidden = ((q_idx >= lts) & (q_idx < lte)) | ((q_idx >= uts) & (q_idx < ute)) | (q_idx < limit)
    return ~hidden


def set_flex_mask(case: Case, heads: int, device: torch.device | str | None = None) -> None:
    """Point :func:`flex_mask_mod` at ``case``'s mask (on ``device``) for ``heads`` query
    heads."""
    mask = case.mask if device is None else case.mask.to(device)
    _FLEX_STATE.update(bounds=flex_bounds(mask, case.batch), group=heads // mask.num_heads)


def build_block_mask(case: Case, heads: int, device: torch.device | str):
    """The ``BlockMask`` of ``case`` for ``heads`` query heads (built eagerly: no compile per
    shape; a decode step's mask is ``B x Sk`` elements). One mask head gives ``H = None``, which
    flex's decoding kernel needs under grouped-query attention."""
    from torch.nn.attention.flex_attention import create_block_mask

    set_flex_mask(case, heads, device)
    mask_heads = None if case.mask.num_heads == 1 else heads
    return create_block_mask(
        flex_mask_mod,
        case.mask.batch_size,
        mask_heads,
        case.seqlen_q,
        case.seqlen_k,
        device=device,
    )


# ---------------------------------------------------------------------- calls
def flashmask_call(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """FlashMask on ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``; returns ``[B, Sq, H, D]``."""
    mask, causal = case.flashmask_mask, case.causal

    def call() -> torch.Tensor:
        return flashmask_attention(q, k, v, mask, causal=causal)

    return call


def sdpa_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None
) -> Callable[[], torch.Tensor]:
    """SDPA on ``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` with ``enable_gqa`` and ``attn_mask``
    (``None``, a boolean mask or a ``CausalBias``); returns ``[B, H, Sq, D]``."""
    import torch.nn.functional as F

    gqa = q.shape[1] != k.shape[1]

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)

    return call


def sdpa_mask(case: Case, device: torch.device | str | None = None):
    """What the ``sdpa`` row passes as ``attn_mask``: nothing for causal at ``Sq = 1`` (one
    query at the end sees every key), ``causal_lower_right`` for a causal chunk, else
    :func:`dense_mask`."""
    if case.name == "causal":
        if case.seqlen_q == 1:
            return None
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(case.seqlen_q, case.seqlen_k)
    return dense_mask(case, device)


def flex_call(
    flex: Callable, block_mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """``flex`` (``flex_attention``, compiled or not) on ``q [B, H, Sq, D]``, ``k, v
    [B, Hkv, Sk, D]``; returns ``[B, H, Sq, D]``."""
    gqa = q.shape[1] != k.shape[1]

    def call() -> torch.Tensor:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    return call


def reference_attention(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_scores: int = 2**27
) -> torch.Tensor:
    """Float32 attention under ``case.mask``: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` ->
    float32 ``[B, Sq, H, D]`` (rows that see nothing: 0). One sequence and at most
    ``max_scores`` scores at a time, so a 128K cache fits."""
    batch, sq, heads, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dense = case.mask.to(q.device).to_dense(sq)  # [Bm, Hm, Sq, Sk], Hm in {1, Hkv}
    chunk = max(1, min(sq, max_scores // (heads * sk)))
    out = torch.empty(batch, sq, heads, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        kb = k[b].transpose(0, 1).float()  # [Hkv, Sk, D]
        vb = v[b].transpose(0, 1).float()
        visible_b = dense[min(b, dense.shape[0] - 1)]  # [Hm, Sq, Sk]
        for start in range(0, sq, chunk):
            stop = min(sq, start + chunk)
            rows = stop - start
            # [rows, H, D] -> [Hkv, group * rows, D]: query head h reads key/value head h // group.
            qb = q[b, start:stop].float().permute(1, 0, 2).reshape(kv_heads, group * rows, d)
            scores = (qb @ kb.transpose(1, 2)) * d**-0.5
            scores = scores.view(kv_heads, group, rows, sk)
            visible = visible_b[:, start:stop].unsqueeze(1)  # [Hm, 1, rows, Sk]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            ob = probs.view(kv_heads, group * rows, sk) @ vb  # [Hkv, group * rows, D]
            out[b, start:stop] = ob.view(heads, rows, d).transpose(0, 1)
    return out


# ---------------------------------------------------------------------- timing (GPU)
@dataclass
class Timing:
    gpu_ms: float  # median device time, L2 flushed, launch latency hidden
    wall_ms: float  # wall time per call, called back to back
    host_ms: float  # the host's enqueue time per call


def _flushed_gpu_times_ms(fn: Callable[[], object], calls: int, host_ms: float) -> list[float]:
    """Device time (ms) of each of ``calls`` calls of ``fn``, the L2 flushed before each (256 MB
    zeroed, as ``flashmask.bench._timed_calls_ms`` and ``do_bench`` do), then a GPU sleep of
    twice the host's enqueue time: a decoding call's host work (tens of us) can outlast the
    flush, and the events would then time the host's launch latency with the kernels."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    # At <= 2 GHz a cycle is >= 0.5 ns: 2e6 cycles per ms sleep at least as long as asked.
    cycles = int((2 * host_ms + 0.02) * 2e6)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(calls)
    ]
    for start, end in events:
        flush.zero_()
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_call(fn: Callable[[], object], rep_ms: int, min_repeats: int = 5) -> Timing:
    """:class:`Timing` of ``fn`` (called once first): about ``rep_ms`` of back-to-back calls for
    the wall time, then about ``rep_ms`` of flushed, individually timed calls (at least
    ``min_repeats``, at most 200) for the median device time."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate_ms = (time.perf_counter() - t0) * 1e3
    # Host enqueue time: nothing here synchronises with the device, so the loop never waits.
    n_host = 10 if estimate_ms < 1 else 2
    t0 = time.perf_counter()
    for _ in range(n_host):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / n_host
    torch.cuda.synchronize()
    n_wall = max(3, min(1000, int(rep_ms / max(estimate_ms, 1e-3))))
    t0 = time.perf_counter()
    for _ in range(n_wall):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / n_wall
    per_call = wall_ms + 2 * host_ms + 0.1  # + the flush and the sleep
    calls = max(min_repeats, min(200, int(rep_ms / per_call)))
    gpu_ms = statistics.median(_flushed_gpu_times_ms(fn, calls, host_ms))
    return Timing(gpu_ms, wall_ms, host_ms)


# ---------------------------------------------------------------------- rows
@dataclass
class DecodeRow:
    """One implementation on one case. Times in us (prep in ms); ``visible_kv_bytes`` and
    ``tb_s`` (visible bytes / GPU time) for every row, ``tflops`` (mask-aware) for ``Sq > 1``;
    ``max_err``: max |out - float32 reference|, ``tolerance`` the bound it must stay under;
    ``note``: ``WRONG``, ``OOM`` or an error."""

    case: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    impl: str
    heads: int
    kv_heads: int
    head_dim: int
    visible_kv_bytes: int
    gpu_us: float | None = None
    wall_us: float | None = None
    host_us: float | None = None
    tb_s: float | None = None
    tflops: float | None = None
    pct_of_train_fwd: float | None = None
    prep_ms: float | None = None
    max_err: float | None = None
    err_vs_flashmask: float | None = None
    tolerance: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- plan and arguments
@dataclass(frozen=True)
class Shape:
    """Inputs shared by several cases: ``batch`` x ``seqlen_q`` queries over ``seqlen_k`` keys;
    ``chunk``: a chunked-prefill shape (also timed against the training forward)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    cases: tuple[str, ...]
    chunk: bool = False


@dataclass(frozen=True)
class Config:
    batches: tuple[int, ...]
    cache_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    cases: tuple[str, ...]
    chunk_lens: tuple[int, ...]
    chunk_cache_lens: tuple[int, ...]
    chunk_cases: tuple[str, ...]
    impls: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    sink_tokens: int
    seed: int
    rep_ms: int
    min_repeats: int
    out: str


def plan_shapes(config: Config) -> list[Shape]:
    """Decode shapes (every cache length x batch x query length) then chunk shapes (batch 1,
    every chunk cache length x chunk length), each with its cases."""
    shapes = [
        Shape(b, sq, sk, config.cases)
        for sk in config.cache_lens
        for b in config.batches
        for sq in config.query_lens
    ]
    shapes += [
        Shape(1, sq, sk, config.chunk_cases, chunk=True)
        for sk in config.chunk_cache_lens
        for sq in config.chunk_lens
    ]
    return [s for s in shapes if s.cases]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmask bench --decode",
        description=__doc__.split("\n\n")[0],
        epilog="Default grid (H200 targets): bf16, 32 query / 8 key-value heads, head dim 128; "
        "decode at batch 1, 8, 32 over 8K, 32K, 128K caches; chunks of 2048 over 32K and 128K.",
    )
    add = parser.add_argument
    add(
        "--batches",
        help=f"comma-separated batch sizes of the decode steps ({_DEFAULTS['batches']})",
    )
    add("--cache-lens", help=f"comma-separated KV cache lengths Sk ({_DEFAULTS['cache_lens']})")
    add("--query-lens", default="1", help="comma-separated query lengths Sq of a step (1)")
    add("--cases", default=",".join(CASES), help=f"comma-separated cases ({','.join(CASES)})")
    add(
        "--chunk-lens",
        default="2048",
        help="comma-separated chunked-prefill lengths, batch 1; 'none' for no chunks (2048)",
    )
    add(
        "--chunk-cache-lens",
        help=f"comma-separated cache lengths of the chunks ({_DEFAULTS['chunk_cache_lens']})",
    )
    add(
        "--chunk-cases",
        default="causal,causal_document",
        help="comma-separated cases of the chunks (causal,causal_document)",
    )
    add("--impls", default=",".join(IMPLS), help=f"comma-separated ({','.join(IMPLS)})")
    add("--heads", type=int, default=32, help="query heads (32)")
    add("--kv-heads", type=int, default=8, help="key/value heads, dividing --heads (8)")
    add("--head-dim", type=int, default=128, help="head dimension (128)")
    add("--window", type=int, default=4096, help="sliding_window: keys per query, own included")
    add("--sink-tokens", type=int, default=4, help="sliding_window: attention sinks (4)")
    add("--seed", type=int, default=0, help="seed of the documents and ragged lengths (0)")
    add("--rep-ms", type=int, help=f"ms of calls per timing ({_DEFAULTS['rep_ms']})")
    add("--min-repeats", type=int, default=5, help="timed calls at the least (5)")
    add(
        "--quick",
        action="store_true",
        help="a short run: batches 1,8, caches 8K,32K, chunks over 32K, 20 ms per timing "
        "(options given explicitly still apply)",
    )
    add(
        "--out",
        default="benchmarks/results/decode",
        help="output path prefix of the .json and .md (benchmarks/results/decode)",
    )
    return parser


def _int_list(parser: argparse.ArgumentParser, option: str, text: str, allow_none: bool = False):
    if allow_none and text.strip().lower() in ("", "none"):
        return ()
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        parser.error(f"{option} must be comma-separated positive integers, got {text!r}")
    return values


def _names(parser: argparse.ArgumentParser, option: str, text: str, choices: tuple[str, ...]):
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    for name in names:
        if name not in choices:
            parser.error(f"{option}: unknown {name!r} (choose from {', '.join(choices)})")
    if not names:
        parser.error(f"{option} must name at least one of {', '.join(choices)}")
    return names


def parse_config(argv: list[str]) -> Config:
    """The run's :class:`Config` from the command line (without ``--decode``); bad values exit
    through ``parser.error`` (status 2) naming the option."""
    parser = _parser()
    args = parser.parse_args(argv)
    base = _QUICK if args.quick else _DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for option in ("heads", "kv_heads", "head_dim", "window", "rep_ms", "min_repeats"):
        if getattr(args, option) < 1:
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} must be at least 1, got {getattr(args, option)}")
    if args.sink_tokens < 0:
        parser.error(f"--sink-tokens must be at least 0, got {args.sink_tokens}")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
    cache_lens = _int_list(parser, "--cache-lens", args.cache_lens)
    query_lens = _int_list(parser, "--query-lens", args.query_lens)
    chunk_lens = _int_list(parser, "--chunk-lens", args.chunk_lens, allow_none=True)
    chunk_cache_lens = _int_list(parser, "--chunk-cache-lens", args.chunk_cache_lens)
    for option, lens, caches, cache_option in (
        ("--query-lens", query_lens, cache_lens, "--cache-lens"),
        ("--chunk-lens", chunk_lens, chunk_cache_lens, "--chunk-cache-lens"),
    ):
        if lens and max(lens) >= min(caches):
            parser.error(
                f"{option} must stay below every {cache_option} value (a cache holds more keys "
                f"than the queries), got {max(lens)} against {min(caches)}"
            )
    return Config(
        batches=_int_list(parser, "--batches", args.batches),
        cache_lens=cache_lens,
        query_lens=query_lens,
        cases=_names(parser, "--cases", args.cases, CASES),
        chunk_lens=chunk_lens,
        chunk_cache_lens=chunk_cache_lens,
        chunk_cases=_names(parser, "--chunk-cases", args.chunk_cases, CASES),
        impls=_names(parser, "--impls", args.impls, IMPLS),
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        window=args.window,
        sink_tokens=args.sink_tokens,
        seed=args.seed,
        rep_ms=args.rep_ms,
        min_repeats=args.min_repeats,
        out=args.out,
    )


# ---------------------------------------------------------------------- running (GPU)
def _kernels(fn: Callable[[], object]) -> list[str]:
    from flashmask.bench import _kernel_names

    try:
        return _kernel_names(fn)
    except Exception as exc:  # a profiler problem must not cost the timings
        return [f"unavailable: {type(exc).__name__}: {exc}"[:120]]


class _CaseRunner:
    """Times every implementation of one case on one shape's inputs."""

    def __init__(
        self,
        config: Config,
        case: Case,
        inputs: dict,
        flex: Callable | None,
        device: torch.device | str = "cuda",
    ):
        self.config, self.case, self.inputs, self.flex = config, case, inputs, flex
        self.device = torch.device(device)
        self.bytes = visible_kv_bytes(
            case.mask, case.seqlen_q, case.batch, config.kv_heads, config.head_dim
        )
        self.flop = (
            visible_flop(case.mask, case.seqlen_q, case.batch, config.heads, config.head_dim)
            if case.seqlen_q > 1
            else None
        )
        q, k, v = inputs["bshd"]
        self.reference = reference_attention(case, q, k, v)
        self.tolerance = ERROR_TOLERANCE * float(self.reference.abs().max())
        self.flashmask_out: torch.Tensor | None = None
        self.rows: list[DecodeRow] = []

    def row(self, impl: str) -> DecodeRow:
        c, cfg = self.case, self.config
        return DecodeRow(
            c.name, c.batch, c.seqlen_q, c.seqlen_k, impl, cfg.heads, cfg.kv_heads,
            cfg.head_dim, self.bytes, tolerance=self.tolerance,
        )  # fmt: skip

    def finish(
        self, row: DecodeRow, fn: Callable[[], torch.Tensor], bshd: bool, names: bool = True
    ) -> DecodeRow:
        """Check ``fn``'s output (``[B, Sq, H, D]`` if ``bshd`` else ``[B, H, Sq, D]``), time it
        and fill ``row``."""
        out = fn()
        out = out if bshd else out.transpose(1, 2)
        row.max_err = float((out.float() - self.reference).abs().max())
        if self.flashmask_out is not None and row.impl != "flashmask":
            row.err_vs_flashmask = float((out.float() - self.flashmask_out.float()).abs().max())
        if not row.max_err <= self.tolerance:  # NaN fails too
            row.note = "WRONG"
        del out
        timing = time_call(fn, self.config.rep_ms, self.config.min_repeats)
        row.gpu_us, row.wall_us, row.host_us = (
            1e3 * timing.gpu_ms, 1e3 * timing.wall_ms, 1e3 * timing.host_ms,
        )  # fmt: skip
        row.tb_s = row.visible_kv_bytes / (timing.gpu_ms * 1e-3) / 1e12
        if self.flop is not None:
            row.tflops = self.flop / (timing.gpu_ms * 1e-3) / 1e12
        if names:
            row.extra["kernels"] = _kernels(fn)
        return row

    def run(self) -> list[DecodeRow]:
        runners = {
            "flashmask": self.run_flashmask,
            "sdpa": self.run_sdpa,
            "sdpa-best": self.run_sdpa_best,
            "flex": self.run_flex,
        }
        for impl in IMPLS:
            if impl not in self.config.impls:
                continue
            if impl == "sdpa-best" and self.case.name != "causal":
                continue
            try:
                runners[impl]()
            except torch.OutOfMemoryError:
                # One implementation out of memory must not cost the others' rows.
                self.rows.append(self._failed(impl, "OOM"))
                torch.cuda.empty_cache()
            except Exception as exc:
                note = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:200]
                print(f"{self.case.name} {impl}: {note}", file=sys.stderr)
                self.rows.append(self._failed(impl, note))
                torch.cuda.empty_cache()
        return self.rows

    def _failed(self, impl: str, note: str) -> DecodeRow:
        row = self.row(impl)
        row.note = note
        return row

    def run_flashmask(self) -> None:
        from flashmask.bench import _cuda_time
        from flashmask.kernels import clear_prepared

        q, k, v = self.inputs["bshd"]
        fn = flashmask_call(self.case, q, k, v)
        self.flashmask_out = fn()
        row = self.finish(self.row("flashmask"), fn, bshd=True)

        # A step's first call prepares its mask (every later layer reuses it): the preparation
        # is that call's extra wall time over a call that finds it prepared.
        def cold() -> None:
            clear_prepared()
            fn()

        row.prep_ms = max(0.0, _cuda_time(cold, 11) - _cuda_time(fn, 11))
        fn()  # leave the mask prepared
        self.rows.append(row)

    def run_sdpa(self) -> None:
        from flashmask.bench import _cuda_time

        q, k, v = self.inputs["bhsd"]
        attn_mask = sdpa_mask(self.case, self.device)
        row = self.row("sdpa")
        if isinstance(attn_mask, torch.Tensor):
            row.prep_ms = _cuda_time(lambda: dense_mask(self.case, self.device))
        self.rows.append(self.finish(row, sdpa_call(q, k, v, attn_mask), bshd=False))

    def run_sdpa_best(self) -> None:
        """The fastest SDPA backend for causal attention: each of flash / efficient / cuDNN on
        its own (no mask at ``Sq = 1``; for a chunk the dense bottom-right mask, and
        ``causal_lower_right``, which picks its kernel itself)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = self.inputs["bhsd"]
        backends = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }
        candidates: dict[str, tuple[SDPBackend | None, object]] = {}
        if self.case.seqlen_q == 1:
            for label, backend in backends.items():
                candidates[label] = (backend, None)
        else:
            candidates["causal_lower_right"] = (None, sdpa_mask(self.case))
            dense = dense_mask(self.case, self.device)
            for label in ("efficient", "cudnn"):
                candidates[f"{label}+dense"] = (backends[label], dense)

        def context(backend: SDPBackend | None):
            return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()

        ran: list[DecodeRow] = []
        timings: dict[str, object] = {}
        calls = {}
        for label, (backend, attn_mask) in candidates.items():
            calls[label] = fn = sdpa_call(q, k, v, attn_mask)
            try:
                with context(backend):
                    row = self.finish(self.row("sdpa-best"), fn, bshd=False, names=False)
            except torch.OutOfMemoryError:
                timings[label] = "OOM"
                torch.cuda.empty_cache()
                continue
            except Exception as exc:  # no kernel of this backend for these inputs
                message = f"unavailable: {type(exc).__name__}: {exc}"
                timings[label] = message.splitlines()[0][:160]
                continue
            row.extra["backend"] = label
            timings[label] = row.gpu_us if not row.note else f"{row.gpu_us} ({row.note})"
            ran.append(row)
        if not ran:
            raise RuntimeError(f"no SDPA backend ran: {timings}")
        # The fastest right one; a wrong one only when none is right (so it shows as WRONG).
        best = min(ran, key=lambda r: (r.note == "WRONG", r.gpu_us))
        best.extra["candidates_us"] = timings
        label = best.extra["backend"]
        with context(candidates[label][0]):
            best.extra["kernels"] = _kernels(calls[label])
        self.rows.append(best)

    def run_flex(self) -> None:
        from flashmask.bench import _cuda_time

        q, k, v = self.inputs["bhsd"]
        heads = self.config.heads
        block_mask = build_block_mask(self.case, heads, self.device)
        prep_ms = _cuda_time(lambda: build_block_mask(self.case, heads, self.device))
        set_flex_mask(self.case, heads, self.device)
        row = self.finish(self.row("flex"), flex_call(self.flex, block_mask, q, k, v), bshd=False)
        row.prep_ms = prep_ms
        row.extra["block_mask"] = "create_block_mask, eager"
        self.rows.append(row)


def _training_row(
    config: Config, name: str, seqlen: int, device: torch.device | str = "cuda"
) -> DecodeRow | None:
    """FlashMask's training forward (``Sq = Sk = seqlen``, batch 1) over the square mask of
    case ``name``: the TFLOP/s a chunk of that case is compared with."""
    from flashmask.bench import visible_flop as square_flop

    found = training_mask(
        name, seqlen, window=config.window, sink_tokens=config.sink_tokens, seed=config.seed
    )
    if found is None:
        return None
    mask, causal = found
    mask = mask.to(device) if mask is not None else None
    d, h, hk = config.head_dim, config.heads, config.kv_heads
    row = DecodeRow(name, 1, seqlen, seqlen, "flashmask-train-fwd", h, hk, d, 0)
    try:
        q = torch.randn(1, seqlen, h, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, seqlen, hk, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ref_mask = mask if mask is not None else masks.causal(seqlen).to(device)
        row.visible_kv_bytes = visible_kv_bytes(ref_mask, seqlen, 1, hk, d)

        def fn() -> torch.Tensor:
            return flashmask_attention(q, k, v, mask, causal=causal)

        timing = time_call(fn, config.rep_ms, config.min_repeats)
        row.gpu_us, row.wall_us, row.host_us = (
            1e3 * timing.gpu_ms, 1e3 * timing.wall_ms, 1e3 * timing.host_ms,
        )  # fmt: skip
        row.tflops = square_flop(mask, causal, seqlen, d, h, 1) / (timing.gpu_ms * 1e-3) / 1e12
        row.extra["kernels"] = _kernels(fn)
    except torch.OutOfMemoryError:
        row.note = "OOM"
        torch.cuda.empty_cache()
    return row


def _inputs(config: Config, shape: Shape, device: torch.device | str = "cuda") -> dict:
    """Random bf16 inputs of ``shape``: FlashMask's ``[B, S, H, D]`` and the same values in
    SDPA's and flex's ``[B, H, S, D]`` (a KV cache's layout), each contiguous."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(config.seed)
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    h, hk, d = config.heads, config.kv_heads, config.head_dim
    q = torch.randn(b, sq, h, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, sk, hk, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, sk, hk, d, device=device, dtype=dtype, generator=gen)
    bshd = (q, k, v)
    bhsd = tuple(x.transpose(1, 2).contiguous() for x in bshd)
    return {"bshd": bshd, "bhsd": bhsd}


def run(config: Config, device: torch.device | str = "cuda") -> list[DecodeRow]:
    """Every shape of :func:`plan_shapes` and its cases on ``device``, in order; the JSON is
    rewritten after each case so an interrupted run keeps its rows."""
    from torch.nn.attention.flex_attention import flex_attention

    from flashmask.bench import _progress

    # One compiled flex kernel per shape; never fall back to eager flex.
    torch._dynamo.config.cache_size_limit = 64
    shapes = plan_shapes(config)
    bar = _progress(sum(len(s.cases) for s in shapes))
    rows: list[DecodeRow] = []
    for shape in shapes:
        # A fresh Dynamo per shape compiles flex static: after a second size it would compile
        # the next one dynamic (slower kernels).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False) if "flex" in config.impls else None
        try:
            inputs = _inputs(config, shape, device)
        except torch.OutOfMemoryError:
            for name in shape.cases:
                row = DecodeRow(
                    name, shape.batch, shape.seqlen_q, shape.seqlen_k, "inputs", config.heads,
                    config.kv_heads, config.head_dim, 0, note="OOM",
                )  # fmt: skip
                rows.append(row)
                bar.update(1)
            torch.cuda.empty_cache()
            continue
        chunk_rows: list[DecodeRow] = []
        for name in shape.cases:
            bar.set_description(f"{name} B={shape.batch} Sq={shape.seqlen_q} Sk={shape.seqlen_k}")
            case = build_case(
                name, shape.batch, shape.seqlen_q, shape.seqlen_k, window=config.window,
                sink_tokens=config.sink_tokens, seed=config.seed, device=device,
            )  # fmt: skip
            case_rows = _CaseRunner(config, case, inputs, flex, device).run()
            rows += case_rows
            chunk_rows += case_rows
            bar.update(1)
            _write_json(Path(config.out), rows, config)
        del inputs
        torch.cuda.empty_cache()
        if shape.chunk:
            for name in shape.cases:
                train = _training_row(config, name, shape.seqlen_k, device)
                if train is None:
                    continue
                rows.append(train)
                for row in chunk_rows:
                    if row.case == name and row.tflops and train.tflops:
                        row.pct_of_train_fwd = 100 * row.tflops / train.tflops
            torch.cuda.empty_cache()
        _write_json(Path(config.out), rows, config)
    bar.close()
    return rows


# ---------------------------------------------------------------------- reporting
def markdown(rows: list[DecodeRow]) -> str:
    """The result table, one line per row (``—`` where a column does not apply)."""
    lines = [
        "| case | B | Sq | Sk | impl | GPU us | wall us | visible KV MB | TB/s | TFLOP/s "
        "| % of train fwd | prep ms | max err | GPU time / flashmask's | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def key(r: DecodeRow) -> tuple:
        return (r.case, r.batch, r.seqlen_q, r.seqlen_k)

    flashmask = {key(r): r.gpu_us for r in rows if r.impl == "flashmask" and r.gpu_us}

    def f(x, fmt="{:.1f}"):
        return "—" if x is None else fmt.format(x)

    for r in rows:
        ref = flashmask.get(key(r))
        ratio = f"{r.gpu_us / ref:.2f}x" if ref and r.gpu_us and r.impl != "flashmask" else "—"
        impl = r.impl
        if r.extra.get("backend"):
            impl += f" ({r.extra['backend']})"
        lines.append(
            f"| {r.case} | {r.batch} | {r.seqlen_q} | {r.seqlen_k} | {impl} | {f(r.gpu_us)} "
            f"| {f(r.wall_us)} | {f(r.visible_kv_bytes / 2**20 if r.visible_kv_bytes else None)} "
            f"| {f(r.tb_s, '{:.2f}')} | {f(r.tflops, '{:.0f}')} "
            f"| {f(r.pct_of_train_fwd, '{:.0f}%')} | {f(r.prep_ms, '{:.3f}')} "
            f"| {f(r.max_err, '{:.1e}')} | {ratio} | {r.note} |"
        )
    return "\n".join(lines) + "\n"


_NOTE = """GPU us: median device time per call, the L2 flushed (256 MB zeroed) before each call and
the host's launch work hidden behind a GPU sleep. Wall us: wall time per call of calls made back
to back (the call rate: launch latency included, L2 warm). Visible KV: bytes of K and V (bf16,
all key/value heads) of the keys some query of a sequence sees; TB/s = visible KV / GPU time.
TFLOP/s (Sq > 1): 4 x head dim per visible (query, key) pair and query head; % of train fwd: a
chunk's TFLOP/s against flashmask's training forward over the square mask at Sk (batch 1, row
flashmask-train-fwd). Prep: flashmask's mask preparation (its first call's extra wall time, once
per mask for all layers of a step: not in GPU us), flex's BlockMask build, SDPA's dense mask
build. Max err: max |out - float32 reference|; WRONG when above 2% of the reference's largest
magnitude. GPU time / flashmask's above 1: flashmask is faster.
"""


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here, timeout=10
        ).returncode
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _write_json(
    out: Path, rows: list[DecodeRow], config: Config, elapsed_s: float | None = None
) -> dict:
    from flashmask.bench import _tile_configs
    from flashmask.kernels.config import device_decode_config

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "config": asdict(config),
        "decode_config": asdict(device_decode_config(config.head_dim, torch.device("cuda"))),
        "tile_configs": _tile_configs([config.head_dim]),
        "error_tolerance": ERROR_TOLERANCE,
        "elapsed_s": elapsed_s,
    }
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    return meta


def main(argv: list[str] | None = None) -> int:
    """``flashmask bench --decode [options]`` (``argv`` without ``--decode``). Returns 0, 1 when
    a result was wrong or flashmask failed, 2 without a CUDA GPU (or on a bad option)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_config(argv)
    if not torch.cuda.is_available():
        print(
            "flashmask bench --decode needs a CUDA GPU (torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    rows = run(config)
    elapsed_s = time.perf_counter() - start
    out = Path(config.out)
    meta = _write_json(out, rows, config, elapsed_s)
    table = markdown(rows)
    command = " ".join(["flashmask bench --decode", *argv])
    out.with_suffix(".md").write_text(
        f"# flashmask bench --decode ({meta['gpu']}, torch {meta['torch']}, triton "
        f"{meta['triton']}, {meta['date']}, commit {meta['git_commit']})\n\n`{command}`\n\n"
        f"{config.heads} query heads, {config.kv_heads} key/value heads, head dim "
        f"{config.head_dim}, bf16.\n\n{table}\n{_NOTE}"
    )
    print(table)
    print(f"{len(rows)} rows in {elapsed_s:.0f} s; results in {out}.json and .md", file=sys.stderr)
    wrong = [r for r in rows if r.note == "WRONG"]
    failed = [r for r in rows if r.impl.startswith("flashmask") and r.note and r.note != "WRONG"]
    for r in wrong:
        print(
            f"WRONG: {r.impl} on {r.case} B={r.batch} Sq={r.seqlen_q} Sk={r.seqlen_k}: max err "
            f"{r.max_err:.3e} > {r.tolerance:.3e}",
            file=sys.stderr,
        )
    for r in failed:
        print(
            f"FAILED: {r.impl} on {r.case} B={r.batch} Sk={r.seqlen_k}: {r.note}", file=sys.stderr
        )
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    sys.exit(main())
