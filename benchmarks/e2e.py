"""End-to-end training benchmark: a ~1B Llama-style model, packed SFT and shared-prompt DPO.

For each attention backend (``flashmask`` with its O(N) mask, ``sdpa`` with the same mask as a
dense 4-D boolean tensor, ``flex_attention`` with a ``BlockMask`` built from it) this measures
tokens/s and peak CUDA memory of full training steps (forward, backward, AdamW):

* packed SFT at 4K, 8K, 16K and 32K tokens per row (random documents of S/16 to S/4 tokens,
  causal-document mask, one row per step);
* shared-prompt DPO at 8K (pairs ``prompt ‖ chosen ‖ rejected``, share-question mask; the
  step is a no-grad reference forward plus the policy's forward and backward);
* the longest packed sequence that still trains, with gradient checkpointing (doubling from
  32K until out of memory, the step-time limit or ``--longest-max``).

The loss is a chunked cross-entropy (LM head and loss recomputed per 8K-token chunk in the
backward) so that the vocabulary projection does not hide the attention's memory. Every result
is written as soon as it is measured, to ``DIR/e2e.json`` and ``DIR/e2e.md`` (``--out DIR``,
default ``$OUT`` or ``benchmarks/results/e2e``). Parts that would start after ``--budget-s``
seconds are skipped (and marked so), which keeps a run inside a fixed time slot.

Usage, from the repository root (the README's table: ``benchmarks/gpu_run.sh e2e``)::

    PYTHONPATH=src python3 benchmarks/e2e.py            # ~1B model, bf16, one CUDA GPU
    PYTHONPATH=src python3 benchmarks/e2e.py --longest-max 262144 --step-limit-s 30
    PYTHONPATH=src python3 benchmarks/e2e.py --smoke    # tiny model on CPU, checks the script

Needs transformers (``pip install -e '.[integrations]'``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import transformers
except ImportError:  # pragma: no cover - depends on the machine
    sys.exit("benchmarks/e2e.py needs transformers: pip install -e '.[integrations]'")

import flashmask
import flashmask.integrations.transformers  # registers attn_implementation="flashmask"
from flashmask.integrations import data
from flashmask.integrations.transformers import enable_activation_checkpointing

BACKENDS = ("flashmask", "sdpa", "flex_attention")
MODEL_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
MODEL_TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
LOSS_CHUNK = 8192
NO_ATTENTION = "no_attention"
PARTS = ("sft", "dpo", "longest")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    report = {
        "meta": _meta(args, device, dtype),
        "sft": [],
        "dpo": [],
        "longest": [],
    }

    def save() -> None:
        (out_dir / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "e2e.md").write_text(_markdown(report))

    model = _model(args, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    generator = torch.Generator().manual_seed(0)
    save()

    for seqlen in args.seqlens if "sft" in args.parts else []:
        batch = _sft_batch(seqlen, generator, args.vocab)
        # "no_attention" (attention replaced by the identity) is the bound that the rest of the
        # model sets: no attention backend can train faster than it.
        for backend in [*args.backends, NO_ATTENTION]:
            row = {"backend": backend, "seqlen": seqlen}
            row |= _measure(
                lambda b=backend, x=batch: _sft_step(model, optimizer, b, x, device),
                args,
                device,
                deadline,
                tokens=int((batch["sample_index"] >= 0).sum()),
            )
            report["sft"].append(row)
            _log("sft", row)
            save()

    if "dpo" in args.parts:
        _run_dpo(model, optimizer, args, device, generator, deadline, report, save)
    if "longest" in args.parts:
        enable_activation_checkpointing(model)
    for backend in args.backends if "longest" in args.parts else []:
        row = {"backend": backend} | _longest(
            model, optimizer, backend, args, device, generator, deadline
        )
        report["longest"].append(row)
        _log("longest", row)
        save()

    print(f"wrote {out_dir / 'e2e.json'} and {out_dir / 'e2e.md'}")
    print(_markdown(report))
    return 0


def _run_dpo(model, optimizer, args, device, generator, deadline, report, save) -> None:
    """Shared-prompt DPO with every backend, the usual separate layout with SDPA, and the check
    that both layouts give the same log-probs and loss."""
    pairs = _dpo_pairs(args.dpo_seqlen, generator, args.vocab)
    batch = data.pack_preference(pairs, args.dpo_seqlen, pad_to_max_tokens=True)
    separate = _separate_batch(pairs)
    report["dpo_equality"] = _dpo_equality(model, batch, separate, device)
    _log("dpo_equality", report["dpo_equality"])
    for backend in args.backends:
        row = {"backend": backend, "layout": "shared prompt", "seqlen": args.dpo_seqlen}
        row |= _measure(
            lambda b=backend: _dpo_step(model, optimizer, b, batch, device),
            args,
            device,
            deadline,
            tokens=int((batch["input_ids"] != 0).sum()),
            pairs=len(pairs),
        )
        report["dpo"].append(row)
        _log("dpo", row)
        save()
    row = {"backend": "sdpa", "layout": "separate sequences", "seqlen": separate["seqlen"]}
    row |= _measure(
        lambda: _dpo_separate_step(model, optimizer, separate, device),
        args,
        device,
        deadline,
        tokens=int(separate["attention_mask"].sum()),
        pairs=len(pairs),
    )
    report["dpo"].append(row)
    _log("dpo", row)
    save()


# ---------------------------------------------------------------------- setup
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, small sizes")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/e2e"))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (all)"
    )
    p.add_argument("--seqlens", nargs="+", type=int, default=None, help="SFT row lengths")
    p.add_argument("--dpo-seqlen", type=int, default=None, help="DPO row length (8192)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (5)")
    p.add_argument("--longest-start", type=int, default=None, help="first length tried (32K)")
    p.add_argument("--longest-max", type=int, default=None, help="stop doubling here (512K)")
    p.add_argument(
        "--step-limit-s", type=float, default=60.0, help="stop a search past this step time"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="skip the parts that would start after this many seconds",
    )
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke)")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "seqlens": [128, 256] if smoke else [4096, 8192, 16384, 32768],
        "dpo_seqlen": 256 if smoke else 8192,
        "warmup": 1 if smoke else 2,
        "steps": 2 if smoke else 5,
        "longest_start": 512 if smoke else 32768,
        "longest_max": 1024 if smoke else 524288,
        "device": "cpu" if smoke else "cuda",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available; use --smoke for the CPU check")
    args.config = MODEL_TINY if smoke else MODEL_1B
    args.vocab = args.config["vocab_size"]
    return args


def _meta(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": transformers.__version__,
        "flashmask": flashmask.__version__,
        "python": platform.python_version(),
        "model": args.config,
        "smoke": args.smoke,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "loss": f"chunked cross-entropy ({LOSS_CHUNK}-token chunks)",
        "optimizer": "AdamW (foreach), states in the parameter dtype",
    }


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    config = transformers.LlamaConfig(
        **args.config, max_position_embeddings=max(args.longest_max, *args.seqlens)
    )
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="flashmask", dtype=dtype
        )
    return model.train()


# ---------------------------------------------------------------------- data
def _docs(total: int, generator: torch.Generator, low: int, high: int) -> list[int]:
    lens, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(low, high + 1, (1,), generator=generator)))
        lens.append(n)
        left -= n
    return lens


def _sft_batch(seqlen: int, generator: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """One row of ``seqlen`` tokens, filled with random documents of S/16 to S/4 tokens."""
    lens = _docs(seqlen, generator, max(1, seqlen // 16), max(1, seqlen // 4))
    samples = [{"input_ids": torch.randint(1, vocab, (n,), generator=generator)} for n in lens]
    return data.pack_sft(samples, seqlen, pad_to_max_tokens=True)


def _dpo_pairs(seqlen: int, generator: torch.Generator, vocab: int) -> list[dict]:
    """Random preference pairs filling one row of ``seqlen`` tokens: prompts of S/32 to S/4
    tokens, responses of S/64 to S/8."""
    pairs, total = [], 0
    while True:
        p = int(torch.randint(max(1, seqlen // 32), max(2, seqlen // 4), (1,), generator=generator))
        c, r = (
            int(torch.randint(max(1, seqlen // 64), max(2, seqlen // 8), (1,), generator=generator))
            for _ in range(2)
        )
        if total + p + c + r > seqlen:
            return pairs
        pairs.append(
            {
                key: torch.randint(1, vocab, (n,), generator=generator)
                for key, n in (("prompt", p), ("chosen", c), ("rejected", r))
            }
        )
        total += p + c + r


def _separate_batch(pairs: list[dict]) -> dict:
    """The usual DPO layout: ``prompt ‖ chosen`` and ``prompt ‖ rejected`` as separate rows
    (chosen rows first), right-padded to the longest, with a 2-D padding mask and, per row, the
    response's first position and length."""
    rows = [torch.cat([p["prompt"], p[key]]) for key in ("chosen", "rejected") for p in pairs]
    starts = [len(p["prompt"]) for _ in range(2) for p in pairs]
    seqlen = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), seqlen, dtype=torch.int64)
    attention_mask = torch.zeros(len(rows), seqlen, dtype=torch.int64)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    lengths = [len(r) - s for r, s in zip(rows, starts, strict=True)]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "starts": starts,
        "lengths": lengths,
        "seqlen": seqlen,
    }


