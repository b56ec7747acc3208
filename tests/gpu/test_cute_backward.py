"""The CuTe backward (``flashmask.kernels.cute_kernels.backward``) on a Hopper GPU: routed in
place of the Gluon backward at every length, each case's out, lse, dq, dk and dv within the
tolerance rule of the float32 reference (``test_kernels.check_accuracy``: also dq of fully
masked rows and dk/dv of keys no query sees exactly 0); dK and dV of the skipping mode equal the
dense mode's bit for bit (dQ's reduce-adds run in no fixed order). Skipped without a Hopper GPU
or without the ``flashmask[cute]`` extra."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashmask import kernels
from flashmask.kernels import preparation, routing
from tests.gpu.conftest import HOPPER_CUTE_MARKS
from tests.gpu.test_kernels import (
    FORMS,
    MASK_NAMES,
    UNMASKED,
    Case,
    check_accuracy,
    make_inputs,
)

pytestmark = HOPPER_CUTE_MARKS


@pytest.fixture
def cute_backward_everywhere(monkeypatch):
    """Route every hd128 call the Gluon backward takes to the CuTe backward, at every length."""
    monkeypatch.setattr(routing, "CUTE_BWD_HEAD_DIMS", (128,))
    monkeypatch.setattr(
        routing,
        "GLUON_BWD_MIN_MASKED_SEQLEN",
        dict.fromkeys(routing.GLUON_BWD_MIN_MASKED_SEQLEN, 0),
    )


def _cases() -> list[Case]:
    cases = [
        Case(name, 1024, 1024, 8, hk, 128, False, dtype, mask_heads=hk if "evict" in name else 1)
        for name in MASK_NAMES
        for hk in (8, 2)
        for dtype in (torch.bfloat16, torch.float16)
    ]
    cases += [
        Case("random", sq, sk, hq, hk, 128, False, causal=causal, columns=columns, mask_heads=hm)
        for causal, columns in FORMS
        for sq, sk in ((256, 384), (384, 256), (1024, 1024), (2048, 1024))
        for hq, hk, hm in ((4, 4, 4), (8, 1, 1), (8, 2, 2))
    ]
    cases += [
        Case(name, sq, sk, 8, 2, 128, False)
        for name in UNMASKED
        for sq, sk in ((256, 384), (384, 256), (1024, 1024))
    ]
    # More programs than the GPU has SMs (several waves, heaviest first), one head per group.
    many = ("full", "causal", "causal_document", "share_question", "global_sliding_window")
    cases += [Case(name, 4096, 4096, 8, 2, 128, False) for name in many]
    cases += [Case("random_eviction", 4096, 4096, 8, 8, 128, False, mask_heads=8)]
    cases += [replace(Case("document", 2048, 2048, 16, 16, 128, False), batch=4)]
    # One mask per query head (Hm = Hq > Hk).
    cases += [
        Case("random", 2048, 2048, 8, 2, 128, False, causal=causal, columns=columns, mask_heads=8)
        for causal, columns in FORMS
    ]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_matches_reference(case: Case, record_property, cute_backward_everywhere):
    x = make_inputs(case)
    assert routing.use_gluon_backward(
        x.q, x.k, x.v, x.dout, False, True, x.sri is not None,
        kernels.tile_config(128, has_mask=x.sri is not None),
    ) and routing.use_cute_backward(x.q), "the case must run the CuTe backward"  # fmt: skip
    check_accuracy(case, record_property)


@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window"])
def test_skipping_equals_dense_for_dk_dv_bit_for_bit(name: str):
    from flashmask.kernels.backward_launcher import backward_delta
    from flashmask.kernels.cute_kernels import backward_launch

    x = make_inputs(Case(name, 4096, 4096, 8, 2, 128, False))
    scale = 0.088
    out, lse = kernels.forward(x.q, x.k, x.v, x.sri, x.causal, scale)
    delta = backward_delta(out, x.dout, None)
    grads = []
    for skip in (True, False):
        bounds, (lists,) = preparation.prepare_cached(
            x.sri, x.causal, 4096, 4096, x.q.shape[0], x.q.device, [(64, 128, False)], skip
        )
        order = preparation.program_order(lists, x.k.shape[2], False)
        args = (x.dout, x.q, x.k, x.v, lse, delta, bounds, lists, 1, x.causal, scale)
        grads.append(backward_launch.backward(*args, skip_tiles=skip, order=order))
    (dq, dk, dv), (dq_dense, dk_dense, dv_dense) = grads
    assert torch.equal(dk, dk_dense) and torch.equal(dv, dv_dense)
    torch.testing.assert_close(dq, dq_dense, atol=2e-2, rtol=1e-2)
