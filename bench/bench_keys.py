"""Ordered keys benchmark: publish-to-first-delivery latency of a shared subscriber with and
without `orderedKeys`, at a steady publish rate, in the same run.

    python bench/bench_keys.py [--messages 2600] [--rate 65] [--keys 40] [--members 4] [--shards 2]
        [--runs 3] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. One
queue, two shared subscribers of it, one with `orderedKeys` and one without, each with
`--members` consumers in this process that receive (up to 10 messages a call, a long poll)
and ack at once. One publisher sends `--messages` single-message publishes at `--rate` a
second, each with one of `--keys` keys and its send time in the payload; both subscribers
see the same publishes on the same cores, so their latencies compare within a run.

Figures: p50 and p99 of send-to-first-delivery per subscriber, the ordered p50 over the
unordered p50 (the goal: at most 2), and each subscriber's ZooKeeper writes (claims,
renewals, completions, published key sets) per 1,000 messages.
"""

from __future__ import annotations

import asyncio
import struct
import time

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import Figure, arguments, drop_scratch, parse, percentiles, repeat_async, report, scratch_settings

RECEIVE_MAX = 10
RECEIVE_WAIT = 1.0
# After the last publish, how long the subscribers may take to deliver the rest.
DRAIN_LIMIT_SECONDS = 120.0
SUBSCRIBERS = {"unordered": False, "ordered": True}


class Group:
    """The members of one subscriber, and each message's first delivery latency."""

    def __init__(self, store: Store, queue: QueueRef, name: str, members: int) -> None:
        self.consumers = [Consumer(store, queue, name) for _ in range(members)]
        self.latency: dict[str, float] = {}
        self.expected = 0
        self.all_seen = asyncio.Event()

    async def start(self) -> None:
        for consumer in self.consumers:
            await consumer.start()

    async def member(self, consumer: Consumer, stop: asyncio.Event) -> None:
        while not stop.is_set():
            got = await consumer.receive(max_messages=RECEIVE_MAX, wait=RECEIVE_WAIT)
            now = time.time()
            for delivery in got:
                (sent,) = struct.unpack("!d", delivery.message.payload[:8])
                self.latency.setdefault(delivery.message.message_id, now - sent)
            if got:
                await consumer.ack_many([d.receipt for d in got])
            if self.expected and len(self.latency) >= self.expected:
                self.all_seen.set()

    async def stop(self) -> None:
        for consumer in self.consumers:
            await consumer.stop()

    def zk_writes(self) -> int:
        return sum(c._sharing.zk_writes for c in self.consumers if c._sharing is not None)


async def publish_steadily(store: Store, queue: QueueRef, count: int, rate: float, keys: int, size: int) -> None:
    """`count` single-message publishes, one every 1/rate s (each sent on time, not after the last answer)."""
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    padding = b"x" * max(0, size - 8)
    started = time.monotonic()
    calls: list[asyncio.Task[object]] = []
    for i in range(count):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        message = OutgoingMessage(struct.pack("!d", time.time()) + padding, key=f"key-{i % keys}")
        calls.append(asyncio.create_task(publisher.publish([message])))
    await asyncio.gather(*calls)
    await publisher.flush_heads()


async def once(store: Store, args: object, run: int) -> dict[str, float]:
    messages: int = getattr(args, "messages")
    queue = QueueRef("default", f"keys-{run}")
    catalog.apply_queue(store, queue, QueueSpec(shards=getattr(args, "shards"), retention_seconds=3600,
                                                consistency="ONE"))
    groups: dict[str, Group] = {}
    for name, ordered in SUBSCRIBERS.items():
        catalog.apply_subscriber(store, queue, name, SubscriberSpec(
            queue=queue.name, start_position="earliest", visibility_timeout_seconds=30, delivery="shared",
            ordered_keys=ordered))
        groups[name] = Group(store, queue, name, getattr(args, "members"))
    for group in groups.values():
        await group.start()
    stop = asyncio.Event()
    members = [asyncio.create_task(group.member(consumer, stop))
               for group in groups.values() for consumer in group.consumers]
    try:
        await publish_steadily(store, queue, messages, getattr(args, "rate"), getattr(args, "keys"),
                               getattr(args, "size"))
        for group in groups.values():
            group.expected = messages
            if len(group.latency) >= messages:
                group.all_seen.set()
        try:
            await asyncio.wait_for(asyncio.gather(*(g.all_seen.wait() for g in groups.values())),
                                   DRAIN_LIMIT_SECONDS)
        except TimeoutError:
            seen = {name: len(group.latency) for name, group in groups.items()}
            raise SystemExit(f"not every message delivered {DRAIN_LIMIT_SECONDS:.0f}s after the last "
                             f"publish: {seen} of {messages}") from None
    finally:
        stop.set()
        await asyncio.gather(*members)
        writes = {name: group.zk_writes() for name, group in groups.items()}
        for group in groups.values():
            await group.stop()
    figures: dict[str, float] = {}
    for name, group in groups.items():
        p50, p99 = percentiles(list(group.latency.values()))
        figures[f"{name}_p50"], figures[f"{name}_p99"] = p50, p99
        figures[f"{name}_zk_writes_per_1000"] = writes[name] * 1000 / messages
    figures["ratio_p50"] = figures["ordered_p50"] / figures["unordered_p50"]
    figures["ratio_p99"] = figures["ordered_p99"] / figures["unordered_p99"]
    return figures


FIGURES = [
    Figure("unordered_p50", "shared, no orderedKeys: publish to first delivery p50", "ms"),
    Figure("unordered_p99", "  p99", "ms"),
    Figure("ordered_p50", "shared, orderedKeys: publish to first delivery p50", "ms"),
    Figure("ordered_p99", "  p99", "ms"),
    Figure("ratio_p50", "ordered p50 / unordered p50 (goal <= 2)", "x"),
    Figure("ratio_p99", "ordered p99 / unordered p99", "x"),
    Figure("unordered_zk_writes_per_1000", "no orderedKeys: ZooKeeper writes per 1,000 messages", ""),
    Figure("ordered_zk_writes_per_1000", "orderedKeys: ZooKeeper writes per 1,000 messages", ""),
]


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], messages=2600, size=64)
    parser.set_defaults(shards=2)
    parser.add_argument("--rate", type=float, default=65.0, help="publishes a second")
    parser.add_argument("--keys", type=int, default=40)
    parser.add_argument("--members", type=int, default=4, help="members of each subscriber")
    args = parse(parser, smoke_messages=200)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        samples = await repeat_async(args.runs, lambda run: once(store, args, run))
    finally:
        drop_scratch(store, settings)
        store.close()
    report("keys", args, {"messages": args.messages, "rate": args.rate, "keys": args.keys,
                          "members": args.members, "shards": args.shards}, FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
