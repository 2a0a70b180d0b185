"""The operator's metrics: what each recording function counts, and the subscriber gauges,
which follow the status figures the operator writes and go with the subscriber.

The metrics live in prometheus_client's default registry for the whole process, so each
test reads how much a series moved rather than its value.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from prometheus_client import REGISTRY

from casque.config import Settings
from casque.errors import BackendUnavailable
from casque.operator import injection, metrics
from casque.operator.context import OperatorContext, StoreHolder
from casque.operator.failures import Failure
from casque.operator.handlers.common import run_locked
from casque.operator.reconcile import Outcome


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


# --- reconciles, repairs, leadership, admission reviews -----------------------------------


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Moved:
    """How far some series moved between its creation and `of`."""

    def __init__(self, *series: tuple[str, dict[str, str]]) -> None:
        self._before = {(name, tuple(sorted(labels.items()))): value(name, **labels) for name, labels in series}

    def of(self, name: str, **labels: str) -> float:
        return value(name, **labels) - self._before[(name, tuple(sorted(labels.items())))]


def reconcile_series(kind: str, action: str, reason: str) -> list[tuple[str, dict[str, str]]]:
    return [
        *(("casque_operator_reconciles_total", {"kind": kind, "action": action, "outcome": outcome})
          for outcome in ("ok", "temporary_error", "permanent_error")),
        ("casque_operator_reconcile_duration_seconds_count", {"kind": kind, "action": action}),
        ("casque_operator_reconcile_duration_seconds_sum", {"kind": kind, "action": action}),
        ("casque_operator_reconcile_errors_total", {"kind": kind, "reason": reason}),
    ]


@pytest.mark.parametrize("failure, outcome", [
    (None, "ok"),
    (Failure("BackendUnavailable", "Cassandra is down", 20.0), "temporary_error"),
    (Failure("InvalidSpec", "shards: must be at least 1", None), "permanent_error"),
])
def test_a_reconcile_is_counted_by_outcome_and_timed(failure: Failure | None, outcome: str) -> None:
    reason = failure.reason if failure is not None else "None"
    moved = Moved(*reconcile_series("Queue", "apply", reason))
    metrics.observe_reconcile("Queue", "apply", 0.3, failure)
    for other in {"ok", "temporary_error", "permanent_error"} - {outcome}:
        assert moved.of("casque_operator_reconciles_total", kind="Queue", action="apply", outcome=other) == 0
    assert moved.of("casque_operator_reconciles_total", kind="Queue", action="apply", outcome=outcome) == 1
    assert moved.of("casque_operator_reconcile_duration_seconds_count", kind="Queue", action="apply") == 1
    assert moved.of("casque_operator_reconcile_duration_seconds_sum", kind="Queue", action="apply") == pytest.approx(0.3)
    # Errors by reason: only a failure counts, under the reason its Ready condition shows.
    assert moved.of("casque_operator_reconcile_errors_total", kind="Queue", reason=reason) == (failure is not None)


def test_repairs_count_each_thing_put_right_and_nothing_when_there_was_no_drift() -> None:
    moved = Moved(("casque_operator_drift_repairs_total", {"kind": "Subscriber"}))
    metrics.count_repairs("Subscriber", [])
    assert moved.of("casque_operator_drift_repairs_total", kind="Subscriber") == 0
    metrics.count_repairs("Subscriber", ["the subscriber znode is missing", "offsets of shard 2 are missing"])
    assert moved.of("casque_operator_drift_repairs_total", kind="Subscriber") == 2


def test_the_leader_gauge_says_whether_this_replica_leads() -> None:
    try:
        metrics.record_leadership(True)
        assert value("casque_operator_leader") == 1
        metrics.record_leadership(False)
        assert value("casque_operator_leader") == 0
    finally:
        metrics.record_leadership(False)


# The handlers record through run_locked: a flow that returns, and one that escapes.


@pytest.fixture
def context() -> Iterator[OperatorContext]:
    context = OperatorContext(stores=StoreHolder(Settings()))  # never opened: the flows below need no backend
    yield context
    context.close()


def body(uid: str) -> kopf.Body:
    return kopf.Body({"apiVersion": "casque.io/v1alpha1", "kind": "Queue",
                      "metadata": {"name": "orders", "namespace": "metrics-test", "uid": uid}})


async def test_the_handlers_count_a_refresh_with_its_repairs(context: OperatorContext) -> None:
    moved = Moved(*reconcile_series("Queue", "refresh", "None"), ("casque_operator_drift_repairs_total", {"kind": "Queue"}))

    async def flow() -> Outcome:
        return Outcome(repaired=["the messages table is missing"])

    outcome = await run_locked(context, body("u1"), "Queue", "refresh", flow)
    assert outcome.repaired == ["the messages table is missing"]
    assert moved.of("casque_operator_reconciles_total", kind="Queue", action="refresh", outcome="ok") == 1
    assert moved.of("casque_operator_reconcile_duration_seconds_count", kind="Queue", action="refresh") == 1
    assert moved.of("casque_operator_drift_repairs_total", kind="Queue") == 1


async def test_a_flow_that_escapes_with_an_error_is_counted_under_its_class(context: OperatorContext) -> None:
    moved = Moved(*reconcile_series("Queue", "delete", "BackendUnavailable"),
                  ("casque_operator_reconcile_errors_total", {"kind": "Queue", "reason": "InternalError"}))

    async def unavailable() -> Outcome:
        raise BackendUnavailable("ZooKeeper: connection lost")

    async def broken() -> Outcome:
        raise KeyError("status")

    with pytest.raises(BackendUnavailable):
        await run_locked(context, body("u2"), "Queue", "delete", unavailable)
    with pytest.raises(KeyError):
        await run_locked(context, body("u2"), "Queue", "delete", broken)
    assert moved.of("casque_operator_reconciles_total", kind="Queue", action="delete", outcome="temporary_error") == 2
    assert moved.of("casque_operator_reconcile_errors_total", kind="Queue", reason="BackendUnavailable") == 1
    assert moved.of("casque_operator_reconcile_errors_total", kind="Queue", reason="InternalError") == 1
    assert moved.of("casque_operator_reconcile_duration_seconds_count", kind="Queue", action="delete") == 2


def admission(annotations: dict[str, Any]) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "app", "annotations": annotations},
           "spec": {"containers": [{"name": "app", "image": "example/app:1"}]}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "42", "operation": "CREATE", "namespace": "shop", "object": pod}}


def test_each_admission_answer_is_counted_by_outcome_and_a_failure_to_answer_as_an_error() -> None:
    outcomes = ("injected", "skipped", "refused", "error")
    moved = Moved(*(("casque_operator_admission_reviews_total", {"outcome": o}) for o in outcomes))
    settings, backends = injection.InjectionSettings(), Settings()
    injection.answer(admission({"casque.io/inject": "true", "casque.io/queue": "orders"}), settings, backends)
    injection.answer(admission({}), settings, backends)
    refused = injection.answer(admission({"casque.io/inject": "true", "casque.io/port": "http"}), settings, backends)
    assert refused["response"]["allowed"] is False
    # Annotations that are not a mapping: the review itself fails, and kopf's server answers 500.
    with pytest.raises(AttributeError):
        injection.answer(admission(["casque.io/inject"]), settings, backends)  # type: ignore[arg-type]
    assert {o: moved.of("casque_operator_admission_reviews_total", outcome=o) for o in outcomes} == {
        "injected": 1, "skipped": 1, "refused": 1, "error": 1}
