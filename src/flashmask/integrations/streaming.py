"""Streaming generation under sliding-window FlashMask policies, with a bounded KV cache.

With a layer policy of ``"sliding_window"`` (window ``w``, ``sink_tokens`` ``s``), a key at
position ``a`` is visible to query ``p`` only when ``a < s`` or ``p - w <= a <= p``. Once the
queries have moved past ``a + w`` no future query sees it, so the cache of such a layer keeps the
``s`` sink tokens and the last ``w`` tokens only: O(w + s) memory per layer whatever the length
generated. The layer's mask, aligned bottom-right, reads the kept keys correctly: the cache holds
``[sinks | the w tokens before the new queries | the new queries]``, exactly what
``masks.sliding_window(Sk, w, sink_tokens=s, seqlen_q=Sq)`` expects. Other layers keep all keys.

    apply_flashmask(model, mask="sliding_window", window=256, sink_tokens=4)
    tokens = stream_generate(model, input_ids, max_new_tokens=64, prefill_chunk=512)

Padding is not supported here (one sequence, or a batch of equal-length prompts).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from flashmask.integrations.policy import _attention_modules, policy_of, spec_of

__all__ = ["StreamingLayer", "cache_nbytes", "stream_generate", "streaming_cache"]


class StreamingLayer(DynamicLayer):
    """A cache layer that keeps the first ``sink_tokens`` and the last ``window`` keys/values.

    ``get_seq_length`` reports every token seen, so positions (RoPE) stay those of the full
    sequence while the stored tensors stay bounded.
    """

    is_croppable = False

    def __init__(self, window: int, sink_tokens: int = 0) -> None:
        super().__init__()
        self.window = window
        self.sink_tokens = sink_tokens
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new states; return all keys the new queries may see; keep the bounded set."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        keep = self.sink_tokens + self.window
        if keys.shape[-2] > keep:
            s, tail = self.sink_tokens, keys.shape[-2] - self.window
            self.keys = torch.cat([keys[..., :s, :], keys[..., tail:, :]], dim=-2)
            self.values = torch.cat([values[..., :s, :], values[..., tail:, :]], dim=-2)
        else:
            self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.keys.shape[-2] if self.is_initialized else 0
        return stored + query_length, 0

    def get_max_length(self) -> int:
        return self.sink_tokens + self.window

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a streaming cache layer cannot be cropped (evicted keys are gone)"
        )

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


def streaming_cache(model: torch.nn.Module) -> Cache:
    """A cache for ``model`` (after :func:`apply_flashmask`): bounded :class:`StreamingLayer` for
    sliding-window layers, ordinary growing layers for the rest."""
    modules = sorted(_attention_modules(model), key=lambda m: m.layer_idx)
    layers = []
    for module in modules:
        spec = spec_of(policy_of(module), module.layer_idx)
        if spec is not None and spec.kind == "sliding_window":
            layers.append(StreamingLayer(spec.window, spec.sink_tokens))
        else:
            layers.append(DynamicLayer())
    return Cache(layers=layers)


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by the keys and values of a cache."""
    total = 0
    for layer in cache.layers:
        if layer.is_initialized:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


@torch.no_grad()
def stream_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    prefill_chunk: int | None = None,
    cache: Cache | None = None,
) -> tuple[torch.Tensor, Cache]:
    """Greedy generation with chunked prefill and single-token decode over a streaming cache.

    Args:
        input_ids: ``[B, S]`` prompt (no padding).
        max_new_tokens: tokens to generate.
        prefill_chunk: prompt tokens per forward pass (default: the whole prompt at once).
        cache: a cache to continue from (default: a new :func:`streaming_cache`).

    Returns:
        ``(tokens [B, max_new_tokens], cache)``.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seqlen > 0], got {tuple(input_ids.shape)}")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
    cache = streaming_cache(model) if cache is None else cache
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept both generations.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step = prefill_chunk or input_ids.shape[1]
    logits = None
    for start in range(0, input_ids.shape[1], step):
        chunk = input_ids[:, start : start + step]
        logits = model(input_ids=chunk, use_cache=True, **{name: cache}).logits
    tokens = []
    for _ in range(max_new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(next_token)
        if len(tokens) == max_new_tokens:
            break
        logits = model(input_ids=next_token, use_cache=True, **{name: cache}).logits
    return torch.cat(tokens, dim=1), cache
