"""The public ``flashmask.flashmask_attention``: layouts, mask forms, ``window_size``, dtypes, and
one test per documented argument error (each error names the argument)."""

from __future__ import annotations

import pytest
import torch

import flashmask
from flashmask import FlashMask
from tests.strategies import FORM_IDS, FORMS, Form
from tests.tolerance import assert_close_to_reference, naive_attention, naive_logsumexp

LENGTHS = [(12, 12), (7, 13), (13, 7)]
LENGTH_IDS = [f"Sq{q}-Sk{k}" for q, k in LENGTHS]


def qkv(
    seed,
    batch=2,
    seqlen_q=12,
    seqlen_k=12,
    heads_q=4,
    heads_k=2,
    head_dim=8,
    dtype=torch.float64,
    head_dim_v=None,
    requires_grad=False,
):
    """q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hk, D]``, v ``[B, Sk, Hk, Dv]`` drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, seqlen_q, heads_q, head_dim),
        (batch, seqlen_k, heads_k, head_dim),
        (batch, seqlen_k, heads_k, head_dim_v or head_dim),
    ]
    return tuple(
        torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
        for s in shapes
    )


def random_indices(seed, form: Form, batch, heads, seqlen_q, seqlen_k) -> torch.Tensor:
    """Values in [-1, Sq + 1]: mostly in range, some clamped."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seqlen_k, form.bounds)
    return torch.randint(-1, seqlen_q + 2, shape, generator=g, dtype=torch.int32)


def window_dense(left, right, causal, seqlen_q, seqlen_k) -> torch.Tensor:
    """Query i (aligned to i' = i + Sk - Sq) sees keys [i' - left, i' + right]; -1 = unbounded;
    causal also hides keys after i'."""
    i = torch.arange(seqlen_q).view(-1, 1) + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k).view(1, -1)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0 and not causal:
        visible &= j <= i + right
    if causal:
        visible &= j <= i
    return visible


# ---------------------------------------------------------------------------- semantics
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("mask_heads", ["Hm1", "HmHk", "HmHq"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), LENGTHS, ids=LENGTH_IDS)
def test_matches_the_dense_definition(form, mask_heads, seqlen_q, seqlen_k):
    """[B, S, H, D] layout, GQA (Hq=4, Hk=2), Hm in {1, Hk, Hq}, Sq != Sk: out and lse equal
    naive float64 attention under ``to_dense`` of the same indices."""
    heads_m = {"Hm1": 1, "HmHk": 2, "HmHq": 4}[mask_heads]
    q, k, v = qkv(1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_v=5)
    indices = random_indices(2, form, 2, heads_m, seqlen_q, seqlen_k)
    out, lse = flashmask.flashmask_attention(
        q, k, v, indices, causal=form.causal, return_softmax_lse=True
    )
    dense = flashmask.to_dense(indices, causal=form.causal, seqlen_q=seqlen_q)
    assert out.shape == (2, seqlen_q, 4, 5)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense, 8**-0.5))
    torch.testing.assert_close(lse, naive_logsumexp(q, k, dense, 8**-0.5))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), LENGTHS, ids=LENGTH_IDS)
def test_without_indices_is_full_or_bottom_right_causal_attention(causal, seqlen_q, seqlen_k):
    q, k, v = qkv(3, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    dense = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        dense = dense.tril(seqlen_k - seqlen_q)
    out = flashmask.flashmask_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense, 8**-0.5))


WINDOWS = [3, 0, (2, 1), (0, 4), (-1, 2), (2, -1), (-1, -1)]


@pytest.mark.parametrize("window_size", WINDOWS, ids=[str(w) for w in WINDOWS])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), LENGTHS, ids=LENGTH_IDS)
def test_window_size_matches_the_dense_definition(window_size, causal, seqlen_q, seqlen_k):
    """``window_size`` w or (left, right): query i' = i + Sk - Sq sees keys [i' - left,
    i' + right] (-1 unbounded); ``right`` is ignored when causal."""
    left, right = (window_size, window_size) if isinstance(window_size, int) else window_size
    q, k, v = qkv(4, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    out = flashmask.flashmask_attention(q, k, v, causal=causal, window_size=window_size)
    dense = window_dense(left, right, causal, seqlen_q, seqlen_k)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense, 8**-0.5))


