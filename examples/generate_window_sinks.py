"""Batched generation with a sliding window and attention sinks, prompts of different lengths.

    python examples/generate_window_sinks.py                 # tiny model, GPU if any, else CPU
    python examples/generate_window_sinks.py --config 1b     # ~1B Llama-style model on a GPU

* a randomly initialised Llama (built from a config: nothing is downloaded) gets a sliding
  window of ``--window`` keys plus ``--sinks`` attention-sink tokens on every layer
  (``apply_flashmask``);
* prompts of different lengths (byte-tokenised text from ``examples/data``) are left-padded as
  a tokenizer would pad them and decoded greedily with chunked prefill (``stream_generate``):
  positions count each row's own tokens, padding is seen by no query, and every layer's cache
  keeps each row's sinks and the last ``window`` keys only;
* it prints tokens/s, the cache's bytes against a cache that keeps every key, and whether each
  row got the tokens it gets when generated alone (``--no-check`` skips that).
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import torch
import transformers

import flashmask
from flashmask.integrations.streaming import cache_nbytes, stream_generate


def left_padded(lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, max(lengths)]``: row ``b`` is the first
    ``lengths[b]`` bytes of the shipped SFT text, padded on the left with ``common.PAD_ID``."""
    records = common.load_jsonl("sft.jsonl")
    text = common.encode("".join(r["prompt"] + r["completion"] for r in records))
    width = max(lengths)
    ids = torch.full((len(lengths), width), common.PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.tensor(text[:n])
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(common.CONFIGS), default="tiny")
    p.add_argument("--lengths", default="1,24,60,120", help="prompt lengths (1,24,60,120)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per row (64)")
    p.add_argument("--window", type=int, default=32, help="sliding window keys (32)")
    p.add_argument("--sinks", type=int, default=4, help="attention-sink tokens (4)")
    p.add_argument("--prefill-chunk", type=int, default=32, help="prompt columns per pass (32)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda")
    p.add_argument("--no-check", action="store_true", help="skip generating each row alone")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # The Triton kernels take half precision; the CPU runs the exact float32 reference.
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=common.VOCAB_SIZE,
        pad_token_id=common.PAD_ID,
        max_position_embeddings=4096,
        **common.CONFIGS[args.config],
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(args.device).eval()
    flashmask.apply_flashmask(
        model, mask="sliding_window", window=args.window, sink_tokens=args.sinks
    )

    ids, mask = left_padded(lengths, args.device)
    generate = {"prefill_chunk": args.prefill_chunk}
    stream_generate(model, ids[:, -8:], 2, **generate)  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize(args.device)
    t0 = time.perf_counter()
    tokens, cache = stream_generate(model, ids, args.new_tokens, attention_mask=mask, **generate)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize(args.device)
    seconds = time.perf_counter() - t0
    rate = tokens.numel() / seconds

    # A cache without eviction holds every column of the padded batch (as transformers' does).
    columns = cache.get_seq_length()
    kept = cache_nbytes(cache)
    full = sum(
        (layer.keys[..., :1, :].numel() + layer.values[..., :1, :].numel())
        * layer.keys.element_size()
        * columns
        for layer in cache.layers
    )

    tag = f"generate_window_sinks [{args.config}, {args.device}, {str(dtype).split('.')[-1]}]"
    print(f"{tag}: window {args.window} + {args.sinks} sinks, prompts of {lengths} tokens")
    print(f"generated {len(lengths)} x {args.new_tokens} tokens in {seconds:.2f} s = "
          f"{rate:,.0f} tokens/s (chunked prefill of {args.prefill_chunk})")  # fmt: skip
    print(f"cache: {kept:,} B ({cache.layers[0].keys.shape[-2]} keys per row and layer); "
          f"without eviction: {full:,} B ({columns} keys); {full / kept:.1f}x")  # fmt: skip
    for row, n in enumerate(lengths):
        print(f"  row {row} ({n:3d} prompt tokens): {tokens[row, :12].tolist()} ...")

    summary = {"tokens_per_s": rate, "cache_bytes": kept, "full_cache_bytes": full}
    if not args.no_check:
        same = 0
        for row, n in enumerate(lengths):
            single, _ = stream_generate(model, ids[row : row + 1, -n:], args.new_tokens, **generate)
            same += int(torch.equal(single[0], tokens[row]))
        # bfloat16 on a GPU may flip a near tie between batched and single-row runs.
        print(f"rows equal to their generation alone: {same}/{len(lengths)}")
        summary["rows_equal_alone"] = same
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
