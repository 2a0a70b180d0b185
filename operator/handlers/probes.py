"""The liveness probe: fails when a watch stream has stalled (see casque.operator.health)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client

from casque.operator.context import OperatorContext
from casque.operator.resources import GROUP, VERSION

logger = logging.getLogger(__name__)


async def watch_health(context: OperatorContext, seen: Mapping[str, kopf.Index[str, str]]) -> dict[str, Any]:
    """`seen` maps a plural (queues, subscribers) to kopf's index of delivered resourceVersions."""
    report: dict[str, Any] = {}
    stalled: list[str] = []
    for plural, index in seen.items():
        try:
            listed = await asyncio.to_thread(list_versions, context, plural)
        except Exception as error:  # noqa: BLE001 - an API outage says nothing about our watch
            logger.warning("liveness: listing %s failed: %s", plural, error)
            report[plural] = {"listed": None}
            continue
        delivered = {uid: version for uid, versions in index.items() for version in list(versions)[-1:]}
        behind = context.health.check(plural, delivered, listed, time.monotonic())
        report[plural] = {"listed": len(listed), "watched": len(delivered), "stalled": len(behind)}
        stalled += [f"{plural}/{uid}" for uid in behind]
    if stalled:
        # PermanentError: fail this probe now rather than retry inside it; kopf then answers 500.
        raise kopf.PermanentError(f"watch stream stalled: the API server has newer versions of {', '.join(stalled)}")
    return report


def list_served(context: OperatorContext, plural: str) -> list[dict[str, Any]]:
    """Every object of `plural` in the namespaces the operator serves, by a fresh LIST (blocking)."""
    api = client.CustomObjectsApi(context.kube_api())
    pages: list[Any]
    if context.namespaces:
        pages = [api.list_namespaced_custom_object(GROUP, VERSION, ns, plural) for ns in context.namespaces]
    else:
        pages = [api.list_cluster_custom_object(GROUP, VERSION, plural)]
    return [item for page in pages for item in page.get("items", [])]


def list_versions(context: OperatorContext, plural: str) -> dict[str, str]:
    """uid -> resourceVersion of every object the operator serves, by a fresh LIST."""
    return {item["metadata"]["uid"]: item["metadata"]["resourceVersion"] for item in list_served(context, plural)}
