"""Ordered keys: a keyed message waits for the one before it, here and in other members' ranges."""

from __future__ import annotations

from datetime import datetime, timezone

from casque.engine.keylocks import PRUNE_FLOOR, KeyLocks, key_hash
from casque.engine.messages import Position, StoredMessage
from casque.engine.shard_state import ShardState


def message(batch: int, seq: int, key: str | None) -> StoredMessage:
    return StoredMessage(position=Position(0, batch, seq), message_id=f"{batch}-{seq}",
                         published_at=datetime.now(timezone.utc), payload=b"x", key=key)


def taken_ids(state: ShardState, limit: int = 10, now: float = 0.0) -> list[str]:
    return [h.entry.message.message_id for h in state.take(limit, now, 30.0, 0.0)]


def test_the_next_message_of_a_key_waits_until_the_one_before_it_is_acked() -> None:
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [message(1, 0, "a"), message(1, 1, "b"), message(1, 2, "a"), message(1, 3, None)])
    first = state.take(10, 0.0, 30.0, 0.0)
    assert [h.entry.message.message_id for h in first] == ["1-0", "1-1", "1-3"]
    assert taken_ids(state) == []  # 1-2 waits for 1-0
    state.ack(Position(0, 1, 0), first[0].nonce)
    assert taken_ids(state) == ["1-2"]


def test_a_nacked_message_keeps_its_place_and_the_next_of_its_key_waits() -> None:
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [message(1, 0, "a"), message(1, 1, "a")])
    (handout,) = state.take(10, 0.0, 30.0, 0.0)
    state.nack(Position(0, 1, 0), handout.nonce, delay=0.0, now=0.0)
    assert taken_ids(state) == ["1-0"]  # redelivered first; 1-1 still waits


def test_an_expired_visibility_does_not_let_the_next_message_through() -> None:
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [message(1, 0, "a"), message(1, 1, "a")])
    assert taken_ids(state) == ["1-0"]
    assert taken_ids(state, now=31.0) == ["1-0"]


def test_a_dead_lettered_message_frees_its_key() -> None:
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [message(1, 0, "a"), message(1, 1, "a")])
    assert taken_ids(state) == ["1-0"]
    state.dead_letter(Position(0, 1, 0))
    assert taken_ids(state) == ["1-1"]


def test_ranges_of_one_member_share_the_lock_of_a_key() -> None:
    locks = KeyLocks()
    low, high = ShardState(shard=0, offset=1, locks=locks), ShardState(shard=0, offset=2, locks=locks)
    low.add_batch(1, [message(1, 0, "a")])
    high.add_batch(2, [message(2, 0, "a"), message(2, 1, "b")])
    assert taken_ids(high) == ["2-1"]
    (handout,) = low.take(10, 0.0, 30.0, 0.0)
    low.ack(Position(0, 1, 0), handout.nonce)
    assert taken_ids(high) == ["2-0"]


def test_a_key_in_another_members_lower_range_waits_and_an_unknown_range_holds_every_key() -> None:
    foreign: list[frozenset[int]] | None = [frozenset({key_hash("a")})]
    locks = KeyLocks(foreign=lambda batch: foreign if batch > 1 else [])
    state = ShardState(shard=0, offset=2, locks=locks)
    state.add_batch(2, [message(2, 0, "a"), message(2, 1, "b"), message(2, 2, None)])
    assert taken_ids(state) == ["2-1", "2-2"]
    foreign = None
    assert taken_ids(state) == []
    foreign = []
    assert taken_ids(state) == ["2-0"]


def test_messages_behind_a_first_one_that_waits_on_another_member_count_as_held_by_others() -> None:
    """Counted as ready, a backlog of one key behind a message held back by another member's
    range kept the member from claiming that range once it reached CLAIM_LOW_WATER."""
    foreign: list[frozenset[int]] = [frozenset({key_hash("a")})]
    locks = KeyLocks(foreign=lambda batch: foreign)
    state = ShardState(shard=0, offset=2, locks=locks)
    state.add_batch(2, [message(2, seq, "a") for seq in range(5)] + [message(2, 5, "b")])
    assert taken_ids(state) == ["2-5"]
    assert state.held_by_others == 5  # 2-0 held elsewhere, and the four behind it
    assert locks.waits_elsewhere("a") and not locks.waits_elsewhere("b") and not locks.waits_elsewhere(None)
    foreign = []
    (first,) = state.take(10, 0.0, 30.0, 0.0)
    assert first.entry.message.message_id == "2-0" and not locks.waits_elsewhere("a")
    assert taken_ids(state) == []
    assert state.held_by_others == 0  # behind this member's own message in flight: not counted


def test_a_dropped_range_releases_its_keys() -> None:
    locks = KeyLocks()
    dropped, kept = ShardState(shard=0, offset=1, locks=locks), ShardState(shard=0, offset=2, locks=locks)
    dropped.add_batch(1, [message(1, 0, "a")])
    kept.add_batch(2, [message(2, 0, "a")])
    assert taken_ids(kept) == []
    dropped.release_keys()
    assert taken_ids(kept) == ["2-0"]


