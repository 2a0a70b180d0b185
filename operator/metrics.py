"""Queue-level figures the operator exports once for the whole installation.

Every status refresh of a Subscriber sets its gauges from the figures it just wrote into the
status, so Prometheus (and an autoscaler reading it, such as KEDA) sees the same lag as
`kubectl get subscribers`, from one exporter instead of every sidecar at scrape time.
Served with prometheus_client's default registry by `casque operator run --metrics-port`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

_LABELS = ["namespace", "queue", "subscriber"]
SUBSCRIBER_GAUGES = {
    "lagMessages": Gauge("casque_subscriber_lag_messages", "Messages the subscriber has yet to consume", _LABELS),
    "lagBatches": Gauge("casque_subscriber_lag_batches", "Batches the subscriber has yet to consume", _LABELS),
    "inFlight": Gauge("casque_subscriber_in_flight", "Messages delivered and not yet acked", _LABELS),
    "consumers": Gauge("casque_subscriber_consumers", "Live consumers (sidecars) of the subscriber", _LABELS),
}
# The queue each subscriber's series were last set under, to remove them on deletion.
_exported: dict[tuple[str, str], str] = {}


def observe_subscriber(namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Set the subscriber's gauges from a status patch (figures absent or null are left as they are)."""
    queue = status.get("queue")
    if not isinstance(queue, str):
        return
    previous = _exported.get((namespace, name))
    if previous is not None and previous != queue:
        forget_subscriber(namespace, name)
    _exported[(namespace, name)] = queue
    for key, gauge in SUBSCRIBER_GAUGES.items():
        value = status.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge.labels(namespace, queue, name).set(value)


def forget_subscriber(namespace: str, name: str) -> None:
    queue = _exported.pop((namespace, name), None)
    if queue is None:
        return
    for gauge in SUBSCRIBER_GAUGES.values():
        try:
            gauge.remove(namespace, queue, name)
        except KeyError:
            pass
