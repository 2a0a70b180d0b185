"""`casque apply -f FILE` and `casque delete -f FILE`: Queues and Subscribers without Kubernetes.

A file holds the same YAML documents as the custom resources (`apiVersion: casque.io/v1alpha1`,
kind Queue or Subscriber). They are validated with the same specs and carried out by the same
reconcile flows as the operator's, against the backends of the CASQUE_* settings: the local
stack by default. Every document is checked before anything is done, so a typo in the last
one does not leave the first ones half-applied.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

from casque.errors import CasqueError, InvalidSpec
from casque.schema import validate_name

if TYPE_CHECKING:
    from casque.operator.namespace_setup import StoreSource
    from casque.operator.reconcile import Outcome, Resource

    Flow = Callable[[StoreSource, Resource], Awaitable[Outcome]]

FileOption = Annotated[
    str, typer.Option("--filename", "-f", help="YAML file of Queue and Subscriber documents ('-' for stdin).")
]
NamespaceOption = Annotated[
    str | None,
    typer.Option("--namespace", "-n", help="Namespace of documents that name none (default: default)."),
]


@dataclass(frozen=True)
class Document:
    kind: str  # Queue or Subscriber
    namespace: str
    name: str
    spec: dict[str, Any]
    where: str  # FILE#n, for messages

    @property
    def label(self) -> str:
        if self.kind == "Subscriber":
            return f"subscriber {self.namespace}/{self.name} (queue {self.spec.get('queue')})"
        return f"queue {self.namespace}/{self.name}"


def apply_file(filename: FileOption, namespace: NamespaceOption = None) -> None:
    """Create or update the queues and subscribers of FILE (queues first)."""
    from casque.operator import reconcile

    documents = read_documents(_read(filename), filename, namespace)
    now = datetime.now(timezone.utc)
    steps: list[tuple[Document, Flow]] = [
        *((d, lambda stores, r: reconcile.reconcile_queue(stores, r, now)) for d in documents if d.kind == "Queue"),
        *((d, lambda stores, r: reconcile.reconcile_subscriber(stores, r, now)) for d in documents if d.kind != "Queue"),
    ]
    # As the operator does for a namespace's Queues: its keyspace and role first.
    namespaces = sorted({d.namespace for d in documents if d.kind == "Queue"})
    asyncio.run(_run(steps, prepare=namespaces))


def delete_file(filename: FileOption, namespace: NamespaceOption = None) -> None:
    """Delete the queues and subscribers of FILE (subscribers first); a Queue's deletionPolicy decides its data."""
    from casque.operator import reconcile

    documents = read_documents(_read(filename), filename, namespace)
    steps: list[tuple[Document, Flow]] = [
        *((d, reconcile.delete_subscriber) for d in documents if d.kind == "Subscriber"),
        *((d, reconcile.delete_queue) for d in documents if d.kind == "Queue"),
    ]
    asyncio.run(_run(steps, prepare=[]))


def read_documents(text: str, source: str, namespace: str | None = None) -> list[Document]:
    """The Queue and Subscriber documents of a YAML stream, each validated; InvalidSpec otherwise."""
    from casque.operator import resource_specs
    from casque.operator.resources import API_VERSION, QUEUE_KIND, SUBSCRIBER_KIND

    try:
        raw_documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise InvalidSpec(f"{source}: not valid YAML{_where(error)}") from error
    documents: list[Document] = []
    seen: set[tuple[str, str, str]] = set()
    for number, raw in enumerate(raw_documents, start=1):
        if raw is None:  # an empty document, e.g. after a trailing ---
            continue
        where = f"{source}#{number}" if len(raw_documents) > 1 else source
        if not isinstance(raw, dict):
            raise InvalidSpec(f"{where}: a document must be a mapping with apiVersion, kind, metadata and spec")
        if raw.get("apiVersion") != API_VERSION:
            raise InvalidSpec(f"{where}: apiVersion must be {API_VERSION}, not {raw.get('apiVersion')!r}")
        kind = raw.get("kind")
        if kind not in (QUEUE_KIND, SUBSCRIBER_KIND):
            raise InvalidSpec(f"{where}: kind must be {QUEUE_KIND} or {SUBSCRIBER_KIND}, not {kind!r}")
        metadata = raw.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if not isinstance(name, str):
            raise InvalidSpec(f"{where}: metadata.name is missing")
        spec = raw.get("spec") if raw.get("spec") is not None else {}
        if not isinstance(spec, dict):
            raise InvalidSpec(f"{where}: spec must be a mapping")
        document = Document(
            kind=kind,
            namespace=namespace or (metadata or {}).get("namespace") or "default",
            name=name,
            spec=spec,
            where=where,
        )
        try:
            if kind == QUEUE_KIND:
                resource_specs.queue_ref(document.namespace, name)
                resource_specs.parse_queue_spec(spec)
            else:
                subscriber = resource_specs.parse_subscriber_spec(spec)
                resource_specs.queue_ref(document.namespace, subscriber.queue)
                validate_name("subscriber", name)
        except InvalidSpec as error:
            raise InvalidSpec(f"{where}: {kind} {name}: {error}") from error
        key = (kind, document.namespace, name)
        if key in seen:
            raise InvalidSpec(f"{where}: {kind} {document.namespace}/{name} appears twice")
        seen.add(key)
        documents.append(document)
    if not documents:
        raise InvalidSpec(f"{source}: no Queue or Subscriber documents")
    return documents


async def _run(steps: list[tuple[Document, Flow]], prepare: list[str]) -> None:
    """Carry out each document's flow in order, one line per action; stop at the first failure.
    With keyspace isolation, the namespaces in `prepare` first get their keyspace and Cassandra
    role, as the operator gives them before their first Queue."""
    from casque.config import Settings
    from casque.operator import conditions, namespace_setup, reconcile, tenancy

    settings = Settings()
    store = await asyncio.to_thread(namespace_setup.open_store, settings)
    try:
        for namespace in prepare:
            role = tenancy.cassandra_role(settings, namespace)
            if role is not None:
                await asyncio.to_thread(namespace_setup.prepare_namespace_cassandra, lambda: store, namespace, role)
                typer.echo(f"namespace {namespace}: keyspace {role.keyspace} and Cassandra role {role.username}")
        for document, flow in steps:
            resource = reconcile.Resource(namespace=document.namespace, name=document.name, spec=document.spec)
            outcome = await flow(lambda: store, resource)
            for rebuilt in outcome.changes.rebuilt:
                typer.echo(f"{document.label}: rebuilt: {rebuilt}")
            for action in outcome.changes.actions:
                typer.echo(f"{document.label}: {action}")
            if not outcome.changes.changed and outcome.failure is None:
                typer.echo(f"{document.label}: unchanged")
            for warning in outcome.changes.warnings:
                typer.echo(f"{document.label}: warning: {warning}")
            if outcome.failure is not None:
                error = outcome.failure.error
                kind = type(error) if isinstance(error, CasqueError) else CasqueError
                raise kind(f"{document.label}: {outcome.failure.message}")
            ready = conditions.find(outcome.status.get("conditions"), conditions.READY)
            if ready is not None and ready.get("status") != "True":
                typer.echo(f"{document.label}: not ready: {ready.get('reason')}: {ready.get('message')}")
    finally:
        await asyncio.to_thread(store.close)


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    try:
        return Path(filename).read_text()
    except OSError as error:
        raise InvalidSpec(f"{filename}: {error.strerror}") from error


def _where(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {problem}" if problem else at
