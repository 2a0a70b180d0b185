"""Subscribing on a real Cassandra and ZooKeeper: fan-out, competing consumers, crashes, seek."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import pytest
from kazoo.client import KazooClient

from casque.engine import catalog, offsets, shard_reader
from casque.engine.consumer import Consumer
from casque.engine.leases import assign
from casque.engine.messages import Delivery, OutgoingMessage
from casque.engine.offsets import OffsetRecord, SeekTarget, seek
from casque.engine.publisher import Publisher
from casque.errors import StaleReceipt
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque.znodes import SubscriberPaths

QUEUE = QueueRef("default", "work")


async def setup_queue(store: Store, shards: int, subscribers: list[str], start: str = "earliest") -> QueueSpec:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    for name in subscribers:
        catalog.apply_subscriber(store, QUEUE, name, SubscriberSpec(queue=QUEUE.name, start_position=start,
                                                                     visibility_timeout_seconds=30))
    return spec


async def publish_many(store: Store, spec: QueueSpec, n: int, prefix: str = "m") -> set[str]:
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    results = await asyncio.gather(
        *(publisher.publish([OutgoingMessage(f"{prefix}{i}".encode(), key=f"k{i}")]) for i in range(n))
    )
    await publisher.flush_heads()
    return {r[0].message_id for r in results}


async def drain(consumer: Consumer, expected: int, ack: bool = True, limit_s: float = 60) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + limit_s
    while len(got) < expected and time.monotonic() < deadline:
        batch = await consumer.receive(max_messages=50, wait=1.0)
        if ack:
            await asyncio.gather(*(consumer.ack(d.receipt) for d in batch))
        got.extend(batch)
    return got


async def wait_for(condition: Callable[[], bool], limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_every_acked_publish_is_delivered_once_and_offsets_reach_the_head(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = await setup_queue(store, shards=3, subscribers=["billing"])
    published = await publish_many(store, spec, 300)
    consumer = Consumer(store, QUEUE, "billing")
    consumers.append(consumer)
    await consumer.start()
    got = await drain(consumer, 300)
    counts = Counter(d.message.message_id for d in got)
    assert set(counts) == published and max(counts.values()) == 1
    # Per shard, delivery order is log order.
    for shard in range(3):
        positions = [(d.message.position.batch, d.message.position.seq) for d in got if d.message.position.shard == shard]
        assert positions == sorted(positions)
    for reader in consumer.readers.values():
        await reader.commit()
    for shard in range(3):
        head = catalog.read_int(store, store.paths(QUEUE).head(shard))
        offset = catalog.read_offset(store, store.paths(QUEUE).subscriber("billing"), shard)
        assert offset == head + 1


async def test_two_subscribers_each_see_everything(store: Store, consumers: list[Consumer]) -> None:
    spec = await setup_queue(store, shards=2, subscribers=["audit", "mailer"])
    published = await publish_many(store, spec, 120)
    for name in ("audit", "mailer"):
        consumer = Consumer(store, QUEUE, name)
        consumers.append(consumer)
        await consumer.start()
        assert {d.message.message_id for d in await drain(consumer, 120)} == published


async def test_long_poll_wakes_on_publish(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slow recheck of a caught-up shard is out of reach: only the head watch can wake it.
    monkeypatch.setattr(shard_reader, "CAUGHT_UP_RECHECK_SECONDS", 3600.0)
    spec = await setup_queue(store, shards=1, subscribers=["waiter"], start="latest")
    consumer = Consumer(store, QUEUE, "waiter")
    consumers.append(consumer)
    await consumer.start()
    await wait_for(lambda: consumer.held_shards == {0} and consumer.readers[0].caught_up)
    receiving = asyncio.create_task(consumer.receive(max_messages=1, wait=120))
    await wait_for(lambda: consumer.waiting_receives == 1)
    published = await publish_many(store, spec, 1)
    deliveries = await receiving
    assert {d.message.message_id for d in deliveries} == published


async def test_competing_consumers_split_shards_and_a_crash_redelivers_only_unacked(
    store: Store, new_store: Callable[[], Store], consumers: list[Consumer]
) -> None:
    spec = await setup_queue(store, shards=4, subscribers=["workers"])
    published = await publish_many(store, spec, 200)
    a_store, b_store = new_store(), new_store()
    a, b = Consumer(a_store, QUEUE, "workers", member_id="a"), Consumer(b_store, QUEUE, "workers", member_id="b")
    consumers.append(a)
    await a.start()
    await b.start()
    shares = assign(["a", "b"], [0, 1, 2, 3])
    assert len(shares["a"]) == len(shares["b"]) == 2
    await wait_for(lambda: a.held_shards == shares["a"] and b.held_shards == shares["b"])

    # b takes some messages, acks half of them, then its process dies (session closed, no release).
    taken = await b.receive(max_messages=20, wait=5)
    assert taken
    acked_by_b = {d.message.message_id for d in taken[::2]}
    for d in taken[::2]:
        await b.ack(d.receipt)
    await b.acks.flush()
    b_store.zk.stop()  # the sidecar is gone: ephemeral member and leases vanish

    await wait_for(lambda: a.held_shards == {0, 1, 2, 3})
    rest = await drain(a, len(published) - len(acked_by_b))
    from_a = Counter(d.message.message_id for d in rest)
    assert max(from_a.values()) == 1
    assert set(from_a) == published - acked_by_b  # unacked ones came back, acked ones did not


async def test_stale_receipt_after_visibility_expiry_and_nack_delay(store: Store, consumers: list[Consumer]) -> None:
    spec = await setup_queue(store, shards=1, subscribers=["slow"])
    await publish_many(store, spec, 1)
    consumer = Consumer(store, QUEUE, "slow")
    consumers.append(consumer)
    await consumer.start()
    (first,) = await consumer.receive(max_messages=1, wait=10, visibility=0.2)
    (second,) = await consumer.receive(max_messages=1, wait=10, visibility=30)
    assert second.message.message_id == first.message.message_id
    assert second.delivery_count == 2
    with pytest.raises(StaleReceipt):
        await consumer.ack(first.receipt)
    await consumer.nack(second.receipt, delay=0.3)
    assert await consumer.receive(max_messages=1, wait=0) == []
    (third,) = await consumer.receive(max_messages=1, wait=10)
    assert third.delivery_count == 3
    assert await consumer.ack(third.receipt) is True
    assert await consumer.ack(third.receipt) is False


async def test_seek_to_earliest_replays_and_seek_to_latest_skips(store: Store, consumers: list[Consumer]) -> None:
    spec = await setup_queue(store, shards=2, subscribers=["replayer"])
    published = await publish_many(store, spec, 60)
    consumer = Consumer(store, QUEUE, "replayer")
    consumers.append(consumer)
    await consumer.start()
    assert {d.message.message_id for d in await drain(consumer, 60)} == published
    await consumer.acks.flush()

    await asyncio.to_thread(seek, store, QUEUE, "replayer", SeekTarget("earliest"))
    replayed = await drain(consumer, 60)
    assert Counter(d.message.message_id for d in replayed) == Counter(published)

    await asyncio.to_thread(seek, store, QUEUE, "replayer", SeekTarget("latest"))
    later = await publish_many(store, spec, 5, prefix="late")
    assert {d.message.message_id for d in await drain(consumer, 5)} == later


async def test_stats_report_published_lag_and_in_flight(store: Store, consumers: list[Consumer]) -> None:
    from casque.engine.stats import queue_stats, subscriber_stats

    spec = await setup_queue(store, shards=2, subscribers=["counted"])
    await publish_many(store, spec, 40)
    before = await queue_stats(store, QUEUE)
    assert before.published_messages == 40
    assert before.published_bytes == sum(len(f"m{i}") + len(f"k{i}") for i in range(40))  # payload and key
    lagging = await subscriber_stats(store, QUEUE, "counted")
    assert lagging.lag_messages == 40 and lagging.lag_batches == before.batches
    assert lagging.oldest_unacked_age_seconds is not None

    consumer = Consumer(store, QUEUE, "counted")
    consumers.append(consumer)
    await consumer.start()
    held = await drain(consumer, 10, ack=False, limit_s=30)
    await consumer.publish_report()
    during = await subscriber_stats(store, QUEUE, "counted")
    assert during.in_flight == len(held) and during.members == [consumer.member_id]
    for d in held:
        await consumer.ack(d.receipt)
    await drain(consumer, 40 - len(held))
    for reader in consumer.readers.values():
        await reader.commit()
    after = await subscriber_stats(store, QUEUE, "counted")
    assert after.lag_messages == 0 and after.lag_batches == 0 and after.oldest_unacked_age_seconds is None


@pytest.mark.parametrize("acked", ["one of its batch", "its whole batch"])
async def test_an_ack_between_a_seek_and_the_member_noticing_it_is_stale(
    store: Store, consumers: list[Consumer], acked: str
) -> None:
    """A seek is answered once its transaction is in ZooKeeper; members learn of it through a
    watch, later. A delivery acked in between is one the seek replays, so its ack must not be
    answered `acked` (the message comes again): it is stale, as the API says of receipts a seek
    made old. One of a batch's messages is made durable by an ack row, a whole batch by an
    offset write: both ways."""
    await setup_queue(store, shards=1, subscribers=["late"])
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    results = await publisher.publish([OutgoingMessage(f"s{i}".encode()) for i in range(3)])
    await publisher.flush_heads()
    assert len({r.batch for r in results}) == 1
    consumer = Consumer(store, QUEUE, "late")
    consumers.append(consumer)
    await consumer.start()
    delivered = await drain(consumer, 3, ack=False)
    assert len(delivered) == 3

    consumer.resync = lambda: None  # type: ignore[method-assign]  # the seek's watch is late here
    await asyncio.to_thread(seek, store, QUEUE, "late", SeekTarget("earliest"))
    chosen = delivered[:1] if acked == "one of its batch" else delivered
    answers = await consumer.ack_many([d.receipt for d in chosen])
    assert all(isinstance(a, StaleReceipt) for a in answers), answers

    del consumer.resync  # the watch arrives
    consumer.resync()
    replayed = await drain(consumer, 3)
    assert Counter(d.message.message_id for d in replayed) == Counter(r.message_id for r in results)


async def test_an_ack_call_looks_for_seeks_with_one_read_whatever_its_shards(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a seek moved the shards of an ack call's deliveries is told by one read of the
    subscriber's seek mark, not by one offset read per shard; after a seek of one shard, too,
    once the member has applied it, and the other shards' acks are still answered."""
    spec = await setup_queue(store, shards=4, subscribers=["marks"])
    await publish_many(store, spec, 60)
    consumer = Consumer(store, QUEUE, "marks")
    consumers.append(consumer)
    await consumer.start()
    delivered = await drain(consumer, 60, ack=False)
    by_shard: dict[int, list[Delivery]] = {}
    for d in delivered:
        by_shard.setdefault(d.message.position.shard, []).append(d)
    assert len(by_shard) >= 3, by_shard.keys()
    offset_reads: list[int] = []
    read_offset = offsets.read_offset

    async def counted(client: KazooClient, paths: SubscriberPaths, shard: int) -> OffsetRecord:
        offset_reads.append(shard)
        return await read_offset(client, paths, shard)

    monkeypatch.setattr(offsets, "read_offset", counted)
    first = [ds[0] for ds in by_shard.values()]
    assert await consumer.ack_many([d.receipt for d in first]) == [True] * len(first)
    assert offset_reads == [], "an ack call read offsets to look for seeks"

    moved, *others = sorted(by_shard)
    offset = consumer.readers[moved].state.offset
    await asyncio.to_thread(seek, store, QUEUE, "marks", SeekTarget("batch", batches={moved: offset}))
    mark = (await asyncio.to_thread(store.zk.exists, consumer.paths.seek)).mzxid
    await wait_for(lambda: all(r.seek_mark == mark for r in consumer.readers.values()))
    offset_reads.clear()
    rest = [d for shard in others for d in by_shard[shard][1:]]
    assert await consumer.ack_many([d.receipt for d in rest]) == [True] * len(rest)
    assert offset_reads == [], "an ack call after an applied seek read offsets to look for seeks"
