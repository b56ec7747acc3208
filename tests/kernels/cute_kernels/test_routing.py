"""Which calls the CuTe forward takes (``routing.use_cute_forward``), and that the launcher hands
it the lists, bounds and launch order it prepares."""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import torch

if not torch.cuda.is_available():  # before anything imports triton: the preparation's kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashmask import kernels, masks
from flashmask.kernels import cute_kernels, hardware, routing

HOPPER = (9, 0)


def _qkv(seqlen=8192, head_dim=256, dtype=torch.bfloat16):
    q = torch.zeros(1, seqlen, 2, head_dim, dtype=dtype, device="meta")
    k = torch.zeros(1, seqlen, 1, head_dim, dtype=dtype, device="meta")
    return q, k, torch.zeros_like(k)


def _as_if_on(monkeypatch, capability, cute=True):
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: capability)
    monkeypatch.setattr(routing, "cute_available", lambda: cute)


def test_it_takes_head_dim_256_from_8k_keys_on_hopper_with_the_extra(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    for masked, causal in ((False, False), (False, True), (True, True), (True, False)):
        assert routing.use_cute_forward(*_qkv(), 0.1, masked, causal)
    assert routing.use_cute_forward(*_qkv(dtype=torch.float16), 0.1, False, False)
    assert not routing.use_cute_forward(*_qkv(seqlen=4096), 0.1, False, False)  # from 8K only
    assert not routing.use_cute_forward(*_qkv(head_dim=64), 0.1, False, False)  # Gluon's
    assert not routing.use_cute_forward(*_qkv(dtype=torch.float32), 0.1, False, False)
    assert not routing.use_cute_forward(*_qkv(), 0.0, False, False)  # row max of unscaled scores
    assert not routing.use_cute_forward(*_qkv(), -0.1, False, False)
    q, k, v = _qkv()
    assert not routing.use_cute_forward(q, k, v[..., :128], 0.1, False, False)  # D != Dv
    _as_if_on(monkeypatch, (10, 0))
    assert not routing.use_cute_forward(*_qkv(), 0.1, False, False)
    _as_if_on(monkeypatch, None)  # CPU
    assert not routing.use_cute_forward(*_qkv(), 0.1, False, False)
    _as_if_on(monkeypatch, HOPPER, cute=False)  # without the cute extra
    assert not routing.use_cute_forward(*_qkv(), 0.1, False, False)


def test_at_head_dim_64_it_takes_masked_calls_from_32k_keys_only(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    long, short = _qkv(seqlen=32768, head_dim=64), _qkv(seqlen=16384, head_dim=64)
    assert routing.use_cute_forward(*long, 0.1, masked=True, causal=True)  # causal masks
    assert routing.use_cute_forward(*long, 0.1, masked=True, causal=False)  # upper intervals
    assert not routing.use_cute_forward(*long, 0.1, masked=False, causal=False)  # full: Gluon
    assert not routing.use_cute_forward(*long, 0.1, masked=False, causal=True)  # causal: Gluon
    assert not routing.use_cute_forward(*short, 0.1, masked=True, causal=True)  # 8K: Triton


def test_at_head_dim_128_it_takes_every_mask_form_from_8k_keys(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    qkv = _qkv(head_dim=128)
    assert routing.use_cute_forward(*qkv, 0.1, masked=False, causal=False)  # full
    assert routing.use_cute_forward(*qkv, 0.1, masked=False, causal=True)  # causal
    assert routing.use_cute_forward(*qkv, 0.1, masked=True, causal=True)  # causal masks
    assert routing.use_cute_forward(*qkv, 0.1, masked=True, causal=False)  # upper intervals
    assert not routing.use_cute_forward(*_qkv(seqlen=4096, head_dim=128), 0.1, False, True)


def test_mla_head_dims_192_and_128_take_every_mask_form_from_8k_keys(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    q, k, v = _qkv(head_dim=192)
    v = v[..., :128]
    for masked, causal in ((False, False), (False, True), (True, True), (True, False)):
        assert routing.use_cute_forward(q, k, v, 0.1, masked, causal)
    assert not routing.use_cute_forward(q, k, k, 0.1, False, False)  # 192 / 192: not built
    assert not routing.use_cute_forward(q, k, v[..., :64], 0.1, False, False)  # 192 / 64
    short = _qkv(seqlen=4096, head_dim=192)
    assert not routing.use_cute_forward(short[0], short[1], short[2][..., :128], 0.1, False, True)


def test_a_head_dim_left_out_of_the_non_causal_table_leaves_those_masks_to_gluon(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    monkeypatch.setattr(routing, "CUTE_FWD_NONCAUSAL_MASK_HEAD_DIMS", (256,))
    qkv = _qkv(head_dim=128)
    assert not routing.use_cute_forward(*qkv, 0.1, masked=True, causal=False)
    assert routing.use_cute_forward(*qkv, 0.1, masked=True, causal=True)


def test_launcher_hands_it_contiguous_inputs_lists_bounds_and_order(monkeypatch):
    seen = {}

    def fake_forward(
        q,
        k,
        v,
        bounds,
        lists,
        hm,
        causal,
        has_upper,
        scale,
        skip,
        order,
        softcap,
        sinks,
        edge_intervals,
    ):
        seen.update(q=q, bounds=bounds, lists=lists, hm=hm, causal=causal, order=order)
        seen.update(edge_intervals=edge_intervals)
        seen.update(has_upper=has_upper, scale=scale, skip=skip, softcap=softcap, sinks=sinks)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    fake = types.SimpleNamespace(forward=fake_forward, key_tile=lambda d: 64 if d > 128 else 128)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.cute_kernels.launch", fake)
    # Also the package's attribute, in case the real module was imported before.
    monkeypatch.setattr(cute_kernels, "launch", fake, raising=False)
    monkeypatch.setattr(routing, "use_cute_forward", lambda *args: True)
    mask = masks.causal_document([128, 256])  # [1, 1, 384, 1]
    q = torch.randn(1, 4, 384, 256, dtype=torch.float16).transpose(1, 2)  # [B, S, H, D] view
    k = torch.randn(1, 384, 2, 256, dtype=torch.float16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = kernels.forward(
        q, k, k, mask.startend_row_indices, True, 0.0625, softcap=30.0, sinks=sinks
    )
    assert seen["q"].is_contiguous() and torch.equal(seen["q"], q)
    assert seen["softcap"] == 30.0 and seen["sinks"] is sinks
    # The kernel joins the sinks: nothing folds them in again after it.
    assert not out.any() and not lse.any()
    assert seen["lists"].entries.shape[-2:] == (3, 6)  # 384 / 128 query tiles, 384 / 64 keys
    assert seen["bounds"].shape == (1, 1, 4, 384) and seen["hm"] == 1
    assert (seen["causal"], seen["has_upper"], seen["scale"], seen["skip"]) == (
        True, False, 0.0625, True,
    )  # fmt: skip
    assert seen["order"] is not None and seen["order"].numel() == 3 * 4  # tiles x query heads
    assert seen["edge_intervals"]  # one column, causal: the two-compare mask


def test_the_plan_follows_the_routing_table_at_head_dim_128(monkeypatch):
    """``plan_forward`` (what the launcher and ``flashmask bench`` prepare for): at head dim 128
    and 8K keys every mask form's forward takes the CuTe lists; with a non-causal mask left out
    of the table, the Gluon forward's (both 128-row tiles; the plan records which kernel)."""
    from flashmask.kernels import forward_launcher

    _as_if_on(monkeypatch, HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    q, k, v = _qkv(head_dim=128)
    sri = torch.zeros(1, 1, 8192, 2, dtype=torch.int32, device="meta")
    # The Hopper configuration (under the interpreter tile_config gives the small CPU one).
    config = dataclasses.replace(kernels.tile_config(128, has_mask=True), fwd_gluon=True)
    causal = forward_launcher.plan_forward(q, k, v, sri[..., :1], True, 0.1, False, config)
    assert causal.use_cute and not causal.use_gluon
    noncausal = forward_launcher.plan_forward(q, k, v, sri, False, 0.1, False, config)
    assert noncausal.use_cute and not noncausal.use_gluon
    unmasked = forward_launcher.plan_forward(q, k, v, None, False, 0.1, False, config)
    assert unmasked.use_cute
    monkeypatch.setattr(routing, "CUTE_FWD_NONCAUSAL_MASK_HEAD_DIMS", (256,))
    noncausal = forward_launcher.plan_forward(q, k, v, sri, False, 0.1, False, config)
    assert noncausal.use_gluon and not noncausal.use_cute


def test_a_deterministic_plan_prepares_the_lists_the_cute_backward_reads(monkeypatch):
    """With the deterministic CuTe backward routed, the forward's plan (and the backward's own
    list shapes) hold the Gluon backward's 64 x 128 column-major lists, not the Triton passes'."""
    from flashmask.kernels import forward_launcher

    _as_if_on(monkeypatch, HOPPER)
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_MASKED", True)  # a masked call
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    q, k, v = _qkv(head_dim=128)
    sri = torch.zeros(1, 1, 8192, 2, dtype=torch.int32, device="meta")
    config = dataclasses.replace(kernels.tile_config(128, has_mask=True), fwd_gluon=True)
    gluon_lists = routing.backward_shapes(True, 128, config)
    plan = forward_launcher.plan_forward(q, k, v, sri, False, 0.1, True, config)
    assert all(shape in plan.shapes for shape in gluon_lists)
    assert routing.backward_list_shapes(q, k, v, q, sri, True, config) == gluon_lists
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_HEAD_DIMS", ())
    triton_lists = routing.backward_shapes(False, 128, config)
    assert routing.backward_list_shapes(q, k, v, q, sri, True, config) == triton_lists


def test_a_logit_cap_routes_the_forward_as_the_uncapped_call(monkeypatch):
    """The CuTe forward takes the cap: a capped call runs it wherever the uncapped call would,
    and also with a negative scale (its row max is then over the capped scores), which the
    uncapped call leaves to the Triton forward."""
    from flashmask.kernels import forward_launcher

    _as_if_on(monkeypatch, HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    q, k, v = _qkv(head_dim=128)
    sri = torch.zeros(1, 1, 8192, 2, dtype=torch.int32, device="meta")
    config = dataclasses.replace(kernels.tile_config(128, has_mask=True), fwd_gluon=True)
    for mask, causal in ((sri[..., :1], True), (sri, False), (None, False), (None, True)):
        for softcap in (0.0, 30.0):
            plan = forward_launcher.plan_forward(
                q, k, v, mask, causal, 0.1, False, config, softcap=softcap
            )
            assert plan.use_cute and not plan.use_gluon
    assert not routing.use_cute_forward(q, k, v, -0.1, True, True)
    assert routing.use_cute_forward(q, k, v, -0.1, True, True, softcap=30.0)


def test_the_cute_backward_takes_no_call_until_a_head_dim_is_routed(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    q = _qkv(head_dim=128)[0]
    assert not routing.use_cute_backward(q)
    monkeypatch.setattr(routing, "CUTE_BWD_HEAD_DIMS", (128,))
    assert routing.use_cute_backward(q)
    assert not routing.use_cute_backward(_qkv(head_dim=64)[0])
    assert not routing.use_cute_backward(q, 30.0)  # no logit cap in the CuTe backward
    _as_if_on(monkeypatch, HOPPER, cute=False)
    assert not routing.use_cute_backward(q)


def test_a_routed_call_goes_to_the_cute_backward_with_the_gluon_lists_and_order(monkeypatch):
    seen = {}

    def fake_backward(dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale, *, order,
                      dq_accumulator, deterministic):  # fmt: skip
        seen.update(q=q, delta=delta, bounds=bounds, lists=lists, hm=hm, causal=causal)
        seen.update(order=order, dq_accumulator=dq_accumulator, deterministic=deterministic)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(backward=fake_backward, one_launch=lambda *args: True)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.cute_kernels.backward_launch", fake)
    monkeypatch.setattr(cute_kernels, "backward_launch", fake, raising=False)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    monkeypatch.setattr(routing, "use_cute_backward", lambda q, softcap=0.0: True)
    mask = masks.causal_document([128, 256])  # [1, 1, 384, 1]
    q = torch.randn(1, 384, 4, 128)
    k = torch.randn(1, 384, 2, 128)
    out, lse = torch.randn_like(q), torch.randn(1, 4, 384)
    kernels.backward(q, None, q, k, k, out, lse, mask.startend_row_indices, True, 0.1, False)
    assert seen["lists"].entries.shape[-2:] == (3, 6)  # 384 / 128 key tiles, 384 / 64 queries
    assert seen["bounds"].shape == (1, 1, 4, 384) and seen["hm"] == 1 and seen["causal"]
    assert seen["order"] is not None and seen["order"].numel() == 3 * 2  # tiles x kv heads
    # Zeroed by the row-term kernel, which computed delta = rowsum(dO * O) beside it.
    assert torch.equal(seen["dq_accumulator"], torch.zeros_like(q))
    torch.testing.assert_close(seen["delta"], (q * out).sum(-1).transpose(1, 2))
    assert not seen["deterministic"]


def test_deterministic_calls_take_the_cute_backward_at_its_head_dims(monkeypatch):
    _as_if_on(monkeypatch, HOPPER)
    q, k, v = _qkv(head_dim=128)
    dout = torch.zeros_like(q)
    unmasked = False
    assert routing.use_cute_deterministic_backward(q, k, v, dout, True, unmasked)
    assert not routing.use_cute_deterministic_backward(q, k, v, dout, False, unmasked)
    assert not routing.use_cute_deterministic_backward(q, k, v, dout, True, True)  # a mask
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert routing.use_cute_deterministic_backward(q, k, v, dout, False, unmasked)  # torch's
    assert not routing.use_cute_deterministic_backward(q, k, v, dout, True, unmasked, 30.0)
    q4k, k4k, v4k = _qkv(seqlen=4096, head_dim=128)  # from 8K keys
    assert not routing.use_cute_deterministic_backward(q4k, k4k, v4k, q4k, True, unmasked)
    q64, k64, v64 = _qkv(head_dim=64)  # compiled, not timed
    assert not routing.use_cute_deterministic_backward(q64, k64, v64, q64, True, unmasked)
    q256, k256, v256 = _qkv(head_dim=256)  # beyond the kernel's shared memory
    assert not routing.use_cute_deterministic_backward(q256, k256, v256, q256, True, unmasked)
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_HEAD_DIMS", (64, 128))
    monkeypatch.setattr(routing, "CUTE_DETERMINISTIC_BWD_MASKED", True)
    assert routing.use_cute_deterministic_backward(q64, k64, v64, q64, True, unmasked)
    assert routing.use_cute_deterministic_backward(q, k, v, dout, True, True)
    # What the Gluon backward refuses, the variant refuses too, whatever the table says.
    q_odd, k_odd, v_odd = _qkv(seqlen=8256, head_dim=128)  # not a multiple of 128
    assert not routing.use_cute_deterministic_backward(q_odd, k_odd, v_odd, q_odd, True, False)
    _as_if_on(monkeypatch, HOPPER, cute=False)
    assert not routing.use_cute_deterministic_backward(q, k, v, dout, True, unmasked)
    _as_if_on(monkeypatch, None)  # CPU
    assert not routing.use_cute_deterministic_backward(q, k, v, dout, True, unmasked)


def test_a_deterministic_call_goes_to_the_cute_backward_asking_for_the_fixed_order(monkeypatch):
    seen = {}

    def fake_backward(dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale, *, order,
                      dq_accumulator, deterministic):  # fmt: skip
        seen.update(lists=lists, deterministic=deterministic)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(backward=fake_backward, one_launch=lambda *args: True)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.cute_kernels.backward_launch", fake)
    monkeypatch.setattr(cute_kernels, "backward_launch", fake, raising=False)
    monkeypatch.setattr(routing, "use_cute_deterministic_backward", lambda *args: True)
    mask = masks.causal_document([128, 256])
    q = torch.randn(1, 384, 4, 128)
    k = torch.randn(1, 384, 2, 128)
    out, lse = torch.randn_like(q), torch.randn(1, 4, 384)
    kernels.backward(q, None, q, k, k, out, lse, mask.startend_row_indices, True, 0.1, True)
    assert seen["deterministic"]
    assert seen["lists"].entries.shape[-2:] == (3, 6)  # the Gluon backward's 64 x 128 lists


def test_a_capped_call_goes_to_the_gluon_backward_where_the_cute_one_is_routed(monkeypatch):
    """With the CuTe backward routed at head dim 128, a capped call still runs the Gluon
    backward (the CuTe one has no cap), which receives the cap."""
    seen = {}

    def fake_backward(dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale, *, order,
                      dq_accumulator, softcap=0.0):  # fmt: skip
        seen.update(softcap=softcap)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def cute_backward(*args, **kwargs):
        raise AssertionError("a capped call reached the CuTe backward")

    gluon = types.SimpleNamespace(backward=fake_backward, one_launch=lambda *args: True)
    cute = types.SimpleNamespace(backward=cute_backward, one_launch=lambda *args: True)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.cute_kernels.backward_launch", cute)
    monkeypatch.setattr(cute_kernels, "backward_launch", cute, raising=False)
    monkeypatch.setattr(routing, "gluon_backward_module", lambda head_dim: gluon)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    monkeypatch.setattr(routing, "CUTE_BWD_HEAD_DIMS", (128,))
    monkeypatch.setattr(routing, "cute_available", lambda: True)
    mask = masks.causal_document([128, 256])  # [1, 1, 384, 1]
    q = torch.randn(1, 384, 4, 128)
    k = torch.randn(1, 384, 2, 128)
    out, lse = torch.randn_like(q), torch.randn(1, 4, 384)
    sri = mask.startend_row_indices
    kernels.backward(q, None, q, k, k, out, lse, sri, True, 0.1, False, softcap=30.0)
    assert seen["softcap"] == 30.0


def test_the_fp8_forward_takes_only_listed_head_dims_on_hopper_with_the_extra(monkeypatch):
    """``use_cute_fp8_forward``: FP8 q/k/v of a listed head dim (V's too), a 16-bit output, a
    positive scale and no cap on a Hopper GPU with the extra, at any length."""
    fp8 = torch.float8_e4m3fn
    _as_if_on(monkeypatch, HOPPER)
    qkv = _qkv(seqlen=128, head_dim=128, dtype=fp8)
    monkeypatch.setattr(routing, "CUTE_FP8_HEAD_DIMS", ())
    assert not routing.use_cute_fp8_forward(*qkv, 0.1)
    monkeypatch.setattr(routing, "CUTE_FP8_HEAD_DIMS", (128,))
    assert routing.use_cute_fp8_forward(*qkv, 0.1)  # no length threshold
    assert routing.use_cute_fp8_forward(*qkv, 0.1, out_dtype=torch.float16)
    assert not routing.use_cute_fp8_forward(*qkv, 0.1, out_dtype=torch.float32)
    assert not routing.use_cute_fp8_forward(*qkv, 0.0)  # row max of unscaled scores
    assert not routing.use_cute_fp8_forward(*qkv, 0.1, softcap=30.0)  # no cap in CuTe
    assert not routing.use_cute_fp8_forward(*_qkv(head_dim=64, dtype=fp8), 0.1)  # not listed
    assert not routing.use_cute_fp8_forward(*_qkv(head_dim=128), 0.1)  # bf16
    q, k, v = qkv
    assert not routing.use_cute_fp8_forward(q, k, v[..., :64], 0.1)  # Dv != D
    assert not routing.use_cute_fp8_forward(q, k, v.to(torch.bfloat16), 0.1)
    _as_if_on(monkeypatch, (10, 0))
    assert not routing.use_cute_fp8_forward(*qkv, 0.1)
    _as_if_on(monkeypatch, None)  # CPU, or the interpreter
    assert not routing.use_cute_fp8_forward(*qkv, 0.1)
    _as_if_on(monkeypatch, HOPPER, cute=False)
    assert not routing.use_cute_fp8_forward(*qkv, 0.1)
