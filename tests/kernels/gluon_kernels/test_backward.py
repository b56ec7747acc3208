"""The Gluon backward (``flashmask.kernels.gluon_kernels.backward``, ``backward_hd256`` at head
dim 256): where the launcher uses it, what it hands the kernel, and that it compiles for Hopper
into a warp-specialised kernel.

Its dQ goes through fp32 reduce-adds, so it serves ``deterministic=False`` only; the bit-exact
guarantees (skip == dense, repeat == repeat) stay with the Triton kernels. Gluon has no CPU
interpreter: the GPU tests (``tests/gpu``, their non-deterministic cases) prove its
results; here the routing rules (a logit cap included, which it takes and the CuTe backward
does not) and an sm_90 compile of every shipped variant (``benchmarks/sass_report.py --family
gluon_bwd``).
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
from flashmask.kernels import hardware, routing, tiles
from tests.kernels.sm90_compile import compile_reports, json_lines
from tests.kernels.test_tile_configs import INTERPRETER_WARNING

HOPPER = (9, 0)


def _inputs(seqlen_q=256, seqlen_k=384, head_dim=128, dtype=torch.bfloat16):
    q = torch.zeros(2, seqlen_q, 4, head_dim, dtype=dtype)
    k = torch.zeros(2, seqlen_k, 2, head_dim, dtype=dtype)
    return q, k, torch.zeros_like(k), torch.zeros_like(q)


def test_eligible_inputs_are_the_forward_s_with_a_dout_like_q_or_mla_s():
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
    # Multi-head latent attention: Q/K 192 with V (and dout) 128, through the hd256 layout.
    q, k, v, dout = _inputs(head_dim=192)
    v, dout = v[..., :128], dout[..., :128]
    assert routing.gluon_backward_eligible(q, k, v, dout, HOPPER)
    assert not routing.gluon_backward_eligible(q, k, v, dout[..., :64], HOPPER)
    q, k, v, dout = _inputs(head_dim=256)  # no other pair: 256 with V's 128
    assert not routing.gluon_backward_eligible(q, k, v[..., :128], dout[..., :128], HOPPER)


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
    assert routing.use_gluon_backward(*on_gpu, False, True, False, cfg, 30.0)  # a logit cap
    assert not routing.use_gluon_backward(*on_gpu, True, True, False, cfg)  # atomics
    assert not routing.use_gluon_backward(*on_gpu, True, True, False, cfg, 30.0)
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
    it won on eleven and lost 1% on sliding_window (``docs/performance.md``). Any number of
    mask heads (checked on the H200 with random_eviction's mask per head group)."""
    assert routing.GLUON_BWD_MIN_MASKED_SEQLEN[head_dim] == min_keys
    cfg = replace(kernels.tile_config(head_dim), bwd_gluon=True)
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)
    short = _inputs(seqlen_q=256, seqlen_k=min_keys - 128, head_dim=head_dim)
    long = _inputs(seqlen_q=256, seqlen_k=min_keys, head_dim=head_dim)
    assert routing.use_gluon_backward(*short, False, True, False, cfg)  # no mask: any length
    assert not routing.use_gluon_backward(*short, False, True, True, cfg)
    assert routing.use_gluon_backward(*long, False, True, True, cfg)
    # A logit cap changes none of it.
    assert routing.use_gluon_backward(*short, False, True, False, cfg, 30.0)
    assert not routing.use_gluon_backward(*short, False, True, True, cfg, 30.0)
    assert routing.use_gluon_backward(*long, False, True, True, cfg, 30.0)
    shapes = routing.backward_list_shapes(*long, torch.zeros(1), False, cfg, 30.0)
    assert shapes == [(routing.GLUON_BWD_QUERIES, routing.gluon_backward_keys(head_dim), False)]
    # With the thresholds lifted (the GPU tests' Gluon cases on short masks):
    monkeypatch.setattr(routing, "GLUON_BWD_MIN_MASKED_SEQLEN", {})
    assert routing.use_gluon_backward(*short, False, True, True, cfg)


