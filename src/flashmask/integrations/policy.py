"""Per-layer mask policies and training-step schedules for transformers models.

``apply_flashmask(model, mask=...)`` switches a loaded model to the ``"flashmask"`` attention
backend and gives every attention layer a *policy*: the mask that layer applies. The batch's own
structure (packed documents from ``position_ids``, padding, an explicit mask) is always respected:
the layer's mask is intersected with the batch's document boundaries. Examples::

    apply_flashmask(model, mask="sliding_window", window=1024)            # every layer
    apply_flashmask(model, mask="sliding_window", window=[512, 1024, 2048])  # cycles over layers
    apply_flashmask(model, mask="sliding_window", window=512, layers=range(4))  # rest causal
    apply_flashmask(model, mask=lambda layer_idx, ctx: my_flashmask)     # anything
    schedule = MaskSchedule([(0, {"mask": "sliding_window", "window": 256}), (1000, "causal")])
    apply_flashmask(model, mask=schedule)                                 # changes with the step
    remove_flashmask(model)                                               # back to the original

A policy sees a :class:`MaskContext` (layer index, batch size, query and key lengths, device and,
in a padded batch, each key's position within its row) and returns a
:class:`~flashmask.FlashMask` ``[1 or B, 1 or Hk, Sk, C]`` for that call. Masks are aligned
bottom-right, so the same policy serves training (``Sq == Sk``), chunked prefill and
single-token decode over a KV cache (``Sq < Sk``): build the mask for ``ctx.seqlen_q`` queries
(the builders of :mod:`flashmask.masks` take ``seqlen_q``); one built for another query length is
an error.

In a padded batch (a 2-D ``attention_mask`` with zeros, as ``model.generate`` passes for
left-padded prompts) the mask kinds are built in each row's own positions
(:func:`padded_layer_mask`): a row's sink tokens are its first real tokens, its window and prefix
count from there and padding is hidden, so a left-padded row gets the mask (and the logits and
tokens) of its prompt alone. A callable policy gets the positions as ``ctx.key_positions``; its
mask is intersected with the padding.

The backend (:mod:`flashmask.integrations.transformers`, imported and so registered by this
module) reads the policies: :class:`MaskContext`, :func:`policy_of` and the module attribute
they use are defined there and re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from flashmask import masks
from flashmask.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    POLICY_ATTR,
    MaskContext,
    Policy,
    policy_of,
)
from flashmask.mask import FlashMask

__all__ = [
    "MASK_KINDS",
    "MaskContext",
    "MaskSchedule",
    "MaskSpec",
    "apply_flashmask",
    "layer_mask",
    "padded_layer_mask",
    "policy_of",
    "remove_flashmask",
    "spec_of",
]

MASK_KINDS = ("causal", "full", "sliding_window", "prefix_lm")
_STATE_ATTR = "_flashmask_original_attn_implementation"


@dataclass(frozen=True)
class MaskSpec:
    """One mask type with its parameters.

    ``kind``: ``"causal"``, ``"full"`` (bidirectional), ``"sliding_window"`` (causal, query at
    key position ``p`` sees keys ``[p - window, p]`` plus the first ``sink_tokens`` keys) or
    ``"prefix_lm"`` (the first ``prefix_len`` keys are seen by every query, the rest causally).
    """

    kind: str = "causal"
    window: int | None = None
    sink_tokens: int = 0
    prefix_len: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {self.kind!r}")
        if self.kind == "sliding_window":
            if not _is_int(self.window) or self.window < 0:
                raise ValueError(
                    f"window must be a non-negative int for sliding_window, got {self.window!r}"
                )
        elif self.window is not None:
            raise ValueError(f"window only applies to sliding_window, not {self.kind!r}")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be a non-negative int, got {self.sink_tokens!r}")
        if self.sink_tokens and self.kind != "sliding_window":
            raise ValueError(f"sink_tokens only applies to sliding_window, not {self.kind!r}")
        if self.kind == "prefix_lm":
            if not _is_int(self.prefix_len) or self.prefix_len < 0:
                raise ValueError(
                    f"prefix_len must be a non-negative int for prefix_lm, got {self.prefix_len!r}"
                )
        elif self.prefix_len is not None:
            raise ValueError(f"prefix_len only applies to prefix_lm, not {self.kind!r}")

    def build(self, ctx: MaskContext) -> FlashMask:
        """This spec's mask for one call, on ``ctx.device``: int32 ``[1, 1, Sk, C]`` in column
        positions, or ``[B, 1, Sk, C]`` in each row's own positions when the call is padded
        (``ctx.key_positions``, see :func:`padded_layer_mask`)."""
        if ctx.key_positions is None:
            return layer_mask(self, ctx.seqlen_q, ctx.seqlen_k, ctx.device)
        return padded_layer_mask(self, ctx.key_positions.to(ctx.device), ctx.seqlen_q)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def layer_mask(
    spec: MaskSpec, seqlen_q: int, seqlen_k: int, device: torch.device | str | None = None
) -> FlashMask:
    """The mask of ``spec`` for ``Sq`` queries standing at the last ``Sq`` of ``Sk`` positions."""
    if spec.kind == "causal":
        return masks.causal(seqlen_k, seqlen_q=seqlen_q, device=device)
    if spec.kind == "full":
        return masks.full(seqlen_k, seqlen_q=seqlen_q, device=device)
    if spec.kind == "sliding_window":
        return masks.sliding_window(
            seqlen_k, spec.window, sink_tokens=spec.sink_tokens, seqlen_q=seqlen_q, device=device
        )
    # prefix_lm: prefix keys are seen by every query; later keys causally (rows before them).
    cols = torch.arange(seqlen_k, device=device, dtype=torch.int64)
    offset = seqlen_k - seqlen_q  # query i stands at key position i + offset
    ute = torch.where(cols < spec.prefix_len, 0, (cols - offset).clamp(0, seqlen_q))
    bounds = torch.stack([torch.full_like(cols, seqlen_q), ute], -1)
    return FlashMask(bounds.to(torch.int32).view(1, 1, -1, 2), False, seqlen_q)


def padded_layer_mask(spec: MaskSpec, key_positions: torch.Tensor, seqlen_q: int) -> FlashMask:
    """The mask of ``spec`` in each row's own positions, for a padded batch.

    A query at position ``p`` sees a key at position ``a`` when ``spec`` allows it (``causal``:
    ``a <= p``; ``sliding_window``: also ``a >= p - window`` unless ``a < sink_tokens``;
    ``prefix_lm``: ``a <= p`` or ``a < prefix_len``; ``full``: always), so a left-padded row gets
    the mask of its prompt alone: its sinks are its first real tokens, its window and prefix are
    counted from there. Padding keys are seen by no query. A padding query sees nothing when its
    row's padding lies before and after the row's real tokens only (left or right padding); one
    between real tokens sees what the real query before it sees (one interval per key column
    cannot hide it; its output means nothing either way).

    Args:
        spec: the layer's mask spec.
        key_positions: int64 ``[B, Sk]``, each key's position in its row (the number of the row's
            real tokens before it), ``-1`` for padding. The queries are the last ``Sq`` keys.
        seqlen_q: ``Sq``.

    Returns:
        A FlashMask ``[B, 1, Sk, C]`` for ``Sq`` queries: causal ``C = 1`` for ``"causal"`` and
        ``"sliding_window"`` (the kernels' bottom-right triangle is ``a <= p``: a row's positions
        grow along its columns), non-causal ``C = 2`` for ``"full"`` and ``"prefix_lm"``. Tensor
        operations only, so it traces and captures without a host read.
    """
    if (
        not isinstance(key_positions, torch.Tensor)
        or key_positions.dim() != 2
        or key_positions.dtype.is_floating_point
        or key_positions.dtype.is_complex
        or key_positions.dtype == torch.bool
    ):
        raise TypeError(
            "key_positions must be an integer tensor [batch, seqlen_k], got "
            f"{getattr(key_positions, 'dtype', type(key_positions).__name__)} "
            f"{tuple(getattr(key_positions, 'shape', ()))}"
        )
    if not _is_int(seqlen_q):
        raise TypeError(f"seqlen_q must be an int, got {type(seqlen_q).__name__}")
    if not 1 <= seqlen_q <= key_positions.shape[-1]:
        raise ValueError(
            f"seqlen_q must be in [1, seqlen_k={key_positions.shape[-1]}] (the queries are the "
            f"last keys), got {seqlen_q}"
        )
    key_positions = key_positions.to(torch.int64)
    query_positions = key_positions[:, -seqlen_q:]
    real_key = key_positions >= 0
    real_query = query_positions >= 0
    rows = torch.arange(seqlen_q, device=key_positions.device)
    # The row's real queries lie in rows [first_real, end_real) (Sq and 0 when it has none);
    # padding rows outside that range are hidden below.
    first_real = torch.where(real_query, rows, seqlen_q).amin(-1, keepdim=True)
    end_real = torch.where(real_query, rows + 1, 0).amax(-1, keepdim=True)
    # Padding queries take the position before them: a non-decreasing row to search, where the
    # query rows at positions <= t are the first searchsorted(.., t, right=True).
    searchable = query_positions.cummax(-1).values.contiguous()
    all_rows = torch.full_like(key_positions, seqlen_q)
    if spec.kind in ("causal", "sliding_window"):
        lts = all_rows
        if spec.kind == "sliding_window":
            # The key leaves the window after the query rows at positions <= key + window.
            reach = (key_positions + spec.window).contiguous()
            lts = torch.searchsorted(searchable, reach, right=True)
            if spec.sink_tokens:
                lts = torch.where(key_positions < spec.sink_tokens, all_rows, lts)
        columns = [torch.where(real_key, torch.minimum(lts, end_real), 0)]
        causal = True
    else:
        ute = torch.zeros_like(key_positions)
        if spec.kind == "prefix_lm":
            # Past the prefix, the rows before the first query at the key's position are hidden.
            first_row = torch.searchsorted(searchable, key_positions.contiguous())
            ute = torch.where(key_positions < spec.prefix_len, ute, first_row)
        lts = torch.where(real_key, end_real.expand_as(key_positions), 0)
        columns = [lts, torch.maximum(ute, first_real)]
        causal = False
    bounds = torch.stack([c.clamp(0, seqlen_q) for c in columns], dim=-1)
    return FlashMask(bounds.unsqueeze(1).to(torch.int32).contiguous(), causal, seqlen_q)


def _spec_fields(value: str | Mapping[str, Any] | MaskSpec) -> dict[str, Any]:
    """``{"mask": kind, **params}`` for a kind name, a dict or a :class:`MaskSpec`."""
    if isinstance(value, str):
        return {"mask": value}
    if isinstance(value, MaskSpec):
        return {
            "mask": value.kind,
            "window": value.window,
            "sink_tokens": value.sink_tokens,
            "prefix_len": value.prefix_len,
        }
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"a mask spec must be a str, a dict or a MaskSpec, got {type(value).__name__}")


def _as_spec(value: str | Mapping[str, Any] | MaskSpec) -> MaskSpec:
    if isinstance(value, MaskSpec):
        return value
    fields = _spec_fields(value)
    return MaskSpec(fields.pop("mask", "causal"), **fields)


class MaskSchedule:
    """Mask policies that change with the training step.

    Args:
        milestones: ``(first_step, policy)`` pairs in increasing step order; ``policy`` is anything
            :func:`apply_flashmask` takes as ``mask`` (a kind name, a dict such as
            ``{"mask": "sliding_window", "window": 256}``, a :class:`MaskSpec`, a per-layer list,
            or a callable). The first milestone must start at step 0.

    Drive it with :meth:`set_step` from a plain loop, or with :meth:`callback` from a
    transformers ``Trainer``.
    """

    def __init__(self, milestones: Sequence[tuple[int, Any]]) -> None:
        if not isinstance(milestones, Sequence) or not milestones:
            raise ValueError("milestones must be a non-empty list of (step, policy) pairs")
        steps = []
        policies = []
        for item in milestones:
            if not isinstance(item, (tuple, list)) or len(item) != 2 or not _is_int(item[0]):
                raise ValueError(f"milestones entries must be (int step, policy), got {item!r}")
            steps.append(item[0])
            policies.append(_resolve_policy(item[1], None))
        if steps[0] != 0 or any(b <= a for a, b in pairwise(steps)):
            raise ValueError(f"milestone steps must start at 0 and increase, got {steps}")
        self.steps = steps
        self._policies = policies
        self.step = 0

    def set_step(self, step: int) -> None:
        """Use the policy of the last milestone at or before ``step``."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.step = step

    def current_index(self) -> int:
        """Index of the milestone in force."""
        index = 0
        for i, first in enumerate(self.steps):
            if self.step >= first:
                index = i
        return index

    def __call__(self, layer_idx: int, ctx: MaskContext) -> FlashMask | None:
        return self._policies[self.current_index()](layer_idx, ctx)

    def spec_for(self, layer_idx: int) -> MaskSpec | None:
        return spec_of(self._policies[self.current_index()], layer_idx)

    def callback(self) -> Any:
        """A transformers ``TrainerCallback`` that sets the step before every training step."""
        from transformers import TrainerCallback

        schedule = self

        class FlashMaskScheduleCallback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                schedule.set_step(state.global_step)

        return FlashMaskScheduleCallback()


