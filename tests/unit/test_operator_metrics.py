"""The operator's subscriber gauges follow the status figures it writes, and go with the subscriber."""

from __future__ import annotations

from prometheus_client import REGISTRY

from casque.operator import metrics


def sample(name: str, queue: str, subscriber: str = "pool") -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": "metrics-test", "queue": queue, "subscriber": subscriber})


def test_gauges_are_set_from_the_status_figures_and_removed_with_the_subscriber() -> None:
    metrics.observe_subscriber("metrics-test", "pool", {}, {"queue": "orders", "lagMessages": 1200,
                                                            "lagBatches": 12, "inFlight": 30, "consumers": 8})
    assert sample("casque_subscriber_lag_messages", "orders") == 1200
    assert sample("casque_subscriber_consumers", "orders") == 8
    # A refresh whose figures could not be read (null) leaves the last known values.
    metrics.observe_subscriber("metrics-test", "pool", {}, {"queue": "orders", "lagMessages": None, "lagBatches": 3})
    assert sample("casque_subscriber_lag_messages", "orders") == 1200
    assert sample("casque_subscriber_lag_batches", "orders") == 3
    metrics.forget_subscriber("metrics-test", "pool")
    assert sample("casque_subscriber_lag_messages", "orders") is None


def test_a_patch_of_only_the_changed_figures_still_sets_them() -> None:
    """A merge patch leaves out what did not change, the queue name among it."""
    status = {"queue": "orders", "lagMessages": 0, "lagBatches": 0, "consumers": 1}
    metrics.observe_subscriber("metrics-test", "steady", {}, status)
    metrics.observe_subscriber("metrics-test", "steady", status, {"lagMessages": 7, "lagBatches": 1})
    assert sample("casque_subscriber_lag_messages", "orders", "steady") == 7
    assert sample("casque_subscriber_consumers", "orders", "steady") == 1
    metrics.forget_subscriber("metrics-test", "steady")


def test_a_subscriber_moved_to_another_queue_keeps_no_series_of_the_old_one() -> None:
    metrics.observe_subscriber("metrics-test", "mover", {}, {"queue": "old", "lagMessages": 5})
    metrics.observe_subscriber("metrics-test", "mover", {}, {"queue": "new", "lagMessages": 7})
    assert sample("casque_subscriber_lag_messages", "old", "mover") is None
    assert sample("casque_subscriber_lag_messages", "new", "mover") == 7
    metrics.forget_subscriber("metrics-test", "mover")


def test_a_status_patch_without_figures_sets_nothing() -> None:
    metrics.observe_subscriber("metrics-test", "quiet", {}, {"conditions": []})
    assert sample("casque_subscriber_lag_messages", "orders", "quiet") is None


def test_the_oldest_pending_time_is_exported_as_a_timestamp_and_zero_when_nothing_waits() -> None:
    metrics.observe_subscriber("metrics-test", "aged", {}, {"queue": "orders", "deadLettered": 4,
                                                            "oldestPendingTime": "2030-01-01T00:00:00Z"})
    assert sample("casque_subscriber_oldest_pending_timestamp_seconds", "orders", "aged") == 1893456000.0
    assert sample("casque_subscriber_dead_lettered", "orders", "aged") == 4
    metrics.observe_subscriber("metrics-test", "aged", {}, {"queue": "orders", "oldestPendingTime": None})
    assert sample("casque_subscriber_oldest_pending_timestamp_seconds", "orders", "aged") == 0
    metrics.forget_subscriber("metrics-test", "aged")
    assert sample("casque_subscriber_oldest_pending_timestamp_seconds", "orders", "aged") is None
