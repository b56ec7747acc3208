"""The backward of full attention over chunks of query rows, so that a head's working set stays
in L2.

A key-stationary backward program (``gluon_kernels.backward``) walks every query tile of its
head: it reads that tile's Q and dO and adds to its dQ. The programs of a grid drift apart, so
at any moment the running programs of a head touch all of its query rows: ``Sq * D * 8`` bytes
(Q and dO in 16 bits, dQ in fp32). On the H200 (50 MB of L2) full attention at head dim 128 kept
a 98% L2 hit rate at 32K (32 MB) and fell to 74% at 128K (128 MB), running 16% slower per FLOP;
causal attention at 128K kept 98.9%.

Attention's gradients split exactly over query rows: a chunk's dQ depends only on its own rows,
and dK, dV are sums over rows. So the launcher runs the kernel once per chunk of rows, each with
the keys in full, every chunk after the first adding its dK/dV into the first one's fp32 sums.
Only full attention (no mask, not causal) is split here: a mask's bounds and the causal diagonal
are in absolute rows.

Measured on the H200 against one launch (``docs/performance.md``): at hd128 and 128K four 32K
chunks ran 1.05x, at 64K two chunks 2.3% slower, at hd256 2% slower at 32K and 128K. Hence the
split from a working set of :data:`QUERY_SPLIT_FROM_BYTES` (128 MiB: 128K rows at hd128), and
only at head dims 64 and 128. Its cost is memory: the fp32 dK/dV sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The per-head working set the chunks are sized to (well under the H200's 50 MB of L2, which
# also holds K, V and the other running heads' traffic); 0 turns the split off.
QUERY_CHUNK_BYTES = 32 << 20
# The working set from which full attention is split (below it, one launch measured faster).
QUERY_SPLIT_FROM_BYTES = 128 << 20
# Chunk lengths are multiples of this many rows (the Gluon backward's length granularity).
ROW_GRANULE = 128


def working_set_bytes(seqlen_q: int, head_dim: int, heads_per_kv: int) -> int:
    """Q and dO (16-bit) and dQ (fp32) of the ``heads_per_kv`` query heads a program walks."""
    return seqlen_q * head_dim * 8 * heads_per_kv


def query_chunk_rows(
    seqlen_q: int,
    head_dim: int,
    heads_per_kv: int,
    chunk_bytes: int | None = None,
    split_from_bytes: int | None = None,
) -> int:
    """Rows per chunk for full attention over ``seqlen_q`` rows, or 0 for one launch: when the
    working set (:func:`working_set_bytes`) is below ``split_from_bytes`` or ``chunk_bytes`` is
    0. A chunk's working set fits ``chunk_bytes``; its rows are a multiple of
    :data:`ROW_GRANULE`, at least one. Defaults: :data:`QUERY_CHUNK_BYTES` and
    :data:`QUERY_SPLIT_FROM_BYTES`, read at the call."""
    if chunk_bytes is None:
        chunk_bytes = QUERY_CHUNK_BYTES
    if split_from_bytes is None:
        split_from_bytes = QUERY_SPLIT_FROM_BYTES
    if chunk_bytes <= 0 or working_set_bytes(seqlen_q, head_dim, heads_per_kv) < split_from_bytes:
        return 0
    rows = chunk_bytes // working_set_bytes(1, head_dim, heads_per_kv)
    rows = max(ROW_GRANULE, rows // ROW_GRANULE * ROW_GRANULE)
    return rows if rows < seqlen_q else 0


ChunkBackward = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


def backward_by_query_chunks(
    run_chunk: ChunkBackward,
    q: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    rows: int,
    kv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of full attention from ``run_chunk`` applied to consecutive chunks of
    ``rows`` query rows (the last one shorter).

    ``q``, ``dout``: ``[B, Sq, H, D]``; ``lse``, ``delta``: float32 ``[B, H, Sq]``.
    ``run_chunk(q_c, dout_c, lse_c, delta_c, dk, dv)`` gets contiguous slices of them and the
    float32 dK/dV sums so far (``None`` for the first chunk); it returns the chunk's ``dq_c``
    (like ``q_c``) and the sums with the chunk's added: new float32 tensors like K and V for the
    first chunk, the ones it was given (added to in place) for every later one. Returns ``dq``
    like ``q`` and the sums in ``kv_dtype``.
    """
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    seqlen_q = q.shape[1]
    dq = torch.empty_like(q)
    dk = dv = None
    for start in range(0, seqlen_q, rows):
        stop = min(seqlen_q, start + rows)
        dq_c, dk, dv = run_chunk(
            q[:, start:stop].contiguous(),
            dout[:, start:stop].contiguous(),
            lse[:, :, start:stop].contiguous(),
            delta[:, :, start:stop].contiguous(),
            dk,
            dv,
        )
        dq[:, start:stop] = dq_c
    return dq, dk.to(kv_dtype), dv.to(kv_dtype)


def full_attention_lists(
    batch: int, key_tiles: int, query_tiles: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(entries, counts, num_partial)`` of the column-major tile lists of full attention
    without a mask at lengths divisible by the tiles (``kernels.tiles.backward_lists``' form):
    every key tile visits every query tile, all full (encoded ``-m - 1``), ascending."""
    order = -torch.arange(query_tiles, dtype=torch.int32, device=device) - 1
    entries = order.expand(batch, 1, key_tiles, query_tiles).contiguous()
    counts = torch.full((batch, 1, key_tiles), query_tiles, dtype=torch.int32, device=device)
    return entries, counts, torch.zeros_like(counts)
