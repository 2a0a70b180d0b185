"""A status timer that finishes while the operator stops writes nothing (handlers.common.report_refresh)."""

from __future__ import annotations

import asyncio
import logging

import kopf

from casque.config import Settings
from casque.operator.context import OperatorContext, StoreHolder
from casque.operator.failures import Failure
from casque.operator.handlers.common import report_refresh
from casque.operator.reconcile import Outcome

FAILED = Outcome(
    status={"conditions": [{"type": "Ready", "status": "False", "reason": "BackendUnavailable"}]},
    failure=Failure("BackendUnavailable", "ZooKeeper: ConnectionClosedError", retry_after=10),
)


def body(ready: str) -> kopf.Body:
    return kopf.Body({"metadata": {"name": "billing", "namespace": "shop", "uid": "u-1"}, "spec": {},
                      "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "Ready"}]}})


async def test_a_refresh_that_fails_while_the_operator_stops_leaves_the_status_alone() -> None:
    """Stopping closes the operator's own connections: the refresh still running then fails,
    and writing that would flip Ready on every rollout until the next leader put it back."""
    context = OperatorContext(stores=StoreHolder(Settings()), stopped=asyncio.Event())
    context.stopped.set()
    patch = kopf.Patch()
    assert report_refresh(context, body("True"), patch, FAILED, logging.getLogger("test")) is False
    assert not patch


async def test_a_refresh_of_a_running_operator_reports_its_failure() -> None:
    context = OperatorContext(stores=StoreHolder(Settings()), stopped=asyncio.Event())
    patch = kopf.Patch()
    # Already not ready, so no Event is posted (that needs kopf's own context).
    assert report_refresh(context, body("False"), patch, FAILED, logging.getLogger("test")) is True
    assert patch["status"]["conditions"][0]["reason"] == "BackendUnavailable"
