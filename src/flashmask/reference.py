"""The pure-PyTorch oracle: exact FlashMask attention on any device, chunked over query rows.

Forward and backward evaluate the semantics literally (a dense visibility matrix per chunk, a
softmax with fully masked rows giving 0) in float32, or float64 for float64 inputs. Only
``chunk x Sk`` scores per (batch, head) are alive at a time, so long sequences run on a CPU.

Layouts follow the public API: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hk, D]``, ``v [B, Sk, Hk, Dv]``,
``out [B, Sq, Hq, Dv]``, ``lse [B, Hq, Sq]`` (natural log; ``-inf`` for fully masked rows).

Non-finite keys and values: a masked (row, key) pair has probability 0, but ``0 * NaN`` and
``0 * inf`` are NaN, so a NaN or infinity in ``k`` or ``v`` at a key a row cannot see would
reach that row through the matrix products (``P @ V``, ``dS @ K``). When ``k`` or ``v`` hold
non-finite values (one check per call), the products run with them zeroed and, for the rows
that do see one, with the original values; masked entries of ``dS`` are set to exact zeros.
The result is bit-identical for the other rows, and finite inputs take the plain path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashmask.mask import ColumnIntervals, dense_rows

__all__ = [
    "fold_sinks",
    "reference_backward",
    "reference_forward",
    "row_term",
    "sink_gradient",
]

# Score elements kept alive per chunk (4 MB of float32 per intermediate): small chunks stay in
# cache, which measured about 2x faster than 32 MB chunks at 32K tokens on the CPU.
_SCORE_BUDGET = 1 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(batch: int, heads: int, seqlen_k: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return max(1, chunk_size)
    return max(1, _SCORE_BUDGET // max(1, batch * heads * seqlen_k))


def _grouped(x: torch.Tensor, heads_k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, Hq, D]`` -> ``[B, Hk, G, S, D]`` in ``dtype`` (query head ``h = hk * G + g``)."""
    b, s, hq, d = x.shape
    return x.to(dtype).view(b, s, heads_k, hq // heads_k, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hk, G, S, D]`` -> ``[B, S, Hk * G, D]``."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _visible(
    intervals: ColumnIntervals | None,
    causal: bool,
    row_start: int,
    row_end: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
    heads_k: int | None = None,
) -> torch.Tensor | None:
    """Visibility of a row chunk, broadcastable to ``[B, Hk, G, rows, Sk]`` (None = all visible):
    mask heads ``Hm`` in ``{1, Hk}`` broadcast over the group, ``Hm = Hq`` (``heads_k`` given,
    ``Hm > heads_k``) split into ``[Hk, G]``."""
    if intervals is None:
        if not causal:
            return None
        rows = torch.arange(row_start, row_end, device=device).view(-1, 1)
        cols = torch.arange(seqlen_k, device=device).view(1, -1)
        return cols <= rows + (seqlen_k - seqlen_q)
    dense = dense_rows(intervals, causal, row_start, row_end, seqlen_q)
    b, hm = dense.shape[:2]
    if heads_k is not None and hm > heads_k:  # one mask per query head
        return dense.view(b, heads_k, hm // heads_k, *dense.shape[2:])
    return dense.unsqueeze(2)


class _NonFinite(NamedTuple):
    """Non-finite keys/values of a call: which keys hold one and copies with them zeroed."""

    bad_k: torch.Tensor  # bool [B, Hk, 1, 1, Sk]: key j has a non-finite entry in k
    bad_v: torch.Tensor  # bool [B, Hk, 1, 1, Sk]: ... in v
    k_zeroed: torch.Tensor  # kg with non-finite entries replaced by 0
    v_zeroed: torch.Tensor


def _nonfinite(kg: torch.Tensor, vg: torch.Tensor) -> _NonFinite | None:
    """``None`` when ``kg`` and ``vg`` (``[B, Hk, 1, Sk, D]``) are finite (one host sync)."""
    finite_k, finite_v = torch.isfinite(kg), torch.isfinite(vg)
    if bool(finite_k.all()) and bool(finite_v.all()):
        return None
    return _NonFinite(
        ~finite_k.all(-1).unsqueeze(-2),
        ~finite_v.all(-1).unsqueeze(-2),
        torch.where(finite_k, kg, 0.0),
        torch.where(finite_v, vg, 0.0),
    )


def _product(
    weights: torch.Tensor,
    values: torch.Tensor,
    zeroed: torch.Tensor,
    bad: torch.Tensor,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """``weights @ values`` for weights that are 0 at masked pairs: the non-finite ``values``
    (``bad`` keys) enter only the rows that see one of them, so ``0 * NaN`` stays out of the
    others. ``zeroed`` is ``values`` with its non-finite entries replaced by 0."""
    out = weights @ zeroed
    sees = bad if visible is None else visible & bad
    sees = sees.any(-1, keepdim=True)  # [B, Hk, 1, rows or 1, 1]
    if bool(sees.any()):
        out = torch.where(sees, weights @ values, out)
    return out


def _key_range(visible: torch.Tensor | None, seqlen_k: int) -> tuple[int, int]:
    """The smallest key range ``[lo, hi)`` holding every key visible to some row of the chunk.

    Keys outside it only add exact zeros to the softmax, so slicing them away keeps the result
    exact while sparse masks (documents, windows) run in proportion to their visible area.
    """
    if visible is None:
        return 0, seqlen_k
    seen = visible.reshape(-1, seqlen_k).any(0).nonzero()
    if seen.numel() == 0:
        return 0, 0
    return int(seen[0]), int(seen[-1]) + 1


def capped_scores(
    products: torch.Tensor, softmax_scale: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scores, slope)`` of the dot products ``q . k``: ``scale * q . k``, or with ``softcap >
    0`` Gemma's logit cap ``softcap * tanh(scale * q . k / softcap)``, and the cap's derivative
    ``1 - tanh^2`` (``None`` without a cap), which the backward multiplies ``dS`` by."""
    scores = products * softmax_scale
    if not softcap:
        return scores, None
    t = torch.tanh(scores / softcap)
    return softcap * t, 1.0 - t * t


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    intervals: ColumnIntervals | None,
    causal: bool,
    softmax_scale: float,
    chunk_size: int | None = None,
    softcap: float = 0.0,
    probability_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact masked attention; returns ``(out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq])``.

    ``intervals`` are the clamped column intervals of the mask (``None``: no interval mask); lse
    is float32, or float64 for float64 inputs. ``softcap > 0`` caps the scaled scores
    (:func:`capped_scores`); 0 leaves them. ``probability_dtype`` (``None``: exact) rounds the
    unnormalised probabilities ``exp(s - row_max)``, which lie in ``[0, 1]``, to that dtype
    before the ``P V`` product, the row sums still taken before rounding: what an FP8 kernel
    computes (:func:`flashmask.fp8.emulate_fp8_forward`).
    """
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dtype = _compute_dtype(q.dtype)
    kg = k.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hk, 1, Sk, D]
    vg = v.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)
    out = torch.empty(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=dtype, device=q.device)
    nonfinite = _nonfinite(kg, vg)
    step = _rows_per_chunk(b, hq, sk, chunk_size)
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        visible = _visible(intervals, causal, r0, r1, sq, sk, q.device, hk)
        lo, hi = _key_range(visible, sk)
        if lo == hi:  # every row of the chunk is fully masked
            out[:, r0:r1] = 0
            lse[:, :, r0:r1] = float("-inf")
            continue
        qc = _grouped(q[:, r0:r1], hk, dtype)  # [B, Hk, G, rows, D]
        scores, _ = capped_scores(qc @ kg[..., lo:hi, :].transpose(-1, -2), softmax_scale, softcap)
        if visible is not None:
            scores = scores.masked_fill(~visible[..., lo:hi], float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        # A fully masked row has max -inf; shift by 0 instead so exp gives exact zeros, not NaN.
        row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
        p = torch.exp(scores - row_max)
        row_sum = p.sum(-1, keepdim=True)
        if probability_dtype is not None:
            p = p.to(probability_dtype).to(dtype)
        if nonfinite is None:
            pv = p @ vg[..., lo:hi, :]
        else:
            pv = _product(
                p,
                vg[..., lo:hi, :],
                nonfinite.v_zeroed[..., lo:hi, :],
                nonfinite.bad_v[..., lo:hi],
                None if visible is None else visible[..., lo:hi],
            )
        oc = pv / torch.where(row_sum == 0, 1.0, row_sum)
        out[:, r0:r1] = _ungrouped(oc).to(q.dtype)
        lse[:, :, r0:r1] = (row_max + torch.log(row_sum)).squeeze(-1).reshape(b, hq, r1 - r0)
    return out, lse


def reference_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    intervals: ColumnIntervals | None,
    causal: bool,
    softmax_scale: float,
    chunk_size: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the input dtypes, given ``dout`` and optionally ``dlse``.

    Uses ``dS = P * (dP - rowsum(dO * O) + dlse)``: the lse gradient enters exactly like a
    shift of the softmax's row term, so merging partial results by lse stays differentiable.
    With ``softcap > 0`` it is also multiplied by the cap's derivative ``1 - tanh^2``.
    """
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    dtype = _compute_dtype(q.dtype)
    kg = k.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)
    vg = v.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)
    dq = torch.empty_like(q)
    dk = torch.zeros(b, hk, sk, k.shape[-1], dtype=dtype, device=q.device)
    dv = torch.zeros(b, hk, sk, v.shape[-1], dtype=dtype, device=q.device)
    delta = row_term(dout, out, dlse)  # [B, Hq, Sq]
    lse = lse.to(dtype)
    nonfinite = _nonfinite(kg, vg)
    step = _rows_per_chunk(b, hq, sk, chunk_size)
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        rows = r1 - r0
        visible = _visible(intervals, causal, r0, r1, sq, sk, q.device, hk)
        lo, hi = _key_range(visible, sk)
        if lo == hi:  # fully masked rows have zero gradients
            dq[:, r0:r1] = 0
            continue
        kc, vc = kg[..., lo:hi, :], vg[..., lo:hi, :]
        qc = _grouped(q[:, r0:r1], hk, dtype)
        doc = _grouped(dout[:, r0:r1], hk, dtype)
        lse_c = lse[:, :, r0:r1].reshape(b, hk, g, rows, 1)
        delta_c = delta[:, :, r0:r1].reshape(b, hk, g, rows, 1)
        scores, slope = capped_scores(qc @ kc.transpose(-1, -2), softmax_scale, softcap)
        p = torch.exp(scores - torch.where(torch.isinf(lse_c), 0.0, lse_c))
        hidden = torch.isinf(lse_c)
        if visible is not None:
            hidden = hidden | ~visible[..., lo:hi]
        p = p.masked_fill(hidden, 0.0)
        dv[:, :, lo:hi] += (p.transpose(-1, -2) @ doc).sum(2)
        dp = doc @ vc.transpose(-1, -2)
        ds = p * (dp - delta_c) * softmax_scale
        if slope is not None:
            ds = ds * slope
        if nonfinite is None:
            dsk = ds @ kc
        else:
            # dP is NaN at every row for a non-finite value; masked pairs must give exact zeros.
            ds = ds.masked_fill(hidden, 0.0)
            dsk = _product(
                ds,
                kc,
                nonfinite.k_zeroed[..., lo:hi, :],
                nonfinite.bad_k[..., lo:hi],
                None if visible is None else visible[..., lo:hi],
            )
        dq[:, r0:r1] = _ungrouped(dsk).to(q.dtype)
        dk[:, :, lo:hi] += (ds.transpose(-1, -2) @ qc).sum(2)
    # Laid out like ``torch.empty_like(k)`` / ``(v)``: the fake kernel in ops.py promises that.
    dk_out = torch.empty_like(k).copy_(dk.transpose(1, 2))
    dv_out = torch.empty_like(v).copy_(dv.transpose(1, 2))
    return dq, dk_out, dv_out


def fold_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')`` of attention whose rows' softmax denominators gain ``exp(sinks[h])``
    (learnable sinks: one logit per query head, no value), from ``out [B, Sq, Hq, Dv]`` and
    ``lse [B, Hq, Sq]`` of the same attention without them: ``lse' = logaddexp(lse, sink)``,
    ``out' = out * exp(lse - lse')``. A row that sees no key keeps ``out = 0`` and gets
    ``lse' = sink`` (``-inf`` with a ``-inf`` sink)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    # With lse and sink both -inf, total is -inf and the difference NaN: the factor is 1 there
    # (the row's out is 0 anyway).
    keep = torch.exp(torch.where(total == float("-inf"), 0.0, lse - total))
    scaled = out.to(keep.dtype) * keep.transpose(1, 2).unsqueeze(-1)
    return scaled.to(out.dtype), total


def sink_gradient(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, shaped and typed like ``sinks [Hq]``, from the folded ``lse'`` and the
    backward's row term ``delta = rowsum(dO * O') - dlse'`` (both ``[B, Hq, Sq]``): the sink's
    probability in row ``i`` is ``p = exp(sink - lse'_i)`` and its score's gradient is
    ``p * (0 - delta_i)`` (it carries no value, so ``dP = 0``); summed over batch and rows."""
    lse = lse.to(delta.dtype)
    sink = sinks.to(delta.dtype).view(1, -1, 1)
    p = torch.exp(torch.where(lse == float("-inf"), float("-inf"), sink - lse))
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def row_term(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """The softmax backward's row term ``delta = rowsum(dO * O) - dlse`` ``[B, Hq, Sq]`` (in the
    reference's compute dtype) from ``dout``/``out [B, Sq, Hq, Dv]`` and ``dlse [B, Hq, Sq]``."""
    dtype = _compute_dtype(out.dtype)
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)
    return delta if dlse is None else delta - dlse.to(dtype)
