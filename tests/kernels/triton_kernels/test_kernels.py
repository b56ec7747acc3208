"""The Triton kernels (``flashmask.kernels.forward`` / ``backward``) against the float64 oracle.

On a machine without CUDA every test runs the same kernel code through Triton's interpreter on
the CPU, with 16x16 tiles and fp16 only: the interpreter evaluates tiles with numpy, which has no
bfloat16, so bf16 cases are GPU-only. On a CUDA machine the same tests run on the GPU in fp16 and
bf16 with the production tile configuration.

Every comparison uses the suite's one tolerance rule (``tests.tolerance``): the kernel's error
against ``reference.py`` in float64 may be at most twice (max) / 1.1 times (mean) the error of a
plain low-precision implementation, plus rounding noise (see ``check_against_reference`` for
which one); lse is also held to float32 accuracy. Exactly-zero results are checked exactly:
fully masked query rows give ``out == 0``, ``lse == -inf`` and ``dq == 0``; key columns no query
sees give ``dk == dv == 0``.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before anything imports triton (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import zlib  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402

from flashmask import kernels  # noqa: E402
from flashmask.kernels import (  # noqa: E402
    TileConfig,
    backward_launcher,
    hardware,
    preparation,
    routing,
    tensors,
    tiles,
)
from flashmask.mask import FlashMask, TileClass  # noqa: E402
from flashmask.reference import reference_backward, reference_forward  # noqa: E402
from tests.tolerance import (  # noqa: E402
    assert_close_to_reference,
    naive_attention,
    naive_logsumexp,
)

# Triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecates.
INTERPRETER_WARNING = "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
pytestmark = [
    pytest.mark.gpu if CUDA else pytest.mark.interpreter,
    pytest.mark.filterwarnings(INTERPRETER_WARNING),
]

DEVICE = torch.device("cuda" if CUDA else "cpu")
FP16 = pytest.param(torch.float16, id="fp16")
BF16 = pytest.param(
    torch.bfloat16,
    id="bf16",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            not CUDA,
            reason="bf16 needs a GPU: Triton's interpreter computes tiles in numpy, which has no "
            "bfloat16 (it returns garbage)",
        ),
    ],
)
DTYPES = [FP16, BF16]

# 16x16 tiles everywhere: the interpreter's default, and on a GPU the size at which these small
# masks skip whole tiles (the production tiles of 64-128 would cover them with one tile).
SMALL_TILES = TileConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)

# (causal, C) of startend_row_indices; C = 0 means no interval mask (startend_row_indices=None).
FORMS = {
    "causal-C1": (True, 1),
    "causal-C2": (True, 2),
    "noncausal-C2": (False, 2),
    "noncausal-C4": (False, 4),
    "nomask-full": (False, 0),
    "nomask-causal": (True, 0),
}
MASK_FORMS = ["causal-C1", "causal-C2", "noncausal-C2", "noncausal-C4"]
ALL_FORMS = [*MASK_FORMS, "nomask-full", "nomask-causal"]


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


# ---------------------------------------------------------------------------------------- masks
def random_indices(
    form: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, gen: torch.Generator
) -> torch.Tensor:
    """Uniform random bounds in ``[0, Sq]`` per column, ordered the way the form means them."""
    causal, c = FORMS[form]
    v = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k, c), generator=gen)
    v = v.sort(-1).values
    if not causal and c == 2:  # masked [LTS, Sq) + [0, UTE) with UTE <= LTS
        v = v.flip(-1)
    elif c == 4:  # masked [LTS, LTE) + [UTS, UTE), the upper interval above the lower one
        v = v[..., [2, 3, 0, 1]]
    return v.to(torch.int32)


def _stack(columns: list[list[int]], heads: int) -> torch.Tensor:
    """``[Sk, C]`` columns -> ``[1, heads, Sk, C]`` int32 (the same mask for every head)."""
    return torch.tensor(columns, dtype=torch.int32)[None, None].expand(1, heads, -1, -1)


def _doc_spans(doc_lens: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in doc_lens:
        spans.append((start, start + n))
        start += n
    return spans


def causal_document_padded(seqlen: int, doc_lens: list[int], heads: int = 1) -> torch.Tensor:
    """causal-C1: documents attend causally within themselves; the padding tail after the last
    document is hidden from every row (fully masked key columns and fully masked query rows)."""
    columns = [[0]] * seqlen
    for start, end in _doc_spans(doc_lens):
        for j in range(start, end):
            columns[j] = [end]
    return _stack(columns, heads)


def share_question(seqlen: int, docs: list[list[int]], heads: int = 1) -> torch.Tensor:
    """causal-C2: a question followed by answers that all see the question, not each other
    (``docs`` = [question length, answer lengths...]); the rest of the sequence is padding that
    sees only itself."""
    columns = [[j + 1, seqlen] for j in range(seqlen)]  # padding: only the diagonal
    start = 0
    for lens in docs:
        doc_end = start + sum(lens)
        spans = _doc_spans(lens)
        for j in range(start, start + lens[0]):
            columns[j] = [doc_end, seqlen]
        for a_start, a_end in spans[1:]:
            for j in range(start + a_start, start + a_end):
                columns[j] = [start + a_end, doc_end]
        start = doc_end
    return _stack(columns, heads)


def bidirectional_window(seqlen_q: int, seqlen_k: int, window: int, heads: int = 1) -> torch.Tensor:
    """noncausal-C2: key j is visible to rows ``[j - window, j + window]``."""
    columns = [[min(j + window + 1, seqlen_q), max(j - window, 0)] for j in range(seqlen_k)]
    return _stack(columns, heads)


def document_padded(seqlen: int, doc_lens: list[int], heads: int = 1) -> torch.Tensor:
    """noncausal-C4: bidirectional documents; padding columns are hidden from every row."""
    columns = [[0, seqlen, 0, 0]] * seqlen
    for start, end in _doc_spans(doc_lens):
        for j in range(start, end):
            columns[j] = [end, seqlen, 0, start]  # masked [end, Sq) and [0, start)
    return _stack(columns, heads)


def causal_window(seqlen_q: int, seqlen_k: int, window: int, heads: int = 1) -> torch.Tensor:
    """causal-C2 sliding window: key j is hidden from rows ``>= j + window`` (``LTE = Sq``)."""
    return _stack([[min(j + window, seqlen_q), seqlen_q] for j in range(seqlen_k)], heads)


def structured_indices(form: str, batch: int, heads: int, seqlen: int) -> torch.Tensor:
    """A builder-like mask of ``form`` at ``Sq = Sk = seqlen`` (different for every batch item
    and head), with whole 16x16 tiles skipped and unmasked."""
    items = []
    for b in range(batch):
        per_head = []
        for h in range(heads):
            i = b * heads + h
            if form == "causal-C1":
                docs = [[40, 7], [7, 16, 9], [33, 17], [20, 13]][i % 4]
                m = causal_document_padded(seqlen, docs)
            elif form == "causal-C2" and i % 2:
                m = causal_window(seqlen, seqlen, [40, 9][i // 2 % 2])
            elif form == "causal-C2":
                docs = [[[24, 10, 14]], [[5, 10, 12], [4, 6, 6]], [[3, 20], [8, 8, 1]]][i // 2 % 3]
                m = share_question(seqlen, docs)
            elif form == "noncausal-C2":
                m = bidirectional_window(seqlen, seqlen, [40, 3, 20, 11][i % 4])
            else:
                docs = [[12, 20, 9], [32, 5], [17, 17, 10], [40]][i % 4]  # + padding
                m = document_padded(seqlen, docs)
            per_head.append(m[:, 0])
        items.append(torch.stack(per_head, dim=1))
    return torch.cat(items).contiguous()


def visibility(
    sri: torch.Tensor | None, causal: bool, batch: int, seqlen_q: int, seqlen_k: int
) -> torch.Tensor:
    """Dense visibility ``[B, Hm, Sq, Sk]`` (True = the query row may attend to the key)."""
    if sri is not None:
        return FlashMask(sri.cpu(), causal).to_dense(seqlen_q)
    rows = torch.arange(seqlen_q).view(-1, 1)
    cols = torch.arange(seqlen_k).view(1, -1)
    visible = cols <= rows + (seqlen_k - seqlen_q) if causal else cols >= 0
    return visible.expand(batch, 1, seqlen_q, seqlen_k)


# ---------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    form: str
    seqlen_q: int
    seqlen_k: int
    heads_q: int = 2
    heads_k: int = 2
    mask_heads: int = 1
    head_dim: int = 64
    batch: int = 1
    mask: str = "random"  # "random" or "structured" (ignored for the nomask forms)

    @property
    def causal(self) -> bool:
        return FORMS[self.form][0]

    @property
    def id(self) -> str:
        kind = "" if FORMS[self.form][1] == 0 else f"-{self.mask}-Hm{self.mask_heads}"
        return (
            f"{self.form}{kind}-{self.seqlen_q}x{self.seqlen_k}-b{self.batch}"
            f"-h{self.heads_q}k{self.heads_k}-d{self.head_dim}"
        )


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    sri: torch.Tensor | None
    scale: float
    seed: int


def make_inputs(case: Case, dtype: torch.dtype, *, seed: int | None = None) -> Inputs:
    seed = _seed(case.id) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, d = case.batch, case.seqlen_q, case.seqlen_k, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q, k, v = (
        randn(b, sq, case.heads_q, d),
        randn(b, sk, case.heads_k, d),
        randn(b, sk, case.heads_k, d),
    )
    dout = randn(b, sq, case.heads_q, d)
    if FORMS[case.form][1] == 0:
        sri = None
    elif case.mask == "random":
        sri = random_indices(case.form, b, case.mask_heads, sq, sk, gen)
    else:
        assert sq == sk, "structured masks are defined for Sq == Sk"
        sri = structured_indices(case.form, b, case.mask_heads, sq)
    sri = None if sri is None else sri.to(DEVICE)
    return Inputs(q, k, v, dout, sri, d**-0.5, seed)


# The ways the Triton backward launches its dQ pass: in one grid with the dK/dV pass (where
# their warp counts agree, the default at D <= 128) or as a launch of its own (D = 256).
DQ_PATHS = ["dq-pass", "dq-pass-own-launch"]


def dq_path(path: str, head_dim: int) -> dict:
    """``run_kernels`` arguments selecting a dQ path."""
    if path == "dq-pass":
        return {"deterministic": True}
    config = kernels.tile_config(head_dim)
    return {"deterministic": True, "config": replace(config, dq_warps=2 * config.bwd_warps)}


def run_kernels(
    x: Inputs,
    causal: bool,
    *,
    deterministic: bool = True,
    dlse: torch.Tensor | None = None,
    skip_tiles: bool = True,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(out, lse, dq, dk, dv)`` from the Triton kernels."""
    out, lse = kernels.forward(
        x.q, x.k, x.v, x.sri, causal, x.scale, skip_tiles=skip_tiles, config=config
    )
    grads = kernels.backward(
        x.dout, dlse, x.q, x.k, x.v, out, lse, x.sri, causal, x.scale, deterministic,
        skip_tiles=skip_tiles, config=config,
    )  # fmt: skip
    return out, lse, *grads


