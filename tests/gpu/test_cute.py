"""The CuTe forward (``flashmask.kernels.cute_kernels``) on a Hopper GPU against the float32
reference, over the cases of ``test_kernels`` that its shapes take, and skipping == dense bit
for bit. The persistent variant (what ``launch.forward`` takes for a non-causal mask) runs on
the non-causal cases, among them many with more query tiles than three programs per SM take;
``test_persistent_matches_one_item_per_program`` forces it on and off on the same inputs.
Skipped without a Hopper GPU or without the ``flashmask[cute]`` extra.

    PYTHONPATH=src python -m pytest -q tests/gpu/test_cute.py -k persistent   # those cases"""

from __future__ import annotations

import pytest
import torch

from flashmask import reference
from flashmask.kernels import preparation, tiles
from flashmask.reference import reference_forward
from tests.gpu.conftest import HOPPER_CUTE_MARKS
from tests.gpu.test_kernels import (
    FORMS,
    MASK_NAMES,
    SHAPES,
    UNMASKED,
    Case,
    make_inputs,
)
from tests.tolerance import assert_close_to_reference, naive_attention

pytestmark = HOPPER_CUTE_MARKS


def cute_forward(
    x,
    scale: float,
    skip_tiles: bool = True,
    persistent: bool | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """``(out, lse)`` of the CuTe forward on a case's inputs, with the lists and launch order
    the launcher would prepare; ``persistent``: as ``launch.forward`` (``None``: its rule);
    ``softcap``: the logit cap (0: none); ``sinks``: ``[Hq]`` or ``None``."""
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
        q, k, v, bounds, lists, mask_heads, x.causal, not x.causal, scale, skip_tiles, order,
        persistent=persistent, softcap=softcap, sinks=sinks,
        edge_intervals=tiles.edge_intervals(x.sri, x.causal),
    )  # fmt: skip


def forward_cases() -> list[Case]:
    """The cases every Hopper forward family runs (the bf16 and the FP8 CuTe forwards): every
    mask of ``MASK_NAMES`` (full and causal among them) at each head dim, grouped-query 8 on 2
    and not, random_eviction with one mask per K/V head; every form of random indices (fully
    masked rows among them) at ragged lengths; no mask at ragged lengths (causal with Sq > Sk:
    the first Sq - Sk rows see no key)."""
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
    return cases


def _cases() -> list[Case]:
    cases = forward_cases()
    # More query tiles than the GPU has SMs (several waves of programs, heaviest first).
    many = ("full", "causal", "causal_document", "share_question", "global_sliding_window")
    cases += [Case(name, 4096, 4096, 8, 2, 128, True) for name in many]
    cases += [Case("random_eviction", 4096, 4096, 8, 2, 128, True, mask_heads=2)]
    cases += [Case("causal_document", 4096, 4096, 8, 2, d, True) for d in (64, 256)]
    cases += [Case("causal", 4000, 4500, 8, 2, 128, True)]
    # One mask per query head (Hm = Hq > Hk).
    cases += [
        Case("random", 1024, 1024, 8, 2, d, True, causal=causal, columns=columns, mask_heads=8)
        for causal, columns in FORMS
        for d in (128, 256)
    ]
    # Multi-head latent attention (Q/K head dim 192, V's 128; O through Q's slots in its own
    # layout): every mask, both schedules, ragged lengths, per-head masks.
    cases += [Case(name, 1024, 1024, 8, 2, 192, True, dv=128) for name in MASK_NAMES]
    cases += [
        Case("random", sq, sk, 8, 2, 192, True, causal=causal, columns=columns, dv=128)
        for causal, columns in FORMS
        for sq, sk in ((1000, 1100), (4500, 4000))
    ]
    cases += [Case("document", 4096, 4096, 8, 8, 192, True, mask_heads=8, dv=128)]
    # The logit cap (2.0: it changes unit-variance scores), on every mask at head dim 128, on
    # some at the other head dims, ragged lengths in every form, and the persistent schedule.
    cases += [Case(name, 1024, 1024, 8, 2, 128, True, softcap=2.0) for name in MASK_NAMES]
    cases += [
        Case(name, 1024, 1024, 8, 2, d, True, softcap=2.0, dv=128 if d == 192 else None)
        for name in ("causal", "causal_document", "share_question")
        for d in (64, 192, 256)
    ]
    cases += [
        Case("random", 1000, 1100, 8, 2, 128, True, causal=causal, columns=columns, softcap=2.0)
        for causal, columns in FORMS
    ]
    cases += [
        Case(name, 4096, 4096, 8, 2, 128, True, softcap=2.0)
        for name in ("full", "causal", "document", "global_sliding_window")
    ]
    return cases


