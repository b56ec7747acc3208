"""``context_parallel_attention`` rejects bad ``sinks`` and ``softcap`` as ``flashmask_attention``
does, before it needs a process group (so no processes here)."""

from __future__ import annotations

import pytest
import torch

from flashmask import masks
from flashmask.distributed import context_parallel_attention, make_plan

PLAN = make_plan(masks.causal_document([5, 3], 8), 1, chunk_size=4)
Z = torch.zeros

ERRORS = [
    pytest.param({"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor", id="sinks-list"),
    pytest.param(
        {"sinks": Z(4, dtype=torch.int32)}, TypeError, "sinks must be a floating", id="sinks-int"
    ),
    pytest.param(
        {"sinks": Z(2)}, ValueError, r"sinks must have shape \[Hq\] = \[4\]", id="sinks-shape"
    ),
    pytest.param({"sinks": Z(1, 4)}, ValueError, r"sinks must have shape \[Hq\]", id="sinks-2d"),
    pytest.param({"sinks": Z(4, device="meta")}, ValueError, "sinks is on meta", id="sinks-meta"),
    pytest.param({"softcap": "50"}, TypeError, "softcap must be a float", id="softcap-str"),
    pytest.param({"softcap": True}, TypeError, "softcap must be a float", id="softcap-bool"),
    pytest.param({"softcap": -1.0}, ValueError, "softcap must be a finite number", id="softcap<0"),
    pytest.param(
        {"softcap": float("inf")}, ValueError, "softcap must be a finite number", id="softcap-inf"
    ),
    pytest.param(
        {"softcap": float("nan")}, ValueError, "softcap must be a finite number", id="softcap-nan"
    ),
]

VALID = [
    pytest.param({"sinks": Z(4)}, id="sinks"),
    pytest.param({"sinks": Z(4, dtype=torch.bfloat16)}, id="sinks-bf16"),
    pytest.param({"softcap": 30.0}, id="softcap"),
    pytest.param({"softcap": 0}, id="softcap-off"),
    pytest.param({"softcap": None}, id="softcap-none"),
]


def _call(**overrides):
    q = Z(1, 8, 4, 8)
    k, v = Z(1, 8, 2, 8), Z(1, 8, 2, 6)
    return context_parallel_attention(q, k, v, PLAN, **overrides)


@pytest.mark.parametrize(("overrides", "error", "match"), ERRORS)
def test_bad_sinks_or_softcap_raise_an_error_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


@pytest.mark.parametrize("overrides", VALID)
def test_valid_sinks_and_softcap_pass_the_checks(overrides):
    # The next thing the call needs is torch.distributed: reaching it means the checks passed.
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed"):
        _call(**overrides)
