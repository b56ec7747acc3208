"""Argument checks and bound-vector helpers shared by the builders of :mod:`flashmask.masks`:
integers and per-document lists validated with errors that name the argument, and the ``[B, S]``
column-bound vectors stacked into a :class:`~flashmask.mask.FlashMask`."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from flashmask.mask import FlashMask

_Device = torch.device | str | None


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _int(name: str, value: object, *, minimum: int | None = None) -> int:
    try:
        if not _is_int(value):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _is_seq(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _listify(value: object) -> object:
    """Tensors and arrays become nested lists; everything else is returned unchanged."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "tolist") and hasattr(value, "ndim")):
        return value.tolist()
    return value


def _samples(
    name: str, value: object, is_item: Callable[[object], bool], what: str
) -> tuple[list[list], bool]:
    """One sample (a sequence of items) or a batch (a sequence of samples).

    Returns the list of samples and whether ``value`` was a batch.
    """
    value = _listify(value)
    if not _is_seq(value):
        raise TypeError(f"{name} must be a list of {what} or a list of such lists (one per sample)")
    if len(value) == 0:
        raise ValueError(f"{name} must not be empty")
    if all(is_item(v) for v in value):
        return [list(value)], False
    if all(_is_seq(s) and all(is_item(v) for v in s) for s in value):
        return [list(s) for s in value], True
    raise TypeError(f"{name} must be a list of {what} or a list of such lists (one per sample)")


def _at(name: str, batched: bool, b: int, *index: int) -> str:
    """``name[b][i]...`` as the user wrote it (without ``[b]`` for a single sample)."""
    return name + (f"[{b}]" if batched else "") + "".join(f"[{i}]" for i in index)


def _is_pair(value: object) -> bool:
    return _is_seq(value) and len(value) == 2 and all(_is_int(v) for v in value)


def _is_int_list(value: object) -> bool:
    return _is_seq(value) and all(_is_int(v) for v in value)


def _doc_lens(name: str, doc_lens: object) -> tuple[list[list[int]], bool]:
    samples, batched = _samples(name, doc_lens, _is_int, "document lengths (ints)")
    for b, lens in enumerate(samples):
        for i, n in enumerate(lens):
            lens[i] = _int(_at(name, batched, b, i), n, minimum=0)
    return samples, batched


def _seqlen(seqlen: object, name: str, totals: list[int], batched: bool) -> int:
    """``seqlen`` checked against the samples' totals (the longest total when ``None``)."""
    longest = max(totals)
    if seqlen is None:
        if longest == 0:
            raise ValueError(f"{name} holds no token; give a positive seqlen or longer documents")
        return longest
    seqlen = _int("seqlen", seqlen, minimum=1)
    if longest > seqlen:
        b = totals.index(longest)
        where = f"{name}[{b}]" if batched else name
        raise ValueError(f"seqlen={seqlen} is shorter than {where}, which holds {longest} tokens")
    return seqlen


def _window(window: object) -> tuple[int, int]:
    window = _listify(window)
    if _is_seq(window):
        if len(window) != 2:
            raise ValueError(f"window must be an int or a (left, right) pair, got {window!r}")
        return _int("window[0]", window[0], minimum=0), _int("window[1]", window[1], minimum=0)
    w = _int("window", window, minimum=0)
    return w, w


# ---------------------------------------------------------------------- tensor helpers
def _vec(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _per_doc(values: Sequence[int], lens: Sequence[int], seqlen: int, pad: int) -> torch.Tensor:
    """``values[d]`` repeated over document ``d``'s tokens, then ``pad`` up to ``seqlen``."""
    vec = torch.repeat_interleave(_vec(values), _vec(lens))
    return torch.cat([vec, vec.new_full((seqlen - vec.numel(),), pad)])


def _doc_starts_ends(lens: Sequence[int]) -> tuple[list[int], list[int]]:
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total)
    return [e - n for e, n in zip(ends, lens, strict=True)], ends


def _mask(
    columns: Sequence[torch.Tensor], causal: bool, device: _Device, seqlen_q: int
) -> FlashMask:
    """Stack ``[B, S]`` (or ``[B, H, S]``) bound vectors into a FlashMask on ``device``, built
    for ``seqlen_q`` queries."""
    sri = torch.stack(list(columns), dim=-1)
    if sri.dim() == 3:
        sri = sri.unsqueeze(1)
    return FlashMask(sri.to(device=device, dtype=torch.int32).contiguous(), causal, seqlen_q)


def _repeat(vec: torch.Tensor, batch_size: int) -> torch.Tensor:
    return vec.unsqueeze(0).expand(batch_size, -1)
