"""`casque spark stats`: what a queue's history looks like, from its stored rows.

One pushed-down read of the range's partitions feeds every table (the projection without
payloads is cached); acks are read from their own partitions; subscriber lag comes from
the offsets and heads in ZooKeeper, as the engine's statistics compute it.

Tables (each written as Parquet under `parquet/<name>/` and as JSON `<name>.json`):

- per_minute   messages, bytes (payload + key + attributes, as the engine counts them),
               payload bytes and batches per minute of publish time
- sizes        message size distribution in bins (powers of 4 bytes)
- shards       per shard: messages, bytes, batches, first and last batch, share of messages
- latency      per subscriber: publish-to-ack latency of the messages whose acks are
               recorded as ack rows (messages covered by an offset move leave no row)
- lag          per subscriber and shard: offset, head, lag in batches and messages

`summary.json` holds the totals and the range; `report.html` and `summary.md` are the
report a person reads, with PNG charts under `charts/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casque.engine import catalog
from casque.engine.offsets import read_epoch
from casque.engine.stats import subscriber_stats
from casque.spark import readers
from casque.spark.errors import OutputExists
from casque.spark.ranges import ResolvedRange, format_time
from casque.store import Store

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

Record = dict[str, Any]

# Upper bounds of the size bins, in bytes; the last bin is everything above.
SIZE_BINS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# Upper bounds of the latency bins, in milliseconds.
LATENCY_BINS_MS = (10, 100, 1000, 10_000, 60_000, 600_000)
QUANTILE_ACCURACY = 10_000

TABLE_SCHEMAS = {
    "lag": "subscriber string, shard int, offset long, head long, lag_batches long, lag_messages long, "
           "oldest_unacked_at timestamp, leased_by string",
}


@dataclass
class StatsResult:
    out: Path
    summary: Record
    tables: dict[str, list[Record]] = field(default_factory=dict)


def _label(upper: int | None, lower: int) -> str:
    def human(n: int) -> str:
        for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= size and n % size == 0:
                return f"{n // size} {unit}"
        return f"{n} B"

    return f"> {human(lower)}" if upper is None else f"<= {human(upper)}"


def size_bin(column: Column) -> Column:
    """The index of a size's bin in SIZE_BINS (len(SIZE_BINS) for larger sizes)."""
    from pyspark.sql import functions as F

    expression = F.lit(len(SIZE_BINS))
    for index in reversed(range(len(SIZE_BINS))):
        expression = F.when(column <= SIZE_BINS[index], F.lit(index)).otherwise(expression)
    return expression


def latency_bin(column: Column) -> Column:
    from pyspark.sql import functions as F

    expression = F.lit(len(LATENCY_BINS_MS))
    for index in reversed(range(len(LATENCY_BINS_MS))):
        expression = F.when(column <= LATENCY_BINS_MS[index], F.lit(index)).otherwise(expression)
    return expression


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return format_time(moment)
    if isinstance(value, date):
        return value.isoformat()
    return value


def _records(frame: DataFrame) -> list[Record]:
    return [{k: _jsonable(v) for k, v in row.asDict().items()} for row in frame.collect()]