def run_reference(
    x: Inputs, causal: bool, dtype: torch.dtype, dlse: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """``(out, lse, dq, dk, dv)`` of ``reference.py`` computed from ``x`` cast to ``dtype``."""
    intervals = None if x.sri is None else FlashMask(x.sri, causal).intervals(x.q.shape[1])
    q, k, v, dout = (t.to(dtype) for t in (x.q, x.k, x.v, x.dout))
    out, lse = reference_forward(q, k, v, intervals, causal, x.scale)
    dlse = None if dlse is None else dlse.to(lse.dtype)
    grads = reference_backward(dout, dlse, q, k, v, out, lse, intervals, causal, x.scale)
    return out, lse, *grads


def run_low_precision(
    x: Inputs, causal: bool, dlse: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """``(out, lse, dq, dk, dv)`` of plain PyTorch attention in the input dtype (autograd)."""
    dtype = x.q.dtype
    b, sq, _, _ = x.q.shape
    visible = visibility(x.sri, causal, b, sq, x.k.shape[1]).to(DEVICE)
    q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    out = naive_attention(q, k, v, visible, x.scale, dtype=dtype)
    lse = naive_logsumexp(q, k, visible, x.scale, dtype=dtype)
    outputs, grad_outputs = [out], [x.dout]
    if dlse is not None:
        outputs.append(lse)
        grad_outputs.append(dlse.to(dtype))
    grads = torch.autograd.grad(outputs, (q, k, v), grad_outputs)
    return out.detach(), lse.detach(), *grads


def _worse(hi: torch.Tensor, *candidates: torch.Tensor) -> torch.Tensor:
    """The candidate farther (max abs) from ``hi``."""
    return max(candidates, key=lambda c: (c.double() - hi.double()).abs().max().item())


def check_against_reference(
    actual: tuple[torch.Tensor, ...],
    x: Inputs,
    causal: bool,
    context: str,
    *,
    dlse: torch.Tensor | None = None,
) -> None:
    """out, lse, dq, dk, dv vs the float64 reference, with exact zeros where nothing is visible.

    ``ref_lo`` (the error budget's yardstick) is plain PyTorch attention in the input dtype
    (``tests.tolerance.naive_attention``, FlashAttention's ``upcast=False`` reference): the
    kernels, like FlashAttention, round P and dS to the input dtype before their matmuls, which
    ``reference.py`` (fp32 compute) does not, so ``reference.py``'s fp16 run alone would be a
    yardstick ~1.5x too tight for the mean rule. Where that plain run happens to be exact (a
    softmax over a single key has zero gradient in any precision, while the kernel's
    ``rowsum(dO * O) - dO.V`` leaves fp32 residue) ``reference.py``'s fp16 run is used instead:
    ``ref_lo`` is whichever of the two is farther from float64.
    """
    out, lse, dq, dk, dv = actual
    dtype = x.q.dtype
    hi = run_reference(x, causal, torch.float64, dlse)
    lo = [
        _worse(h, a, b)
        for h, a, b in zip(
            hi,
            run_low_precision(x, causal, dlse),
            run_reference(x, causal, dtype, dlse),
            strict=True,
        )
    ]
    context = f"({context}, seed={x.seed})"

    # Exact values where rows or columns see nothing.
    b, sq, hq, _ = x.q.shape
    sk, hk = x.k.shape[1], x.k.shape[2]
    visible = visibility(x.sri, causal, b, sq, sk).to(DEVICE)
    per_q_head = visible.repeat_interleave(hq // visible.shape[1], dim=1)  # [B, Hq, Sq, Sk]
    dead_rows = ~per_q_head.any(-1)  # [B, Hq, Sq]
    dead_cols = ~per_q_head.any(-2).view(b, hk, hq // hk, sk).any(2)  # [B, Hk, Sk]
    assert torch.equal(hi[1] == float("-inf"), dead_rows), f"reference lse -inf rows {context}"
    rows_bshd = dead_rows.transpose(1, 2)  # [B, Sq, Hq]
    cols_bshd = dead_cols.transpose(1, 2)  # [B, Sk, Hk]
    assert bool((out[rows_bshd] == 0).all()), f"out of fully masked rows is not 0 {context}"
    assert bool((lse[dead_rows] == float("-inf")).all()), f"lse of fully masked rows {context}"
    assert bool((dq[rows_bshd] == 0).all()), f"dq of fully masked rows is not 0 {context}"
    assert bool((dk[cols_bshd] == 0).all()), f"dk of fully masked columns is not 0 {context}"
    assert bool((dv[cols_bshd] == 0).all()), f"dv of fully masked columns is not 0 {context}"

    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    assert lse.dtype == torch.float32
    assert_close_to_reference(out, hi[0], lo[0], "out", context=context)
    live = ~dead_rows
    assert_close_to_reference(lse[live], hi[1][live], lo[1][live], "lse", context=context)
    # lse is float32 computed in float32 like reference.py's: also hold it to float32 accuracy
    # (torch.testing's float32 tolerances), which the low-precision yardstick above cannot.
    torch.testing.assert_close(
        lse[live], hi[1][live].float(), msg=lambda m: f"lse vs float64 reference {context}: {m}"
    )
    for name, a, h, l in zip(("dq", "dk", "dv"), actual[2:], hi[2:], lo[2:], strict=True):
        if name != "dv" and not bool(h.any()):
            _assert_cancellation_residue(a, x, name, context)
        else:
            assert_close_to_reference(a, h, l, name, context=context)


def _assert_cancellation_residue(grad: torch.Tensor, x: Inputs, name: str, context: str) -> None:
    """dq or dk whose exact value is 0 everywhere (every row sees at most one key: a constant
    softmax). The kernels, like FlashAttention, form ``dS = P * (dP - delta)`` with
    ``delta = rowsum(dO * O)``: two fp32 dot products of ``D`` terms that cancel up to rounding,
    so only a residue of a few fp32 ulps of their size may remain (no relative rule applies)."""
    _, sq, hq, d = x.q.shape
    terms = (x.dout.float() * x.v.float().abs().amax()).abs().sum(-1).amax().item()
    operand = max(x.q.abs().amax().item(), x.k.abs().amax().item())
    summed = sq * hq // x.k.shape[2] if name == "dk" else 1
    bound = 4 * d * torch.finfo(torch.float32).eps * terms * operand * x.scale * summed
    worst = grad.abs().amax().item()
    assert worst <= bound, f"{name}: exact value 0, got {worst:.3e} (bound {bound:.3e}) {context}"


# ------------------------------------------------------------------------ kernel vs reference
# Ragged shapes, plus one that divides the 16x16 test tiles (the unmasked-load fast path).
SHAPES = [(1, 1), (17, 17), (37, 50), (50, 37), (33, 65), (48, 64)]
# (Hq, Hk, Hm): MHA with a shared and a per-head mask, MQA, GQA with a per-kv-head mask.
HEADS = [(2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 2, 2)]
HEAD_DIMS = [16, 40, 64]  # 40 runs with a padded BLOCK_D of 64


def _matrix() -> list[Case]:
    """A representative slice of forms x shapes x heads x head dims x batch (not the product):
    every form meets every shape, every head layout and every head dim."""
    cases = []
    for i, form in enumerate(ALL_FORMS):
        for j, (sq, sk) in enumerate(SHAPES):
            hq, hk, hm = HEADS[(i + j) % len(HEADS)]
            if FORMS[form][1] == 0:
                hm = 1
            d = HEAD_DIMS[(i + 2 * j) % len(HEAD_DIMS)]
            cases.append(Case(form, sq, sk, hq, hk, hm, d, batch=1 + (i + j) % 2))
    for i, form in enumerate(MASK_FORMS):
        hq, hk, hm = [(2, 2, 2), (4, 1, 1), (4, 2, 2), (2, 2, 1)][i]
        cases.append(Case(form, 50, 50, hq, hk, hm, 40, batch=2, mask="structured"))
    return cases


MATRIX = _matrix()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])
def test_kernels_match_reference(case, dtype):
    """Forward and deterministic backward agree with the float64 reference for every form,
    ragged shapes (not multiples of the tile), MHA/MQA/GQA, shared/per-head masks, padded head
    dims and batch > 1."""
    x = make_inputs(case, dtype)
    actual = run_kernels(x, case.causal, deterministic=True)
    check_against_reference(actual, x, case.causal, case.id)


DLSE_CASES = [
    Case("causal-C1", 37, 50, 2, 2, 2, 40),
    Case("causal-C2", 50, 37, 4, 1, 1, 64),
    Case("noncausal-C2", 33, 65, 4, 2, 2, 16),
    Case("noncausal-C4", 50, 50, 2, 2, 1, 64, mask="structured"),
    Case("nomask-causal", 50, 37, 2, 2, 1, 64),
]


@pytest.mark.parametrize("path", DQ_PATHS)
@pytest.mark.parametrize("case", DLSE_CASES, ids=[c.id for c in DLSE_CASES])
def test_backward_with_lse_gradient_matches_reference(case, path):
    """A nonzero ``dlse`` (lse used downstream, e.g. to merge partial attentions) enters the
    gradients exactly as in ``reference_backward``."""
    x = make_inputs(case, torch.float16)
    gen = torch.Generator().manual_seed(x.seed + 1)
    dlse = torch.randn(case.batch, case.heads_q, case.seqlen_q, generator=gen).to(DEVICE)
    actual = run_kernels(x, case.causal, dlse=dlse, **dq_path(path, case.head_dim))
    check_against_reference(actual, x, case.causal, f"{case.id}-dlse-{path}", dlse=dlse)
    # The lse gradient must matter here, or the check above would not test it.
    without = run_kernels(x, case.causal, **dq_path(path, case.head_dim))
    assert not torch.equal(actual[2], without[2])


# ------------------------------------------------------------------------------ masked edges
def _fully_masked_rows_cases() -> list[tuple[str, Case, torch.Tensor | None]]:
    s = 50
    rows_16_40 = _stack([[16, 40]] * s, 2)  # rows 16..39 see nothing: a whole tile and a half
    leading = _stack([[s, 20]] * s, 2)  # rows 0..19 (the first tile and more) see nothing
    everything = _stack([[0, s, 0, 0]] * s, 2)  # no row sees anything
    # Every third column hidden, the others seen by their own row only: every third row is dead.
    odd = _stack([[j + 1, s] if j % 3 else [0, s] for j in range(s)], 2)
    return [
        ("causal-C2-rows-16-to-40", Case("causal-C2", s, s, 4, 2, 2, 40), rows_16_40),
        ("noncausal-C2-leading-rows", Case("noncausal-C2", s, s, 2, 2, 2, 64), leading),
        ("noncausal-C4-every-row", Case("noncausal-C4", s, s, 4, 2, 2, 16), everything),
        ("causal-C2-every-third-row", Case("causal-C2", s, s, 2, 2, 2, 64), odd),
        # Bottom-right causal with Sq > Sk: the first Sq - Sk rows precede every key.
        ("nomask-causal-sq-above-sk", Case("nomask-causal", 50, 17, 4, 1, 1, 64), None),
    ]


FULLY_MASKED_ROWS = _fully_masked_rows_cases()


@pytest.mark.parametrize(
    ("case", "sri"),
    [(c, m) for _, c, m in FULLY_MASKED_ROWS],
    ids=[name for name, _, _ in FULLY_MASKED_ROWS],
)
@pytest.mark.parametrize("path", DQ_PATHS)
def test_fully_masked_rows_give_zero_output_and_neg_inf_lse(case, sri, path):
    """Rows that see no key: ``out == 0``, ``lse == -inf`` and ``dq == 0`` exactly (no NaN from
    0/0 or exp(-inf - -inf)), across whole tiles, leading tiles and every row."""
    x = make_inputs(case, torch.float16)
    if sri is not None:
        x.sri = sri.expand(case.batch, -1, -1, -1).contiguous().to(DEVICE)
    dead = ~visibility(x.sri, case.causal, case.batch, case.seqlen_q, case.seqlen_k).any(-1)
    assert bool(dead.any()), "the mask must hide some rows entirely"
    actual = run_kernels(x, case.causal, **dq_path(path, case.head_dim))
    for t in actual:
        assert not t.isnan().any()
    check_against_reference(actual, x, case.causal, case.id)


def test_fully_masked_key_columns_give_zero_dk_dv():
    """Keys no query sees (padding, hidden spans, and a whole key tile) get ``dk == dv == 0``."""
    case = Case("causal-C1", 37, 50, 4, 1, 1, 40, batch=2)
    x = make_inputs(case, torch.float16)
    sri = x.sri.clone()
    sri[0, :, 5:9] = 0  # a few columns inside a tile
    sri[0, :, 16:32] = 0  # a whole key tile
    sri[1, :, 40:] = 0  # the tail
    x.sri = sri
    actual = run_kernels(x, case.causal)
    _, _, _, dk, dv = actual
    for cols in (dk[0, 5:9], dk[0, 16:32], dk[1, 40:], dv[0, 5:9], dv[0, 16:32], dv[1, 40:]):
        assert bool((cols == 0).all())
    check_against_reference(actual, x, case.causal, case.id + "-hidden-columns")


@pytest.mark.parametrize(
    "case",
    [Case("causal-C1", 37, 37, 2, 2, 2, 64), Case("noncausal-C4", 33, 33, 4, 2, 2, 40)],
    ids=["mha-head-1", "gqa-kv-head-1"],
)
def test_fully_masked_head(case):
    """A mask head that hides everything: its query heads give 0 / -inf / zero grads, its kv
    head zero dk/dv, and the other heads are unaffected."""
    x = make_inputs(case, torch.float16)
    hidden = {1: [0], 4: [0, case.seqlen_q, 0, 0]}[FORMS[case.form][1]]
    x.sri[:, 1] = torch.tensor(hidden, dtype=torch.int32)
    out, lse, dq, dk, dv = actual = run_kernels(x, case.causal)
    g = case.heads_q // case.heads_k
    assert bool((out[:, :, g:] == 0).all()) and bool((dq[:, :, g:] == 0).all())
    assert bool((lse[:, g:] == float("-inf")).all())
    assert bool((dk[:, :, 1] == 0).all()) and bool((dv[:, :, 1] == 0).all())
    assert bool(lse[:, :g].isfinite().any())
    check_against_reference(actual, x, case.causal, case.id + "-dead-head")


# ------------------------------------------------------------------ determinism, bit-exactness
@pytest.mark.parametrize(
    "case",
    [Case("causal-C2", 50, 37, 4, 1, 1, 64), Case("noncausal-C4", 33, 50, 2, 2, 2, 40, batch=2)],
    ids=lambda c: c.id,
)
def test_deterministic_backward_is_bitwise_reproducible(case):
    """Two runs with ``deterministic=True`` give identical bits (forward and all gradients)."""
    x = make_inputs(case, torch.float16)
    first = run_kernels(x, case.causal, deterministic=True)
    second = run_kernels(x, case.causal, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, b), name


SKIP_CASES = [
    Case("causal-C1", 65, 65, 2, 2, 2, 40, mask="structured"),
    Case("causal-C2", 65, 65, 4, 1, 1, 64, mask="structured"),
    Case("noncausal-C2", 65, 65, 4, 2, 2, 16, mask="structured"),
    Case("noncausal-C4", 65, 65, 2, 2, 1, 64, batch=2, mask="structured"),
    Case("nomask-causal", 65, 50, 2, 2, 1, 40),
]


@pytest.mark.parametrize("case", SKIP_CASES, ids=[c.id for c in SKIP_CASES])
def test_skipping_tiles_is_bit_exact(case):
    """Tile skipping and unmasked-tile fast paths change no bit: ``skip_tiles=True`` equals the
    dense mode (every tile visited with the element mask) for out, lse, dq, dk, dv."""
    x = make_inputs(case, torch.float16)
    bounds = tiles.column_bounds(
        x.sri, case.causal, case.seqlen_q, case.seqlen_k, case.batch, DEVICE
    )
    classes = tiles.tile_classes(bounds, case.causal, case.seqlen_q, 16, 16)
    counts = torch.bincount(classes.flatten().long().cpu(), minlength=3)
    # Both shortcuts must be taken: skipped tiles and unmasked (no element mask) tiles.
    assert int(counts[TileClass.SKIP]) >= 4 and int(counts[TileClass.FULL]) >= 1, counts.tolist()
    skipping = run_kernels(x, case.causal, skip_tiles=True, config=SMALL_TILES)
    dense = run_kernels(x, case.causal, skip_tiles=False, config=SMALL_TILES)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), skipping, dense, strict=True):
        assert torch.equal(a, b), f"{name} differs between skip_tiles=True and False ({case.id})"
    check_against_reference(skipping, x, case.causal, case.id)


