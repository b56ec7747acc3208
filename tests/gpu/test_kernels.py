"""The kernels on a CUDA GPU against float32 references, over masks, shapes and head dims.

Skipped without a CUDA GPU (marker ``gpu``). On a GPU machine, from the repository root::

    python -m pytest -q -n 4 tests/gpu                           # the quick matrix
    FLASHMASK_GPU_FULL=1 python -m pytest -q -n 4 tests/gpu      # every head dim
    FLASHMASK_GPU_REPORT=benchmarks/results/gpu_check_$(date +%F).json \\
        python -m pytest -q -n 4 tests/gpu                       # and a JSON summary

(``benchmarks/gpu_run.sh check`` runs the last; see ``tests/gpu/conftest.py``). The cases:

* every builder's mask (``masks.MASK_TYPES`` and ``hash_sparse``) at 1024 tokens, batch 2: head
  dims 64, 128 and 256 (full matrix: 32, 64, 96, 128, 192, 256), bf16 (and fp16 at 128 and
  256), 8 query heads on 8 key/value heads with ``deterministic=True`` and on 2 (grouped-query)
  with ``deterministic=False`` (the Gluon backward and its atomic dQ where routing sends it);
* random ``startend_row_indices`` of every form (causal with 1 or 2 columns, non-causal with 2
  or 4) with out-of-range values and empty or reversed intervals, at ragged ``Sq != Sk`` shapes
  down to one key: fully masked rows, and gradients that are exactly 0;
* full and causal attention with ``Sq != Sk`` (the causal offset), and more (batch x head)
  programs than one grid axis holds (65535);
* masked cases with the routing's length limits lifted (``routing.GLUON_FWD_MIN_MASKED_SEQLEN``
  and ``GLUON_BWD_MIN_MASKED_SEQLEN`` set to 0), so that the Gluon kernels run on these short
  masks too (Hopper only);
* bit-exactness: skipping tiles equals treating every tile as partial (``skip_tiles=False``),
  the deterministic backward repeats bit for bit, also after a fresh mask preparation, and the
  Triton forward's TMA loads (head dim 128) equal its pointer loads.

The rule (``tests/tolerance.py``): out, lse, dq, dk and dv are compared with a float32 reference
(``flashmask.reference`` on the same bf16/fp16 inputs); the error may be at most twice that of
PyTorch's own attention in the input dtype (``tests.tolerance.naive_attention``) plus rounding
noise, and 1.1x on the mean. lse is also held to float32 accuracy. Where the exact dq or dk is
0 (no query row sees two keys) only a few fp32 ulps of cancellation residue may remain. Fully
masked rows give out = 0, lse = -inf and dq = 0, and keys no query sees dk = dv = 0, exactly.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from flashmask import kernels, masks, reference
from flashmask.kernels import routing
from flashmask.kernels.config import device_decode_config
from flashmask.mask import FlashMask
from flashmask.reference import reference_backward, reference_forward
from tests.gpu.conftest import CASE_PROPERTY, FULL
from tests.tolerance import assert_close_to_reference, naive_attention, naive_logsumexp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEAD_DIMS = (32, 64, 96, 128, 192, 256) if FULL else (64, 128, 256)
MASK_NAMES = (*masks.MASK_TYPES, "hash_sparse")
UNMASKED = ("full", "causal")
# (causal, columns of startend_row_indices): every form a FlashMask takes.
FORMS = ((True, 1), (True, 2), (False, 2), (False, 4))
RANDOM_FORMS = tuple(f"random-causal{int(causal)}-C{columns}" for causal, columns in FORMS)
# Ragged (Sq, Sk) shapes: one token, one key, lengths off every tile, and multiples of 128 with
# Sq != Sk (the Gluon kernels' shapes, and the causal offset).
SHAPES = (
    (1, 1), (113, 203), (128, 217), (239, 1), (799, 3), (1023, 1024), (1024, 1023),
    (2048, 1999), (256, 384), (384, 256),
)  # fmt: skip
SEQLEN = 1024
BATCH = 2
# The logit cap (2.0: tight enough to change unit-variance scores) and the sinks, alone and
# together.
FEATURES = ({"softcap": 2.0}, {"sinks": True}, {"softcap": 2.0, "sinks": True})


@dataclass(frozen=True)
class Case:
    """One accuracy case: ``mask`` names a builder (``masks.example``; "full" and "causal" run
    without a mask) or is "random" (random indices of ``columns`` columns in the ``causal``
    form, ``mask_heads`` heads). ``gluon_everywhere`` lifts the routing's length limits."""

    mask: str
    sq: int
    sk: int
    hq: int
    hk: int
    d: int
    deterministic: bool
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    columns: int = 0
    mask_heads: int = 1
    batch: int = BATCH
    gluon_everywhere: bool = False
    dv: int | None = None  # V's head dim where it differs from Q's (multi-head latent attention)
    softcap: float = 0.0  # Gemma's logit cap
    sinks: bool = False  # learnable sinks (gpt-oss), one per query head

    @property
    def id(self) -> str:
        label = self.mask
        if self.mask == "random":
            label = f"random-causal{int(self.causal)}-C{self.columns}-Hm{self.mask_heads}"
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{label}-{self.sq}x{self.sk}-B{self.batch}-H{self.hq}:{self.hk}-D{self.d}-{dtype}"
        text += f"-det{int(self.deterministic)}" + (f"-Dv{self.dv}" if self.dv else "")
        text += (f"-cap{self.softcap:g}" if self.softcap else "") + ("-sinks" if self.sinks else "")
        return text + ("-gluon" if self.gluon_everywhere else "")


