"""Shared delivery benchmark: receive+ack with more members than shards, and its ZooKeeper cost.

    python bench/bench_shared.py [--messages 20000] [--size 256] [--shards 2] [--runs 3]
        [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. A
backlog of `--messages` is published once to a `--shards` queue (100 messages a publish
call); each run then drains it with a new subscriber per group size: a leased subscriber
with one member per shard (the most leased delivery can use), and shared subscribers with
1, 2, 4 and 8 members. The members are consumers in this process, each receiving up to 100
messages a call and acking them, so the figures show what the protocol costs, not more
CPUs: on a 2-core machine the members share the same cores.

Figures: msgs/s for each group, each shared group's rate as a ratio of the leased one of the
same run, and ZooKeeper writes per 1,000 messages in shared delivery (claims, renewals,
completions; the goal is at most 10).
"""

from __future__ import annotations

import asyncio
import time

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import Figure, arguments, drop_scratch, parse, repeat_async, report, scratch_settings

GROUPS = (1, 2, 4, 8)
RECEIVE_MAX = 100
PUBLISH_CALL = 100


async def publish_backlog(store: Store, queue: QueueRef, count: int, size: int) -> None:
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    payload = b"x" * size
    calls = [publisher.publish([OutgoingMessage(payload, key=f"k{i}") for i in range(start, min(count, start + PUBLISH_CALL))])
             for start in range(0, count, PUBLISH_CALL)]
    for start in range(0, len(calls), 32):
        await asyncio.gather(*calls[start:start + 32])
    await publisher.flush_heads()


async def drain(store: Store, queue: QueueRef, subscriber: str, members: int, messages: int) -> tuple[float, int]:
    """Seconds for `members` consumers of `subscriber` to receive and ack `messages`; ZooKeeper
    writes of their shared delivery."""
    group = [Consumer(store, queue, subscriber) for _ in range(members)]
    for consumer in group:
        await consumer.start()
    done = 0
    finished = asyncio.Event()

    async def member(consumer: Consumer) -> None:
        nonlocal done
        while not finished.is_set():
            got = await consumer.receive(max_messages=RECEIVE_MAX, wait=0.5)
            if got:
                results = await consumer.ack_many([d.receipt for d in got])
                done += sum(1 for r in results if r is True)
                if done >= messages:
                    finished.set()

    started = time.perf_counter()
    await asyncio.gather(*(member(c) for c in group))
    seconds = time.perf_counter() - started
    writes = sum(c._sharing.zk_writes for c in group if c._sharing is not None)
    for consumer in group:
        await consumer.stop()
    return seconds, writes


async def once(store: Store, args: object, run: int) -> dict[str, float]:
    messages: int = getattr(args, "messages")
    queue = QueueRef("default", f"shared-{run}")
    catalog.apply_queue(store, queue, QueueSpec(shards=getattr(args, "shards"), retention_seconds=3600,
                                                consistency="ONE"))
    await publish_backlog(store, queue, messages, getattr(args, "size"))
    figures: dict[str, float] = {}

    def subscribe(name: str, delivery: str) -> str:
        catalog.apply_subscriber(store, queue, name, SubscriberSpec(
            queue=queue.name, start_position="earliest", visibility_timeout_seconds=60, delivery=delivery))
        return name

    leased_seconds, _ = await drain(store, queue, subscribe("leased", "leased"), getattr(args, "shards"), messages)
    leased_rate = messages / leased_seconds
    figures["leased"] = leased_rate
    writes_total = 0
    for members in GROUPS:
        seconds, writes = await drain(store, queue, subscribe(f"shared-{members}", "shared"), members, messages)
        figures[f"shared_{members}"] = messages / seconds
        figures[f"shared_{members}_ratio"] = messages / seconds / leased_rate
        writes_total += writes
    figures["zk_writes_per_1000"] = writes_total * 1000 / (messages * len(GROUPS))
    return figures


FIGURES = [
    Figure("leased", "leased: one member per shard (the limit of leases)", "msgs/s"),
    *(f for members in GROUPS for f in (
        Figure(f"shared_{members}", f"shared: {members} member{'s' if members > 1 else ''}", "msgs/s"),
        Figure(f"shared_{members}_ratio", "  ratio of leased", "x"))),
    Figure("zk_writes_per_1000", "shared: ZooKeeper writes per 1,000 messages (goal <= 10)", ""),
]


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], messages=20000, size=256)
    parser.set_defaults(shards=2)
    args = parse(parser, smoke_messages=800)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        samples = await repeat_async(args.runs, lambda run: once(store, args, run))
    finally:
        drop_scratch(store, settings)
        store.close()
    report("shared", args, {"messages": args.messages, "shards": args.shards, "size": args.size,
                            "receive max": RECEIVE_MAX}, FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
