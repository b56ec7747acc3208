"""The CuTe backward compiles for sm_90a on a machine without a GPU, in every variant the
launcher can ask for (each mask form, the dense mode and the launch order); its results are
proved on a GPU by ``tests/gpu/test_cute_backward.py``."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

# backward_launch (imported first) sets CUTE_DSL_ARCH before cutlass is imported.
from flashmask.kernels.cute_kernels import backward_launch

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the flashmask[cute] extra (nvidia-cutlass-dsl)", allow_module_level=True)

from flashmask.kernels.cute_kernels import backward
from flashmask.kernels.cute_kernels.backward import BackwardVariant
from tests.kernels.cute_kernels.ptx import compiled_ptx, spill_bytes

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


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_deterministic_variants_compile(head_dim: int):
    for causal, has_mask, has_upper in FORMS:
        variant = BackwardVariant(head_dim, causal, has_mask, has_upper, False, True, True)
        assert backward_launch.compiled_backward(variant, torch.bfloat16) is not None


def _lists(name: str, seqlen: int, skip_tiles: bool = True):
    """The CuTe backward's lists (column-major, 64 x 128 tiles) of example mask ``name``."""
    from flashmask import masks
    from flashmask.kernels import preparation

    mask = masks.example(name, seqlen)
    shapes = ((64, 128, False),)
    sri = mask.startend_row_indices
    _, lists = preparation.prepare_cached(
        sri, mask.causal, seqlen, seqlen, sri.shape[0], sri.device, shapes, skip_tiles
    )
    return lists[0]


def _tiles_of(lists, b: int, h: int, n: int) -> list[int]:
    """Key tile ``n``'s listed query tiles, in list order."""
    entries = lists.entries[b, h, n, : lists.counts[b, h, n]].tolist()
    return [e if e >= 0 else -e - 1 for e in entries]


@pytest.mark.parametrize("skip_tiles", [True, False], ids=["skip", "dense"])
@pytest.mark.parametrize("name", ["causal_document", "share_question", "random_eviction"])
def test_the_deterministic_walk_lists_the_same_tiles_in_ascending_order(name, skip_tiles):
    lists = _lists(name, 1024, skip_tiles)
    walk = backward_launch.deterministic_lists(lists)
    assert torch.equal(walk.counts, lists.counts)
    batch, heads, key_tiles, _ = lists.entries.shape
    for b, h, n in itertools.product(range(batch), range(heads), range(key_tiles)):
        listed = lists.entries[b, h, n, : lists.counts[b, h, n]]
        walked = walk.entries[b, h, n, : lists.counts[b, h, n]]
        assert sorted(walked.tolist()) == sorted(listed.tolist())  # same entries, same classes
        assert _tiles_of(walk, b, h, n) == sorted(_tiles_of(lists, b, h, n))


@pytest.mark.parametrize("skip_tiles", [True, False], ids=["skip", "dense"])
@pytest.mark.parametrize("name", ["causal_document", "share_question", "random_eviction"])
def test_each_dq_add_waits_for_the_higher_key_tiles_listing_its_query_tile(name, skip_tiles):
    """A deterministic backward adds key tile n's dQ into query tile m after the adds of every
    higher key tile whose list holds m: its ticket counts exactly those."""
    lists = backward_launch.deterministic_lists(_lists(name, 1024, skip_tiles))
    tickets = backward_launch.dq_tickets(lists)
    assert tickets.shape == lists.entries.shape and tickets.dtype == torch.int32
    batch, heads, key_tiles, _ = lists.entries.shape
    for b, h in itertools.product(range(batch), range(heads)):
        listed = [set(_tiles_of(lists, b, h, n)) for n in range(key_tiles)]
        for n in range(key_tiles):
            for j, m in enumerate(_tiles_of(lists, b, h, n)):
                higher = sum(m in listed[above] for above in range(n + 1, key_tiles))
                assert tickets[b, h, n, j] == higher


def test_the_deterministic_plan_is_computed_by_mask_heads_and_kept_with_its_lists(monkeypatch):
    """In steps of a few mask heads (here one per step: a per-head mask over a batch of 2) it
    gives what the two functions give on the whole lists, and a second call (another layer)
    gets the same tensors back."""
    from flashmask import masks
    from flashmask.kernels import preparation

    mask = masks.random_eviction(512, 100, num_heads=3, batch_size=2)
    sri = mask.startend_row_indices
    _, (lists,) = preparation.prepare_cached(
        sri, mask.causal, 512, 512, 2, sri.device, [(64, 128, False)]
    )
    monkeypatch.setattr(backward_launch, "PLAN_CHUNK_ENTRIES", 1)
    walk, tickets = backward_launch.deterministic_plan(lists)
    expected = backward_launch.deterministic_lists(lists)
    assert torch.equal(walk.entries, expected.entries)
    assert torch.equal(tickets, backward_launch.dq_tickets(expected))
    again = backward_launch.deterministic_plan(lists)
    assert again[0].entries is walk.entries and again[1] is tickets