def test_3d_indices_are_read_as_one_bound_per_column():
    q, k, v = qkv(5)
    indices = random_indices(6, Form(True, 1), 2, 2, 12, 12)
    out3 = flashmask.flashmask_attention(q, k, v, indices[..., 0], causal=True)
    out4 = flashmask.flashmask_attention(q, k, v, indices, causal=True)
    assert torch.equal(out3, out4)
    with pytest.raises(ValueError, match=r"startend_row_indices.*causal is False.*but got 1"):
        flashmask.flashmask_attention(q, k, v, indices[..., 0])


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_a_flashmask_can_replace_the_raw_indices(form):
    """A FlashMask carries its own causal flag; passing ``causal=False`` with it is fine."""
    q, k, v = qkv(7)
    indices = random_indices(8, form, 2, 1, 12, 12)
    raw = flashmask.flashmask_attention(q, k, v, indices, causal=form.causal)
    mask = FlashMask(indices, form.causal)
    assert torch.equal(flashmask.flashmask_attention(q, k, v, mask), raw)
    assert torch.equal(flashmask.flashmask_attention(q, k, v, mask, causal=form.causal), raw)


def test_causal_true_conflicts_with_a_non_causal_flashmask():
    q, k, v = qkv(9)
    mask = FlashMask(random_indices(0, Form(False, 2), 2, 1, 12, 12), causal=False)
    with pytest.raises(ValueError, match="causal=True conflicts with a non-causal FlashMask"):
        flashmask.flashmask_attention(q, k, v, mask, causal=True)


def test_softmax_scale_defaults_to_head_dim_to_the_minus_half():
    q, k, v = qkv(10, head_dim=16)
    default = flashmask.flashmask_attention(q, k, v, causal=True)
    assert torch.equal(
        default, flashmask.flashmask_attention(q, k, v, causal=True, softmax_scale=0.25)
    )
    scaled = flashmask.flashmask_attention(q, k, v, causal=True, softmax_scale=2)
    dense = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(scaled, naive_attention(q, k, v, dense, 2.0))


@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
    ids=["fp16", "bf16", "fp32", "fp64"],
)
def test_return_softmax_lse_shape_and_dtype(dtype, lse_dtype):
    q, k, v = qkv(11, batch=3, seqlen_q=5, seqlen_k=7, heads_q=6, heads_k=3, dtype=dtype)
    out = flashmask.flashmask_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (3, 5, 6, 8)
    out, lse = flashmask.flashmask_attention(q, k, v, return_softmax_lse=True)
    assert out.dtype == dtype
    assert lse.shape == (3, 6, 5) and lse.dtype == lse_dtype


def test_deterministic_gives_the_same_result():
    q, k, v = qkv(12, requires_grad=True)
    out = flashmask.flashmask_attention(q, k, v, causal=True)
    again = flashmask.flashmask_attention(q, k, v, causal=True, deterministic=True)
    assert torch.equal(out, again)


