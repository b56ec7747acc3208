"""The converting Gluon backward's schedule (``flashmask.kernels.dq_conversion``): which slot
is which work item or conversion unit, and how far each unit trails its group's items.

The kernel decodes slots with its own copy of :func:`conversion_slot` (Gluon has no CPU
interpreter); the H200 check runs that copy (``benchmarks/gpu_check.py --gluon-bwd
PERSISTENT=2``). Here the specification itself.
"""

from __future__ import annotations

import pytest

from flashmask.kernels.dq_conversion import (
    CONVERT_ROWS,
    conversion_lag,
    conversion_slot,
    units_per_group,
)


def _schedule(items_per_group: int, units: int, groups: int, lag: int) -> list[tuple]:
    total = groups * (items_per_group + units)
    return [conversion_slot(s, items_per_group, units, groups, lag) for s in range(total)]


# (items per group, units per group, groups, lag): the 8K bench (64 key tiles, 4 units, 64
# groups of batch 4 x 16 heads, 132 programs), 32K (one batch), GQA, and lags at and beyond the
# number of groups.
CASES = [(64, 4, 64, 5), (256, 16, 16, 2), (64, 16, 8, 3), (3, 2, 4, 4), (3, 2, 4, 9), (1, 1, 1, 1)]


@pytest.mark.parametrize(("items_per_group", "units", "groups", "lag"), CASES)
def test_every_item_in_natural_order_and_every_unit_once(items_per_group, units, groups, lag):
    slots = _schedule(items_per_group, units, groups, lag)
    items = [first for is_item, first, _ in slots if is_item]
    assert items == list(range(items_per_group * groups))
    converted = sorted((group, unit) for is_item, group, unit in slots if not is_item)
    assert converted == [(g, u) for g in range(groups) for u in range(units)]


@pytest.mark.parametrize(("items_per_group", "units", "groups", "lag"), CASES)
def test_a_groups_units_come_lag_groups_of_items_after_its_last_item(
    items_per_group, units, groups, lag
):
    """Between a group's last item and each of its units lie the items of the ``lag`` groups
    after it (all of the later groups' where fewer remain), so a program taking the unit took
    it about ``lag * items_per_group`` slots after that last item was taken."""
    slots = _schedule(items_per_group, units, groups, lag)
    last_item = {}
    for s, (is_item, first, _) in enumerate(slots):
        if is_item:
            last_item[first // items_per_group] = s
    for s, (is_item, group, _) in enumerate(slots):
        if not is_item:
            between = sum(1 for is_i, _, _ in slots[last_item[group] + 1 : s] if is_i)
            assert between == min(lag, groups - 1 - group) * items_per_group, (s, group)


def test_lag_holds_twice_the_programs_items():
    assert conversion_lag(64, 132) == 5  # 8K: 320 items of 5 groups >= 264
    assert conversion_lag(256, 132) == 2  # 32K
    assert conversion_lag(1024, 132) == 1  # 128K: one group holds more
    assert conversion_lag(2, 3) == 3
    with pytest.raises(ValueError, match="programs"):
        conversion_lag(64, 0)


def test_units_cover_each_query_head_in_convert_rows_chunks():
    assert CONVERT_ROWS == 2048
    assert units_per_group(1, 8192) == 4
    assert units_per_group(4, 8192) == 16  # GQA: a group's four query heads
    assert units_per_group(1, 2176) == 2  # the last unit partial
    assert units_per_group(2, 128) == 2


def test_slot_outside_the_schedule_is_refused_by_name():
    with pytest.raises(ValueError, match="s must be in"):
        conversion_slot(12, 2, 1, 4, 1)
    with pytest.raises(ValueError, match="s must be in"):
        conversion_slot(-1, 2, 1, 4, 1)


def test_lag_per_program_sets_how_many_items_per_program_it_holds():
    assert conversion_lag(64, 132, per_program=6) == 13  # 832 items >= 792
    assert conversion_lag(64, 132, per_program=1) == 3
    with pytest.raises(ValueError, match="per_program"):
        conversion_lag(64, 132, per_program=0)