@pytest.fixture
def training_forward(monkeypatch):
    """Route every forward to the training kernels (off the split-KV ones that calls with more
    keys than queries take, ``test_decode.py``): for tests of the training forward's launch."""
    monkeypatch.setattr(routing, "use_decode", lambda *args: False)


LAUNCH_CASES = [
    Case("causal-C2", 48, 64, 4, 2, 2, 64, batch=2),  # divides the tiles: unmasked loads
    Case("noncausal-C4", 37, 50, 4, 1, 1, 40, mask="random"),  # ragged, padded head dim
    Case("nomask-causal", 64, 48, 2, 2, 1, 16),
]


@pytest.mark.parametrize("case", LAUNCH_CASES, ids=[c.id for c in LAUNCH_CASES])
def test_one_grid_backward_changes_no_bit(case):
    """The backward's one-grid launch is a pure scheduling choice: the two passes launched
    apart (as when their warp counts differ) give the same bits."""
    x = make_inputs(case, torch.float16)
    base = kernels.tile_config(case.head_dim)
    default = run_kernels(x, case.causal, config=base)
    apart = run_kernels(x, case.causal, config=replace(base, dq_warps=2 * base.bwd_warps))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), default, apart, strict=True):
        assert torch.equal(a, b), f"{name} differs with the passes launched apart ({case.id})"
    check_against_reference(default, x, case.causal, case.id)


