"""Priorities, dead letters and redrive on the real servers."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import pytest

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.deadletters import DELIVERIES, LAST_ERROR, MESSAGE_ID, SOURCE, redrive
from casque.engine.messages import OutgoingMessage
from casque.engine.offsets import SeekTarget, seek
from casque.engine.publisher import Publisher
from casque.engine.stats import queue_stats
from casque.errors import InvalidSpec, PositionOutOfRange
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

ORDERS = QueueRef("default", "orders")
DEAD = QueueRef("default", "orders-dead")


async def start(store: Store, queue: QueueRef, name: str, consumers: list[Consumer]) -> Consumer:
    consumer = Consumer(store, queue, name)
    consumers.append(consumer)
    await consumer.start()
    return consumer


async def test_higher_priorities_first_without_starving_lower(store: Store, consumers: list[Consumer]) -> None:
    spec = QueueSpec(shards=1, priorities=3, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, ORDERS, spec)
    catalog.apply_subscriber(store, ORDERS, "picker", SubscriberSpec(queue="orders", start_position="earliest"))
    publisher = Publisher(store, ORDERS, catalog.read_queue(store, ORDERS))
    for level in (0, 1, 2):
        await publisher.publish([OutgoingMessage(f"p{level}-{i}".encode(), priority=level) for i in range(100)])
    with pytest.raises(InvalidSpec, match="priority 3"):
        await publisher.publish([OutgoingMessage(b"x", priority=3)])
    await publisher.flush_heads()
    consumer = await start(store, ORDERS, "picker", consumers)
    # Let every level's reader load its messages, so the order below is the policy's alone.
    for _ in range(600):
        if len(consumer.readers) == 3 and all(r.state.loaded_messages == 100 for r in consumer.readers.values()):
            break
        await asyncio.sleep(0.05)
    order: list[int] = []
    while len(order) < 300:
        deliveries = await consumer.receive(max_messages=10, wait=10)
        assert deliveries
        order.extend(int(d.message.payload[1:2]) for d in deliveries)
        await consumer.ack_many([d.receipt for d in deliveries])
    first_hundred = order[:100]
    # The highest level first, but every tenth delivery serves the lower levels (and every
    # tenth of those the lowest).
    assert (first_hundred.count(2), first_hundred.count(1), first_hundred.count(0)) == (90, 9, 1)
    assert sorted(order) == [0] * 100 + [1] * 100 + [2] * 100
    assert (await queue_stats(store, ORDERS)).published_by_priority() == {0: 100, 1: 100, 2: 100}
    last_high = max(i for i, level in enumerate(order) if level == 2)
    first_low = min(i for i, level in enumerate(order) if level == 0)
    assert first_low < last_high  # level 0 was not starved until level 2 ran dry


def id_lifetimes(store: Store, queue: QueueRef, prefix: str) -> list[int]:
    """Seconds left to the `client_ids` rows of `queue` whose client id starts with `prefix`."""
    key = catalog.read_queue(store, queue).shared_key(queue)
    rows = store.session.execute(
        f"SELECT client_id, TTL(message_id) AS left FROM {store.keyspace}.client_ids WHERE queue = %s ALLOW FILTERING",
        (key,))
    return [row.left for row in rows if row.client_id.startswith(prefix)]


async def test_poison_message_is_dead_lettered_after_max_deliveries_and_redriven(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    for queue in (ORDERS, DEAD):
        catalog.apply_queue(store, queue, spec)
    catalog.apply_subscriber(store, ORDERS, "billing", SubscriberSpec(
        queue="orders", start_position="earliest", max_deliveries=3, dead_letter_queue="orders-dead"))
    catalog.apply_subscriber(store, ORDERS, "audit", SubscriberSpec(queue="orders", start_position="earliest"))
    catalog.apply_subscriber(store, DEAD, "inspector", SubscriberSpec(queue="orders-dead", start_position="earliest"))
    publisher = Publisher(store, ORDERS, catalog.read_queue(store, ORDERS))
    (poison,) = await publisher.publish([OutgoingMessage(b"poison", key="p", attributes={"kind": "bad"})])
    await publisher.publish([OutgoingMessage(f"fine-{i}".encode(), key=str(i)) for i in range(20)])
    await publisher.flush_heads()

    billing = await start(store, ORDERS, "billing", consumers)
    poison_deliveries = 0
    fine = 0
    while poison_deliveries < 3 or fine < 20:
        for d in await billing.receive(max_messages=10, wait=10):
            if d.message.payload == b"poison":
                poison_deliveries += 1
                assert d.delivery_count == poison_deliveries
                await billing.nack(d.receipt, error=f"cannot parse (attempt {d.delivery_count})")
            else:
                fine += 1
                await billing.ack(d.receipt)
    # The fourth delivery does not happen: the message goes to the dead-letter queue instead.
    assert await billing.receive(max_messages=10, wait=1) == []
    inspector = await start(store, DEAD, "inspector", consumers)
    (dead,) = await inspector.receive(max_messages=10, wait=15)
    assert dead.message.payload == b"poison" and dead.message.attributes["kind"] == "bad"
    assert dead.message.attributes[SOURCE] == ORDERS.key
    assert dead.message.attributes[MESSAGE_ID] == poison.message_id
    assert dead.message.attributes[DELIVERIES] == "3"
    assert dead.message.attributes[LAST_ERROR] == "cannot parse (attempt 3)"
    assert billing.counters.dead_lettered == 1

    # Redrive brings it back to billing only; audit, which never failed it, does not see it twice.
    result = await redrive(store, DEAD)
    assert result.redriven == 1
    assert (await redrive(store, DEAD)).redriven == 0  # a rerun doubles nothing
    # ... at any distance: the dead letter's and the redrive's ids are remembered as long as
    # what they copy is kept (an hour here), not for the 10 minutes of an app's ids.
    assert id_lifetimes(store, DEAD, "dlq/") == [pytest.approx(3600, abs=120)]
    assert id_lifetimes(store, ORDERS, "redrive/") == [pytest.approx(3600, abs=120)]
    (again,) = await billing.receive(max_messages=10, wait=15)
    assert again.message.payload == b"poison" and again.delivery_count == 1
    await billing.ack(again.receipt)
    audit = await start(store, ORDERS, "audit", consumers)
    seen = []
    while len(seen) < 21:
        batch = await audit.receive(max_messages=50, wait=5)
        assert batch, f"audit saw only {len(seen)}"
        seen.extend(d.message.payload for d in batch)
        await audit.ack_many([d.receipt for d in batch])
    assert seen.count(b"poison") == 1
    assert await audit.receive(max_messages=10, wait=1) == []
    assert (await queue_stats(store, DEAD)).published_messages == 1
    from casque.engine.stats import subscriber_stats

    assert (await subscriber_stats(store, ORDERS, "billing")).dead_lettered == 1

    # A subscriber deleted and created again under the same name counts afresh.
    catalog.delete_subscriber(store, ORDERS, "billing")
    catalog.apply_subscriber(store, ORDERS, "billing", SubscriberSpec(
        queue="orders", max_deliveries=3, dead_letter_queue="orders-dead"))
    assert (await subscriber_stats(store, ORDERS, "billing")).dead_lettered == 0


async def test_an_expired_message_is_never_delivered(store: Store, consumers: list[Consumer]) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, ORDERS, spec)
    catalog.apply_subscriber(store, ORDERS, "late", SubscriberSpec(queue="orders", start_position="earliest"))
    publisher = Publisher(store, ORDERS, catalog.read_queue(store, ORDERS))
    await publisher.publish([OutgoingMessage(b"flash", ttl_seconds=1)])
    expired_by = datetime.now(timezone.utc) + timedelta(seconds=1)  # its expiry is before this
    (lasting,) = await publisher.publish([OutgoingMessage(b"lasting")])
    await publisher.flush_heads()
    while datetime.now(timezone.utc) <= expired_by:  # wall clock: the one expiry is defined in
        await asyncio.sleep(0.05)
    consumer = await start(store, ORDERS, "late", consumers)
    (only,) = await consumer.receive(max_messages=10, wait=10)
    assert only.message.message_id == lasting.message_id
    await consumer.ack(only.receipt)
    assert await consumer.receive(max_messages=10, wait=0.5) == []


async def test_seek_older_than_retention_is_refused(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, ORDERS, spec)
    catalog.apply_subscriber(store, ORDERS, "seeker", SubscriberSpec(queue="orders"))
    with pytest.raises(PositionOutOfRange, match="older than the queue's retention"):
        await asyncio.to_thread(
            seek, store, ORDERS, "seeker", SeekTarget("time", time=datetime.now(timezone.utc) - timedelta(hours=2))
        )
    with pytest.raises(PositionOutOfRange, match="cannot seek to batch 50"):
        await asyncio.to_thread(seek, store, ORDERS, "seeker", SeekTarget("batch", batches={0: 50}))


async def write_dead_letters(store: Store, sources: list[QueueRef], first: int = 0) -> None:
    """Dead letters in DEAD, one from each source given, as consumers write them, over both shards."""
    dead_letters = Publisher(store, DEAD, catalog.read_queue(store, DEAD))
    for i, source in enumerate(sources, start=first):
        await dead_letters.publish([OutgoingMessage(
            f"dead-{i}".encode(), key=str(i), attributes={SOURCE: source.key, MESSAGE_ID: f"m-{i}"},
            client_id=f"dlq/{source.key}/billing/0/0/1/{i}")])
    await dead_letters.flush_heads()


async def test_a_redrive_rerun_past_the_id_window_sends_nothing_twice(
    store: Store
) -> None:
    # An app's ids are remembered 10 s (the shortest window); the redrive's, as long as the dead letters live.
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE", deduplication_window_seconds=10)
    for queue in (ORDERS, DEAD):
        catalog.apply_queue(store, queue, spec)
    await write_dead_letters(store, [ORDERS] * 3)
    assert (await redrive(store, DEAD)).redriven == 3
    # The run's watermark lost, as if it had died before recording it: the ids must hold.
    store.zk.delete(store.paths(DEAD).redrive)
    app = Publisher(store, ORDERS, catalog.read_queue(store, ORDERS))
    await app.publish([OutgoingMessage(b"by the app", client_id="app-1")])
    deadline = time.monotonic() + 60
    while id_lifetimes(store, ORDERS, "app-1"):  # the window has passed
        assert time.monotonic() < deadline, "the app's id outlived its window"
        await asyncio.sleep(0.2)
    again = await redrive(store, DEAD)
    assert (again.redriven, again.duplicates) == (0, 3)


async def test_redrive_in_parts_sends_every_dead_letter_back_once(store: Store) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    other = QueueRef("default", "returns")
    for queue in (ORDERS, other, DEAD):
        catalog.apply_queue(store, queue, spec)
    await write_dead_letters(store, [ORDERS if i % 2 else other for i in range(7)])

    first = await redrive(store, DEAD, limit=3)
    assert (first.redriven, first.duplicates) == (3, 0)
    rest = await redrive(store, DEAD)
    assert rest.redriven == 4  # and those of the first run it read again are duplicates
    assert rest.by_source == {k: v - first.by_source.get(k, 0) for k, v in {ORDERS.key: 3, other.key: 4}.items()}
    # A rerun starts at the watermark: nothing to read, nothing sent.
    again = await redrive(store, DEAD)
    assert (again.redriven, again.duplicates) == (0, 0)
    await write_dead_letters(store, [other], first=7)
    assert (await redrive(store, DEAD)).by_source == {other.key: 1}
    assert [(await queue_stats(store, q)).published_messages for q in (ORDERS, other)] == [3, 5]


async def test_redrive_follows_no_dead_letter_whose_source_is_outside_its_namespace(store: Store) -> None:
    # A tenant writes its dead-letter queue's rows itself (its own keyspace): a forged dead
    # letter may name any source. The redrive, run with the installation's rights, must not
    # publish into another namespace's queue, nor stop at a source it cannot read.
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    elsewhere = QueueRef("other", "orders")
    for queue in (ORDERS, DEAD, elsewhere):
        catalog.apply_queue(store, queue, spec)
    await write_dead_letters(store, [ORDERS])
    forged = Publisher(store, DEAD, catalog.read_queue(store, DEAD))
    for i, source in enumerate([elsewhere.key, "Not A Queue", "a/b/c", DEAD.key, elsewhere.key], start=1):
        await forged.publish([OutgoingMessage(b"forged", attributes={SOURCE: source, MESSAGE_ID: f"f-{i}"})])
    await forged.flush_heads()

    result = await redrive(store, DEAD)
    assert (result.redriven, result.by_source) == (1, {ORDERS.key: 1})
    assert result.skipped == {elsewhere.key: 2, "Not A Queue": 1, "a/b/c": 1, DEAD.key: 1}
    assert (await queue_stats(store, elsewhere)).published_messages == 0
    again = await redrive(store, DEAD)  # skipped ones are passed, as redriven ones are
    assert (again.redriven, again.skipped) == (0, {})
