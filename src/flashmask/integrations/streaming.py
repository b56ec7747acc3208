"""Streaming generation under sliding-window FlashMask policies, with a bounded KV cache.

With a layer policy of ``"sliding_window"`` (window ``w``, ``sink_tokens`` ``s``), a key at
position ``a`` is visible to the query at position ``p`` only when ``a <= p`` and (``a < s`` or
``a >= p - w``). Once a sequence has moved past ``a + w`` no future query sees the key, so the
cache of such a layer (:class:`StreamingLayer`) keeps each sequence's ``s`` sink tokens and the
last ``w`` tokens only: O(w + s) memory per layer whatever the length generated. Layers under
other policies keep every key (:class:`FullLayer`)::

    apply_flashmask(model, mask="sliding_window", window=256, sink_tokens=4)
    tokens, cache = stream_generate(
        model, input_ids, max_new_tokens=64, attention_mask=attention_mask, prefill_chunk=512
    )

**Positions are per sequence.** A batch of prompts of different lengths comes left-padded with a
``[B, S]`` ``attention_mask`` (1 = token, 0 = padding), as for ``model.generate``. Padding never
advances a sequence's positions: the ``t``-th real token of a row has position ``t`` (its RoPE
position id, and the position the window and the sinks are counted in), and padding keys are
visible to no query. Every row therefore generates what it would generate alone.

**Design: a position record per layer.** Each cache layer keeps, beside its keys ``[B, H, K, D]``,
an int64 record ``positions [B, K]``: the per-sequence position of every kept key, ``-1`` for
padding and for empty slots. The record is updated by the same code that appends and evicts the
keys, so it cannot drift from them:

* the tokens of a forward get positions from the layer's per-row counter (``next_position``)
  and the forward's token mask (:attr:`StreamingCache.token_mask`, set by
  :func:`stream_generate`; ``None`` = every token real);
* a :class:`StreamingLayer` holding more than ``s + w`` keys compacts itself to exactly
  ``s + w`` slots: ``s`` sink slots, where slot ``k`` of row ``b`` holds the key at position
  ``k`` of that row once it has left the window (gathered per row: the rows' first tokens sit
  at different columns under left padding), followed by the last ``w`` columns (the window,
  common to all rows because every row advances by one column per token once its padding has
  passed). A sink still inside the window is kept there only, so no key is ever stored twice; a
  sink slot with nothing in it (a row shorter than ``s`` tokens so far) has position ``-1``.
  Padding is therefore never pinned in the sinks: the bound stays ``s + w`` keys however ragged
  the batch.

The record reaches the attention through the layer policies: during :func:`stream_generate`
every attention module's policy is wrapped (and restored afterwards) by one that builds the
layer's mask from the record of the keys the layer's cache just returned: for a
:class:`~flashmask.integrations.policy.MaskSpec` policy, the spec's definition in per-sequence
positions (padding hidden); for an opaque callable policy, the callable's own mask (read in the
cache's column coordinates, as without padding) intersected with the record's padding. The
causal FlashMask forms suffice for causal specs: a layer's cached columns all precede the new
queries, which stand in position order, so the kernels' bottom-right causal triangle is exactly
"key position <= query position". The backend's own derivation from ``position_ids`` (a new
document where positions restart, first forward only) still intersects in; it only separates
padding from real tokens, which the record hides anyway.

A model without layer policies (any attention implementation: eager, sdpa, "flashmask") keeps
every key in every layer, so the record of layer 0 is the history of the batch's 2-D padding
mask: :func:`stream_generate` passes it as ``attention_mask`` with per-sequence
``position_ids``, exactly what ``model.generate`` does for a left-padded batch.

Limits: a model whose attention modules pass transformers' own ``sliding_window`` (Mistral,
Qwen2 with ``use_sliding_window``) gets that window from the backend in column coordinates,
which on a compacted :class:`StreamingLayer` misplaces the sink columns; give such models the
window as a policy instead. An opaque callable policy sees column coordinates: under left
padding a rule written in positions (e.g. "the first 4 keys") lands on the padding.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from flashmask.integrations.policy import MaskSpec, _attention_modules, policy_of, spec_of
from flashmask.integrations.transformers import POLICY_ATTR, MaskContext, Policy
from flashmask.mask import FlashMask, intersect

__all__ = [
    "FullLayer",
    "StreamingCache",
    "StreamingLayer",
    "cache_nbytes",
    "stream_generate",
    "streaming_cache",
]


class _PositionRecord:
    """The per-sequence position record shared by :class:`FullLayer` and :class:`StreamingLayer`.

    Attributes:
        positions: int64 ``[B, K]``, the position of every stored key (``-1``: padding or an empty
            slot); ``None`` before the first update.
        next_position: int64 ``[B]``, the position the next real token of each row gets.
        call_positions: int64 ``[B, Sk]``, the positions of the keys returned by the last update
            (the keys the current forward's queries attend to).
        call_query_start: int64 ``[B]``, the position of the last update's first query, counted
            back from its last one (a chunk's real tokens end it: left padding). Padded queries
            stand below the row's first position; their outputs are never read.

    The batch operations of transformers' layers (``batch_select_indices``, ``reorder_cache``,
    ``batch_repeat_interleave``) move the record's rows with the keys'.
    """

    positions: torch.Tensor | None
    next_position: torch.Tensor | None
    call_positions: torch.Tensor | None
    call_query_start: torch.Tensor | None

    def _clear_record(self) -> None:
        self.positions = None
        self.next_position = None
        self.call_positions = None
        self.call_query_start = None

    def _record_new_tokens(
        self, key_states: torch.Tensor, token_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Positions ``[B, q]`` of the new keys (``-1`` for padding); advances the counters."""
        batch, length, device = key_states.shape[0], key_states.shape[-2], key_states.device
        if self.positions is None:
            self.positions = torch.empty(batch, 0, dtype=torch.int64, device=device)
            self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        if token_mask is None:
            token_mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        elif token_mask.shape != (batch, length):
            raise ValueError(
                f"the cache's token_mask is {tuple(token_mask.shape)} but the forward has "
                f"{batch} rows of {length} tokens"
            )
        counts = token_mask.to(device=device, dtype=torch.int64).cumsum(-1)
        new = torch.where(token_mask.to(device), self.next_position[:, None] + counts - 1, -1)
        self.call_query_start = self.next_position + counts[:, -1] - length
        self.next_position = self.next_position + counts[:, -1]
        return new

    def _select_record_rows(self, index: torch.Tensor) -> None:
        if self.positions is not None:
            index = index.to(self.positions.device)
            self.positions = self.positions[index]
            self.next_position = self.next_position[index]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_record_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_record_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            rows = torch.arange(self.positions.shape[0], device=self.positions.device)
            self._select_record_rows(rows.repeat_interleave(repeats))


class FullLayer(_PositionRecord, DynamicLayer):
    """A growing cache layer (every key kept) with the per-sequence position record."""

    def __init__(self) -> None:
        super().__init__()
        self._clear_record()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        token_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, q, D]``; return all keys and values.

        ``token_mask`` ``[B, q]`` bool marks the real tokens (``None``: all real).
        """
        new = self._record_new_tokens(key_states, token_mask)
        self.positions = torch.cat([self.positions, new], dim=-1)
        self.call_positions = self.positions
        return super().update(key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop of the keys and values; the record follows them."""
        super().crop(tokens_to_remove)
        if self.positions is None or self.positions.shape[-1] == self.keys.shape[-2]:
            return
        self.positions = self.positions[:, : self.keys.shape[-2]]
        if self.positions.shape[-1] == 0:
            self.next_position = torch.zeros_like(self.next_position)
        else:  # the row's last real token, or nothing (-1): next is one past it
            self.next_position = self.positions.max(-1).values + 1
        self.call_positions = self.call_query_start = None

    def reset(self) -> None:
        super().reset()
        self._clear_record()


