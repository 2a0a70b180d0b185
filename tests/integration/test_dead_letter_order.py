"""A message moved to the dead-letter queue counts as done only once that is durable.

With ordered keys, a key's next message is handed out once the one before it is done. A
message over its max deliveries is done when its dead-letter copy is published *and* its
DEAD row is written (and its shard still this member's): before, the key moved on as soon
as the copy was published, so a DEAD row that failed left a message that a restart
delivers again after its successor. A member in this process, its DEAD row write failing
at the driver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from casque.engine import catalog, shard_state
from casque.engine.acks import DEAD, AckEvent, AckLog
from casque.engine.consumer import Consumer
from casque.engine.counters import QueueCounters
from casque.engine.history import message_history
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = QueueRef("default", "orders")
DEAD_LETTERS = QueueRef("default", "orders-dead")
SUBSCRIBER = "billing"


@pytest.fixture
async def consumer(store: Store, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Consumer]:
    """A member of an ordered-key subscriber that dead-letters after one delivery, two
    messages of one key published (a move that fails is tried again after 1 s, not 30)."""
    monkeypatch.setattr(shard_state, "DEAD_LETTER_RETRY_SECONDS", 1.0)
    for queue in (QUEUE, DEAD_LETTERS):
        catalog.apply_queue(store, queue, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", ordered_keys=True, max_deliveries=1,
        dead_letter_queue=DEAD_LETTERS.name))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    await publisher.publish([OutgoingMessage(b"first", key="k"), OutgoingMessage(b"second", key="k")])
    await publisher.flush_heads()
    member = Consumer(store, QUEUE, SUBSCRIBER)
    await member.start()
    yield member
    await member.stop()


def failing_dead_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    written = AckLog._write

    async def failing(self: AckLog, events: list[AckEvent]) -> None:
        if any(e.outcome == DEAD for e in events):
            raise BackendUnavailable("Cassandra: OperationTimedOut: errors={}, last_host=injected")
        await written(self, events)

    monkeypatch.setattr(AckLog, "_write", failing)


async def test_a_keys_next_message_waits_until_the_dead_letter_is_durable(
    store: Store, consumer: Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (first,) = await consumer.receive(1, wait=30)
    assert first.message.payload == b"first"
    failing_dead_rows(monkeypatch)
    await consumer.nack(first.receipt)  # its last delivery: to the dead-letter queue at once
    # The copy is published, its DEAD row is not: the key must not move on.
    assert await consumer.receive(1, wait=3) == []
    history = await message_history(store, QUEUE, first.message.message_id)
    assert [s.state for s in history.subscribers] != ["dead_lettered"]
    monkeypatch.undo()  # the row can be written again: the move is tried again and lands
    (second,) = await consumer.receive(1, wait=30)
    assert second.message.payload == b"second"
    history = await message_history(store, QUEUE, first.message.message_id)
    assert [s.state for s in history.subscribers] == ["dead_lettered"]


async def test_a_dead_letter_count_that_fails_leaves_the_message_done(
    store: Store, consumer: Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (first,) = await consumer.receive(1, wait=30)

    async def failing(self: QueueCounters, *args: object) -> None:
        raise BackendUnavailable("Cassandra: WriteTimeout: injected")

    monkeypatch.setattr(QueueCounters, "add", failing)
    await consumer.nack(first.receipt)
    (second,) = await consumer.receive(1, wait=30)  # the key moved on: the DEAD row is written
    assert second.message.payload == b"second"
    history = await message_history(store, QUEUE, first.message.message_id)
    assert [s.state for s in history.subscribers] == ["dead_lettered"]
