"""Mask preparation for the kernels (``flashmask.kernels.tiles``), checked against dense masks.

The kernels trust the tile classes blindly: a tile wrongly classed ``SKIP`` silently drops
visible keys, a tile wrongly classed ``FULL`` silently attends to masked ones. So every class is
compared with a reduction of the dense mask over the tile (testing-anchors §6.B.6):

* ``SKIP`` only when no (row, column) pair of the tile is visible;
* ``FULL`` only when every in-bounds pair is visible, and never for a key tile that runs past
  ``Sk`` (its out-of-range columns need the element mask);

and the compacted work lists must list exactly the non-skipped tiles, ascending, with their class.
``tiles.py`` is the oracle of the Triton mask preparation (``kernels.prepare``, run through the
interpreter without CUDA), which must reproduce its bounds and lists exactly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (tests/conftest.py does too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
import zlib

import pytest
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from flashmask import kernels, masks
from flashmask.kernels import mask_prep, preparation, tiles
from flashmask.mask import ColumnIntervals, FlashMask, TileClass, dense_rows
from tests.strategies import FORM_IDS, FORMS, Form, flashmasks, random_cases

# Triton 3.6's interpreter (kernels.prepare on CPU) converts 1-element arrays the way numpy
# deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

SKIP, PARTIAL, FULL = TileClass.SKIP, TileClass.PARTIAL, TileClass.FULL

TILE_SIZES = [(16, 16), (64, 64), (128, 128), (128, 64), (64, 128), (16, 32)]
TILE_IDS = [f"{m}x{n}" for m, n in TILE_SIZES]
# (Sq, Sk): single elements, a single key, ragged tails on both axes, exact multiples.
SHAPES = [(1, 1), (17, 1), (100, 37), (37, 100), (129, 129), (200, 333), (64, 64)]


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _row_values(shape: tuple[int, ...], seqlen_q: int, gen: torch.Generator) -> torch.Tensor:
    """Bounds: mostly in ``[0, Sq]``, often exactly 0 or ``Sq``, sometimes out of range."""
    values = torch.randint(-2, seqlen_q + 3, shape, generator=gen)
    kind = torch.randint(0, 10, shape, generator=gen)
    values = torch.where(kind < 2, 0, values)
    return torch.where(kind == 2, seqlen_q, values)


def _empty_column(form: Form, seqlen_q: int) -> torch.Tensor:
    """Bounds hiding no row (the causal part aside)."""
    sq = seqlen_q
    return torch.tensor(
        {1: [sq], 2: [sq, sq] if form.causal else [sq, 0], 4: [sq, sq, 0, 0]}[form.bounds]
    )


def _full_column(form: Form, seqlen_q: int) -> torch.Tensor:
    """Bounds hiding every row."""
    return torch.tensor({1: [0], 2: [0, seqlen_q], 4: [0, seqlen_q, 0, 0]}[form.bounds])


def _random_indices(
    form: Form, batch: int, heads: int, seqlen_q: int, seqlen_k: int, gen: torch.Generator
) -> torch.Tensor:
    """Piecewise-constant random masks: columns come in runs sharing their bounds (runs of 1 to
    ``Sk`` columns, in half of the masks jittered by a row), so whole tiles end up skipped or
    unmasked as in real masks, and the edges between runs fall at every offset inside a tile."""
    slices = []
    for _ in range(batch * heads):
        run = [1, 5, 16, 64, seqlen_k][int(torch.randint(0, 5, (1,), generator=gen))]
        n_runs = -(-seqlen_k // run)
        values = _row_values((n_runs, form.bounds), seqlen_q, gen)
        if form.bounds >= 2 and float(torch.rand(1, generator=gen)) < 0.8:
            # Mostly ordered intervals (for non-causal C=2: UTE <= LTS); the rest may be empty or
            # reversed.
            pairs = values.view(n_runs, -1, 2).sort(-1, descending=form == Form(False, 2)).values
            values = pairs.reshape(n_runs, form.bounds)
        kind = torch.randint(0, 10, (n_runs, 1), generator=gen)
        values = torch.where(kind == 0, _empty_column(form, seqlen_q), values)
        values = torch.where(kind == 1, _full_column(form, seqlen_q), values)
        columns = values.repeat_interleave(run, dim=0)[:seqlen_k]
        jitter = torch.randint(-1, 2, columns.shape, generator=gen)
        rate = 0.2 * float(torch.randint(0, 2, (1,), generator=gen))  # half the masks: none
        jitter = jitter * (torch.rand(columns.shape, generator=gen) < rate)
        slices.append(columns + jitter)
    return torch.stack(slices).view(batch, heads, seqlen_k, form.bounds).to(torch.int32)


def _tile_reductions(
    visible: torch.Tensor, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile: any pair visible, and every in-bounds pair visible (``[B, Hm, Tm, Tn]``)."""
    b, h, sq, sk = visible.shape
    tm, tn = -(-sq // block_m), -(-sk // block_n)
    padded = torch.zeros(b, h, tm * block_m, tn * block_n, dtype=torch.bool)
    padded[..., :sq, :sk] = visible
    outside = torch.ones_like(padded)
    outside[..., :sq, :sk] = False
    per_tile = (b, h, tm, block_m, tn, block_n)
    any_visible = padded.view(per_tile).any(5).any(3)
    all_visible = (padded | outside).view(per_tile).all(5).all(3)
    return any_visible, all_visible


def _visible(sri: torch.Tensor | None, causal: bool, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Dense visibility ``[B, Hm, Sq, Sk]`` straight from the semantics in ``flashmask.mask``."""
    if sri is not None:
        return FlashMask(sri, causal).to_dense(seqlen_q)
    rows = torch.arange(seqlen_q).view(-1, 1)
    cols = torch.arange(seqlen_k).view(1, -1)
    visible = cols <= rows + (seqlen_k - seqlen_q) if causal else cols >= 0
    return visible.expand(seqlen_q, seqlen_k)[None, None]


def _classes(sri, causal, seqlen_q, seqlen_k, block_m, block_n, skip_tiles=True):
    batch = 1 if sri is None else sri.shape[0]
    bounds = tiles.column_bounds(sri, causal, seqlen_q, seqlen_k, batch, torch.device("cpu"))
    return tiles.tile_classes(bounds, causal, seqlen_q, block_m, block_n, skip_tiles)


def _assert_sound(
    classes: torch.Tensor, visible: torch.Tensor, block_m: int, block_n: int, context: str
) -> None:
    b, h, sq, sk = visible.shape
    assert classes.dtype == torch.int8, context
    assert classes.shape == (b, h, -(-sq // block_m), -(-sk // block_n)), context
    assert bool(((classes == SKIP) | (classes == PARTIAL) | (classes == FULL)).all()), context
    any_visible, all_visible = _tile_reductions(visible, block_m, block_n)
    bad_skip = (classes == SKIP) & any_visible
    assert not bad_skip.any(), (
        f"SKIP tile with a visible pair at [b, h, m, n] = {bad_skip.nonzero()[0].tolist()} "
        f"{context}"
    )
    bad_full = (classes == FULL) & ~all_visible
    assert not bad_full.any(), (
        f"FULL tile with a masked pair at [b, h, m, n] = {bad_full.nonzero()[0].tolist()} {context}"
    )
    if sk % block_n:
        assert not (classes[..., -1] == FULL).any(), (
            f"FULL key tile running past Sk={sk} (block_n={block_n}) {context}"
        )


@pytest.mark.parametrize(("block_m", "block_n"), TILE_SIZES, ids=TILE_IDS)
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_tile_classes_are_sound_for_random_masks(form, block_m, block_n):
    """SKIP only without a visible pair, FULL only with every in-bounds pair visible (and never
    on a ragged last key tile), over random masks with Sq != Sk and ragged tails."""
    seen = torch.zeros(3, dtype=torch.int64)
    for seqlen_q, seqlen_k in SHAPES:
        seed = _seed(form.name, block_m, block_n, seqlen_q, seqlen_k)
        gen = torch.Generator().manual_seed(seed)
        sri = _random_indices(form, random_cases(12), 2, seqlen_q, seqlen_k, gen)
        classes = _classes(sri, form.causal, seqlen_q, seqlen_k, block_m, block_n)
        visible = _visible(sri, form.causal, seqlen_q, seqlen_k)
        context = f"({form.name}, Sq={seqlen_q}, Sk={seqlen_k}, seed={seed})"
        _assert_sound(classes, visible, block_m, block_n, context)
        seen += torch.bincount(classes.flatten().long(), minlength=3)
    # The masks must exercise every class, or soundness above is vacuous for the missing one.
    assert bool((seen > 0).all()), f"class counts (skip, partial, full) = {seen.tolist()}"


@given(
    drawn=st.sampled_from(FORMS).flatmap(lambda form: flashmasks(form, max_seqlen=40)),
    block_m=st.sampled_from([1, 4, 8, 16]),
    block_n=st.sampled_from([1, 4, 8, 16]),
)
def test_tile_classes_are_sound_for_edge_values(drawn, block_m, block_n):
    """The hypothesis masks add int32 extremes, reversed intervals and full/empty columns."""
    mask, seqlen_q, seqlen_k = drawn.mask, drawn.seqlen_q, drawn.seqlen_k
    sri = mask.startend_row_indices
    classes = _classes(sri, mask.causal, seqlen_q, seqlen_k, block_m, block_n)
    visible = _visible(sri, mask.causal, seqlen_q, seqlen_k)
    _assert_sound(classes, visible, block_m, block_n, f"(causal={mask.causal}, Sq={seqlen_q})")


@pytest.mark.parametrize(("block_m", "block_n"), TILE_SIZES, ids=TILE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_classes_are_exact_without_an_interval_mask(causal, block_m, block_n):
    """With no interval mask the classes are exact, not merely conservative: the causal triangle
    is skipped tile by tile and everything below it is unmasked (except a ragged last key tile)."""
    for seqlen_q, seqlen_k in SHAPES:
        classes = _classes(None, causal, seqlen_q, seqlen_k, block_m, block_n)
        any_visible, all_visible = _tile_reductions(
            _visible(None, causal, seqlen_q, seqlen_k), block_m, block_n
        )
        if seqlen_k % block_n:
            all_visible[..., -1] = False
        expected = torch.where(all_visible, FULL, PARTIAL)
        expected = torch.where(any_visible, expected, SKIP).to(torch.int8)
        assert torch.equal(classes, expected), f"Sq={seqlen_q}, Sk={seqlen_k}"


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_dense_mode_skips_no_tile_and_keeps_full_tiles_in_place(form):
    """``skip_tiles=False`` (the bit-exactness baseline) skips nothing: skipped tiles become
    partial, full tiles stay full (the kernels then mask them too), so the visiting order of
    every tile that holds a visible pair is the same in both modes."""
    gen = torch.Generator().manual_seed(_seed("dense", form.name))
    sri = _random_indices(form, 2, 2, 100, 37, gen)
    sri[0, 0] = _empty_column(form, 100)  # full tiles
    sri[1, 1, :16] = _full_column(form, 100)  # skipped tiles
    skipping = _classes(sri, form.causal, 100, 37, 16, 16)
    dense = _classes(sri, form.causal, 100, 37, 16, 16, skip_tiles=False)
    assert dense.shape == (2, 2, 7, 3)
    assert bool((skipping == SKIP).any()) and bool((skipping == FULL).any())
    assert not bool((dense == SKIP).any())
    assert torch.equal(dense == FULL, skipping == FULL)


def test_column_bounds_without_a_mask_are_empty_intervals():
    """No mask: one mask head, every interval empty, so only the causal flag hides anything."""
    bounds = tiles.column_bounds(None, True, 7, 5, 3, torch.device("cpu"))
    assert bounds.dtype == torch.int32
    assert bounds.shape == (3, 1, 4, 5)
    visible = dense_rows(ColumnIntervals(*bounds.unbind(2)), False, 0, 7, 7)
    assert bool(visible.all())


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_column_bounds_are_the_clamped_intervals(form):
    """The kernels' ``[B, Hm, 4, Sk]`` bounds hold (LTS, LTE, UTS, UTE) of the mask, clamped."""
    gen = torch.Generator().manual_seed(_seed("bounds", form.name))
    sri = _random_indices(form, 2, 2, 37, 50, gen)
    bounds = tiles.column_bounds(sri, form.causal, 37, 50, 2, torch.device("cpu"))
    assert bounds.shape == (2, 2, 4, 50)
    assert bounds.is_contiguous()
    assert bool(((bounds >= 0) & (bounds <= 37)).all())
    visible = dense_rows(ColumnIntervals(*bounds.unbind(2)), form.causal, 0, 37, 37)
    assert torch.equal(visible, _visible(sri, form.causal, 37, 50))


def _decode(entries: torch.Tensor, count: int) -> list[tuple[int, int]]:
    """``(tile, class)`` pairs of one list row."""
    return [(e, PARTIAL) if e >= 0 else (-e - 1, FULL) for e in entries[:count].tolist()]


def test_compact_lists_partial_then_full_tiles_ascending_with_their_encoding():
    """Entries: ``i`` for a partial tile, ``-i - 1`` for a full one, skipped tiles left out; the
    partial tiles first, then the full ones, each group ascending. ``counts`` is the number of
    kept tiles (0 for an all-skipped row), ``num_partial`` the number of partial ones."""
    gen = torch.Generator().manual_seed(_seed("compact"))
    classes = torch.randint(0, 3, (2, 3, 5, 9), generator=gen, dtype=torch.int8)
    classes[0, 0, 0] = SKIP  # an empty list
    classes[0, 0, 1] = FULL  # every tile kept
    classes[0, 0, 2] = PARTIAL
    lists = tiles.compact(classes)
    for t in lists:
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert lists.entries.shape == (2, 3, 5, 9) and lists.counts.shape == (2, 3, 5)
    assert lists.num_partial.shape == (2, 3, 5)
    for b, h, m in itertools.product(range(2), range(3), range(5)):
        row = classes[b, h, m].tolist()
        partial = [(i, c) for i, c in enumerate(row) if c == PARTIAL]
        full = [(i, c) for i, c in enumerate(row) if c == FULL]
        count = int(lists.counts[b, h, m])
        assert count == len(partial) + len(full), (b, h, m)
        assert int(lists.num_partial[b, h, m]) == len(partial), (b, h, m)
        assert _decode(lists.entries[b, h, m], count) == partial + full, (b, h, m)
    assert int(lists.counts[0, 0, 0]) == 0
    assert lists.entries[0, 0, 1].tolist() == [-i - 1 for i in range(9)]
    assert lists.entries[0, 0, 2].tolist() == list(range(9))


def test_program_order_runs_the_longest_lists_first_each_length_class_in_grid_order():
    """A column of global tokens (8 query tiles against 2-3 for the rest) runs first for both
    grid heads; the others keep the grid's order (tile fastest, then head): lengths 2 and 3
    share a class (bit length 2), 1 is the next, and an empty list runs last."""
    counts = torch.tensor([[[8, 2, 3, 1, 0]]], dtype=torch.int32)  # [B, Hm, T]
    order = tiles.program_order(counts, grid_heads=2, reverse_tiles=False)
    assert order.dtype == torch.int32
    assert order.tolist() == [0, 5, 1, 2, 6, 7, 3, 8, 4, 9]


def test_program_order_reads_each_grid_heads_mask_head_and_the_reversed_tiles():
    """Grid head ``h`` reads mask head ``h // (grid_heads // Hm)``; with ``reverse_tiles`` grid
    index ``p`` runs tile ``T - 1 - p`` (the forward's heaviest-last-rows-first grid)."""
    counts = torch.tensor([[[1, 4], [4, 1]]], dtype=torch.int32)  # mask heads 0 and 1
    # Four grid heads: 0 and 1 read mask head 0, 2 and 3 mask head 1.
    order = tiles.program_order(counts, grid_heads=4, reverse_tiles=False)
    assert order.tolist() == [1, 3, 4, 6, 0, 2, 5, 7]
    reversed_order = tiles.program_order(counts, grid_heads=4, reverse_tiles=True)
    assert reversed_order.tolist() == [0, 2, 5, 7, 1, 3, 4, 6]


@pytest.mark.parametrize("seed", range(3))
def test_program_order_is_a_permutation_of_the_grid_heaviest_class_first(seed):
    """Every program runs exactly once; along the order the bit length of a program's list
    length never rises, and programs of one class keep the grid's order (random lengths, two
    batches, two mask heads over four grid heads, reversed tiles)."""
    gen = torch.Generator().manual_seed(_seed(f"order-{seed}"))
    batch, mask_heads, heads, num_tiles = 2, 2, 4, 7
    counts = torch.randint(0, 40, (batch, mask_heads, num_tiles), generator=gen)
    order = tiles.program_order(counts.to(torch.int32), heads, reverse_tiles=True).tolist()
    assert sorted(order) == list(range(batch * heads * num_tiles))

    def length_class(i):
        b, h, p = i // (num_tiles * heads), (i // num_tiles) % heads, i % num_tiles
        return int(counts[b, h // (heads // mask_heads), num_tiles - 1 - p]).bit_length()

    keys = [(-length_class(i), i) for i in order]
    assert keys == sorted(keys)


@pytest.mark.parametrize(
    ("batch", "mask_heads", "grid_heads", "num_tiles", "chunks"),
    [(2, 1, 4, 7, (16, 4)), (1, 2, 2, 33, (8, 8)), (3, 2, 6, 5, (2048, 128)), (2, 2, 8, 9, (4, 2))],
)
@pytest.mark.parametrize("reverse_tiles", [True, False])
def test_the_order_kernel_sorts_as_the_oracle(
    batch, mask_heads, grid_heads, num_tiles, chunks, reverse_tiles, monkeypatch
):
    """``mask_prep.program_order_kernel`` (what the launchers use) gives
    :func:`tiles.program_order`'s order, counting and placing in one step or many, with grid
    heads reading one mask head or several each, an empty list and lengths from 0 to past a
    power of two (and around 2**20)."""
    monkeypatch.setattr(preparation, "ORDER_COUNT_CHUNK", chunks[0])
    monkeypatch.setattr(preparation, "ORDER_PLACE_CHUNK", chunks[1])
    gen = torch.Generator().manual_seed(_seed(f"order-kernel-{batch}-{num_tiles}-{chunks}"))
    counts = torch.randint(0, 70, (batch, mask_heads, num_tiles), generator=gen)
    counts[0, 0, 0] = 0
    counts[0, 0, 1] = 2**20 - 1  # lengths far past the usual: bit lengths 20 and 21
    counts[-1, -1, -1] = 2**20
    counts = counts.to(torch.int32)
    want = tiles.program_order(counts, grid_heads, reverse_tiles)
    lists = tiles.TileLists(counts, counts.to(DEVICE), counts)  # only the counts are read
    (got,) = preparation._launch_program_orders([(lists, grid_heads, reverse_tiles)])
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    # Two orders in one launch (a forward's and its backward's): each as alone.
    other = tiles.TileLists(counts, counts[..., :3].contiguous().to(DEVICE), counts)
    first, second = preparation._launch_program_orders(
        [(lists, grid_heads, reverse_tiles), (other, 2 * grid_heads, not reverse_tiles)]
    )
    assert torch.equal(first.cpu(), want)
    want_second = tiles.program_order(counts[..., :3], 2 * grid_heads, not reverse_tiles)
    assert torch.equal(second.cpu(), want_second)


@triton.jit
def _bit_lengths_kernel(N, Out, size, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(N + offs, mask=offs < size, other=0)
    tl.store(Out + offs, mask_prep._bit_length(n), mask=offs < size)


def test_the_order_kernels_length_classes_are_bit_lengths():
    """``mask_prep._bit_length`` (the order kernel's class of a list length) is Python's
    ``int.bit_length`` from 0 to 2**24: 0, 1, 2 for 2-3, 3 for 4-7, ..."""
    values = sorted({*range(0, 300), *(2**e + d for e in range(8, 25) for d in (-1, 0, 1))})
    n = torch.tensor(values, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(n)
    _bit_lengths_kernel[(triton.cdiv(len(values), 128),)](n, out, len(values), BLOCK=128)
    assert out.cpu().tolist() == [v.bit_length() for v in values]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_forward_and_backward_lists_describe_the_same_tiles(form):
    """Tile (m, n) is in query tile m's forward list iff m is in key tile n's backward list, with
    the same class, and the lists hold exactly the non-skipped tiles of the classification."""
    gen = torch.Generator().manual_seed(_seed("lists", form.name))
    sri = _random_indices(form, 2, 2, 100, 70, gen)
    sri[0, 0] = _empty_column(form, 100)  # one slice without interval mask: FULL tiles
    sri[1, 1, 20:50] = _full_column(form, 100)  # and one with hidden columns: SKIP tiles
    classes = _classes(sri, form.causal, 100, 70, 16, 16)
    fwd, bwd = tiles.forward_lists(classes), tiles.backward_lists(classes)
    tm, tn = classes.shape[-2:]
    assert fwd.entries.shape == (2, 2, tm, tn) and bwd.entries.shape == (2, 2, tn, tm)
    for b, h in itertools.product(range(2), range(2)):
        expected = {
            (m, n, c)
            for m, n in itertools.product(range(tm), range(tn))
            if (c := int(classes[b, h, m, n])) != SKIP
        }
        from_fwd = {
            (m, n, c)
            for m in range(tm)
            for n, c in _decode(fwd.entries[b, h, m], int(fwd.counts[b, h, m]))
        }
        from_bwd = {
            (m, n, c)
            for n in range(tn)
            for m, c in _decode(bwd.entries[b, h, n], int(bwd.counts[b, h, n]))
        }
        assert from_fwd == expected, (b, h)
        assert from_bwd == expected, (b, h)
    kinds = set(classes.flatten().tolist())
    assert kinds == {SKIP, PARTIAL, FULL}, f"the mask should produce every class, got {kinds}"


# ------------------------------------------------------------------ Triton mask preparation
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (Sq, Sk, block_m, block_n): ragged tails, Sq != Sk, tiles larger than the sequence.
PREPARE_SHAPES = [(37, 100, 16, 16), (100, 37, 64, 32), (129, 129, 128, 64), (50, 65, 32, 128)]


def _assert_lists_equal(actual: tiles.TileLists, expected: tiles.TileLists, what: str) -> None:
    assert torch.equal(actual.counts.cpu(), expected.counts), f"counts of {what}"
    assert torch.equal(actual.num_partial.cpu(), expected.num_partial), f"num_partial of {what}"
    inner = expected.entries.shape[-1]
    used = torch.arange(inner).view(1, 1, 1, -1) < expected.counts.unsqueeze(-1)
    # Entries past a row's count are scratch: compare only the listed ones.
    assert torch.equal(actual.entries.cpu()[used], expected.entries[used]), f"entries of {what}"


@pytest.mark.parametrize("skip_tiles", [True, False], ids=["skip", "dense"])
@pytest.mark.parametrize(
    "form", [*FORMS, None, "causal"], ids=[*FORM_IDS, "nomask", "nomask-causal"]
)
def test_triton_prepare_equals_the_torch_oracle(form, skip_tiles):
    """``kernels.prepare`` (the launchers' mask preparation) gives the bounds of
    ``column_bounds`` and, row- and column-major, exactly the lists of ``tile_classes`` +
    ``compact``: the kernels' correctness rests on the oracle tested above."""
    for i, (sq, sk, bm, bn) in enumerate(PREPARE_SHAPES):
        if isinstance(form, Form):
            gen = torch.Generator().manual_seed(_seed("prepare", form.name, i))
            sri, causal, batch = _random_indices(form, 2, 2, sq, sk, gen), form.causal, 2
        else:
            sri, causal, batch = None, form == "causal", 2
        shapes = [(bm, bn, True), (bm, bn, False)]
        bounds, (rows, cols) = kernels.prepare(
            None if sri is None else sri.to(DEVICE),
            causal,
            sq,
            sk,
            batch,
            DEVICE,
            shapes,
            skip_tiles,
        )
        expected = tiles.column_bounds(sri, causal, sq, sk, batch, torch.device("cpu"))
        if sri is None:
            assert bounds is None, "no bounds are built (or read) without a mask"
        else:
            assert torch.equal(bounds.cpu(), expected), f"bounds, shape {i}"
        classes = tiles.tile_classes(expected, causal, sq, bm, bn, skip_tiles)
        _assert_lists_equal(rows, tiles.forward_lists(classes), f"row-major lists, shape {i}")
        _assert_lists_equal(cols, tiles.backward_lists(classes), f"column-major lists, shape {i}")


def test_triton_prepare_handles_more_tiles_than_one_chunk():
    """More than 256 tiles along a list (the list kernel walks them in chunks), with int32
    extremes among the indices."""
    form = Form(False, 4)
    sq, sk = 16 * 300 + 5, 40
    gen = torch.Generator().manual_seed(_seed("chunks"))
    sri = _random_indices(form, 1, 1, sq, sk, gen)
    sri[0, 0, :3] = torch.iinfo(torch.int32).min
    sri[0, 0, 3:6] = torch.iinfo(torch.int32).max
    shapes = [(16, 16, True), (16, 16, False)]
    bounds, (rows, cols) = kernels.prepare(sri.to(DEVICE), False, sq, sk, 1, DEVICE, shapes)
    expected = tiles.column_bounds(sri, False, sq, sk, 1, torch.device("cpu"))
    assert torch.equal(bounds.cpu(), expected)
    classes = tiles.tile_classes(expected, False, sq, 16, 16)
    _assert_lists_equal(rows, tiles.forward_lists(classes), "row-major lists")
    _assert_lists_equal(cols, tiles.backward_lists(classes), "column-major lists")
    assert int(cols.counts.max()) > 256


def _count_launches(monkeypatch) -> dict[str, int]:
    from flashmask.kernels import mask_prep

    counts = {"summarize_kernel": 0, "tile_list_kernel": 0}
    for name in counts:
        fn = getattr(mask_prep, name)
        real = fn.run

        def run(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fn, "run", run)
    return counts


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
def test_triton_prepare_costs_at_most_two_launches_per_call(masked, monkeypatch):
    """The preparation is launch-bound on a GPU, so its launch count is part of its contract:
    one summary (none without a mask) and one list kernel per two distinct lists; a repeated
    shape is built once and returned twice, equal to the oracle."""
    form = Form(True, 2)
    sq, sk, bm, bn = 50, 41, 16, 16
    gen = torch.Generator().manual_seed(_seed("launches"))
    sri = _random_indices(form, 2, 1, sq, sk, gen) if masked else None
    counts = _count_launches(monkeypatch)
    shapes = [(bm, bn, False), (bm, bn, True), (bm, bn, False)]
    bounds, (cols, rows, cols_again) = kernels.prepare(
        None if sri is None else sri.to(DEVICE), True, sq, sk, 2, DEVICE, shapes
    )
    assert counts == {"summarize_kernel": int(masked), "tile_list_kernel": 1}
    assert cols_again is cols
    assert (bounds is None) == (not masked)
    expected = tiles.column_bounds(sri, True, sq, sk, 2, torch.device("cpu"))
    classes = tiles.tile_classes(expected, True, sq, bm, bn)
    _assert_lists_equal(rows, tiles.forward_lists(classes), "row-major lists")
    _assert_lists_equal(cols, tiles.backward_lists(classes), "column-major lists")


# Runs in a process of its own (Triton's interpreter off): the mask-preparation kernels compiled
# for sm_90 as the launchers call them. The interpreter runs Python where the compiler needs
# constexprs (an annotated constexpr local compiled under the interpreter only), so a kernel the
# CPU tests pass can still fail to compile for the GPU.
_COMPILE_MASK_PREP = """
import itertools, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashmask.kernels.mask_prep import program_order_kernel, summarize_kernel, tile_list_kernel
target = GPUTarget("cuda", 90, 32)
def compile(kernel, runtime, constexprs):
    names = kernel.arg_names
    signature = {**runtime, **dict.fromkeys(constexprs, "constexpr")}
    indexed = {(names.index(k),): v for k, v in constexprs.items()}
    triton.compile(ASTSource(kernel, signature, constexprs=indexed), target=target)
    print(json.dumps({"kernel": kernel.fn.__name__, **constexprs}))
ints = lambda names: dict.fromkeys(names.split(), "i32")
summary_args = {**dict.fromkeys(["Indices", "Bounds", "Summary", "SubSummary"], "*i32"),
    **ints("stride_ib stride_ih stride_is stride_ic num_mask_heads seqlen_q seqlen_k "
           "num_n_tiles num_sub_tiles")}
for causal, c, (bn, sub) in itertools.product((True, False), (1, 2, 4), ((64, 0), (128, 64))):
    if causal and c == 4:
        continue
    compile(summarize_kernel, summary_args, dict(CAUSAL=causal, BOUNDS_PER_COLUMN=c,
        HAS_MASK=True, WRITE_BOUNDS=True, BLOCK_N=bn, SUB_N=sub))
list_args = {}
for slot in "AB":
    list_args |= {f"{n}{slot}": "*i32" for n in ("Summary", "Entries", "Counts", "NumPartial")}
    list_args |= {f"num_m_tiles_{slot.lower()}": "i32", f"num_n_tiles_{slot.lower()}": "i32"}
list_args |= ints("num_outer_a seqlen_q seqlen_k")
for has_mask in (True, False):
    compile(tile_list_kernel, list_args, dict(CAUSAL=True, HAS_MASK=has_mask, SKIP_TILES=True,
        ROW_MAJOR_A=True, BLOCK_M_A=64, BLOCK_N_A=64, CHUNK_A=128, HAS_B=True,
        ROW_MAJOR_B=False, BLOCK_M_B=128, BLOCK_N_B=128, CHUNK_B=64))
order_args = {}
for slot in "AB":
    order_args |= {f"Counts{slot}": "*i32", f"Order{slot}": "*i32"}
    order_args |= ints(" ".join(f"{n}_{slot.lower()}" for n in
        ("num_tiles", "grid_heads", "heads_per_mask_head")))
order_args |= ints("batch num_mask_heads")
for has_b in (True, False):
    compile(program_order_kernel, order_args, dict(REVERSE_TILES_A=True, HAS_B=has_b,
        REVERSE_TILES_B=False, COUNT_CHUNK=2048, PLACE_CHUNK=128))
"""


def test_the_mask_preparation_kernels_compile_for_sm90():
    """The kernels compile for Hopper in the forms the launchers use: summaries of one width
    and of two (``SUB_N``) for every bounds form, a two-list launch of the forward's and the
    Gluon backward's tile shapes, with and without a mask, and the launch order's sort with
    and without reversed tiles."""
    from tests.kernels.sm90_compile import json_lines

    compiled = json_lines(["-c", _COMPILE_MASK_PREP])
    summaries = [r for r in compiled if r["kernel"] == "summarize_kernel"]
    assert {r["SUB_N"] for r in summaries} == {0, 64} and len(summaries) == 10
    assert sum(r["kernel"] == "tile_list_kernel" for r in compiled) == 2
    assert sum(r["kernel"] == "program_order_kernel" for r in compiled) == 2


def test_edge_intervals_are_the_forms_whose_bounds_reach_the_first_and_last_rows():
    """``edge_intervals``: one column when causal (LTS), two when not (LTS, UTE). Exactly
    then the normalised bounds hold LTE = Sq and UTS = 0, which the two-compare mask takes
    for granted; a causal mask of two columns has its own LTE, a four-column one both."""
    gen = torch.Generator().manual_seed(0)
    for name in masks.MASK_TYPES:
        if name in ("full", "causal"):
            continue
        mask = masks.example(name, 300, batch_size=2, generator=gen)
        sri, causal = mask.startend_row_indices, mask.causal
        bounds = tiles.column_bounds(sri, causal, 300, 300, 2, "cpu")
        edges = bool((bounds[:, :, 1] == 300).all() and (bounds[:, :, 2] == 0).all())
        expected = sri.shape[-1] == (1 if causal else 2)
        assert tiles.edge_intervals(sri, causal) is expected, name
        if expected:
            assert edges, name
    assert not tiles.edge_intervals(None, True)
