"""A delayed message's row is found again from its message id: the id carries the due time
the row is stored at, to the millisecond, never before the time asked for."""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from casque.engine.delayed import due_and_id, stored_due

MOMENT = datetime(2026, 12, 2, 0, 50, 1, 123456, tzinfo=timezone.utc)


@pytest.mark.parametrize("due", [
    MOMENT,
    MOMENT.replace(microsecond=123000),  # a whole millisecond stays as it is
    MOMENT.replace(microsecond=999999),  # rounds up into the next second
    datetime(2026, 12, 2, 0, 50, 1, 1000, tzinfo=timezone.utc),  # 1.001 s: 1000.9999... as a float
])
def test_the_row_is_due_at_the_millisecond_its_id_carries_never_before(due: datetime) -> None:
    stored, message_id = due_and_id(due)
    assert due <= stored < due + timedelta(milliseconds=1) and stored.microsecond % 1000 == 0
    assert stored_due(message_id, MOMENT + timedelta(hours=1)) == stored
    assert uuid.UUID(message_id).version == 7


def test_any_due_time_is_found_again_from_its_id() -> None:
    picks = random.Random(52)
    for _ in range(20_000):
        due = MOMENT + timedelta(microseconds=picks.randrange(10**13))
        stored, message_id = due_and_id(due)
        assert stored_due(message_id, MOMENT) == stored and due <= stored


def test_an_id_that_carries_no_time_leaves_the_retrys_own_due_time() -> None:
    assert stored_due(str(uuid.uuid4()), MOMENT) == MOMENT
    assert stored_due("not-a-uuid", MOMENT) == MOMENT
