"""Compiling and launching the CuTe backward (``backward.HopperBackward``): one compiled kernel
per :class:`~.backward.BackwardVariant` and dtype, built from symbolic tensors (it compiles
without a GPU and serves every shape), called with the torch tensors' DLPack views."""

from __future__ import annotations

import functools

import torch

# launch sets CUTE_DSL_ARCH before anything imports cutlass.
from flashmask._tensor_cache import TensorKeyedCache
from flashmask.kernels.cute_kernels import launch
from flashmask.kernels.tiles import TileLists

# Head dims the kernel is written for: its shared memory (224 KB at D = 128) leaves no room
# for D = 256. At D = 64 the same tiles take 128 KB.
HEAD_DIMS = (64, 128)


@functools.cache
def compiled_backward(variant, torch_dtype: torch.dtype):
    """The compiled :class:`~.backward.HopperBackward` of ``variant`` for ``torch_dtype`` (for
    sm_90a, with or without a GPU)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from flashmask.kernels.cute_kernels.backward import HopperBackward

    dtype = launch._dtype(torch_dtype)
    symbolic = launch._symbolic
    tensors = (
        *(symbolic(dtype, 4, 8) for _ in range(4)),  # q, k, v, dout
        symbolic(cutlass.Float32, 3, 1),  # lse
        symbolic(cutlass.Float32, 3, 1),  # delta
        symbolic(cutlass.Float32, 4, 4),  # dq accumulator
        symbolic(dtype, 4, 8),  # dk
        symbolic(dtype, 4, 8),  # dv
        symbolic(cutlass.Int32, 4, 4),  # bounds, column-major: 16-byte columns
        symbolic(cutlass.Int32, 4, 1),  # entries
        symbolic(cutlass.Int32, 3, 1),  # counts
        symbolic(cutlass.Int32, 1, 1),  # order
        symbolic(cutlass.Int32, 3, 1),  # turns (deterministic)
        symbolic(cutlass.Int32, 4, 1),  # tickets (deterministic)
    )
    return cute.compile(
        HopperBackward(variant),
        *tensors,
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cuda.CUstream(0),
    )


def _listed_tiles(lists: TileLists) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tiles, listed)``: each entry's query tile (its class's encoding undone; 0 past
    ``counts``) and whether it is within ``counts``."""
    entries, counts = lists.entries, lists.counts
    tiles = torch.where(entries >= 0, entries, -entries - 1).long()
    listed = torch.arange(entries.shape[-1], device=entries.device) < counts.unsqueeze(-1)
    return torch.where(listed, tiles, 0), listed


def deterministic_lists(lists: TileLists) -> TileLists:
    """``lists`` with each key tile's query tiles in ascending order, partial and unmasked ones
    mixed (the kernel reads each entry's class from its sign), as the deterministic backward
    walks them: a query tile's key tiles then reach it in the order of their adds
    (:func:`dq_tickets`) under causal-like masks, nearly without waiting."""
    tiles, listed = _listed_tiles(lists)
    key = torch.where(listed, tiles, lists.entries.shape[-1])  # what is not listed, last
    order = key.argsort(dim=-1, stable=True)
    return TileLists(lists.entries.gather(-1, order), lists.counts, lists.num_partial)


def dq_tickets(lists: TileLists) -> torch.Tensor:
    """int32 ``[B, Hm, Tn, Tm]`` beside the column-major ``lists`` (key tile ``n``'s query tiles,
    ``entries [B, Hm, Tn, Tm]``): for entry ``j`` of key tile ``n``, how many higher key tiles
    list the same query tile. A deterministic backward adds key tile ``n``'s dQ of that query
    tile once that many adds are done there, so each query tile's dQ sums its key tiles in
    descending order, whatever the timing. Entries past ``counts`` get 0 (never read)."""
    tiles, listed = _listed_tiles(lists)
    visits = torch.zeros(lists.entries.shape, dtype=torch.int32, device=tiles.device)
    visits.scatter_add_(3, tiles, listed.int())
    # Key tiles above n, per query tile: a cumulative sum from the last key tile down.
    later = visits.flip(2).cumsum(2, dtype=torch.int32).flip(2) - visits
    return torch.where(listed, later.gather(3, tiles), 0).to(torch.int32)


def descending_key_tiles(batch: int, kv_heads: int, key_tiles: int, device) -> torch.Tensor:
    """The deterministic backward's launch order over its grid ``(key_tiles, kv_heads,
    batch)``: each head's key tiles from the last down, so that every program an add waits for
    (a higher key tile of its head, :func:`dq_tickets`) was launched before it."""
    items = torch.arange(batch * kv_heads * key_tiles, dtype=torch.int32, device=device)
    return items.view(batch, kv_heads, key_tiles).flip(-1).reshape(-1).contiguous()


# Entries of the lists' [B * Hm, Tn, Tm] rows each step of :func:`deterministic_plan` takes at
# most: its int64 temporaries stay near 8 bytes times this (the lists of one mask head at 128K
# tokens have 2M entries).
PLAN_CHUNK_ENTRIES = 1 << 22
# Deterministic plans kept, keyed by the prepared lists they come from (which the preparation
# cache keeps alive while their mask is): one per mask in use, as the lists themselves.
_PLANS: TensorKeyedCache[tuple[TileLists, torch.Tensor]] = TensorKeyedCache(16)


