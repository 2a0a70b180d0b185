"""The sidecar's aiohttp application: one factory, typed keys, resources opened in cleanup_ctx.

Middlewares, outermost first: metrics (sees every answer, errors included), errors (turns
every failure into the JSON error shape), guards (Host, Origin, content type and declared
length, before any body is read), the bearer token check when configured, then the gate
that handles few large requests at a time (bodies.py).

Resources: the app listens at once and connects its backends in the background, retrying
until they answer (see runtime.py); then it builds the QueueService with its publishers,
consumers and push workers. A caller may lend a Store, as tests do. Leaving the cleanup
context drains the service first, so even an app stopped without server.py's signal
handling releases its leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from casque.config import Settings
from casque.engine.clock import clock_of
from casque.errors import AccessDenied, TlsRefused
from casque.sidecar import bodies
from casque.sidecar.auth import bearer_middleware
from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import error_middleware
from casque.sidecar.guards import guard_middleware
from casque.sidecar.keys import BACKENDS, METRICS, OPENAPI, RUNTIME, SETTINGS, TRACING
from casque.sidecar.logs import request_middleware
from casque.sidecar.metrics import SidecarMetrics, metrics_middleware
from casque.sidecar.openapi import build
from casque.sidecar.push import PushWorker, push_token
from casque.sidecar.routes import OPERATIONS, add_routes
from casque.sidecar.runtime import Runtime
from casque.sidecar.scopes import Scopes, scope_middleware
from casque.sidecar.service import QueueService, Subscription
from casque.sidecar.tracing import Tracing, from_environment
from casque.store import Store

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "METRICS", "OPENAPI", "RUNTIME", "SETTINGS", "TRACING", "create_app", "service_of"]

CONNECT_RETRY_MIN_SECONDS = 0.5
CONNECT_RETRY_MAX_SECONDS = 10.0


def _version() -> str:
    try:
        return metadata.version("casque")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def create_app(
    settings: SidecarSettings, backends: Settings | None = None, store: Store | None = None,
    tracing: Tracing | None = None,
) -> web.Application:
    """A sidecar app. `store`, when given, is used as it is and left open at the end; so is
    `tracing`. Without it, tracing is what the OTEL_* variables configure (tracing.py)."""
    metrics = SidecarMetrics()
    # The request id first: every line logged while a request is handled, errors included, names it.
    middlewares: list[Middleware] = [
        request_middleware(settings.access_log), metrics_middleware(metrics), error_middleware,
        guard_middleware(settings),
    ]
    if settings.token is not None:
        middlewares.append(bearer_middleware(settings.token.get_secret_value()))
    # After auth (a stranger learns nothing of the scopes), before any body is read.
    needs = {op.operation_id: op.scope for op in OPERATIONS if op.scope is not None}
    middlewares.append(scope_middleware(Scopes.of(settings.publish_scope, settings.subscribe_scope), needs))
    middlewares.append(bodies.large_requests)  # after auth: a stranger's uploads hold no slot
    # aiohttp's own limit stays as a backstop behind bodies.py's, which refuses earlier.
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app[BACKENDS] = backends or Settings()
    app[METRICS] = metrics
    app[RUNTIME] = Runtime()
    app[TRACING] = tracing if tracing is not None else from_environment()
    openapi: Callable[[], dict[str, Any]] = functools.cache(
        functools.partial(build, OPERATIONS, _version(), bearer_token=settings.token is not None))
    app[OPENAPI] = openapi
    bodies.install(app)
    memory = bodies.memory_of(app)
    metrics.track_request_memory(lambda: memory.charged, lambda: memory.peak)
    add_routes(app)
    app.cleanup_ctx.append(_backends_context(store))
    if tracing is None and app[TRACING] is not None:
        app.on_cleanup.append(_flush_spans)
    return app


async def _flush_spans(app: web.Application) -> None:
    # Spans are exported in the background in batches: flush what is left before exiting.
    traced = app[TRACING]
    if traced is not None:
        await asyncio.to_thread(traced.shutdown)


def service_of(app: web.Application) -> QueueService:
    """The app's service once its backends are connected (NotReady before)."""
    return app[RUNTIME].require()


