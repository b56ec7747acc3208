"""The Gluon backward (``flashmask.kernels.gluon_kernels.backward``): where the launcher uses it, and that it
compiles for Hopper into a warp-specialised kernel.

Its dQ goes through fp32 atomics, so it serves ``deterministic=False`` only; the bit-exact
guarantees (skip == dense, repeat == repeat) stay with the Triton kernels. Gluon has no CPU
interpreter: the H200 check (``benchmarks/gpu_check.py``, its ``det=False`` cases) proves its
results; here the routing rules and an sm_90 compile of every variant.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import replace

import numpy as np
import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from flashmask import kernels, masks
from flashmask.kernels import backward_launcher, hardware, routing, tiles
from tests.kernels.sm90_compile import ROOT, compile_reports, json_lines
from tests.kernels.test_tile_configs import INTERPRETER_WARNING

HOPPER = (9, 0)


def _inputs(seqlen_q=256, seqlen_k=384, head_dim=128, dtype=torch.bfloat16):
    q = torch.zeros(2, seqlen_q, 4, head_dim, dtype=dtype)
    k = torch.zeros(2, seqlen_k, 2, head_dim, dtype=dtype)
    return q, k, torch.zeros_like(k), torch.zeros_like(q)


def test_eligible_inputs_are_the_forward_s_with_a_dout_like_q():
    q, k, v, dout = _inputs()
    assert routing.gluon_backward_eligible(q, k, v, dout, HOPPER)
    assert not routing.gluon_backward_eligible(q, k, v, dout, (8, 0))
    assert not routing.gluon_backward_eligible(*_inputs(seqlen_q=200), HOPPER)
    assert not routing.gluon_backward_eligible(*_inputs(head_dim=96), HOPPER)
    assert not routing.gluon_backward_eligible(*_inputs(head_dim=192), HOPPER)
    # D = 256 through its own kernel (``gluon_bwd256``), D = 64 through the D = 128 one.
    assert routing.gluon_backward_eligible(*_inputs(head_dim=256), HOPPER)
    assert routing.gluon_backward_eligible(*_inputs(head_dim=64), HOPPER)
    assert not routing.gluon_backward_eligible(q, k, v, dout.half(), HOPPER)
    assert not routing.gluon_backward_eligible(q, k, v, dout[:, :128], HOPPER)
    # Any layout (the launcher makes contiguous aligned copies where needed).
    strided = torch.zeros(2, 4, 256, 128, dtype=q.dtype).transpose(1, 2)
    assert routing.gluon_backward_eligible(q, k, v, strided, HOPPER)


def test_launcher_uses_it_only_non_deterministic_skipping_on_a_gpu(monkeypatch):
    q, k, v, dout = _inputs()
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    assert not routing.use_gluon_backward(q, k, v, dout, False, True, False, cfg)  # CPU tensors
    monkeypatch.setattr(hardware, "capability_of", lambda index: HOPPER)
    monkeypatch.setattr(hardware, "cuda_index", lambda device: 0)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    on_gpu = [x.to("meta") for x in (q, k, v, dout)]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: 0)
    assert routing.use_gluon_backward(*on_gpu, False, True, False, cfg)
    assert not routing.use_gluon_backward(*on_gpu, True, True, False, cfg)  # atomics
    assert not routing.use_gluon_backward(*on_gpu, False, False, False, cfg)  # dense mode
    assert not routing.use_gluon_backward(
        *on_gpu, False, True, False, replace(cfg, bwd_gluon=False)
    )
    monkeypatch.setattr(hardware, "capability_of", lambda index: (10, 0))
    assert not routing.use_gluon_backward(*on_gpu, False, True, False, cfg)


def test_torch_deterministic_algorithms_keep_the_reproducible_backward(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` must not get fp32 atomics, whatever the
    call's ``deterministic`` says."""
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    inputs = _inputs()
    assert routing.use_gluon_backward(*inputs, False, True, False, cfg)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not routing.use_gluon_backward(*inputs, False, True, False, cfg)


@pytest.mark.parametrize(("head_dim", "min_keys"), [(64, 8192), (128, 4096)])
def test_with_a_mask_only_from_4k_keys_at_hd128_and_8k_at_hd64(monkeypatch, head_dim, min_keys):
    """Its 128-key tiles skip less finely than the Triton backward's: on the H200 at hd128 and 4K
    it won 1-31% on ten of the 12 masks and lost 2% and 9% on the two sparsest; at hd64 and 8K
    it won on eleven and lost 1% on sliding_window
    (``benchmarks/results/gluon_backward_hd128_4k_s11.log``, ``gluon_backward_hd64_8k_s11.log``).
    Any number of mask heads (checked on the H200 with random_eviction's mask per head group,
    ``benchmarks/results/gpu_check_gluon_s7.json``)."""
    assert routing.GLUON_BWD_MIN_MASKED_SEQLEN[head_dim] == min_keys
    cfg = replace(kernels.tile_config(head_dim), bwd_gluon=True)
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    short = _inputs(seqlen_q=256, seqlen_k=min_keys - 128, head_dim=head_dim)
    long = _inputs(seqlen_q=256, seqlen_k=min_keys, head_dim=head_dim)
    assert routing.use_gluon_backward(*short, False, True, False, cfg)  # no mask: any length
    assert not routing.use_gluon_backward(*short, False, True, True, cfg)
    assert routing.use_gluon_backward(*long, False, True, True, cfg)
    # gpu_check --gluon-everywhere:
    monkeypatch.setattr(routing, "GLUON_BWD_MIN_MASKED_SEQLEN", {})
    assert routing.use_gluon_backward(*short, False, True, True, cfg)


def test_at_head_dim_256_with_a_mask_at_any_length(monkeypatch):
    """Its 64-key tiles skip as finely as the Triton backward's, and it measured 1.43-1.69x
    that backward on every mask at 8K (``benchmarks/results/gluon_backward_hd256_s9.log``)."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    cfg = kernels.tile_config(256)  # the default: the H200's tiles
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    for seqlen in (256, 8192):
        inputs = _inputs(seqlen_q=seqlen, seqlen_k=seqlen, head_dim=256)
        assert routing.use_gluon_backward(*inputs, False, True, True, cfg)
        shapes = routing.backward_list_shapes(*inputs, torch.zeros(1), False, cfg)
        assert shapes == [(64, 64, False)]


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_default_tiles_use_it_at_head_dims_64_128_and_256_with_or_without_a_mask(
    monkeypatch, head_dim
):
    """Measured faster on the H200 at hd64, hd128 (with a mask from 8K and 4K keys, the
    launcher's rule) and hd256."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    for has_mask in (True, False):
        use = kernels.tile_config(head_dim, has_mask=has_mask).bwd_gluon
        assert use == (head_dim in routing.GLUON_BWD_HEAD_DIMS)
    assert not kernels.compact_tile_config(head_dim).bwd_gluon
    monkeypatch.setattr(hardware, "interpreting", lambda: True)
    assert not kernels.tile_config(head_dim).bwd_gluon


@pytest.fixture(scope="module")
def sm90_reports() -> list[dict]:
    return compile_reports("gluon_backward.py")


def _shipped(report: dict) -> bool:
    """Whether a compile report is of the module's default ``ROW_TERMS_SMEM``,
    ``LATE_DQ_HANDOFF`` and ``DQ_BEFORE_DK`` forms with dK/dV in the inputs' dtype
    (``gluon_bwd256`` has neither of the last two: reported as 0 and False)."""
    module = "gluon_bwd256" if report["head_dim"] == 256 else "gluon_bwd"
    default_form = {"gluon_bwd": 1, "gluon_bwd256": 2}[module]
    default_late = {"gluon_bwd": 2, "gluon_bwd256": 0}[module]
    return (
        report["row_terms_smem"] == default_form
        and report["late_dq"] == default_late
        and not report["dkdv_fp32"]
        and report["dq_before_dk"] == (module == "gluon_bwd")
        and report["dkdv_tma"] == _ships_tma_dkdv(report)
        and report["persistent"] == (SHIPS_PERSISTENT and module == "gluon_bwd")
        and not report["timeline"]
        and not report["early_kv"]
        and not report["first_store"]
    )


# ``gluon_bwd.PERSISTENT`` as shipped, restated so that the test process does not import Gluon.
SHIPS_PERSISTENT = False


def _ships_tma_dkdv(report: dict) -> bool:
    """``gluon_bwd.dkdv_by_tma`` as shipped (``DKDV_TMA = 2``: every form but plain causal) and
    ``gluon_bwd256.dkdv_by_tma`` at D = 256 (``DKDV_TMA = 2``: with a mask only), restated so
    that the test process does not import Gluon."""
    if report["head_dim"] == 256:
        return report["has_mask"]
    return report["has_mask"] or not report["causal"]


def _compiled_for(report: dict) -> tuple:
    """``(head dim, causal, masked, dtype, TMA dQ writer)``: what a compile report is of, apart
    from the kernel's form."""
    return (
        report["head_dim"], report["causal"], report["has_mask"], report["dtype"],
        report["dq_tma"],
    )  # fmt: skip


def _shipped_twin(reports: list[dict], compiled_for: tuple) -> dict:
    """The shipped form's report compiled for ``compiled_for`` (see :func:`_compiled_for`)."""
    return next(r for r in reports if _shipped(r) and _compiled_for(r) == compiled_for)


# ``(head dim, causal, masked)`` of the forms compiled for measurement at D = 64/128.
_MEASURED_FORMS = {(d, c, m) for d in (64, 128) for c, m in ((False, False), (True, True))}


def test_compiles_warp_specialised_for_sm90(sm90_reports):
    reports = [r for r in sm90_reports if _shipped(r)]
    variants = {_compiled_for(r) for r in reports}
    assert len(variants) == 16 and {v[0] for v in variants} == set(routing.GLUON_BWD_HEAD_DIMS)
    assert {v[3] for v in variants} == {"bf16", "fp16"}
    assert {v[4] for v in variants} == {False, True}  # the red.global writer (measurement)
    for report in reports:
        # Producer + dQ writers in one warpgroup: 12 warps, the consumers raised to 240.
        assert report["warps"] == 12, report
        assert any("inc.sync.aligned.u32 240" in s for s in report["setmaxnreg"]), report
        assert report["UTMALDG"] > 0, report
        if report["dq_tma"]:  # dQ leaves through TMA reduce-adds, not red.global
            assert report["UTMAREDG"] > 0 and report["REDG"] == 0, report
        else:
            assert report["REDG"] > 0 and report["UTMAREDG"] == 0, report
        # Five matmuls; at D = 256 per warpgroup S^T and dP^T over the head dim (16 k-steps
        # each) and dV, dK, dQ (4 each).
        assert report["HGMMA"] >= (44 if report["head_dim"] == 256 else 5 * 4), report
        # Version-dependent but small: at most 80 bytes under Triton 3.6 (the H200's; none
        # without a mask), up to 152 under 3.9. A register blow-up would spill kilobytes.
        assert report["spill_bytes"] <= 256, report
        assert report["shared_kb"] <= 227, report  # Hopper's limit per block


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
@pytest.mark.parametrize(
    ("head_dim", "module", "key_tiles"), [(128, "gluon_bwd", 3), (256, "gluon_bwd256", 6)]
)
def test_launcher_hands_the_kernel_ready_inputs_delta_and_column_lists(
    monkeypatch, head_dim, module, key_tiles
):
    """What ``kernels.backward`` passes the Gluon backward (a stand-in records it; the kernel
    needs a GPU): contiguous q/k/v/dout equal to the caller's, the forward's lse as float32,
    ``delta = rowsum(dO * O) - dlse`` and the column-major lists at its tiles (64x128; 64x64
    through ``gluon_bwd256`` at D = 256), and a float32 dQ accumulator like q that the delta
    kernel has zeroed where the backward is one launch (the stand-in says it is)."""
    seen = {}

    def fake_backward(
        dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale, order=None,
        dq_accumulator=None,
    ):  # fmt: skip
        seen.update(dout=dout, q=q, lse=lse, delta=delta, lists=lists, hm=hm, causal=causal)
        seen.update(order=order, dq_accumulator=dq_accumulator)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(
        backward=fake_backward, one_launch=lambda *args: True, first_store_dq=lambda: False
    )
    monkeypatch.setitem(sys.modules, f"flashmask.kernels.{module}", fake)
    monkeypatch.setattr(kernels, module, fake, raising=False)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    cfg = replace(kernels.tile_config(head_dim), bwd_gluon=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, head_dim, generator=gen).half().transpose(1, 2)
    k = torch.randn(1, 384, 2, head_dim, generator=gen).half()
    out = torch.randn(1, 256, 4, head_dim, generator=gen).half()
    dout = torch.randn(1, 4, 256, head_dim, generator=gen).half().transpose(1, 2)
    lse = torch.randn(1, 4, 256, generator=gen)
    dlse = torch.randn(1, 4, 256, generator=gen)
    kernels.backward(dout, dlse, q, k, k, out, lse, None, True, 0.125, False, config=cfg)
    assert seen["q"].is_contiguous() and torch.equal(seen["q"], q)
    assert seen["dout"].is_contiguous() and torch.equal(seen["dout"], dout)
    assert seen["lse"].dtype == torch.float32 and torch.equal(seen["lse"], lse)
    want = (dout.float() * out.float()).sum(-1).transpose(1, 2) - dlse
    torch.testing.assert_close(seen["delta"], want, rtol=1e-3, atol=1e-3)
    # 384 keys in 128- (64-) key tiles, 256 / 64 query tiles
    assert seen["lists"].entries.shape[-2:] == (key_tiles, 4)
    assert (seen["hm"], seen["causal"]) == (1, True)
    assert seen["order"] is None  # no mask: the grid's own order
    accumulator = seen["dq_accumulator"]
    assert accumulator.dtype == torch.float32 and accumulator.shape == q.shape
    assert accumulator.is_contiguous() and not accumulator.any()
    # With a mask, longest lists first over the grid (key tiles, 2 kv heads, 1 batch).
    sri = masks.causal_document([64, 128, 192], seqlen=384).startend_row_indices
    kernels.backward(dout, dlse, q, k, k, out, lse, sri, True, 0.125, False, config=cfg)
    assert torch.equal(seen["order"], tiles.program_order(seen["lists"].counts, 2, False))


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
def test_launcher_hands_first_store_backward_zeroed_flags_instead_of_zeros(monkeypatch):
    """With ``gluon_bwd.DQ_FIRST_STORE`` (the module says so through ``first_store_dq``) the
    delta kernel zeros one int32 flag per 64-row dQ tile of each query head instead of the fp32
    accumulator, and the backward gets both; delta is the same."""
    seen = {}

    def fake_backward(*args, order=None, dq_accumulator=None, dq_flags=None):
        seen.update(delta=args[5], dq_accumulator=dq_accumulator, dq_flags=dq_flags)
        q, k, v = args[1:4]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(
        backward=fake_backward, one_launch=lambda *args: True, first_store_dq=lambda: True
    )
    monkeypatch.setitem(sys.modules, "flashmask.kernels.gluon_kernels.backward", fake)
    monkeypatch.setattr(kernels, "gluon_bwd", fake, raising=False)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    gen = torch.Generator().manual_seed(1)
    q, k, out, dout = (torch.randn(2, 200, 3, 128, generator=gen).half() for _ in range(4))
    lse = torch.randn(2, 3, 200, generator=gen)
    kernels.backward(dout, None, q, k, k, out, lse, None, True, 0.125, False, config=cfg)
    flags, accumulator = seen["dq_flags"], seen["dq_accumulator"]
    assert flags.dtype == torch.int32 and flags.shape == (2, 3, 4)  # 200 rows: 4 tiles of 64
    assert flags.is_contiguous() and not flags.any()
    assert accumulator.dtype == torch.float32 and accumulator.shape == q.shape
    torch.testing.assert_close(seen["delta"], backward_launcher.backward_delta(out, dout, None))


def test_row_terms_staged_by_the_producer_replace_the_consumers_global_loads(sm90_reports):
    """The shipped kernels' producer leaves each tile's lse and delta rows in shared memory
    (``ROW_TERMS_SMEM``), so the consumers' scalar global loads of them (16 per row term and
    thread at D = 64/128, 8 at D = 256) are gone against the unstaged form (0), for at most
    1 KB more shared memory and at most 16 bytes more spills. The same products: ``HGMMA``
    counts equal."""

    unstaged = {_compiled_for(r): r for r in sm90_reports if r["row_terms_smem"] == 0}
    assert not any(r["dkdv_fp32"] for r in unstaged.values())
    assert {(d, c, m) for d, c, m, _, _ in unstaged} == {
        (d, c, m)
        for d in routing.GLUON_BWD_HEAD_DIMS
        for c, m in ((False, False), (True, True), (False, True))
    }
    for k, old in unstaged.items():
        new = _shipped_twin(sm90_reports, k)
        assert new["HGMMA"] == old["HGMMA"], (new, old)
        # The producer's row loads stay: a few of its own per tile.
        assert old["LDG"] - new["LDG"] >= (12 if k[0] == 256 else 24), (new, old)
        assert 0 < new["shared_kb"] - old["shared_kb"] <= 1.1, (new, old)
        # Triton 3.9 spills 16 bytes more in the staged form at D = 128 without a mask (with
        # the late dQ hand-off); 3.6, the H200's, none.
        assert new["spill_bytes"] <= old["spill_bytes"] + 16, (new, old)
        assert new["shared_kb"] <= 227, new


def test_dq_is_handed_over_under_the_next_tiles_products_without_serialising_them(sm90_reports):
    """``gluon_bwd.LATE_DQ_HANDOFF``: the shipped kernels at D = 64/128 publish each tile's dQ
    (and release its Q/dO slot) after issuing the next tile's score products. Against the
    order before it (0): the same products, no more spills, and as few ``wgmma`` waits, so
    ptxas keeps the products asynchronous (it waits on every one, 32 waits for 32 ``HGMMA``,
    where it cannot keep an accumulator's registers from issue to wait: the form that carried
    the dQ tile itself into the next tile did that at D = 128)."""

    before = {
        _compiled_for(r): r for r in sm90_reports if r["late_dq"] == 0 and r["head_dim"] != 256
    }
    assert {(d, c, m) for d, c, m, _, _ in before} == _MEASURED_FORMS
    for k, old in before.items():
        assert old["row_terms_smem"] == 1 and not old["dkdv_fp32"]
        new = _shipped_twin(sm90_reports, k)
        assert new["HGMMA"] == old["HGMMA"], (new, old)
        assert new["WARPGROUP.DEPBAR"] <= old["WARPGROUP.DEPBAR"], (new, old)
        assert new["WARPGROUP.DEPBAR"] * 4 < new["HGMMA"], new
        assert new["spill_bytes"] <= old["spill_bytes"], (new, old)
        assert new["shared_kb"] == old["shared_kb"], (new, old)


def test_dk_after_dq_stores_dq_while_dk_runs_without_serialising_them(sm90_reports):
    """``gluon_bwd.DQ_BEFORE_DK`` (the default at D = 64/128): dK's product issued after dQ's.
    Against dK before dQ (the order before it): the same products, one ``wgmma`` wait more
    (dQ's alone, before its store for the writer, then dK's), no serialised products, the same
    shared memory and at most 16 bytes more spills."""

    dk_first = {
        _compiled_for(r): r for r in sm90_reports if r["head_dim"] != 256 and not r["dq_before_dk"]
    }
    assert {(d, c, m) for d, c, m, _, _ in dk_first} == _MEASURED_FORMS
    for k, old in dk_first.items():
        assert old["late_dq"] == 2 and not old["dkdv_fp32"]
        new = _shipped_twin(sm90_reports, k)
        assert new["HGMMA"] == old["HGMMA"], (new, old)
        assert new["WARPGROUP.DEPBAR"] == old["WARPGROUP.DEPBAR"] + 1, (new, old)
        assert new["WARPGROUP.DEPBAR"] * 4 < new["HGMMA"], new
        assert new["spill_bytes"] <= old["spill_bytes"] + 16, (new, old)
        assert new["shared_kb"] == old["shared_kb"], (new, old)


def test_dk_dv_leave_through_shared_memory_and_two_tma_stores(sm90_reports):
    """``gluon_bwd.DKDV_TMA``: dK and dV staged in the K/V tiles' buffers and stored with one
    TMA store each, against the stores from registers (2- or 4-byte ``STG`` of one or two elements):
    no ``STG`` left, two ``UTMASTG``, the same products and waits, the same shared memory (the
    buffers are reused) and no more spills."""

    def form(report: dict) -> tuple:
        return (
            *_compiled_for(report), report["late_dq"], report["dq_before_dk"],
            report["row_terms_smem"], report["dkdv_fp32"],
        )  # fmt: skip

    by_form = {
        (form(r), r["dkdv_tma"]): r
        for r in sm90_reports
        if r["head_dim"] != 256
        and r["persistent"] == SHIPS_PERSISTENT
        and not r["timeline"]
        and not r["first_store"]
    }
    pairs = [
        (by_form[k, True], by_form[k, False]) for k, tma in by_form if tma and (k, False) in by_form
    ]
    assert {(r["head_dim"], r["causal"], r["has_mask"]) for r, _ in pairs} == _MEASURED_FORMS
    for new, old in pairs:
        assert old["STG"] > 0 and new["STG"] == 0, (new, old)
        assert new["UTMASTG"] == 2 and old["UTMASTG"] == 0, (new, old)
        assert new["HGMMA"] == old["HGMMA"], (new, old)
        assert new["WARPGROUP.DEPBAR"] == old["WARPGROUP.DEPBAR"], (new, old)
        assert new["shared_kb"] == old["shared_kb"], (new, old)
        assert new["spill_bytes"] <= old["spill_bytes"], (new, old)


def test_persistent_programs_loop_with_the_same_products(sm90_reports):
    """``gluon_bwd.PERSISTENT``: one program per SM looping over the work items, each next one
    taken with one atomic. Against one program per item compiled for the same inputs (full,
    plain causal, masked at D = 64/128): the same products and ``wgmma`` waits (the tile loop
    is the same code), one ``ATOMG`` where the other has none, a few hundred bytes of shared
    memory more (the item ring and the K/V buffers' "empty" barrier), and spills bounded (under
    Triton 3.6, the H200's: none but 56 bytes for plain causal at D = 128, in the consumers'
    loop-carried values)."""
    persistent = [
        r for r in sm90_reports
        if r["persistent"] != SHIPS_PERSISTENT and not r["early_kv"] and not r["timeline"]
    ]  # fmt: skip
    assert {(r["head_dim"], r["causal"], r["has_mask"]) for r in persistent} == {
        (d, c, m) for d in (64, 128) for c, m in ((False, False), (True, False), (True, True))
    }
    for report in persistent:
        twin = _shipped_twin(sm90_reports, _compiled_for(report))
        looping, per_item = (report, twin) if report["persistent"] else (twin, report)
        assert looping["ATOMG"] == 1 and per_item["ATOMG"] == 0, (looping, per_item)
        assert looping["HGMMA"] == per_item["HGMMA"], (looping, per_item)
        assert looping["WARPGROUP.DEPBAR"] == per_item["WARPGROUP.DEPBAR"], (looping, per_item)
        assert 0 < looping["shared_kb"] - per_item["shared_kb"] <= 0.5, (looping, per_item)
        assert looping["shared_kb"] <= 227, looping
        assert looping["warps"] == 12 and looping["UTMALDG"] > 0, looping
        assert looping["spill_bytes"] <= per_item["spill_bytes"] + 128, (looping, per_item)


def test_early_kv_release_keeps_the_products_and_shared_memory(sm90_reports):
    """``gluon_bwd.EARLY_KV_RELEASE`` (persistent only): dK/dV staged in the dQ and dS^T
    buffers, the producer's next item taken before its loads and the item's first Q/dO tile
    loaded before its K/V. Against the persistent form without it (full, plain causal, masked
    causal; D = 64/128): the same products, waits, TMA stores, atomics and shared memory (no
    buffer is added), at most two barriers more (the wait for the previous item's stores; under
    3.9 one more) and spills bounded (under 3.6: 8 bytes more for full attention at D = 128)."""
    early = [r for r in sm90_reports if r["early_kv"]]
    assert {(r["head_dim"], r["causal"], r["has_mask"]) for r in early} == {
        (d, c, m) for d in (64, 128) for c, m in ((False, False), (True, False), (True, True))
    }
    for report in early:
        twin = next(
            r for r in sm90_reports
            if r["persistent"] and not r["early_kv"] and not r["timeline"]
            and _compiled_for(r) == _compiled_for(report)
        )  # fmt: skip
        for key in ("HGMMA", "WARPGROUP.DEPBAR", "UTMASTG", "STG", "ATOMG", "shared_kb"):
            assert report[key] == twin[key], (key, report, twin)
        assert 0 <= report["BAR"] - twin["BAR"] <= 2, (report, twin)
        assert report["UTMALDG"] >= twin["UTMALDG"], (report, twin)
        assert report["spill_bytes"] <= twin["spill_bytes"] + 64, (report, twin)


def test_first_store_dq_writes_add_a_claim_and_a_store_and_nothing_else(sm90_reports):
    """``gluon_bwd.DQ_FIRST_STORE`` (D = 64/128, one program per item): each dQ tile's writer
    claims it (compare-and-swap; form 2 before the tile is handed over), the first stores it
    and publishes it (exchange), the others wait for that (an acquiring load) and add; against
    the shipped form: the same products,
    registers and spills, TMA loads unchanged, the plain TMA store and the three atomics added,
    shared memory within 32 bytes (the claim's broadcast)."""
    claiming = [r for r in sm90_reports if r["first_store"]]
    assert {(r["head_dim"], r["causal"], r["has_mask"], r["first_store"]) for r in claiming} == {
        (d, c, m, form)
        for d in (64, 128)
        for c, m in ((False, False), (True, True))
        for form in (1, 2)
    }
    for report in claiming:
        twin = next(
            r for r in sm90_reports if _shipped(r) and _compiled_for(r) == _compiled_for(report)
        )
        for key in ("HGMMA", "WARPGROUP.DEPBAR", "UTMALDG", "registers", "spill_bytes"):
            assert report[key] == twin[key], (key, report, twin)
        assert report["ATOMG"] == twin["ATOMG"] + 2, (report, twin)  # the CAS and the exchange
        assert report["UTMASTG"] > twin["UTMASTG"], (report, twin)
        assert 0 <= report["shared_kb"] - twin["shared_kb"] <= 32 / 1024, (report, twin)


def test_timeline_stamps_add_their_stores_and_nothing_else(sm90_reports):
    """``gluon_bwd.TIMELINE`` (a diagnostic, ``benchmarks/bwd_timeline.py``): with a tensor to
    stamp into, each item's consumers store its nine stamps (ten in the persistent form) and
    nothing else changes: the same
    products, waits, shared memory and barriers (one more under Triton 3.9, none under 3.6) and
    spills (up to 64 bytes more under 3.9) as the form without them, in
    both the per-item and the persistent form (full and masked causal, D = 128). Without one
    (``None``) the stamps are not compiled: the shipped reports have no ``STG`` at all where
    dK/dV leave through TMA."""
    stamped = [r for r in sm90_reports if r["timeline"]]
    assert {(r["causal"], r["has_mask"], r["persistent"]) for r in stamped} == {
        (c, m, p) for c, m in ((False, False), (True, True)) for p in (False, True)
    }
    for report in stamped:
        twin = next(
            r for r in sm90_reports
            if not r["timeline"] and not r["early_kv"] and not r["first_store"]
            and r["persistent"] == report["persistent"]
            and r["row_terms_smem"] == report["row_terms_smem"]
            and r["late_dq"] == report["late_dq"] and r["dkdv_tma"] == report["dkdv_tma"]
            and r["dq_before_dk"] == report["dq_before_dk"]
            and not r["dkdv_fp32"] and _compiled_for(r) == _compiled_for(report)
        )  # fmt: skip
        # The persistent form also stamps when the consumers have the next item.
        assert twin["STG"] == 0 and report["STG"] == 9 + report["persistent"], (report, twin)
        for key in ("HGMMA", "WARPGROUP.DEPBAR", "UTMALDG", "UTMASTG", "shared_kb"):
            assert report[key] == twin[key], (key, report, twin)
        # Under Triton 3.6 (the H200's) the same barriers; 3.9 puts one more beside them.
        assert 0 <= report["BAR"] - twin["BAR"] <= 1, (report, twin)
        # The stamps' registers: none spilled under 3.6; 3.9 spills a few more bytes.
        assert report["spill_bytes"] <= twin["spill_bytes"] + 64, (report, twin)


def test_hd256_tma_dk_dv_form_stores_without_stg(sm90_reports):
    """``gluon_bwd256.DKDV_TMA``: the same epilogue at D = 256, each warpgroup's head-dim half
    staged in the K/V buffers, shipped with a mask (full attention keeps the stores from
    registers). Against the stores from registers compiled for the same inputs: no ``STG``, TMA
    stores, the same products and waits, the same shared memory and no more spills."""
    hd256 = [r for r in sm90_reports if r["head_dim"] == 256 and not r["dkdv_fp32"]]
    by_form = {(_compiled_for(r), r["dkdv_tma"]): r for r in hd256 if r["row_terms_smem"] == 2}
    pairs = [
        (by_form[k, True], by_form[k, False]) for k, tma in by_form if tma and (k, False) in by_form
    ]
    assert {(new["causal"], new["has_mask"]) for new, _ in pairs} == {(False, False), (True, True)}
    for new, old in pairs:
        assert _shipped(new) == new["has_mask"] and _shipped(old) != new["has_mask"], (new, old)
        assert old["STG"] > 0, old
        assert new["STG"] == 0 and new["UTMASTG"] >= 2, new
        assert new["HGMMA"] == old["HGMMA"], (new, old)
        assert new["WARPGROUP.DEPBAR"] == old["WARPGROUP.DEPBAR"], (new, old)
        assert new["shared_kb"] == old["shared_kb"], (new, old)
        assert new["spill_bytes"] <= old["spill_bytes"], (new, old)


def test_no_tma_dk_dv_stores_for_fp32_partial_sums(sm90_reports):
    """A query chunk's fp32 dK/dV (stored or added to) keep the stores from registers, whatever
    ``DKDV_TMA`` says (the K/V buffers hold 16-bit tiles)."""
    chunked = [r for r in sm90_reports if r["dkdv_fp32"]]
    assert chunked
    for report in chunked:
        assert not report["dkdv_tma"] and report["UTMASTG"] == 0 and report["STG"] > 0, report


def test_compiles_with_fp32_dk_dv_for_full_attentions_query_chunks(sm90_reports):
    """``kernels.query_chunks`` runs long full attention once per chunk of query rows and adds
    the chunks' dK/dV in fp32: the kernel stores them as fp32 then, at every head dim, with the
    same products and no more spills than with 16-bit dK/dV beyond the wider stores'."""
    chunked = {r["head_dim"]: r for r in sm90_reports if r["dkdv_fp32"] and not r["add_dkdv"]}
    assert set(chunked) == set(routing.GLUON_BWD_HEAD_DIMS)
    for d, report in chunked.items():
        plain = _shipped_twin(sm90_reports, (d, False, False, "bf16", True))
        assert report["HGMMA"] == plain["HGMMA"], (report, plain)
        assert report["spill_bytes"] <= plain["spill_bytes"] + 64, (report, plain)
        assert report["shared_kb"] == plain["shared_kb"], (report, plain)


# Runs in a process of its own (gluon_bwd imports Gluon): gluon_bwd.launch over query chunks
# with its per-launch step replaced by a stand-in that adds 1 (ADD_DKDV) or stores 1 in fp32.
_CHUNK_LAUNCHES = """
import json, torch
from flashmask.kernels import query_chunks, tiles
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
query_chunks.QUERY_SPLIT_FROM_BYTES = 0
query_chunks.QUERY_CHUNK_BYTES = 128 * 8 * 128  # 128 rows per chunk at D = 128
launches = []
def fake_launch_once(kernel, block_n, nb, dqb, tma, dout, q, k, v, lse, delta, bounds, lists,
                     hm, causal, scale, dkdv_dtype, dk_out=None, dv_out=None, **constants):
    add = constants["ADD_DKDV"]
    launches.append({"rows": q.shape[1], "add": add, "dtype": str(dkdv_dtype),
                     "into_first": add and dk_out is launches_first[0]})
    if add:
        dk_out += 1.0
        dv_out += 2.0
        return torch.zeros_like(q), dk_out, dv_out
    dk = torch.ones_like(k, dtype=dkdv_dtype)
    launches_first[:] = [dk]
    return torch.zeros_like(q), dk, torch.full_like(v, 2.0, dtype=dkdv_dtype)
launches_first = [None]
gluon_bwd._launch_once = fake_launch_once
q = torch.zeros(1, 320, 2, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
lse = torch.zeros(1, 2, 320)
lists = tiles.TileLists(torch.zeros(1, 1, 2, 5, dtype=torch.int32),
                        torch.zeros(1, 1, 2, dtype=torch.int32), None)
dq, dk, dv = gluon_bwd.launch(None, 128, 2, 2, True, q, q, k, k, lse, lse, None, lists, 1,
                              False, 0.125, split_queries=True, ADD_DKDV=False)
try:
    gluon_bwd.launch(None, 128, 2, 2, True, q, q, k, k, lse, lse, None, lists, 1, False, 0.125,
                     split_queries=True, dq_accumulator=torch.zeros(q.shape), ADD_DKDV=False)
    refused = ""
except ValueError as error:
    refused = str(error)
one_launch = [gluon_bwd.one_launch(q, k, masked, causal, split)
              for masked, causal, split in [(False, False, True), (True, False, True),
                                            (False, True, True), (False, False, False)]]
print(json.dumps({"launches": launches, "dk": sorted(set(dk.float().flatten().tolist())),
                  "dv": sorted(set(dv.float().flatten().tolist())), "dtype": str(dk.dtype),
                  "refused": refused, "one_launch": one_launch}))
"""


def test_query_chunks_after_the_first_add_into_its_fp32_sums():
    """With ``CHUNKS_ADD_IN_KERNEL`` (on) the launcher runs the first chunk of query rows with
    fp32 dK/dV outputs and every later one adding into those same tensors (``ADD_DKDV``), then
    casts once: no partial sums to add (the chunks: 128, 128, 64 rows)."""
    (result,) = json_lines(["-c", _CHUNK_LAUNCHES])
    assert [launch["rows"] for launch in result["launches"]] == [128, 128, 64]
    assert [launch["add"] for launch in result["launches"]] == [False, True, True]
    assert all(launch["dtype"] == "torch.float32" for launch in result["launches"])
    assert [launch["into_first"] for launch in result["launches"][1:]] == [True, True]
    assert result["dk"] == [3.0] and result["dv"] == [6.0]  # each chunk added once
    assert result["dtype"] == "torch.bfloat16"
    # Only full attention splits: one dQ accumulator for all rows would not fit the chunks.
    assert result["one_launch"] == [False, True, True, True]
    assert "dq_accumulator" in result["refused"]


def test_chunks_can_add_dk_dv_into_one_fp32_accumulator_in_the_kernel(sm90_reports):
    """``gluon_bwd.CHUNKS_ADD_IN_KERNEL`` (on): the chunk's launch loads the fp32 sums
    so far and adds before its store (more global loads), with the same products and no more
    than 64 bytes of spills beyond the storing kernel's."""
    adding = {r["head_dim"]: r for r in sm90_reports if r["add_dkdv"]}
    assert set(adding) == {64, 128}
    for d, report in adding.items():
        storing = next(
            r for r in sm90_reports
            if r["dkdv_fp32"] and not r["add_dkdv"] and r["head_dim"] == d
        )  # fmt: skip
        assert report["HGMMA"] == storing["HGMMA"], (report, storing)
        assert report["LDG"] > storing["LDG"], (report, storing)
        assert report["spill_bytes"] <= storing["spill_bytes"] + 64, (report, storing)


# Runs in a process of its own (gluon_bwd imports Gluon): the launcher's checks of its module
# constants, before anything is launched.
_CONSTANT_CHECKS = """
import json, torch
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256
errors = {}
for module, name, value in ((gluon_bwd, "LATE_DQ_HANDOFF", 3), (gluon_bwd, "LATE_DQ_HANDOFF", -1),
                            (gluon_bwd, "DKDV_TMA", 3), (gluon_bwd256, "DKDV_TMA", 3),
                            (gluon_bwd, "PERSISTENT", 2), (gluon_bwd, "MAX_PROGRAMS", -1),
                            (gluon_bwd, "EARLY_KV_RELEASE", 2), (gluon_bwd, "DQ_FIRST_STORE", 3)):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        module.backward(*[None] * 11)
    except ValueError as error:
        errors[f"{module.__name__.split('.')[-1]}.{name}={value}"] = str(error)
    setattr(module, name, saved)
gluon_bwd.EARLY_KV_RELEASE, gluon_bwd.DQ_BUFFERS = 1, 1
try:
    gluon_bwd.backward(*[None] * 11)
except ValueError as error:
    errors["gluon_bwd.EARLY_KV_RELEASE=1,DQ_BUFFERS=1"] = str(error)
gluon_bwd.EARLY_KV_RELEASE, gluon_bwd.DQ_BUFFERS = 0, 2
try:  # per-tile flags while DQ_FIRST_STORE is off
    gluon_bwd.backward(*[None] * 11, dq_accumulator=torch.zeros(1), dq_flags=torch.zeros(1))
except ValueError as error:
    errors["gluon_bwd.DQ_FIRST_STORE=0,dq_flags"] = str(error)
print(json.dumps(errors))
"""


# Runs in a process of its own (gluon_backward imports Gluon): the benchmark scripts' constant
# options, as gpu_check.py's --gluon-bwd / --gluon-bwd256 apply them.
_OPTION_CHECKS = """
import argparse, json, sys
sys.path.insert(0, BENCHMARKS)
import gluon_backward
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256
seen = {}
for module, option, text in ((gluon_bwd256, "--gluon-bwd256", "DKDV_TMA=1"),
                             (gluon_bwd, "--gluon-bwd", "DKDV_TMA=0,LATE_DQ_HANDOFF=1"),
                             (gluon_bwd256, "--gluon-bwd256", "LATE_DQ_HANDOFF=1"),
                             (gluon_bwd, "--gluon-bwd", "NOT_A_CONSTANT=1")):
    parser = argparse.ArgumentParser()
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))
    try:
        gluon_backward.apply_gluon_bwd_option(parser, text, module, option)
        seen[text] = [module.DKDV_TMA, getattr(module, "LATE_DQ_HANDOFF", None)]
    except ValueError as error:
        seen[text] = str(error)
print(json.dumps(seen))
""".replace("BENCHMARKS", repr(str(ROOT / "benchmarks")))


def test_constant_options_set_the_named_module_or_refuse_by_name():
    """``--gluon-bwd256 DKDV_TMA=1`` sets the hd256 module's constant (as its own type), and
    ``--gluon-bwd`` the hd64/128 one's; a constant the module lacks, or no constant at all, is
    the parser's error naming the option."""
    (seen,) = json_lines(["-c", _OPTION_CHECKS])
    assert seen["DKDV_TMA=1"] == [1, None]
    assert seen["DKDV_TMA=0,LATE_DQ_HANDOFF=1"] == [0, 1]
    assert "--gluon-bwd256" in seen["LATE_DQ_HANDOFF=1"]
    assert "gluon_bwd256 has no ['LATE_DQ_HANDOFF']" in seen["LATE_DQ_HANDOFF=1"]
    assert seen["NOT_A_CONSTANT=1"].startswith("--gluon-bwd: expected NAME=INT")


def test_launcher_refuses_kernel_forms_it_does_not_have():
    """``gluon_bwd.LATE_DQ_HANDOFF`` and ``DKDV_TMA`` (and ``gluon_bwd256.DKDV_TMA``) are 0, 1
    or 2; anything else (such as the nineteenth session's measured and removed slot-release
    forms 3 and 4) is refused, naming the constant, before a launch; so is
    ``EARLY_KV_RELEASE`` but 0 or 1, and 1 with one dQ buffer (it stages dK in the second);
    so is ``DQ_FIRST_STORE`` but 0, 1 or 2, and per-tile dQ flags handed over while it is off."""
    (errors,) = json_lines(["-c", _CONSTANT_CHECKS])
    assert set(errors) == {
        "gluon_bwd.LATE_DQ_HANDOFF=3",
        "gluon_bwd.LATE_DQ_HANDOFF=-1",
        "gluon_bwd.DKDV_TMA=3",
        "gluon_bwd256.DKDV_TMA=3",
        "gluon_bwd.PERSISTENT=2",
        "gluon_bwd.MAX_PROGRAMS=-1",
        "gluon_bwd.EARLY_KV_RELEASE=2",
        "gluon_bwd.EARLY_KV_RELEASE=1,DQ_BUFFERS=1",
        "gluon_bwd.DQ_FIRST_STORE=3",
        "gluon_bwd.DQ_FIRST_STORE=0,dq_flags",
    }
    flags_error = errors.pop("gluon_bwd.DQ_FIRST_STORE=0,dq_flags")
    assert "dq_flags" in flags_error and "DQ_FIRST_STORE" in flags_error
    assert all(key.split("=")[0] in message for key, message in errors.items())


# Runs in a process of its own (gluon_bwd imports Gluon): one launch of the Gluon backward with
# the kernel launch and the SM count replaced by stand-ins (132 SMs, as the H200 has), per form.
_PERSISTENT_LAUNCHES = """
import json, torch
from flashmask.kernels import tiles
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
seen = []
def fake_launch(kernel, grid, *args, **kwargs):
    counter = kwargs["next_item_ptr"]
    seen[-1].update(grid=list(grid), num_items=kwargs["num_items"],
                    persistent=kwargs["PERSISTENT"], counter_zeroed=counter.numel() == 1
                    and not counter.any(), counter_is_counts=counter is lists.counts)
gluon_bwd.launch_kernel = fake_launch
gluon_bwd.sm_count = lambda device: 132
b, s, h, hk, d = 2, 1024, 8, 4, 128
q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
k = torch.zeros(b, s, hk, d, dtype=torch.bfloat16)
lse = torch.zeros(b, h, s)
tn, tm = s // 128, s // 64
lists = tiles.TileLists(torch.zeros(b, 1, tn, tm, dtype=torch.int32),
                        torch.zeros(b, 1, tn, dtype=torch.int32), None)
for persistent, max_programs in ((0, 0), (1, 0), (1, 3), (1, 1000)):
    gluon_bwd.PERSISTENT, gluon_bwd.MAX_PROGRAMS = persistent, max_programs
    seen.append({"form": [persistent, max_programs]})
    gluon_bwd.backward(q, q, k, k, lse, lse, None, lists, 1, True, 0.125)
print(json.dumps({"seen": seen}))
"""


def test_persistent_backward_runs_one_program_per_sm_taking_items_from_a_zeroed_counter():
    """``gluon_bwd.PERSISTENT``: the grid ``(key tiles, kv heads, batch)`` = (8, 4, 2), 64 work
    items, becomes 1-D with ``min(items, SMs or MAX_PROGRAMS)`` programs, and where that is
    fewer than the items the kernel gets a zeroed int32 counter to take the rest from (else the
    counts tensor, a pointer it does not read); off, the 3-D grid of one program per item."""
    (result,) = json_lines(["-c", _PERSISTENT_LAUNCHES])
    seen = result["seen"]
    by_form = {tuple(launch["form"]): launch for launch in seen}
    assert by_form[0, 0]["grid"] == [8, 4, 2] and not by_form[0, 0]["persistent"]
    assert by_form[1, 0]["grid"] == [64] and by_form[1, 0]["counter_is_counts"]  # 64 < 132 SMs
    assert by_form[1, 3]["grid"] == [3] and by_form[1, 3]["counter_zeroed"]
    assert by_form[1, 1000]["grid"] == [64] and by_form[1, 1000]["counter_is_counts"]
    assert all(launch["num_items"] == 64 for launch in seen)
    assert all(launch["persistent"] for form, launch in by_form.items() if form[0])


# Runs in a process of its own (gluon_bwd imports Gluon): the timeline tensor the launcher hands
# the kernel, with the kernel launch replaced by a stand-in.
_TIMELINE_LAUNCHES = """
import json, torch
from flashmask.kernels import tiles
from flashmask.kernels.gluon_kernels import backward as gluon_bwd
seen = {}
gluon_bwd.launch_kernel = lambda kernel, grid, *args, **kwargs: seen.update(
    given=kwargs["timeline_ptr"])
b, s, h, d = 1, 1024, 2, 128
q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
lse = torch.zeros(b, h, s)
lists = tiles.TileLists(torch.zeros(b, 1, s // 128, s // 64, dtype=torch.int32),
                        torch.zeros(b, 1, s // 128, dtype=torch.int32), None)
result = {}
for name, timeline in (("none", None), ("fits", torch.zeros(16, 10, dtype=torch.int64)),
                       ("short", torch.zeros(15, 10, dtype=torch.int64)),
                       ("int32", torch.zeros(16, 10, dtype=torch.int32))):
    gluon_bwd.TIMELINE = timeline
    seen.clear()
    try:
        gluon_bwd.backward(q, q, q, q, lse, lse, None, lists, 1, True, 0.125)
        result[name] = "none" if seen["given"] is None else (
            "same" if seen["given"] is timeline else "other")
    except ValueError as error:
        result[name] = str(error)
print(json.dumps(result))
"""


def test_launcher_hands_the_timeline_over_or_refuses_it_by_name():
    """``gluon_bwd.TIMELINE``: ``None`` launches without stamps (``timeline_ptr`` ``None``); an
    int64 tensor on the inputs' device with room for every work item's row (2 kv heads x 8 key
    tiles = 16 items of ``TIMELINE_FIELDS`` = 10 here) is handed to the kernel as it is; a
    shorter one or another dtype is refused, naming the constant and what it needs."""
    (result,) = json_lines(["-c", _TIMELINE_LAUNCHES])
    assert result["none"] == "none" and result["fits"] == "same"
    for name in ("short", "int32"):
        assert "gluon_bwd.TIMELINE must be an int64 tensor" in result[name], result
        assert "16 x 10" in result[name], result


def _timeline_module():
    spec = importlib.util.spec_from_file_location(
        "bwd_timeline", ROOT / "benchmarks" / "bwd_timeline.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stamped_item(
    sm: int, start_ns: int, phases_ns: tuple[int, int, int, int], tiles: int, received_ns: int = 0
):
    """A timeline row of an item on ``sm`` starting at ``start_ns`` with its kv, first-tile,
    loop and drain phases, on a 2 GHz clock (and the global timer in nanoseconds); the next
    item received ``received_ns`` after its end (0: not stamped)."""
    kv, first, loop, drain = phases_ns
    marks = np.cumsum([start_ns, kv, first, loop, drain])
    received = 2 * (marks[-1] + received_ns) if received_ns else 0
    return [*(2 * marks), sm, tiles, marks[0], marks[-1], received]


def test_timeline_summary_splits_the_sm_time_into_its_phases():
    """``benchmarks/bwd_timeline.summarize``: three items on two SMs (2 GHz clock). SM 0 runs
    items of 10 and 5 tiles with 1 us between them, SM 1 one of 15 tiles from 0.5 us, every
    tile 1 us, every item 1 us for K/V, 0.5 for its first tile and 1 for its drain: of the 2 SMs
    x 21 us, the loops are 30 us, the waits 3 + 1.5, the drains 3, the gap 1, SM 1's ramp 0.5
    and tail 3; the loop fit is 0 + 1 us per tile. A third, idle SM adds its whole span, half
    to the ramp and half to the tail."""
    timeline = _timeline_module()
    rows = np.array(
        [
            _stamped_item(0, 0, (1000, 500, 10_000, 1000), 10),
            _stamped_item(0, 13_500, (1000, 500, 5_000, 1000), 5),
            _stamped_item(1, 500, (1000, 500, 15_000, 1000), 15),
        ]
    )
    summary = timeline.summarize(rows, num_sms=2)
    assert summary["clock_ghz"] == pytest.approx(2.0)
    assert summary["span_us"] == pytest.approx(21.0)
    expected_us = {"kv": 3, "first": 1.5, "loop": 30, "drain": 3, "gap": 1, "ramp": 0.5,
                   "tail": 3}  # fmt: skip
    for phase, us in expected_us.items():
        assert summary["share"][phase] == pytest.approx(us / 42), phase
    assert summary["loop_fixed_us"] == pytest.approx(0.0, abs=1e-9)
    assert summary["loop_per_tile_us"] == pytest.approx(1.0)
    assert summary["median_us"]["per_tile"] == pytest.approx(1.0)
    assert summary["median_us"]["gap"] == pytest.approx(1.0)
    assert summary["median_us"]["gap_until_received"] == 0.0  # not stamped
    rows[0] = _stamped_item(0, 0, (1000, 500, 10_000, 1000), 10, received_ns=400)
    received = timeline.summarize(rows, num_sms=2)["median_us"]["gap_until_received"]
    assert received == pytest.approx(0.4)  # of the 1 us before SM 0's second item
    with_idle = timeline.summarize(rows, num_sms=3)
    assert sum(with_idle["share"].values()) == pytest.approx(1.0)
    assert with_idle["share"]["ramp"] * 63 == pytest.approx(0.5 + 10.5)


def test_timeline_summary_refuses_rows_an_item_left_unstamped():
    """An item whose end was never stamped (a launch that did not run it, or the wrong rows)
    is an error naming the timeline, not a silently short split."""
    timeline = _timeline_module()
    rows = np.array([_stamped_item(0, 0, (1000, 500, 1000, 1000), 1), [0] * 10])
    with pytest.raises(ValueError, match="timeline"):
        timeline.summarize(rows, num_sms=1)