# Non-causal masks (the persistent variant by launch.forward's rule; the builders' non-causal
# ones and random indices of both non-causal forms) with more query tiles than 3 x 132 SMs:
# 2 x 8 x 32 = 512 work items at 4096 queries (576 at 4500), each program running several, the
# later ones taken from the launch's counter, the K/V rings running on from one to the next.
# Grouped-query (8 on 2) and not, per-head masks, every head dim, ragged lengths. (The
# non-causal cases of test_matches_reference, at 1024 tokens, run one item per program.)
def _persistent_cases() -> list[Case]:
    cases = [
        Case(name, 4096, 4096, 8, 2, 128, True)
        for name in ("document", "prefix_lm_document", "prefix_lm_causal")
    ]
    cases += [Case("global_sliding_window", 4096, 4096, 8, 8, 128, True)]
    cases += [Case("document", 4096, 4096, 8, 8, d, True) for d in (64, 256)]
    cases += [
        Case("random", sq, sk, 8, 2, 128, True, causal=False, columns=columns, mask_heads=hm)
        for columns in (2, 4)
        for sq, sk in ((4000, 4500), (4500, 4000))
        for hm in (1, 2)
    ]
    cases += [
        Case("random", 4500, 4000, 8, 2, d, True, causal=False, columns=4, mask_heads=2)
        for d in (64, 256)
    ]
    return cases


# The same inputs with the persistent variant forced on and off: the non-causal cases above and
# forms launch.forward runs one item per program by default (causal masks, full, causal).
AB_CASES = [
    *(Case(name, 4096, 4096, 8, 2, 128, True) for name in ("document", "global_sliding_window")),
    *(Case(name, 4096, 4096, 8, 2, 128, True) for name in ("share_question", "sliding_window")),
    Case("random", 4500, 4000, 8, 2, 128, True, causal=False, columns=4, mask_heads=2),
    Case("random", 4000, 4500, 8, 2, 128, True, causal=True, columns=2, mask_heads=2),
    Case("document", 4096, 4096, 8, 2, 256, True),
    Case("global_sliding_window", 4096, 4096, 8, 8, 64, True),
    Case("full", 4000, 4500, 8, 2, 128, True),
    Case("causal", 4096, 4096, 8, 2, 128, True),
]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_matches_reference(case: Case):
    x = make_inputs(case)
    scale = case.d**-0.5
    out, lse = cute_forward(x, scale, softcap=case.softcap)
    check_against_reference(case, x, scale, out, lse)


def _sinks_cases() -> list[Case]:
    """Sinks on every mask at head dim 128, the other head dims (192: MLA's) on two, every
    form of random indices at ragged lengths (fully masked rows: O = 0, lse = the sink), the
    persistent schedule over several waves, and with the logit cap."""
    cases = [Case(name, 1024, 1024, 8, 2, 128, True, sinks=True) for name in MASK_NAMES]
    cases += [
        Case(name, 1024, 1024, 8, 2, d, True, sinks=True, dv=128 if d == 192 else None)
        for name in ("causal", "document")
        for d in (64, 192, 256)
    ]
    cases += [
        Case("random", 1000, 1100, 8, 2, 128, True, causal=causal, columns=columns, sinks=True)
        for causal, columns in FORMS
    ]
    cases += [
        Case(name, 4096, 4096, 8, 2, 128, True, sinks=True)
        for name in ("full", "causal", "document", "global_sliding_window")
    ]
    cases += [
        Case(name, 1024, 1024, 8, 2, 128, True, softcap=2.0, sinks=True)
        for name in ("causal", "share_question")
    ]
    return cases


