"""What the backends hold for a Queue or a Subscriber, read without changing anything, and
how it drifted from the spec (a missing head znode, a subscriber without an offset)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from kazoo.exceptions import NoNodeError

from casque.engine import catalog, stats as engine_stats
from casque.engine.stats import SubscriberStats
from casque.errors import QueueNotFound, SubscriberNotFound
from casque.operator.failures import backend_errors, in_thread
from casque.operator.resource_specs import queue_ref
from casque.schema import QueueRef, read_table_options
from casque.specs import QueueSpec, QueueState, SubscriberSpec, SubscriberState
from casque.store import Store


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
    seen = await in_thread(_observe_queue, store, ref)
    if figures and seen.stored is not None and not queue_drift(seen.stored, seen):
        seen = replace(seen, stats=await collect_queue_stats(store, ref, sorted(seen.offsets)))
    return seen


async def observe_subscriber(
    store: Store, namespace: str, name: str, spec: SubscriberSpec, *, figures: bool = True
) -> SubscriberObservation:
    seen = await in_thread(_observe_subscriber, store, namespace, name, spec)
    if figures and seen.stored is not None and not _missing_offsets(seen.heads, seen.offsets):
        seen = replace(seen, stats=await _subscriber_stats(store, queue_ref(namespace, spec.queue), name))
    return seen


async def collect_queue_stats(store: Store, ref: QueueRef, subscribers: list[str]) -> QueueStats:
    """The queue's message figures from the engine's stats: extend here as the engine reports more.

    One header read per shard for the queue, and up to three per shard and subscriber
    (`casque.engine.stats`); the znodes are known to be in place when this runs.

    The subscribers' lags are read first and the queue's totals after them: a publish that
    lands between the reads is then counted in the total if it is in a lag, and a status
    never shows more messages pending than published.
    """
    per_subscriber = [s for s in [await _subscriber_stats(store, ref, name) for name in subscribers] if s]
    with backend_errors():
        try:
            queue = await engine_stats.queue_stats(store, ref)
        except (NoNodeError, QueueNotFound):  # deleted meanwhile
            return QueueStats()
    lags = [s.lag_messages for s in per_subscriber]
    oldest = [
        as_utc(shard.oldest_unacked_at)
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


def as_utc(moment: datetime) -> datetime:
    """The driver returns naive UTC datetimes."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment
