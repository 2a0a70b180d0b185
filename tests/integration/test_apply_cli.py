"""`casque apply -f` and `casque delete -f` as a user runs them, against the real Cassandra and ZooKeeper."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cassandra.cluster import Session
from kazoo.client import KazooClient

from casque.engine import catalog
from casque.schema import QueueRef, read_table_options
from casque.store import Store
from tests.fixtures.stack import Backends, drop_keyspace

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "casque.cli"]

ORDERS = """\
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {{name: billing}}
spec: {{queue: orders, startPosition: earliest}}
---
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {{name: orders}}
spec:
  shards: {shards}
  retention: {retention}
  deletionPolicy: {policy}
"""


@dataclass
class Local:
    env: dict[str, str]
    store: Store
    tmp: Path

    def casque(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], capture_output=True, text=True, env=self.env, input=stdin, timeout=120, cwd=self.tmp
        )

    def write(self, text: str, name: str = "orders.yaml") -> str:
        (self.tmp / name).write_text(text)
        return name

    def ttl(self, ref: QueueRef) -> int | None:
        options = read_table_options(self.store.session, self.store.keyspace, ref)
        return options.default_time_to_live if options.exists else None


@pytest.fixture
def local(backends: Backends, cql: Session, tmp_path: Path) -> Iterator[Local]:
    """The CLI's settings pointed at the test backends, with a keyspace and a znode root of its own."""
    suffix = uuid.uuid4().hex[:12]
    keyspace, top = f"cli_{suffix}", f"/cli-{suffix}"
    zk = KazooClient(hosts=backends.zookeeper_hosts)
    zk.start(timeout=15)
    store = Store(
        session=cql,
        zk=zk,
        keyspace=keyspace,
        zk_root=f"{top}/casque",
        replication_cql="{'class': 'SimpleStrategy', 'replication_factor': 1}",
    )
    env = {
        **os.environ,
        "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(backends.contact_points),
        "CASQUE_CASSANDRA_PORT": str(backends.cql_port),
        "CASQUE_ZOOKEEPER_HOSTS": backends.zookeeper_hosts,
        "CASQUE_KEYSPACE": keyspace,
        "CASQUE_ZOOKEEPER_ROOT": store.zk_root,
        "CASQUE_CONSISTENCY": "ONE",
    }
    try:
        yield Local(env, store, tmp_path)
    finally:
        drop_keyspace(cql, keyspace)
        zk.delete(top, recursive=True)
        zk.stop()
        zk.close()


def test_apply_creates_then_changes_nothing_then_updates(local: Local) -> None:
    ref = QueueRef("default", "orders")
    file = local.write(ORDERS.format(shards=2, retention="1h", policy="Delete"))

    first = local.casque("apply", "-f", file)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    # Queues go first, whatever the order in the file.
    assert lines[0].startswith("queue default/orders: table ") and lines[0].endswith("created (3600s)")
    assert "queue default/orders: queue znode created" in lines
    assert lines[-1] == "subscriber default/billing (queue orders): subscriber created at earliest"
    assert local.ttl(ref) == 3600
    assert catalog.list_subscribers(local.store, ref) == ["billing"]

    again = local.casque("apply", "-f", file)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        "queue default/orders: unchanged",
        "subscriber default/billing (queue orders): unchanged",
    ]

    local.write(ORDERS.format(shards=3, retention="2h", policy="Delete"))
    grown = local.casque("apply", "-f", file)
    assert grown.returncode == 0, grown.stderr
    assert "queue default/orders: shard 2 added" in grown.stdout.splitlines()
    assert "retention set (7200s)" in grown.stdout
    assert local.ttl(ref) == 7200
    assert catalog.read_queue(local.store, ref).spec.shards == 3


def test_delete_honours_the_deletion_policy(local: Local) -> None:
    kept, dropped = QueueRef("default", "orders"), QueueRef("staging", "orders")
    retain = local.write(ORDERS.format(shards=1, retention="1h", policy="Retain"), "retain.yaml")
    delete = local.write(ORDERS.format(shards=1, retention="1h", policy="Delete"), "delete.yaml")
    assert local.casque("apply", "-f", retain).returncode == 0
    assert local.casque("apply", "-f", delete, "--namespace", "staging").returncode == 0

    result = local.casque("delete", "-f", retain)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "subscriber default/billing (queue orders): subscriber billing removed",
        "queue default/orders: retained table and znodes",
    ]
    assert local.ttl(kept) == 3600 and catalog.read_queue(local.store, kept).spec.shards == 1
    assert catalog.list_subscribers(local.store, kept) == []

    result = local.casque("delete", "-f", delete, "-n", "staging")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("queue staging/orders: dropped table ")
    assert local.ttl(dropped) is None
    assert not local.store.zk.exists(local.store.paths(dropped).base)
    # Deleting again is harmless.
    again = local.casque("delete", "-f", delete, "-n", "staging")
    assert again.returncode == 0, again.stderr


