"""What an observation means for a resource's status: ready or not and why, the figures
shown (depth, lag, oldest pending), and the status written after a failure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from casque.operator import conditions
from casque.operator.failures import DEAD_LETTER_QUEUE_NOT_FOUND, DRIFTED, QUEUE_NOT_FOUND, RECONCILED, Failure
from casque.operator.observation import (
    QueueObservation,
    SubscriberObservation,
    as_utc,
    queue_drift,
    subscriber_drift,
)
from casque.specs import QueueSpec, SubscriberSpec, format_duration


def lag_batches(heads: Mapping[int, int], offsets: Mapping[int, int]) -> int:
    """Batches not yet done: every batch <= head exists and every batch < offset is done."""
    return sum(max(0, head + 1 - offsets.get(shard, head + 1)) for shard, head in heads.items())


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str
    message: str


def queue_readiness(spec: QueueSpec, seen: QueueObservation) -> Readiness:
    drift = queue_drift(spec, seen)
    if drift:
        return Readiness(False, DRIFTED, "; ".join(drift))
    return Readiness(
        True,
        RECONCILED,
        f"{spec.shards} shards, retention {format_duration(spec.retention_seconds)}, "
        f"deletion policy {spec.deletion_policy}",
    )


def subscriber_readiness(spec: SubscriberSpec, seen: SubscriberObservation) -> Readiness:
    if not seen.queue_exists:
        return Readiness(False, QUEUE_NOT_FOUND, f"queue {spec.queue} does not exist (yet)")
    drift = subscriber_drift(spec, seen)
    if drift:
        return Readiness(False, DRIFTED, "; ".join(drift))
    if seen.dead_letter_queue_exists is False:
        return Readiness(
            False, DEAD_LETTER_QUEUE_NOT_FOUND, f"dead-letter queue {spec.dead_letter_queue} does not exist (yet)"
        )
    return Readiness(True, RECONCILED, f"consuming queue {spec.queue}")


def may_repair(status: Mapping[str, Any] | None, generation: int | None) -> bool:
    """Whether a status refresh may judge readiness and re-apply the spec to repair drift.

    Only once this generation's spec has been applied, which `status.observedGeneration`
    records. Before that the change handler owns the object: a refresh would call a spec
    still being applied "drift", or re-apply, and post an event for, a spec that fails
    for good on every tick until someone changes it.
    """
    return generation is not None and (status or {}).get("observedGeneration") == generation


def queue_figures(seen: QueueObservation) -> dict[str, Any]:
    # The lag in batches from the reads that gave the depth, when there were any: the heads
    # read before them may be older, and a status must not show messages in no batch.
    lags = [lag_batches(seen.heads, offsets) for offsets in seen.offsets.values()]
    oldest = seen.stats.oldest_pending
    return {
        "shards": len(seen.heads),
        "publishedBatches": sum(seen.heads.values()),
        "publishedMessages": seen.stats.published_messages,
        "lagBatches": seen.stats.lag_batches if seen.stats.lag_batches is not None else max(lags, default=0),
        "subscribers": len(seen.offsets),
        "depth": seen.stats.depth,
        "oldestPendingTime": conditions.timestamp(as_utc(oldest)) if oldest is not None else None,
        "schemaVersion": seen.schema_version if seen.stored is not None else None,
    }


def standing_by(spec: SubscriberSpec, seen: SubscriberObservation) -> int | None:
    """Consumers that can hold nothing: leased delivery gives each shard (a priority level's
    shards are shards of their own) to one member, so members beyond them wait; shared
    delivery gives every member ranges of every shard. None while the shards are unknown."""
    if spec.delivery == "shared":
        return 0
    if not seen.heads:
        return None
    return max(0, seen.consumers - len(seen.heads))


def subscriber_figures(spec: SubscriberSpec, seen: SubscriberObservation) -> dict[str, Any]:
    figures = seen.stats
    oldest = [as_utc(s.oldest_unacked_at) for s in figures.shards if s.oldest_unacked_at] if figures else []
    # As for the queue: the lag in batches from the same reads as the lag in messages.
    batches = figures.lag_batches if figures else lag_batches(seen.heads, seen.offsets)
    return {
        "queue": spec.queue,
        "lagBatches": batches if seen.stored is not None else None,
        "lagMessages": figures.lag_messages if figures else None,
        "oldestPendingTime": conditions.timestamp(min(oldest)) if oldest else None,
        "consumers": seen.consumers,
        "standingBy": standing_by(spec, seen),
        "inFlight": figures.in_flight if figures else None,
        "deadLettered": figures.dead_lettered if figures else None,
        "filtered": figures.filtered if figures else None,
    }


def readiness_status(
    status: Mapping[str, Any] | None,
    readiness: Readiness,
    generation: int | None,
    now: datetime,
    *,
    applied: bool = True,
) -> dict[str, Any]:
    """The Ready condition (with the generation it judged) and, if `applied`, observedGeneration.

    `status.observedGeneration` is the generation whose spec the backends hold: a failure
    to apply leaves it behind, while the condition's own observedGeneration says which
    spec the failure is about.
    """
    wanted: dict[str, Any] = {"observedGeneration": generation} if applied else {}
    return wanted | {
        "conditions": conditions.with_condition(
            (status or {}).get("conditions"),
            conditions.READY,
            status=readiness.ready,
            reason=readiness.reason,
            message=readiness.message,
            generation=generation,
            now=now,
        ),
    }


def failure_status(
    status: Mapping[str, Any] | None, failure: Failure, generation: int | None, now: datetime
) -> dict[str, Any]:
    readiness = Readiness(False, failure.reason, failure.message)
    return readiness_status(status, readiness, generation, now, applied=False)
