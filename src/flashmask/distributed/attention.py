"""``context_parallel_attention``: exact FlashMask attention over a sequence split across ranks.

Each rank holds the queries, keys and values of its chunks (:func:`dispatch`). Per call:

1. The rank starts the key/value exchange asynchronously (``all_gather`` or ``pruned``, see
   :mod:`flashmask.distributed.exchange`).
2. With ``overlap=True`` it computes attention of its queries against its *own* chunks while the
   exchange is in flight, then against the received chunks, and merges the two partial results
   by their log-sum-exp in float32 (float64 for float64 inputs). With ``overlap=False`` it waits
   and makes one call over its own and the received chunks in global order (no merge).
3. Masks come from :meth:`ContextParallelPlan.local_mask`: pure arithmetic on the replicated
   global mask (no mask traffic), non-causal 4-bound form, so the kernels need no causal flag.

Backward (exact, design §A.7.6): each block's backward is given the *final* output and lse, so
``P = exp(S - lse_final)`` is already the globally normalised probability and the block gradients
simply add up. The rank computes the received chunks' gradients first, starts the reverse exchange
(gradients go back to the chunk owners), and computes its own chunks' gradients while they travel.

Only remote chunks with some visible pair (the need matrix) are computed with, in both modes: the
modes differ only in what travels. Received keys/values are kept for the backward (memory
``R x F`` per layer) rather than exchanged again.

A logit cap (``softcap``) is applied inside every block, forward and backward: the merge by lse
is unchanged because each block's lse is already that of the capped scores. Learnable sinks are
folded once, after the merge (folding per block would count the sink once per block); the blocks'
backward then receives the folded output and lse, so ``P`` includes the sink's share of the
denominator, and the sinks' gradient comes from the same row term as on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from flashmask import ops, reference
from flashmask.attention import _check_sinks, _check_softcap
from flashmask.distributed.exchange import AllGatherExchange, PrunedExchange
from flashmask.distributed.localize import chunk_columns
from flashmask.distributed.plan import MODES, ContextParallelPlan

__all__ = ["context_parallel_attention", "merge_partials", "resolve_group"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_group(group: object) -> dist.ProcessGroup | None:
    """A process group from ``None`` (the default group), a ``ProcessGroup`` or a 1-D
    ``DeviceMesh``; raises if ``torch.distributed`` is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism needs torch.distributed: call "
            "torch.distributed.init_process_group first"
        )
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (e.g. mesh['cp']), got a {group.ndim}-D mesh"
            )
        return group.get_group()
    raise TypeError(
        f"group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}"
    )


