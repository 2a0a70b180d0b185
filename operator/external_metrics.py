"""The answers of the Kubernetes External Metrics API (`external.metrics.k8s.io/v1beta1`)
for casque's subscribers, from the figures the operator's status refreshes write into each
Subscriber's status: what lets a HorizontalPodAutoscaler (or KEDA) scale a consumer
Deployment on a subscriber's lag without Prometheus in between.

The answers come from the Subscribers as the API server holds them, not from the backends:
any replica answers the same, leader or not, and a read costs the API server one list. The
figures are as fresh as the last status refresh (the chart's refresh interval).

A metric's labels are the Subscriber's own labels with `queue` and `subscriber` over them;
an HPA's `metric.selector` picks among the namespace's Subscribers by them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"


def _status_figure(key: str) -> Callable[[Mapping[str, Any], datetime], float | None]:
    def figure(status: Mapping[str, Any], now: datetime) -> float | None:
        value = status.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return figure


def _oldest_pending_age(status: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds since the oldest message the subscriber has yet to consume was published; 0
    when nothing is pending, none before the first refresh."""
    if "oldestPendingTime" not in status:
        return None
    oldest = status["oldestPendingTime"]
    if not oldest:
        return 0.0
    try:
        published = datetime.fromisoformat(str(oldest))
    except ValueError:
        return None
    return max(0.0, (now - published).total_seconds())


# Metric name: how to read it from a Subscriber's status at a moment.
METRICS: Mapping[str, Callable[[Mapping[str, Any], datetime], float | None]] = {
    "casque-subscriber-lag-messages": _status_figure("lagMessages"),
    "casque-subscriber-in-flight": _status_figure("inFlight"),
    "casque-subscriber-oldest-pending-age-seconds": _oldest_pending_age,
}


class BadSelector(ValueError):
    """A label selector that does not parse: the API answers 400 with this message."""


@dataclass(frozen=True)
class Requirement:
    """One clause of a label selector: `key` `operator` `values` (exists, !exists, in, notin)."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator == "in":
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values  # notin


# A label key (an optional DNS-subdomain prefix and a name) and a label value, as Kubernetes
# allows them.
_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s+\(\s*({_VALUE}(?:\s*,\s*{_VALUE})*)\s*\)$")
_EQUALITY = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")


def _clauses(selector: str) -> Iterable[str]:
    """The selector's comma-separated clauses; commas inside a set's parentheses stay."""
    depth, start = 0, 0
    for at, char in enumerate(selector):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            yield selector[start:at].strip()
            start = at + 1
    yield selector[start:].strip()


def parse_selector(selector: str) -> tuple[Requirement, ...]:
    """A Kubernetes label selector (`a=b,c!=d,e in (f,g),!h`); empty selects everything."""
    if not selector.strip():
        return ()
    requirements = []
    for clause in _clauses(selector):
        if match := _SET.match(clause):
            values = frozenset(v.strip() for v in match.group(3).split(","))
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif match := _EQUALITY.match(clause):
            operator = "notin" if match.group(2) == "!=" else "in"
            requirements.append(Requirement(match.group(1), operator, frozenset({match.group(3)})))
        elif match := _EXISTS.match(clause):
            requirements.append(Requirement(match.group(2), "!exists" if match.group(1) else "exists"))
        else:
            raise BadSelector(f"cannot parse {clause!r} of the label selector {selector!r}")
    return tuple(requirements)


def metric_labels(subscriber: Mapping[str, Any]) -> dict[str, str]:
    """The labels of a Subscriber's metrics: its own, then its queue and name."""
    metadata = subscriber.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    labels["queue"] = str((subscriber.get("spec") or {}).get("queue", ""))
    labels["subscriber"] = str(metadata.get("name", ""))
    return labels


def quantity(value: float) -> str:
    """`value` as a Kubernetes quantity: whole numbers as they are, others in thousandths."""
    if value == int(value):
        return str(int(value))
    return f"{round(value * 1000)}m"


def resource_list() -> dict[str, Any]:
    """The group version's discovery document: one resource per metric, read with get."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {"name": name, "singularName": "", "namespaced": True, "kind": "ExternalMetricValueList",
             "verbs": ["get"]}
            for name in METRICS
        ],
    }


def metric_values(metric: str, subscribers: Iterable[Mapping[str, Any]], selector: str,
                  now: datetime) -> dict[str, Any]:
    """The ExternalMetricValueList of `metric` over the `subscribers` (of one namespace) that
    `selector` picks. A Subscriber with no figure yet (before its first refresh) is left
    out. Raises KeyError for a metric casque does not serve, BadSelector for a bad selector."""
    read = METRICS[metric]
    requirements = parse_selector(selector)
    items: list[dict[str, Any]] = []
    for subscriber in subscribers:
        labels = metric_labels(subscriber)
        if not all(requirement.matches(labels) for requirement in requirements):
            continue
        value = read(subscriber.get("status") or {}, now)
        if value is None:
            continue
        items.append({"metricName": metric, "metricLabels": labels,
                      "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "value": quantity(value)})
    items.sort(key=lambda item: item["metricLabels"]["subscriber"])
    return {"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": items}
