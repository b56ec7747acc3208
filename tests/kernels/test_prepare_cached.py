"""``kernels.prepare_cached``: a mask tensor is prepared once and reused by every later call.

A model's layers and their backward passes all receive the same ``startend_row_indices``
object, so the launchers prepare it (bounds, summaries, tile lists) on first use only. These
tests pin down when the cache may answer (same live tensor, unchanged, same lengths, batch,
device, stream and mode), that what it answers equals a fresh preparation, and that it lets go
of freed masks and never holds more than a few.
"""

from __future__ import annotations

import gc
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (tests/conftest.py does too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from flashmask import kernels
from flashmask.kernels import TileConfig, forward_launcher, preparation, routing
from tests.kernels.test_tiles import _assert_lists_equal, _count_launches

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# dK/dV tiles 32x16: the same 16-wide key tiles (one summary), a list of their own.
TILES = TileConfig(16, 16, 4, 1, 32, 16, 4, 1, 16, 16, 4, 1)
SQ = SK = 40


@pytest.fixture(autouse=True)
def empty_cache():
    kernels.clear_prepared()
    yield
    kernels.clear_prepared()


def _mask(seed: int = 0, heads: int = 1) -> torch.Tensor:
    """Causal document mask (C=1): every column hides the rows from its document's end on."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, SK, (3,), generator=gen).tolist())
    ends = torch.tensor([next((c for c in cuts if c > j), SK) for j in range(SK)])
    return ends.view(1, 1, SK, 1).expand(2, heads, SK, 1).contiguous().to(torch.int32).to(DEVICE)


def _layer(sri: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """One attention layer's forward + backward through the launchers."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (
        torch.randn(2, SQ, 2, 16, generator=gen).to(DEVICE, torch.float16) for _ in "qkvd"
    )
    out, lse = kernels.forward(q, k, v, sri, True, 0.25, config=TILES)
    grads = kernels.backward(do, None, q, k, v, out, lse, sri, True, 0.25, True, config=TILES)
    return out, lse, *grads


def test_layers_sharing_a_mask_prepare_it_once(monkeypatch):
    """First layer: forward = summary + its list, backward = the dK/dV list only (the dQ list
    has the forward's shape and the summary exists). Every further layer: no launch at all,
    and the same bits as a layer prepared from scratch."""
    sri = _mask()
    counts = _count_launches(monkeypatch)
    first = _layer(sri)
    assert counts == {"summarize_kernel": 1, "tile_list_kernel": 2}
    for _ in range(3):
        again = _layer(sri)
    assert counts == {"summarize_kernel": 1, "tile_list_kernel": 2}
    preparation._PREPARED.clear()
    fresh = _layer(sri)
    for a, b in zip(first + again, fresh + fresh, strict=True):
        assert torch.equal(a, b)


def test_cached_lists_equal_a_fresh_preparation():
    sri = _mask(seed=3, heads=2)
    shapes = [(16, 16, True), (16, 32, False), (32, 16, True)]
    args = (True, SQ, SK, 2, DEVICE)
    kernels.prepare_cached(sri, *args, shapes[:1])  # a partial entry, completed below
    bounds, cached = kernels.prepare_cached(sri, *args, shapes)
    expected_bounds, expected = kernels.prepare(sri, *args, shapes)
    assert torch.equal(bounds, expected_bounds)
    for shape, a, b in zip(shapes, cached, expected, strict=True):
        _assert_lists_equal(a, b.__class__(*(t.cpu() for t in b)), str(shape))


def test_an_in_place_edit_invalidates(monkeypatch):
    """``_version`` is part of the key: editing the mask in place prepares it again, and the
    result follows the new mask."""
    sri = _mask(seed=0)
    kernels.prepare_cached(sri, True, SQ, SK, 2, DEVICE, [(16, 16, True)])
    sri.copy_(_mask(seed=5))
    counts = _count_launches(monkeypatch)
    _, (lists,) = kernels.prepare_cached(sri, True, SQ, SK, 2, DEVICE, [(16, 16, True)])
    assert counts == {"summarize_kernel": 1, "tile_list_kernel": 1}
    _, (expected,) = kernels.prepare(sri.clone(), True, SQ, SK, 2, DEVICE, [(16, 16, True)])
    _assert_lists_equal(lists, expected.__class__(*(t.cpu() for t in expected)), "edited mask")


