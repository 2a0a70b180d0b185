"""A Queue's or Subscriber's `spec` mapping read into the engine's spec, its problems named by
their field path as in the resource (`spec.shards: ...`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationError

from casque.errors import InvalidSpec
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec

DeletionPolicy = Literal["Retain", "Delete"]


def parse_queue_spec(raw: Mapping[str, Any] | None) -> QueueSpec:
    try:
        return QueueSpec.model_validate(dict(raw or {}))
    except ValidationError as error:
        raise InvalidSpec(describe(error)) from error


def parse_subscriber_spec(raw: Mapping[str, Any] | None) -> SubscriberSpec:
    try:
        return SubscriberSpec.model_validate(dict(raw or {}))
    except ValidationError as error:
        raise InvalidSpec(describe(error)) from error


def describe(error: ValidationError) -> str:
    """One line per problem, named by its field path as in the resource: `spec.shards: ...`."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(["spec", *(str(part) for part in item["loc"])])
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


def queue_ref(namespace: str | None, name: str) -> QueueRef:
    return QueueRef(namespace or "default", name)  # raises InvalidSpec for a bad name


def deletion_policy(raw: Mapping[str, Any] | None) -> DeletionPolicy:
    """The policy alone, so that a Queue whose other fields are invalid can still be deleted."""
    value = (raw or {}).get("deletionPolicy", "Retain")
    return "Delete" if value == "Delete" else "Retain"