class _Cycle:
    """Layer ``i`` uses ``specs[i % len(specs)]``."""

    def __init__(self, specs: list[MaskSpec]) -> None:
        self.specs = specs

    def spec_for(self, layer_idx: int) -> MaskSpec:
        return self.specs[layer_idx % len(self.specs)]

    def __call__(self, layer_idx: int, ctx: MaskContext) -> FlashMask:
        return self.spec_for(layer_idx).build(ctx)


class _OnlyLayers:
    """``base`` on the chosen layers, causal on the others."""

    def __init__(self, base: Policy, chosen: set[int]) -> None:
        self.base = base
        self.chosen = chosen

    def spec_for(self, layer_idx: int) -> MaskSpec | None:
        if layer_idx not in self.chosen:
            return MaskSpec("causal")
        return spec_of(self.base, layer_idx)

    def __call__(self, layer_idx: int, ctx: MaskContext) -> FlashMask | None:
        if layer_idx not in self.chosen:
            return MaskSpec("causal").build(ctx)
        return self.base(layer_idx, ctx)


def spec_of(policy: Policy | None, layer_idx: int) -> MaskSpec | None:
    """The :class:`MaskSpec` a policy applies to a layer, or ``None`` when it is an opaque
    callable (the streaming cache then keeps that layer's whole history)."""
    spec_for = getattr(policy, "spec_for", None)
    return spec_for(layer_idx) if spec_for is not None else None


