"""`casque get` and `casque describe` on the real stack: tables, -o json|yaml, and the exit codes."""

from __future__ import annotations

import json
import socket

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from casque.cli.main import app
from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends

REF = QueueRef("default", "orders")


@pytest.fixture
def env(store: Store, backends: Backends, keyspace: str, zk_hosts: str) -> dict[str, str]:
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=7200, consistency="ONE"))
    catalog.apply_queue(store, QueueRef("staging", "audit"), QueueSpec(shards=1, retention_seconds=3600,
                                                                        consistency="ONE"))
    catalog.apply_subscriber(store, REF, "billing", SubscriberSpec(queue="orders", start_position="earliest",
                                                                   visibility_timeout_seconds=45,
                                                                   message_filter='has(attributes.region)'))
    return backends.client_env(keyspace, zk_hosts, store.zk_root)


def run(env: dict[str, str], *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == code, (result.output, result.stderr, result.exception)
    return result


def test_get_queues_as_a_table_and_as_documents(env: dict[str, str]) -> None:
    table = run(env, "get", "queues").stdout
    assert "orders" in table and "audit" not in table and "2h" in table
    everywhere = run(env, "get", "queues", "-A").stdout
    assert "staging" in everywhere and "audit" in everywhere

    (document,) = json.loads(run(env, "get", "queues", "-o", "json").stdout)
    assert document["apiVersion"] == "casque.io/v1alpha1" and document["kind"] == "Queue"
    assert document["metadata"]["name"] == "orders" and document["metadata"]["namespace"] == "default"
    assert document["spec"]["shards"] == 2 and document["spec"]["retention"] == 7200
    assert document["status"]["subscribers"] == ["billing"] and document["status"]["publishedMessages"] == 0
    (same,) = yaml.safe_load_all(run(env, "get", "queue", "orders", "-o", "yaml").stdout)
    assert {k: v for k, v in same.items() if k != "status"} == {k: v for k, v in document.items() if k != "status"}


def test_get_subscribers_and_describe(env: dict[str, str]) -> None:
    header, row = run(env, "get", "subscribers").stdout.splitlines()[:2]
    assert "billing" in row.split()
    assert row[header.index("FILTERED"):].split()[0] == "0"
    (document,) = yaml.safe_load_all(run(env, "get", "subscribers", "orders", "-o", "yaml").stdout)
    assert document["kind"] == "Subscriber" and document["spec"]["visibilityTimeout"] == 45
    assert document["spec"]["filter"] == "has(attributes.region)"
    assert document["status"]["subscriber"] == "billing" and "lagMessages" in document["status"]
    assert document["status"]["filtered"] == 0

    text = run(env, "describe", "subscriber", "orders", "billing").stdout
    assert text.startswith("Subscriber: default/billing") and "visibilityTimeout: 45" in text
    assert "filter: has(attributes.region)" in text
    queue = json.loads(run(env, "describe", "queue", "orders", "-o", "json").stdout)
    assert queue["metadata"]["name"] == "orders" and queue["status"]["subscribers"] == ["billing"]
    assert "Queue: staging/audit" in run(env, "describe", "queue", "staging/audit").stdout


def test_get_output_is_what_apply_takes_back(env: dict[str, str], tmp_path: pytest.TempPathFactory) -> None:
    exported = run(env, "get", "queues", "-A", "-o", "yaml").stdout
    documents = list(yaml.safe_load_all(exported))
    assert {d["metadata"]["name"] for d in documents} == {"orders", "audit"}
    # The documents parse as apply's input: same specs, so applying them changes nothing.
    from casque.cli.apply import read_documents

    parsed = read_documents(exported, "exported.yaml")
    assert {(d.namespace, d.name) for d in parsed} == {("default", "orders"), ("staging", "audit")}


def test_exit_codes(env: dict[str, str]) -> None:
    missing = run(env, "describe", "queue", "nope", code=3)
    assert missing.stderr.strip() == "casque: queue default/nope does not exist"
    run(env, "describe", "subscriber", "orders", "nobody", code=3)
    run(env, "get", "subscribers", "nope", code=3)
    run(env, "get", "queues", "-o", "xml", code=2)
    run(env, "get", "queues", "orders", "-A", code=2)
    run(env, "get", "nothing", code=2)  # typer's own usage error
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    down = run({**env, "CASQUE_CASSANDRA_PORT": str(closed)}, "get", "queues", code=4)
    assert down.stderr.startswith("casque: Cassandra at")


def test_a_queue_with_a_schema_shows_its_version(env: dict[str, str], store: Store) -> None:
    schema = {"type": "object", "properties": {"total": {"type": "number"}}}
    catalog.apply_queue(store, REF, QueueSpec.model_validate(
        {"shards": 2, "retention": 7200, "consistency": "ONE", "schema": schema, "schemaCompatibility": "none"}))
    header, row = run(env, "get", "queues").stdout.splitlines()[:2]
    assert "SCHEMA" in header.split() and "v1" in row.split()
    assert "schemaVersion: 1" in run(env, "describe", "queue", "orders").stdout
    (document,) = json.loads(run(env, "get", "queues", "-o", "json").stdout)
    assert document["status"]["schemaVersion"] == 1 and document["spec"]["schema"] == schema
    assert "-" in run(env, "get", "queues", "-n", "staging").stdout.splitlines()[1].split()  # no schema