def test_the_deterministic_launch_runs_each_heads_key_tiles_from_the_last_down():
    order = backward_launch.descending_key_tiles(2, 3, 4, torch.device("cpu"))
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(24))
    # Program i of the launch runs natural item order[i] = n + 4 (h + 3 b).
    launched = [(item % 4, item // 4 % 3, item // 12) for item in order.tolist()]
    assert launched[:5] == [(3, 0, 0), (2, 0, 0), (1, 0, 0), (0, 0, 0), (3, 1, 0)]
    for (n, h, b), (n2, h2, b2) in itertools.pairwise(launched):
        assert (b, h) < (b2, h2) or ((b, h) == (b2, h2) and n2 == n - 1)


def test_other_head_dims_are_refused_with_the_argument_named():
    q = torch.zeros(1, 128, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: the CuTe backward takes head dims"):
        backward_launch.backward(q, q, q, q, None, None, None, None, 1, False, 1.0)


_BACKWARD = """
import torch
from flashmask.kernels.cute_kernels import backward_launch
from flashmask.kernels.cute_kernels.backward import BackwardVariant
variant = BackwardVariant(128, {causal}, False, False, False, False)
backward_launch.compiled_backward(variant, torch.bfloat16)
"""


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_unmasked_variants_spill_nothing(tmp_path, causal: bool):
    """With dQ's stores through the swizzled pointer (each address computed apart) the full
    variant spilled 56 bytes inside its tile loop (these tools); one base each, it spills
    none."""
    ptx = compiled_ptx(tmp_path / "dump", _BACKWARD.format(causal=causal))
    assert spill_bytes(tmp_path, ptx) == 0


def _dq_buffer_offset(stage: int, row: int, column: int) -> int:
    """Byte offset of fp32 dQ element (row, column) of buffer ``stage`` (before the swizzle):
    64 x 64 per buffer in two 128-byte-wide atoms of 32 columns, rows 128 bytes apart."""
    return stage * 64 * 64 * 4 + (column // 32) * 64 * 128 + row * 128 + (column % 32) * 4


def _swizzle_128b(address: int) -> int:
    """The 128-byte swizzle of shared-memory byte ``address``: bits 4-6 XOR bits 7-9."""
    return address ^ ((address >> 3) & 0x70)


def test_each_threads_dq_stores_are_a_swizzled_base_per_column_group_plus_constants():
    """What ``backward.swizzled_at_first`` relies on, for every thread and buffer: thread t of
    a warpgroup holds rows 16 (t // 32) + (t % 32) // 4 + 8 h and columns 8 j + 2 (t % 4) + e
    of the 64 x 64 fp32 dQ product (PTX's wgmma accumulator fragment), and in each group j
    the swizzled address of each element is that of the group's first plus the unswizzled
    distance. The buffers start at a 1024-byte boundary, so address and offset bits agree."""
    assert backward.BLOCK_M == 64 and backward.DQ_BUFFERS == 2
    for stage, t, j in itertools.product(range(2 * backward.DQ_BUFFERS), range(128), range(8)):
        row0 = 16 * (t // 32) + (t % 32) // 4
        col0 = 8 * j + 2 * (t % 4)
        first = _dq_buffer_offset(stage, row0, col0)
        for h, e in itertools.product(range(2), range(2)):
            offset = _dq_buffer_offset(stage, row0 + 8 * h, col0 + e)
            assert _swizzle_128b(offset) == _swizzle_128b(first) + offset - first


def test_a_warps_dq_stores_meet_no_bank_conflict():
    """Each of a warp's 8-byte dQ stores (one row half h, one column group j) takes two
    wavefronts, the least for 256 bytes: its 32 lanes' pairs cover every bank twice."""
    for warp, h, j in itertools.product(range(4), range(2), range(8)):
        banks = [
            _swizzle_128b(
                _dq_buffer_offset(0, 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4))
            )
            // 4
            % 32
            for lane in range(32)
        ]
        words = sorted(bank + half for bank in banks for half in (0, 1))
        assert words == sorted(list(range(32)) * 2)
