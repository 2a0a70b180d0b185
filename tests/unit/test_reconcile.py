"""The operator's reconcile logic without any server: specs, drift, readiness, status, failures."""

from __future__ import annotations

from dataclasses import replace

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from casque.engine.stats import SubscriberShardStats, SubscriberStats
from casque.errors import (
    BackendUnavailable,
    IncompatibleSchema,
    InvalidChange,
    InvalidSpec,
    QueueNotFound,
    StaleReceipt,
)
from casque.operator import conditions, failures, observation, readiness, reconcile, resource_specs
from casque.operator.observation import QueueObservation, QueueStats, SubscriberObservation
from casque.operator.reconcile import Resource
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
SPEC = QueueSpec(shards=2, retention_seconds=3600)


def in_place(spec: QueueSpec = SPEC, **changes: Any) -> QueueObservation:
    """What the backends hold right after applying `spec`, with `changes`."""
    values: dict[str, Any] = {
        "stored": spec,
        "table_ttl": spec.retention_seconds,
        "heads": {shard: 0 for shard in range(spec.shards)},
        "offsets": {},
    }
    return QueueObservation(**(values | changes))


def unreachable() -> Store:
    raise BackendUnavailable("ZooKeeper at 127.0.0.1:2181 is unreachable")


def untouchable() -> Store:
    raise AssertionError("this flow must not need the backends")


def ready(status: dict[str, Any]) -> dict[str, Any]:
    condition = conditions.find(status.get("conditions"), conditions.READY)
    assert condition is not None
    return dict(condition)


# --- specs and failures -------------------------------------------------------------------


def test_specs_parse_with_durations_and_defaults() -> None:
    spec = resource_specs.parse_queue_spec({"shards": 8, "retention": "2d", "defaultDelay": "15m"})
    assert (spec.shards, spec.retention_seconds, spec.default_delay_seconds) == (8, 2 * 86400, 900)
    assert resource_specs.parse_queue_spec(None) == QueueSpec()
    subscriber = resource_specs.parse_subscriber_spec({"queue": "orders", "visibilityTimeout": "2m"})
    assert subscriber.visibility_timeout_seconds == 120


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"shards": 0}, "spec.shards: Input should be greater than or equal to 1"),
        ({"retention": "7w"}, "spec.retention: invalid duration '7w'"),
        ({"retention": "1h", "defaultDelay": "2h"}, "spec: defaultDelay must be shorter than retention"),
        ({"replicas": 3}, "spec.replicas: Extra inputs are not permitted"),
        ({"retention": "1h", "deduplicationWindow": "2h"},
         "spec: deduplicationWindow must not be longer than retention"),
        ({"deduplicationWindow": "5s"}, "spec.deduplicationWindow: Input should be greater than or equal to 10"),
        ({"deduplicationWindow": "10 min"}, "spec.deduplicationWindow: invalid duration '10 min'"),
    ],
)
def test_invalid_queue_specs_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec) as refused:
        resource_specs.parse_queue_spec(raw)
    assert message in str(refused.value)


def test_the_deduplication_window_defaults_to_ten_minutes_within_the_retention() -> None:
    assert resource_specs.parse_queue_spec(None).deduplication_window == 600
    # Unset on a queue that keeps messages for less: the retention, not a refusal.
    assert resource_specs.parse_queue_spec({"retention": "2m"}).deduplication_window == 120
    assert resource_specs.parse_queue_spec({"retention": "1h", "deduplicationWindow": "1h"}).deduplication_window == 3600
    assert resource_specs.parse_queue_spec({"deduplicationWindow": 30}).deduplication_window == 30
    # Unset, it is not written to the queue's znode, which sidecars of the version before
    # (refusing unknown fields) still read during a rolling upgrade.
    assert "deduplication" not in QueueSpec().model_dump_json()


def test_invalid_subscriber_spec() -> None:
    with pytest.raises(InvalidSpec, match="spec: deadLetterQueue must be another queue"):
        resource_specs.parse_subscriber_spec({"queue": "orders", "deadLetterQueue": "orders"})
    with pytest.raises(InvalidSpec, match="spec.queue: Field required"):
        resource_specs.parse_subscriber_spec({})