def _mask_cases() -> list[Case]:
    cases = []
    for name in MASK_NAMES:
        for d in HEAD_DIMS:
            for dtype in (torch.bfloat16, torch.float16):
                if dtype == torch.float16 and d not in (128, 256):
                    continue
                for hq, hk in ((8, 8), (8, 2)):
                    heads = hk if name == "random_eviction" else 1
                    case = Case(name, SEQLEN, SEQLEN, hq, hk, d, hk != 2, dtype, mask_heads=heads)
                    cases.append(case)
    return cases


def _shape_cases() -> list[Case]:
    cases = []
    for causal, columns in FORMS:
        for sq, sk in SHAPES:
            for hq, hk, hm in ((4, 4, 4), (8, 1, 1)):
                dims = (128,) if not FULL else (64, 128)
                if sq % 128 == 0 and sk % 128 == 0:  # the Gluon hd256 backward's shapes too
                    dims += (256,)
                for d in dims:
                    form = {"causal": causal, "columns": columns, "mask_heads": hm}
                    cases.append(Case("random", sq, sk, hq, hk, d, hk == 4, **form))
    for sq, sk in ((256, 384), (384, 256)):
        for name in UNMASKED:
            for d in (128, 256):
                for hq, hk in ((4, 4), (8, 2)):
                    cases.append(Case(name, sq, sk, hq, hk, d, hk == 4))
    # Multi-head latent attention's head dims (q/k 192, v 128) and the reverse, on the Triton
    # kernels, with and without a mask.
    for d, dv in ((192, 128), (64, 128)):
        cases.append(Case("random", 1000, 1100, 8, 2, d, True, causal=True, columns=1, dv=dv))
        cases.append(Case("causal", 1024, 1024, 8, 8, d, False, dv=dv))
    # One mask per query head (Hm = Hq > Hk): every kernel family, deterministic or not.
    for d in (64, 128, 256):
        for det in (True, False):
            cases.append(Case("random", 1024, 1024, 8, 2, d, det, causal=True, columns=2,
                              mask_heads=8))  # fmt: skip
            cases.append(Case("random", 2048, 2048, 8, 2, d, det, causal=False, columns=4,
                              mask_heads=8))  # fmt: skip
    # MLA's head dims capped, alone and with sinks (the Triton backward, deterministic or not).
    for feature in FEATURES[0], FEATURES[2]:
        for det in (True, False):
            case = Case("causal_document", SEQLEN, SEQLEN, 8, 2, 192, det, dv=128, **feature)
            cases.append(case)
    # Logit cap and learnable sinks, alone and together, on masks of every kind.
    for d in (64, 128, 256):
        for feature in FEATURES:
            for mask, hk in (("full", 8), ("causal_document", 2), ("share_question", 8)):
                cases.append(Case(mask, SEQLEN, SEQLEN, 8, hk, d, hk == 8, **feature))
            cases.append(Case("random", 1000, 1100, 8, 2, d, False, causal=False, columns=2,
                              **feature))  # fmt: skip
    # More (batch x head) programs than one grid axis may hold: heads and batch have axes of
    # their own, so this must run and be right.
    cases.append(Case("random", 16, 16, 16, 16, 64, True, causal=True, columns=1, batch=4100))
    return cases


