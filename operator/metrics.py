"""Queue-level figures the operator exports once for the whole installation.

Every status refresh of a Subscriber sets its gauges from the figures it just wrote into the
status, so Prometheus (and an autoscaler reading it, such as KEDA) sees the same lag as
`kubectl get subscribers`, from one exporter instead of every sidecar at scrape time.
Served with prometheus_client's default registry by `casque operator run --metrics-port`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from prometheus_client import Gauge

_LABELS = ["namespace", "queue", "subscriber"]
SUBSCRIBER_GAUGES = {
    "lagMessages": Gauge("casque_subscriber_lag_messages", "Messages the subscriber has yet to consume", _LABELS),
    "lagBatches": Gauge("casque_subscriber_lag_batches", "Batches the subscriber has yet to consume", _LABELS),
    "inFlight": Gauge("casque_subscriber_in_flight", "Messages delivered and not yet acked", _LABELS),
    "consumers": Gauge("casque_subscriber_consumers", "Live consumers (sidecars) of the subscriber", _LABELS),
    "deadLettered": Gauge("casque_subscriber_dead_lettered", "Messages sent to the dead-letter queue so far",
                          _LABELS),
}
# A time, not an age: an age set at each status refresh would be stale by the refresh
# interval between refreshes, while `time() - this` is right at every evaluation. 0 when
# nothing is pending.
OLDEST_PENDING = Gauge("casque_subscriber_oldest_pending_timestamp_seconds",
                       "Publish time (Unix seconds) of the oldest message the subscriber has yet to consume; "
                       "0 when none", _LABELS)
# The queue each subscriber's series were last set under, to remove them on deletion.
_exported: dict[tuple[str, str], str] = {}


def observe_subscriber(namespace: str, name: str, status: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
    """Set the subscriber's gauges from its `status` with this pass's merge `patch` applied.

    A patch holds only what changed (a new lag, but not the unchanged queue name), so the
    gauges are set from both. Figures absent or null are left as they are."""
    figures = {**status, **patch}
    queue = figures.get("queue")
    if not isinstance(queue, str):
        return
    previous = _exported.get((namespace, name))
    if previous is not None and previous != queue:
        forget_subscriber(namespace, name)
    _exported[(namespace, name)] = queue
    for key, gauge in SUBSCRIBER_GAUGES.items():
        value = figures.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge.labels(namespace, queue, name).set(value)
    if "oldestPendingTime" in figures:
        oldest = figures["oldestPendingTime"]
        try:
            stamp = datetime.fromisoformat(oldest.replace("Z", "+00:00")).timestamp() if oldest else 0.0
        except (AttributeError, ValueError):
            return
        OLDEST_PENDING.labels(namespace, queue, name).set(stamp)


def forget_subscriber(namespace: str, name: str) -> None:
    queue = _exported.pop((namespace, name), None)
    if queue is None:
        return
    for gauge in (*SUBSCRIBER_GAUGES.values(), OLDEST_PENDING):
        try:
            gauge.remove(namespace, queue, name)
        except KeyError:
            pass