@pytest.mark.parametrize(
    "change",
    [
        {"causal": False},
        {"seqlen_q": SQ - 1},
        {"skip_tiles": False},
    ],
    ids=["causal", "seqlen", "dense-mode"],
)
def test_other_call_parameters_do_not_reuse(change, monkeypatch):
    sri = _mask()
    call = dict(causal=True, seqlen_q=SQ, seqlen_k=SK, batch=2, device=DEVICE, skip_tiles=True)
    kernels.prepare_cached(sri, shapes=[(16, 16, True)], **call)
    counts = _count_launches(monkeypatch)
    kernels.prepare_cached(sri, shapes=[(16, 16, True)], **(call | change))
    assert counts["tile_list_kernel"] == 1


def test_the_custom_ops_prepare_every_call_and_keep_nothing(monkeypatch):
    """Through the custom ops (what compiled code calls, possibly in a CUDA graph pool: kept
    preparations would be live allocations the graph does not own) every call prepares its
    mask afresh, with the same bits as the cached eager path."""
    from flashmask import ops

    monkeypatch.setattr(ops, "_use_kernel", lambda q, k, v: True)
    sri = _mask()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, SQ, 2, 16, generator=gen).to(DEVICE, torch.float16) for _ in "qkv")
    counts = _count_launches(monkeypatch)
    eager = ops._forward(q, k, v, sri, True, 0.25, True)
    assert len(preparation._PREPARED) == 1
    kernels.clear_prepared()
    for calls in (1, 2):
        op = ops.attention_forward(q, k, v, sri, True, 0.25, True)
        assert len(preparation._PREPARED) == 0
        assert counts["summarize_kernel"] == 1 + calls
    for a, b in zip(eager, op, strict=True):
        assert torch.equal(a, b)
    with preparation.uncached():
        assert not preparation.may_cache(DEVICE)
    assert preparation.may_cache(DEVICE)


def test_freed_masks_are_forgotten_and_few_are_kept():
    """A mask tensor's entry goes when the tensor does, and at most ``PREPARED_CAPACITY``
    masks are held (a dataset of masks kept on the device must not pin all their lists)."""
    sri = _mask()
    kernels.prepare_cached(sri, True, SQ, SK, 2, DEVICE, [(16, 16, True)])
    assert len(preparation._PREPARED) == 1
    del sri
    gc.collect()
    assert len(preparation._PREPARED) == 0
    held = [_mask(seed=i) for i in range(preparation.PREPARED_CAPACITY + 3)]
    for sri in held:
        kernels.prepare_cached(sri, True, SQ, SK, 2, DEVICE, [(16, 16, True)])
    assert len(preparation._PREPARED) == preparation.PREPARED_CAPACITY
    assert list(preparation._PREPARED.tensor_ids()) == [
        id(t) for t in held[-preparation.PREPARED_CAPACITY :]
    ]


def test_lists_without_a_mask_are_built_once_per_call_parameters(monkeypatch):
    """Without a mask the lists depend on the call's parameters only: a second call with the
    same ones launches nothing and answers the same lists; other lengths build their own; the
    masked cache stays empty."""
    counts = _count_launches(monkeypatch)
    call = dict(causal=True, seqlen_k=SK, batch=2, device=DEVICE, shapes=[(16, 16, True)])
    bounds, (first,) = kernels.prepare_cached(None, seqlen_q=SQ, **call)
    _, (again,) = kernels.prepare_cached(None, seqlen_q=SQ, **call)
    assert bounds is None and again is first
    assert counts == {"summarize_kernel": 0, "tile_list_kernel": 1}
    _, (shorter,) = kernels.prepare_cached(None, seqlen_q=SQ - 16, **call)
    assert counts["tile_list_kernel"] == 2 and shorter.entries.shape != first.entries.shape
    fresh = kernels.prepare(None, True, SQ, SK, 2, DEVICE, [(16, 16, True)])[1][0]
    _assert_lists_equal(first, type(fresh)(*(x.cpu() for x in fresh)), "the cached lists")


