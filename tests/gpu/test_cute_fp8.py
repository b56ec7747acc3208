"""The FP8 (e4m3) CuTe forward (``launch.forward_fp8``) on a Hopper GPU.

Inputs are the cases' bf16 draws quantised to e4m3 with a descale per (batch, K/V head)
(``flashmask.quantize_fp8``: amax / 448 over the head's group). Each output is compared with

* the float32 reference (``flashmask.reference.reference_forward``) on the DEQUANTISED inputs,
  which differs from the kernel by the rounding of P to e4m3 for ``P V`` (3 mantissa bits:
  up to 2^-4 relative per probability) and O's rounding to bf16;
* an emulation of that rounding in float32 (scores, ``P = exp(s - rowmax)`` rounded to e4m3,
  ``P V`` in fp32 divided by the fp32 row sum): the kernel's error against the reference must
  be at most twice the emulation's, plus a floor of O's own bf16 rounding (the kernel rounds P
  against the running row max of its tiles, the emulation against the final one, so their
  errors are alike in size, not equal).

lse, which the fp32 probabilities give, must match the reference within the accumulation error
of the FP8 tensor cores' scores (``tests.tolerance.assert_fp8_lse_close``: a flat 1e-3 failed 8
of 221 cases by up to 2.2e-3, at head dim 256 and on rows seeing few keys, on an H100, while
their outputs were as close as the emulation's); fully masked rows must give ``lse = -inf`` and
O = 0 exactly. Skipped without a Hopper GPU or without the ``flashmask[cute]`` extra. Run::

    PYTHONPATH=src python -m pytest -q tests/gpu/test_cute_fp8.py"""

from __future__ import annotations

import pytest
import torch

import flashmask
from flashmask import fp8
from flashmask.kernels import preparation, tiles
from flashmask.reference import reference_forward
from tests.gpu.conftest import HOPPER_CUTE_MARKS
from tests.gpu.test_cute import forward_cases
from tests.gpu.test_kernels import FORMS, Case, Inputs, make_inputs
from tests.tolerance import assert_fp8_lse_close

pytestmark = HOPPER_CUTE_MARKS


