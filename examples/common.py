"""Shared parts of the training examples: model sizes, a byte tokenizer, the shipped data, the
command line, progress and the end-of-run summary.

Nothing here downloads anything: models are built from a config with random weights and text is
tokenised as UTF-8 bytes (vocabulary 256, token 0 = padding).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

import flashmask.integrations.transformers  # noqa: F401  (registers attn_implementation="flashmask")
from flashmask.integrations import data

DATA = Path(__file__).parent / "data"
VOCAB_SIZE = 256
PAD_ID = 0  # the NUL byte never occurs in the data

CONFIGS = {
    # Seconds on a laptop CPU.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # ~1.0B parameters (Llama-3.2-1B-like body, byte vocabulary): for a GPU.
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}


def encode(text: str) -> list[int]:
    """UTF-8 bytes as token ids."""
    return list(text.encode("utf-8"))


def load_jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def parser(description: str, *, max_tokens: int, samples: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny", help="model size (tiny)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (20)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help=f"tokens per packed row ({max_tokens})"
    )
    p.add_argument(
        "--samples-per-step", type=int, default=None, help=f"samples per step ({samples})"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (3e-3)")
    p.add_argument(
        "--attn",
        default="flashmask",
        choices=["flashmask", "sdpa", "eager"],
        help="attention backend; sdpa/eager get the same mask as a dense 4-D tensor (flashmask)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(default_max_tokens=max_tokens, default_samples=samples)
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill size-dependent defaults: the 1b config packs 16x longer rows."""
    scale = 16 if args.config == "1b" else 1
    if args.max_tokens is None:
        args.max_tokens = args.default_max_tokens * scale
    if args.samples_per_step is None:
        args.samples_per_step = args.default_samples * scale
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.config == "1b" and not args.device.startswith("cuda"):
        print("note: --config 1b on CPU is very slow; it is meant for a GPU", file=sys.stderr)
    torch.manual_seed(args.seed)
    return args


def build_model(args: argparse.Namespace, task: str = "causal_lm", **extra):
    """A randomly initialised Llama-style model on ``args.device`` in ``args.dtype``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_ID,
        max_position_embeddings=max(4096, args.max_tokens),
        **CONFIGS[args.config],
        **extra,
    )
    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "score": transformers.AutoModelForSequenceClassification,
    }[task]
    model = auto.from_config(config, attn_implementation=args.attn, dtype=args.dtype)
    return model.to(args.device)


def model_inputs(batch: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    """The model inputs of a packed batch for ``args.attn``: the FlashMask tensor for
    "flashmask", the same mask as a dense 4-D tensor for "sdpa"/"eager" (for comparisons)."""
    inputs = data.model_inputs(batch, args.device)
    if args.attn != "flashmask":
        mask = inputs.pop("startend_row_indices")
        dtype = torch.bool if args.attn == "sdpa" else args.dtype
        inputs["attention_mask"] = data.dense_attention_mask(mask, dtype=dtype)
    return inputs


def batches(records: list, per_step: int, steps: int, seed: int) -> Iterator[list]:
    """``steps`` batches of ``per_step`` records, cycling through shuffled epochs."""
    rng = random.Random(seed)
    pool: list = []
    for _ in range(steps):
        batch = []
        while len(batch) < per_step:
            if not pool:
                pool = list(records)
                rng.shuffle(pool)
            batch.append(pool.pop())
        yield batch


def progress(iterable: Iterable, total: int, desc: str) -> Iterable:
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False)


class Meter:
    """Tokens, time and metrics of a run, and its summary."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.tokens = 0
        self.history: dict[str, list[float]] = {}
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        self.start = time.perf_counter()

    def step(self, tokens: int, **metrics: float) -> None:
        self.tokens += tokens
        for key, value in metrics.items():
            self.history.setdefault(key, []).append(float(value))

    def summary(self, name: str) -> dict[str, float]:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.start
        result = {"seconds": seconds, "tokens_per_s": self.tokens / seconds}
        for key, values in self.history.items():
            result[f"first_{key}"], result[f"last_{key}"] = values[0], values[-1]
        memory, what = peak_memory(self.device)
        result["peak_memory_mib"] = memory / 2**20
        metrics = ", ".join(
            f"{k} {self.history[k][0]:.4f} -> {self.history[k][-1]:.4f}" for k in self.history
        )
        print(
            f"{name}: {len(next(iter(self.history.values()), []))} steps, {metrics}; "
            f"{self.tokens} tokens in {seconds:.1f} s = {result['tokens_per_s']:,.0f} tokens/s; "
            f"{what} {result['peak_memory_mib']:,.0f} MiB"
        )
        return result


def train_packed_sft(
    model: torch.nn.Module,
    parameters: Iterable[torch.nn.Parameter],
    samples: list[dict],
    args: argparse.Namespace,
    tag: str,
) -> dict[str, float]:
    """The packed-SFT loop shared by the SFT examples: pack each step's samples with
    :func:`flashmask.integrations.data.pack_sft`, one AdamW step over ``parameters``."""
    from flashmask.integrations import data

    optimizer = torch.optim.AdamW(parameters, lr=args.lr)
    meter = Meter(args.device)
    steps = batches(samples, args.samples_per_step, args.steps, args.seed)
    for step_samples in progress(steps, args.steps, tag):
        batch = data.pack_sft(step_samples, args.max_tokens, pad_token_id=PAD_ID)
        loss = model(**model_inputs(batch, args)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step(int((batch["sample_index"] >= 0).sum()), loss=loss.item())
    return meter.summary(f"{tag} [{args.config}, {args.attn}, {args.device}]")


def peak_memory(device: str) -> tuple[int, str]:
    """Peak bytes: CUDA's allocator peak, or the process's peak resident set on CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "peak RSS"
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
