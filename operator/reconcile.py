"""What the operator and `casque apply` do to a Queue or a Subscriber, as plain async functions.

Level-based, not diff-based: each flow takes the wanted spec (the `spec` mapping of a custom
resource or of a YAML document) and the status written last time, acts on Cassandra and
ZooKeeper only through `casque.engine.catalog` (the one home of DDL and znode writes), then
observes the backends and derives the new status from what it saw. Applying the same spec
again finds everything in place and changes nothing, status included. The catalog and the
drivers block, so they run in worker threads; the event loop stays free for kopf.

Nothing here knows kopf or the Kubernetes API. A failure is classified into a condition
reason and a retry delay (`Failure`); the kopf handlers turn that into `PermanentError` or
`TemporaryError`, the CLI into an exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal, ParamSpec, TypeVar

from cassandra import Unauthorized
from kazoo.exceptions import NoNodeError
from kazoo.security import ANYONE_ID_UNSAFE
from pydantic import ValidationError

from casque.backends import cql, zk
from casque.config import Settings
from casque.engine import catalog, stats as engine_stats
from casque.engine.catalog import Changes
from casque.engine.stats import SubscriberStats
from casque.errors import (
    AccessDenied,
    BackendUnavailable,
    CasqueError,
    IncompatibleSchema,
    InvalidChange,
    InvalidSpec,
    QueueNotFound,
    QuotaExceeded,
    SubscriberNotFound,
)
from casque.operator import conditions, schema_status
from casque.operator.quotas import Limits, violations
from casque.schema import QueueRef, read_table_options, validate_name
from casque.specs import QueueSpec, QueueState, SubscriberSpec, SubscriberState, format_duration
from casque.store import Store
from casque.tenancy import NamespaceRole
from casque.znodes import queues_root

# Something that hands out the Store, opening it on first use. Flows that may not need the
# backends at all (deleting a Queue whose policy is Retain) call it only when they must.
StoreSource = Callable[[], Store]
DeletionPolicy = Literal["Retain", "Delete"]
P = ParamSpec("P")
T = TypeVar("T")

# Reasons of the Ready condition.
RECONCILED = "Reconciled"
DRIFTED = "Drifted"
INVALID_SPEC = "InvalidSpec"
INVALID_CHANGE = "InvalidChange"
INCOMPATIBLE_SCHEMA = "IncompatibleSchema"
BACKEND_UNAVAILABLE = "BackendUnavailable"
QUEUE_NOT_FOUND = "QueueNotFound"
DEAD_LETTER_QUEUE_NOT_FOUND = "DeadLetterQueueNotFound"
INTERNAL_ERROR = "InternalError"
QUOTA_EXCEEDED = "QuotaExceeded"

# Seconds before retrying: a backend outage is usually a restart or a failover; a missing
# queue is usually a Subscriber applied in the same breath as its Queue.
BACKEND_RETRY_SECONDS = 20.0
QUEUE_RETRY_SECONDS = 5.0
ERROR_RETRY_SECONDS = 60.0
# A refused queue may fit once another is deleted or the quota raised: look again now and then.
QUOTA_RETRY_SECONDS = 60.0


# --- Failures -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """Why a flow did not reach the wanted state, as a condition reason and message."""

    reason: str
    message: str
    # None: permanent, retrying cannot help until the spec changes.
    retry_after: float | None
    error: BaseException | None = field(default=None, compare=False)

    @property
    def permanent(self) -> bool:
        return self.retry_after is None


def classify(error: BaseException) -> Failure:
    # IncompatibleSchema is an InvalidChange, which is an InvalidSpec: most specific first.
    if isinstance(error, IncompatibleSchema):
        return Failure(INCOMPATIBLE_SCHEMA, str(error), None, error)
    if isinstance(error, InvalidChange):
        return Failure(INVALID_CHANGE, str(error), None, error)
    if isinstance(error, InvalidSpec):
        return Failure(INVALID_SPEC, str(error), None, error)
    if isinstance(error, BackendUnavailable):
        return Failure(BACKEND_UNAVAILABLE, str(error), BACKEND_RETRY_SECONDS, error)
    if isinstance(error, QueueNotFound):
        return Failure(QUEUE_NOT_FOUND, str(error), QUEUE_RETRY_SECONDS, error)
    if isinstance(error, QuotaExceeded):
        return Failure(QUOTA_EXCEEDED, str(error), QUOTA_RETRY_SECONDS, error)
    if isinstance(error, CasqueError):
        return Failure(type(error).__name__, str(error), ERROR_RETRY_SECONDS, error)
    return Failure(INTERNAL_ERROR, f"{type(error).__name__}: {error}", ERROR_RETRY_SECONDS, error)


@contextlib.contextmanager
def backend_errors() -> Iterator[None]:
    """Driver errors that mean "not now" become BackendUnavailable, which is retried.

    The catalog calls the drivers directly; their timeouts and connection losses are mapped
    here, once, for every flow.
    """
    try:
        yield
    except (*cql.RETRYABLE, *zk.RETRYABLE) as error:
        raise BackendUnavailable(f"{type(error).__name__}: {error}") from error


def open_store(settings: Settings) -> Store:
    """Connect to the backends of `settings` and make sure the installation exists."""
    with backend_errors():
        store = Store.open(settings)
        try:
            catalog.ensure_installation(store)
        except BaseException:
            store.close()
            raise
    return store


def prepare_namespace_cassandra(stores: StoreSource, namespace: str, role: NamespaceRole) -> None:
    """Keyspace isolation: the namespace's keyspace with its shared tables, and its role
    (blocking). Before the namespace's Secret names the role, so no sidecar is handed a
    login that does not exist yet."""
    with backend_errors():
        store = stores()
        try:
            catalog.ensure_namespace_keyspace(store, namespace)
            catalog.ensure_namespace_role(store, role)
        except Unauthorized as error:
            raise AccessDenied(
                f"the operator's Cassandra role may not prepare namespace {namespace} (it needs CREATE and "
                f"AUTHORIZE on all keyspaces and CREATE on all roles, or superuser): {error}"
            ) from error


def secure_namespace_znodes(stores: StoreSource, namespace: str) -> int:
    """Give the namespace's znodes the ACL of the current identities (blocking): before its
    ZooKeeper Secret names a new identity. Returns how many changed.

    Not while the namespace's znodes are open (an installation that ran without ZooKeeper
    authentication): its running sidecars hold no credentials yet, and securing waits for
    the administrators' `casque secure-znodes`, once they do (docs/security.md).
    """
    with backend_errors():
        store = stores()
        try:
            acl, _ = store.zk.get_acls(f"{queues_root(store.zk_root)}/{namespace}")
        except NoNodeError:
            return 0  # its first Queue: nothing made yet
        if any(entry.id == ANYONE_ID_UNSAFE for entry in acl):
            return 0
        return catalog.secure_znodes(store, namespace)


def forget_namespace_cassandra(stores: StoreSource, role: NamespaceRole) -> None:
    """The namespace's last Queue is gone: its role goes, its keyspace stays (blocking)."""
    with backend_errors():
        catalog.drop_namespace_role(stores(), role)


