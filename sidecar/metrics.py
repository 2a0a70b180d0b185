"""Prometheus metrics of one sidecar: requests, messages, latency, lag, in-flight and leases.

Each app has its own registry, so several sidecars in one process (tests) do not mix.
Counters move as requests are handled; the gauges of this sidecar's consumers (in flight,
leases, unread shards, stalls) are refreshed when /metrics is scraped. Subscriber-wide
figures (lag, oldest pending message) are the operator's to export, once for every sidecar
(operator/metrics.py). The one exception is stalls: each sidecar judges the shards it
answers for (casque.sidecar.stalls), reading their offset and head znodes at most every
few seconds, so a stall shows where the stalled consumer runs. Recording a metric must
never fail a request: the middleware keeps its own failures to the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from casque.errors import NewerFormat

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Localhost requests take ~0.1 ms to seconds (long polls); publish waits for a Cassandra write.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "casque_sidecar_requests", "HTTP requests by operation and status.", ["operation", "status"], registry=r
        )
        self.latency = Histogram(
            "casque_sidecar_request_seconds", "Time to answer a request, by operation.", ["operation"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.published = Counter(
            "casque_sidecar_published_messages", "Messages written (duplicates excluded).", ["queue"], registry=r
        )
        self.duplicates = Counter(
            "casque_sidecar_duplicate_publishes", "Publishes whose id was already published.", ["queue"], registry=r
        )
        self.schema_refusals = Counter(
            "casque_sidecar_schema_refused_publishes",
            "Publish requests refused because a message did not match the queue's schema, by the rule that failed.",
            ["queue", "rule"], registry=r,
        )
        self.received = Counter(
            "casque_sidecar_received_messages", "Messages handed to the app (pull or push).",
            ["queue", "subscriber"], registry=r,
        )
        self.redelivered = Counter(
            "casque_sidecar_redelivered_messages", "Deliveries after the first of a message.",
            ["queue", "subscriber"], registry=r,
        )
        self.handed_back = Counter(
            "casque_sidecar_handed_back_messages",
            "Deliveries put back at once because the app's connection closed before it got them.",
            ["queue", "subscriber"], registry=r,
        )
        self.acked = Counter(
            "casque_sidecar_acked_messages", "Messages acknowledged.", ["queue", "subscriber"], registry=r
        )
        self.nacked = Counter(
            "casque_sidecar_nacked_messages", "Messages handed back for redelivery.", ["queue", "subscriber"],
            registry=r,
        )
        self.pushes = Counter(
            "casque_sidecar_push_deliveries", "Push deliveries by outcome (ack, retry, drop).",
            ["subscriber", "outcome"], registry=r,
        )
        self.push_errors = Counter(
            "casque_sidecar_push_errors",
            "Pushes that failed in the sidecar, not at the app, by stage: render (the message cannot be rendered; "
            "dead-lettered or kept), send (nacked with backoff), task (escaped the push; nacked with backoff).",
            ["subscriber", "stage"], registry=r,
        )
        self.push_latency = Histogram(
            "casque_sidecar_push_seconds", "Time the app took to answer a push.", ["subscriber"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.request_memory = Gauge(
            "casque_sidecar_request_memory_bytes",
            "What the request bodies being handled are charged (their bytes, and their JSON values at the "
            "most one was measured to cost): now, and the most since the start.", ["when"], registry=r,
        )
        self.in_flight = Gauge(
            "casque_sidecar_in_flight_messages", "Messages handed out and not yet acked.", ["subscriber"], registry=r
        )
        self.leases = Gauge("casque_sidecar_leased_shards", "Shards this sidecar holds a lease on.", ["subscriber"],
                            registry=r)
        self.unread_shards = Gauge(
            "casque_sidecar_unread_shards",
            "Shards due to this sidecar that it does not read now (lease not held, or reading or committing fails).",
            ["subscriber"], registry=r,
        )
        self.stalled_shards = Gauge(
            "casque_sidecar_stalled_shards",
            "Shards this sidecar answers for (leased, or all in shared delivery) with lag and an offset that has not "
            "moved for the subscriber's stall threshold.",
            ["queue", "subscriber"], registry=r,
        )
        self.stall_seconds = Gauge(
            "casque_sidecar_stall_seconds",
            "The longest a shard with lag that this sidecar answers for has gone without an offset move (0: no lag).",
            ["queue", "subscriber"], registry=r,
        )
        self.protocol = Gauge(
            "casque_sidecar_protocol", "The protocol version whose records this sidecar writes (the installation's).",
            registry=r,
        )
        self.protocol_refused = Gauge(
            "casque_sidecar_protocol_refused",
            "1 while the installation runs a protocol above the highest this sidecar speaks: it publishes nothing.",
            registry=r,
        )
        # Records of a later format this process refused (casque.formats), every reader
        # together: brought up to NewerFormat's count when scraped (`count_refusals`).
        self.newer_format = Counter(
            "casque_sidecar_newer_format_refusals",
            "Stored records refused because a later version of casque wrote them in a format this one cannot read.",
            registry=r,
        )
        self._refusals_counted = 0
        self.stall_threshold = Gauge(
            "casque_sidecar_stall_threshold_seconds",
            "Lag without an offset move for this long is a stall (the subscriber's stallAfter, or from its "
            "visibility timeout).",
            ["queue", "subscriber"], registry=r,
        )

    def track_protocol(self, writes: Callable[[], float], refused: Callable[[], float]) -> None:
        """The installation's protocol as this sidecar follows it (casque.engine.protocol)."""
        self.protocol.set_function(writes)
        self.protocol_refused.set_function(refused)

    def count_refusals(self) -> None:
        seen = NewerFormat.refusals
        if seen > self._refusals_counted:
            self.newer_format.inc(seen - self._refusals_counted)
            self._refusals_counted = seen

    def track_request_memory(self, now: Callable[[], float], peak: Callable[[], float]) -> None:
        self.request_memory.labels("now").set_function(now)
        self.request_memory.labels("peak").set_function(peak)


def metrics_middleware(metrics: SidecarMetrics) -> Middleware:
    """Counts and times every request under its operation (the route name, i.e. the operationId)."""
    # The labelled children, looked up once: labels() takes a lock and builds its key on
    # every call. Operations are the routes' names and statuses a handful, so it stays small.
    children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as http:
            status = http.status
            raise
        finally:
            try:
                route = request.match_info.route
                operation = (route.name if route is not None else None) or "unmatched"
                child = children.get((operation, status))
                if child is None:
                    child = children[(operation, status)] = (
                        metrics.requests.labels(operation, str(status)), metrics.latency.labels(operation))
                child[0].inc()
                child[1].observe(time.perf_counter() - started)
            except Exception:
                log.exception("recording request metrics failed")

    return middleware
