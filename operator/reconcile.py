"""What the operator and `casque apply` do to a Queue or a Subscriber, as plain async functions.

Level-based, not diff-based: each flow takes the wanted spec (the `spec` mapping of a custom
resource or of a YAML document) and the status written last time, acts on Cassandra and
ZooKeeper only through `casque.engine.catalog` (the one home of DDL and znode writes), then
observes the backends and derives the new status from what it saw. Applying the same spec
again finds everything in place and changes nothing, status included. The catalog and the
drivers block, so they run in worker threads; the event loop stays free for kopf.

Nothing here knows kopf or the Kubernetes API. The flows' parts live beside them: reading a
resource's spec (resource_specs), preparing a namespace (namespace_setup), observing the
backends and their drift (observation), the status that follows (readiness), and a failure
classified into a condition reason and a retry delay (failures, whose `Failure` the kopf
handlers turn into `PermanentError` or `TemporaryError`, the CLI into an exit code).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from casque.engine import catalog
from casque.engine.catalog import Changes
from casque.errors import InvalidSpec, QueueNotFound, QuotaExceeded
from casque.operator import conditions, schema_status
from casque.operator.failures import INCOMPATIBLE_SCHEMA, Failure, classify, in_thread
from casque.operator.namespace_setup import StoreSource
from casque.operator.observation import observe_queue, observe_subscriber, queue_drift, subscriber_drift
from casque.operator.quotas import Limits, violations
from casque.operator.readiness import (
    failure_status,
    may_repair,
    queue_figures,
    queue_readiness,
    readiness_status,
    subscriber_figures,
    subscriber_readiness,
)
from casque.operator.resource_specs import deletion_policy, parse_queue_spec, parse_subscriber_spec, queue_ref
from casque.operator.storage_quota import PUBLISHING, StorageVerdict
from casque.schema import QueueRef, validate_name
from casque.specs import QueueSpec
from casque.store import Store


@dataclass
class Outcome:
    """What a flow did and the status it leads to (a merge patch of `.status`)."""

    status: dict[str, Any] = field(default_factory=dict)
    changes: Changes = field(default_factory=Changes)
    failure: Failure | None = None
    repaired: list[str] = field(default_factory=list)  # drift that a refresh put right


@dataclass(frozen=True)
class Resource:
    """A Queue or Subscriber as the flows see it: identity, wanted spec, last status."""

    namespace: str
    name: str
    spec: Mapping[str, Any] | None
    status: Mapping[str, Any] | None = None
    generation: int | None = None


async def reconcile_queue(
    stores: StoreSource, resource: Resource, now: datetime, limits: Limits = Limits()
) -> Outcome:
    """Create or update the queue's table and znodes, then report what is there.

    With `limits`, a queue that would take its namespace past them is refused
    (`QuotaExceeded`) before anything is created or changed."""
    try:
        ref = queue_ref(resource.namespace, resource.name)
        spec = parse_queue_spec(resource.spec)
        store = await asyncio.to_thread(stores)
        if limits.any:
            await in_thread(check_quota, store, ref, spec, limits)
        changes = await in_thread(catalog.apply_queue, store, ref, spec)
        seen = await observe_queue(store, ref)
    except Exception as error:  # noqa: BLE001 - every failure becomes a condition
        return failed(resource, classify(error), now)
    wanted = {
        **queue_figures(seen),
        **readiness_status(resource.status, queue_readiness(spec, seen), resource.generation, now),
        "warnings": changes.warnings or None,
    }
    wanted["conditions"] = schema_status.in_force(
        wanted["conditions"], seen.schema_version, spec.data_schema is not None, resource.generation, now)
    return Outcome(status=conditions.merge_patch(resource.status, wanted), changes=changes)


def check_quota(store: Store, ref: QueueRef, spec: QueueSpec, limits: Limits) -> None:
    """Judge against the queues that exist in the backends, not the resources: a Queue that
    was refused, or is not yet applied, uses nothing; one made by `casque apply` does."""
    others: list[QueueSpec] = []
    current: QueueSpec | None = None
    for other in catalog.list_queues(store, ref.namespace):
        try:
            stored = catalog.read_queue(store, other, granted=False).spec
        except QueueNotFound:
            continue  # being created or deleted
        if other == ref:
            current = stored
        else:
            others.append(stored)
    problems = violations(limits, others, current, spec)
    if problems:
        raise QuotaExceeded(f"queue {ref} exceeds the namespace's quota: " + "; ".join(problems))


async def refresh_queue(stores: StoreSource, resource: Resource, now: datetime,
                        storage: StorageVerdict | None = None) -> Outcome:
    """Re-read the figures, and repair drift (a dropped table, lost znodes) once reconciled.
    With `storage`, the namespace's stored bytes and write rate against its quotas become the
    Publishing condition (casque.operator.storage_quota)."""
    try:
        ref = queue_ref(resource.namespace, resource.name)
        spec = parse_queue_spec(resource.spec)
    except InvalidSpec:
        return Outcome()  # the reconcile has reported it; nothing to measure against
    judge = may_repair(resource.status, resource.generation)
    outcome = Outcome()
    try:
        store = await asyncio.to_thread(stores)
        seen = await observe_queue(store, ref)
        drift = queue_drift(spec, seen)
        if drift and judge:
            outcome.changes = await in_thread(catalog.apply_queue, store, ref, spec)
            outcome.repaired = drift
            seen = await observe_queue(store, ref)
    except Exception as error:  # noqa: BLE001
        return failed(resource, classify(error), now) if judge else Outcome(failure=classify(error))
    wanted = queue_figures(seen)
    if judge:
        wanted |= readiness_status(resource.status, queue_readiness(spec, seen), resource.generation, now)
    if storage is not None:
        current = wanted.get("conditions", (resource.status or {}).get("conditions"))
        wanted["conditions"] = conditions.with_condition(
            current, PUBLISHING, status=storage.publishing,
            reason=storage.reason,
            message=storage.describe(), generation=resource.generation, now=now)
    outcome.status = conditions.merge_patch(resource.status, wanted)
    return outcome


async def delete_queue(stores: StoreSource, resource: Resource) -> Outcome:
    """Carry out the deletion policy. Retain touches no backend, so it works when they are down."""
    try:
        ref = queue_ref(resource.namespace, resource.name)
        policy = deletion_policy(resource.spec)
        if policy == "Retain":
            return Outcome(changes=Changes(actions=["retained table and znodes"]))
        store = await asyncio.to_thread(stores)
        return Outcome(changes=await in_thread(catalog.delete_queue, store, ref, policy))
    except Exception as error:  # noqa: BLE001
        return Outcome(failure=classify(error))


async def reconcile_subscriber(stores: StoreSource, resource: Resource, now: datetime) -> Outcome:
    """Create the subscriber (offsets from its start position) or update its settings."""
    try:
        validate_name("subscriber", resource.name)
        spec = parse_subscriber_spec(resource.spec)
        ref = queue_ref(resource.namespace, spec.queue)
        store = await asyncio.to_thread(stores)
        changes = await in_thread(catalog.apply_subscriber, store, ref, resource.name, spec)
        seen = await observe_subscriber(store, resource.namespace, resource.name, spec)
    except Exception as error:  # noqa: BLE001
        return failed(resource, classify(error), now)
    wanted = {
        **subscriber_figures(spec, seen),
        **readiness_status(resource.status, subscriber_readiness(spec, seen), resource.generation, now),
    }
    return Outcome(status=conditions.merge_patch(resource.status, wanted), changes=changes)


async def refresh_subscriber(stores: StoreSource, resource: Resource, now: datetime) -> Outcome:
    """Re-read lag and consumers; recreate a lost subscriber znode once reconciled."""
    try:
        validate_name("subscriber", resource.name)
        spec = parse_subscriber_spec(resource.spec)
    except InvalidSpec:
        return Outcome()
    judge = may_repair(resource.status, resource.generation)
    outcome = Outcome()
    try:
        store = await asyncio.to_thread(stores)
        seen = await observe_subscriber(store, resource.namespace, resource.name, spec)
        drift = subscriber_drift(spec, seen)
        if drift and judge:
            ref = queue_ref(resource.namespace, spec.queue)
            outcome.changes = await in_thread(catalog.apply_subscriber, store, ref, resource.name, spec)
            outcome.repaired = drift
            seen = await observe_subscriber(store, resource.namespace, resource.name, spec)
    except Exception as error:  # noqa: BLE001
        return failed(resource, classify(error), now) if judge else Outcome(failure=classify(error))
    wanted = subscriber_figures(spec, seen)
    if judge:
        wanted |= readiness_status(resource.status, subscriber_readiness(spec, seen), resource.generation, now)
    outcome.status = conditions.merge_patch(resource.status, wanted)
    return outcome


async def delete_subscriber(stores: StoreSource, resource: Resource) -> Outcome:
    """A subscriber's state lives in ZooKeeper only (and TTL'd rows), so it always goes."""
    queue = (resource.spec or {}).get("queue")
    try:
        if not isinstance(queue, str):
            return Outcome()  # never applied: there is nothing to remove
        ref = queue_ref(resource.namespace, queue)
        validate_name("subscriber", resource.name)
        store = await asyncio.to_thread(stores)
        return Outcome(changes=await in_thread(catalog.delete_subscriber, store, ref, resource.name))
    except InvalidSpec:
        return Outcome()  # a name that was never valid was never applied either
    except Exception as error:  # noqa: BLE001
        return Outcome(failure=classify(error))


def failed(resource: Resource, failure: Failure, now: datetime) -> Outcome:
    wanted = failure_status(resource.status, failure, resource.generation, now)
    if failure.reason == INCOMPATIBLE_SCHEMA:
        wanted["conditions"] = schema_status.refused(wanted["conditions"], failure.message, resource.generation, now)
    return Outcome(status=conditions.merge_patch(resource.status, wanted), failure=failure)
