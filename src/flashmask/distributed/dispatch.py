"""Move tensors with a sequence dimension between the global layout and a rank's local layout.

:func:`dispatch` needs no communication: every rank holds the global tensor (hidden states,
``position_ids``, labels, ...) and keeps its own chunks. :func:`undispatch` all-gathers the
local pieces and restores global order.

Gotchas (both are why these helpers take any tensor, not just hidden states):

* ``position_ids`` must be dispatched like the hidden states, so that RoPE sees global positions.
* Labels for next-token prediction must be **shifted in global order before dispatch**
  (``labels[:, :-1] = input_ids[:, 1:]``): after dispatch a rank's neighbouring tokens are not
  neighbours in the sequence. Pad them with the loss's ignore index (``pad_value=-100``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashmask.distributed.attention import resolve_group
from flashmask.distributed.plan import ContextParallelPlan

__all__ = ["dispatch", "undispatch"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check(x: object, plan: object, seq_dim: object) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"seq_dim must be an int, got {type(seq_dim).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim {seq_dim} is out of range for a {x.dim()}-D tensor")
    return seq_dim % x.dim()


def _rank(plan: ContextParallelPlan, rank: int | None, group: object) -> int:
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.world_size:
            raise ValueError(f"rank must be an int in [0, {plan.world_size}), got {rank!r}")
        return rank
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    if world != plan.world_size:
        raise ValueError(
            f"plan.world_size is {plan.world_size} but the process group has {world} ranks"
        )
    return dist.get_rank(pg)


def dispatch(
    x: torch.Tensor,
    plan: ContextParallelPlan,
    seq_dim: int = 1,
    *,
    rank: int | None = None,
    group: object = None,
    pad_value: float | int | bool = 0,
) -> torch.Tensor:
    """This rank's part of a global tensor: ``x.shape[seq_dim]`` goes from ``S`` to ``S_local``.

    Args:
        x: the global tensor, with ``plan.seqlen`` (or ``plan.padded_seqlen``) along ``seq_dim``.
        plan: the context-parallel plan.
        seq_dim: the sequence dimension (1 for ``[B, S, ...]``).
        rank: the rank whose part to take (default: this process's rank in ``group``).
        group: process group / 1-D DeviceMesh / None, used only when ``rank`` is None.
        pad_value: fill of the padding tokens (use the ignore index for labels).

    Returns:
        The local tensor, chunks of ``plan.assignment[rank]`` in ascending order. Differentiable.
    """
    dim = _check(x, plan, seq_dim)
    r = _rank(plan, rank, group)
    length = x.shape[dim]
    if length not in (plan.seqlen, plan.padded_seqlen):
        raise ValueError(
            f"x.shape[{seq_dim}] must be plan.seqlen = {plan.seqlen} (or the padded "
            f"{plan.padded_seqlen}), got {length}"
        )
    if length < plan.padded_seqlen:
        shape = list(x.shape)
        shape[dim] = plan.padded_seqlen - length
        x = torch.cat([x, x.new_full(shape, pad_value)], dim)
    return x.index_select(dim, plan.token_indices(r).to(x.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather local pieces; backward keeps this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, group, world_size, rank, dim):
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty(world_size * moved.shape[0], *moved.shape[1:])
        _all_gather(out, moved, group=group)
        ctx.rank, ctx.dim, ctx.local = rank, dim, moved.shape[0]
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        piece = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        return piece.contiguous(), None, None, None, None


def undispatch(
    x: torch.Tensor,
    plan: ContextParallelPlan,
    seq_dim: int = 1,
    *,
    group: object = None,
) -> torch.Tensor:
    """Reassemble the global tensor from every rank's local part (all-gather; collective).

    Args:
        x: the local tensor with ``plan.local_seqlen`` along ``seq_dim``.
        plan: the plan ``x`` was dispatched with.
        seq_dim: the sequence dimension.
        group: process group / 1-D DeviceMesh / None (default group).

    Returns:
        The global tensor with ``plan.seqlen`` along ``seq_dim`` (padding dropped), the same on
        every rank. Differentiable; the backward hands each rank *its slice* of the incoming
        gradient, which is right when every rank computes the same function of the gathered
        tensor (e.g. the same loss). ``undispatch(dispatch(x)) == x`` exactly.
    """
    dim = _check(x, plan, seq_dim)
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    if world != plan.world_size:
        raise ValueError(
            f"plan.world_size is {plan.world_size} but the process group has {world} ranks"
        )
    if x.shape[dim] != plan.local_seqlen:
        raise ValueError(
            f"x.shape[{seq_dim}] must be plan.local_seqlen = {plan.local_seqlen}, "
            f"got {x.shape[dim]}"
        )
    gathered = _GatherSequence.apply(x, pg, world, dist.get_rank(pg), dim)
    # Gathered position p holds global token order[p]; invert to global order, drop padding.
    order = torch.cat([plan.token_indices(r) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return gathered.index_select(dim, inverse[: plan.seqlen].to(x.device))
