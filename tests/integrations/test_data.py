"""Collators: packing properties, masks against independent dense constructions, losses."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from flashmask import FlashMask
from flashmask.integrations import data
from tests.strategies import random_cases

BATCHES = random_cases(20)


def _random_samples(g: torch.Generator, count: int, longest: int, *, labels: bool = True):
    samples = []
    for _ in range(count):
        n = int(torch.randint(1, longest + 1, (1,), generator=g))
        ids = torch.randint(1, 1000, (n,), generator=g).tolist()
        sample = {"input_ids": ids}
        if labels and n > 2 and bool(torch.rand(1, generator=g) < 0.5):
            cut = int(torch.randint(0, n, (1,), generator=g))
            sample["labels"] = [-100] * cut + ids[cut:]
        samples.append(sample)
    return samples


def _dense_causal_document(sample_index: torch.Tensor) -> torch.Tensor:
    """``[R, 1, S, S]``: query i sees key j iff j <= i and both hold the same (real) sample."""
    same = sample_index[:, :, None] == sample_index[:, None, :]
    real = (sample_index >= 0)[:, :, None] & (sample_index >= 0)[:, None, :]
    causal = torch.ones(sample_index.shape[1], sample_index.shape[1], dtype=torch.bool).tril()
    return (same & real & causal).unsqueeze(1)


# ---------------------------------------------------------------------- pack_sft
@pytest.mark.parametrize("seed", range(BATCHES))
def test_pack_sft_loses_no_token_and_builds_the_document_mask(seed):
    g = torch.Generator().manual_seed(seed)
    max_tokens = int(torch.randint(16, 65, (1,), generator=g))
    samples = _random_samples(g, int(torch.randint(1, 30, (1,), generator=g)), max_tokens)
    batch = data.pack_sft(samples, max_tokens, pad_token_id=-1)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    owner = batch["sample_index"]
    rows, seqlen = ids.shape
    assert seqlen <= max_tokens
    assert {k: v.dtype for k, v in batch.items()} == {
        "input_ids": torch.int64,
        "labels": torch.int64,
        "position_ids": torch.int64,
        "startend_row_indices": torch.int32,
        "sample_index": torch.int64,
        "doc_lens": torch.int64,
    }

    pad_free = owner >= 0
    # No token lost or duplicated: the multiset of (sample, token) pairs is unchanged, and each
    # sample is one contiguous run, in order, with positions 0..n-1.
    packed = collections.Counter(zip(owner[pad_free].tolist(), ids[pad_free].tolist(), strict=True))
    given = collections.Counter((i, t) for i, s in enumerate(samples) for t in s["input_ids"])
    assert packed == given
    for i, sample in enumerate(samples):
        where = (owner == i).nonzero()
        r = int(where[0, 0])
        cols = where[:, 1]
        assert bool((where[:, 0] == r).all())
        assert torch.equal(cols, torch.arange(int(cols[0]), int(cols[0]) + len(cols)))
        assert ids[r, cols].tolist() == sample["input_ids"]
        assert pos[r, cols].tolist() == list(range(len(cols)))
        expected = list(sample.get("labels", sample["input_ids"]))
        expected[0] = -100  # a document is never predicted from the one before it
        assert labels[r, cols].tolist() == expected
    pad = owner < 0
    assert bool((ids[pad] == -1).all())
    assert bool((labels[pad] == -100).all())
    assert bool((batch["doc_lens"].sum(-1) == (~pad).sum(-1)).all())

    mask = FlashMask(batch["startend_row_indices"], causal=True)
    assert mask.startend_row_indices.shape == (rows, 1, seqlen, 1)
    assert torch.equal(mask.to_dense(), _dense_causal_document(owner))


def test_pack_sft_is_best_fit_decreasing():
    samples = [{"input_ids": [7] * n} for n in (5, 4, 3, 2, 1, 1)]
    batch = data.pack_sft(samples, 6)
    # Longest first, each into the fullest row that still fits: [5, 1], [4, 2], [3, 1].
    assert batch["doc_lens"].tolist() == [[5, 1], [4, 2], [3, 1]]
    assert batch["sample_index"].tolist() == [
        [0, 0, 0, 0, 0, 4],
        [1, 1, 1, 1, 3, 3],
        [2, 2, 2, 5, -1, -1],
    ]


def test_pack_sft_padding_options():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": torch.tensor([4, 5])}]
    assert data.pack_sft(samples, 8)["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    padded = data.pack_sft(samples, 8, pad_to_max_tokens=True, pad_token_id=9)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert padded["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]


def test_pack_sft_too_long_sample_raises_or_truncates():
    samples = [{"input_ids": [1, 2]}, {"input_ids": list(range(1, 11)), "labels": [5] * 10}]
    with pytest.raises(ValueError, match=r"samples\[1\] has 10 tokens, more than max_tokens=4"):
        data.pack_sft(samples, 4)
    batch = data.pack_sft(samples, 4, truncate=True)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 5, 5], [-100, 2, -100, -100]]


@pytest.mark.parametrize(
    ("samples", "kwargs", "error", "match"),
    [
        ([], {}, ValueError, "samples is empty"),
        ({"input_ids": [1]}, {}, TypeError, "samples must be a sequence"),
        ([{"input_ids": []}], {}, ValueError, r"samples\[0\]\['input_ids'\] is empty"),
        ([{"ids": [1]}], {}, ValueError, r"samples\[0\] has no 'input_ids'"),
        ([[1, 2]], {}, TypeError, r"samples\[0\] must be a mapping"),
        ([{"input_ids": [1, 2.5]}], {}, TypeError, r"\['input_ids'\]\[1\] must be an int"),
        ([{"input_ids": torch.ones(2, 2, dtype=torch.long)}], {}, TypeError, "1-D integer"),
        ([{"input_ids": [1, 2], "labels": [1]}], {}, ValueError, "has 1 tokens but"),
        ([{"input_ids": [1]}], {"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ([{"input_ids": [1]}], {"max_tokens": 2.0}, TypeError, "max_tokens must be an int"),
        ([{"input_ids": [1]}], {"pad_token_id": None}, TypeError, "pad_token_id must be an int"),
    ],
)
def test_pack_sft_bad_input(samples, kwargs, error, match):
    kwargs = {"max_tokens": 8, **kwargs}
    with pytest.raises(error, match=match):
        data.pack_sft(samples, **kwargs)


# ---------------------------------------------------------------------- pack_preference
def _random_pairs(g: torch.Generator, count: int, longest: int):
    def tokens(n):
        return torch.randint(1, 1000, (n,), generator=g).tolist()

    pairs = []
    for _ in range(count):
        p, c, r = (int(x) for x in torch.randint(1, max(2, longest // 3) + 1, (3,), generator=g))
        pairs.append({"prompt": tokens(p), "chosen": tokens(c), "rejected": tokens(r)})
    return pairs


@pytest.mark.parametrize("seed", range(BATCHES))
def test_pack_preference_layout_and_share_question_mask(seed):
    g = torch.Generator().manual_seed(seed)
    max_tokens = int(torch.randint(12, 60, (1,), generator=g))
    pairs = _random_pairs(g, int(torch.randint(1, 12, (1,), generator=g)), max_tokens)
    batch = data.pack_preference(pairs, max_tokens)
    ids, pos = batch["input_ids"], batch["position_ids"]
    rows, seqlen = ids.shape
    assert seqlen <= max_tokens

    # Independent dense construction: per pair, prompt P, chosen C, rejected R at [a, b).
    visible = torch.zeros(rows, 1, seqlen, seqlen, dtype=torch.bool)
    flat_ids = ids.flatten()
    used = torch.zeros(rows, seqlen, dtype=torch.bool)
    for i, pair in enumerate(pairs):
        p, c, r = (len(pair[k]) for k in ("prompt", "chosen", "rejected"))
        row = int(batch["pair_row"][i])
        last_c, last_r = (int(x) for x in batch["last_index"][2 * i : 2 * i + 2])
        start = last_c - c - p + 1 - row * seqlen  # column of the prompt's first token
        assert last_r == last_c + r
        span = slice(start, start + p + c + r)
        assert ids[row, span].tolist() == pair["prompt"] + pair["chosen"] + pair["rejected"]
        assert pos[row, span].tolist() == [*range(p + c), *range(p, p + r)]
        assert not bool(used[row, span].any())
        used[row, span] = True
        prompt = range(start, start + p)
        chosen = range(start + p, start + p + c)
        rejected = range(start + p + c, start + p + c + r)
        for q in (*prompt, *chosen, *rejected):
            for k in (*prompt, *(chosen if q in chosen else rejected if q in rejected else ())):
                visible[row, 0, q, k] = k <= q
        # Gather maps: every response token once, predicted from the previous token of its
        # own response, the first one from the prompt's last token.
        for response, tokens in ((2 * i, chosen), (2 * i + 1, rejected)):
            sel = batch["response_index"] == response
            targets = batch["token_index"][sel]
            predictors = batch["logit_index"][sel]
            assert targets.tolist() == [row * seqlen + t for t in tokens]
            expected = [row * seqlen + t for t in (start + p - 1, *tokens[:-1])]
            assert predictors.tolist() == expected
            assert flat_ids[targets].tolist() == pair["chosen" if response % 2 == 0 else "rejected"]
    mask = FlashMask(batch["startend_row_indices"], causal=True)
    assert torch.equal(mask.to_dense(), visible)
    assert bool((ids[~used] == 0).all())
    assert batch["token_index"].numel() == sum(len(q["chosen"]) + len(q["rejected"]) for q in pairs)


@pytest.mark.parametrize(
    ("pairs", "error", "match"),
    [
        ([], ValueError, "pairs is empty"),
        ([{"prompt": [1], "chosen": [2]}], ValueError, r"pairs\[0\] has no 'rejected'"),
        ([{"prompt": [], "chosen": [2], "rejected": [3]}], ValueError, "'prompt'.* is empty"),
        (
            [{"prompt": [1] * 5, "chosen": [2] * 3, "rejected": [3] * 3}],
            ValueError,
            r"pairs\[0\] has 11 tokens \(prompt 5 \+ chosen 3 \+ rejected 3\)",
        ),
    ],
)
def test_pack_preference_bad_input(pairs, error, match):
    with pytest.raises(error, match=match):
        data.pack_preference(pairs, 10)


def test_response_logps_and_scores_gather_by_pair():
    pairs = [
        {"prompt": [1, 2], "chosen": [3], "rejected": [4, 5]},
        {"prompt": [6], "chosen": [7, 8], "rejected": [9]},
    ]
    batch = data.pack_preference(pairs, 16)
    rows, seqlen = batch["input_ids"].shape
    vocab = 12
    logits = torch.randn(rows, seqlen, vocab, dtype=torch.float64)
    chosen, rejected = data.response_logps(logits, batch)
    logp = logits.log_softmax(-1).flatten(0, 1)
    for i, pair in enumerate(pairs):
        start = int(batch["last_index"][2 * i]) - len(pair["chosen"]) - len(pair["prompt"]) + 1
        p = len(pair["prompt"])
        want_c = sum(logp[start + p - 1 + k, t] for k, t in enumerate(pair["chosen"]))
        r0 = start + p + len(pair["chosen"])
        predictors = [start + p - 1, *range(r0, r0 + len(pair["rejected"]) - 1)]
        want_r = sum(logp[a, t] for a, t in zip(predictors, pair["rejected"], strict=True))
        torch.testing.assert_close(chosen[i], want_c)
        torch.testing.assert_close(rejected[i], want_r)
    scores = torch.arange(rows * seqlen, dtype=torch.float64).view(rows, seqlen, 1)
    c, r = data.response_scores(scores, batch)
    assert c.tolist() == batch["last_index"][0::2].tolist()
    assert r.tolist() == batch["last_index"][1::2].tolist()
    with pytest.raises(ValueError, match="logits must be a"):
        data.response_logps(logits[0], batch)
    with pytest.raises(ValueError, match="scores must be"):
        data.response_scores(scores[:, :-1], batch)


# ---------------------------------------------------------------------- losses, dense masks
def test_dpo_and_bradley_terry_losses():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.5))
    margin = (-1.0 - -2.0) - (-3.0 - -2.5)
    expected = -math.log(1 / (1 + math.exp(-0.5 * margin)))
    torch.testing.assert_close(data.dpo_loss(pc, pr, rc, rr, beta=0.5).item(), expected)
    torch.testing.assert_close(
        data.bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])).item(),
        (math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2,
    )
    with pytest.raises(ValueError, match="beta must be a positive number"):
        data.dpo_loss(pc, pr, rc, rr, beta=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        data.dpo_loss(pc, pr, rc, torch.zeros(2))
    with pytest.raises(TypeError, match=r"rejected_scores must be a torch\.Tensor"):
        data.bradley_terry_loss(pc, [1.0])


def test_dense_attention_mask_gives_padding_rows_their_diagonal():
    batch = data.pack_sft([{"input_ids": [1, 2, 3]}], 5, pad_to_max_tokens=True)
    dense = data.dense_attention_mask(batch["startend_row_indices"])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(dense[0, 0], expected)
    additive = data.dense_attention_mask(batch["startend_row_indices"], dtype=torch.float32)
    assert torch.equal(additive == 0, dense)
    assert additive.min().item() == torch.finfo(torch.float32).min
    with pytest.raises(TypeError, match=r"dtype must be torch\.bool or a float dtype"):
        data.dense_attention_mask(batch["startend_row_indices"], dtype=torch.int32)


def test_model_inputs_selects_and_moves():
    batch = data.pack_sft([{"input_ids": [1, 2, 3]}], 4)
    inputs = data.model_inputs(batch, "cpu")
    assert set(inputs) == {"input_ids", "labels", "position_ids", "startend_row_indices"}
