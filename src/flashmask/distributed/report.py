"""``flashmask cp-plan``: what context parallelism would do with a mask, from the planner alone.

For one mask type (:func:`flashmask.masks.example`) and a range of world sizes, build the plan of
every balancer and report, per world size and balancer: per-rank work (visible query-key pairs),
the imbalance ``max / mean`` and the bytes each execution mode moves per attention layer
(forward keys/values + backward gradients). Nothing runs on a GPU: these are the plan's own
numbers (exact counts for the given mask), not measurements.

Bytes per token of key + value: ``B * Hk * (D + Dv) * itemsize``. The forward moves keys/values
in the input dtype in both modes; the backward returns gradients in the input dtype in ``pruned``
mode and in float32 for fp16/bf16 in ``all_gather`` mode (its reduce-scatter sums in the
collective; see :mod:`flashmask.distributed.exchange`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashmask import masks
from flashmask.distributed.balance import BALANCERS
from flashmask.distributed.plan import WORKLOADS, ContextParallelPlan, make_plan

__all__ = ["PlanRow", "main", "plan_rows", "render_markdown"]

_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
TARGET_REDUCTION = 0.50  # the target: pruned moves >= 50% fewer bytes than all_gather
TARGET_IMBALANCE = 1.10  # ... while max/mean compute stays <= 1.10 (at 8 ranks)


@dataclass(frozen=True)
class PlanRow:
    """The planner's numbers for one (world size, balancer)."""

    world_size: int
    balancer: str
    chunks_per_rank: int
    padded_seqlen: int
    rank_work: tuple[int, ...]
    imbalance: float
    all_gather_forward: int
    all_gather_backward: int
    pruned_forward: int
    pruned_backward: int
    pruned_received: tuple[int, ...]  # forward bytes received per rank, pruned mode

    @property
    def all_gather_bytes(self) -> int:
        return self.all_gather_forward + self.all_gather_backward

    @property
    def pruned_bytes(self) -> int:
        return self.pruned_forward + self.pruned_backward

    @property
    def reduction(self) -> float:
        """``1 - pruned / all_gather`` bytes (forward + backward)."""
        return 1 - self.pruned_bytes / self.all_gather_bytes if self.all_gather_bytes else 0.0

    @property
    def forward_reduction(self) -> float:
        """``1 - pruned / all_gather`` forward bytes (same dtype in both modes)."""
        if not self.all_gather_forward:
            return 0.0
        return 1 - self.pruned_forward / self.all_gather_forward


def _row(plan: ContextParallelPlan, kv_bytes: int, grad_bytes_all_gather: int) -> PlanRow:
    per_chunk = plan.chunk_size
    ag = int(plan.transfers("all_gather").sum()) * per_chunk
    pruned = plan.transfers("pruned")
    pr = int(pruned.sum()) * per_chunk
    return PlanRow(
        world_size=plan.world_size,
        balancer=plan.balancer,
        chunks_per_rank=plan.chunks_per_rank,
        padded_seqlen=plan.padded_seqlen,
        rank_work=tuple(int(x) for x in plan.rank_work),
        imbalance=plan.imbalance,
        all_gather_forward=ag * kv_bytes,
        all_gather_backward=ag * grad_bytes_all_gather,
        pruned_forward=pr * kv_bytes,
        pruned_backward=pr * kv_bytes,
        pruned_received=tuple(int(x) * per_chunk * kv_bytes for x in pruned.sum(0)),
    )


