"""The chunked reference (``flashmask.reference``) is the oracle: check it against a naive float64
dense softmax, against autograd, and on the edge cases it must get exactly right."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask
from flashmask import FlashMask
from flashmask.reference import reference_backward, reference_forward
from tests.strategies import FORM_IDS, FORMS, Form, flashmasks, random_cases
from tests.tolerance import naive_attention, naive_logsumexp

forms = pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
mask_heads = pytest.mark.parametrize("mask_heads", ["Hm1", "HmHk"])
HEAD_CONFIGS = [(2, 2), (4, 2), (4, 1)]  # (Hq, Hk): MHA, GQA, MQA


def randn(generator: torch.Generator, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=dtype)


def make_qkv(seed, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim_v, dtype):
    g = torch.Generator().manual_seed(seed)
    q = randn(g, batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k = randn(g, batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    v = randn(g, batch, seqlen_k, heads_k, head_dim_v, dtype=dtype)
    return q, k, v


def naive_grads(q, k, v, dense, scale, dout, dlse):
    """(dq, dk, dv) of ``sum(out * dout) + sum(lse * dlse)`` by autograd through the naive oracle,
    with ``dlse`` ignored on fully masked rows (their lse is the constant -inf)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = naive_attention(q, k, v, dense, scale)
    lse = naive_logsumexp(q, k, dense, scale)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    loss = (out * dout).sum() + (lse * dlse).sum()
    return torch.autograd.grad(loss, (q, k, v))


# ---------------------------------------------------------------------------- vs naive float64
@forms
@mask_heads
@settings(max_examples=random_cases(25))
@given(data=st.data())
def test_reference_matches_naive_attention_and_autograd(form, mask_heads, data):
    """Random masks of every form (incl. Sq != Sk, GQA/MQA, Dv != D, a random softmax_scale):
    forward, lse and all gradients (with an lse gradient) equal the naive float64 oracle, and
    chunking by 3 query rows changes nothing."""
    heads_q, heads_k = data.draw(st.sampled_from(HEAD_CONFIGS), label="(Hq, Hk)")
    hm = 1 if mask_heads == "Hm1" else heads_k
    drawn = data.draw(flashmasks(form, max_seqlen=48, mask_heads=(hm,)), label="mask")
    m, sq, sk = drawn.mask, drawn.seqlen_q, drawn.seqlen_k
    head_dim, head_dim_v = data.draw(st.sampled_from([(8, 8), (8, 5), (3, 6)]), label="(D, Dv)")
    scale = data.draw(st.floats(0.05, 2.0), label="softmax_scale")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(
        seed, m.batch_size, sq, sk, heads_q, heads_k, head_dim, head_dim_v, torch.float64
    )
    intervals = m.intervals(sq)
    dense = m.to_dense(sq)

    out, lse = reference_forward(q, k, v, intervals, m.causal, scale)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense, scale))
    torch.testing.assert_close(lse, naive_logsumexp(q, k, dense, scale))

    g = torch.Generator().manual_seed(seed + 1)
    dout, dlse = randn(g, *out.shape), randn(g, *lse.shape)
    grads = reference_backward(dout, dlse, q, k, v, out, lse, intervals, m.causal, scale)
    for name, got, want in zip(
        "qkv", grads, naive_grads(q, k, v, dense, scale, dout, dlse), strict=True
    ):
        torch.testing.assert_close(got, want, msg=lambda s, n=name: f"d{n}: {s}")

    out3, lse3 = reference_forward(q, k, v, intervals, m.causal, scale, chunk_size=3)
    torch.testing.assert_close(out3, out)
    torch.testing.assert_close(lse3, lse)
    grads3 = reference_backward(
        dout, dlse, q, k, v, out, lse, intervals, m.causal, scale, chunk_size=3
    )
    for got, want in zip(grads3, grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("seqlen_q", "seqlen_k"), [(5, 9), (9, 5), (1, 7), (7, 1), (6, 6)], ids=lambda s: f"{s}"
)
def test_reference_without_indices_is_plain_or_bottom_right_causal_attention(
    causal, seqlen_q, seqlen_k
):
    """``intervals=None``: full attention, or causal with key j hidden from query i when
    ``j > i + Sk - Sq`` (rows i < Sq - Sk see nothing)."""
    q, k, v = make_qkv(0, 2, seqlen_q, seqlen_k, 4, 2, 8, 8, torch.float64)
    dense = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        dense = dense.tril(seqlen_k - seqlen_q)
    out, lse = reference_forward(q, k, v, None, causal, 0.3)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense, 0.3))
    torch.testing.assert_close(lse, naive_logsumexp(q, k, dense, 0.3))
    g = torch.Generator().manual_seed(1)
    dout, dlse = randn(g, *out.shape), randn(g, *lse.shape)
    grads = reference_backward(dout, dlse, q, k, v, out, lse, None, causal, 0.3)
    for got, want in zip(grads, naive_grads(q, k, v, dense, 0.3, dout, dlse), strict=True):
        torch.testing.assert_close(got, want)


