"""What the Cassandra driver keeps of the schema: a sidecar's session holds its own keyspace
alone, and still routes each statement to the replicas of its partition."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from cassandra.cluster import Session

from casque.backends.cql import connect
from casque.config import Settings
from casque.schema import ensure_keyspace
from casque.store import Store
from tests.fixtures.stack import Backends, drop_keyspace
from tests.fixtures.waiting import wait_for

REPLICATION = "{'class': 'SimpleStrategy', 'replication_factor': 1}"


def settings_for(backends: Backends, keyspace: str) -> Settings:
    return Settings(cassandra_contact_points=backends.contact_points, cassandra_port=backends.cql_port,
                    consistency="ONE", keyspace=keyspace)


@pytest.fixture
def another_keyspace(cql: Session) -> Iterator[str]:
    """A keyspace with a table, as another tenant's would be."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    ensure_keyspace(cql, name, REPLICATION)
    cql.execute(f"CREATE TABLE IF NOT EXISTS {name}.other (k int PRIMARY KEY)")
    try:
        yield name
    finally:
        drop_keyspace(cql, name)


def test_a_sidecars_session_knows_its_keyspace_alone_and_its_replicas(
    backends: Backends, store: Store, another_keyspace: str
) -> None:
    settings = settings_for(backends, store.keyspace)
    cluster, session = connect(settings, schema_of=store.keyspace)
    try:
        assert not cluster.schema_metadata_enabled
        assert set(cluster.metadata.keyspaces) == {store.keyspace}
        assert not cluster.metadata.keyspaces[store.keyspace].tables  # its replication is all it needs
        replicas = cluster.metadata.get_replicas(store.keyspace, b"any partition key")
        assert replicas and {host.endpoint.address for host in replicas} <= set(backends.contact_points)
        # Its prepared statements bring their routing columns, in any keyspace.
        prepared = session.prepare(f"SELECT * FROM {another_keyspace}.other WHERE k = ?")
        assert prepared.routing_key_indexes
    finally:
        cluster.shutdown()
    full, _ = connect(settings)
    try:
        assert {store.keyspace, another_keyspace} <= set(full.metadata.keyspaces)
        assert "other" in full.metadata.keyspaces[another_keyspace].tables
    finally:
        full.shutdown()


def test_a_session_opened_before_its_keyspace_exists_learns_it_once_made(backends: Backends, cql: Session) -> None:
    missing = f"t_{uuid.uuid4().hex[:16]}"
    cluster, _ = connect(settings_for(backends, missing), schema_of=missing)
    try:
        assert cluster.schema_metadata_enabled  # the whole schema, kept up to date, as by default
        ensure_keyspace(cql, missing, REPLICATION)
        wait_for("the session to learn the new keyspace", lambda: missing in cluster.metadata.keyspaces)
        assert cluster.metadata.get_replicas(missing, b"any partition key")
    finally:
        cluster.shutdown()
        drop_keyspace(cql, missing)
