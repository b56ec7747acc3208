"""The CuTe forward compiles for sm_90a on a machine without a GPU, in every variant the
launcher can ask for (each head dim, mask form, the dense mode, the launch order, and the
persistent schedule); its results are proved on a GPU by ``tests/gpu``."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

# launch (imported first) sets CUTE_DSL_ARCH before cutlass is imported.
from flashmask.kernels.cute_kernels import launch

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the flashmask[cute] extra (nvidia-cutlass-dsl)", allow_module_level=True)

from flashmask.kernels.cute_kernels.forward import ForwardVariant
from tests.kernels.cute_kernels.ptx import compiled_ptx, spill_bytes

# (causal, has_mask, has_upper): full, causal, causal with a lower interval, and non-causal
# with both intervals (what column_bounds gives every FlashMask form).
FORMS = [(False, False, False), (True, False, False), (True, True, False), (False, True, True)]


FORM_IDS = ["full", "causal", "causal_mask", "mask"]
# Q/K head dims; 192 is multi-head latent attention's, whose V has head dim 128 (O leaves
# through Q's slots in its own layout).
HEAD_DIMS = [64, 128, 192, 256]
VALUE_HEAD_DIM = {192: 128}


def _variant(head_dim: int, form: tuple[bool, bool, bool], dense: bool, persistent: bool):
    causal, has_mask, has_upper = form
    return ForwardVariant(
        head_dim=head_dim,
        block_n=launch.key_tile(head_dim),
        kv_stages=launch.KV_STAGES[head_dim],
        causal=causal,
        has_mask=has_mask,
        has_upper=has_upper,
        mask_full_tiles=dense,
        ordered=has_mask,  # launch orders exist only with a mask
        persistent=persistent,
        head_dim_v=VALUE_HEAD_DIM.get(head_dim),
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dense", [False, True], ids=["skip", "dense"])
def test_every_variant_compiles(head_dim: int, form: tuple[bool, bool, bool], dense: bool):
    variant = _variant(head_dim, form, dense, persistent=False)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


# The persistent schedule: what the launcher takes for a non-causal mask (in both modes), and,
# in the skipping mode, every other form (``launch.forward(..., persistent=True)`` forces it;
# without a mask it runs the items in their own order, unordered).
PERSISTENT = [(form, False) for form in FORMS] + [(FORMS[-1], True)]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(
    ("form", "dense"), PERSISTENT, ids=[f"{i}-skip" for i in FORM_IDS] + ["mask-dense"]
)
def test_every_persistent_variant_compiles(
    head_dim: int, form: tuple[bool, bool, bool], dense: bool
):
    variant = _variant(head_dim, form, dense, persistent=True)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


# The logit cap (Gemma's), a compile-time constant: each head dim with the forms that take
# the per-tile and the persistent schedules, and the dense mode's element mask on every tile.
CAPPED = [(FORMS[1], False, False), (FORMS[2], False, False), (FORMS[3], False, True)]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(
    ("form", "dense", "persistent"), CAPPED, ids=["causal", "causal_mask", "mask-persistent"]
)
def test_every_capped_variant_compiles(
    head_dim: int, form: tuple[bool, bool, bool], dense: bool, persistent: bool
):
    variant = dataclasses.replace(_variant(head_dim, form, dense, persistent), softcap=30.0)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


def test_capped_dense_variant_compiles():
    variant = dataclasses.replace(_variant(128, FORMS[2], True, False), softcap=50.0)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


# Learnable sinks, joined in the epilogue: the per-tile and the persistent schedules, with and
# without a cap (gpt-oss has no cap, but the two are independent flags).
SINKS = [
    (FORMS[0], False, 0.0),
    (FORMS[1], False, 0.0),
    (FORMS[3], True, 0.0),
    (FORMS[1], False, 30.0),
]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    ("form", "persistent", "softcap"), SINKS, ids=["full", "causal", "mask-persistent", "capped"]
)
def test_every_sinks_variant_compiles(
    head_dim: int, form: tuple[bool, bool, bool], persistent: bool, softcap: float
):
    variant = dataclasses.replace(
        _variant(head_dim, form, False, persistent), sinks=True, softcap=softcap
    )
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


# Edge intervals (``ForwardVariant.edge_intervals``: the lower interval runs to the last row,
# the upper one starts at row 0) where the launcher takes them: a causal mask of one column
# (one program per query tile) and a non-causal one of two (persistent), both modes.
EDGE = [(FORMS[2], False, False), (FORMS[3], False, True), (FORMS[3], True, True)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    ("form", "dense", "persistent"), EDGE, ids=["causal_mask", "mask-persistent", "mask-dense"]
)
def test_every_edge_interval_variant_compiles(
    head_dim: int, form: tuple[bool, bool, bool], dense: bool, persistent: bool
):
    variant = dataclasses.replace(_variant(head_dim, form, dense, persistent), edge_intervals=True)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


def test_float16_compiles():
    variant = ForwardVariant(128, 128, launch.KV_STAGES[128], True, True, False, False, True)
    assert launch.compiled_forward(variant, torch.float16) is not None


def test_value_dim_is_the_head_dim_unless_v_has_its_own():
    assert _variant(128, FORMS[0], False, False).value_dim == 128
    assert _variant(192, FORMS[0], False, False).value_dim == 128


_VARIANT = """
import dataclasses, torch
from tests.kernels.cute_kernels.test_forward import FORMS, _variant
from flashmask.kernels.cute_kernels import launch
variant = dataclasses.replace(_variant(128, FORMS[{form}], False, {persistent}), **{fields!r})
launch.compiled_forward(variant, torch.bfloat16)
"""


def _ptx(tmp_path, form: int = 1, persistent: bool = False, **fields) -> str:
    """The PTX of the head-dim-128 forward of ``FORMS[form]`` (default: causal) with the
    variant ``fields`` given."""
    return compiled_ptx(tmp_path, _VARIANT.format(form=form, persistent=persistent, fields=fields))


def _ptx_counts(tmp_path, softcap: float) -> dict[str, int]:
    """Instruction counts in the PTX of the causal head-dim-128 forward with ``softcap``."""
    text = _ptx(tmp_path, softcap=softcap)
    return {op: text.count(op) for op in ("tanh.approx.f32", "ex2.approx", "rcp.approx")}


def _spill_bytes(tmp_path, **variant) -> int:
    return spill_bytes(tmp_path, _ptx(tmp_path / "dump", **variant))


def test_sinks_add_no_spills(tmp_path):
    """The sink is loaded in the epilogue: held from the start of the tile loop it raised the
    persistent variant's spills from 104 to 292 bytes (measured with this test's tools)."""
    for form, persistent in ((3, True), (1, False)):
        plain = _spill_bytes(tmp_path / f"plain{form}", form=form, persistent=persistent)
        sinks = _spill_bytes(
            tmp_path / f"sinks{form}", form=form, persistent=persistent, sinks=True
        )
        assert sinks <= plain, (form, sinks, plain)


def test_the_cap_takes_one_tanh_per_score_and_no_reciprocal(tmp_path):
    """The cap is PTX's ``tanh.approx.f32`` (one MUFU op per score; measured 1.21-1.29x the
    plain forward where ``1 - 2 / (e^(2x) + 1)`` took 1.40-1.55x): as many tanh as the
    softmax's exponentials per score, no extra exponential and no reciprocal."""
    plain = _ptx_counts(tmp_path / "plain", 0.0)
    capped = _ptx_counts(tmp_path / "capped", 30.0)
    assert plain["tanh.approx.f32"] == 0
    assert capped["tanh.approx.f32"] > 0
    assert capped["ex2.approx"] == plain["ex2.approx"]
    assert capped["rcp.approx"] == plain["rcp.approx"]


