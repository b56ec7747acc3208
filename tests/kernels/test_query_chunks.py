"""Full attention's backward over chunks of query rows (``flashmask.kernels.query_chunks``).

The Gluon backward splits long full attention into chunks of query rows so that a head's Q, dO
and dQ stay in L2; the split must be exact: a chunk's dQ depends on its rows only, dK and dV are
sums over rows. Checked here in float64 against autograd, with a per-chunk backward written from
the forward's lse and delta as the kernel computes it.
"""

from __future__ import annotations

import pytest
import torch

from flashmask.kernels import query_chunks, tiles


@pytest.mark.parametrize(
    ("seqlen_q", "head_dim", "heads_per_kv", "rows"),
    [
        (131072, 128, 1, 32768),  # measured: 1.05x one launch on the H200
        (65536, 128, 1, 0),  # measured: two chunks 2.3% slower than one launch
        (262144, 64, 1, 65536),
        (131072, 64, 1, 0),
        (32768, 128, 4, 8192),
        (65536, 128, 3, 10880),
    ],
)
def test_full_attention_splits_from_a_128_mib_working_set_into_32_mib_chunks(
    seqlen_q, head_dim, heads_per_kv, rows
):
    """The working set is 8 bytes per row and head-dim element (Q and dO in 16 bits, dQ in fp32)
    of each query head a program walks; chunks are rounded down to 128 rows."""
    assert query_chunks.query_chunk_rows(seqlen_q, head_dim, heads_per_kv) == rows
    if rows:
        assert query_chunks.working_set_bytes(rows, head_dim, heads_per_kv) <= 32 << 20
    assert (rows > 0) == (
        query_chunks.working_set_bytes(seqlen_q, head_dim, heads_per_kv) >= 128 << 20
    )


def test_chunk_rows_are_at_least_one_granule_and_never_the_whole_length():
    small = query_chunks.query_chunk_rows(4096, 128, 1, chunk_bytes=1000, split_from_bytes=0)
    assert small == query_chunks.ROW_GRANULE
    assert query_chunks.query_chunk_rows(4096, 128, 1, split_from_bytes=0) == 0  # one chunk
    assert query_chunks.query_chunk_rows(1 << 20, 128, 1, chunk_bytes=0) == 0


def test_chunk_rows_read_the_module_settings_at_the_call(monkeypatch):
    monkeypatch.setattr(query_chunks, "QUERY_SPLIT_FROM_BYTES", 1 << 40)
    assert query_chunks.query_chunk_rows(131072, 128, 1) == 0
    monkeypatch.setattr(query_chunks, "QUERY_SPLIT_FROM_BYTES", 0)
    monkeypatch.setattr(query_chunks, "QUERY_CHUNK_BYTES", 0)
    assert query_chunks.query_chunk_rows(131072, 128, 1) == 0


def _attention_and_lse(q, k, v, scale):
    """Full attention ``[B, Sq, H, D]`` and its lse ``[B, H, Sq]`` (K/V heads repeated for GQA)."""
    groups = q.shape[2] // k.shape[2]
    kh = k.repeat_interleave(groups, dim=2)
    vh = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), vh)
    return out, lse


def _chunk_backward(k, v, scale):
    """A chunk's ``(dq, dk, dv)`` from its rows' lse and delta, as the kernel forms them: ``P``
    from the scores and lse, ``dS = P (dP - delta)``; dK/dV summed over the kernel's GQA group
    and added to the sums it is given (in place, as the kernel's ``ADD_DKDV``)."""
    groups_seen = []

    def run(q_c, dout_c, lse_c, delta_c, dk_sums, dv_sums):
        for t in (q_c, dout_c, lse_c, delta_c):
            assert t.is_contiguous()
        groups = q_c.shape[2] // k.shape[2]
        kh = k.repeat_interleave(groups, dim=2)
        vh = v.repeat_interleave(groups, dim=2)
        p = (torch.einsum("bqhd,bkhd->bhqk", q_c, kh) * scale - lse_c[..., None]).exp()
        dp = torch.einsum("bqhd,bkhd->bhqk", dout_c, vh)
        ds = p * (dp - delta_c[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q_c) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout_c)
        fold = (k.shape[0], k.shape[1], k.shape[2], groups, k.shape[3])
        groups_seen.append(q_c.shape[1])
        dk, dv = dk.reshape(fold).sum(3), dv.reshape(fold).sum(3)
        if dk_sums is None:
            return dq, dk, dv
        dk_sums += dk
        dv_sums += dv
        return dq, dk_sums, dv_sums

    return run, groups_seen


