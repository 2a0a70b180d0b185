"""Engine benchmark: publish and receive+ack against limits measured on the same node, in one run.

    python bench/bench_engine.py [--messages 20000] [--size 1024] [--shards 4] [--runs 3]
        [--only receive] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end.
Reports, for the same rows on the same node, each figure the median of `--runs` runs:
- the limits: plain unlogged single-partition batches of the same rows, at the batch size
  the engine's group commit reached for each publish form, and a paged read; single-row
  inserts for context (a group commit is not bound by them);
- the engine's publish msgs/s (also with a client id on every message) and receive+ack
  msgs/s, each as a ratio of its limit in the same run, and Cassandra statements per 1,000 ids
  (each touches one partition); publish with ids also as a ratio of the same publish without;
- the cost of the conditional claim against a plain batch of the same rows;
- publish-to-receive latency p50/p99 at a moderate rate with a consumer waiting;
- ZooKeeper and Cassandra round trips per 1,000 messages, and of those the checkpoints of
  heads and offsets (casque.engine.checkpoints: grouped, at most one a second per shard).

`--only receive` publishes the same messages and writes the rows of the paged read, then
measures receive+ack against that read and nothing else (the publish limits, ids, claim
cost and latency are left out): quicker, for work on the consumer. `--only ids` measures
the 100-msg/call publish without ids, with client ids and with producer sequences against
plain batches of that size, and nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

from cassandra.cluster import Session
from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.engine.sequences import producer_key
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import (
    Figure,
    arguments,
    drop_scratch,
    parse,
    percentiles,
    pipeline,
    plain_batch_rate,
    raw_insert_rate,
    repeat_async,
    report,
    scratch_settings,
)

WINDOW = 256  # requests in flight, for the raw driver pipelines and the engine alike

FIGURES = [
    Figure("raw_insert_rows_per_s", "raw driver single-row inserts (context only)", "rows/s"),
    Figure("plain_batch_single_rows_per_s", "limit: plain unlogged batches, 1-msg/call batch size", "rows/s"),
    Figure("publish_single", "publish 1 msg/call, 256 calls in flight", "msgs/s"),
    Figure("publish_single_batch", "  its average batch (group commit)", "msgs"),
    Figure("publish_single_ratio", "  ratio of plain batches of that size", "x"),
    Figure("plain_batch_rows_per_s", "limit: plain unlogged batches, 100-msg/call batch size", "rows/s"),
    Figure("publish_batched", "publish 100 msgs/call, 32 calls in flight", "msgs/s"),
    Figure("publish_batched_batch", "  its average batch", "msgs"),
    Figure("publish_batched_ratio", "  ratio of plain batches of that size", "x"),
    Figure("publish_ids", "publish 100 msgs/call, a client id on each", "msgs/s"),
    Figure("publish_ids_ratio", "  ratio of plain batches (100-msg/call size)", "x"),
    Figure("publish_ids_vs_plain_publish", "  ratio of the same publish without ids", "x"),
    Figure("ids_statements", "  Cassandra statements per 1,000 messages", ""),
    Figure("ids_statements_for_ids", "  of them for the ids", ""),
    Figure("publish_sequences", "publish 100 msgs/call, producer sequences (one producer)", "msgs/s"),
    Figure("publish_sequences_ratio", "  ratio of plain batches (100-msg/call size)", "x"),
    Figure("publish_sequences_vs_plain_publish", "  ratio of the same publish without ids", "x"),
    Figure("sequences_statements_for_ids", "  Cassandra statements per 1,000 messages for the keys", ""),
    Figure("conditional_batch_ms", "conditional claim, batch of the 100-msg/call size", "ms"),
    Figure("plain_batch_ms", "plain batch of the same rows", "ms"),
    Figure("claim_ratio", "  conditional / plain", "x"),
    Figure("raw_read_rows_per_s", "limit: raw driver paged read", "rows/s"),
    Figure("consume", "receive+ack (ack_many, 256 per call)", "msgs/s"),
    Figure("consume_ratio", "  ratio of the paged read", "x"),
    Figure("latency_p50", "publish-to-receive latency p50, long poll", "ms"),
    Figure("latency_p99", "publish-to-receive latency p99", "ms"),
    Figure("zookeeper_per_1000", "ZooKeeper round trips per 1,000 messages", ""),
    Figure("cassandra_per_1000", "Cassandra round trips per 1,000 messages", ""),
    Figure("checkpoints_per_1000", "  of them checkpoints of heads and offsets (at most 1/s per shard)", ""),
    Figure("lost_claims", "lost claims", ""),
    Figure("unknown_outcomes", "unknown outcomes", ""),
]


async def claim_cost(store: Store, table: str, payload: bytes, batch_size: int, per_stream: int) -> dict[str, float]:
    """Median ms of a conditional claim batch and of a plain batch of the same rows, one
    stream per shard as the engine writes them."""
    session: Session = store.session
    insert = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    now = datetime.now(timezone.utc)
    header = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, writer) VALUES (?, ?, ?, -1, 'bench') IF NOT EXISTS"
    )
    plain_header = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, writer) VALUES (?, ?, ?, -1, 'bench')"
    )

    async def stream(shard: int, conditional: bool, n: int) -> list[float]:
        times = []
        for batch in range(1, n + 1):
            statement = BatchStatement(batch_type=BatchType.UNLOGGED)
            statement.add(header if conditional else plain_header, (shard, bucket_of(batch), batch))
            for seq in range(batch_size):
                statement.add(insert, (shard, bucket_of(batch), batch, seq, f"{batch}-{seq}", now, payload))
            started = time.perf_counter()
            await cql.execute(session, statement)
            times.append(time.perf_counter() - started)
        return times

    conditional = [t for ts in await asyncio.gather(*(stream(700 + s, True, per_stream) for s in range(4))) for t in ts]
    plain = [t for ts in await asyncio.gather(*(stream(600 + s, False, per_stream) for s in range(4))) for t in ts]
    return {"conditional_batch_ms": statistics.median(conditional) * 1000,
            "plain_batch_ms": statistics.median(plain) * 1000}


async def paged_read_rate(store: Store, table: str, count: int) -> float:
    """Rows/s of a paged read of the rows raw_insert_rate wrote (shards 900-903)."""
    select = store.session.prepare(f"SELECT * FROM {table} WHERE shard = ? AND bucket = ?")
    select.fetch_size = 2000
    started = time.perf_counter()
    read = 0
    for shard in range(900, 904):
        for bucket in range(bucket_of(1 + count // 100) + 1):
            result = await cql.execute(store.session, select, (shard, bucket))
            while True:
                read += len(result.current_rows)
                if not result.has_more_pages:
                    break
                result = await asyncio.to_thread(lambda r=result: (r.fetch_next_page(), r)[1])
    return read / (time.perf_counter() - started)


async def paged_read_rate_of_new_rows(store: Store, table: str, count: int, payload: bytes) -> float:
    """The paged read's rows/s, after writing its rows (as the full run's raw inserts do)."""
    await asyncio.to_thread(raw_insert_rate, store, table, count, payload, WINDOW)
    return await paged_read_rate(store, table, count)


async def receive_rate(store: Store, queue: QueueRef, total: int, consumer: Consumer | None = None) -> float:
    """Engine receive + ack of the `total` messages published: msgs/s. The consumer is left
    started when passed in (the latency probe uses it next), stopped otherwise."""
    own = consumer is None
    consumer = consumer or Consumer(store, queue, "bench")
    await consumer.start()
    received = 0
    started = time.perf_counter()
    while received < total:
        deliveries = await consumer.receive(max_messages=256, wait=5)
        if not deliveries:
            raise SystemExit("consumer stalled")
        await consumer.ack_many([d.receipt for d in deliveries])
        received += len(deliveries)
    rate = total / (time.perf_counter() - started)
    if own:
        await consumer.stop()
    return rate


async def keyed_publish_rate(
    store: Store, queue: QueueRef, spec: QueueSpec, calls: int, messages: Callable[[int], list[OutgoingMessage]],
) -> tuple[float, Publisher]:
    """Msgs/s of `calls` 100-message calls (32 in flight) on a queue of their own, and its publisher."""
    catalog.apply_queue(store, queue, spec)
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    rate = calls * 100 / await pipeline(calls, 32, lambda i: publisher.publish(messages(i)))
    await publisher.flush_heads()
    return rate, publisher


async def run_once(store: Store, args: argparse.Namespace, run: int) -> dict[str, float]:
    """One run on queues of its own: every figure, ratios against limits of this run."""
    queue = QueueRef("default", f"bench-{run}")
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE")
    payload = os.urandom(args.size)
    catalog.apply_queue(store, queue, spec)
    catalog.apply_subscriber(store, queue, "bench", SubscriberSpec(queue=queue.name, start_position="earliest"))

    # Engine publish: WINDOW concurrent single-message publishes, like many app requests...
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    message = OutgoingMessage(payload)
    half = args.messages // 2
    single_rate = half / await pipeline(half, WINDOW, lambda i: publisher.publish([message]))
    single_batch = publisher.counters.messages / max(1, publisher.counters.batches)
    # ...and batch calls of 100 messages (what clients should use), 32 calls in flight.
    batch_call = [message] * 100
    calls = max(1, (args.messages - half) // 100)
    before = publisher.counters.messages, publisher.counters.batches
    batched_rate = calls * 100 / await pipeline(calls, 32, lambda i: publisher.publish(batch_call))
    await publisher.flush_heads()
    counters = publisher.counters
    avg_batch = (counters.messages - before[0]) / max(1, counters.batches - before[1])
    total = half + calls * 100

    table = store.table(queue)
    if args.only == "receive":
        raw_read = await paged_read_rate_of_new_rows(store, table, total, payload)
        consume_rate = await receive_rate(store, queue, total)
        return {"raw_read_rows_per_s": raw_read, "consume": consume_rate, "consume_ratio": consume_rate / raw_read}

    # The same batch calls with a client id on every message (idempotent publish), on a
    # queue of their own: the id checks, intents and positions are what they add...
    ids_rate, ids_publisher = await keyed_publish_rate(
        store, QueueRef("default", f"bench-ids-{run}"), spec, calls,
        lambda i: [OutgoingMessage(payload, client_id=f"c{i}-{n}") for n in range(100)])
    ids_statements = ids_publisher.idempotency.statements + ids_publisher.counters.cassandra_writes
    # ...and with producer sequences: one producer numbering its messages, as the app client does.
    sequences_rate, sequences_publisher = await keyed_publish_rate(
        store, QueueRef("default", f"bench-seqs-{run}"), spec, calls,
        lambda i: [OutgoingMessage(payload, client_id=producer_key(f"bench-{run}", i * 100 + n)) for n in range(100)])
    keyed = {
        "publish_ids": ids_rate,
        "publish_ids_vs_plain_publish": ids_rate / batched_rate,
        "ids_statements": ids_statements * 1000 / (calls * 100),
        "ids_statements_for_ids": ids_publisher.idempotency.statements * 1000 / (calls * 100),
        "publish_sequences": sequences_rate,
        "publish_sequences_vs_plain_publish": sequences_rate / batched_rate,
        "sequences_statements_for_ids": sequences_publisher.idempotency.statements * 1000 / (calls * 100),
    }
    if args.only == "ids":
        plain = await plain_batch_rate(store, table, total, payload, max(1, round(avg_batch)), shard_base=800)
        return {**keyed, "plain_batch_rows_per_s": plain, "publish_batched": batched_rate,
                "publish_batched_batch": avg_batch, "publish_batched_ratio": batched_rate / plain,
                "publish_ids_ratio": ids_rate / plain, "publish_sequences_ratio": sequences_rate / plain}

    # The limits, on the same table (shards the engine does not use).
    raw_insert = await asyncio.to_thread(raw_insert_rate, store, table, total, payload, WINDOW)
    plain_single = await plain_batch_rate(store, table, half, payload, max(1, round(single_batch)), shard_base=500)
    plain_batched = await plain_batch_rate(store, table, total, payload, max(1, round(avg_batch)), shard_base=800)
    claim = await claim_cost(store, table, payload, max(1, round(avg_batch)),
                             max(5, min(50, total // (4 * max(1, round(avg_batch))))))
    raw_read = await paged_read_rate(store, table, total)

    consumer = Consumer(store, queue, "bench")
    consume_rate = await receive_rate(store, queue, total, consumer)

    # Latency: publish at a moderate rate while the consumer long-polls. Each probe
    # carries its send time, so the receiver needs nothing from the sender.
    latencies: list[float] = []

    async def consume_latency(n: int) -> None:
        while len(latencies) < n:
            deliveries = await consumer.receive(max_messages=100, wait=2)
            now = time.perf_counter()
            latencies.extend(now - float(d.message.payload[6:]) for d in deliveries
                             if d.message.payload.startswith(b"probe:"))
            await consumer.ack_many([d.receipt for d in deliveries])

    probes = 20 if args.smoke else 500
    reader = asyncio.create_task(consume_latency(probes))
    for _ in range(probes):
        await publisher.publish([OutgoingMessage(f"probe:{time.perf_counter()!r}".encode())])
        await asyncio.sleep(0.002)
    await asyncio.wait_for(reader, 120)
    await consumer.stop()
    p50, p99 = percentiles(latencies)

    zk_ops = publisher.zookeeper_operations() + consumer.counters.offset_commits + consumer.counters.lease_checks
    checkpoints = publisher.checkpoints.writes + (consumer.checkpoints.writer.writes if consumer.checkpoints else 0)
    cassandra_ops = counters.cassandra_writes + consumer.counters.batch_reads + consumer.acks.statements + checkpoints
    return {
        "raw_insert_rows_per_s": raw_insert,
        "plain_batch_single_rows_per_s": plain_single,
        "publish_single": single_rate,
        "publish_single_batch": single_batch,
        "publish_single_ratio": single_rate / plain_single,
        "plain_batch_rows_per_s": plain_batched,
        "publish_batched": batched_rate,
        "publish_batched_batch": avg_batch,
        "publish_batched_ratio": batched_rate / plain_batched,
        **keyed,
        "publish_ids_ratio": ids_rate / plain_batched,
        "publish_sequences_ratio": sequences_rate / plain_batched,
        **claim,
        "claim_ratio": claim["conditional_batch_ms"] / claim["plain_batch_ms"],
        "raw_read_rows_per_s": raw_read,
        "consume": consume_rate,
        "consume_ratio": consume_rate / raw_read,
        "latency_p50": p50,
        "latency_p99": p99,
        "zookeeper_per_1000": zk_ops * 1000 / total,
        "cassandra_per_1000": cassandra_ops * 1000 / total,
        "checkpoints_per_1000": checkpoints * 1000 / total,
        "lost_claims": counters.conflicts,
        "unknown_outcomes": counters.unknown_outcomes,
    }


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], 20000, 1024)
    parser.add_argument("--only", choices=["receive", "ids"],
                        help="receive: only receive+ack against the paged read; ids: only the keyed publishes")
    args = parse(parser, smoke_messages=600)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        samples = await repeat_async(args.runs, lambda run: run_once(store, args, run))
    finally:
        drop_scratch(store, settings)
        store.close()
    report("engine", args, {"messages": args.messages, "size": args.size, "shards": args.shards,
                            "in_flight": WINDOW}, FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
