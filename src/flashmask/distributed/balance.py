"""Assign sequence chunks to ranks: equal chunk counts, balanced work, local communication.

Every balancer takes the per-chunk work (``work[c]``, from the mask) and returns one tuple of chunk
ids per rank, each ascending (localization lays a rank's rows out in global order) and all of the
same length ``n / P``. Equal counts keep every local tensor the same shape, so the collectives need
no shape exchange.

* ``contiguous``: rank ``r`` gets chunks ``[r k, (r+1) k)``. Best locality, poor balance for
  causal masks (the last rank does most of the work).
* ``zigzag``: the sequence is cut into ``2P`` segments of ``k/2`` chunks; rank ``r`` gets segments
  ``r`` and ``2P-1-r`` (DualChunkSwap / head-tail). Balances a plain causal mask; needs ``k`` even.
* ``heap``: LPT greedy (largest chunk first onto the least loaded rank that still has room;
  MagiAttention ``_solve_with_minhp``, Paddle ``assign_tasks_heap``). Near-perfect balance, but it
  scatters documents over ranks, which destroys the locality that pruning exploits (§A.8).
* ``document``: keep each document (a run of chunks that no visible pair crosses) on one rank
  where balance allows, split the documents that are too heavy into contiguous pieces, then repair
  the remaining imbalance with the fewest chunk swaps (see :func:`document_aware`).
"""

from __future__ import annotations

import torch

__all__ = ["BALANCERS", "assign", "contiguous", "document_aware", "documents", "heap", "zigzag"]

BALANCERS: tuple[str, ...] = ("contiguous", "zigzag", "heap", "document")
"""Names accepted by :func:`assign` (and ``make_plan(balancer=...)``)."""

Assignment = tuple[tuple[int, ...], ...]


def _sorted(bins: list[list[int]]) -> Assignment:
    return tuple(tuple(sorted(b)) for b in bins)


def contiguous(num_chunks: int, world_size: int) -> Assignment:
    """Rank ``r`` gets chunks ``[r k, (r+1) k)`` with ``k = num_chunks / world_size``."""
    k = num_chunks // world_size
    return tuple(tuple(range(r * k, (r + 1) * k)) for r in range(world_size))


def zigzag(num_chunks: int, world_size: int) -> Assignment:
    """Head-tail: ``2P`` segments of ``k/2`` chunks; rank ``r`` gets segments ``r``, ``2P-1-r``."""
    if num_chunks % (2 * world_size):
        raise ValueError(
            f"zigzag needs an even number of chunks per rank, got {num_chunks} chunks for "
            f"{world_size} ranks"
        )
    half = num_chunks // (2 * world_size)
    out = []
    for r in range(world_size):
        head = range(r * half, (r + 1) * half)
        tail_start = (2 * world_size - 1 - r) * half
        out.append((*head, *range(tail_start, tail_start + half)))
    return tuple(out)


def heap(work: torch.Tensor, world_size: int) -> Assignment:
    """LPT: chunks by decreasing work, each onto the least loaded rank that has room."""
    w = [int(x) for x in work.tolist()]
    n = len(w)
    k = n // world_size
    load = [0] * world_size
    bins: list[list[int]] = [[] for _ in range(world_size)]
    # Stable order (work descending, then chunk id) so every rank computes the same assignment.
    for c in sorted(range(n), key=lambda c: (-w[c], c)):
        r = min((r for r in range(world_size) if len(bins[r]) < k), key=lambda r: (load[r], r))
        bins[r].append(c)
        load[r] += w[c]
    return _sorted(bins)


def documents(need: torch.Tensor) -> list[range]:
    """Maximal runs of chunks that no visible pair crosses, from the chunk need matrix ``[n, n]``.

    The cut between chunks ``c`` and ``c + 1`` is free when no query chunk ``<= c`` sees a key chunk
    ``> c`` and no query chunk ``> c`` sees a key chunk ``<= c``. For packed-document masks the runs
    are the documents (rounded out to chunk boundaries).
    """
    n = need.shape[0]
    a = need.to(torch.int64)
    # crossing[c] = sum over a <= c < b of a[a, b] + a[b, a] via 2-D prefix sums.
    p = torch.zeros(n + 1, n + 1, dtype=torch.int64)
    p[1:, 1:] = a.cumsum(0).cumsum(1)

    def block(r0: int, r1: int, c0: int, c1: int) -> int:
        return int(p[r1, c1] - p[r0, c1] - p[r1, c0] + p[r0, c0])

    runs, start = [], 0
    for c in range(n - 1):
        if block(0, c + 1, c + 1, n) + block(c + 1, n, 0, c + 1) == 0:
            runs.append(range(start, c + 1))
            start = c + 1
    runs.append(range(start, n))
    return runs


