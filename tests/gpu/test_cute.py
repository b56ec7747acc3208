"""The CuTe forward (``flashmask.kernels.cute_kernels``) on a Hopper GPU against the float32
reference, over the cases of ``test_kernels`` that its shapes take, and skipping == dense bit
for bit. Skipped without a Hopper GPU or without the ``flashmask[cute]`` extra."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flashmask.kernels import preparation
from flashmask.reference import reference_forward
from tests.gpu.test_kernels import (
    FORMS,
    MASK_NAMES,
    SHAPES,
    UNMASKED,
    Case,
    make_inputs,
)
from tests.tolerance import assert_close_to_reference, naive_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None, reason="needs the flashmask[cute] extra"
    ),
]


def cute_forward(x, scale: float, skip_tiles: bool = True):
    """``(out, lse)`` of the CuTe forward on a case's inputs, with the lists and launch order
    the launcher would prepare."""
    from flashmask.kernels.cute_kernels import launch

    q, k, v = (t.contiguous() for t in (x.q, x.k, x.v))
    b, sq, hq, d = q.shape
    shape = (128, launch.key_tile(d), True)
    bounds, (lists,) = preparation.prepare_cached(
        x.sri, x.causal, sq, k.shape[1], b, q.device, [shape], skip_tiles
    )
    order = None
    if x.sri is not None:
        (order,) = preparation.program_orders([(lists, hq, True)])
    mask_heads = 1 if x.sri is None else x.sri.shape[1]
    return launch.forward(
        q, k, v, bounds, lists, mask_heads, x.causal, not x.causal, scale, skip_tiles, order
    )


def _cases() -> list[Case]:
    cases = [
        Case(name, 1024, 1024, 8, hk, d, True, mask_heads=hk if name == "random_eviction" else 1)
        for name in MASK_NAMES
        for d in (64, 128, 256)
        for hk in (8, 2)
    ]
    cases += [
        Case("random", sq, sk, 4, 2, 128, True, causal=causal, columns=columns, mask_heads=hm)
        for causal, columns in FORMS
        for sq, sk in SHAPES
        for hm in (1, 2)
    ]
    cases += [
        Case(name, sq, sk, 8, 2, d, True)
        for name in UNMASKED
        for sq, sk in ((256, 384), (384, 256), (1000, 1100))
        for d in (64, 128, 256)
    ]
    # More query tiles than the GPU has SMs (several waves of programs, heaviest first).
    many = ("full", "causal", "causal_document", "share_question", "global_sliding_window")
    cases += [Case(name, 4096, 4096, 8, 2, 128, True) for name in many]
    cases += [Case("random_eviction", 4096, 4096, 8, 2, 128, True, mask_heads=2)]
    cases += [Case("causal_document", 4096, 4096, 8, 2, d, True) for d in (64, 256)]
    cases += [Case("causal", 4000, 4500, 8, 2, 128, True)]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_matches_reference(case: Case):
    x = make_inputs(case)
    scale = case.d**-0.5
    out, lse = cute_forward(x, scale)
    intervals = None
    if x.sri is not None:
        from flashmask.mask import FlashMask

        intervals = FlashMask(x.sri, x.causal).intervals(case.sq)
    ref_out, ref_lse = reference_forward(
        x.q.float(), x.k.float(), x.v.float(), intervals, x.causal, scale
    )
    low = naive_attention(x.q, x.k, x.v, x.visible, scale, dtype=x.q.dtype)
    assert_close_to_reference(out, ref_out, low, "out", context=case.id)
    hidden = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), hidden), "lse -inf exactly on hidden rows"
    assert (out.float().transpose(1, 2)[hidden] == 0).all(), "fully masked rows give 0"
    finite = ~hidden
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window"])
def test_skipping_equals_dense_bit_for_bit(name: str):
    x = make_inputs(Case(name, 4096, 4096, 8, 2, 128, True))  # several waves of programs
    skipped = cute_forward(x, 0.088)
    dense = cute_forward(x, 0.088, skip_tiles=False)
    assert torch.equal(skipped[0], dense[0]) and torch.equal(skipped[1], dense[1])
