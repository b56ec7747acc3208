"""Hypothesis strategies for valid random FlashMasks of every (causal, C) form.

"Valid" means anything the API accepts: every int32 value has a defined meaning (values are
clamped to ``[0, Sq]``, an interval whose start >= end is empty), so the strategies deliberately
draw empty intervals, reversed intervals, the edge values 0 and ``Sq``, values outside
``[0, Sq]`` (up to the int32 limits), fully masked and fully visible columns, ``Hm`` in {1, 2}
and ``Sq != Sk``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from flashmask import FlashMask

__all__ = [
    "FORMS",
    "FORM_IDS",
    "DrawnMask",
    "Form",
    "flashmasks",
    "random_cases",
    "row_value",
]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def random_cases(n: int) -> int:
    """``n`` scaled by the ``FLASHMASK_RANDOM_CASES`` multiplier (default 1), at least 1."""
    scale = float(os.environ.get("FLASHMASK_RANDOM_CASES", "1"))
    return max(1, round(n * scale))


class Form(NamedTuple):
    """One (causal, C) combination of ``startend_row_indices``."""

    causal: bool
    bounds: int

    @property
    def name(self) -> str:
        return f"{'causal' if self.causal else 'noncausal'}-C{self.bounds}"


FORMS = (Form(True, 1), Form(True, 2), Form(False, 2), Form(False, 4))
FORM_IDS = [f.name for f in FORMS]

# Column values meaning "every row masked" / "no row masked" (the causal part aside), per form.
_FULL_COLUMN = {
    Form(True, 1): lambda sq: [0],
    Form(True, 2): lambda sq: [0, sq],
    Form(False, 2): lambda sq: [0, sq],
    Form(False, 4): lambda sq: [0, sq, 0, sq],
}
_EMPTY_COLUMN = {
    Form(True, 1): lambda sq: [sq],
    Form(True, 2): lambda sq: [sq, sq],
    Form(False, 2): lambda sq: [sq, 0],
    Form(False, 4): lambda sq: [sq, sq, 0, 0],
}


class DrawnMask(NamedTuple):
    """A drawn mask and the query length it was drawn for."""

    mask: FlashMask
    seqlen_q: int

    @property
    def seqlen_k(self) -> int:
        return self.mask.seqlen_k


def row_value(seqlen_q: int) -> st.SearchStrategy[int]:
    """One bound: mostly in ``[0, Sq]``, often exactly 0 or ``Sq``, sometimes out of range."""
    in_range = st.integers(0, seqlen_q)
    edge = st.sampled_from([0, seqlen_q])
    outside = st.sampled_from([-2, -1, seqlen_q + 1, seqlen_q + 2, INT32_MIN, INT32_MAX])
    return st.one_of(in_range, in_range, in_range, edge, edge, outside)


def _interval(seqlen_q: int) -> st.SearchStrategy[list[int]]:
    """``[start, end)``: usually ordered, sometimes empty (start == end) or reversed."""
    value = row_value(seqlen_q)

    @st.composite
    def draw_interval(draw: st.DrawFn) -> list[int]:
        start = draw(value)
        kind = draw(st.integers(0, 5))
        if kind <= 2:
            return [start, draw(st.integers(min(max(start, 0), seqlen_q), seqlen_q))]
        if kind == 3:
            return [start, start]
        if kind == 4 and start > INT32_MIN:
            return [start, start - draw(st.integers(1, 3))]
        return [start, draw(value)]

    return draw_interval()


def _column(form: Form, seqlen_q: int) -> st.SearchStrategy[list[int]]:
    """The ``C`` values of one key column; 1 in 10 fully masked, 1 in 10 without any interval."""
    if form.bounds == 1:
        values = row_value(seqlen_q).map(lambda v: [v])
    elif form.bounds == 2:
        values = _interval(seqlen_q)
    else:
        values = st.tuples(_interval(seqlen_q), _interval(seqlen_q)).map(lambda p: p[0] + p[1])
    special = st.sampled_from([_FULL_COLUMN[form](seqlen_q), _EMPTY_COLUMN[form](seqlen_q)])
    return st.one_of(values, values, values, values, special)


@st.composite
def flashmasks(
    draw: st.DrawFn,
    form: Form,
    *,
    max_seqlen: int = 24,
    min_seqlen: int = 1,
    mask_heads: tuple[int, ...] = (1, 2),
    max_batch: int = 2,
    equal_lengths: bool | None = None,
) -> DrawnMask:
    """A valid ``FlashMask`` of ``form`` with its ``seqlen_q``.

    Args:
        form: the (causal, C) combination to draw.
        max_seqlen, min_seqlen: range of ``Sq`` and ``Sk``.
        mask_heads: the ``Hm`` values to choose from.
        max_batch: largest batch size.
        equal_lengths: force ``Sq == Sk`` (True) or let hypothesis choose (None); False still
            allows equal lengths when both draws agree.
    """
    seqlen_k = draw(st.integers(min_seqlen, max_seqlen))
    different = draw(st.booleans()) if equal_lengths is None else not equal_lengths
    seqlen_q = draw(st.integers(min_seqlen, max_seqlen)) if different else seqlen_k
    batch = draw(st.integers(1, max_batch))
    heads = draw(st.sampled_from(mask_heads))
    columns = draw(
        st.lists(
            _column(form, seqlen_q),
            min_size=batch * heads * seqlen_k,
            max_size=batch * heads * seqlen_k,
        )
    )
    indices = torch.tensor(columns, dtype=torch.int32).view(batch, heads, seqlen_k, form.bounds)
    return DrawnMask(FlashMask(indices, form.causal), seqlen_q)