@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "rows"),
    [(1, 256, 192, 2, 2, 128), (2, 320, 128, 4, 2, 128), (2, 384, 256, 2, 1, 384)],
)
def test_chunked_gradients_equal_the_unchunked_ones(
    batch, seqlen_q, seqlen_k, heads, kv_heads, rows
):
    """Chunks of ``rows`` query rows (the last one shorter where they do not divide ``Sq``),
    batches of two (slices that are views with gaps, copied contiguous), GQA: the same dQ, dK, dV
    as autograd through the whole of full attention, to float64 rounding."""
    gen = torch.Generator().manual_seed(seqlen_q + heads)
    scale = 0.125

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(batch, seqlen_q, heads, 16).requires_grad_()
    k = randn(batch, seqlen_k, kv_heads, 16).requires_grad_()
    v = randn(batch, seqlen_k, kv_heads, 16).requires_grad_()
    dout = randn(batch, seqlen_q, heads, 16)
    out, lse = _attention_and_lse(q, k, v, scale)
    want = torch.autograd.grad(out, (q, k, v), dout)
    delta = (dout * out.detach()).sum(-1).transpose(1, 2).contiguous()
    run, chunk_lengths = _chunk_backward(k.detach(), v.detach(), scale)
    got = query_chunks.backward_by_query_chunks(
        run, q.detach(), dout, lse.detach(), delta, rows, torch.float64
    )
    expected_chunks = [min(rows, seqlen_q - s) for s in range(0, seqlen_q, rows)]
    assert chunk_lengths == expected_chunks
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


def test_later_chunks_add_into_the_first_chunks_sums_and_come_back_in_the_inputs_dtype():
    """The first chunk gets no sums and returns new float32 ones; every later chunk gets those
    same tensors to add into and returns them; the sums come back once, in ``kv_dtype``."""
    given = []

    def run(q_c, dout_c, lse_c, delta_c, dk_sums, dv_sums):
        given.append((dk_sums, dv_sums))
        if dk_sums is None:
            dk_sums, dv_sums = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)
        dk_sums += 1.0
        dv_sums += 2.0
        return torch.zeros_like(q_c), dk_sums, dv_sums

    q = torch.zeros(1, 300, 1, 8, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 300)
    dq, dk, dv = query_chunks.backward_by_query_chunks(run, q, q, lse, lse, 128, torch.bfloat16)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    assert torch.equal(dk.float(), torch.full_like(dk.float(), 3.0))  # three chunks, each once
    assert torch.equal(dv.float(), torch.full_like(dv.float(), 6.0))
    assert given[0] == (None, None)
    assert given[1][0] is given[2][0] and given[1][1] is given[2][1]
    assert given[1][0].dtype == torch.float32


def test_rows_must_be_positive():
    q = torch.zeros(1, 128, 1, 8)
    with pytest.raises(ValueError, match="rows"):
        query_chunks.backward_by_query_chunks(None, q, q, q[..., 0], q[..., 0], 0, q.dtype)


@pytest.mark.parametrize(("batch", "seqlen_q", "seqlen_k"), [(1, 512, 256), (2, 256, 384)])
def test_full_attention_lists_are_the_mask_preparations(batch, seqlen_q, seqlen_k):
    """What each chunk's launch gets instead of a call to the mask preparation: the column-major
    lists ``tiles`` builds for full attention without a mask (64-row query tiles, 128-key tiles
    as the hd128 Gluon backward's)."""
    bounds = tiles.column_bounds(None, False, seqlen_q, seqlen_k, batch, torch.device("cpu"))
    classes = tiles.tile_classes(bounds, False, seqlen_q, 64, 128)
    want = tiles.backward_lists(classes)
    got = query_chunks.full_attention_lists(
        batch, seqlen_k // 128, seqlen_q // 64, torch.device("cpu")
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.is_contiguous()
        assert torch.equal(g, w)
