"""The checkpoint rows' max register (write timestamps ordered as (epoch, batch)), the grouped
writer, and the formats of stored states."""

from __future__ import annotations

import asyncio
import json

import pytest

from casque.engine.checkpoints import HEAD, CheckpointWriter, Position, register_timestamp
from casque.errors import NewerFormat
from casque.specs import STATE_FORMAT, QueueState, SubscriberState


def test_a_later_epoch_orders_above_any_batch_of_an_earlier_one() -> None:
    assert register_timestamp(1, 1) > register_timestamp(0, (1 << 40) - 1)
    assert register_timestamp(3, 10) > register_timestamp(3, 9)
    assert register_timestamp(0, 0) == 0


def test_the_register_orders_as_positions_do() -> None:
    positions = [Position(5, 2), Position(900, 1), Position(6, 2), Position(1, 0)]
    by_timestamp = sorted(positions, key=lambda p: register_timestamp(p.epoch, p.batch))
    assert by_timestamp == sorted(positions, key=lambda p: p.order)


@pytest.mark.parametrize(("epoch", "batch"), [(0, -1), (-1, 0), (0, 1 << 40), (1 << 22, 0)])
def test_a_position_outside_the_register_is_refused(epoch: int, batch: int) -> None:
    with pytest.raises(ValueError, match="out of the checkpoint's range"):
        register_timestamp(epoch, batch)


class RecordingCheckpoints:
    """The writes a CheckpointWriter sends, failing the first `failures` of them."""

    def __init__(self, failures: int = 0) -> None:
        self.written: list[tuple[str, int, Position]] = []
        self.failures = failures

    def prepare(self) -> bool:
        return True

    async def write(self, owner: str, shard: int, position: Position) -> None:
        if self.failures:
            self.failures -= 1
            raise TimeoutError("the write timed out")
        self.written.append((owner, shard, position))


async def test_a_flush_writes_the_highest_position_noted_per_owner_and_shard_once() -> None:
    sink = RecordingCheckpoints()
    writer = CheckpointWriter(sink, interval=3600)  # type: ignore[arg-type]
    writer.note("billing", 0, Position(5))
    writer.note("billing", 0, Position(9))
    writer.note("billing", 0, Position(7))  # a late report of an earlier offset
    writer.note("billing", 1, Position(2, epoch=1))
    writer.note("billing", 1, Position(900, epoch=0))  # before the seek: lower, whatever its batch
    await writer.flush()
    assert sorted(sink.written) == [("billing", 0, Position(9)), ("billing", 1, Position(2, epoch=1))]
    await writer.flush()
    assert len(sink.written) == 2  # nothing noted since: nothing written again


async def test_a_write_that_fails_is_kept_and_written_by_the_next_flush() -> None:
    sink = RecordingCheckpoints(failures=1)
    writer = CheckpointWriter(sink, interval=3600)  # type: ignore[arg-type]
    writer.note(HEAD, 3, Position(40, totals=(400, 4096)))
    await writer.flush()
    assert sink.written == [] and writer.failures == 1
    writer.note(HEAD, 3, Position(39))  # older than the one kept: the kept one stays
    await writer.flush()
    assert sink.written == [(HEAD, 3, Position(40, totals=(400, 4096)))]


async def test_noted_positions_are_written_in_the_background_after_the_interval() -> None:
    sink = RecordingCheckpoints()
    writer = CheckpointWriter(sink, interval=0.01)  # type: ignore[arg-type]
    writer.note("billing", 0, Position(3))
    while not sink.written:
        await asyncio.sleep(0.01)
    assert sink.written == [("billing", 0, Position(3))]


@pytest.mark.parametrize("kind", [QueueState, SubscriberState])
def test_a_state_of_a_later_format_is_refused_and_one_without_a_format_is_the_first(
    kind: type[QueueState] | type[SubscriberState],
) -> None:
    spec = ({"shards": 1, "retention": "1h"} if kind is QueueState else {"queue": "orders"})
    written = {"spec": spec, "created_at": "2026-12-01T00:00:00Z"}
    assert kind.model_validate_json(json.dumps(written)).format == STATE_FORMAT == 1
    with pytest.raises(NewerFormat, match=f"format {STATE_FORMAT + 1}; this version of casque reads up to"):
        kind.model_validate_json(json.dumps({**written, "format": STATE_FORMAT + 1}))


async def test_checkpoints_whose_keyspace_is_gone_are_dropped_not_tried_for_ever() -> None:
    from cassandra import InvalidRequest

    sink = RecordingCheckpoints()
    writer = CheckpointWriter(sink, interval=3600)  # type: ignore[arg-type]

    async def gone(owner: str, shard: int, position: Position) -> None:
        raise InvalidRequest('Error from server: code=2200 [Invalid query] message="keyspace t_1 does not exist"')

    sink.write = gone  # type: ignore[method-assign]
    writer.note("billing", 0, Position(5))
    await writer.flush()
    assert writer._pending == {}  # dropped, not kept for another try
    missing_table = InvalidRequest('Error from server: code=2200 [Invalid query] message="unconfigured table checkpoints"')

    async def no_table(owner: str, shard: int, position: Position) -> None:
        raise missing_table

    sink.write = no_table  # type: ignore[method-assign]
    writer.note("billing", 0, Position(6))
    await writer.flush()
    assert list(writer._pending) == [("billing", 0)]  # kept: the operator makes the table at its next apply