@pytest.mark.parametrize(
    ("error", "reason", "retry"),
    [
        (InvalidChange("fewer shards"), "InvalidChange", None),
        (IncompatibleSchema("maximum lowered"), "IncompatibleSchema", None),
        (InvalidSpec("bad"), "InvalidSpec", None),
        (BackendUnavailable("down"), "BackendUnavailable", failures.BACKEND_RETRY_SECONDS),
        (QueueNotFound("no queue"), "QueueNotFound", failures.QUEUE_RETRY_SECONDS),
        (StaleReceipt("stale"), "StaleReceipt", failures.ERROR_RETRY_SECONDS),
        (KeyError("bug"), "InternalError", failures.ERROR_RETRY_SECONDS),
    ],
)
def test_failures_are_classified(error: Exception, reason: str, retry: float | None) -> None:
    failure = failures.classify(error)
    assert (failure.reason, failure.retry_after, failure.permanent) == (reason, retry, retry is None)
    assert failure.error is error


def test_driver_errors_become_backend_unavailable() -> None:
    from cassandra.cluster import NoHostAvailable
    from kazoo.exceptions import ConnectionLoss

    for error in (NoHostAvailable("no host", {}), ConnectionLoss()):
        with pytest.raises(BackendUnavailable):
            with failures.backend_errors():
                raise error


def test_deletion_policy_survives_an_otherwise_invalid_spec() -> None:
    assert resource_specs.deletion_policy({"deletionPolicy": "Delete", "shards": 0}) == "Delete"
    assert resource_specs.deletion_policy({}) == "Retain"
    assert resource_specs.deletion_policy(None) == "Retain"
    assert resource_specs.deletion_policy({"deletionPolicy": "Shred"}) == "Retain"


# --- drift, lag, readiness ----------------------------------------------------------------


def test_lag_counts_batches_between_offset_and_head() -> None:
    heads = {0: 10, 1: 4, 2: 0}
    assert readiness.lag_batches(heads, {0: 11, 1: 11, 2: 1}) == 0  # all done ("latest")
    assert readiness.lag_batches(heads, {0: 1, 1: 3, 2: 1}) == 10 + 2
    assert readiness.lag_batches(heads, {}) == 0  # an unknown offset is drift, not lag


def test_no_drift_right_after_apply() -> None:
    assert observation.queue_drift(SPEC, in_place()) == []
    assert readiness.queue_readiness(SPEC, in_place()) == readiness.Readiness(
        True, "Reconciled", "2 shards, retention 1h, deletion policy Retain"
    )


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"stored": None}, "the queue's znode is missing"),
        ({"stored": QueueSpec(shards=2, retention_seconds=7200)}, "differs from the resource"),
        ({"table_ttl": None}, "the messages table is missing"),
        ({"table_ttl": 60}, "keeps messages 60s, not 3600s"),
        ({"heads": {0: 5}}, "shards without a head znode: 1"),
        ({"offsets": {"billing": {0: 1}}}, "subscriber billing has no offset for shards 1"),
    ],
)
def test_drift_is_named(changes: dict[str, Any], problem: str) -> None:
    drift = observation.queue_drift(SPEC, in_place(**changes))
    assert len(drift) == 1 and problem in drift[0]
    verdict = readiness.queue_readiness(SPEC, in_place(**changes))
    assert (verdict.ready, verdict.reason) == (False, "Drifted")


def test_missing_shards_are_listed_as_ranges() -> None:
    spec = QueueSpec(shards=8)
    drift = observation.queue_drift(spec, in_place(spec, heads={1: 0, 6: 0}))
    assert drift == ["shards without a head znode: 0, 2-5, 7"]


def test_queue_figures() -> None:
    published = datetime(2026, 3, 1, 11, 0)  # naive UTC, as the driver returns it
    seen = in_place(
        heads={0: 10, 1: 3},
        offsets={"fast": {0: 11, 1: 4}, "slow": {0: 6, 1: 1}},
        stats=QueueStats(published_messages=130, depth=42, oldest_pending=published),
    )
    assert readiness.queue_figures(seen) == {
        "shards": 2,
        "publishedBatches": 13,
        "publishedMessages": 130,
        "lagBatches": 5 + 3,
        "subscribers": 2,
        "depth": 42,
        "oldestPendingTime": "2026-03-01T11:00:00Z",
        "schemaVersion": 0,
    }