def test_strided_views_give_the_same_result_as_contiguous_inputs():
    """q/k/v as views into one fused [B, S, 3, H, D] buffer and a [B, H, S, D] transpose."""
    g = torch.Generator().manual_seed(13)
    fused = torch.randn(2, 12, 3, 2, 8, generator=g, dtype=torch.float64)
    q, k, v = fused.unbind(2)
    transposed = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    indices = random_indices(14, Form(False, 4), 2, 2, 12, 12)
    for args in ((q, k, v), (transposed, k, v)):
        strided = flashmask.flashmask_attention(*args, indices)
        contiguous = flashmask.flashmask_attention(*(t.contiguous() for t in args), indices)
        torch.testing.assert_close(strided, contiguous, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_low_precision_inputs_are_as_accurate_as_plain_attention(dtype, form):
    """fp16/bf16 on the CPU: out, dq, dk, dv within the tolerance rule against float64, with a
    plain low-precision dense attention as the error yardstick."""
    q, k, v = qkv(15, seqlen_q=16, seqlen_k=16, dtype=dtype, requires_grad=True)
    indices = random_indices(16, form, 2, 2, 16, 16)
    dense = flashmask.to_dense(indices, causal=form.causal)
    dout = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(17)).to(dtype)
    scale = 8**-0.5

    def run(fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        return (out, *torch.autograd.grad(out, args[:3], dout.to(out.dtype)))

    actual = run(flashmask.flashmask_attention, q, k, v, indices, causal=form.causal)
    hi = run(
        naive_attention, *(t.detach().double().requires_grad_() for t in (q, k, v)), dense, scale
    )
    lo = run(naive_attention, q, k, v, dense, scale, dtype=dtype)
    for name, a, h, low in zip(("out", "dq", "dk", "dv"), actual, hi, lo, strict=True):
        assert a.dtype == dtype
        assert_close_to_reference(a, h, low, name, context=f"{form.name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_row_masked_gives_zeros_never_nan(dtype):
    q, k, v = qkv(18, dtype=dtype, requires_grad=True)
    nothing_visible = torch.zeros(2, 1, 12, 1, dtype=torch.int32)  # LTS = 0 masks every row
    out, lse = flashmask.flashmask_attention(
        q, k, v, nothing_visible, causal=True, return_softmax_lse=True
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("-inf")).all())
    grads = torch.autograd.grad(out.sum() + torch.where(lse.isinf(), 0.0, lse).sum(), (q, k, v))
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


# ---------------------------------------------------------------------------- sinks
def naive_attention_with_sinks(q, k, v, dense_mask, scale, sinks):
    """``(out, lse)`` of float64 dense attention whose softmax takes one more column per query
    head, ``sinks[h]``, that carries no value (gpt-oss's sinks, written out directly)."""
    hq, hk = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    scores = qh @ kh.mT * scale
    if dense_mask is not None:
        visible = dense_mask.repeat_interleave(hq // dense_mask.shape[1], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
    column = sinks.to(scores.dtype).view(1, hq, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat([scores, column], dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return (p @ vh).transpose(1, 2), torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), LENGTHS, ids=LENGTH_IDS)
def test_sinks_join_every_rows_softmax_with_their_gradients(form, seqlen_q, seqlen_k):
    """out, lse and the gradients of q, k, v and the sinks equal float64 dense attention with
    one extra softmax column per query head (GQA, Sq != Sk, rows that see no key included)."""
    q, k, v = qkv(5, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_v=5, requires_grad=True)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    sinks.requires_grad_(True)
    indices = random_indices(7, form, 2, 2, seqlen_q, seqlen_k)
    out, lse = flashmask.flashmask_attention(
        q, k, v, indices, causal=form.causal, return_softmax_lse=True, sinks=sinks
    )
    dense = flashmask.to_dense(indices, causal=form.causal, seqlen_q=seqlen_q)
    ref_out, ref_lse = naive_attention_with_sinks(q, k, v, dense, 8**-0.5, sinks)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.Generator().manual_seed(8)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    inputs = (q, k, v, sinks)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), inputs)
    ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), inputs)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref, strict=True):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


def test_with_sinks_a_row_that_sees_no_key_gives_zeros_and_the_sink_as_lse():
    q, k, v = qkv(9)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    hidden = torch.full((2, 1, 12, 1), 0, dtype=torch.int32)  # LTS = 0: every row hidden
    out, lse = flashmask.flashmask_attention(
        q, k, v, hidden, causal=True, return_softmax_lse=True, sinks=sinks
    )
    assert (out == 0).all()
    torch.testing.assert_close(lse, sinks.view(1, 4, 1).expand(2, 4, 12))


