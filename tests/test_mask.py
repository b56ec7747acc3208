"""The FlashMask representation: meaning, dense round trips, block summaries, tiles, checks.

The loop-based oracles below are written from semantics §1.3 / §3.1 directly, independently of
``flashmask.mask``.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmask import FlashMask, MaskNotRepresentableError, TileClass, masks, to_dense, validate
from tests.strategies import FORM_IDS, FORMS, flashmasks, random_cases


# ---------------------------------------------------------------------------- loop oracles
def formal_visibility(indices: torch.Tensor, causal: bool, seqlen_q: int) -> torch.Tensor:
    """Semantics §1.3 evaluated element by element on the raw (unclamped) values."""
    batch, heads, seqlen_k, bounds = indices.shape
    values = indices.tolist()
    out = [
        [[[True] * seqlen_k for _ in range(seqlen_q)] for _ in range(heads)] for _ in range(batch)
    ]
    for b in range(batch):
        for h in range(heads):
            for j in range(seqlen_k):
                r = values[b][h][j]
                for i in range(seqlen_q):
                    if causal:
                        masked = i >= r[0] if bounds == 1 else r[0] <= i < r[1]
                        masked = masked or i < j - (seqlen_k - seqlen_q)
                    elif bounds == 2:
                        masked = i >= r[0] or i < r[1]
                    else:
                        masked = r[0] <= i < r[1] or r[2] <= i < r[3]
                    out[b][h][i][j] = not masked
    return torch.tensor(out, dtype=torch.bool)


def normalized_column(r: list[int], causal: bool, seqlen_q: int) -> tuple[int, int, int, int]:
    """(LTS, LTE, UTS, UTE) of one column, clamped to [0, Sq], absent bounds filled (§1.3)."""

    def clamp(x: int) -> int:
        return min(max(x, 0), seqlen_q)

    if causal:
        return clamp(r[0]), clamp(r[1]) if len(r) == 2 else seqlen_q, 0, 0
    if len(r) == 2:
        return clamp(r[0]), seqlen_q, 0, clamp(r[1])
    return clamp(r[0]), clamp(r[1]), clamp(r[2]), clamp(r[3])


def loop_block_summary(mask: FlashMask, block_n: int, seqlen_q: int) -> list[torch.Tensor]:
    """The 8 vectors in BlockSummary order (lts max/min, lte max/min, uts ..., ute ...)."""
    batch, heads, seqlen_k, _ = mask.startend_row_indices.shape
    values = mask.startend_row_indices.tolist()
    n_blocks = -(-seqlen_k // block_n)
    out = torch.zeros(8, batch, heads, n_blocks, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            for n in range(n_blocks):
                cols = range(n * block_n, min(seqlen_k, (n + 1) * block_n))
                bounds = [normalized_column(values[b][h][j], mask.causal, seqlen_q) for j in cols]
                for k in range(4):
                    out[2 * k, b, h, n] = max(c[k] for c in bounds)
                    out[2 * k + 1, b, h, n] = min(c[k] for c in bounds)
    return list(out)


def sri(values, causal: bool = False) -> FlashMask:
    """A one-batch, one-head FlashMask from per-column value lists (or bare ints for C = 1)."""
    rows = [v if isinstance(v, list) else [v] for v in values]
    return FlashMask(torch.tensor(rows, dtype=torch.int32)[None, None], causal)


forms = pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)


# ---------------------------------------------------------------------------- meaning
@forms
@settings(max_examples=random_cases(100))
@given(data=st.data())
def test_to_dense_matches_the_formal_definition(form, data):
    """Every form, Hm in {1, 2}, Sq != Sk, out-of-range and reversed values: the vectorised
    ``to_dense`` equals the element-by-element definition on the raw values."""
    drawn = data.draw(flashmasks(form))
    m = drawn.mask
    expected = formal_visibility(m.startend_row_indices, m.causal, drawn.seqlen_q)
    assert torch.equal(m.to_dense(drawn.seqlen_q), expected)
    as_function = to_dense(m.startend_row_indices, causal=m.causal, seqlen_q=drawn.seqlen_q)
    assert torch.equal(as_function, expected)


def test_to_dense_hand_checked_picture_of_each_form():
    """One 4x4 example per form, drawn by hand (rows = queries, columns = keys)."""
    # causal C=1: a causal document mask with documents [2, 2].
    assert sri([2, 2, 4, 4], causal=True).to_string() == "#...\n##..\n..#.\n..##"
    # causal C=2: column 0 additionally hides rows [2, 3).
    assert sri([[2, 3], [4, 4], [4, 4], [4, 4]], causal=True).to_string() == (
        "#...\n##..\n.##.\n####"
    )
    # non-causal C=2: documents [2, 2] attending bidirectionally.
    assert sri([[2, 0], [2, 0], [4, 2], [4, 2]]).to_string() == "##..\n##..\n..##\n..##"
    # non-causal C=4: column 1 hides rows [0, 1) and [3, 4), column 2 hides rows [1, 3).
    assert sri([[4, 4, 0, 0], [3, 4, 0, 1], [1, 3, 0, 0], [4, 4, 0, 0]]).to_string() == (
        "#.##\n##.#\n##.#\n#.##"
    )


def test_causal_alignment_is_bottom_right_when_lengths_differ():
    """With Sq < Sk the last query row sees every key; with Sq > Sk the first rows see none."""
    no_interval = sri([4, 4, 4, 4], causal=True)  # LTS = Sq: nothing masked besides causal
    assert no_interval.to_string(seqlen_q=2) == "###.\n####"
    wide = sri([6, 6], causal=True)
    assert wide.to_string(seqlen_q=4) == "..\n..\n#.\n##"


def test_3d_indices_are_read_as_one_bound_per_column():
    indices = torch.tensor([[[2, 2, 4, 4]]], dtype=torch.int32)
    assert torch.equal(to_dense(indices, causal=True), to_dense(indices.unsqueeze(-1), causal=True))


def test_intervals_are_clamped_and_absent_bounds_filled():
    m = FlashMask(torch.tensor([[[[-5, 9], [2, 1]]]], dtype=torch.int32), causal=False)
    iv = m.intervals(seqlen_q=4)
    assert iv.lts.tolist() == [[[0, 2]]]
    assert iv.lte.tolist() == [[[4, 4]]]
    assert iv.uts.tolist() == [[[0, 0]]]
    assert iv.ute.tolist() == [[[4, 1]]]


# ---------------------------------------------------------------------------- from_dense
@forms
@settings(max_examples=random_cases(100))
@given(data=st.data())
def test_from_dense_round_trips_with_no_larger_form(form, data):
    """``from_dense(to_dense(m))`` draws the same picture, uses at most ``C`` bounds, and keeps
    the causal form for a causal mask (a causal mask always fits the causal form)."""
    drawn = data.draw(flashmasks(form))
    dense = drawn.mask.to_dense(drawn.seqlen_q)
    back = FlashMask.from_dense(dense)
    assert torch.equal(back.to_dense(drawn.seqlen_q), dense)
    assert back.bounds <= form.bounds
    if form.causal:
        assert back.causal
    assert validate(back, seqlen_q=drawn.seqlen_q, raise_error=False) == []


@pytest.mark.parametrize(
    ("picture", "causal", "bounds"),
    [
        (["#...", "##..", "###.", "####"], True, 1),
        (["#...", ".#..", "###.", "####"], True, 2),
        (["##..", "##..", "..##", "..##"], False, 2),
        (["####", ".###", "####", ".###"], False, 4),
    ],
    ids=["causal-C1", "causal-C2", "document-C2", "two-runs-C4"],
)
def test_from_dense_picks_the_smallest_form(picture, causal, bounds):
    dense = torch.tensor([[c == "#" for c in row] for row in picture])
    m = FlashMask.from_dense(dense)
    assert (m.causal, m.bounds) == (causal, bounds)
    assert m.to_string() == "\n".join(picture)


def test_from_dense_keeps_the_lower_of_two_masked_runs_as_the_lt_interval():
    """Regression: the LT start was taken from the first masked run instead of the last, so a
    column masked at rows {0, 1} and {4} came back masked at rows [0, 5)."""
    dense = torch.ones(6, 3, dtype=torch.bool)
    dense[[0, 1, 4], 0] = False
    m = FlashMask.from_dense(dense)
    assert m.startend_row_indices[0, 0, 0].tolist() == [4, 5, 0, 2]
    assert torch.equal(m.to_dense(6)[0, 0], dense)


def test_from_dense_names_the_column_with_three_masked_runs():
    dense = torch.ones(7, 3, dtype=torch.bool)
    dense[[0, 2, 4], 1] = False
    with pytest.raises(MaskNotRepresentableError, match=r"column 1 .*\[0, 1\), \[2, 3\), \[4, 5\)"):
        FlashMask.from_dense(dense)


def test_from_dense_forced_causal_on_a_non_causal_mask_names_the_column():
    dense = torch.ones(4, 4, dtype=torch.bool)  # column 1 is visible from row 0
    with pytest.raises(MaskNotRepresentableError, match=r"column 1 .*causal"):
        FlashMask.from_dense(dense, causal=True)


def test_from_dense_forced_non_causal_on_a_causal_mask():
    dense = torch.ones(5, 5, dtype=torch.bool).tril()
    m = FlashMask.from_dense(dense, causal=False)
    assert not m.causal
    assert torch.equal(m.to_dense()[0, 0], dense)


@pytest.mark.parametrize(
    ("bool_mask", "causal", "error", "match"),
    [
        ([[True]], None, TypeError, "bool_mask must be a torch.Tensor"),
        (torch.ones(2, 2, dtype=torch.int32), None, TypeError, "bool_mask.dtype"),
        (torch.ones(2, 2, 2, dtype=torch.bool), None, ValueError, "bool_mask must be"),
        (torch.ones(1, 1, 0, 2, dtype=torch.bool), None, ValueError, "bool_mask must not be"),
        (torch.ones(2, 2, dtype=torch.bool), 1, TypeError, "causal must be None or a bool"),
    ],
    ids=["non-tensor", "int-dtype", "rank-3", "empty", "causal-int"],
)
def test_from_dense_rejects_bad_arguments(bool_mask, causal, error, match):
    with pytest.raises(error, match=match):
        FlashMask.from_dense(bool_mask, causal=causal)


# ---------------------------------------------------------------------------- block summary
@forms
@pytest.mark.parametrize("block_n", [1, 3, 16], ids=["bn1", "bn3", "bn16"])
@settings(max_examples=random_cases(25))
@given(data=st.data())
def test_block_summary_matches_a_loop(form, block_n, data):
    """Per key block min/max of the clamped bounds; a partial last block reduces only its
    valid columns."""
    drawn = data.draw(flashmasks(form, max_seqlen=40))
    summary = drawn.mask.block_summary(block_n, drawn.seqlen_q)
    expected = loop_block_summary(drawn.mask, block_n, drawn.seqlen_q)
    for field, got, want in zip(summary._fields, summary, expected, strict=True):
        assert torch.equal(got, want), field


# ---------------------------------------------------------------------------- tiles
TILES = [(16, 16), (16, 8), (8, 16)]


def dense_tile_reductions(dense: torch.Tensor, block_m: int, block_n: int):
    """(any visible pair, every in-bounds pair visible) per tile of a [B, H, Sq, Sk] mask."""
    b, h, sq, sk = dense.shape
    tm, tn = -(-sq // block_m), -(-sk // block_n)
    pad = (0, tn * block_n - sk, 0, tm * block_m - sq)
    tiles_any = torch.nn.functional.pad(dense, pad, value=False)
    tiles_all = torch.nn.functional.pad(dense, pad, value=True)
    shape = (b, h, tm, block_m, tn, block_n)
    return (
        tiles_any.view(shape).any(-1).any(-2),
        tiles_all.view(shape).all(-1).all(-2),
    )


@forms
@pytest.mark.parametrize(("block_m", "block_n"), TILES, ids=[f"{m}x{n}" for m, n in TILES])
@settings(max_examples=random_cases(50))
@given(data=st.data())
def test_classify_tiles_is_sound(form, block_m, block_n, data):
    """SKIP only when no pair of the tile is visible, FULL only when every in-bounds pair is;
    lengths up to 40 leave partial tail tiles on both axes."""
    drawn = data.draw(flashmasks(form, max_seqlen=40))
    classes = drawn.mask.classify_tiles(block_m, block_n, drawn.seqlen_q)
    any_visible, all_visible = dense_tile_reductions(
        drawn.mask.to_dense(drawn.seqlen_q), block_m, block_n
    )
    assert classes.dtype == torch.int8
    assert classes.shape == any_visible.shape
    assert not (any_visible & (classes == TileClass.SKIP)).any(), "skipped a visible pair"
    assert not (~all_visible & (classes == TileClass.FULL)).any(), "FULL tile with a masked pair"


def test_classify_tiles_is_exact_on_a_causal_document_mask():
    """8x8 causal, documents [4, 4], 4x4 tiles: the diagonal tiles are partial, the top-right one
    is hidden by causality and the bottom-left one by the document boundary."""
    m = sri([4] * 4 + [8] * 4, causal=True)
    assert m.classify_tiles(4, 4).tolist() == [
        [[[TileClass.PARTIAL, TileClass.SKIP], [TileClass.SKIP, TileClass.PARTIAL]]]
    ]
    causal_only = sri([8] * 8, causal=True)
    assert causal_only.classify_tiles(4, 4).tolist() == [
        [[[TileClass.PARTIAL, TileClass.SKIP], [TileClass.FULL, TileClass.PARTIAL]]]
    ]


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (sri([8] * 8, causal=True), 0.25),
        (sri([4] * 4 + [8] * 4, causal=True), 0.5),
        (sri([[8, 0]] * 8), 0.0),
        (sri([[0, 0]] * 8), 1.0),
    ],
    ids=["causal", "causal-document", "full", "nothing-visible"],
)
def test_sparsity_is_the_fraction_of_skipped_tiles(mask, expected):
    assert mask.sparsity(4, 4) == expected


@pytest.mark.parametrize(
    ("method", "kwargs", "error", "match"),
    [
        ("block_summary", {"block_n": 0}, ValueError, "block_n must be positive"),
        ("block_summary", {"block_n": 2.0}, TypeError, "block_n must be an int"),
        ("classify_tiles", {"block_m": True, "block_n": 4}, TypeError, "block_m must be an int"),
        ("to_dense", {"seqlen_q": 0}, ValueError, "seqlen_q must be positive"),
    ],
    ids=["block_n-zero", "block_n-float", "block_m-bool", "seqlen_q-zero"],
)
def test_size_arguments_are_checked(method, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(sri([2, 2], causal=True), method)(**kwargs)


# ---------------------------------------------------------------------------- size, display
def test_nbytes_is_four_bytes_per_index():
    m = FlashMask(torch.zeros(2, 3, 5, 4, dtype=torch.int32))
    assert m.nbytes == 4 * 2 * 3 * 5 * 4
    assert (m.batch_size, m.num_heads, m.seqlen_k, m.bounds) == (2, 3, 5, 4)


def test_repr_of_a_small_mask_shows_the_picture():
    m = sri([3, 3, 3, 5, 5], causal=True)
    assert repr(m) == (
        "FlashMask(batch=1, heads=1, seqlen_q=None, seqlen_k=5, bounds=1, causal=True, "
        "device=cpu)\n"
        "#....\n"
        "##...\n"
        "###..\n"
        "...#.\n"
        "...##"
    )


def test_repr_of_a_large_mask_is_one_line():
    m = FlashMask(torch.full((2, 1, 64, 2), 64, dtype=torch.int32), causal=True)
    assert repr(m) == (
        "FlashMask(batch=2, heads=1, seqlen_q=None, seqlen_k=64, bounds=2, causal=True, device=cpu)"
    )


def test_repr_shows_the_query_length_a_mask_was_built_for():
    m = masks.causal(64, seqlen_q=16)
    assert repr(m) == (
        "FlashMask(batch=1, heads=1, seqlen_q=16, seqlen_k=64, bounds=1, causal=True, device=cpu)"
    )


def test_to_string_of_a_large_mask_draws_tiles():
    """32x32 causal document mask (documents [16, 16]) drawn in 4x4 tiles."""
    m = sri([16] * 16 + [32] * 16, causal=True)
    rows = [
        "░       ",
        "█░      ",
        "██░     ",
        "███░    ",
        "    ░   ",
        "    █░  ",
        "    ██░ ",
        "    ███░",
    ]
    expected = "(tiles of 4x4: █ unmasked, ░ partial, blank skipped)\n" + "\n".join(rows)
    assert m.to_string(max_size=8) == expected


def test_to_string_selects_batch_and_head():
    indices = torch.tensor([[[2, 2]], [[0, 2]]], dtype=torch.int32).view(1, 2, 2, 1)
    m = FlashMask(indices, causal=True)
    assert m.to_string(head=0) == "#.\n##"
    assert m.to_string(head=1) == "..\n.#"


# ---------------------------------------------------------------------------- validate
def test_validate_accepts_a_clean_mask():
    m = sri([[4, 4, 0, 0], [3, 4, 0, 1], [1, 3, 0, 0], [4, 4, 0, 0]])
    assert validate(m) == []


@pytest.mark.parametrize(
    ("mask", "seqlen_q", "match"),
    [
        (
            sri([-1, 2], causal=True),
            None,
            r"LTS has negative values, first at \(batch 0, head 0, column 0\)",
        ),
        (sri([[1, 2], [2, 5]]), None, r"UTE has values above seqlen_q=2, first at .*column 1\)"),
        (
            sri([[1, 1], [2, 0]], causal=True),
            None,
            r"LTS > LTE \(an empty interval\), first at .*column 1\)",
        ),
        (sri([[4, 4, 0, 0], [4, 4, 3, 1]] + [[4, 4, 0, 0]] * 2), None, r"UTS > UTE"),
        (
            sri([[2, 6, 0, 3]] + [[6, 6, 0, 0]] * 5),
            None,
            r"the upper interval \[UTS, UTE\) is not above",
        ),
        (sri([3, 3], causal=True), 2, r"LTS has values above seqlen_q=2"),
    ],
    ids=["negative", "above-sq", "lts-after-lte", "uts-after-ute", "ut-below-lt", "seqlen_q"],
)
def test_validate_reports_each_kind_of_mistake(mask, seqlen_q, match):
    problems = validate(mask, seqlen_q=seqlen_q, raise_error=False)
    assert len(problems) == 1
    assert re.search(match, problems[0])
    with pytest.raises(ValueError, match="startend_row_indices: " + match):
        validate(mask, seqlen_q=seqlen_q)


def test_validate_accepts_raw_tensors_and_3d_indices():
    indices = torch.tensor([[[2, 2, 9]]], dtype=torch.int32)
    assert validate(indices, causal=True, raise_error=False) == [
        "LTS has values above seqlen_q=3, first at (batch 0, head 0, column 2)"
    ]


# ---------------------------------------------------------------------------- constructor
@pytest.mark.parametrize(
    ("indices", "causal", "error", "match"),
    [
        ([[[[1]]]], True, TypeError, "startend_row_indices must be a torch.Tensor, got list"),
        (
            torch.zeros(1, 1, 4, 1, dtype=torch.int64),
            True,
            TypeError,
            "startend_row_indices.dtype must be torch.int32",
        ),
        (
            torch.zeros(1, 4, 1, dtype=torch.int32),
            True,
            ValueError,
            "startend_row_indices must have rank 4",
        ),
        (
            torch.zeros(1, 1, 1, 4, 1, dtype=torch.int32),
            True,
            ValueError,
            "startend_row_indices must have rank 4",
        ),
        (
            torch.zeros(1, 1, 4, 1, dtype=torch.int32),
            1,
            TypeError,
            "causal must be a bool, got int",
        ),
        (
            torch.zeros(1, 1, 4, 4, dtype=torch.int32),
            True,
            ValueError,
            "when causal is True, the last dimension should be 1 or 2, but got 4",
        ),
        (
            torch.zeros(1, 1, 4, 1, dtype=torch.int32),
            False,
            ValueError,
            "when causal is False, the last dimension should be 2 or 4, but got 1",
        ),
        (
            torch.zeros(1, 1, 4, 3, dtype=torch.int32),
            False,
            ValueError,
            "startend_row_indices.*should be 2 or 4, but got 3",
        ),
        (
            torch.zeros(0, 1, 4, 2, dtype=torch.int32),
            False,
            ValueError,
            "startend_row_indices must have non-empty",
        ),
        (
            torch.zeros(1, 0, 4, 2, dtype=torch.int32),
            False,
            ValueError,
            "startend_row_indices must have non-empty",
        ),
        (
            torch.zeros(1, 1, 0, 2, dtype=torch.int32),
            False,
            ValueError,
            "startend_row_indices must have non-empty",
        ),
    ],
    ids=[
        "non-tensor",
        "int64",
        "rank-3",
        "rank-5",
        "causal-int",
        "causal-C4",
        "noncausal-C1",
        "noncausal-C3",
        "empty-batch",
        "empty-heads",
        "empty-seqlen_k",
    ],
)
def test_constructor_rejects_invalid_arguments(indices, causal, error, match):
    with pytest.raises(error, match=match):
        FlashMask(indices, causal)


def test_to_moves_the_indices_and_keeps_causal():
    m = sri([2, 2], causal=True).to("meta")
    assert m.device.type == "meta" and m.causal


# ---------------------------------------------------------------------------- seqlen_q
def test_a_mask_used_at_another_query_length_is_an_error():
    """``causal_document([3, 2, 3], seqlen=8)`` read with 16 queries would hide every key from
    every row (all LTS are <= 8): the mask knows it was built for 8 queries and says so."""
    m = masks.causal_document([3, 2, 3], seqlen=8)
    assert m.seqlen_q == 8
    for call in (
        lambda: m.to_dense(16),
        lambda: m.intervals(16),
        lambda: m.classify_tiles(4, 4, 16),
        lambda: m.to_string(16),
        lambda: validate(m, seqlen_q=16),
    ):
        with pytest.raises(ValueError, match=r"built for seqlen_q=8 .*with_seqlen_q\(16\)"):
            call()
    assert torch.equal(m.to_dense(), m.to_dense(8))  # the default is the mask's own length


def test_with_seqlen_q_reinterprets_the_same_indices():
    m = masks.causal_document([3, 2, 3], seqlen=8)
    wide = m.with_seqlen_q(16)
    assert wide.seqlen_q == 16 and wide.startend_row_indices is m.startend_row_indices
    dense = wide.to_dense()
    # The documented reinterpretation: LTS = 8 now masks rows 8 to 15, and bottom-right causal
    # alignment hides every key from rows 0 to 7: nothing is visible.
    assert dense.shape == (1, 1, 16, 8) and not dense.any()
    free = m.with_seqlen_q(None)
    assert free.seqlen_q is None and free.to_dense(16).shape == (1, 1, 16, 8)
    with pytest.raises(ValueError, match="seqlen_q must be positive"):
        m.with_seqlen_q(0)


def test_raw_indices_carry_no_query_length():
    m = FlashMask(torch.full((1, 1, 4, 1), 4, dtype=torch.int32), True)
    assert m.seqlen_q is None
    assert m.to_dense(2).shape == (1, 1, 2, 4) and m.to_dense().shape == (1, 1, 4, 4)


@pytest.mark.parametrize(
    ("seqlen_q", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_constructor_checks_seqlen_q(seqlen_q, error):
    with pytest.raises(error, match="seqlen_q"):
        FlashMask(torch.zeros(1, 1, 4, 1, dtype=torch.int32), True, seqlen_q)


def test_from_dense_to_and_select_keep_the_query_length():
    dense = masks.sliding_window(12, 3, seqlen_q=5).to_dense()
    m = FlashMask.from_dense(dense)
    assert m.seqlen_q == 5 and torch.equal(m.to_dense(), dense)
    assert m.to("meta").seqlen_q == 5
    per_head = masks.random_eviction(8, 4, num_heads=2, generator=torch.Generator().manual_seed(0))
    assert per_head.select(0, 1).seqlen_q == 8
    assert torch.equal(per_head.select(0, 1).to_dense(), per_head.to_dense()[:, 1:2])


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@settings(max_examples=random_cases(10))
@given(data=st.data())
def test_last_rows_are_the_last_query_rows_of_the_mask(form, data):
    """``last_rows(n)`` is the dense mask's last ``n`` rows, for every form and any ``n``."""
    drawn = data.draw(flashmasks(form))
    mask = drawn.mask.with_seqlen_q(drawn.seqlen_q)
    n = data.draw(st.integers(1, drawn.seqlen_q))
    last = mask.last_rows(n)
    assert last.seqlen_q == n and last.causal == mask.causal
    assert torch.equal(last.to_dense(), mask.to_dense()[..., -n:, :])


def test_last_rows_of_a_sliding_window_keep_the_sinks_and_the_window():
    m = masks.sliding_window(8, 2, sink_tokens=1)
    assert m.last_rows(1).to_string() == "#....###"
    assert m.last_rows(8).to_string() == m.to_string()
    with pytest.raises(ValueError, match="seqlen_q must be at most the mask's query length 8"):
        m.last_rows(9)
    with pytest.raises(ValueError, match="seqlen_q must be positive"):
        m.last_rows(0)