def test_a_message_still_in_flight_at_a_departed_member_holds_its_key_until_its_recorded_deadline() -> None:
    # A range taken over from a member whose session ended: 1-0 was delivered there, and its
    # app may still work on it until the deadline recorded with the delivery.
    state = ShardState(shard=0, offset=1, locks=KeyLocks())
    state.add_batch(1, [message(1, 0, "a"), message(1, 1, "a"), message(1, 2, "b")], deliveries={0: 1},
                    in_flight_until={0: 20.0})
    assert state.in_flight == 1
    assert taken_ids(state, now=0.0) == ["1-2"]  # 1-0 is someone else's; 1-1 waits behind it
    assert taken_ids(state, now=19.9) == []
    redelivered = state.take(10, 20.0, 30.0, 0.0)
    assert [(h.entry.message.message_id, h.entry.deliveries) for h in redelivered] == [("1-0", 2)]
    state.ack(Position(0, 1, 0), redelivered[0].nonce)
    assert taken_ids(state, now=20.0) == ["1-1"]


def test_messages_a_filter_drops_behind_a_key_held_open_cost_nothing_once_done() -> None:
    """A filter drops every message of a key but the first, which the app holds and never
    acks. The dropped ones are done: what the key's lock keeps of them must not grow with
    their number (the prefetch budget counts loaded messages, and these are not loaded any
    more, so nothing else would stop the reader)."""
    state = ShardState(shard=0, offset=1, locks=KeyLocks(), matches=lambda m: m.payload == b"wanted")
    kept = StoredMessage(position=Position(0, 1, 0), message_id="1-0", published_at=datetime.now(timezone.utc),
                         payload=b"wanted", key="k")
    state.add_batch(1, [kept])
    assert taken_ids(state) == ["1-0"]  # in the app's hands from now on
    for batch in range(2, 2 + 500):
        state.add_batch(batch, [message(batch, seq, "k") for seq in range(100)])
        assert taken_ids(state) == []  # 100 dropped: none matches the filter
    assert state.counters.filtered == 50_000 and state.loaded_messages == 1
    # Before: 100,000 (each dropped message in the heap and in the finished set).
    assert state.locks is not None and state.locks.positions_kept <= 3 * PRUNE_FLOOR, state.locks.positions_kept


def test_a_range_released_and_taken_back_twice_while_its_key_waits_here_does_not_stop_the_key() -> None:
    """One member: `low` holds a's first message in flight; `high`, a later range, holds a's
    next one. `high` is released (its app stopped asking) and taken over again by the same
    member, twice, each time a new state over the member's one KeyLocks of the shard. Before,
    the locks kept each released position in a set and each load's in a heap: two releases of
    one position counted once, a copy stayed open for good, and key a stopped at that member (a
    test node's autoscaled group, members releasing and retaking their own ranges)."""
    locks = KeyLocks()
    low = ShardState(shard=0, offset=1, locks=locks)
    low.add_batch(1, [message(1, 0, "a")])
    (first,) = low.take(10, 0.0, 30.0, 0.0)
    for _ in range(2):
        released = ShardState(shard=0, offset=2, locks=locks)
        released.add_batch(2, [message(2, 0, "a")])
        assert taken_ids(released) == []  # behind 1-0
        released.release_keys()
    high = ShardState(shard=0, offset=2, locks=locks)
    high.add_batch(2, [message(2, 0, "a")])
    low.ack(Position(0, 1, 0), first.nonce)
    (second,) = high.take(10, 0.0, 30.0, 0.0)
    assert second.entry.message.message_id == "2-0"
    high.ack(Position(0, 2, 0), second.nonce)
    later = ShardState(shard=0, offset=3, locks=locks)
    later.add_batch(3, [message(3, 0, "a")])
    (third,) = later.take(10, 0.0, 30.0, 0.0)
    assert third.entry.message.message_id == "3-0"
    later.ack(Position(0, 3, 0), third.nonce)
    assert locks.keys_held == 0


def test_a_dropped_states_late_ack_does_not_free_the_position_its_successor_holds() -> None:
    """A range dropped here (taken over) and loaded again by this member: an ack that reaches
    the dropped state after its keys were released must not free the key for the new load's
    copy of the same message, which is still open."""
    locks = KeyLocks()
    dropped = ShardState(shard=0, offset=1, locks=locks)
    dropped.add_batch(1, [message(1, 0, "a"), message(1, 1, "a")])
    (handout,) = dropped.take(10, 0.0, 30.0, 0.0)
    dropped.release_keys()
    again = ShardState(shard=0, offset=1, locks=locks)
    again.add_batch(1, [message(1, 0, "a"), message(1, 1, "a")])
    assert taken_ids(again) == ["1-0"]
    dropped.ack(Position(0, 1, 0), handout.nonce)  # late, on the state that lost the range
    assert taken_ids(again) == []  # 1-1 still waits for the new load's 1-0
