"""Scopes as pure logic: what a pod may publish to and consume, from its settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import OutOfScope, status_of
from casque.sidecar.routes import OPERATIONS
from casque.sidecar.scopes import Scopes


def test_unset_scopes_allow_everything() -> None:
    scopes = Scopes.of(None, None)
    scopes.check("publish", "anything")
    scopes.check("subscribe", "anything", "anyone")


def test_empty_scopes_allow_nothing() -> None:
    scopes = Scopes.of([], [])
    with pytest.raises(OutOfScope, match="its publish scope: nothing"):
        scopes.check("publish", "orders")
    with pytest.raises(OutOfScope, match="its subscribe scope: nothing"):
        scopes.check("subscribe", "orders", "billing")


def test_listed_queues_and_subscribers_only() -> None:
    scopes = Scopes.of(["orders"], ["orders/billing", "audit/*"])
    scopes.check("publish", "orders")
    scopes.check("subscribe", "orders", "billing")
    scopes.check("subscribe", "audit", "whoever")
    with pytest.raises(OutOfScope) as refused:
        scopes.check("publish", "audit")
    assert refused.value.code == "out_of_scope" and status_of(refused.value) == 403
    with pytest.raises(OutOfScope, match="orders/shipping"):
        scopes.check("subscribe", "orders", "shipping")
    with pytest.raises(OutOfScope):
        scopes.check("subscribe", "billing", "orders")  # not a prefix match


def test_every_operation_naming_a_subscriber_is_subscribe_scoped_and_publishes_publish_scoped() -> None:
    for operation in OPERATIONS:
        if operation.operation_id in ("publish", "publishBatch"):
            assert operation.scope == "publish"
        elif "{subscriber}" in operation.path and operation.method == "POST":
            assert operation.scope == "subscribe", operation.operation_id
        else:
            assert operation.scope is None  # stats only read
        if operation.scope is not None:
            assert 403 in operation.errors


@pytest.mark.parametrize(
    ("field", "value"),
    [("publish_scope", "Orders"), ("subscribe_scope", "billing"), ("subscribe_scope", "orders/*x")],
)
def test_malformed_scope_settings_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match="scope|DNS label"):
        SidecarSettings(**{field: value})