# --- Specs --------------------------------------------------------------------------------


def parse_queue_spec(raw: Mapping[str, Any] | None) -> QueueSpec:
    try:
        return QueueSpec.model_validate(dict(raw or {}))
    except ValidationError as error:
        raise InvalidSpec(describe(error)) from error


def parse_subscriber_spec(raw: Mapping[str, Any] | None) -> SubscriberSpec:
    try:
        return SubscriberSpec.model_validate(dict(raw or {}))
    except ValidationError as error:
        raise InvalidSpec(describe(error)) from error


def describe(error: ValidationError) -> str:
    """One line per problem, named by its field path as in the resource: `spec.shards: ...`."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(["spec", *(str(part) for part in item["loc"])])
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


def queue_ref(namespace: str | None, name: str) -> QueueRef:
    return QueueRef(namespace or "default", name)  # raises InvalidSpec for a bad name


def deletion_policy(raw: Mapping[str, Any] | None) -> DeletionPolicy:
    """The policy alone, so that a Queue whose other fields are invalid can still be deleted."""
    value = (raw or {}).get("deletionPolicy", "Retain")
    return "Delete" if value == "Delete" else "Retain"


# --- Reading state ------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueStats:
    """Figures about the queue's messages, from the engine's stats (see `collect_queue_stats`)."""

    published_messages: int | None = None  # over the queue's life, from the batch headers' running totals
    depth: int | None = None  # messages the slowest subscriber has yet to consume
    lag_batches: int | None = None  # batches the slowest subscriber has yet to consume, as of `depth`
    oldest_pending: datetime | None = None  # publish time of the oldest message some subscriber has not consumed


@dataclass(frozen=True)
class QueueObservation:
    stored: QueueSpec | None  # the spec in the queue's znode; None if the queue does not exist
    table_ttl: int | None  # the messages table's default_time_to_live; None if it does not exist
    heads: dict[int, int]  # shard -> head, for the shards whose head znode exists
    offsets: dict[str, dict[int, int]]  # subscriber -> shard -> offset
    stats: QueueStats = QueueStats()
    schema_version: int = 0  # of the schema in force (QueueState.schema_version)


@dataclass(frozen=True)
class SubscriberObservation:
    queue_exists: bool
    stored: SubscriberSpec | None
    heads: dict[int, int]
    offsets: dict[int, int]
    consumers: int
    dead_letter_queue_exists: bool | None  # None when no dead-letter queue is configured
    stats: SubscriberStats | None = None


async def observe_queue(store: Store, ref: QueueRef, *, figures: bool = True) -> QueueObservation:
    seen = await _in_thread(_observe_queue, store, ref)
    if figures and seen.stored is not None and not queue_drift(seen.stored, seen):
        seen = replace(seen, stats=await collect_queue_stats(store, ref, sorted(seen.offsets)))
    return seen


async def observe_subscriber(
    store: Store, namespace: str, name: str, spec: SubscriberSpec, *, figures: bool = True
) -> SubscriberObservation:
    seen = await _in_thread(_observe_subscriber, store, namespace, name, spec)
    if figures and seen.stored is not None and not _missing_offsets(seen.heads, seen.offsets):
        seen = replace(seen, stats=await _subscriber_stats(store, queue_ref(namespace, spec.queue), name))
    return seen


async def collect_queue_stats(store: Store, ref: QueueRef, subscribers: list[str]) -> QueueStats:
    """The queue's message figures from the engine's stats: extend here as the engine reports more.

    One header read per shard for the queue, and up to three per shard and subscriber
    (`casque.engine.stats`); the znodes are known to be in place when this runs.
    """
    with backend_errors():
        try:
            queue = await engine_stats.queue_stats(store, ref)
        except (NoNodeError, QueueNotFound):  # deleted meanwhile
            return QueueStats()
    per_subscriber = [s for s in [await _subscriber_stats(store, ref, name) for name in subscribers] if s]
    lags = [s.lag_messages for s in per_subscriber]
    oldest = [
        _utc(shard.oldest_unacked_at)
        for s in per_subscriber
        for shard in s.shards
        if shard.oldest_unacked_at is not None
    ]
    return QueueStats(
        published_messages=queue.published_messages,
        depth=None if any(lag is None for lag in lags) else max((lag or 0 for lag in lags), default=0),
        lag_batches=max((s.lag_batches for s in per_subscriber), default=0) if per_subscriber else None,
        oldest_pending=min(oldest, default=None),
    )


async def _subscriber_stats(store: Store, ref: QueueRef, name: str) -> SubscriberStats | None:
    with backend_errors():
        try:
            return await engine_stats.subscriber_stats(store, ref, name)
        except (NoNodeError, QueueNotFound, SubscriberNotFound):  # deleted meanwhile
            return None


def _observe_queue(store: Store, ref: QueueRef) -> QueueObservation:
    with backend_errors():
        stored = _stored_queue(store, ref)
        table = read_table_options(store.session, store.keyspace_of(ref.namespace), ref)
        heads = _read_heads(store, ref)
        offsets = {
            name: _read_offsets(store, ref, name)
            for name in catalog.list_subscribers(store, ref)
            if _stored_subscriber(store, ref, name) is not None
        }
    return QueueObservation(
        stored=stored.spec if stored else None,
        table_ttl=table.default_time_to_live if table.exists else None,
        heads=heads,
        offsets=offsets,
        schema_version=stored.schema_version if stored else 0,
    )


def _observe_subscriber(store: Store, namespace: str, name: str, spec: SubscriberSpec) -> SubscriberObservation:
    ref = queue_ref(namespace, spec.queue)
    with backend_errors():
        queue_exists = _stored_queue(store, ref) is not None
        stored = _stored_subscriber(store, ref, name) if queue_exists else None
        dlq: bool | None = None
        if spec.dead_letter_queue is not None:
            dlq = _stored_queue(store, queue_ref(namespace, spec.dead_letter_queue)) is not None
        return SubscriberObservation(
            queue_exists=queue_exists,
            stored=stored.spec if stored else None,
            heads=_read_heads(store, ref) if queue_exists else {},
            offsets=_read_offsets(store, ref, name) if stored else {},
            consumers=len(_children(store, store.paths(ref).subscriber(name).members)) if stored else 0,
            dead_letter_queue_exists=dlq,
        )


def _stored_queue(store: Store, ref: QueueRef) -> QueueState | None:
    # Unchecked: a spec beyond its grant is drift for the next apply to restore.
    try:
        return catalog.read_queue(store, ref, granted=False)
    except QueueNotFound:
        return None


def _stored_subscriber(store: Store, ref: QueueRef, name: str) -> SubscriberState | None:
    # A subscriber's znode gets its data last, after its offsets: without data it is still
    # being created (or was left half-way), and is not counted.
    try:
        data, _ = store.zk.get(store.paths(ref).subscriber(name).base)
    except NoNodeError:
        return None
    return SubscriberState.model_validate_json(data) if data else None


def _read_heads(store: Store, ref: QueueRef) -> dict[int, int]:
    paths = store.paths(ref)
    heads = {}
    for child in _children(store, paths.shards):
        if child.isdigit():
            try:
                heads[int(child)] = catalog.read_int(store, paths.head(int(child)))
            except NoNodeError:
                continue
    return heads


def _read_offsets(store: Store, ref: QueueRef, name: str) -> dict[int, int]:
    paths = store.paths(ref).subscriber(name)
    offsets = {}
    for child in _children(store, paths.offsets):
        if child.isdigit():
            try:
                offsets[int(child)] = catalog.read_offset(store, paths, int(child))
            except NoNodeError:
                continue
    return offsets


def _children(store: Store, path: str) -> list[str]:
    try:
        return list(store.zk.get_children(path))
    except NoNodeError:
        return []


def _missing_offsets(heads: Mapping[int, int], offsets: Mapping[int, int]) -> list[int]:
    return [shard for shard in sorted(heads) if shard not in offsets]


# --- Deciding -----------------------------------------------------------------------------


def lag_batches(heads: Mapping[int, int], offsets: Mapping[int, int]) -> int:
    """Batches not yet done: every batch <= head exists and every batch < offset is done."""
    return sum(max(0, head + 1 - offsets.get(shard, head + 1)) for shard, head in heads.items())


def queue_drift(spec: QueueSpec, seen: QueueObservation) -> list[str]:
    """How the backends differ from what applying `spec` leaves behind; empty when in place."""
    problems = []
    if seen.stored is None:
        problems.append("the queue's znode is missing")
    elif seen.stored != spec:
        problems.append("the spec stored in ZooKeeper differs from the resource")
    if seen.table_ttl is None:
        problems.append("the messages table is missing")
    elif seen.table_ttl != spec.retention_seconds:
        problems.append(f"the table keeps messages {seen.table_ttl}s, not {spec.retention_seconds}s")
    missing = [shard for shard in range(spec.shards) if shard not in seen.heads]
    if missing:
        problems.append(f"shards without a head znode: {_ranges(missing)}")
    for name, offsets in sorted(seen.offsets.items()):
        gaps = [shard for shard in range(spec.shards) if shard not in offsets]
        if gaps:
            problems.append(f"subscriber {name} has no offset for shards {_ranges(gaps)}")
    return problems


def subscriber_drift(spec: SubscriberSpec, seen: SubscriberObservation) -> list[str]:
    if not seen.queue_exists:
        return []  # not drift: nothing can be applied until the queue exists
    if seen.stored is None:
        return ["the subscriber's znode is missing"]
    if seen.stored != spec:
        return ["the spec stored in ZooKeeper differs from the resource"]
    return []


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
        "oldestPendingTime": conditions.timestamp(_utc(oldest)) if oldest is not None else None,
        "schemaVersion": seen.schema_version if seen.stored is not None else None,
    }


def subscriber_figures(spec: SubscriberSpec, seen: SubscriberObservation) -> dict[str, Any]:
    figures = seen.stats
    oldest = [_utc(s.oldest_unacked_at) for s in figures.shards if s.oldest_unacked_at] if figures else []
    # As for the queue: the lag in batches from the same reads as the lag in messages.
    batches = figures.lag_batches if figures else lag_batches(seen.heads, seen.offsets)
    return {
        "queue": spec.queue,
        "lagBatches": batches if seen.stored is not None else None,
        "lagMessages": figures.lag_messages if figures else None,
        "oldestPendingTime": conditions.timestamp(min(oldest)) if oldest else None,
        "consumers": seen.consumers,
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


# --- Flows --------------------------------------------------------------------------------


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
            await _in_thread(check_quota, store, ref, spec, limits)
        changes = await _in_thread(catalog.apply_queue, store, ref, spec)
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


async def refresh_queue(stores: StoreSource, resource: Resource, now: datetime) -> Outcome:
    """Re-read the figures, and repair drift (a dropped table, lost znodes) once reconciled."""
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
            outcome.changes = await _in_thread(catalog.apply_queue, store, ref, spec)
            outcome.repaired = drift
            seen = await observe_queue(store, ref)
    except Exception as error:  # noqa: BLE001
        return failed(resource, classify(error), now) if judge else Outcome(failure=classify(error))
    wanted = queue_figures(seen)
    if judge:
        wanted |= readiness_status(resource.status, queue_readiness(spec, seen), resource.generation, now)
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
        return Outcome(changes=await _in_thread(catalog.delete_queue, store, ref, policy))
    except Exception as error:  # noqa: BLE001
        return Outcome(failure=classify(error))


async def reconcile_subscriber(stores: StoreSource, resource: Resource, now: datetime) -> Outcome:
    """Create the subscriber (offsets from its start position) or update its settings."""
    try:
        validate_name("subscriber", resource.name)
        spec = parse_subscriber_spec(resource.spec)
        ref = queue_ref(resource.namespace, spec.queue)
        store = await asyncio.to_thread(stores)
        changes = await _in_thread(catalog.apply_subscriber, store, ref, resource.name, spec)
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
            outcome.changes = await _in_thread(catalog.apply_subscriber, store, ref, resource.name, spec)
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
        return Outcome(changes=await _in_thread(catalog.delete_subscriber, store, ref, resource.name))
    except InvalidSpec:
        return Outcome()  # a name that was never valid was never applied either
    except Exception as error:  # noqa: BLE001
        return Outcome(failure=classify(error))


async def _in_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a blocking catalog or driver call in a worker thread, its driver errors mapped."""

    def call() -> T:
        with backend_errors():
            return function(*args, **kwargs)

    return await asyncio.to_thread(call)


def failed(resource: Resource, failure: Failure, now: datetime) -> Outcome:
    wanted = failure_status(resource.status, failure, resource.generation, now)
    if failure.reason == INCOMPATIBLE_SCHEMA:
        wanted["conditions"] = schema_status.refused(wanted["conditions"], failure.message, resource.generation, now)
    return Outcome(status=conditions.merge_patch(resource.status, wanted), failure=failure)


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    parts: list[str] = []
    start = previous = numbers[0]
    for number in [*numbers[1:], None]:
        if number is not None and number == previous + 1:
            previous = number
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if number is not None:
            start = previous = number
    return ", ".join(parts)


def _utc(moment: datetime) -> datetime:
    """The driver returns naive UTC datetimes."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment
