"""The split-KV kernels (decoding and chunked prefill) on a CUDA GPU against float32 references.

Skipped without a CUDA GPU (marker ``gpu``); run with the rest of ``tests/gpu`` (see
``tests/gpu/test_kernels.py`` for the commands and the tolerance rule, which these cases share).
The cases, every one routed to the split-KV forward (checked; the backward runs too, on the
training kernels, and is held to the same rule):

* every builder's mask (``masks.MASK_TYPES`` and ``hash_sparse``) over 2,000 keys, read by its
  last 1 or 16 query rows (``FlashMask.last_rows``), head dims 64, 128 and 256, 32 query heads
  on 8 key/value heads (16 rows: 64 packed rows per program) and 8 on 1 (128 packed rows);
* random ``startend_row_indices`` of every form at ragged cache lengths (one key past a tile,
  a tile short of one, 8K + 37), with out-of-range values and fully masked rows, grouped-query
  ratios 8:1, 6:2 (a group of 3) and 4:4;
* ragged cache lengths within a batch expressed through the mask (the columns past a
  sequence's length fully masked), with NaN in the K/V tiles past each length: a tile the mask
  skips is never read, so the NaN reaches nothing.
"""

from __future__ import annotations

import pytest
import torch

from flashmask import flashmask_attention, kernels, masks
from flashmask.kernels import routing
from flashmask.kernels.config import device_decode_config
from flashmask.mask import FlashMask
from flashmask.reference import reference_forward
from tests.gpu.conftest import CASE_PROPERTY, FULL
from tests.gpu.test_kernels import MASK_NAMES, Case, check_accuracy, make_inputs
from tests.tolerance import assert_close_to_reference, naive_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEAD_DIMS = (32, 64, 96, 128, 192, 256) if FULL else (64, 128, 256)
CACHE = 2000


def _mask_cases() -> list[Case]:
    cases = []
    for name in MASK_NAMES:
        for d in HEAD_DIMS:
            for sq, hq, hk in ((1, 32, 8), (16, 32, 8), (16, 8, 1)):
                heads = hk if name == "random_eviction" else 1
                cases.append(Case(name, sq, CACHE, hq, hk, d, True, mask_heads=heads))
    return cases


def _random_cases() -> list[Case]:
    cases = []
    for causal, columns in ((True, 1), (True, 2), (False, 2), (False, 4)):
        for sq, sk in ((1, 65), (1, 127), (3, 8229), (16, 1000)):
            for hq, hk, hm in ((8, 1, 1), (6, 2, 2), (4, 4, 4)):
                form = {"causal": causal, "columns": columns, "mask_heads": hm}
                cases.append(Case("random", sq, sk, hq, hk, 128, True, **form))
    for name in ("full", "causal"):
        for sq in (1, 16):
            cases.append(Case(name, sq, 8229, 32, 8, 128, True))
    return cases


DECODE_CASES = _mask_cases() + _random_cases()


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_split_kv_forward_matches_the_reference(case: Case, record_property) -> None:
    """out and lse of the split-KV forward (and the backward after it) within the rule."""
    x = make_inputs(case)
    assert routing.use_decode(x.q, x.k, True, device_decode_config(case.d, x.q.device)), case.id
    check_accuracy(case, record_property)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_ragged_cache_lengths_read_only_each_sequences_keys(d: int, record_property) -> None:
    """A batch of 4 caches of 5,000 slots holding 1, 700, 3,001 and 5,000 keys: the columns past
    a length are masked (``LTS = 0``), the K/V tiles past it hold NaN, and each row equals
    attention over its own keys alone."""
    lengths = (1, 700, 3001, 5000)
    batch, sk, hq, hk = len(lengths), 5000, 32, 8
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cols = torch.arange(sk, device="cuda")
    length = torch.tensor(lengths, device="cuda").view(-1, 1)
    # One query row (causal: bottom-right, it sees every key): column j is masked from row 0
    # past the length, from row 1 (none) before it.
    lts = torch.where(cols < length, 1, 0).to(torch.int32)
    mask = FlashMask(lts.view(batch, 1, sk, 1), causal=True, seqlen_q=1)
    block = device_decode_config(d, q.device).block_n
    for b, n in enumerate(lengths):
        first_unread = -(-n // block) * block
        k[b, first_unread:] = float("nan")
        v[b, first_unread:] = float("nan")
    out, lse = flashmask_attention(q, k, v, mask, return_softmax_lse=True)
    record = {"kind": "decode_ragged", "case": f"ragged-D{d}", "kernels": "fwd=split-kv"}
    record_property(CASE_PROPERTY, record)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for b, n in enumerate(lengths):
        kb, vb = k[b : b + 1, :n], v[b : b + 1, :n]
        visible = torch.ones(1, 1, 1, n, dtype=torch.bool, device="cuda")
        ref, ref_lse = reference_forward(
            q[b : b + 1].float(), kb.float(), vb.float(), None, False, d**-0.5
        )
        low = naive_attention(q[b : b + 1], kb, vb, visible, d**-0.5, dtype=torch.bfloat16)
        assert_close_to_reference(out[b : b + 1], ref, low, "out", context=f"ragged b={b}")
        torch.testing.assert_close(lse[b : b + 1], ref_lse.float())


def test_split_kv_equals_the_training_forward_closely(monkeypatch) -> None:
    """The same decode step through the split-KV kernels and through the training forward
    (routing patched) agree within bf16 output rounding: the splits change only the order of
    float32 sums."""
    mask = masks.sliding_window(16384, 4096, sink_tokens=4).last_rows(1).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(8, 16384, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    # The kernels take one mask row per batch entry (the public API checks it).
    sri = mask.startend_row_indices.expand(8, -1, -1, -1).contiguous()
    split, split_lse = kernels.forward(q, k, v, sri, mask.causal, 128**-0.5)
    monkeypatch.setattr(routing, "use_decode", lambda *args: False)
    train, train_lse = kernels.forward(q, k, v, sri, mask.causal, 128**-0.5)
    torch.testing.assert_close(split, train, atol=2 * 2**-8, rtol=0)
    torch.testing.assert_close(split_lse, train_lse, atol=1e-5, rtol=1e-5)