class StreamingLayer(_PositionRecord, DynamicLayer):
    """A cache layer that keeps each sequence's first ``sink_tokens`` keys and the last ``window``.

    The stored keys are at most ``sink_tokens + window`` per row (see the module docstring for the
    layout). ``get_seq_length`` reports every token column seen (padding included, as
    transformers' own layers do), while the stored tensors stay bounded.
    """

    is_croppable = False

    def __init__(self, window: int, sink_tokens: int = 0) -> None:
        super().__init__()
        self.window = window
        self.sink_tokens = sink_tokens
        self.cumulative_length = 0
        self._clear_record()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        token_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states ``[B, H, q, D]``; return every key the new queries may see
        (kept keys, then the new ones); keep the bounded set.

        ``token_mask`` ``[B, q]`` bool marks the real tokens (``None``: all real).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = self._record_new_tokens(key_states, token_mask)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        positions = torch.cat([self.positions, new], dim=-1)
        self.call_positions = positions
        if keys.shape[-2] > self.sink_tokens + self.window:
            self.keys, self.values, self.positions = self._evict(keys, values, positions)
        else:
            self.keys, self.values, self.positions = keys, values, positions
        return keys, values

    def _evict(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[sink slots | last window columns]`` of ``keys``, ``values`` and ``positions``."""
        tail = keys.shape[-2] - self.window  # columns [tail, end) are the window
        window = (keys[..., tail:, :], values[..., tail:, :], positions[:, tail:])
        if self.sink_tokens == 0:
            return window
        # Sink slot k of row b: the key at position k if it has left the window. Positions are
        # unique within a row, so at most one column matches.
        slots = torch.arange(self.sink_tokens, device=positions.device)
        match = positions[:, :tail, None] == slots  # [B, tail, s]
        found = match.any(1)  # [B, s]
        column = match.to(torch.int8).argmax(1)  # [B, s]; 0 where not found (masked below)

        def gather(states: torch.Tensor) -> torch.Tensor:
            b, h, _, d = states.shape
            index = column[:, None, :, None].expand(b, h, self.sink_tokens, d)
            picked = states.gather(2, index)
            return torch.where(found[:, None, :, None], picked, torch.zeros_like(picked))

        sink_positions = torch.where(found, slots, -1)
        return (
            torch.cat([gather(keys), window[0]], dim=-2),
            torch.cat([gather(values), window[1]], dim=-2),
            torch.cat([sink_positions, window[2]], dim=-1),
        )

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older 5.x pass the cache positions
            query_length = query_length.shape[0]
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
        self._clear_record()


class StreamingCache(Cache):
    """A transformers ``Cache`` of :class:`FullLayer` / :class:`StreamingLayer` (one per layer).

    ``token_mask`` (bool ``[B, q]``, ``None`` = all real) marks the real tokens of the next
    forward; :func:`stream_generate` sets it around every forward and every layer's update reads
    it. Calling the model directly with this cache and no ``token_mask`` treats every token as
    real.
    """

    def __init__(self, layers: list[FullLayer | StreamingLayer]) -> None:
        super().__init__(layers=layers)
        self.token_mask: torch.Tensor | None = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update layer ``layer_idx`` with the new states ``[B, H, q, D]`` and ``token_mask``.

        The layer is called directly: transformers' ``Cache.update`` forwards no extra keyword
        in some 5.x versions, and these layers need none of its ``cache_kwargs``.
        """
        return self.layers[layer_idx].update(key_states, value_states, token_mask=self.token_mask)

    def next_position(self) -> torch.Tensor | None:
        """int64 ``[B]``: the position the next real token of each row gets (``None`` while
        the cache is empty)."""
        return self.layers[0].next_position if self.layers else None


def _layer_for(module: torch.nn.Module) -> FullLayer | StreamingLayer:
    spec = spec_of(policy_of(module), module.layer_idx)
    if spec is not None and spec.kind == "sliding_window":
        return StreamingLayer(spec.window, spec.sink_tokens)
    return FullLayer()


def streaming_cache(model: torch.nn.Module) -> StreamingCache:
    """A cache for ``model`` (after :func:`apply_flashmask`): a bounded :class:`StreamingLayer`
    for each sliding-window layer, a growing :class:`FullLayer` for the rest."""
    modules = sorted(_attention_modules(model), key=lambda m: m.layer_idx)
    return StreamingCache([_layer_for(module) for module in modules])


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by the keys and values of a cache (the position record of a
    :class:`StreamingCache`, 8 bytes per row and kept key, is not counted)."""
    total = 0
    for layer in cache.layers:
        if layer.is_initialized:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


# ---------------------------------------------------------------------- masks from the record
def record_mask(
    spec: MaskSpec, key_positions: torch.Tensor, query_start: torch.Tensor, seqlen_q: int
) -> FlashMask:
    """The mask of ``spec`` in per-sequence positions, padding hidden.

    Args:
        spec: the layer's mask spec.
        key_positions: int64 ``[B, Sk]``, each key's position (``-1``: padding, hidden from all).
        query_start: int64 ``[B]``; query row ``i`` of row ``b`` stands at position
            ``query_start[b] + i``. The last ``Sq`` key columns are the queries themselves.
        seqlen_q: ``Sq``.

    Returns:
        A FlashMask ``[B, 1, Sk, C]`` for ``Sq`` queries: causal ``C = 1`` for ``"causal"`` and
        ``"sliding_window"``, non-causal ``C = 2`` for ``"full"`` and ``"prefix_lm"``.
    """
    valid = key_positions >= 0
    # Query rows before ``first_row`` stand at positions below the key's.
    first_row = key_positions - query_start[:, None]
    all_rows = torch.full_like(key_positions, seqlen_q)
    if spec.kind in ("causal", "sliding_window"):
        # Causal form: the kernels' bottom-right triangle is "key position <= query position"
        # because cached columns precede the queries, which stand in position order.
        lts = all_rows
        if spec.kind == "sliding_window":
            # The key leaves the window at the query row standing at position key + window + 1.
            lts = first_row + spec.window + 1
            if spec.sink_tokens:
                lts = torch.where(key_positions < spec.sink_tokens, all_rows, lts)
        columns = [torch.where(valid, lts, 0)]
        causal = True
    else:
        ute = torch.zeros_like(key_positions)
        if spec.kind == "prefix_lm":
            ute = torch.where(key_positions < spec.prefix_len, ute, first_row)
        columns = [torch.where(valid, all_rows, 0), ute]
        causal = False
    bounds = torch.stack([c.clamp(0, seqlen_q) for c in columns], dim=-1)
    return FlashMask(bounds.unsqueeze(1).to(torch.int32).contiguous(), causal, seqlen_q)


def _padding_mask(key_positions: torch.Tensor, seqlen_q: int) -> FlashMask:
    """Non-causal ``[B, 1, Sk, 2]`` mask hiding the padding keys (position ``-1``) only."""
    lts = torch.where(key_positions >= 0, seqlen_q, 0)
    bounds = torch.stack([lts, torch.zeros_like(lts)], dim=-1)
    return FlashMask(bounds.unsqueeze(1).to(torch.int32).contiguous(), False, seqlen_q)


class _RecordPolicy:
    """The policy installed on one attention module while :func:`stream_generate` runs: the
    module's own policy (``None``: causal, or full for a non-causal module) read from the
    position record of its cache layer."""

    def __init__(self, original: Policy | None, cache: StreamingCache, causal: bool) -> None:
        self.original = original
        self.cache = cache
        self.default = MaskSpec("causal" if causal else "full")

    def spec_for(self, layer_idx: int) -> MaskSpec | None:
        if self.original is None:
            return self.default
        return spec_of(self.original, layer_idx)

    def __call__(self, layer_idx: int, ctx: MaskContext) -> FlashMask | None:
        layer = self.cache.layers[layer_idx]
        positions = layer.call_positions
        if positions is None or tuple(positions.shape) != (ctx.batch_size, ctx.seqlen_k):
            raise RuntimeError(
                f"layer {layer_idx}: the attention call has {ctx.batch_size} x {ctx.seqlen_k} "
                "keys but its streaming cache layer did not just return them (was the model "
                "called with another cache?)"
            )
        spec = self.spec_for(layer_idx)
        if spec is not None:
            return record_mask(spec, positions, layer.call_query_start, ctx.seqlen_q)
        mask = self.original(layer_idx, ctx)
        if mask is None:
            return record_mask(self.default, positions, layer.call_query_start, ctx.seqlen_q)
        if not isinstance(mask, FlashMask):
            return mask  # the backend names the wrong type
        padding = _padding_mask(positions.to(mask.device), ctx.seqlen_q)
        return intersect(mask, padding, seqlen_q=ctx.seqlen_q)


_ABSENT = object()


@contextmanager
def _record_policies(model: torch.nn.Module, cache: StreamingCache) -> Iterator[None]:
    """Wrap every attention module's policy in a :class:`_RecordPolicy`; restore on exit."""
    saved = []
    try:
        for module in _attention_modules(model):
            original = module.__dict__.get(POLICY_ATTR, _ABSENT)
            saved.append((module, original))
            causal = bool(getattr(module, "is_causal", True))
            policy = None if original is _ABSENT else original
            setattr(module, POLICY_ATTR, _RecordPolicy(policy, cache, causal))
        yield
    finally:
        for module, original in saved:
            if original is _ABSENT:
                delattr(module, POLICY_ATTR)
            else:
                setattr(module, POLICY_ATTR, original)


# ---------------------------------------------------------------------- generation
def _check_attention_mask(attention_mask: object, input_ids: torch.Tensor) -> torch.Tensor:
    """``attention_mask`` as bool ``[B, S]`` on ``input_ids``' device, checked left-padded."""
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"attention_mask must be a torch.Tensor [batch, seqlen] of 0/1, got "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(
            f"attention_mask must be a bool or integer tensor of 0/1, got {attention_mask.dtype}"
        )
    mask = attention_mask.to(input_ids.device)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    mask = mask.bool()
    ends_padded = (~mask[:, -1]).nonzero().flatten().tolist()
    if ends_padded:
        raise ValueError(
            f"attention_mask must be left-padded with at least one token per row, but rows "
            f"{ends_padded} end with padding (right padding, or no token at all)"
        )
    holes = (mask[:, :-1] & ~mask[:, 1:]).any(-1).nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"attention_mask must be left-padded (zeros only before a row's tokens), but rows "
            f"{holes} have padding after a token"
        )
    return mask


