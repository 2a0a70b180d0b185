"""Queue handlers: reconcile on create, update and resume; refresh on a timer; delete by policy.

Before a Queue is reconciled its namespace gets its ZooKeeper identity (a Secret, when
ZooKeeper authentication is configured) and its quotas are read from the Namespace; after
the namespace's last Queue is deleted the Secret goes too.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.errors import InvalidSpec
from casque.operator import reconcile, tenancy
from casque.operator.context import OperatorContext
from casque.operator.handlers.common import report, resource_of, run_locked, to_kopf
from casque.operator.quotas import Limits, limits_for
from casque.operator.reconcile import Failure, Outcome
from casque.operator.resources import GROUP, QUEUES, VERSION

NAMESPACE_RETRY_SECONDS = 20.0


async def apply(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)

    async def flow() -> Outcome:
        now = datetime.now(timezone.utc)
        try:
            limits = await asyncio.to_thread(namespace_limits, context, resource.namespace)
            if await asyncio.to_thread(
                tenancy.apply_zookeeper_secret, context.kube_api(), context.stores.settings, resource.namespace
            ):
                kopf.info(body, reason="Applied", message=f"Secret {tenancy.ZOOKEEPER_SECRET} written "
                          "(the namespace's ZooKeeper identity)")
        except InvalidSpec as error:  # a malformed quota annotation on the Namespace
            return reconcile.failed(resource, Failure("InvalidQuota", str(error), reconcile.QUOTA_RETRY_SECONDS, error), now)
        except ApiException as error:
            message = f"preparing namespace {resource.namespace}: Kubernetes API answered {error.status} {error.reason}"
            return reconcile.failed(resource, Failure("NamespaceNotPrepared", message, NAMESPACE_RETRY_SECONDS, error), now)
        return await reconcile.reconcile_queue(context.stores, resource, now, limits)

    outcome = await run_locked(context, body, flow)
    report(body, patch, outcome, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)


def namespace_limits(context: OperatorContext, namespace: str) -> Limits:
    """The operator's default quotas, overridden by the Namespace's annotations (blocking)."""
    namespace_object = client.CoreV1Api(context.kube_api()).read_namespace(namespace)
    metadata = namespace_object.metadata
    return limits_for(context.quotas, metadata.annotations if metadata is not None else None)


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
    if context.stores.settings.zookeeper_username is not None:
        await asyncio.to_thread(forget_namespace, context, resource.namespace, resource.name, logger)
    context.forget(body.metadata.uid)


def forget_namespace(context: OperatorContext, namespace: str, deleted: str, logger: kopf.Logger) -> None:
    """Remove the namespace's identity once its last Queue is gone (blocking). A Queue created
    meanwhile writes it again. Its znodes keep their ACLs: a retained queue found again later
    is reachable with the same identity, which is derived, not stored."""
    try:
        queues = cast(dict[str, Any], client.CustomObjectsApi(context.kube_api()).list_namespaced_custom_object(
            GROUP, VERSION, namespace, QUEUES))
        if any(item["metadata"]["name"] != deleted for item in queues.get("items", [])):
            return
        if tenancy.delete_zookeeper_secret(context.kube_api(), namespace):
            logger.info("namespace %s has no Queue left: Secret %s deleted", namespace, tenancy.ZOOKEEPER_SECRET)
    except ApiException as error:
        # The Secret left behind names an identity that reaches only this namespace's znodes.
        logger.warning("could not remove Secret %s of namespace %s: %s %s",
                       tenancy.ZOOKEEPER_SECRET, namespace, error.status, error.reason)
