"""`casque get queues|subscribers` and `casque describe queue|subscriber`: what exists, kubectl-style.

They read the catalog (the queues' and subscribers' znodes) and the same statistics as
`casque stats`, on the backends of the CASQUE_* settings, so they work with or without
Kubernetes. `-o json|yaml` prints each one as a casque.io document (apiVersion, kind,
metadata, spec, status): `casque get queues -o yaml > all.yaml` is a file `casque apply -f`
takes back (it ignores status).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from casque.cli.exits import UsageError
from casque.cli.output import MACHINE, ListOutput, TextOutput, check, dumps, dumps_all, print_whole
from casque.cli.options import CassandraOption, KeyspaceOption, ZookeeperOption, backend_settings
from casque.cli.queue_commands import opened
from casque.engine import catalog
from casque.engine.stats import queue_stats, subscriber_stats
from casque.instants import rfc3339
from casque.schema import QueueRef
from casque.specs import QueueState, SubscriberState, format_duration
from casque.store import Store

API_VERSION = "casque.io/v1alpha1"  # the CRDs' (casque.operator.resources); the CLI does not import the operator
out = Console()

get_app = typer.Typer(help="List queues or subscribers.", no_args_is_help=True)
describe_app = typer.Typer(help="Show one queue or subscriber in full: spec and live statistics.", no_args_is_help=True)

NamespaceOption = Annotated[str, typer.Option("--namespace", "-n", help="The namespace.")]
AllNamespaces = Annotated[bool, typer.Option("--all-namespaces", "-A", help="Every namespace.")]


# --- documents --------------------------------------------------------------------------------


def _metadata(ref: QueueRef, name: str, created: datetime) -> dict[str, Any]:
    return {"name": name, "namespace": ref.namespace, "creationTimestamp": _stamp(created)}


def _stamp(moment: datetime) -> str:
    return rfc3339(moment)


def _spec(model: Any) -> dict[str, Any]:
    spec: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return spec


def queue_document(ref: QueueRef, state: QueueState, stats: dict[str, Any] | None, subscribers: list[str]) -> dict[str, Any]:
    status: dict[str, Any] = {"subscribers": subscribers}
    if state.spec.data_schema is not None:
        # The version in force; each message carries the one it was checked against.
        status["schemaVersion"] = state.schema_version
    if stats is not None:
        status.update(stats)
    return {"apiVersion": API_VERSION, "kind": "Queue", "metadata": _metadata(ref, ref.name, state.created_at),
            "spec": _spec(state.spec), "status": status}


def subscriber_document(ref: QueueRef, name: str, state: SubscriberState, stats: dict[str, Any] | None) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Subscriber", "metadata": _metadata(ref, name, state.created_at),
            "spec": _spec(state.spec), "status": stats or {}}


async def _queue_stats(store: Store, ref: QueueRef) -> dict[str, Any]:
    from casque.sidecar.models.status import QueueStatsResult

    wire: dict[str, Any] = QueueStatsResult.of(await queue_stats(store, ref)).wire()
    return wire


async def _subscriber_stats(store: Store, ref: QueueRef, name: str) -> dict[str, Any]:
    from casque.sidecar.models.status import SubscriberStatsResult

    wire: dict[str, Any] = SubscriberStatsResult.of(await subscriber_stats(store, ref, name)).wire()
    return wire


async def _queues(store: Store, refs: list[QueueRef]) -> list[dict[str, Any]]:
    async def one(ref: QueueRef) -> dict[str, Any]:
        state = await asyncio.to_thread(catalog.read_queue, store, ref)
        names = await asyncio.to_thread(catalog.list_subscribers, store, ref)
        return queue_document(ref, state, await _queue_stats(store, ref), names)

    return list(await asyncio.gather(*(one(ref) for ref in refs)))


async def _subscribers(store: Store, pairs: list[tuple[QueueRef, str]]) -> list[dict[str, Any]]:
    async def one(ref: QueueRef, name: str) -> dict[str, Any]:
        state = await asyncio.to_thread(catalog.read_subscriber, store, ref, name)
        return subscriber_document(ref, name, state, await _subscriber_stats(store, ref, name))

    return list(await asyncio.gather(*(one(ref, name) for ref, name in pairs)))


def _ref(namespace: str, name: str) -> QueueRef:
    return QueueRef.parse(name) if "/" in name else QueueRef(namespace, name)


# --- tables -----------------------------------------------------------------------------------


def _age(created: str) -> str:
    seconds = int((datetime.now(timezone.utc) - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds())
    return format_duration(max(seconds, 0)) if seconds < 86400 else f"{seconds // 86400}d"


def _count(value: Any) -> str:
    return "?" if value is None else f"{value:,}"


def _schema(version: int | None) -> str:
    """The queue's schema version in force, `v3`; `-` for a queue without a schema."""
    return "-" if version is None else f"v{version}"


