"""Subscriber handlers: reconcile on create, update and resume; refresh on a timer; delete."""

from __future__ import annotations

from datetime import datetime, timezone

import kopf

from casque.operator import metrics, reconcile
from casque.operator.context import OperatorContext
from casque.operator.handlers.common import report, report_refresh, resource_of, run_locked, to_kopf


async def apply(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, "Subscriber", "apply",
        lambda: reconcile.reconcile_subscriber(context.stores, resource, datetime.now(timezone.utc)),
    )
    report(body, patch, outcome, logger)
    metrics.observe_subscriber(resource.namespace, resource.name, resource.status or {}, outcome.status)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)


async def refresh(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, "Subscriber", "refresh",
        lambda: reconcile.refresh_subscriber(context.stores, resource, datetime.now(timezone.utc)),
    )
    if report_refresh(context, body, patch, outcome, logger):
        metrics.observe_subscriber(resource.namespace, resource.name, resource.status or {}, outcome.status)


async def delete(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, "Subscriber", "delete", lambda: reconcile.delete_subscriber(context.stores, resource)
    )
    report(body, patch, outcome, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)
    context.forget(body.metadata.uid)
    metrics.forget_subscriber(resource.namespace, resource.name)
