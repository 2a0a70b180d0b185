"""Every Prometheus metric the operator exports, and the small functions that record them.

Served with prometheus_client's default registry by `casque operator run --metrics-port`,
on every replica: the leader's reconciles and subscriber figures, every replica's webhook
answers and whether it leads. The handlers, the webhook and the leadership loop record
through the functions here and never touch a metric object, so names and labels live in
one place and the rules in helm/casque/templates/prometheusrule.yaml are checked against it
(tests/unit/test_dashboards.py, tests/integration/test_helm.py).

Subscriber gauges: every status refresh of a Subscriber sets them from the figures it just
wrote into the status, so Prometheus (and an autoscaler reading it, such as KEDA) sees the
same lag as `kubectl get subscribers`, from one exporter instead of every sidecar at scrape
time.

No metric here carries a `namespace` label of its own except the subscriber and namespace
storage gauges, whose `namespace` is the Subscriber's or the measured one's: the chart's
ServiceMonitor honours it, so the operator's own series get the namespace the operator runs
in from the scrape target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, Protocol

from prometheus_client import Counter, Gauge, Histogram

# --- reconciles ---------------------------------------------------------------------------

Kind = Literal["Queue", "Subscriber"]
# apply: create, update or resume; refresh: the status timer (which also repairs drift).
Action = Literal["apply", "refresh", "delete"]
# ok: the wanted state was reached; temporary_error: retried (by kopf after its delay, or by
# the next refresh); permanent_error: only a new spec can help.
ReconcileOutcome = Literal["ok", "temporary_error", "permanent_error"]

# Reconciles run from a few milliseconds (nothing to change) to tens of seconds (a table
# created on a loaded Cassandra, a backend timing out).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

RECONCILES = Counter(
    "casque_operator_reconciles", "Reconciles of Queues and Subscribers, by kind, action and outcome",
    ["kind", "action", "outcome"],
)
RECONCILE_SECONDS = Histogram(
    "casque_operator_reconcile_duration_seconds", "Time a reconcile took, under the object's lock, by kind and action",
    ["kind", "action"], buckets=DURATION_BUCKETS,
)
RECONCILE_ERRORS = Counter(
    "casque_operator_reconcile_errors",
    "Reconciles that did not reach the wanted state, by kind and reason (the Ready condition's reason)",
    ["kind", "reason"],
)
DRIFT_REPAIRS = Counter(
    "casque_operator_drift_repairs",
    "Drift a status refresh found and put right (a dropped table, a lost znode ...), one per thing repaired",
    ["kind"],
)
REBUILDS = Counter(
    "casque_operator_rebuilds",
    "State ZooKeeper had lost or held older than Cassandra's checkpoints (a queue, a subscriber, a head, an "
    "offset, a seek epoch), rebuilt from them; one per thing rebuilt",
    ["kind"],
)


class Failed(Protocol):
    """What the metrics need of a failed reconcile (casque.operator.failures.Failure)."""

    @property
    def reason(self) -> str: ...

    @property
    def permanent(self) -> bool: ...


def outcome_of(failure: Failed | None) -> ReconcileOutcome:
    if failure is None:
        return "ok"
    return "permanent_error" if failure.permanent else "temporary_error"


def observe_reconcile(kind: Kind, action: Action, seconds: float, failure: Failed | None) -> None:
    """Count one reconcile, its duration, and its failure's reason if it failed."""
    RECONCILES.labels(kind, action, outcome_of(failure)).inc()
    RECONCILE_SECONDS.labels(kind, action).observe(seconds)
    if failure is not None:
        RECONCILE_ERRORS.labels(kind, failure.reason).inc()


def count_repairs(kind: Kind, repaired: Sequence[str], rebuilt: Sequence[str] = ()) -> None:
    if repaired:
        DRIFT_REPAIRS.labels(kind).inc(len(repaired))
    if rebuilt:
        REBUILDS.labels(kind).inc(len(rebuilt))


# --- leadership ---------------------------------------------------------------------------

