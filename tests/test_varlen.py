"""``flashmask_varlen_attention``: packed sequences attend within their own segment, exactly as
each sequence alone would (outputs, lse and gradients), padding past the last boundary sees and
is seen by nothing, an extra FlashMask over the packed axis intersects, and bad arguments raise
errors naming them."""

from __future__ import annotations

import pytest
import torch

import flashmask
from flashmask import masks
from flashmask.varlen import flashmask_varlen_attention, segment_mask
from tests.tolerance import naive_attention

HQ, HK, D, DV = 4, 2, 8, 6


def packed(lengths: list[int], heads: int, dim: int, seed: int, pad: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths) + pad, heads, dim, generator=g, dtype=torch.float64)
    return x.requires_grad_(True)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def one_by_one(q, k, v, lengths_q, lengths_k, causal, window_size=None):
    """Each segment alone through flashmask_attention (bottom-right causal, ``window_size`` as
    there), concatenated."""
    outs, lses = [], []
    cq, ck = cumulative(lengths_q).tolist(), cumulative(lengths_k).tolist()
    for r in range(len(lengths_q)):
        if lengths_q[r] == 0:  # a segment without queries adds no rows
            continue
        out, lse = flashmask.flashmask_attention(
            q[None, cq[r] : cq[r + 1]], k[None, ck[r] : ck[r + 1]], v[None, ck[r] : ck[r + 1]],
            causal=causal, window_size=window_size, return_softmax_lse=True,
        )  # fmt: skip
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


