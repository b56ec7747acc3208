"""Composing masks: the intersection of two FlashMasks, computed on intervals in O(N).

A query may attend to a key under ``a & b`` when it may under both, so the masked rows of every
key column are the union of the two masks' masked intervals (plus the causal triangle if either
is causal). The union is merged per column and written back in the smallest form that holds it;
when a column needs more intervals than any form has, :class:`MaskNotRepresentableError` names it.

Typical uses: a document mask intersected with a sliding window or a per-layer policy.
"""

from __future__ import annotations

import torch

from flashmask.mask import FlashMask, MaskNotRepresentableError

__all__ = ["intersect"]


def _broadcast_size(name: str, a: int, b: int) -> int:
    if a != b and 1 not in (a, b):
        raise ValueError(f"{name} must match or be 1 in one of the masks, got {a} and {b}")
    return max(a, b)


def _merge(starts: torch.Tensor, ends: torch.Tensor, seqlen_q: int):
    """Merge K intervals per column (last axis) into at most K disjoint ones, ascending.

    Returns ``(merged_starts, merged_ends, count)``; unused slots hold ``(Sq, Sq)``. Sorting by
    start, an interval opens a new run when it starts after every earlier interval has ended (a
    running maximum); runs are then reduced with two scatters, a fixed ~15 ops for any K.
    """
    empty = starts >= ends
    starts = torch.where(empty, seqlen_q, starts)
    ends = torch.where(empty, seqlen_q, ends)
    order = starts.argsort(dim=-1)
    starts, ends = starts.gather(-1, order), ends.gather(-1, order)
    k = starts.shape[-1]
    present = starts < seqlen_q
    reach = torch.where(present, ends, -1).cummax(-1).values
    before = torch.nn.functional.pad(reach[..., :-1], (1, 0), value=-1)
    opens = present & (starts > before)  # touching intervals ([a, b) then [b, c)) merge
    run = opens.to(torch.int64).cumsum(-1) - 1
    slot = torch.where(present, run, k)  # absent intervals go to a discarded extra slot
    shape = (*starts.shape[:-1], k + 1)
    out_s = torch.full(shape, seqlen_q, dtype=starts.dtype, device=starts.device)
    out_e = torch.full(shape, seqlen_q, dtype=ends.dtype, device=ends.device)
    out_s = out_s.scatter_reduce(-1, slot, starts, "amin", include_self=True)
    out_e = out_e.scatter_reduce(
        -1, slot, torch.where(present, ends, -1), "amax", include_self=False
    )
    count = opens.sum(-1)
    return out_s[..., :k], out_e[..., :k], count


def _first_bad(bad: torch.Tensor) -> str:
    b, h, j = (int(x) for x in bad.nonzero()[0].tolist())
    return f"column {j} (batch {b}, head {h})"


def intersect(first: FlashMask, second: FlashMask, *, seqlen_q: int | None = None) -> FlashMask:
    """The mask that lets a query attend to a key only where both masks do.

    Args:
        first, second: masks over the same ``Sk``; batch and head dimensions broadcast (each 1 or
            equal).
        seqlen_q: the query length both masks are read with (default ``Sk``); causal alignment
            is bottom-right as everywhere else.

    Returns:
        A :class:`FlashMask` in the smallest form (causal when either input is causal and the rest
        fits one interval per column, else non-causal C=2 or C=4).

    Raises:
        MaskNotRepresentableError: some column's masked rows need more intervals than any form
            holds (the message names the first such column).
    """
    for name, m in (("first", first), ("second", second)):
        if not isinstance(m, FlashMask):
            raise TypeError(f"{name} must be a FlashMask, got {type(m).__name__}")
    if first.seqlen_k != second.seqlen_k:
        raise ValueError(
            f"first and second must share seqlen_k, got {first.seqlen_k} and {second.seqlen_k}"
        )
    if first.device != second.device:
        raise ValueError(
            f"first and second must be on one device, got {first.device} and {second.device}"
        )
    sk = first.seqlen_k
    sq = sk if seqlen_q is None else first._seqlen_q(seqlen_q)
    batch = _broadcast_size("batch size", first.batch_size, second.batch_size)
    heads = _broadcast_size("mask heads", first.num_heads, second.num_heads)
    shape = (batch, heads, sk)
    starts, ends = [], []
    for m in (first, second):
        iv = m.intervals(sq)
        starts += [iv.lts.expand(shape), iv.uts.expand(shape)]
        ends += [iv.lte.expand(shape), iv.ute.expand(shape)]
    causal = first.causal or second.causal
    cols = torch.arange(sk, device=first.device, dtype=torch.int32)
    causal_end = (cols - (sk - sq)).clamp(0, sq).expand(shape)
    if causal:
        starts.append(torch.zeros_like(causal_end))
        ends.append(causal_end)
    ms, me, count = _merge(torch.stack(starts, -1), torch.stack(ends, -1), sq)

    if causal:
        # Rows above the diagonal are hidden by the causal flag: clip them off every interval.
        cs = torch.maximum(ms, causal_end.unsqueeze(-1))
        ce = torch.where(me > cs, me, cs)
        rest = (ce > cs).sum(-1)
        if bool((rest <= 1).all()):
            has = ce > cs
            lts = torch.where(has, cs, sq).amin(-1)
            lte = torch.where(has, ce, sq).amin(-1)
            lte = torch.where(rest == 0, sq, lte)
            if bool((lte == sq).all()):
                return FlashMask(lts.to(torch.int32).unsqueeze(-1).contiguous(), True)
            return FlashMask(torch.stack([lts, lte], -1).to(torch.int32).contiguous(), True)
    if not bool((count <= 2).all()):
        raise MaskNotRepresentableError(
            f"the intersection cannot be represented: {_first_bad(count > 2)} would need "
            "more than two masked row intervals"
        )
    first_s, first_e, second_s, second_e = ms[..., 0], me[..., 0], ms[..., 1], me[..., 1]
    # C=2 holds a prefix [0, UTE) and a suffix [LTS, Sq).
    prefix = torch.where(count >= 1, first_s == 0, True)
    one_suffix = (count == 1) & (first_e == sq)
    two_ok = (count == 2) & prefix & (second_e == sq)
    fits_c2 = (count == 0) | (count == 1) & (prefix | one_suffix) | two_ok
    if bool(fits_c2.all()):
        ute = torch.where((count >= 1) & (first_s == 0) & ~one_suffix, first_e, 0)
        ute = torch.where((count == 1) & one_suffix & (first_s == 0), sq, ute)
        lts = torch.where(count == 2, second_s, torch.where(one_suffix, first_s, sq))
        return FlashMask(torch.stack([lts, ute], -1).to(torch.int32).contiguous(), False)
    # C=4: the upper interval is the first run, the lower one the second (or the only one).
    lts = torch.where(count == 2, second_s, first_s)
    lte = torch.where(count == 2, second_e, first_e)
    uts = torch.where(count == 2, first_s, 0)
    ute = torch.where(count == 2, first_e, 0)
    return FlashMask(torch.stack([lts, lte, uts, ute], -1).to(torch.int32).contiguous(), False)
