"""Message ids are version 7 UUIDs that carry when the message is due in the log."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from casque.engine.messages import id_time, time_ordered_ids

MOMENT = datetime(2026, 11, 28, 18, 30, 15, 123456, tzinfo=timezone.utc)


@pytest.mark.parametrize("count", [0, 1, 2, 100, 1000])
def test_ids_are_distinct_version_7_uuids_in_their_usual_form(count: int) -> None:
    ids = time_ordered_ids(count, MOMENT.timestamp())
    assert len(ids) == len(set(ids)) == count
    for text in ids:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant, str(parsed)) == (7, uuid.RFC_4122, text)


@pytest.mark.parametrize("count", [1, 3])
def test_an_id_gives_back_its_time_to_the_millisecond(count: int) -> None:
    for text in time_ordered_ids(count, MOMENT.timestamp()):
        assert id_time(text) == MOMENT.replace(microsecond=123000)


def test_ids_of_later_times_sort_after_earlier_ones() -> None:
    earlier = time_ordered_ids(50, MOMENT.timestamp())
    later = time_ordered_ids(50, MOMENT.timestamp() + 0.002)
    assert max(earlier) < min(later)


# Fixed texts: xdist's workers must collect the same test ids.
@pytest.mark.parametrize("text", ["5981c4bc-b5c7-4a1d-97c0-30c6acc4dc5f",  # version 4
                                  "f6d8230e-eb5c-11f1-b29f-02fc00000001",  # version 1
                                  "not-an-id", "",
                                  "eb8aB5ac-fcD7-7C6A-87A6-618944cEb04E",  # version 7, but past year 9999
                                  "{01a234c6-28b7-72cf-95f6-6f8a3eb258fd}",  # not the form ids are made in
                                  "01a234c628b772cf95f66f8a3eb258fd"])
def test_ids_without_a_time_have_none(text: str) -> None:
    assert id_time(text) is None
