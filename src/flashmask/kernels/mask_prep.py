"""Triton mask preparation: normalised bounds, per-key-tile min/max summary, tile lists, and
the kernels' launch orders.

Three small kernels replace the dozens of torch ops of :mod:`.tiles` (which stays as their
oracle) so that preparing a mask costs O(N) + O(tiles) work in two launches per call (one
without a mask):

* ``summarize_kernel`` (one program per (batch, mask head, key tile)): reads the raw
  ``[B, Hm, Sk, C]`` indices, writes the normalised ``[B, Hm, 4, Sk]`` bounds (optional) and the
  8 min/max values of each bound over the tile's valid columns, ``[B, Hm, 8, Tn]``; optionally
  also those of a second, narrower key-tile width that divides the first (``SUB_N``: the
  forward's 64-key and the Gluon backward's 128-key summaries in one launch).
* ``tile_list_kernel`` (one program per (batch, mask head, outer tile) of each of up to two
  lists): classifies the tiles of one row (``ROW_MAJOR``: a query tile's key tiles) or one column
  (a key tile's query tiles) of the tile grid and compacts the survivors into a list (partial
  tiles, then full ones), as :func:`.tiles.compact` does. Without a mask it needs no summary:
  only the causal triangle and the ragged last key tile classify tiles.
* ``program_order_kernel`` (one program per grid row, batch and head, of each of up to two
  launch orders): the attention kernels' programs sorted longest list first, as
  :func:`.tiles.program_order` does (with a mask only).
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(2**30)


@triton.jit
def _store_summary(s, stride, lts, lte, uts, ute, valid, AXIS: tl.constexpr, store_mask):
    """The 8 min/max values of the bounds over ``valid`` columns, reduced along ``AXIS``, at
    ``s, s + stride, ... s + 7 * stride`` (where ``store_mask`` is set; ``None``: everywhere)."""
    tl.store(s, tl.max(tl.where(valid, lts, -BIG), AXIS), mask=store_mask)
    tl.store(s + stride, tl.min(tl.where(valid, lts, BIG), AXIS), mask=store_mask)
    tl.store(s + 2 * stride, tl.max(tl.where(valid, lte, -BIG), AXIS), mask=store_mask)
    tl.store(s + 3 * stride, tl.min(tl.where(valid, lte, BIG), AXIS), mask=store_mask)
    tl.store(s + 4 * stride, tl.max(tl.where(valid, uts, -BIG), AXIS), mask=store_mask)
    tl.store(s + 5 * stride, tl.min(tl.where(valid, uts, BIG), AXIS), mask=store_mask)
    tl.store(s + 6 * stride, tl.max(tl.where(valid, ute, -BIG), AXIS), mask=store_mask)
    tl.store(s + 7 * stride, tl.min(tl.where(valid, ute, BIG), AXIS), mask=store_mask)


@triton.jit
def summarize_kernel(
    Indices, Bounds, Summary, SubSummary,
    stride_ib, stride_ih, stride_is, stride_ic,
    num_mask_heads, seqlen_q, seqlen_k, num_n_tiles, num_sub_tiles,
    CAUSAL: tl.constexpr,
    BOUNDS_PER_COLUMN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WRITE_BOUNDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
):  # fmt: skip
    """Summaries of the ``BLOCK_N``-key tiles into ``Summary``; with ``SUB_N`` (0: none; else
    a divisor of ``BLOCK_N``) also of the ``SUB_N``-key tiles into ``SubSummary``
    (``[B, Hm, 8, num_sub_tiles]``), each program its ``BLOCK_N // SUB_N`` of them."""
    n_tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = b * num_mask_heads + h
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = cols < seqlen_k
    full = tl.full([BLOCK_N], 0, tl.int32) + seqlen_q
    zero = tl.zeros([BLOCK_N], dtype=tl.int32)
    lts = full
    lte = full
    uts = zero
    ute = zero
    if HAS_MASK:
        base = Indices + b.to(tl.int64) * stride_ib + h * stride_ih + cols * stride_is
        lts = tl.minimum(tl.maximum(tl.load(base, mask=valid, other=0), 0), seqlen_q)
        if BOUNDS_PER_COLUMN >= 2:
            second = tl.minimum(
                tl.maximum(tl.load(base + stride_ic, mask=valid, other=0), 0), seqlen_q
            )
            if CAUSAL:
                lte = second  # causal C=2: (LTS, LTE)
            elif BOUNDS_PER_COLUMN == 2:
                ute = second  # non-causal C=2: (LTS, UTE)
            else:
                lte = second  # non-causal C=4: (LTS, LTE, UTS, UTE)
                uts = tl.minimum(
                    tl.maximum(tl.load(base + 2 * stride_ic, mask=valid, other=0), 0), seqlen_q
                )
                ute = tl.minimum(
                    tl.maximum(tl.load(base + 3 * stride_ic, mask=valid, other=0), 0), seqlen_q
                )
    if WRITE_BOUNDS:
        out = Bounds + bh.to(tl.int64) * 4 * seqlen_k + cols
        tl.store(out, lts, mask=valid)
        tl.store(out + seqlen_k, lte, mask=valid)
        tl.store(out + 2 * seqlen_k, uts, mask=valid)
        tl.store(out + 3 * seqlen_k, ute, mask=valid)
    s = Summary + bh.to(tl.int64) * 8 * num_n_tiles + n_tile
    _store_summary(s, num_n_tiles, lts, lte, uts, ute, valid, 0, None)
    if SUB_N > 0:
        # Row r of the [BLOCK_N // SUB_N, SUB_N] views is sub-tile n_tile * (BLOCK_N // SUB_N) + r;
        # sub-tiles past the last key (a ragged last tile) are not stored.
        sub = n_tile * (BLOCK_N // SUB_N) + tl.arange(0, BLOCK_N // SUB_N)
        _store_summary(
            SubSummary + bh.to(tl.int64) * 8 * num_sub_tiles + sub, num_sub_tiles,
            tl.reshape(lts, (BLOCK_N // SUB_N, SUB_N)), tl.reshape(lte, (BLOCK_N // SUB_N, SUB_N)),
            tl.reshape(uts, (BLOCK_N // SUB_N, SUB_N)), tl.reshape(ute, (BLOCK_N // SUB_N, SUB_N)),
            tl.reshape(valid, (BLOCK_N // SUB_N, SUB_N)), 1, sub < num_sub_tiles,
        )  # fmt: skip


@triton.jit
def _classify(
    summary, m, n, num_n_tiles, seqlen_q, seqlen_k,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SKIP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``(skip, partial)`` flags of tiles ``(m, n)`` (vectors); a tile is full when neither.

    Without ``HAS_MASK`` no interval hides anything (no summary is read); without
    ``SKIP_TILES`` (the dense mode) no tile is skipped: fully masked ones count as partial."""
    m_s = m * BLOCK_M
    m_e = tl.minimum(m_s + BLOCK_M, seqlen_q)
    n_s = n * BLOCK_N
    n_e = tl.minimum(n_s + BLOCK_N, seqlen_k)
    if HAS_MASK:
        n_load = tl.minimum(n, num_n_tiles - 1)
        lts_max = tl.load(summary + n_load)
        lts_min = tl.load(summary + num_n_tiles + n_load)
        lte_max = tl.load(summary + 2 * num_n_tiles + n_load)
        lte_min = tl.load(summary + 3 * num_n_tiles + n_load)
        uts_max = tl.load(summary + 4 * num_n_tiles + n_load)
        uts_min = tl.load(summary + 5 * num_n_tiles + n_load)
        ute_max = tl.load(summary + 6 * num_n_tiles + n_load)
        ute_min = tl.load(summary + 7 * num_n_tiles + n_load)
        skip = ((m_s >= lts_max) & (m_e <= lte_min)) | ((m_s >= uts_max) & (m_e <= ute_min))
        partial = ((m_s < lte_max) & (m_e > lts_min)) | ((m_s < ute_max) & (m_e > uts_min))
    else:
        skip = (m_s + n_s) < 0  # all False, of the tile vector's shape
        partial = skip
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        skip = skip | (n_s > m_e - 1 + offset)
        partial = partial | (n_e - 1 > m_s + offset)
    # A key tile that runs past Sk always needs the element mask. (``tl.where``, not ``|``: in a
    # column-major list this flag is a scalar, which Triton 3.9's interpreter keeps as int32 and
    # would turn the whole mask into int32.)
    partial = tl.where(n_e - n_s < BLOCK_N, True, partial)
    if SKIP_TILES:
        partial = partial & ~skip
    else:
        partial = partial | skip
        skip = skip & False
    return skip, partial


@triton.jit
def _build_list(
    Summary, Entries, Counts, NumPartial, bh, outer, seqlen_q, seqlen_k, num_m_tiles, num_n_tiles,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ROW_MAJOR: tl.constexpr,
    SKIP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Classify and compact the row (``ROW_MAJOR``: query tile ``outer``'s key tiles) or column
    (key tile ``outer``'s query tiles) of (batch x mask head) ``bh``'s tile grid into the
    list outputs ``Entries`` / ``Counts`` / ``NumPartial``."""
    num_outer = num_m_tiles if ROW_MAJOR else num_n_tiles
    num_inner = num_n_tiles if ROW_MAJOR else num_m_tiles
    summary = Summary + bh * 8 * num_n_tiles
    counts = Counts + bh * num_outer
    num_partial = NumPartial + bh * num_outer
    row = Entries + (bh * num_outer + outer) * num_inner
    count = 0
    # Two passes over the row: partial tiles first, then full ones (as :func:`.tiles.compact`).
    # The second pass classifies the row again rather than storing the first pass's flags: it is
    # O(tiles) scalar work, and the full tiles' positions depend on the partial count.
    for full_pass in tl.static_range(2):
        for start in range(0, num_inner, CHUNK):
            inner = start + tl.arange(0, CHUNK)
            in_range = inner < num_inner
            if ROW_MAJOR:
                m = outer
                n = inner
            else:
                m = inner
                n = outer
            skip, partial = _classify(
                summary, m, n, num_n_tiles, seqlen_q, seqlen_k,
                CAUSAL, HAS_MASK, SKIP_TILES, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if full_pass == 0:
                keep = partial & in_range
                encoded = inner
            else:
                keep = ~(skip | partial) & in_range
                encoded = -inner - 1
            position = count + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(row + position, encoded, mask=keep)
            count += tl.sum(keep.to(tl.int32), 0)
        if full_pass == 0:
            tl.store(num_partial + outer, count)
    tl.store(counts + outer, count)


@triton.jit
def tile_list_kernel(
    SummaryA, EntriesA, CountsA, NumPartialA, num_m_tiles_a, num_n_tiles_a,
    SummaryB, EntriesB, CountsB, NumPartialB, num_m_tiles_b, num_n_tiles_b,
    num_outer_a, seqlen_q, seqlen_k,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SKIP_TILES: tl.constexpr,
    ROW_MAJOR_A: tl.constexpr,
    BLOCK_M_A: tl.constexpr,
    BLOCK_N_A: tl.constexpr,
    CHUNK_A: tl.constexpr,
    HAS_B: tl.constexpr,
    ROW_MAJOR_B: tl.constexpr,
    BLOCK_M_B: tl.constexpr,
    BLOCK_N_B: tl.constexpr,
    CHUNK_B: tl.constexpr,
):  # fmt: skip
    """One or two tile lists (A and, with ``HAS_B``, B) in one launch; grid ``(outer tiles of A +
    outer tiles of B, mask heads, batch)``. Each list has its own tile shape and orientation;
    ``Summary*`` is the summary at that list's key-tile width (unused without ``HAS_MASK``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    if pid < num_outer_a:
        _build_list(
            SummaryA, EntriesA, CountsA, NumPartialA, bh, pid,
            seqlen_q, seqlen_k, num_m_tiles_a, num_n_tiles_a,
            CAUSAL, HAS_MASK, ROW_MAJOR_A, SKIP_TILES, BLOCK_M_A, BLOCK_N_A, CHUNK_A,
        )  # fmt: skip
    elif HAS_B:
        _build_list(
            SummaryB, EntriesB, CountsB, NumPartialB, bh, pid - num_outer_a,
            seqlen_q, seqlen_k, num_m_tiles_b, num_n_tiles_b,
            CAUSAL, HAS_MASK, ROW_MAJOR_B, SKIP_TILES, BLOCK_M_B, BLOCK_N_B, CHUNK_B,
        )  # fmt: skip


@triton.jit
def _bit_length(n):
    """The bit length of each int32 ``n >= 0`` (0 for 0, 1 for 1, 2 for 2-3, 3 for 4-7, ...):
    the exponent of ``n`` as a float32 (``tiles.program_order`` takes ``frexp``'s, the same)."""
    biased_exponent = (n.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(n > 0, biased_exponent - 126, 0)


@triton.jit
def _place_row(
    Counts, Order, row, batch, num_tiles, grid_heads, heads_per_mask_head, num_mask_heads,
    REVERSE_TILES: tl.constexpr,
    COUNT_CHUNK: tl.constexpr,
    PLACE_CHUNK: tl.constexpr,
):  # fmt: skip
    """One program of :func:`program_order_kernel`'s sort: the ``num_tiles`` items of grid row
    ``row = b * grid_heads + h`` placed in ``Order``.

    An item's slot is the number of items of heavier classes, plus those of its class in the
    grid rows before ``row``, plus those of its class before it in its row. The first two come
    from the mask rows' lists (``Counts`` ``[B, Hm, T]``, contiguous), each standing for the
    ``heads_per_mask_head`` consecutive grid rows that read it: the mask rows before ``row``'s
    count for all of theirs, ``row``'s own for the grid rows of it before ``row``. Counting
    ``B * Hm * T`` lengths instead of the grid's ``B * grid_heads * T`` keeps the pass short
    (one step of ``COUNT_CHUNK`` while that is at most its size)."""
    classes = tl.arange(0, 32)
    b = row // grid_heads
    h = row % grid_heads
    mask_row = b * num_mask_heads + h // heads_per_mask_head
    own_rows_before = h % heads_per_mask_head
    every = tl.zeros([32], dtype=tl.int32)  # per class, over all mask rows
    rows_before = tl.zeros([32], dtype=tl.int32)  # over the mask rows before mask_row
    own = tl.zeros([32], dtype=tl.int32)  # over mask_row
    num_mask_items = batch * num_mask_heads * num_tiles
    for start in range(0, num_mask_items, COUNT_CHUNK):
        items = start + tl.arange(0, COUNT_CHUNK)
        valid = items < num_mask_items
        length = _bit_length(tl.load(Counts + items, mask=valid, other=0))
        item_row = items // num_tiles
        every += tl.histogram(length, 32, mask=valid)
        rows_before += tl.histogram(length, 32, mask=valid & (item_row < mask_row))
        own += tl.histogram(length, 32, mask=valid & (item_row == mask_row))
    # Slots taken by the classes above each class (longer lists run first), then by the
    # class's items in the grid rows before this one.
    heavier = tl.sum(tl.where(classes[None, :] > classes[:, None], every[None, :], 0), 1)
    taken = (heavier + rows_before) * heads_per_mask_head + own * own_rows_before
    for start in range(0, num_tiles, PLACE_CHUNK):
        p = start + tl.arange(0, PLACE_CHUNK)
        valid = p < num_tiles
        tile = num_tiles - 1 - p if REVERSE_TILES else p
        length = _bit_length(tl.load(Counts + mask_row * num_tiles + tile, mask=valid, other=0))
        onehot = ((length[:, None] == classes[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1
        first = tl.sum(onehot * taken[None, :], 1)
        tl.store(Order + first + rank, row * num_tiles + p, mask=valid)
        taken += tl.sum(onehot, 0)


@triton.jit
def program_order_kernel(
    CountsA, OrderA, num_tiles_a, grid_heads_a, heads_per_mask_head_a,
    CountsB, OrderB, num_tiles_b, grid_heads_b, heads_per_mask_head_b,
    batch, num_mask_heads,
    REVERSE_TILES_A: tl.constexpr,
    HAS_B: tl.constexpr,
    REVERSE_TILES_B: tl.constexpr,
    COUNT_CHUNK: tl.constexpr,
    PLACE_CHUNK: tl.constexpr,
):  # fmt: skip
    """``tiles.program_order`` of one or two lists (A and, with ``HAS_B``, B: the forward's and
    the Gluon backward's) in one launch: a stable counting sort of each list's grid items
    ``(b * grid_heads + h) * T + p`` by descending bit length of their list length (``Counts*``
    int32 ``[B, Hm, T]``), the item numbers stored to ``Order*``. Grid ``(B * grid_heads_a +
    B * grid_heads_b,)``: one program per grid row (:func:`_place_row`)."""
    pid = tl.program_id(0)
    rows_a = batch * grid_heads_a
    if pid < rows_a:
        _place_row(
            CountsA, OrderA, pid, batch, num_tiles_a, grid_heads_a, heads_per_mask_head_a,
            num_mask_heads, REVERSE_TILES_A, COUNT_CHUNK, PLACE_CHUNK,
        )  # fmt: skip
    elif HAS_B:
        _place_row(
            CountsB, OrderB, pid - rows_a, batch, num_tiles_b, grid_heads_b,
            heads_per_mask_head_b, num_mask_heads, REVERSE_TILES_B, COUNT_CHUNK, PLACE_CHUNK,
        )  # fmt: skip
