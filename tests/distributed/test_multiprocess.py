"""Context-parallel attention on real process groups (gloo, CPU, float64 reference path).

One spawned world per world size (spawning costs seconds, so each world runs every check): for
every mask x balancer x mode x overlap, the distributed output, lse and gradients (dq, dk, dv) must
equal the single-process ``flashmask_attention`` on the full sequence; the traffic each rank
actually sent must equal what the plan's need matrix predicts; dispatch/undispatch must round-trip
exactly; fully masked rows (including whole ranks) must give exact zeros. Learnable sinks and the
logit cap get a second world per size (a test of their own, which xdist runs beside the first):
the same equality on fewer masks, in float64 and float32, with the sinks' gradient summed over
the ranks' partials.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashmask
from flashmask import FlashMask, masks
from flashmask.distributed import (
    BALANCERS,
    MODES,
    context_parallel_attention,
    dispatch,
    make_plan,
    track_communication,
    undispatch,
)
from flashmask.distributed.attention import resolve_group
from tests.distributed.workers import exit_without_teardown
from tests.tolerance import assert_close_to_reference

SEQLEN = 50  # not a multiple of chunk * world: exercises the plan's padding
CHUNK = 4
HEADS_Q, HEADS_K, HEAD_DIM, HEAD_DIM_V = 4, 2, 8, 6
TOL = 1e-10  # float64 on both sides; observed errors are ~1e-15


def _random_mask(causal: bool, bounds: int, heads: int, seed: int) -> FlashMask:
    g = torch.Generator().manual_seed(seed)
    sri = torch.randint(-2, SEQLEN + 3, (2, heads, SEQLEN, bounds), generator=g)
    return FlashMask(sri.to(torch.int32), causal)


def cases() -> dict[str, FlashMask]:
    """Masks of the checklist (testing-anchors §6.H), batch 2, built identically on every rank."""

    def example(name):
        return masks.example(name, SEQLEN, batch_size=2, generator=torch.Generator().manual_seed(1))

    return {
        "causal_document": example("causal_document"),
        "share_question": example("share_question"),
        "sliding_window": masks.sliding_window(SEQLEN, 6, batch_size=2),
        "global_sliding_window": masks.global_sliding_window(SEQLEN, 3, (5, 4), batch_size=2),
        "prefix_lm_document": example("prefix_lm_document"),
        "padding_rows": masks.causal_document([[10, 14, 9], [7, 5]], SEQLEN),
        "one_short_document": masks.causal_document([[12], [9]], SEQLEN),  # later ranks: all masked
        "random_causal_c1": _random_mask(True, 1, 1, 10),
        "random_causal_c2": _random_mask(True, 2, HEADS_K, 11),
        "random_noncausal_c2": _random_mask(False, 2, 1, 12),
        "random_noncausal_c4_a": _random_mask(False, 4, HEADS_K, 13),
        "random_noncausal_c4_b": _random_mask(False, 4, 1, 14),
    }


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, dout = randn(2, SEQLEN, HEADS_Q, HEAD_DIM), randn(2, SEQLEN, HEADS_Q, HEAD_DIM_V)
    k, v = randn(2, SEQLEN, HEADS_K, HEAD_DIM), randn(2, SEQLEN, HEADS_K, HEAD_DIM_V)
    dlse = randn(2, HEADS_Q, SEQLEN)
    return q, k, v, dout, dlse


def _loss(out, lse, dout, dlse):
    # lse is -inf on fully masked rows: they carry no lse gradient in either computation.
    return (out * dout).sum() + (lse.masked_fill(torch.isinf(lse), 0) * dlse).sum()


def _reference(mask: FlashMask, q, k, v, dout, dlse):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashmask.flashmask_attention(*leaves, mask, return_softmax_lse=True)
    _loss(out, lse, dout, dlse).backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


class Checker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.checks = 0

    def expect(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")


def _run_case(check, label, mask, plan, mode, overlap, group, inputs, ref):
    q, k, v, dout, dlse = inputs
    rank = dist.get_rank(resolve_group(group))
    where = f"{label} P={plan.world_size} {plan.balancer} {mode} overlap={overlap}"
    local = [dispatch(t, plan, 1, group=group).requires_grad_() for t in (q, k, v)]
    dout_l = dispatch(dout, plan, 1, group=group)
    dlse_l = dispatch(dlse, plan, 2, group=group)
    with track_communication() as log:
        out, lse = context_parallel_attention(
            *local, plan, mode=mode, group=group, return_softmax_lse=True, overlap=overlap
        )
        _loss(out, lse, dout_l, dlse_l).backward()

    # Equal to the single-process result, gathered back to global order.
    ref_out, ref_lse, ref_grads = ref
    full_out = undispatch(out.detach(), plan, 1, group=group)
    full_lse = undispatch(lse.detach(), plan, 2, group=group)
    check.expect(_max_err(full_out, ref_out) <= TOL, f"{where}: out {_max_err(full_out, ref_out)}")
    same_inf = torch.equal(torch.isinf(full_lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    lse_err = _max_err(full_lse[finite], ref_lse[finite]) if same_inf else math.inf
    check.expect(lse_err <= TOL, f"{where}: lse {lse_err} (same -inf rows: {same_inf})")
    for name, t, r in zip(("dq", "dk", "dv"), local, ref_grads, strict=True):
        err = _max_err(undispatch(t.grad, plan, 1, group=group), r)
        check.expect(err <= TOL, f"{where}: {name} {err}")

    # Fully masked rows (and padding) are exact zeros with lse -inf, never NaN.
    dead = torch.isinf(dispatch(ref_lse, plan, 2, group=group, pad_value=-math.inf))  # [B,H,S]
    dead_rows = dead.transpose(1, 2).unsqueeze(-1)
    check.expect(bool((out.detach().masked_select(dead_rows) == 0).all()), f"{where}: dead out")
    check.expect(bool(torch.isinf(lse.detach()[dead]).all()), f"{where}: dead lse")
    dq_dead = local[0].grad.masked_select(dead.transpose(1, 2).unsqueeze(-1))
    check.expect(bool((dq_dead == 0).all()), f"{where}: dead dq")
    check.expect(not out.isnan().any() and not local[0].grad.isnan().any(), f"{where}: NaN")

    # Traffic actually sent equals the need matrix's prediction.
    b, hk = k.shape[0], k.shape[2]
    row_bytes = b * hk * (HEAD_DIM + HEAD_DIM_V) * 8
    transfers = plan.transfers(mode)
    sent_fwd = int(transfers[rank].sum())
    sent_bwd = int(transfers[:, rank].sum())  # gradients of the chunks this rank received
    check.expect(log.forward_chunks == sent_fwd, f"{where}: fwd chunks {log.forward_chunks}")
    check.expect(log.backward_chunks == sent_bwd, f"{where}: bwd chunks {log.backward_chunks}")
    check.expect(
        log.forward_bytes == sent_fwd * plan.chunk_size * row_bytes,
        f"{where}: fwd bytes {log.forward_bytes} != {sent_fwd * plan.chunk_size * row_bytes}",
    )
    check.expect(
        log.backward_bytes == sent_bwd * plan.chunk_size * row_bytes,
        f"{where}: bwd bytes {log.backward_bytes}",
    )
    return bool(dead.all())


def _check_world(check: Checker, group, tag: str) -> None:
    world = dist.get_world_size(group)
    inputs = _inputs()
    all_masked_rank_seen = False
    for label, mask in cases().items():
        ref = _reference(mask, *inputs)
        for balancer in BALANCERS:
            plan = make_plan(mask, world, chunk_size=CHUNK, balancer=balancer)
            for mode in MODES:
                for overlap in (True, False):
                    dead = _run_case(check, f"{tag}{label}", mask, plan, mode, overlap, group,
                                     inputs, ref)  # fmt: skip
                    all_masked_rank_seen |= dead
    if world > 1:
        # "one_short_document" under the contiguous balancer leaves whole ranks fully masked.
        flags = torch.tensor([float(all_masked_rank_seen)])
        dist.all_reduce(flags, group=group)
        check.expect(flags.item() > 0, "no rank had all of its rows masked")


def _check_round_trip(check: Checker, world: int) -> None:
    plan = make_plan(cases()["causal_document"], world, chunk_size=CHUNK, balancer="heap")
    g = torch.Generator().manual_seed(5)  # the same global tensors on every rank
    x = torch.randn(2, SEQLEN, 3, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 100, (2, SEQLEN), generator=g)
    back = undispatch(dispatch(x, plan), plan)
    check.expect(torch.equal(back, x), "dispatch/undispatch of hidden states")
    local_labels = dispatch(labels, plan, pad_value=-100)
    check.expect(local_labels.shape == (2, plan.local_seqlen), "dispatched labels shape")
    check.expect(torch.equal(undispatch(local_labels, plan), labels), "labels round trip")
    rows = plan.token_indices(dist.get_rank())
    check.expect(bool((local_labels[:, rows >= SEQLEN] == -100).all()), "label padding")
    # undispatch is differentiable: the gradient of a replicated loss is this rank's slice.
    xl = dispatch(x, plan).requires_grad_()
    (undispatch(xl, plan) * 2).sum().backward()
    expected = torch.where((rows < SEQLEN).view(1, -1, 1), 2.0, 0.0).expand_as(xl)  # padding: 0
    check.expect(torch.equal(xl.grad, expected), "undispatch backward")


def _spawned(rank: int, world: int, path: str, checks: Callable[[Checker], None]) -> None:
    """One spawned rank: join the gloo group at ``path``, run ``checks``, then fail with every
    check any of them broke (after a barrier, so that no rank leaves a collective behind)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        # A fresh CPU process's first exp/logsumexp can differ in the last bits (design notes
        # §A.8); warm it up before comparing.
        torch.logsumexp(torch.randn(4, 8, dtype=torch.float64), -1)
        check = Checker(rank)
        checks(check)
        dist.barrier()
        if check.failures:
            raise AssertionError(
                f"{len(check.failures)} of {check.checks} checks failed:\n"
                + "\n".join(check.failures[:40])
            )
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_without_teardown()


