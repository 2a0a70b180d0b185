"""Running the sidecar as a process, with a shutdown that loses nothing.

On SIGTERM (Kubernetes stopping the pod) or SIGINT the sidecar keeps listening while it
drains: new publishes and receives get 503 (the app's client retries elsewhere), accepted
publishes finish their writes, and acks for messages already handed out are still taken,
because the app in the same pod is finishing those very messages. Only then are acks and
offsets flushed, leases released, and the listener closed. A second signal ends the
process at once; that too loses nothing confirmed, since a publish is answered only
after it is written and an ack only after its record is.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import uvloop
from aiohttp import web

from casque import logs
from casque.config import Settings
from casque.logs import LogFormat
from casque.sidecar import heap
from casque.sidecar.app import RUNTIME, create_app
from casque.sidecar.config import SidecarSettings
from casque.sidecar.guards import MAX_HEADERS
from casque.sidecar.logs import quiet_malformed_requests
from casque.sidecar.memory_report import MemoryReports, start_tracing
from casque.sidecar.routes import health_of, metrics_of, readiness_of

log = logging.getLogger(__name__)

# After draining, requests still open (none should be: long polls end on drain) get this long.
CLOSE_TIMEOUT_SECONDS = 5.0


def protocol_options(settings: SidecarSettings) -> dict[str, Any]:
    """How the HTTP connections are held. aiohttp closes a connection that has no whole
    request within its keep-alive timeout, counted from the connection's start and from each
    answer, partial headers or not: so that timeout is the header timeout too."""
    return {"keepalive_timeout": settings.header_timeout_seconds, "max_headers": MAX_HEADERS}


async def serve(
    settings: SidecarSettings,
    backends: Settings | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    # First: SIGUSR2's default action would end the process.
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, MemoryReports(settings.memory_snapshot_dir).report)
    app = create_app(settings, backends)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=CLOSE_TIMEOUT_SECONDS, access_log=None,
                           **protocol_options(settings))
    side_runners: list[web.AppRunner] = []
    await runner.setup()  # quick: the backends are connected in the background (runtime.py)
    heap.settle()  # the modules and the app are set up: out of the collector's way
    settling = asyncio.create_task(_settle_when_connected(app))
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
        await site.start()
        address = settings.base_url
        if settings.port == 0:  # an ephemeral port: report the real one
            sockets = runner.addresses
            if sockets:
                address = f"http://{settings.host}:{sockets[0][1]}"
        # First: once the API is said to listen, all of them do.
        if settings.metrics_port is not None:
            side_runners.append(await _serve_metrics(app, settings.metrics_host, settings.metrics_port))
        if settings.health_port is not None:
            side_runners.append(await _serve_health(app, settings.health_host, settings.health_port))
        log.info("casque sidecar listening on %s", address)
        if on_listening is not None:
            on_listening(address)
        await _until_signalled()
        log.info("stopping: draining for up to %ss", settings.drain_seconds)
        service = app[RUNTIME].service
        if service is not None:
            await service.drain()
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR2)
        settling.cancel()
        for side_runner in side_runners:
            await side_runner.cleanup()
        await runner.cleanup()
    log.info("stopped")


async def _settle_when_connected(app: web.Application) -> None:
    """The drivers' connections and the Cassandra schema metadata are the process's too, once
    connected: out of the collector's way as well, and what connecting freed goes back to
    the system (heap.py)."""
    await app[RUNTIME].connected.wait()
    heap.settle()
    heap.release_free_pages()


async def _serve_metrics(app: web.Application, host: str, port: int) -> web.AppRunner:
    """/metrics of `app`, alone, on `host`:`port` (0: any free port, logged)."""

    async def metrics(_: web.Request) -> web.Response:
        return await metrics_of(app)

    scrape = web.Application()
    scrape.router.add_get("/metrics", metrics)
    return await _serve_beside(scrape, host, port, "metrics", "/metrics")


async def _serve_health(app: web.Application, host: str, port: int) -> web.AppRunner:
    """/healthz and /readyz of `app`, alone, on `host`:`port` (0: any free port, logged)."""

    async def health(_: web.Request) -> web.Response:
        return await health_of(app)

    async def ready(request: web.Request) -> web.Response:
        return await readiness_of(app, request.query.get("scope") == "serving")

    probes = web.Application()
    probes.router.add_get("/healthz", health)
    probes.router.add_get("/readyz", ready)
    return await _serve_beside(probes, host, port, "health", "")


async def _serve_beside(side: web.Application, host: str, port: int, what: str, path: str) -> web.AppRunner:
    runner = web.AppRunner(side, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    shown = f"[{host}]" if ":" in host else host
    log.info("casque sidecar %s on http://%s:%s%s", what, shown, runner.addresses[0][1], path)
    return runner


async def _until_signalled() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for number in signals:
        loop.add_signal_handler(number, stop.set)
    try:
        await stop.wait()
    finally:
        # From now on a second signal has its default effect: the process ends at once.
        for number in signals:
            loop.remove_signal_handler(number)


def run(settings: SidecarSettings, backends: Settings | None = None, log_format: LogFormat = "text") -> None:
    logs.configure(log_format)
    quiet_malformed_requests()
    # The drivers log every reconnect attempt at INFO; the sidecar's own lines matter more here.
    for noisy in ("cassandra", "kazoo"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # uvloop: its socket transports and thread-safe wake-ups (every Cassandra and ZooKeeper
    # reply reaches the loop through one) cost less than the standard loop's; here it took
    # about a tenth off the sidecar's CPU per one-message publish.
    start_tracing(settings.memory_trace_frames)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(settings, backends))
