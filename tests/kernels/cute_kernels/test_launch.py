"""The CuTe forward's host side: the column-major bounds its element mask reads, and which
schedule (one program per query tile, or persistent programs) a launch takes."""

from __future__ import annotations

import types

import torch

from flashmask import masks
from flashmask.kernels import tiles
from flashmask.kernels.cute_kernels import launch


def _bounds(seqlen=300, batch=2, name="share_question"):
    mask = masks.example(name, seqlen, batch_size=batch)
    return tiles.column_bounds(mask.startend_row_indices, mask.causal, seqlen, seqlen, batch, "cpu")


def test_each_column_holds_its_four_bounds_and_the_padding_hides_every_row():
    bounds = _bounds()
    out = launch.column_major_bounds(bounds, seqlen_q=300, columns=384)
    assert out.shape == (2, 1, 384, 4) and out.dtype == torch.int32 and out.is_contiguous()
    assert torch.equal(out[:, :, :300], bounds.transpose(2, 3))
    # Past Sk: rows [0, Sq) hidden by the lower interval, the upper one empty.
    pad = torch.tensor([0, 300, 0, 0], dtype=torch.int32).expand(2, 1, 84, 4)
    assert torch.equal(out[:, :, 300:], pad)


def test_a_16_byte_column_starts_every_16_bytes():
    out = launch.column_major_bounds(_bounds(), seqlen_q=300, columns=384)
    assert out.stride() == (384 * 4, 384 * 4, 4, 1)


def test_it_is_built_once_per_bounds_tensor_and_rebuilt_after_an_edit():
    bounds = _bounds()
    first = launch.column_major_bounds(bounds, 300, 384)
    assert launch.column_major_bounds(bounds, 300, 384) is first
    assert launch.column_major_bounds(bounds, 300, 448) is not first  # another tile width
    bounds[0, 0, 0, 5] = 7  # in place: the cached copy is stale
    again = launch.column_major_bounds(bounds, 300, 384)
    assert again is not first and again[0, 0, 5, 0] == 7
    assert launch.column_major_bounds(bounds.clone(), 300, 384) is not again


def _launch_args(
    monkeypatch, bounds, causal, persistent=None, seqlen=300, heads=4, batch=2, sinks=None
):
    """What ``launch.forward`` hands the compiled kernel on the CPU (a recording stand-in for
    the kernel, the torch tensors themselves for their DLPack views; 4 "SMs", as
    ``hardware.multiprocessor_count`` gives off CUDA): ``(variant, args)``."""
    seen = []

    def compiled(variant, dtype):
        return lambda *args: seen.append((variant, args))

    monkeypatch.setattr(launch, "compiled_forward", compiled)
    monkeypatch.setattr(launch, "_view", lambda x, align: x)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)
    )
    q = torch.zeros(batch, seqlen, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen, 2, 128, dtype=torch.bfloat16)
    tm = -(-seqlen // 128)
    counts = torch.ones(batch, 1, tm, dtype=torch.int32)
    lists = tiles.TileLists(torch.zeros(batch, 1, tm, tm, dtype=torch.int32), counts, counts)
    order = torch.arange(batch * heads * tm, dtype=torch.int32) if bounds is not None else None
    launch.forward(
        q, k, k, bounds, lists, 1, causal, not causal, 0.1, True, order, persistent, sinks=sinks
    )
    (call,) = seen
    return call


def test_the_persistent_variant_runs_non_causal_masks_on_min_items_sms_programs(monkeypatch):
    variant, args = _launch_args(monkeypatch, _bounds(name="document"), causal=False)
    assert variant.persistent and variant.ordered
    counter, programs = args[9], args[10]
    assert programs == 4  # min(3 query tiles x 4 heads x 2, 4 SMs)
    assert counter.dtype == torch.int32 and torch.equal(counter, torch.zeros(1, dtype=torch.int32))
    # No more items than programs: one each, no counter.
    bounds = _bounds(seqlen=100, batch=1, name="document")
    variant, args = _launch_args(monkeypatch, bounds, False, heads=2, seqlen=100, batch=1)
    assert variant.persistent and args[10] == 2 and args[9].numel() == 2  # the order, unread


def test_causal_and_unmasked_calls_run_one_item_per_program_unless_forced(monkeypatch):
    for bounds, causal in ((None, False), (None, True), (_bounds(), True)):
        variant, args = _launch_args(monkeypatch, bounds, causal)
        assert not variant.persistent and args[10] == 1
        variant, args = _launch_args(monkeypatch, bounds, causal, persistent=True)
        assert variant.persistent and args[10] == 4
    variant, _ = _launch_args(monkeypatch, _bounds(name="document"), False, persistent=False)
    assert not variant.persistent


def test_sinks_ride_after_the_stream_behind_an_unread_descale_tensor(monkeypatch):
    """A call with sinks compiles the sinks variant and passes, after the stream, a descale
    stand-in (read only in FP8) and the sinks as float32 ``[Hq]``; a call without passes
    neither."""
    sinks = torch.linspace(-1, 1, 4, dtype=torch.bfloat16)
    variant, args = _launch_args(monkeypatch, None, True, sinks=sinks)
    assert variant.sinks
    scales, passed = args[-2:]
    assert scales.shape == (1, 1, 2) and scales.dtype == torch.float32
    assert passed.dtype == torch.float32 and torch.equal(passed, sinks.float())
    variant, args = _launch_args(monkeypatch, None, True)
    assert not variant.sinks and len(args) == 16


def test_a_call_compiles_the_edge_form_only_when_asked_and_only_with_a_mask(monkeypatch):
    def variant_of(bounds, causal, **kw):
        seen = []
        monkeypatch.setattr(launch, "_launch", lambda *a, **k: None)
        monkeypatch.setattr(launch, "compiled_forward", lambda v, dt: seen.append(v))
        q = torch.zeros(1, 300, 2, 128, dtype=torch.bfloat16)
        tm = 3
        counts = torch.ones(1, 1, tm, dtype=torch.int32)
        lists = tiles.TileLists(torch.zeros(1, 1, tm, tm, dtype=torch.int32), counts, counts)
        launch.forward(q, q, q, bounds, lists, 1, causal, not causal, 0.1, True, None, **kw)
        return seen[0]

    bounds = _bounds(name="causal_document", batch=1)
    assert variant_of(bounds, True, edge_intervals=True).edge_intervals
    assert not variant_of(bounds, True).edge_intervals
    assert not variant_of(None, True, edge_intervals=True).edge_intervals
