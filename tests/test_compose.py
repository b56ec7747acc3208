"""``intersect`` / ``&``: visible exactly where both masks are visible, in the smallest form."""

from __future__ import annotations

import pytest
import torch

import flashmask
from flashmask import FlashMask, MaskNotRepresentableError, masks
from flashmask.compose import intersect
from tests.strategies import FORM_IDS, FORMS, random_cases


def random_mask(form, batch, heads, seqlen_q, seqlen_k, gen) -> FlashMask:
    shape = (batch, heads, seqlen_k, form.bounds)
    values = torch.randint(-2, seqlen_q + 3, shape, generator=gen, dtype=torch.int32)
    return FlashMask(values, form.causal)


@pytest.mark.parametrize("form_b", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("form_a", FORMS, ids=FORM_IDS)
def test_intersection_of_random_masks_equals_dense_and(form_a, form_b):
    """Where the intersection is representable it equals the dense AND; where it is not, the
    dense AND really has a column with more masked runs than any form holds."""
    gen = torch.Generator().manual_seed(hash((form_a, form_b)) % 2**31)
    represented = 0
    for trial in range(random_cases(30)):
        sk = int(torch.randint(1, 20, (1,), generator=gen))
        sq = sk if trial % 2 else int(torch.randint(1, 20, (1,), generator=gen))
        a = random_mask(form_a, 2, 1, sq, sk, gen)
        b = random_mask(form_b, 1 if trial % 3 else 2, 2, sq, sk, gen)
        expected = a.to_dense(sq) & b.to_dense(sq)
        try:
            both = intersect(a, b, seqlen_q=sq)
        except MaskNotRepresentableError:
            with pytest.raises(MaskNotRepresentableError):
                FlashMask.from_dense(expected)
            continue
        represented += 1
        assert torch.equal(both.to_dense(sq), expected), (trial, sq, sk)
        smallest = FlashMask.from_dense(expected)
        if both.causal == smallest.causal:
            assert both.bounds == smallest.bounds, (trial, both, smallest)
        else:  # only two non-causal inputs may hide the triangle without being causal
            assert not (form_a.causal or form_b.causal)
    assert represented > 0


def test_document_and_sliding_window_stay_causal_one_bound():
    """The common training case: packed documents under a sliding window (one causal bound)."""
    docs = masks.causal_document([5, 7, 4], seqlen=16)
    window = masks.sliding_window(16, 3)
    both = docs & window
    assert (both.causal, both.bounds) == (True, 1)
    assert torch.equal(both.to_dense(), docs.to_dense() & window.to_dense())


def test_prefix_lm_and_document_mix_causal_and_bidirectional_parts():
    docs = masks.causal_document([6, 10], seqlen=16)
    prefix = masks.prefix_lm_causal(16, 4)
    both = prefix & docs
    assert both.causal
    assert torch.equal(both.to_dense(), prefix.to_dense() & docs.to_dense())


def test_operator_matches_function_and_broadcasts_heads():
    per_head = masks.random_eviction(12, 6, num_heads=2, generator=torch.Generator().manual_seed(0))
    shared = masks.causal_document([[4, 8]], seqlen=12)
    both = per_head & shared
    assert both.num_heads == 2
    assert torch.equal(both.to_dense(), per_head.to_dense() & shared.to_dense())
    assert torch.equal(flashmask.intersect(per_head, shared).startend_row_indices,
                       both.startend_row_indices)  # fmt: skip


def test_not_representable_names_the_column():
    """Two holes in the middle of a column plus the causal triangle cannot be stored (column 0
    has no triangle above it, so it still fits the non-causal C=4 form)."""
    seqlen = 8
    a = FlashMask(torch.tensor([[2, 3]] * seqlen, dtype=torch.int32).view(1, 1, seqlen, 2), True)
    b = FlashMask(torch.tensor([[5, 6]] * seqlen, dtype=torch.int32).view(1, 1, seqlen, 2), True)
    with pytest.raises(MaskNotRepresentableError, match="column 1"):
        intersect(a, b)


@pytest.mark.parametrize(
    ("other", "error", "match"),
    [
        ("not a mask", TypeError, "second"),
        (masks.causal(9), ValueError, "seqlen_k"),
        (masks.causal(8, batch_size=3), ValueError, "batch size"),
    ],
    ids=["type", "seqlen_k", "batch"],
)
def test_invalid_arguments_are_named(other, error, match):
    with pytest.raises(error, match=match):
        intersect(masks.causal(8, batch_size=2), other)


def test_intersection_keeps_the_query_length_and_rejects_a_mismatch():
    decode = masks.causal(10, seqlen_q=3)
    window = masks.sliding_window(10, 4, seqlen_q=3)
    both = decode & window
    assert both.seqlen_q == 3
    assert torch.equal(both.to_dense(), decode.to_dense() & window.to_dense())
    raw = FlashMask(masks.causal(10).startend_row_indices, True)  # raw indices: any length
    assert (raw & window).seqlen_q == 3
    assert intersect(raw, raw).seqlen_q == 10  # computed for Sq = Sk, and says so
    with pytest.raises(ValueError, match="different query lengths"):
        masks.causal(10) & window
    with pytest.raises(ValueError, match="built for seqlen_q=3"):
        intersect(decode, window, seqlen_q=10)