def _stalled(shards: list[int] | None) -> str:
    """The stalled shards (lag, offset unmoved past the threshold), by number."""
    return "-" if not shards else ",".join(map(str, shards))


def queue_table(documents: list[dict[str, Any]], namespaces: bool, wide: bool = False) -> Table:
    """`wide` adds what `kubectl get queues -o wide` shows beyond the default columns."""
    table = Table(box=None, pad_edge=False)
    columns = (["NAMESPACE"] if namespaces else []) + [
        "NAME", "SHARDS", "PRIORITIES", "RETENTION", "SCHEMA", "MESSAGES", "SUBSCRIBERS", "AGE"] + (
        ["CONSISTENCY", "MAX MESSAGE"] if wide else [])
    for column in columns:
        table.add_column(column, no_wrap=True)
    for d in documents:
        spec, status, meta = d["spec"], d["status"], d["metadata"]
        row = ([meta["namespace"]] if namespaces else []) + [
            meta["name"], str(spec["shards"]), str(spec["priorities"]), format_duration(spec["retention"]),
            _schema(status.get("schemaVersion")), _count(status.get("publishedMessages")), str(len(status["subscribers"])), _age(meta["creationTimestamp"])]
        if wide:
            row += [str(spec.get("consistency", "-")), str(spec.get("maxMessageBytes", "-"))]
        table.add_row(*row)
    return table


def subscriber_table(documents: list[dict[str, Any]], namespaces: bool, wide: bool = False) -> Table:
    """`wide` adds the delivery mode and the filter, as `kubectl get subscribers -o wide` does."""
    table = Table(box=None, pad_edge=False)
    columns = (["NAMESPACE"] if namespaces else []) + [
        "QUEUE", "NAME", "LAG", "OLDEST UNACKED", "STALLED", "IN FLIGHT", "DEAD", "FILTERED", "MEMBERS", "AGE"] + (
        ["DELIVERY", "FILTER"] if wide else [])
    for column in columns:
        table.add_column(column, no_wrap=True)
    for d in documents:
        spec, status, meta = d["spec"], d["status"], d["metadata"]
        oldest = status.get("oldestUnackedAgeSeconds")
        row = ([meta["namespace"]] if namespaces else []) + [
            spec["queue"], meta["name"], _count(status.get("lagMessages")),
            "-" if oldest is None else f"{oldest:,.1f}s", _stalled(status.get("stalledShards")),
            _count(status.get("inFlight")),
            _count(status.get("deadLettered")), _count(status.get("filtered")), str(len(status.get("members", []))),
            _age(meta["creationTimestamp"])]
        if wide:
            row += [str(spec.get("delivery", "leased")), str(spec.get("filter", "-"))]
        table.add_row(*row)
    return table


def describe_text(document: dict[str, Any]) -> str:
    """A document as indented `key: value` lines, for people."""
    lines = [f"{document['kind']}: {document['metadata']['namespace']}/{document['metadata']['name']}",
             f"Created: {document['metadata']['creationTimestamp']}"]

    def walk(value: Any, indent: int) -> None:
        pad = "  " * indent
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, dict | list) and item:
                    lines.append(f"{pad}{key}:")
                    walk(item, indent + 1)
                else:
                    lines.append(f"{pad}{key}: {'-' if item is None or item == [] or item == {} else item}")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    first, *rest = list(item.items()) or [("", "")]
                    lines.append(f"{pad}- {first[0]}: {first[1]}")
                    walk(dict(rest), indent + 1)
                else:
                    lines.append(f"{pad}- {item}")

    lines.append("Spec:")
    walk(document["spec"], 1)
    lines.append("Status:")
    walk(document["status"], 1)
    return "\n".join(lines)


# --- commands ---------------------------------------------------------------------------------


