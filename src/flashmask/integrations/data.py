"""Collators that pack training samples into rows with FlashMask masks, and preference losses.

Two layouts, both returning a ``dict`` of tensors; :func:`model_inputs` picks the ones a
transformers model running the ``"flashmask"`` backend takes (``model(**model_inputs(batch))``;
see :mod:`flashmask.integrations.transformers`):

**Packed SFT** (:func:`pack_sft`): samples are packed best-fit-decreasing into rows of at most
``max_tokens`` tokens. Each sample is one document with a causal mask of its own (no attention
across documents), positions restarting at 0, and labels in Hugging Face's convention: the model
shifts them internally, so ``labels[t]`` is the target predicted from position ``t - 1``, and
``labels`` equals ``input_ids`` except ``-100`` at the first token of every document (so no
document is predicted from the previous one's last token), on padding, and wherever the sample's
own ``labels`` are ``-100`` (e.g. prompt tokens). The packed loss therefore sums exactly the same
terms as running every sample separately.

**Shared-prompt preference pairs** (:func:`pack_preference`): each pair becomes one document
``prompt ‖ chosen ‖ rejected`` under the share-question mask: both responses see the prompt,
``rejected`` does not see ``chosen``. Positions of ``rejected`` restart at ``len(prompt)``, so
every token has the position and the visible context it has in the separate sequence
``prompt ‖ rejected``: its hidden states, log-probabilities and scores equal those of the separate
forward pass while the prompt is computed once. Several pairs share a row when they fit.
:func:`response_logps` and :func:`response_scores` gather per-response values from the packed
output; :func:`dpo_loss` and :func:`bradley_terry_loss` turn them into losses.

Padding sits at the end of each row: ``pad_token_id`` tokens, label ``-100``, positions
``0, 1, ...`` and fully masked keys and queries in the FlashMask.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from flashmask import masks
from flashmask.mask import FlashMask

__all__ = [
    "IGNORE_INDEX",
    "MODEL_INPUTS",
    "bradley_terry_loss",
    "dense_attention_mask",
    "dpo_loss",
    "model_inputs",
    "pack_preference",
    "pack_sft",
    "response_logps",
    "response_scores",
]

IGNORE_INDEX = -100
"""The label that transformers' (and PyTorch's) cross-entropy ignores."""

MODEL_INPUTS = ("input_ids", "labels", "position_ids", "startend_row_indices")
"""The keys of a packed batch that are model inputs; the others index the packed layout."""

_Ids = Sequence[int] | torch.Tensor


def model_inputs(
    batch: Mapping[str, torch.Tensor], device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """The model inputs of a packed batch (:data:`MODEL_INPUTS` that it has), optionally moved to
    ``device``: ``model(**model_inputs(batch, "cuda"))``."""
    return {
        k: batch[k] if device is None else batch[k].to(device) for k in MODEL_INPUTS if k in batch
    }


# ---------------------------------------------------------------------- argument checks
def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _int_arg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _token_list(name: str, value: object) -> list[int]:
    """A non-empty list of ints from a sequence or a 1-D integer tensor (``name`` for errors)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-D integer tensor or a list of ints, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}"
            )
        tokens = value.tolist()
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        tokens = list(value)
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"{name}[{i}] must be an int, got {type(t).__name__}")
    else:
        raise TypeError(
            f"{name} must be a list of ints or a 1-D tensor, got {type(value).__name__}"
        )
    if not tokens:
        raise ValueError(f"{name} is empty")
    return tokens


def _field(sample: object, where: str, key: str) -> object:
    if not isinstance(sample, Mapping):
        raise TypeError(f"{where} must be a mapping with {key!r}, got {type(sample).__name__}")
    if key not in sample:
        raise ValueError(f"{where} has no {key!r}")
    return sample[key]


# ---------------------------------------------------------------------- packing
def _best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total ``<= capacity``.

    Longest first, each into the fullest bin it still fits (a new bin when none does). Ties keep
    input order, so the result is deterministic. Within a bin, items keep the order they were
    placed in.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), ascending
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            remaining, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (remaining - lengths[i], b))
    return bins


def _row_length(totals: Sequence[int], max_tokens: int, pad_to_max_tokens: bool) -> int:
    return max_tokens if pad_to_max_tokens else max(totals)