def plan_rows(
    name: str,
    seqlen: int,
    world_sizes: Sequence[int],
    *,
    balancers: Sequence[str] = BALANCERS,
    chunk_size: int = 512,
    batch_size: int = 1,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    workload: str = "pairs",
    tolerance: float = 0.05,
    seed: int = 0,
) -> list[PlanRow]:
    """Plan ``masks.example(name, seqlen)`` for every world size and balancer."""
    mask = masks.example(
        name, seqlen, batch_size=batch_size, generator=torch.Generator().manual_seed(seed)
    )
    item = _DTYPES[dtype]
    kv_bytes = batch_size * kv_heads * 2 * head_dim * item
    grad_bytes = batch_size * kv_heads * 2 * head_dim * max(item, 4)
    rows = []
    for p in world_sizes:
        for balancer in balancers:
            plan = make_plan(
                mask,
                p,
                chunk_size=chunk_size,
                balancer=balancer,
                workload=workload,
                tolerance=tolerance,
            )
            rows.append(_row(plan, kv_bytes, grad_bytes))
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def render_markdown(
    rows: Sequence[PlanRow], *, title: str, detail_world_size: int | None = None
) -> str:
    """The report: one row per (world size, balancer), per-rank detail, and the target check."""
    lines = [
        title,
        "",
        "Planner numbers (exact counts from the mask), not GPU measurements. Work = visible "
        "(query, key) pairs; bytes = network traffic of all ranks per attention layer: forward "
        "keys/values, backward gradients (float32 in all_gather mode for 16-bit inputs, the "
        'input dtype in pruned mode). "Saves" = 1 - pruned / all_gather bytes; the forward '
        "column compares equal dtypes and is the one the targets are checked on.",
        "",
        "| ranks | balancer | chunks/rank | imbalance (max/mean) | max rank work (M pairs) | "
        "all_gather GiB fwd / bwd | pruned GiB fwd / bwd | pruned saves (fwd) | "
        "pruned saves (fwd+bwd) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.world_size} | {r.balancer} | {r.chunks_per_rank} | {r.imbalance:.3f} | "
            f"{max(r.rank_work) / 1e6:,.1f} | "
            f"{_gib(r.all_gather_forward)} / {_gib(r.all_gather_backward)} | "
            f"{_gib(r.pruned_forward)} / {_gib(r.pruned_backward)} | "
            f"{r.forward_reduction:.1%} | {r.reduction:.1%} |"
        )
    detail = [r for r in rows if r.world_size == detail_world_size]
    if detail:
        lines += [
            "",
            f"Per-rank work at {detail_world_size} ranks (work / mean work; pruned forward MiB "
            "received):",
            "",
            "| balancer | " + " | ".join(f"rank {i}" for i in range(detail_world_size)) + " |",
            "|---|" + "---:|" * detail_world_size,
        ]
        for r in detail:
            mean = sum(r.rank_work) / len(r.rank_work) or 1
            cells = [
                f"{w / mean:.2f} ({b / 2**20:,.0f})"
                for w, b in zip(r.rank_work, r.pruned_received, strict=True)
            ]
            lines.append(f"| {r.balancer} | " + " | ".join(cells) + " |")
        lines += ["", _target_check(detail, detail_world_size)]
    return "\n".join(lines) + "\n"


def _target_check(rows: Sequence[PlanRow], world_size: int) -> str:
    parts = []
    for r in rows:
        ok = r.forward_reduction >= TARGET_REDUCTION and r.imbalance <= TARGET_IMBALANCE
        parts.append(
            f"- {r.balancer}: pruned moves {r.forward_reduction:.1%} fewer bytes than all_gather "
            f"(forward, equal dtypes; fwd+bwd: {r.reduction:.1%}), imbalance {r.imbalance:.3f} "
            f"-> {'meets' if ok else 'misses'} the targets"
        )
    head = (
        f"Targets at {world_size} ranks (pruned >= {TARGET_REDUCTION:.0%} fewer bytes than "
        f"all_gather and imbalance <= {TARGET_IMBALANCE:.2f}):"
    )
    return "\n".join([head, "", *parts])