def _separate_logps(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probabilities of :func:`_separate_batch` rows: ``(chosen, rejected)``."""
    ids = batch["input_ids"].to(logits.device)
    sums = []
    for i, (start, length) in enumerate(zip(batch["starts"], batch["lengths"], strict=True)):
        logp = logits[i, start - 1 : start + length - 1].float().log_softmax(-1)
        sums.append(logp.gather(-1, ids[i, start : start + length, None]).sum())
    sums = torch.stack(sums)
    half = len(sums) // 2
    return sums[:half], sums[half:]


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention removed: the output is the query itself (``[B, S, H, D]``), costing nothing."""
    return query.transpose(1, 2), None


transformers.AttentionInterface.register(NO_ATTENTION, _no_attention)


def _inputs(batch: dict, backend: str, device: torch.device) -> dict:
    """Model inputs for ``backend``: the FlashMask tensor, a dense bool mask or a BlockMask."""
    inputs = {k: batch[k].to(device) for k in ("input_ids", "position_ids")}
    if backend == NO_ATTENTION:
        return inputs
    sri = batch["startend_row_indices"].to(device)
    if backend == "flashmask":
        inputs["startend_row_indices"] = sri
    elif backend == "sdpa":
        inputs["attention_mask"] = data.dense_attention_mask(sri)
    else:
        inputs["attention_mask"] = _block_mask(sri)
    return inputs


def _block_mask(sri: torch.Tensor):
    """A FlexAttention ``BlockMask`` equal to the causal C=1 FlashMask ``sri [B, 1, S, 1]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    lts = sri[:, 0, :, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < lts[b, kv_idx])

    batch, seqlen = lts.shape
    # Compiled, the mask is built block by block; eagerly it would materialise S x S.
    compiled = sri.device.type == "cuda"
    return create_block_mask(
        mask_mod, batch, None, seqlen, seqlen, device=sri.device, _compile=compiled
    )


# ---------------------------------------------------------------------- steps
def _chunked_loss(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, the LM head recomputed per chunk in the backward."""
    hidden, labels = hidden[:, :-1], labels[:, 1:]
    count = (labels != -100).sum().clamp(min=1)

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], LOSS_CHUNK):
        end = start + LOSS_CHUNK
        total = total + torch.utils.checkpoint.checkpoint(
            chunk_loss, hidden[:, start:end], labels[:, start:end], use_reentrant=False
        )
    return total / count