def _worker(rank: int, world: int, path: str) -> None:
    def checks(check: Checker) -> None:
        _check_world(check, None, "")
        _check_round_trip(check, world)
        if world == 2:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
            plan = make_plan(cases()["share_question"], 2, chunk_size=CHUNK)
            inputs = _inputs()
            ref = _reference(plan.mask, *inputs)
            _run_case(check, "mesh:share_question", plan.mask, plan, "pruned", True, mesh["cp"],
                      inputs, ref)  # fmt: skip
        if world == 4:
            # Two context-parallel groups side by side (data parallel x context parallel).
            groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            mine = groups[rank // 2]
            inputs = _inputs(seed=rank // 2)
            mask = cases()["prefix_lm_document"]
            ref = _reference(mask, *inputs)
            for mode in MODES:
                plan = make_plan(mask, 2, chunk_size=CHUNK, balancer="document")
                _run_case(check, f"subgroup{rank // 2}", mask, plan, mode, True, mine, inputs,
                          ref)  # fmt: skip

    _spawned(rank, world, path, checks)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"world{w}")
def test_context_parallel_equals_single_process(world_size, tmp_path):
    mp.spawn(_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)


# ---------------------------------------------------------------------- sinks and softcap
CAP = 2.0  # scores here are ~N(0, 1): a cap of 2 bends a good share of them
FEATURES = {"sinks": (True, None), "softcap": (False, CAP), "sinks+softcap": (True, CAP)}
FEATURE_MASKS = ("causal_document", "sliding_window", "random_noncausal_c4_a", "one_short_document")
# One balancer per mask: every balancer's chunk layout meets sinks and the cap.
FEATURE_BALANCERS = ("document", "zigzag", "heap", "contiguous")


def _sinks() -> torch.Tensor:
    # Around e^1 per head: the sink takes a sizeable share of short rows' probability.
    g = torch.Generator().manual_seed(3)
    return torch.randn(HEADS_Q, generator=g, dtype=torch.float64) + 1.0


def _feature_results(fn, q, k, v, sinks, dout, dlse, **kwargs) -> dict[str, torch.Tensor]:
    """out, lse and the gradients of q, k, v (and sinks) of ``fn`` under ``_loss``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = fn(*leaves, sink, **kwargs)
    _loss(out, lse, dout, dlse).backward()
    result = {"out": out.detach(), "lse": lse.detach()}
    result.update(zip(("dq", "dk", "dv"), (t.grad for t in leaves), strict=True))
    if sink is not None:
        result["dsinks"] = sink.grad
    return result


def _feature_references(mask: FlashMask, sinks, softcap, dtype: torch.dtype):
    """``(hi, lo)``: the single-device ``flashmask_attention`` in float64 and in ``dtype`` (None
    for float64): what a context-parallel call in ``dtype`` must match."""
    q, k, v, dout, dlse = _inputs()

    def single_device(q, k, v, sink):
        return flashmask.flashmask_attention(
            q, k, v, mask, return_softmax_lse=True, sinks=sink, softcap=softcap
        )

    hi = _feature_results(single_device, q, k, v, sinks, dout, dlse)
    if dtype == torch.float64:
        return hi, None
    low = [t.to(dtype) for t in (q, k, v, dout, dlse)]
    lo = _feature_results(
        single_device, *low[:3], None if sinks is None else sinks.to(dtype), *low[3:]
    )
    return hi, lo


def _run_feature_case(check, where, plan, mode, overlap, sinks, softcap, dtype, hi, lo) -> None:
    q, k, v, dout, dlse = (
        dispatch(t.to(dtype), plan, d) for t, d in zip(_inputs(), (1, 1, 1, 1, 2), strict=True)
    )
    sinks = None if sinks is None else sinks.to(dtype)

    def cp(q, k, v, sink):
        return context_parallel_attention(
            q, k, v, plan, mode=mode, return_softmax_lse=True, overlap=overlap, sinks=sink,
            softcap=softcap,
        )  # fmt: skip

    local = _feature_results(cp, q, k, v, sinks, dout, dlse)
    got = {name: undispatch(t, plan, 2 if name == "lse" else 1) for name, t in local.items()
           if name != "dsinks"}  # fmt: skip
    if "dsinks" in local:
        # Each rank holds the partial sum over its rows; the group's sum is the gradient. The
        # sum runs in float64 so that only the library's rounding is measured, not this test's
        # own reduction (data-parallel code sums in its own dtype).
        dsinks = local["dsinks"].double()
        dist.all_reduce(dsinks)
        got["dsinks"] = dsinks
    check.expect(got.keys() == hi.keys(), f"{where}: results {sorted(got)} != {sorted(hi)}")
    for name, actual in got.items():
        expected = hi[name]
        plain = None if lo is None else lo[name]
        if name == "lse":
            # Rows that see no key: -inf without sinks, exactly the sink with them.
            finite = torch.isfinite(expected)
            same = torch.equal(torch.isinf(actual), ~finite)
            check.expect(same, f"{where}: lse is -inf on other rows than on one device")
            if not same:
                continue
            actual, expected = actual[finite], expected[finite]
            plain = None if plain is None else plain[finite]
        if plain is None:
            # float64 on both sides: equal up to rounding, as in _run_case.
            err = _max_err(actual, expected)
            check.expect(err <= TOL, f"{where}: {name} {err}")
            continue
        try:
            if name == "dsinks":
                # Four numbers, each a float32 sum over all rows: the two sides sum in another
                # order, so each is within an ulp or so of float64 by luck of the order, and
                # the rule's mean criterion (1.1x the single device's) has no sample to average
                # over. torch's float32 tolerance (about 10 ulps) still catches a lost row.
                torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-5)
            else:
                assert_close_to_reference(actual, expected, plain, name, context=where)
            check.expect(True, "")
        except AssertionError as e:
            check.expect(False, f"{where}: {e}")

    # Padding rows (no part of the sequence): out 0, lse the sink (or -inf), as a row that sees
    # no key on one device.
    rows = plan.token_indices(dist.get_rank()) >= SEQLEN
    out, lse = local["out"], local["lse"]
    check.expect(bool((out[:, rows] == 0).all()), f"{where}: padding out")
    pad_lse = lse[:, :, rows]
    want = -math.inf if sinks is None else sinks.to(lse.dtype).view(1, -1, 1).expand_as(pad_lse)
    check.expect(bool((pad_lse == want).all()), f"{where}: padding lse")


def _check_features(check: Checker) -> None:
    world = dist.get_world_size()
    every = cases()
    for label, balancer in zip(FEATURE_MASKS, FEATURE_BALANCERS, strict=True):
        mask = every[label]
        plan = make_plan(mask, world, chunk_size=CHUNK, balancer=balancer)
        for feature, (with_sinks, softcap) in FEATURES.items():
            # float32 for the combined feature only: the other two add nothing float64 misses.
            dtypes = (torch.float64, torch.float32) if with_sinks and softcap else (torch.float64,)
            for dtype in dtypes:
                sinks = _sinks() if with_sinks else None
                hi, lo = _feature_references(mask, sinks, softcap, dtype)
                for mode in MODES:
                    for overlap in (True, False):
                        where = f"{label} P={world} {balancer} {feature} {dtype} {mode}"
                        where += f" overlap={overlap}"
                        _run_feature_case(check, where, plan, mode, overlap, sinks, softcap,
                                          dtype, hi, lo)  # fmt: skip


def _check_derivative(check: Checker) -> None:
    """One rank: the autograd rule is the derivative of what the call returns (gradcheck), the
    padding row's lse (the sink) included; sinks that need no gradient get none."""
    g = torch.Generator().manual_seed(7)
    mask = masks.causal_document([3, 4], 7)  # chunks of 4: one padding row
    plan = make_plan(mask, 1, chunk_size=4)
    q, k, v = (torch.randn(1, 8, h, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h, d in ((2, 4), (1, 4), (1, 3)))  # fmt: skip
    sinks = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    for overlap in (True, False):

        def call(q, k, v, sinks, overlap=overlap):
            return context_parallel_attention(
                q, k, v, plan, return_softmax_lse=True, overlap=overlap, sinks=sinks, softcap=1.5
            )

        ok = torch.autograd.gradcheck(call, (q, k, v, sinks), raise_exception=False)
        check.expect(ok, f"gradcheck with sinks and softcap, overlap={overlap}")
    fixed = sinks.detach()
    context_parallel_attention(q, k, v, plan, sinks=fixed).sum().backward()
    check.expect(fixed.grad is None and q.grad is not None, "sinks without requires_grad")


def _feature_worker(rank: int, world: int, path: str) -> None:
    def checks(check: Checker) -> None:
        _check_features(check)
        if world == 1:
            _check_derivative(check)

    _spawned(rank, world, path, checks)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"world{w}")
def test_context_parallel_sinks_and_softcap_equal_single_process(world_size, tmp_path):
    """With sinks, a logit cap or both, out, lse and dq, dk, dv (and the sum over ranks of the
    local dsinks) match the single-device ``flashmask_attention`` by the tolerance rule, in
    float64 and float32, for both modes and overlap settings; padding rows give out 0 and lse
    the sink. One rank also gradchecks the call."""
    mp.spawn(_feature_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)
