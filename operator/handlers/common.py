"""What every handler does around a reconcile flow, in one place.

Run the flow under the object's lock (counted and timed for Prometheus), write its status
patch, post Kubernetes Events, and map a failure to kopf: `PermanentError` when only a new
spec can help, `TemporaryError(delay=...)` otherwise. This is the operator's one place
that translates casque's failures to the outside.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from casque.operator import conditions, metrics
from casque.operator.context import OperatorContext
from casque.operator.failures import Failure, classify
from casque.operator.reconcile import Outcome, Resource


def resource_of(body: kopf.Body) -> Resource:
    return Resource(
        namespace=body.metadata.namespace or "default",
        name=body.metadata.name,
        spec=dict(body.spec),
        status=dict(body.status),
        generation=body.metadata.get("generation"),
    )


async def run_locked(
    context: OperatorContext,
    body: kopf.Body,
    kind: metrics.Kind,
    action: metrics.Action,
    flow: Callable[[], Awaitable[Outcome]],
) -> Outcome:
    """Run `flow` under the object's lock, counted and timed (the wait for the lock excluded:
    it measures the other handler of the object, not this one)."""
    async with context.lock(body.metadata.uid):
        started = time.monotonic()
        try:
            outcome = await flow()
        except Exception as error:
            # The flows turn every failure into an Outcome; one escaping is a bug, counted too.
            metrics.observe_reconcile(kind, action, time.monotonic() - started, classify(error))
            raise
        metrics.observe_reconcile(kind, action, time.monotonic() - started, outcome.failure)
        metrics.count_repairs(kind, outcome.repaired, outcome.changes.rebuilt)
        return outcome


def report(body: kopf.Body, patch: kopf.Patch, outcome: Outcome, logger: kopf.Logger, *, timer: bool = False) -> None:
    """Status and events. A timer posts a failure only when it flips Ready, not on every tick."""
    for key, value in outcome.status.items():
        patch.status[key] = value
    if outcome.changes.actions:
        kopf.info(body, reason="Applied", message="; ".join(outcome.changes.actions))
    for warning in outcome.changes.warnings:
        kopf.warn(body, reason="Warning", message=warning)
    for rebuilt in outcome.changes.rebuilt:
        kopf.warn(body, reason="Rebuilt", message=rebuilt)
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


def report_refresh(
    context: OperatorContext, body: kopf.Body, patch: kopf.Patch, outcome: Outcome, logger: kopf.Logger
) -> bool:
    """A status timer's report, or none if the operator began to stop while the timer ran:
    stopping closes its own backend connections, so a failure then says nothing of the
    backends, and writing it would flip Ready on every rollout (the next leader puts it back)."""
    if context.stopped.is_set():
        logger.debug("the operator is stopping: the refresh's status is left unwritten")
        return False
    report(body, patch, outcome, logger, timer=True)
    return True


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
