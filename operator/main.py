"""Every kopf registration of the operator, and nothing else: the handlers live in `handlers/`.

Run it with `casque operator run` (leader election, liveness endpoint, namespaces); the
module also works with plain `kopf run -m casque.operator.main --standalone`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from casque.operator.context import OperatorContext, OperatorOptions, context_of
from casque.operator.handlers import probes, queues, secrets, subscribers
from casque.operator.resources import ANNOTATION_PREFIX, FINALIZER, GROUP, QUEUES, SUBSCRIBERS, VERSION

# Read when the module is imported: kopf fixes timer intervals at registration.
OPTIONS = OperatorOptions()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # Progress and the last handled spec in annotations only: the CRDs' status schema is
    # closed, and kopf's bookkeeping stays out of the status users read.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # One replica acts at a time through a Lease (see leadership.py), not through kopf's peering.
    settings.peering.standalone = True
    # End every watch request after a few minutes, on top of kopf's inactivity timeout:
    # a connection that looks open but delivers nothing is replaced even without bookmarks.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.INFO
    # A refresh timer still running when its object is deleted holds the finalizer until kopf
    # looks again: every 60 s by default, so a deleted Queue lingered a minute on a busy node.
    settings.background.cancellation_polling = 1.0
    if getattr(memo, "casque", None) is None:  # started by `kopf run` rather than `casque operator run`
        memo.casque = OperatorContext.from_environment()


@kopf.on.startup()
async def copy_secrets(memo: kopf.Memo, **_: Any) -> None:
    # Not a kopf handler on Secrets: kopf would watch every Secret of every served namespace.
    context = context_of(memo)
    context.tasks.append(asyncio.create_task(secrets.follow_sources(context), name="sidecar-secrets"))


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    context = context_of(memo)
    context.stopped.set()
    await asyncio.gather(*context.tasks, return_exceptions=True)
    context.close()


# --- Queues -------------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, QUEUES)
@kopf.on.create(GROUP, VERSION, QUEUES)
@kopf.on.update(GROUP, VERSION, QUEUES)
async def apply_queue(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    await queues.apply(context_of(memo), body, patch, logger)


@kopf.on.delete(GROUP, VERSION, QUEUES)
async def delete_queue(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    await queues.delete(context_of(memo), body, patch, logger)


@kopf.timer(GROUP, VERSION, QUEUES, interval=OPTIONS.refresh_interval, initial_delay=OPTIONS.refresh_interval)
async def refresh_queue(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    await queues.refresh(context_of(memo), body, patch, logger)


# A raw watch, not a change handler: kopf keeps no annotations on the cluster's Namespaces,
# and the operator needs only what a Namespace's quota annotations say now.
@kopf.on.event("", "v1", "namespaces")
async def namespace_changed(
    type: str | None, name: str, meta: kopf.Meta, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    if type == "MODIFIED":  # the initial listing comes as None; a new Namespace has no Queues
        await queues.quotas_changed(context_of(memo), name, meta.annotations, logger)


@kopf.index(GROUP, VERSION, QUEUES)
def queue_versions(uid: str, meta: kopf.Meta, **_: Any) -> dict[str, str]:
    return {uid: str(meta.get("resourceVersion"))}


# --- Subscribers --------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, SUBSCRIBERS)
@kopf.on.create(GROUP, VERSION, SUBSCRIBERS)
@kopf.on.update(GROUP, VERSION, SUBSCRIBERS)
async def apply_subscriber(
    body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    await subscribers.apply(context_of(memo), body, patch, logger)


@kopf.on.delete(GROUP, VERSION, SUBSCRIBERS)
async def delete_subscriber(
    body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    await subscribers.delete(context_of(memo), body, patch, logger)


@kopf.timer(GROUP, VERSION, SUBSCRIBERS, interval=OPTIONS.refresh_interval, initial_delay=OPTIONS.refresh_interval)
async def refresh_subscriber(
    body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    await subscribers.refresh(context_of(memo), body, patch, logger)


@kopf.index(GROUP, VERSION, SUBSCRIBERS)
def subscriber_versions(uid: str, meta: kopf.Meta, **_: Any) -> dict[str, str]:
    return {uid: str(meta.get("resourceVersion"))}


# --- Liveness -----------------------------------------------------------------------------


@kopf.on.probe(id="watch")
async def watch_probe(memo: kopf.Memo, **kwargs: Any) -> dict[str, Any]:
    # kopf passes each index as a keyword argument named after its indexing function.
    indices: dict[str, kopf.Index[str, str]] = {
        QUEUES: kwargs["queue_versions"],
        SUBSCRIBERS: kwargs["subscriber_versions"],
    }
    return await probes.watch_health(context_of(memo), indices)


# --- Sidecar injection --------------------------------------------------------------------
# Deliberately not a kopf admission handler: kopf runs only on the replica holding the Lease,
# but the webhook Service sends requests to every replica. `casque operator run --webhook-port`
# serves it beside kopf, on leader and standby alike (see casque.operator.injection).