LEADER = Gauge(
    "casque_operator_leader",
    "1 while this replica holds the Lease and runs the reconcilers (or runs without leader election), else 0",
)


def record_leadership(leading: bool) -> None:
    LEADER.set(1 if leading else 0)


# --- the injection webhook ----------------------------------------------------------------

# injected: the pod got a sidecar; skipped: it asked for none; refused: its annotations ask for
# something impossible (the pod is refused, with the reason); error: the webhook failed to
# answer (the API server then applies the failurePolicy: with Ignore the pod starts bare).
AdmissionOutcome = Literal["injected", "skipped", "refused", "error"]

ADMISSION_REVIEWS = Counter(
    "casque_operator_admission_reviews", "Pods the injection webhook answered, by outcome", ["outcome"]
)


def count_admission(outcome: AdmissionOutcome) -> None:
    ADMISSION_REVIEWS.labels(outcome).inc()


# --- namespaces' stored bytes (casque.operator.storage_quota) ----------------------------------

NAMESPACE_STORED_BYTES = Gauge("casque_namespace_stored_bytes",
                               "Bytes on disk of the namespace's keyspace across the ring, replicas included, as "
                               "last measured", ["namespace"])
NAMESPACE_STORED_BYTES_LIMIT = Gauge("casque_namespace_stored_bytes_limit",
                                     "The namespace's stored-bytes quota (absent: none)", ["namespace"])
NAMESPACE_PUBLISHING = Gauge("casque_namespace_publishing",
                             "1 while the namespace may publish, 0 while it is over its stored-bytes or write-rate quota",
                             ["namespace"])


def _set_or_remove(gauge: Gauge, namespace: str, value: float | None) -> None:
    """The namespace's series set to `value`, or absent without one."""
    if value is None:
        try:
            gauge.remove(namespace)
        except KeyError:
            pass
    else:
        gauge.labels(namespace).set(value)


def namespace_storage(namespace: str, stored: int, limit: int | None, publishing: bool) -> None:
    NAMESPACE_STORED_BYTES.labels(namespace).set(stored)
    _set_or_remove(NAMESPACE_STORED_BYTES_LIMIT, namespace, limit)
    NAMESPACE_PUBLISHING.labels(namespace).set(1 if publishing else 0)


NAMESPACE_WRITES_PER_SECOND = Gauge("casque_namespace_writes_per_second",
                                    "Writes into the namespace's publishing tables per second, over the last "
                                    "interval (with a write-rate quota)", ["namespace"])
NAMESPACE_WRITES_PER_SECOND_LIMIT = Gauge("casque_namespace_writes_per_second_limit",
                                          "The namespace's write-rate quota (absent: none)", ["namespace"])


def namespace_write_rate(namespace: str, rate: float | None, limit: float | None) -> None:
    """The last measured rate and the limit; both absent without a limit."""
    _set_or_remove(NAMESPACE_WRITES_PER_SECOND, namespace, rate)
    _set_or_remove(NAMESPACE_WRITES_PER_SECOND_LIMIT, namespace, limit)


# --- subscriber figures -------------------------------------------------------------------

_LABELS = ["namespace", "queue", "subscriber"]
SUBSCRIBER_GAUGES = {
    "lagMessages": Gauge("casque_subscriber_lag_messages", "Messages the subscriber has yet to consume", _LABELS),
    "lagBatches": Gauge("casque_subscriber_lag_batches", "Batches the subscriber has yet to consume", _LABELS),
    "inFlight": Gauge("casque_subscriber_in_flight", "Messages delivered and not yet acked", _LABELS),
    "consumers": Gauge("casque_subscriber_consumers", "Live consumers (sidecars) of the subscriber", _LABELS),
    "standingBy": Gauge("casque_subscriber_standing_by",
                        "Consumers holding nothing: in leased delivery, those beyond the queue's shards", _LABELS),
    "deadLettered": Gauge("casque_subscriber_dead_lettered", "Messages sent to the dead-letter queue so far",
                          _LABELS),
    "filtered": Gauge("casque_subscriber_filtered", "Messages the subscriber's filter did not match so far",
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