def test_documents_come_from_stdin(local: Local) -> None:
    text = "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: events, namespace: shop}\n"
    result = local.casque("apply", "-f", "-", stdin=text)
    assert result.returncode == 0, result.stderr
    assert local.ttl(QueueRef("shop", "events")) == 7 * 86400


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: [", "orders.yaml: not valid YAML at line 5, column 8: expected the node content"),
        (
            "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: orders}\nspec: {shards: 0}\n",
            "orders.yaml: Queue orders: spec.shards: Input should be greater than or equal to 1",
        ),
        (
            "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: orders}\nspec: {retention: 5s}\n",
            "orders.yaml: Queue orders: spec.retention: Input should be greater than or equal to 60",
        ),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "apiVersion must be casque.io/v1alpha1"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_changes_nothing(local: Local, text: str, message: str) -> None:
    # A valid Queue first: it must not be applied when a later document is bad.
    good = "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: first}\n---\n"
    result = local.casque("apply", "-f", local.write(good + text))
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("casque: orders.yaml") and message.removeprefix("orders.yaml") in line
    assert read_table_options(local.store.session, local.store.keyspace, QueueRef("default", "first")).exists is False


def test_refusals_from_the_backends_state(local: Local) -> None:
    file = local.write(ORDERS.format(shards=3, retention="1h", policy="Retain"))
    assert local.casque("apply", "-f", file).returncode == 0
    local.write(ORDERS.format(shards=2, retention="1h", policy="Retain"))
    fewer = local.casque("apply", "-f", file)
    assert fewer.returncode == 1
    assert fewer.stderr.splitlines() == [
        "casque: queue default/orders: queue default/orders has 3 shards; shards can be added, never removed"
    ]

    orphan = "apiVersion: casque.io/v1alpha1\nkind: Subscriber\nmetadata: {name: audit}\nspec: {queue: nowhere}\n"
    missing = local.casque("apply", "-f", local.write(orphan, "orphan.yaml"))
    assert missing.returncode == 3  # not found
    assert missing.stderr.strip() == "casque: subscriber default/audit (queue nowhere): queue default/nowhere does not exist"


def test_an_incompatible_schema_is_refused_and_the_one_in_force_stays(local: Local) -> None:
    queue = ("apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {{name: orders}}\n"
             "spec: {{shards: 1, retention: 1h, schema: {{type: object, required: [{required}]}}}}\n")
    file = local.write(queue.format(required="id"))
    first = local.casque("apply", "-f", file)
    assert first.returncode == 0, first.stderr
    assert "queue default/orders: schema version 1" not in first.stdout  # a new queue: created at version 1
    local.write(queue.format(required="id, total"))
    refused = local.casque("apply", "-f", file)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "casque: queue default/orders: queue default/orders: the new schema is not backward compatible with "
        "version 1, which stays in force: /: required adds total. Set schemaCompatibility: none to change it anyway"
    ]
    state = catalog.read_queue(local.store, QueueRef("default", "orders"))
    assert state.schema_version == 1 and state.spec.data_schema == {"type": "object", "required": ["id"]}
    local.write(queue.format(required=""))  # removing a required name is compatible
    relaxed = local.casque("apply", "-f", file)
    assert relaxed.returncode == 0, relaxed.stderr
    assert "queue default/orders: schema version 2" in relaxed.stdout.splitlines()


def test_unreachable_backends_are_one_line(local: Local) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    local.env["CASQUE_CASSANDRA_PORT"] = str(closed)
    result = local.casque("apply", "-f", local.write(ORDERS.format(shards=1, retention="1h", policy="Retain")))
    assert result.returncode == 4  # backend unavailable
    (line,) = result.stderr.splitlines()
    assert line.startswith("casque: Cassandra at ['127.0.0.1'] is unreachable")