def fp8_forward(
    x: Inputs,
    scale: float,
    skip_tiles: bool = True,
    persistent: bool | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(out, lse, (q, k, v) dequantised)`` of the FP8 forward on a case's inputs quantised
    per (batch, K/V head), with the lists and launch order the launcher would prepare (as
    ``tests/gpu/test_cute.py``'s ``cute_forward``, edge intervals included), and ``sinks``
    (``[Hq]``) if given."""
    from flashmask.kernels.cute_kernels import launch

    b, sq, hq, d = x.q.shape
    hk = x.k.shape[2]
    (q8, qd), (k8, kd), (v8, vd) = (
        flashmask.quantize_fp8(t, group=t.shape[2] // hk) for t in (x.q, x.k, x.v)
    )
    bounds, (lists,) = preparation.prepare_cached(
        x.sri,
        x.causal,
        sq,
        x.k.shape[1],
        b,
        x.q.device,
        [launch.fp8_tile_shape(d, full_attention=x.sri is None and not x.causal)],
        skip_tiles,
    )
    order = None
    if x.sri is not None:
        (order,) = preparation.program_orders([(lists, hq, True)])
    mask_heads = 1 if x.sri is None else x.sri.shape[1]
    out, lse = launch.forward_fp8(
        q8, k8, v8, bounds, lists, mask_heads, x.causal, not x.causal, scale, skip_tiles, order,
        qd, kd, vd, out_dtype, persistent=persistent, sinks=sinks,
        edge_intervals=tiles.edge_intervals(x.sri, x.causal),
    )  # fmt: skip
    return out, lse, tuple(fp8.dequantize(t, ds, hk) for t, ds in ((q8, qd), (k8, kd), (v8, vd)))


def emulate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """O of FP8 attention as the kernel rounds it, in float32, head by head: scores of the
    (dequantised) inputs, ``P = exp(s - rowmax)`` rounded to e4m3 for ``P V``, divided by the
    row sum of the unrounded P; 0 on fully masked rows. ``visible`` bool ``[B or 1, Hm or 1,
    Sq, Sk]``, query head ``h`` taking mask head ``h // (Hq / Hm)``."""
    b, sq, hq, _ = q.shape
    hk = k.shape[2]
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            mask = visible[bi % visible.shape[0], h // (hq // visible.shape[1])]
            s = (q[bi, :, h] @ k[bi, :, kv].T) * scale
            s = s.masked_fill(~mask, -torch.inf)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(s - m)
            total = p.sum(-1, keepdim=True)
            o = p.to(torch.float8_e4m3fn).float() @ v[bi, :, kv]
            out[bi, :, h] = torch.where(total > 0, o / total.clamp(min=1e-30), 0.0)
    return out


def check_fp8(case: Case, x: Inputs, scale: float, out, lse, dequantised) -> None:
    """``out``/``lse`` of the FP8 forward against the float32 reference on the dequantised
    inputs and the rounding emulation (module docstring)."""
    q, k, v = dequantised
    intervals = None
    if x.sri is not None:
        from flashmask.mask import FlashMask

        intervals = FlashMask(x.sri, x.causal).intervals(case.sq)
    ref_out, ref_lse = reference_forward(q, k, v, intervals, x.causal, scale)
    ref_out = ref_out.float()
    emu = emulate(q, k, v, x.visible, scale)
    actual = out.float()
    assert torch.isfinite(actual).all(), f"{case.id}: non-finite output"
    hidden = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), hidden), "lse -inf exactly on hidden rows"
    assert (actual.transpose(1, 2)[hidden] == 0).all(), "fully masked rows give 0"
    assert_fp8_lse_close(lse, ref_lse, q, k, scale, context=case.id)
    # O's own rounding (to bf16/fp16): twice the output's unit roundoff at its largest value.
    floor = 2 * torch.finfo(out.dtype).eps * ref_out.abs().amax().item()
    err = (actual - ref_out).abs()
    emu_err = (emu - ref_out).abs()
    assert err.amax() <= 2 * emu_err.amax() + floor, (
        f"{case.id}: max error {err.amax():.3g} against the emulation's {emu_err.amax():.3g}"
    )
    assert err.mean() <= 2 * emu_err.mean() + floor / 4, (
        f"{case.id}: mean error {err.mean():.3g} against the emulation's {emu_err.mean():.3g}"
    )


def _cases() -> list[Case]:
    # The bf16 CuTe forward's cases (masks, ragged random forms, no mask at ragged lengths).
    cases = forward_cases()
    # One mask per query head (Hm = Hq > Hk).
    cases += [
        Case("random", 1024, 1024, 8, 2, d, True, causal=causal, columns=columns, mask_heads=8)
        for causal, columns in FORMS
        for d in (64, 128, 256)
    ]
    # Several waves of programs (and persistent programs taking several items each).
    many = ("full", "causal", "causal_document", "document", "global_sliding_window")
    cases += [Case(name, 4096, 4096, 8, 2, 128, True) for name in many]
    cases += [Case("random_eviction", 4096, 4096, 8, 2, 128, True, mask_heads=2)]
    cases += [Case("document", 4096, 4096, 8, 2, d, True) for d in (64, 256)]
    cases += [Case("causal", 4000, 4500, 8, 2, 128, True)]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_matches_reference_within_fp8_rounding(case: Case):
    x = make_inputs(case)
    scale = case.d**-0.5
    out, lse, dequantised = fp8_forward(x, scale)
    check_fp8(case, x, scale, out, lse, dequantised)


def test_fully_masked_rows_give_zero_and_minus_infinity():
    # Causal with 384 queries on 256 keys: rows 0..127 see no key.
    case = Case("causal", 384, 256, 8, 2, 128, True)
    x = make_inputs(case)
    out, lse, dequantised = fp8_forward(x, 0.088)
    assert torch.isneginf(lse[:, :, :128]).all() and (out[:, :128] == 0).all()
    assert torch.isfinite(lse[:, :, 128:]).all()
    check_fp8(case, x, 0.088, out, lse, dequantised)


@pytest.mark.parametrize(
    "case",
    [
        *(Case(name, 1024, 1024, 8, 2, 128, True) for name in ("full", "causal", "document")),
        *(
            Case("random", 1000, 1100, 8, 2, d, True, causal=causal, columns=columns)
            for causal, columns in FORMS
            for d in (64, 256)
        ),
    ],
    ids=lambda c: c.id,
)
def test_sinks_join_the_rows_in_the_kernel(case: Case):
    """With sinks, out and lse are the call's without them with the sinks folded in after it
    (``kernels.sinks.fold_sinks``, what the FP8 path did before), to O's rounding; a fully
    masked row gives O = 0 and lse = its sink."""
    from flashmask.kernels.sinks import fold_sinks

    x = make_inputs(case)
    sinks = torch.linspace(-2.0, 3.0, case.hq, device="cuda")
    out, lse, _ = fp8_forward(x, 0.088, sinks=sinks)
    want_out, want_lse, _ = fp8_forward(x, 0.088)
    hidden = torch.isneginf(want_lse)
    fold_sinks(want_out, want_lse, sinks)
    floor = 4 * torch.finfo(out.dtype).eps * want_out.float().abs().amax().item()
    assert (out.float() - want_out.float()).abs().amax() <= floor, case.id
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (out.float().transpose(1, 2)[hidden] == 0).all(), "fully masked rows give 0"
    torch.testing.assert_close(lse[hidden], sinks.view(1, -1, 1).expand_as(lse)[hidden])


@pytest.mark.parametrize("name", ["causal", "document", "share_question"])
def test_float16_output(name: str):
    case = Case(name, 1024, 1024, 8, 2, 128, True)
    x = make_inputs(case)
    out, lse, dequantised = fp8_forward(x, 0.088, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    check_fp8(case, x, 0.088, out, lse, dequantised)


@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window"])
def test_skipping_equals_dense_bit_for_bit(name: str):
    x = make_inputs(Case(name, 4096, 4096, 8, 2, 128, True))
    skipped = fp8_forward(x, 0.088)
    dense = fp8_forward(x, 0.088, skip_tiles=False)
    assert torch.equal(skipped[0], dense[0]) and torch.equal(skipped[1], dense[1])


@pytest.mark.parametrize(
    "case",
    [
        Case("document", 4096, 4096, 8, 2, 128, True),
        Case("causal", 4096, 4096, 8, 2, 128, True),
        Case("random", 4500, 4000, 8, 2, 256, True, causal=False, columns=4, mask_heads=2),
    ],
    ids=lambda c: c.id,
)
def test_persistent_matches_one_item_per_program(case: Case):
    """The same ops per query tile either way: equal bit for bit."""
    x = make_inputs(case)
    on = fp8_forward(x, 0.088, persistent=True)
    off = fp8_forward(x, 0.088, persistent=False)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


def test_descales_scale_scores_and_output():
    """Halving every descale of v halves O; scaling q's descale by 2 and k's by 1/2 changes
    nothing."""
    from flashmask.kernels.cute_kernels import launch

    x = make_inputs(Case("causal_document", 1024, 1024, 8, 2, 128, True))
    hk = x.k.shape[2]
    (q8, qd), (k8, kd), (v8, vd) = (
        flashmask.quantize_fp8(t, group=t.shape[2] // hk) for t in (x.q, x.k, x.v)
    )
    bounds, (lists,) = preparation.prepare_cached(
        x.sri,
        x.causal,
        1024,
        1024,
        2,
        x.q.device,
        [launch.fp8_tile_shape(128, full_attention=False)],
    )
    (order,) = preparation.program_orders([(lists, 8, True)])

    def run(qd, kd, vd):
        return launch.forward_fp8(
            q8, k8, v8, bounds, lists, 1, x.causal, False, 0.088, True, order, qd, kd, vd
        )

    base = run(qd, kd, vd)
    halved = run(qd, kd, vd / 2)
    torch.testing.assert_close(halved[0].float(), base[0].float() / 2, atol=0, rtol=0)
    swapped = run(qd * 2, kd / 2, vd)
    torch.testing.assert_close(swapped[1], base[1], atol=1e-5, rtol=1e-6)


def test_rejects_bad_inputs_naming_them():
    from flashmask.kernels.cute_kernels import launch

    b, s, hq, hk, d = 1, 256, 4, 2, 128
    q8 = torch.zeros(b, s, hq, d, device="cuda").to(torch.float8_e4m3fn)
    k8 = torch.zeros(b, s, hk, d, device="cuda").to(torch.float8_e4m3fn)
    ones = torch.ones(b, hk, device="cuda")
    _, (lists,) = preparation.prepare_cached(
        None, True, s, s, b, q8.device, [launch.fp8_tile_shape(d, full_attention=False)]
    )

    def call(**change):
        args = {"q": q8, "k": k8, "v": k8, "q_descale": ones, "k_descale": ones, "v_descale": ones}
        args.update(change)
        return launch.forward_fp8(
            args["q"], args["k"], args["v"], None, lists, 1, True, False, 0.1, True, None,
            args["q_descale"], args["k_descale"], args["v_descale"],
        )  # fmt: skip

    call()  # the unchanged call runs
    with pytest.raises(TypeError, match=r"q must be torch\.float8_e4m3fn"):
        call(q=q8.to(torch.bfloat16))
    with pytest.raises(ValueError, match="v must have k's shape"):
        call(v=k8[:, :128])
    with pytest.raises(TypeError, match=r"k_descale must be torch\.float32"):
        call(k_descale=ones.half())
    with pytest.raises(ValueError, match="v_descale must be on q's CUDA device"):
        call(v_descale=ones.cpu())