def _gluon_cases() -> list[Case]:
    """Masked cases the Gluon kernels take once the length limits are lifted: the backward
    (``deterministic=False``) at head dims 64 and 128 and MLA's 192 / 128, the forward at 128;
    also with a logit cap (the Gluon kernels' ``SOFTCAP``) and sinks."""
    cases = []
    for name in MASK_NAMES:
        if name in UNMASKED:
            continue
        for d in (64, 128) if FULL else (128,):
            for hq, hk in ((8, 8), (8, 2)):
                heads = hk if name == "random_eviction" else 1
                case = Case(name, SEQLEN, SEQLEN, hq, hk, d, False, mask_heads=heads)
                cases.append(replace(case, gluon_everywhere=True))
    for causal, columns in FORMS:
        for sq, sk in ((256, 384), (384, 256)):
            for hq, hk, hm in ((4, 4, 4), (8, 1, 1)):
                form = {"causal": causal, "columns": columns, "mask_heads": hm}
                case = Case("random", sq, sk, hq, hk, 128, False, **form)
                cases.append(replace(case, gluon_everywhere=True))
    for feature in FEATURES:
        for name in ("causal_document", "share_question", "sliding_window"):
            case = Case(name, SEQLEN, SEQLEN, 8, 2, 128, False, **feature)
            cases.append(replace(case, gluon_everywhere=True))
    # Multi-head latent attention (Q/K 192, V 128: the hd256 layout with Q/K padded to 256):
    # masks of every kind, every random form at Sq != Sk, and sinks (capped calls run the Triton
    # backward: ``_shape_cases``).
    for name in ("full", "causal", "causal_document", "share_question", "random_eviction"):
        heads = 2 if name == "random_eviction" else 1
        case = Case(name, SEQLEN, SEQLEN, 8, 2, 192, False, mask_heads=heads, dv=128)
        cases.append(replace(case, gluon_everywhere=True))
    for causal, columns in FORMS:
        for sq, sk in ((256, 384), (384, 256)):
            form = {"causal": causal, "columns": columns, "mask_heads": 4, "dv": 128}
            case = Case("random", sq, sk, 4, 4, 192, False, **form)
            cases.append(replace(case, gluon_everywhere=True))
    case = Case("causal_document", SEQLEN, SEQLEN, 8, 2, 192, False, dv=128, sinks=True)
    cases.append(replace(case, gluon_everywhere=True))
    return cases


ACCURACY_CASES = _mask_cases() + _shape_cases()
GLUON_CASES = _gluon_cases()
# The deterministic cases the CuTe backward's deterministic variant takes once its routing limits
# (head dim 128, 8K keys, no mask) are lifted: head dims 64 and 128, lengths of whole 128-row
# tiles, no logit cap, V's head dim Q's.
CUTE_DETERMINISTIC_CASES = [
    c
    for c in ACCURACY_CASES
    if c.deterministic
    and c.d in (64, 128)
    and not c.dv
    and not c.softcap
    and c.sq % 128 == 0
    and c.sk % 128 == 0
]


def random_indices(
    b: int, hm: int, sq: int, sk: int, causal: bool, columns: int, generator: torch.Generator
) -> torch.Tensor:
    """Random int32 ``startend_row_indices [b, hm, sk, columns]`` including out-of-range values
    and empty or reversed intervals (with 4 columns mostly the upper interval above the lower
    one)."""
    x = torch.randint(-2, sq + 3, (b, hm, sk, columns), generator=generator, dtype=torch.int32)
    if columns == 4 and not causal:
        x = x.sort(-1).values[..., [2, 3, 0, 1]]
    return x


