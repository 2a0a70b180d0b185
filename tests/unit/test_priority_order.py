"""Which shard a member looks at first: higher priority levels first, fair within a level."""

from __future__ import annotations

from casque.specs import PRIORITY_STRIDE, by_priority


def test_higher_levels_come_first_and_each_turn_starts_a_level_at_another_shard() -> None:
    low, high = [0, 1, 2], [PRIORITY_STRIDE, PRIORITY_STRIDE + 1]
    shards = low + high
    assert by_priority(shards, 0) == high + low
    assert by_priority(shards, 1) == [high[1], high[0], 1, 2, 0]
    firsts = {by_priority(shards, turn)[len(high)] for turn in range(len(low))}
    assert firsts == set(low), "every shard of the lower level is first in its turn"
