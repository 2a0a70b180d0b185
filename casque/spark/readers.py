"""DataFrames over a queue's tables that read only the partitions of a resolved range.

The connector pushes a predicate down to Cassandra when it restricts every partition key
column with = or IN: `shard IN (...) AND bucket IN (...)` becomes a read of exactly those
partitions (`Cassandra Filters` in `explain()`), where anything less (a filter on batch_no
alone, say) would scan the whole table by token ranges.

One such read is one Spark task, so a range is cut into several reads (`plan_reads`): each
covers a few shards times a few buckets, exactly partitions of the range, and there are
about MAX_READS of them at most, enough tasks to keep a cluster's cores busy without a
query plan of thousands of unions.

Rows are then filtered to the exact batch intervals (a bucket holds 64 batches) and, for a
time window, to the publish times: what a job sees is exactly the range.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from functools import reduce
from typing import TYPE_CHECKING

from casque.formats import FORMAT_MARK, UNMARKED_FORMAT
from casque.schema import ACKS_TABLE, HEADER_SEQ
from casque.spark.ranges import ResolvedRange

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

CASSANDRA_FORMAT = "org.apache.spark.sql.cassandra"

MESSAGE_COLUMNS = (
    "shard", "batch_no", "seq", "message_id", "published_at", "key", "attributes", "payload",
    "content_type", "client_id", "expires_at",
)
HEADER_COLUMNS = ("shard", "batch_no", "seq", "published_at", "writer", "message_count", "total_messages",
                  "total_bytes")


# Reads (Spark tasks) a range is cut into, at most about this many.
MAX_READS = 64

Read = tuple[tuple[int, ...], tuple[int, ...]]  # (shards, buckets): their product is read


def plan_reads(resolved: ResolvedRange, max_reads: int = MAX_READS) -> list[Read]:
    """Cut the range's (shard, bucket) partitions into at most about `max_reads` exact reads."""
    readable = resolved.readable
    total = sum(len(s.buckets) for s in readable)
    if total == 0:
        return []
    per_read = math.ceil(total / max(1, min(total, max_reads)))
    chunks: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for shard in readable:
        buckets = shard.buckets
        for start in range(0, len(buckets), per_read):
            chunks[buckets[start:start + per_read]].append(shard.shard)
    reads: list[Read] = []
    for buckets, shards in sorted(chunks.items()):
        step = max(1, per_read // len(buckets))
        for start in range(0, len(shards), step):
            reads.append((tuple(shards[start:start + step]), buckets))
    return reads


def table(spark: SparkSession, keyspace: str, name: str) -> DataFrame:
    return spark.read.format(CASSANDRA_FORMAT).options(keyspace=keyspace, table=name).load()


def _or(conditions: Sequence[Column]) -> Column:
    return reduce(lambda a, b: a | b, conditions)


def range_rows(spark: SparkSession, keyspace: str, resolved: ResolvedRange, columns: Sequence[str]) -> DataFrame:
    """Every row (headers and messages) of the range's batches, with `columns`."""
    from pyspark.sql import functions as F

    base = table(spark, keyspace, resolved.queue.messages_table)
    wanted = list(dict.fromkeys(["shard", "batch_no", "seq", *columns]))
    timed = resolved.spec.since is not None or resolved.spec.until is not None
    read = list(dict.fromkeys([*wanted, "writer", *(["published_at"] if timed else [])]))
    readable = resolved.readable
    if not readable:
        # An always-false filter: Spark plans an empty relation and reads nothing.
        return base.select(*wanted).where(F.lit(False))
    frames = [
        base.where(F.col("shard").isin(list(shards)) & F.col("bucket").isin(list(buckets))).select(*read)
        for shards, buckets in plan_reads(resolved)
    ]
    rows = reduce(lambda a, b: a.unionByName(b), frames)
    within = _or([
        (F.col("shard") == s.shard) & F.col("batch_no").between(first, last)
        for s in readable for first, last in s.intervals
    ])
    rows = rows.where(within)
    if resolved.spec.since is not None:
        rows = rows.where(F.col("published_at") >= F.lit(resolved.spec.since))
    if resolved.spec.until is not None:
        rows = rows.where(F.col("published_at") < F.lit(resolved.spec.until))
    return _refusing_later_formats(rows).select(*wanted)


# The words a job's failure carries when it met a batch of a later format: the CLI turns it
# into NewerFormat (casque.cli.spark_commands).
LATER_FORMAT = "casque: a later format: "


def _refusing_later_formats(rows: DataFrame) -> DataFrame:
    """`rows` whose `seq` fails the job at a header whose writer carries a later format
    (casque.formats) instead of letting its batch be read as format 1's. On `seq`, which every
    read filters on or keeps, so that no plan can leave the check out."""
    from pyspark.sql import functions as F

    later = (F.col("seq") == HEADER_SEQ) & F.col("writer").contains(FORMAT_MARK)
    refusal = F.concat(
        F.lit(f"{LATER_FORMAT}batch "), F.col("batch_no").cast("string"), F.lit(" of shard "),
        F.col("shard").cast("string"), F.lit(" was written in format "),
        F.substring_index(F.col("writer"), FORMAT_MARK, -1),
        F.lit(f"; this version of casque reads up to {UNMARKED_FORMAT}: upgrade it"))
    return rows.withColumn("seq", F.when(later, F.raise_error(refusal)).otherwise(F.col("seq")))


def messages(spark: SparkSession, keyspace: str, resolved: ResolvedRange,
             columns: Sequence[str] = MESSAGE_COLUMNS) -> DataFrame:
    from pyspark.sql import functions as F

    return range_rows(spark, keyspace, resolved, columns).where(F.col("seq") > HEADER_SEQ).select(*columns)


def headers(spark: SparkSession, keyspace: str, resolved: ResolvedRange,
            columns: Sequence[str] = HEADER_COLUMNS) -> DataFrame:
    from pyspark.sql import functions as F

    return range_rows(spark, keyspace, resolved, columns).where(F.col("seq") == HEADER_SEQ).select(*columns)


def message_size(payload: str = "payload", key: str = "key", attributes: str = "attributes") -> Column:
    """A message's size as the engine counts it against limits and in header totals:
    payload + key + attribute names and values, in bytes."""
    from pyspark.sql import functions as F

    attribute_bytes = F.aggregate(
        F.map_entries(F.coalesce(F.col(attributes), F.create_map().cast("map<string,string>"))),
        F.lit(0).cast("long"),
        lambda total, entry: (
            total + F.octet_length(entry["key"]) + F.coalesce(F.octet_length(entry["value"]), F.lit(0))
        ),
    )
    return (
        F.coalesce(F.length(F.col(payload)), F.lit(0)).cast("long")
        + F.coalesce(F.octet_length(F.col(key)), F.lit(0))
        + attribute_bytes
    )


def timeuuid_time(column: str) -> Column:
    """The time inside a version-1 UUID string (the connector reads timeuuid as text).

    60 bits of 100 ns intervals since 1582-10-15: time_hi (less its version digit),
    time_mid, time_low, in that order.
    """
    from pyspark.sql import functions as F

    uuid = F.col(column)
    hex_time = F.concat(F.substring(uuid, 16, 3), F.substring(uuid, 10, 4), F.substring(uuid, 1, 8))
    intervals = F.conv(hex_time, 16, 10).cast("decimal(20,0)")
    gregorian_offset = 122192928000000000  # 100 ns intervals from 1582-10-15 to 1970-01-01
    micros = ((intervals - F.lit(gregorian_offset)) / F.lit(10)).cast("long")
    return F.timestamp_micros(micros)


def acks(spark: SparkSession, keyspace: str, resolved: ResolvedRange,
         epochs: dict[str, tuple[str, list[int]]]) -> DataFrame:
    """Ack rows of subscribers (name -> (ack key, epochs to read)) for the range's partitions,
    with the subscriber's name in the `subscriber` column.

    The partition key (queue, subscriber, epoch, shard, bucket) is pushed down whole: the
    connector reads the product of the IN lists, or joins against it when it is large.
    """
    from pyspark.sql import functions as F

    base = table(spark, keyspace, ACKS_TABLE)
    columns = ["subscriber", "epoch", "shard", "batch_no", "entry", "outcome", "seqs"]
    readable = resolved.readable
    if not readable or not epochs:
        return base.select(*columns).where(F.lit(False))
    reads = plan_reads(resolved, max(1, MAX_READS // len(epochs)))
    frames = []
    for subscriber, (ack_key, subscriber_epochs) in sorted(epochs.items()):
        for shards, buckets in reads:
            frames.append(
                base.where(
                    (F.col("queue") == resolved.queue.key)
                    & (F.col("subscriber") == ack_key)
                    & F.col("epoch").isin(subscriber_epochs)
                    & F.col("shard").isin(list(shards))
                    & F.col("bucket").isin(list(buckets))
                ).select(*columns).withColumn("subscriber", F.lit(subscriber))
            )
    rows = reduce(lambda a, b: a.unionByName(b), frames)
    within = _or([
        (F.col("shard") == s.shard) & F.col("batch_no").between(first, last)
        for s in readable for first, last in s.intervals
    ])
    return rows.where(within)