def document_aware(
    work: torch.Tensor, need: torch.Tensor, world_size: int, tolerance: float = 0.05
) -> Assignment:
    """Keep documents whole where balance allows; split heavy ones; repair with few swaps.

    1. Documents (:func:`documents`) heavier than ``(1 + tolerance) * mean`` rank work, or longer
       than a rank, are cut into contiguous pieces of at most that work and ``k`` chunks.
    2. Pieces and whole documents, heaviest first, go to the least loaded rank that has room for
       the whole piece and stays within ``(1 + tolerance) * mean``; a piece that fits nowhere is
       split again at the room of the emptiest rank (chunk counts must come out equal).
    3. While ``max / mean > 1 + tolerance``, swap a chunk of the most loaded rank with one
       elsewhere, choosing the swap that reaches the cap while breaking the fewest need links.
    4. The result competes with ``contiguous`` and ``zigzag`` (when ``k`` is even): of the
       assignments within the tolerance, the one whose pruned exchange moves the fewest chunks
       wins (ties: the simple layouts). A sliding window (one long "document") thus stays
       contiguous and a plain causal mask gets zigzag, while packed documents get the heuristic.

    Args:
        work: per-chunk work ``[n]``.
        need: chunk need matrix ``[n, n]`` (query chunk sees key chunk).
        world_size: ``P``; ``n`` must be a multiple of it.
        tolerance: allowed imbalance above the mean before pieces are split or swapped.
    """
    n = work.numel()
    k = n // world_size
    w = [int(x) for x in work.tolist()]
    mean = sum(w) / world_size
    cap = (1 + tolerance) * mean

    pieces: list[list[int]] = []
    for run in documents(need):
        piece: list[int] = []
        acc = 0
        for c in run:
            if piece and (len(piece) == k or acc + w[c] > cap):
                pieces.append(piece)
                piece, acc = [], 0
            piece.append(c)
            acc += w[c]
        pieces.append(piece)

    load = [0] * world_size
    bins: list[list[int]] = [[] for _ in range(world_size)]
    queue = sorted(pieces, key=lambda p: (-sum(w[c] for c in p), -len(p), p[0]))
    while queue:
        piece = queue.pop(0)
        pw = sum(w[c] for c in piece)
        fits = [
            r for r in range(world_size) if len(bins[r]) + len(piece) <= k and load[r] + pw <= cap
        ]
        if not fits:
            # Prefer any rank with room for the whole piece (over the cap) before cutting it.
            fits = [r for r in range(world_size) if len(bins[r]) + len(piece) <= k]
        if fits:
            r = min(fits, key=lambda r: (load[r], r))
            bins[r] += piece
            load[r] += pw
            continue
        # No rank has room for the whole piece: cut it at the room of the rank with most room
        # (ties: least loaded), place the head, and queue the tail.
        r = max(range(world_size), key=lambda r: (k - len(bins[r]), -load[r], -r))
        room = k - len(bins[r])
        head, tail = piece[:room], piece[room:]
        bins[r] += head
        load[r] += sum(w[c] for c in head)
        queue.append(tail)
        queue.sort(key=lambda p: (-sum(w[c] for c in p), -len(p), p[0]))

    _swap_repair(bins, load, w, mean, tolerance, need)
    heuristic = _sorted(bins)
    # Simple layouts first so that they win ties (min keeps the first of equal keys).
    candidates = [contiguous(n, world_size)]
    if k % 2 == 0:
        candidates.append(zigzag(n, world_size))
    candidates.append(heuristic)
    within = [a for a in candidates if _max_load(a, w) <= cap]
    if not within:
        return heuristic
    return min(within, key=lambda a: pruned_chunks(a, need))


def _max_load(assignment: Assignment, w: list[int]) -> int:
    return max(sum(w[c] for c in chunks) for chunks in assignment)