def test_at_mla_head_dims_without_a_mask_at_any_length_with_one_from_32k_keys(monkeypatch):
    """Q/K 192 with V 128 (``backward_hd256``, Q and K padded to 256) measured on the H100
    against the Triton backward: 1.15-1.44x without a mask at 8K and 32K; with one 1.02-1.42x on
    nine of ten masks at 32K but 0.73-0.97x on five of ten at 8K (``docs/performance.md``)."""
    assert routing.GLUON_BWD_MIN_MASKED_SEQLEN[192] == 32768
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    cfg = kernels.tile_config(192)  # the default tiles: the Gluon backward on
    monkeypatch.setattr(hardware, "gpu_capability", lambda q: HOPPER)
    monkeypatch.setattr(routing, "gluon_available", lambda: True)

    def mla(seqlen):
        q, k, v, dout = _inputs(seqlen_q=256, seqlen_k=seqlen, head_dim=192)
        return q, k, v[..., :128], dout[..., :128]

    assert routing.use_gluon_backward(*mla(8192), False, True, False, cfg)  # no mask
    assert not routing.use_gluon_backward(*mla(32768 - 128), False, True, True, cfg)
    assert routing.use_gluon_backward(*mla(32768), False, True, True, cfg)
    shapes = routing.backward_list_shapes(*mla(32768), torch.zeros(1), False, cfg)
    assert shapes == [(64, 64, False)]
    # Capped MLA calls keep the Triton backward (a capped case with sinks failed on the GPU).
    assert not routing.use_gluon_backward(*mla(8192), False, True, False, cfg, 30.0)


def test_at_head_dim_256_with_a_mask_at_any_length(monkeypatch):
    """Its 64-key tiles skip as finely as the Triton backward's, and it measured 1.43-1.69x
    that backward on every mask at 8K (``docs/performance.md``)."""
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
    launcher's rule) and hd256, and at MLA's 192 (V's 128; ``gluon_backward_eligible`` holds
    the pair)."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    gluon_dims = {*routing.GLUON_BWD_HEAD_DIMS, *routing.GLUON_BWD_VALUE_HEAD_DIMS}
    for has_mask in (True, False):
        use = kernels.tile_config(head_dim, has_mask=has_mask).bwd_gluon
        assert use == (head_dim in gluon_dims)
    assert not kernels.compact_tile_config(head_dim).bwd_gluon
    monkeypatch.setattr(hardware, "interpreting", lambda: True)
    assert not kernels.tile_config(head_dim).bwd_gluon


@pytest.mark.filterwarnings(INTERPRETER_WARNING)  # the tile-list kernels run interpreted
@pytest.mark.parametrize(
    ("head_dim", "module", "key_tiles"), [(128, "backward", 3), (256, "backward_hd256", 6)]
)
def test_launcher_hands_the_kernel_ready_inputs_delta_and_column_lists(
    monkeypatch, head_dim, module, key_tiles
):
    """What ``kernels.backward`` passes the Gluon backward (a stand-in records it; the kernel
    needs a GPU): contiguous q/k/v/dout equal to the caller's, the forward's lse as float32,
    ``delta = rowsum(dO * O) - dlse`` and the column-major lists at its tiles (64x128; 64x64
    through ``backward_hd256`` at D = 256), and a float32 dQ accumulator like q that the delta
    kernel has zeroed where the backward is one launch (the stand-in says it is), and the
    forward's logit cap."""
    seen = {}

    def fake_backward(
        dout, q, k, v, lse, delta, bounds, lists, hm, causal, scale, order=None,
        dq_accumulator=None, softcap=0.0,
    ):  # fmt: skip
        seen.update(dout=dout, q=q, lse=lse, delta=delta, lists=lists, hm=hm, causal=causal)
        seen.update(order=order, dq_accumulator=dq_accumulator, softcap=softcap)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fake = types.SimpleNamespace(backward=fake_backward, one_launch=lambda *args: True)
    monkeypatch.setitem(sys.modules, f"flashmask.kernels.gluon_kernels.{module}", fake)
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
    assert seen["softcap"] == 0.0
    # With a mask, longest lists first over the grid (key tiles, 2 kv heads, 1 batch); capped.
    sri = masks.causal_document([64, 128, 192], seqlen=384).startend_row_indices
    kernels.backward(
        dout, dlse, q, k, k, out, lse, sri, True, 0.125, False, config=cfg, softcap=30.0
    )
    assert torch.equal(seen["order"], tiles.program_order(seen["lists"].counts, 2, False))
    assert seen["softcap"] == 30.0


