"""Spark scan benchmark: rows/s of the Spark jobs' read against a paged driver scan, in one run.

    python bench/bench_spark_scan.py [--messages 200000] [--size 200] [--shards 4] [--runs 3]
        [--master local[*]] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end.
Writes the messages as the publisher lays them out (batches of 1,000 with a header row),
then reads the same rows, payloads included, four ways:

- driver, by partition: one process pages through each (shard, bucket) partition of the
  range, as a hand-written export would (fetch size 5,000);
- driver, whole table: one paged `SELECT` over the token ring;
- Spark, range: the jobs' reader, partition keys pushed down (what stats/export/replay do);
- Spark, whole table: the connector's token-range scan with no predicate.

Each read runs once to warm up (the JVM, the connector's session, the node's caches), then
`--runs` times; each figure is the median of those runs, each ratio computed per run. The
session start is reported on its own. The figure that matters is the ratio of
the Spark range read to the driver partition scan: on 2 cores, Spark's gain comes from
reading partitions in parallel and from decoding rows in the JVM instead of in Python.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cassandra.query import BatchStatement, BatchType  # noqa: E402

from casque.engine import catalog  # noqa: E402
from casque.schema import HEADER_SEQ, QueueRef, bucket_of  # noqa: E402
from casque.spark import readers  # noqa: E402
from casque.spark.ranges import parse_range, resolve  # noqa: E402
from casque.spark.session import SparkOptions, build_session  # noqa: E402
from casque.specs import QueueSpec  # noqa: E402
from casque.store import Store  # noqa: E402

from benchlib import Figure, arguments, drop_scratch, parse, report, scratch_settings  # noqa: E402

BATCH = 1000
WINDOW = 4
FETCH = 5000


def write_log(store: Store, queue: QueueRef, shards: int, messages: int, size: int) -> dict[int, int]:
    """Batches of BATCH messages, spread over the shards; returns each shard's head."""
    table = store.table(queue)
    session = store.session
    header = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, published_at, writer, message_count, "
        "total_messages, total_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    row = session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    payload = os.urandom(size)
    heads = {s: 0 for s in range(shards)}
    totals = {s: 0 for s in range(shards)}
    window = threading.Semaphore(WINDOW)
    errors: list[BaseException] = []
    written = 0
    number = 0
    while written < messages:
        shard = number % shards
        number += 1
        count = min(BATCH, messages - written)
        heads[shard] += 1
        batch = heads[shard]
        totals[shard] += count
        now = datetime.now(timezone.utc)
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        statement.add(header, (shard, bucket_of(batch), batch, HEADER_SEQ, now, "bench", count, totals[shard],
                               totals[shard] * size))
        for seq in range(count):
            statement.add(row, (shard, bucket_of(batch), batch, seq, str(uuid.uuid4()), now, payload))
        window.acquire()
        future = session.execute_async(statement)
        future.add_callbacks(lambda _: window.release(),
                             lambda error: (errors.append(error), window.release()))
        written += count
    for _ in range(WINDOW):
        window.acquire()
    if errors:
        raise errors[0]
    for shard, head in heads.items():
        store.zk.set(store.paths(queue).head(shard), str(head).encode())
    return heads


def driver_by_partition(store: Store, queue: QueueRef, heads: dict[int, int]) -> tuple[int, int, float]:
    statement = store.session.prepare(
        f"SELECT shard, batch_no, seq, payload FROM {store.table(queue)} WHERE shard = ? AND bucket = ?"
    )
    statement.fetch_size = FETCH
    rows = payload_bytes = 0
    started = time.perf_counter()
    for shard, head in heads.items():
        for bucket in range(bucket_of(1), bucket_of(head) + 1):
            for row in store.session.execute(statement, (shard, bucket)):
                if row.seq >= 0:
                    rows += 1
                    payload_bytes += len(row.payload or b"")
    return rows, payload_bytes, time.perf_counter() - started


def driver_whole_table(store: Store, queue: QueueRef) -> tuple[int, int, float]:
    statement = store.session.prepare(f"SELECT shard, batch_no, seq, payload FROM {store.table(queue)}")
    statement.fetch_size = FETCH
    rows = payload_bytes = 0
    started = time.perf_counter()
    for row in store.session.execute(statement):
        if row.seq >= 0:
            rows += 1
            payload_bytes += len(row.payload or b"")
    return rows, payload_bytes, time.perf_counter() - started


