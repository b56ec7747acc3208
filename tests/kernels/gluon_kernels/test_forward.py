"""The Gluon forward (``flashmask.kernels.gluon_kernels.forward``): where the launcher uses it,
and that it compiles for Hopper into a warp-specialised kernel.

Gluon has no CPU interpreter, so its results are proven on a GPU (``tests/gpu`` runs the
library's forward, which takes this kernel for hd128 inputs: unmasked ones, and masked ones from
8K keys or, with the thresholds lifted, short ones). Here: the routing rules (on the GPU only,
positive scale or a logit cap, shapes its 2-D TMA descriptors describe exactly, Hopper only, the
masked length limit, capped calls that the CuTe forward would take uncapped), what the launcher
hands the kernel, and an sm_90 compile of every shipped variant (``benchmarks/sass_report.py
--family gluon_fwd``).
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

from flashmask import kernels, masks
from flashmask.kernels import hardware, routing, tensors, tiles
from tests.kernels.sm90_compile import compile_reports, json_lines
from tests.kernels.test_tile_configs import INTERPRETER_WARNING

HOPPER = (9, 0)


def _qkv(batch=2, seqlen_q=256, seqlen_k=384, heads=4, kv_heads=2, head_dim=128, **kwargs):
    dtype = kwargs.get("dtype", torch.bfloat16)
    q = torch.zeros(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = torch.zeros(batch, seqlen_k, kv_heads, head_dim, dtype=dtype)
    return q, k, torch.zeros_like(k)


def test_eligible_inputs_hopper_fp16_bf16_head_dims_64_128_tile_multiples():
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128, 256):
            assert routing.gluon_forward_eligible(*_qkv(head_dim=head_dim, dtype=dtype), HOPPER)
    assert routing.gluon_forward_eligible(*_qkv(), (9, 0))


@pytest.mark.parametrize(
    "why, args, capability",
    [
        ("Ampere has no wgmma/TMA", _qkv(), (8, 0)),
        ("Blackwell has no wgmma", _qkv(), (10, 0)),
        ("float32", _qkv(dtype=torch.float32), HOPPER),
        ("head dim 96", _qkv(head_dim=96), HOPPER),
        ("head dim 192", _qkv(head_dim=192), HOPPER),
        ("Sq not a multiple of 128", _qkv(seqlen_q=200), HOPPER),
        ("Sk not a multiple of 128", _qkv(seqlen_k=1000), HOPPER),
    ],
)
def test_ineligible_inputs(why, args, capability):
    assert not routing.gluon_forward_eligible(*args, capability), why


def test_any_layout_is_eligible_and_reaches_the_kernel_contiguous_and_aligned():
    """transformers passes ``[B, H, S, D]`` tensors transposed to ``[B, S, H, D]``: the kernel's
    2-D TMA descriptors need contiguous, 16-byte aligned tensors, which ``tma_ready`` makes
    (copying only what is not already so)."""
    q, k, v = _qkv()
    transposed = torch.randn(2, 4, 256, 128).to(q.dtype).transpose(1, 2)  # [B, S, H, D] view
    assert not transposed.is_contiguous()
    assert routing.gluon_forward_eligible(transposed, k, v, HOPPER)
    assert not routing.gluon_forward_eligible(q, k.half(), v, HOPPER)  # one dtype
    ready = tensors.tma_ready(transposed)
    assert ready.is_contiguous() and ready.data_ptr() % 16 == 0
    assert torch.equal(ready, transposed)
    assert tensors.tma_ready(q) is q  # already contiguous and aligned: no copy
    # A contiguous tensor starting 2 bytes into its storage: TMA needs 16-byte aligned bases.
    shifted = torch.arange(q.numel() + 1, dtype=torch.float32).to(q.dtype)[1:].view(q.shape)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    ready = tensors.tma_ready(shifted)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, shifted)


def test_launcher_uses_it_only_on_a_gpu_with_positive_scale_and_the_flag(monkeypatch):
    q, k, v = _qkv()
    cfg = replace(kernels.tile_config(128, has_mask=False), fwd_gluon=True)
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    assert not routing.use_gluon_forward(q, k, v, 0.1, False, cfg)  # CPU tensors
    # As if on an H200: the device test is the only thing standing between CPU and the kernel.
    monkeypatch.setattr(hardware, "capability_of", lambda index: HOPPER)
    monkeypatch.setattr(hardware, "cuda_index", lambda device: 0)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    on_gpu = [x.to("meta") for x in (q, k, v)]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: 0)
    assert routing.use_gluon_forward(*on_gpu, 0.1, False, cfg)
    assert not routing.use_gluon_forward(*on_gpu, 0.0, False, cfg)  # row max over unscaled scores
    assert not routing.use_gluon_forward(*on_gpu, -0.1, False, cfg)
    # With a logit cap the row max is over the capped (scaled) scores: any scale.
    for scale in (0.1, 0.0, -0.1):
        assert routing.use_gluon_forward(*on_gpu, scale, False, cfg, 30.0)
    assert not routing.use_gluon_forward(*on_gpu, 0.1, False, replace(cfg, fwd_gluon=False))
    monkeypatch.setattr(hardware, "interpreting", lambda: True)
    assert not routing.use_gluon_forward(*on_gpu, 0.1, False, cfg)


def test_without_the_gluon_api_the_triton_kernels_run_with_one_warning(monkeypatch):
    """An older Triton (no Gluon Hopper API): the modules fail to import; the launchers must
    then take the Triton kernels, not fail."""
    monkeypatch.setitem(
        sys.modules, "flashmask.kernels.gluon_kernels.forward", None
    )  # import fails
    routing.gluon_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Gluon kernels are unavailable"):
            assert not routing.gluon_available()
        q, k, v = _qkv()
        cfg = replace(kernels.tile_config(128, has_mask=False), fwd_gluon=True)
        monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
        assert routing.gluon_forward_eligible(q, k, v, HOPPER)
        assert not routing.use_gluon_forward(q, k, v, 0.1, False, cfg)
    finally:
        routing.gluon_available.cache_clear()


def test_with_a_mask_only_from_8k_keys(monkeypatch):
    """At 4K its 128x128 tiles lost to the Triton forward's 64x64 ones on four sparse masks of
    ten; from 8K keys (one program per SM taking the tiles) it won on seven to nine of ten and
    took 11-13% less time over the ten. Without a mask it is used at every length."""
    assert routing.GLUON_FWD_MIN_MASKED_SEQLEN == 8192
    cfg = replace(kernels.tile_config(128), fwd_gluon=True)
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    short = _qkv(seqlen_q=8192, seqlen_k=4096)
    long = _qkv(seqlen_q=256, seqlen_k=routing.GLUON_FWD_MIN_MASKED_SEQLEN)
    assert routing.use_gluon_forward(*short, 0.1, False, cfg)  # no mask: any length
    assert not routing.use_gluon_forward(*short, 0.1, True, cfg)
    assert routing.use_gluon_forward(*long, 0.1, True, cfg)
    # With the thresholds lifted (the GPU tests' Gluon cases on short masks):
    monkeypatch.setattr(routing, "GLUON_FWD_MIN_MASKED_SEQLEN", 0)
    assert routing.use_gluon_forward(*short, 0.1, True, cfg)


def test_capped_calls_route_as_uncapped_ones(monkeypatch):
    """A logit cap (``softcap > 0``) changes no routing: on a (faked) Hopper GPU with the
    ``cute`` extra, the CuTe forward takes the calls it takes uncapped (it has the cap too);
    shorter ones run the Gluon forward capped (the length limit with a mask, the config's flag,
    else the Triton forward)."""
    cfg = replace(kernels.tile_config(128), fwd_gluon=True)
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    monkeypatch.setattr(routing, "cute_available", lambda: True)
    long = _qkv(seqlen_q=256, seqlen_k=routing.CUTE_FWD_MIN_SEQLEN)
    for masked, causal in ((False, False), (False, True), (True, True), (True, False)):
        assert routing.forward_kernel(*long, 0.1, masked, causal, cfg) == (True, False)
        assert routing.forward_kernel(*long, 0.1, masked, causal, cfg, 30.0) == (True, False)
    short = _qkv(seqlen_q=256, seqlen_k=4096)
    assert routing.forward_kernel(*short, 0.1, False, True, cfg, 30.0) == (False, True)
    # With a mask below the Gluon forward's length limit, or with its flag off: Triton.
    assert routing.forward_kernel(*short, 0.1, True, True, cfg, 30.0) == (False, False)
    off = replace(cfg, fwd_gluon=False)
    assert routing.forward_kernel(*short, 0.1, False, True, off, 30.0) == (False, False)
    # The lists the forward prepares follow: the Gluon forward's 128 x 128 tiles.
    tile = routing.GLUON_FWD_TILE
    shapes = routing.forward_list_shapes(*short, None, True, 0.1, cfg, 30.0)
    assert shapes == [(tile, tile, True)]


def test_key_tiles_and_slots_per_head_dim():
    """128-key tiles in three K/V slots up to D = 128, 64-key tiles in two at D = 256."""
    assert [routing.gluon_forward_tiles(d) for d in (64, 128, 256)] == [
        (128, 3), (128, 3), (64, 2)
    ]  # fmt: skip


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_default_tiles_use_it_at_head_dim_128_and_without_a_mask_at_64(monkeypatch, head_dim):
    """Measured faster on the H200 at hd128 (with a mask from 8K keys, the launcher's rule)
    and at hd64 on full and causal attention; at hd64 it lost on masks, at hd256 everywhere."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    assert kernels.tile_config(head_dim, has_mask=True).fwd_gluon == (head_dim == 128)
    assert kernels.tile_config(head_dim, has_mask=False).fwd_gluon == (head_dim in (64, 128))
    assert not kernels.compact_tile_config(head_dim).fwd_gluon
    monkeypatch.setattr(hardware, "interpreting", lambda: True)
    assert not kernels.tile_config(head_dim, has_mask=False).fwd_gluon


@pytest.fixture(scope="module")
def sm90_reports() -> list[dict]:
    return compile_reports("gluon_fwd")


def test_compiles_warp_specialised_for_sm90(sm90_reports):
    """Every shipped variant: head dims 64 and 128 (128-key tiles, three K/V slots; also in
    fp16) and 256 (64-key tiles, two slots), full, causal and masked, skipping and dense mode.
    The producer gives registers back, the two compute warpgroups take 240 each; Q, K and V in
    through TMA; O out through two TMA stores (one per warpgroup) except in full attention;
    spills small; shared memory within the H200's 227 KB per block."""
    variants = {
        (r["head_dim"], r["causal"], r["has_mask"], r["dense"], r["dtype"], r["softcap"])
        for r in sm90_reports
    }
    assert len(variants) == len(sm90_reports) == 32  # 26 uncapped, 6 capped
    assert {v[0] for v in variants} == set(routing.GLUON_FWD_HEAD_DIMS)
    assert {v[4] for v in variants} == {"bfloat16", "float16"}
    for report in sm90_reports:
        assert (report["block_n"], report["num_buffers"]) == routing.gluon_forward_tiles(
            report["head_dim"]
        ), report
        assert any(s.endswith(" 240;") for s in report["setmaxnreg"]), report
        assert report["warps"] == 12, report  # 4 + 4 compute warps, the producer's warpgroup
        assert report["HGMMA"] > 0 and report["UTMALDG"] > 0 and report["HMMA"] == 0, report
        full = not report["causal"] and not report["has_mask"]
        assert report["o_tma"] == (not full), report
        assert report["UTMASTG"] == (0 if full else 2), report
        # One atomic per program's next query tile (taken from the launch's counter).
        assert report["ATOMG"] == 1, report
        # 32 bytes in the dense mode's masked variant under Triton 3.6 (the H200's; the
        # bit-exactness check's mode), none in the others; hd256's 64-key tiles spill more.
        assert report["spill_bytes"] <= (256 if report["head_dim"] == 256 else 32), report
        assert report["shared_kb"] <= 227, report  # the H200's shared memory per block
        if report["has_mask"]:  # partial tiles read the column bounds
            assert report["LDG"] > 16, report


def _variant(report: dict) -> tuple:
    """A forward report's variant, but for the logit cap."""
    return tuple(report[k] for k in ("head_dim", "causal", "has_mask", "dense", "dtype"))


def test_capped_variants_compile_like_the_uncapped_ones(sm90_reports):
    """With a logit cap (head dim 128 causal and masked, 256 masked; both modes): the same
    products, an exponential more per score (the cap's tanh, ``1 - 2 / (e^(2x) + 1)``, beside
    ``exp2(s - m)``) with its reciprocal (``rcp.approx``; no ``tanh.approx``, whose 2^-11 error
    would show in lse), the same registers and no more spills than the uncapped variant (none
    at 128)."""
    uncapped = {_variant(r): r for r in sm90_reports if not r["softcap"]}
    capped = [r for r in sm90_reports if r["softcap"]]
    assert {(r["head_dim"], r["causal"], r["has_mask"]) for r in capped} == {
        (128, True, False), (128, False, True), (256, False, True)
    }  # fmt: skip
    assert {r["dense"] for r in capped} == {False, True}
    for report in capped:
        plain = uncapped[_variant(report)]
        assert report["HGMMA"] == plain["HGMMA"], (report, plain)
        added = report["MUFU.EX2"] - plain["MUFU.EX2"]
        assert added >= 64 * report["block_n"] // 128, (report, plain)  # a thread's scores
        assert report["MUFU.RCP"] - plain["MUFU.RCP"] == added, (report, plain)
        assert report["MUFU.TANH"] == 0, report
        assert report["registers"] == plain["registers"], (report, plain)
        assert report["spill_bytes"] <= plain["spill_bytes"], (report, plain)


def test_o_leaves_through_tma_stores_but_in_full_attention(sm90_reports):
    """With O through TMA stores only the lse rows leave as ``STG``: far fewer than the stores
    of O from registers that full attention keeps (compiled for the same head dim, mode and
    dtype)."""
    by_variant = {_variant(r): r for r in sm90_reports if not r["softcap"]}
    pairs = 0
    for (d, _, _, dense, dtype), report in by_variant.items():
        full = by_variant.get((d, False, False, dense, dtype))
        if report["o_tma"] and full is not None:
            assert report["STG"] * 8 < full["STG"], (report, full)
            pairs += 1
    assert pairs == 18  # three TMA forms x two modes x three head dims


# Runs in a process of its own (the Gluon forward imports Gluon): the grid the launcher asks
# for, the launch itself recorded instead of run.
_GRID_CHECK = """
import json, torch
from flashmask.kernels import tiles
from flashmask.kernels.gluon_kernels import forward as gluon_fwd
launches = []
def record(kernel, grid, *args, **kwargs):
    # ..., num_items, next-item counter (the lists' counts stand in where none is read)
    counter = "counts" if args[-1] is lists.counts else args[-1].tolist()
    launches.append([grid, args[-2], counter, args[4] is not None])
gluon_fwd.launch_kernel = record
gluon_fwd.sm_count = lambda device: 132
for seqlen, causal in ((1024, False), (8192, True)):
    q = torch.zeros(2, seqlen, 3, 128, dtype=torch.bfloat16)  # tiles x 3 heads x 2 items
    tm = seqlen // 128
    counts = torch.zeros(2, 1, tm, dtype=torch.int32)
    lists = tiles.TileLists(torch.zeros(2, 1, tm, tm, dtype=torch.int32), counts, counts)
    gluon_fwd.forward(q, q, q, None, lists, 1, causal, 0.1, True, 128, 3)
print(json.dumps({"launches": launches}))
"""


def test_launcher_runs_one_program_per_sm_over_the_query_tiles():
    """As many programs as SMs (fewer where there are fewer query tiles), told the number of
    work items (tiles x heads x batch) and, where there are more items than programs, handed a
    zeroed counter from which they take the items past their first (else no counter: no
    zeroing launch); O through TMA (a descriptor) with causal attention, not in full."""
    (seen,) = json_lines(["-c", _GRID_CHECK])
    assert seen["launches"] == [[[48], 48, "counts", False], [[132], 384, [0], True]]


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
def test_launcher_hands_the_kernel_ready_inputs_and_its_tile_lists(monkeypatch):
    """What ``kernels.forward`` passes the Gluon forward (a stand-in records it; the kernel
    itself needs a GPU): contiguous aligned q/k/v equal to the caller's, the bounds and
    row-major lists at its 128x128 tiles, the mask head count, causal, scale, mode and logit
    cap."""
    seen = {}

    def fake_forward(
        q, k, v, bounds, lists, hm, causal, scale, skip_tiles, block_n, slots, order=None,
        softcap=0.0,
    ):  # fmt: skip
        seen.update(q=q, k=k, bounds=bounds, lists=lists, hm=hm, causal=causal, scale=scale)
        seen.update(tiles=(block_n, slots), order=order, softcap=softcap)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    fake = types.SimpleNamespace(forward=fake_forward)
    monkeypatch.setitem(sys.modules, "flashmask.kernels.gluon_kernels.forward", fake)
    monkeypatch.setattr(routing, "use_gluon_forward", lambda *args: True)
    cfg = replace(kernels.tile_config(128, has_mask=False), fwd_gluon=True)
    q = torch.randn(1, 4, 256, 128, dtype=torch.float16).transpose(1, 2)  # [B, S, H, D] view
    k = torch.randn(1, 384, 2, 128, dtype=torch.float16)
    kernels.forward(q, k, k, None, True, 0.125, config=cfg)
    assert seen["q"].is_contiguous() and torch.equal(seen["q"], q)
    assert seen["bounds"] is None and seen["hm"] == 1
    assert seen["lists"].entries.shape[-2:] == (2, 3)  # 256 / 128 query tiles, 384 / 128 keys
    assert (seen["causal"], seen["scale"]) == (True, 0.125)
    assert seen["tiles"] == routing.gluon_forward_tiles(128) == (128, 3)
    assert seen["order"] is None  # no mask: the grid's own order
    assert seen["softcap"] == 0.0
    kernels.forward(q, k, k, None, True, 0.125, config=cfg, softcap=30.0)
    assert seen["softcap"] == 30.0
    mask = masks.causal_document([128, 256])  # [1, 1, 384, 1]
    q = torch.randn(1, 384, 4, 128, dtype=torch.float16)
    kernels.forward(q, k, k, mask.startend_row_indices, True, 0.125, config=cfg)
    assert seen["bounds"].shape == (1, 1, 4, 384) and seen["hm"] == 1
    assert seen["lists"].entries.shape[-2:] == (3, 3)
    # With a mask the programs run longest lists first (3 query tiles, 4 heads, 1 batch).
    want = tiles.program_order(seen["lists"].counts, 4, True)
    assert torch.equal(seen["order"], want) and sorted(want.tolist()) == list(range(12))


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
def test_launchers_tell_the_routing_whether_a_mask_is_given(monkeypatch):
    """The length limit applies to masked calls only, so ``kernels.forward`` and
    ``kernels.backward`` must pass the routing functions whether there is a mask, and the logit
    cap (which keeps a call from the CuTe forward); the list shapes a benchmark prepares
    (``forward_list_shapes``/``backward_list_shapes``) follow the same routing."""
    seen = []

    def record_forward(q, k, v, scale, masked, config, softcap=0.0):
        seen.append(("fwd", masked, softcap))
        return False

    def record_backward(q, k, v, dout, deterministic, skip_tiles, masked, config, softcap=0.0):
        seen.append(("bwd", masked, softcap))
        return False

    monkeypatch.setattr(routing, "use_gluon_forward", record_forward)
    monkeypatch.setattr(routing, "use_gluon_backward", record_backward)
    q = torch.randn(1, 32, 2, 16)
    mask = masks.causal_document([16, 16])
    for sri in (None, mask.startend_row_indices):
        for cap in (0.0, 5.0):
            seen.clear()
            out, lse = kernels.forward(q, q, q, sri, True, 0.25, softcap=cap)
            kernels.backward(
                torch.ones_like(out), None, q, q, q, out, lse, sri, True, 0.25, False, softcap=cap
            )
            assert seen == [("fwd", sri is not None, cap), ("bwd", sri is not None, cap)]


def test_list_shapes_follow_the_routing(monkeypatch):
    cfg = kernels.TileConfig(64, 32, 4, 2, 32, 64, 4, 2, 64, 16, 4, 2)
    q = torch.zeros(1, 256, 2, 128)
    monkeypatch.setattr(routing, "use_gluon_forward", lambda *args: True)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    tile = routing.GLUON_FWD_TILE
    assert routing.forward_list_shapes(q, q, q, None, False, 0.1, cfg) == [(tile, tile, True)]
    gluon_bwd_lists = [(routing.GLUON_BWD_QUERIES, routing.GLUON_BWD_KEYS, False)]
    assert routing.backward_list_shapes(q, q, q, q, None, False, cfg) == gluon_bwd_lists
    monkeypatch.setattr(routing, "use_gluon_forward", lambda *args: False)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: False)
    assert routing.forward_list_shapes(q, q, q, None, False, 0.1, cfg) == [(64, 32, True)]
    # The Triton backward: the dK/dV pass's lists and the dQ pass's, deterministic or not.
    both = [(32, 64, False), (64, 16, True)]
    assert routing.backward_list_shapes(q, q, q, q, None, True, cfg) == both
    assert routing.backward_list_shapes(q, q, q, q, None, False, cfg) == both
    # The logit cap reaches the routing: here the Gluon kernels take capped calls only.
    monkeypatch.setattr(routing, "use_gluon_forward", lambda *args: args[-1] == 30.0)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: args[-1] == 30.0)
    capped = routing.forward_list_shapes(q, q, q, None, False, 0.1, cfg, 30.0)
    assert capped == [(tile, tile, True)]
    assert routing.backward_list_shapes(q, q, q, q, None, False, cfg, 30.0) == gluon_bwd_lists
    assert routing.backward_list_shapes(q, q, q, q, None, False, cfg) == both


def test_tiles_per_head_dim_fit_the_h200_shared_memory():
    """Q tile plus the K/V slots, in bf16: at most the 227 KB an H200 block may use."""
    for head_dim in routing.GLUON_FWD_HEAD_DIMS:
        key_tile, slots = routing.gluon_forward_tiles(head_dim)
        assert routing.GLUON_FWD_TILE % key_tile == 0  # key tiles divide the lengths it takes
        q_bytes = routing.GLUON_FWD_TILE * head_dim * 2
        kv_bytes = slots * 2 * key_tile * head_dim * 2
        assert q_bytes + kv_bytes <= 227 * 1024, head_dim
