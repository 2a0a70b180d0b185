"""The history checker of the consumer-group fault tests finds each kind of violation."""

from __future__ import annotations

from tests.fixtures.history import (
    Ack,
    Delivery,
    History,
    Seek,
    check,
    delivered_behind_acked_successors,
    keys_in_flight_twice,
    redelivered_within_visibility,
)


def _history() -> History:
    history = History(published={"m1": 1.0, "m2": 1.0})
    history.deliveries += [Delivery("m1", "r1", "a", 1, 2.0, 2.1), Delivery("m2", "r2", "a", 1, 2.0, 2.1)]
    history.acks += [Ack("m1", "r1", "acked", 3.0, 3.1), Ack("m2", "r2", "acked", 3.0, 3.1)]
    return history


def test_a_clean_history_passes() -> None:
    verdict = check(_history())
    assert verdict.ok, str(verdict)


def test_a_message_never_delivered_is_lost_and_one_never_published_is_a_phantom() -> None:
    history = _history()
    history.published["m3"] = 1.0
    history.deliveries.append(Delivery("ghost", "r9", "b", 1, 2.0, 2.1))
    verdict = check(history, require_all_acked=False)
    assert verdict.lost == {"m3"} and verdict.phantoms == {"ghost"} and not verdict.ok


def test_a_message_never_acked_is_unfinished() -> None:
    history = _history()
    history.acks.pop()
    assert check(history).unfinished == {"m2"}
    assert check(history, require_all_acked=False).ok


def test_a_delivery_asked_for_after_an_ack_was_answered_is_a_violation_unless_a_seek_came_between() -> None:
    history = _history()
    history.deliveries.append(Delivery("m1", "r3", "b", 2, 4.0, 4.1))
    assert len(check(history).redelivered_after_ack) == 1
    history.seeks.append(Seek(3.5, 3.6))
    assert check(history).ok


def test_an_ack_answered_already_acked_promises_as_much_as_acked() -> None:
    # A resent ack answered `already_acked` says an earlier ack is durable: nothing may come again.
    history = _history()
    history.acks.append(Ack("m1", "r1", "already_acked", 3.5, 3.6))
    history.acks[0] = Ack("m1", "r1", "backend_unavailable", 3.0, 3.1)
    history.deliveries.append(Delivery("m1", "r3", "b", 2, 4.0, 4.1))
    assert len(check(history).redelivered_after_ack) == 1


def test_overlapping_calls_are_given_the_benefit_of_the_doubt() -> None:
    history = _history()
    # Sent before the ack was answered: it may have been served before the ack took effect.
    history.deliveries.append(Delivery("m1", "r3", "b", 2, 3.05, 3.2))
    assert check(history).ok


def test_an_ack_of_a_superseded_delivery_must_not_be_answered_acked() -> None:
    history = History(published={"m1": 1.0})
    history.deliveries += [Delivery("m1", "old", "a", 1, 2.0, 2.1), Delivery("m1", "new", "b", 2, 5.0, 5.1)]
    history.acks += [Ack("m1", "old", "acked", 6.0, 6.1)]
    assert len(check(history).stale_acks_accepted) == 1
    history.acks[0] = Ack("m1", "old", "lease_lost", 6.0, 6.1)
    history.acks.append(Ack("m1", "new", "acked", 6.0, 6.1))
    assert check(history).ok


def test_an_ack_with_an_unknown_outcome_may_have_finished_the_message_a_stale_one_did_not() -> None:
    history = _history()
    history.acks[1] = Ack("m2", "r2", "backend_unavailable", 3.0, 3.1)
    assert check(history).ok
    history.acks[1] = Ack("m2", "r2", "stale_receipt", 3.0, 3.1)
    assert check(history).unfinished == {"m2"}


def test_a_seek_before_the_acked_delivery_allows_no_redelivery_after_the_ack() -> None:
    history = _history()
    history.seeks.append(Seek(1.5, 1.6))  # wholly before m1's delivery at 2.0
    history.deliveries.append(Delivery("m1", "r3", "b", 1, 4.0, 4.1))
    assert len(check(history).redelivered_after_ack) == 1


def test_an_ordered_key_whose_earlier_message_comes_again_after_a_later_one_was_acked() -> None:
    history = _history()
    keys = {"m1": ("k", 0), "m2": ("k", 1)}
    assert delivered_behind_acked_successors(history, keys) == []
    history.deliveries.append(Delivery("m1", "r3", "b", 2, 4.0, 4.1))
    ((ack, again),) = delivered_behind_acked_successors(history, keys)
    assert ack.message_id == "m2" and again.receipt == "r3"


def test_a_redelivery_inside_the_earlier_deliverys_visibility_is_found() -> None:
    history = History(published={"m1": 1.0})
    history.deliveries += [Delivery("m1", "r1", "a", 1, 2.0, 2.1), Delivery("m1", "r2", "b", 2, 8.0, 8.1)]
    assert len(redelivered_within_visibility(history, 30.0)) == 1
    assert redelivered_within_visibility(history, 5.0) == []


def test_a_key_handed_out_before_its_earlier_delivery_was_acked_is_in_flight_twice() -> None:
    history = History(published={"m1": 1.0, "m2": 1.0})
    history.deliveries += [Delivery("m1", "r1", "a", 1, 2.0, 2.1), Delivery("m2", "r2", "b", 1, 3.0, 3.1)]
    history.acks.append(Ack("m1", "r1", "acked", 4.0, 4.1))
    assert len(keys_in_flight_twice(history, {"m1": "k", "m2": "k"})) == 1
    history.acks[0] = Ack("m1", "r1", "acked", 2.5, 2.6)
    assert keys_in_flight_twice(history, {"m1": "k", "m2": "k"}) == []
