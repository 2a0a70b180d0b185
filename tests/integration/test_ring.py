"""The three-node local ring: all nodes up and normal, and QUORUM writes with RF=3."""

import re

from cassandra import ConsistencyLevel
from cassandra.query import SimpleStatement

from casque.devstack.stack import Stack
from tests.fixtures.stack import ring_cluster


def test_three_nodes_up_normal_and_quorum_writes(ring: Stack) -> None:
    status = ring.cassandra_nodes()[0].nodetool("status")
    up_normal = re.findall(r"^UN\s+(127\.0\.0\.\d)", status, flags=re.MULTILINE)
    assert sorted(up_normal) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

    cluster = ring_cluster(ring)
    session = cluster.connect()
    try:
        session.execute(
            "CREATE KEYSPACE IF NOT EXISTS ring_check WITH replication = "
            "{'class': 'SimpleStrategy', 'replication_factor': 3}"
        )
        session.execute("CREATE TABLE IF NOT EXISTS ring_check.kv (k int PRIMARY KEY, v text)")
        write = SimpleStatement(
            "INSERT INTO ring_check.kv (k, v) VALUES (%s, %s)", consistency_level=ConsistencyLevel.QUORUM
        )
        for k in range(50):
            session.execute(write, (k, f"value-{k}"))
        read = SimpleStatement("SELECT k, v FROM ring_check.kv", consistency_level=ConsistencyLevel.ALL)
        rows = {row.k: row.v for row in session.execute(read)}
        assert rows == {k: f"value-{k}" for k in range(50)}
    finally:
        cluster.shutdown()
