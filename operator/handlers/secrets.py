"""The sidecar Secrets' copies (casque.operator.copies): kept in each Queue's namespace by the
Queue handlers, and pushed to every namespace holding one when a source changes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.operator import copies
from casque.operator.context import OperatorContext
from casque.operator.handlers.probes import list_served
from casque.operator.resources import QUEUES

log = logging.getLogger(__name__)


def names(context: OperatorContext) -> list[str]:
    """The Secrets to copy; none without the operator's own namespace to read them from."""
    if context.secrets_namespace is None:
        return []
    return copies.source_names(context.injection, context.stores.settings)


async def keep_copies(context: OperatorContext, body: kopf.Body, logger: kopf.Logger, *, timer: bool = False) -> None:
    """Create or correct the copies in the namespace of the Queue `body`. From a timer, at most
    once per refresh interval per namespace, and a problem is reported only when it is new.

    A failure is logged, never raised: the Queue itself is fine, and the next tick tries again.
    """
    sources = names(context)
    namespace = body.metadata.namespace or "default"
    if not sources or context.secrets_namespace is None:
        return
    now = time.monotonic()
    # Half the interval: a Queue's own ticks, a little early or late, must not skip every other one.
    if timer and now - context.copies_checked.get(namespace, float("-inf")) < context.options.refresh_interval / 2:
        return
    context.copies_checked[namespace] = now
    try:
        report = await asyncio.to_thread(copy_all, context, sources, namespace)
    except ApiException as error:
        logger.warning("could not copy the sidecar's Secrets into namespace %s: Kubernetes API answered %s %s",
                       namespace, error.status, error.reason)
        return
    if report.written:
        kopf.info(body, reason="SecretsCopied", message=f"copied {', '.join(report.written)} from namespace "
                  f"{context.secrets_namespace} (the sidecar's Secrets)")
    problems = tuple(report.warnings())
    if problems and (not timer or context.copies_reported.get(namespace) != problems):
        for problem in problems:
            logger.warning("%s", problem)
            kopf.warn(body, reason="SecretNotCopied", message=problem)
    context.copies_reported[namespace] = problems


def copy_all(context: OperatorContext, sources: list[str], namespace: str) -> copies.CopyReport:
    assert context.secrets_namespace is not None
    found, missing = copies.read_sources(context.kube_api(), context.secrets_namespace, sources,
                                         copies.copied_keys(context.injection, context.stores.settings))
    report = copies.copy_into(context.kube_api(), found, namespace)
    report.missing = missing
    return report


def queue_namespaces(context: OperatorContext) -> list[str]:
    """The namespaces the operator serves that hold a Queue (blocking)."""
    return sorted({cast(str, item["metadata"]["namespace"]) for item in list_served(context, QUEUES)})


async def follow_sources(context: OperatorContext) -> None:
    """Until the operator stops: read the source Secrets every refresh interval, and when one
    has changed (or on the first pass: a change may have happened while no operator led), make
    every copy current.

    By GET on each name rather than a watch: RBAC lets a watch be limited to one name only
    through a field selector, and kopf watches a resource in every namespace it serves. The
    operator's right is `get` on those names in its own namespace and nothing wider.
    """
    seen: dict[str, str] | None = None
    while not context.stopped.is_set():
        try:
            seen = await asyncio.to_thread(check_sources, context, seen)
        except ApiException as error:
            log.warning("could not read the sidecar's Secrets in namespace %s: Kubernetes API answered %s %s",
                        context.secrets_namespace, error.status, error.reason)
        except Exception:  # noqa: BLE001 - the next pass tries again; this loop must not die
            log.exception("copying the sidecar's Secrets failed")
        try:
            await asyncio.wait_for(context.stopped.wait(), timeout=context.options.refresh_interval)
        except asyncio.TimeoutError:
            pass


def check_sources(context: OperatorContext, seen: dict[str, str] | None) -> dict[str, str] | None:
    """One pass of `follow_sources` (blocking): the sources' resourceVersions now."""
    sources = names(context)
    if not sources or context.secrets_namespace is None:
        return seen
    found, _ = copies.read_sources(context.kube_api(), context.secrets_namespace, sources,
                                   copies.copied_keys(context.injection, context.stores.settings))
    versions = {secret["metadata"]["name"]: str(secret["metadata"].get("resourceVersion")) for secret in found}
    if versions == seen:
        return seen
    with_queues = set(queue_namespaces(context))
    for namespace in served_namespaces(context):
        if namespace == context.secrets_namespace:
            continue
        report = copies.copy_into(context.kube_api(), found, namespace,
                                  "all" if namespace in with_queues else "update")
        if report.written:
            log.info("namespace %s: copies of %s written", namespace, ", ".join(report.written))
        for problem in report.warnings():
            log.warning("%s", problem)
    return versions


def served_namespaces(context: OperatorContext) -> list[str]:
    if context.namespaces:
        return list(context.namespaces)
    listed = client.CoreV1Api(context.kube_api()).list_namespace()
    return [item.metadata.name for item in listed.items if item.metadata is not None and item.metadata.name]
