"""The Gluon backward (``flashmask.kernels.gluon_bwd``): where the launcher uses it, and that it
compiles for Hopper into a warp-specialised kernel.

Its dQ goes through fp32 atomics, so it serves ``deterministic=False`` only; the bit-exact
guarantees (skip == dense, repeat == repeat) stay with the Triton kernels. Gluon has no CPU
interpreter: the H200 check (``benchmarks/gpu_check.py``, its ``det=False`` cases) proves its
results; here the routing rules and an sm_90 compile of every variant.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from flashmask import kernels
from tests.kernels.sm90_compile import compile_reports
from tests.kernels.test_tile_configs import INTERPRETER_WARNING

HOPPER = (9, 0)


def _inputs(seqlen_q=256, seqlen_k=384, head_dim=128, dtype=torch.bfloat16):
    q = torch.zeros(2, seqlen_q, 4, head_dim, dtype=dtype)
    k = torch.zeros(2, seqlen_k, 2, head_dim, dtype=dtype)
    return q, k, torch.zeros_like(k), torch.zeros_like(q)


def test_eligible_inputs_are_the_forward_s_with_a_dout_like_q():
    q, k, v, dout = _inputs()
    assert kernels.gluon_backward_eligible(q, k, v, dout, HOPPER)
    assert not kernels.gluon_backward_eligible(q, k, v, dout, (8, 0))
    assert not kernels.gluon_backward_eligible(*_inputs(seqlen_q=200), HOPPER)
    assert not kernels.gluon_backward_eligible(*_inputs(head_dim=96), HOPPER)
    # The forward takes D = 256; the backward's dK/dV accumulators would not fit there.
    assert kernels.gluon_forward_eligible(*_inputs(head_dim=256)[:3], HOPPER)
    assert not kernels.gluon_backward_eligible(*_inputs(head_dim=256), HOPPER)
    assert not kernels.gluon_backward_eligible(q, k, v, dout.half(), HOPPER)
    assert not kernels.gluon_backward_eligible(q, k, v, dout[:, :128], HOPPER)
    # Any layout (the launcher makes contiguous aligned copies where needed).
    strided = torch.zeros(2, 4, 256, 128, dtype=q.dtype).transpose(1, 2)
    assert kernels.gluon_backward_eligible(q, k, v, strided, HOPPER)


def test_launcher_uses_it_only_non_deterministic_skipping_on_a_gpu(monkeypatch):
    q, k, v, dout = _inputs()
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    assert not kernels._use_gluon_backward(q, k, v, dout, False, True, False, cfg)  # CPU tensors
    monkeypatch.setattr(kernels, "_capability_of", lambda index: HOPPER)
    monkeypatch.setattr(kernels, "_cuda_index", lambda device: 0)
    monkeypatch.setattr(kernels, "gluon_available", lambda: True)
    on_gpu = [x.to("meta") for x in (q, k, v, dout)]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: 0)
    assert kernels._use_gluon_backward(*on_gpu, False, True, False, cfg)
    assert not kernels._use_gluon_backward(*on_gpu, True, True, False, cfg)  # atomics
    assert not kernels._use_gluon_backward(*on_gpu, False, False, False, cfg)  # dense mode
    assert not kernels._use_gluon_backward(
        *on_gpu, False, True, False, replace(cfg, bwd_gluon=False)
    )
    monkeypatch.setattr(kernels, "_capability_of", lambda index: (10, 0))
    assert not kernels._use_gluon_backward(*on_gpu, False, True, False, cfg)


def test_torch_deterministic_algorithms_keep_the_reproducible_backward(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` must not get fp32 atomics, whatever the
    call's ``deterministic`` says."""
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    monkeypatch.setattr(kernels, "_gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(kernels, "gluon_available", lambda: True)
    inputs = _inputs()
    assert kernels._use_gluon_backward(*inputs, False, True, False, cfg)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not kernels._use_gluon_backward(*inputs, False, True, False, cfg)


def test_with_a_mask_only_from_16k_keys(monkeypatch):
    """Measured slower than the Triton backward on sparse masks at 8K (its 128-key tiles skip
    less finely). Any number of mask heads (checked on the H200 with random_eviction's mask per
    head group, ``benchmarks/results/gpu_check_gluon_s7.json``)."""
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    monkeypatch.setattr(kernels, "_gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(kernels, "gluon_available", lambda: True)
    short = _inputs(seqlen_q=8192, seqlen_k=8192)
    long = _inputs(seqlen_q=256, seqlen_k=kernels.GLUON_BWD_MIN_MASKED_SEQLEN)
    assert kernels._use_gluon_backward(*short, False, True, False, cfg)  # no mask: any length
    assert not kernels._use_gluon_backward(*short, False, True, True, cfg)
    assert kernels._use_gluon_backward(*long, False, True, True, cfg)
    # gpu_check --gluon-everywhere:
    monkeypatch.setattr(kernels, "GLUON_BWD_MIN_MASKED_SEQLEN", 0)
    assert kernels._use_gluon_backward(*short, False, True, True, cfg)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_default_tiles_use_it_at_head_dims_64_and_128_with_or_without_a_mask(monkeypatch, head_dim):
    """Measured faster on the H200 at hd64 and hd128 (with a mask from 16K keys, the
    launcher's rule)."""
    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    for has_mask in (True, False):
        assert kernels.tile_config(head_dim, has_mask=has_mask).bwd_gluon == (head_dim in (64, 128))
    assert not kernels.compact_tile_config(head_dim).bwd_gluon
    monkeypatch.setattr(kernels, "_interpreting", lambda: True)
    assert not kernels.tile_config(head_dim).bwd_gluon


def test_compiles_warp_specialised_for_sm90():
    reports = compile_reports("gluon_backward.py")
    variants = {
        (r["head_dim"], r["causal"], r["has_mask"], r["dtype"], r["dq_tma"]) for r in reports
    }
    assert len(variants) == 11 and {v[0] for v in variants} == set(kernels.GLUON_BWD_HEAD_DIMS)
    assert {v[3] for v in variants} == {"bf16", "fp16"}
    assert {v[4] for v in variants} == {False, True}  # dQ through TMA reduce-adds (measurement)
    for report in reports:
        # Producer + dQ writers in one warpgroup: 12 warps, the consumers raised to 240.
        assert report["warps"] == 12, report
        assert any("inc.sync.aligned.u32 240" in s for s in report["setmaxnreg"]), report
        assert report["UTMALDG"] > 0, report
        if report["dq_tma"]:  # dQ leaves through TMA reduce-adds, not red.global
            assert report["UTMAREDG"] > 0 and report["REDG"] == 0, report
        else:
            assert report["REDG"] > 0 and report["UTMAREDG"] == 0, report
        assert report["HGMMA"] >= 5 * 4, report  # five matmuls, at least four k-steps each
        # Version-dependent but small: at most 80 bytes under Triton 3.6 (the H200's; none
        # without a mask), up to 152 under 3.9. A register blow-up would spill kilobytes.
        assert report["spill_bytes"] <= 256, report


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
def test_launcher_hands_the_kernel_ready_inputs_delta_and_column_lists(monkeypatch):
    """What ``kernels.backward`` passes the Gluon backward (a stand-in records it; the kernel
    needs a GPU): contiguous q/k/v/dout equal to the caller's, the forward's lse as float32,
    ``delta = rowsum(dO * O) - dlse`` and the column-major lists at its 64x128 tiles."""
    seen = {}

    def fake_backward(dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale):
        seen.update(dout=dout, q=q, lse=lse, delta=delta, lists=lists, hm=hm, causal=causal)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(backward=fake_backward)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.gluon_bwd", fake)
    monkeypatch.setattr(kernels, "gluon_bwd", fake, raising=False)
    monkeypatch.setattr(kernels, "_use_gluon_backward", lambda *args: True)
    cfg = replace(kernels.tile_config(128), bwd_gluon=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 128, generator=gen).half().transpose(1, 2)
    k = torch.randn(1, 384, 2, 128, generator=gen).half()
    out = torch.randn(1, 256, 4, 128, generator=gen).half()
    dout = torch.randn(1, 4, 256, 128, generator=gen).half().transpose(1, 2)
    lse = torch.randn(1, 4, 256, generator=gen)
    dlse = torch.randn(1, 4, 256, generator=gen)
    kernels.backward(dout, dlse, q, k, k, out, lse, None, True, 0.125, False, config=cfg)
    assert seen["q"].is_contiguous() and torch.equal(seen["q"], q)
    assert seen["dout"].is_contiguous() and torch.equal(seen["dout"], dout)
    assert seen["lse"].dtype == torch.float32 and torch.equal(seen["lse"], lse)
    want = (dout.float() * out.float()).sum(-1).transpose(1, 2) - dlse
    torch.testing.assert_close(seen["delta"], want, rtol=1e-3, atol=1e-3)
    assert seen["lists"].entries.shape[-2:] == (3, 4)  # 384 / 128 key tiles, 256 / 64 queries
    assert (seen["hm"], seen["causal"]) == (1, True)
