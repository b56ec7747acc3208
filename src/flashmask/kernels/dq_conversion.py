"""The schedule of a Gluon backward that converts dQ in the kernel (``gluon_bwd.PERSISTENT = 2``).

The Gluon backward adds each tile's dQ into an fp32 accumulator with TMA reduce-adds, and the
accumulator was converted to the inputs' dtype by a kernel of its own after the backward:
~94 us per 32K tokens at head dim 128 (``benchmarks/results/kernel_times_s19.log``), 3-6% of an
8K or 32K call on the sparse masks, reading the accumulator back from HBM. The converting
backward does the conversion itself, as work of its own beside the work items: a persistent
program takes *slots* from one counter, each either a work item (a key tile of a kv head and
batch) or a *conversion unit* (``CONVERT_ROWS`` rows of one query head's dQ), and converts a unit
once every item that adds into it has counted its completed adds.

The slots put every work item in the natural order (key tile fastest, then kv head, then
batch), so the items of one kv head and batch (a *group*, whose query heads' dQ they alone add
to) are consecutive; a group's units follow its last item after ``lag`` more groups of items
(:func:`conversion_lag`: enough for about two items per program, so that a unit rarely waits
and the accumulator's rows are still in L2). No unit can wait forever: a slot is only ever held
by a running program (every program takes even its first slot from the counter), a unit waits
only for items of earlier slots, and an item waits for nothing a later slot holds; so the
waiting unit of the earliest slot waits only for items that are running or finish.

This module is the schedule's specification in plain Python (the kernel decodes slots with its
own copy, ``gluon_bwd._slot``, which the H200 check runs).
"""

from __future__ import annotations

# Rows of one query head's dQ per conversion unit: 4 units per head at 8K (1 MB of fp32 each at
# head dim 128), so that the units spread over programs without a tail of their own.
CONVERT_ROWS = 2048


def conversion_lag(items_per_group: int, programs: int, per_program: int = 2) -> int:
    """Groups of items between a group's last item and its first conversion unit: the fewest
    that hold at least ``per_program`` items for each of the ``programs`` (at least one;
    ``gluon_bwd.CONVERT_LAG_PROGRAMS`` sets ``per_program``)."""
    if items_per_group < 1 or programs < 1 or per_program < 1:
        raise ValueError(
            "items_per_group, programs and per_program must be >= 1, got "
            f"{items_per_group}, {programs}, {per_program}"
        )
    return max(1, -(-per_program * programs // items_per_group))


def units_per_group(heads_per_kv: int, seqlen_q: int) -> int:
    """Conversion units of one group: ``CONVERT_ROWS`` rows at a time of each of its
    ``heads_per_kv`` query heads."""
    return heads_per_kv * -(-seqlen_q // CONVERT_ROWS)


def conversion_slot(
    s: int, items_per_group: int, units: int, groups: int, lag: int
) -> tuple[bool, int, int]:
    """Slot ``s`` of ``groups * (items_per_group + units)``: ``(True, item, -1)`` for work item
    ``item`` (its index in the natural order) or ``(False, group, unit)`` for conversion unit
    ``unit`` of ``group``. The first ``lag`` groups' items come alone; then each next group's
    items, followed by the units of the group ``lag`` before it; then the last ``lag`` groups'
    units."""
    if not 0 <= s < groups * (items_per_group + units):
        raise ValueError(f"s must be in [0, {groups * (items_per_group + units)}), got {s}")
    head = items_per_group * min(lag, groups)
    middle = max(groups - lag, 0)
    block = items_per_group + units
    if s < head:
        return True, s, -1
    if s < head + middle * block:
        k, r = divmod(s - head, block)
        if r < items_per_group:
            return True, head + k * items_per_group + r, -1
        c = k * units + r - items_per_group
    else:
        c = middle * units + s - head - middle * block
    return False, c // units, c % units
