"""How an ack call makes its acks durable (casque.engine.consumer.durability_plan)."""

from __future__ import annotations

from typing import Any, cast

from casque.engine.acks import ACK, AckEvent
from casque.engine.consumer import durability_plan
from casque.schema import bucket_of


class Source:
    """A shard whose batches below `offset` are complete."""

    def __init__(self, shard: int, offset: int, proven: bool = False) -> None:
        self.shard = shard
        self.offset = offset
        self.proven = proven

    def completes(self, batch: int) -> bool:
        return batch < self.offset

    def proves_rows_locally(self) -> bool:
        return self.proven


def acked(index: int, source: Source, batch: int, seq: int = 0) -> Any:
    return (index, cast(Any, source), AckEvent(0, source.shard, batch, seq, outcome=ACK))


def test_acks_of_open_batches_go_to_rows() -> None:
    shard = Source(0, offset=5)
    rows, covering = durability_plan([acked(0, shard, 5), acked(1, shard, 6)])
    assert [i for i, _, _ in rows] == [0, 1]
    assert covering == {}


def test_acks_of_complete_batches_wait_for_the_offset_when_no_row_is_written() -> None:
    shard = Source(0, offset=5)
    rows, covering = durability_plan([acked(0, shard, 3), acked(1, shard, 4)])
    assert rows == []
    assert [i for i, _, _ in covering[cast(Any, shard)]] == [0, 1]


def test_acks_of_complete_batches_ride_in_a_row_written_to_their_partition_anyway() -> None:
    shard = Source(0, offset=5)
    rows, covering = durability_plan([acked(0, shard, 3), acked(1, shard, 5)])
    assert sorted(i for i, _, _ in rows) == [0, 1]
    assert covering == {}


def test_only_the_same_partition_counts() -> None:
    # Another shard's row, or a row in another bucket of the same shard, is another partition.
    first, second = Source(0, offset=70), Source(1, offset=3)
    assert bucket_of(10) != bucket_of(69)
    rows, covering = durability_plan([acked(0, first, 10), acked(1, first, 69), acked(2, first, 70),
                                      acked(3, second, 1)])
    assert sorted(i for i, _, _ in rows) == [1, 2]
    assert [i for i, _, _ in covering[cast(Any, first)]] == [0]
    assert [i for i, _, _ in covering[cast(Any, second)]] == [3]


def test_only_the_same_source_counts() -> None:
    # Two claimed ranges of one shard share a partition; a complete range's acks wait for
    # its completion, which deletes the claim a lease check after a row would look for.
    complete, open_range = Source(0, offset=5), Source(0, offset=5)
    rows, covering = durability_plan([acked(0, complete, 4), acked(1, open_range, 5)])
    assert [i for i, _, _ in rows] == [1]
    assert [i for i, _, _ in covering[cast(Any, complete)]] == [0]


def test_a_shard_whose_lease_is_proven_locally_writes_rows_for_complete_batches_too() -> None:
    # Its lease check costs no round trip: one row is quicker than waiting for an offset write.
    proven, unproven = Source(0, offset=5, proven=True), Source(1, offset=5)
    rows, covering = durability_plan([acked(0, proven, 3), acked(1, unproven, 3)])
    assert [i for i, _, _ in rows] == [0]
    assert list(covering) == [cast(Any, unproven)]
