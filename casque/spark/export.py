"""`casque spark export`: a range of a queue's messages to Parquet or JSON lines, byte for byte.

Layout of the output directory:

    manifest.json       the queue, the resolved range, the format, counts per shard, the files
    messages/           Spark's part files: part-*.parquet, or part-*.json (one JSON object a line)

Every message row of the range is written once, ordered by (shard, batch, seq) across the
part files. Columns: shard, batch, seq, message_id, published_at, key, attributes, payload,
content_type, client_id, expires_at. In Parquet the payload is binary and times are
timestamps (UTC, millisecond precision like Cassandra's). In JSON lines the payload is
`payload_base64` (standard base64 with padding: any bytes survive) and times are RFC3339
strings; absent values are null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from casque.spark import readers
from casque.spark.errors import InvalidRange
from casque.spark.ranges import ResolvedRange
from casque.spark.stats import output_dir

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Format = Literal["parquet", "jsonl"]
FORMATS: tuple[Format, ...] = ("parquet", "jsonl")
TIME_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'"


@dataclass(frozen=True)
class ExportResult:
    out: Path
    messages: int
    payload_bytes: int
    per_shard: dict[int, int]
    files: list[str]


def export_frame(spark: SparkSession, keyspace: str, resolved: ResolvedRange, fmt: Format) -> DataFrame:
    """The exported rows, in export order, with the columns of the chosen format."""
    from pyspark.sql import functions as F

    rows = readers.messages(spark, keyspace, resolved).withColumnRenamed("batch_no", "batch")
    if fmt == "jsonl":
        rows = rows.select(
            "shard", "batch", "seq", "message_id",
            F.date_format("published_at", TIME_FORMAT).alias("published_at"),
            "key", "attributes",
            # Spark's base64 breaks lines every 76 characters (MIME); one line of standard base64.
            F.regexp_replace(F.base64("payload"), "[\\r\\n]", "").alias("payload_base64"),
            "content_type", "client_id",
            F.date_format("expires_at", TIME_FORMAT).alias("expires_at"),
        )
    else:
        rows = rows.select("shard", "batch", "seq", "message_id", "published_at", "key", "attributes", "payload",
                           "content_type", "client_id", "expires_at")
    return rows.orderBy("shard", "batch", "seq")


def export(spark: SparkSession, keyspace: str, resolved: ResolvedRange, fmt: str, out: Path,
           overwrite: bool = False) -> ExportResult:
    if fmt not in FORMATS:
        raise InvalidRange(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    chosen: Format = "jsonl" if fmt == "jsonl" else "parquet"
    with output_dir(out, overwrite) as staging:
        result = _export(spark, keyspace, resolved, chosen, staging)
    return replace(result, out=out)


def _export(spark: SparkSession, keyspace: str, resolved: ResolvedRange, chosen: Format, out: Path) -> ExportResult:
    from pyspark.sql import functions as F

    frame = export_frame(spark, keyspace, resolved, chosen)
    target = str(out / "messages")
    if chosen == "jsonl":
        # ignoreNullFields off: every line has every field, null when absent.
        frame.write.option("ignoreNullFields", "false").json(target)
    else:
        frame.write.parquet(target)
    # Counted from what was written, not from a second read of Cassandra.
    written = spark.read.parquet(target) if chosen == "parquet" else spark.read.json(target)
    payload_length = (F.length("payload") if chosen == "parquet"
                      else F.length(F.unbase64("payload_base64")))
    counts = written.groupBy("shard").agg(F.count(F.lit(1)).alias("messages"),
                                          F.coalesce(F.sum(payload_length), F.lit(0)).alias("bytes")).collect()
    per_shard = {int(r["shard"]): int(r["messages"]) for r in counts}
    payload_bytes = sum(int(r["bytes"]) for r in counts)
    files = sorted(p.name for p in (out / "messages").iterdir() if p.name.startswith("part-"))
    messages = sum(per_shard.values())
    manifest = {
        **resolved.describe(),
        "format": chosen,
        "messages": messages,
        "payload_bytes": payload_bytes,
        "per_shard": {str(k): v for k, v in sorted(per_shard.items())},
        "files": [f"messages/{name}" for name in files],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return ExportResult(out, messages, payload_bytes, per_shard, files)
