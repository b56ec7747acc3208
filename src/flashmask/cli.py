"""The ``flashmask`` command: ``show`` a mask, run the ``demo`` against SDPA, ``bench``.

Every subcommand returns an exit status from :func:`main`: 0 on success, 1 when the demo's
results disagree, 2 for a usage error (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import flashmask
from flashmask import kernels, masks
from flashmask.mask import FlashMask, TileClass, classify_tiles

__all__ = ["main"]

_EXAMPLE_ONLY = ("hash_sparse",)  # accepted by masks.example, not among the benchmark types


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flashmask`` command line with ``argv`` (default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # Everything after "bench" belongs to the benchmark's own parser.
        return _bench(argv[1:])
    if argv[:1] == ["cp-plan"]:
        # Everything after "cp-plan" belongs to the planner report's own parser.
        return _cp_plan(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmask",
        description="FlashMask attention masks for PyTorch: draw masks, compare against SDPA.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {flashmask.__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="what to run (flashmask COMMAND --help for more)"
    )

    show = sub.add_parser(
        "show",
        help="draw an example mask as text (and optionally as a PNG)",
        description="Build masks.example(NAME, SEQLEN), print it as text with a summary line, "
        "and optionally write a PNG of the dense mask with its tile classes.",
    )
    show.add_argument("name", metavar="NAME", help="mask type: " + ", ".join(_mask_names()))
    show.add_argument("--seqlen", type=_positive_int, default=64, help="key length Sk (64)")
    show.add_argument(
        "--seqlen-q",
        type=_positive_int,
        default=None,
        help="query length Sq (default: Sk); the example's indices are read at this length "
        "(FlashMask.with_seqlen_q)",
    )
    show.add_argument("--batch", type=_non_negative_int, default=0, help="batch index to draw (0)")
    show.add_argument("--head", type=_non_negative_int, default=0, help="head index to draw (0)")
    show.add_argument(
        "--block", type=_positive_int, default=16, help="tile size for the tile classes (16)"
    )
    show.add_argument(
        "--max-size",
        type=_positive_int,
        default=64,
        help="largest Sq/Sk drawn element by element; larger masks are drawn per tile (64)",
    )
    show.add_argument("--seed", type=int, default=0, help="seed of random mask types (0)")
    show.add_argument(
        "--png",
        metavar="PATH",
        default=None,
        help="also write a PNG picture with the tile classes, per element up to "
        f"{_PNG_PIXELS} rows/columns and per tile beyond (needs matplotlib: "
        "pip install 'flashmask[plots]')",
    )
    show.set_defaults(run=_show)

    demo = sub.add_parser(
        "demo",
        help="packed SFT on a tiny Llama: flashmask vs SDPA with a dense mask",
        description="Train a tiny randomly initialised Llama for a few steps on packed random "
        "documents twice, with attn_implementation='flashmask' (causal-document FlashMask) and "
        "with 'sdpa' (the same mask as a dense 4-D boolean tensor), from the same weights on the "
        "same batches: loss of every step, step time and peak memory of both (needs "
        "transformers). --attention-only compares the attention op alone instead "
        "(flashmask_attention vs scaled_dot_product_attention: outputs, gradients, time).",
    )
    demo.add_argument(
        "--seqlen",
        type=_positive_int,
        default=None,
        help="packed sequence length (default: 8192 on CUDA, 1024 on CPU; attention only: "
        "4096 on CUDA, 2048 on CPU)",
    )
    demo.add_argument("--steps", type=_positive_int, default=4, help="training steps (4)")
    demo.add_argument("--rows", type=_positive_int, default=2, help="packed rows per step (2)")
    demo.add_argument(
        "--device", default="auto", help="auto (CUDA when available, else CPU), cpu or cuda[:N]"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of documents, inputs, weights")
    demo.add_argument(
        "--attention-only",
        action="store_true",
        help="compare the attention op alone (no transformers needed)",
    )
    demo.add_argument("--heads", type=_positive_int, default=8, help="attention only: heads (8)")
    demo.add_argument(
        "--head-dim", type=_positive_int, default=64, help="attention only: head dimension (64)"
    )
    demo.add_argument(
        "--repeats", type=_positive_int, default=3, help="attention only: timed runs (3)"
    )
    demo.set_defaults(run=_demo)

    sub.add_parser(
        "bench",
        help="run the benchmark (arguments go to flashmask.bench; see flashmask bench --help)",
        add_help=False,
    )
    sub.add_parser(
        "cp-plan",
        help="context-parallel planner report for a mask (see flashmask cp-plan --help)",
        add_help=False,
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _mask_names() -> tuple[str, ...]:
    return (*getattr(masks, "MASK_TYPES", ()), *_EXAMPLE_ONLY)


def _error(command: str, message: str) -> int:
    print(f"flashmask {command}: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- show
def _show(args: argparse.Namespace) -> int:
    names = _mask_names()
    if args.name not in names:
        return _error("show", f"unknown mask {args.name!r}; valid names: {', '.join(names)}")
    generator = torch.Generator().manual_seed(args.seed)
    mask = masks.example(
        args.name,
        args.seqlen,
        batch_size=args.batch + 1,
        num_heads=args.head + 1,
        generator=generator,
    )
    if args.batch >= mask.batch_size:
        return _error("show", f"--batch {args.batch} is out of range for {mask!r}")
    # A mask with one head (Hm = 1) is shared by every head.
    head = args.head if mask.num_heads > 1 else 0
    if head >= mask.num_heads:
        return _error("show", f"--head {args.head} is out of range for {mask!r}")
    if args.png is not None and not _has_matplotlib():
        return _error("show", "--png needs matplotlib: pip install 'flashmask[plots]'")
    seqlen_q = args.seqlen_q or mask.seqlen_k
    # The examples are built for Sq = Sk; --seqlen-q reads the same indices at another length.
    mask = mask.with_seqlen_q(seqlen_q)

    print(mask.to_string(seqlen_q, batch=args.batch, head=head, max_size=args.max_size))
    summary = _summary(args.name, mask, seqlen_q, args.block)
    if mask.batch_size > 1 or mask.num_heads > 1:
        summary += f" | drawn: batch {args.batch}, head {head}"
    print(summary)
    if args.png is not None:
        _write_png(args.png, args.name, mask, seqlen_q, args.batch, head, args.block)
        print(f"wrote {args.png}")
    return 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# Tile classes held at a time while counting them (int8 plus a few boolean intermediates each):
# the summary of a long mask with small tiles is counted in bounded memory.
_TILES_PER_CHUNK = 1 << 22


def _tile_counts(mask: FlashMask, seqlen_q: int, block: int) -> tuple[int, int, int]:
    """``(skipped, partial, total)`` tiles of ``block x block``, counted over chunks of query
    tiles."""
    summary = mask.block_summary(block, seqlen_q)
    row_tiles = -(-seqlen_q // block)
    per_chunk = max(
        1, _TILES_PER_CHUNK // (mask.batch_size * mask.num_heads * -(-mask.seqlen_k // block))
    )
    skipped = partial = 0
    for start in range(0, row_tiles, per_chunk):
        rows = range(start, min(row_tiles, start + per_chunk))
        classes = classify_tiles(
            summary, mask.causal, seqlen_q, mask.seqlen_k, block, block, row_tiles=rows
        )
        skipped += int((classes == TileClass.SKIP).sum())
        partial += int((classes == TileClass.PARTIAL).sum())
    total = mask.batch_size * mask.num_heads * row_tiles * -(-mask.seqlen_k // block)
    return skipped, partial, total


def _summary(name: str, mask: FlashMask, seqlen_q: int, block: int) -> str:
    skipped, partial, total = _tile_counts(mask, seqlen_q, block)
    counts = {TileClass.SKIP: skipped, TileClass.PARTIAL: partial}
    dense_bytes = mask.batch_size * mask.num_heads * seqlen_q * mask.seqlen_k
    return (
        f"{name}: causal={mask.causal} C={mask.bounds} Sq={seqlen_q} Sk={mask.seqlen_k} "
        f"B={mask.batch_size} Hm={mask.num_heads} | {mask.nbytes} bytes "
        f"(dense bool mask: {dense_bytes} bytes) | {block}x{block} tiles: "
        f"{counts[TileClass.SKIP]}/{total} skipped ({counts[TileClass.SKIP] / total:.1%}), "
        f"{counts[TileClass.PARTIAL]} partial, "
        f"{total - counts[TileClass.SKIP] - counts[TileClass.PARTIAL]} unmasked"
    )


# Colours of (tile class, element visible); a skipped tile has no visible element and an
# unmasked tile no masked one. Drawn per tile, a partial tile has the one colour of its class.
_TILE_COLOURS = {
    "skipped tile (fully masked)": "#d9d9d9",
    "partial tile: masked element": "#fde0b6",
    "partial tile: visible element": "#e8870e",
    "unmasked tile (nothing masked)": "#3b75af",
}
_PER_TILE_COLOURS = {
    "skipped tile (fully masked)": "#d9d9d9",
    "partial tile (some elements masked)": "#e8870e",
    "unmasked tile (nothing masked)": "#3b75af",
}
# Largest Sq or Sk drawn element by element; beyond it the PNG has one pixel per tile, with
# tiles large enough that the image stays within _PNG_PIXELS x _PNG_PIXELS (1 byte each).
_PNG_PIXELS = 1024


def png_image(
    mask: FlashMask, seqlen_q: int, batch: int, head: int, block: int
) -> tuple[torch.Tensor, int]:
    """The picture ``flashmask show --png`` draws of one (batch, head) slice: ``(image, tile)``.

    Up to :data:`_PNG_PIXELS` rows and columns, ``image`` is uint8 ``[Sq, Sk]`` with one pixel
    per element: 0 skipped tile, 1 / 2 masked / visible element of a partial tile, 3 unmasked
    tile (``tile = 1``, tiles of ``block``). Beyond, it is uint8 ``[ceil(Sq / tile),
    ceil(Sk / tile)]`` with one pixel per ``tile x tile`` tile (``tile`` the smallest multiple of
    ``block`` that keeps both sides within :data:`_PNG_PIXELS`): 0 skipped, 2 partial,
    3 unmasked. Memory is O(Sk + pixels) at any length.
    """
    one = mask.select(batch, head)
    sq, sk = seqlen_q, mask.seqlen_k
    if max(sq, sk) <= _PNG_PIXELS:
        visible = one.to_dense(sq)[0, 0].cpu()
        classes = one.classify_tiles(block, block, sq)[0, 0].cpu()
        per_element = classes.repeat_interleave(block, 0).repeat_interleave(block, 1)[:sq, :sk]
        image = torch.where(
            per_element == TileClass.PARTIAL,
            1 + visible.to(torch.uint8),
            torch.where(per_element == TileClass.SKIP, 0, 3),
        )
        return image.to(torch.uint8), 1
    tile = block * -(-max(sq, sk) // (_PNG_PIXELS * block))
    classes = one.classify_tiles(tile, tile, sq)[0, 0].cpu()
    image = torch.where(
        classes == TileClass.PARTIAL, 2, torch.where(classes == TileClass.SKIP, 0, 3)
    )
    return image.to(torch.uint8), tile


def _write_png(
    path: str, name: str, mask: FlashMask, seqlen_q: int, batch: int, head: int, block: int
) -> None:
    import matplotlib  # lazily: only the PNG path needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    image, tile = png_image(mask, seqlen_q, batch, head, block)
    sq, sk = seqlen_q, mask.seqlen_k
    size = 6.0
    fig, ax = plt.subplots(figsize=(size * min(1.0, sk / sq) + 2.8, size * min(1.0, sq / sk)))
    ax.imshow(
        image.numpy(),
        cmap=ListedColormap(list(_TILE_COLOURS.values())),
        vmin=-0.5,
        vmax=3.5,
        interpolation="nearest",
        extent=(0, sk, sq, 0),
    )
    drawn = block if tile == 1 else tile
    if max(sq, sk) // drawn <= 128:
        for r in range(drawn, sq, drawn):
            ax.axhline(r, color="white", linewidth=0.6)
        for c in range(drawn, sk, drawn):
            ax.axvline(c, color="white", linewidth=0.6)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    how = f"{block}x{block} tiles" if tile == 1 else f"drawn per {tile}x{tile} tile"
    ax.set_title(f"{name} (causal={mask.causal}, C={mask.bounds}), {how}")
    colours = _TILE_COLOURS if tile == 1 else _PER_TILE_COLOURS
    handles = [Patch(facecolor=c, edgecolor="grey", label=label) for label, c in colours.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------- demo
# Largest allowed max |flashmask - SDPA|, relative to the largest |SDPA value|. For bf16 two
# correct kernels differ by a few units in the last place (2^-8 relative); a masking bug gives
# differences of the order of the values themselves.
_DEMO_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _demo(args: argparse.Namespace) -> int:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            return _error("demo", f"invalid --device {args.device!r}: {e}")
        if device.type == "cuda" and not torch.cuda.is_available():
            return _error("demo", "--device cuda was asked for but CUDA is not available")
    if args.attention_only:
        return _demo_attention(args, device)
    try:
        from flashmask.integrations.demo import run_demo
    except ImportError as e:
        return _error(
            "demo",
            f"the training demo needs transformers ({e}); pip install 'flashmask[integrations]' "
            "or run flashmask demo --attention-only",
        )
    seqlen = args.seqlen or (8192 if device.type == "cuda" else 1024)
    return run_demo(seqlen=seqlen, rows=args.rows, steps=args.steps, device=device, seed=args.seed)


def _demo_attention(args: argparse.Namespace, device: torch.device) -> int:
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    seqlen = args.seqlen or (4096 if on_cuda else 2048)
    heads, head_dim = args.heads, args.head_dim

    generator = torch.Generator().manual_seed(args.seed)
    doc_lens = _random_doc_lens(seqlen, generator)
    mask = masks.causal_document(doc_lens, seqlen, device=device)
    dense = mask.to_dense()  # [1, 1, S, S], True = may attend

    q, k, v, dout = (
        torch.randn(1, seqlen, heads, head_dim, generator=generator).to(device, dtype)
        for _ in range(4)
    )

    def run_flashmask(q, k, v):
        return flashmask.flashmask_attention(q, k, v, mask)

    def run_sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=dense
        )
        return out.transpose(1, 2)  # back to [B, S, H, D]

    dev_name = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    path = "Triton kernels" if kernels.supports(q, k, v) else "chunked PyTorch reference"
    print(
        f"flashmask demo: {len(doc_lens)} documents packed into seqlen {seqlen}, causal-document "
        f"mask, {heads} heads, head_dim {head_dim}, {dtype} on {device} ({dev_name}); "
        f"flashmask runs the {path}",
        flush=True,
    )
    _progress("forward + backward: flashmask_attention")
    out_fm, grads_fm = _forward_backward(run_flashmask, q, k, v, dout)
    _progress("forward + backward: SDPA with the dense mask")
    out_ref, grads_ref = _forward_backward(run_sdpa, q, k, v, dout)
    out_diff = _max_abs(out_fm.float() - out_ref.float())
    grad_diff = max(
        _max_abs(a.float() - b.float()) for a, b in zip(grads_fm, grads_ref, strict=True)
    )
    rtol = _DEMO_RTOL[dtype]
    out_tol = rtol * _max_abs(out_ref.float())
    grad_tol = rtol * max(_max_abs(g.float()) for g in grads_ref)
    ok = out_diff <= out_tol and grad_diff <= grad_tol

    runs = f"{args.repeats + 1} runs, the first a warm-up"
    _progress(f"timing flashmask_attention ({runs})")
    time_fm = _median_time(run_flashmask, q, k, v, dout, args.repeats, on_cuda)
    _progress(f"timing SDPA with the dense mask ({runs})")
    time_ref = _median_time(run_sdpa, q, k, v, dout, args.repeats, on_cuda)

    dense_bytes = dense.numel() * dense.element_size()
    rule = f"tolerance ({rtol:g} x max |SDPA|)"
    rows = [
        ("", "flashmask", "SDPA + dense mask"),
        ("mask", f"{mask.nbytes:,} B (O(N))", f"{dense_bytes:,} B (O(N^2))"),
        (f"fwd+bwd time (median of {args.repeats})", _ms(time_fm), _ms(time_ref)),
        ("max |out diff|", _sci(out_diff), f"{rule}: {_sci(out_tol)}"),
        ("max |dq, dk, dv diff|", _sci(grad_diff), f"{rule}: {_sci(grad_tol)}"),
    ]
    print()
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, width, strict=True)).rstrip())
    print("PASS" if ok else "FAIL: flashmask_attention and SDPA disagree beyond the tolerance")
    return 0 if ok else 1


def _progress(message: str) -> None:
    """One line of progress, flushed at once (a long CPU run otherwise prints nothing)."""
    print(f"  ... {message}", flush=True)


def _random_doc_lens(seqlen: int, generator: torch.Generator) -> list[int]:
    """Document lengths between ``seqlen / 16`` and ``seqlen / 4`` that add up to ``seqlen``."""
    low, high = max(1, seqlen // 16), max(1, seqlen // 4)
    lens: list[int] = []
    remaining = seqlen
    while remaining > 0:
        n = int(torch.randint(low, high + 1, (1,), generator=generator))
        lens.append(min(n, remaining))
        remaining -= lens[-1]
    return lens


def _forward_backward(
    fn: Callable[..., torch.Tensor], q, k, v, dout
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _median_time(fn: Callable[..., torch.Tensor], q, k, v, dout, repeats: int, sync: bool):
    times = []
    for i in range(repeats + 1):  # the first run is a warm-up
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _forward_backward(fn, q, k, v, dout)
        if sync:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_abs(x: torch.Tensor) -> float:
    return x.abs().max().item()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _sci(x: float) -> str:
    return f"{x:.2e}"


# ---------------------------------------------------------------------- bench
def _bench(argv: list[str]) -> int:
    # --decode selects the decode-step and chunked-prefill benchmark, with its own options.
    decode = "--decode" in argv
    try:
        if decode:
            bench = importlib.import_module("flashmask.bench_decode")
        else:
            bench = importlib.import_module("flashmask.bench")
    except ModuleNotFoundError as e:
        if e.name not in ("flashmask.bench", "flashmask.bench_decode"):
            raise
        return _error("bench", f"the benchmark module {e.name} is not available yet")
    status = bench.main([a for a in argv if a != "--decode"])
    return 0 if status is None else int(status)


# ---------------------------------------------------------------------- cp-plan
def _cp_plan(argv: list[str]) -> int:
    from flashmask.distributed import report  # lazily: only this command needs it

    return report.main(argv)
