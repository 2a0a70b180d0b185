"""Message history: what a trace costs, and what ids that carry a time cost the publish path.

    python bench/bench_history.py [--messages 20000] [--shards 4] [--runs 3] [--json] [--smoke]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. Each
run publishes `--messages` messages to a queue of `--shards` shards with two subscribers, in
calls of 10 from 8 concurrent publishers (so batches are many and small, as under a busy
sidecar), then traces (casque.engine.history.message_history) 40 of them chosen at random,
and 5 made-up ids with the time of a published message, which no message has: those read
every batch written up to SEARCH_AFTER past that time, the most a trace ever reads.

Figures: the wall time of a trace that finds its message (median and p99 over the 40) and of
one that finds nothing, and in-process CPU µs per id made for a publish: the time-carrying
ids (messages.time_ordered_ids) one at a time and 100 a call, beside uuid.uuid4(), which the
ids were before. No index row is written per message: a trace costs the publish path only
the id's making.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from typing import Any

from benchlib import Figure, arguments, drop_scratch, parse, percentiles, repeat_async, report, scratch_settings

from casque.engine import catalog
from casque.engine.history import message_history
from casque.engine.messages import OutgoingMessage, time_ordered_ids
from casque.engine.publisher import Publisher
from casque.errors import MessageNotFound
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = QueueRef("default", "traced")
CALL_MESSAGES = 10
PUBLISHERS = 8
TRACED = 40
MADE_UP = 5

FIGURES = [
    Figure("found_p50_ms", "trace of a published message, p50", "ms"),
    Figure("found_p99_ms", "trace of a published message, p99", "ms"),
    Figure("missing_ms", "trace of an id no message has (reads its whole search window)", "ms"),
    Figure("batches", "  batches written per run (context)", ""),
    Figure("id_one_us", "id made for a one-message publish (time_ordered_ids)", "µs"),
    Figure("id_batch_us", "id made in a 100-message publish, per id", "µs"),
    Figure("uuid4_us", "  uuid.uuid4() per id, the ids before (context)", "µs"),
]


def cpu_per_id(make: Any, calls: int) -> float:
    start = time.process_time()
    made = 0
    for _ in range(calls):
        made += len(make())
    return (time.process_time() - start) / made * 1e6


async def publish_all(store: Store, messages: int, size: int) -> list[str]:
    state = await asyncio.to_thread(catalog.read_queue, store, QUEUE)
    publishers = [Publisher(store, QUEUE, state) for _ in range(PUBLISHERS)]
    payload = b"x" * size
    calls = [[OutgoingMessage(payload) for _ in range(min(CALL_MESSAGES, messages - start))]
             for start in range(0, messages, CALL_MESSAGES)]
    ids: list[str] = []

    async def publisher(index: int) -> None:
        for call in calls[index::PUBLISHERS]:
            ids.extend(p.message_id for p in await publishers[index].publish(call))

    await asyncio.gather(*(publisher(i) for i in range(PUBLISHERS)))
    for p in publishers:
        await p.flush_heads()
    return ids


async def once(store: Store, args: Any, run: int) -> dict[str, float]:
    await asyncio.to_thread(catalog.apply_queue, store, QUEUE, QueueSpec(
        shards=args.shards, retention_seconds=3600, consistency="ONE"))
    for name in ("billing", "audit"):
        await asyncio.to_thread(catalog.apply_subscriber, store, QUEUE, name,
                                SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    try:
        ids = await publish_all(store, args.messages, args.size)
        rng = random.Random(run)
        found: list[float] = []
        for message_id in rng.sample(ids, min(TRACED, len(ids))):
            start = time.perf_counter()
            history = await message_history(store, QUEUE, message_id)
            found.append(time.perf_counter() - start)
            assert history.position is not None and len(history.subscribers) == 2
        missing: list[float] = []
        for message_id in rng.sample(ids, min(MADE_UP, len(ids))):
            made_up = message_id[:24] + "f" * 12  # its time, random bits no id has in practice
            start = time.perf_counter()
            try:
                await message_history(store, QUEUE, made_up)
                raise SystemExit(f"a made-up id was found: {made_up}")
            except MessageNotFound:
                missing.append((time.perf_counter() - start) * 1e3)
        heads = [int(store.zk.get(store.paths(QUEUE).head(s))[0] or b"0") for s in range(args.shards)]
    finally:
        await asyncio.to_thread(catalog.delete_queue, store, QUEUE, "Delete")
    p50, p99 = percentiles(found)
    now = time.time()
    return {
        "found_p50_ms": p50, "found_p99_ms": p99, "missing_ms": statistics.median(missing),
        "batches": float(sum(heads)),
        "id_one_us": cpu_per_id(lambda: time_ordered_ids(1, now), 20000),
        "id_batch_us": cpu_per_id(lambda: time_ordered_ids(100, now), 400),
        "uuid4_us": cpu_per_id(lambda: [str(uuid.uuid4())], 20000),
    }


async def main() -> None:
    args = parse(arguments((__doc__ or "").splitlines()[0], messages=20000, size=256), smoke_messages=600)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = await asyncio.to_thread(Store.open, settings)
    try:
        await asyncio.to_thread(catalog.ensure_installation, store)
        samples = await repeat_async(args.runs, lambda run: once(store, args, run))
    finally:
        await asyncio.to_thread(drop_scratch, store, settings)
        await asyncio.to_thread(store.close)
    report("history", args, {"messages": args.messages, "shards": args.shards, "traced": TRACED}, FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
