"""The operator's per-namespace rules, pure: the namespace's ZooKeeper Secret and quotas."""

from __future__ import annotations

import base64

import pytest
from pydantic import SecretStr

from casque.backends.zkacl import Identity, namespace_identity, parse_acl
from casque.config import Settings
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_LOGS, MAX_QUEUES, MAX_RETENTION, Limits, QuotaSettings, limits_for, violations
from casque.operator.tenancy import zookeeper_secret
from casque.specs import QueueSpec

PASSWORD = "i" * 40


def spec(shards: int = 1, priorities: int = 1, retention: int = 3600) -> QueueSpec:
    return QueueSpec(shards=shards, priorities=priorities, retention_seconds=retention)


def test_no_secret_without_zookeeper_authentication() -> None:
    assert zookeeper_secret(Settings(), "shop") is None


def test_the_secret_holds_the_namespaces_identity_and_acl_never_the_installations() -> None:
    settings = Settings(zookeeper_username="casque", zookeeper_password=SecretStr(PASSWORD))
    secret = zookeeper_secret(settings, "shop")
    assert secret is not None and secret["metadata"]["namespace"] == "shop"
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    expected = namespace_identity(Identity("casque", PASSWORD), "shop")
    assert (data["username"], data["password"]) == (expected.username, expected.password)
    assert {entry.id for entry in parse_acl(data["acl"])} == {Identity("casque", PASSWORD).acl_id, expected.acl_id}
    assert PASSWORD not in str(secret)


def test_queue_count_limit_counts_new_queues_only() -> None:
    limits = Limits(max_queues=2)
    assert violations(limits, [spec()], None, spec()) == []
    [problem] = violations(limits, [spec(), spec()], None, spec())
    assert "2 queues and has 2 already" in problem
    assert violations(limits, [spec(), spec()], spec(), spec(shards=2)) == []  # an update is not a new queue


def test_shard_priority_limit_sums_the_namespace() -> None:
    limits = Limits(max_shard_priorities=10)
    assert violations(limits, [spec(shards=4)], None, spec(shards=3, priorities=2)) == []
    [problem] = violations(limits, [spec(shards=4)], None, spec(shards=4, priorities=2))
    assert "would reach 12" in problem and "limit is 10" in problem


def test_lowering_a_limit_never_refuses_what_does_not_grow() -> None:
    limits = Limits(max_shard_priorities=2, max_retention_seconds=60)
    running = spec(shards=8, retention=86400)
    assert violations(limits, [], running, spec(shards=8, retention=3600)) == []
    problems = violations(limits, [], running, spec(shards=9, retention=2 * 86400))
    assert len(problems) == 2 and "retention 2d is longer than the namespace's limit of 1m" in problems[1]


def test_namespace_annotations_override_the_defaults() -> None:
    defaults = QuotaSettings(max_queues=5, max_shard_priorities=20, max_retention="7d")
    assert limits_for(defaults, None) == Limits(5, 20, 7 * 86400)
    assert limits_for(defaults, {MAX_QUEUES: "50", MAX_LOGS: "", MAX_RETENTION: "30d"}) == Limits(50, None, 30 * 86400)
    for bad in ({MAX_QUEUES: "many"}, {MAX_RETENTION: "forever"}):
        with pytest.raises(InvalidSpec):
            limits_for(defaults, bad)