CASES = [
    pytest.param([5, 1, 7], None, id="self-attention"),
    pytest.param([5, 1, 7], [9, 4, 7], id="cached-keys"),  # chunked prefill / continuous batching
    pytest.param([3, 0, 4], [3, 2, 6], id="empty-query-segment"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("lengths_q", "lengths_k"), CASES)
def test_each_segment_attends_as_if_alone(lengths_q, lengths_k, causal):
    same = lengths_k is None
    lengths_k = lengths_q if same else lengths_k
    q = packed(lengths_q, HQ, D, 1)
    k, v = packed(lengths_k, HK, D, 2), packed(lengths_k, HK, DV, 3)
    cu_k = None if same else cumulative(lengths_k)
    out, lse = flashmask_varlen_attention(
        q, k, v, cumulative(lengths_q), cu_k, max(lengths_q), max(lengths_k), causal=causal,
        return_softmax_lse=True,
    )  # fmt: skip
    ref_out, ref_lse = one_by_one(q, k, v, lengths_q, lengths_k, causal)
    assert out.shape == (sum(lengths_q), HQ, DV) and lse.shape == (HQ, sum(lengths_q))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window_size", [2, (3, 1), (-1, 2), (1, -1)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("lengths_q", "lengths_k"), [([5, 8], None), ([4, 3], [9, 6])])
def test_a_window_applies_within_each_segment(lengths_q, lengths_k, causal, window_size):
    """``window_size`` around each query's position in its own segment, as each segment alone
    with the same ``window_size`` (bottom-right aligned where there are more keys)."""
    same = lengths_k is None
    lengths_k = lengths_q if same else lengths_k
    q = packed(lengths_q, HQ, D, 20)
    k, v = packed(lengths_k, HK, D, 21), packed(lengths_k, HK, DV, 22)
    out = flashmask_varlen_attention(
        q, k, v, cumulative(lengths_q), None if same else cumulative(lengths_k), causal=causal,
        window_size=window_size,
    )  # fmt: skip
    want, _ = one_by_one(q, k, v, lengths_q, lengths_k, causal, window_size)
    torch.testing.assert_close(out, want)


def test_padding_past_the_last_boundary_sees_and_is_seen_by_nothing():
    lengths = [4, 6]
    q, k, v = (packed(lengths, h, d, s, pad=3) for h, d, s in ((HQ, D, 5), (HK, D, 6), (HK, D, 7)))
    out, lse = flashmask_varlen_attention(
        q, k, v, cumulative(lengths), causal=True, return_softmax_lse=True
    )
    assert (out[10:] == 0).all() and (lse[:, 10:] == float("-inf")).all()
    ref_out, _ = one_by_one(q, k, v, lengths, lengths, True)
    torch.testing.assert_close(out[:10], ref_out)
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert (dk[10:] == 0).all() and (dv[10:] == 0).all()


def test_a_mask_over_the_packed_axis_intersects_with_the_segments():
    lengths = [6, 9]
    q, k, v = packed(lengths, HQ, D, 8), packed(lengths, HK, D, 9), packed(lengths, HK, DV, 10)
    window = masks.sliding_window(15, window=3)  # over the whole packing
    out = flashmask_varlen_attention(q, k, v, cumulative(lengths), causal=True, mask=window)
    visible = segment_mask(cumulative(lengths), None, 15, 15, causal=True).to_dense(15)
    visible = visible & window.to_dense(15)
    want = naive_attention(q[None], k[None], v[None], visible, D**-0.5)[0]
    torch.testing.assert_close(out, want)
    # The window does cut inside the second segment: the result is not the segments' alone.
    assert not torch.allclose(out, one_by_one(q, k, v, lengths, lengths, True)[0])


def test_sinks_pass_through():
    lengths = [3, 5]
    q, k, v = packed(lengths, HQ, D, 11), packed(lengths, HK, D, 12), packed(lengths, HK, D, 13)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    out = flashmask_varlen_attention(q, k, v, cumulative(lengths), sinks=sinks)
    mask = segment_mask(cumulative(lengths), None, 8, 8, causal=False)
    want = flashmask.flashmask_attention(q[None], k[None], v[None], mask, sinks=sinks)[0]
    torch.testing.assert_close(out, want)


def _call(**overrides):
    args = {
        "query": torch.zeros(7, HQ, D),
        "key": torch.zeros(7, HK, D),
        "value": torch.zeros(7, HK, D),
        "cu_seqlens_q": torch.tensor([0, 3, 7]),
    }
    args.update(overrides)
    return flashmask_varlen_attention(**args)


def test_the_valid_call_used_by_the_error_tests_runs():
    assert _call().shape == (7, HQ, D)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"query": torch.zeros(1, 7, HQ, D)}, ValueError, "query must be 3-D"),
        ({"key": [0.0]}, TypeError, "key must be a torch.Tensor"),
        ({"cu_seqlens_q": torch.tensor([0.0, 7.0])}, TypeError, "cu_seqlens_q must be an integer"),
        ({"cu_seqlens_q": torch.tensor([[0, 7]])}, ValueError, r"cu_seqlens_q must be 1-D"),
        ({"cu_seqlens_q": torch.tensor([7])}, ValueError, "at least two cumulative lengths"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 3])}, ValueError, "cu_seqlens_q must rise from 0"),
        ({"cu_seqlens_q": torch.tensor([0, 9])}, ValueError, "at most total_q = 7"),
        (
            {"cu_seqlens_k": torch.tensor([0, 7])},
            ValueError,
            "cu_seqlens_q and cu_seqlens_k must describe the same segments",
        ),
        (
            {"key": torch.zeros(9, HK, D), "value": torch.zeros(9, HK, D)},
            ValueError,
            "cu_seqlens_k is needed",
        ),
        ({"max_seqlen_q": 2.5}, TypeError, "max_seqlen_q must be a non-negative int"),
        ({"mask": torch.zeros(1, 7, 2, dtype=torch.int32)}, TypeError, "mask must be a FlashMask"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"window_size": (1, 2, 3)}, TypeError, "window_size must be an int or a"),
        ({"window_size": -2}, ValueError, "window_size entries must be >= -1"),
        (
            {"query": torch.zeros(7, HQ, D, dtype=torch.float8_e4m3fn)},
            TypeError,
            "query is float8_e4m3fn: packed sequences take no FP8 inputs",
        ),
    ],
)
def test_invalid_arguments_raise_an_error_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)