def spark_scan(frame: Any) -> tuple[int, int, float]:
    from pyspark.sql import functions as F

    started = time.perf_counter()
    result = frame.where(F.col("seq") >= 0).agg(
        F.count(F.lit(1)).alias("rows"), F.sum(F.length("payload")).alias("bytes")
    ).collect()[0]
    return int(result["rows"]), int(result["bytes"] or 0), time.perf_counter() - started


def warm_runs(run: Any, runs: int) -> list[tuple[int, int, float]]:
    """`runs` runs of `run` after a first one that warms caches alike for every reader."""
    rows, size, _ = run()
    results = [run() for _ in range(runs)]
    for result in results:
        assert result[:2] == (rows, size)
    return results


FIGURES = [
    Figure("driver_partition", "driver, by partition (1 process)", "rows/s"),
    Figure("driver_table", "driver, whole table (1 process)", "rows/s"),
    Figure("spark_range", "spark, range (pushed down)", "rows/s"),
    Figure("spark_table", "spark, whole table (token ranges)", "rows/s"),
    Figure("range_ratio", "spark range / driver by partition", "x"),
    Figure("table_ratio", "spark whole table / driver whole table", "x"),
    Figure("session_s", "spark session start", "s"),
    Figure("break_even_rows", "rows from which a job pays for its session start (0: never)", ""),
]


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], 200_000, 200)
    parser.add_argument("--master", default="local[*]")
    args = parse(parser, smoke_messages=1000)

    settings = scratch_settings(args.cassandra, args.zookeeper)
    keyspace = settings.keyspace
    store = Store.open(settings)
    queue = QueueRef("default", "scan")
    spark = None
    try:
        catalog.ensure_installation(store)
        catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE"))
        started = time.perf_counter()
        heads = write_log(store, queue, args.shards, args.messages, args.size)
        write_seconds = time.perf_counter() - started

        by_partition = warm_runs(lambda: driver_by_partition(store, queue, heads), args.runs)
        whole = warm_runs(lambda: driver_whole_table(store, queue), args.runs)

        started = time.perf_counter()
        spark = build_session(settings, SparkOptions(master=args.master, app_name="casque-bench-scan"))
        session_seconds = time.perf_counter() - started
        resolved = resolve(store, queue, parse_range(None))
        ranged = warm_runs(lambda: spark_scan(readers.range_rows(spark, keyspace, resolved, ["payload"])), args.runs)
        table = warm_runs(lambda: spark_scan(readers.table(spark, keyspace, queue.messages_table)), args.runs)

        for name, runs in (("driver by partition", by_partition), ("driver whole table", whole),
                           ("spark range", ranged), ("spark whole table", table)):
            rows, size = runs[0][:2]
            assert rows == args.messages and size == args.messages * args.size, (name, rows, size)

        samples: dict[str, list[float]] = {key: [] for key in (f.key for f in FIGURES)}
        for part, tab, rng, spk in zip(by_partition, whole, ranged, table):
            samples["driver_partition"].append(part[0] / part[2])
            samples["driver_table"].append(tab[0] / tab[2])
            samples["spark_range"].append(rng[0] / rng[2])
            samples["spark_table"].append(spk[0] / spk[2])
            samples["range_ratio"].append(part[2] / rng[2])
            samples["table_ratio"].append(tab[2] / spk[2])
            samples["session_s"].append(session_seconds)
            per_row_driver, per_row_spark = part[2] / part[0], rng[2] / rng[0]
            samples["break_even_rows"].append(session_seconds / (per_row_driver - per_row_spark)
                                              if per_row_spark < per_row_driver else 0)
    finally:
        if spark is not None:
            spark.stop()
        drop_scratch(store, settings)
        store.close()
    report("spark scan", args, {"rows": args.messages, "size": args.size, "shards": args.shards,
                                "cores": os.cpu_count(), "master": args.master, "written in s": round(write_seconds, 1)},
           FIGURES, samples)


if __name__ == "__main__":
    main()
