"""`casque spark stats | export | replay`: jobs over a queue's stored history, on Spark.

Each command resolves its range against the backends (heads and batch headers, through the
CASQUE_* settings), starts one SparkSession (`local[*]` unless --master says otherwise) and
stops it at the end. PySpark is imported only when a command runs, so the rest of the CLI
works without the `spark` extra.

Range syntax (see casque/spark/ranges.py and docs/spark.md):
    TIME..TIME          RFC3339 times, [from, to), either side may be empty
    SHARD:FIRST-LAST    batches of one shard, inclusive; `*` for every shard
terms joined by commas; --since/--until (stats) and --from/--to (export, replay) are the
time window alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from casque.cli.options import CassandraOption, KeyspaceOption, NamespaceOption, ZookeeperOption, backend_settings
from casque.cli.queue_commands import queue_of
from casque.config import Settings
from casque.errors import CasqueError, NewerFormat
from casque.schema import QueueRef
from casque.spark.errors import SparkJobError, SparkUnavailable
from casque.spark.ranges import RangeSpec, ResolvedRange, parse_range, parse_time
from casque.spark.readers import LATER_FORMAT
from casque.store import Store

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

app = typer.Typer(help="Statistics, export and replay of a queue's history, on Spark.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)

QueueOption = Annotated[str, typer.Option("--queue", "-q", help="Queue name (or namespace/name).")]
RangeOption = Annotated[
    str | None,
    typer.Option("--range", "-r", help="TIME..TIME and/or SHARD:FIRST-LAST terms, comma-separated (default: all)."),
]
MasterOption = Annotated[
    str | None,
    typer.Option("--master", help="Spark master: local[*] (default), spark://HOST:7077 or k8s://https://HOST:PORT; "
                                  "under spark-submit, spark-submit's."),
]
ConfOption = Annotated[
    list[str] | None, typer.Option("--conf", help="Extra Spark setting KEY=VALUE (repeatable).")
]
ConnectorOption = Annotated[
    str,
    typer.Option("--connector", help="auto (cached jars, else packages), local (cached jars only) or packages."),
]
OverwriteOption = Annotated[bool, typer.Option("--overwrite", help="Replace the output directory's contents.")]


def _range(text: str | None, since: str | None, until: str | None) -> RangeSpec:
    spec = parse_range(text)
    return spec.with_times(parse_time(since) if since else None, parse_time(until) if until else None)


def _conf(items: list[str] | None) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SparkJobError(f"--conf {item!r}: expected KEY=VALUE")
        pairs[key.strip()] = value
    return pairs


@contextmanager
def _session(settings: Settings, master: str | None, conf: list[str] | None,
             connector: str) -> Iterator[SparkSession]:
    from pyspark.sql import SparkSession

    from casque.spark.session import DEFAULT_MASTER, SparkOptions, build_session, submitted

    if master is None and not submitted():
        master = DEFAULT_MASTER

    # Embedded (a notebook, the tests): join the process's running session and leave it running.
    running = SparkSession.getActiveSession() is not None
    session = build_session(settings, SparkOptions(master=master, conf=_conf(conf), connector=connector,
                                                   app_name="casque-spark"))
    try:
        with _spark_errors():
            yield session
    finally:
        if not running:
            session.stop()


@contextmanager
def _spark_errors() -> Iterator[None]:
    """A failed Spark job (Cassandra unreachable from an executor, say) as one line."""
    try:
        yield
    except CasqueError:
        raise
    except Exception as error:
        module = type(error).__module__
        if not module.startswith(("py4j", "pyspark")):
            raise
        text = str(error).strip()
        if LATER_FORMAT in text:  # a batch of a later format (casque.spark.readers)
            refusal = text.split(LATER_FORMAT, 1)[1].splitlines()[0]
            raise NewerFormat(refusal.split(": upgrade it")[0] + ": upgrade it") from error
        # Java stack traces follow the first line; the cause is usually the last "Caused by".
        causes = [line.strip() for line in text.splitlines() if line.strip().startswith("Caused by:")]
        first = causes[-1] if causes else (text.splitlines()[0] if text else type(error).__name__)
        raise SparkJobError(f"the Spark job failed: {first[:300]}") from error


def _resolve(settings: Settings, ref: QueueRef, spec: RangeSpec) -> tuple[Store, ResolvedRange]:
    from casque.spark.ranges import resolve

    store = Store.open(settings)
    try:
        return store, resolve(store, ref, spec)
    except BaseException:
        store.close()
        raise


def _require_spark() -> None:
    try:
        import pyspark  # noqa: F401
    except ImportError as missing:
        raise SparkUnavailable("PySpark is not installed: pip install 'casque[spark]'") from missing


@app.command("stats")
def stats(
    queue: QueueOption,
    since: Annotated[str | None, typer.Option("--since", help="RFC3339 time: publishes from this time on.")] = None,
    until: Annotated[str | None, typer.Option("--until", help="RFC3339 time: publishes before this time.")] = None,
    range_: RangeOption = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output directory (default: ./casque-stats-QUEUE-TIME).")
    ] = None,
    overwrite: OverwriteOption = False,
    master: MasterOption = None,
    conf: ConfOption = None,
    connector: ConnectorOption = "auto",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Per-minute rates, sizes, shard balance, ack latency and lag; Parquet, JSON and a report."""
    _require_spark()
    from casque.spark.progress import stage_progress
    from casque.spark.stats import compute

    ref = queue_of(namespace, queue)
    spec = _range(range_, since, until)
    settings = backend_settings(cassandra, zookeeper, keyspace)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = out_dir or Path(f"casque-stats-{ref.namespace}-{ref.name}-{stamp}")
    store, resolved = _resolve(settings, ref, spec)
    try:
        with _session(settings, master, conf, connector) as spark, stage_progress(spark, err, f"stats of {ref}"):
            result = compute(spark, store, resolved, target, overwrite=overwrite)
    finally:
        store.close()
    summary = result.summary
    table = Table(title=f"{ref} ({summary['range']})", show_header=False)
    for label, value in (
        ("messages", f"{summary['messages']:,}"),
        ("batches", f"{summary['batches']:,}"),
        ("bytes", f"{summary['bytes']:,}"),
        ("first published", summary["first_published_at"] or "-"),
        ("last published", summary["last_published_at"] or "-"),
        ("minutes with publishes", str(len(result.tables["per_minute"]))),
        ("subscribers", ", ".join(summary["subscribers"]) or "-"),
    ):
        table.add_row(label, value)
    out.print(table)
    out.print(f"report: {target / 'report.html'}  (tables as Parquet and JSON in {target})")