def _resolve_policy(mask: Any, layers: Iterable[int] | None, **params: Any) -> Policy:
    """Normalise ``apply_flashmask``'s arguments to one callable ``(layer_idx, ctx) -> mask``."""
    if isinstance(mask, MaskSchedule) or (callable(mask) and not isinstance(mask, MaskSpec)):
        if params:
            raise ValueError(f"parameters {sorted(params)} do not apply to a callable mask policy")
        base: Policy = mask
    elif isinstance(mask, (list, tuple)):
        if params:
            raise ValueError(f"parameters {sorted(params)} do not apply to a list of mask specs")
        base = _Cycle([_as_spec(m) for m in mask])
    else:
        fields = {**_spec_fields(mask), **params}
        lists = {k: v for k, v in fields.items() if isinstance(v, (list, tuple))}
        lengths = {len(v) for v in lists.values()}
        if len(lengths) > 1 or 0 in lengths:
            raise ValueError(f"per-layer parameter lists must share one non-zero length: {lists}")
        count = lengths.pop() if lengths else 1
        base = _Cycle(
            [
                _as_spec({k: (v[i] if k in lists else v) for k, v in fields.items()})
                for i in range(count)
            ]
        )
    if layers is None:
        return base
    chosen = set(layers)
    if not all(_is_int(x) for x in chosen):
        raise TypeError(f"layers must be ints, got {sorted(map(repr, chosen))}")
    return _OnlyLayers(base, chosen)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not found:
        raise ValueError(
            "model has no attention modules with a layer_idx (is it a transformers decoder?)"
        )
    return found


