"""Running the operator: campaign for the Lease, then run kopf until stopped or the Lease is lost.

A replica that does not lead runs no kopf at all, so it neither watches nor writes. While it
waits it still answers its liveness endpoint (it is healthy, merely on standby); once it
leads, kopf serves that endpoint with the watch-health probe.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import urllib.parse
import uuid
from dataclasses import dataclass

import kopf
from aiohttp import web
from kubernetes import client

from casque.operator import metrics
from casque.operator.context import OperatorContext
from casque.operator.leadership import LeaderElector, LeaseConfig

logger = logging.getLogger(__name__)

# Exit codes of `casque operator run`.
EXIT_STOPPED = 0
EXIT_LEADERSHIP_LOST = 3


@dataclass(frozen=True)
class RunOptions:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    liveness: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    lease: LeaseConfig | None = None  # None: no leader election (a single replica)


def default_identity() -> str:
    # Unique per process: a restarted container must not mistake the old holder for itself.
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def main(options: RunOptions) -> int:
    return asyncio.run(run(options))


async def run(options: RunOptions) -> int:
    # Importing the module registers the handlers with kopf's default registry.
    from casque.operator import main as registrations  # noqa: F401

    context = OperatorContext.from_environment(options.namespaces)
    stop = context.stopped
    elector = None
    metrics.record_leadership(False)
    if options.lease is not None:
        elector = LeaderElector(client.CoordinationV1Api(context.kube_api()), options.lease)
        if not await _campaign(elector, options.liveness, stop):
            await asyncio.to_thread(elector.release)
            context.close()
            return EXIT_STOPPED
    # Leading from here until kopf stops: without election this replica is the only one.
    metrics.record_leadership(True)
    try:
        return await _operate(options, context, elector)
    finally:
        metrics.record_leadership(False)


async def _operate(options: RunOptions, context: OperatorContext, elector: LeaderElector | None) -> int:
    stop = context.stopped
    operator = asyncio.create_task(
        kopf.operator(
            standalone=True,
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=options.liveness,
            stop_flag=stop,
            memo=kopf.Memo(casque=context),
        ),
        name="kopf",
    )
    if elector is None:
        await operator
        return EXIT_STOPPED
    keeper = asyncio.create_task(elector.hold(), name="lease")
    try:
        await asyncio.wait({operator, keeper}, return_when=asyncio.FIRST_COMPLETED)
        if keeper.done():
            logger.error("leadership lost: stopping the operator")
            # At once, not after kopf's handlers have wound down: another replica may lead now.
            metrics.record_leadership(False)
            stop.set()
            await operator
            return EXIT_LEADERSHIP_LOST
        operator.result()  # re-raise if kopf failed
        return EXIT_STOPPED
    finally:
        keeper.cancel()
        await asyncio.to_thread(elector.release)


async def _campaign(elector: LeaderElector, liveness: str | None, stop: asyncio.Event) -> bool:
    """Wait for the Lease; False if stopped by a signal first."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    standby = await _serve_standby(liveness) if liveness else None
    try:
        acquire = asyncio.create_task(elector.acquire())
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (acquire, stopped):
            task.cancel()
        return acquire in done and acquire.exception() is None and not stop.is_set()
    finally:
        if standby is not None:
            await standby.cleanup()  # frees the port for kopf's own endpoint
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve_standby(endpoint: str) -> web.AppRunner:
    parts = urllib.parse.urlsplit(endpoint)

    async def healthy(_: web.Request) -> web.Response:
        return web.json_response({"role": "standby"})

    app = web.Application()
    app.add_routes([web.get(parts.path or "/", healthy)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "localhost", parts.port or 80).start()
    return runner