@app.command("export")
def export(
    queue: QueueOption,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="parquet or jsonl.")] = "parquet",
    from_: Annotated[str | None, typer.Option("--from", help="RFC3339 time: publishes from this time on.")] = None,
    to: Annotated[str | None, typer.Option("--to", help="RFC3339 time: publishes before this time.")] = None,
    range_: RangeOption = None,
    overwrite: OverwriteOption = False,
    master: MasterOption = None,
    conf: ConfOption = None,
    connector: ConnectorOption = "auto",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Write a range's messages, byte for byte, as Parquet or JSON lines (payload in base64)."""
    _require_spark()
    from casque.spark.export import FORMATS, export as run_export
    from casque.spark.progress import stage_progress

    if fmt not in FORMATS:
        raise SparkJobError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    ref = queue_of(namespace, queue)
    spec = _range(range_, from_, to)
    settings = backend_settings(cassandra, zookeeper, keyspace)
    store, resolved = _resolve(settings, ref, spec)
    try:
        with _session(settings, master, conf, connector) as spark, stage_progress(spark, err, f"export of {ref}"):
            result = run_export(spark, store.keyspace_of(ref.namespace), resolved, fmt, out_dir, overwrite=overwrite)
    finally:
        store.close()
    shards = ", ".join(f"{shard}: {count:,}" for shard, count in sorted(result.per_shard.items())) or "none"
    out.print(f"exported {result.messages:,} messages ({result.payload_bytes:,} payload bytes) of {ref} "
              f"to {out_dir} as {fmt}; per shard {shards}")


@app.command("replay")
def replay(
    queue: QueueOption,
    into: Annotated[str, typer.Option("--into", help="The queue to publish into (or namespace/name).")],
    range_: RangeOption = None,
    from_: Annotated[str | None, typer.Option("--from", help="RFC3339 time: publishes from this time on.")] = None,
    to: Annotated[str | None, typer.Option("--to", help="RFC3339 time: publishes before this time.")] = None,
    master: MasterOption = None,
    conf: ConfOption = None,
    connector: ConnectorOption = "auto",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Re-publish a range into another queue through the publish path; a rerun adds nothing."""
    _require_spark()
    from casque.spark.progress import rich_progress
    from casque.spark.replay import replay as run_replay

    ref = queue_of(namespace, queue)
    target = queue_of(namespace, into)
    if target == ref:
        raise SparkJobError(f"cannot replay {ref} into itself")
    spec = _range(range_, from_, to)
    settings = backend_settings(cassandra, zookeeper, keyspace)
    store, resolved = _resolve(settings, ref, spec)
    try:
        with _session(settings, master, conf, connector) as spark:
            with rich_progress(err, f"{ref} -> {target}") as progress:
                result = asyncio.run(run_replay(spark, store, resolved, target, progress))
    finally:
        store.close()
    out.print(
        f"replayed {ref} ({spec}) into {target}: {result.published:,} published, "
        f"{result.already_there + result.duplicates:,} already there, {result.expired:,} expired"
    )
    out.print(json.dumps(result.describe()), highlight=False, soft_wrap=True)
