"""How many rows a shard read asks for per page: about READ_PAGE_BYTES, whatever the message size."""

from __future__ import annotations

import pytest

from casque.engine import batches
from casque.engine.batches import page_rows


@pytest.mark.parametrize("mean, rows", [
    (None, batches.FIRST_PAGE_ROWS),  # nothing to go by yet
    (100.0, batches.MAX_PAGE_ROWS),  # tiny rows: capped
    (1024.0, 512),
    (4096.0, 128),
    (64 * 1024.0, batches.MIN_PAGE_ROWS),  # large rows: a few per page, never fewer than the floor
    (0.0, batches.MAX_PAGE_ROWS),
])
def test_pages_hold_about_the_same_bytes(mean: float | None, rows: int) -> None:
    assert page_rows(mean) == rows


def test_a_page_of_the_largest_rows_stays_far_below_a_read() -> None:
    largest = 1024 * 1024  # a message at the size limit
    assert page_rows(float(largest)) * largest <= 16 * batches.READ_BYTES
    assert batches.READ_BYTES >= 2 * 1024 * 1024  # a read always holds a whole batch (at most 1 MiB)