def merge_partials(
    out_a: torch.Tensor | None,
    lse_a: torch.Tensor | None,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets.

    Args:
        out_a: ``[B, S, H, D]`` partial output so far (None before the first block).
        lse_a: ``[B, H, S]`` its log-sum-exp, ``-inf`` where it sees no key.
        out_b: ``[B, S, H, D]`` the next block's partial output.
        lse_b: ``[B, H, S]`` its log-sum-exp, ``-inf`` where the block sees no key.

    Returns:
        ``(out, lse)`` in the dtype of ``lse_b`` (float32 or float64): ``lse = log(e^a + e^b)``,
        ``out = e^(a - lse) out_a + e^(b - lse) out_b``. A row with ``-inf`` in both stays
        ``out = 0``, ``lse = -inf`` (never NaN: the shift ``m`` is replaced by 0 there).
    """
    dtype = lse_b.dtype
    if out_a is None or lse_a is None:
        return out_b.to(dtype), lse_b
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    empty = total == 0
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(total))
    total = torch.where(empty, torch.ones_like(total), total)
    scale_a = (wa / total).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    scale_b = (wb / total).transpose(1, 2).unsqueeze(-1)
    return out_a.to(dtype) * scale_a + out_b.to(dtype) * scale_b, lse


# ---------------------------------------------------------------------- per-rank schedule
@dataclass(frozen=True)
class _Schedule:
    """Everything one rank needs per call, derived once from the plan (cached on it)."""

    overlap: bool
    # overlap=True: own queries x own chunks, and x the needed remote chunks (ascending); None
    # when no pair of that block is visible.
    own_mask: torch.Tensor | None
    remote_mask: torch.Tensor | None
    # overlap=False: own queries x (own + needed remote chunks) in ascending global order, and the
    # rows of cat([own rows, remote rows]) in that order.
    fused_mask: torch.Tensor | None
    fused_order: torch.Tensor | None
    remote_tokens: int
    padding_rows: torch.Tensor | None  # local positions of padding tokens
    exchange: AllGatherExchange | PrunedExchange | None  # None: nothing travels anywhere


def _schedule(
    plan: ContextParallelPlan, rank: int, mode: str, overlap: bool, group, device: torch.device
) -> _Schedule:
    key = ("schedule", rank, mode, overlap, id(group), device)
    cached = plan._cache.get(key)
    if cached is not None:
        return cached
    cs, k = plan.chunk_size, plan.chunks_per_rank
    own = plan.assignment[rank]
    remote = plan.remote_chunks(rank)
    own_mask = remote_mask = fused_mask = fused_order = None
    if overlap:
        if plan.needs_own_chunks(rank):
            own_mask = plan.local_mask(rank, own).to(device)
        if remote:
            remote_mask = plan.local_mask(rank, remote).to(device)
    elif remote or plan.needs_own_chunks(rank):
        fused_chunks = sorted((*own, *remote))
        fused_mask = plan.local_mask(rank, fused_chunks).to(device)
        slot = {c: i for i, c in enumerate((*own, *remote))}
        fused_order = chunk_columns([slot[c] for c in fused_chunks], cs, device)

    tokens = plan.token_indices(rank)
    padding = (tokens >= plan.seqlen).nonzero().flatten()
    padding_rows = padding.to(device) if padding.numel() else None

    exchange = None
    if mode == "all_gather" and plan.world_size > 1:
        owner = plan.owner
        slot_in_rank = {c: i for chunks in plan.assignment for i, c in enumerate(chunks)}
        gathered_slot = [int(owner[c]) * k + slot_in_rank[c] for c in remote]
        exchange = AllGatherExchange(
            group, plan.world_size, plan.local_seqlen, chunk_columns(gathered_slot, cs, device), cs
        )
    elif mode == "pruned" and int(plan.transfers("pruned").sum()) > 0:
        need = plan.need
        send_slots: list[int] = []
        send_splits, recv_splits = [], []
        arrival: list[int] = []
        for peer in range(plan.world_size):
            if peer == rank:
                send_splits.append(0)
                recv_splits.append(0)
                continue
            outgoing = [i for i, c in enumerate(own) if bool(need[peer, c])]
            incoming = [c for c in plan.assignment[peer] if bool(need[rank, c])]
            send_slots += outgoing
            arrival += incoming
            send_splits.append(len(outgoing) * cs)
            recv_splits.append(len(incoming) * cs)
        arrival_pos = {c: i for i, c in enumerate(arrival)}
        exchange = PrunedExchange(
            group,
            plan.local_seqlen,
            chunk_columns(send_slots, cs, device),
            send_splits,
            recv_splits,
            chunk_columns([arrival_pos[c] for c in remote], cs, device),
            cs,
        )
    result = _Schedule(
        overlap,
        own_mask,
        remote_mask,
        fused_mask,
        fused_order,
        len(remote) * cs,
        padding_rows,
        exchange,
    )
    plan._cache[key] = result
    return result


# ---------------------------------------------------------------------- packing
def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k [B, S, Hk, D]``, ``v [B, S, Hk, Dv]`` -> token rows ``[S, B * Hk * (D + Dv)]``."""
    s = k.shape[1]
    return torch.cat([k.transpose(0, 1).reshape(s, -1), v.transpose(0, 1).reshape(s, -1)], 1)


def _unpack(
    rows: torch.Tensor, batch: int, heads: int, d: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    s = rows.shape[0]
    split = batch * heads * d
    k = rows[:, :split].reshape(s, batch, heads, d).transpose(0, 1).contiguous()
    v = rows[:, split:].reshape(s, batch, heads, dv).transpose(0, 1).contiguous()
    return k, v


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------- autograd
class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        sinks: torch.Tensor | None,
        schedule: _Schedule,
        scale: float,
        deterministic: bool,
        softcap: float,
    ):
        b, s, hq, _ = q.shape
        hk, d, dv = k.shape[2], k.shape[3], v.shape[3]
        acc = _accum_dtype(q.dtype)
        pending = schedule.exchange.start(_pack(k, v)) if schedule.exchange else None

        def block(kb, vb, mask):
            # The cap acts on each score, so every block caps its own; no sinks here (see the fold).
            return ops.attention_forward(q, kb, vb, mask, False, scale, deterministic, softcap)

        out = lse = None
        k_remote = v_remote = None
        if schedule.overlap:
            if schedule.own_mask is not None:
                out, lse = block(k, v, schedule.own_mask)
            if pending is not None:
                k_remote, v_remote = _unpack(pending.wait(), b, hk, d, dv)
            if schedule.remote_mask is not None:
                out_r, lse_r = block(k_remote, v_remote, schedule.remote_mask)
                out, lse = merge_partials(out, lse, out_r, lse_r)
        else:
            if pending is not None:
                k_remote, v_remote = _unpack(pending.wait(), b, hk, d, dv)
            if schedule.fused_mask is not None:
                kf, vf = _fused(k, v, k_remote, v_remote, schedule.fused_order)
                out, lse = block(kf, vf, schedule.fused_mask)
        if out is None:  # no visible key at all: every local row is fully masked
            out = q.new_zeros(b, s, hq, dv, dtype=acc)
            lse = torch.full((b, hq, s), -math.inf, dtype=acc, device=q.device)
        lse = lse.to(acc)
        if schedule.padding_rows is not None:
            # Padding rows may see real keys where the mask had no spare interval to hide them.
            out = out.index_fill(1, schedule.padding_rows, 0)
            lse = lse.index_fill(2, schedule.padding_rows, -math.inf)
        if sinks is not None:
            # Once, on the merged rows (a sink per block would enter the denominator once per
            # block), and before the cast, so a merged float32 output is rounded only once. A row
            # that sees no key, padding included, keeps out 0 and gets lse = sink, as on one
            # device. The reference's fold is plain PyTorch, so it takes the merged float32 rows
            # on any device and dtype (the Triton fold is CUDA-only and takes a float32 lse).
            out, lse = reference.fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, k_remote, v_remote, out, lse, sinks)
        ctx.schedule, ctx.scale, ctx.deterministic = schedule, scale, deterministic
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, k_remote, v_remote, out, lse, sinks = ctx.saved_tensors
        schedule: _Schedule = ctx.schedule
        acc = _accum_dtype(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        # With sinks a padding row's lse is the sink (a row that sees no key), so its dlse is
        # the sinks' gradient there: the sinks' row term takes dlse before the zeroing below.
        dlse_sinks = dlse
        lse_blocks = lse
        if schedule.padding_rows is not None:
            # The forward zeroed these rows (out constant 0): no gradient reaches the blocks.
            dout = dout.index_fill(1, schedule.padding_rows, 0)
            if dlse is not None:
                dlse = dlse.index_fill(2, schedule.padding_rows, 0)
            if sinks is not None:
                # The fold made their lse finite; -inf gives them P = 0 exactly in the blocks
                # (a finite lse would weigh the real keys the mask could not hide from them).
                lse_blocks = lse.index_fill(2, schedule.padding_rows, -math.inf)

        def block(kb, vb, mask):
            # out and lse are the folded ones, so P already has the sink in its denominator and
            # the blocks need no sinks: the op's fourth output (dsinks) is then empty.
            dq_b, dk_b, dv_b, _ = ops.attention_backward(
                dout, dlse, q, kb, vb, out, lse_blocks, mask, False, ctx.scale, ctx.deterministic,
                ctx.softcap,
            )  # fmt: skip
            return dq_b, dk_b, dv_b

        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        b, _, hk, d = k.shape
        exchange = schedule.exchange
        if schedule.overlap or schedule.fused_mask is None:
            remote_rows = None
            if schedule.remote_mask is not None:
                dq_r, dk_r, dv_r = block(k_remote, v_remote, schedule.remote_mask)
                dq += dq_r
                remote_rows = _pack(dk_r, dv_r)
            pending = _start_reverse(exchange, remote_rows, schedule, k, v, acc)
            if schedule.own_mask is not None:
                dq_o, dk_o, dv_o = block(k, v, schedule.own_mask)
                dq += dq_o
                dk += dk_o
                dv += dv_o
        else:
            kf, vf = _fused(k, v, k_remote, v_remote, schedule.fused_order)
            dq_f, dk_f, dv_f = block(kf, vf, schedule.fused_mask)
            dq += dq_f
            # Split the fused gradients back into own rows and remote rows (sorted).
            fused_rows = _pack(dk_f, dv_f)
            rows = torch.empty_like(fused_rows).index_copy_(0, schedule.fused_order, fused_rows)
            s_local = k.shape[1]
            own_k, own_v = _unpack(rows[:s_local], b, hk, d, v.shape[3])
            dk += own_k
            dv += own_v
            remote_rows = rows[s_local:] if schedule.remote_tokens else None
            pending = _start_reverse(exchange, remote_rows, schedule, k, v, acc)
        if pending is not None:
            back_k, back_v = _unpack(pending.wait(), b, hk, d, v.shape[3])
            dk += back_k
            dv += back_v
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # As the single-device op computes it, over this rank's rows only: a partial sum
            # that the data-parallel reduction of the (replicated) sinks completes.
            delta = reference.row_term(dout, out, dlse_sinks)
            dsinks = reference.sink_gradient(lse, delta, sinks)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)
        return (*grads, None, None, None, None)


