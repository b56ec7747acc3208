"""The split-KV kernels (``triton_kernels.decode``): few queries over many keys.

Calls with more keys than queries and at most ``DecodeConfig.max_rows`` packed rows (queries x
query heads per key/value head) run them (``routing.use_decode``). They must give the training
forward's values (the float64 reference within the suite's tolerance rule, exact zeros and
``-inf`` for rows that see nothing), whatever the number of splits, for every mask form, GQA
group (powers of two or not), ragged cache lengths expressed through the mask, and a
non-positive scale; and they must never read a key tile the mask's lists skip. On a machine
without CUDA they run through Triton's interpreter with 16-key tiles.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from flashmask import kernels, masks  # noqa: E402
from flashmask.kernels import decode_launcher, hardware, routing  # noqa: E402
from flashmask.kernels.config import DecodeConfig, decode_config, device_decode_config  # noqa: E402
from flashmask.reference import reference_forward  # noqa: E402
from tests.kernels.triton_kernels.test_kernels import (  # noqa: E402
    DEVICE,
    INTERPRETER_WARNING,
    Case,
    check_against_reference,
    make_inputs,
    run_kernels,
)

pytestmark = [
    pytest.mark.gpu if CUDA else pytest.mark.interpreter,
    pytest.mark.filterwarnings(INTERPRETER_WARNING),
]


@pytest.fixture
def counted_launches(monkeypatch) -> list:
    """Record every split-KV forward (to prove a call was routed there)."""
    calls: list = []
    real = decode_launcher.forward

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_launcher, "forward", counting)
    return calls


# Decoding (Sq = 1), speculative / multi-token steps (Sq = 3, 5) and a short prefill chunk
# (Sq = 16) against caches that are and are not multiples of the 16-key test tiles; GQA groups
# 1 (MHA), 2, 3 (not a power of two), 4 and 8 (MQA), with shared and per-KV-head masks.
DECODE_CASES = [
    Case("nomask-causal", 1, 100, 8, 2, 1, 64),
    Case("nomask-full", 1, 37, 4, 4, 1, 40),
    Case("causal-C1", 1, 80, 8, 1, 1, 64, batch=2),
    Case("causal-C2", 3, 70, 6, 2, 2, 32, batch=2),
    Case("noncausal-C2", 5, 64, 4, 2, 1, 16),
    Case("noncausal-C4", 3, 53, 4, 2, 2, 64, batch=2),
    Case("nomask-causal", 16, 96, 4, 2, 1, 32),
    Case("causal-C1", 16, 47, 2, 2, 2, 16),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_split_kv_forward_matches_reference(case, counted_launches):
    """out and lse (and, through the training backward on them, every gradient) agree with the
    float64 reference; rows that see nothing get 0 and ``-inf`` exactly."""
    x = make_inputs(case, torch.float16)
    actual = run_kernels(x, case.causal)
    assert counted_launches, "the call did not take the split-KV kernels"
    check_against_reference(actual, x, case.causal, case.id)


@pytest.mark.parametrize("splits", [1, 2, 7, 64], ids=lambda s: f"splits{s}")
def test_every_number_of_splits_gives_the_same_result(splits, monkeypatch):
    """One split (no merge), a few, and more splits than the listed tiles (empty splits weigh
    nothing): all within the tolerance rule of the reference."""
    case = Case("causal-C2", 3, 90, 4, 2, 2, 64, batch=2)
    x = make_inputs(case, torch.float16)
    monkeypatch.setattr(decode_launcher, "num_splits", lambda *args: splits)
    check_against_reference(run_kernels(x, case.causal), x, case.causal, f"{case.id}-{splits}")


def test_fully_masked_rows_over_several_splits_give_zero_and_neg_inf(monkeypatch):
    """A query row hidden from every key (a mask whose columns all hide row 1) merges its
    splits to output 0 and lse ``-inf``, with no NaN from 0/0."""
    monkeypatch.setattr(decode_launcher, "num_splits", lambda *args: 5)
    b, sq, sk, d = 1, 3, 70, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, 4, d, generator=gen).half().to(DEVICE) for s in (sq, sk, sk))
    sri = torch.zeros(b, 1, sk, 2, dtype=torch.int32)  # non-causal C2: hide rows [LTS, Sq)+[0, UTE)
    sri[..., 0], sri[..., 1] = sq, 2  # rows 0 and 1 hidden everywhere
    sri[..., 40:, 1] = 1  # row 1 sees keys 40+; row 0 sees nothing
    out, lse = kernels.forward(q, k, v, sri.to(DEVICE), False, d**-0.5)
    assert not out.isnan().any() and not lse.isnan().any()
    assert bool((out[:, 0] == 0).all()) and bool((lse[:, :, 0] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, :, 1:]).all())


def _poisoned_cache(k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor):
    """``k``, ``v`` with NaN in every key column that ``hidden`` (bool ``[B, Sk]``) marks."""
    nan = float("nan")
    where = hidden[:, :, None, None]
    return k.masked_fill(where, nan), v.masked_fill(where, nan)


def test_sliding_window_with_sinks_reads_only_the_sinks_and_the_window(monkeypatch):
    """Decoding under ``masks.sliding_window`` with sink tokens: NaN in every key tile between
    the sinks and the window changes nothing, so those tiles are never read, and the result
    equals attention over the sinks and the window alone."""
    monkeypatch.setattr(decode_launcher, "num_splits", lambda *args: 3)
    sk, window, sinks, d = 160, 20, 4, 32
    mask = masks.sliding_window(sk, window, sink_tokens=sinks, seqlen_q=1)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 4, d, generator=gen).half().to(DEVICE)
    k, v = (torch.randn(1, sk, 2, d, generator=gen).half().to(DEVICE) for _ in range(2))
    # Key tiles of 16: the sinks' tile [0, 16) and the window's tiles from 128 are listed.
    block = device_decode_config(d, DEVICE).block_n
    first_window_tile = (sk - 1 - window) // block * block
    gap = torch.zeros(1, sk, dtype=torch.bool, device=DEVICE)
    gap[:, block:first_window_tile] = True
    pk, pv = _poisoned_cache(k, v, gap)
    out, lse = kernels.forward(q, pk, pv, mask.startend_row_indices.to(DEVICE), True, d**-0.5)
    assert not out.isnan().any()
    keep = torch.cat([torch.arange(sinks), torch.arange(sk - 1 - window, sk)]).to(DEVICE)
    ref_out, ref_lse = reference_forward(
        q.double(), k[:, keep].double(), v[:, keep].double(), None, False, d**-0.5
    )
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_ragged_cache_lengths_through_the_mask_never_read_past_a_sequence():
    """A batch of caches of different lengths in one ``[B, Sk]`` tensor, each sequence's queries
    its last ``Sq`` positions (causal, bottom-right aligned to its own length ``n``): non-causal
    C = 2 hides rows ``[0, UTE)`` of key ``j < n`` with ``UTE = j - (n - Sq)`` and every row of
    the keys past ``n``. Each sequence's result equals causal attention over its own keys, and
    NaN in the key tiles past its length is never read."""
    lengths, sk, sq, d = [21, 64, 90], 96, 2, 32
    b = len(lengths)
    sri = torch.zeros(b, 1, sk, 2, dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(b, sq, 8, d, generator=gen).half().to(DEVICE)
    k, v = (torch.randn(b, sk, 2, d, generator=gen).half().to(DEVICE) for _ in range(2))
    block = device_decode_config(d, DEVICE).block_n
    unread = torch.zeros(b, sk, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(lengths):
        cols = torch.arange(n)
        sri[i, 0, :n, 0] = sq  # nothing hidden below
        sri[i, 0, :n, 1] = (cols - (n - sq)).clamp(0, sq).to(torch.int32)
        sri[i, 0, n:, 0] = 0  # hidden from every row
        unread[i, -(-n // block) * block :] = True
    pk, pv = _poisoned_cache(k, v, unread)
    out, lse = kernels.forward(q, pk, pv, sri.to(DEVICE), False, d**-0.5)
    assert not out.isnan().any()
    for i, n in enumerate(lengths):
        ref_out, ref_lse = reference_forward(
            q[i : i + 1].double(), k[i : i + 1, :n].double(), v[i : i + 1, :n].double(),
            None, True, d**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[i : i + 1].double(), ref_out, atol=2e-3, rtol=0)
        torch.testing.assert_close(lse[i : i + 1].double(), ref_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [0.0, -0.3], ids=["zero-scale", "negative-scale"])
def test_zero_and_negative_scale(scale):
    """A non-positive scale (scores scaled before the row max) matches the reference."""
    case = Case("noncausal-C2", 2, 60, 4, 2, 2, 32)
    x = make_inputs(case, torch.float16)
    x.scale = scale
    check_against_reference(run_kernels(x, case.causal), x, case.causal, f"{case.id}-{scale}")


def test_routing_takes_few_queries_over_more_keys():
    """Split-KV when ``Sk > Sq`` and ``Sq * group <= max_rows``; the training forward when the
    queries are as many as the keys, too many to pack, or in the dense mode."""
    decode = DecodeConfig(max_rows=128)

    def routed(sq: int, sk: int, hq: int, hk: int, skip: bool = True) -> bool:
        q = torch.empty(1, sq, hq, 64)
        k = torch.empty(1, sk, hk, 64)
        return routing.use_decode(q, k, skip, decode)

    assert routed(1, 2, 32, 8) and routed(32, 4096, 32, 8) and routed(128, 129, 1, 1)
    assert not routed(33, 4096, 32, 8)  # 132 packed rows
    assert not routed(64, 64, 1, 1) and not routed(100, 40, 1, 1)
    assert not routed(1, 4096, 32, 8, skip=False)


def test_row_tiles_pack_query_heads_into_power_of_two_tiles():
    """``row_tile``: queries per tile a power of two within ``max_rows / group`` (and not beyond
    ``Sq`` rounded up); rows a power of two, at least 16."""
    decode = DecodeConfig(max_rows=128)
    assert decode_launcher.row_tile(1, 4, decode) == (1, 16)
    assert decode_launcher.row_tile(1, 32, decode) == (1, 32)
    assert decode_launcher.row_tile(5, 3, decode) == (8, 32)
    assert decode_launcher.row_tile(100, 2, decode) == (64, 128)
    assert decode_launcher.row_tile(1, 128, decode) == (1, 128)


def test_splits_fill_one_wave_within_the_key_tiles(monkeypatch):
    """``num_splits``: as many splits as fit one wave of ``programs_per_sm`` programs per
    multiprocessor (never a partial second wave), never more than key tiles or
    ``max_splits``, at least one."""
    monkeypatch.setattr(hardware, "multiprocessor_count", lambda device: 132)
    decode = DecodeConfig(programs_per_sm=2, max_splits=128)
    cpu = torch.device("cpu")
    assert decode_launcher.num_splits(8, 2048, cpu, decode) == 33  # batch 1, 8 KV heads
    assert decode_launcher.num_splits(64, 2048, cpu, decode) == 4  # batch 8: 256 of 264
    assert decode_launcher.num_splits(256, 2048, cpu, decode) == 1  # batch 32: one wave
    assert decode_launcher.num_splits(8, 10, cpu, decode) == 10
    assert decode_launcher.num_splits(1, 4096, cpu, replace(decode, max_splits=16)) == 16
    assert decode_launcher.num_splits(10_000, 4096, cpu, decode) == 1


def test_hopper_decodes_with_128_key_tiles_one_program_per_multiprocessor(monkeypatch):
    """``decode_config``: up to head dim 128, a GPU with Hopper's shared memory gets 128-key
    tiles, 8 warps, 3 stages and one program per multiprocessor (the measured choice); smaller
    or unknown shared memory the 64-key tiles two to a multiprocessor; head dims above 128 the
    32-key tiles."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    hopper = decode_config(128, shared_memory=227 * 1024)
    assert (hopper.block_n, hopper.warps, hopper.stages, hopper.programs_per_sm) == (128, 8, 3, 1)
    assert decode_config(64, shared_memory=227 * 1024) == hopper
    for shared in (None, 99 * 1024, 163 * 1024):
        assert decode_config(128, shared_memory=shared) == DecodeConfig()
    assert decode_config(256, shared_memory=227 * 1024).block_n == 32


