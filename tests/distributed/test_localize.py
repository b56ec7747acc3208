"""Zero-communication localization, checked against dense masks (single process).

The property behind context parallelism: for any rank (a set of query chunks) and any list of key
chunks, the localized mask is exactly the global dense mask restricted to those rows and columns,
for every (causal, C) form, with padding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashmask import FlashMask, masks
from flashmask.distributed import local_mask, localize_rows, normal_form, pair_counts, tile_counts
from flashmask.distributed.localize import chunk_columns
from tests.strategies import FORM_IDS, FORMS, flashmasks

forms = pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)


@st.composite
def chunked(draw, form):
    """A self-attention mask, a chunk size, a padded length and a random chunk ownership."""
    drawn = draw(flashmasks(form, max_seqlen=20, equal_lengths=True))
    chunk = draw(st.integers(1, 5))
    n = -(-drawn.seqlen_k // chunk) + draw(st.integers(0, 2))
    perm = draw(st.permutations(range(n)))
    owned = sorted(perm[: draw(st.integers(1, n))])
    keys = list(draw(st.permutations(range(n))))[: draw(st.integers(1, n))]
    return drawn.mask, chunk, n * chunk, owned, keys


def _padded_dense(mask: FlashMask, padded: int) -> torch.Tensor:
    """Global dense mask with fully masked padding: bool ``[B, Hm, N, N]``."""
    s = mask.seqlen_k
    dense = torch.zeros(mask.batch_size, mask.num_heads, padded, padded, dtype=torch.bool)
    dense[:, :, :s, :s] = mask.to_dense()
    return dense


@forms
@given(data=st.data())
def test_normal_form_is_the_same_mask_with_padding_hidden(form, data):
    mask, _, padded, _, _ = data.draw(chunked(form))
    g = normal_form(mask, padded)
    assert g.dtype == torch.int32 and g.shape == (*mask.startend_row_indices.shape[:2], padded, 4)
    dense = FlashMask(g, False).to_dense(padded)
    s = mask.seqlen_k
    assert torch.equal(dense[:, :, :s, :s], mask.to_dense())
    assert not dense[:, :, :, s:].any(), "padding keys must be hidden from every query"
    # Padding rows are hidden wherever the column has an interval to spare (every real column
    # of a causal C=1 or non-causal C=2 mask has one: its lower interval reaches the end).
    if (mask.causal and mask.bounds == 1) or (not mask.causal and mask.bounds == 2):
        assert not dense[:, :, s:, :].any()


@forms
@given(data=st.data())
def test_local_mask_is_the_dense_mask_restricted_to_owned_rows_and_chosen_keys(form, data):
    mask, chunk, padded, owned, keys = data.draw(chunked(form))
    g = normal_form(mask, padded)
    local = local_mask(g, owned, keys, chunk)
    assert local.dtype == torch.int32 and local.shape[2] == len(keys) * chunk
    rows = chunk_columns(owned, chunk)
    cols = chunk_columns(keys, chunk)
    expected = FlashMask(g, False).to_dense(padded)[:, :, rows][:, :, :, cols]
    assert torch.equal(FlashMask(local, False).to_dense(len(owned) * chunk), expected)


@forms
@given(data=st.data())
def test_pair_counts_and_need_match_dense_counts(form, data):
    mask, chunk, padded, _, _ = data.draw(chunked(form))
    s, n = mask.seqlen_k, padded // chunk
    w = pair_counts(normal_form(mask, padded), s, chunk)
    dense = _padded_dense(mask, padded).to(torch.int64)
    expected = dense.view(-1, n, chunk, n, chunk).sum((0, 2, 4))
    assert torch.equal(w, expected)


def test_localize_rows_counts_owned_rows_below_each_value():
    # Owned chunks 1 and 3 of size 4: rows 4..7 and 12..15 -> local rows 0..7.
    values = torch.arange(0, 18)
    local = localize_rows(values, [1, 3], 4)
    owned = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    assert local.tolist() == [int((owned < v).sum()) for v in values.tolist()]
    # Paddle's clip-shift-max for two chunks gives the same numbers.
    first = (values - 4).clamp(0, 4)
    second = (values - 12).clamp(0, 4)
    assert torch.equal(local, torch.maximum(first, torch.where(second > 0, second + 4, 0)))


def test_localize_rows_rejects_unsorted_chunks():
    with pytest.raises(ValueError, match="row_chunks"):
        localize_rows(torch.arange(4), [2, 1], 2)


def test_normal_form_argument_errors():
    m = masks.causal(8)
    with pytest.raises(TypeError, match="mask"):
        normal_form(m.startend_row_indices)
    with pytest.raises(ValueError, match="padded_seqlen"):
        normal_form(m, 4)


@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "share_question"])
def test_tile_counts_bound_the_visible_tiles(name):
    """Non-skipped tiles are a superset of the tiles with a visible pair (classification is
    conservative) and never more than all tiles."""
    mask = masks.example(name, 64)
    g = normal_form(mask, 64)
    tiles = tile_counts(g, 16, 8)
    dense = mask.to_dense().to(torch.int64).view(8, 8, 8, 8).sum((1, 3)) > 0  # 8x8 tiles
    visible_tiles = dense.to(torch.int64).view(4, 2, 4, 2).sum((1, 3))
    assert bool((tiles >= visible_tiles).all()) and bool((tiles <= 4).all())
    with pytest.raises(ValueError, match="tile_size"):
        tile_counts(g, 12, 8)


def test_localize_rows_equals_the_sum_of_clamps_definition():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 12, (1,), generator=g))
        chunk = int(torch.randint(1, 6, (1,), generator=g))
        count = int(torch.randint(1, n + 1, (1,), generator=g))
        owned = sorted(torch.randperm(n, generator=g)[:count].tolist())
        values = torch.randint(-3, n * chunk + 4, (5, 7), generator=g, dtype=torch.int32)
        expected = sum((values.long() - c * chunk).clamp(0, chunk) for c in owned)
        local = localize_rows(values, owned, chunk)
        assert local.dtype == torch.int32 and torch.equal(local.long(), expected)
