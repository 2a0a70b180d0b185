"""The External Metrics API's answers from Subscribers' statuses (casque.operator.external_metrics)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from casque.operator.external_metrics import (
    GROUP_VERSION,
    BadSelector,
    Requirement,
    metric_values,
    parse_selector,
    quantity,
    resource_list,
)

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)


def subscriber(name: str, queue: str, status: dict[str, Any] | None, labels: dict[str, str] | None = None
               ) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": {"queue": queue},
            **({"status": status} if status is not None else {})}


BILLING = subscriber("billing", "orders", {"lagMessages": 1200, "inFlight": 40,
                                           "oldestPendingTime": "2026-12-04T11:59:30Z"}, {"team": "payments"})
AUDIT = subscriber("audit", "orders", {"lagMessages": 0, "inFlight": 0, "oldestPendingTime": None})
FRESH = subscriber("fresh", "orders", None)  # not refreshed yet


def values(metric: str, selector: str = "") -> dict[str, str]:
    listed = metric_values(metric, [BILLING, AUDIT, FRESH], selector, NOW)
    assert listed["kind"] == "ExternalMetricValueList" and listed["apiVersion"] == GROUP_VERSION
    return {item["metricLabels"]["subscriber"]: item["value"] for item in listed["items"]}


def test_each_metric_reads_its_figure_and_leaves_out_subscribers_not_refreshed_yet() -> None:
    assert values("casque-subscriber-lag-messages") == {"audit": "0", "billing": "1200"}
    assert values("casque-subscriber-in-flight") == {"audit": "0", "billing": "40"}
    # An age, from the publish time of the oldest pending message; 0 with nothing pending.
    assert values("casque-subscriber-oldest-pending-age-seconds") == {"audit": "0", "billing": "30"}


def test_a_selector_picks_by_the_subscribers_name_queue_and_own_labels() -> None:
    assert values("casque-subscriber-lag-messages", "subscriber=billing") == {"billing": "1200"}
    assert values("casque-subscriber-lag-messages", "queue==orders,subscriber!=billing") == {"audit": "0"}
    assert values("casque-subscriber-lag-messages", "team in (payments, risk)") == {"billing": "1200"}
    assert values("casque-subscriber-lag-messages", "team notin (payments)") == {"audit": "0"}
    assert values("casque-subscriber-lag-messages", "!team") == {"audit": "0"}
    assert values("casque-subscriber-lag-messages", "team,queue=orders") == {"billing": "1200"}
    assert values("casque-subscriber-lag-messages", "queue=payments") == {}


def test_an_items_labels_name_its_queue_and_subscriber_over_the_subscribers_own() -> None:
    shadowing = subscriber("billing", "orders", {"lagMessages": 1}, {"subscriber": "other", "queue": "x"})
    (item,) = metric_values("casque-subscriber-lag-messages", [shadowing], "", NOW)["items"]
    assert item["metricLabels"] == {"subscriber": "billing", "queue": "orders"}
    assert item["timestamp"] == "2026-12-04T12:00:00Z"


@pytest.mark.parametrize("selector", ["team in payments", "=x", "a=b=c", "a b", "team in (a,b", "Bad Key=x"])
def test_a_selector_that_does_not_parse_is_refused_with_the_clause(selector: str) -> None:
    with pytest.raises(BadSelector, match="cannot parse"):
        parse_selector(selector)


def test_selector_clauses_parse_as_kubernetes_writes_them() -> None:
    assert parse_selector("") == ()
    assert parse_selector("app.kubernetes.io/name=billing-worker, tier in (a,b) ,!gone") == (
        Requirement("app.kubernetes.io/name", "in", frozenset({"billing-worker"})),
        Requirement("tier", "in", frozenset({"a", "b"})),
        Requirement("gone", "!exists"),
    )


def test_an_unknown_metric_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        metric_values("casque-subscriber-bogus", [BILLING], "", NOW)


def test_quantities_are_whole_or_in_thousandths_and_discovery_lists_every_metric() -> None:
    assert [quantity(v) for v in (0.0, 12.0, 1.5, 0.0004)] == ["0", "12", "1500m", "0m"]
    listed = resource_list()
    assert listed["groupVersion"] == GROUP_VERSION
    assert {r["name"] for r in listed["resources"]} == {
        "casque-subscriber-lag-messages", "casque-subscriber-in-flight", "casque-subscriber-oldest-pending-age-seconds"}
    assert all(r["namespaced"] and r["verbs"] == ["get"] for r in listed["resources"])
