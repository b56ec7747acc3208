"""Mask builders (``flashmask.masks``): each equals a dense mask written from its definition.

Every expected mask below is built in plain Python from the mask type's description (which query
``i`` may see which key ``j``), never from the builder's interval formulas, and compared with the
builder's ``FlashMask.to_dense()``.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import flashmask
from flashmask import masks

# ---------------------------------------------------------------------- helpers


def dense(seqlen, visible, *, seqlen_q=None):
    """Bool ``[Sq, Sk]`` with ``visible(i, j)`` evaluated for every query ``i`` and key ``j``."""
    rows = seqlen if seqlen_q is None else seqlen_q
    return torch.tensor([[bool(visible(i, j)) for j in range(seqlen)] for i in range(rows)])


def stack(*pictures):
    """``[B, 1, Sq, Sk]`` from one ``[Sq, Sk]`` picture per sample."""
    return torch.stack(pictures).unsqueeze(1)


def segments(lens, seqlen):
    """The segment index of every token (``None`` for the padding tail)."""
    owner = []
    for index, n in enumerate(lens):
        owner += [index] * n
    return owner + [None] * (seqlen - len(owner))


def assert_mask(mask, expected, *, causal, bounds, seqlen_q=None):
    """``mask`` has the given form, int32 contiguous indices and exactly ``expected``'s pixels."""
    assert isinstance(mask, flashmask.FlashMask)
    sri = mask.startend_row_indices
    assert sri.dtype == torch.int32
    assert sri.is_contiguous()
    assert (mask.causal, mask.bounds) == (causal, bounds)
    assert flashmask.validate(mask, seqlen_q=seqlen_q) == []
    assert torch.equal(mask.to_dense(seqlen_q), expected)


def assert_padding_masked(mask, totals):
    """No query sees a padding key and padding queries see nothing."""
    pixels = mask.to_dense()
    for b, total in enumerate(totals):
        assert not pixels[b, :, :, total:].any(), f"sample {b}: a padding key is visible"
        assert not pixels[b, :, total:, :].any(), f"sample {b}: a padding query sees a key"


# ---------------------------------------------------------------------- full and causal


def test_full_lets_every_query_see_every_key():
    expected = dense(5, lambda i, j: True)
    assert_mask(masks.full(5, batch_size=2), stack(expected, expected), causal=False, bounds=2)


@pytest.mark.parametrize("seqlen_q", [3, 5, 8])
def test_full_with_another_query_length_is_still_full(seqlen_q):
    expected = dense(5, lambda i, j: True, seqlen_q=seqlen_q)
    mask = masks.full(5, seqlen_q=seqlen_q)
    assert_mask(mask, stack(expected), causal=False, bounds=2, seqlen_q=seqlen_q)


def test_causal_query_sees_keys_up_to_itself():
    expected = dense(6, lambda i, j: j <= i)
    assert_mask(masks.causal(6, batch_size=3), stack(*[expected] * 3), causal=True, bounds=1)


@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(3, 7), (7, 4)])
def test_causal_aligns_the_triangle_bottom_right_when_lengths_differ(seqlen_q, seqlen_k):
    """The last query sees every key (FlashAttention >= 2.1 convention)."""
    offset = seqlen_k - seqlen_q
    expected = dense(seqlen_k, lambda i, j: j <= i + offset, seqlen_q=seqlen_q)
    mask = masks.causal(seqlen_k, seqlen_q=seqlen_q)
    assert_mask(mask, stack(expected), causal=True, bounds=1, seqlen_q=seqlen_q)


# ---------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window", [0, 1, 2, 5, 7, 20])
def test_sliding_window_query_sees_itself_and_window_keys_before(window):
    expected = dense(8, lambda i, j: i - window <= j <= i)
    mask = masks.sliding_window(8, window, batch_size=2)
    assert_mask(mask, stack(expected, expected), causal=True, bounds=1)


# ---------------------------------------------------------------------- causal document