@pytest.fixture(scope="module")
def sm90_reports() -> list[dict]:
    return compile_reports("gluon_bwd")


def _one_launch(reports: list[dict]) -> list[dict]:
    """The reports of launches over all query rows (not a query chunk's)."""
    return [r for r in reports if not r["chunk"]]


def test_compiles_warp_specialised_for_sm90(sm90_reports):
    """Every shipped variant: head dims 64, 128 (also in fp16), 256 and multi-head latent
    attention's 192 with V's 128 (Q/K padded to 256), full, causal and masked (causal or not).
    Producer and dQ writers in one warpgroup beside the two consumer warpgroups, the
    consumers raised to 240 registers; operands in through TMA, dQ out through
    TMA reduce-adds; the five products per tile as ``wgmma`` kept asynchronous (far fewer waits
    than products: ptxas waits on every one where it cannot keep an accumulator's registers from
    issue to wait); spills small, shared memory within Hopper's 227 KB."""
    reports = _one_launch(sm90_reports)
    variants = {
        (r["head_dim"], r["causal"], r["has_mask"], r["dtype"], r["softcap"]) for r in reports
    }
    assert len(variants) == len(reports) == 21  # 17 uncapped, 4 capped
    mla = set(routing.GLUON_BWD_VALUE_HEAD_DIMS)
    assert {v[0] for v in variants} == set(routing.GLUON_BWD_HEAD_DIMS) | mla
    assert {v[3] for v in variants} == {"bfloat16", "float16"}
    for report in reports:
        wide = report["head_dim"] == 256 or report["head_dim"] in mla
        kernel = "gluon_bwd256_kernel" if wide else "gluon_bwd_kernel"
        assert report["kernel"] == kernel, report
        assert report["warps"] == 12, report
        assert any("inc.sync.aligned.u32 240" in s for s in report["setmaxnreg"]), report
        assert report["UTMALDG"] > 0 and report["UTMAREDG"] > 0, report
        assert report["REDG"] == 0 and report["ATOMG"] == 0 and report["HMMA"] == 0, report
        # Five matmuls; at D = 256 per warpgroup S^T and dP^T over the head dim (16 k-steps
        # each) and dV, dK, dQ (4 each).
        # (At 192 / 128: 12 and 8 k-steps, then 4 each.)
        want = {256: 44, 192: 32}.get(report["head_dim"], 5 * 4)
        assert report["HGMMA"] >= want, report
        assert report["WARPGROUP.DEPBAR"] * 4 < report["HGMMA"], report
        # Version-dependent but small: at most 80 bytes under Triton 3.6 (the H200's; none
        # without a mask), up to 152 under 3.9. A register blow-up would spill kilobytes.
        assert report["spill_bytes"] <= 256, report
        assert report["shared_kb"] <= 227, report  # Hopper's limit per block


