"""Decode throughput of a ~1B Llama-shaped model with and without CUDA graphs.

The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 query and 8 key/value heads of 64,
MLP 8192, vocabulary 128256, tied embeddings: 1.24B parameters), built from its config with
random weights in bf16 on one CUDA GPU. For each batch size (1 and 8), prompts of
``--prompt-len`` random tokens and ``--new-tokens`` greedy tokens, per attention backend
(``flashmask``, ``sdpa``; the same weights) it measures:

* ``generate``: ``model.generate(..., cache_implementation="static", disable_compile=True)``,
  transformers' eager loop over a static KV cache;
* ``generate+compile``: the same with transformers' own graph path, ``compile_config=
  CompileConfig(fullgraph=True, mode="reduce-overhead")`` (the decode step compiled by inductor
  and run as a CUDA graph by cudagraph trees; the prefill stays eager). transformers turns
  ``fullgraph`` off for every backend whose name contains "flash" (its FlashAttention check),
  so for ``flashmask`` the row reports the setting it really ran with;
* ``static step``: the script's own decode step (:class:`StaticDecoder`): a ``StaticCache``,
  static token / position tensors, greedy argmax and the token bookkeeping all on the device;
  eager, one Python call per token;
* ``static step+graph``: that step captured once with ``torch.cuda.graph`` (warm-up on a side
  stream, then capture) and replayed per token. The replay loop runs under
  ``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation anywhere in it raises.
  The host time of the loop is reported beside its GPU time as a second witness (a loop that
  never waits for the GPU finishes enqueueing long before the GPU finishes);
* ``stream_generate``: :func:`flashmask.integrations.streaming.stream_generate` (growing
  per-layer caches with a position record; no layer policy), and for ``flashmask`` also with
  a sliding-window policy of ``--window`` keys and ``--sinks`` sink tokens (a bounded cache).
  Eager only: its caches grow with ``torch.cat`` and compact themselves past the window, so
  the key count (every attention shape) changes per token and the masks are rebuilt in Python
  from the position record; no fixed decode step exists to capture. The static-cache rows
  are the graph comparison.

Every row checks its greedy tokens against the eager ``generate`` of the same backend and
batch (``match``: the fraction of equal tokens, and the first differing step). For each eager
path the host synchronisations per decode step are counted under
``torch.cuda.set_sync_debug_mode("warn")`` and their source lines reported, which shows any
sync that the flashmask path itself adds at decode.

Results: ``<out>.json`` (metadata: GPU, versions, date, git commit, command; one object per
row) and ``<out>.md`` (tables, notes, command), rewritten after every row. Parts that would
start after ``--budget-s`` seconds are skipped and marked so.

Usage, from the repository root::

    PYTHONPATH=src python benchmarks/decode_graphs.py --out benchmarks/results/decode_graphs
    PYTHONPATH=src python benchmarks/decode_graphs.py --quick --out /tmp/decode_graphs
    PYTHONPATH=src python benchmarks/decode_graphs.py --smoke --out /tmp/dg  # tiny, CPU

Without CUDA (and without ``--smoke``) it exits with status 2. Needs transformers
(``pip install -e '.[integrations]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import transformers
except ImportError:  # pragma: no cover - depends on the machine
    sys.exit("benchmarks/decode_graphs.py needs transformers: pip install -e '.[integrations]'")

import flashmask
import flashmask.integrations.transformers  # registers attn_implementation="flashmask"
from flashmask.integrations.policy import apply_flashmask, remove_flashmask
from flashmask.integrations.streaming import stream_generate

BACKENDS = ("flashmask", "sdpa")
METHODS = (
    "generate",
    "static step",
    "static step+graph",
    "stream_generate",
    "stream_generate window",
    "generate+compile",
)
# Llama-3.2-1B's shape (random weights).
MODEL_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}
MODEL_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}
# Token ids below this are never drawn for prompts (bos, eos and pad of Llama configs).
FIRST_PROMPT_TOKEN = 3
# Eager decode steps run before capture, on a side stream (kernel compilation, allocator).
CAPTURE_WARMUP = 2
SYNC_MESSAGE = "synchronizing CUDA operation"
# A generate+compile row starts only with this much of the budget left (inductor compiles the
# 16-layer decode step in tens of seconds).
COMPILE_RESERVE_S = 45.0
EXIT_NO_CUDA = 2


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; defaults depend on ``--quick`` and ``--smoke``.

    Raises:
        SystemExit: status 2 (argparse's) with a message naming the bad argument.
    """
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes OUT.json and OUT.md; exits 2 without CUDA unless --smoke. Outside a git "
        "checkout, set GIT_COMMIT to record the commit measured.",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results/decode_graphs",
        help="output path without suffix: writes OUT.json and OUT.md",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="64 new tokens, compile rows at the first batch size only, 150 s budget",
    )
    p.add_argument("--smoke", action="store_true", help="tiny float32 model on CPU (no graphs)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (1 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (512)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per row (256)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="what to measure"
    )
    p.add_argument(
        "--compile-batches",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the generate+compile rows (default: all; --quick: the first)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed repetitions, median (1)")
    p.add_argument("--window", type=int, default=None, help="stream window keys (256)")
    p.add_argument("--sinks", type=int, default=4, help="stream sink tokens (4)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (128256)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the rows that would start after this many seconds (210; --quick 150)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quick, smoke = args.quick, args.smoke
    defaults = {
        "batches": [1, 2] if smoke else [1, 8],
        "prompt_len": 24 if smoke else 512,
        "new_tokens": 8 if smoke else (64 if quick else 256),
        "reps": 1,
        "window": 8 if smoke else 256,
        "budget_s": 150.0 if quick else 210.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compile_batches is None:
        args.compile_batches = args.batches[:1] if quick else list(args.batches)
    for name in ("batches", "compile_batches"):
        values = getattr(args, name)
        if any(b < 1 for b in values):
            p.error(f"--{name.replace('_', '-')} must be positive integers, got {values}")
        setattr(args, name, list(dict.fromkeys(values)))
    if args.prompt_len < 1:
        p.error(f"--prompt-len must be at least 1, got {args.prompt_len}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (a prefill token and a decode step), got "
                f"{args.new_tokens}")  # fmt: skip
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    if args.window < 1:
        p.error(f"--window must be at least 1, got {args.window}")
    if args.sinks < 0:
        p.error(f"--sinks must be at least 0, got {args.sinks}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    config = dict(MODEL_TINY if smoke else MODEL_1B)
    if args.vocab is not None:
        if args.vocab <= FIRST_PROMPT_TOKEN:
            p.error(f"--vocab must be larger than {FIRST_PROMPT_TOKEN}, got {args.vocab}")
        config["vocab_size"] = args.vocab
    args.config = config
    args.backends = list(dict.fromkeys(args.backends))
    args.methods = [m for m in METHODS if m in args.methods]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (2 without CUDA unless ``--smoke``)."""
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "decode_graphs.py: CUDA is not available: this benchmark needs one CUDA GPU "
            "(--smoke runs a tiny model on CPU to check the script)",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Suffixes appended, not substituted: an --out with a dot in its name keeps it.
    json_path, md_path = Path(f"{out}.json"), Path(f"{out}.md")
    started = time.monotonic()
    deadline = started + args.budget_s
    model = build_model(args.config, device, dtype, args.seed, args.prompt_len + args.new_tokens)
    report: dict[str, Any] = {"meta": metadata(args, model, device, dtype, argv), "rows": []}

    def save() -> None:
        report["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        md_path.write_text(markdown(report))

    save()
    runner = Runner(model, args, device, deadline, report, save)
    for batch in args.batches:
        runner.batch(batch)
    for batch in args.compile_batches if "generate+compile" in args.methods else []:
        for backend in args.backends:
            runner.compiled(batch, backend)
    save()
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    print(markdown(report))
    return 0


# ---------------------------------------------------------------------- model and inputs
def build_model(
    config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int, max_len: int
) -> Any:
    """A ``LlamaForCausalLM`` of ``config`` with random weights (seed ``seed``), in ``dtype`` on
    ``device``, eval mode, flashmask attention; no EOS (random weights would stop rows at
    random), pad id 0."""
    llama = transformers.LlamaConfig(**config, max_position_embeddings=max(2048, max_len))
    torch.manual_seed(seed)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            llama, attn_implementation="flashmask", dtype=dtype
        )
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(batch: int, length: int, vocab: int, seed: int, device: torch.device):
    """Random prompts, int64 ``[batch, length]`` of ids in ``[FIRST_PROMPT_TOKEN, vocab)``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_PROMPT_TOKEN, vocab, (batch, length), generator=generator)
    return ids.to(device)


def set_backend(model: Any, backend: str) -> None:
    if model.config._attn_implementation != backend:
        model.set_attn_implementation(backend)


def cache_argument(model: Any) -> str:
    """The forward's cache keyword: transformers renamed ``past_key_values`` to ``cache`` (5.2x)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def generate_tokens(
    model: Any,
    input_ids: torch.Tensor,
    new_tokens: int,
    cache: Any = None,
    compile_config: Any = None,
) -> torch.Tensor:
    """Greedy ``generate`` over a static cache: the new tokens, int64 ``[B, new_tokens]``.

    ``cache``: a ``StaticCache`` to reuse (reset here first; it must hold at least
    ``S + new_tokens - 1`` slots); ``None``: ``cache_implementation="static"`` (a new one of
    ``S + new_tokens - 1`` slots). Reusing one keeps every call's shapes and cache addresses,
    so transformers' CUDA graphs are recorded once, not per call. Eager (``disable_compile``:
    transformers would otherwise compile the decode step of a static cache on CUDA by itself)
    unless ``compile_config`` is given."""
    if cache is None:
        cache_kwargs: dict[str, Any] = {"cache_implementation": "static"}
    else:
        cache.reset()
        cache_kwargs = {cache_argument(model): cache}
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            disable_compile=compile_config is None,
            compile_config=compile_config,
            **cache_kwargs,
        )
    return output[:, input_ids.shape[1] :]


def static_cache(model: Any, max_cache_len: int) -> Any:
    """A transformers ``StaticCache`` of ``max_cache_len`` slots for ``model``."""
    return transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)


# ---------------------------------------------------------------------- the static decode step
class StaticDecoder:
    """Greedy decoding over a transformers ``StaticCache`` with one fixed-shape decode step.

    The step (:meth:`step`) reads and writes only tensors whose address never changes: the
    current tokens ``ids`` int64 ``[B, 1]``, their positions ``positions`` int64 ``[B, 1]``, the
    output buffer ``tokens`` int64 ``[B, N + CAPTURE_WARMUP]``, the column it writes next
    ``index`` int64 ``[1]``, and the cache's keys, values and length tensors (transformers'
    ``StaticLayer.cumulative_length``, which its ``update`` advances in place). One step runs the
    model on ``ids``, takes the greedy argmax, writes it to ``tokens[:, index]`` and into
    ``ids``, and advances ``positions`` and ``index``: no value is read on the host, so the step
    can be captured once (:meth:`capture`) and replayed per token.

    The cache holds ``max_cache_len`` slots (default ``P + N - 1``, what ``generate`` allocates
    for ``N`` new tokens, so both run the attention kernels on the same shapes).

    Usage: ``decoder.prefill()`` (eager; the first token), optionally ``decoder.capture()``,
    then ``N - 1`` calls of :meth:`step`; :attr:`generated` is the ``[B, N]`` result.
    """

    def __init__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        new_tokens: int,
        max_cache_len: int | None = None,
    ) -> None:
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        self.model = model
        self.input_ids = input_ids
        self.new_tokens = new_tokens
        self.prompt_len = prompt_len
        # Room for the warm-up steps of a capture too (they write past the prompt before the
        # state is rewound), so a short run never indexes past the slots.
        needed = prompt_len + max(new_tokens - 1, CAPTURE_WARMUP)
        self.max_cache_len = max(max_cache_len or prompt_len + new_tokens - 1, needed)
        self.cache = static_cache(model, self.max_cache_len)
        self.cache_kwarg = {cache_argument(model): self.cache}
        self.tokens = torch.zeros(
            batch, new_tokens + CAPTURE_WARMUP, dtype=torch.long, device=device
        )
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.full((batch, 1), prompt_len, dtype=torch.long, device=device)
        self.index = torch.ones(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def generated(self) -> torch.Tensor:
        """int64 ``[B, N]``: the prefill's token, then one per step taken."""
        return self.tokens[:, : self.new_tokens]

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last-position logits ``[B, V]`` of one forward over ``ids [B, q]`` at ``positions``."""
        output = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **self.cache_kwarg,
        )
        return output.logits[:, -1]

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the prompt through the model (eager), filling the cache; write the first token."""
        batch, length = self.input_ids.shape
        positions = torch.arange(length, device=self.input_ids.device).expand(batch, length)
        first = self._logits(self.input_ids, positions).argmax(-1)
        self.tokens[:, 0] = first
        self._first = first.clone()
        self._lengths = [layer.cumulative_length for layer in self.cache.layers]
        if not all(isinstance(t, torch.Tensor) for t in self._lengths):
            raise RuntimeError(
                "this transformers' StaticCache layers keep no cumulative_length tensor; the "
                "decode step cannot be rewound after warm-up"
            )
        self.rewind()

    def rewind(self) -> None:
        """Back to the state right after :meth:`prefill` (in place: every address is kept)."""
        for length in self._lengths:
            length.fill_(self.prompt_len)
        self.ids.copy_(self._first[:, None])
        self.positions.fill_(self.prompt_len)
        self.index.fill_(1)

    def _step(self) -> None:
        next_ids = self._logits(self.ids, self.positions).argmax(-1, keepdim=True)  # [B, 1]
        self.tokens.index_copy_(1, self.index, next_ids)
        self.ids.copy_(next_ids)
        self.positions.add_(1)
        self.index.add_(1)

    @torch.no_grad()
    def capture(self, warmup: int = CAPTURE_WARMUP) -> None:
        """Capture one :meth:`step` in a CUDA graph: ``warmup`` eager steps on a side stream
        (kernel compilation, allocator pools), a rewind, then the capture (which runs nothing)."""
        if not self.input_ids.is_cuda:
            raise RuntimeError("CUDA graph capture needs the model on a CUDA device")
        if not 1 <= warmup <= CAPTURE_WARMUP:
            raise ValueError(f"warmup must be in [1, {CAPTURE_WARMUP}], got {warmup}")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.rewind()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph

    @torch.no_grad()
    def step(self) -> None:
        """One decode step: the graph's replay when captured, else the eager step."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def decode(self) -> None:
        """The ``N - 1`` decode steps after :meth:`prefill`."""
        for _ in range(self.new_tokens - 1):
            self.step()


# ---------------------------------------------------------------------- measurement helpers
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), seconds)``, the device idle before and after."""
    _synchronize(device)
    start = time.perf_counter()
    result = fn()
    _synchronize(device)
    return result, time.perf_counter() - start


@contextlib.contextmanager
def sync_debug_mode(mode: str, device: torch.device) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, the previous mode restored (a no-op
    off CUDA)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _site(filename: str, lineno: int) -> str:
    """``file:line`` relative to site-packages or the repository, for the report."""
    path = filename.replace(os.sep, "/")
    for marker in ("/site-packages/", "/src/", "/benchmarks/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            if marker == "/benchmarks/":
                path = "benchmarks/" + path
            elif marker == "/src/":
                path = "src/" + path
            break
    return f"{path}:{lineno}"


def count_host_syncs(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Counter[str]]:
    """``(fn(), sites)``: the host synchronisations ``fn`` made, counted per Python source line
    (the line that called the synchronising operation) under
    ``torch.cuda.set_sync_debug_mode("warn")``; empty off CUDA. ``fn`` must not synchronise
    on purpose (``torch.cuda.synchronize`` is counted too)."""
    sites: Counter[str] = Counter()
    if device.type != "cuda":
        return fn(), sites
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug_mode("warn", device):
            result = fn()
    for w in caught:
        if SYNC_MESSAGE in str(w.message):
            sites[_site(w.filename, w.lineno)] += 1
    return result, sites


def per_step_syncs(
    run: Callable[[int], Any], device: torch.device, short: int = 3, long: int = 7
) -> dict[str, Any] | None:
    """Host syncs per decode step of ``run(new_tokens)`` (a whole generation): the count of a
    ``long`` run minus a ``short`` one, over the steps between; the sites of that difference."""
    if device.type != "cuda":
        return None
    _, few = count_host_syncs(lambda: run(short), device)
    _, many = count_host_syncs(lambda: run(long), device)
    extra = many - few
    steps = long - short
    return {
        "per_step": round(sum(extra.values()) / steps, 2),
        "sites_per_step": {site: n / steps for site, n in extra.most_common(8)},
    }


def token_agreement(tokens: torch.Tensor, reference: torch.Tensor | None) -> dict[str, Any]:
    """``equal``, ``match`` (fraction of equal tokens) and ``first_mismatch`` (the first step,
    over all rows, where ``tokens [B, N]`` and ``reference`` differ; ``None`` if none)."""
    if reference is None:
        return {"equal": None, "match": None, "first_mismatch": None}
    tokens, reference = tokens.cpu(), reference.cpu()
    same = tokens == reference
    differs = (~same).any(0).nonzero().flatten()
    return {
        "equal": bool(same.all()),
        "match": round(float(same.float().mean()), 4),
        "first_mismatch": int(differs[0]) if differs.numel() else None,
    }


def _rate(batch: int, tokens: int, seconds: float | None) -> float | None:
    if seconds is None or seconds <= 0:
        return None
    return round(batch * tokens / seconds, 1)


# ---------------------------------------------------------------------- the runs
class Runner:
    """Measures the rows of one model, appending each to ``report["rows"]`` and saving."""

    def __init__(
        self,
        model: Any,
        args: argparse.Namespace,
        device: torch.device,
        deadline: float,
        report: dict[str, Any],
        save: Callable[[], None],
    ) -> None:
        self.model = model
        self.args = args
        self.device = device
        self.deadline = deadline
        self.report = report
        self.save = save
        self.reference: dict[tuple[int, str], torch.Tensor] = {}

    # A row: run ``measure`` unless the budget is spent; errors become the row's status.
    def _row(
        self,
        batch: int,
        backend: str,
        method: str,
        measure: Callable[[], dict],
        needs_s: float = 0.0,
    ) -> dict:
        n = self.args.new_tokens
        row: dict[str, Any] = {
            "batch": batch,
            "backend": backend,
            "method": method,
            "graph": method in ("static step+graph", "generate+compile"),
            "prompt_len": self.args.prompt_len,
            "new_tokens": n,
        }
        if time.monotonic() + needs_s > self.deadline:
            row["status"] = f"skipped: --budget-s {self.args.budget_s:g} spent" + (
                f" (needs ~{needs_s:g} s)" if needs_s else ""
            )
        else:
            start = time.monotonic()
            try:
                set_backend(self.model, backend)
                row |= measure()
                row["status"] = "ok"
            except Exception as error:  # a failed row must not lose the others
                row["status"] = f"error: {type(error).__name__}: {error}"[:500]
                row["traceback"] = traceback.format_exc()[-3000:]
            finally:
                _synchronize_quietly(self.device)
            row["wall_s"] = round(time.monotonic() - start, 1)
        self.report["rows"].append(row)
        self.save()
        _log(row)
        return row

    def batch(self, batch: int) -> None:
        """Every row of one batch size but ``generate+compile`` (run last: it compiles)."""
        args = self.args
        prompts = make_prompts(batch, args.prompt_len, args.config["vocab_size"], args.seed + batch,
                               self.device)  # fmt: skip
        methods = args.methods
        for backend in args.backends:
            if "generate" in methods or any(m.startswith("static") for m in methods):
                # The eager generate is every row's token reference.
                self._row(batch, backend, "generate", lambda: self._generate(prompts, backend))
            if "static step" in methods:
                self._row(batch, backend, "static step",
                          lambda: self._static(prompts, backend, graph=False))  # fmt: skip
            if "static step+graph" in methods:
                if self.device.type == "cuda":
                    self._row(batch, backend, "static step+graph",
                              lambda: self._static(prompts, backend, graph=True))  # fmt: skip
                else:
                    self._skipped(batch, backend, "static step+graph", "CUDA graphs need a GPU")
            if "stream_generate" in methods:
                self._row(batch, backend, "stream_generate",
                          lambda: self._stream(prompts, backend, window=False))  # fmt: skip
            if "stream_generate window" in methods and backend == "flashmask":
                self._row(batch, backend, "stream_generate window",
                          lambda: self._stream(prompts, backend, window=True))  # fmt: skip
        self._cross_backend(batch)

    def compiled(self, batch: int, backend: str) -> None:
        if self.device.type != "cuda":
            self._skipped(batch, backend, "generate+compile", "CUDA graphs need a GPU")
            return
        args = self.args
        prompts = make_prompts(batch, args.prompt_len, args.config["vocab_size"], args.seed + batch,
                               self.device)  # fmt: skip
        self._row(batch, backend, "generate+compile", lambda: self._compiled(prompts, backend),
                  needs_s=COMPILE_RESERVE_S)  # fmt: skip

    def _skipped(self, batch: int, backend: str, method: str, why: str) -> None:
        row = {"batch": batch, "backend": backend, "method": method, "graph": True}
        row["status"] = f"skipped: {why}"
        self.report["rows"].append(row)
        self.save()
        _log(row)

    def _median_time(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        results = [timed(fn, self.device) for _ in range(self.args.reps)]
        return results[-1][0], statistics.median(t for _, t in results)

    def _generate(self, prompts: torch.Tensor, backend: str) -> dict[str, Any]:
        n, batch = self.args.new_tokens, prompts.shape[0]
        # generate's own cache size for n tokens, reused by every call (the same shapes).
        cache = static_cache(self.model, prompts.shape[1] + n - 1)
        run = lambda k: generate_tokens(self.model, prompts, k, cache)  # noqa: E731
        run(min(n, 4))  # warm-up: kernels compiled (the cache fixes every shape)
        tokens, total = self._median_time(lambda: run(n))
        _, prefill = self._median_time(lambda: run(1))
        self.reference[batch, backend] = tokens
        decode = (total - prefill) / (n - 1)
        return {
            "prefill_ms": round(prefill * 1e3, 2),
            "decode_ms_per_step": round(decode * 1e3, 3),
            "decode_tokens_per_s": _rate(batch, 1, decode),
            "e2e_tokens_per_s": _rate(batch, n, total),
            "reference": True,  # the other rows' tokens are compared with these
            "host_syncs": per_step_syncs(run, self.device),
        }

    def _static(self, prompts: torch.Tensor, backend: str, graph: bool) -> dict[str, Any]:
        n, batch, device = self.args.new_tokens, prompts.shape[0], self.device
        reference = self.reference.get((batch, backend))
        cache_len = prompts.shape[1] + n - 1
        # Warm-up (eager step; kernels compiled), and the syncs of one eager decode step.
        warm = StaticDecoder(self.model, prompts, n, cache_len)
        warm.prefill()
        _, step_sites = count_host_syncs(warm.step, device)
        del warm
        decoder = StaticDecoder(self.model, prompts, n, cache_len)
        _, prefill = timed(decoder.prefill, device)
        result: dict[str, Any] = {"prefill_ms": round(prefill * 1e3, 2)}
        if graph:
            _, capture = timed(decoder.capture, device)
            result["capture_ms"] = round(capture * 1e3, 1)
            _, step_sites = count_host_syncs(decoder.step, device)  # one replay
            decoder.rewind()
        if device.type == "cuda":
            result["host_syncs"] = {"per_step": sum(step_sites.values()),
                                    "sites_per_step": dict(step_sites)}  # fmt: skip
        host, device_s, check = self._decode_loop(decoder, graph)
        result |= {
            "decode_ms_per_step": round(device_s / (n - 1) * 1e3, 3),
            "decode_tokens_per_s": _rate(batch, 1, device_s / (n - 1)),
            "e2e_tokens_per_s": _rate(batch, n, prefill + device_s),
            "host_loop_ms": round(host * 1e3, 2),
            "device_ms": round(device_s * 1e3, 2),
            **token_agreement(decoder.generated, reference),
        }
        if graph:
            result["replay_sync_check"] = check
        return result

    def _decode_loop(self, decoder: StaticDecoder, graph: bool) -> tuple[float, float, str]:
        """Time ``decoder.decode()``: ``(host seconds to enqueue the loop, seconds until the
        device finished, the sync check)``. Replays run under sync debug mode "error"."""
        device = self.device
        _synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        check = "not checked (eager)"
        if graph:
            steps = decoder.new_tokens - 1
            try:
                with sync_debug_mode("error", device):
                    decoder.decode()
                    host = time.perf_counter() - t0
                    end.record()
                check = f"no host sync in {steps} replays (set_sync_debug_mode('error'))"
            except RuntimeError as error:
                raise RuntimeError(
                    f"a host synchronisation during graph replay: {error}"
                ) from error
        else:
            decoder.decode()
            host = time.perf_counter() - t0
            if device.type == "cuda":
                end.record()
        _synchronize(device)
        if device.type == "cuda":
            device_s = start.elapsed_time(end) / 1e3
        else:
            device_s = time.perf_counter() - t0
        return host, device_s, check

    def _stream(self, prompts: torch.Tensor, backend: str, window: bool) -> dict[str, Any]:
        args, batch = self.args, prompts.shape[0]
        n = args.new_tokens
        if window:
            apply_flashmask(self.model, mask="sliding_window", window=args.window,
                            sink_tokens=args.sinks)  # fmt: skip
        try:
            run = lambda k: stream_generate(self.model, prompts, k)[0]  # noqa: E731
            # Warm-up: the key count grows per step; 20 steps meet the lengths that Triton
            # specialises kernels for (divisible by 16 or not).
            run(min(n, 20))
            tokens, total = self._median_time(lambda: run(n))
            _, prefill = self._median_time(lambda: run(1))
            syncs = per_step_syncs(run, self.device)
        finally:
            if window:
                remove_flashmask(self.model)
                set_backend(self.model, backend)
        decode = (total - prefill) / (n - 1)
        result = {
            "prefill_ms": round(prefill * 1e3, 2),
            "decode_ms_per_step": round(decode * 1e3, 3),
            "decode_tokens_per_s": _rate(batch, 1, decode),
            "e2e_tokens_per_s": _rate(batch, n, total),
            **token_agreement(tokens, None if window else self.reference.get((batch, backend))),
            "host_syncs": syncs,
        }
        if window:
            result["window"] = {"window": args.window, "sink_tokens": args.sinks}
        return result

    def _compiled(self, prompts: torch.Tensor, backend: str) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        n, batch = self.args.new_tokens, prompts.shape[0]
        config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
        cache = static_cache(self.model, prompts.shape[1] + n - 1)
        run = lambda k: generate_tokens(self.model, prompts, k, cache, config)  # noqa: E731
        skips_before = counters["inductor"]["cudagraph_skips"]
        breaks_before = sum(counters["graph_break"].values())
        # Compiles the decode step (and records its CUDA graph: cudagraph trees warm up once,
        # record on the next call, replay from then on).
        _, compile_s = timed(lambda: run(min(n, 4)), self.device)
        tokens, total = self._median_time(lambda: run(n))
        _, prefill = self._median_time(lambda: run(1))
        decode = (total - prefill) / (n - 1)
        used = getattr(self.model, "_last_compile_config", None)
        return {
            "prefill_ms": round(prefill * 1e3, 2),
            "decode_ms_per_step": round(decode * 1e3, 3),
            "decode_tokens_per_s": _rate(batch, 1, decode),
            "e2e_tokens_per_s": _rate(batch, n, total),
            **token_agreement(tokens, self.reference.get((batch, backend))),
            "compile_s": round(compile_s, 1),
            "fullgraph": getattr(used, "fullgraph", None),
            "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips_before,
        }

    def _cross_backend(self, batch: int) -> None:
        """How far the flashmask and sdpa greedy tokens agree (bf16 rounding differs)."""
        a, b = (self.reference.get((batch, backend)) for backend in BACKENDS)
        if a is not None and b is not None:
            self.report.setdefault("flashmask_vs_sdpa_tokens", {})[str(batch)] = token_agreement(
                a, b
            )
            self.save()


def _synchronize_quietly(device: torch.device) -> None:
    # A sticky CUDA error shows in the next row anyway.
    with contextlib.suppress(Exception):
        _synchronize(device)


def _log(row: dict[str, Any]) -> None:
    keys = ("batch", "backend", "method", "status", "decode_tokens_per_s", "e2e_tokens_per_s",
            "equal", "wall_s")  # fmt: skip
    print(json.dumps({k: row.get(k) for k in keys}), flush=True)


# ---------------------------------------------------------------------- report
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def metadata(
    args: argparse.Namespace,
    model: Any,
    device: torch.device,
    dtype: torch.dtype,
    argv: list[str] | None,
) -> dict[str, Any]:
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    command = argv if argv is not None else sys.argv[1:]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "flashmask": flashmask.__version__,
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get("GIT_COMMIT"),
        "git_dirty": None if status is None else bool(status),
        "command": "PYTHONPATH=src python benchmarks/decode_graphs.py "
        + " ".join(shlex.quote(a) for a in command),
        "dtype": str(dtype),
        "model": {"kind": "LlamaForCausalLM, random weights", **args.config},
        "parameters": sum(p.numel() for p in model.parameters()),
        "batches": args.batches,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "quick": args.quick,
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "timing": (
            "decode_ms_per_step: GPU time per decode step (static step rows: the decode loop "
            "timed by CUDA events; generate / stream rows: (time of N tokens - time of 1 "
            "token) / (N - 1)); decode_tokens_per_s = batch / that; e2e_tokens_per_s = batch * N "
            "/ (prefill + decode). Median of --reps runs after a warm-up."
        ),
    }


NOTES = [
    "`static step+graph`: one decode step (forward, argmax, token bookkeeping) captured with "
    "`torch.cuda.graph` after a side-stream warm-up, replayed per token; the replay loop runs "
    "under `torch.cuda.set_sync_debug_mode('error')` (any host synchronisation raises), and "
    "`host_loop_ms` far below `device_ms` shows the host never waited for the GPU.",
    "`generate+compile`: transformers' own CUDA-graph path (`CompileConfig(fullgraph=True, "
    "mode='reduce-overhead')`, decode step only; compile time excluded from the rates). "
    "transformers sets fullgraph=False for any backend whose name contains 'flash' (its "
    "FlashAttention check also matches 'flashmask'); `fullgraph` shows what ran.",
    "`stream_generate` is eager only: its per-layer caches grow by `torch.cat` every token "
    "(and a sliding-window layer compacts itself past sinks + window), so the key count and "
    "every attention shape change per step and the masks are rebuilt in Python from the "
    "position record; there is no fixed-shape step to capture. The static-cache rows are the "
    "graph comparison.",
    "`host syncs/step`: synchronising CUDA calls per eager decode step, counted under "
    "`set_sync_debug_mode('warn')`; JSON `host_syncs.sites_per_step` names the source lines.",
    "Random weights: greedy tokens of flashmask and sdpa (different bf16 kernels) may part "
    "after a few steps; each row is compared with the eager generate of its own backend.",
]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 100 else f"{value:.3g}"
    return str(value)


def _equal_cell(row: dict[str, Any]) -> str:
    if row.get("reference"):
        return "(reference)"
    if row.get("equal") is None:
        return "-"
    if row["equal"]:
        return "yes"
    return f"no ({row['match']:.0%}, from step {row['first_mismatch']})"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: metadata, the rows, the speed-ups, notes and the command."""
    meta = report["meta"]
    lines = [
        "# Decode with and without CUDA graphs",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}, triton "
        f"{meta['triton']}, flashmask {meta['flashmask']} (commit {meta['git_commit']}"
        f"{', dirty' if meta.get('git_dirty') else ''}), {meta['date']}.",
        f"Model: Llama-shaped, {meta['parameters'] / 1e9:.2f}B parameters (random weights), "
        f"{meta['dtype']}; prompt {meta['prompt_len']} tokens, {meta['new_tokens']} greedy new "
        "tokens per row.",
        "",
        "| batch | backend | method | graph | prefill ms | decode ms/step | decode tok/s "
        "| e2e tok/s | tokens = eager generate | host syncs/step | status |",
        "|---:|---|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in report["rows"]:
        syncs = row.get("host_syncs")
        lines.append(
            f"| {row['batch']} | {row['backend']} | {row['method']} | "
            f"{'yes' if row.get('graph') else 'no'} | {_fmt(row.get('prefill_ms'))} | "
            f"{_fmt(row.get('decode_ms_per_step'))} | {_fmt(row.get('decode_tokens_per_s'))} | "
            f"{_fmt(row.get('e2e_tokens_per_s'))} | {_equal_cell(row)} | "
            f"{_fmt(syncs.get('per_step') if syncs else None)} | {row['status'][:80]} |"
        )
    lines += ["", *_speedups(report["rows"])]
    cross = report.get("flashmask_vs_sdpa_tokens")
    if cross:
        lines += ["", "Greedy tokens, flashmask vs sdpa (eager generate):"]
        for batch, agreement in cross.items():
            lines.append(
                f"- batch {batch}: {agreement['match']:.0%} equal, first difference at step "
                f"{agreement['first_mismatch']}"
            )
    checks = [
        f"- batch {r['batch']} {r['backend']}: {r['replay_sync_check']}; host loop "
        f"{r['host_loop_ms']} ms vs device {r['device_ms']} ms"
        for r in report["rows"]
        if r.get("replay_sync_check")
    ]
    if checks:
        lines += ["", "Graph replay without host synchronisation:", *checks]
    sites = _sync_sites(report["rows"])
    if sites:
        lines += ["", "Host syncs per eager decode step, by source line:", *sites]
    lines += ["", "Notes:", *(f"- {note}" for note in NOTES)]
    lines += ["", "Command:", "", "```bash", meta["command"], "```", ""]
    return "\n".join(lines)


def _speedups(rows: list[dict[str, Any]]) -> list[str]:
    """Decode tokens/s ratios: graph over eager per backend, flashmask over sdpa per method."""
    rate = {
        (r["batch"], r["backend"], r["method"]): r.get("decode_tokens_per_s")
        for r in rows
        if r.get("status") == "ok"
    }

    def ratio(a: tuple, b: tuple) -> str:
        x, y = rate.get(a), rate.get(b)
        return f"{x / y:.2f}x" if x and y else "-"

    batches = sorted({r["batch"] for r in rows})
    lines = [
        "Decode tokens/s ratios:",
        "",
        "| batch | backend | static graph / static eager | generate+compile / generate |",
        "|---:|---|---:|---:|",
    ]
    for batch in batches:
        for backend in BACKENDS:
            graph = ratio((batch, backend, "static step+graph"), (batch, backend, "static step"))
            comp = ratio((batch, backend, "generate+compile"), (batch, backend, "generate"))
            lines.append(f"| {batch} | {backend} | {graph} | {comp} |")
    lines += ["", "| batch | method | flashmask / sdpa |", "|---:|---|---:|"]
    for batch in batches:
        for method in METHODS:
            if method == "stream_generate window":
                continue
            value = ratio((batch, "flashmask", method), (batch, "sdpa", method))
            if value != "-":
                lines.append(f"| {batch} | {method} | {value} |")
    return lines


def _sync_sites(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        syncs = r.get("host_syncs") or {}
        if syncs.get("sites_per_step") and not r.get("graph"):
            where = ", ".join(f"{site} x{n:g}" for site, n in syncs["sites_per_step"].items())
            lines.append(f"- batch {r['batch']} {r['backend']} {r['method']}: {where}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