def causal_document_picture(lens, seqlen):
    doc = segments(lens, seqlen)
    return dense(seqlen, lambda i, j: doc[i] is not None and doc[i] == doc[j] and j <= i)


@pytest.mark.parametrize(
    "lens",
    [[3, 1, 4], [1, 1, 1, 1, 1], [6], [2, 0, 3]],
    ids=["three-docs", "one-token-docs", "single-doc", "empty-doc"],
)
def test_causal_document_is_causal_inside_each_document(lens):
    expected = causal_document_picture(lens, sum(lens))
    assert_mask(masks.causal_document(lens), stack(expected), causal=True, bounds=1)


def test_causal_document_batch_pads_shorter_samples_with_a_fully_masked_tail():
    batch = [[3, 2], [1, 1, 1, 1], [6]]
    mask = masks.causal_document(batch, seqlen=7)
    expected = stack(*[causal_document_picture(lens, 7) for lens in batch])
    assert_mask(mask, expected, causal=True, bounds=1)
    assert_padding_masked(mask, [5, 4, 6])


def test_causal_document_seqlen_defaults_to_the_longest_sample():
    mask = masks.causal_document([[2, 2], [5], [1]])
    assert mask.seqlen_k == 5
    assert_padding_masked(mask, [4, 5, 1])


def test_causal_document_accepts_a_tensor_of_lengths():
    mask = masks.causal_document(torch.tensor([[2, 3], [4, 1]]))
    expected = stack(causal_document_picture([2, 3], 5), causal_document_picture([4, 1], 5))
    assert_mask(mask, expected, causal=True, bounds=1)


# ---------------------------------------------------------------------- document


def document_picture(lens, seqlen):
    doc = segments(lens, seqlen)
    return dense(seqlen, lambda i, j: doc[i] is not None and doc[i] == doc[j])


@pytest.mark.parametrize(
    "lens",
    [[3, 2, 4], [1, 1, 1], [5], [2, 0, 2], [4, 4]],
    ids=["unequal-docs", "one-token-docs", "single-doc", "empty-doc", "equal-docs"],
)
def test_document_is_bidirectional_inside_each_document(lens):
    """Unequal lengths catch Paddle's generator, whose UTE is only right for equal ones."""
    expected = document_picture(lens, sum(lens))
    assert_mask(masks.document(lens), stack(expected), causal=False, bounds=2)


def test_document_batch_pads_shorter_samples_with_a_fully_masked_tail():
    batch = [[3, 2, 4], [1, 1], [9]]
    mask = masks.document(batch, seqlen=10)
    expected = stack(*[document_picture(lens, 10) for lens in batch])
    assert_mask(mask, expected, causal=False, bounds=2)
    assert_padding_masked(mask, [9, 2, 9])


# ---------------------------------------------------------------------- share question


def share_question_picture(docs, seqlen):
    """Causal inside a document; answer keys are seen only by their own answer."""
    doc, part = [], []
    for d, parts in enumerate(docs):
        for k, n in enumerate(parts):
            doc += [d] * n
            part += [k] * n
    doc += [None] * (seqlen - len(doc))
    part += [None] * (seqlen - len(part))

    def visible(i, j):
        same_doc = doc[i] is not None and doc[i] == doc[j] and j <= i
        return same_doc and (part[j] == 0 or part[j] == part[i])

    return dense(seqlen, visible)


@pytest.mark.parametrize(
    "docs",
    [[[2, 3, 1]], [[2, 2, 1], [1, 1, 1, 1]], [[3]], [[1, 1, 1], [2, 1, 1, 2]]],
    ids=["one-doc", "two-docs", "question-only", "one-token-parts"],
)
def test_share_question_answers_see_the_question_but_not_each_other(docs):
    seqlen = sum(map(sum, docs))
    expected = share_question_picture(docs, seqlen)
    assert_mask(masks.share_question(docs), stack(expected), causal=True, bounds=1)


