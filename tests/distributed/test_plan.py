"""Plans without processes: balancers, need matrix, transfers, dispatch by rank, the lse merge."""

from __future__ import annotations

import math

import pytest
import torch

from flashmask import masks
from flashmask.distributed import (
    BALANCERS,
    ContextParallelPlan,
    balance,
    dispatch,
    make_plan,
    merge_partials,
)

balancers = pytest.mark.parametrize("balancer", BALANCERS)
MASKS = ["causal_document", "share_question", "sliding_window", "global_sliding_window",
         "prefix_lm_document", "document", "causal", "random_eviction"]  # fmt: skip


def _dense_pairs(plan: ContextParallelPlan) -> torch.Tensor:
    n, cs, s = plan.num_chunks, plan.chunk_size, plan.seqlen
    dense = torch.zeros(plan.padded_seqlen, plan.padded_seqlen, dtype=torch.int64)
    dense[:s, :s] = plan.mask.to_dense().to(torch.int64).sum((0, 1))
    return dense.view(n, cs, n, cs).sum((1, 3))


@balancers
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", MASKS)
def test_every_balancer_gives_each_rank_an_equal_ascending_share(name, world_size, balancer):
    plan = make_plan(masks.example(name, 96, batch_size=2), world_size, chunk_size=4,
                     balancer=balancer)  # fmt: skip
    chunks = [c for rank in plan.assignment for c in rank]
    assert sorted(chunks) == list(range(plan.num_chunks))
    assert all(len(r) == plan.chunks_per_rank for r in plan.assignment)
    assert all(list(r) == sorted(r) for r in plan.assignment)
    assert plan.padded_seqlen % (plan.chunk_size * world_size) == 0
    assert plan.padded_seqlen >= 96
    assert torch.equal(plan.pairs, _dense_pairs(plan))
    assert int(plan.rank_work.sum()) == int(plan.mask.to_dense().sum())
    # need[r, c] <=> some query of rank r sees some key of chunk c (dense check).
    for r, owned in enumerate(plan.assignment):
        assert torch.equal(plan.need[r], _dense_pairs(plan)[list(owned)].sum(0) > 0)
    # Pruned transfers are the need matrix off the owners; all_gather sends everything.
    t = plan.transfers("pruned")
    for src, owned in enumerate(plan.assignment):
        for dst in range(world_size):
            expected = 0 if src == dst else int(plan.need[dst, list(owned)].sum())
            assert int(t[src, dst]) == expected
    ag = plan.transfers("all_gather")
    assert int(ag.sum()) == world_size * (world_size - 1) * plan.chunks_per_rank
    assert bool((t <= ag).all())
    assert plan.bytes_moved("pruned", 10) == int(t.sum()) * plan.chunk_size * 10