def _write(spark: SparkSession, out: Path, name: str, frame: DataFrame, records: list[Record]) -> None:
    frame.coalesce(1).write.mode("overwrite").parquet(str(out / "parquet" / name))
    (out / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")


@contextlib.contextmanager
def output_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """A directory beside `out` for a job's results, which takes `out`'s place only once the
    job is done. A job that fails (a range it may not read, a batch of a later format) leaves
    `out` as it was, an earlier run's results included, and no half-written directory that
    would read as a result."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputExists(f"{out} is not empty; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        # Renamed aside before it is removed: `out` is never a mix of two runs.
        replaced = staging.with_suffix(".replaced")
        out.rename(replaced)
        staging.rename(out)
        shutil.rmtree(replaced)
    else:
        staging.rename(out)


def compute(spark: SparkSession, store: Store, resolved: ResolvedRange, out: Path,
            overwrite: bool = False) -> StatsResult:
    """Compute every table of the range, write them under `out`, and return them."""
    with output_dir(out, overwrite) as staging:
        result = _compute(spark, store, resolved, staging)
    return replace(result, out=out)


def _compute(spark: SparkSession, store: Store, resolved: ResolvedRange, out: Path) -> StatsResult:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    rows = readers.range_rows(
        spark, store.keyspace_of(resolved.queue.namespace), resolved, ["published_at", "payload", "key", "attributes", "message_count"]
    ).select(
        "shard", "batch_no", "seq", "published_at", "message_count",
        readers.message_size().alias("size"),
        F.coalesce(F.length("payload"), F.lit(0)).cast("long").alias("payload_bytes"),
    ).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        messages = rows.where(F.col("seq") >= 0)
        headers = rows.where(F.col("seq") < 0)
        tables: dict[str, list[Record]] = {}

        per_minute = (
            messages.groupBy(F.date_trunc("minute", "published_at").alias("minute"))
            .agg(
                F.count(F.lit(1)).alias("messages"),
                F.sum("size").alias("bytes"),
                F.sum("payload_bytes").alias("payload_bytes"),
                F.countDistinct("shard", "batch_no").alias("batches"),
            )
            .orderBy("minute")
        )
        tables["per_minute"] = _records(per_minute)
        _write(spark, out, "per_minute", per_minute, tables["per_minute"])

        bins = (
            messages.groupBy(size_bin(F.col("size")).alias("bin"))
            .agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"))
        )
        found = {r["bin"]: r for r in _records(bins)}
        size_rows = []
        for index in range(len(SIZE_BINS) + 1):
            upper = SIZE_BINS[index] if index < len(SIZE_BINS) else None
            lower = SIZE_BINS[index - 1] if index > 0 else 0
            hit = found.get(index, {})
            size_rows.append({
                "bin": index, "label": _label(upper, lower), "lower_bytes": lower, "upper_bytes": upper,
                "messages": int(hit.get("messages") or 0), "bytes": int(hit.get("bytes") or 0),
            })
        tables["sizes"] = size_rows
        _write(spark, out, "sizes", spark.createDataFrame(
            size_rows, "bin int, label string, lower_bytes long, upper_bytes long, messages long, bytes long"
        ), size_rows)

        shard_frame = (
            messages.groupBy("shard")
            .agg(
                F.count(F.lit(1)).alias("messages"),
                F.sum("size").alias("bytes"),
                F.countDistinct("batch_no").alias("batches"),
                F.min("batch_no").alias("first_batch"),
                F.max("batch_no").alias("last_batch"),
            )
        )
        by_shard = {r["shard"]: r for r in _records(shard_frame)}
        total_messages = sum(int(r["messages"]) for r in by_shard.values())
        shard_rows = []
        for shard in resolved.shards:
            hit = by_shard.get(shard.shard, {})
            count = int(hit.get("messages") or 0)
            shard_rows.append({
                "shard": shard.shard, "head": shard.head, "range_batches": shard.batches,
                "messages": count, "bytes": int(hit.get("bytes") or 0), "batches": int(hit.get("batches") or 0),
                "first_batch": hit.get("first_batch"), "last_batch": hit.get("last_batch"),
                "share": round(count / total_messages, 6) if total_messages else 0.0,
            })
        tables["shards"] = shard_rows
        _write(spark, out, "shards", spark.createDataFrame(
            shard_rows, "shard int, head long, range_batches long, messages long, bytes long, batches long, "
            "first_batch long, last_batch long, share double"
        ), shard_rows)

        subscribers = catalog.list_subscribers(store, resolved.queue)
        latency_rows, latency_bins = _latency(spark, store, resolved, messages, subscribers)
        tables["latency"] = latency_rows
        _write(spark, out, "latency", spark.createDataFrame(
            latency_rows, "subscriber string, acked long, min_ms double, p50_ms double, p90_ms double, "
            "p99_ms double, max_ms double, mean_ms double"
        ), latency_rows)
        tables["latency_bins"] = latency_bins
        _write(spark, out, "latency_bins", spark.createDataFrame(
            latency_bins, "subscriber string, bin int, label string, upper_ms long, messages long"
        ), latency_bins)

        lag_rows = _lag(store, resolved, subscribers)
        tables["lag"] = [{k: _jsonable(v) for k, v in r.items()} for r in lag_rows]
        _write(spark, out, "lag", spark.createDataFrame(lag_rows, TABLE_SCHEMAS["lag"]), tables["lag"])

        totals = _records(
            messages.agg(
                F.count(F.lit(1)).alias("messages"),
                F.coalesce(F.sum("size"), F.lit(0)).alias("bytes"),
                F.coalesce(F.sum("payload_bytes"), F.lit(0)).alias("payload_bytes"),
                F.min("size").alias("min_size"),
                F.max("size").alias("max_size"),
                F.avg("size").alias("mean_size"),
                F.percentile_approx("size", [0.5, 0.9, 0.99], QUANTILE_ACCURACY).alias("size_quantiles"),
                F.min("published_at").alias("first_published_at"),
                F.max("published_at").alias("last_published_at"),
            )
        )[0]
        header_totals = _records(
            headers.agg(
                F.count(F.lit(1)).alias("batches"),
                F.coalesce(F.sum("message_count"), F.lit(0)).alias("batch_messages"),
            )
        )[0]
    finally:
        rows.unpersist()
    quantiles = totals.pop("size_quantiles") or [None, None, None]
    summary: Record = {
        **resolved.describe(),
        "messages": int(totals["messages"]),
        "bytes": int(totals["bytes"]),
        "payload_bytes": int(totals["payload_bytes"]),
        "batches": int(header_totals["batches"]),
        # Fewer messages than the batch headers count: ephemeral messages (per-message TTL) expired.
        "batch_messages": int(header_totals["batch_messages"]),
        "size": {
            "min": totals["min_size"], "max": totals["max_size"], "mean": totals["mean_size"],
            "p50": quantiles[0], "p90": quantiles[1], "p99": quantiles[2],
        },
        "first_published_at": totals["first_published_at"],
        "last_published_at": totals["last_published_at"],
        "subscribers": subscribers,
        "partitions_read": resolved.partitions,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    result = StatsResult(out, summary, tables)
    from casque.spark import report

    report.write(result)
    return result


def _latency(spark: SparkSession, store: Store, resolved: ResolvedRange, messages: DataFrame,
             subscribers: list[str]) -> tuple[list[Record], list[Record]]:
    from pyspark.sql import functions as F

    # Every epoch up to the latest seek: a shard's epoch is the latest seek that named it.
    epochs = {
        name: (
            catalog.read_subscriber(store, resolved.queue, name).ack_key(name),
            list(range(read_epoch(store.zk, store.paths(resolved.queue).subscriber(name))[0] + 1)),
        )
        for name in subscribers
    }
    acked = (
        readers.acks(spark, store.keyspace_of(resolved.queue.namespace), resolved, epochs)
        .where(F.col("outcome") == "ack")
        .select("subscriber", "shard", "batch_no", F.explode("seqs").alias("seq"),
                readers.timeuuid_time("entry").alias("acked_at"))
        # A message acked in several epochs (after a seek) counts once per epoch it was
        # delivered in; within one pass, its first ack is the one that counts.
        .groupBy("subscriber", "shard", "batch_no", "seq")
        .agg(F.min("acked_at").alias("acked_at"))
    )
    latencies = acked.join(messages.select("shard", "batch_no", "seq", "published_at"),
                           ["shard", "batch_no", "seq"]).select(
        "subscriber",
        ((F.unix_micros("acked_at") - F.unix_micros("published_at")) / F.lit(1000.0)).alias("ms"),
    )
    summary = _records(
        latencies.groupBy("subscriber").agg(
            F.count(F.lit(1)).alias("acked"),
            F.min("ms").alias("min_ms"),
            F.percentile_approx("ms", [0.5, 0.9, 0.99], QUANTILE_ACCURACY).alias("q"),
            F.max("ms").alias("max_ms"),
            F.avg("ms").alias("mean_ms"),
        ).orderBy("subscriber")
    )
    rows = []
    for record in summary:
        q = record.pop("q")
        rows.append({"subscriber": record["subscriber"], "acked": record["acked"], "min_ms": record["min_ms"],
                     "p50_ms": q[0], "p90_ms": q[1], "p99_ms": q[2], "max_ms": record["max_ms"],
                     "mean_ms": record["mean_ms"]})
    counted = {
        (r["subscriber"], r["bin"]): int(r["messages"])
        for r in _records(latencies.groupBy("subscriber", latency_bin(F.col("ms")).alias("bin"))
                          .agg(F.count(F.lit(1)).alias("messages")))
    }
    bins = []
    for name in sorted({r["subscriber"] for r in rows}):
        for index in range(len(LATENCY_BINS_MS) + 1):
            upper = LATENCY_BINS_MS[index] if index < len(LATENCY_BINS_MS) else None
            label = f"<= {_ms(upper)}" if upper is not None else f"> {_ms(LATENCY_BINS_MS[-1])}"
            bins.append({"subscriber": name, "bin": index, "label": label, "upper_ms": upper,
                         "messages": counted.get((name, index), 0)})
    return rows, bins


def _ms(value: int) -> str:
    if value >= 60_000 and value % 60_000 == 0:
        return f"{value // 60_000} min"
    if value >= 1000 and value % 1000 == 0:
        return f"{value // 1000} s"
    return f"{value} ms"


def _lag(store: Store, resolved: ResolvedRange, subscribers: list[str]) -> list[Record]:
    """Lag now, from ZooKeeper and batch headers (not limited to the range: lag is about the present)."""

    async def gather() -> list[Record]:
        rows: list[Record] = []
        for name in subscribers:
            stats = await subscriber_stats(store, resolved.queue, name)
            for shard in stats.shards:
                rows.append({
                    "subscriber": name, "shard": shard.shard, "offset": shard.offset, "head": shard.head,
                    "lag_batches": shard.lag_batches, "lag_messages": shard.lag_messages,
                    "oldest_unacked_at": shard.oldest_unacked_at, "leased_by": shard.leased_by,
                })
        return rows

    # Its own event loop in a worker thread: the job may be called from a running loop (an
    # async caller) or from none (the CLI).
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(asyncio.run, gather()).result()