def write_png(rows: Sequence[PlanRow], path: str, title: str) -> None:
    """Imbalance and pruned/all_gather bytes against the world size, one line per balancer."""
    import matplotlib  # lazily: only the PNG needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    balancers = list(dict.fromkeys(r.balancer for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for b in balancers:
        mine = [r for r in rows if r.balancer == b]
        ps = [r.world_size for r in mine]
        ax1.plot(ps, [r.imbalance for r in mine], marker="o", label=b)
        ax2.plot(ps, [1 - r.forward_reduction for r in mine], marker="o", label=b)
    ax1.axhline(TARGET_IMBALANCE, color="grey", linestyle="--", linewidth=0.8)
    ax2.axhline(1 - TARGET_REDUCTION, color="grey", linestyle="--", linewidth=0.8)
    for ax, label in (
        (ax1, "compute imbalance (max / mean)"),
        (ax2, "pruned / all_gather bytes (forward)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax2.set_ylim(bottom=0)
    ax1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmask cp-plan",
        description="Plan context parallelism for an example mask: per-rank work, imbalance "
        "and bytes moved per execution mode and balancer (planner numbers, not measurements).",
    )
    parser.add_argument(
        "name",
        metavar="NAME",
        help="mask type: one of flashmask.masks.MASK_TYPES or hash_sparse (masks.example)",
    )
    parser.add_argument(
        "--seqlen", type=_positive_int, default=131072, help="tokens in the sequence (131072)"
    )
    parser.add_argument(
        "--world-sizes",
        type=_int_list,
        default=[2, 4, 8, 16, 32, 64],
        help="comma-separated numbers of ranks to plan for (2,4,8,16,32,64)",
    )
    parser.add_argument(
        "--chunk-size", type=_positive_int, default=512, help="tokens per planner chunk (512)"
    )
    parser.add_argument(
        "--balancers",
        type=_name_list,
        default=list(BALANCERS),
        help=f"comma-separated balancers to compare ({','.join(BALANCERS)})",
    )
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size (1)")
    parser.add_argument("--kv-heads", type=_positive_int, default=8, help="key/value heads (8)")
    parser.add_argument(
        "--head-dim", type=_positive_int, default=128, help="head dimension D = Dv (128)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="bfloat16",
        help="dtype of keys and values, for the bytes moved (bfloat16)",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="pairs",
        help="what the balancers even out: visible (query, key) pairs or unskipped tiles (pairs)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="imbalance above the mean rank work the document balancer accepts (0.05 = 5%%)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random mask draws (0)")
    parser.add_argument(
        "--detail", type=_positive_int, default=8, help="world size of the per-rank table (8)"
    )
    parser.add_argument(
        "--png", metavar="PATH", default=None, help="also write a PNG plot (needs matplotlib)"
    )
    parser.add_argument("--output", metavar="PATH", default=None, help="also write the Markdown")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text}")
    return values


def _name_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BALANCERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown balancer(s) {', '.join(bad) or text!r}; valid: {', '.join(BALANCERS)}"
        )
    return names


def _error(message: str) -> int:
    print(f"flashmask cp-plan: error: {message}", file=sys.stderr)
    return 2


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flashmask cp-plan`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    valid = (*masks.MASK_TYPES, "hash_sparse")
    if args.name not in valid:
        return _error(f"unknown mask {args.name!r}; valid names: {', '.join(valid)}")
    if args.png and not _has_matplotlib():
        return _error("--png needs matplotlib: pip install 'flashmask[plots]'")
    rows = plan_rows(
        args.name,
        args.seqlen,
        args.world_sizes,
        balancers=args.balancers,
        chunk_size=args.chunk_size,
        batch_size=args.batch,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        workload=args.workload,
        tolerance=args.tolerance,
        seed=args.seed,
    )
    title = (
        f"## Context-parallel plan: {args.name}, {args.seqlen:,} tokens, chunk {args.chunk_size}, "
        f"B={args.batch}, Hk={args.kv_heads}, D={args.head_dim}, {args.dtype}"
    )
    text = render_markdown(rows, title=title, detail_world_size=args.detail)
    print(text, end="")
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}")
    if args.png:
        write_png(rows, args.png, f"{args.name}, {args.seqlen:,} tokens, chunk {args.chunk_size}")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