@pytest.mark.parametrize("case", _sinks_cases(), ids=lambda c: c.id)
def test_sinks_join_the_rows_in_the_kernel(case: Case):
    """Learnable sinks in the epilogue: out and lse those of the reference with the sinks
    folded in (one logit per query head, some below and some above the scores' range)."""
    x = make_inputs(case)
    scale = case.d**-0.5
    sinks = torch.linspace(-2.0, 3.0, case.hq, device="cuda")
    out, lse = cute_forward(x, scale, softcap=case.softcap, sinks=sinks)
    check_against_reference(case, x, scale, out, lse, sinks)


@pytest.mark.parametrize("name", ["causal", "document", "share_question"])
def test_a_capped_call_takes_a_negative_scale(name: str):
    """With a cap the row max is over the capped scores, so any scale runs (the uncapped
    kernel's max over unscaled scores needs a positive one)."""
    case = Case(name, 1024, 1024, 8, 2, 128, True, softcap=2.0)
    x = make_inputs(case)
    scale = -(case.d**-0.5)
    out, lse = cute_forward(x, scale, softcap=case.softcap)
    check_against_reference(case, x, scale, out, lse)


@pytest.mark.parametrize("case", _persistent_cases(), ids=lambda c: c.id)
def test_persistent_matches_reference(case: Case):
    x = make_inputs(case)
    scale = case.d**-0.5
    out, lse = cute_forward(x, scale)  # persistent by launch.forward's rule
    check_against_reference(case, x, scale, out, lse)


@pytest.mark.parametrize("case", AB_CASES, ids=lambda c: c.id)
def test_persistent_matches_one_item_per_program(case: Case):
    """Forced on and off on the same inputs, each within the reference's tolerance and both
    within it of each other (the same ops per query tile: expected equal bit for bit)."""
    x = make_inputs(case)
    scale = case.d**-0.5
    on = cute_forward(x, scale, persistent=True)
    off = cute_forward(x, scale, persistent=False)
    check_against_reference(case, x, scale, *on)
    check_against_reference(case, x, scale, *off)
    low = naive_attention(x.q, x.k, x.v, x.visible, scale, dtype=x.q.dtype)
    assert_close_to_reference(on[0], off[0].float(), low, "out", context=f"{case.id} on/off")
    assert torch.equal(torch.isinf(on[1]), torch.isinf(off[1])), "the same fully masked rows"
    finite = torch.isfinite(off[1])
    torch.testing.assert_close(on[1][finite], off[1][finite], atol=1e-3, rtol=1e-4)


def check_against_reference(case: Case, x, scale: float, out, lse, sinks=None) -> None:
    """``out`` and ``lse`` against the float32 reference (with the case's logit cap, and
    ``sinks`` folded in where given): out as close as a plain bf16/fp16 computation, lse to
    1e-3, ``O = 0`` exactly on the fully masked rows and their lse ``-inf`` (with sinks: the
    row's sink)."""
    intervals = None
    if x.sri is not None:
        from flashmask.mask import FlashMask

        intervals = FlashMask(x.sri, x.causal).intervals(case.sq)
    cap = case.softcap
    ref_out, ref_lse = reference_forward(
        x.q.float(), x.k.float(), x.v.float(), intervals, x.causal, scale, softcap=cap
    )
    hidden = torch.isinf(ref_lse)
    if sinks is not None:
        ref_out, ref_lse = reference.fold_sinks(ref_out, ref_lse, sinks)
    low = naive_attention(
        x.q, x.k, x.v, x.visible, scale, dtype=x.q.dtype, softcap=cap, sinks=sinks
    )
    assert_close_to_reference(out, ref_out, low, "out", context=case.id)
    if sinks is None:
        assert torch.equal(torch.isinf(lse) & (lse < 0), hidden), "lse -inf exactly on hidden rows"
    else:
        want = sinks.view(1, -1, 1).expand_as(lse)[hidden]
        torch.testing.assert_close(lse[hidden], want, atol=1e-5, rtol=1e-5)
    assert (out.float().transpose(1, 2)[hidden] == 0).all(), "fully masked rows give 0"
    finite = ~hidden
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window"])
def test_skipping_equals_dense_bit_for_bit(name: str):
    # Several waves of programs (global_sliding_window: several items per persistent program).
    x = make_inputs(Case(name, 4096, 4096, 8, 2, 128, True))
    skipped = cute_forward(x, 0.088)
    dense = cute_forward(x, 0.088, skip_tiles=False)
    assert torch.equal(skipped[0], dense[0]) and torch.equal(skipped[1], dense[1])
