"""FP8 attention on a CUDA GPU: ``flashmask_attention`` on float8_e4m3fn inputs against the float32
reference on the dequantised inputs, with :func:`flashmask.fp8.emulate_fp8_forward` as the
low-precision yardstick.

Skipped without a CUDA GPU (marker ``gpu``); runs with the rest of ``tests/gpu`` (see
``tests/gpu/test_kernels.py``). The rule is the suite's (``tests/tolerance.py``) with the
emulation in the place of PyTorch's low-precision attention: the FP8 output's error against the
float32 reference may be at most twice the emulation's (which rounds the probabilities to e4m3
before ``P V``, as an FP8 kernel does) plus the output dtype's rounding noise, 1.1x on the mean;
lse within the FP8 tensor cores' accumulation error of the scores (``assert_fp8_lse_close``);
fully masked rows out = 0 and lse = -inf exactly.

On a Hopper GPU with the ``cute`` extra the routed cases run the CuTe FP8 forward; the others
(float32 outputs, a cap, other GPUs) the reference path, whose only error is the output's
rounding. Each case records which path ran (``kernels``: "FP8 kernel" or "reference").
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

import flashmask
from flashmask import fp8, masks
from flashmask.kernels import routing
from tests.gpu.conftest import CASE_PROPERTY, FULL
from tests.tolerance import assert_close_to_reference, assert_fp8_lse_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
HEAD_DIMS = (64, 128, 192, 256) if FULL else (64, 128, 256)
MASK_NAMES = (*masks.MASK_TYPES, "hash_sparse")
# (causal, columns) of random startend_row_indices, at ragged Sq != Sk.
FORMS = ((True, 1), (True, 2), (False, 2), (False, 4))
SHAPES = ((113, 203), (1024, 1023), (256, 384))


@dataclass(frozen=True)
class Case:
    """``mask``: a builder of ``masks.example`` ("full"/"causal": no mask) or "random" (indices
    of ``columns`` columns in the ``causal`` form)."""

    mask: str
    sq: int
    sk: int
    hq: int
    hk: int
    d: int
    out_dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    columns: int = 0
    batch: int = 2

    @property
    def id(self) -> str:
        label = self.mask
        if self.mask == "random":
            label = f"random-causal{int(self.causal)}-C{self.columns}"
        out = str(self.out_dtype).removeprefix("torch.")
        return f"fp8-{label}-{self.sq}x{self.sk}-H{self.hq}:{self.hk}-D{self.d}-out_{out}"


def _cases() -> list[Case]:
    cases = []
    for name in MASK_NAMES:
        for d in HEAD_DIMS:
            for hq, hk in ((8, 8), (8, 2)):
                cases.append(Case(name, 1024, 1024, hq, hk, d))
    for causal, columns in FORMS:
        for sq, sk in SHAPES:
            cases.append(Case("random", sq, sk, 8, 2, 128, causal=causal, columns=columns))
    for out_dtype in (torch.float16, torch.float32):
        for d in (64, 128, 256):
            cases.append(Case("causal_document", 1024, 1024, 8, 2, d, out_dtype))
    return cases


CASES = _cases()


def _inputs(case: Case):
    """FP8 ``(q, k, v)``, their descales (per batch and head; queries per key/value head's
    group), the mask argument and the causal flag of ``case``."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    shapes = [
        (case.batch, case.sq, case.hq, case.d),
        (case.batch, case.sk, case.hk, case.d),
        (case.batch, case.sk, case.hk, case.d),
    ]
    q, k, v = (torch.randn(s, generator=g).to(DEVICE) for s in shapes)
    (q8, qd), (k8, kd), (v8, vd) = (
        flashmask.quantize_fp8(q, group=case.hq // case.hk),
        flashmask.quantize_fp8(k),
        flashmask.quantize_fp8(v),
    )
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    if case.mask in ("full", "causal"):
        return (q8, k8, v8), descales, None, case.mask == "causal"
    if case.mask == "random":
        indices = torch.randint(
            -1, case.sq + 2, (case.batch, 1, case.sk, case.columns), generator=g,
            dtype=torch.int32,
        ).to(DEVICE)  # fmt: skip
        return (q8, k8, v8), descales, indices, case.causal
    heads = case.hk if case.mask == "random_eviction" else 1
    mask = masks.example(case.mask, case.sk, batch_size=case.batch, num_heads=heads, generator=g)
    return (q8, k8, v8), descales, mask.to(DEVICE), False


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fp8_attention_is_within_twice_the_emulations_error(case: Case, record_property) -> None:
    qkv, descales, mask, causal = _inputs(case)
    q8, k8, v8 = qkv
    scale = case.d**-0.5
    kernel = routing.use_cute_fp8_forward(q8, k8, v8, scale, 0.0, case.out_dtype)
    record = {"kind": "fp8", "case": case.id, "kernels": "FP8 kernel" if kernel else "reference"}
    record_property(CASE_PROPERTY, record)

    out, lse = flashmask.flashmask_attention(
        *qkv, mask, causal=causal, return_softmax_lse=True, out_dtype=case.out_dtype, **descales
    )
    heads_k = case.hk
    exact, exact_lse = flashmask.flashmask_attention(
        fp8.dequantize(q8, descales["q_descale"], heads_k),
        fp8.dequantize(k8, descales["k_descale"], heads_k),
        fp8.dequantize(v8, descales["v_descale"], heads_k),
        mask, causal=causal, return_softmax_lse=True,
    )  # fmt: skip
    emulated, _ = fp8.emulate_fp8_forward(
        *qkv, mask, causal=causal, out_dtype=case.out_dtype, **descales
    )
    assert out.dtype == case.out_dtype and lse.dtype == torch.float32

    dead = exact_lse == float("-inf")  # [B, Hq, Sq]: rows that see no key
    rows = dead.transpose(1, 2)  # [B, Sq, Hq]
    assert bool((out[rows] == 0).all()), "out of fully masked rows is 0"
    assert bool((lse[dead] == float("-inf")).all()), "lse of fully masked rows is -inf"
    err = (out.double() - exact.double()).abs().max().item()
    err_emulation = (emulated.double() - exact.double()).abs().max().item()
    record["errors"] = {
        "out": {
            "max_err": err,
            "max_err_lowp": err_emulation,
            "ratio_vs_lowp": err / err_emulation if err_emulation > 0 else None,
        }
    }
    assert_close_to_reference(out, exact, emulated, "out", context=case.id)
    assert_fp8_lse_close(
        lse, exact_lse, fp8.dequantize(q8, descales["q_descale"], heads_k),
        fp8.dequantize(k8, descales["k_descale"], heads_k), scale, context=case.id,
    )  # fmt: skip
