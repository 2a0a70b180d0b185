"""Queues and subscribers applied to real Cassandra and ZooKeeper: idempotent, growing, deleting."""

from datetime import datetime, timedelta, timezone

import pytest
from cassandra import ConsistencyLevel

from casque.engine import catalog
from casque.engine.batches import Log
from casque.errors import InvalidChange, QueueNotFound
from casque.schema import HEADER_SEQ, QueueRef, bucket_of, read_table_options
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

ORDERS = QueueRef("default", "orders")


def test_apply_queue_is_idempotent_and_grows_shards(store: Store) -> None:
    first = catalog.apply_queue(store, ORDERS, QueueSpec(shards=2, retention_seconds=3600))
    assert first.changed
    assert catalog.apply_queue(store, ORDERS, QueueSpec(shards=2, retention_seconds=3600)).changed is False
    assert sorted(store.zk.get_children(store.paths(ORDERS).shards)) == ["0", "1"]

    catalog.apply_subscriber(store, ORDERS, "billing", SubscriberSpec(queue="orders", start_position="earliest"))
    grown = catalog.apply_queue(store, ORDERS, QueueSpec(shards=3, retention_seconds=7200))
    assert "shard 2 added" in grown.actions
    assert read_table_options(store.session, store.keyspace, ORDERS).default_time_to_live == 7200
    # An existing subscriber reads the new shard from its start.
    assert catalog.read_offset(store, store.paths(ORDERS).subscriber("billing"), 2) == 1

    with pytest.raises(InvalidChange, match="never removed"):
        catalog.apply_queue(store, ORDERS, QueueSpec(shards=1))


def test_subscriber_start_positions(store: Store) -> None:
    catalog.apply_queue(store, ORDERS, QueueSpec(shards=1, retention_seconds=3600))
    # Ten batches in shard 0, published a minute apart, and the head at 10.
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for batch in range(1, 11):
        store.session.execute(
            f"INSERT INTO {store.table(ORDERS)} (shard, bucket, batch_no, seq, published_at, message_count) "
            "VALUES (0, %s, %s, %s, %s, 0)",
            (bucket_of(batch), batch, HEADER_SEQ, start + timedelta(minutes=batch)),
        )
    store.zk.set(store.paths(ORDERS).head(0), b"10")

    def offset_of(name: str, position: object) -> int:
        catalog.apply_subscriber(store, ORDERS, name, SubscriberSpec(queue="orders", start_position=position))
        return catalog.read_offset(store, store.paths(ORDERS).subscriber(name), 0)

    assert offset_of("from-start", "earliest") == 1
    assert offset_of("from-now", "latest") == 11
    assert offset_of("from-time", start + timedelta(minutes=4, seconds=30)) == 5
    assert offset_of("from-future", start + timedelta(days=1)) == 11
    # Re-applying does not move an existing subscriber.
    assert offset_of("from-now", "earliest") == 11


def test_delete_policies(store: Store) -> None:
    kept = QueueRef("default", "kept")
    gone = QueueRef("default", "gone")
    for ref in (kept, gone):
        catalog.apply_queue(store, ref, QueueSpec(shards=1, retention_seconds=3600))
    catalog.delete_queue(store, kept, "Retain")
    catalog.delete_queue(store, gone, "Delete")
    assert catalog.read_queue(store, kept).spec.shards == 1
    assert read_table_options(store.session, store.keyspace, kept).exists
    with pytest.raises(QueueNotFound):
        catalog.read_queue(store, gone)
    assert not read_table_options(store.session, store.keyspace, gone).exists
    assert catalog.list_queues(store) == [kept]


def test_a_keyspace_in_one_datacenter_claims_with_local_serial(store: Store) -> None:
    catalog.apply_queue(store, ORDERS, QueueSpec(shards=1, retention_seconds=3600))
    assert not store.spans_datacenters()
    assert Log(store, ORDERS, "LOCAL_QUORUM").serial_consistency == ConsistencyLevel.LOCAL_SERIAL