def pack_sft(
    samples: Sequence[Mapping[str, _Ids]],
    max_tokens: int,
    *,
    pad_token_id: int = 0,
    truncate: bool = False,
    pad_to_max_tokens: bool = False,
) -> dict[str, torch.Tensor]:
    """Pack tokenized SFT samples best-fit-decreasing into rows of at most ``max_tokens``.

    Args:
        samples: each a mapping with ``"input_ids"`` (ints) and optionally ``"labels"`` of the
            same length (``-100`` where no loss is wanted, e.g. on the prompt; default: every
            token is a target).
        max_tokens: the most tokens in a row.
        pad_token_id: the token id of padding.
        truncate: cut samples longer than ``max_tokens`` to their first ``max_tokens`` tokens
            instead of raising.
        pad_to_max_tokens: pad every row to ``max_tokens`` (static shapes) instead of to the
            longest row.

    Returns:
        With ``R`` rows of ``S`` tokens:

        * ``input_ids`` int64 ``[R, S]``;
        * ``labels`` int64 ``[R, S]``, HF convention (the model shifts): ``-100`` at each
          document's first token, on padding and where the sample's labels are ``-100``;
        * ``position_ids`` int64 ``[R, S]``, restarting at 0 for every document;
        * ``startend_row_indices`` int32 ``[R, 1, S, 1]``: the causal-document FlashMask
          (causal, ``C = 1``; padding keys and queries fully masked); pass it to the model as
          ``startend_row_indices=`` or wrap it as ``FlashMask(..., causal=True)``;
        * ``sample_index`` int64 ``[R, S]``: which sample each token came from, ``-1`` on padding
          (documents are the runs of equal values);
        * ``doc_lens`` int64 ``[R, D]``: the documents' lengths in row order, 0-padded.

    Raises:
        ValueError: ``samples`` is empty, a sample is empty, its labels have another length, or
            it is longer than ``max_tokens`` (the error names it) and ``truncate`` is False.
    """
    max_tokens = _positive_int("max_tokens", max_tokens)
    pad_token_id = _int_arg("pad_token_id", pad_token_id)
    if not isinstance(samples, Sequence) or isinstance(samples, str | bytes | Mapping):
        raise TypeError(f"samples must be a sequence of mappings, got {type(samples).__name__}")
    if len(samples) == 0:
        raise ValueError("samples is empty")
    docs: list[tuple[list[int], list[int]]] = []
    for i, sample in enumerate(samples):
        ids = _token_list(
            f"samples[{i}]['input_ids']", _field(sample, f"samples[{i}]", "input_ids")
        )
        if sample.get("labels") is None:
            labels = list(ids)
        else:
            labels = _token_list(f"samples[{i}]['labels']", sample["labels"])
            if len(labels) != len(ids):
                raise ValueError(
                    f"samples[{i}]['labels'] has {len(labels)} tokens but its input_ids have "
                    f"{len(ids)}"
                )
        if len(ids) > max_tokens:
            if not truncate:
                raise ValueError(
                    f"samples[{i}] has {len(ids)} tokens, more than max_tokens={max_tokens}; "
                    "raise max_tokens or pass truncate=True"
                )
            ids, labels = ids[:max_tokens], labels[:max_tokens]
        docs.append((ids, labels))

    rows = _best_fit_decreasing([len(ids) for ids, _ in docs], max_tokens)
    totals = [sum(len(docs[i][0]) for i in row) for row in rows]
    seqlen = _row_length(totals, max_tokens, pad_to_max_tokens)
    input_ids = torch.full((len(rows), seqlen), pad_token_id, dtype=torch.int64)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    position_ids = torch.zeros_like(input_ids)
    sample_index = torch.full_like(input_ids, -1)
    doc_lens = torch.zeros(len(rows), max(len(row) for row in rows), dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            ids, labs = docs[i]
            n = len(ids)
            input_ids[r, at : at + n] = torch.tensor(ids)
            labels[r, at : at + n] = torch.tensor(labs)
            labels[r, at] = IGNORE_INDEX  # never predict a document from the previous one
            position_ids[r, at : at + n] = torch.arange(n)
            sample_index[r, at : at + n] = i
            doc_lens[r, d] = n
            at += n
        position_ids[r, at:] = torch.arange(seqlen - at)
    mask = masks.causal_document([[len(docs[i][0]) for i in row] for row in rows], seqlen)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "startend_row_indices": mask.startend_row_indices,
        "sample_index": sample_index,
        "doc_lens": doc_lens,
    }