def test_sinks_of_minus_infinity_change_nothing():
    q, k, v = qkv(10)
    plain, plain_lse = flashmask.flashmask_attention(q, k, v, causal=True, return_softmax_lse=True)
    out, lse = flashmask.flashmask_attention(
        q, k, v, causal=True, return_softmax_lse=True, sinks=torch.full((4,), float("-inf"))
    )
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(lse, plain_lse)


def test_low_precision_sinks_get_a_gradient_of_their_dtype():
    q, k, v = qkv(11, dtype=torch.float32)
    sinks = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    flashmask.flashmask_attention(q, k, v, sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- logit cap
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), LENGTHS, ids=LENGTH_IDS)
def test_softcap_caps_the_scaled_scores_before_the_mask(form, seqlen_q, seqlen_k):
    """out, lse and gradients equal float64 dense attention over ``cap * tanh(s / cap)``."""
    q, k, v = qkv(14, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_v=5, requires_grad=True)
    indices = random_indices(15, form, 2, 2, seqlen_q, seqlen_k)
    out, lse = flashmask.flashmask_attention(
        q, k, v, indices, causal=form.causal, return_softmax_lse=True, softcap=0.7
    )
    visible = flashmask.to_dense(indices, causal=form.causal, seqlen_q=seqlen_q)
    visible = visible.repeat_interleave(2, dim=1)  # mask heads -> query heads
    kh, vh = (t.transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    scores = 0.7 * torch.tanh(q.transpose(1, 2) @ kh.mT * 8**-0.5 / 0.7)
    scores = scores.masked_fill(~visible, float("-inf"))
    seen = visible.any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, scores, 0.0), dim=-1) * visible
    ref_out = (p @ vh).transpose(1, 2)
    ref_lse = torch.where(seen, scores, 0.0).logsumexp(-1).masked_fill(~seen[..., 0], -torch.inf)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(16), dtype=out.dtype)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want)


def test_softcap_zero_or_none_is_off():
    q, k, v = qkv(17)
    plain = flashmask.flashmask_attention(q, k, v, causal=True)
    assert torch.equal(flashmask.flashmask_attention(q, k, v, causal=True, softcap=0), plain)
    assert torch.equal(flashmask.flashmask_attention(q, k, v, causal=True, softcap=None), plain)


# ---------------------------------------------------------------------------- errors
def _call(**overrides):
    """Call flashmask_attention with valid float32 arguments, some replaced by ``overrides``."""
    args = {
        "query": torch.zeros(2, 6, 4, 8),
        "key": torch.zeros(2, 5, 2, 8),
        "value": torch.zeros(2, 5, 2, 8),
        "startend_row_indices": torch.zeros(2, 1, 5, 2, dtype=torch.int32),
        "causal": False,
    }
    args.update(overrides)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    return flashmask.flashmask_attention(q, k, v, **args)


def test_the_valid_call_used_by_the_error_tests_runs():
    assert _call().shape == (2, 6, 4, 8)


