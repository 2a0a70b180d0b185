"""The sidecar's aiohttp application: one factory, typed keys, resources opened in cleanup_ctx.

Middlewares, outermost first: metrics (sees every answer, errors included), errors (turns
every failure into the JSON error shape), then the bearer token check when configured.
Resources: the Store (unless the caller lends one, as tests do) and the QueueService with
its publishers, consumers and push workers. Leaving the cleanup context drains the service
first, so even an app stopped without server.py's signal handling releases its leases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from importlib import metadata

from aiohttp import web
from aiohttp.typedefs import Middleware

from casque.config import Settings
from casque.sidecar.auth import bearer_middleware
from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import error_middleware
from casque.sidecar.keys import BACKENDS, METRICS, OPENAPI, SERVICE, SETTINGS, STORE
from casque.sidecar.metrics import SidecarMetrics, metrics_middleware
from casque.sidecar.openapi import build
from casque.sidecar.push import PushWorker
from casque.sidecar.routes import OPERATIONS, add_routes
from casque.sidecar.service import QueueService, Subscription
from casque.store import Store

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "METRICS", "OPENAPI", "SERVICE", "SETTINGS", "STORE", "create_app"]


def _version() -> str:
    try:
        return metadata.version("casque")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def create_app(settings: SidecarSettings, backends: Settings | None = None, store: Store | None = None) -> web.Application:
    """A sidecar app. `store`, when given, is used as it is and left open at the end."""
    metrics = SidecarMetrics()
    middlewares: list[Middleware] = [metrics_middleware(metrics), error_middleware]
    if settings.token is not None:
        middlewares.append(bearer_middleware(settings.token.get_secret_value()))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app[BACKENDS] = backends or Settings()
    app[METRICS] = metrics
    app[OPENAPI] = build(OPERATIONS, _version(), bearer_token=settings.token is not None)
    add_routes(app)
    app.cleanup_ctx.append(_store_context(store))
    app.cleanup_ctx.append(_service_context)
    return app


def _store_context(lent: Store | None) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        if lent is not None:
            app[STORE] = lent
            yield
            return
        store = await asyncio.to_thread(Store.open, app[BACKENDS])
        app[STORE] = store
        try:
            yield
        finally:
            await asyncio.to_thread(store.close)

    return context


async def _service_context(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    service = QueueService(app[STORE], settings, app[METRICS])
    service.on_consumer_started.append(lambda subscription: _start_push(service, subscription))
    app[SERVICE] = service
    service.start()
    try:
        yield
    finally:
        await service.drain()


def _start_push(service: QueueService, subscription: Subscription) -> None:
    """Push to the sidecar's push URL, else to the one the Subscriber names, if any."""
    consumer = subscription.consumer
    assert consumer is not None and service.queue is not None
    url = service.settings.push_url or consumer.subscriber_state.spec.push_url
    if not url:
        return
    worker = PushWorker(consumer, service.queue, subscription.name, url, service.settings, service.metrics)
    worker.start()
    service.stoppers.append(worker.stop)

