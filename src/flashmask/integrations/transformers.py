"""The ``"flashmask"`` attention backend for Hugging Face transformers.

Importing this module registers the backend::

    import flashmask.integrations.transformers  # noqa: F401  (registers "flashmask")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashmask")
    loss = model(**batch).loss   # batch from flashmask.integrations.data.pack_sft

Command-line tools that never import flashmask (``trl sft --attn_implementation flashmask``)
run through the launcher, which registers the backend first: ``python -m flashmask.run trl sft
...`` (:mod:`flashmask.run`).

It works for models that call transformers' attention interface (Llama, Qwen2, Mistral and most
decoder-only models of transformers >= 5). The attention function receives ``[B, H, S, D]``
query/key/value, runs :func:`flashmask.flashmask_attention` on ``[B, S, H, D]`` views (GQA
natively, ``softmax_scale`` = the module's ``scaling``) and returns ``(out [B, S, H, D], None)``.

Which mask it applies, first match wins:

1. an explicit mask passed through the model call: ``model(..., flashmask=FlashMask)`` or
   ``model(..., startend_row_indices=int32 [B, Hm, Sk, C])`` (a raw tensor is read as causal
   when ``C`` is 1 or 2 and as non-causal when ``C`` is 4; pass a :class:`~flashmask.FlashMask`
   for a non-causal ``C = 2`` mask). Shared-prompt (DPO/RM) batches must use this: their
   position ids restart mid-document on purpose. A non-causal explicit mask on a causal
   attention module (every decoder's) would let queries see later tokens, so it is an error
   unless the call also passes ``flashmask_bidirectional=True``. A FlashMask built for another
   query length than the call's (e.g. a training mask reused during generation) is an error too
   (:meth:`~flashmask.FlashMask.with_seqlen_q`);
2. queries that do not stand at the end of the keys: a static cache (``StaticCache``,
   ``generate(..., cache_implementation="static")``) hands every slot over as a key, the queries
   after the tokens cached so far. The mask hook (:func:`flashmask_mask_interface`) then passes
   *key rows* (the query row at each key's position, from the cache's offset tensor, computed on
   the device without a host read, as compiled and CUDA-graph decoding need); keys after a
   query's position (the empty slots included) and padded keys are hidden. Layer policies assume
   the queries are the last keys: with such a cache they are an error;
3. ``cu_seq_lens_q`` (``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
   one causal document per segment. With ``cu_seq_lens_k`` covering more keys than queries
   (continuous batching, ``model.generate_batch``: each request's new tokens are its queries, its
   cached and new tokens its keys), segment ``r``'s queries see only segment ``r``'s keys, causal
   with the segment's last query at its last key. Every such layout is one visible run of query
   rows per key column, a non-causal ``C = 2`` FlashMask; ``cu_seq_lens_q`` alone over more keys
   than queries is an error (the keys' segments would be unknown);
4. a 2-D padding mask ``attention_mask [B, Sk]`` with zeros: padded keys are hidden from every
   query; when each row's real tokens are one contiguous run (left or right padding) padded
   queries see nothing (output 0), otherwise they see the real keys before them, as in SDPA;
5. packed ``position_ids`` (no padding mask): a new document starts wherever the position does
   not continue the previous one by +1 (transformers' own rule), each document causal, as TRL's
   packing / padding-free collators expect (transformers' SDPA/eager paths skip this while a KV
   cache is in use, e.g. ``model.eval()`` with ``use_cache=True``; here it applies whenever
   queries and keys are the same tokens);
6. plain causal (or full, for a module with ``is_causal = False``).

A model whose attention layers pass ``sliding_window=w`` (Mistral, Qwen2 with
``use_sliding_window``) gets transformers' window (query ``i`` sees keys ``(i - w, i]``)
intersected with the mask above; for the built-in masks that is one interval per key column,
``LTS_j = min(end of j's document, j + w)``. A 4-D mask that transformers hands over unchanged
(a dense bool or additive mask passed as ``attention_mask``) is converted with
:meth:`FlashMask.from_dense` (O(S^2) per layer: meant for tests and compatibility).

A layer policy (:func:`flashmask.integrations.policy.apply_flashmask`, read by
:func:`layer_policy_mask`) supplies the causal structure; the mask above then only contributes
the batch's boundaries. Under a 2-D padding mask (4. above; a left-padded ``generate``: prefill,
chunked prefill and decode steps over a dynamic cache) the policy's :class:`MaskContext` carries
each key's position within its row, and a policy built from mask specs builds its mask in those
positions with the padding hidden (sinks are a row's first real tokens, windows and prefixes count
from there), which replaces the padding boundaries unless a module window also applies; a
callable policy's mask is intersected with them.

Every mask is built from tensor operations on the device, with no value read back to the host,
so ``torch.compile(model, fullgraph=True)`` traces it without a graph break and CUDA graphs
capture it; checks that read values and the eager-mode shortcuts to the maskless causal path
run only outside tracing and capture (:func:`_may_sync`).

Dtypes: under autocast, attention runs in the autocast dtype (as SDPA does; autocast can hand
over mixed dtypes). Otherwise CPU inputs of any float dtype run the exact reference; on CUDA,
float32 inputs (PEFT upcasts layer norms) are cast to the dtype the Triton kernels take (that of
the attention module's first half-precision ``nn.Linear`` weight) and the output is cast back;
without one they run the exact (slow) float32 reference.

Learnable attention sinks (gpt-oss's ``s_aux``, one logit per query head) join every row's
softmax (:func:`flashmask.flashmask_attention`'s ``sinks``), with their gradient; Gemma's logit
soft-capping (``softcap``) caps the scores (on the GPU through the Triton or Gluon kernels).

Not supported (clear error): attention dropout while training.
``output_attentions`` returns ``None`` weights. Models that overlay their own mask
functions on the causal mask (``or_mask_function``/``and_mask_function``, e.g. bidirectional
image tokens) get only the masks above, as with FlashAttention. Because the name contains
"flash", transformers 5.x treats the backend as a FlashAttention flavour where it checks names
(see :func:`_skip_flash_attention_preload`); for the models above that changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from flashmask import masks
from flashmask._tensor_cache import TensorKeyedCache
from flashmask.attention import flashmask_attention
from flashmask.mask import FlashMask, intersect
from flashmask.varlen import check_cumulative as _check_cumulative
from flashmask.varlen import column_mask as _column_mask
from flashmask.varlen import cumulative_lengths as _cumulative
from flashmask.varlen import may_read_values as _may_sync
from flashmask.varlen import segment_bounds

try:
    from transformers import AttentionInterface
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "flashmask.integrations.transformers needs transformers>=5: "
        "pip install 'flashmask[integrations]'"
    ) from error

try:  # transformers >= 4.5x; older versions build 4-D masks themselves (read via from_dense)
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:  # pragma: no cover - depends on the installed version
    AttentionMaskInterface = None

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KEY_ROW_HIDDEN",
    "POLICY_ATTR",
    "MaskContext",
    "enable_activation_checkpointing",
    "flashmask_attention_forward",
    "flashmask_mask_interface",
    "layer_policy_mask",
    "policy_of",
    "register",
    "resolve_mask",
]

ATTN_IMPLEMENTATION = "flashmask"
"""The ``attn_implementation`` name this module registers."""

KEY_ROW_HIDDEN = 1 << 30
"""The key row :func:`flashmask_mask_interface` gives a key no query may see (padding): beyond
every query length, and hidden from every query row whatever the module's causality."""

