"""Engine benchmark: publish and receive+ack against limits measured on the same node, in one run.

    python bench/bench_engine.py [--messages 20000] [--size 1024] [--shards 4]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end.
Prints, for the same rows on the same node:
- the raw driver limits: single-row inserts (async pipeline), plain single-partition
  batches of the engine's average batch size, and a paged read;
- the engine's publish msgs/s (also with a client id on every message) and receive+ack
  msgs/s, each as a ratio of those limits, and Cassandra statements per 1,000 ids;
- publish-to-receive latency p50/p99 at a moderate rate with a consumer waiting;
- ZooKeeper and Cassandra round trips per 1,000 messages.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from datetime import datetime, timezone

from cassandra.cluster import Session
from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import arguments, drop_scratch, percentiles, pipeline, raw_insert_rate, scratch_settings

WINDOW = 256  # requests in flight, for the raw driver pipelines and the engine alike


async def raw_limits(store: Store, table: str, count: int, payload: bytes, batch_size: int) -> dict[str, float]:
    session: Session = store.session
    insert = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    now = datetime.now(timezone.utc)

    rows_per_second = await asyncio.to_thread(raw_insert_rate, store, table, count, payload, WINDOW)

    batches = max(1, count // batch_size)

    async def plain_batch(i: int) -> None:
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        for seq in range(batch_size):
            statement.add(insert, (800 + i % 4, bucket_of(i), i, seq, f"{i}-{seq}", now, payload))
        await cql.execute(session, statement)

    batch_seconds = await pipeline(batches, WINDOW, plain_batch)

    # The cost of the claim itself: the same batches, conditional or plain, one stream per
    # shard as the engine writes them.
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

    per_stream = max(5, min(50, count // (4 * batch_size)))
    conditional = [t for ts in await asyncio.gather(*(stream(700 + s, True, per_stream) for s in range(4))) for t in ts]
    plain = [t for ts in await asyncio.gather(*(stream(600 + s, False, per_stream) for s in range(4))) for t in ts]

    select = session.prepare(f"SELECT * FROM {table} WHERE shard = ? AND bucket = ?")
    select.fetch_size = 2000
    started = time.perf_counter()
    read = 0
    for shard in range(900, 904):
        for bucket in range(bucket_of(1 + count // 100) + 1):
            result = await cql.execute(session, select, (shard, bucket))
            while True:
                read += len(result.current_rows)
                if not result.has_more_pages:
                    break
                result = await asyncio.to_thread(lambda r=result: (r.fetch_next_page(), r)[1])
    read_seconds = time.perf_counter() - started
    return {
        "raw_insert_rows_per_s": rows_per_second,
        "raw_batch_rows_per_s": batches * batch_size / batch_seconds,
        "raw_read_rows_per_s": read / read_seconds,
        "conditional_batch_ms": statistics.median(conditional) * 1000,
        "plain_batch_ms": statistics.median(plain) * 1000,
    }


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], 20000, 1024)
    args = parser.parse_args()

    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    queue = QueueRef("default", "bench")
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE")
    payload = os.urandom(args.size)
    try:
        catalog.ensure_installation(store)
        catalog.apply_queue(store, queue, spec)
        catalog.apply_subscriber(store, queue, "bench", SubscriberSpec(queue="bench", start_position="earliest"))

        # Engine publish: WINDOW concurrent single-message publishes, like many app requests...
        publisher = Publisher(store, queue, catalog.read_queue(store, queue))
        message = OutgoingMessage(payload)
        half = args.messages // 2
        publish_seconds = await pipeline(half, WINDOW, lambda i: publisher.publish([message]))
        single_rate = half / publish_seconds
        single_batch = publisher.counters.messages / max(1, publisher.counters.batches)
        # ...and batch calls of 100 messages (what clients should use), 32 calls in flight.
        batch_call = [message] * 100
        calls = (args.messages - half) // 100
        before = publisher.counters.messages, publisher.counters.batches
        batched_seconds = await pipeline(calls, 32, lambda i: publisher.publish(batch_call))
        await publisher.flush_heads()
        counters = publisher.counters
        batched_rate = calls * 100 / batched_seconds
        avg_batch = (counters.messages - before[0]) / max(1, counters.batches - before[1])
        args.messages = half + calls * 100

        # The same batch calls with a client id on every message (idempotent publish), on a
        # queue of their own: the id checks, intents and positions are what they add.
        with_ids = QueueRef("default", "bench-ids")
        catalog.apply_queue(store, with_ids, spec)
        id_publisher = Publisher(store, with_ids, catalog.read_queue(store, with_ids))
        id_calls = calls

        async def publish_with_ids(i: int) -> None:
            await id_publisher.publish([OutgoingMessage(payload, client_id=f"c{i}-{n}") for n in range(100)])

        ids_seconds = await pipeline(id_calls, 32, publish_with_ids)
        await id_publisher.flush_heads()
        ids_rate = id_calls * 100 / ids_seconds
        ids_statements = id_publisher.idempotency.statements + id_publisher.counters.cassandra_writes

        limits = await raw_limits(store, store.table(queue), args.messages, payload, max(1, round(avg_batch)))

        # Engine receive + ack of everything just published.
        consumer = Consumer(store, queue, "bench")
        await consumer.start()
        received = 0
        started = time.perf_counter()
        while received < args.messages:
            deliveries = await consumer.receive(max_messages=256, wait=5)
            if not deliveries:
                raise SystemExit("consumer stalled")
            await consumer.ack_many([d.receipt for d in deliveries])
            received += len(deliveries)
        consume_seconds = time.perf_counter() - started
        consume_rate = args.messages / consume_seconds

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

        probe = 500
        reader = asyncio.create_task(consume_latency(probe))
        for _ in range(probe):
            await publisher.publish([OutgoingMessage(f"probe:{time.perf_counter()!r}".encode())])
            await asyncio.sleep(0.002)
        await asyncio.wait_for(reader, 120)
        await consumer.stop()
        latencies.sort()

        messages_total = args.messages
        zk_ops = publisher.zookeeper_operations() + consumer.counters.offset_commits
        cassandra_ops = counters.cassandra_writes + consumer.counters.batch_reads + consumer.acks.statements
        print(f"casque engine benchmark: {args.messages} messages of {args.size} B, {args.shards} shards, "
              f"{WINDOW} in flight, Cassandra {args.cassandra}")
        print(f"raw driver single-row inserts   {limits['raw_insert_rows_per_s']:10.0f} rows/s")
        print(f"raw driver plain batches ({avg_batch:5.1f}) {limits['raw_batch_rows_per_s']:10.0f} rows/s")
        print(f"claim cost, batch of {round(avg_batch)}: conditional {limits['conditional_batch_ms']:.1f} ms, "
              f"plain {limits['plain_batch_ms']:.1f} ms (median, 4 streams): "
              f"ratio {limits['conditional_batch_ms'] / limits['plain_batch_ms']:.2f}")
        print(f"raw driver paged read           {limits['raw_read_rows_per_s']:10.0f} rows/s")
        for label, rate, size in (("1 msg/call, 256 calls", single_rate, single_batch),
                                  ("100 msgs/call, 32 calls", batched_rate, avg_batch)):
            print(f"engine publish {label:24s} {rate:8.0f} msgs/s  "
                  f"ratio {rate / limits['raw_insert_rows_per_s']:.2f} of single-row inserts, "
                  f"{rate / limits['raw_batch_rows_per_s']:.2f} of plain batches (avg batch {size:.1f})")
        print(f"engine publish {'100 msgs/call with ids':24s} {ids_rate:8.0f} msgs/s  "
              f"ratio {ids_rate / limits['raw_batch_rows_per_s']:.2f} of plain batches; "
              f"{ids_statements * 1000 / (id_calls * 100):.1f} Cassandra statements per 1,000 messages "
              f"({id_publisher.idempotency.statements * 1000 / (id_calls * 100):.1f} of them for the ids)")
        print(f"lost claims {counters.conflicts}, unknown outcomes {counters.unknown_outcomes}")
        print(f"engine receive+ack              {consume_rate:10.0f} msgs/s  "
              f"ratio {consume_rate / limits['raw_read_rows_per_s']:.2f} of the paged read")
        p50, p99 = percentiles(latencies)
        print(f"publish-to-receive latency      p50 {p50:.1f} ms  p99 {p99:.1f} ms  ({len(latencies)} samples)")
        print(f"round trips per 1,000 messages  ZooKeeper {zk_ops * 1000 / messages_total:.1f}  "
              f"Cassandra {cassandra_ops * 1000 / messages_total:.1f}")
    finally:
        drop_scratch(store, settings)
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