@pytest.mark.parametrize("case", LAUNCH_CASES, ids=[c.id for c in LAUNCH_CASES])
def test_running_the_longest_lists_first_changes_no_bit(case, monkeypatch, training_forward):
    """With a mask, the forward's programs in ``preparation.program_orders`` (longest lists first)
    against the grid's natural order (no order handed over): the same bits, since the order
    only moves programs between SMs. Under a causal mask, whose lists differ in length across
    the tiles of every head, the order does reorder them; without a mask none is made."""
    x = make_inputs(case, torch.float16)
    orders = []
    real = preparation.program_orders

    def recording(requests):
        computed = real(requests)
        orders.append(computed[0])  # the forward's
        return computed

    monkeypatch.setattr(preparation, "program_orders", recording)
    kernels.clear_prepared()
    ordered = run_kernels(x, case.causal)
    assert len(orders) == (x.sri is not None)  # the forward's; the Triton backward takes none
    if orders and case.causal:
        natural = torch.arange(orders[0].numel(), dtype=torch.int32)
        assert not torch.equal(orders[0].cpu(), natural), "lists alike: nothing reordered"
    monkeypatch.setattr(preparation, "program_orders", lambda requests: [None] * len(requests))
    kernels.clear_prepared()
    natural_run = run_kernels(x, case.causal)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ordered, natural_run, strict=True):
        assert torch.equal(a, b), f"{name} differs with the natural order ({case.id})"


