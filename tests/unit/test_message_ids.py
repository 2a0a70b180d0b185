"""Message ids made a call at a time are random version 4 UUIDs, as uuid4() makes them."""

from __future__ import annotations

import uuid

import pytest

from casque.engine.messages import random_ids


@pytest.mark.parametrize("count", [0, 1, 2, 100, 1000])
def test_random_ids_are_distinct_version_4_uuids_in_their_usual_form(count: int) -> None:
    ids = random_ids(count)
    assert len(ids) == len(set(ids)) == count
    for text in ids:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, text)