def pruned_chunks(assignment: Assignment, need: torch.Tensor) -> int:
    """Chunks the pruned exchange sends: ``(rank r, chunk c)`` pairs where ``r`` does not own
    ``c`` but one of its query chunks sees it (``need`` is the ``[n, n]`` chunk matrix)."""
    total = 0
    for chunks in assignment:
        seen = need[list(chunks)].any(0)
        seen[list(chunks)] = False
        total += int(seen.sum())
    return total


def _swap_repair(
    bins: list[list[int]],
    load: list[int],
    w: list[int],
    mean: float,
    tolerance: float,
    need: torch.Tensor,
) -> None:
    """Swap chunk pairs until ``max(load) <= (1 + tolerance) * mean`` or no swap helps.

    Each step swaps one chunk of the most loaded rank with one chunk elsewhere. Among the swaps
    that bring both ranks within the cap it takes the one that breaks the fewest need links
    (pairs of chunks that see each other and would no longer share a rank: a proxy for the
    transfers the swap adds), then the lowest new maximum; when none reaches the cap, the lowest
    new maximum. Vectorised over all candidate pairs: O(k * n) per step.
    """
    n, world_size = len(w), len(bins)
    cap = (1 + tolerance) * mean
    linked = (need | need.T).to(torch.int64)
    self_link = linked.diagonal()
    weight = torch.tensor(w, dtype=torch.int64)
    rank_of = torch.empty(n, dtype=torch.int64)
    for r, chunks in enumerate(bins):
        rank_of[chunks] = r
    one_hot = torch.zeros(n, world_size, dtype=torch.int64)
    one_hot[torch.arange(n), rank_of] = 1
    links = linked @ one_hot  # links[c, r]: chunks on rank r linked with chunk c
    loads = torch.tensor(load, dtype=torch.int64)
    never = torch.iinfo(torch.int64).max
    for _ in range(4 * n):
        top = int(loads.argmax())
        if loads[top] <= cap:
            break
        mine = (rank_of == top).nonzero().flatten()
        other = (rank_of != top).nonzero().flatten()
        other_rank = rank_of[other]
        d = weight[mine].view(-1, 1) - weight[other].view(1, -1)
        new_max = torch.maximum(loads[top] - d, loads[other_rank].view(1, -1) + d)
        helps = (d > 0) & (new_max < loads[top])
        if not bool(helps.any()):
            break
        between = linked[mine][:, other]
        broken = (
            (links[mine, top] - self_link[mine]).view(-1, 1)
            + (links[other, other_rank] - self_link[other]).view(1, -1)
            - (links[mine][:, other_rank] - between)
            - (links[other, top].view(1, -1) - between)
        )
        within = helps & (new_max <= cap)
        # Two-level choice: fewest broken links then lowest maximum (or the reverse when no swap
        # reaches the cap).
        first, second, allowed = (
            (broken, new_max, within) if bool(within.any()) else (new_max, broken, helps)
        )
        best = torch.where(allowed, first, never).min()
        key = torch.where(allowed & (first == best), second, never)
        i, j = divmod(int(key.argmin()), other.numel())
        a, b, r, delta = int(mine[i]), int(other[j]), int(other_rank[j]), int(d[i, j])
        rank_of[a], rank_of[b] = r, top
        links[:, top] += linked[:, b] - linked[:, a]
        links[:, r] += linked[:, a] - linked[:, b]
        loads[top] -= delta
        loads[r] += delta
    for r in range(world_size):
        bins[r] = (rank_of == r).nonzero().flatten().tolist()
        load[r] = int(loads[r])


def assign(
    balancer: str, work: torch.Tensor, need: torch.Tensor, world_size: int, tolerance: float = 0.05
) -> Assignment:
    """Dispatch to the balancer named ``balancer`` (one of :data:`BALANCERS`)."""
    n = work.numel()
    if balancer == "contiguous":
        return contiguous(n, world_size)
    if balancer == "zigzag":
        return zigzag(n, world_size)
    if balancer == "heap":
        return heap(work, world_size)
    if balancer == "document":
        return document_aware(work, need, world_size, tolerance)
    raise ValueError(f"balancer must be one of {', '.join(BALANCERS)}; got {balancer!r}")