@dataclass
class Inputs:
    """A case's CUDA tensors: ``q, dout [B, Sq, Hq, D]``, ``k, v [B, Sk, Hk, D]``, the mask
    (``sri`` or ``None``, ``causal``) and its visibility, bool ``[B or 1, Hm or 1, Sq, Sk]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    sri: torch.Tensor | None
    causal: bool
    visible: torch.Tensor


def make_inputs(case: Case) -> Inputs:
    """Inputs drawn from a seed of the case's id (the same on every run and worker)."""
    seed = zlib.crc32(case.id.encode())
    cpu = torch.Generator().manual_seed(seed)
    gpu = torch.Generator(device="cuda").manual_seed(seed)

    def randn(s: int, h: int, d: int = case.d) -> torch.Tensor:
        shape = (case.batch, s, h, d)
        return torch.randn(shape, generator=gpu, device="cuda", dtype=case.dtype)

    dv = case.dv or case.d
    q, dout = randn(case.sq, case.hq), randn(case.sq, case.hq, dv)
    k, v = randn(case.sk, case.hk), randn(case.sk, case.hk, dv)
    if case.mask in UNMASKED:
        causal = case.mask == "causal"
        rows = torch.arange(case.sq, device="cuda").view(-1, 1)
        cols = torch.arange(case.sk, device="cuda").view(1, -1)
        visible = cols <= rows + (case.sk - case.sq)
        if not causal:
            visible = torch.ones_like(visible)
        return Inputs(q, k, v, dout, None, causal, visible[None, None])
    if case.mask == "random":
        sri = random_indices(
            case.batch, case.mask_heads, case.sq, case.sk, case.causal, case.columns, cpu
        ).cuda()
        mask = FlashMask(sri, case.causal)
    else:
        # The builder's mask over the keys, read by its last Sq query rows (a decode step or a
        # prefill chunk at the end of a cache when Sq < Sk).
        mask = masks.example(
            case.mask, case.sk, batch_size=case.batch, num_heads=case.mask_heads, generator=cpu
        )
        mask = mask.last_rows(case.sq).to("cuda")
    return Inputs(q, k, v, dout, mask.startend_row_indices, mask.causal, mask.to_dense(case.sq))


def kernel_paths(x: Inputs, scale: float, deterministic: bool, softcap: float = 0.0) -> str:
    """Which forward and backward kernels a call runs (``split-kv``, ``cute``, ``gluon`` or
    ``triton``), by the launchers' own routing rules, so that a run shows which paths it
    checked."""
    d, masked = x.q.shape[-1], x.sri is not None
    config = kernels.tile_config(d, has_mask=masked)
    plain = not softcap and x.v.shape[-1] == d
    if plain and routing.use_decode(x.q, x.k, True, device_decode_config(d, x.q.device)):
        fwd = "split-kv"
    else:
        cute, gluon = routing.forward_kernel(
            x.q, x.k, x.v, scale, masked, x.causal, config, softcap
        )
        fwd = "cute" if cute else "gluon" if gluon else "triton"
    bwd = routing.use_gluon_backward(
        x.q, x.k, x.v, x.dout, deterministic, True, masked, config, softcap
    )
    bwd_name = ("cute" if routing.use_cute_backward(x.q, softcap) else "gluon") if bwd else "triton"
    if not bwd and routing.use_cute_deterministic_backward(
        x.q, x.k, x.v, x.dout, deterministic, masked, softcap
    ):
        bwd_name = "cute-deterministic"
    return f"fwd={fwd} bwd={bwd_name}"


def residue_bound(name: str, x: Inputs, scale: float) -> float:
    """The largest |dq| or |dk| allowed where the exact gradient is 0 (every query row sees at
    most one key, so its softmax is constant): ``dS = P * (dP - delta)`` with
    ``delta = rowsum(dO * O)`` leaves a few fp32 ulps of the terms' size (as the CPU suite's
    ``tests/kernels/triton_kernels/test_kernels.py``)."""
    d = x.q.shape[-1]
    terms = (x.dout.float().abs() * x.v.float().abs().amax()).sum(-1).amax().item()
    operand = max(x.q.abs().amax().item(), x.k.abs().amax().item())
    summed = x.q.shape[2] // x.k.shape[2] * x.q.shape[1] if name == "dk" else 1
    return 4 * d * torch.finfo(torch.float32).eps * terms * operand * abs(scale) * summed