def _fused(k, v, k_remote, v_remote, order):
    """Own and remote keys/values in ascending global order (one kernel call)."""
    if k_remote is None:
        return k.index_select(1, order), v.index_select(1, order)
    return (
        torch.cat([k, k_remote], 1).index_select(1, order),
        torch.cat([v, v_remote], 1).index_select(1, order),
    )


def _start_reverse(exchange, remote_rows, schedule: _Schedule, k, v, acc):
    """Start returning remote gradients; every rank joins the collective, even with nothing to
    send (its rows are then empty)."""
    if exchange is None:
        return None
    if remote_rows is None:
        width = k.shape[0] * k.shape[2] * (k.shape[3] + v.shape[3])
        remote_rows = k.new_zeros(schedule.remote_tokens, width)
    return exchange.start_reverse(remote_rows, acc)


# ---------------------------------------------------------------------- public entry
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: ContextParallelPlan,
    *,
    mode: str = "pruned",
    group: object = None,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
    overlap: bool = True,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashMask attention of this rank's queries against the whole (distributed) sequence.

    Args:
        query: local queries ``[B, S_local, Hq, D]`` in the plan's layout (:func:`dispatch`).
        key: local keys ``[B, S_local, Hk, D]``, ``Hq % Hk == 0``.
        value: local values ``[B, S_local, Hk, Dv]``.
        plan: from :func:`make_plan` with this group's size; the same plan on every rank.
            ``S_local = plan.local_seqlen``; the mask's batch must be ``B`` and its heads 1 or
            ``Hk``.
        mode: ``"pruned"`` (send a chunk only to ranks whose queries see it; all-to-all-v) or
            ``"all_gather"`` (every rank receives every chunk; reduce-scatter in backward).
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None (the default group).
        softmax_scale: score scale, default ``D ** -0.5``.
        return_softmax_lse: also return the lse ``[B, Hq, S_local]`` (float32; float64 for
            float64 inputs; ``-inf`` for rows that see no key, ``sinks[h]`` with sinks). It is
            differentiable.
        overlap: compute the own-chunk block while keys/values travel and merge by lse (True),
            or wait and make a single kernel call (False). Both are exact.
        deterministic: passed to the kernels (bit-reproducible backward).
        sinks: learnable attention sinks (gpt-oss's) as in :func:`flashmask.flashmask_attention`:
            a floating tensor ``[Hq]`` of logits in the units of the scaled scores, on the
            query's device, the same (replicated) values on every rank. Query head ``h``'s sink
            joins every row's softmax denominator as ``exp(sinks[h])`` once, after the ranks'
            partial results are merged. Differentiable, but **the gradient on each rank is the
            partial sum over that rank's rows only**: like the gradient of any parameter
            replicated over the context-parallel group, it must be summed over the group (the
            data-parallel / FSDP gradient reduction does this when the CP ranks are part of it;
            otherwise all-reduce ``sinks.grad`` over ``group``).
        softcap: Gemma's logit cap ``softcap * tanh(score / softcap)`` on every scaled score,
            as in :func:`flashmask.flashmask_attention` (``None`` or 0: off); each block caps
            its own scores, forward and backward.

    Returns:
        ``out [B, S_local, Hq, Dv]`` (input dtype), or ``(out, lse)``. Equal to the single-device
        :func:`flashmask.flashmask_attention` on the full sequence, restricted to this rank's rows
        (:func:`undispatch` reassembles it). Rows that see no key and padding rows (which are
        no part of the sequence) give out 0 and lse ``-inf``, or with sinks lse ``sinks[h]`` as
        on one device; a padding row's gradients reach nothing but, with sinks, ``sinks``
        through its lse (``dispatch`` pads with 0, so a loss over dispatched tensors adds none).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got {t.shape}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}.dtype must be a floating dtype, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError("query, key and value must be on one device")
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    b, s, hq, d = query.shape
    if key.shape[:2] != (b, s) or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"key and value must be [B, S_local, Hk, .] like query {tuple(query.shape)}, got "
            f"key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if key.shape[3] != d:
        raise ValueError(f"query and key must share head_dim, got {d} and {key.shape[3]}")
    if hq % key.shape[2]:
        raise ValueError(f"key heads {key.shape[2]} must divide query heads {hq}")
    if s != plan.local_seqlen:
        raise ValueError(
            f"query.shape[1] must be plan.local_seqlen = {plan.local_seqlen}, got {s} "
            "(dispatch the global tensors with flashmask.distributed.dispatch)"
        )
    if plan.mask.batch_size != b:
        raise ValueError(f"the plan's mask has batch {plan.mask.batch_size}, query has {b}")
    if plan.mask.num_heads not in (1, key.shape[2]):
        raise ValueError(
            f"the plan's mask has {plan.mask.num_heads} heads; it must have 1 or the number of "
            f"key/value heads {key.shape[2]}"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    for name, flag in (
        ("return_softmax_lse", return_softmax_lse),
        ("overlap", overlap),
        ("deterministic", deterministic),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if softmax_scale is None:
        softmax_scale = d**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale)}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    # The single-device checks, so both entry points accept and reject the same values.
    if sinks is not None:
        _check_sinks(sinks, query)
    cap = _check_softcap(softcap)
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    if world != plan.world_size:
        raise ValueError(
            f"plan.world_size is {plan.world_size} but the process group has {world} ranks"
        )
    rank = dist.get_rank(pg)
    schedule = _schedule(plan, rank, mode, overlap, pg, query.device)
    out, lse = _ContextParallelAttention.apply(
        query, key, value, sinks, schedule, float(softmax_scale), deterministic, cap
    )
    return (out, lse) if return_softmax_lse else out