def test_share_question_batch_pads_shorter_samples_with_a_fully_masked_tail():
    batch = [[[2, 2, 1], [1, 1, 1]], [[3, 1, 2]], [[1, 2]]]
    mask = masks.share_question(batch, seqlen=9)
    expected = stack(*[share_question_picture(docs, 9) for docs in batch])
    assert_mask(mask, expected, causal=True, bounds=1)
    assert_padding_masked(mask, [8, 6, 3])


# ---------------------------------------------------------------------- global + sliding window


@pytest.mark.parametrize(
    ("seqlen", "global_tokens", "window"),
    [(10, 2, 2), (10, 0, 1), (10, 3, (1, 3)), (12, 2, (4, 0)), (6, 1, (0, 0)), (5, 5, 1)],
)
def test_global_sliding_window_sees_the_window_and_global_tokens(seqlen, global_tokens, window):
    left, right = (window, window) if isinstance(window, int) else window
    g = global_tokens
    expected = dense(seqlen, lambda i, j: i < g or j < g or i - left <= j <= i + right)
    mask = masks.global_sliding_window(seqlen, global_tokens, window, batch_size=2)
    assert_mask(mask, stack(expected, expected), causal=False, bounds=4)


# ---------------------------------------------------------------------- causal blockwise


def causal_blockwise_picture(lens, seqlen):
    """Each document causal on its own; the last one also sees all earlier documents.

    Padding queries see the earlier (demonstration) documents only: a FlashMask column cannot
    hide them from padding rows too (see the builder's docstring).
    """
    doc = segments(lens, seqlen)
    last = len(lens) - 1

    def visible(i, j):
        if doc[j] is None:
            return False
        if doc[i] is None:
            return doc[j] != last
        return j <= i and (doc[i] == doc[j] or doc[i] == last)

    return dense(seqlen, visible)


@pytest.mark.parametrize(
    "lens", [[2, 3, 2], [1, 1, 1, 1], [4], [3, 2]], ids=["three", "one-token", "single", "two"]
)
def test_causal_blockwise_last_document_sees_every_document(lens):
    expected = causal_blockwise_picture(lens, sum(lens))
    assert_mask(masks.causal_blockwise(lens), stack(expected), causal=True, bounds=2)


def test_causal_blockwise_padding_is_hidden_and_padding_queries_see_only_demonstrations():
    batch = [[2, 2, 2], [1, 3], [5]]
    mask = masks.causal_blockwise(batch, seqlen=8)
    expected = stack(*[causal_blockwise_picture(lens, 8) for lens in batch])
    assert_mask(mask, expected, causal=True, bounds=2)
    pixels = mask.to_dense()
    assert not pixels[:, :, :, 6:].any()  # no query sees a padding key
    assert not pixels[2, :, 5:, :].any()  # one document: padding queries see nothing


# ---------------------------------------------------------------------- prefix LM


def prefix_lm_document_picture(docs, seqlen):
    """Inside a document, the prefix keys are seen by every query, the others causally."""
    doc, prefix_end, start = [], [], 0
    for d, (prefix, n) in enumerate(docs):
        doc += [d] * n
        prefix_end += [start + prefix] * n
        start += n
    doc += [None] * (seqlen - len(doc))

    def visible(i, j):
        same_doc = doc[i] is not None and doc[i] == doc[j]
        return same_doc and (j < prefix_end[j] or j <= i)

    return dense(seqlen, visible)


@pytest.mark.parametrize(
    "docs",
    [[(2, 3), (1, 2)], [(0, 3), (3, 3)], [(1, 1), (1, 1)], [(4, 6)]],
    ids=["partial-prefixes", "no-and-whole-prefix", "one-token-docs", "single-doc"],
)
def test_prefix_lm_document_prefix_is_bidirectional_the_rest_causal(docs):
    seqlen = sum(n for _, n in docs)
    expected = prefix_lm_document_picture(docs, seqlen)
    assert_mask(masks.prefix_lm_document(docs), stack(expected), causal=False, bounds=2)


