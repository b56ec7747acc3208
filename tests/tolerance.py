"""The one tolerance rule of the test suite, and the naive oracle the reference is checked against.

Rule (testing-anchors §6.A.1; FlashAttention-3's max rule plus FlexAttention's mean rule): a result
``actual`` is close to the high-precision reference ``ref_hi`` when its error is no larger than
twice the error that a plain low-precision implementation (``ref_lo``, same inputs, same dtype as
``actual``) makes, plus the rounding noise of the output dtype.
"""

from __future__ import annotations

import torch

__all__ = [
    "assert_close_to_reference",
    "assert_fp8_lse_close",
    "naive_attention",
    "naive_logsumexp",
]


def _rounding_noise(ref_hi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|(hi + 0.3 - 0.3) - hi|`` evaluated in ``dtype``, returned in float64."""
    hi = ref_hi.to(dtype)
    return ((hi + 0.3) - 0.3 - hi).abs().double()


def assert_close_to_reference(
    actual: torch.Tensor,
    ref_hi: torch.Tensor,
    ref_lo: torch.Tensor,
    name: str,
    *,
    context: str = "",
) -> None:
    """Assert ``actual`` is as close to ``ref_hi`` as a plain low-precision computation is.

    * every element of ``actual``, ``ref_hi`` and ``ref_lo`` is finite;
    * ``max|actual - hi| <= 2 * max|lo - hi| + 2 * max(noise)``;
    * ``mean|actual - hi| <= 1.1 * mean|lo - hi| + mean(noise)``;

    where ``noise = |(hi + 0.3 - 0.3) - hi|`` is computed in ``actual.dtype``. Compare ``lse``
    only on rows where it is finite (fully masked rows are ``-inf`` and checked exactly).

    Args:
        actual: the result under test (any float dtype).
        ref_hi: the same quantity from a float64 (CPU) or float32 (GPU) reference.
        ref_lo: the same quantity from a plain implementation run in ``actual``'s dtype.
        name: what is compared (``"out"``, ``"dq"``, ...), printed on failure.
        context: anything else worth printing on failure (form, shape, seed).
    """
    if actual.shape != ref_hi.shape or ref_lo.shape != ref_hi.shape:
        raise AssertionError(
            f"{name}: shape mismatch actual {tuple(actual.shape)}, ref_hi "
            f"{tuple(ref_hi.shape)}, ref_lo {tuple(ref_lo.shape)} {context}"
        )
    header = f"{name} {tuple(actual.shape)} {actual.dtype} {context}".rstrip()
    for label, t in (("actual", actual), ("ref_hi", ref_hi), ("ref_lo", ref_lo)):
        if not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            raise AssertionError(f"{header}: {label} has non-finite values, first at {bad}")
    hi = ref_hi.double()
    err = (actual.double() - hi).abs()
    ref_err = (ref_lo.double() - hi).abs()
    noise = _rounding_noise(ref_hi, actual.dtype)
    if err.numel() == 0:
        return
    max_bound = 2 * ref_err.max().item() + 2 * noise.max().item()
    mean_bound = 1.1 * ref_err.mean().item() + noise.mean().item()
    max_err, mean_err = err.max().item(), err.mean().item()
    if max_err > max_bound or mean_err > mean_bound:
        raise AssertionError(
            f"{header}: max error {max_err:.3e} (bound {max_bound:.3e}, low-precision reference "
            f"{ref_err.max().item():.3e}); mean error {mean_err:.3e} (bound {mean_bound:.3e}, "
            f"low-precision reference {ref_err.mean().item():.3e}); worst element at "
            f"{list(torch.unravel_index(err.argmax(), err.shape))}"
        )


# Mantissa bits that Hopper's FP8 ``wgmma`` keeps in its fp32 accumulator (about 14: DeepSeek-V3
# technical report, 3.3.2), and the k depth of one FP8 ``wgmma`` instruction.
FP8_ACCUMULATOR_BITS = 14
FP8_MMA_K = 32


def assert_fp8_lse_close(
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    *,
    context: str = "",
) -> None:
    """Assert an FP8 kernel's ``lse [B, Hq, Sq]`` is within its scores' accumulation error of
    the float32 reference's, on the rows where the reference is finite (-inf exactly on the
    others, the fully masked rows).

    The kernel's scores come from e4m3 products summed by tensor cores that keep about
    :data:`FP8_ACCUMULATOR_BITS` bits: each of the ``D / 32`` instructions of a score may round
    its partial sum by ``2^-14`` of its magnitude, at most ``scale * sum_d |q_d| |k_jd|``; lse,
    a smooth maximum of its row's scores, moves by no more than their largest error. Bound per
    row: ``1e-3 + 1e-4 |lse| + (D / 32) 2^-14 scale sum_d |q_d| max_j |k_jd|`` (the last a cheap
    upper bound of the product sums). ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hk, D]``: the
    dequantised float32 inputs."""
    hq, d = q.shape[2], q.shape[3]
    group = hq // k.shape[2]
    key_max = k.abs().amax(1).repeat_interleave(group, 1)  # [B, Hq, D]
    magnitude = torch.einsum("bshd,bhd->bhs", q.abs().float(), key_max.float())
    slack = (d / FP8_MMA_K) * 2.0**-FP8_ACCUMULATOR_BITS * abs(scale) * magnitude
    finite = torch.isfinite(ref_lse)
    # Fully masked rows: -inf exactly, as the reference's.
    hidden = lse[~finite].float()
    assert bool((hidden == ref_lse[~finite].float()).all()), (
        f"{context}: lse of fully masked rows {hidden.unique().tolist()}, expected -inf"
    )
    err = (lse.float() - ref_lse.float()).abs()[finite]
    if err.numel() == 0:  # every row fully masked
        return
    bound = (1e-3 + 1e-4 * ref_lse.abs() + slack)[finite]
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{context}: lse error {err[worst].item():.3g} beyond its bound {bound[worst].item():.3g} "
        f"({int((err > bound).sum())} of {err.numel()} rows)"
    )


def _scores(q, k, dense_mask, scale, dtype, softcap=0.0):
    """Masked scores ``[B, Hq, Sq, Sk]`` (capped at ``softcap * tanh(s / softcap)`` where
    ``softcap > 0``) and the visibility they were masked with."""
    hq, hk = q.shape[2], k.shape[2]
    qh = q.to(dtype).transpose(1, 2)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    # In a low-precision dtype the scale goes on k first (FlashAttention's "reorder_ops"), which
    # estimates the error of merely reordering the computation.
    scores = qh @ (kh * scale).transpose(-1, -2) if dtype.itemsize < 4 else qh @ kh.mT * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if dense_mask is None:
        visible = torch.ones_like(scores, dtype=torch.bool)
    else:
        m = dense_mask if dense_mask.dim() == 4 else dense_mask[None, None]
        visible = m.repeat_interleave(hq // m.shape[1], dim=1).expand_as(scores)
    any_visible = visible.any(-1, keepdim=True)
    scores = torch.where(visible, scores, float("-inf"))
    return torch.where(any_visible, scores, 0.0), visible, any_visible


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense_mask: torch.Tensor | None,
    scale: float,
    *,
    dtype: torch.dtype = torch.float64,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense-softmax attention, written independently of ``flashmask.reference``.

    ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hk, D]``, ``v [B, Sk, Hk, Dv]``; ``dense_mask`` is bool
    ``[B, Hm, Sq, Sk]`` or ``[Sq, Sk]`` (True = may attend; query head ``h`` uses mask head
    ``h // (Hq // Hm)``) or None. ``softcap > 0`` caps the scaled scores (Gemma); ``sinks``
    ``[Hq]`` adds one score column per head that carries no value (gpt-oss). Computes in
    ``dtype`` (float64 by default) and returns ``out [B, Sq, Hq, Dv]`` in ``dtype``; fully
    masked rows give 0. Differentiable (``sinks`` too).
    """
    scores, visible, _ = _scores(q, k, dense_mask, scale, dtype, softcap)
    sk = scores.shape[-1]
    if sinks is not None:
        scores = torch.cat([scores, _sink_column(sinks, scores)], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :sk] * visible
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(q.shape[2] // v.shape[2], dim=1)
    return (p @ vh).transpose(1, 2)


def naive_logsumexp(
    q: torch.Tensor,
    k: torch.Tensor,
    dense_mask: torch.Tensor | None,
    scale: float,
    *,
    dtype: torch.dtype = torch.float64,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logsumexp`` of the scaled, masked scores: ``[B, Hq, Sq]``, ``-inf`` on fully masked rows
    (with ``sinks``, the sink's column joins every row: a fully masked row's is the sink).

    Differentiable (the gradient of a fully masked row is 0, not NaN).
    """
    scores, _, any_visible = _scores(q, k, dense_mask, scale, dtype, softcap)
    lse = torch.where(any_visible.squeeze(-1), torch.logsumexp(scores, dim=-1), float("-inf"))
    if sinks is None:
        return lse
    return torch.logaddexp(lse, _sink_column(sinks, scores).squeeze(-1))


def _sink_column(sinks: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``sinks [Hq]`` as a score column ``[B, Hq, Sq, 1]`` beside ``scores``."""
    b, hq, sq, _ = scores.shape
    return sinks.to(scores.dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
