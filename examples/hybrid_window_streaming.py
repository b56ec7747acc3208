"""Hybrid-window model: train a few steps under a growing-window schedule, then stream.

* layers alternate between a sliding window (with 4 attention-sink tokens) and full causal
  attention; the window grows during training (16 keys until step 4, 32 until step 8, then 64);
* after training, generation streams with chunked prefill and single-token decode; the windowed
  layers keep only ``sinks + window`` keys, so their cache stays bounded however long the
  generation runs, and the printout compares its memory with a full cache.

Runs on the CPU in seconds with a tiny random Llama:
``python examples/hybrid_window_streaming.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import flashmask
from flashmask.integrations.policy import MaskSchedule, MaskSpec
from flashmask.integrations.streaming import cache_nbytes, stream_generate, streaming_cache


def schedule_for(window: int) -> list[MaskSpec]:
    """Even layers: sliding window with 4 sinks; odd layers: causal."""
    return [MaskSpec("sliding_window", window=window, sink_tokens=4), MaskSpec("causal")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=200)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    windows = [16, 32, 64]
    schedule = MaskSchedule([(0, schedule_for(16)), (4, schedule_for(32)), (8, schedule_for(64))])
    flashmask.apply_flashmask(model, mask=schedule)

    # Packed training batch: three documents signalled by restarting position ids.
    lengths = [
        args.seqlen // 2,
        args.seqlen // 4,
        args.seqlen - args.seqlen // 2 - args.seqlen // 4,
    ]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    data = torch.randint(0, 256, (1, args.seqlen))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(args.steps):
        schedule.set_step(step)  # from a Trainer: trainer.add_callback(schedule.callback())
        t0 = time.perf_counter()
        loss = model(input_ids=data, position_ids=position_ids, labels=data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        window = windows[schedule.current_index()]
        print(f"step {step}: window {window:3d}  loss {loss.item():.4f}  "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms")  # fmt: skip

    model.eval()
    prompt = torch.randint(0, 256, (1, args.seqlen))
    cache = streaming_cache(model)
    t0 = time.perf_counter()
    tokens, cache = stream_generate(model, prompt, args.new_tokens, prefill_chunk=64, cache=cache)
    seconds = time.perf_counter() - t0
    seen = cache.get_seq_length()
    windowed, full = cache.layers[0], cache.layers[1]
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * 4  # bytes of k + v per token, fp32
    print(f"streamed {tokens.shape[1]} tokens after a {prompt.shape[1]}-token prompt "
          f"(chunked prefill of 64) in {seconds:.2f} s")  # fmt: skip
    print(f"tokens seen per layer: {seen}")
    kept, grown = windowed.keys.shape[-2], full.keys.shape[-2]
    print(f"windowed layer cache: {kept} keys ({kept * per_token} B); "
          f"causal layer cache: {grown} keys ({grown * per_token} B)")  # fmt: skip
    print(f"whole cache: {cache_nbytes(cache)} B; without eviction: "
          f"{seen * per_token * config.num_hidden_layers} B")  # fmt: skip


if __name__ == "__main__":
    main()
