"""The DDL against a real Cassandra: idempotent create, retention alter, TWCS and TTL applied."""

from cassandra.cluster import Session

from casque.schema import (
    ACKS_TABLE,
    QueueRef,
    count_queue_tables,
    ensure_keyspace,
    ensure_queue_table,
    read_table_options,
)

REPLICATION = "{'class': 'SimpleStrategy', 'replication_factor': 1}"


def test_queue_table_create_is_idempotent_and_alter_changes_retention(cql: Session, keyspace: str) -> None:
    queue = QueueRef("default", "orders")
    ensure_keyspace(cql, keyspace, REPLICATION)
    assert ensure_queue_table(cql, keyspace, queue, 86400) is True
    assert ensure_queue_table(cql, keyspace, queue, 86400) is False

    options = read_table_options(cql, keyspace, queue)
    assert options.default_time_to_live == 86400
    assert options.compaction is not None
    assert options.compaction["class"].endswith("TimeWindowCompactionStrategy")
    assert options.compaction["compaction_window_unit"] == "HOURS"

    assert ensure_queue_table(cql, keyspace, queue, 30 * 86400) is True
    options = read_table_options(cql, keyspace, queue)
    assert options.default_time_to_live == 30 * 86400
    assert options.compaction is not None and options.compaction["compaction_window_unit"] == "DAYS"
    assert count_queue_tables(cql, keyspace) == 1


def test_rows_get_the_table_ttl(cql: Session, keyspace: str) -> None:
    queue = QueueRef("default", "ttl")
    ensure_keyspace(cql, keyspace, REPLICATION)
    ensure_queue_table(cql, keyspace, queue, 3600)
    cql.execute(
        f"INSERT INTO {keyspace}.{queue.messages_table} (shard, bucket, batch_no, seq, payload) "
        "VALUES (0, 0, 1, 0, 0x01)"
    )
    row = cql.execute(
        f"SELECT TTL(payload) AS ttl FROM {keyspace}.{queue.messages_table} WHERE shard = 0 AND bucket = 0"
    ).one()
    assert 3590 <= row.ttl <= 3600
    tables = {r.table_name for r in cql.execute(
        "SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s", (keyspace,))}
    assert ACKS_TABLE in tables