def _check_cache(model: torch.nn.Module, cache: object, batch: int) -> StreamingCache:
    if not isinstance(cache, StreamingCache):
        raise TypeError(
            f"cache must be a StreamingCache from streaming_cache(model), got "
            f"{type(cache).__name__}"
        )
    modules = sorted(_attention_modules(model), key=lambda m: m.layer_idx)
    expected = [_layer_for(module) for module in modules]
    described = [
        (type(layer), getattr(layer, "window", None), getattr(layer, "sink_tokens", None))
        for layer in expected
    ]
    actual = [
        (type(layer), getattr(layer, "window", None), getattr(layer, "sink_tokens", None))
        for layer in cache.layers
    ]
    if actual != described:
        raise ValueError(
            "cache does not match the model's layer policies (was it built for another policy, "
            "or has a MaskSchedule moved on?); build it with streaming_cache(model)"
        )
    seen = cache.next_position()
    if seen is not None and seen.shape[0] != batch:
        raise ValueError(f"cache holds {seen.shape[0]} sequences but input_ids has {batch} rows")
    return cache


@torch.no_grad()
def stream_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    prefill_chunk: int | None = None,
    cache: StreamingCache | None = None,
) -> tuple[torch.Tensor, StreamingCache]:
    """Greedy generation with chunked prefill and single-token decode over a streaming cache.

    Args:
        model: a transformers causal LM, after :func:`apply_flashmask` (or without policies:
            every layer then keeps its whole history).
        input_ids: ``[B, S]`` prompts, left-padded when their lengths differ.
        max_new_tokens: tokens to generate per row (no early stop at EOS).
        attention_mask: ``[B, S]`` bool or integer, 1 = token and 0 = padding, left padding
            only (every row ends with a token); ``None``: no padding.
        prefill_chunk: prompt columns per forward pass (default: the whole prompt at once).
        cache: a :func:`streaming_cache` of this model to continue from (it holds the earlier
            tokens; ``input_ids`` then continues every row). Default: a new one.

    Returns:
        ``(tokens [B, max_new_tokens], cache)``: row ``b``'s greedy continuation, the same as
        generating row ``b`` alone without padding. The last token is not yet in the cache.

    Raises:
        ValueError: a bad ``input_ids``, ``max_new_tokens``, ``prefill_chunk`` or
            ``attention_mask`` (shape, dtype, values, right padding), or a cache built for
            other policies or another batch size.
        TypeError: a cache that does not come from :func:`streaming_cache`.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids must be [batch, seqlen > 0], got {shape}")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prefill_chunk is not None and (
        isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
    batch, length = input_ids.shape
    if attention_mask is None:
        token_mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        token_mask = _check_attention_mask(attention_mask, input_ids)
    cache = streaming_cache(model) if cache is None else _check_cache(model, cache, batch)
    has_policies = any(policy_of(m) is not None for m in _attention_modules(model))

    parameters = inspect.signature(model.forward).parameters
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept both generations.
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    extra: dict[str, Any] = {"use_cache": True, cache_name: cache}
    if "logits_to_keep" in parameters:
        extra["logits_to_keep"] = 1  # only the last position's logits are ever read

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last-position logits ``[B, V]`` of one forward over ``ids`` ``[B, q]``."""
        first = cache.next_position()
        if first is None:
            first = torch.zeros(batch, dtype=torch.int64, device=ids.device)
        # Real tokens continue their row's positions; padding gets 1, as in model.generate.
        position_ids = torch.where(mask, first[:, None] + mask.long().cumsum(-1) - 1, 1)
        inputs = {"input_ids": ids, "position_ids": position_ids, **extra}
        if not has_policies:
            # Every layer keeps every key, so layer 0's record is the batch's padding history.
            history = cache.layers[0].positions
            seen = mask[:, :0] if history is None else history >= 0
            inputs["attention_mask"] = torch.cat([seen, mask], dim=-1).long()
        cache.token_mask = mask
        try:
            return model(**inputs).logits[:, -1]
        finally:
            cache.token_mask = None

    step = prefill_chunk or length
    with _record_policies(model, cache) if has_policies else nullcontext():
        for start in range(0, length, step):
            chunk = slice(start, start + step)
            logits = forward(input_ids[:, chunk], token_mask[:, chunk])
        tokens = []
        decode_mask = torch.ones(batch, 1, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            next_token = logits.argmax(-1, keepdim=True)
            tokens.append(next_token)
            if len(tokens) == max_new_tokens:
                break
            logits = forward(next_token, decode_mask)
    return torch.cat(tokens, dim=1), cache
