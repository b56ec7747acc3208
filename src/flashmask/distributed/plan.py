"""The context-parallel plan: chunks, their ranks, the need matrix and the transfers it implies.

A plan is built once per micro-batch from the replicated global mask, by every rank, without
communication (the same inputs give the same plan everywhere), and is then reused by every
attention layer: the mask does not change between layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashmask.distributed import balance
from flashmask.distributed.localize import chunk_columns, local_mask, normal_form
from flashmask.distributed.workload import pair_counts, tile_counts
from flashmask.mask import FlashMask, _check_positive_int, as_flashmask

__all__ = ["MODES", "WORKLOADS", "ContextParallelPlan", "make_plan"]

MODES: tuple[str, ...] = ("all_gather", "pruned")
"""Execution modes of :func:`~flashmask.distributed.context_parallel_attention`."""

WORKLOADS: tuple[str, ...] = ("pairs", "tiles")
"""Work measures the balancers can equalise: exact visible pairs, or non-skipped kernel tiles."""


@dataclass(frozen=True, eq=False)
class ContextParallelPlan:
    """How one micro-batch's sequence is split over ``world_size`` ranks.

    The global sequence of ``seqlen`` tokens is padded to ``padded_seqlen = num_chunks *
    chunk_size`` (fully masked padding at the end) and cut into chunks; rank ``r`` holds the
    chunks ``assignment[r]`` (ascending), laid out in that order, ``local_seqlen`` tokens.

    Attributes:
        mask: the global mask (replicated on every rank).
        world_size: ``P``.
        chunk_size: tokens per chunk.
        seqlen: ``S``, real tokens.
        padded_seqlen: ``N``, a multiple of ``chunk_size * P``.
        balancer: the balancer that produced ``assignment``.
        workload: the work measure the balancer used (``"pairs"`` or ``"tiles"``).
        assignment: chunk ids per rank, each ascending, all the same length.
        intervals: the global mask in non-causal 4-bound normal form, int32 ``[B, Hm, N, 4]``.
        pairs: visible (query, key) pairs per (query chunk, key chunk), int64 ``[n, n]`` (CPU),
            summed over batch and mask heads.
        work: per-chunk work the balancer equalised, int64 ``[n]``.
    """

    mask: FlashMask
    world_size: int
    chunk_size: int
    seqlen: int
    padded_seqlen: int
    balancer: str
    workload: str
    assignment: tuple[tuple[int, ...], ...]
    intervals: torch.Tensor
    pairs: torch.Tensor
    work: torch.Tensor
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ shapes
    @property
    def num_chunks(self) -> int:
        return self.padded_seqlen // self.chunk_size

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.world_size

    @property
    def local_seqlen(self) -> int:
        """Tokens per rank: the sequence length of every local tensor."""
        return self.chunks_per_rank * self.chunk_size

    @property
    def owner(self) -> torch.Tensor:
        """Rank of every chunk: int64 ``[n]``."""
        owner = torch.empty(self.num_chunks, dtype=torch.int64)
        for r, chunks in enumerate(self.assignment):
            owner[list(chunks)] = r
        return owner

    # ------------------------------------------------------------------ work
    @property
    def rank_work(self) -> torch.Tensor:
        """Visible (query, key) pairs computed by each rank: int64 ``[P]``."""
        per_chunk = self.pairs.sum(1)
        return torch.stack([per_chunk[list(c)].sum() for c in self.assignment])

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`rank_work` (1.0 is perfect; 1.0 for an all-masked plan)."""
        w = self.rank_work.double()
        mean = w.mean().item()
        return w.max().item() / mean if mean > 0 else 1.0

    @property
    def need(self) -> torch.Tensor:
        """``need[r, c]``: some query of rank ``r`` sees some key of chunk ``c``; bool ``[P, n]``.

        Computed from the replicated mask, so the sender and the receiver of every transfer agree
        without a handshake.
        """
        if "need" not in self._cache:
            visible = self.pairs > 0
            self._cache["need"] = torch.stack([visible[list(c)].any(0) for c in self.assignment])
        return self._cache["need"]

    def transfers(self, mode: str) -> torch.Tensor:
        """Chunks that rank ``src`` sends to rank ``dst`` in the forward: int64 ``[P, P]``.

        ``all_gather`` sends every chunk to every other rank; ``pruned`` sends chunk ``c`` from its
        owner to rank ``r != owner`` only when ``need[r, c]``. The backward returns the same
        chunks' key/value gradients along the reverse edges (``transfers(mode).T``).
        """
        _check_mode(mode)
        p, k = self.world_size, self.chunks_per_rank
        if mode == "all_gather":
            return (torch.ones(p, p, dtype=torch.int64) - torch.eye(p, dtype=torch.int64)) * k
        counts = torch.zeros(p, p, dtype=torch.int64)
        need = self.need
        for src, chunks in enumerate(self.assignment):
            counts[src] = need[:, list(chunks)].sum(1)
        counts.fill_diagonal_(0)
        return counts

    def bytes_moved(self, mode: str, bytes_per_token: int) -> int:
        """Bytes all ranks send in one forward, for ``bytes_per_token`` of key + value.

        The backward returns as many chunks of gradients: in the input dtype in ``pruned`` mode,
        in float32 for fp16/bf16 inputs in ``all_gather`` mode (see :mod:`.exchange`).
        """
        return int(self.transfers(mode).sum()) * self.chunk_size * bytes_per_token

    # ------------------------------------------------------------------ per rank
    def token_indices(self, rank: int) -> torch.Tensor:
        """Global token index of every local position of ``rank``: int64 ``[local_seqlen]``.

        Indices ``>= seqlen`` are padding.
        """
        _check_rank(rank, self.world_size)
        return chunk_columns(self.assignment[rank], self.chunk_size)

    def local_mask(self, rank: int, key_chunks: tuple[int, ...] | list[int]) -> torch.Tensor:
        """Mask of ``rank``'s queries x ``key_chunks`` (in that order): int32 ``[B, Hm, K, 4]``,
        non-causal, ``K = len(key_chunks) * chunk_size`` columns."""
        _check_rank(rank, self.world_size)
        return local_mask(self.intervals, self.assignment[rank], key_chunks, self.chunk_size)

    def remote_chunks(self, rank: int) -> tuple[int, ...]:
        """Chunks of other ranks that ``rank``'s queries see, ascending."""
        _check_rank(rank, self.world_size)
        own = set(self.assignment[rank])
        need = self.need[rank].nonzero().flatten().tolist()
        return tuple(c for c in need if c not in own)

    def needs_own_chunks(self, rank: int) -> bool:
        """Whether ``rank``'s queries see any of its own keys."""
        return bool(self.need[rank, list(self.assignment[rank])].any())

    def summary(self) -> str:
        """One line: sizes, balance and the bytes ratio of the two modes."""
        ag, pr = self.transfers("all_gather").sum().item(), self.transfers("pruned").sum().item()
        return (
            f"ContextParallelPlan(P={self.world_size}, S={self.seqlen}, N={self.padded_seqlen}, "
            f"chunk={self.chunk_size}, chunks/rank={self.chunks_per_rank}, "
            f"balancer={self.balancer}, imbalance={self.imbalance:.3f}, "
            f"chunks sent: all_gather {ag}, pruned {pr})"
        )

    def __repr__(self) -> str:
        return self.summary()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def make_plan(
    mask: FlashMask | torch.Tensor,
    world_size: int,
    *,
    causal: bool = False,
    chunk_size: int = 128,
    balancer: str = "document",
    workload: str = "pairs",
    tile_size: int = 128,
    tolerance: float = 0.05,
) -> ContextParallelPlan:
    """Plan context parallelism for one micro-batch (no communication; identical on every rank).

    Args:
        mask: the global self-attention mask (``Sq == Sk``): a :class:`~flashmask.FlashMask` or
            ``startend_row_indices`` ``[B, Hm, S, C]`` / ``[B, Hm, S]`` with ``causal``.
        world_size: ``P``, the number of ranks of the context-parallel group.
        causal: the causal flag when ``mask`` is a tensor (a FlashMask carries its own).
        chunk_size: tokens per chunk, the unit of balancing and of pruned transfers. Use a
            multiple of the kernel tile (128) on GPUs; small values are fine in tests.
        balancer: one of ``"contiguous"``, ``"zigzag"``, ``"heap"``, ``"document"`` (see
            :mod:`flashmask.distributed.balance`).
        workload: ``"pairs"`` (exact visible pairs) or ``"tiles"`` (non-skipped
            ``tile_size`` tiles, the kernels' work; needs ``chunk_size % tile_size == 0``).
        tile_size: tile edge for ``workload="tiles"``.
        tolerance: imbalance the ``document`` balancer accepts above the mean (0.05 = 5%).

    Returns:
        A :class:`ContextParallelPlan`. The sequence is padded to a multiple of
        ``chunk_size * P`` (``2 * chunk_size * P`` for ``zigzag``, which needs an even number of
        chunks per rank); padding tokens are fully masked, and :func:`dispatch` /
        :func:`undispatch` add and drop them.
    """
    if isinstance(mask, (torch.Tensor, FlashMask)):
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        mask = as_flashmask(mask, causal)
    else:
        raise TypeError(f"mask must be a FlashMask or a torch.Tensor, got {type(mask).__name__}")
    world_size = _check_positive_int("world_size", world_size)
    chunk_size = _check_positive_int("chunk_size", chunk_size)
    if balancer not in balance.BALANCERS:
        raise ValueError(
            f"balancer must be one of {', '.join(balance.BALANCERS)}; got {balancer!r}"
        )
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {workload!r}")
    tile_size = _check_positive_int("tile_size", tile_size)
    if workload == "tiles" and chunk_size % tile_size:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a multiple of tile_size ({tile_size}) when "
            "workload='tiles'"
        )
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise ValueError(f"tolerance must be a non-negative number, got {tolerance!r}")

    seqlen = mask.seqlen_k
    unit = chunk_size * world_size * (2 if balancer == "zigzag" else 1)
    padded = -(-seqlen // unit) * unit
    intervals = normal_form(mask, padded)
    pairs = pair_counts(intervals, seqlen, chunk_size)
    if workload == "pairs":
        work = pairs.sum(1)
    else:
        work = tile_counts(intervals, chunk_size, tile_size).sum(1)
    assignment = balance.assign(balancer, work, pairs > 0, world_size, float(tolerance))
    return ContextParallelPlan(
        mask=mask,
        world_size=world_size,
        chunk_size=chunk_size,
        seqlen=seqlen,
        padded_seqlen=padded,
        balancer=balancer,
        workload=workload,
        assignment=assignment,
        intervals=intervals,
        pairs=pairs,
        work=work,
    )
