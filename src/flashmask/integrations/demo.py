"""``flashmask demo``: a few steps of packed SFT on a tiny Llama, flashmask vs SDPA + dense mask.

Both runs start from the same random weights and see the same packed batches (random documents,
:func:`flashmask.integrations.data.pack_sft`); one uses ``attn_implementation="flashmask"`` with
the causal-document FlashMask, the other ``"sdpa"`` with the same mask as a dense 4-D boolean
tensor. The demo prints the loss of every step for both, their difference, the median step time
and the peak memory of each run (over the steps after the first, above what the first step left
allocated: weights, optimizer state, caches), and passes when the losses agree.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import statistics
import time
from dataclasses import dataclass

import torch

import flashmask.integrations.transformers  # noqa: F401  (registers "flashmask")
from flashmask.integrations import data

__all__ = ["DemoResult", "run_demo"]

# Largest allowed |loss difference| relative to the loss. float32 runs agree to ~1e-6; bf16 runs
# differ by rounding (2^-8 relative per operation); a masking bug changes the loss by O(1).
_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@dataclass
class DemoResult:
    """Per-backend measurements of one demo run."""

    losses: list[float]
    step_seconds: list[float]
    peak_bytes: int | None
    mask_bytes: int


def run_demo(
    *,
    seqlen: int,
    rows: int = 2,
    steps: int = 4,
    device: torch.device,
    seed: int = 0,
) -> int:
    """Run the comparison and print it; returns 0 when the losses agree, else 1."""
    import transformers

    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=seqlen,
    )
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    base = base.to(device, dtype)
    generator = torch.Generator().manual_seed(seed)
    batches = [_packed_batch(seqlen, rows, generator) for _ in range(steps)]

    tokens = int(sum((b["sample_index"] >= 0).sum() for b in batches))
    docs = int(sum((b["doc_lens"] > 0).sum() for b in batches))
    where = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    print(
        f"flashmask demo: packed SFT, tiny Llama (hidden 64, 2 layers, 4 heads / 2 KV heads), "
        f"{steps} AdamW steps of {rows} x {seqlen} tokens ({tokens:,} real tokens in {docs} "
        f"documents), {dtype} on {device} ({where})",
        flush=True,
    )
    results = {}
    for attn in ("flashmask", "sdpa"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(attn)
        results[attn] = _train(model, attn, batches, device, dtype)
        del model

    fm, sd = results["flashmask"], results["sdpa"]
    diffs = [abs(a - b) for a, b in zip(fm.losses, sd.losses, strict=True)]
    tolerance = _RTOL[dtype] * max(abs(x) for x in sd.losses)
    ok = max(diffs) <= tolerance
    print()
    table = [("step", "loss flashmask", "loss sdpa + dense mask", "|difference|")]
    for i, (a, b, d) in enumerate(zip(fm.losses, sd.losses, diffs, strict=True)):
        table.append((str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{d:.1e}"))
    _print_table(table)
    memory_label = "peak CUDA memory" if on_cuda else "peak RSS"
    memory_label += " above step 1" if steps > 1 else ""
    summary = [
        ("", "flashmask", "sdpa + dense mask"),
        ("mask per step", _bytes(fm.mask_bytes), _bytes(sd.mask_bytes)),
        (
            f"median step time ({len(fm.step_seconds)} steps after the first)",
            _ms(statistics.median(fm.step_seconds)),
            _ms(statistics.median(sd.step_seconds)),
        ),
        (memory_label, _bytes(fm.peak_bytes), _bytes(sd.peak_bytes)),
    ]
    print()
    _print_table(summary)
    rule = f"{_RTOL[dtype]:g} x max loss = {tolerance:.1e}"
    if ok:
        print(f"PASS: losses agree (max difference {max(diffs):.1e} <= {rule})")
    else:
        print(f"FAIL: losses differ by up to {max(diffs):.1e} > {rule}")
    return 0 if ok else 1


def _packed_batch(seqlen: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random documents of ``seqlen / 16`` to ``seqlen / 4`` tokens packed into ``rows`` rows."""
    low, high = max(2, seqlen // 16), max(2, seqlen // 4)
    samples, total = [], 0
    while True:
        n = int(torch.randint(low, high + 1, (1,), generator=generator))
        if total + n > rows * seqlen * 0.9:
            break
        ids = torch.randint(1, 256, (n,), generator=generator)
        samples.append({"input_ids": ids})
        total += n
    batch = data.pack_sft(samples, seqlen, pad_to_max_tokens=True)
    if batch["input_ids"].shape[0] != rows:  # best-fit rarely needs one more row; drop it
        batch = {k: v[:rows] if v.dim() > 1 else v for k, v in batch.items()}
    return batch


def _train(model, attn: str, batches: list[dict], device: torch.device, dtype) -> DemoResult:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    on_cuda = device.type == "cuda"
    inputs = []
    for batch in batches:
        step = data.model_inputs(batch, device)
        if attn != "flashmask":
            step["attention_mask"] = data.dense_attention_mask(step.pop("startend_row_indices"))
        inputs.append(step)
    mask = inputs[0].get("startend_row_indices", inputs[0].get("attention_mask"))
    losses, seconds = [], []
    label = "flashmask" if attn == "flashmask" else f"{attn} + dense mask"
    total = len(inputs)

    def step(inputs: dict) -> None:
        if on_cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() synchronises
        seconds.append(time.perf_counter() - start)
        # A long CPU run otherwise prints nothing until the end.
        print(
            f"  ... {label}: step {len(losses)}/{total}, loss {losses[-1]:.6f}, "
            f"{seconds[-1]:.2f} s",
            flush=True,
        )

    # The first step allocates the optimizer state and warms caches up; the memory peak is
    # measured over the later steps, above that baseline (activations and the mask).
    step(inputs[0])
    peak = _PeakMemory(device)
    with peak:
        for later in inputs[1:]:
            step(later)
    return DemoResult(
        losses, seconds[1:] or seconds, peak.bytes, mask.numel() * mask.element_size()
    )


class _PeakMemory:
    """Peak memory of a block: CUDA's allocator peak, or on Linux the growth of the process's
    peak resident set (reset through ``/proc/self/clear_refs``); ``bytes`` is None when neither
    is available."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> _PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        # Give freed heap back first, so that the peak measures this block alone.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self._base = _reset_peak_rss()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._base is not None:
            peak = _read_status("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._base)


def _reset_peak_rss() -> int | None:
    """Reset the peak resident set to the current one (Linux); returns it, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _read_status("VmRSS")


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
