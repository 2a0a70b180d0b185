"""An ack resent after its delivery left the member: `already_acked` when it was acked.

An app whose ack answer was lost sends it again; by then its sidecar may no longer hold the
message's shard (a rebalance moved it) or range (it completed). Before, that resend was
answered 409 `stale_receipt`, telling the app its work might be done again, though the ack
rows said the message was acked. A receipt whose message was not acked is still stale.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import StaleReceipt
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = QueueRef("default", "receipts")


async def until(what: str, condition: Callable[[], bool], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def publish(store: Store, shards: int, delivery: str, keys: list[str]) -> None:
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "workers", SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", delivery=delivery))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    await publisher.publish([OutgoingMessage(key.encode(), key=key) for key in keys])
    await publisher.flush_heads()


async def start(consumers: list[Consumer], store: Store) -> Consumer:
    consumer = Consumer(store, QUEUE, "workers")
    consumers.append(consumer)
    await consumer.start()
    return consumer


async def test_a_resent_ack_after_the_shard_moved_is_already_acked(
    store: Store, new_store: Callable[[], Store], consumers: list[Consumer]
) -> None:
    await publish(store, 2, "leased", [f"k{i}" for i in range(8)])  # both shards get some
    first = await start(consumers, new_store())
    await until("the first member holds both shards", lambda: first.held_shards == {0, 1})
    taken = []
    while len(taken) < 8:
        taken.extend(await first.receive(8, wait=10))
    acked, unacked = taken[:-2], taken[-2:]
    assert all(r is True for r in await first.ack_many([d.receipt for d in acked]))
    second = await start(consumers, new_store())
    await until("a shard moved to the second member",
                lambda: len(first.held_shards) == 1 and len(second.held_shards) == 1)
    (moved,) = {0, 1} - first.held_shards
    resent = [d for d in acked if d.message.position.shard == moved]
    assert resent, "the moved shard had acked messages"
    assert await first.ack_many([d.receipt for d in resent]) == [False] * len(resent)  # already acked
    for delivery in unacked:
        if delivery.message.position.shard == moved:
            (result,) = await first.ack_many([delivery.receipt])
            assert isinstance(result, StaleReceipt)  # never acked: its next holder delivers it


async def test_a_resent_ack_after_the_range_completed_is_already_acked(
    store: Store, consumers: list[Consumer]
) -> None:
    await publish(store, 1, "shared", ["a", "b", "c"])
    member = await start(consumers, store)
    taken = []
    while len(taken) < 3:
        taken.extend(await member.receive(3, wait=10))
    assert await member.ack_many([d.receipt for d in taken]) == [True] * 3
    await until("the range completed", lambda: catalog.read_offset(
        store, store.paths(QUEUE).subscriber("workers"), 0) == 2)
    assert await member.ack_many([d.receipt for d in taken]) == [False] * 3