def test_capped_variants_compile_like_the_uncapped_ones(sm90_reports):
    """With a logit cap (head dim 128 causal, masked and in query chunks, 256 masked): the same
    products and stores, an exponential more per score (the cap's tanh, ``1 - 2 / (e^(2x) +
    1)``, beside ``P``'s) with its reciprocal (``rcp.approx``; no ``tanh.approx``, whose 2^-11
    error would show in the gradients' lse), the same registers, and spills that stay small
    (8-16 bytes more than uncapped under Triton 3.9)."""

    def variant(report: dict) -> tuple:
        keys = ("head_dim", "causal", "has_mask", "dtype", "chunk", "add_dkdv")
        return tuple(report[k] for k in keys)

    uncapped = {variant(r): r for r in sm90_reports if not r["softcap"]}
    capped = [r for r in sm90_reports if r["softcap"]]
    assert {(r["head_dim"], r["causal"], r["has_mask"], r["chunk"]) for r in capped} == {
        (128, True, False, False), (128, False, True, False), (256, False, True, False),
        (192, False, True, False), (128, False, False, True),
    }  # fmt: skip
    for report in capped:
        plain = uncapped[variant(report)]
        for key in ("HGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "registers", "shared_kb"):
            assert report[key] == plain[key], (key, report, plain)
        added = report["MUFU.EX2"] - plain["MUFU.EX2"]
        # A thread's scores: 32 of a 128 x 64 tile (D = 128), 16 of 64 x 64 (D = 256, 192).
        assert added >= (32 if report["head_dim"] == 128 else 16), (report, plain)
        assert report["MUFU.RCP"] - plain["MUFU.RCP"] == added, (report, plain)
        assert report["MUFU.TANH"] == 0, report
        assert report["spill_bytes"] <= plain["spill_bytes"] + 64, (report, plain)


def test_dk_dv_leave_through_tma_stores_where_they_ship(sm90_reports):
    """dK and dV staged in the K/V tiles' buffers and stored with one TMA store each (no
    ``STG`` left) except where stores from registers measured faster: plain causal attention
    at D = 64/128, and every unmasked form at D = 256 (there the TMA form ships with a mask
    only). With V's own head dim (192 / 128) always through TMA: the stores from registers
    share dK's offsets."""
    for report in _one_launch(sm90_reports):
        masked, causal = report["has_mask"], report["causal"]
        tma = masked or (not causal and report["head_dim"] != 256)
        tma = tma or report["head_dim_v"] != report["head_dim"]
        assert report["dkdv_tma"] == tma, report
        if tma:
            assert report["STG"] == 0 and report["UTMASTG"] >= 2, report
        else:
            assert report["STG"] > 0 and report["UTMASTG"] == 0, report


def test_query_chunks_keep_fp32_dk_dv_stores_from_registers(sm90_reports):
    """Long full attention runs in chunks of query rows (``kernels.query_chunks``, head dims 64
    and 128): the first chunk's launch stores fp32 dK/dV sums, every later one loads and adds to
    them before its store (more global loads, no more than 64 bytes more spills), both from
    registers (the K/V buffers hold 16-bit tiles), with the same products as one launch over
    all rows. Also with a logit cap at D = 128."""
    chunked = [r for r in sm90_reports if r["chunk"]]
    assert {(r["head_dim"], r["add_dkdv"], bool(r["softcap"])) for r in chunked} == {
        (d, add, False) for d in (64, 128) for add in (False, True)
    } | {(128, add, True) for add in (False, True)}
    for report in chunked:
        assert report["dkdv_fp32"] and not report["dkdv_tma"], report
        assert report["UTMASTG"] == 0 and report["STG"] > 0, report
        whole = next(
            r for r in sm90_reports
            if not r["chunk"] and r["head_dim"] == report["head_dim"] and not r["causal"]
            and not r["has_mask"] and not r["softcap"]
        )  # fmt: skip
        assert report["HGMMA"] == whole["HGMMA"], (report, whole)
        assert report["shared_kb"] == whole["shared_kb"], (report, whole)
    for d, capped in ((64, False), (128, False), (128, True)):
        storing, adding = (
            next(
                r for r in chunked
                if r["head_dim"] == d and r["add_dkdv"] == add and bool(r["softcap"]) == capped
            )
            for add in (False, True)
        )  # fmt: skip
        assert adding["LDG"] > storing["LDG"], (adding, storing)
        assert adding["spill_bytes"] <= storing["spill_bytes"] + 64, (adding, storing)


# Runs in a process of its own (the Gluon modules import Gluon): backward_launch.launch over
# query chunks with its per-launch step replaced by a stand-in that adds 1 (and 2) into the sums
# it is given, or stores them in fp32.
_CHUNK_LAUNCHES = """
import json, torch
from flashmask.kernels import query_chunks, tiles
from flashmask.kernels.gluon_kernels import backward, backward_launch
query_chunks.QUERY_SPLIT_FROM_BYTES = 0
query_chunks.QUERY_CHUNK_BYTES = 128 * 8 * 128  # 128 rows per chunk at D = 128
launches = []
first = []
def fake_launch_once(kernel, block_n, nb, dqb, dout, q, k, v, lse, delta, bounds, lists, hm,
                     causal, scale, *, dkdv_tma, fp32_sums=False, dk_sums=None, dv_sums=None,
                     **rest):
    launches.append({"rows": q.shape[1], "fp32": fp32_sums, "tma": dkdv_tma,
                     "into_first": dk_sums is not None and dk_sums is first[0],
                     "lists": list(lists.entries.shape), "causal": causal,
                     "masked": bounds is not None})
    if dk_sums is not None:
        dk_sums += 1.0
        dv_sums += 2.0
        return torch.zeros_like(q), dk_sums, dv_sums
    dk = torch.ones_like(k, dtype=torch.float32)
    first.append(dk)
    return torch.zeros_like(q), dk, torch.full_like(v, 2.0, dtype=torch.float32)
backward_launch._launch_once = fake_launch_once
q = torch.zeros(1, 320, 2, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
lse = torch.zeros(1, 2, 320)
lists = tiles.TileLists(torch.zeros(1, 1, 2, 5, dtype=torch.int32),
                        torch.zeros(1, 1, 2, dtype=torch.int32), None)
dq, dk, dv = backward.backward(q, q, k, k, lse, lse, None, lists, 1, False, 0.125)
try:
    backward.backward(q, q, k, k, lse, lse, None, lists, 1, False, 0.125,
                      dq_accumulator=torch.zeros(q.shape))
    refused = ""
except ValueError as error:
    refused = str(error)
one_launch = [backward.one_launch(q, k, masked, causal)
              for masked, causal in [(False, False), (True, False), (False, True)]]
print(json.dumps({"launches": launches, "dk": sorted(set(dk.float().flatten().tolist())),
                  "dv": sorted(set(dv.float().flatten().tolist())), "dtype": str(dk.dtype),
                  "refused": refused, "one_launch": one_launch}))
"""


def test_query_chunks_after_the_first_add_into_its_fp32_sums():
    """The launcher runs the first chunk of query rows with fp32 dK/dV outputs and every later
    one adding into those same tensors (the kernel's ``ADD_DKDV``), each with full attention's
    lists for its rows and dK/dV stored from registers, then casts once (the chunks: 128, 128,
    64 rows)."""
    (result,) = json_lines(["-c", _CHUNK_LAUNCHES])
    launches = result["launches"]
    assert [launch["rows"] for launch in launches] == [128, 128, 64]
    assert all(launch["fp32"] and not launch["tma"] for launch in launches)
    assert [launch["into_first"] for launch in launches] == [False, True, True]
    assert [launch["lists"] for launch in launches] == [[1, 1, 2, 2], [1, 1, 2, 2], [1, 1, 2, 1]]
    assert not any(launch["causal"] or launch["masked"] for launch in launches)
    assert result["dk"] == [3.0] and result["dv"] == [6.0]  # each chunk added once
    assert result["dtype"] == "torch.bfloat16"
    # Only full attention splits: one dQ accumulator for all rows would not fit the chunks.
    assert result["one_launch"] == [False, True, True]
    assert "dq_accumulator" in result["refused"]
