"""A subscriber's state of a message, folded from its ack rows (casque.engine.history)."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from casque.engine.acks import ACK, DEAD, NACK, BatchMarks
from casque.engine.deadletters import MESSAGE_ID, dead_letter_client_id
from casque.engine.delayed import moved_client_id
from casque.engine.history import Origin, origin_of, read_marks, subscriber_state
from casque.engine.messages import Position
from casque.engine.pipelines import output_client_id
from casque.schema import QueueRef

SEQ = 3
NOW = 1_000_000


class Row(NamedTuple):
    outcome: str | None = None
    seqs: frozenset[int] | None = None
    deliveries: dict[int, int] | None = None
    visible_until: dict[int, int] | None = None


def delivered(count: int, until: int) -> Row:
    return Row(deliveries={SEQ: count}, visible_until={SEQ: until})


def nacked(count: int, until: int) -> Row:
    return Row(outcome=NACK, deliveries={SEQ: count}, visible_until={SEQ: until})


def state_of(*rows: Row, batch: int = 10, offset: int = 5, matches: bool = True, expired: bool = False,
             addressed: bool = True) -> tuple[str, int | None]:
    return subscriber_state(read_marks(list(rows), SEQ), batch, offset, matches, expired, addressed, NOW)


@pytest.mark.parametrize("rows, expected", [
    ((), ("pending", None)),
    ((delivered(1, NOW + 500),), ("in_flight", NOW + 500)),
    ((delivered(1, NOW - 1),), ("pending", None)),  # its visibility ran out: visible again
    ((delivered(1, NOW + 500), nacked(1, NOW + 9000)), ("nacked", NOW + 9000)),
    ((delivered(1, NOW + 500), nacked(1, NOW - 1)), ("pending", None)),
    # a nack of an earlier delivery says nothing of the current one, in whatever order the rows come
    ((nacked(1, NOW + 9000), delivered(2, NOW + 500), delivered(1, NOW + 100)), ("in_flight", NOW + 500)),
    # an extension (a row with a deadline and no count) lengthens the current delivery
    ((delivered(2, NOW - 1), Row(visible_until={SEQ: NOW + 700})), ("in_flight", NOW + 700)),
    ((delivered(2, NOW + 5), Row(outcome=ACK, seqs=frozenset({SEQ}))), ("acked", None)),
    ((delivered(3, NOW + 5), Row(outcome=DEAD, seqs=frozenset({SEQ}))), ("dead_lettered", None)),
    # another message's rows of the same batch do not count
    ((Row(outcome=ACK, seqs=frozenset({SEQ + 1})), Row(deliveries={SEQ + 1: 4}, visible_until={SEQ + 1: NOW + 5})),
     ("pending", None)),
])
def test_rows_fold_into_the_state(rows: tuple[Row, ...], expected: tuple[str, int | None]) -> None:
    assert state_of(*rows) == expected


def test_delivery_counts_are_the_highest_recorded() -> None:
    marks = read_marks([delivered(2, NOW), delivered(4, NOW + 1), nacked(4, NOW + 2), delivered(3, NOW)], SEQ)
    assert (marks.deliveries, marks.nacked) == (4, 4)


def test_what_the_subscriber_did_outranks_where_its_offset_is() -> None:
    acked = Row(outcome=ACK, seqs=frozenset({SEQ}))
    assert state_of(acked, batch=4, offset=5) == ("acked", None)
    assert state_of(batch=4, offset=5) == ("passed", None)
    assert state_of(batch=4, offset=5, matches=False) == ("filtered", None)


def test_a_message_for_another_subscriber_is_not_addressed_whatever_the_rows_say() -> None:
    assert state_of(delivered(1, NOW + 5), addressed=False) == ("not_addressed", None)


def test_an_expired_message_never_delivered_again_is_expired() -> None:
    assert state_of(expired=True) == ("expired", None)
    assert state_of(delivered(1, NOW + 5), expired=True) == ("in_flight", NOW + 5)


def test_the_origin_of_an_engine_made_message_is_read_back_from_its_client_id() -> None:
    orders = QueueRef("default", "orders")
    output = origin_of(output_client_id("billing#4", "019ac3b4-62f1-7a1c-9e0b-3f5d2c41a8e7", 2), {})
    assert output == Origin("pipeline_output", subscriber="billing", message_id="019ac3b4-62f1-7a1c-9e0b-3f5d2c41a8e7",
                            index=2)
    dead = origin_of(dead_letter_client_id(orders, "billing", 3, Position(1, 44, 7)), {MESSAGE_ID: "m-1"})
    assert dead == Origin("dead_letter", queue="default/orders", subscriber="billing", message_id="m-1",
                          position=Position(1, 44, 7))
    assert origin_of(moved_client_id("m-2"), {}) == Origin("delayed")
    assert origin_of("redrive/m-3", {}) == Origin("redrive", message_id="m-3")
    assert origin_of("replay:default/orders:2:9:0", {}) == Origin("replay", queue="default/orders",
                                                                 position=Position(2, 9, 0))
    assert origin_of("order-7", {}) is None


def test_a_batchs_marks_tell_a_nacked_message_from_one_in_flight() -> None:
    marks = BatchMarks()
    for row in (delivered(1, NOW + 500), nacked(1, NOW + 9000)):
        marks.add_row(row.outcome, row.seqs, row.deliveries, row.visible_until)
    assert (marks.waiting_until(SEQ), marks.in_flight_until(SEQ)) == (NOW + 9000, None)
    marks.add_row(None, None, {SEQ: 2}, {SEQ: NOW + 700})  # delivered again: the nack is over
    assert (marks.waiting_until(SEQ), marks.in_flight_until(SEQ)) == (None, NOW + 700)
    marks.add_row(ACK, frozenset({SEQ}), None, None)
    assert marks.in_flight_until(SEQ) is None and SEQ in marks.done


def test_a_retry_backoff_recorded_after_an_expired_visibility_shows_as_nacked_until_it_ends() -> None:
    # The member records the wait of a delivery whose visibility ended under a retry policy.
    assert state_of(delivered(2, NOW - 10), nacked(2, NOW + 4000)) == ("nacked", NOW + 4000)


def test_a_retry_backoff_after_an_expired_visibility_is_known_though_nobody_recorded_it() -> None:
    # The member died before its timer wrote the NACK row: the delivery row, its count and the
    # policy say the same (what a member loading the batch now does, acks.BatchMarks).
    assert subscriber_state(read_marks([delivered(2, NOW - 10)], SEQ), 10, 5, True, False, True, NOW,
                            backoff_ms=4000) == ("nacked", NOW + 3990)
    assert subscriber_state(read_marks([delivered(2, NOW + 10)], SEQ), 10, 5, True, False, True, NOW,
                            backoff_ms=4000) == ("in_flight", NOW + 10)
    marks = BatchMarks()
    marks.add_row(None, None, {SEQ: 2}, {SEQ: NOW - 10})
    assert marks.resting_until(SEQ, lambda deliveries: 2.0 * deliveries, NOW) == NOW + 3990
    assert marks.resting_until(SEQ, None, NOW) is None  # no retry policy: ready at once
    assert marks.resting_until(SEQ, lambda deliveries: 4.0, NOW - 20) is None  # still in flight then
    marks.add_row(NACK, None, {SEQ: 2}, {SEQ: NOW + 500})
    assert marks.resting_until(SEQ, lambda deliveries: 4.0, NOW) == NOW + 500  # a recorded nack rules
