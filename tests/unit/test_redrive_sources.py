"""Which sources a redrive follows: a dead letter's `casque-dlq-source` is what a tenant wrote."""

from __future__ import annotations

import pytest

from casque.engine.deadletters import RedriveResult, source_queue
from casque.schema import QueueRef

DEAD = QueueRef("shop", "orders-dead")


def test_a_source_in_the_dead_letter_queues_namespace_is_followed() -> None:
    assert source_queue("shop/orders", DEAD) == QueueRef("shop", "orders")


@pytest.mark.parametrize("source", [
    "other/orders",  # another namespace
    "shop/orders-dead",  # the dead-letter queue itself
    "orders",  # no namespace: not as the engine writes it
    "shop/orders\n", "shop/Orders", "shop/", "/orders", "a/shop/orders", "",
])
def test_a_source_elsewhere_or_malformed_is_not_followed(source: str) -> None:
    assert source_queue(source, DEAD) is None


def test_skipped_dead_letters_read_as_one_line() -> None:
    assert RedriveResult(0, 0, {}).skipped_line(DEAD) is None
    many = RedriveResult(1, 0, {"shop/orders": 1}, {f"ns-{i}/q": i + 1 for i in range(7)})
    line = many.skipped_line(DEAD)
    assert line == ("skipped 28 dead letter(s) whose source is not a queue of namespace shop: 'ns-0/q' (1), "
                    "'ns-1/q' (2), 'ns-2/q' (3), 'ns-3/q' (4), 'ns-4/q' (5) and 2 more")
    assert "\n" not in (RedriveResult(0, 0, {}, {"a\nb": 1}).skipped_line(DEAD) or "")