def test_lists_without_a_mask_keep_the_last_few_parameter_sets_and_clear(monkeypatch):
    counts = _count_launches(monkeypatch)
    call = dict(causal=False, seqlen_k=SK, batch=1, device=DEVICE, shapes=[(16, 16, False)])
    lengths = [16 * (i + 1) for i in range(preparation.UNMASKED_CAPACITY + 1)]
    for seqlen_q in lengths:
        kernels.prepare_cached(None, seqlen_q=seqlen_q, **call)
    assert counts["tile_list_kernel"] == len(lengths)
    kernels.prepare_cached(None, seqlen_q=lengths[-1], **call)  # kept: no launch
    assert counts["tile_list_kernel"] == len(lengths)
    kernels.prepare_cached(None, seqlen_q=lengths[0], **call)  # the oldest went: rebuilt
    assert counts["tile_list_kernel"] == len(lengths) + 1
    kernels.clear_prepared()
    kernels.prepare_cached(None, seqlen_q=lengths[-1], **call)
    assert counts["tile_list_kernel"] == len(lengths) + 2


def test_one_mask_used_with_two_call_parameter_sets_keeps_an_entry_for_each(monkeypatch):
    """Entries are per (mask tensor, call parameters): alternating between two (here the
    dense and the skipping mode) re-prepares neither."""
    sri = _mask()
    call = dict(causal=True, seqlen_q=SQ, seqlen_k=SK, batch=2, device=DEVICE)
    for skip_tiles in (True, False):
        kernels.prepare_cached(sri, shapes=[(16, 16, True)], skip_tiles=skip_tiles, **call)
    assert len(preparation._PREPARED) == 2
    counts = _count_launches(monkeypatch)
    for skip_tiles in (True, False, True):
        kernels.prepare_cached(sri, shapes=[(16, 16, True)], skip_tiles=skip_tiles, **call)
    assert counts == {"summarize_kernel": 0, "tile_list_kernel": 0}


@pytest.mark.parametrize("seqlen_k", [SK, 64], ids=["ragged", "even"])
def test_two_key_tile_widths_are_summarised_in_one_launch(seqlen_k, monkeypatch):
    """A new mask needing the 16- and 32-key summaries (the forward's and the backward's
    widths) gets both from one launch, equal to two one-width launches; with a ragged last tile
    the 16-key tiles past the last key are not written."""
    sri = _mask()[..., :seqlen_k, :].contiguous() if seqlen_k <= SK else None
    if sri is None:
        gen = torch.Generator().manual_seed(5)
        sri = torch.randint(0, SQ + 1, (2, 1, seqlen_k, 1), generator=gen, dtype=torch.int32)
        sri = sri.to(DEVICE)
    bounds = torch.empty(2, 1, 4, seqlen_k, dtype=torch.int32, device=DEVICE)
    counts = _count_launches(monkeypatch)
    together: dict[int, torch.Tensor] = {}
    preparation._summarize(sri, True, SQ, seqlen_k, bounds, together, [16, 32])
    assert counts["summarize_kernel"] == 1
    alone: dict[int, torch.Tensor] = {}
    bounds_alone = torch.empty_like(bounds)
    for width in (16, 32):
        preparation._summarize(sri, True, SQ, seqlen_k, bounds_alone, alone, [width])
    assert torch.equal(bounds, bounds_alone)
    for width in (16, 32):
        assert together[width].shape == alone[width].shape
        assert torch.equal(together[width], alone[width]), width


