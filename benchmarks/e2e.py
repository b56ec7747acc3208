"""End-to-end training benchmark: a ~1B model, packed SFT and shared-prompt DPO.

``--model`` picks the model's style (each about 1B parameters, hidden size 2048, 16 layers):

* ``llama`` (default): Llama, GQA with 16 query and 8 key/value heads of 128 dims;
* ``gpt_oss``: gpt-oss, learnable per-head attention sinks, layers alternating between a
  128-token sliding window and full attention, 32 query and 8 key/value heads of 64 dims, a
  mixture of 4 experts (top 2) as the MLP;
* ``deepseek_v3``: DeepSeek-V3's multi-head latent attention (q/k head dim 192 = 128 + 64
  rotary, v head dim 128), every MLP dense.

For each attention backend (``flashmask`` with its O(N) mask, ``sdpa`` with the same mask as a
dense 4-D boolean tensor, ``flex_attention`` with a ``BlockMask`` built from it) this measures
tokens/s and peak CUDA memory of full training steps (forward, backward, AdamW):

* packed SFT at 4K, 8K, 16K and 32K tokens per row (random documents of S/16 to S/4 tokens,
  causal-document mask, one row per step);
* shared-prompt DPO at 8K (pairs ``prompt ‖ chosen ‖ rejected``, share-question mask; the
  step is a no-grad reference forward plus the policy's forward and backward);
* the longest packed sequence that still trains, with gradient checkpointing (doubling from
  32K until out of memory, the step-time limit or ``--longest-max``).

A backend that cannot train the model on the device (transformers refuses it, would drop the
model's attention sinks, or the device has no backward for it) is not run: its rows say
``skipped: <why>`` and the report's header repeats the reason. gpt-oss's sinks leave out
``sdpa`` everywhere and ``flex_attention`` off CUDA, for instance. The separate-rows DPO baseline
uses the first of ``sdpa``, ``flex_attention`` and ``eager`` that can train the model.

The loss is a chunked cross-entropy (LM head and loss recomputed per 8K-token chunk in the
backward) so that the vocabulary projection does not hide the attention's memory. Every result
is written as soon as it is measured, to ``DIR/e2e.json`` and ``DIR/e2e.md`` (``--out DIR``,
default ``$OUT`` or ``benchmarks/results/e2e``). Parts that would start after ``--budget-s``
seconds are skipped (and marked so), which keeps a run inside a fixed time slot.

Usage, from the repository root (the README's table: ``benchmarks/gpu_run.sh e2e``)::

    PYTHONPATH=src python3 benchmarks/e2e.py            # ~1B model, bf16, one CUDA GPU
    PYTHONPATH=src python3 benchmarks/e2e.py --longest-max 262144 --step-limit-s 30
    PYTHONPATH=src python3 benchmarks/e2e.py --smoke    # tiny model on CPU, checks the script
    PYTHONPATH=src python3 benchmarks/e2e.py --model gpt_oss   # or deepseek_v3
    PYTHONPATH=src python3 benchmarks/e2e.py --count-params     # each ~1B model's size

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
# Per model style: the transformers config class, a ~1B config (the GPU run) and a tiny one
# (--smoke on CPU) of the same structure.
MODELS: dict[str, dict] = {
    "llama": {
        "title": "Llama-style",
        "config_class": "LlamaConfig",
        "1b": {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        },
    },
    "gpt_oss": {
        "title": "gpt-oss-style",
        "config_class": "GptOssConfig",
        # 4 experts of intermediate size 2048 keep the total near 1B; every other layer (the
        # first included) slides a 128-token window, as gpt-oss does.
        "1b": {
            "hidden_size": 2048,
            "intermediate_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "vocab_size": 32000,
        },
        # The window is shorter than the smoke run's documents and responses, so it masks.
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 32,
            "vocab_size": 256,
        },
    },
    "deepseek_v3": {
        "title": "MLA-style (DeepSeek-V3)",
        "config_class": "DeepseekV3Config",
        # Every layer dense (first_k_dense_replace = all of them): the attention is the point.
        "1b": {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 16,
            "vocab_size": 32000,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "first_k_dense_replace": 2,
            "vocab_size": 256,
        },
    },
}
# The separate-rows DPO baseline: the first of these that can train the model on the device.
SEPARATE_BACKENDS = ("sdpa", "flex_attention", "eager")
LOSS_CHUNK = 8192
NO_ATTENTION = "no_attention"
PARTS = ("sft", "dpo", "longest")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.count_params:
        for style, spec in MODELS.items():
            # The position limit changes no parameter (RoPE has none).
            counts = _parameter_counts(_config(style, spec["1b"], 131072))
            print(f"{style}: {counts['total']:,} parameters ({counts['active']:,} per token)")
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    model = _model(args, device, dtype)
    args.window = _sliding_window(model.config)
    skipped = {b: why for b in args.backends if (why := _cannot_train(model, b, device))}
    args.separate_backend = next(
        b for b in SEPARATE_BACKENDS if b == "eager" or not _cannot_train(model, b, device)
    )
    report = {
        "meta": _meta(args, model, device, dtype, skipped),
        "sft": [],
        "dpo": [],
        "longest": [],
    }

    def save() -> None:
        (out_dir / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "e2e.md").write_text(_markdown(report))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    generator = torch.Generator().manual_seed(0)
    save()

    for seqlen in args.seqlens if "sft" in args.parts else []:
        batch = _sft_batch(seqlen, generator, args.vocab)
        # "no_attention" (attention replaced by the identity) is the bound that the rest of the
        # model sets: no attention backend can train faster than it.
        for backend in [*args.backends, NO_ATTENTION]:
            row = {"backend": backend, "seqlen": seqlen}
            if backend in skipped:
                row["status"] = _skip_status(backend, skipped)
            else:
                row |= _measure(
                    lambda b=backend, x=batch: _sft_step(model, optimizer, b, x, device, args),
                    args,
                    device,
                    deadline,
                    tokens=int((batch["sample_index"] >= 0).sum()),
                )
            report["sft"].append(row)
            _log("sft", row)
            save()

    if "dpo" in args.parts:
        _run_dpo(model, optimizer, args, device, generator, deadline, report, save, skipped)
    if "longest" in args.parts:
        enable_activation_checkpointing(model)
    for backend in args.backends if "longest" in args.parts else []:
        if backend in skipped:
            row = {"backend": backend, "longest_seqlen": None, "tried": []}
            row["status"] = _skip_status(backend, skipped)
        else:
            row = {"backend": backend} | _longest(
                model, optimizer, backend, args, device, generator, deadline
            )
        report["longest"].append(row)
        _log("longest", row)
        save()

    print(f"wrote {out_dir / 'e2e.json'} and {out_dir / 'e2e.md'}")
    print(_markdown(report))
    return 0


def _run_dpo(
    model,
    optimizer,
    args: argparse.Namespace,
    device: torch.device,
    generator: torch.Generator,
    deadline: float,
    report: dict,
    save: Callable[[], None],
    skipped: dict[str, str],
) -> None:
    """Shared-prompt DPO with every backend, the usual separate layout with the baseline backend
    (``args.separate_backend``), and the check that both layouts give the same log-probs and
    loss."""
    pairs = _dpo_pairs(args.dpo_seqlen, generator, args.vocab)
    batch = data.pack_preference(pairs, args.dpo_seqlen, pad_to_max_tokens=True)
    separate = _separate_batch(pairs)
    report["dpo_equality"] = _dpo_equality(model, batch, separate, device, args)
    _log("dpo_equality", report["dpo_equality"])
    for backend in args.backends:
        row = {"backend": backend, "layout": "shared prompt", "seqlen": args.dpo_seqlen}
        if backend in skipped:
            row["status"] = _skip_status(backend, skipped)
        else:
            row |= _measure(
                lambda b=backend: _dpo_step(model, optimizer, b, batch, device, args),
                args,
                device,
                deadline,
                tokens=int((batch["input_ids"] != 0).sum()),
                pairs=len(pairs),
            )
        report["dpo"].append(row)
        _log("dpo", row)
        save()
    backend = args.separate_backend
    row = {"backend": backend, "layout": "separate sequences", "seqlen": separate["seqlen"]}
    row |= _measure(
        lambda: _dpo_separate_step(model, optimizer, backend, separate, device),
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
    p.add_argument(
        "--model", choices=tuple(MODELS), default="llama", help="the model's style (llama)"
    )
    p.add_argument(
        "--count-params",
        action="store_true",
        help="print each ~1B model's parameter count (meta device, no memory) and exit",
    )
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
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.count_params:
        p.error("CUDA is not available; use --smoke for the CPU check")
    args.config = MODELS[args.model]["tiny" if smoke else "1b"]
    args.vocab = args.config["vocab_size"]
    return args


def _meta(
    args: argparse.Namespace,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    skipped: dict[str, str],
) -> dict:
    """The run's settings: versions, the model (style, class, config, size) and the backends
    not run with the reason for each."""
    counts = _parameter_counts(model)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": transformers.__version__,
        "flashmask": flashmask.__version__,
        "python": platform.python_version(),
        "model_style": args.model,
        "model_class": type(model).__name__,
        "model": args.config,
        "parameters": counts["total"],
        "parameters_per_token": counts["active"],
        "sliding_window": args.window,
        "attention_sinks": _has_sinks(model),
        "smoke": args.smoke,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "loss": f"chunked cross-entropy ({LOSS_CHUNK}-token chunks)",
        "optimizer": "AdamW (foreach), states in the parameter dtype",
        "skipped_backends": skipped,
        "separate_dpo_backend": args.separate_backend,
    }
    experts = getattr(model.config, "_experts_implementation", None)
    if counts["active"] != counts["total"] and experts is not None:
        meta["experts_implementation"] = experts
    return meta


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def _config(style: str, values: dict, max_positions: int) -> transformers.PretrainedConfig:
    """The transformers config of model ``style`` with ``values`` (a ``MODELS`` entry)."""
    config_class = getattr(transformers, MODELS[style]["config_class"])
    return config_class(**values, max_position_embeddings=max_positions)


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    config = _config(args.model, args.config, max(args.longest_max, *args.seqlens))
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="flashmask", dtype=dtype
        )
    return model.train()


def _parameter_counts(
    model_or_config: torch.nn.Module | transformers.PretrainedConfig,
) -> dict[str, int]:
    """Parameters of a model (a config is instantiated on the meta device, without memory):
    ``total``, and ``active``, those one token uses (a mixture of experts' top-k share)."""
    model = model_or_config
    if isinstance(model, transformers.PretrainedConfig):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                model_or_config, attn_implementation="eager"
            )
    config = model.config
    total = experts = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".experts." in name:  # routed experts; DeepSeek's shared ones run for every token
            experts += param.numel()
    count = getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", 1)
    top_k = getattr(config, "num_experts_per_tok", count)
    return {"total": total, "active": total - experts + experts * top_k // count}


def _sliding_window(config: transformers.PretrainedConfig) -> int | None:
    """The window of the model's sliding-window layers (``None``: it has none)."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return config.sliding_window
    return None


def _has_sinks(model: torch.nn.Module) -> bool:
    """Whether the attention layers have learnable sinks (gpt-oss's ``sinks``)."""
    return any(name.endswith(".sinks") for name, _ in model.named_parameters())


def _cannot_train(model: torch.nn.Module, backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot train ``model`` on ``device`` (``None``: it can)."""
    if backend in ("flashmask", NO_ATTENTION):
        return None
    current = model.config._attn_implementation
    try:
        model.set_attn_implementation(backend)
    except (ValueError, ImportError) as error:
        return f"transformers refuses it: {str(error).split('. ')[0]}"
    finally:
        model.set_attn_implementation(current)
    if _has_sinks(model) and backend == "sdpa":
        # transformers' SDPA function takes no sinks: it would run a model without them.
        return "transformers' sdpa attention drops the attention sinks"
    if _has_sinks(model) and backend == "flex_attention" and device.type != "cuda":
        # transformers adds the sinks from FlexAttention's log-sum-exp, which it reads only on
        # CUDA; elsewhere it raises.
        return "transformers' flex_attention applies attention sinks on CUDA only"
    if backend == "flex_attention" and device.type != "cuda":
        return _flex_backward_error(device)
    return None


def _flex_backward_error(device: torch.device) -> str | None:
    """torch's reason why FlexAttention has no backward on ``device`` (``None``: it has one)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 16, 16, device=device, requires_grad=True)
    try:
        flex_attention(q, q, q).sum().backward()
    except NotImplementedError as error:
        return f"torch: {str(error).split('. ')[0]}"
    return None


def _skip_status(backend: str, skipped: dict[str, str]) -> str:
    return f"skipped: {skipped[backend]}"


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
    """Attention removed: the output is the query itself (``[B, S, H, Dv]``), costing nothing;
    cut to the value's head dim, which is smaller under MLA (DeepSeek's 192 vs 128)."""
    return query[..., : value.shape[-1]].transpose(1, 2), None


transformers.AttentionInterface.register(NO_ATTENTION, _no_attention)


def _inputs(batch: dict, backend: str, device: torch.device, window: int | None) -> dict:
    """Model inputs for ``backend``: the FlashMask tensor, a dense bool mask or a BlockMask.

    The flashmask backend intersects the mask with a layer's ``sliding_window`` itself; a model
    with sliding-window layers gets the other backends' masks per layer type, the sliding
    layers' within ``window`` (query ``i`` sees keys ``(i - window, i]``, as transformers)."""
    inputs = {k: batch[k].to(device) for k in ("input_ids", "position_ids")}
    if backend == NO_ATTENTION:
        return inputs
    sri = batch["startend_row_indices"].to(device)
    if backend == "flashmask":
        inputs["startend_row_indices"] = sri
        return inputs
    build = _dense_mask if backend == "sdpa" else _block_mask
    if window is None:
        inputs["attention_mask"] = build(sri, None)
    else:
        # A dict is taken as the finished mask of each layer type.
        inputs["attention_mask"] = {
            "full_attention": build(sri, None),
            "sliding_attention": build(sri, window),
        }
    return inputs


def _dense_mask(sri: torch.Tensor, window: int | None) -> torch.Tensor:
    """The dense bool mask ``[B, 1, S, S]`` of the causal FlashMask ``sri``, within ``window``."""
    dense = data.dense_attention_mask(sri)
    if window is None:
        return dense
    rows = torch.arange(dense.shape[-1], device=sri.device)
    return dense & (rows[:, None] - rows[None, :] < window)


def _block_mask(sri: torch.Tensor, window: int | None):
    """A FlexAttention ``BlockMask`` equal to the causal C=1 FlashMask ``sri [B, 1, S, 1]``,
    within ``window`` when given."""
    from torch.nn.attention.flex_attention import create_block_mask

    lts = sri[:, 0, :, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < lts[b, kv_idx])

    def window_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    batch, seqlen = lts.shape
    # Compiled, the mask is built block by block; eagerly it would materialise S x S.
    compiled = sri.device.type == "cuda"
    return create_block_mask(
        mask_mod if window is None else window_mod,
        batch,
        None,
        seqlen,
        seqlen,
        device=sri.device,
        _compile=compiled,
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


def _sft_step(
    model, optimizer, backend: str, batch: dict, device: torch.device, args: argparse.Namespace
) -> None:
    _set_backend(model, backend)
    inputs = _inputs(batch, backend, device, args.window)
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


def _dpo_step(
    model, optimizer, backend: str, batch: dict, device: torch.device, args: argparse.Namespace
) -> None:
    """One shared-prompt DPO step with ``backend``."""
    _set_backend(model, backend)
    inputs = _inputs(batch, backend, device, args.window)
    index = {k: v.to(device) for k, v in batch.items()}
    _dpo_update(
        model,
        optimizer,
        lambda: data.response_logps(model(**inputs, use_cache=False).logits, index),
    )


def _separate_inputs(batch: dict, device: torch.device) -> dict:
    return {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}


def _dpo_separate_step(model, optimizer, backend: str, batch: dict, device: torch.device) -> None:
    """The same DPO step on the usual layout (separate padded rows, 2-D padding mask) with
    ``backend``."""
    _set_backend(model, backend)
    inputs = _separate_inputs(batch, device)
    _dpo_update(
        model, optimizer, lambda: _separate_logps(model(**inputs, use_cache=False).logits, batch)
    )


def _dpo_equality(
    model, shared: dict, separate: dict, device: torch.device, args: argparse.Namespace
) -> dict:
    """Response log-probs and a DPO loss from the shared-prompt rows (flashmask) and from the
    separate rows (``args.separate_backend``), same weights. The loss uses zero reference
    log-probs (the reference pass would see the same weights) so that it depends on the
    policy's log-probs alone."""
    with torch.no_grad():
        _set_backend(model, "flashmask")
        index = {k: v.to(device) for k, v in shared.items()}
        logits = model(**_inputs(shared, "flashmask", device, args.window), use_cache=False).logits
        packed = data.response_logps(logits, index)
        del logits
        _set_backend(model, args.separate_backend)
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
        "separate_backend": args.separate_backend,
        "loss_separate": loss_usual,
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
            lambda b=batch: _sft_step(model, optimizer, backend, b, device, args),
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
    size = "tiny" if meta["smoke"] else f"{meta['parameters'] / 1e9:.2f}B-parameter"
    lines = [
        f"# End-to-end training benchmark: {size} {MODELS[meta['model_style']]['title']} model",
        "",
        f"{meta['date']}, {meta['device']}, {meta['dtype']}, torch {meta['torch']}, "
        f"triton {meta['triton']}, transformers {meta['transformers']}"
        + (" (smoke run: tiny model on CPU)" if meta["smoke"] else ""),
        "",
        f"Model: {meta['model_class']} {json.dumps(meta['model'])}, {meta['parameters']:,} "
        f"parameters"
        + (
            f" ({meta['parameters_per_token']:,} per token)"
            if meta["parameters_per_token"] != meta["parameters"]
            else ""
        )
        + f". Loss: {meta['loss']}. Optimizer: "
        f"{meta['optimizer']}. Median of {meta['timed_steps']} steps after "
        f"{meta['warmup_steps']} warm-up steps; peak memory over all of them.",
        "",
    ]
    for backend, why in meta["skipped_backends"].items():
        lines += [f"Not run: `{backend}`, {why}.", ""]
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
        "separate layout is the usual one (prompt+chosen and prompt+rejected as padded rows, "
        f"`{meta['separate_dpo_backend']}`).",
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
            f"{equality['loss_separate']:.6f} separate/{equality['separate_backend']}.",
        ]
        if meta["sliding_window"] is not None:
            lines[-1] += (
                f" The sliding layers' window ({meta['sliding_window']}) counts row indices: in "
                "the shared row a rejected response's first tokens see fewer prompt tokens "
                "than in their own row (the chosen response lies between), so where a window "
                "reaches back over a chosen response the layouts differ by more than rounding."
            )
    lines.append("")
    lines += ["## Longest trainable packed sequence (gradient checkpointing)", ""]
    lines += ["| backend | longest seqlen | tried (step s, peak GiB) |", "|---|---:|---|"]
    for row in report["longest"]:
        tried = ", ".join(
            f"{t['seqlen']}: {t['status']}"
            + (f" ({t['step_ms'] / 1e3:.1f} s, {t['peak_gib']} GiB)" if "peak_gib" in t else "")
            for t in row["tried"]
        )
        lines.append(
            f"| {row['backend']} | {row['longest_seqlen']} | {tried or row.get('status', '')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