def apply_flashmask(
    model: torch.nn.Module,
    mask: Any = "causal",
    *,
    layers: Iterable[int] | None = None,
    **params: Any,
) -> torch.nn.Module:
    """Switch ``model`` to the ``"flashmask"`` attention backend with a per-layer mask policy.

    Args:
        model: a transformers ``PreTrainedModel`` (Llama-, Qwen2-, Mistral-style decoders).
        mask: a kind (``"causal"``, ``"full"``, ``"sliding_window"``, ``"prefix_lm"``) with its
            ``params``; a dict ``{"mask": kind, **params}`` or :class:`MaskSpec`; a list of those
            cycled over layers; a :class:`MaskSchedule`; or a callable
            ``(layer_idx, ctx: MaskContext) -> FlashMask | None`` (``None``: plain causal).
        layers: the layer indices that get ``mask``; the others stay causal.
        params: ``window``, ``sink_tokens``, ``prefix_len``; a list value (e.g.
            ``window=[512, 1024, 2048]``) cycles over layers.

    Returns:
        ``model``, changed in place (undo with :func:`remove_flashmask`).
    """
    policy = _resolve_policy(mask, layers, **params)
    modules = _attention_modules(model)
    if not hasattr(model, _STATE_ATTR):
        original = getattr(model.config, "_attn_implementation", None)
        object.__setattr__(model, _STATE_ATTR, original)
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    for module in modules:
        setattr(module, POLICY_ATTR, policy)
    return model


def remove_flashmask(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_flashmask`: drop the policies and restore the original backend."""
    if not hasattr(model, _STATE_ATTR):
        raise ValueError("remove_flashmask: this model was not changed by apply_flashmask")
    for module in _attention_modules(model):
        if hasattr(module, POLICY_ATTR):
            delattr(module, POLICY_ATTR)
    _set_attn_implementation(model, getattr(model, _STATE_ATTR) or "eager")
    object.__delattr__(model, _STATE_ATTR)
    return model


def _set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # older transformers: the config field is what attention layers read
        model.config._attn_implementation = name