def test_prefix_lm_document_batch_pads_shorter_samples_with_a_fully_masked_tail():
    batch = [[(2, 3), (1, 2)], [(3, 3)], [(1, 4), (0, 3)]]
    mask = masks.prefix_lm_document(batch, seqlen=8)
    expected = stack(*[prefix_lm_document_picture(docs, 8) for docs in batch])
    assert_mask(mask, expected, causal=False, bounds=2)
    assert_padding_masked(mask, [5, 3, 7])


@pytest.mark.parametrize("prefix_len", [0, 1, 3, 6])
def test_prefix_lm_causal_everyone_sees_the_prefix_then_causal(prefix_len):
    expected = dense(6, lambda i, j: j < prefix_len or j <= i)
    mask = masks.prefix_lm_causal(6, prefix_len, batch_size=2)
    assert_mask(mask, stack(expected, expected), causal=False, bounds=2)


# ---------------------------------------------------------------------- QK-sparse


def qk_sparse_picture(seqlen, spans):
    """Causal, except that a query and a key inside the same span never interact."""

    def inside(t, offset, length):
        return offset <= t < offset + length

    def visible(i, j):
        same_span = any(inside(i, o, n) and inside(j, o, n) for o, n in spans)
        return j <= i and not same_span

    return dense(seqlen, visible)


@pytest.mark.parametrize(
    "spans",
    [[(1, 2), (5, 3)], [(0, 3)], [], [(2, 0), (4, 1)], [(0, 8)]],
    ids=["two-spans", "span-at-start", "no-span", "empty-and-one-token", "whole-sequence"],
)
def test_qk_sparse_hides_each_span_from_its_own_queries(spans):
    expected = qk_sparse_picture(8, spans)
    mask = masks.qk_sparse(8, spans, batch_size=2)
    assert_mask(mask, stack(expected, expected), causal=True, bounds=2)


def test_qk_sparse_query_at_a_span_start_at_zero_sees_nothing():
    assert not masks.qk_sparse(6, [(0, 2)]).to_dense()[0, 0, :2].any()


def test_qk_sparse_takes_one_list_of_spans_per_sample():
    per_sample = [[(1, 2)], [], [(3, 3), (0, 1)]]
    mask = masks.qk_sparse(7, per_sample)
    assert mask.batch_size == 3
    expected = stack(*[qk_sparse_picture(7, spans) for spans in per_sample])
    assert_mask(mask, expected, causal=True, bounds=2)


# ---------------------------------------------------------------------- hash sparse


def hash_sparse_picture(ids, seqlen):
    """Causal inside each bucket (the tokens are sorted, so a bucket is one run)."""
    bucket = list(ids) + [None] * (seqlen - len(ids))
    return dense(seqlen, lambda i, j: bucket[i] is not None and bucket[i] == bucket[j] and j <= i)


@pytest.mark.parametrize(
    "ids",
    [[7, 7, 2, 2, 2, 5], [0], [3, 3, 3, 3], [1, 2, 3, 4], [-1, -1, 9]],
    ids=["three-buckets", "one-token", "one-bucket", "singletons", "any-ids"],
)
def test_hash_sparse_is_causal_inside_each_bucket(ids):
    expected = hash_sparse_picture(ids, len(ids))
    assert_mask(masks.hash_sparse(ids), stack(expected), causal=True, bounds=1)


def test_hash_sparse_batch_pads_shorter_samples_with_a_fully_masked_tail():
    batch = [[1, 1, 2, 2, 2], [4, 3, 3], [0, 0, 0, 0, 5, 5]]
    mask = masks.hash_sparse(batch)
    expected = stack(*[hash_sparse_picture(ids, 6) for ids in batch])
    assert_mask(mask, expected, causal=True, bounds=1)
    assert_padding_masked(mask, [5, 3, 6])


