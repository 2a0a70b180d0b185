"""Queue handlers: reconcile on create, update and resume; refresh on a timer; delete by policy."""

from __future__ import annotations

from datetime import datetime, timezone

import kopf

from casque.operator import reconcile
from casque.operator.context import OperatorContext
from casque.operator.handlers.common import report, resource_of, run_locked, to_kopf


async def apply(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, lambda: reconcile.reconcile_queue(context.stores, resource, datetime.now(timezone.utc))
    )
    report(body, patch, outcome, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)


async def refresh(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, lambda: reconcile.refresh_queue(context.stores, resource, datetime.now(timezone.utc))
    )
    report(body, patch, outcome, logger, timer=True)


async def delete(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(context, body, lambda: reconcile.delete_queue(context.stores, resource))
    report(body, patch, outcome, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)
    context.forget(body.metadata.uid)