def get_queues(
    names: Annotated[list[str] | None, typer.Argument(help="Queues to show (default: all).", show_default=False)] = None,
    namespace: NamespaceOption = "default",
    all_namespaces: AllNamespaces = False,
    output: ListOutput = "table",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """List queues: shards, priorities, retention, published messages, subscribers, age."""
    check(output, ("table", "wide", *MACHINE))
    if names and all_namespaces:
        raise UsageError("name queues or give --all-namespaces, not both")
    settings = backend_settings(cassandra, zookeeper, keyspace)

    async def run() -> list[dict[str, Any]]:
        async with opened(settings) as store:
            if names:
                refs = [_ref(namespace, n) for n in names]
            else:
                refs = await asyncio.to_thread(catalog.list_queues, store, None if all_namespaces else namespace)
            return await _queues(store, refs)

    documents = asyncio.run(run())
    if output in MACHINE:
        typer.echo(dumps_all(documents, output) if documents or output == "json" else "")
    elif documents:
        print_whole(queue_table(documents, all_namespaces, output == "wide"), out)
    else:
        typer.echo("no queues" + ("" if all_namespaces else f" in namespace {namespace}"), err=True)


def get_subscribers(
    queue: Annotated[str | None, typer.Argument(help="Only this queue's (or namespace/name).", show_default=False)] = None,
    namespace: NamespaceOption = "default",
    all_namespaces: AllNamespaces = False,
    output: ListOutput = "table",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """List subscribers: queue, lag, oldest unacked age, stalled shards, in flight, dead-lettered, members, age."""
    check(output, ("table", "wide", *MACHINE))
    if queue and all_namespaces:
        raise UsageError("name a queue or give --all-namespaces, not both")
    settings = backend_settings(cassandra, zookeeper, keyspace)

    async def run() -> list[dict[str, Any]]:
        async with opened(settings) as store:
            if queue:
                refs = [_ref(namespace, queue)]
                await asyncio.to_thread(catalog.read_queue, store, refs[0])  # QueueNotFound for a wrong name
            else:
                refs = await asyncio.to_thread(catalog.list_queues, store, None if all_namespaces else namespace)
            pairs = [(ref, name) for ref in refs for name in await asyncio.to_thread(catalog.list_subscribers, store, ref)]
            return await _subscribers(store, pairs)

    documents = asyncio.run(run())
    if output in MACHINE:
        typer.echo(dumps_all(documents, output) if documents or output == "json" else "")
    elif documents:
        print_whole(subscriber_table(documents, all_namespaces, output == "wide"), out)
    else:
        typer.echo("no subscribers", err=True)


def describe_queue(
    name: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    namespace: NamespaceOption = "default",
    output: TextOutput = "text",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """A queue's spec, when it was created, its subscribers and its statistics."""
    check(output, ("text", *MACHINE))
    settings = backend_settings(cassandra, zookeeper, keyspace)

    async def run() -> dict[str, Any]:
        async with opened(settings) as store:
            (document,) = await _queues(store, [_ref(namespace, name)])
            return document

    document = asyncio.run(run())
    typer.echo(dumps(document, output) if output in MACHINE else describe_text(document))


def describe_subscriber(
    queue: Annotated[str, typer.Argument(help="Queue name (or namespace/name).")],
    name: Annotated[str, typer.Argument(help="Subscriber name.")],
    namespace: NamespaceOption = "default",
    output: TextOutput = "text",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """A subscriber's spec and statistics: lag per shard, in flight, redelivered, dead-lettered, members."""
    check(output, ("text", *MACHINE))
    settings = backend_settings(cassandra, zookeeper, keyspace)

    async def run() -> dict[str, Any]:
        async with opened(settings) as store:
            ref = _ref(namespace, queue)
            await asyncio.to_thread(catalog.read_queue, store, ref)
            (document,) = await _subscribers(store, [(ref, name)])
            return document

    document = asyncio.run(run())
    typer.echo(dumps(document, output) if output in MACHINE else describe_text(document))


def register(app: typer.Typer) -> None:
    # kubectl's habit: plural, singular and short forms all work; help lists the first.
    forms: list[tuple[typer.Typer, tuple[str, ...], Callable[..., None]]] = [
        (get_app, ("queues", "queue", "q"), get_queues),
        (get_app, ("subscribers", "subscriber", "sub"), get_subscribers),
        (describe_app, ("queue", "queues", "q"), describe_queue),
        (describe_app, ("subscriber", "subscribers", "sub"), describe_subscriber),
    ]
    for group, names, command in forms:
        for number, name in enumerate(names):
            group.command(name, hidden=number > 0)(command)
    app.add_typer(get_app, name="get")
    app.add_typer(describe_app, name="describe")
