from datetime import datetime, timedelta, timezone

import pytest

from casque.engine.messages import Position, StoredMessage
from casque.engine.shard_state import ShardState
from casque.errors import StaleReceipt

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
WALL = T0.timestamp()


def msgs(batch: int, n: int, expires: datetime | None = None) -> list[StoredMessage]:
    return [
        StoredMessage(Position(0, batch, s), f"{batch}-{s}", T0, b"x", expires_at=expires) for s in range(n)
    ]


def ids(handouts: list) -> list[str]:
    return [h.entry.message.message_id for h in handouts]


def test_delivers_in_log_order_and_offset_moves_over_complete_batches() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 2))
    state.add_batch(2, msgs(2, 1))
    got = state.take(10, now=0, visibility=30, expired_ttl=WALL)
    assert ids(got) == ["1-0", "1-1", "2-0"]
    state.ack(got[2].entry.message.position, got[2].nonce)
    assert state.advance_offset() == 1  # batch 1 is not complete yet
    state.ack(got[0].entry.message.position, got[0].nonce)
    state.ack(got[1].entry.message.position, got[1].nonce)
    assert state.advance_offset() == 3
    assert state.batches == {}


def test_acked_before_are_skipped() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 3), done={0, 2})
    assert ids(state.take(10, 0, 30, WALL)) == ["1-1"]


def test_expired_visibility_redelivers_with_a_new_receipt_and_old_one_is_stale() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1))
    (first,) = state.take(1, now=0, visibility=10, expired_ttl=WALL)
    assert state.take(1, now=5, visibility=10, expired_ttl=WALL) == []
    (second,) = state.take(1, now=11, visibility=10, expired_ttl=WALL)
    assert second.redelivery and second.entry.deliveries == 2
    assert second.nonce != first.nonce
    with pytest.raises(StaleReceipt):
        state.ack(first.entry.message.position, first.nonce)
    assert state.ack(second.entry.message.position, second.nonce) is True
    assert state.ack(second.entry.message.position, second.nonce) is False  # idempotent


def test_extend_keeps_the_message_invisible() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1))
    (h,) = state.take(1, now=0, visibility=10, expired_ttl=WALL)
    state.extend(h.entry.message.position, h.nonce, visibility=100, now=9)
    assert state.take(1, now=50, visibility=10, expired_ttl=WALL) == []
    assert len(state.take(1, now=110, visibility=10, expired_ttl=WALL)) == 1


def test_nack_with_delay_and_no_head_of_line_blocking() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 3))
    first = state.take(1, now=0, visibility=1000, expired_ttl=WALL)[0]
    state.nack(first.entry.message.position, first.nonce, delay=60, now=0)
    # The delayed message does not hold back the ones behind it.
    assert ids(state.take(10, now=1, visibility=1000, expired_ttl=WALL)) == ["1-1", "1-2"]
    assert state.next_due() == 60
    assert state.take(10, now=59, visibility=30, expired_ttl=WALL) == []
    assert ids(state.take(10, now=61, visibility=30, expired_ttl=WALL)) == ["1-0"]


def test_ephemeral_message_past_ttl_is_never_delivered_and_counts_as_done() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1, expires=T0 + timedelta(seconds=5)))
    assert state.take(1, now=0, visibility=30, expired_ttl=WALL + 10) == []
    assert state.counters.expired_ttl == 1
    assert state.advance_offset() == 2


def test_ack_below_offset_is_idempotent_and_unknown_is_stale() -> None:
    state = ShardState(shard=0, offset=5)
    assert state.ack(Position(0, 3, 0), 123) is False
    with pytest.raises(StaleReceipt):
        state.ack(Position(0, 9, 0), 123)