def _set_backend(model, backend: str) -> None:
    if model.config._attn_implementation != backend:
        model.set_attn_implementation(backend)


def _sft_step(model, optimizer, backend: str, batch: dict, device: torch.device) -> None:
    _set_backend(model, backend)
    inputs = _inputs(batch, backend, device)
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    loss = _chunked_loss(model, hidden, batch["labels"].to(device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _dpo_update(model, optimizer, logps: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One DPO step from ``logps()`` (one forward, ``(chosen, rejected)`` log-probs): a no-grad
    reference pass, the policy pass and its backward, an AdamW step."""
    # The reference pass reuses the policy's weights: its cost, not its value, is measured.
    with torch.no_grad():
        ref = logps()
    loss = data.dpo_loss(*logps(), *ref, beta=0.1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _dpo_step(model, optimizer, backend: str, batch: dict, device: torch.device) -> None:
    """One shared-prompt DPO step with ``backend``."""
    _set_backend(model, backend)
    inputs = _inputs(batch, backend, device)
    index = {k: v.to(device) for k, v in batch.items()}
    _dpo_update(
        model,
        optimizer,
        lambda: data.response_logps(model(**inputs, use_cache=False).logits, index),
    )


def _separate_inputs(batch: dict, device: torch.device) -> dict:
    return {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}


def _dpo_separate_step(model, optimizer, batch: dict, device: torch.device) -> None:
    """The same DPO step on the usual layout (separate padded rows, SDPA, 2-D padding mask)."""
    _set_backend(model, "sdpa")
    inputs = _separate_inputs(batch, device)
    _dpo_update(
        model, optimizer, lambda: _separate_logps(model(**inputs, use_cache=False).logits, batch)
    )


def _dpo_equality(model, shared: dict, separate: dict, device: torch.device) -> dict:
    """Response log-probs and a DPO loss from the shared-prompt rows (flashmask) and from the
    separate rows (SDPA), same weights. The loss uses zero reference log-probs (the reference
    pass would see the same weights) so that it depends on the policy's log-probs alone."""
    with torch.no_grad():
        _set_backend(model, "flashmask")
        index = {k: v.to(device) for k, v in shared.items()}
        logits = model(**_inputs(shared, "flashmask", device), use_cache=False).logits
        packed = data.response_logps(logits, index)
        del logits
        _set_backend(model, "sdpa")
        inputs = _separate_inputs(separate, device)
        usual = _separate_logps(model(**inputs, use_cache=False).logits, separate)
    a, b = torch.cat(packed).double(), torch.cat(usual).double()
    zero = torch.zeros_like(packed[0])
    loss_packed = float(data.dpo_loss(*packed, zero, zero, beta=0.1))
    loss_usual = float(data.dpo_loss(*usual, zero, zero, beta=0.1))
    return {
        "pairs": len(separate["starts"]) // 2,
        "response_tokens": int(sum(separate["lengths"])),
        "max_abs_logp_diff": float((a - b).abs().max()),
        "mean_abs_logp": round(float(b.abs().mean()), 2),
        "max_rel_logp_diff": float((a - b).abs().max() / b.abs().max()),
        "loss_shared_flashmask": loss_packed,
        "loss_separate_sdpa": loss_usual,
    }


# ---------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _measure(
    step: Callable[[], None],
    args: argparse.Namespace,
    device: torch.device,
    deadline: float,
    *,
    tokens: int,
    pairs: int | None = None,
    warmup: int | None = None,
    steps: int | None = None,
) -> dict:
    """Run ``warmup`` untimed and ``steps`` timed steps: tokens/s from the median step time,
    peak memory (CUDA) over all of them; ``status`` says ok / OOM / error / skipped."""
    warmup = args.warmup if warmup is None else warmup
    steps = args.steps if steps is None else steps
    if time.monotonic() > deadline:
        return {"status": "skipped (time budget)"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    try:
        for i in range(warmup + steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    except Exception as error:  # report and go on: one backend failing must not stop the rest
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if _is_oom(error):
            return {"status": "OOM"}
        traceback.print_exc()
        return {"status": f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    seconds = statistics.median(times)
    result = {
        "status": "ok",
        "tokens": tokens,
        "step_ms": round(seconds * 1e3, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }
    if pairs is not None:
        result["pairs"] = pairs
        result["pairs_per_s"] = round(pairs / seconds, 2)
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def _longest(model, optimizer, backend, args, device, generator, deadline) -> dict:
    """Double the packed length from ``--longest-start`` while one checkpointed step fits."""
    best, tried, seqlen = None, [], args.longest_start
    while seqlen <= args.longest_max:
        batch = _sft_batch(seqlen, generator, args.vocab)
        result = _measure(
            lambda b=batch: _sft_step(model, optimizer, backend, b, device),
            args,
            device,
            deadline,
            tokens=seqlen,
            warmup=0,
            steps=1,
        )
        tried.append({"seqlen": seqlen} | result)
        if result["status"] != "ok":
            break
        best = {"seqlen": seqlen} | result
        if result["step_ms"] / 1e3 > args.step_limit_s:
            tried[-1]["status"] = "ok (step time limit reached)"
            break
        seqlen *= 2
    return {"longest_seqlen": None if best is None else best["seqlen"], "tried": tried}


# ---------------------------------------------------------------------- report
def _log(what: str, row: dict) -> None:
    print(f"[{what}] " + json.dumps({k: v for k, v in row.items() if k != "tried"}), flush=True)


def _markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# End-to-end training benchmark",
        "",
        f"{meta['date']}, {meta['device']}, {meta['dtype']}, torch {meta['torch']}, "
        f"triton {meta['triton']}, transformers {meta['transformers']}"
        + (" (smoke run: tiny model on CPU)" if meta["smoke"] else ""),
        "",
        f"Model: {json.dumps(meta['model'])}. Loss: {meta['loss']}. Optimizer: "
        f"{meta['optimizer']}. Median of {meta['timed_steps']} steps after "
        f"{meta['warmup_steps']} warm-up steps; peak memory over all of them.",
        "",
    ]
    lines += [
        "## Packed SFT",
        "",
        f"`{NO_ATTENTION}` replaces attention by the identity: the speed the rest of the model "
        "allows.",
        "",
        "| seqlen | backend | tokens/s | step ms | peak GiB | status |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for row in report["sft"]:
        lines.append(
            f"| {row['seqlen']} | {row['backend']} | {row.get('tokens_per_s', '')} | "
            f"{row.get('step_ms', '')} | {row.get('peak_gib', '')} | {row['status']} |"
        )
    lines += [
        "",
        "## DPO",
        "",
        "One step = no-grad reference forward + policy forward and backward + AdamW. The shared "
        "layout packs `prompt ‖ chosen ‖ rejected` into one row (share-question mask); the "
        "separate layout is the usual one (prompt+chosen and prompt+rejected as padded rows).",
        "",
        "| layout | backend | row length | pairs/s | tokens/s | step ms | peak GiB | status |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["dpo"]:
        lines.append(
            f"| {row.get('layout', '')} | {row['backend']} | {row['seqlen']} | "
            f"{row.get('pairs_per_s', '')} | {row.get('tokens_per_s', '')} | "
            f"{row.get('step_ms', '')} | {row.get('peak_gib', '')} | {row['status']} |"
        )
    equality = report.get("dpo_equality")
    if equality:
        lines += [
            "",
            f"Same weights, {equality['pairs']} pairs ({equality['response_tokens']} response "
            f"tokens): response log-probs differ by at most {equality['max_abs_logp_diff']:.3g} "
            f"(mean |log p| {equality['mean_abs_logp']}; relative "
            f"{equality['max_rel_logp_diff']:.2e}); DPO loss (zero reference) "
            f"{equality['loss_shared_flashmask']:.6f} shared/flashmask vs "
            f"{equality['loss_separate_sdpa']:.6f} separate/SDPA.",
        ]
    lines.append("")
    lines += ["## Longest trainable packed sequence (gradient checkpointing)", ""]
    lines += ["| backend | longest seqlen | tried (step s, peak GiB) |", "|---|---:|---|"]
    for row in report["longest"]:
        tried = ", ".join(
            f"{t['seqlen']}: {t['status']}"
            + (f" ({t['step_ms'] / 1e3:.1f} s, {t['peak_gib']} GiB)" if "peak_gib" in t else "")
            for t in row["tried"]
        )
        lines.append(f"| {row['backend']} | {row['longest_seqlen']} | {tried} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