def _backends_context(lent: Store | None) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        runtime = app[RUNTIME]
        if lent is not None:
            # Connected already: the service is up (its clock read) before the first request.
            await _connect(app, lent)
            connecting = None
        else:
            connecting = asyncio.get_running_loop().create_task(_connect(app, lent))
        try:
            yield
        finally:
            if connecting is not None:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
            if runtime.service is not None:
                await runtime.service.drain()
            if runtime.store is not None and lent is None:
                await asyncio.to_thread(runtime.store.close)

    return context


async def _connect(app: web.Application, lent: Store | None) -> None:
    """Open the backends, retrying with backoff until they answer, then start serving."""
    runtime = app[RUNTIME]
    delay = CONNECT_RETRY_MIN_SECONDS
    store = lent
    while store is None:
        try:
            store = await _open_store(app[BACKENDS], app[SETTINGS].namespace)
        except (AccessDenied, TlsRefused) as error:
            # Wrong credentials or certificates do not heal by themselves, but a rotated
            # Secret mounted anew does not restart the process either: say why loudly, and
            # keep trying slowly.
            runtime.problem = f"a backend refused the sidecar's credentials: {error}"
            log.error("%s; retrying in %.1fs", runtime.problem, CONNECT_RETRY_MAX_SECONDS)
            await asyncio.sleep(CONNECT_RETRY_MAX_SECONDS)
        except Exception as error:  # any failure to connect is worth another try; the log says which
            runtime.problem = f"backends not reachable yet ({type(error).__name__}: {error}); retrying"
            log.warning("%s in %.1fs", runtime.problem, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, CONNECT_RETRY_MAX_SECONDS)
    await _read_backend_clock(store, runtime)
    runtime.store = store
    service = QueueService(store, app[SETTINGS], app[METRICS])
    token = push_token(app[SETTINGS])  # one per start: the same for every subscriber's pushes
    tracing = app[TRACING]
    service.on_consumer_started.append(lambda subscription: _start_push(service, subscription, token, tracing))
    runtime.service = service
    runtime.problem = ""
    runtime.connected.set()
    service.start()
    log.info("backends connected")


async def _read_backend_clock(store: Store, runtime: Runtime) -> None:
    """Learn Cassandra's clock before serving: claims' times and due times are judged by
    other processes, so none may be read from this process's own clock (casque.engine.clock)."""
    delay = CONNECT_RETRY_MIN_SECONDS
    while True:
        try:
            await clock_of(store.session).sample()
            return
        except Exception as error:  # Cassandra answered a moment ago: worth another try
            runtime.problem = f"cannot read Cassandra's clock yet ({type(error).__name__}: {error}); retrying"
            log.warning("%s in %.1fs", runtime.problem, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, CONNECT_RETRY_MAX_SECONDS)


async def _open_store(settings: Settings, namespace: str) -> Store:
    opening = asyncio.get_running_loop().run_in_executor(None, Store.open, settings, namespace)
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        # Stopped while connecting: the thread goes on, so close what it opens.
        def close(done: asyncio.Future[Store]) -> None:
            if not done.cancelled() and done.exception() is None:
                with contextlib.suppress(Exception):
                    done.result().close()

        opening.add_done_callback(close)
        raise


def _start_push(service: QueueService, subscription: Subscription, token: str, tracing: Tracing | None) -> None:
    """A push worker per consumer: it pushes while the sidecar or the Subscriber names a URL."""
    consumer = subscription.consumer
    assert consumer is not None and service.queue is not None
    worker = PushWorker(consumer, service.queue, subscription.name, service.settings, service.metrics, token,
                        tracing)
    subscription.push = worker
    worker.start()
    service.stoppers.append(worker.stop)