def test_the_lag_in_batches_comes_from_the_reads_that_gave_the_lag_in_messages() -> None:
    """The heads are read before the engine's stats: a publish landing between the two must
    not give a status with seven messages of lag in no batch."""
    spec = SubscriberSpec(queue="orders")
    at = datetime(2026, 3, 1, 11, 0, tzinfo=timezone.utc)
    stats = SubscriberStats(queue="orders", subscriber="billing", members=[], in_flight=0, delivered=0,
                            redelivered=0, sampled_at=at, shards=[
                                SubscriberShardStats(0, offset=1, head=1, lag_batches=1, lag_messages=4,
                                                     oldest_unacked_at=at, leased_by=None),
                                SubscriberShardStats(1, offset=1, head=1, lag_batches=1, lag_messages=3,
                                                     oldest_unacked_at=at, leased_by=None)])
    before_the_publish = {0: 0, 1: 0}
    seen = SubscriberObservation(queue_exists=True, stored=spec, heads=before_the_publish, offsets={0: 1, 1: 1},
                                 consumers=0, dead_letter_queue_exists=None, stats=stats)
    figures = readiness.subscriber_figures(spec, seen)
    assert (figures["lagBatches"], figures["lagMessages"]) == (2, 7)
    queue = in_place(heads=before_the_publish, offsets={"billing": {0: 1, 1: 1}},
                     stats=QueueStats(published_messages=7, depth=7, lag_batches=2, oldest_pending=at))
    assert readiness.queue_figures(queue)["lagBatches"] == 2


def test_subscriber_readiness() -> None:
    spec = SubscriberSpec(queue="orders", dead_letter_queue="orders-dlq")
    seen = SubscriberObservation(
        queue_exists=True, stored=spec, heads={0: 4}, offsets={0: 2}, consumers=1, dead_letter_queue_exists=True
    )
    assert readiness.subscriber_readiness(spec, seen).ready
    assert readiness.subscriber_figures(spec, seen) == {
        "queue": "orders",
        "lagBatches": 3,
        "lagMessages": None,  # until the engine's stats are read
        "oldestPendingTime": None,
        "consumers": 1,
        "standingBy": 0,
        "inFlight": None,
        "deadLettered": None,
        "filtered": None,
    }

    no_queue = SubscriberObservation(False, None, {}, {}, 0, None)
    assert readiness.subscriber_readiness(spec, no_queue).reason == "QueueNotFound"
    assert observation.subscriber_drift(spec, no_queue) == []
    no_dlq = SubscriberObservation(True, spec, {0: 4}, {0: 2}, 0, False)
    assert readiness.subscriber_readiness(spec, no_dlq).reason == "DeadLetterQueueNotFound"
    lost = SubscriberObservation(True, None, {0: 4}, {}, 0, True)
    assert readiness.subscriber_readiness(spec, lost).reason == "Drifted"


def test_leased_consumers_beyond_the_shards_stand_by_and_shared_ones_never() -> None:
    three = SubscriberObservation(True, SubscriberSpec(queue="orders"), {0: 4, 1: 4}, {0: 2, 1: 2}, 3, None)
    assert readiness.standing_by(SubscriberSpec(queue="orders"), three) == 1
    assert readiness.standing_by(SubscriberSpec(queue="orders", delivery="shared"), three) == 0
    one = replace(three, consumers=1)
    assert readiness.standing_by(SubscriberSpec(queue="orders"), one) == 0
    assert readiness.standing_by(SubscriberSpec(queue="orders"), replace(three, heads={})) is None


def test_a_refresh_judges_only_a_generation_that_was_applied() -> None:
    assert not readiness.may_repair(None, 1)  # never applied
    assert not readiness.may_repair({"observedGeneration": 1}, 2)  # a new spec is being applied, or failed
    assert readiness.may_repair({"observedGeneration": 2}, 2)
    assert not readiness.may_repair({"observedGeneration": 2}, None)


# --- flows without backends ---------------------------------------------------------------


