"""What every handler does around a reconcile flow, in one place.

Run the flow under the object's lock, write its status patch, post Kubernetes Events, and map a failure to kopf: `PermanentError` when only
a new spec can help, `TemporaryError(delay=...)` otherwise. This is the operator's one place
that translates casque's failures to the outside.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from casque.operator import conditions
from casque.operator.context import OperatorContext
from casque.operator.reconcile import Failure, Outcome, Resource


def resource_of(body: kopf.Body) -> Resource:
    return Resource(
        namespace=body.metadata.namespace or "default",
        name=body.metadata.name,
        spec=dict(body.spec),
        status=dict(body.status),
        generation=body.metadata.get("generation"),
    )


async def run_locked(context: OperatorContext, body: kopf.Body, flow: Callable[[], Awaitable[Outcome]]) -> Outcome:
    async with context.lock(body.metadata.uid):
        return await flow()


def report(body: kopf.Body, patch: kopf.Patch, outcome: Outcome, logger: kopf.Logger, *, timer: bool = False) -> None:
    """Status and events. A timer posts a failure only when it flips Ready, not on every tick."""
    for key, value in outcome.status.items():
        patch.status[key] = value
    if outcome.changes.actions:
        kopf.info(body, reason="Applied", message="; ".join(outcome.changes.actions))
    for warning in outcome.changes.warnings:
        kopf.warn(body, reason="Warning", message=warning)
    if outcome.repaired:
        kopf.warn(body, reason="Repaired", message="; ".join(outcome.repaired))
    failure = outcome.failure
    if failure is None:
        return
    if failure.error is not None and failure.reason == "InternalError":
        logger.error("%s", failure.message, exc_info=failure.error)
    else:
        logger.warning("%s: %s", failure.reason, failure.message)
    if not timer or ready_flipped(body.status, outcome.status):
        kopf.warn(body, reason=failure.reason, message=failure.message)


def to_kopf(failure: Failure) -> kopf.PermanentError | kopf.TemporaryError:
    text = f"{failure.reason}: {failure.message}"
    if failure.retry_after is None:
        return kopf.PermanentError(text)
    return kopf.TemporaryError(text, delay=failure.retry_after)


def ready_flipped(before: Mapping[str, Any], status_patch: Mapping[str, Any]) -> bool:
    if "conditions" not in status_patch:
        return False
    old = conditions.find(before.get("conditions"), conditions.READY)
    new = conditions.find(status_patch["conditions"], conditions.READY)
    return (old or {}).get("status") != (new or {}).get("status")
