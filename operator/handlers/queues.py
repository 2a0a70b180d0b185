"""Queue handlers: reconcile on create, update and resume; refresh on a timer; delete by policy.

Before a Queue is reconciled its namespace gets its ZooKeeper identity (a Secret, when
ZooKeeper authentication is configured), its Cassandra keyspace, role and Secret (with
keyspace isolation), and its quotas are read from the Namespace; after the namespace's last
Queue is deleted the Secrets and the role go too (the keyspace stays, with retained data).
The namespace also gets copies of the sidecar's Secrets (casque.operator.copies), which stay.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.errors import CasqueError, InvalidSpec
from casque.operator import failures, metrics, namespace_setup, reconcile, refusals, resource_specs, tenancy
from casque.operator.context import OperatorContext
from casque.operator.failures import Failure
from casque.operator.handlers import secrets
from casque.operator.handlers.common import report, report_refresh, resource_of, run_locked, to_kopf
from casque.operator.quotas import Limits, limits_for
from casque.operator.reconcile import Outcome
from casque.operator.resources import GROUP, QUEUES, VERSION
from casque.operator.storage_quota import StorageVerdict
from casque.tenancy import NamespaceRole

NAMESPACE_RETRY_SECONDS = 20.0

log = logging.getLogger(__name__)


async def apply(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    outcome = await reconcile_and_report(context, body, patch, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)


async def reconcile_and_report(context: OperatorContext, body: kopf.Body, patch: kopf.Patch,
                               logger: kopf.Logger) -> Outcome:
    """A Queue's apply, its status into `patch` and its events posted; its failure returned,
    with the retry a quota's refusal waits for."""
    resource = resource_of(body)
    judged_by: dict[str, str] = {}  # the namespace's quota annotations, as the flow read them

    async def flow() -> Outcome:
        now = datetime.now(timezone.utc)
        try:
            judged_by.update(await asyncio.to_thread(read_quota_annotations, context, resource.namespace))
            limits = limits_for(context.quotas, judged_by)
            closed = await asyncio.to_thread(namespace_setup.close_owned_ensemble, context.stores,
                                             context.stores.settings)
            if closed:
                kopf.info(body, reason="Applied", message=f"ZooKeeper's {', '.join(closed)} closed to every login "
                          "but the installation's (anyone may read)")
            if await asyncio.to_thread(namespace_setup.apply_znode_quota, context.stores, context.stores.settings,
                                       resource.namespace, limits.znodes):
                kopf.info(body, reason="Applied",
                          message=f"namespace {resource.namespace}: ZooKeeper quota {limits.znodes.describe()}")
            if await asyncio.to_thread(
                tenancy.apply_zookeeper_secret, context.kube_api(), context.stores.settings, resource.namespace,
                functools.partial(namespace_setup.secure_namespace_znodes, context.stores, resource.namespace),
            ):
                kopf.info(body, reason="Applied", message=f"Secret {tenancy.ZOOKEEPER_SECRET} written "
                          "(the namespace's ZooKeeper identity; its znodes' ACLs name it)")
            role = tenancy.cassandra_role(context.stores.settings, resource.namespace)
            if role is not None:
                # The role before the Secret that names it, with the writes its stored bytes allow.
                verdict = await asyncio.to_thread(storage_verdict, context, resource.namespace, role, limits)
                publishing = verdict.publishing if verdict is not None else context.storage.publishing(resource.namespace)
                await asyncio.to_thread(
                    namespace_setup.prepare_namespace_cassandra, context.stores, resource.namespace, role, publishing
                )
                context.storage.granted(resource.namespace, publishing)
                if await asyncio.to_thread(
                    tenancy.apply_cassandra_secret, context.kube_api(), context.stores.settings, resource.namespace
                ):
                    kopf.info(body, reason="Applied", message=f"Secret {tenancy.CASSANDRA_SECRET} written "
                              f"(the namespace's Cassandra role, keyspace {role.keyspace})")
        except InvalidSpec as error:  # a malformed quota annotation on the Namespace
            return reconcile.failed(resource, Failure(failures.INVALID_QUOTA, str(error), failures.QUOTA_RETRY_SECONDS,
                                                      error), now)
        except ApiException as error:
            message = f"preparing namespace {resource.namespace}: Kubernetes API answered {error.status} {error.reason}"
            return reconcile.failed(resource, Failure("NamespaceNotPrepared", message, NAMESPACE_RETRY_SECONDS, error), now)
        except CasqueError as error:  # the namespace's keyspace or role could not be made
            return reconcile.failed(resource, failures.classify(error), now)
        return await reconcile.reconcile_queue(context.stores, resource, now, limits)

    outcome = await run_locked(context, body, "Queue", "apply", flow)
    if outcome.failure is not None and outcome.failure.reason in refusals.QUOTA_REASONS:
        outcome = replace(outcome, failure=replace(outcome.failure, retry_after=context.options.quota_retry_seconds))
    context.refusals.record(resource.namespace, resource.name, outcome.failure, judged_by)
    report(body, patch, outcome, logger)
    # Whatever became of the Queue: its namespace's pods need the Secrets either way.
    await secrets.keep_copies(context, body, logger)
    return outcome