def check_accuracy(case: Case, record_property) -> None:
    """Run the kernels on ``case``, record their errors (see ``conftest.summary``) and fail
    with every rule they break."""
    x = make_inputs(case)
    b, sq, hq, d = x.q.shape
    sk, hk = x.k.shape[1], x.k.shape[2]
    scale = d**-0.5
    record = {"kind": "accuracy", "case": case.id}
    record["kernels"] = kernel_paths(x, scale, case.deterministic, case.softcap)
    record_property(CASE_PROPERTY, record)
    cap = case.softcap
    # One sink logit per query head, some below and some above the scores' range.
    sinks = torch.linspace(-2.0, 3.0, hq, device="cuda") if case.sinks else None
    out, lse = kernels.forward(x.q, x.k, x.v, x.sri, x.causal, scale, softcap=cap, sinks=sinks)
    dq, dk, dv, *dsinks = kernels.backward(
        x.dout, None, x.q, x.k, x.v, out, lse, x.sri, x.causal, scale, case.deterministic,
        softcap=cap, sinks=sinks,
    )  # fmt: skip

    intervals = FlashMask(x.sri, x.causal).intervals(sq) if x.sri is not None else None
    qf, kf, vf = x.q.float(), x.k.float(), x.v.float()
    ref_out, ref_lse = reference_forward(qf, kf, vf, intervals, x.causal, scale, softcap=cap)
    if sinks is not None:
        ref_out, ref_lse = reference.fold_sinks(ref_out, ref_lse, sinks)
    ref_grads = reference_backward(
        x.dout.float(), None, qf, kf, vf, ref_out, ref_lse, intervals, x.causal, scale,
        softcap=cap,
    )  # fmt: skip
    low = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
    features = {"softcap": cap, "sinks": sinks}
    low_out = naive_attention(*low, x.visible, scale, dtype=case.dtype, **features)
    low_out.backward(x.dout)
    low_lse = naive_logsumexp(x.q, x.k, x.visible, scale, dtype=case.dtype, **features)

    per_head = x.visible.expand(b, -1, sq, sk)
    per_head = per_head.repeat_interleave(hq // per_head.shape[1], 1)  # [B, Hq, Sq, Sk]
    dead_rows = ~per_head.any(-1)  # [B, Hq, Sq]
    dead_cols = ~per_head.any(-2).view(b, hk, hq // hk, sk).any(2)  # [B, Hk, Sk]
    # No query row sees two keys: the exact dq and dk are 0 (a constant softmax).
    exact_zero = bool((per_head.sum(-1) <= 1).all())

    failures, errors = [], {}
    rows, cols = dead_rows.transpose(1, 2), dead_cols.transpose(1, 2)  # [B, S, H]
    dead_lse = torch.full_like(lse, float("-inf"))
    if sinks is not None:  # a row that sees no key keeps the sink alone
        dead_lse = sinks.view(1, hq, 1).expand_as(lse)
        # dsinks sums rowsum(dO * O') over rows, whose only error is the stored out's rounding:
        # it must equal the float64 gradient from the kernels' own out and lse.
        exact = reference.sink_gradient(
            lse.double(), reference.row_term(x.dout.double(), out.double(), None), sinks.double()
        )
        errors["dsinks"] = {"max_err": (dsinks[0].double() - exact).abs().max().item()}
        try:
            torch.testing.assert_close(dsinks[0].double(), exact, rtol=1e-4, atol=1e-4)
        except AssertionError as exc:
            failures.append(f"dsinks: {exc}")
    for name, ok in (
        ("out of fully masked rows is 0", (out[rows] == 0).all()),
        ("lse of fully masked rows is -inf (the sink)", (lse == dead_lse)[dead_rows].all()),
        ("dq of fully masked rows is 0", (dq[rows] == 0).all()),
        ("dk of keys no query sees is 0", (dk[cols] == 0).all()),
        ("dv of keys no query sees is 0", (dv[cols] == 0).all()),
    ):
        if not bool(ok):
            failures.append(f"{name}: not so")
    live = ~dead_rows
    pairs = [
        ("out", out, ref_out, low_out),
        ("lse", lse[live], ref_lse[live], low_lse[live]),
        *zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, (t.grad for t in low), strict=True),
    ]
    for name, actual, hi, lo in pairs:
        if actual.numel() == 0:
            continue
        err = (actual.double() - hi.double()).abs().max().item()
        if exact_zero and name in ("dq", "dk"):
            bound = residue_bound(name, x, scale)
            errors[name] = {"max_err": err, "residue_bound": bound}
            if not err <= bound:
                failures.append(f"{name}: residue {err:.3e} above {bound:.3e} (exact value 0)")
            continue
        err_lo = (lo.double() - hi.double()).abs().max().item()
        ratio = err / err_lo if err_lo > 0 else None
        errors[name] = {"max_err": err, "max_err_lowp": err_lo, "ratio_vs_lowp": ratio}
        try:
            assert_close_to_reference(actual, hi, lo, name, context=case.id)
            if name == "lse":
                torch.testing.assert_close(actual, hi.float())
        except AssertionError as exc:
            failures.append(str(exc))
    record["errors"] = errors
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=lambda c: c.id)
def test_kernels_match_the_reference(case: Case, record_property) -> None:
    """out, lse, dq, dk, dv of one case within the tolerance rule of the float32 reference."""
    check_accuracy(case, record_property)


@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: c.id)
def test_gluon_kernels_on_short_masks_match_the_reference(
    case: Case, record_property, monkeypatch
) -> None:
    """With the routing's masked length limits at 0, the Gluon backward (and at head dim 128
    the Gluon forward) runs on these short masked cases, capped ones too, within the same
    rule."""
    capability = torch.cuda.get_device_capability()
    if capability[0] != 9 or not routing.gluon_available():
        pytest.skip(f"the Gluon kernels run on Hopper (sm_90) only; this GPU is {capability}")
    monkeypatch.setattr(routing, "GLUON_FWD_MIN_MASKED_SEQLEN", 0)
    monkeypatch.setattr(
        routing,
        "GLUON_BWD_MIN_MASKED_SEQLEN",
        dict.fromkeys(routing.GLUON_BWD_MIN_MASKED_SEQLEN, 0),
    )
    x = make_inputs(case)
    paths = kernel_paths(x, case.d**-0.5, case.deterministic, case.softcap)
    fwd_gluon = kernels.tile_config(case.d, has_mask=True).fwd_gluon
    assert paths == f"fwd={'gluon' if fwd_gluon else 'triton'} bwd=gluon", paths
    check_accuracy(case, record_property)


@pytest.mark.parametrize("case", CUTE_DETERMINISTIC_CASES, ids=lambda c: c.id)
def test_the_cute_deterministic_backward_on_short_masks_matches_the_reference(
    case: Case, record_property, monkeypatch
) -> None:
    """With the routing's limits lifted (any length, masks, head dims 64 and 128), the CuTe
    backward's deterministic variant runs these cases within the same rule, and a repeated
    backward equals the first bit for bit."""
    capability = torch.cuda.get_device_capability()
    if capability[0] != 9 or not routing.cute_available():
        pytest.skip(f"the CuTe kernels run on Hopper (sm_90) with flashmask[cute]; {capability}")
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_MIN_SEQLEN", 0)
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_MASKED", True)
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_HEAD_DIMS", (64, 128))
    x = make_inputs(case)
    paths = kernel_paths(x, case.d**-0.5, case.deterministic, case.softcap)
    assert paths.endswith("bwd=cute-deterministic"), paths
    check_accuracy(case, record_property)
    scale = case.d**-0.5
    out, lse = kernels.forward(x.q, x.k, x.v, x.sri, x.causal, scale)
    first = kernels.backward(x.dout, None, x.q, x.k, x.v, out, lse, x.sri, x.causal, scale, True)
    again = kernels.backward(x.dout, None, x.q, x.k, x.v, out, lse, x.sri, x.causal, scale, True)
    assert _equal(first, again)


def _bit_exact_cases() -> list[tuple[str, float | None]]:
    """(mask, scale): every builder's mask at the default scale, three with a negative scale
    (the forward's scale-before-max path), and random masks of every form."""
    cases = [(name, None) for name in MASK_NAMES]
    cases += [(name, -0.05) for name in ("causal", "document", "prefix_lm_causal")]
    return cases + [(name, None) for name in RANDOM_FORMS]


def _bit_exact_inputs(mask: str) -> Inputs:
    """hd128, bf16, batch 2 x 1024 tokens, 8 query heads on 2 key/value heads."""
    if mask in RANDOM_FORMS:
        causal, columns = FORMS[RANDOM_FORMS.index(mask)]
        case = Case("random", SEQLEN, SEQLEN, 8, 2, 128, True, causal=causal, columns=columns)
    else:
        case = Case(mask, SEQLEN, SEQLEN, 8, 2, 128, True, mask_heads=2 if "evict" in mask else 1)
    return make_inputs(case)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mask, scale", _bit_exact_cases())
def test_skipping_and_repeats_are_bit_exact(mask: str, scale: float | None, record_property):
    """Skipping tiles == every tile partial (``skip_tiles=False``), forward and deterministic
    backward; a repeated backward == the first; a fresh mask preparation == the cached one."""
    x = _bit_exact_inputs(mask)
    scale = x.q.shape[-1] ** -0.5 if scale is None else scale
    args = (x.sri, x.causal, scale)
    o1, l1 = kernels.forward(x.q, x.k, x.v, *args)
    o2, l2 = kernels.forward(x.q, x.k, x.v, *args, skip_tiles=False)
    g1 = kernels.backward(x.dout, None, x.q, x.k, x.v, o1, l1, *args, True)
    g2 = kernels.backward(x.dout, None, x.q, x.k, x.v, o1, l1, *args, True, skip_tiles=False)
    g3 = kernels.backward(x.dout, None, x.q, x.k, x.v, o1, l1, *args, True)
    # The repeat above reused the mask's cached preparation; prepare it afresh once more.
    kernels.clear_prepared()
    o5, l5 = kernels.forward(x.q, x.k, x.v, *args)
    g5 = kernels.backward(x.dout, None, x.q, x.k, x.v, o5, l5, *args, True)
    checks = {
        "skip_equals_dense": _equal((o1, l1, *g1), (o2, l2, *g2)),
        "deterministic_repeat": _equal(g1, g3),
        "cached_equals_fresh_preparation": _equal((o1, l1, *g1), (o5, l5, *g5)),
    }
    record = {"kind": "bit_exact", "case": f"{mask}-scale{scale:.3g}", **checks}
    record_property(CASE_PROPERTY, record)
    assert all(checks.values()), checks


TMA_CASES = ("full", "causal", "document", "prefix_lm_causal", *RANDOM_FORMS)


@pytest.mark.parametrize("mask", TMA_CASES)
def test_forward_tma_loads_are_bit_exact(mask: str, record_property) -> None:
    """The Triton forward at head dim 128 as shipped (Q/K/V tiles loaded through TMA tensor
    descriptors, ``TileConfig.fwd_tma``) == the same forward with pointer loads, bitwise."""
    x = _bit_exact_inputs(mask)
    args = (x.sri, x.causal, x.q.shape[-1] ** -0.5)
    # The Triton forward on both sides: where the default is the Gluon forward (no mask,
    # hd128), comparing it with itself would prove nothing about the loads.
    base = kernels.tile_config(x.q.shape[-1], has_mask=x.sri is not None)
    base = replace(base, fwd_gluon=False, fwd_tma=True)
    pointers = replace(base, fwd_tma=False)
    tma = kernels.forward(x.q, x.k, x.v, *args, config=base)
    plain = kernels.forward(x.q, x.k, x.v, *args, config=pointers)
    equal = _equal(tma, plain)
    record_property(CASE_PROPERTY, {"kind": "tma_loads", "case": mask, "equal": equal})
    assert equal, f"{mask}: the forward's TMA loads change its results"
