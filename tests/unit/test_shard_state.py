from datetime import datetime, timedelta, timezone

import pytest

from casque.engine.messages import Position, StoredMessage
from casque.engine.keylocks import KeyLocks, key_hash
from casque.engine.entries import AckStart, Handout
from casque.engine.heaps import HEAP_FLOOR, HEAP_SLACK, pruned
from casque.engine.shard_state import ShardState
from casque.errors import StaleReceipt
from casque.specs import RetryPolicy

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
WALL = T0.timestamp()
# Long enough that no deadline comes due during a test: nothing pops a stale deadline entry
# then, so only compaction can keep the heap small.
LONG_VISIBILITY = 12 * 3600.0


def msgs(batch: int, n: int, expires: datetime | None = None) -> list[StoredMessage]:
    return [
        StoredMessage(Position(0, batch, s), f"{batch}-{s}", T0, b"x", expires_at=expires) for s in range(n)
    ]


def sized_msgs(batch: int, sizes: list[int]) -> list[StoredMessage]:
    return [StoredMessage(Position(0, batch, s), f"{batch}-{s}", T0, b"x" * size) for s, size in enumerate(sizes)]


def ids(handouts: list[Handout]) -> list[str]:
    return [h.entry.message.message_id for h in handouts]


def heap_bound(state: ShardState) -> int:
    # Compaction keeps the heap collecting stale entries (here the deadlines) within
    # HEAP_FLOOR + HEAP_SLACK x its live entries; the other heaps hold about one entry per
    # loaded message. The constant covers what a take pushes after the last compaction.
    return HEAP_FLOOR + HEAP_SLACK * state.loaded_messages + 16


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


def test_a_retry_policy_spaces_out_deliveries_after_nacks_without_delay_and_expiries() -> None:
    policy = RetryPolicy(minimum_backoff_seconds=10, maximum_backoff_seconds=25)
    state = ShardState(shard=0, offset=1, backoff=policy.backoff)
    state.add_batch(1, msgs(1, 2))
    (first,) = state.take(1, now=0, visibility=30, expired_ttl=WALL)
    # Delivered once: 10 s; the message behind it is not held back meanwhile.
    state.nack(first.entry.message.position, first.nonce, delay=None, now=0)
    assert state.next_due() == 10
    (other,) = state.take(1, now=1, visibility=30, expired_ttl=WALL)
    assert state.ack(other.entry.message.position, other.nonce)
    assert state.take(1, now=9.9, visibility=30, expired_ttl=WALL) == []
    (second,) = state.take(1, now=10, visibility=30, expired_ttl=WALL)
    # Delivered twice: 20 s, counted from when the visibility ran out (40), not when a take noticed.
    assert state.take(1, now=59, visibility=30, expired_ttl=WALL) == []
    assert state.counters.expired_visibility == 1 and state.next_due() == 60
    (third,) = state.take(1, now=60, visibility=30, expired_ttl=WALL)
    # Three times: 40 s, capped at 25; a nack's own delay wins over the policy, 0 included.
    state.nack(third.entry.message.position, third.nonce, delay=None, now=61)
    assert state.take(1, now=85.9, visibility=30, expired_ttl=WALL) == []
    (fourth,) = state.take(1, now=86, visibility=30, expired_ttl=WALL)
    state.nack(fourth.entry.message.position, fourth.nonce, delay=0, now=87)
    assert ids(state.take(1, now=87, visibility=30, expired_ttl=WALL)) == ["1-0"]
    assert second.entry.deliveries == 5


def test_a_deadline_and_its_backoff_both_past_release_the_message_at_once() -> None:
    """An app that stops asking for a while finds the message ready, not waiting out a backoff
    counted from the moment it asked again."""
    state = ShardState(shard=0, offset=1, backoff=RetryPolicy(minimum_backoff_seconds=5).backoff)
    state.add_batch(1, msgs(1, 1))
    state.take(1, now=0, visibility=10, expired_ttl=WALL)
    assert ids(state.take(1, now=100, visibility=10, expired_ttl=WALL)) == ["1-0"]


