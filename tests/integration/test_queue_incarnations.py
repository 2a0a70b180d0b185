"""A queue deleted and created again under its name is a new queue: it inherits no publish
ids, delayed messages or counts of the old one, and running sidecars follow it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import pytest

from casque.engine import catalog
from casque.engine.batches import Log
from casque.engine.consumer import Consumer
from casque.engine.delayed import DelayMover
from casque.engine.messages import OutgoingMessage, Published
from casque.engine.publisher import Publisher
from casque.engine.stats import queue_stats
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState, SubscriberSpec
from casque.store import Store
from tests.fixtures.group import until

QUEUE = QueueRef("default", "reborn")
SPEC = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")


def recreate(store: Store) -> QueueState:
    catalog.delete_queue(store, QUEUE, "Delete")
    catalog.apply_queue(store, QUEUE, SPEC)
    return catalog.read_queue(store, QUEUE)


async def payloads(store: Store, queue: QueueRef = QUEUE) -> list[bytes]:
    """Every message in the queue's log, shard by shard."""
    log = Log(store, queue, SPEC.consistency)
    found: list[bytes] = []
    for shard in SPEC.log_shards():
        head = catalog.read_int(store, store.paths(queue).head(shard))
        batch = 1
        while batch <= head:
            chunk = await log.read_from(shard, batch)
            if not chunk:
                break
            found.extend(m.payload for b in chunk for m in b.messages)
            batch = chunk[-1].header.batch + 1
    return found


@pytest.fixture
async def mover(store: Store) -> AsyncIterator[DelayMover]:
    """A mover that, like a sidecar's, publishes through the current publisher of the queue."""
    publishers: dict[str, Publisher] = {}

    async def publish(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[Published]:
        publisher = publishers.setdefault(state.incarnation, Publisher(store, QUEUE, state))
        results = await publisher.publish([m for _, m in items], [i for i, _ in items])
        await publisher.flush_heads()
        return results

    catalog.apply_queue(store, QUEUE, SPEC)
    running = DelayMover(store, QUEUE, publish, "mover")
    yield running
    await running.stop()
    catalog.delete_queue(store, QUEUE, "Delete")


async def test_each_creation_is_a_new_incarnation_and_an_update_keeps_it(store: Store) -> None:
    catalog.apply_queue(store, QUEUE, SPEC)
    first = catalog.read_queue(store, QUEUE)
    catalog.apply_queue(store, QUEUE, SPEC.model_copy(update={"shards": 3}))
    updated = catalog.read_queue(store, QUEUE)
    assert updated.incarnation == first.incarnation and updated.spec.shards == 3
    catalog.delete_queue(store, QUEUE, "Retain")
    assert catalog.read_queue(store, QUEUE).incarnation == first.incarnation
    again = recreate(store)
    assert again.incarnation and again.incarnation != first.incarnation
    assert again.spec.shards == SPEC.shards
    assert [catalog.read_int(store, store.paths(QUEUE).head(s)) for s in SPEC.log_shards()] == [0, 0]
    catalog.delete_queue(store, QUEUE, "Delete")


async def test_a_recreated_queue_stores_a_client_id_the_old_one_had_seen(store: Store) -> None:
    catalog.apply_queue(store, QUEUE, SPEC)
    old = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (first,) = await old.publish([OutgoingMessage(b"old order", client_id="order-1")])
    await old.flush_heads()
    assert await payloads(store) == [b"old order"]

    new = Publisher(store, QUEUE, recreate(store))
    (second,) = await new.publish([OutgoingMessage(b"new order", client_id="order-1")])
    await new.flush_heads()
    assert not second.duplicate
    assert await payloads(store) == [b"new order"]
    catalog.delete_queue(store, QUEUE, "Delete")


async def test_a_recreated_queue_moves_only_its_own_delayed_messages(store: Store, mover: DelayMover) -> None:
    mover.start()
    async def leading() -> bool:
        return mover.leading

    await until("the mover to lead", leading, 30)
    old = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    soon = datetime.now(timezone.utc) + timedelta(seconds=3)
    await old.publish([OutgoingMessage(b"old, delayed", deliver_at=soon)])
    assert (await queue_stats(store, QUEUE)).delayed == 1

    state = recreate(store)
    assert (await queue_stats(store, QUEUE)).delayed == 0
    new = Publisher(store, QUEUE, state)
    # Due after the old message: the pass that moves it has looked past the old one's time.
    # And still ahead when published, however slow the machine was so far: a message due
    # already (or within IMMEDIATE_SECONDS) goes straight into the log, and nothing would be moved.
    later = max(soon, datetime.now(timezone.utc)) + timedelta(seconds=4)
    (published,) = await new.publish([OutgoingMessage(b"new, delayed", deliver_at=later)])
    assert published.batch == -1, "the new message was due before its publish was done"

    # Moved by the mover, or, on a machine slow enough that the mover's pass went past its due
    # time before the row landed, by its publisher (casque.engine.delayed). The mover counts a
    # move once its publish has returned, which is after the message shows in the log.
    async def moved() -> bool:
        return mover.moved + new.delayed_moves > 0

    await until("the new incarnation's delayed message to be moved", moved, 60)
    assert await payloads(store) == [b"new, delayed"]
    assert mover.delayed is not None and mover.moved + new.delayed_moves == 1
    assert (await queue_stats(store, QUEUE)).delayed == 0


async def test_dead_letters_go_to_the_dead_letter_queues_current_incarnation(store: Store) -> None:
    dead = QueueRef("default", "reborn-dead")
    catalog.apply_queue(store, QUEUE, SPEC)
    catalog.apply_queue(store, dead, SPEC)
    catalog.apply_subscriber(store, QUEUE, "picky", SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", max_deliveries=1, dead_letter_queue=dead.name))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    consumer = Consumer(store, QUEUE, "picky")
    await consumer.start()

    async def dead_letter(payload: bytes) -> None:
        await publisher.publish([OutgoingMessage(payload)])
        await publisher.flush_heads()
        (delivery,) = await consumer.receive(max_messages=1, wait=30)
        assert delivery.message.payload == payload
        await consumer.nack(delivery.receipt)

        async def arrived() -> bool:
            assert await consumer.receive(max_messages=1) == []  # over max deliveries: dead-lettered instead
            return payload in await payloads(store, dead)

        await until(f"{payload!r} in the dead-letter queue", arrived, 60)

    try:
        await dead_letter(b"first poison")
        catalog.delete_queue(store, dead, "Delete")
        catalog.apply_queue(store, dead, SPEC)
        await dead_letter(b"second poison")
        assert await payloads(store, dead) == [b"second poison"]
    finally:
        await consumer.stop()
        for queue in (QUEUE, dead):
            catalog.delete_queue(store, queue, "Delete")
