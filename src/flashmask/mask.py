"""The FlashMask representation: column intervals of masked query rows.

A mask is an int32 tensor ``startend_row_indices`` of shape ``[B, Hm, Sk, C]`` plus a ``causal``
flag. For every key column ``j`` it lists half-open intervals ``[start, end)`` of *masked query
rows*; which of the ``C`` entries means what depends on ``(causal, C)``:

======  ===  =================================================  ==============================
causal   C   entries                                            masked rows of key column j
======  ===  =================================================  ==============================
True     1   LTS                                                ``[LTS, Sq)`` + causal
True     2   LTS, LTE                                           ``[LTS, LTE)`` + causal
False    2   LTS, UTE                                           ``[LTS, Sq) + [0, UTE)``
False    4   LTS, LTE, UTS, UTE                                 ``[LTS, LTE) + [UTS, UTE)``
======  ===  =================================================  ==============================

"causal" means key ``j`` is also hidden from query rows ``i < j - (Sk - Sq)`` (bottom-right
alignment when ``Sq != Sk``, the FlashAttention >= 2.1 convention). Every int32 value has a defined
meaning: values are clamped to ``[0, Sq]`` and an interval whose start >= end is empty.

Because the values are row numbers up to ``Sq``, the same indices mean another mask at another
query length (``LTS = Sq`` "nothing masked below" becomes "rows ``[Sq, Sq')`` masked"). A
:class:`FlashMask` therefore records the query length it was built for (``seqlen_q``; every
builder in :mod:`flashmask.masks`, :meth:`FlashMask.from_dense` and :func:`intersect` set it)
and every call with another ``Sq`` raises ``ValueError``. :meth:`FlashMask.with_seqlen_q` reads
the same indices at another length on purpose; ``seqlen_q=None`` (raw indices) means "whatever
``Sq`` the call has", ``Sk`` where no call fixes it.

Dense boolean masks use PyTorch's polarity: ``True`` = the query may attend to the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "BlockSummary",
    "ColumnIntervals",
    "FlashMask",
    "MaskNotRepresentableError",
    "TileClass",
    "as_flashmask",
    "intersect",
    "to_dense",
    "validate",
]

_VALID_BOUNDS = {True: (1, 2), False: (2, 4)}


class MaskNotRepresentableError(ValueError):
    """A dense mask whose masked rows in some key column do not fit the FlashMask intervals."""


class TileClass:
    """Tile classes produced by :meth:`FlashMask.classify_tiles`."""

    SKIP = 0  # every (row, column) pair of the tile is masked: never loaded
    PARTIAL = 1  # some pairs are masked: the element mask is applied
    FULL = 2  # no pair is masked: computed without any mask work


class ColumnIntervals(NamedTuple):
    """The two masked row intervals of every key column, clamped to ``[0, Sq]``.

    Each field is int32 ``[B, Hm, Sk]``. Masked rows of column ``j`` are
    ``[lts, lte) ∪ [uts, ute)``; absent intervals are empty (``lte = Sq`` where the form has no
    LTE, ``uts = ute = 0`` where it has no upper interval). The causal triangle is not included.
    """

    lts: torch.Tensor
    lte: torch.Tensor
    uts: torch.Tensor
    ute: torch.Tensor


class BlockSummary(NamedTuple):
    """Per key block (``block_n`` columns) minimum and maximum of each interval bound.

    Each field is int32 ``[B, Hm, ceil(Sk / block_n)]`` (semantics §3.1); a partial last block
    reduces only its valid columns.
    """

    lts_max: torch.Tensor
    lts_min: torch.Tensor
    lte_max: torch.Tensor
    lte_min: torch.Tensor
    uts_max: torch.Tensor
    uts_min: torch.Tensor
    ute_max: torch.Tensor
    ute_min: torch.Tensor


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True, eq=False)
class FlashMask:
    """An attention mask stored as per-key-column intervals of masked query rows.

    Args:
        startend_row_indices: int32 ``[B, Hm, Sk, C]``; ``Hm`` is 1 (shared by all heads), the
            number of key/value heads or that of query heads; ``C`` is 1 or 2 when ``causal``
            else 2 or 4 (see the module docstring for what each entry means).
        causal: also hide key ``j`` from rows ``i < j - (Sk - Sq)`` (bottom-right aligned).
        seqlen_q: the query length ``Sq`` the indices were written for. Reading the mask with
            another ``Sq`` (:func:`flashmask.flashmask_attention`, :meth:`to_dense`, ...) raises
            ``ValueError``; :meth:`with_seqlen_q` reinterprets the same indices on purpose.
            ``None`` (the default for raw indices) accepts any ``Sq`` and means ``Sk`` where no
            call gives one.

    The mask costs ``4 * B * Hm * Sk * C`` bytes whatever the query length, against
    ``B * Hm * Sq * Sk`` bytes for a dense boolean mask.

    Example:
        >>> import flashmask
        >>> m = flashmask.masks.causal_document([3, 2], seqlen=5)
        >>> print(m.to_string())
        #....
        ##...
        ###..
        ...#.
        ...##
    """

    startend_row_indices: torch.Tensor
    causal: bool = False
    seqlen_q: int | None = None

    def __post_init__(self) -> None:
        sri = self.startend_row_indices
        if not isinstance(sri, torch.Tensor):
            raise TypeError(
                f"startend_row_indices must be a torch.Tensor, got {type(sri).__name__}"
            )
        if sri.dtype != torch.int32:
            raise TypeError(f"startend_row_indices.dtype must be torch.int32, but got {sri.dtype}")
        if sri.dim() != 4:
            raise ValueError(
                "startend_row_indices must have rank 4 [batch, mask_heads, seqlen_k, bounds], "
                f"but got shape {tuple(sri.shape)}"
            )
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        bounds = sri.shape[-1]
        if bounds not in _VALID_BOUNDS[self.causal]:
            allowed = " or ".join(map(str, _VALID_BOUNDS[self.causal]))
            raise ValueError(
                f"Invalid shape of startend_row_indices: when causal is {self.causal}, the last "
                f"dimension should be {allowed}, but got {bounds}"
            )
        if min(sri.shape[:3]) == 0:
            raise ValueError(
                f"startend_row_indices must have non-empty batch, head and seqlen_k dimensions, "
                f"but got shape {tuple(sri.shape)}"
            )
        if self.seqlen_q is not None:
            _check_positive_int("seqlen_q", self.seqlen_q)

    # ------------------------------------------------------------------ shape properties
    @property
    def batch_size(self) -> int:
        return self.startend_row_indices.shape[0]

    @property
    def num_heads(self) -> int:
        """``Hm``: 1 for a mask shared by all heads, else the number of key/value heads or of
        query heads."""
        return self.startend_row_indices.shape[1]

    @property
    def seqlen_k(self) -> int:
        return self.startend_row_indices.shape[2]

    @property
    def bounds(self) -> int:
        """``C``, the number of interval bounds stored per column (1, 2 or 4)."""
        return self.startend_row_indices.shape[3]

    @property
    def device(self) -> torch.device:
        return self.startend_row_indices.device

    @property
    def nbytes(self) -> int:
        """Bytes held by ``startend_row_indices``."""
        sri = self.startend_row_indices
        return sri.numel() * sri.element_size()

    def to(self, device: torch.device | str) -> FlashMask:
        """The same mask with its indices on ``device``."""
        return dataclasses.replace(self, startend_row_indices=self.startend_row_indices.to(device))

    def with_seqlen_q(self, seqlen_q: int | None) -> FlashMask:
        """The same indices read for ``seqlen_q`` queries (``None``: for any query length).

        This reinterprets the values, it does not convert them: a row bound ``v`` still means
        row ``v`` (clamped to ``[0, Sq]``), so a bound equal to the old ``Sq`` ("to the last
        row") now stops at that row. ``causal_document([3, 2, 3], seqlen=8).with_seqlen_q(16)``
        hides every key from rows 8 to 15, for instance. To get the same mask at another query
        length, build it for that length (the builders of :mod:`flashmask.masks` take
        ``seqlen_q`` where it has a meaning).
        """
        if seqlen_q is not None:
            seqlen_q = _check_positive_int("seqlen_q", seqlen_q)
        return dataclasses.replace(self, seqlen_q=seqlen_q)

    def last_rows(self, seqlen_q: int) -> FlashMask:
        """The mask of this mask's last ``seqlen_q`` query rows, over all its keys: what a
        decoding step (``seqlen_q = 1``) or a prefill chunk at the end of the keys attends with.

        Row ``i`` of the result is row ``i + Sq0 - seqlen_q`` of this mask, ``Sq0`` its own query
        length (``Sk`` when it has none; causal masks stay causal, bottom-right aligned): every
        row bound moves down by ``Sq0 - seqlen_q`` and is clamped to ``[0, seqlen_q]``. O(N), on
        the mask's device, no host synchronisation.

        Example:
            >>> from flashmask import masks
            >>> m = masks.sliding_window(8, 2, sink_tokens=1)
            >>> print(m.last_rows(1).to_string())
            #....###
        """
        seqlen_q = _check_positive_int("seqlen_q", seqlen_q)
        own = self._seqlen_q(None)
        if seqlen_q > own:
            raise ValueError(
                f"seqlen_q must be at most the mask's query length {own}, got {seqlen_q}"
            )
        # Clamp before shifting: every int32 is a valid bound, and int32 arithmetic wraps.
        sri = (self.startend_row_indices.clamp(0, own) - (own - seqlen_q)).clamp(0, seqlen_q)
        return FlashMask(sri, self.causal, seqlen_q)

    # ------------------------------------------------------------------ semantics
    def intervals(self, seqlen_q: int | None = None) -> ColumnIntervals:
        """The masked row intervals of every column, clamped to ``[0, seqlen_q]``.

        ``seqlen_q`` defaults to the mask's own ``seqlen_q`` (``Sk`` when it has none).
        """
        sq = self._seqlen_q(seqlen_q)
        sri = self.startend_row_indices.clamp(0, sq)
        full = torch.full_like(sri[..., 0], sq)
        zero = torch.zeros_like(sri[..., 0])
        c = self.bounds
        if self.causal:
            lte = sri[..., 1] if c == 2 else full
            return ColumnIntervals(sri[..., 0], lte, zero, zero)
        if c == 2:
            return ColumnIntervals(sri[..., 0], full, zero, sri[..., 1])
        return ColumnIntervals(sri[..., 0], sri[..., 1], sri[..., 2], sri[..., 3])

    def to_dense(self, seqlen_q: int | None = None) -> torch.Tensor:
        """Boolean ``[B, Hm, Sq, Sk]``, True where the query row may attend to the key column."""
        sq = self._seqlen_q(seqlen_q)
        return dense_rows(self.intervals(sq), self.causal, 0, sq, sq)

    @classmethod
    def from_dense(cls, bool_mask: torch.Tensor, causal: bool | None = None) -> FlashMask:
        """Convert a dense boolean mask (``True`` = may attend) to the smallest FlashMask form.

        Args:
            bool_mask: ``[Sq, Sk]`` or ``[B, Hm, Sq, Sk]`` boolean tensor.
            causal: ``None`` picks the causal form whenever the mask hides the causal triangle,
                ``True``/``False`` force the form.

        Returns:
            A mask with ``seqlen_q = Sq`` of ``bool_mask``.

        Raises:
            MaskNotRepresentableError: a key column's masked rows do not form the intervals the
                chosen form allows (the message names the first such column).
        """
        return _from_dense(bool_mask, causal)

    # ------------------------------------------------------------------ tiles
    def block_summary(self, block_n: int, seqlen_q: int | None = None) -> BlockSummary:
        """The 8 per-key-block min/max vectors of semantics §3.1 (pure torch, O(N))."""
        block_n = _check_positive_int("block_n", block_n)
        return summarize_blocks(self.intervals(seqlen_q), block_n)

    def classify_tiles(
        self, block_m: int, block_n: int, seqlen_q: int | None = None
    ) -> torch.Tensor:
        """Class of every ``block_m x block_n`` tile: int8 ``[B, Hm, ceil(Sq/bm), ceil(Sk/bn)]``.

        Values are :class:`TileClass` members. The classification is conservative: ``SKIP`` only
        when no pair of the tile is visible, ``FULL`` only when every in-bounds pair is visible.
        """
        block_m = _check_positive_int("block_m", block_m)
        sq = self._seqlen_q(seqlen_q)
        return classify_tiles(
            self.block_summary(block_n, sq), self.causal, sq, self.seqlen_k, block_m, block_n
        )

    def sparsity(
        self, block_m: int = 128, block_n: int = 128, seqlen_q: int | None = None
    ) -> float:
        """Fraction of ``block_m x block_n`` tiles that are fully masked (and skipped)."""
        classes = self.classify_tiles(block_m, block_n, seqlen_q)
        return (classes == TileClass.SKIP).float().mean().item()

    # ------------------------------------------------------------------ display
    def to_string(
        self, seqlen_q: int | None = None, *, batch: int = 0, head: int = 0, max_size: int = 48
    ) -> str:
        """Draw one (batch, head) slice: rows are queries, columns keys.

        Up to ``max_size`` rows and columns each element is drawn (``#`` visible, ``.`` masked);
        larger masks are drawn per tile (``█`` unmasked, ``░`` partial, space skipped) with tiles
        just large enough to fit.
        """
        sq = self._seqlen_q(seqlen_q)
        one = self.select(batch, head)
        if max(sq, self.seqlen_k) <= max_size:
            dense = one.to_dense(sq)[0, 0]
            return "\n".join("".join("#" if v else "." for v in row.tolist()) for row in dense)
        block = -(-max(sq, self.seqlen_k) // max_size)
        classes = one.classify_tiles(block, block, sq)[0, 0]
        glyph = {TileClass.SKIP: " ", TileClass.PARTIAL: "░", TileClass.FULL: "█"}
        lines = ["".join(glyph[v] for v in row.tolist()) for row in classes]
        return f"(tiles of {block}x{block}: █ unmasked, ░ partial, blank skipped)\n" + "\n".join(
            lines
        )

    def select(self, batch: int, head: int) -> FlashMask:
        """The ``[1, 1, Sk, C]`` mask of one (batch, head) slice (a view of the indices)."""
        sri = self.startend_row_indices[batch : batch + 1, head : head + 1]
        return dataclasses.replace(self, startend_row_indices=sri)

    def __and__(self, other: FlashMask) -> FlashMask:
        """Visible where both masks are visible: :func:`intersect` at the masks' ``seqlen_q``
        (``Sk`` when neither has one)."""
        if not isinstance(other, FlashMask):
            return NotImplemented
        return intersect(self, other)

    def __repr__(self) -> str:
        head = (
            f"FlashMask(batch={self.batch_size}, heads={self.num_heads}, "
            f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, bounds={self.bounds}, "
            f"causal={self.causal}, device={self.device.type})"
        )
        if max(self._seqlen_q(None), self.seqlen_k) <= 32:
            return head + "\n" + self.to_string()
        return head

    def _seqlen_q(self, seqlen_q: int | None) -> int:
        """The query length a call reads the mask with: ``seqlen_q``, checked against the one
        the mask was built for; by default the mask's own (``Sk`` when it has none)."""
        if seqlen_q is None:
            return self.seqlen_k if self.seqlen_q is None else self.seqlen_q
        seqlen_q = _check_positive_int("seqlen_q", seqlen_q)
        check_seqlen_q(self, seqlen_q)
        return seqlen_q


def check_seqlen_q(mask: FlashMask, seqlen_q: int) -> None:
    """Raise ``ValueError`` when ``mask`` was built for another query length than ``seqlen_q``."""
    if mask.seqlen_q is not None and mask.seqlen_q != seqlen_q:
        raise ValueError(
            f"the mask was built for seqlen_q={mask.seqlen_q} queries but is used with "
            f"seqlen_q={seqlen_q}: its row indices would mean another mask. Build the mask for "
            f"{seqlen_q} queries, or call mask.with_seqlen_q({seqlen_q}) to read the same "
            "indices at that length on purpose"
        )


# ---------------------------------------------------------------------- functions
def dense_rows(
    intervals: ColumnIntervals, causal: bool, row_start: int, row_end: int, seqlen_q: int
) -> torch.Tensor:
    """Visibility of query rows ``[row_start, row_end)``: bool ``[B, Hm, rows, Sk]``.

    This is the formal definition of semantics §1.3 evaluated literally.
    """
    lts, lte, uts, ute = (v.unsqueeze(-2) for v in intervals)
    sk = lts.shape[-1]
    rows = torch.arange(row_start, row_end, device=lts.device, dtype=torch.int32).view(-1, 1)
    masked = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
    if causal:
        cols = torch.arange(sk, device=lts.device, dtype=torch.int32).view(1, -1)
        masked = masked | (cols > rows + (sk - seqlen_q))
    return ~masked


def summarize_blocks(intervals: ColumnIntervals, block_n: int) -> BlockSummary:
    """Min and max of each bound over every ``block_n`` key columns (a partial last block
    reduces only its valid columns)."""
    sk = intervals.lts.shape[-1]
    n_blocks = -(-sk // block_n)
    pad = n_blocks * block_n - sk
    out = []
    for vec in intervals:
        if pad:
            # Replicating the last valid column leaves every min and max unchanged.
            vec = torch.cat([vec, vec[..., -1:].expand(*vec.shape[:-1], pad)], dim=-1)
        blocks = vec.reshape(*vec.shape[:-1], n_blocks, block_n)
        out += [blocks.amax(-1), blocks.amin(-1)]
    return BlockSummary(*out)


def classify_tiles(
    summary: BlockSummary,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    row_tiles: range | None = None,
) -> torch.Tensor:
    """Tile classes from a block summary (semantics §3.2 generalised to the 4 normalised bounds).

    Returns int8 ``[B, Hm, Tm, Tn]`` of :class:`TileClass` values, or only the query tiles
    ``row_tiles`` (a ``range`` of tile indices, step 1) in that order, to bound the memory.
    """
    device = summary.lts_max.device
    if row_tiles is None:
        row_tiles = range(-(-seqlen_q // block_m))
    tn = summary.lts_max.shape[-1]
    m_s = torch.arange(row_tiles.start, row_tiles.stop, device=device, dtype=torch.int32)
    m_s = m_s.view(-1, 1) * block_m
    m_e = torch.clamp(m_s + block_m, max=seqlen_q)
    s = BlockSummary(*(v.unsqueeze(-2) for v in summary))  # [B, Hm, 1, Tn]
    lt_all = (m_s >= s.lts_max) & (m_e <= s.lte_min)
    ut_all = (m_s >= s.uts_max) & (m_e <= s.ute_min)
    lt_some = (m_s < s.lte_max) & (m_e > s.lts_min)
    ut_some = (m_s < s.ute_max) & (m_e > s.uts_min)
    skip = lt_all | ut_all
    partial = lt_some | ut_some
    if causal:
        # Key column j is hidden from row i when j > i + offset (bottom-right alignment).
        offset = seqlen_k - seqlen_q
        n_s = torch.arange(tn, device=device, dtype=torch.int32).view(1, -1) * block_n
        n_e = torch.clamp(n_s + block_n, max=seqlen_k)
        skip = skip | (n_s > m_e - 1 + offset)
        partial = partial | (n_e - 1 > m_s + offset)
    classes = torch.where(partial, TileClass.PARTIAL, TileClass.FULL)
    classes = torch.where(skip, TileClass.SKIP, classes)
    return classes.to(torch.int8)


def as_flashmask(startend_row_indices: torch.Tensor | FlashMask, causal: bool = False) -> FlashMask:
    """Accept a :class:`FlashMask`, a 4-D index tensor, or a 3-D ``[B, Hm, Sk]`` tensor (C = 1)."""
    if isinstance(startend_row_indices, FlashMask):
        return startend_row_indices
    if isinstance(startend_row_indices, torch.Tensor) and startend_row_indices.dim() == 3:
        startend_row_indices = startend_row_indices.unsqueeze(-1)
    return FlashMask(startend_row_indices, causal)


def to_dense(
    startend_row_indices: torch.Tensor | FlashMask,
    *,
    causal: bool = False,
    seqlen_q: int | None = None,
) -> torch.Tensor:
    """Dense boolean ``[B, Hm, Sq, Sk]`` mask (``True`` = may attend); ``Sq`` defaults to ``Sk``."""
    return as_flashmask(startend_row_indices, causal).to_dense(seqlen_q)


def validate(
    mask: FlashMask | torch.Tensor,
    *,
    causal: bool = False,
    seqlen_q: int | None = None,
    raise_error: bool = True,
) -> list[str]:
    """Report values that are legal but look like mistakes.

    Every int32 value has a defined meaning, so the attention never checks these on its hot path.
    This function finds negative values, values above ``Sq``, reversed intervals (start > end)
    and, for ``C = 4``, an upper interval that is not above the lower one.

    Returns:
        The list of problems found (empty when the mask looks right).

    Raises:
        ValueError: when ``raise_error`` and a problem was found.
    """
    m = as_flashmask(mask, causal)
    sq = m._seqlen_q(seqlen_q)
    sri = m.startend_row_indices
    names = {
        (True, 1): ("LTS",),
        (True, 2): ("LTS", "LTE"),
        (False, 2): ("LTS", "UTE"),
        (False, 4): ("LTS", "LTE", "UTS", "UTE"),
    }[(m.causal, m.bounds)]
    problems: list[str] = []

    def first(where: torch.Tensor) -> str:
        b, h, j = (int(x) for x in where.nonzero()[0].tolist())
        return f"(batch {b}, head {h}, column {j})"

    for k, name in enumerate(names):
        col = sri[..., k]
        if (col < 0).any():
            problems.append(f"{name} has negative values, first at {first(col < 0)}")
        if (col > sq).any():
            problems.append(f"{name} has values above seqlen_q={sq}, first at {first(col > sq)}")
    pairs = [("LTS", "LTE"), ("UTS", "UTE")]
    for start, end in pairs:
        if start in names and end in names:
            s, e = sri[..., names.index(start)], sri[..., names.index(end)]
            if (s > e).any():
                problems.append(f"{start} > {end} (an empty interval), first at {first(s > e)}")
    if m.bounds == 4:
        lts, lte, uts, ute = (sri[..., k] for k in range(4))
        overlap = (uts < ute) & (lts < lte) & (ute > lts)
        if overlap.any():
            problems.append(
                f"the upper interval [UTS, UTE) is not above [LTS, LTE), first at {first(overlap)}"
            )
    if problems and raise_error:
        raise ValueError("startend_row_indices: " + "; ".join(problems))
    return problems


# ---------------------------------------------------------------------- intersection
def _broadcast_size(name: str, a: int, b: int) -> int:
    if a != b and 1 not in (a, b):
        raise ValueError(f"{name} must match or be 1 in one of the masks, got {a} and {b}")
    return max(a, b)


def _merge(
    starts: torch.Tensor, ends: torch.Tensor, seqlen_q: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge K intervals per column (last axis) into at most K disjoint ones, ascending.

    Returns ``(merged_starts, merged_ends, count)``; unused slots hold ``(Sq, Sq)``. Sorting by
    start, an interval opens a new run when it starts after every earlier interval has ended (a
    running maximum); runs are then reduced with two scatters, a fixed ~15 ops for any K.
    """
    empty = starts >= ends
    starts = torch.where(empty, seqlen_q, starts)
    ends = torch.where(empty, seqlen_q, ends)
    order = starts.argsort(dim=-1)
    starts, ends = starts.gather(-1, order), ends.gather(-1, order)
    k = starts.shape[-1]
    present = starts < seqlen_q
    reach = torch.where(present, ends, -1).cummax(-1).values
    before = torch.nn.functional.pad(reach[..., :-1], (1, 0), value=-1)
    opens = present & (starts > before)  # touching intervals ([a, b) then [b, c)) merge
    run = opens.to(torch.int64).cumsum(-1) - 1
    slot = torch.where(present, run, k)  # absent intervals go to a discarded extra slot
    shape = (*starts.shape[:-1], k + 1)
    out_s = torch.full(shape, seqlen_q, dtype=starts.dtype, device=starts.device)
    out_e = torch.full(shape, seqlen_q, dtype=ends.dtype, device=ends.device)
    out_s = out_s.scatter_reduce(-1, slot, starts, "amin", include_self=True)
    out_e = out_e.scatter_reduce(
        -1, slot, torch.where(present, ends, -1), "amax", include_self=False
    )
    count = opens.sum(-1)
    return out_s[..., :k], out_e[..., :k], count


def _first_bad(bad: torch.Tensor) -> str:
    b, h, j = (int(x) for x in bad.nonzero()[0].tolist())
    return f"column {j} (batch {b}, head {h})"


def _intersection_seqlen_q(first: FlashMask, second: FlashMask, seqlen_q: int | None) -> int:
    """The query length both masks are read with: ``seqlen_q``, else the one they carry, else
    ``Sk``; ``ValueError`` when they disagree."""
    carried = {m.seqlen_q for m in (first, second)} - {None}
    if len(carried) > 1:
        raise ValueError(
            f"first and second were built for different query lengths, seqlen_q="
            f"{first.seqlen_q} and {second.seqlen_q}; build them for one (or use "
            "with_seqlen_q to read one at the other's length on purpose)"
        )
    if seqlen_q is not None:
        seqlen_q = _check_positive_int("seqlen_q", seqlen_q)
        for m in (first, second):
            check_seqlen_q(m, seqlen_q)
        return seqlen_q
    return carried.pop() if carried else first.seqlen_k


def intersect(first: FlashMask, second: FlashMask, *, seqlen_q: int | None = None) -> FlashMask:
    """The mask that lets a query attend to a key only where both masks do (``first & second``).

    The masked rows of every key column are the union of the two masks' masked intervals (plus
    the causal triangle if either is causal), merged per column in O(N) and written back in the
    smallest form that holds them.

    Args:
        first: a mask over ``Sk`` keys.
        second: a mask over the same ``Sk``; batch and head dimensions broadcast against
            ``first``'s (each 1 or equal).
        seqlen_q: the query length both masks are read with; by default the ``seqlen_q`` the
            masks carry (``Sk`` when neither has one). It must agree with the masks' own. Causal
            alignment is bottom-right as everywhere else.

    Returns:
        A :class:`FlashMask` for ``seqlen_q`` queries in the smallest form (causal when either
        input is causal and the rest fits one interval per column, else non-causal C=2 or C=4).

    Raises:
        MaskNotRepresentableError: some column's masked rows need more intervals than any form
            holds (the message names the first such column).
    """
    for name, m in (("first", first), ("second", second)):
        if not isinstance(m, FlashMask):
            raise TypeError(f"{name} must be a FlashMask, got {type(m).__name__}")
    if first.seqlen_k != second.seqlen_k:
        raise ValueError(
            f"first and second must share seqlen_k, got {first.seqlen_k} and {second.seqlen_k}"
        )
    if first.device != second.device:
        raise ValueError(
            f"first and second must be on one device, got {first.device} and {second.device}"
        )
    sk = first.seqlen_k
    sq = _intersection_seqlen_q(first, second, seqlen_q)
    batch = _broadcast_size("batch size", first.batch_size, second.batch_size)
    heads = _broadcast_size("mask heads", first.num_heads, second.num_heads)
    shape = (batch, heads, sk)
    starts, ends = [], []
    for m in (first, second):
        iv = m.intervals(sq)
        starts += [iv.lts.expand(shape), iv.uts.expand(shape)]
        ends += [iv.lte.expand(shape), iv.ute.expand(shape)]
    causal = first.causal or second.causal
    cols = torch.arange(sk, device=first.device, dtype=torch.int32)
    causal_end = (cols - (sk - sq)).clamp(0, sq).expand(shape)
    if causal:
        starts.append(torch.zeros_like(causal_end))
        ends.append(causal_end)
    ms, me, count = _merge(torch.stack(starts, -1), torch.stack(ends, -1), sq)

    def build(values: list[torch.Tensor], is_causal: bool) -> FlashMask:
        sri = torch.stack(values, dim=-1).to(torch.int32).contiguous()
        return FlashMask(sri, is_causal, sq)

    if causal:
        # Rows above the diagonal are hidden by the causal flag: clip them off every interval.
        cs = torch.maximum(ms, causal_end.unsqueeze(-1))
        ce = torch.where(me > cs, me, cs)
        rest = (ce > cs).sum(-1)
        if bool((rest <= 1).all()):
            has = ce > cs
            lts = torch.where(has, cs, sq).amin(-1)
            lte = torch.where(has, ce, sq).amin(-1)
            lte = torch.where(rest == 0, sq, lte)
            if bool((lte == sq).all()):
                return build([lts], True)
            return build([lts, lte], True)
    if not bool((count <= 2).all()):
        raise MaskNotRepresentableError(
            f"the intersection cannot be represented: {_first_bad(count > 2)} would need "
            "more than two masked row intervals"
        )
    first_s, first_e, second_s, second_e = ms[..., 0], me[..., 0], ms[..., 1], me[..., 1]
    # C=2 holds a prefix [0, UTE) and a suffix [LTS, Sq).
    prefix = torch.where(count >= 1, first_s == 0, True)
    one_suffix = (count == 1) & (first_e == sq)
    two_ok = (count == 2) & prefix & (second_e == sq)
    fits_c2 = (count == 0) | (count == 1) & (prefix | one_suffix) | two_ok
    if bool(fits_c2.all()):
        ute = torch.where((count >= 1) & (first_s == 0) & ~one_suffix, first_e, 0)
        ute = torch.where((count == 1) & one_suffix & (first_s == 0), sq, ute)
        lts = torch.where(count == 2, second_s, torch.where(one_suffix, first_s, sq))
        return build([lts, ute], False)
    # C=4: the upper interval is the first run, the lower one the second (or the only one).
    lts = torch.where(count == 2, second_s, first_s)
    lte = torch.where(count == 2, second_e, first_e)
    uts = torch.where(count == 2, first_s, 0)
    ute = torch.where(count == 2, first_e, 0)
    return build([lts, lte, uts, ute], False)


# ---------------------------------------------------------------------- from_dense
def _runs(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of True along the last axis: (count, start of the first, end of the last)."""
    n = masked.shape[-1]
    prev = torch.nn.functional.pad(masked[..., :-1], (1, 0), value=False)
    count = (masked & ~prev).sum(-1)
    first = torch.where(masked.any(-1), masked.int().argmax(-1), n)
    last_end = n - masked.flip(-1).int().argmax(-1)
    last_end = torch.where(masked.any(-1), last_end, n)
    return count, first, last_end


def _describe_column(masked_col: torch.Tensor) -> str:
    spans: list[list[int]] = []
    for r in masked_col.nonzero().flatten().tolist():
        if spans and spans[-1][1] == r:
            spans[-1][1] = r + 1
        else:
            spans.append([r, r + 1])
    return ", ".join(f"[{a}, {b})" for a, b in spans) or "none"


def _not_representable(bad: torch.Tensor, masked_cols: torch.Tensor, form: str) -> None:
    b, h, j = (int(x) for x in bad.nonzero()[0].tolist())
    raise MaskNotRepresentableError(
        f"bool_mask column {j} (batch {b}, head {h}) cannot be represented as {form}: its masked "
        f"query rows are {_describe_column(masked_cols[b, h, j])}"
    )


def _from_dense(bool_mask: torch.Tensor, causal: bool | None) -> FlashMask:
    if not isinstance(bool_mask, torch.Tensor):
        raise TypeError(f"bool_mask must be a torch.Tensor, got {type(bool_mask).__name__}")
    if bool_mask.dtype != torch.bool:
        raise TypeError(f"bool_mask.dtype must be torch.bool, but got {bool_mask.dtype}")
    if bool_mask.dim() == 2:
        bool_mask = bool_mask[None, None]
    if bool_mask.dim() != 4:
        raise ValueError(
            f"bool_mask must be [Sq, Sk] or [B, Hm, Sq, Sk], but got shape {tuple(bool_mask.shape)}"
        )
    if bool_mask.numel() == 0:
        raise ValueError(f"bool_mask must not be empty, but got shape {tuple(bool_mask.shape)}")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be None or a bool, got {type(causal).__name__}")
    sq, sk = bool_mask.shape[-2:]
    masked = ~bool_mask.transpose(-1, -2)  # [B, Hm, Sk, Sq]: masked rows of every column
    rows = torch.arange(sq, device=masked.device)
    causal_start = (torch.arange(sk, device=masked.device) - (sk - sq)).clamp(0, sq)
    hidden_by_causal = rows.view(1, -1) < causal_start.view(-1, 1)  # [Sk, Sq]

    def build(values: list[torch.Tensor], is_causal: bool) -> FlashMask:
        sri = torch.stack(values, dim=-1).to(torch.int32).contiguous()
        return FlashMask(sri, is_causal, sq)

    if causal is not False:
        outside = masked & ~hidden_by_causal
        count, first, last_end = _runs(outside)
        causal_ok = (masked | ~hidden_by_causal).all(-1) & (count <= 1)
        if bool(causal_ok.all()):
            lts = torch.where(count == 0, sq, first)
            lte = torch.where(count == 0, sq, last_end)
            if bool((lte == sq).all()):
                return build([lts], True)
            return build([lts, lte], True)
        if causal:
            _not_representable(~causal_ok, masked, "a causal mask with one interval per column")
    count, first, last_end = _runs(masked)
    visible_count, visible_first, visible_end = _runs(~masked)
    if bool((visible_count <= 1).all()):
        # Visible rows [a, b) form one run: masked = [0, a) ∪ [b, Sq).
        ute = torch.where(visible_count == 0, 0, visible_first)
        lts = torch.where(visible_count == 0, 0, visible_end)
        return build([lts, ute], False)
    if not bool((count <= 2).all()):
        _not_representable(count > 2, masked, "two intervals per column")
    # Two runs: the upper one (smaller rows) is UT, the lower one is LT; a single run is LT.
    second_start = sq - _first_run_end(masked.flip(-1))  # start of the last run
    lts = torch.where(count == 0, sq, second_start)
    lte = torch.where(count == 0, sq, last_end)
    uts = torch.where(count == 2, first, 0)
    ute_first_run_end = _first_run_end(masked)
    ute = torch.where(count == 2, ute_first_run_end, 0)
    return build([lts, lte, uts, ute], False)


def _first_run_end(masked: torch.Tensor) -> torch.Tensor:
    """End (exclusive) of the first run of True along the last axis (n where there is none)."""
    n = masked.shape[-1]
    started = masked.cummax(-1).values
    after = started & ~masked  # rows after the first run began that are not masked
    return torch.where(after.any(-1), after.int().argmax(-1), n)