POLICY_ATTR = "flashmask_policy"
"""The attribute of an attention module that holds its mask policy
(:func:`flashmask.integrations.policy.apply_flashmask` sets it)."""


class MaskContext(NamedTuple):
    """What a mask policy knows about one attention call.

    ``key_positions``, int64 ``[B, Sk]``, is set when the call carries a 2-D padding mask
    (``attention_mask`` of a padded batch, e.g. a left-padded ``generate``): the position of
    every key within its own row, that is the number of the row's real tokens before it (what
    ``generate`` gives as position ids), ``-1`` for padding. The queries are the last ``Sq``
    keys, so ``key_positions[:, -Sq:]`` are theirs. ``None``: no padding mask; key column ``j``
    stands at position ``j`` in every row.
    """

    layer_idx: int
    batch_size: int
    seqlen_q: int
    seqlen_k: int
    device: torch.device
    key_positions: torch.Tensor | None = None


Policy = Callable[[int, MaskContext], "FlashMask | None"]
"""A mask policy: ``(layer_idx, ctx) -> FlashMask [1 or B, 1 or Hk, Sk, C]`` or ``None``
(plain causal)."""

_HALF = (torch.float16, torch.bfloat16)
_REGISTERED: set[str] = set()


def register(name: str = ATTN_IMPLEMENTATION) -> None:
    """Register the attention function (and mask function, where transformers has the interface)
    under ``name``. Runs on import with the default name; calling it again is harmless."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    AttentionInterface.register(name, flashmask_attention_forward)
    _REGISTERED.add(name)
    if "flash" in name:
        _skip_flash_attention_preload()
    if AttentionMaskInterface is not None:
        # Without a registered mask function transformers drops every mask (even causal) for
        # an unknown backend; ours just hands the 2-D padding mask through.
        AttentionMaskInterface.register(name, flashmask_mask_interface)


def enable_activation_checkpointing(model: Any, use_reentrant: bool = False) -> None:
    """Turn on activation (gradient) checkpointing of a transformers model, any 5.x version.

    transformers renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``
    in 5.2x (the old name stays as a deprecated alias there); this calls whichever the installed
    version has, with non-reentrant checkpointing by default (needed for PEFT and compile).
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TypeError(
            f"model ({type(model).__name__}) has no activation_checkpointing_enable or "
            "gradient_checkpointing_enable method; pass a transformers PreTrainedModel"
        )
    enable({"use_reentrant": use_reentrant})


def _skip_flash_attention_preload() -> None:
    """Let transformers accept a registered name that contains "flash".

    transformers 5.x treats every ``attn_implementation`` containing "flash" as a FlashAttention
    flavour. When a model is built or switched to it, ``modeling_utils`` then (1) preloads the
    FlashAttention package or a Hub kernel of that name (``lazy_import_flash_attention``), which
    fails for "flashmask", and (2) replaces the name by a FlashAttention kernel of the model's
    own list where it has one (gpt-oss's ``_compatible_flash_implementations``), so the model
    would never call flashmask. For our names both are skipped: the preload returns nothing (its
    result is unused there), and ``modeling_utils``' own ``is_flash_attention_requested`` answers
    False for them (the other modules, e.g. the mask builders, keep transformers' answer). Every
    other name goes to transformers' functions unchanged.
    """
    try:
        import transformers.modeling_utils as modeling_utils
    except ImportError:  # pragma: no cover - depends on the installed version
        return
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is not None and getattr(original, "_flashmask_skips", None) is not _REGISTERED:

        def lazy_import_flash_attention(implementation: Any, *args: Any, **kwargs: Any) -> Any:
            if implementation in _REGISTERED:
                return None
            return original(implementation, *args, **kwargs)

        lazy_import_flash_attention._flashmask_skips = _REGISTERED
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention
    requested = getattr(modeling_utils, "is_flash_attention_requested", None)
    if requested is not None and getattr(requested, "_flashmask_skips", None) is not _REGISTERED:

        def is_flash_attention_requested(
            config: Any = None, requested_attention_implementation: Any = None, **kwargs: Any
        ) -> bool:
            if config is None and requested_attention_implementation in _REGISTERED:
                return False
            return requested(
                config=config,
                requested_attention_implementation=requested_attention_implementation,
                **kwargs,
            )

        is_flash_attention_requested._flashmask_skips = _REGISTERED
        modeling_utils.is_flash_attention_requested = is_flash_attention_requested


