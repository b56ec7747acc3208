"""The cases the GPU comparison scripts share (``gluon_forward.py``, ``gluon_backward.py``): their
common command line, a bench mask by name, its mask-aware FLOP count
(``flashmask.bench.visible_flop``), the inputs of a backward comparison, and how far results
are from reference ones."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import NamedTuple

import torch

from flashmask import masks
from flashmask.bench import visible_flop  # also imported from here by the scripts

DEFAULT_MASKS = "full,causal,causal_document,share_question,document,sliding_window"


def _comma_list(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def case_parser(description: str, masks_default: str = DEFAULT_MASKS) -> argparse.ArgumentParser:
    """The options every comparison script takes: ``--compile-only`` (sm_90 compile reports, no
    GPU), ``--seqlens`` (comma-separated, parsed to ints), ``--masks`` (comma-separated bench
    mask names, parsed to a list), and ``--tokens`` / ``--hidden`` (batch = tokens / seqlen,
    heads = hidden / head dim)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--seqlens", type=_comma_list(int), default="8192,32768")
    parser.add_argument("--masks", type=_comma_list(str), default=masks_default)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    return parser


def mask_case(name: str, seqlen: int, batch: int, device: str = "cuda"):
    """``(mask, startend_row_indices on device, causal)`` of ``flashmask bench``'s mask
    ``name`` at ``seqlen``; "full" and "causal" have no mask (``None, None``)."""
    if name in ("full", "causal"):
        return None, None, name == "causal"
    mask = masks.example(name, seqlen, batch_size=batch, generator=torch.Generator().manual_seed(0))
    return mask, mask.startend_row_indices.to(device), mask.causal


class BackwardCase(NamedTuple):
    """One length and mask of a backward comparison: bf16 ``q, k, v, dout [B, S, H, D]``, the
    library forward's ``out`` and ``lse``, the mask (``sri``, ``causal``), the softmax scale and
    the five-matmul backward's mask-aware FLOPs."""

    seqlen: int
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    sri: torch.Tensor | None
    causal: bool
    scale: float
    flop: float

    def run_backward(self, deterministic: bool, config=None):
        """``kernels.backward`` on this case (no lse gradient): ``(dq, dk, dv)``; ``config`` as
        there (``None``: the library's tiles and routing)."""
        from flashmask import kernels

        return kernels.backward(
            self.dout, None, self.q, self.k, self.v, self.out, self.lse, self.sri, self.causal,
            self.scale, deterministic, config=config,
        )  # fmt: skip


def backward_cases(
    seqlens: list[int], mask_names: list[str], tokens: int, hidden: int, head_dim: int
) -> Iterator[BackwardCase]:
    """Per length (batch = tokens / seqlen, ``hidden / head_dim`` heads, random inputs drawn once
    per length) and per mask, a :class:`BackwardCase`."""
    from flashmask import kernels

    for s in seqlens:
        b, h = max(1, tokens // s), hidden // head_dim
        q, k, v, dout = (
            torch.randn(b, s, h, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        scale = head_dim**-0.5
        for name in mask_names:
            mask, sri, causal = mask_case(name, s, b)
            flop = visible_flop(mask, causal, s, head_dim, h, b, 10.0)  # 5 matmuls
            out, lse = kernels.forward(q, k, v, sri, causal, scale)
            yield BackwardCase(s, name, q, k, v, dout, out, lse, sri, causal, scale, flop)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref|`` over ``max |ref|`` (over 1 where ``ref`` is all zeros)."""
    return float((x.float() - ref.float()).abs().max()) / (float(ref.float().abs().max()) or 1.0)


def forward_differences(out, lse, ref_out, ref_lse) -> tuple[float, float, bool]:
    """``(max |out - ref_out|, max |lse - ref_lse| over visible rows, whether every fully
    masked row has lse -inf)``."""
    live = torch.isfinite(ref_lse)
    out_err = float((out.float() - ref_out.float()).abs().max())
    lse_err = float((lse - ref_lse)[live].abs().max()) if live.any() else 0.0
    return out_err, lse_err, bool((lse[~live] == float("-inf")).all())


def add_o_tma_option(parser: argparse.ArgumentParser, applies_to: str) -> None:
    """``--gluon-fwd-o-tma {0,1,2}``: ``gluon_fwd.O_TMA`` for ``applies_to`` (e.g. "the run"),
    set by :func:`apply_o_tma_option`; unset keeps the shipped form."""
    parser.add_argument(
        "--gluon-fwd-o-tma",
        choices=("0", "1", "2"),
        default=None,
        help=f"gluon_fwd.O_TMA for {applies_to} (the forward's O from registers, 0, through TMA "
        "stores, 1, or TMA stores except for full attention, 2; unset: as shipped)",
    )


def apply_o_tma_option(value: str | None) -> str:
    """Set ``gluon_fwd.O_TMA`` from ``--gluon-fwd-o-tma``'s ``value`` (``None``: leave it);
    the setting's label for a run's variant text (``"O_TMA=1"``, ``""`` when left)."""
    if value is None:
        return ""
    from flashmask.kernels.gluon_kernels import forward as gluon_fwd

    gluon_fwd.O_TMA = int(value)
    return f"O_TMA={value}"
