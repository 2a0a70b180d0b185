"""Queue and subscriber stats, and the health answer."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from casque.engine.stats import QueueStats, SubscriberStats
from casque.sidecar.models.base import Reply
from casque.specs import priority_of

class ShardStatsBody(Reply):
    shard: int
    priority: int
    head: int
    published_messages: int | None
    published_bytes: int | None
    last_published_at: datetime | None


class QueueStatsResult(Reply):
    queue: str
    published_messages: int | None
    published_bytes: int | None
    published_by_priority: dict[str, int | None]
    delayed: int = Field(description="Published with a delay and not yet due.")
    batches: int
    shards: list[ShardStatsBody]
    sampled_at: datetime

    @classmethod
    def of(cls, stats: QueueStats) -> QueueStatsResult:
        return cls(
            queue=stats.queue,
            published_messages=stats.published_messages,
            published_bytes=stats.published_bytes,
            published_by_priority={str(p): n for p, n in sorted(stats.published_by_priority().items())},
            delayed=stats.delayed,
            batches=stats.batches,
            shards=[
                ShardStatsBody(
                    shard=s.shard,
                    priority=priority_of(s.shard),
                    head=s.head,
                    published_messages=s.published_messages,
                    published_bytes=s.published_bytes,
                    last_published_at=s.last_published_at,
                )
                for s in stats.shards
            ],
            sampled_at=stats.sampled_at,
        )


class SubscriberShardStatsBody(Reply):
    shard: int
    priority: int
    offset: int
    head: int
    lag_batches: int
    lag_messages: int | None
    oldest_unacked_at: datetime | None
    leased_by: str | None
    # A stall: lag, and the offset unmoved since `stalledSince` for at least stallAfterSeconds.
    stalled: bool = False
    stalled_since: datetime | None = None
    offset_moved_at: datetime | None = None


class SubscriberStatsResult(Reply):
    queue: str
    subscriber: str
    lag_batches: int
    lag_messages: int | None
    lag_by_priority: dict[str, int | None]
    oldest_unacked_age_seconds: float | None
    in_flight: int
    delivered: int
    redelivered: int
    dead_lettered: int
    filtered: int
    members: list[str]
    shards: list[SubscriberShardStatsBody]
    sampled_at: datetime
    stall_after_seconds: float
    stalled_shards: list[int]

    @classmethod
    def of(cls, stats: SubscriberStats) -> SubscriberStatsResult:
        return cls(
            queue=stats.queue,
            subscriber=stats.subscriber,
            lag_batches=stats.lag_batches,
            lag_messages=stats.lag_messages,
            lag_by_priority={str(p): n for p, n in sorted(stats.lag_by_priority().items())},
            oldest_unacked_age_seconds=stats.oldest_unacked_age_seconds,
            in_flight=stats.in_flight,
            delivered=stats.delivered,
            redelivered=stats.redelivered,
            dead_lettered=stats.dead_lettered,
            filtered=stats.filtered,
            members=stats.members,
            shards=[
                SubscriberShardStatsBody(
                    shard=s.shard,
                    priority=priority_of(s.shard),
                    offset=s.offset,
                    head=s.head,
                    lag_batches=s.lag_batches,
                    lag_messages=s.lag_messages,
                    oldest_unacked_at=s.oldest_unacked_at,
                    leased_by=s.leased_by,
                    stalled=s.stalled_since is not None,
                    stalled_since=s.stalled_since,
                    offset_moved_at=s.offset_moved_at,
                )
                for s in stats.shards
            ],
            sampled_at=stats.sampled_at,
            stall_after_seconds=stats.stall_after_seconds,
            stalled_shards=stats.stalled_shards,
        )


HealthStatus = Literal["ok", "starting", "unready", "draining"]


class Health(Reply):
    status: HealthStatus
    checks: dict[str, str] = Field(default_factory=dict)
