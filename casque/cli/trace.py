"""`casque trace QUEUE MESSAGE_ID`: what happened to a message, read from the backends
(casque.engine.history), as the sidecar's messageHistory answers it."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Annotated

import typer
from rich.console import Console, Group
from rich.table import Table

from casque.cli.output import MACHINE, TableOutput, check, dumps, print_whole
from casque.cli.options import CassandraOption, KeyspaceOption, NamespaceOption, ZookeeperOption, backend_settings
from casque.cli.queue_commands import opened, queue_of
from casque.config import Settings
from casque.engine.history import MessageHistory, Origin, message_history
from casque.schema import QueueRef
from casque.sidecar.history import MessageHistoryResult

out = Console()


def trace(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    message_id: Annotated[str, typer.Argument(help="The id its publish answered with.")],
    output: TableOutput = "table",
    namespace: NamespaceOption = "default",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Where a message is, and for each subscriber whether it is pending, in flight, nacked,
    acked, filtered or dead-lettered (exit code 3 when no message has the id)."""
    check(output, ("table", *MACHINE))
    history = asyncio.run(_read(backend_settings(cassandra, zookeeper, keyspace), queue_of(namespace, queue), message_id))
    if output in MACHINE:
        typer.echo(dumps(MessageHistoryResult.of(history).wire(), output))
    else:
        print_whole(history_view(history), out)


async def _read(settings: Settings, ref: QueueRef, message_id: str) -> MessageHistory:
    async with opened(settings, ref.namespace) as store:
        return await message_history(store, ref, message_id)


def _time(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def origin_text(origin: Origin) -> str:
    place = "" if origin.position is None else (
        f" at shard {origin.position.shard}, batch {origin.position.batch}, seq {origin.position.seq}")
    if origin.kind == "pipeline_output":
        return f"output {origin.index} of message {origin.message_id}, acked by subscriber {origin.subscriber}"
    if origin.kind == "dead_letter":
        return f"dead letter of message {origin.message_id or '?'} of {origin.queue}{place}, given up by {origin.subscriber}"
    if origin.kind == "redrive":
        return f"redrive of dead letter {origin.message_id}"
    if origin.kind == "replay":
        return f"replay of {origin.queue}{place}"
    return "moved from the delayed table when due"


def history_view(history: MessageHistory) -> Group:
    where = Table.grid(padding=(0, 2))
    where.add_column(style="bold")
    where.add_column(no_wrap=True)
    where.add_row("message", history.message_id)
    where.add_row("queue", history.queue)
    if history.position is None:
        where.add_row("state", f"delayed until {_time(history.due_at)}")
        return Group(where)
    p = history.position
    where.add_row("place", f"shard {p.shard} (priority {history.priority}), batch {p.batch}, seq {p.seq}")
    where.add_row("published", f"{_time(history.published_at)} by publisher {history.publisher or '?'}")
    if history.producer_id is not None:
        where.add_row("producer", f"{history.producer_id} #{history.producer_seq}")
    elif history.client_id is not None:
        where.add_row("id key", history.client_id.replace("\x00", " "))
    if history.origin is not None:
        where.add_row("origin", origin_text(history.origin))
    if history.expires_at is not None:
        where.add_row("expires", _time(history.expires_at))
    table = Table(title="subscribers", title_justify="left")
    for column in ("subscriber", "state", "deliveries", "until", "dead letter"):
        table.add_column(column, justify="right" if column == "deliveries" else "left", no_wrap=True)
    for s in history.subscribers:
        dead = "-" if s.dead_letter_queue is None else f"{s.dead_letter_queue}/{s.dead_letter_id or '?'}"
        table.add_row(s.subscriber, s.state, str(s.deliveries), _time(s.until) if s.until else "-", dead)
    return Group(where, table if history.subscribers else "[dim]no subscribers[/dim]")


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