def flashmask_mask_interface(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int | torch.Tensor | None = None,
    kv_offset: int = 0,
    *,
    attention_mask: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask hook: what the attention function needs beyond its query and key
    tensors, in O(Sk) memory.

    transformers calls it once per forward (per kind of layer) with the number of queries
    ``q_length`` and keys ``kv_length`` and where they stand: query ``i`` at position
    ``q_offset + i``, key ``j`` at position ``kv_offset + j``. It returns

    * ``None`` when the queries are the last keys (no cache, a dynamic cache) and no key is
      padding;
    * the 2-D padding mask ``[B, kv_length]`` (bool, True = real key) when the queries are the
      last keys and some key is padding;
    * otherwise *key rows*, int32 ``[B or 1, 1, 1, kv_length]``: for key ``j`` the query row at
      its position, ``j + kv_offset - q_offset`` (:data:`KEY_ROW_HIDDEN` for a padded key). A
      static cache is the case: its keys are all its slots, the queries stand after the tokens
      cached so far (``q_offset``, a tensor) and the slots after them are empty. The rows are
      computed on the device without reading ``q_offset``, so a compiled or CUDA-graph decode
      step captures them; transformers hands a 4-D tensor to the layers unchanged (``generate``
      builds it once per step for a static cache and passes it to the model).

    The 2-D ``attention_mask`` covers positions ``[0, its length)``; as in transformers' own
    masks it is cut to ``[kv_offset, kv_offset + kv_length)`` and padded with False (slots not
    written yet). Sizes that put the queries past the last key (a cache that compacts its keys,
    such as :class:`flashmask.integrations.streaming.StreamingLayer`) mean the queries are the
    last keys. Versions of transformers that pass ``cache_position`` (the queries' positions)
    instead of ``q_length``/``q_offset`` are read from it; other keyword extras are ignored.
    Whether every key is real is read on the host only outside ``torch.compile`` tracing and
    CUDA graph capture (there the padding mask is returned as it is).
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask  # a 4-D mask of the caller's, passed on as it is
    if cache_position is not None:
        q_length = cache_position.shape[-1] if q_length is None else q_length
        q_offset = cache_position.reshape(-1)[0] if q_offset is None else q_offset
    if kv_length is None or q_length is None:
        # A caller that gives no sizes: the padding mask as it is.
        if attention_mask is None or (_may_sync() and bool(attention_mask.all())):
            return None
        return attention_mask.to(torch.bool)
    offset = (0 if q_offset is None else q_offset) - kv_offset  # key column of query row 0
    if isinstance(offset, torch.Tensor) and q_length != kv_length:
        # The queries stand at most at the end of the keys (a cache that compacts its keys puts
        # them past it): clamped on the device, so a static cache's step never reads the host.
        offset = offset.clamp(max=kv_length - q_length)
    valid = None
    if attention_mask is not None:
        valid = attention_mask.to(torch.bool)
        end = kv_offset + kv_length
        if valid.shape[-1] < end:
            valid = torch.nn.functional.pad(valid, (0, end - valid.shape[-1]), value=False)
        valid = valid[:, kv_offset:end]
    # The queries are the last keys unless a static cache's sizes say otherwise: as many keys as
    # queries leave no other place, and an int offset past the last place (keys fewer than the
    # positions before the queries: a cache that compacts its keys) keeps them last too.
    if q_length == kv_length:
        last = True
    elif isinstance(offset, torch.Tensor):
        last = False
    else:
        last = offset >= kv_length - q_length
    if last:
        if valid is None or (_may_sync() and bool(valid.all())):
            return None
        return valid
    device = kwargs.get("device")
    if device is None:
        device = valid.device if valid is not None else getattr(offset, "device", "cpu")
    rows = torch.arange(kv_length, device=device) - offset
    rows = rows.unsqueeze(0) if valid is None else torch.where(valid, rows, KEY_ROW_HIDDEN)
    return rows.to(torch.int32)[:, None, None, :]


def flashmask_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    *,
    flashmask: FlashMask | torch.Tensor | None = None,
    startend_row_indices: torch.Tensor | None = None,
    flashmask_bidirectional: bool = False,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, Sq, D]``, ``key``/``value
    [B, Hk, Sk, D]`` -> ``(out [B, Sq, Hq, D], None)``.

    ``attention_mask`` is what :func:`flashmask_mask_interface` returned (``None``, a 2-D
    padding mask or int32 key rows) or a 4-D mask passed by the caller. The mask applied is
    described in the module docstring; ``scaling`` defaults to ``D ** -0.5``. ``flashmask``,
    ``startend_row_indices`` and ``flashmask_bidirectional`` (allow a non-causal explicit mask on
    a causal module) come from the model call's keyword arguments.

    Raises:
        ValueError: a non-causal explicit mask on a causal module without
            ``flashmask_bidirectional=True``; a FlashMask built for another query length;
            attention dropout while training;
            cumulative lengths that cannot describe the call (see :func:`resolve_mask`); a
            layer mask policy with ``cu_seq_lens_k`` over more keys than queries.
        TypeError: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` that are not integer tensors.
    """
    if dropout:
        raise ValueError(
            f"the flashmask attention backend has no attention dropout, got dropout={dropout} "
            "(the model is training with config.attention_dropout > 0); set "
            "config.attention_dropout = 0"
        )
    sinks = kwargs.get("s_aux")  # gpt-oss's learnable sinks, one logit per query head
    if flashmask is not None and startend_row_indices is not None:
        raise ValueError("pass either flashmask or startend_row_indices, not both")
    _check_integer_tensor("cu_seq_lens_q", cu_seq_lens_q)
    _check_integer_tensor("cu_seq_lens_k", cu_seq_lens_k)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)

    # [B, H, S, D] -> [B, S, H, D] views; the kernels take strided inputs.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    # A layer policy from apply_flashmask supplies the causal structure itself; the batch then
    # contributes only its boundaries (documents, padding) as a non-causal mask.
    has_policy = policy_of(module) is not None
    if has_policy and _is_key_rows(attention_mask):
        raise ValueError(
            "a layer mask policy (apply_flashmask) puts the queries at the end of the keys, but "
            "this call's queries stand elsewhere among them (a static cache: its empty slots "
            "follow the queries); use a dynamic cache (or flashmask.integrations.streaming) "
            "with layer policies"
        )
    if has_policy and cu_seq_lens_k is not None and seqlen_q != seqlen_k:
        # A policy's masks put every query at the end of all the keys; here each segment's queries
        # stand at the end of their own segment of keys.
        raise ValueError(
            "a layer mask policy (apply_flashmask) cannot be combined with cu_seq_lens_k covering "
            f"more keys ({seqlen_k}) than queries ({seqlen_q}), as in continuous batching; remove "
            "the policy (flashmask.remove_flashmask) for this kind of generation"
        )
    if causal and not has_policy:
        _check_explicit_is_causal(flashmask, startend_row_indices, flashmask_bidirectional)
    explicit = flashmask if flashmask is not None else startend_row_indices
    positions = None
    if has_policy and explicit is None and cu_seq_lens_q is None and cu_seq_lens_k is None:
        # A padded batch: the policy counts sinks, windows and prefixes in each row's own
        # positions (a left-padded row is the same sequence as its prompt alone).
        positions = _padding_positions(attention_mask, batch, seqlen_k, q.device)
    if positions is not None and sliding_window is None and _policy_spec(module) is not None:
        # A spec policy's mask in per-row positions hides the padding itself; intersecting it
        # with the padding boundaries would change nothing (and picks its form on the host).
        mask = None
    else:
        mask = resolve_mask(
            batch,
            seqlen_q,
            seqlen_k,
            device=q.device,
            causal=causal and not has_policy,
            explicit=explicit,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            sliding_window=sliding_window,
        )
    if has_policy:
        mask = layer_policy_mask(
            module, mask, batch, seqlen_q, seqlen_k, q.device, key_positions=positions
        )

    compute, output = _dtypes(q, k, v, module)
    q, k, v = (t.to(compute) for t in (q, k, v))
    if mask is None:
        out = flashmask_attention(
            q, k, v, causal=causal, softmax_scale=scaling, sinks=sinks, softcap=softcap
        )
    else:
        out = flashmask_attention(
            q, k, v, mask, softmax_scale=scaling, sinks=sinks, softcap=softcap
        )
    return out.to(output), None


def _check_integer_tensor(name: str, value: object) -> None:
    """``cu_seq_lens_*`` must hold integers: a float tensor would be truncated silently."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (cumulative document lengths), got {value.dtype}"
        )


def _check_explicit_is_causal(
    flashmask: FlashMask | torch.Tensor | None,
    startend_row_indices: torch.Tensor | None,
    allowed: object,
) -> None:
    """A causal module given a non-causal explicit mask: an error unless ``allowed``."""
    if not isinstance(allowed, bool):
        raise TypeError(f"flashmask_bidirectional must be a bool, got {type(allowed).__name__}")
    if flashmask is not None:
        name, explicit = "flashmask", flashmask
    elif startend_row_indices is not None:
        name, explicit = "startend_row_indices", startend_row_indices
    else:
        return
    if isinstance(explicit, FlashMask):
        causal = explicit.causal
    elif isinstance(explicit, torch.Tensor):
        causal = explicit.dim() == 3 or explicit.shape[-1] != 4  # as _explicit_mask reads it
    else:
        return  # _explicit_mask names the wrong type
    if not causal and not allowed:
        raise ValueError(
            f"{name} is a non-causal mask but the attention module is causal: its queries "
            "would see later tokens. Pass a causal mask (the causal forms of flashmask.masks, "
            "or intersect it with masks.causal), or pass flashmask_bidirectional=True with "
            f"{name} to the model call to allow bidirectional attention on purpose"
        )


def resolve_mask(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    device: torch.device,
    causal: bool = True,
    explicit: FlashMask | torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> FlashMask | None:
    """The FlashMask the backend applies (see the module docstring), or ``None`` for plain
    causal (``causal=True``) / full attention.

    Args:
        batch: ``B`` of the attention call.
        seqlen_q: ``Sq`` of the attention call.
        seqlen_k: ``Sk`` of the attention call.
        device: where the mask must live (the query's device).
        causal: the attention module's causality (used for every mask but an explicit one).
        explicit: a :class:`FlashMask` or int32 ``startend_row_indices [B or 1, Hm, Sk, C]``.
        attention_mask: a 2-D padding mask ``[B, >= Sk]`` (the last ``Sk`` columns are used;
            nonzero = real token), a 4-D dense mask (bool True = attend, or additive float
            with 0 = attend), or the int32 key rows ``[B or 1, 1, 1, Sk]`` of
            :func:`flashmask_mask_interface` (queries that do not stand at the end of the keys,
            e.g. with a static cache: key ``j`` is at query row ``rows[j]``'s position, and
            causal modules hide it from the rows above).
        position_ids: ``[B or 1, Sq]`` positions; restarts mark packed documents.
        cu_seq_lens_q: int ``[N + 1]`` cumulative query lengths of ``N`` segments (documents or
            requests) over the flattened batch.
        cu_seq_lens_k: int ``[N + 1]`` cumulative key lengths of the same segments. When it
            differs from ``cu_seq_lens_q`` (continuous batching: a request's keys are its cached
            tokens followed by its new ones), segment ``r``'s queries see only segment ``r``'s
            keys, causally with the segment's last query at its last key. Needs ``B = 1``
            unless it equals ``cu_seq_lens_q``.
        sliding_window: transformers' window ``w``: query ``i`` sees keys ``(i - w, i]``.

    Raises:
        ValueError: ``cu_seq_lens_k`` without ``cu_seq_lens_q``; ``cu_seq_lens_q`` alone when
            ``Sq != Sk`` (the keys' segments are unknown); cumulative lengths that do not rise
            from 0 within the call's tokens (checked outside ``torch.compile`` tracing and CUDA
            graph capture, where reading them would need a host sync).
    """
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if explicit is not None:
        mask = _explicit_mask(explicit, batch, seqlen_k, device)
        if sliding_window is not None:
            window = _window_only(seqlen_q, seqlen_k, mask.causal, sliding_window, device)
            mask = intersect(mask, window, seqlen_q=seqlen_q)
        return mask
    key_rows = _is_key_rows(attention_mask)
    if attention_mask is not None and attention_mask.dim() == 4 and not key_rows:
        mask = _from_dense_4d(attention_mask, batch, seqlen_q, seqlen_k, device)
        if sliding_window is not None:
            window = _window_only(seqlen_q, seqlen_k, mask.causal, sliding_window, device)
            mask = intersect(mask, window, seqlen_q=seqlen_q)
        return mask
    if attention_mask is not None and attention_mask.dim() != 2 and not key_rows:
        raise ValueError(
            "attention_mask must be a 2-D padding mask [batch, seqlen_k] or a 4-D mask, got "
            f"shape {tuple(attention_mask.shape)}"
        )

    # The one batch-describing input that applies, first match wins.
    if key_rows:
        kind, source = "key_rows", attention_mask
    elif cu_seq_lens_k is not None:
        if cu_seq_lens_q is None:
            raise ValueError(
                "cu_seq_lens_k was passed without cu_seq_lens_q: pass both (cumulative query and "
                "key lengths of the same segments)"
            )
        kind, source = "cu_seq_lens", cu_seq_lens_k
    elif cu_seq_lens_q is not None:
        if seqlen_q != seqlen_k:
            raise ValueError(
                f"cu_seq_lens_q was passed for {seqlen_q} queries over {seqlen_k} keys: pass "
                "cu_seq_lens_k too (the cumulative key length of every segment), otherwise which "
                "keys a segment's queries may see is unknown"
            )
        kind, source = "cu_seq_lens_q", cu_seq_lens_q
    elif attention_mask is not None:
        kind, source = "attention_mask", attention_mask
    elif position_ids is not None and position_ids.dim() == 2 and seqlen_q == seqlen_k:
        kind, source = "position_ids", position_ids
    else:
        kind, source = None, None

    def derive() -> FlashMask | None:
        return _derived_mask(
            batch,
            seqlen_q,
            seqlen_k,
            device,
            causal,
            kind,
            source,
            sliding_window,
            cu_seq_lens_q=cu_seq_lens_q,
        )

    if source is None or torch.compiler.is_compiling():
        return derive()
    # Every layer of a forward gets the same source tensor: derive its mask once, so the layers
    # also share one startend_row_indices tensor (and the kernels' preparation of it).
    # (Not while tracing: reading a tensor's identity there would guard the graph on it.)
    key = (batch, seqlen_q, seqlen_k, device, causal, sliding_window, kind)
    if kind == "cu_seq_lens":
        # The mask depends on both tensors: the entry is keyed by cu_seq_lens_k and names
        # cu_seq_lens_q by id and version; the entry holds cu_seq_lens_q, so that id cannot be
        # reused by another tensor while the entry exists.
        key = (*key, id(cu_seq_lens_q), cu_seq_lens_q._version)
        return _LAYER_MEMO.get(source, key, lambda: (cu_seq_lens_q, derive()))[1]
    return _LAYER_MEMO.get(source, key, derive)


def _is_key_rows(attention_mask: torch.Tensor | None) -> bool:
    """Whether ``attention_mask`` is the key rows of :func:`flashmask_mask_interface` (a 4-D
    integer tensor: transformers' own 4-D masks are bool or float)."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and not attention_mask.is_floating_point()
        and not attention_mask.is_complex()
        and attention_mask.dtype != torch.bool
    )


def _derived_mask(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
    causal: bool,
    kind: str | None,
    source: torch.Tensor | None,
    sliding_window: int | None,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
) -> FlashMask | None:
    """The mask of the batch-describing input ``source`` (``kind``: ``"key_rows"``,
    ``"cu_seq_lens"`` (source: ``cu_seq_lens_k``), ``"cu_seq_lens_q"``, ``"attention_mask"`` or
    ``"position_ids"``; ``None``: none applies) and the window; ``None`` when nothing narrows
    plain causal / full attention. Built from tensor operations alone, so it traces and
    captures without host syncs; checks that read values run only where :func:`_may_sync`
    allows."""
    # Per key column j: masked query rows [lts_j, Sq), plus [0, ute_j) when not causal.
    cols = torch.arange(seqlen_k, device=device)
    lts = torch.full((batch, seqlen_k), seqlen_q, dtype=torch.int64, device=device)
    ute = torch.zeros_like(lts)
    # The query row that stands at key column j's position: bottom-right alignment over the whole
    # call unless segments place their queries at the end of their own keys.
    anchor = cols - (seqlen_k - seqlen_q)
    aligned = True  # whether anchor is the whole call's bottom-right alignment (the causal form)
    shaped = False  # whether anything narrows plain causal / full attention
    if kind == "key_rows":
        if (
            source.shape[1:3] != (1, 1)
            or source.shape[0] not in (1, batch)
            or (source.shape[-1] != seqlen_k)
        ):
            raise ValueError(
                f"the key rows of flashmask_mask_interface must be [batch={batch} or 1, 1, 1, "
                f"seqlen_k={seqlen_k}], got shape {tuple(source.shape)} (the mask was sized for "
                "another layer's keys)"
            )
        anchor = source[:, 0, 0, :].to(device=device, dtype=torch.int64).expand(batch, -1)
        lts = torch.where(anchor >= KEY_ROW_HIDDEN, 0, lts)
        aligned = False
        shaped = True
    elif kind == "cu_seq_lens":
        cu_q, cu_k = (
            _cumulative(cu_seq_lens_q, "cu_seq_lens_q"),
            _cumulative(source, "cu_seq_lens_k"),
        )
        same = (
            seqlen_q == seqlen_k
            and _may_sync()
            and cu_q.shape == cu_k.shape
            and bool(torch.equal(cu_q.to(cu_k.device), cu_k))
        )
        if same or (batch > 1 and seqlen_q == seqlen_k and not _may_sync()):
            # Queries and keys are the same tokens: one causal document per segment, which the
            # flattened-batch form below handles for any batch size. (Traced with B > 1 the two
            # cannot be compared; cu_seq_lens_k must then equal cu_seq_lens_q.)
            kind, source = "cu_seq_lens_q", cu_seq_lens_q
        elif batch != 1:
            raise ValueError(
                "cu_seq_lens_k that differs from cu_seq_lens_q needs a batch of 1 (the segments "
                f"of a flattened batch), got batch={batch} with {seqlen_q} queries and "
                f"{seqlen_k} keys"
            )
        else:
            names = ("cu_seq_lens_q", "cu_seq_lens_k", "seqlen_q", "seqlen_k")
            lts, ute, anchor = segment_bounds(
                cu_q.to(device), cu_k.to(device), seqlen_q, seqlen_k, names
            )
            aligned = False
            shaped = True
    if kind == "cu_seq_lens_q":
        starts, valid = _starts_from_cu_seqlens(source, batch, seqlen_k, device)
        ute, doc_end = _document_bounds(starts)
        lts = torch.where(valid, doc_end, 0)
        shaped = True
    elif kind == "attention_mask":
        attention_mask = source
        valid = attention_mask[:, -seqlen_k:].to(device=device, dtype=torch.bool)
        if valid.shape[0] == 1 and batch > 1:
            valid = valid.expand(batch, -1)
        if valid.shape != (batch, seqlen_k):
            raise ValueError(
                f"attention_mask must be [batch={batch}, >= seqlen_k={seqlen_k}], got shape "
                f"{tuple(attention_mask.shape)}"
            )
        if seqlen_q == seqlen_k:
            # A row padded on the left or right: its real run [start, end) is all that any of its
            # queries may see, so padded queries see nothing. A row with holes keeps full rows.
            runs = valid[:, :1].int() + (valid[:, 1:] & ~valid[:, :-1]).sum(-1, keepdim=True)
            run_start = valid.int().argmax(-1, keepdim=True)
            run_end = seqlen_k - valid.flip(-1).int().argmax(-1, keepdim=True)
            lts = torch.where(runs <= 1, run_end, lts)
            ute = torch.where(runs <= 1, run_start, ute)
        lts = torch.where(valid, lts, 0)
        shaped = True
    elif kind == "position_ids":
        position_ids = source
        if position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seqlen_q:
            raise ValueError(
                f"position_ids must be [batch={batch} or 1, seqlen={seqlen_q}], got shape "
                f"{tuple(position_ids.shape)}"
            )
        pos = position_ids.to(device).expand(batch, -1)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        # One host sync (per forward, thanks to the memo in resolve_mask) keeps unpacked batches
        # on the maskless causal fast path in eager mode; traced or captured, the mask is built.
        if not _may_sync() or bool(starts[:, 1:].any()):
            ute, lts = _document_bounds(starts)
            shaped = True

    if sliding_window is not None:
        lts = torch.minimum(lts, anchor + sliding_window)
        if not causal:
            ute = torch.maximum(ute, anchor - sliding_window + 1)
        shaped = True
    if not shaped:
        return None
    if aligned:
        return _column_mask(lts, ute, causal, seqlen_q)
    if causal:
        # Causality relative to each key's own anchor is not the whole call's bottom-right
        # alignment, so it goes into the intervals: key j is hidden from rows above its anchor.
        ute = torch.maximum(ute, anchor)
    return _column_mask(lts, ute, False, seqlen_q)


# ---------------------------------------------------------------------- helpers
# Values derived from the tensors transformers hands every layer of a forward (the same
# ``position_ids`` / ``cu_seq_lens_q`` / padding-mask object): the mask, whose derivation may need
# a host sync, is derived once per forward instead of once per layer, and all layers share its
# ``startend_row_indices`` tensor (which lets the kernels reuse their preparation of it). A few
# entries are kept (layers of one model may differ in window), shared by all threads (activation
# checkpointing recomputes in the backward's).
_LAYER_MEMO: TensorKeyedCache[Any] = TensorKeyedCache(8)


def _explicit_mask(
    explicit: FlashMask | torch.Tensor, batch: int, seqlen_k: int, device: torch.device
) -> FlashMask:
    if isinstance(explicit, FlashMask):
        mask = explicit
    elif isinstance(explicit, torch.Tensor):
        sri = explicit.unsqueeze(-1) if explicit.dim() == 3 else explicit
        if sri.dim() != 4:
            raise ValueError(
                "startend_row_indices must be [batch, mask_heads, seqlen_k, C] (or without C), "
                f"got shape {tuple(explicit.shape)}"
            )
        # Paddle's convention for a decoder: C = 1 or 2 are causal forms, C = 4 is not.
        mask = FlashMask(sri, causal=sri.shape[-1] != 4)
    else:
        raise TypeError(
            "flashmask must be a FlashMask and startend_row_indices an int32 tensor, got "
            f"{type(explicit).__name__}"
        )
    if mask.seqlen_k != seqlen_k:
        raise ValueError(
            f"the explicit mask covers {mask.seqlen_k} keys but the attention call has "
            f"{seqlen_k} (with a KV cache, the mask must cover the whole cache)"
        )
    if mask.device != device:
        mask = mask.to(device)
    if mask.batch_size == 1 and batch > 1:
        mask = _expand_batch(mask, batch)
    return mask


def _expand_batch(mask: FlashMask, batch: int) -> FlashMask:
    """``mask`` ``[1, Hm, Sk, C]`` broadcast to ``batch`` rows (a view)."""
    sri = mask.startend_row_indices.expand(batch, -1, -1, -1)
    return dataclasses.replace(mask, startend_row_indices=sri)


def _window_only(
    seqlen_q: int, seqlen_k: int, causal: bool, window: int, device: torch.device
) -> FlashMask:
    """transformers' sliding window as a FlashMask ``[1, 1, Sk, C]`` (bottom-right aligned)."""
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    offset = seqlen_k - seqlen_q
    return _column_mask(cols + window - offset, cols - window + 1 - offset, causal, seqlen_q)


def _document_bounds(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_start, doc_end)`` of every token, ``[B, S]`` int64, from ``starts [B, S]`` bool
    (True where a document begins; position 0 always begins one)."""
    seqlen = starts.shape[-1]
    idx = torch.arange(seqlen, device=starts.device).expand_as(starts)
    doc_start = torch.where(starts, idx, 0).cummax(-1).values
    # The end of t's document is the first start after t: a reverse running minimum.
    next_start = torch.full_like(idx, seqlen)
    next_start[:, :-1] = torch.where(starts[:, 1:], idx[:, 1:], seqlen)
    doc_end = next_start.flip(-1).cummin(-1).values.flip(-1)
    return doc_start, doc_end


def _starts_from_cu_seqlens(
    cu_seq_lens: torch.Tensor, batch: int, seqlen: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document starts and real-token flags ``[B, S]`` from cumulative lengths over the flattened
    ``B * S`` tokens. Tokens past the last boundary are padding: they start a block of their own
    (so padded queries see no real key) and are flagged as not real."""
    cu = _cumulative(cu_seq_lens, "cu_seq_lens_q").to(device)
    total = batch * seqlen
    if _may_sync():
        _check_cumulative("cu_seq_lens_q", cu, total, "batch * seqlen")
    # One slot past the end takes a boundary at B * S (no padding), so no value needs a check.
    starts = torch.zeros(total + 1, dtype=torch.bool, device=device)
    starts[cu.clamp(0, total)] = True
    starts = starts[:total].view(batch, seqlen).clone()
    starts[:, 0] = True  # a row never continues the previous one
    valid = (torch.arange(total, device=device) < cu[-1]).view(batch, seqlen)
    return starts, valid


def _from_dense_4d(
    attention_mask: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int, device: torch.device
) -> FlashMask:
    """A 4-D dense mask handed over by transformers as a FlashMask (O(Sq * Sk))."""
    if attention_mask.dtype == torch.bool:
        visible = attention_mask
    elif attention_mask.is_floating_point():
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        if bool((attention_mask[visible] != 0).any()):
            raise ValueError(
                "the flashmask backend takes 4-D additive masks of 0 (attend) and a large "
                "negative value (masked) only; this one carries attention biases"
            )
    else:
        raise TypeError(f"a 4-D attention_mask must be bool or float, got {attention_mask.dtype}")
    visible = visible[..., -seqlen_q:, -seqlen_k:].to(device)
    if visible.shape[0] == 1 and batch > 1:
        visible = visible.expand(batch, -1, -1, -1)
    if visible.shape[0] != batch or visible.shape[-2:] != (seqlen_q, seqlen_k):
        raise ValueError(
            f"a 4-D attention_mask must be [batch={batch}, heads, {seqlen_q}, {seqlen_k}], got "
            f"shape {tuple(attention_mask.shape)}"
        )
    return FlashMask.from_dense(visible)


# ---------------------------------------------------------------------- layer policies
def policy_of(module: torch.nn.Module) -> Policy | None:
    """The mask policy attached to an attention module (:data:`POLICY_ATTR`), if any."""
    return getattr(module, POLICY_ATTR, None)


def _policy_spec(module: torch.nn.Module) -> Any:
    """The mask spec ``module``'s policy applies to its layer (``spec_for``), or ``None`` for a
    policy without one (an opaque callable). A policy with a spec builds its mask from the spec
    and the call's :class:`MaskContext`, per-row positions included."""
    spec_for = getattr(policy_of(module), "spec_for", None)
    return None if spec_for is None else spec_for(module.layer_idx)


def _padding_positions(
    attention_mask: torch.Tensor | None, batch: int, seqlen_k: int, device: torch.device
) -> torch.Tensor | None:
    """The key positions, int64 ``[B, Sk]``, of a call whose ``attention_mask`` is a 2-D padding
    mask ``[B or 1, >= Sk]`` (nonzero = real token; its last ``Sk`` columns are the keys): a real
    token's position is the number of real tokens before it in its row (over the whole mask, so
    real tokens before the call's keys count), ``-1`` for padding. ``None`` for any other
    ``attention_mask``. Tensor operations only (no host read); derived once per forward and
    shared by the layers."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None

    def derive() -> torch.Tensor:
        real = attention_mask.to(device=device, dtype=torch.bool)
        if real.shape[0] == 1 and batch > 1:
            real = real.expand(batch, -1)
        if real.shape[0] != batch or real.shape[1] < seqlen_k:
            raise ValueError(
                f"attention_mask must be [batch={batch}, >= seqlen_k={seqlen_k}], got shape "
                f"{tuple(attention_mask.shape)}"
            )
        return torch.where(real, real.long().cumsum(-1) - 1, -1)[:, -seqlen_k:]

    key = ("positions", batch, seqlen_k, device)
    return _LAYER_MEMO.get(attention_mask, key, derive)


def layer_policy_mask(
    module: torch.nn.Module,
    boundaries: FlashMask | None,
    batch_size: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
    *,
    key_positions: torch.Tensor | None = None,
) -> FlashMask | None:
    """The mask an attention call of ``module`` applies under its policy (``None``: no policy).

    Args:
        module: the attention module (its policy, :data:`POLICY_ATTR`, and ``layer_idx``).
        boundaries: the batch's own non-causal mask (documents, padding, an explicit mask) or
            ``None``; the layer's mask is intersected with it.
        batch_size: ``B`` of the call.
        seqlen_q: ``Sq`` of the call.
        seqlen_k: ``Sk`` of the call.
        device: where the mask must live.
        key_positions: int64 ``[B, Sk]``, each key's position in its row (``-1``: padding), or
            ``None`` (no padding mask); handed to the policy in its :class:`MaskContext`.
    """
    policy = policy_of(module)
    if policy is None:
        return None
    ctx = MaskContext(module.layer_idx, batch_size, seqlen_q, seqlen_k, device, key_positions)
    mask = policy(module.layer_idx, ctx)
    if mask is None:
        mask = masks.causal(seqlen_k, seqlen_q=seqlen_q, device=device)
    if not isinstance(mask, FlashMask):
        raise TypeError(f"a mask policy must return a FlashMask or None, got {type(mask).__name__}")
    if mask.device != device:
        mask = mask.to(device)
    if mask.batch_size == 1 and batch_size > 1:
        mask = _expand_batch(mask, batch_size)
    if boundaries is None:
        return mask
    return intersect(mask, boundaries, seqlen_q=seqlen_q)


def _dtypes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module: torch.nn.Module
) -> tuple[torch.dtype, torch.dtype]:
    """``(compute dtype, output dtype)`` for ``q, k, v``.

    * Under autocast, the autocast dtype for both, as SDPA does (autocast can hand over mixed
      dtypes: Llama's RoPE turns bf16 q/k into float32 while v stays bf16).
    * Otherwise the common dtype of the three for the output; the computation runs in it too,
      except float32 on CUDA, which the Triton kernels do not take: like transformers'
      FlashAttention path (``get_target_dtype``) it runs in the dtype of the module's first
      half-precision ``nn.Linear`` weight (PEFT keeps base weights in bf16 while upcast layer
      norms emit float32), and stays float32 (the exact, slow reference) without one.
    """
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return dtype, dtype
    output = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if device_type == "cuda" and output == torch.float32:
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in _HALF:
                return layer.weight.dtype, output
    return output, output


register()