async def admit_refused(context: OperatorContext, namespace: str, names: list[str], logger: kopf.Logger) -> None:
    """Apply again the Queues of `namespace` refused for its quotas, now that room may have
    been made, and write their status. kopf's own retry of each stays scheduled: it finds
    the Queue reconciled, or refused again as now."""
    api = client.CustomObjectsApi(context.kube_api())
    for name in names:
        try:
            raw = await asyncio.to_thread(api.get_namespaced_custom_object, GROUP, VERSION, namespace, QUEUES, name)
        except ApiException as error:
            if error.status == 404:
                context.refusals.forget(namespace, name)
            else:
                logger.warning("Queue %s/%s refused for its quota not tried again now: Kubernetes API answered "
                               "%s %s (its retry stays)", namespace, name, error.status, error.reason)
            continue
        body = kopf.Body(cast(kopf.RawBody, raw))
        if body.metadata.get("deletionTimestamp"):
            continue
        patch = kopf.Patch()
        outcome = await reconcile_and_report(context, body, patch, logger)
        logger.info("Queue %s/%s, refused for its namespace's quotas, applied again: %s", namespace, name,
                    "reconciled" if outcome.failure is None else outcome.failure.reason)
        try:
            await asyncio.to_thread(api.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, QUEUES,
                                    name, {"status": dict(patch.status)})
        except ApiException as error:
            # kopf's retry writes it: the Queue's own handler runs the same apply.
            logger.warning("status of Queue %s/%s not written: Kubernetes API answered %s %s", namespace, name,
                           error.status, error.reason)


async def quotas_changed(context: OperatorContext, namespace: str, annotations: Mapping[str, str] | None,
                         logger: kopf.Logger) -> None:
    """A Namespace changed: its refused Queues judged by other quota annotations are applied again."""
    names = context.refusals.judged_by_other_quotas(namespace, annotations or {})
    if names:
        await admit_refused(context, namespace, names, logger)


def read_quota_annotations(context: OperatorContext, namespace: str) -> dict[str, str]:
    """The Namespace's annotations that override the operator's default quotas (blocking)."""
    namespace_object = client.CoreV1Api(context.kube_api()).read_namespace(namespace)
    metadata = namespace_object.metadata
    return refusals.quota_annotations(metadata.annotations if metadata is not None else None)


def namespace_limits(context: OperatorContext, namespace: str) -> Limits:
    """The operator's default quotas, overridden by the Namespace's annotations (blocking)."""
    return limits_for(context.quotas, read_quota_annotations(context, namespace))


def storage_verdict(context: OperatorContext, namespace: str, role: NamespaceRole,
                    limits: Limits) -> StorageVerdict | None:
    """The namespace's stored bytes and write rate against its limits, measured at most once
    per refresh interval (blocking); None, logged, when Cassandra did not say (the last writes
    stay)."""
    try:
        verdict = context.storage.verdict(context.stores(), role, namespace, limits.max_stored_bytes,
                                          limits.max_writes_per_second)
    except CasqueError as error:
        log.warning("namespace %s: stored bytes not measured: %s", namespace, error)
        return None
    metrics.namespace_storage(namespace, verdict.stored.bytes, verdict.limit, verdict.publishing)
    metrics.namespace_write_rate(namespace, verdict.rate.writes_per_second if verdict.rate else None,
                                 verdict.rate.limit if verdict.rate else None)
    return verdict