def test_a_forward_that_a_backward_follows_prepares_the_backwards_lists_too(monkeypatch):
    """Inputs that require grad: the forward prepares its list and the backward's in one list
    launch (after one summary launch for both widths); the backward then launches none, and
    every result equals that of a layer whose passes prepared their own lists."""
    sri = _mask()
    wider = TileConfig(16, 16, 4, 1, 16, 32, 4, 1, 16, 16, 4, 1)  # dK/dV over 32-key tiles
    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (
        torch.randn(2, SQ, 2, 16, generator=gen).to(DEVICE, torch.float16) for _ in "qkvd"
    )
    counts = _count_launches(monkeypatch)
    qg = q.clone().requires_grad_()
    out, lse = kernels.forward(qg, k, v, sri, True, 0.25, config=wider)
    assert counts == {"summarize_kernel": 1, "tile_list_kernel": 1}
    grads = kernels.backward(do, None, q, k, v, out, lse, sri, True, 0.25, True, config=wider)
    assert counts == {"summarize_kernel": 1, "tile_list_kernel": 1}
    kernels.clear_prepared()
    plain_out, plain_lse = kernels.forward(q, k, v, sri, True, 0.25, config=wider)
    plain = kernels.backward(do, None, q, k, v, plain_out, plain_lse, sri, True, 0.25, True,
                             config=wider)  # fmt: skip
    assert counts == {"summarize_kernel": 3, "tile_list_kernel": 3}
    for a, b in zip((out, lse, *grads), (plain_out, plain_lse, *plain), strict=True):
        assert torch.equal(a, b)


def test_a_lists_launch_order_is_computed_once_and_cleared_with_the_preparations():
    """``preparation.program_order`` answers the same tensor for the same lists and grid (every
    layer's forward shares a mask's lists), another for another grid or another lists, none
    with ``PROGRAM_ORDER`` off; ``clear_prepared`` forgets them."""
    call = dict(causal=True, seqlen_k=SK, batch=2, device=DEVICE, shapes=[(16, 16, True)])
    _, (lists,) = kernels.prepare_cached(None, seqlen_q=SQ, **call)
    first = preparation.program_order(lists, 4, True)
    assert preparation.program_order(lists, 4, True) is first
    assert torch.equal(first.cpu(), kernels.tiles.program_order(lists.counts, 4, True).cpu())
    assert preparation.program_order(lists, 2, True) is not first
    _, (shorter,) = kernels.prepare_cached(None, seqlen_q=SQ - 16, **call)
    assert preparation.program_order(shorter, 4, True).numel() != first.numel()
    kernels.clear_prepared()
    assert preparation.program_order(lists, 4, True) is not first


def _count_order_launches(monkeypatch) -> list[dict]:
    """The constexprs of every ``program_order_kernel`` launch."""
    from flashmask.kernels import mask_prep

    launches: list[dict] = []
    real = mask_prep.program_order_kernel.run

    def run(*args, **kwargs):
        launches.append({k: v for k, v in kwargs.items() if k.isupper()})
        return real(*args, **kwargs)

    monkeypatch.setattr(mask_prep.program_order_kernel, "run", run)
    return launches


def test_two_orders_take_one_launch_and_only_the_missing_ones_are_computed(monkeypatch):
    call = dict(causal=True, seqlen_k=SK, batch=2, device=DEVICE)
    _, (rows, cols) = kernels.prepare_cached(
        None, seqlen_q=SQ, shapes=[(16, 16, True), (16, 16, False)], **call
    )
    launches = _count_order_launches(monkeypatch)
    fwd, bwd = preparation.program_orders([(rows, 4, True), (cols, 2, False)])
    assert len(launches) == 1 and launches[0]["HAS_B"]
    assert preparation.program_order(cols, 2, False) is bwd and len(launches) == 1
    again, other = preparation.program_orders([(rows, 4, True), (cols, 4, False)])
    assert again is fwd and len(launches) == 2 and not launches[1]["HAS_B"]
    assert torch.equal(other.cpu(), kernels.tiles.program_order(cols.counts, 4, False).cpu())


