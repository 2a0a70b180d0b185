"""Queue and subscriber statistics, cheap enough to read every few seconds.

A queue's numbers come from one ZooKeeper read and one header read per shard: every batch
header carries the shard's running totals of messages and bytes, so counting never scans
the log. A subscriber's lag is the difference of the totals at its offset and at the head;
its oldest unacked message is the one at its offset. In-flight and redelivery counts come
from what each live consumer reports in its member znode.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from cassandra import InvalidRequest
from kazoo.exceptions import NoNodeError

from casque.backends import zk
from casque.engine import catalog
from casque.engine import totals as shard_totals
from casque.engine.batches import Header, Log
from casque.engine.counters import DELAYED_IN, DELAYED_OUT, QueueCounters, dead_lettered, filtered
from casque.engine.stalls import read_progress, stall_threshold
from casque.schema import QueueRef
from casque.specs import QueueState, priority_of
from casque.store import Store
from casque.znodes import decode_head


@dataclass(frozen=True)
class ShardStats:
    shard: int
    head: int
    published_messages: int | None
    published_bytes: int | None
    last_published_at: datetime | None


@dataclass(frozen=True)
class QueueStats:
    queue: str
    shards: list[ShardStats]
    sampled_at: datetime
    # Messages waiting in the delayed table (published with a delay, not moved yet).
    delayed: int = 0

    def published_by_priority(self) -> dict[int, int | None]:
        return _sum_by_level((s.shard, s.published_messages) for s in self.shards)

    @property
    def published_messages(self) -> int | None:
        counts = [s.published_messages for s in self.shards]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    @property
    def published_bytes(self) -> int | None:
        sizes = [s.published_bytes for s in self.shards]
        return None if any(c is None for c in sizes) else sum(c for c in sizes if c is not None)

    @property
    def batches(self) -> int:
        return sum(s.head for s in self.shards)

    def rate_since(self, earlier: QueueStats) -> float | None:
        """Messages per second published between two samples."""
        now, then = self.published_messages, earlier.published_messages
        seconds = (self.sampled_at - earlier.sampled_at).total_seconds()
        if now is None or then is None or seconds <= 0:
            return None
        return (now - then) / seconds


@dataclass(frozen=True)
class SubscriberShardStats:
    shard: int
    offset: int
    head: int
    lag_batches: int
    lag_messages: int | None
    oldest_unacked_at: datetime | None
    leased_by: str | None
    # When the offset znode was last written, and since when the shard is stalled (None: it is not).
    offset_moved_at: datetime | None = None
    stalled_since: datetime | None = None


@dataclass(frozen=True)
class SubscriberStats:
    queue: str
    subscriber: str
    shards: list[SubscriberShardStats]
    members: list[str]
    in_flight: int
    delivered: int
    redelivered: int
    sampled_at: datetime
    member_reports: dict[str, dict[str, int]] = field(default_factory=dict)
    dead_lettered: int = 0
    # Messages the subscriber's filter did not match (done without a delivery), so far.
    filtered: int = 0
    # Lag with no offset move for this long is a stall (casque.engine.stalls).
    stall_after_seconds: float = 0.0

    @property
    def stalled_shards(self) -> list[int]:
        return [s.shard for s in self.shards if s.stalled_since is not None]

    def lag_by_priority(self) -> dict[int, int | None]:
        return _sum_by_level((s.shard, s.lag_messages) for s in self.shards)

    @property
    def lag_batches(self) -> int:
        return sum(s.lag_batches for s in self.shards)

    @property
    def lag_messages(self) -> int | None:
        lags = [s.lag_messages for s in self.shards]
        return None if any(x is None for x in lags) else sum(x for x in lags if x is not None)

    @property
    def oldest_unacked_age_seconds(self) -> float | None:
        oldest = [s.oldest_unacked_at for s in self.shards if s.oldest_unacked_at is not None]
        if not oldest:
            return None
        return max(0.0, (self.sampled_at - min(oldest)).total_seconds())


def _sum_by_level(values: Iterable[tuple[int, int | None]]) -> dict[int, int | None]:
    """Per priority level, the sum over its shards; None where any shard's figure is unknown."""
    grouped: dict[int, list[int | None]] = {}
    for shard, value in values:
        grouped.setdefault(priority_of(shard), []).append(value)
    return {
        level: None if any(v is None for v in vs) else sum(v for v in vs if v is not None)
        for level, vs in grouped.items()
    }


async def _counts(store: Store, queue: QueueRef, state: QueueState) -> dict[str, int]:
    """The queue's durable counters; none in an installation set up before they existed
    (the next apply of any queue creates the table)."""
    try:
        return await QueueCounters(store.for_namespace(queue.namespace), state.shared_key(queue)).read()
    except InvalidRequest:
        return {}


async def _get_int(store: Store, path: str) -> int:
    data, _ = await zk.call(store.zk.get_async, path)
    return decode_head(data)