def test_the_row_max_rises_lazily_where_it_was_measured_faster():
    """``lazy_rescale``: the bf16/fp16 one-item variants and the capped persistent one; the
    plain persistent variant (its spills grow) and FP8 (a row's top P must round to 1 in e4m3)
    raise the max on every larger tile top."""
    one_item = _variant(128, FORMS[2], False, False)
    persistent = _variant(128, FORMS[3], False, True)
    assert one_item.lazy_rescale
    assert dataclasses.replace(one_item, softcap=30.0).lazy_rescale
    assert not persistent.lazy_rescale
    assert dataclasses.replace(persistent, softcap=30.0).lazy_rescale
    assert not dataclasses.replace(one_item, fp8=True).lazy_rescale
    assert not dataclasses.replace(persistent, softcap=30.0, fp8=True).lazy_rescale


def test_every_variant_skips_the_rescale_on_a_warp_vote(tmp_path):
    """The O rescale sits behind a warp vote in the lazy variants (one-item, capped persistent)
    and in the exact-max ones (plain persistent) alike: where no row of a warp raised its max,
    the factors are exactly 1 and the 64 multiplies per thread are skipped."""
    votes = {
        name: _ptx(tmp_path / name, form=form, persistent=persistent, **fields).count("vote.")
        for name, form, persistent, fields in (
            ("causal", 1, False, {}),
            ("persistent", 3, True, {}),
            ("capped_persistent", 3, True, {"softcap": 30.0}),
        )
    }
    assert all(count > 0 for count in votes.values()), votes


@pytest.mark.parametrize(
    ("form", "softcap"), [(0, 0.0), (1, 0.0), (2, 0.0), (2, 30.0)], ids=[*FORM_IDS[:3], "capped"]
)
def test_the_one_item_forwards_do_not_spill(tmp_path, form: int, softcap: float):
    """The head-dim-128 forward of one query tile per program (full, causal, causal with a mask,
    and capped) holds its tile loop in registers: the lazy rescale's measured gain on these
    variants came without spills, and a spill in the loop costs more than it saves."""
    assert _spill_bytes(tmp_path, form=form, persistent=False, softcap=softcap) == 0


@pytest.mark.parametrize("form", [2, 3], ids=FORM_IDS[2:])
def test_edge_intervals_hide_a_row_in_half_the_compares(tmp_path, form: int):
    """A mask whose intervals reach the first and last rows tests ``row >= LTS`` (and, not
    causal, ``row < UTE``) where the general form tests both ends of each interval: 2 or 1
    compares per score instead of 4 or 2 (the causal triangle's own compare aside)."""
    general = _ptx(tmp_path / "general", form=form, persistent=form == 3).count("setp.")
    edge = _ptx(tmp_path / "edge", form=form, persistent=form == 3, edge_intervals=True)
    scores = 64  # per thread and tile: 2 rows x 32 columns
    assert general - edge.count("setp.") >= scores * (2 if form == 3 else 1)


def test_the_mask_forwards_with_edge_intervals_do_not_spill(tmp_path):
    """The two-compare mask of the causal one-column form (one program per query tile) and of
    the non-causal two-column form (persistent) holds the tile loop in registers."""
    for form, persistent in ((2, False), (3, True)):
        spills = _spill_bytes(
            tmp_path / str(form), form=form, persistent=persistent, edge_intervals=True
        )
        assert spills == 0, (form, spills)