def test_a_forward_before_the_gluon_backward_computes_both_launch_orders(monkeypatch):
    """Inputs that require grad and a backward routed to the Gluon kernel: the forward
    computes its order and the backward's in one launch, which the backward then finds."""
    sri = _mask()
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: True)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, SQ, 4, 16, generator=gen).to(DEVICE, torch.float16) for _ in "qkv")
    k, v = k[:, :SK, :2].contiguous(), v[:, :SK, :2].contiguous()
    launches = _count_order_launches(monkeypatch)
    kernels.forward(q.requires_grad_(), k, v, sri, True, 0.25)
    assert len(launches) == 1 and launches[0]["HAS_B"]
    config = kernels.tile_config(16, has_mask=True)
    shape = routing.backward_shapes(True, 16, config)[0]
    _, (cols,) = kernels.prepare_cached(sri, True, SQ, SK, 2, DEVICE, [shape])
    bwd = preparation.program_order(cols, 2, False)
    assert len(launches) == 1  # found, not computed again
    assert torch.equal(bwd.cpu(), kernels.tiles.program_order(cols.counts.cpu(), 2, False))


@pytest.mark.parametrize("gluon_backward", [False, True], ids=["triton-bwd", "gluon-bwd"])
def test_the_forward_plan_names_what_the_forward_prepares(gluon_backward, monkeypatch):
    """``forward_launcher.plan_forward`` (what ``flashmask bench`` times as a new mask's
    preparation, through ``forward_launcher.prepare_plan``) is exactly what a forward with inputs
    requiring grad prepares: after that forward, preparing it launches nothing, and its
    orders are the forward's and, before the Gluon backward only, the backward's."""
    sri = _mask(seed=8)
    monkeypatch.setattr(routing, "use_gluon_backward", lambda *args: gluon_backward)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, SQ, 4, 16, generator=gen).to(DEVICE, torch.float16) for _ in "qkv")
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    q.requires_grad_()
    config = kernels.tile_config(16, has_mask=True)
    plan = forward_launcher.plan_forward(q, k, v, sri, True, 0.25, False, config)
    shapes, orders = plan.shapes, plan.orders
    kernels.forward(q, k, v, sri, True, 0.25, config=config)
    launches = _count_launches(monkeypatch)
    order_launches = _count_order_launches(monkeypatch)
    forward_launcher.prepare_plan(plan, sri, True, SQ, SK, 2, DEVICE)
    assert launches == {"summarize_kernel": 0, "tile_list_kernel": 0} and not order_launches
    assert orders[0] == (shapes[0], (4, True))
    assert len(orders) == 1 + gluon_backward


@pytest.mark.parametrize(
    "shape",
    [pytest.param((1, 1, SK, 1), id="batch-1 mask for batch 2"),
     pytest.param((2, 1, SK - 1, 1), id="one key short"),
     pytest.param((2, 1, SK, 3), id="three columns"),
     pytest.param((2, SK, 1), id="no heads dimension")],
)  # fmt: skip
def test_a_mask_the_kernels_would_read_past_is_refused(shape):
    """The kernels index the mask per batch entry and key without bounds checks: a mask of any
    other shape than ``[B, Hm, Sk, 1 | 2 | 4]`` raises ``ValueError`` naming the argument before
    anything is launched, cached or not, forward or split-KV decode."""
    q = torch.randn(2, SQ, 2, 16, device=DEVICE)
    k = v = torch.randn(2, SK, 2, 16, device=DEVICE)
    sri = torch.full(shape, SQ, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"startend_row_indices must be \[batch=2"):
        kernels.forward(q, k, v, sri, True, 0.25, config=TILES)
    with pytest.raises(ValueError, match="startend_row_indices"):
        kernels.forward(q[:, :1], k, v, sri, True, 0.25)  # one query: the split-KV path
    with pytest.raises(ValueError, match="startend_row_indices"):
        preparation.prepare(sri, True, SQ, SK, 2, DEVICE, [(16, 16, True)])
