"""`casque publish`, `consume`, `tail`, `stats`, `seek`, `redrive`: the queue from a terminal.

These commands work on the backends directly (the CASQUE_* settings, the local stack by
default), so an operator needs no sidecar to look at or move a queue (`casque sidecar`,
which serves the HTTP API, is in sidecar_command.py). `consume` joins the subscriber's
group like any sidecar, and leaves it cleanly on Ctrl-C; `tail` reads the log and joins
nothing, so it takes no messages from anyone.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from kazoo.recipe.watchers import DataWatch
from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from casque.backends import zk
from casque.cli.exits import UsageError
from casque.cli.options import (
    CassandraOption,
    KeyspaceOption,
    NamespaceOption,
    ZookeeperOption,
    backend_settings,
    readable_errors,
)
from casque.cli.output import MACHINE, TableOutput, TextOutput, check, dumps
from casque.config import Settings
from casque.engine import catalog
from casque.engine.batches import Log
from casque.engine.consumer import Consumer
from casque.engine.deadletters import RedriveResult, redrive as redrive_dead_letters
from casque.engine.messages import Delivery, OutgoingMessage, StoredMessage
from casque.engine.offsets import SeekTarget, seek as seek_offsets
from casque.engine.publisher import Publisher
from casque.engine.stats import QueueStats, SubscriberStats, queue_stats, subscriber_stats
from casque.errors import InvalidSpec
from casque.instants import in_utc
from casque.schema import QueueRef
from casque.sidecar.models.publishing import PublishMessage
from casque.store import Store
from casque.znodes import decode_head

out = Console()
err = Console(stderr=True)

# Publishes from files and counts go out in requests of this many messages.
PUBLISH_CHUNK = 500
# Show a progress bar for operations on at least this many messages.
PROGRESS_FROM = 200


@asynccontextmanager
async def opened(settings: Settings, namespace: str | None = None) -> AsyncIterator[Store]:
    """The backends of `settings`; with `namespace`, as that namespace's sidecar sees them
    (its own keyspace, with keyspace isolation)."""
    store = await asyncio.to_thread(Store.open, settings)
    try:
        yield store if namespace is None else store.for_namespace(namespace)
    finally:
        await asyncio.to_thread(store.close)


def queue_of(namespace: str, name: str) -> QueueRef:
    return QueueRef.parse(name) if "/" in name else QueueRef(namespace, name)


@asynccontextmanager
async def _interruptible() -> AsyncIterator[asyncio.Event]:
    """An event set by Ctrl-C or SIGTERM, so long commands stop cleanly (leases released)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled = []
    for number in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(number, stop.set)
            handled.append(number)
        except (ValueError, RuntimeError):  # not the main thread (embedded use): no handlers
            pass
    try:
        yield stop
    finally:
        for number in handled:
            loop.remove_signal_handler(number)


def _progress(total: int, what: str) -> Progress:
    return Progress(
        TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=total < PROGRESS_FROM,
    )


# --- publish ------------------------------------------------------------------------------------
def _message_from_text(
    data: str, key: str | None, attributes: list[str], content_type: str | None, message_id: str | None,
    ttl: int | None, schedule: dict[str, Any] | None = None,
) -> PublishMessage:
    """DATA is JSON if it reads as JSON, else text."""
    body: dict[str, Any] = {}
    try:
        body["data"] = json.loads(data)
        if content_type is not None and not content_type.endswith("json"):
            body["data"] = data
    except ValueError:
        body["data"] = data
        content_type = content_type or "text/plain; charset=utf-8"
    pairs = {}
    for item in attributes:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--attr {item!r}: expected NAME=VALUE")
        pairs[name] = value
    optional = {"datacontenttype": content_type, "partitionkey": key, "id": message_id, "ttl": ttl,
                **(schedule or {})}
    body.update({k: v for k, v in optional.items() if v is not None})
    if pairs:
        body["attributes"] = pairs
    with readable_errors():
        return PublishMessage.model_validate(body)


