"""Context parallelism for FlashMask attention on ``torch.distributed``.

One long sequence is split into chunks spread over the ranks of a process group; each rank keeps
the queries of its chunks and receives the key/value chunks its queries see. The global mask is
O(N), so every rank holds it and derives everything else (its local masks, which chunks go
where) by arithmetic, with no mask traffic.

>>> plan = make_plan(mask, world_size, chunk_size=1024, balancer="document")  # doctest: +SKIP
>>> q, k, v = (dispatch(t, plan) for t in (q_full, k_full, v_full))   # [B, S_local, H, D]
>>> out = context_parallel_attention(q, k, v, plan, mode="pruned")     # exact, autograd
>>> out_full = undispatch(out, plan)                                   # [B, S, H, D]

``docs/context_parallel.md`` describes the design and the planner's numbers.
"""

from flashmask.distributed.attention import context_parallel_attention, merge_partials
from flashmask.distributed.balance import BALANCERS
from flashmask.distributed.dispatch import dispatch, undispatch
from flashmask.distributed.exchange import CommunicationLog, track_communication
from flashmask.distributed.localize import local_mask, localize_rows, normal_form
from flashmask.distributed.plan import MODES, WORKLOADS, ContextParallelPlan, make_plan
from flashmask.distributed.workload import pair_counts, tile_counts

__all__ = [
    "BALANCERS",
    "MODES",
    "WORKLOADS",
    "CommunicationLog",
    "ContextParallelPlan",
    "context_parallel_attention",
    "dispatch",
    "local_mask",
    "localize_rows",
    "make_plan",
    "merge_partials",
    "normal_form",
    "pair_counts",
    "tile_counts",
    "track_communication",
    "undispatch",
]
