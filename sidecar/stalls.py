"""Stalls of the subscribers this sidecar consumes for: the /readyz detail and the gauges.

Per subscriber, the shards this sidecar answers for: the ones it leases (leased delivery), or
every shard (shared delivery, where every member delivers from every shard). Each is judged
from the stored state (casque.engine.stalls), as `casque describe subscriber` judges it. An
evaluation reads two znodes and at most one header per shard, so it is kept for
STALL_CHECK_SECONDS: readiness probes and scrapes together cost no more than that.

A stall is reported, never counted against readiness: restarting a pod or taking it out of
its Services does not fix an app that stopped acking or a message that can never be done
(the restarted consumer meets the same message), and a poison message would take every
pod of the subscriber out at once. docs/architecture.md argues it in full.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from casque.engine.consumer import Consumer
from casque.engine.stalls import read_progress, stall_threshold

# How long an evaluation is reused; far below any stall threshold (tens of seconds).
STALL_CHECK_SECONDS = 2.0


@dataclass(frozen=True)
class StallReport:
    threshold: float
    # Stalled shards and since when their offset stood still with lag.
    stalled: dict[int, datetime] = field(default_factory=dict)
    # The longest any lagging shard here has waited with its offset unmoved (0: none lags).
    longest_wait_seconds: float = 0.0
    checked_at: float = 0.0

    def detail(self) -> str:
        if not self.stalled:
            return f"none (a shard with lag is stalled after {self.threshold:g}s without an offset move)"
        shards = ", ".join(f"shard {shard} since {since.isoformat(timespec='seconds')}"
                           for shard, since in sorted(self.stalled.items()))
        return f"stalled: {shards} (lag and no offset move for {self.threshold:g}s or more)"


class StallWatch:
    """The latest stall report of each served subscriber, refreshed when older than STALL_CHECK_SECONDS."""

    def __init__(self) -> None:
        self._reports: dict[str, StallReport] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def report(self, name: str, consumer: Consumer) -> StallReport:
        known = self._reports.get(name)
        if known is not None and time.monotonic() - known.checked_at < STALL_CHECK_SECONDS:
            return known
        async with self._locks.setdefault(name, asyncio.Lock()):  # a probe and a scrape share one evaluation
            known = self._reports.get(name)
            if known is not None and time.monotonic() - known.checked_at < STALL_CHECK_SECONDS:
                return known
            report = await evaluate(consumer)
            self._reports[name] = report
            return report


async def evaluate(consumer: Consumer) -> StallReport:
    threshold = stall_threshold(consumer.subscriber_state.spec)
    progress = await asyncio.gather(*(read_progress(consumer.store, consumer.log, consumer.paths, shard)
                                      for shard in consumer.answered_shards()))
    now = datetime.now(timezone.utc)
    stalled = {p.shard: since for p in progress if (since := p.stalled_since(threshold, now)) is not None}
    waits = [(now - since).total_seconds() for p in progress if (since := p.waiting_since) is not None]
    return StallReport(threshold, stalled, max([0.0, *waits]), time.monotonic())