TMA_AVAILABLE = not CUDA or torch.cuda.get_device_capability() >= hardware.TMA_CAPABILITY


def _count_descriptors(monkeypatch) -> list:
    """Record every TMA descriptor the launchers build (to prove the TMA path ran)."""
    built: list = []
    real = tensors.row_descriptor

    def counting(*args):
        built.append(args)
        return real(*args)

    monkeypatch.setattr(tensors, "row_descriptor", counting)
    return built


def _tma_tiles(head_dim: int) -> TileConfig:
    """Forward tiles of 32x32: never square against the padded head dims of these cases (16 or
    64), so the TMA path is taken (square tiles keep pointer loads, ``tensors.tma_tiles_safe``)."""
    return replace(kernels.tile_config(head_dim), fwd_m=32, fwd_n=32)


@pytest.mark.skipif(not TMA_AVAILABLE, reason="TMA needs compute capability 9.0")
@pytest.mark.parametrize("case", LAUNCH_CASES, ids=[c.id for c in LAUNCH_CASES])
def test_tma_loads_change_no_bit(case, monkeypatch, training_forward):
    """The forward's Q/K/V tiles read through TMA descriptors (``TileConfig.fwd_tma``) hold the
    same values as the pointer loads, zeros past the sequence and past the head dim included."""
    x = make_inputs(case, torch.float16)
    base = _tma_tiles(case.head_dim)
    built = _count_descriptors(monkeypatch)
    pointers = kernels.forward(x.q, x.k, x.v, x.sri, case.causal, x.scale, config=base)
    assert not built, "the pointer path built a TMA descriptor"
    tma = kernels.forward(
        x.q, x.k, x.v, x.sri, case.causal, x.scale, config=replace(base, fwd_tma=True)
    )
    assert built, "the TMA path was not taken"
    for name, a, b in zip(("out", "lse"), pointers, tma, strict=True):
        assert torch.equal(a, b), f"{name} differs with TMA loads ({case.id})"


def test_square_tma_tiles_keep_pointer_loads(monkeypatch):
    """Triton 3.6 miscompiled the TMA forward on the H200 whenever a tile was as wide as the
    (padded) head dim: such configurations must load through pointers, with the right result."""
    case = Case("causal-C1", 50, 50, 2, 2, 2, 32)
    x = make_inputs(case, torch.float16)
    built = _count_descriptors(monkeypatch)
    square = replace(kernels.tile_config(32), fwd_m=16, fwd_n=32, fwd_tma=True)
    result = kernels.forward(x.q, x.k, x.v, x.sri, case.causal, x.scale, config=square)
    assert not built
    expected = kernels.forward(
        x.q, x.k, x.v, x.sri, case.causal, x.scale, config=replace(square, fwd_tma=False)
    )
    assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
    assert not tensors.tma_tiles_safe(32, 16, 32) and not tensors.tma_tiles_safe(64, 64, 64)
    assert tensors.tma_tiles_safe(64, 64, 128)


def test_tma_falls_back_to_pointer_loads_when_strides_forbid_it(monkeypatch):
    """TMA needs 16-byte aligned addresses and strides: a tensor at an odd element offset, or
    with a 24-byte row stride, takes the pointer path (same results), never an error."""
    case = Case("causal-C1", 33, 33, 2, 2, 2, 16)
    x = make_inputs(case, torch.float16)
    flat = torch.empty(x.q.numel() + 1, dtype=x.q.dtype, device=x.q.device)
    shifted = flat[1:].view(x.q.shape)  # data pointer 2 bytes past an aligned one
    shifted.copy_(x.q)
    wide = torch.zeros(*x.k.shape[:-1], 12, dtype=x.k.dtype, device=x.k.device)
    narrow = wide[..., :8]  # head dim 8 inside rows of 12: head stride 24 bytes
    assert not tensors.tma_usable((shifted,))
    assert not tensors.tma_usable((narrow,))
    assert tensors.tma_usable((x.q, x.k, x.v)) == TMA_AVAILABLE
    built = _count_descriptors(monkeypatch)
    config = replace(_tma_tiles(case.head_dim), fwd_tma=True)
    result = run_kernels(replace(x, q=shifted), case.causal, config=config)
    assert not built
    expected = run_kernels(x, case.causal, config=replace(config, fwd_tma=False))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), result, expected, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("scale", [0.0, -0.3], ids=["zero-scale", "negative-scale"])
@pytest.mark.parametrize(
    "case",
    [Case("causal-C2", 50, 50, 2, 2, 2, 64, mask="structured"), Case("nomask-full", 33, 48)],
    ids=lambda c: c.id,
)
def test_zero_and_negative_softmax_scale(case, scale, training_forward):
    """``softmax_scale <= 0`` (the scores scaled before the row max, since a non-positive factor
    does not preserve the max): matches the reference, and skipping stays bit-exact."""
    x = make_inputs(case, torch.float16)
    x.scale = scale
    skipping = run_kernels(x, case.causal, skip_tiles=True)
    dense = run_kernels(x, case.causal, skip_tiles=False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), skipping, dense, strict=True):
        assert torch.equal(a, b), f"{name} differs between skip_tiles=True and False ({case.id})"
    check_against_reference(skipping, x, case.causal, f"{case.id}-scale{scale}")