def deterministic_plan(lists: TileLists) -> tuple[TileLists, torch.Tensor]:
    """``(deterministic_lists(lists), dq_tickets of them)``, computed in steps of whole mask
    heads of at most :data:`PLAN_CHUNK_ENTRIES` entries (bounded temporaries at long lengths)
    and kept while ``lists`` lives: every layer's backward of one mask reuses them."""

    def compute() -> tuple[TileLists, torch.Tensor]:
        entries, counts = lists.entries, lists.counts
        rows = entries.shape[0] * entries.shape[1]
        per_row = entries.shape[2] * entries.shape[3]
        step = max(1, PLAN_CHUNK_ENTRIES // per_row)
        flat = TileLists(
            entries.reshape(1, rows, *entries.shape[2:]),
            counts.reshape(1, rows, -1),
            lists.num_partial.reshape(1, rows, -1),
        )
        walked, tickets = [], []
        for start in range(0, rows, step):
            part = TileLists(*(t[:, start : start + step] for t in flat))
            part = deterministic_lists(part)
            walked.append(part.entries)
            tickets.append(dq_tickets(part))
        sorted_lists = TileLists(
            torch.cat(walked, 1).view(entries.shape), counts, lists.num_partial
        )
        return sorted_lists, torch.cat(tickets, 1).view(entries.shape)

    return _PLANS.get(lists.entries, "deterministic", compute)


def one_launch(q: torch.Tensor, k: torch.Tensor, masked: bool, causal: bool) -> bool:
    """Always: :func:`backward` runs all of ``q``'s rows in one launch (as the Gluon modules'
    ``one_launch`` answers for theirs), so one dQ accumulator spans them."""
    return True


def backward(
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
    skip_tiles: bool = True,
    order: torch.Tensor | None = None,
    dq_accumulator: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``(q, k, v)`` of the CuTe backward.

    ``dout``, ``q``: ``[B, Sq, Hq, D]``; ``k``, ``v``: ``[B, Sk, Hk, D]``; contiguous, 16-byte
    aligned, one fp16/bf16 dtype, ``D`` in :data:`HEAD_DIMS`. ``lse`` (the forward's) and
    ``delta`` (``backward_launcher.backward_delta``): float32 ``[B, Hq, Sq]``. ``bounds``
    (``[B, Hm, 4, Sk]``, ``None`` without a mask) and ``lists`` (column-major at 64 x 128 tiles)
    from ``preparation.prepare_cached``; ``order`` (``preparation.program_order`` over the grid
    ``(key tiles, Hk, B)``, ``None``: the grid's order). ``dq_accumulator``: a zeroed float32
    tensor like ``q`` that dQ is added into (``None``: zeroed here). ``deterministic``: each
    query tile's dQ summed over its key tiles in descending order (:func:`dq_tickets`), so dq
    repeats bit for bit; the lists are then walked in ascending order
    (:func:`deterministic_lists`) and the programs launched in
    :func:`descending_key_tiles`' order (``order`` is not read).
    Any lengths: TMA reads past a sequence as zeros and clips the stores."""
    import cuda.bindings.driver as cuda

    from flashmask.kernels.cute_kernels.backward import BLOCK_N, BackwardVariant
    from flashmask.kernels.cute_kernels.forward import LOG2E

    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"q: the CuTe backward takes head dims {HEAD_DIMS}, got {d}")
    has_mask = bounds is not None
    variant = BackwardVariant(
        head_dim=d,
        causal=causal,
        has_mask=has_mask,
        has_upper=has_mask and not causal,
        mask_full_tiles=not skip_tiles,
        ordered=order is not None or deterministic,
        deterministic=deterministic,
    )
    kernel = compiled_backward(variant, q.dtype)
    if dq_accumulator is None:
        dq_accumulator = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    turns, tickets = lists.counts, lists.entries  # never read unless deterministic
    if deterministic:
        # A program waits only for higher key tiles of its head, launched before it: no wait
        # is on a program not yet running.
        lists, tickets = deterministic_plan(lists)
        order = descending_key_tiles(k.shape[0], k.shape[2], lists.entries.shape[-2], q.device)
        turns = torch.zeros(q.shape[0], q.shape[2], lists.entries.shape[-1], dtype=torch.int32,
                            device=q.device)  # fmt: skip
    if order is None:
        order = lists.counts.view(-1)  # never read
    if bounds is None:
        bounds = launch._unread_bounds(q.device)
    else:
        bounds = launch.column_major_bounds(bounds, q.shape[1], lists.entries.shape[-2] * BLOCK_N)
    view = launch._view
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel(
        view(q, 16), view(k, 16), view(v, 16), view(dout, 16), view(lse, 4), view(delta, 4),
        view(dq_accumulator, 16), view(dk, 16), view(dv, 16), view(bounds, 16),
        view(lists.entries, 4), view(lists.counts, 4), view(order, 4), view(turns, 4),
        view(tickets, 4), k.shape[1],
        q.shape[2] // k.shape[2], q.shape[2] // num_mask_heads, softmax_scale * LOG2E,
        softmax_scale, stream,
    )  # fmt: skip
    return dq_accumulator.to(q.dtype), dk, dv