async def test_invalid_spec_fails_for_good_without_touching_the_backends() -> None:
    resource = Resource("default", "orders", {"shards": 0}, status={}, generation=3)
    outcome = await reconcile.reconcile_queue(untouchable, resource, NOW)
    assert outcome.failure is not None and outcome.failure.permanent
    condition = ready(outcome.status)
    assert condition["status"] == "False" and condition["reason"] == "InvalidSpec"
    # The condition judged generation 3; the backends hold no generation yet.
    assert condition["observedGeneration"] == 3 and "observedGeneration" not in outcome.status
    assert condition["lastTransitionTime"] == "2026-03-01T12:00:00Z"


async def test_a_bad_name_is_an_invalid_spec() -> None:
    outcome = await reconcile.reconcile_queue(untouchable, Resource("default", "Orders.v2", {}), NOW)
    assert outcome.failure is not None and outcome.failure.reason == "InvalidSpec"


async def test_backend_outage_is_retried_and_reported() -> None:
    outcome = await reconcile.reconcile_queue(unreachable, Resource("default", "orders", {}, generation=1), NOW)
    assert outcome.failure is not None and outcome.failure.retry_after == failures.BACKEND_RETRY_SECONDS
    assert ready(outcome.status)["reason"] == "BackendUnavailable"

    subscriber = Resource("default", "billing", {"queue": "orders"}, generation=1)
    outcome = await reconcile.reconcile_subscriber(unreachable, subscriber, NOW)
    assert outcome.failure is not None and ready(outcome.status)["reason"] == "BackendUnavailable"


async def test_retain_needs_no_backend() -> None:
    outcome = await reconcile.delete_queue(untouchable, Resource("default", "orders", {"deletionPolicy": "Retain"}))
    assert outcome.failure is None and outcome.changes.actions == ["retained table and znodes"]
    outcome = await reconcile.delete_queue(unreachable, Resource("default", "orders", {"deletionPolicy": "Delete"}))
    assert outcome.failure is not None and outcome.failure.reason == "BackendUnavailable"


async def test_deleting_a_subscriber_that_never_was_valid_is_a_no_op() -> None:
    assert (await reconcile.delete_subscriber(untouchable, Resource("default", "billing", {}))).failure is None
    assert (await reconcile.delete_subscriber(untouchable, Resource("default", "Bad_Name", {"queue": "q"}))).failure is None


async def test_a_refresh_leaves_conditions_alone_until_reconciled() -> None:
    fresh = Resource("default", "orders", {}, status={}, generation=1)
    outcome = await reconcile.refresh_queue(unreachable, fresh, NOW)
    assert outcome.failure is not None and outcome.status == {}
    # Once reconciled, an outage flips Ready; the next reconcile or refresh flips it back.
    reconciled = {
        "observedGeneration": 1,
        "conditions": conditions.with_condition(
            None, "Ready", status=True, reason="Reconciled", message="ok", generation=1, now=NOW - timedelta(hours=1)
        ),
    }
    outcome = await reconcile.refresh_queue(unreachable, Resource("default", "orders", {}, reconciled, 1), NOW)
    assert ready(outcome.status)["reason"] == "BackendUnavailable"
    assert ready(outcome.status)["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    # An invalid spec is the reconcile's to report: the refresh stays silent.
    assert (await reconcile.refresh_queue(untouchable, Resource("default", "orders", {"shards": 0}), NOW)).status == {}


def test_a_refused_schema_change_sets_schema_compatible_false_and_keeps_the_version_shown() -> None:
    before = {"observedGeneration": 1, "schemaVersion": 2, "conditions": []}
    resource = Resource("default", "orders", {}, before, generation=2)
    failure = failures.classify(IncompatibleSchema("/properties/total: maximum lowered from 1000 to 500"))
    status = reconcile.failed(resource, failure, datetime(2026, 3, 1, tzinfo=timezone.utc)).status
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Ready"]["reason"] == "IncompatibleSchema" and by_type["Ready"]["status"] == "False"
    assert by_type["SchemaCompatible"]["status"] == "False"
    assert by_type["SchemaCompatible"]["reason"] == "Incompatible"
    assert "maximum lowered" in by_type["SchemaCompatible"]["message"]
    assert "schemaVersion" not in status and "observedGeneration" not in status  # the old ones stand