async def _header(log: Log, shard: int, batch: int) -> Header | None:
    return None if batch <= 0 else await log.read_header(shard, batch)


async def queue_stats(store: Store, queue: QueueRef) -> QueueStats:
    state = await asyncio.to_thread(catalog.read_queue, store, queue)
    log = Log(store, queue, state.spec.consistency)

    async def one(shard: int) -> ShardStats:
        head = await _get_int(store, store.paths(queue).head(shard))
        header = await _header(log, shard, head)
        # The head is advanced after a publish is answered: batches past it are answered
        # publishes, which stats count at once (a publisher's own stats read what it wrote).
        while (following := await log.read_header(shard, head + 1)) is not None:
            head, header = head + 1, following
        if head == 0:
            return ShardStats(shard, 0, 0, 0, None)
        if header is None:
            # Expired with its batch (an idle queue): the totals live on in ZooKeeper.
            messages, size = await shard_totals.kept(store, log, shard, head) or (None, None)
            return ShardStats(shard, head, messages, size, None)
        return ShardStats(shard, head, header.total_messages, header.total_bytes, header.published_at)

    shards = await asyncio.gather(*(one(s) for s in state.spec.log_shards()))
    counts = await _counts(store, queue, state)
    delayed = counts.get(DELAYED_IN, 0) - counts.get(DELAYED_OUT, 0)
    return QueueStats(str(queue), list(shards), datetime.now(timezone.utc), delayed=max(0, delayed))


async def subscriber_stats(store: Store, queue: QueueRef, subscriber: str) -> SubscriberStats:
    state = await asyncio.to_thread(catalog.read_queue, store, queue)
    subscriber_state = await asyncio.to_thread(catalog.read_subscriber, store, queue, subscriber)
    log = Log(store, queue, state.spec.consistency)
    paths = store.paths(queue).subscriber(subscriber)

    threshold = stall_threshold(subscriber_state.spec)
    now = datetime.now(timezone.utc)

    async def one(shard: int) -> SubscriberShardStats:
        progress = await read_progress(store, log, paths, shard)
        offset, head = progress.offset, progress.head
        try:
            holder, _ = await zk.call(store.zk.get_async, paths.lease(shard))
            leased_by: str | None = holder.decode()
        except NoNodeError:
            leased_by = None
        lag_batches = max(0, head - offset + 1)
        if lag_batches == 0:
            return SubscriberShardStats(shard, offset, head, 0, 0, None, leased_by, progress.offset_moved_at)
        at_head, before_offset = await asyncio.gather(_header(log, shard, head), _header(log, shard, offset - 1))
        lag_messages = None
        if at_head is not None and at_head.total_messages is not None:
            if offset - 1 <= 0:
                lag_messages = at_head.total_messages
            elif before_offset is not None and before_offset.total_messages is not None:
                lag_messages = at_head.total_messages - before_offset.total_messages
        return SubscriberShardStats(shard, offset, head, lag_batches, lag_messages, progress.pending_since, leased_by,
                                    progress.offset_moved_at, progress.stalled_since(threshold, now))

    shards = await asyncio.gather(*(one(s) for s in state.spec.log_shards()))
    members: list[str] = []
    reports: dict[str, dict[str, int]] = {}
    try:
        members = sorted(await zk.call(store.zk.get_children_async, paths.members))
    except NoNodeError:
        pass
    for member in members:
        try:
            data, _ = await zk.call(store.zk.get_async, paths.member(member))
        except NoNodeError:
            continue
        if data:
            reports[member] = {k: int(v) for k, v in json.loads(data).items()}
    counts = await _counts(store, queue, state)
    key = subscriber_state.ack_key(subscriber)
    return SubscriberStats(
        queue=str(queue),
        subscriber=subscriber,
        shards=list(shards),
        members=members,
        in_flight=sum(r.get("in_flight", 0) for r in reports.values()),
        delivered=sum(r.get("delivered", 0) for r in reports.values()),
        redelivered=sum(r.get("redelivered", 0) for r in reports.values()),
        sampled_at=datetime.now(timezone.utc),
        member_reports=reports,
        dead_lettered=counts.get(dead_lettered(key), 0),
        filtered=counts.get(filtered(key), 0),
        stall_after_seconds=threshold,
    )


def with_live_report(stats: SubscriberStats, member: str, report: dict[str, int]) -> SubscriberStats:
    """`stats` with one member's counters as they are now instead of as it last wrote them to
    its member znode (every few seconds): what the member's own sidecar answers, so a receive
    shows in its `inFlight` and `delivered` at once. Only for a member of the group."""
    if member not in stats.members:
        return stats
    reports = {**stats.member_reports, member: report}
    return replace(stats, member_reports=reports,
                   in_flight=sum(r.get("in_flight", 0) for r in reports.values()),
                   delivered=sum(r.get("delivered", 0) for r in reports.values()),
                   redelivered=sum(r.get("redelivered", 0) for r in reports.values()))