# --------------------------------------------------------------------------- inputs and layout
@pytest.mark.parametrize("layout", ["fused-qkv", "bhsd-transposed"])
def test_non_contiguous_inputs_match_contiguous(layout):
    """q, k, v (and dout) as strided views give the same bits as their contiguous copies."""
    case = Case("causal-C2", 37, 37, 2, 2, 2, 40, batch=2)
    x = make_inputs(case, torch.float16)
    gen = torch.Generator().manual_seed(x.seed)
    b, s, h, d = case.batch, case.seqlen_q, case.heads_q, case.head_dim
    if layout == "fused-qkv":
        qkv = torch.randn(b, s, 3, h, d, generator=gen).to(DEVICE, torch.float16)
        q, k, v = qkv.unbind(2)
        dout = torch.randn(b, s, h, 2 * d, generator=gen).to(DEVICE, torch.float16)[..., ::2]
    else:
        q, k, v, dout = (
            torch.randn(b, h, s, d, generator=gen).to(DEVICE, torch.float16).transpose(1, 2)
            for _ in range(4)
        )
    assert not any(t.is_contiguous() for t in (q, k, v, dout))
    strided = replace(x, q=q, k=k, v=v, dout=dout)
    contiguous = replace(
        x, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), dout=dout.contiguous()
    )
    a = run_kernels(strided, case.causal)
    c = run_kernels(contiguous, case.causal)
    for name, u, w in zip(("out", "lse", "dq", "dk", "dv"), a, c, strict=True):
        assert torch.equal(u, w), f"{name} ({layout})"
    check_against_reference(a, contiguous, case.causal, case.id + "-" + layout)


def _strided_indices(sri: torch.Tensor, layout: str) -> torch.Tensor:
    """The same indices as a strided view: broadcast over batch and heads, or bounds-major."""
    if layout == "expanded":
        return sri[:1, :1].expand(sri.shape)
    return sri.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) == Sk


@pytest.mark.parametrize(
    "layout",
    ["expanded", "bounds-major"],
)
def test_strided_startend_row_indices_match_contiguous(layout):
    """Regression: mask_prep.summarize_kernel once read a column's C bounds at base+1, +2, +3,
    ignoring ``startend_row_indices.stride(-1)``.

    Mask indices that are views (a mask expanded over batch and heads, or stored bounds-major
    as ``[B, Hm, C, Sk]`` and transposed) mean the same as their contiguous copy."""
    case = Case("noncausal-C4", 37, 50, 2, 2, 2, 16, batch=2)
    x = make_inputs(case, torch.float16)
    strided = _strided_indices(x.sri, layout)
    assert not strided.is_contiguous()
    a = run_kernels(replace(x, sri=strided), case.causal)
    c = run_kernels(replace(x, sri=strided.contiguous()), case.causal)
    for name, u, w in zip(("out", "lse", "dq", "dk", "dv"), a, c, strict=True):
        assert torch.equal(u, w), f"{name} ({layout})"


@pytest.mark.parametrize("form", MASK_FORMS)
def test_out_of_range_indices_behave_as_clamped(form):
    """Negative values act as 0 and values above Sq as Sq: the same bits as the clamped mask."""
    case = Case(form, 37, 50, 2, 2, 2, 16)
    x = make_inputs(case, torch.float16)
    gen = torch.Generator().manual_seed(x.seed)
    raw = torch.randint(-20, case.seqlen_q + 20, x.sri.shape, generator=gen, dtype=torch.int32)
    raw[0, 0, :3] = torch.iinfo(torch.int32).min
    raw[0, 1, :3] = torch.iinfo(torch.int32).max
    assert bool((raw < 0).any()) and bool((raw > case.seqlen_q).any())
    out_of_range = replace(x, sri=raw.to(DEVICE))
    clamped = replace(x, sri=raw.clamp(0, case.seqlen_q).to(DEVICE))
    a = run_kernels(out_of_range, case.causal)
    c = run_kernels(clamped, case.causal)
    for name, u, w in zip(("out", "lse", "dq", "dk", "dv"), a, c, strict=True):
        assert torch.equal(u, w), f"{name} ({form})"
    check_against_reference(c, clamped, case.causal, case.id + "-clamped")


# ------------------------------------------------------------------------- poisoned memory
def _inside_nan_buffer(t: torch.Tensor) -> torch.Tensor:
    """``t [B, S, H, D]`` as a view into a NaN-filled buffer with 5 more rows, one more head and
    8 more features: every element a kernel may read outside the view is NaN."""
    b, s, h, d = t.shape
    buf = torch.full((b, s + 5, h + 1, d + 8), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, :s, :h, :d]
    view.copy_(t)
    return view


@pytest.mark.parametrize(
    "case",
    [
        Case("causal-C1", 37, 29, 4, 2, 2, 24, batch=2),
        Case("noncausal-C4", 29, 37, 2, 1, 1, 40, batch=2),
        Case("nomask-causal", 33, 33, 2, 2, 1, 16, batch=1),
    ],
    ids=lambda c: c.id,
)
@pytest.mark.parametrize("loads", ["pointers", "tma"])
def test_poisoned_memory_never_leaks_into_results(case, loads, monkeypatch):
    """testing-anchors §6.D.15 (FlexAttention's poisoned test): q, k, v, dout inside NaN-filled
    buffers, indices inside a buffer whose tail beyond Sk holds int32 extremes, and every buffer
    the launchers allocate pre-filled with NaN (floats) or garbage (ints). A load without its
    bounds mask, or an output element the kernels never write, would surface here; the results
    must equal the clean run bit for bit. With the forward's TMA loads the descriptors describe
    the views, so the hardware's out-of-bounds zeros stand in for the masks."""
    if loads == "tma" and not TMA_AVAILABLE:
        pytest.skip("TMA needs compute capability 9.0")
    x = make_inputs(case, torch.float16)
    config = replace(_tma_tiles(case.head_dim), fwd_tma=loads == "tma")
    clean = run_kernels(x, case.causal, config=config)

    poisoned = replace(
        x,
        q=_inside_nan_buffer(x.q),
        k=_inside_nan_buffer(x.k),
        v=_inside_nan_buffer(x.v),
        dout=_inside_nan_buffer(x.dout),
    )
    if x.sri is not None:
        b, hm, sk, c = x.sri.shape
        buf = torch.full((b, hm, sk + 9, c), torch.iinfo(torch.int32).min, dtype=torch.int32)
        buf[..., sk:, ::2] = torch.iinfo(torch.int32).max
        buf = buf.to(x.sri.device)
        buf[:, :, :sk] = x.sri
        poisoned = replace(poisoned, sri=buf[:, :, :sk])

    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", garbage_empty)
    result = run_kernels(poisoned, case.causal, config=config)
    monkeypatch.undo()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), result, clean, strict=True):
        assert not a.isnan().any(), f"{name} has NaN ({case.id})"
        assert torch.equal(a, b), f"{name} differs from the clean run ({case.id})"


def test_batch_items_are_computed_independently():
    """testing-anchors §6.E.22: a batch computed together equals each item computed alone, bit
    for bit (no state crosses the batch axis of the grid)."""
    case = Case("causal-C2", 64, 64, 4, 2, 2, 32, batch=3, mask="structured")
    x = make_inputs(case, torch.float16)
    together = run_kernels(x, case.causal)
    for i in range(case.batch):
        alone = run_kernels(
            replace(
                x,
                q=x.q[i : i + 1],
                k=x.k[i : i + 1],
                v=x.v[i : i + 1],
                dout=x.dout[i : i + 1],
                sri=x.sri[i : i + 1],
            ),
            case.causal,
        )
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), together, alone, strict=True):
            assert torch.equal(a[i : i + 1], b), f"{name} of batch item {i}"


COMPACT_CASES = [
    Case("causal-C2", 100, 100, 4, 2, 2, 64, mask="structured"),
    Case("noncausal-C4", 90, 100, 2, 1, 1, 128),
    Case("nomask-causal", 100, 90, 2, 2, 1, 256),
]


@pytest.mark.parametrize("case", COMPACT_CASES, ids=[c.id for c in COMPACT_CASES])
def test_compact_tiles_match_reference(case):
    """The tiles GPUs with less shared memory than Hopper get (``compact_tile_config``: 64x64,
    and 64x32 / 32x32 at D = 256) compute the same attention, within the usual tolerance."""
    x = make_inputs(case, torch.float16)
    config = kernels.compact_tile_config(case.head_dim)
    actual = run_kernels(x, case.causal, config=config)
    check_against_reference(actual, x, case.causal, case.id + "-compact")


# The head dims the issue names beyond the main matrix's: 32 (exact block), 96 and 192 (padded to
# 128 and 256), 256 (the largest).
HEAD_DIM_CASES = [
    Case("causal-C1", 37, 50, 4, 2, 2, 32),
    Case("noncausal-C2", 50, 37, 2, 1, 1, 96),
    Case("causal-C2", 33, 33, 2, 2, 1, 192),
    Case("noncausal-C4", 40, 33, 2, 2, 2, 256),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=[c.id for c in HEAD_DIM_CASES])
def test_every_supported_head_dim_matches_reference(case):
    x = make_inputs(case, torch.float16)
    actual = run_kernels(x, case.causal)
    check_against_reference(actual, x, case.causal, case.id)


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
def test_delta_kernel_zeros_the_dq_accumulator_it_is_given(with_dlse):
    """``backward_delta`` with a ``dq_accumulator`` (as the Gluon backward gets it) writes zeros
    over every element, here NaN beforehand, rows past a 64-row tile and padded head-dim columns
    included, and returns the same delta as without one."""
    gen = torch.Generator().manual_seed(3)
    out, dout = (torch.randn(2, 80, 3, 24, generator=gen).half().to(DEVICE) for _ in range(2))
    dlse = torch.randn(2, 3, 80, generator=gen).to(DEVICE) if with_dlse else None
    accumulator = torch.full(out.shape, float("nan"), device=DEVICE)
    delta = backward_launcher.backward_delta(out, dout, dlse, accumulator)
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    assert torch.equal(delta, backward_launcher.backward_delta(out, dout, dlse))


def test_delta_kernel_refuses_an_accumulator_unlike_out():
    out = torch.zeros(1, 8, 2, 16, dtype=torch.float16, device=DEVICE)
    for bad in (
        torch.zeros(1, 8, 2, 16, dtype=torch.float16, device=DEVICE),
        torch.zeros(1, 8, 2, 8, device=DEVICE),
        torch.zeros(1, 2, 8, 16, device=DEVICE).transpose(1, 2),
    ):
        with pytest.raises(ValueError, match="dq_accumulator"):
            backward_launcher.backward_delta(out, out, None, bad)


# -------------------------------------------------------------------------------- logit cap
SOFTCAP_CASES = [
    Case("causal-C1", 37, 50, 2, 2, 2, 40),
    Case("noncausal-C4", 50, 50, 2, 2, 1, 64, mask="structured"),
    Case("nomask-causal", 50, 37, 4, 2, 1, 64),
    Case("nomask-full", 33, 65, 2, 1, 1, 16),
]


def _plain_low_precision(
    x: Inputs, causal: bool, softcap: float = 0.0, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of plain attention in the input dtype (autograd), with a logit cap
    (``softcap > 0``) and learnable sinks (``[Hq]``: a score column per head that carries no
    value; then ``dsinks`` too)."""
    b, sq, hq, _ = x.q.shape
    hk = x.k.shape[2]
    visible = visibility(x.sri, causal, b, sq, x.k.shape[1]).to(DEVICE)
    visible = visible.repeat_interleave(hq // visible.shape[1], dim=1)
    q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    inputs = [q, k, v]
    kh = k.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    scores = q.transpose(1, 2) @ (kh * x.scale).transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sinks = sinks.detach().to(x.q.dtype).requires_grad_()
        inputs.append(sinks)
        column = sinks.view(1, hq, 1, 1).expand(b, hq, sq, 1)
        scores = torch.cat([scores, column], dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (p[..., : x.k.shape[1]] @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, inputs, x.dout)
    return out.detach(), *grads


@pytest.mark.parametrize("softcap", [0.5, 5.0])
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[c.id for c in SOFTCAP_CASES])
def test_logit_cap_matches_reference(case, softcap):
    """``softcap``: the forward's capped scores and the backward's cap derivative agree with the
    float64 reference (0.5 caps hard, 5.0 barely) within the suite's rule; the lse too."""
    x = make_inputs(case, torch.float16)
    causal = case.causal
    out, lse = kernels.forward(x.q, x.k, x.v, x.sri, causal, x.scale, softcap=softcap)
    grads = kernels.backward(
        x.dout, None, x.q, x.k, x.v, out, lse, x.sri, causal, x.scale, True, softcap=softcap
    )
    intervals = None if x.sri is None else FlashMask(x.sri, causal).intervals(case.seqlen_q)
    q, k, v, dout = (t.double() for t in (x.q, x.k, x.v, x.dout))
    ref_out, ref_lse = reference_forward(q, k, v, intervals, causal, x.scale, softcap=softcap)
    ref_grads = reference_backward(
        dout, None, q, k, v, ref_out, ref_lse, intervals, causal, x.scale, softcap=softcap
    )
    low = _plain_low_precision(x, causal, softcap)
    for name, actual, hi, lo in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), low, strict=True
    ):
        assert_close_to_reference(actual, hi, lo, name, context=f"{case.id}-cap{softcap}")
    live = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[live], ref_lse[live].float(), atol=2e-3, rtol=1e-3)
    # The cap changes the result: the uncapped forward is farther from the capped reference.
    plain, _ = kernels.forward(x.q, x.k, x.v, x.sri, causal, x.scale)
    assert (plain.double() - ref_out).abs().max() > (out.double() - ref_out).abs().max()


SINKS_CASES = [
    Case("causal-C1", 37, 50, 2, 2, 2, 40),
    Case("noncausal-C4", 50, 50, 4, 2, 1, 64, mask="structured"),
    Case("nomask-causal", 50, 37, 4, 2, 1, 64),
]


@pytest.mark.parametrize("case", SINKS_CASES, ids=[c.id for c in SINKS_CASES])
def test_sinks_fold_and_gradient_match_reference(case):
    """Learnable sinks on the kernels: the forward with ``sinks`` (the kernel, then the sink
    fold, ``kernels.sinks.fold_sinks``, in place; on Hopper the CuTe forward joins them in its
    epilogue), then the backward kernels with ``sinks``, which return ``dsinks`` from their row
    term (``kernels.sinks.sink_gradient``). out, lse, dq, dk and dv are within the suite's rule of
    the float64 reference (a plain fp16 implementation with a sink column as the low-precision
    yardstick). ``dsinks`` is a sum over rows of ``rowsum(dO * O')``, whose only error is that of
    the stored fp16 ``out``: it must equal the float64 gradient computed from the kernels' own
    ``out`` and ``lse`` to float32 accuracy."""
    from flashmask.reference import fold_sinks as reference_fold
    from flashmask.reference import row_term, sink_gradient

    x = make_inputs(case, torch.float16)
    causal = case.causal
    sinks = torch.linspace(-1.0, 2.0, case.heads_q).to(DEVICE)
    out, lse = kernels.forward(x.q, x.k, x.v, x.sri, causal, x.scale, sinks=sinks)
    dq, dk, dv, dsinks = kernels.backward(
        x.dout, None, x.q, x.k, x.v, out, lse, x.sri, causal, x.scale, True, sinks=sinks
    )
    intervals = None if x.sri is None else FlashMask(x.sri, causal).intervals(case.seqlen_q)
    q, k, v, dout = (t.double() for t in (x.q, x.k, x.v, x.dout))
    ref_out, ref_lse = reference_fold(
        *reference_forward(q, k, v, intervals, causal, x.scale), sinks.double()
    )
    ref_grads = reference_backward(
        dout, None, q, k, v, ref_out, ref_lse, intervals, causal, x.scale
    )
    low = _plain_low_precision(x, causal, sinks=sinks)
    for name, actual, hi, lo in zip(
        ("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads), low[:4], strict=True
    ):
        assert_close_to_reference(actual, hi, lo, name, context=case.id)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3)
    exact = sink_gradient(lse.double(), row_term(dout, out.double(), None), sinks.double())
    assert dsinks.dtype == sinks.dtype
    torch.testing.assert_close(dsinks.double(), exact, atol=1e-5, rtol=1e-5)


def test_sink_fold_kernel_equals_the_reference_fold():
    """The fold kernel against ``reference.fold_sinks`` in float32: rows that see no key
    (``lse = -inf``) get out 0 and ``lse' = sink``, a ``-inf`` sink leaves its head as it was,
    and a padded value head dim (24) is handled."""
    from flashmask.kernels.sinks import fold_sinks
    from flashmask.reference import fold_sinks as reference_fold

    gen = torch.Generator().manual_seed(3)
    out = torch.randn(2, 70, 3, 24, generator=gen).to(DEVICE, torch.float16)
    lse = torch.randn(2, 3, 70, generator=gen).to(DEVICE)
    lse[:, :, 5:9] = float("-inf")
    out[:, 5:9] = 0
    sinks = torch.tensor([0.3, float("-inf"), 4.0], device=DEVICE)
    want_out, want_lse = reference_fold(out, lse, sinks)
    fold_sinks(out, lse, sinks)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out, want_out, atol=1e-3, rtol=1e-3)
    assert (out[:, 5:9] == 0).all()
    assert torch.equal(lse[:, 1, 5:9], torch.full_like(lse[:, 1, 5:9], float("-inf")))
    assert torch.equal(lse[:, 0, 5:9], torch.full_like(lse[:, 0, 5:9], 0.3))


def test_sink_gradient_kernel_equals_the_reference_gradient():
    """``kernels.sinks.sink_gradient`` (one program per head) against
    ``reference.sink_gradient`` in float64: several batches, rows past one 1024-row block, rows
    that see no key (``lse' = -inf``: they add nothing) and a float16 ``sinks`` (``dsinks`` takes
    its dtype); a second call gives the same bits (a fixed summation order)."""
    from flashmask.kernels.sinks import sink_gradient
    from flashmask.reference import sink_gradient as reference_gradient

    gen = torch.Generator().manual_seed(4)
    lse = torch.randn(3, 2, 1100, generator=gen).to(DEVICE)
    lse[:, :, 7:20] = float("-inf")
    delta = torch.randn(3, 2, 1100, generator=gen).to(DEVICE)
    for sinks in (torch.tensor([0.5, -2.0]), torch.tensor([1.0, 3.0], dtype=torch.float16)):
        sinks = sinks.to(DEVICE)
        dsinks = sink_gradient(lse, delta, sinks)
        assert dsinks.dtype == sinks.dtype and dsinks.shape == (2,)
        want = reference_gradient(lse.double(), delta.double(), sinks.double())
        tolerance = 1e-5 if sinks.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(dsinks.double(), want, atol=tolerance, rtol=tolerance)
        assert torch.equal(sink_gradient(lse, delta, sinks), dsinks)
    with pytest.raises(ValueError, match="delta must be contiguous float32"):
        sink_gradient(lse, delta.transpose(1, 2).contiguous(), torch.zeros(2, device=DEVICE))


# ---------------------------------------------------------------- one mask per query head
PER_QUERY_HEAD_CASES = [
    Case("causal-C1", 48, 64, 4, 2, 4, 40),
    Case("noncausal-C4", 50, 50, 4, 1, 4, 16),
    Case("noncausal-C2", 37, 50, 6, 2, 6, 64, batch=2),
]


@pytest.mark.parametrize("case", PER_QUERY_HEAD_CASES, ids=[c.id for c in PER_QUERY_HEAD_CASES])
def test_one_mask_per_query_head_matches_reference(case):
    """Mask heads = query heads (``Hm = Hq > Hk``, as Paddle now accepts): the forward reads
    each query head's own mask, the dK/dV pass walks each query head's list of its group; and
    the launch order of a grid over key/value heads sums its group's list lengths."""
    x = make_inputs(case, torch.float16)
    assert x.sri.shape[1] == case.heads_q > case.heads_k
    actual = run_kernels(x, case.causal, deterministic=True)
    check_against_reference(actual, x, case.causal, case.id)
    _, (lists,) = preparation.prepare_cached(
        x.sri, case.causal, case.seqlen_q, case.seqlen_k, case.batch, DEVICE, [(16, 16, False)]
    )
    order = preparation.program_order(lists, case.heads_k, False)
    group = case.heads_q // case.heads_k
    summed = lists.counts.view(case.batch, case.heads_k, group, -1).sum(2)
    assert torch.equal(order.cpu(), tiles.program_order(summed.cpu(), case.heads_k, False))


# ----------------------------------------------------------- value head dim != query head dim
@pytest.mark.parametrize(
    ("form", "head_dim", "head_dim_v"),
    [("causal-C1", 24, 16), ("noncausal-C4", 40, 64), ("nomask-causal", 48, 32),
     ("nomask-full", 16, 24)],
)  # fmt: skip
def test_value_head_dim_other_than_the_query_s_matches_reference(form, head_dim, head_dim_v):
    """``Dv != D`` (multi-head latent attention: q/k 192, v 128): out and dv take V's head dim,
    dq and dk Q's; padded head dims on both sides, GQA, ragged lengths."""
    case = Case(form, 37, 50, 4, 2, 2 if FORMS[form][1] else 1, head_dim)
    x = make_inputs(case, torch.float16)
    gen = torch.Generator().manual_seed(_seed(case.id, head_dim_v))
    x.v = torch.randn(1, 50, 2, head_dim_v, generator=gen).to(DEVICE, torch.float16)
    x.dout = torch.randn(1, 37, 4, head_dim_v, generator=gen).to(DEVICE, torch.float16)
    actual = run_kernels(x, case.causal, deterministic=True)
    assert actual[0].shape[-1] == head_dim_v and actual[4].shape[-1] == head_dim_v
    check_against_reference(actual, x, case.causal, f"{case.id}-dv{head_dim_v}")