def test_contiguous_and_zigzag_layouts():
    assert balance.contiguous(8, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert balance.zigzag(8, 2) == ((0, 1, 6, 7), (2, 3, 4, 5))
    assert balance.zigzag(4, 2) == ((0, 3), (1, 2))
    with pytest.raises(ValueError, match="even number of chunks"):
        balance.zigzag(6, 2)


def test_zigzag_balances_plain_causal_exactly():
    plan = make_plan(masks.causal(64), 4, chunk_size=4, balancer="zigzag")
    assert plan.imbalance == pytest.approx(1.0, abs=0.02)
    assert make_plan(masks.causal(64), 4, chunk_size=4, balancer="contiguous").imbalance > 1.5


def test_heap_is_lpt_with_equal_counts():
    work = torch.tensor([9, 1, 8, 2, 7, 3, 6, 4])
    # Largest first onto the least loaded rank with room (ties: lower rank): 9 8 7 6 4 3 2 1 go
    # to ranks 0 1 1 0 0 1 1 0 -> loads 20 and 20.
    assert balance.heap(work, 2) == ((0, 1, 6, 7), (2, 3, 4, 5))


def test_documents_are_runs_that_no_visible_pair_crosses():
    mask = masks.causal_document([8, 4, 12, 8], 32)
    plan = make_plan(mask, 1, chunk_size=4, balancer="contiguous")
    runs = balance.documents(plan.pairs > 0)
    assert [(r.start, r.stop) for r in runs] == [(0, 2), (2, 3), (3, 6), (6, 8)]


def test_document_balancer_keeps_whole_documents_when_they_balance():
    """Four equal documents on four ranks: each rank gets one document, nothing travels."""
    mask = masks.causal_document([16, 16, 16, 16], 64)
    plan = make_plan(mask, 4, chunk_size=4, balancer="document")
    assert plan.imbalance == 1.0
    assert int(plan.transfers("pruned").sum()) == 0
    assert sorted(plan.assignment) == [tuple(range(4 * r, 4 * r + 4)) for r in range(4)]


def test_document_balancer_meets_its_tolerance_and_moves_less_than_heap():
    mask = masks.example("causal_document", 8192)
    doc = make_plan(mask, 8, chunk_size=64, balancer="document", tolerance=0.05)
    heap = make_plan(mask, 8, chunk_size=64, balancer="heap")
    assert doc.imbalance <= 1.05
    assert doc.transfers("pruned").sum() < 0.5 * heap.transfers("pruned").sum()


def test_tiles_workload_balances_tiles():
    mask = masks.example("causal_document", 1024)
    plan = make_plan(mask, 4, chunk_size=32, balancer="heap", workload="tiles", tile_size=16)
    assert plan.workload == "tiles"
    assert plan.work.sum() <= (1024 // 16) ** 2
    with pytest.raises(ValueError, match="tile_size"):
        make_plan(mask, 4, chunk_size=24, workload="tiles", tile_size=16)


def test_dispatch_by_rank_is_a_permutation_of_the_padded_sequence():
    plan = make_plan(masks.example("causal_document", 30), 3, chunk_size=4, balancer="heap")
    x = torch.arange(2 * 30 * 5).view(2, 30, 5)
    parts = [dispatch(x, plan, 1, rank=r, pad_value=-1) for r in range(3)]
    assert all(p.shape == (2, plan.local_seqlen, 5) for p in parts)
    order = torch.cat([plan.token_indices(r) for r in range(3)])
    padded = torch.cat([x, torch.full((2, plan.padded_seqlen - 30, 5), -1)], 1)
    assert torch.equal(torch.cat(parts, 1), padded[:, order])
    labels = torch.arange(30).view(1, 30)
    assert dispatch(labels, plan, -1, rank=0, pad_value=-100).shape == (1, plan.local_seqlen)


def test_merge_partials_matches_joint_softmax_and_guards_fully_masked_rows():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 2, 3, 10, generator=g, dtype=torch.float64)  # [B, H, S, keys]
    scores[0, 0, 0] = -math.inf  # row seen by no key at all
    scores[0, 1, 1, :5] = -math.inf  # row seen only by the second block
    values = torch.randn(1, 10, 2, 4, generator=g, dtype=torch.float64)

    def block(lo, hi):
        s = scores[..., lo:hi]
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        out = torch.einsum("bhsk,bkhd->bshd", p, values[:, lo:hi])
        return out, lse

    out, lse = merge_partials(*block(0, 5), *block(5, 10))
    ref_out, ref_lse = block(0, 10)
    assert torch.allclose(out, ref_out, atol=1e-14) and not out.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-14)
    assert bool((out[0, 0, 0] == 0).all())
    _, first_lse = merge_partials(None, None, *block(0, 5))
    assert torch.equal(first_lse, block(0, 5)[1])


def test_make_plan_argument_errors():
    m = masks.causal(16)
    with pytest.raises(TypeError, match="mask"):
        make_plan([1, 2], 2)
    with pytest.raises(ValueError, match="world_size"):
        make_plan(m, 0)
    with pytest.raises(TypeError, match="chunk_size"):
        make_plan(m, 2, chunk_size=2.0)
    with pytest.raises(ValueError, match="balancer"):
        make_plan(m, 2, balancer="random")
    with pytest.raises(ValueError, match="workload"):
        make_plan(m, 2, workload="flops")
    with pytest.raises(ValueError, match="tolerance"):
        make_plan(m, 2, tolerance=-1)
    plan = make_plan(m, 2, chunk_size=4)
    with pytest.raises(ValueError, match="mode"):
        plan.transfers("ring")
    with pytest.raises(ValueError, match="rank"):
        plan.token_indices(2)
    with pytest.raises(ValueError, match="seq_dim"):
        dispatch(torch.zeros(1, 16), plan, 3, rank=0)
    with pytest.raises(ValueError, match=r"x.shape\[1\]"):
        dispatch(torch.zeros(1, 15), plan, 1, rank=0)
    # A raw tensor mask with its causal flag is accepted too.
    same = make_plan(m.startend_row_indices, 2, causal=True, chunk_size=4)
    assert torch.equal(same.pairs, plan.pairs)


def test_document_balancer_takes_zigzag_or_contiguous_when_they_balance_and_move_less():
    causal = make_plan(masks.causal(64), 4, chunk_size=4, balancer="document")
    assert causal.assignment == balance.zigzag(16, 4)
    window = make_plan(masks.sliding_window(64, 3), 4, chunk_size=4, balancer="document")
    assert window.assignment == balance.contiguous(16, 4)
    for plan in (causal, window):
        assert balance.pruned_chunks(plan.assignment, plan.pairs > 0) == int(
            plan.transfers("pruned").sum()
        )
