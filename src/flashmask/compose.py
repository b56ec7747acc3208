"""Composing masks: the intersection of two FlashMasks, computed on intervals in O(N).

A query may attend to a key under ``a & b`` when it may under both, so the masked rows of every
key column are the union of the two masks' masked intervals (plus the causal triangle if either
is causal). The union is merged per column and written back in the smallest form that holds it;
when a column needs more intervals than any form has, :class:`MaskNotRepresentableError` names it.

Typical uses: a document mask intersected with a sliding window or a per-layer policy.

:func:`intersect` lives in :mod:`flashmask.mask` next to :class:`~flashmask.FlashMask`, whose
``&`` operator is this intersection; it is also ``flashmask.intersect``.
"""

from __future__ import annotations

from flashmask.mask import MaskNotRepresentableError, intersect

__all__ = ["MaskNotRepresentableError", "intersect"]
