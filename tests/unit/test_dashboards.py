"""The chart's Grafana dashboard and alert rules query only metrics that casque registers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry

from casque.operator import metrics as operator_metrics
from casque.sidecar.metrics import SidecarMetrics

CHART = Path(__file__).resolve().parents[2] / "helm" / "casque"
METRIC = re.compile(r"\bcasque_[a-z_]+\b")


def registered(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes: counters' `_total`, histograms' `_bucket` ... included."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names: set[str] = set()
    for family in registry.collect():
        # A labelled metric with no series yet exposes no samples: its names follow from its type.
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return names


def queried() -> dict[str, set[str]]:
    dashboard = json.loads((CHART / "dashboards" / "casque.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    rules = (CHART / "templates" / "prometheusrule.yaml").read_text()
    rule_expressions = [line.split("expr:", 1)[1] for line in rules.splitlines() if "expr:" in line]
    return {
        "dashboard": {name for text in expressions for name in METRIC.findall(text)},
        "rules": {name for text in rule_expressions for name in METRIC.findall(text)},
    }


def test_every_metric_the_dashboard_and_rules_query_is_registered() -> None:
    assert operator_metrics.SUBSCRIBER_GAUGES  # imported: its gauges are in the default registry
    known = registered(REGISTRY) | registered(SidecarMetrics().registry)
    used = queried()
    assert used["dashboard"] and used["rules"]
    for where, names in used.items():
        assert names <= known, f"{where} queries metrics nobody exports: {sorted(names - known)}"


def test_the_dashboard_shows_lag_age_dead_letters_and_rates() -> None:
    used = queried()["dashboard"]
    assert {"casque_subscriber_lag_messages", "casque_subscriber_oldest_pending_timestamp_seconds",
            "casque_subscriber_dead_lettered", "casque_sidecar_published_messages_total",
            "casque_sidecar_received_messages_total"} <= used
    assert {"casque_subscriber_lag_messages", "casque_subscriber_oldest_pending_timestamp_seconds",
            "casque_subscriber_dead_lettered", "casque_sidecar_stalled_shards", "casque_subscriber_consumers",
            "casque_operator_leader", "casque_operator_reconcile_errors_total",
            "casque_operator_admission_reviews_total", "casque_sidecar_requests_total"} <= queried()["rules"]


def test_the_dashboard_shows_every_operator_metric() -> None:
    """Each series the operator exports for its own health (not the subscriber figures) has a panel."""
    operator_own = {name for name in registered(REGISTRY) if name.startswith("casque_operator_")}
    # A histogram is drawn from its buckets; its sum and count add nothing to a panel.
    drawn = {name for name in operator_own if not name.endswith(("_sum", "_count"))
             and name + "_bucket" not in operator_own and name + "_total" not in operator_own}
    assert drawn, "no operator metric registered"
    missing = drawn - queried()["dashboard"]
    assert not missing, f"operator metrics without a panel: {sorted(missing)}"
