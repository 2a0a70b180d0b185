"""A queue's figures in the operator's status (casque.operator.observation): read so that a
publish landing while they are read never shows more messages pending than published."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from casque.engine import stats as engine_stats
from casque.operator import observation
from casque.schema import QueueRef

QUEUE = QueueRef("shop", "orders")
NOW = datetime(2026, 12, 5, tzinfo=timezone.utc)


class Log:
    """Seven messages, published while the figures are being read: after the first read."""

    def __init__(self) -> None:
        self.published = 0
        self.reads = 0

    def read(self) -> int:
        self.reads += 1
        if self.reads == 2:
            self.published = 7
        return self.published


async def test_a_publish_between_the_reads_never_shows_more_pending_than_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = Log()

    async def queue_stats(store: Any, ref: QueueRef) -> engine_stats.QueueStats:
        total = log.read()
        return engine_stats.QueueStats(str(ref), [engine_stats.ShardStats(0, 1, total, total, NOW)], NOW)

    async def subscriber_stats(store: Any, ref: QueueRef, name: str) -> engine_stats.SubscriberStats:
        lag = log.read()
        shard = engine_stats.SubscriberShardStats(0, 0, 1, 1, lag, NOW if lag else None, None)
        return engine_stats.SubscriberStats(str(ref), name, [shard], [], 0, 0, 0, NOW)

    monkeypatch.setattr(engine_stats, "queue_stats", queue_stats)
    monkeypatch.setattr(engine_stats, "subscriber_stats", subscriber_stats)
    first = await observation.collect_queue_stats(None, QUEUE, ["billing"])  # type: ignore[arg-type]
    assert first.depth is not None and first.published_messages is not None
    assert first.depth <= first.published_messages
    # And both reads were made: the lag of the publish that landed is in the total.
    assert (first.depth, first.published_messages) == (0, 7)