def test_backoff_doubles_per_delivery_up_to_the_maximum() -> None:
    policy = RetryPolicy(minimum_backoff_seconds=10, maximum_backoff_seconds=600)
    assert [policy.backoff(n) for n in range(9)] == [0, 10, 20, 40, 80, 160, 320, 600, 600]
    assert policy.backoff(10**9) == 600  # no overflow however often a message came back
    assert RetryPolicy(minimum_backoff_seconds=0).backoff(5) == 0
    with pytest.raises(ValueError, match="maximumBackoff must not be shorter"):
        RetryPolicy.model_validate({"minimumBackoff": "1m", "maximumBackoff": "30s"})


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


# --- memory: what a shard holds is bounded by what is live, not by its history -------------


def test_acked_messages_behind_an_unfinished_one_are_freed() -> None:
    state = ShardState(shard=0, offset=1)
    for batch in (1, 2, 3):
        state.add_batch(batch, sized_msgs(batch, [seq + 1 for seq in range(100)]))
    handouts = state.take(300, now=0, visibility=30, expired_ttl=WALL)
    unfinished = handouts[37]
    for h in handouts:
        if h is not unfinished:
            state.ack(h.entry.message.position, h.nonce)
    assert state.advance_offset() == 1  # the unfinished message holds the offset back
    # Complete batches are gone; the incomplete one keeps its one live entry, not 99 dead ones.
    assert list(state.batches) == [1]
    assert list(state.batches[1].entries) == [37]
    assert state.loaded_messages == 1
    assert state.loaded_bytes == unfinished.entry.message.size == 38
    state.ack(unfinished.entry.message.position, unfinished.nonce)
    assert state.advance_offset() == 4
    assert state.batches == {}


def test_a_stuck_message_costs_a_constant_however_many_batches_complete_behind_it() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, sized_msgs(1, [1]))
    (stuck,) = state.take(1, now=0, visibility=30, expired_ttl=WALL)
    for batch in range(2, 100_002):  # 100,000 batches behind it, each delivered and acked
        state.add_batch(batch, sized_msgs(batch, [1]))
        (h,) = state.take(1, now=0, visibility=30, expired_ttl=WALL)
        state.ack(h.entry.message.position, h.nonce)
    assert state.advance_offset() == 1
    assert list(state.batches) == [1] and state.loaded_messages == 1
    # A resent ack of a message of a complete batch is still answered as done.
    assert state.start_ack(Position(0, 50_000, 0), 1) is AckStart.DONE
    state.ack(stuck.entry.message.position, stuck.nonce)
    assert state.advance_offset() == 100_002 and state.batches == {}


def test_a_poison_message_nacked_over_and_over_does_not_grow_the_heaps() -> None:
    # A worker fails the first message at once, every time, while it acks the backlog behind it.
    state = ShardState(shard=0, offset=1)
    poison = Position(0, 1, 0)
    next_batch = 1
    for cycle in range(10_000):
        now = float(cycle)
        if state.loaded_messages < 50:
            state.add_batch(next_batch, msgs(next_batch, 100))
            next_batch += 1
        poisoned, backlog = state.take(2, now=now, visibility=LONG_VISIBILITY, expired_ttl=WALL)
        # Compaction must keep the live ready entry: the poison comes back first every time.
        assert poisoned.entry.message.position == poison
        state.nack(poison, poisoned.nonce, delay=0, now=now)
        state.ack(backlog.entry.message.position, backlog.nonce)
        state.advance_offset()
        assert state.heap_entries <= heap_bound(state), cycle
    assert state.batches[1].entries[0].deliveries == 10_000
    assert state.loaded_messages < 150


def test_extending_one_message_over_and_over_does_not_grow_the_heaps() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 10))
    (h,) = state.take(1, now=0, visibility=LONG_VISIBILITY, expired_ttl=WALL)
    position = h.entry.message.position
    deadline = 0.0
    for second in range(1, 10_001):
        deadline = state.extend(position, h.nonce, visibility=LONG_VISIBILITY, now=float(second))
        assert state.heap_entries <= heap_bound(state), second
    # Compaction kept the live deadline: the message stays invisible until the last extension ends.
    assert "1-0" not in ids(state.take(10, now=deadline - 1, visibility=LONG_VISIBILITY, expired_ttl=WALL))
    (again,) = state.take(10, now=deadline, visibility=LONG_VISIBILITY, expired_ttl=WALL)
    assert ids([again]) == ["1-0"] and again.redelivery