Z, I32 = torch.zeros, torch.int32
META = {"device": "meta"}
NO_MASK = {"startend_row_indices": None}
ERRORS = [
    pytest.param(
        {"query": [[1.0]]},
        TypeError,
        "query must be a torch.Tensor, got list",
        id="query-non-tensor",
    ),
    pytest.param(
        {"key": Z(2, 5, 8)},
        ValueError,
        r"key must be 4-D \[batch, seqlen, heads, head_dim\]",
        id="key-rank-3",
    ),
    pytest.param(
        {"value": Z(2, 5, 2, 8, dtype=torch.int64)},
        TypeError,
        "value.dtype must be float16, bfloat16, float32 or float64",
        id="value-int",
    ),
    pytest.param(
        {"key": Z(2, 5, 2, 8, dtype=torch.float64)},
        TypeError,
        "query, key and value must share a dtype",
        id="dtype-mismatch",
    ),
    pytest.param(
        {"query": Z(2, 6, 4, 8, **META)},
        ValueError,
        "query, key and value must be on one device",
        id="device-mismatch",
    ),
    pytest.param(
        {"value": Z(3, 5, 2, 8)},
        ValueError,
        "query, key and value must share the batch size",
        id="batch-mismatch",
    ),
    pytest.param(
        {"value": Z(2, 4, 2, 8)},
        ValueError,
        "key and value must share seqlen_k",
        id="seqlen_k-mismatch",
    ),
    pytest.param(
        {"value": Z(2, 5, 1, 8)},
        ValueError,
        "key and value must share the number of heads",
        id="kv-heads-mismatch",
    ),
    pytest.param(
        {"key": Z(2, 5, 2, 4), "value": Z(2, 5, 2, 4)},
        ValueError,
        "query and key must share head_dim",
        id="head_dim-mismatch",
    ),
    pytest.param(
        {"key": Z(2, 5, 3, 8), "value": Z(2, 5, 3, 8)},
        ValueError,
        "Number of heads in key/value must divide number of heads in query",
        id="heads-not-divisible",
    ),
    pytest.param(
        {"query": Z(2, 0, 4, 8)},
        ValueError,
        "query must not have an empty dimension",
        id="empty-seqlen_q",
    ),
    pytest.param(
        {"key": Z(2, 0, 2, 8), "value": Z(2, 0, 2, 8), **NO_MASK},
        ValueError,
        "key must not have an empty dimension",
        id="empty-seqlen_k",
    ),
    pytest.param(
        {"query": Z(2, 6, 4, 0), "key": Z(2, 5, 2, 0)},
        ValueError,
        "query must not have an empty dimension",
        id="empty-head_dim",
    ),
    pytest.param(
        {"query": Z(0, 6, 4, 8), "key": Z(0, 5, 2, 8), "value": Z(0, 5, 2, 8)},
        ValueError,
        "query must not have an empty dimension",
        id="empty-batch",
    ),
    pytest.param(
        {"startend_row_indices": [[0, 1]]},
        TypeError,
        "startend_row_indices must be a torch.Tensor, a FlashMask or None, got list",
        id="indices-non-tensor",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 1, 5, 2, dtype=torch.int64)},
        TypeError,
        "startend_row_indices.dtype must be torch.int32",
        id="indices-dtype",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 5, dtype=I32)},
        ValueError,
        "startend_row_indices must have rank 4",
        id="indices-rank-2",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 1, 5, 2, 1, dtype=I32)},
        ValueError,
        "startend_row_indices must have rank 4",
        id="indices-rank-5",
    ),
    pytest.param(
        {"startend_row_indices": Z(1, 1, 5, 2, dtype=I32)},
        ValueError,
        r"startend_row_indices.shape\[0\] must be equal to batch_size, but got 1 and 2",
        id="indices-batch",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 3, 5, 2, dtype=I32)},
        ValueError,
        r"startend_row_indices.shape\[1\] \(mask heads\) must be 1 \(broadcast\), "
        "the number of key/value heads 2 or of query heads 4, but got 3",
        id="indices-heads",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 1, 6, 2, dtype=I32)},
        ValueError,
        r"startend_row_indices.shape\[2\] must be equal to seqlen_k, but got 6 and 5",
        id="indices-seqlen_k",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 1, 5, 1, dtype=I32)},
        ValueError,
        "startend_row_indices: when causal is False, the last dimension should be 2 or 4",
        id="indices-C1-noncausal",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 1, 5, 4, dtype=I32), "causal": True},
        ValueError,
        "startend_row_indices: when causal is True, the last dimension should be 1 or 2",
        id="indices-C4-causal",
    ),
    pytest.param(
        {"startend_row_indices": Z(2, 0, 5, 2, dtype=I32)},
        ValueError,
        "startend_row_indices must have non-empty",
        id="indices-empty",
    ),
    pytest.param(
        {
            "query": Z(2, 6, 4, 8, **META),
            "key": Z(2, 5, 2, 8, **META),
            "value": Z(2, 5, 2, 8, **META),
        },
        ValueError,
        "startend_row_indices must be on the query's device meta, got cpu",
        id="indices-device",
    ),
    pytest.param({"causal": 1}, TypeError, "causal must be a bool, got int", id="causal-int"),
    pytest.param(
        {"causal": None}, TypeError, "causal must be a bool, got NoneType", id="causal-none"
    ),
    pytest.param(
        {"return_softmax_lse": 1},
        TypeError,
        "return_softmax_lse must be a bool",
        id="return_softmax_lse-int",
    ),
    pytest.param(
        {"deterministic": "yes"}, TypeError, "deterministic must be a bool", id="deterministic-str"
    ),
    pytest.param(
        {"softmax_scale": "0.5"},
        TypeError,
        "softmax_scale must be a float or None, got str",
        id="softmax_scale-str",
    ),
    pytest.param(
        {"softmax_scale": True},
        TypeError,
        "softmax_scale must be a float or None, got bool",
        id="softmax_scale-bool",
    ),
    pytest.param(
        {"softmax_scale": torch.tensor(0.5)},
        TypeError,
        "softmax_scale must be a float or None, got Tensor",
        id="softmax_scale-tensor",
    ),
    pytest.param(
        {"softmax_scale": float("inf")},
        ValueError,
        "softmax_scale must be finite, got inf",
        id="softmax_scale-inf",
    ),
    pytest.param(
        {"softmax_scale": float("nan")},
        ValueError,
        "softmax_scale must be finite, got nan",
        id="softmax_scale-nan",
    ),
    pytest.param(
        {"window_size": 2},
        ValueError,
        "can't use window_size with startend_row_indices",
        id="window-with-indices",
    ),
    pytest.param(
        {"window_size": True, **NO_MASK},
        TypeError,
        r"window_size must be an int or a \(left, right\) pair of ints",
        id="window-bool",
    ),
    pytest.param(
        {"window_size": 1.5, **NO_MASK},
        TypeError,
        r"window_size must be an int or a \(left, right\) pair of ints, got 1.5",
        id="window-float",
    ),
    pytest.param(
        {"window_size": (1, 2, 3), **NO_MASK},
        TypeError,
        r"window_size must be an int or a \(left, right\) pair of ints, got \(1, 2, 3\)",
        id="window-triple",
    ),
    pytest.param(
        {"window_size": (-2, 1), **NO_MASK},
        ValueError,
        "window_size entries must be >= -1",
        id="window-below-minus-one",
    ),
    pytest.param({"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor", id="sinks-list"),
    pytest.param(
        {"sinks": Z(4, dtype=I32)}, TypeError, "sinks must be a floating tensor", id="sinks-int"
    ),
    pytest.param(
        {"sinks": Z(2)}, ValueError, r"sinks must have shape \[Hq\] = \[4\]", id="sinks-shape"
    ),
    pytest.param({"sinks": Z(4, **META)}, ValueError, "sinks is on meta", id="sinks-device"),
    pytest.param({"softcap": "50"}, TypeError, "softcap must be a float", id="softcap-str"),
    pytest.param({"softcap": True}, TypeError, "softcap must be a float", id="softcap-bool"),
    pytest.param({"softcap": -1.0}, ValueError, "softcap must be a finite number", id="softcap<0"),
    pytest.param(
        {"softcap": float("inf")}, ValueError, "softcap must be a finite number", id="softcap-inf"
    ),
]


@pytest.mark.parametrize(("overrides", "error", "match"), ERRORS)
def test_invalid_arguments_raise_an_error_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_meta_tensors_give_output_shapes_without_computing():
    q = torch.zeros(2, 6, 4, 8, device="meta")
    k = torch.zeros(2, 5, 2, 8, device="meta")
    v = torch.zeros(2, 5, 2, 3, device="meta")
    indices = torch.zeros(2, 2, 5, 4, dtype=torch.int32, device="meta")
    out, lse = flashmask.flashmask_attention(q, k, v, indices, return_softmax_lse=True)
    assert out.shape == (2, 6, 4, 3) and out.device.type == "meta"
    assert lse.shape == (2, 4, 6) and lse.dtype == torch.float32
