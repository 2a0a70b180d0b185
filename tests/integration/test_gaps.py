"""Gaps left by expiry in whatever order it happens (casque.engine.gaps), on the real servers.

An ALTER of a table's TTL applies to the rows written after it: a retention lowered for a
while makes the batches written meanwhile expire before the older ones around them. A
consumer lagging behind such a stretch must cross it, in leased and in shared delivery,
without waiting for the old batches to expire and without passing over a live one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone

import pytest

from casque.engine import catalog, offsets, positions
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.offsets import SeekTarget
from casque.engine.publisher import Publisher
from casque.engine.stats import subscriber_stats
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = QueueRef("default", "gaps")
SHORT_TTL = 2


async def until(what: str, condition: Callable[[], bool], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def gone(store: Store, batches: list[int]) -> bool:
    """Whether none of `batches` (of shard 0) has a header any more."""
    for batch in batches:
        row = store.session.execute(
            f"SELECT batch_no FROM {store.table(QUEUE)} WHERE shard = 0 AND bucket = %s AND batch_no = %s "
            "AND seq = -1", (bucket_of(batch), batch)).one()
        if row is not None:
            return False
    return True


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_a_lagging_consumer_crosses_batches_that_expired_before_older_ones(
    store: Store, consumers: list[Consumer], delivery: str
) -> None:
    """Batches 1-70 keep the queue's hour; the retention is lowered to 2 s for two stretches
    that cross a bucket boundary (64 batches a bucket), with two batches of the hour between
    them; then fresh batches. A consumer that starts from the beginning gets every live
    message, none twice, and its offset passes the head; before, a leased reader and a shared
    member stopped at the second stretch (the bisection for the earliest batch landed in the
    live old prefix, behind them) and waited there for an hour, saying nothing."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "workers", SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=30, delivery=delivery))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    table = store.table(QUEUE)

    async def batches(name: str, count: int, ttl: int) -> dict[str, int]:
        """`count` batches of one message each, written under a table TTL of `ttl`: id -> batch."""
        store.session.execute(f"ALTER TABLE {table} WITH default_time_to_live = {ttl}")
        written = {}
        for i in range(count):
            (result,) = await publisher.publish([OutgoingMessage(f"{name}-{i}".encode())])
            written[result.message_id] = result.batch
        return written

    old = await batches("old", 70, 3600)
    short = await batches("short", 30, SHORT_TTL)
    middle = await batches("middle", 2, 3600)
    short |= await batches("short2", 28, SHORT_TTL)
    fresh = await batches("fresh", 5, 3600)
    await publisher.flush_heads()
    assert sorted(old.values()) == list(range(1, 71))
    # The second stretch runs from bucket 1 (batches 64-127) into bucket 2.
    assert sorted(middle.values()) == [101, 102] and min(fresh.values()) == 131
    await until("the short-lived batches expired", lambda: gone(store, sorted(short.values())))

    consumer = Consumer(store, QUEUE, "workers")
    consumers.append(consumer)
    await consumer.start()
    live = set(old) | set(middle) | set(fresh)
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while not live <= set(seen):
        assert time.monotonic() < deadline, (
            f"stalled: {len(live - set(seen))} live messages never delivered, e.g. "
            f"batches {sorted((old | middle | fresh)[i] for i in live - set(seen))[:5]}")
        deliveries = await consumer.receive(max_messages=50, wait=1.0)
        seen.extend(d.message.message_id for d in deliveries)
        if deliveries:
            await consumer.ack_many([d.receipt for d in deliveries])
    # Every live message once, nothing else; the expired ones were skipped, not lost count of.
    assert sorted(seen) == sorted(live)
    assert consumer.counters.expired_skipped == len(short)
    head = catalog.read_int(store, store.paths(QUEUE).head(0))
    assert head == max(fresh.values())
    await until("the offset passed the head", lambda: catalog.read_offset(
        store, store.paths(QUEUE).subscriber("workers"), 0) == head + 1)


async def test_seeks_and_new_subscribers_find_live_batches_before_a_stretch_a_lowered_retention_expired(
    store: Store,
) -> None:
    """Batches 1-30 under an hour, 31-90 under a retention lowered to a minute, 91-120 under
    the hour again. Once 31-90 have expired, a seek to earliest, a new subscriber starting at
    earliest, and a seek to the time of batch 25 all start at the live batches 1-30. Before,
    their binary searches took any missing batch for the expired prefix of an oldest-first
    log, landed at 91, and skipped 1-30 for good."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "replayer", SubscriberSpec(queue=QUEUE.name, start_position="latest"))

    async def batches(count: int, retention: int) -> list[int]:
        catalog.apply_queue(store, QUEUE, spec.model_copy(update={"retention_seconds": retention}))
        publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
        written = [(await publisher.publish([OutgoingMessage(b"%d" % i)]))[0].batch for i in range(count)]
        await publisher.flush_heads()
        return written

    old = await batches(30, 3600)
    short = await batches(60, 60)
    await batches(30, 3600)
    assert old == list(range(1, 31)) and short == list(range(31, 91))
    state = catalog.read_queue(store, QUEUE)
    assert state.expiry_mixed_until is not None and not state.expiry_in_order(datetime.now(timezone.utc))
    await until("the batches written under a minute's retention expired", lambda: gone(store, short),
                limit_s=240)

    paths = store.paths(QUEUE).subscriber("replayer")
    assert offsets.seek(store, QUEUE, "replayer", SeekTarget("earliest")) == {0: 1}
    assert catalog.read_offset(store, paths, 0) == 1
    batch_25_at = positions.read_header_time(store, QUEUE, 0, 25)
    # Publish times are kept to the millisecond: an earlier batch written in the same one is the first at that time.
    first_then = min(b for b in old if positions.read_header_time(store, QUEUE, 0, b) == batch_25_at)
    assert offsets.seek(store, QUEUE, "replayer", SeekTarget("time", time=batch_25_at)) == {0: first_then}
    catalog.apply_subscriber(store, QUEUE, "late", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    assert catalog.read_offset(store, store.paths(QUEUE).subscriber("late"), 0) == 1


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_a_backlog_that_expired_with_nothing_after_it_is_passed_and_reported_as_no_stall(
    store: Store, consumers: list[Consumer], delivery: str
) -> None:
    """A backlog nobody read expires whole, and nothing is published after it. A consumer that
    then asks for messages finds none; its offset must pass the expired batches, and the shard
    must not be reported stalled: there is nothing left to deliver. Before, shared delivery's
    offset stayed below the expired batches and the stall signal fired."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "workers", SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=30, delivery=delivery,
        stall_after_seconds=1))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    store.session.execute(f"ALTER TABLE {store.table(QUEUE)} WITH default_time_to_live = {SHORT_TTL}")
    written = [(await publisher.publish([OutgoingMessage(b"%d" % i)]))[0].batch for i in range(20)]
    await publisher.flush_heads()
    await until("the backlog expired", lambda: gone(store, written))

    consumer = Consumer(store, QUEUE, "workers")
    consumers.append(consumer)
    await consumer.start()
    head = catalog.read_int(store, store.paths(QUEUE).head(0))
    assert head == max(written)
    paths = store.paths(QUEUE).subscriber("workers")
    deadline = time.monotonic() + 60
    while catalog.read_offset(store, paths, 0) != head + 1:
        assert time.monotonic() < deadline, f"offset {catalog.read_offset(store, paths, 0)} never passed head {head}"
        assert await consumer.receive(max_messages=10, wait=0.5) == []
    stats = await subscriber_stats(store, QUEUE, "workers")
    assert stats.lag_batches == 0 and stats.stalled_shards == [], stats