def test_hash_sparse_accepts_a_batch_tensor():
    ids = torch.tensor([[5, 5, 1, 1], [2, 3, 3, 3]])
    expected = stack(hash_sparse_picture([5, 5, 1, 1], 4), hash_sparse_picture([2, 3, 3, 3], 4))
    assert_mask(masks.hash_sparse(ids), expected, causal=True, bounds=1)


def test_hash_sparse_names_the_position_where_a_bucket_starts_again():
    with pytest.raises(ValueError, match=r"bucket_ids\[1\]: bucket 2 starts again at position 3"):
        masks.hash_sparse([[1, 1], [2, 3, 3, 2, 4]])


# ---------------------------------------------------------------------- random eviction


def visible_keys(pixels):
    """The visible keys of every query row, as Python sets."""
    return [set(torch.nonzero(row).flatten().tolist()) for row in pixels]


@pytest.mark.parametrize(("seqlen", "start_row"), [(12, 4), (9, 1), (16, 8), (5, 5), (7, 6)])
def test_random_eviction_each_row_from_start_row_evicts_one_earlier_key(seqlen, start_row):
    """Rows before ``start_row`` are causal; each later row sees the previous row's keys plus
    itself, minus exactly one earlier key; the diagonal is always visible."""
    mask = masks.random_eviction(
        seqlen,
        start_row,
        num_heads=3,
        batch_size=2,
        generator=torch.Generator().manual_seed(seqlen),
    )
    sri = mask.startend_row_indices
    assert sri.shape == (2, 3, seqlen, 1)
    assert (sri.dtype, sri.is_contiguous(), mask.causal) == (torch.int32, True, True)
    pixels = mask.to_dense()
    for b in range(2):
        for h in range(3):
            rows = visible_keys(pixels[b, h])
            for i in range(start_row):
                assert rows[i] == set(range(i + 1))
            for r in range(start_row, seqlen):
                assert r in rows[r], f"(b={b}, h={h}) row {r} does not see itself"
                evicted = (rows[r - 1] | {r}) - rows[r]
                assert len(evicted) == 1 and min(evicted) < r
                assert rows[r] <= rows[r - 1] | {r}
                assert len(rows[r]) == start_row


def test_random_eviction_draws_differ_between_heads_and_samples():
    mask = masks.random_eviction(64, 16, num_heads=4, batch_size=2, generator=torch.Generator())
    sri = mask.startend_row_indices.view(8, 64)
    assert all(not torch.equal(sri[a], sri[b]) for a in range(8) for b in range(a))


def test_random_eviction_is_reproducible_with_a_seeded_generator():
    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return masks.random_eviction(32, 8, num_heads=2, generator=gen).startend_row_indices

    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


def test_random_eviction_evicts_uniformly_among_cached_keys():
    """With two cached keys, row 2 evicts key 0 or 1 and row 3 evicts key 2 half the time."""
    gen = torch.Generator().manual_seed(0)
    pixels = masks.random_eviction(4, 2, batch_size=4000, generator=gen).to_dense()[:, 0]
    row2_evicts_key0 = (~pixels[:, 2, 0]).sum().item()
    row3_evicts_key2 = (~pixels[:, 3, 2]).sum().item()
    assert abs(row2_evicts_key0 - 2000) < 160  # five standard deviations
    assert abs(row3_evicts_key2 - 2000) < 160


def test_random_eviction_from_the_last_row_onward_is_plain_causal():
    mask = masks.random_eviction(6, 6, num_heads=2)
    assert torch.equal(mask.to_dense(), dense(6, lambda i, j: j <= i).expand(1, 2, 6, 6))


# ---------------------------------------------------------------------- example


ALL_NAMES = (*masks.MASK_TYPES, "hash_sparse")
FORMS = {
    "full": (False, 2),
    "causal": (True, 1),
    "sliding_window": (True, 1),
    "causal_document": (True, 1),
    "document": (False, 2),
    "share_question": (True, 1),
    "global_sliding_window": (False, 4),
    "causal_blockwise": (True, 2),
    "prefix_lm_document": (False, 2),
    "prefix_lm_causal": (False, 2),
    "qk_sparse": (True, 2),
    "random_eviction": (True, 1),
    "hash_sparse": (True, 1),
}


def test_mask_types_are_the_papers_twelve_in_order():
    assert masks.MASK_TYPES == (
        "full",
        "causal",
        "sliding_window",
        "causal_document",
        "document",
        "share_question",
        "global_sliding_window",
        "causal_blockwise",
        "prefix_lm_document",
        "prefix_lm_causal",
        "qk_sparse",
        "random_eviction",
    )


@pytest.mark.parametrize("seqlen", [16, 24, 100, 1000])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_example_has_the_form_shape_and_a_visible_key_in_every_row(name, seqlen):
    """Examples fill the sequence (no padding); only QK-sparse may hide a query's own key."""
    mask = masks.example(name, seqlen, batch_size=3, num_heads=2)
    heads = 2 if name == "random_eviction" else 1
    sri = mask.startend_row_indices
    assert sri.shape == (3, heads, seqlen, FORMS[name][1])
    assert (sri.dtype, sri.is_contiguous(), mask.causal) == (torch.int32, True, FORMS[name][0])
    assert flashmask.validate(mask) == []
    pixels = mask.to_dense()
    assert pixels.any(-1).all(), "some query row sees no key"
    if name != "qk_sparse":
        assert pixels.diagonal(dim1=-2, dim2=-1).all(), "some query row does not see itself"


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_builder_records_the_query_length_it_built_for(name):
    """``example`` calls every builder; each records ``S`` as the mask's ``seqlen_q``."""
    assert masks.example(name, 24, batch_size=2).seqlen_q == 24


@pytest.mark.parametrize(
    "build",
    [
        lambda: masks.full(12, seqlen_q=5),
        lambda: masks.causal(12, seqlen_q=5),
        lambda: masks.sliding_window(12, 3, seqlen_q=5),
    ],
    ids=["full", "causal", "sliding_window"],
)
def test_builders_with_a_query_length_record_it(build):
    mask = build()
    assert mask.seqlen_q == 5 and mask.to_dense().shape == (1, 1, 5, 12)
    with pytest.raises(ValueError, match="built for seqlen_q=5"):
        mask.to_dense(12)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_example_is_deterministic_by_default_and_follows_the_generator(name):
    first = masks.example(name, 64, batch_size=2).startend_row_indices
    assert torch.equal(first, masks.example(name, 64, batch_size=2).startend_row_indices)
    seeded = masks.example(name, 64, batch_size=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, seeded.startend_row_indices)


RANDOM_NAMES = (
    "causal_document",
    "document",
    "share_question",
    "causal_blockwise",
    "prefix_lm_document",
    "qk_sparse",
    "random_eviction",
    "hash_sparse",
)


@pytest.mark.parametrize("name", RANDOM_NAMES)
def test_example_draws_each_sample_of_a_batch_separately(name):
    sri = masks.example(name, 256, batch_size=4).startend_row_indices
    assert len({tuple(sample.flatten().tolist()) for sample in sri}) == 4


@pytest.mark.parametrize(
    ("seqlen", "low", "high"), [(8192, 3, 7), (32768, 10, 14), (131072, 11, 15)]
)
def test_example_packs_the_papers_number_of_documents(seqlen, low, high):
    lts = masks.example("causal_document", seqlen, batch_size=5).startend_row_indices
    counts = [len(torch.unique(sample)) for sample in lts]
    assert all(low <= c <= high for c in counts), counts
    assert len(set(counts)) > 1


def test_example_uses_the_papers_window_prefix_global_and_eviction_parameters():
    s = 1024
    pixels = {name: masks.example(name, s).to_dense()[0, 0] for name in masks.MASK_TYPES}
    assert pixels["sliding_window"][-1].sum() == s // 16 + 1  # itself and 0.0625 S before
    assert pixels["global_sliding_window"][:16].all()  # 16 global queries
    assert pixels["global_sliding_window"][:, :16].all()  # 16 global keys
    assert not pixels["global_sliding_window"][16, 16 + s // 16 + 1 :].any()
    assert pixels["global_sliding_window"][16, 16 : 16 + s // 16 + 1].all()
    assert pixels["prefix_lm_causal"][0].sum() == s // 2
    assert pixels["random_eviction"][s // 2 - 1].sum() == s // 2  # causal up to start_row
    assert pixels["random_eviction"][-1].sum() == s // 2


@pytest.mark.parametrize("name", ALL_NAMES)
def test_example_builds_a_128k_mask(name):
    """``flashmask bench`` builds 128K masks; the builders must be O(N) tensor work."""
    mask = masks.example(name, 131072, num_heads=2)
    assert mask.seqlen_k == 131072
    assert flashmask.validate(mask) == []


# ---------------------------------------------------------------------- pictures and errors


def test_docstring_pictures():
    """Every builder's docstring picture is what the builder draws."""
    result = doctest.testmod(masks, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 13
    assert result.failed == 0


def test_builders_put_the_mask_on_the_requested_device():
    assert masks.causal_document([2, 2], device="cpu").device == torch.device("cpu")
    assert masks.example("random_eviction", 16, device="meta").device.type == "meta"


VALUE_ERRORS = [
    (lambda: masks.full(0), "seqlen"),
    (lambda: masks.full(4, batch_size=0), "batch_size"),
    (lambda: masks.causal(4, seqlen_q=0), "seqlen_q"),
    (lambda: masks.sliding_window(8, -1), "window"),
    (lambda: masks.sliding_window(0, 1), "seqlen"),
    (lambda: masks.causal_document([3, -1]), r"doc_lens\[1\]"),
    (lambda: masks.causal_document([[3], [2, -1]]), r"doc_lens\[1\]\[1\]"),
    (lambda: masks.causal_document([3, 2], seqlen=4), "seqlen"),
    (lambda: masks.causal_document([[3], [2, 3]], seqlen=4), r"doc_lens\[1\]"),
    (lambda: masks.causal_document([]), "doc_lens"),
    (lambda: masks.causal_document([0, 0]), "doc_lens"),
    (lambda: masks.document([2, -2]), r"doc_lens\[1\]"),
    (lambda: masks.document([4], seqlen=3), "seqlen"),
    (lambda: masks.share_question([[2, -1]]), r"docs\[0\]\[1\]"),
    (lambda: masks.share_question([[2, 1], []]), r"docs\[1\]"),
    (lambda: masks.share_question([[2, 2]], seqlen=3), "seqlen"),
    (lambda: masks.global_sliding_window(8, 9, 1), "global_tokens"),
    (lambda: masks.global_sliding_window(8, -1, 1), "global_tokens"),
    (lambda: masks.global_sliding_window(8, 1, -1), "window"),
    (lambda: masks.global_sliding_window(8, 1, (1, -2)), r"window\[1\]"),
    (lambda: masks.global_sliding_window(8, 1, (1, 2, 3)), "window"),
    (lambda: masks.causal_blockwise([2, -2]), r"doc_lens\[1\]"),
    (lambda: masks.causal_blockwise([2, 2], seqlen=3), "seqlen"),
    (lambda: masks.prefix_lm_document([(3, 2)]), "prefix_len"),
    (lambda: masks.prefix_lm_document([(-1, 2)]), "prefix_len"),
    (lambda: masks.prefix_lm_document([(1, 2), (1, -2)]), r"docs\[1\]\[1\] \(doc_len\)"),
    (lambda: masks.prefix_lm_document([(1, 4)], seqlen=3), "seqlen"),
    (lambda: masks.prefix_lm_causal(4, 5), "prefix_len"),
    (lambda: masks.prefix_lm_causal(4, -1), "prefix_len"),
    (lambda: masks.qk_sparse(8, [(6, 3)]), r"maskout\[0\]"),
    (lambda: masks.qk_sparse(8, [(-1, 2)]), "offset"),
    (lambda: masks.qk_sparse(8, [(1, -2)]), "length"),
    (lambda: masks.qk_sparse(8, [(1, 3), (3, 2)]), r"maskout spans .* overlap"),
    (lambda: masks.qk_sparse(8, [[(1, 1)], [(2, 1)]], batch_size=3), "batch_size"),
    (lambda: masks.hash_sparse([1, 1, 2, 1]), "bucket_ids.*position 3"),
    (lambda: masks.hash_sparse([]), "bucket_ids"),
    (lambda: masks.hash_sparse(torch.zeros(2, 2, 2, dtype=torch.int64)), "bucket_ids"),
    (lambda: masks.random_eviction(8, 0), "start_row"),
    (lambda: masks.random_eviction(8, 9), "start_row"),
    (lambda: masks.random_eviction(8, 4, num_heads=0), "num_heads"),
    (lambda: masks.random_eviction(8, 4, batch_size=0), "batch_size"),
    (lambda: masks.example("nope", 16), "name"),
    (lambda: masks.example("causal", 0), "seqlen"),
    (lambda: masks.example("causal", 16, batch_size=0), "batch_size"),
    (lambda: masks.example("random_eviction", 16, num_heads=0), "num_heads"),
]


@pytest.mark.parametrize(("build", "argument"), VALUE_ERRORS)
def test_invalid_values_raise_value_error_naming_the_argument(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


TYPE_ERRORS = [
    (lambda: masks.full(4.0), "seqlen"),
    (lambda: masks.causal(True), "seqlen"),
    (lambda: masks.sliding_window(8, 1.5), "window"),
    (lambda: masks.causal_document([2.5, 1]), "doc_lens"),
    (lambda: masks.causal_document("abc"), "doc_lens"),
    (lambda: masks.document(3), "doc_lens"),
    (lambda: masks.share_question([2, 1]), "docs"),
    (lambda: masks.prefix_lm_document([(1, 2, 3)]), "docs"),
    (lambda: masks.qk_sparse(8, [(1, 2.0)]), "maskout"),
    (lambda: masks.hash_sparse(torch.tensor([0.5, 1.0])), "bucket_ids"),
    (lambda: masks.random_eviction(8, 4, generator=0), "generator"),
    (lambda: masks.example("causal", 16, generator=0), "generator"),
]


@pytest.mark.parametrize(("build", "argument"), TYPE_ERRORS)
def test_arguments_of_the_wrong_type_raise_type_error_naming_the_argument(build, argument):
    with pytest.raises(TypeError, match=argument):
        build()


@pytest.mark.parametrize(
    ("seqlen", "seqlen_q", "window", "sinks"),
    [(10, 10, 3, 2), (10, 4, 3, 2), (12, 1, 4, 3), (5, 5, 0, 1), (6, 6, 2, 6)],
    ids=["square", "new-queries", "decode-step", "zero-window", "all-sinks"],
)
def test_sliding_window_with_sink_tokens_and_a_longer_key_cache(seqlen, seqlen_q, window, sinks):
    """Streaming attention: query i (at key position i + Sk - Sq) sees the last ``window`` keys
    before it, itself, and the first ``sinks`` keys."""
    offset = seqlen - seqlen_q
    expected = torch.tensor(
        [
            [j <= i + offset and (j >= i + offset - window or j < sinks) for j in range(seqlen)]
            for i in range(seqlen_q)
        ]
    )
    mask = masks.sliding_window(seqlen, window, sink_tokens=sinks, seqlen_q=seqlen_q)
    assert torch.equal(mask.to_dense(seqlen_q)[0, 0], expected)


def test_sliding_window_rejects_negative_sink_tokens():
    with pytest.raises(ValueError, match="sink_tokens"):
        masks.sliding_window(8, 2, sink_tokens=-1)