class StagesLimit:
    """Stands in for the split kernel on a GPU whose shared memory holds one pipeline stage:
    more raise ``OutOfResources`` as Triton does when it compiles; one runs the real kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.refused = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs["NUM_STAGES"] > 1:
                self.refused += 1
                raise OutOfResources(300 * 1024, 227 * 1024, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_split_kernel_drops_stages_until_its_shared_memory_fits(monkeypatch):
    """A split kernel too large for the GPU at ``decode.stages`` runs with fewer (three refused
    then two, one ran), gives the same values as asking for one stage, and later calls of the
    shape start from the stages that fit."""
    from flashmask.kernels.triton_kernels import decode as decode_kernels

    limit = StagesLimit(decode_kernels.decode_split_kernel)
    monkeypatch.setattr(decode_kernels, "decode_split_kernel", limit)
    monkeypatch.setattr(decode_launcher, "_FITTED_STAGES", {})
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 32, generator=gen).to(DEVICE, torch.float16)
    k, v = (torch.randn(1, 70, 2, 32, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
    decode = DecodeConfig(block_n=16, warps=4, stages=3)
    out, lse = kernels.forward(q, k, v, None, True, 0.2, decode=decode)
    assert limit.refused == 2
    assert list(decode_launcher._FITTED_STAGES.values()) == [1]
    one_stage = kernels.forward(q, k, v, None, True, 0.2, decode=replace(decode, stages=1))
    assert torch.equal(out, one_stage[0]) and torch.equal(lse, one_stage[1])
    kernels.forward(q, k, v, None, True, 0.2, decode=decode)
    assert limit.refused == 2
