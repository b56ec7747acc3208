"""Key/value exchange between ranks and the reverse exchange of their gradients.

Both exchanges move *token rows*: a rank packs its local keys and values as ``[S_local, F]``
(``F = B * Hk * (D + Dv)``) so one collective carries both. Each exchange is started
asynchronously (``async_op=True``) and waited on later, so the caller computes the attention of
its own chunks while the remote chunks are in flight.

* :class:`AllGatherExchange`: ``all_gather_single`` of every rank's rows; the rank then keeps the
  rows of the chunks it needs. Backward: ``reduce_scatter_single`` (sum) of the gradient rows,
  in float32 for fp16/bf16 inputs so that the collective's sum does not round at every step.
* :class:`PrunedExchange`: ``all_to_all_single`` with uneven splits (MagiAttention's GroupCast):
  chunk ``c`` goes from its owner to rank ``r`` only when ``need[r, c]``. Backward: the same
  collective in reverse (GroupReduce); the owner adds the returned partial gradients in float32.
  Partial gradients travel in the input dtype: they are kernel outputs already rounded to it.

Every started exchange adds its traffic to the logs opened with :func:`track_communication`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "AllGatherExchange",
    "CommunicationLog",
    "Pending",
    "PrunedExchange",
    "track_communication",
]

# torch 2.13 renamed the tensor collectives (the old names warn); torch >= 2.4 is supported.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommunicationLog:
    """Traffic this rank *sent* to other ranks, per direction.

    ``forward_*`` count key/value rows, ``backward_*`` their gradients. Chunks count one per
    (chunk, destination) pair; bytes are what the collective moves on the network, logically
    (an all-gather sends its input to ``P - 1`` ranks).
    """

    forward_bytes: int = 0
    forward_chunks: int = 0
    backward_bytes: int = 0
    backward_chunks: int = 0
    records: list[tuple[str, str, int, int]] = field(default_factory=list)

    def add(self, mode: str, direction: str, chunks: int, nbytes: int) -> None:
        self.records.append((mode, direction, chunks, nbytes))
        if direction == "forward":
            self.forward_chunks += chunks
            self.forward_bytes += nbytes
        else:
            self.backward_chunks += chunks
            self.backward_bytes += nbytes


_LOGS: list[CommunicationLog] = []


@contextlib.contextmanager
def track_communication() -> Iterator[CommunicationLog]:
    """Record the traffic of every exchange started inside the ``with`` block.

    >>> with track_communication() as log:   # doctest: +SKIP
    ...     out = context_parallel_attention(q, k, v, plan)
    ...     out.sum().backward()
    >>> log.forward_bytes, log.backward_bytes  # doctest: +SKIP
    """
    log = CommunicationLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(mode: str, direction: str, chunks: int, nbytes: int) -> None:
    for log in _LOGS:
        log.add(mode, direction, chunks, nbytes)


class Pending:
    """An exchange in flight: :meth:`wait` finishes it and returns the result.

    It holds the collective's buffers until then: on CUDA the collective runs on its own stream,
    and a buffer freed early could be handed to the compute stream while still being read.
    """

    def __init__(self, work, finish, *buffers: torch.Tensor) -> None:
        self._work = work
        self._finish = finish
        self._buffers = buffers

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        result = self._finish()
        self._buffers = ()
        return result


@dataclass(frozen=True)
class AllGatherExchange:
    """All-gather of the local rows; keep ``remote_rows`` (rows of the gathered buffer).

    Attributes:
        group: the process group.
        world_size: ``P``.
        local_tokens: ``S_local``.
        remote_rows: int64 indices into the gathered ``[P * S_local]`` rows: the tokens of the
            remote chunks this rank computes with, ascending by global position.
        chunk_size: tokens per chunk (for the chunk counts of the log).
    """

    group: dist.ProcessGroup | None
    world_size: int
    local_tokens: int
    remote_rows: torch.Tensor
    chunk_size: int

    def start(self, rows: torch.Tensor) -> Pending:
        """Start gathering ``rows`` ``[S_local, F]``; ``wait()`` gives ``[R, F]`` remote rows."""
        rows = rows.contiguous()
        gathered = rows.new_empty(self.world_size * self.local_tokens, rows.shape[1])
        work = _all_gather(gathered, rows, group=self.group, async_op=True)
        others = self.world_size - 1
        _record(
            "all_gather",
            "forward",
            others * self.local_tokens // self.chunk_size,
            others * rows.numel() * rows.element_size(),
        )
        return Pending(work, lambda: gathered.index_select(0, self.remote_rows), rows, gathered)

    def start_reverse(self, grad: torch.Tensor, accum_dtype: torch.dtype) -> Pending:
        """Start summing the remote-row gradients ``[R, F]`` into their owners.

        ``wait()`` gives this rank's ``[S_local, F]`` sum of the partials sent by every rank, in
        ``accum_dtype`` (the collective sums in that dtype).
        """
        width = grad.shape[1]
        full = grad.new_zeros(self.world_size * self.local_tokens, width, dtype=accum_dtype)
        full.index_copy_(0, self.remote_rows, grad.to(accum_dtype))
        out = full.new_empty(self.local_tokens, width)
        work = _reduce_scatter(out, full, group=self.group, async_op=True)
        others = self.world_size - 1
        _record(
            "all_gather",
            "backward",
            others * self.local_tokens // self.chunk_size,
            others * self.local_tokens * width * full.element_size(),
        )
        return Pending(work, lambda: out, full, out)


@dataclass(frozen=True)
class PrunedExchange:
    """All-to-all-v of exactly the chunks each rank needs.

    Attributes:
        group: the process group.
        local_tokens: ``S_local``.
        send_rows: int64 local row indices sent, grouped by destination rank (ascending ranks).
        send_splits: rows sent to each rank (0 for this rank).
        recv_splits: rows received from each rank (0 for this rank).
        arrival_to_sorted: int64 permutation: row ``i`` of the sorted remote rows is row
            ``arrival_to_sorted[i]`` of the received buffer (arrival order is by source rank).
        chunk_size: tokens per chunk (for the chunk counts of the log).
    """

    group: dist.ProcessGroup | None
    local_tokens: int
    send_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    arrival_to_sorted: torch.Tensor
    chunk_size: int

    def start(self, rows: torch.Tensor) -> Pending:
        """Start sending the needed chunks of ``rows`` ``[S_local, F]``; ``wait()`` gives the
        received ``[R, F]`` rows sorted by global position."""
        send = rows.index_select(0, self.send_rows)
        recv = rows.new_empty(sum(self.recv_splits), rows.shape[1])
        work = dist.all_to_all_single(
            recv, send, self.recv_splits, self.send_splits, group=self.group, async_op=True
        )
        _record(
            "pruned",
            "forward",
            send.shape[0] // self.chunk_size,
            send.numel() * send.element_size(),
        )
        return Pending(work, lambda: recv.index_select(0, self.arrival_to_sorted), send, recv)

    def start_reverse(self, grad: torch.Tensor, accum_dtype: torch.dtype) -> Pending:
        """Start returning remote-row gradients ``[R, F]`` (sorted order) to their owners.

        ``wait()`` gives this rank's ``[S_local, F]`` sum of the returned partials in
        ``accum_dtype``.
        """
        back = torch.empty_like(grad)
        back.index_copy_(0, self.arrival_to_sorted, grad)  # sorted -> arrival order
        recv = grad.new_empty(sum(self.send_splits), grad.shape[1])
        work = dist.all_to_all_single(
            recv, back, self.send_splits, self.recv_splits, group=self.group, async_op=True
        )
        _record(
            "pruned",
            "backward",
            back.shape[0] // self.chunk_size,
            back.numel() * back.element_size(),
        )

        def finish() -> torch.Tensor:
            total = grad.new_zeros(self.local_tokens, grad.shape[1], dtype=accum_dtype)
            return total.index_add_(0, self.send_rows, recv.to(accum_dtype))

        return Pending(work, finish, back, recv)