def test_reference_keeps_input_dtype_and_computes_lse_in_float32_for_low_precision():
    q, k, v = make_qkv(0, 1, 5, 5, 2, 2, 4, 4, torch.bfloat16)
    out, lse = reference_forward(q, k, v, None, True, 0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    dq, dk, dv = reference_backward(torch.ones_like(out), None, q, k, v, out, lse, None, True, 0.5)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def test_probability_dtype_rounds_the_probabilities_before_the_value_product_only():
    """An FP8 kernel's emulation: ``P = exp(s - row_max)`` rounded to ``probability_dtype`` enters
    ``P V``; the row sums (and so lse) are those of the unrounded ``P``."""
    q, k, v = make_qkv(1, 1, 6, 9, 2, 1, 8, 4, torch.float32)
    out, lse = reference_forward(q, k, v, None, True, 0.5, probability_dtype=torch.bfloat16)
    exact_out, exact_lse = reference_forward(q, k, v, None, True, 0.5)
    assert torch.equal(lse, exact_lse) and not torch.equal(out, exact_out)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, 2, -1)) * 0.5
    visible = torch.ones(6, 9, dtype=torch.bool).tril(3)  # bottom-right causal
    scores = scores.masked_fill(~visible, -torch.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    want = (p.bfloat16().float() @ v.expand(-1, -1, 2, -1).transpose(1, 2)) / p.sum(-1, True)
    torch.testing.assert_close(out, want.transpose(1, 2))


# ---------------------------------------------------------------------------- gradcheck
def mask_hiding_row(form: Form, heads: int, seqlen: int, row: int, seed: int) -> FlashMask:
    """A random mask of ``form`` (Sq = Sk = seqlen) in which query ``row`` sees no key."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, seqlen + 1, (1, heads, seqlen, form.bounds), generator=g)
    cols = torch.arange(seqlen).view(1, 1, seqlen)
    # The causal part already hides columns j > row from the row; mask the rest via LT.
    hide = cols <= row if form.causal else torch.ones_like(cols, dtype=torch.bool)
    values[..., 0] = torch.where(hide, values[..., 0].clamp(max=row), values[..., 0])
    has_lte = form.bounds == 4 or (form.causal and form.bounds == 2)
    if has_lte:
        values[..., 1] = torch.where(hide, values[..., 1].clamp(min=row + 1), values[..., 1])
    m = FlashMask(values.to(torch.int32), form.causal)
    assert not m.to_dense()[..., row, :].any()  # test setup, not user input
    return m


@forms
@mask_heads
def test_gradcheck_through_flashmask_attention(form, mask_heads):
    """float64 gradcheck of (out, lse) on (B=1, Hq=2, Sq=Sk=11, D=4), every form, with query row 5
    fully masked: out is checked everywhere (a fully masked row's out is the constant 0), lse
    only where it is finite."""
    heads_k = 1 if mask_heads == "Hm1" else 2
    m = mask_hiding_row(form, 1 if mask_heads == "Hm1" else heads_k, 11, row=5, seed=7)
    q, k, v = make_qkv(3, 1, 11, 11, 2, heads_k, 4, 4, torch.float64)
    finite = m.to_dense().any(-1).repeat_interleave(2 // m.num_heads, dim=1)  # [B, Hq, Sq]

    def attention(q, k, v):
        out, lse = flashmask.flashmask_attention(q, k, v, m, return_softmax_lse=True)
        return out, torch.where(finite, lse, 0.0)

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(attention, inputs)


# ---------------------------------------------------------------------------- edge cases
@forms
def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_dq(form):
    m = mask_hiding_row(form, 1, 12, row=4, seed=11)
    hidden_rows = ~m.to_dense()[0, 0].any(-1)
    q, k, v = (t.requires_grad_() for t in make_qkv(5, 1, 12, 12, 2, 1, 8, 8, torch.float32))
    out, lse = flashmask.flashmask_attention(q, k, v, m, return_softmax_lse=True)
    assert torch.equal(out[:, hidden_rows], torch.zeros_like(out[:, hidden_rows]))
    assert bool((lse[:, :, hidden_rows] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, :, ~hidden_rows]).all())
    loss = (out * torch.randn_like(out)).sum() + torch.where(hidden_rows, 0.0, lse).sum()
    loss.backward()
    assert torch.equal(q.grad[:, hidden_rows], torch.zeros_like(q.grad[:, hidden_rows]))
    for t in (q, k, v):
        assert bool(torch.isfinite(t.grad).all())


def test_rows_hidden_only_by_bottom_right_causality_are_zero():
    """Sq = 7 > Sk = 4 with causal: query rows 0..2 see no key."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 1, 7, 4, 2, 2, 4, 4, torch.float64))
    out, lse = flashmask.flashmask_attention(q, k, v, causal=True, return_softmax_lse=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert bool((lse[:, :, :3] == float("-inf")).all())
    out.sum().backward()
    assert torch.equal(q.grad[:, :3], torch.zeros_like(q.grad[:, :3]))


@forms
def test_fully_masked_key_columns_get_zero_dk_and_dv(form):
    seqlen, hidden = 10, [0, 3, 9]
    values = torch.randint(
        0, seqlen + 1, (1, 1, seqlen, form.bounds), generator=torch.Generator().manual_seed(4)
    )
    full_column = {1: [0], 2: [0, seqlen] if form.causal else [0, 0], 4: [0, seqlen, 0, 0]}
    values[0, 0, hidden] = torch.tensor(full_column[form.bounds])
    m = FlashMask(values.to(torch.int32), form.causal)
    q, k, v = (
        t.requires_grad_() for t in make_qkv(6, 1, seqlen, seqlen, 2, 1, 8, 8, torch.float32)
    )
    out = flashmask.flashmask_attention(q, k, v, m)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.equal(k.grad[:, hidden], torch.zeros_like(k.grad[:, hidden]))
    assert torch.equal(v.grad[:, hidden], torch.zeros_like(v.grad[:, hidden]))


@forms
def test_lse_gradient_matches_autograd_through_logsumexp(form):
    """Only the lse is used: dS = P * (dP - delta + dlse) with dP = delta = 0."""
    m = mask_hiding_row(form, 2, 9, row=2, seed=5)
    q, k, v = (t.requires_grad_() for t in make_qkv(8, 1, 9, 9, 4, 2, 4, 4, torch.float64))
    _, lse = flashmask.flashmask_attention(q, k, v, m, return_softmax_lse=True)
    weights = torch.randn(lse.shape, generator=torch.Generator().manual_seed(9), dtype=lse.dtype)
    finite = torch.isfinite(lse)
    dq, dk, dv = torch.autograd.grad((torch.where(finite, lse, 0.0) * weights).sum(), (q, k, v))
    naive = naive_logsumexp(q, k, m.to_dense(), 4**-0.5)
    torch.testing.assert_close(torch.isfinite(naive), finite)
    expected = torch.autograd.grad((torch.where(finite, naive, 0.0) * weights).sum(), (q, k))
    torch.testing.assert_close(dq, expected[0])
    torch.testing.assert_close(dk, expected[1])
    assert torch.equal(dv, torch.zeros_like(dv))  # lse does not depend on v


# ---------------------------------------------------------------------------- long sequences
def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_long_sequence_forward_and_backward_run_in_bounded_memory():
    """8192 tokens, one head, fp32, causal document mask, on the CPU: the reference keeps only
    chunk x Sk scores alive, so the extra peak memory stays below 1.5 dense fp32 [S, S] score
    matrices (a dense implementation needs several). 32K tokens work the same way but take ~30 s
    on 2 cores, too long for every CI run."""
    seqlen, head_dim = 8192, 16
    q, k, v = (
        t.requires_grad_()
        for t in make_qkv(0, 1, seqlen, seqlen, 1, 1, head_dim, head_dim, torch.float32)
    )
    docs = torch.tensor([2048, 4096, 2048])
    lts = torch.repeat_interleave(torch.cumsum(docs, 0), docs).to(torch.int32).view(1, 1, -1, 1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM)
    baseline = _status_mib("VmRSS")
    start = time.perf_counter()
    out = flashmask.flashmask_attention(q, k, v, lts, causal=True)
    out.sum().backward()
    elapsed = time.perf_counter() - start
    peak_extra = _status_mib("VmHWM") - baseline
    dense_scores_mib = seqlen * seqlen * 4 / 2**20
    assert peak_extra < 1.5 * dense_scores_mib, f"peak +{peak_extra:.0f} MiB in {elapsed:.1f} s"
    for t in (out, q.grad, k.grad, v.grad):
        assert bool(torch.isfinite(t).all())
    # The first token of a document sees only itself; the last one sees its whole document.
    scale = head_dim**-0.5
    for first, last in ((0, 2047), (2048, 6143), (6144, 8191)):
        torch.testing.assert_close(out[:, first], v[:, first])
        expected = naive_attention(
            q[:, last : last + 1], k[:, first : last + 1], v[:, first : last + 1], None, scale
        )
        torch.testing.assert_close(out[:, last : last + 1], expected.float())


# ---------------------------------------------------------------------------- non-finite inputs
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def _poison(x: torch.Tensor, keys: torch.Tensor, value: float, gen: torch.Generator):
    """``x [B, Sk, Hk, D]`` with ``value`` in one random entry of every key where ``keys``
    ``[B, Sk, Hk]`` is True, and the same tensor with those entries set to 0."""
    dim = torch.randint(0, x.shape[-1], keys.shape, generator=gen)
    hit = keys.unsqueeze(-1) & (torch.arange(x.shape[-1]) == dim.unsqueeze(-1))
    return x.masked_fill(hit, value), x.masked_fill(hit, 0.0)


@forms
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@settings(max_examples=random_cases(10))
@given(data=st.data())
def test_non_finite_keys_and_values_never_reach_rows_that_cannot_see_them(form, value, data):
    """NaN or infinities in ``k`` / ``v`` at random keys: every row that sees none of them gets
    bit for bit the output, lse and dq of a run with those entries set to 0, and so do the
    dk / dv of every key that no row seeing one of them sees (``0 * NaN`` stays out of the
    ``P @ V`` and ``dS @ K`` products, whatever the chunk size)."""
    heads_q, heads_k = data.draw(st.sampled_from(HEAD_CONFIGS), label="(Hq, Hk)")
    drawn = data.draw(flashmasks(form, max_seqlen=24, mask_heads=(1, heads_k)), label="mask")
    m, sq, sk = drawn.mask, drawn.seqlen_q, drawn.seqlen_k
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(seed, m.batch_size, sq, sk, heads_q, heads_k, 4, 3, torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    bad_k = torch.rand(m.batch_size, sk, heads_k, generator=g) < 0.2
    bad_v = torch.rand(m.batch_size, sk, heads_k, generator=g) < 0.2
    k_bad, k_clean = _poison(k, bad_k, value, g)
    v_bad, v_clean = _poison(v, bad_v, value, g)
    dout = randn(g, m.batch_size, sq, heads_q, 3)
    dlse = randn(g, m.batch_size, heads_q, sq)

    # Which (batch, query head, row) sees a poisoned key, and which keys such rows see.
    group = heads_q // heads_k
    visible = m.to_dense(sq).expand(-1, heads_k, -1, -1).repeat_interleave(group, 1)
    bad = (bad_k | bad_v).transpose(1, 2).repeat_interleave(group, 1)  # [B, Hq, Sk]
    sees = (visible & bad.unsqueeze(2)).any(-1)  # [B, Hq, Sq]
    touched = (visible & sees.unsqueeze(-1)).any(2)  # [B, Hq, Sk]
    touched = touched.view(m.batch_size, heads_k, group, sk).any(2).transpose(1, 2)  # [B, Sk, Hk]
    clean_rows = ~sees.transpose(1, 2)  # [B, Sq, Hq]

    intervals = m.intervals(sq)
    for chunk in (1, 3, None):
        out, lse = reference_forward(q, k_bad, v_bad, intervals, m.causal, 0.7, chunk)
        ref_out, ref_lse = reference_forward(q, k_clean, v_clean, intervals, m.causal, 0.7, chunk)
        assert torch.equal(out[clean_rows], ref_out[clean_rows]), chunk
        assert torch.equal(lse[~sees], ref_lse[~sees]), chunk
        dq, dk, dv = reference_backward(
            dout, dlse, q, k_bad, v_bad, out, lse, intervals, m.causal, 0.7, chunk
        )
        ref_dq, ref_dk, ref_dv = reference_backward(
            dout, dlse, q, k_clean, v_clean, ref_out, ref_lse, intervals, m.causal, 0.7, chunk
        )
        assert torch.equal(dq[clean_rows], ref_dq[clean_rows]), chunk
        assert torch.equal(dk[~touched], ref_dk[~touched]), chunk
        assert torch.equal(dv[~touched], ref_dv[~touched]), chunk


def test_nan_value_hidden_from_a_row_in_a_packed_batch_stays_out_of_flashmask_attention():
    """The public API on the CPU: a NaN value at key 4 (document 2, seen by row 4 only) leaves
    every other row's output and dq finite, and the dk / dv of every key row 4 does not see."""
    mask = flashmask.masks.causal_document([3, 2, 3], seqlen=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (randn(g, 1, 8, 2, 4, dtype=torch.float32).requires_grad_() for _ in range(3))
    v_nan = v.detach().clone()
    v_nan[0, 4, 0, 1] = float("nan")  # key 4: document 2, seen by row 4 only
    v_nan.requires_grad_()
    out = flashmask.flashmask_attention(q, k, v_nan, mask)
    out.sum().backward()
    rows, keys = [0, 1, 2, 3, 5, 6, 7], [0, 1, 2, 5, 6, 7]
    assert out[0, rows].isfinite().all() and out[0, 4, 0].isnan().any()
    assert q.grad[0, rows].isfinite().all()
    assert k.grad[0, keys].isfinite().all() and v_nan.grad[0, keys].isfinite().all()
