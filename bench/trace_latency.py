"""The life of one message, step by step, in each delivery mode: when each step of the engine
ends, counted from the publish call, for messages published one at a time.

    python bench/trace_latency.py [--messages 30] [--shards 2] [--members 2] [--modes leased,shared,ordered]
        [--rate 100 --seconds 5] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs the engine in this process (no HTTP: a sidecar adds its round trips, bench_sidecar.py
measures them) on the local stack, in a keyspace of its own, dropped at the end. For each
mode, `--members` consumers of one subscriber long-poll and ack at once, and a publisher
sends a message, waits until it is received, and sends the next after a pause. The engine's
steps are wrapped to note when each call ends (a step's first end after the publish began
is the one that carried the message; a step that runs in the background for other reasons,
such as a claim scan, may show up too). Each step is printed with the median and p90 of its
end (ms from the publish call) and the median of its own duration. With ordered keys, a
second pass publishes a key's next message while the app works on its first, and times its
delivery from the first one's ack. With `--rate`, a last pass publishes at that rate and
prints the latency beside the shared members' claims (how many, their batches, races lost).
Nothing is judged: it prints where the time goes, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from casque.engine import catalog, claim_reader, claims, completion, delivering, gaps, heads, keylocks, sharing
from casque.engine import shard_reader
from casque.engine import shard_writer
from casque.engine.acking import AckTaker
from casque.engine.batches import Log
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import drop_scratch, scratch_settings

MODES = {"leased": ("leased", False), "shared": ("shared", False), "ordered": ("shared", True)}
PAUSE_SECONDS = 0.15
# How long the app works on the first message of a key in the hand-off pass.
HOLD_SECONDS = 0.1
# The engine's steps: (owner, attribute, label). Each call's end is noted with its duration.
STEPS: list[tuple[Any, str, str]] = [
    (shard_writer.ShardWriter, "_write", "publish: conditional write (claim) of the batch"),
    (heads.HeadAdvancer, "_write", "publish: head znode written"),
    (Publisher, "publish", "publish: answered"),
    (shard_reader.ShardReader, "_head_changed", "leased: head watch fired"),
    (sharing.SharedDelivery, "head_changed", "shared: head watch fired"),
    (sharing.SharedDelivery, "_take_over_lapsed", "shared: scan for lapsed claims"),
    (Log, "read_from", "read of the batches from the offset or cursor"),
    (gaps, "prove_read", "proof that no batch is missing before those read"),
    (claims, "claim_range", "shared: range claimed (ZooKeeper)"),
    (sharing, "load_claim_reader", "shared: claim reader loaded (ack rows read)"),
    (Consumer, "notify", "receives woken"),
    (sharing.SharedDelivery, "cover", "shared: claim covers the delivery"),
    (delivering.Deliverer, "record", "delivery count written"),
    (Consumer, "receive", "receive returned it"),
    (AckTaker, "ack_many", "ack answered (durable)"),
    (keylocks.KeyLocks, "release", "ordered: key released"),
    (claim_reader.ClaimReader, "_complete_loop", "shared: range completion loop ended"),
    (completion, "complete", "shared: range completed (ZooKeeper)"),
]


class Tape:
    """When each step's calls ended (monotonic seconds) and how long each took."""

    def __init__(self) -> None:
        self.ends: dict[str, list[tuple[float, float]]] = {}

    def note(self, label: str, started: float) -> None:
        now = time.monotonic()
        self.ends.setdefault(label, []).append((now, now - started))

    def since(self, start: float, until: float) -> dict[str, tuple[float, float]]:
        """Each step's first end in [start, until): (ms from start, its duration in ms)."""
        found = {}
        for label, ends in self.ends.items():
            for end, took in ends:
                if start <= end < until:
                    found[label] = ((end - start) * 1000, took * 1000)
                    break
        return found


def wrap(tape: Tape, owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)
    if asyncio.iscoroutinefunction(original):
        @functools.wraps(original)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return await original(*args, **kwargs)
            finally:
                tape.note(label, started)
        setattr(owner, name, timed_async)
    else:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                tape.note(label, started)
        setattr(owner, name, timed)


async def consume(consumer: Consumer, delivered: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        got = await consumer.receive(max_messages=10, wait=0.5)
        for delivery in got:
            delivered.setdefault(delivery.message.payload.decode(), time.monotonic())
        if any(d.message.payload.startswith(b"held") for d in got):
            await asyncio.sleep(HOLD_SECONDS)  # the app works on it: its key's next message waits
        if got:
            await consumer.ack_many([d.receipt for d in got])


async def trace_mode(store: Store, tape: Tape, mode: str, args: argparse.Namespace) -> None:
    delivery, ordered = MODES[mode]
    queue = QueueRef("default", f"trace-{mode}")
    catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, queue, "app", SubscriberSpec(queue=queue.name, start_position="earliest",
                                                                 delivery=delivery, ordered_keys=ordered))
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    consumers = [Consumer(store, queue, "app") for _ in range(args.members)]
    for consumer in consumers:
        await consumer.start()
    delivered: dict[str, float] = {}
    stop = asyncio.Event()
    loops = [asyncio.create_task(consume(c, delivered, stop)) for c in consumers]
    rows: list[dict[str, tuple[float, float]]] = []
    try:
        for i in range(args.messages + 5):  # the first five warm up
            await asyncio.sleep(PAUSE_SECONDS)
            name = f"{mode}-{i}"
            started = time.monotonic()
            await publisher.publish([OutgoingMessage(name.encode(), key=f"k{i}")])
            while name not in delivered:
                await asyncio.sleep(0.001)
            if i >= 5:
                await asyncio.sleep(0.05)  # the acks after it
                rows.append(tape.since(started, time.monotonic()) | {
                    "=> publish -> first delivery": ((delivered[name] - started) * 1000, 0.0)})
        show(f"{mode}: one message at a time, {args.messages} messages, {args.members} members", rows)
        if args.rate:
            await under_load(publisher, consumers, delivered, mode, args)
        if ordered:
            await hand_off(publisher, delivered, tape, args)
    finally:
        stop.set()
        await asyncio.gather(*loops)
        for consumer in consumers:
            await consumer.stop()
        await publisher.flush_heads()