def pack_preference(
    pairs: Sequence[Mapping[str, _Ids]],
    max_tokens: int,
    *,
    pad_token_id: int = 0,
    pad_to_max_tokens: bool = False,
) -> dict[str, torch.Tensor]:
    """Pack preference pairs as shared-prompt documents ``prompt ‖ chosen ‖ rejected``.

    Documents are packed best-fit-decreasing, several per row when they fit. Pair ``i`` keeps
    index ``i`` in every per-pair output, whatever row it lands in.

    Args:
        pairs: each a mapping with non-empty ``"prompt"``, ``"chosen"`` and ``"rejected"`` token
            lists (the prompt is needed: it predicts each response's first token).
        max_tokens: the most tokens in a row; a pair longer than this raises.
        pad_token_id: the token id of padding.
        pad_to_max_tokens: pad every row to ``max_tokens`` instead of to the longest row.

    Returns:
        With ``R`` rows of ``S`` tokens, ``P`` pairs and ``T`` response tokens in all
        (flat positions index the row-major ``[R * S]`` flattening):

        * ``input_ids``, ``position_ids`` int64 ``[R, S]`` (rejected positions restart at
          ``len(prompt)``);
        * ``startend_row_indices`` int32 ``[R, 1, S, 1]``: the share-question FlashMask (causal,
          ``C = 1``);
        * ``token_index`` int64 ``[T]``: flat position of every response token;
        * ``logit_index`` int64 ``[T]``: flat position whose logits predict that token (for the
          first token of either response: the prompt's last position);
        * ``response_index`` int64 ``[T]``: ``2 i`` for tokens of pair ``i``'s chosen response,
          ``2 i + 1`` for its rejected one;
        * ``last_index`` int64 ``[2 P]``: flat position of each response's last token (same
          ``2 i`` / ``2 i + 1`` order), where a reward model reads its score;
        * ``pair_row`` int64 ``[P]``: the row of each pair.
    """
    max_tokens = _positive_int("max_tokens", max_tokens)
    pad_token_id = _int_arg("pad_token_id", pad_token_id)
    if not isinstance(pairs, Sequence) or isinstance(pairs, str | bytes | Mapping):
        raise TypeError(f"pairs must be a sequence of mappings, got {type(pairs).__name__}")
    if len(pairs) == 0:
        raise ValueError("pairs is empty")
    parts: list[tuple[list[int], list[int], list[int]]] = []
    for i, pair in enumerate(pairs):
        prompt, chosen, rejected = (
            _token_list(f"pairs[{i}][{key!r}]", _field(pair, f"pairs[{i}]", key))
            for key in ("prompt", "chosen", "rejected")
        )
        total = len(prompt) + len(chosen) + len(rejected)
        if total > max_tokens:
            raise ValueError(
                f"pairs[{i}] has {total} tokens (prompt {len(prompt)} + chosen {len(chosen)} + "
                f"rejected {len(rejected)}), more than max_tokens={max_tokens}"
            )
        parts.append((prompt, chosen, rejected))

    rows = _best_fit_decreasing([sum(map(len, p)) for p in parts], max_tokens)
    totals = [sum(sum(map(len, parts[i])) for i in row) for row in rows]
    seqlen = _row_length(totals, max_tokens, pad_to_max_tokens)
    input_ids = torch.full((len(rows), seqlen), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros_like(input_ids)
    num_pairs = len(parts)
    last_index = torch.zeros(2 * num_pairs, dtype=torch.int64)
    pair_row = torch.zeros(num_pairs, dtype=torch.int64)
    token_index, logit_index, response_index = [], [], []
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            prompt, chosen, rejected = parts[i]
            p, c, n = len(prompt), len(chosen), len(rejected)
            base = r * seqlen + at  # flat position of the prompt's first token
            input_ids[r, at : at + p + c + n] = torch.tensor(prompt + chosen + rejected)
            position_ids[r, at : at + p + c] = torch.arange(p + c)
            position_ids[r, at + p + c : at + p + c + n] = torch.arange(p, p + n)
            for response, start, length in ((0, base + p, c), (1, base + p + c, n)):
                targets = torch.arange(start, start + length)
                # Token k of a response is predicted from token k - 1 of the same response; its
                # first token from the prompt's last position (shared by both responses).
                predictors = torch.cat([torch.tensor([base + p - 1]), targets[:-1]])
                token_index.append(targets)
                logit_index.append(predictors)
                response_index.append(torch.full((length,), 2 * i + response))
                last_index[2 * i + response] = start + length - 1
            pair_row[i] = r
            at += p + c + n
        position_ids[r, at:] = torch.arange(seqlen - at)
    mask = masks.share_question([[[len(x) for x in parts[i]] for i in row] for row in rows], seqlen)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "startend_row_indices": mask.startend_row_indices,
        "token_index": torch.cat(token_index),
        "logit_index": torch.cat(logit_index),
        "response_index": torch.cat(response_index),
        "last_index": last_index,
        "pair_row": pair_row,
    }


def dense_attention_mask(
    mask: FlashMask | torch.Tensor, *, dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    """The dense 4-D mask ``[B, Hm, S, S]`` that transformers' ``"sdpa"`` / ``"eager"`` backends
    take as ``attention_mask`` (for baselines and tests; it costs ``O(S^2)``).

    Args:
        mask: a :class:`FlashMask`, or the ``startend_row_indices`` of a packed batch (read as
            causal, as the collators build them).
        dtype: ``torch.bool`` (True = attend; for SDPA) or a float dtype for eager's additive
            mask (0 = attend, the dtype's most negative value = masked).

    Query rows that see no key (padding) get their own diagonal: SDPA would return NaN there and
    the NaN would leak through the masked products of later layers. Those rows are padding
    either way (label ``-100``), and no other row sees their keys.
    """
    if isinstance(mask, torch.Tensor):
        mask = FlashMask(mask, causal=mask.shape[-1] != 4)
    if not isinstance(mask, FlashMask):
        raise TypeError(
            f"mask must be a FlashMask or a startend_row_indices tensor, got {type(mask).__name__}"
        )
    visible = mask.to_dense()
    blind = ~visible.any(-1, keepdim=True)
    visible = visible | (blind & torch.eye(mask.seqlen_k, dtype=torch.bool, device=mask.device))
    if dtype == torch.bool:
        return visible
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be torch.bool or a float dtype, got {dtype}")
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


# ---------------------------------------------------------------------- gathering and losses
def response_logps(
    logits: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of every chosen and rejected response.

    Args:
        logits: ``[R, S, V]`` model output for ``batch`` (any float dtype; computed in float32
            or wider).
        batch: the output of :func:`pack_preference` (on ``logits``' device).

    Returns:
        ``(chosen_logps [P], rejected_logps [P])``: ``sum_t log p(token_t | context)`` over each
        response's tokens, pair ``i`` at index ``i``; differentiable.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(
            "logits must be a [rows, seqlen, vocab] tensor, got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    input_ids = batch["input_ids"]
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}"
        )
    flat = logits.flatten(0, 1)[batch["logit_index"]]
    dtype = torch.promote_types(flat.dtype, torch.float32)
    targets = input_ids.flatten()[batch["token_index"]]
    token_logps = -F.cross_entropy(flat.to(dtype), targets, reduction="none")
    sums = token_logps.new_zeros(batch["last_index"].numel())
    sums = sums.index_add(0, batch["response_index"], token_logps)
    return sums[0::2], sums[1::2]


def response_scores(
    scores: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scores read at each response's last token (reward models).

    Args:
        scores: ``[R, S]`` or ``[R, S, 1]`` per-token scores (e.g. ``model.score(hidden)`` of a
            ``*ForSequenceClassification`` model with one label).
        batch: the output of :func:`pack_preference`.

    Returns:
        ``(chosen_scores [P], rejected_scores [P])``; differentiable.
    """
    if scores.dim() == 3 and scores.shape[-1] == 1:
        scores = scores.squeeze(-1)
    if scores.shape != batch["input_ids"].shape:
        raise ValueError(
            f"scores must be [rows, seqlen] (or [rows, seqlen, 1]) like input_ids "
            f"{tuple(batch['input_ids'].shape)}, got {tuple(scores.shape)}"
        )
    last = scores.flatten()[batch["last_index"]]
    return last[0::2], last[1::2]


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """The DPO loss (Rafailov et al. 2023), averaged over pairs.

    ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` with policy (``p``) and reference (``r``)
    summed log-probabilities of the chosen (``c``) and rejected (``r``) responses, all ``[P]``.
    """
    tensors = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    _same_shape(
        ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps"),
        tensors,
    )
    if isinstance(beta, bool) or not isinstance(beta, int | float) or beta <= 0:
        raise ValueError(f"beta must be a positive number, got {beta!r}")
    margin = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * margin).mean()


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """The Bradley-Terry reward-model loss ``-log sigmoid(chosen - rejected)``, averaged."""
    _same_shape(("chosen_scores", "rejected_scores"), (chosen_scores, rejected_scores))
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


def _same_shape(names: Sequence[str], tensors: Sequence[object]) -> None:
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(
            "shape mismatch: "
            + ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
        )
