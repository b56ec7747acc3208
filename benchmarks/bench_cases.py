"""The cases the GPU comparison scripts share (``gluon_forward.py``, ``gluon_backward.py``):
their common command line, a bench mask by name, its mask-aware FLOP count, and how far a
forward's ``(out, lse)`` is from a reference one."""

from __future__ import annotations

import argparse

import torch

from flashmask import bench, masks

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


def visible_flop(mask, causal: bool, seqlen: int, head_dim: int, heads: int, batch: int,
                 per_pair: float) -> float:  # fmt: skip
    """FLOPs over the visible query-key pairs only, ``per_pair * head_dim`` per pair and head
    (4 for a forward, 10 for a five-matmul backward), as ``flashmask bench`` counts them."""
    pairs = bench.visible_pairs(mask, causal, seqlen, seqlen)
    return per_pair * head_dim * int(pairs.sum()) * heads * (batch // pairs.shape[0])


def forward_differences(out, lse, ref_out, ref_lse) -> tuple[float, float, bool]:
    """``(max |out - ref_out|, max |lse - ref_lse| over visible rows, whether every fully
    masked row has lse -inf)``."""
    live = torch.isfinite(ref_lse)
    out_err = float((out.float() - ref_out.float()).abs().max())
    lse_err = float((lse - ref_lse)[live].abs().max()) if live.any() else 0.0
    return out_err, lse_err, bool((lse[~live] == float("-inf")).all())