async def enforce_storage(context: OperatorContext, body: kopf.Body, namespace: str) -> StorageVerdict | None:
    """The namespace's verdict, and its role's writes set to match (a Queue's refresh)."""
    role = tenancy.cassandra_role(context.stores.settings, namespace)
    if role is None:
        return None
    try:
        limits = await asyncio.to_thread(namespace_limits, context, namespace)
    except (InvalidSpec, ApiException):
        return None  # the Queue's apply reports a bad annotation; an API error, the next refresh
    verdict = await asyncio.to_thread(storage_verdict, context, namespace, role, limits)
    if verdict is None:
        return None
    try:
        changed = await asyncio.to_thread(context.storage.enforce, context.stores(), role, namespace, verdict)
    except CasqueError as error:
        log.warning("namespace %s: writes of its role not changed: %s", namespace, error)
        return verdict
    if changed:
        kopf.event(body, type="Normal" if verdict.publishing else "Warning",
                   reason="Publishing" if verdict.publishing else verdict.reason, message=verdict.describe())
    return verdict


async def refresh(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    verdict = await enforce_storage(context, body, resource.namespace)
    outcome = await run_locked(
        context, body, "Queue", "refresh",
        lambda: reconcile.refresh_queue(context.stores, resource, datetime.now(timezone.utc), verdict),
    )
    if report_refresh(context, body, patch, outcome, logger):
        await secrets.keep_copies(context, body, logger, timer=True)


async def delete(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    resource = resource_of(body)
    outcome = await run_locked(
        context, body, "Queue", "delete", lambda: reconcile.delete_queue(context.stores, resource)
    )
    report(body, patch, outcome, logger)
    if outcome.failure is not None:
        raise to_kopf(outcome.failure)
    settings = context.stores.settings
    if settings.zookeeper_username is not None or settings.cassandra_isolation == "keyspace":
        await asyncio.to_thread(forget_namespace, context, resource.namespace, resource.name, logger)
    context.forget(body.metadata.uid)
    context.refusals.forget(resource.namespace, resource.name)
    if resource_specs.deletion_policy(resource.spec) == "Delete":
        # Its room may let in a Queue refused for the namespace's quotas (a retained queue
        # keeps its room: the quotas count what the backends hold).
        await admit_refused(context, resource.namespace, context.refusals.refused(resource.namespace), logger)


def forget_namespace(context: OperatorContext, namespace: str, deleted: str, logger: kopf.Logger) -> None:
    """Remove the namespace's identities once its last Queue is gone (blocking). A Queue
    created meanwhile writes them again. Its znodes keep their ACLs and its keyspace its
    tables: a retained queue found again later is reachable with the same identities, which
    are derived, not stored."""
    try:
        if _other_queues(context, namespace, deleted):
            return
        if tenancy.delete_zookeeper_secret(context.kube_api(), namespace):
            logger.info("namespace %s has no Queue left: Secret %s deleted", namespace, tenancy.ZOOKEEPER_SECRET)
        role = tenancy.cassandra_role(context.stores.settings, namespace)
        if role is None:
            return
        if tenancy.delete_cassandra_secret(context.kube_api(), namespace):
            logger.info("namespace %s has no Queue left: Secret %s deleted", namespace, tenancy.CASSANDRA_SECRET)
        namespace_setup.forget_namespace_cassandra(context.stores, role)
        context.storage.forget(namespace)
        logger.info("namespace %s has no Queue left: Cassandra role %s dropped, keyspace %s kept",
                    namespace, role.username, role.keyspace)
        if _other_queues(context, namespace, deleted):
            # A Queue created while the role went: its apply may have run before the drop.
            namespace_setup.prepare_namespace_cassandra(context.stores, namespace, role,
                                                        context.storage.publishing(namespace))
            tenancy.apply_cassandra_secret(context.kube_api(), context.stores.settings, namespace)
    except ApiException as error:
        # A Secret left behind names an identity that reaches only this namespace's data.
        logger.warning("could not remove the Secrets of namespace %s: %s %s", namespace, error.status, error.reason)
    except CasqueError as error:
        # The role stays: it reaches only this namespace's keyspace. The next deletion of a
        # last Queue in the namespace tries again.
        logger.warning("could not drop the Cassandra role of namespace %s: %s", namespace, error)


def _other_queues(context: OperatorContext, namespace: str, deleted: str) -> bool:
    queues = cast(dict[str, Any], client.CustomObjectsApi(context.kube_api()).list_namespaced_custom_object(
        GROUP, VERSION, namespace, QUEUES))
    return any(item["metadata"]["name"] != deleted for item in queues.get("items", []))