def _messages_from_file(path: str) -> list[PublishMessage]:
    """JSON lines, each a message as the API takes it ({"data": ..., "partitionkey": ...})."""
    source = sys.stdin if path == "-" else Path(path).open(encoding="utf-8")
    messages = []
    with source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                messages.append(PublishMessage.model_validate_json(line, strict=True))
            except ValidationError as error:
                first = error.errors(include_url=False)[0]
                where = ".".join(map(str, first["loc"])) or "line"
                raise UsageError(f"{path}:{number}: {where}: {first['msg']}") from None
    return messages


def publish(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    data: Annotated[str | None, typer.Argument(help="The message: JSON if it parses as JSON, else text.")] = None,
    key: Annotated[str | None, typer.Option("--key", "-k", help="Partition key: one key, one shard, in order.")] = None,
    attr: Annotated[list[str] | None, typer.Option("--attr", "-a", help="Attribute NAME=VALUE (repeatable).")] = None,
    content_type: Annotated[str | None, typer.Option("--content-type", help="datacontenttype of the message.")] = None,
    message_id: Annotated[str | None, typer.Option("--id", help="Idempotency id.")] = None,
    ttl: Annotated[int | None, typer.Option(help="Seconds after which it is no longer delivered.")] = None,
    priority: Annotated[int | None, typer.Option("--priority", "-p", min=0, help="Priority level (0 lowest).")] = None,
    delay: Annotated[float | None, typer.Option(min=0, help="Seconds before it is delivered.")] = None,
    deliver_at: Annotated[
        datetime | None, typer.Option("--deliver-at", help="Not delivered before (UTC if no zone).",
                                      formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"])
    ] = None,
    file: Annotated[
        str | None, typer.Option("--file", "-f", help="JSON lines of messages as the API takes them ('-': stdin).")
    ] = None,
    count: Annotated[int, typer.Option("--count", "-c", min=1, help="Publish DATA this many times.")] = 1,
    output: TextOutput = "text",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Publish a message (or a file of them); prints where each landed."""
    check(output, ("text", *MACHINE))
    if (data is None) == (file is None):
        raise UsageError("give DATA or --file")
    if file is not None:
        messages = _messages_from_file(file)
    else:
        assert data is not None
        due = None if deliver_at is None else in_utc(deliver_at)
        schedule = {"priority": priority, "delay": delay, "deliverAt": due}
        one = _message_from_text(data, key, attr or [], content_type, message_id, ttl, schedule)
        messages = [one] * count
    if count > 1 and message_id is not None:
        raise UsageError("--id with --count would publish one message: drop one of them")
    ref = queue_of(namespace, queue)
    settings = backend_settings(cassandra, zookeeper, keyspace)
    asyncio.run(_publish(settings, ref, [m.outgoing() for m in messages], output))


async def _publish(settings: Settings, ref: QueueRef, messages: list[OutgoingMessage], output: str = "text") -> None:
    async with opened(settings, ref.namespace) as store:
        state = await asyncio.to_thread(catalog.read_queue, store, ref)
        publisher = Publisher(store, ref, state)
        # All or nothing: refuse before writing any; checked against the queue's schema too.
        messages = [publisher.checked(message) for message in messages]
        quiet = len(messages) > 10 or output in MACHINE
        landed: list[dict[str, Any]] = []
        with _progress(len(messages), f"publishing to {ref}") as progress:
            task = progress.add_task("publish", total=len(messages))
            for start in range(0, len(messages), PUBLISH_CHUNK):
                chunk = messages[start:start + PUBLISH_CHUNK]
                results = await publisher.publish(chunk)
                progress.advance(task, len(chunk))
                landed.extend({"messageId": r.message_id, "shard": r.shard, "batch": r.batch, "seq": r.seq,
                               "duplicate": r.duplicate,
                               "deliverAt": r.deliver_at.isoformat() if r.deliver_at is not None else None}
                              for r in results)
                if not quiet:
                    for r in results:
                        note = " (duplicate)" if r.duplicate else ""
                        where = (f"shard {r.shard} batch {r.batch} seq {r.seq}" if r.deliver_at is None
                                 else f"delayed until {r.deliver_at.isoformat()}")
                        out.print(f"{r.message_id}  {where}{note}")
        await publisher.flush_heads()
        if output in MACHINE:
            typer.echo(dumps({"queue": str(ref), "results": landed}, output))
        elif quiet:
            out.print(f"published {len(messages)} messages to {ref}")


# --- consume and tail ---------------------------------------------------------------------------
def _describe(message: StoredMessage, deliveries: int | None, output: str, ref: QueueRef) -> str:
    position = message.position
    if output in MACHINE:
        from casque.sidecar.models.receiving import envelope

        record = envelope(_as_delivery(message, deliveries), ref).wire() if deliveries is not None else _log_record(message)
        # JSON: one event per line (JSON lines); YAML: one document per message, a stream.
        return json.dumps(record) if output == "json" else "---\n" + dumps(record, "yaml")
    body = _readable_payload(message)
    key = f" key={message.key}" if message.key else ""
    again = f" (delivery {deliveries})" if deliveries and deliveries > 1 else ""
    when = message.published_at.astimezone(timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    return f"{position.shard}/{position.batch}/{position.seq} {when}{key}{again} {body}"


def _as_delivery(message: StoredMessage, deliveries: int) -> Delivery:
    return Delivery(message=message, receipt="", delivery_count=deliveries, visible_until=0.0)


def _log_record(message: StoredMessage) -> dict[str, Any]:
    return {
        "id": message.message_id,
        "shard": message.position.shard,
        "batch": message.position.batch,
        "seq": message.position.seq,
        "time": message.published_at.isoformat(),
        "partitionkey": message.key,
        "attributes": dict(message.attributes),
        "datacontenttype": message.content_type,
        "data": _readable_payload(message),
    }


def _readable_payload(message: StoredMessage) -> str:
    try:
        return message.payload.decode("utf-8")
    except UnicodeDecodeError:
        return f"<{len(message.payload)} bytes>"


def consume(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    subscriber: Annotated[str, typer.Argument(help="The subscriber to consume as.")],
    max_messages: Annotated[int | None, typer.Option("--max", "-m", min=1, help="Stop after this many.")] = None,
    idle: Annotated[
        float, typer.Option(help="Stop after this many seconds without a message (0: never, follow).")
    ] = 5.0,
    ack: Annotated[bool, typer.Option(help="Ack what was printed (--no-ack: hand it back at once).")] = True,
    output: Annotated[
        str, typer.Option("--output", "-o", help="text, json (CloudEvents, one per line) or yaml (a document each).")
    ] = "text",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Receive messages as SUBSCRIBER, print them and ack them."""
    check(output, ("text", *MACHINE))
    settings = backend_settings(cassandra, zookeeper, keyspace)
    asyncio.run(_consume(settings, queue_of(namespace, queue), subscriber, max_messages, idle, ack, output))


async def _consume(
    settings: Settings, ref: QueueRef, subscriber: str, limit: int | None, idle: float, ack: bool, output: str
) -> None:
    async with opened(settings, ref.namespace) as store, _interruptible() as stop:
        consumer = Consumer(store, ref, subscriber)
        await consumer.start()
        done = 0
        last_seen = asyncio.get_running_loop().time()
        try:
            with _progress(limit or 0, f"consuming {ref}/{subscriber}") as progress:
                task = progress.add_task("consume", total=limit)
                while not stop.is_set() and (limit is None or done < limit):
                    want = min(100, limit - done) if limit is not None else 100
                    # Short waits keep Ctrl-C prompt; the consumer itself wakes on head watches.
                    deliveries = await consumer.receive(want, 0.5)
                    now = asyncio.get_running_loop().time()
                    if not deliveries:
                        if idle > 0 and now - last_seen >= idle:
                            break
                        continue
                    last_seen = now
                    for delivery in deliveries:
                        out.print(_describe(delivery.message, delivery.delivery_count, output, ref),
                                  markup=False, highlight=False, soft_wrap=True)
                    if ack:
                        await asyncio.gather(*(consumer.ack(d.receipt) for d in deliveries))
                    else:
                        await asyncio.gather(*(consumer.nack(d.receipt, 0.0) for d in deliveries))  # back at once, no retry backoff
                    done += len(deliveries)
                    progress.advance(task, len(deliveries))
        finally:
            await consumer.stop()
        err.print(f"{done} messages {'acked' if ack else 'printed and handed back'}")


def tail(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    last: Annotated[int, typer.Option("--last", "-l", min=0, help="Start this many batches back in each shard.")] = 0,
    max_messages: Annotated[int | None, typer.Option("--max", "-m", min=1, help="Stop after this many.")] = None,
    follow: Annotated[bool, typer.Option(help="Keep printing new messages (--no-follow: print and stop).")] = True,
    output: Annotated[
        str, typer.Option("--output", "-o", help="text, json (one per line) or yaml (a document each).")
    ] = "text",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Print new messages of a queue as they are published, without consuming them."""
    check(output, ("text", *MACHINE))
    settings = backend_settings(cassandra, zookeeper, keyspace)
    asyncio.run(_tail(settings, queue_of(namespace, queue), last, max_messages, follow, output))


async def _tail(
    settings: Settings, ref: QueueRef, last: int, limit: int | None, follow: bool, output: str
) -> None:
    async with opened(settings, ref.namespace) as store, _interruptible() as stop:
        state = await asyncio.to_thread(catalog.read_queue, store, ref)
        log = Log(store, ref, state.spec.consistency)
        paths = store.paths(ref)
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        heads: dict[int, int] = {}
        # Head watches wake the tail when a shard's watermark moves: no polling of Cassandra.
        for shard in range(state.spec.shards):
            data, _ = await zk.call(store.zk.get_async, paths.head(shard))
            heads[shard] = decode_head(data)
            DataWatch(store.zk, paths.head(shard), zk.watch_in_loop(
                loop, lambda *_: changed.set(), lambda: not stop.is_set()))
        next_batch = {shard: max(1, head - last + 1) for shard, head in heads.items()}
        printed = 0
        while not stop.is_set():
            changed.clear()
            for shard in sorted(next_batch):
                data, _ = await zk.call(store.zk.get_async, paths.head(shard))
                head = decode_head(data)
                while next_batch[shard] <= head:
                    batches = await log.read_from(shard, next_batch[shard])
                    if not batches:
                        next_batch[shard] += 1  # expired, or beyond this bucket's rows: move on
                        continue
                    for batch in batches:
                        for message in batch.messages:
                            out.print(_describe(message, None, output, ref), markup=False, highlight=False,
                                      soft_wrap=True)
                            printed += 1
                            if limit is not None and printed >= limit:
                                return
                    next_batch[shard] = batches[-1].header.batch + 1
            if not follow:
                return
            waiter = asyncio.ensure_future(changed.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()


# --- stats --------------------------------------------------------------------------------------
def stats(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    subscriber: Annotated[
        list[str] | None, typer.Option("--subscriber", "-s", help="Subscribers to show (default: all).")
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes with --watch.")] = 2.0,
    output: TableOutput = "table",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Published messages, and each subscriber's lag, oldest unacked age and in-flight count."""
    check(output, ("table", *MACHINE))
    if watch and output in MACHINE:
        raise UsageError("--watch refreshes a table: it takes no --output json or yaml")
    settings = backend_settings(cassandra, zookeeper, keyspace)
    asyncio.run(_stats(settings, queue_of(namespace, queue), subscriber, watch, interval, output))


async def _sample(store: Store, ref: QueueRef, names: list[str] | None) -> tuple[QueueStats, list[SubscriberStats]]:
    if names is None:
        names = await asyncio.to_thread(catalog.list_subscribers, store, ref)
    queue = await queue_stats(store, ref)
    subscribers = list(await asyncio.gather(*(subscriber_stats(store, ref, n) for n in names)))
    return queue, subscribers


async def _stats(
    settings: Settings, ref: QueueRef, names: list[str] | None, watch: bool, interval: float, output: str
) -> None:
    async with opened(settings, ref.namespace) as store:
        sample = await _sample(store, ref, names)
        if output in MACHINE:
            typer.echo(dumps(_stats_json(*sample), output))
            return
        if not watch:
            out.print(_stats_view(*sample, rate=None))
            return
        async with _interruptible() as stop:
            with Live(_stats_view(*sample, rate=None), console=out, auto_refresh=False) as live:
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), interval)
                    except TimeoutError:
                        pass
                    earlier = sample[0]
                    sample = await _sample(store, ref, names)
                    live.update(_stats_view(*sample, rate=sample[0].rate_since(earlier)), refresh=True)


def _stats_json(queue: QueueStats, subscribers: list[SubscriberStats]) -> dict[str, Any]:
    from casque.sidecar.models.status import QueueStatsResult, SubscriberStatsResult

    return {
        "queue": QueueStatsResult.of(queue).wire(),
        "subscribers": [SubscriberStatsResult.of(s).wire() for s in subscribers],
    }


def _number(value: float | int | None, digits: int = 0) -> str:
    if value is None:
        return "?"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _stats_view(queue: QueueStats, subscribers: list[SubscriberStats], rate: float | None) -> Group:
    head = Table(title=f"queue {queue.queue}", title_justify="left")
    for column in ("shards", "batches", "messages", "bytes", "delayed", "msgs/s"):
        head.add_column(column, justify="right")
    head.add_row(
        str(len(queue.shards)), _number(queue.batches), _number(queue.published_messages),
        _number(queue.published_bytes), _number(queue.delayed), "-" if rate is None else _number(rate, 1),
    )
    table = Table(title="subscribers", title_justify="left")
    table.add_column("subscriber", no_wrap=True)
    for column in ("lag msgs", "lag batches", "oldest unacked", "in flight", "redelivered", "dead", "filtered", "members"):
        table.add_column(column, justify="right")
    for s in subscribers:
        age = s.oldest_unacked_age_seconds
        table.add_row(
            s.subscriber, _number(s.lag_messages), _number(s.lag_batches),
            "-" if age is None else f"{age:,.1f}s", _number(s.in_flight), _number(s.redelivered),
            _number(s.dead_lettered), _number(s.filtered), str(len(s.members)),
        )
    stamp = queue.sampled_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Group(head, table if subscribers else "[dim]no subscribers[/dim]", f"[dim]{stamp}[/dim]")


# --- seek ---------------------------------------------------------------------------------------
def seek(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    subscriber: Annotated[str, typer.Argument(help="The subscriber to move.")],
    to: Annotated[str | None, typer.Option("--to", help="earliest or latest.")] = None,
    time: Annotated[
        datetime | None, typer.Option("--time", help="The first message published at or after (UTC if no zone).",
                                      formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"])
    ] = None,
    batch: Annotated[list[str] | None, typer.Option("--batch", help="SHARD=BATCH to read next (repeatable).")] = None,
    output: TableOutput = "table",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Move a subscriber: replay from the start or a time, skip to the end, or go to given batches."""
    check(output, ("table", *MACHINE))
    given = [option for option, value in (("--to", to), ("--time", time), ("--batch", batch)) if value]
    if len(given) != 1:
        raise UsageError("give exactly one of --to, --time or --batch")
    if to is not None:
        if to not in ("earliest", "latest"):
            raise UsageError("--to is earliest or latest")
        target = SeekTarget(kind="earliest" if to == "earliest" else "latest")
    elif time is not None:
        target = SeekTarget(kind="time", time=in_utc(time))
    else:
        target = SeekTarget(kind="batch", batches=_shard_batches(batch or []))
    settings = backend_settings(cassandra, zookeeper, keyspace)
    offsets = asyncio.run(_seek(settings, queue_of(namespace, queue), subscriber, target))
    if output in MACHINE:
        typer.echo(dumps({"queue": str(queue_of(namespace, queue)), "subscriber": subscriber, "target": target.kind,
                          "offsets": {str(shard): offset for shard, offset in sorted(offsets.items())}}, output))
        return
    table = Table("shard", "next batch")
    for shard, offset in sorted(offsets.items()):
        table.add_row(str(shard), f"{offset:,}")
    out.print(f"subscriber {subscriber} of {queue} moved ({target.kind}); in-flight receipts are now stale")
    out.print(table)


def _shard_batches(items: list[str]) -> dict[int, int]:
    batches = {}
    for item in items:
        shard, sep, number = item.partition("=")
        if not (sep and shard.isdigit() and number.isdigit()):
            raise UsageError(f"--batch {item!r}: expected SHARD=BATCH, e.g. 0=120")
        batches[int(shard)] = int(number)
    return batches


async def _seek(settings: Settings, ref: QueueRef, subscriber: str, target: SeekTarget) -> dict[int, int]:
    async with opened(settings, ref.namespace) as store:
        if target.batches:
            shards = (await asyncio.to_thread(catalog.read_queue, store, ref)).spec.log_shards()
            outside = [s for s in target.batches if s not in shards]
            if outside:
                raise InvalidSpec(f"queue {ref} has shards {', '.join(map(str, shards))}; no shard {outside[0]}")
        return await asyncio.to_thread(seek_offsets, store, ref, subscriber, target)


# --- redrive ------------------------------------------------------------------------------------
def redrive(
    dead_letter_queue: Annotated[str, typer.Argument(help="The dead-letter queue (or namespace/name).")],
    since: Annotated[
        datetime | None, typer.Option("--since", help="Only messages dead-lettered at or after (UTC if no zone).",
                                      formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"])
    ] = None,
    until: Annotated[
        datetime | None, typer.Option("--until", help="Only messages dead-lettered before (UTC if no zone).",
                                      formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"])
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many messages.")] = None,
    output: TextOutput = "text",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Send dead letters back to the subscriber that gave up on them (a rerun sends nothing twice)."""
    check(output, ("text", *MACHINE))
    settings = backend_settings(cassandra, zookeeper, keyspace)

    async def run() -> RedriveResult:
        dead_letters = queue_of(namespace, dead_letter_queue)
        async with opened(settings, dead_letters.namespace) as store:
            return await redrive_dead_letters(store, dead_letters, None if since is None else in_utc(since),
                                              None if until is None else in_utc(until), limit)

    result = asyncio.run(run())
    if output in MACHINE:
        typer.echo(dumps({"redriven": result.redriven, "duplicates": result.duplicates,
                          "bySource": dict(sorted(result.by_source.items())),
                          "skipped": dict(sorted(result.skipped.items()))}, output))
        return
    skipped = result.skipped_line(queue_of(namespace, dead_letter_queue))
    if skipped is not None:
        out.print(skipped, markup=False, highlight=False, soft_wrap=True)
    for source, count in sorted(result.by_source.items()):
        out.print(f"redrove {count} message(s) to {source}")
    out.print(f"{result.redriven} redriven, {result.duplicates} already redriven before")


def register(app: typer.Typer) -> None:
    app.command("redrive")(redrive)
    app.command("publish")(publish)
    app.command("consume")(consume)
    app.command("tail")(tail)
    app.command("stats")(stats)
    app.command("seek")(seek)

