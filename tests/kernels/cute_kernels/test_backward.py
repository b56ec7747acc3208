"""The CuTe backward compiles for sm_90a on a machine without a GPU, in every variant the
launcher can ask for (each mask form, the dense mode and the launch order); its results are
proved on a GPU by ``tests/gpu/test_cute_backward.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# backward_launch (imported first) sets CUTE_DSL_ARCH before cutlass is imported.
from flashmask.kernels.cute_kernels import backward_launch

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the flashmask[cute] extra (nvidia-cutlass-dsl)", allow_module_level=True)

from flashmask.kernels.cute_kernels.backward import BackwardVariant

# (causal, has_mask, has_upper): full, causal, causal with a lower interval, and non-causal
# with both intervals (what column_bounds gives every FlashMask form).
FORMS = [(False, False, False), (True, False, False), (True, True, False), (False, True, True)]


@pytest.mark.parametrize("form", FORMS, ids=["full", "causal", "causal_mask", "mask"])
@pytest.mark.parametrize("dense", [False, True], ids=["skip", "dense"])
def test_every_variant_compiles(form: tuple[bool, bool, bool], dense: bool):
    causal, has_mask, has_upper = form
    variant = BackwardVariant(
        head_dim=128,
        causal=causal,
        has_mask=has_mask,
        has_upper=has_upper,
        mask_full_tiles=dense,
        ordered=has_mask,  # launch orders exist only with a mask
    )
    assert backward_launch.compiled_backward(variant, torch.bfloat16) is not None


def test_float16_compiles():
    variant = BackwardVariant(128, False, True, True, False, True)
    assert backward_launch.compiled_backward(variant, torch.float16) is not None


def test_other_head_dims_are_refused_with_the_argument_named():
    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: the CuTe backward takes head dims"):
        backward_launch.backward(q, q, q, q, None, None, None, None, 1, False, 1.0)