def test_loaded_bytes_counts_every_loaded_message_not_done() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, sized_msgs(1, [10, 20, 30]), done={1})  # 1-1 was acked by an earlier holder
    state.add_batch(2, sized_msgs(2, [5, 7]))
    assert state.loaded_bytes == 10 + 30 + 5 + 7
    acked_early, nacked, acked_late = state.take(3, now=0, visibility=30, expired_ttl=WALL)
    # In flight, delayed by a nack, or ready: all still held, all counted.
    state.nack(nacked.entry.message.position, nacked.nonce, delay=60, now=0)
    assert state.loaded_bytes == 10 + 30 + 5 + 7
    state.ack(acked_early.entry.message.position, acked_early.nonce)
    assert state.loaded_bytes == 30 + 5 + 7
    state.ack(acked_late.entry.message.position, acked_late.nonce)
    assert state.loaded_bytes == 30 + 7
    rest = state.take(10, now=61, visibility=30, expired_ttl=WALL)
    assert ids(rest) == ["1-2", "2-1"]
    for h in rest:
        state.ack(h.entry.message.position, h.nonce)
    assert state.advance_offset() == 3
    assert state.loaded_bytes == 0 and state.loaded_messages == 0


def test_loaded_bytes_drops_messages_expired_dead_lettered_or_skipped() -> None:
    state = ShardState(shard=0, offset=1)
    expiring = StoredMessage(Position(0, 1, 0), "1-0", T0, b"x" * 3, expires_at=T0 + timedelta(seconds=5))
    state.add_batch(1, [expiring, StoredMessage(Position(0, 1, 1), "1-1", T0, b"x" * 11)])
    state.add_batch(2, sized_msgs(2, [13]))
    assert state.loaded_bytes == 3 + 11 + 13
    (undeliverable,) = state.take(1, now=0, visibility=30, expired_ttl=WALL + 10)  # 1-0 expires on the way
    assert ids([undeliverable]) == ["1-1"] and state.loaded_bytes == 11 + 13
    state.dead_letter(undeliverable.entry.message.position)
    assert state.loaded_bytes == 13
    state.skip_to(3)  # batch 2 expired from the log before it was consumed
    assert state.loaded_bytes == 0 and state.loaded_messages == 0


# --- the ack state machine: in flight -> acking -> done | back in flight ----------------------
def test_an_ack_being_recorded_keeps_the_message_in_flight_and_a_resend_joins_it() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 2))
    first, _ = state.take(10, now=0, visibility=10, expired_ttl=WALL)
    position = first.entry.message.position
    assert state.start_ack(position, first.nonce) is AckStart.STARTED
    assert state.start_ack(position, first.nonce) is AckStart.PENDING  # a resend waits for the same write
    assert state.in_flight == 2
    assert state.take(10, now=11, visibility=10, expired_ttl=WALL)[0].entry.message.message_id == "1-1"
    assert state.in_flight == 1 + 1  # the acking one is never redelivered by its visibility ending
    with pytest.raises(StaleReceipt, match="being recorded"):
        state.nack(position, first.nonce, delay=0, now=11)
    assert state.finish_ack(position, first.nonce) is True
    assert state.start_ack(position, first.nonce) is AckStart.DONE
    assert state.in_flight == 1