async def under_load(publisher: Publisher, consumers: list[Consumer], delivered: dict[str, float], mode: str,
                     args: argparse.Namespace) -> None:
    """`--rate` publishes a second, each sent on schedule: the latency, and what the shared
    members' claims looked like meanwhile (how many, their messages, the races lost)."""
    count = int(args.rate * args.seconds)
    outcomes: list[tuple[int, bool]] = []
    original = claims.claim_range

    async def counted(*call: Any, **named: Any) -> Any:
        record, cursor = await original(*call, **named)
        outcomes.append((0 if record is None else record.end - record.start, record is not None))
        return record, cursor

    claims.claim_range = counted
    sent: dict[str, float] = {}
    try:
        started = time.monotonic()
        calls = []
        for i in range(count):
            delay = started + i / args.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            name = f"{mode}-load-{i}"
            sent[name] = time.monotonic()
            calls.append(asyncio.create_task(publisher.publish([OutgoingMessage(name.encode(), key=f"k{i % 20}")])))
        await asyncio.gather(*calls)
        while not all(name in delivered for name in sent):
            await asyncio.sleep(0.01)
    finally:
        claims.claim_range = original
    latency = sorted((delivered[name] - at) * 1000 for name, at in sent.items())
    won = [size for size, ok in outcomes if ok]
    print(f"\n{mode} at {args.rate:g} msgs/s for {args.seconds:g}s: publish -> first delivery p50 "
          f"{latency[len(latency) // 2]:.1f} ms, p90 {latency[int(len(latency) * 0.9)]:.1f} ms; "
          f"claims {len(won)} ({statistics.mean(won) if won else 0:.1f} batches each), races lost "
          f"{len(outcomes) - len(won)}; batches written {publisher.counters.batches}")


async def hand_off(publisher: Publisher, delivered: dict[str, float], tape: Tape, args: argparse.Namespace) -> None:
    """Two messages of one key, the second published once the first is delivered, while the app
    works on the first for HOLD_SECONDS: the second's delivery, from when the first's ack ended
    (the second is in a range of its own, which either member may claim)."""
    rows = []
    for i in range(args.messages):
        await asyncio.sleep(PAUSE_SECONDS)
        first, second = f"held{i}", f"next{i}"
        await publisher.publish([OutgoingMessage(first.encode(), key=f"h{i}")])
        while first not in delivered:
            await asyncio.sleep(0.001)
        await publisher.publish([OutgoingMessage(second.encode(), key=f"h{i}")])
        while second not in delivered:
            await asyncio.sleep(0.001)
        acks = [end for end, _ in tape.ends["ack answered (durable)"] if delivered[first] <= end]
        if acks:
            rows.append(tape.since(acks[0], delivered[second] + 0.05) | {
                "=> first's ack answered -> second delivered": ((delivered[second] - acks[0]) * 1000, 0.0)})
    show("ordered: two messages of one key, from the first one's ack", rows)


def show(title: str, rows: list[dict[str, tuple[float, float]]]) -> None:
    print(f"\n{title}\n  {'step':56s} {'end p50':>8s} {'end p90':>8s} {'took p50':>8s} {'seen':>5s}")
    labels = sorted({label for row in rows for label in row},
                    key=lambda label: statistics.median(row[label][0] for row in rows if label in row))
    for label in labels:
        ends = sorted(row[label][0] for row in rows if label in row)
        took = statistics.median(row[label][1] for row in rows if label in row)
        p90 = ends[max(0, int(len(ends) * 0.9) - 1)]
        print(f"  {label:56s} {statistics.median(ends):8.1f} {p90:8.1f} {took:8.1f} {len(ends):5d}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=30)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rate", type=float, default=0.0, help="then publish this many a second (0: not)")
    parser.add_argument("--seconds", type=float, default=5.0, help="... for this long")
    parser.add_argument("--cassandra", default="127.0.0.1:9042")
    parser.add_argument("--zookeeper", default="127.0.0.1:2181")
    args = parser.parse_args()
    tape = Tape()
    for owner, name, label in STEPS:
        wrap(tape, owner, name, label)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        for mode in args.modes.split(","):
            await trace_mode(store, tape, mode, args)
    finally:
        drop_scratch(store, settings)
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