def test_a_failed_ack_leaves_the_delivery_as_it_was_until_its_visibility_ends() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1))
    (handout,) = state.take(1, now=0, visibility=10, expired_ttl=WALL)
    position = handout.entry.message.position
    assert state.start_ack(position, handout.nonce) is AckStart.STARTED
    assert state.take(1, now=11, visibility=10, expired_ttl=WALL) == []  # its deadline surfaced while acking
    state.abort_ack(position, handout.nonce)
    assert state.advance_offset() == 1 and state.in_flight == 1
    # The receipt is current again: a resend starts a new ack ...
    assert state.start_ack(position, handout.nonce) is AckStart.STARTED
    state.abort_ack(position, handout.nonce)
    # ... and the visibility, which ended meanwhile, still ends: the message comes again.
    (again,) = state.take(1, now=12, visibility=10, expired_ttl=WALL)
    assert again.entry.deliveries == 2
    with pytest.raises(StaleReceipt):
        state.start_ack(position, handout.nonce)


def test_an_ordered_key_moves_on_only_when_the_ack_is_durable() -> None:
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [StoredMessage(Position(0, 1, s), f"1-{s}", T0, b"x", key="k") for s in range(2)])
    (first,) = state.take(10, now=0, visibility=30, expired_ttl=WALL)
    position = first.entry.message.position
    state.start_ack(position, first.nonce)
    assert state.take(10, now=0, visibility=30, expired_ttl=WALL) == []
    state.abort_ack(position, first.nonce)
    assert state.take(10, now=0, visibility=30, expired_ttl=WALL) == []
    state.start_ack(position, first.nonce)
    state.finish_ack(position, first.nonce)
    assert ids(state.take(10, now=0, visibility=30, expired_ttl=WALL)) == ["1-1"]


def test_messages_held_back_behind_another_members_range_are_counted_and_those_behind_our_own_are_not() -> None:
    """Shared delivery claims more while few messages are ready: those that wait on another
    member's range are not ready, and a take says how many it held back so; those that wait
    for an earlier message held here come as the app acks, and claiming more for them let one
    member take a whole backlog of a few keys."""
    others: list[frozenset[int]] = [frozenset({key_hash("elsewhere")})]
    state = ShardState(shard=0, offset=1, locks=KeyLocks(foreign=lambda batch: others))
    state.add_batch(1, [StoredMessage(Position(0, 1, s), f"1-{s}", T0, b"x", key="k") for s in range(3)]
                    + [StoredMessage(Position(0, 1, 3), "1-3", T0, b"x", key="elsewhere")])
    (first,) = state.take(10, now=0, visibility=30, expired_ttl=WALL)
    assert state.held_by_others == 1
    others.clear()
    assert state.ack(first.entry.message.position, first.nonce)
    assert ids(state.take(10, now=0, visibility=30, expired_ttl=WALL)) == ["1-1", "1-3"]
    assert state.held_by_others == 0


# --- waits recorded in NACK rows, and dead letters on time ----------------------------------------
def test_a_message_loaded_as_waiting_is_ready_at_its_time_with_no_backoff_on_top() -> None:
    state = ShardState(shard=0, offset=1, backoff=lambda deliveries: 100.0)
    state.add_batch(1, msgs(1, 2), deliveries={0: 1}, waiting_until={0: 10.0})
    assert ids(state.take(10, 0, 30, WALL)) == ["1-1"]
    assert state.next_due() is not None and state.next_due() <= 10.0
    assert state.take(10, 9.9, 30, WALL) == []
    again = state.take(10, 10.0, 30, WALL)
    assert ids(again) == ["1-0"] and again[0].entry.deliveries == 2


def test_a_nack_says_when_it_makes_the_message_visible_before_it_changes_anything() -> None:
    state = ShardState(shard=0, offset=1, backoff=lambda deliveries: 4.0)
    state.add_batch(1, msgs(1, 1))
    (h,) = state.take(1, 0, 30, WALL)
    p = h.entry.message.position
    assert state.nack_due(p, h.nonce, 8.0, now=1.0)[1] == 9.0
    assert state.nack_due(p, h.nonce, None, now=1.0)[1] == 5.0  # the retry policy's backoff
    assert state.in_flight == 1  # still in flight: the caller records the nack first
    state.nack(p, h.nonce, 8.0, now=1.0)
    assert state.in_flight == 0 and state.next_due() == 9.0
    with pytest.raises(StaleReceipt):
        state.nack_due(p, h.nonce, 8.0, now=2.0)


def test_a_nacked_message_over_max_deliveries_is_dead_lettered_when_its_delay_ends() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 2))
    first, second = state.take(2, 0, 30, WALL)
    state.nack(first.entry.message.position, first.nonce, 8.0, now=1.0)
    state.nack(second.entry.message.position, second.nonce, 8.0, now=1.0)
    assert state.settle(8.9, max_deliveries=1) == ([], [])
    dead, waits = state.settle(9.0, max_deliveries=1)
    assert sorted(ids(dead)) == ["1-0", "1-1"] and all(h.dead for h in dead) and waits == []
    assert state.settle(9.5, max_deliveries=1) == ([], [])  # handed out once
    assert state.dead_letter(dead[0].entry.message.position) is not None


def test_an_expired_delivery_over_max_deliveries_is_dead_lettered_without_waiting_its_backoff() -> None:
    state = ShardState(shard=0, offset=1, backoff=lambda deliveries: 50.0)
    state.add_batch(1, msgs(1, 1))
    state.take(1, 0, visibility=5, expired_ttl=WALL)
    dead, waits = state.settle(5.0, max_deliveries=1)
    assert ids(dead) == ["1-0"] and waits == []


def test_under_max_deliveries_an_expired_delivery_backs_off_and_its_wait_is_handed_out_to_be_recorded() -> None:
    state = ShardState(shard=0, offset=1, backoff=lambda deliveries: 50.0)
    state.add_batch(1, msgs(1, 1))
    state.take(1, 0, visibility=5, expired_ttl=WALL)
    dead, waits = state.settle(5.0, max_deliveries=3)
    assert dead == [] and [(e.message.message_id, e.deadline) for e in waits] == [("1-0", 55.0)]
    assert state.settle(6.0, max_deliveries=3) == ([], [])  # each wait is handed out once


def test_without_a_dead_letter_queue_nothing_is_dead_lettered_on_time() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1))
    (h,) = state.take(1, 0, 30, WALL)
    state.nack(h.entry.message.position, h.nonce, 1.0, now=0.0)
    assert state.settle(2.0, max_deliveries=0) == ([], [])
    assert ids(state.take(1, 2.0, 30, WALL)) == ["1-0"]


def test_a_message_loaded_over_max_deliveries_with_its_wait_over_is_dead_lettered_by_the_timer() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 2), deliveries={0: 3})
    dead, _ = state.settle(0.0, max_deliveries=3)
    assert ids(dead) == ["1-0"]
    assert state.waits_for_dead_letters(3) is False


def test_a_waiting_message_at_max_deliveries_keeps_its_holder() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 1), deliveries={0: 3}, waiting_until={0: 10.0})
    assert state.waits_for_dead_letters(3) and not state.waits_for_dead_letters(4)
    assert not state.waits_for_dead_letters(0)


def test_the_first_dead_letter_due_is_the_earliest_end_of_a_last_wait_or_visibility() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, msgs(1, 4), deliveries={0: 3, 1: 2, 2: 2}, waiting_until={0: 40.0, 2: 5.0})
    assert state.dead_letter_due(3, now=0.0) == 40.0  # seqs 1 and 2 are under the limit, 3 never delivered
    (h,) = state.take(1, 1.0, 30, WALL)  # seq 1's third delivery: when its visibility ends
    assert h.entry.message.position.seq == 1 and state.dead_letter_due(3, now=1.0) == 31.0
    state.nack(h.entry.message.position, h.nonce, None, now=2.0)  # ready at once: due now
    assert state.dead_letter_due(3, now=2.5) == 2.5
    assert state.dead_letter_due(0, now=2.5) is None  # no dead-letter queue


def test_a_heap_is_pruned_of_stale_and_repeated_items_only_once_they_dominate() -> None:
    small = [(1, 0), (1, 0), (2, 0)]
    assert pruned(small, live=0, keep=lambda item: False) is small  # under HEAP_FLOOR: left alone
    big = [(b, 0) for b in range(HEAP_FLOOR + 10)] + [(3, 0)]
    kept = pruned(big, live=1, keep=lambda item: item[0] < 5)
    assert sorted(kept) == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)] and kept[0] == (0, 0)
