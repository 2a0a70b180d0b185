"""The message path is insert-only: after a publish/consume run, no SSTable holds a deletion."""

from __future__ import annotations

import asyncio
import re

import pytest

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import ACKS_TABLE, CLIENT_IDS_TABLE, PUBLISH_WRITERS_TABLE, QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends

QUEUE = QueueRef("default", "insert-only")
# What sstabledump prints for any kind of deletion: partition, row, cell, range or collection.
DELETION = re.compile(r'"deletion_info"|range_tombstone|"marked_deleted"')


async def test_publish_consume_nack_leaves_no_tombstones(backends: Backends, store: Store) -> None:
    if backends.stack is None:
        pytest.skip("needs the test stack's own Cassandra node to read its SSTables")
    spec = QueueSpec(shards=2, retention_seconds=3600)
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "reader", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    # Keys, attributes, content types, client ids and TTLs, present and absent.
    messages = [
        OutgoingMessage(
            f"payload-{i}".encode(),
            key=f"k{i}" if i % 2 else None,
            attributes={"n": str(i)} if i % 3 else {},
            content_type="text/plain" if i % 5 else None,
            client_id=f"c{i}" if i % 7 == 0 else None,
            ttl_seconds=3000 if i % 11 == 0 else None,
        )
        for i in range(600)
    ]
    await asyncio.gather(*(publisher.publish([m]) for m in messages))

    consumer = Consumer(store, QUEUE, "reader")
    await consumer.start()
    try:
        done = 0
        while done < len(messages):
            deliveries = await consumer.receive(max_messages=100, wait=5)
            assert deliveries, "consumer stalled"
            for d in deliveries:
                if d.delivery_count == 1 and d.message.position.seq % 4 == 0:
                    await consumer.nack(d.receipt)  # redelivered: writes a delivery-count row
                else:
                    await consumer.ack(d.receipt)
                    done += 1
    finally:
        await consumer.stop()

    node = backends.stack.cassandra_nodes()[0]
    await asyncio.to_thread(node.nodetool, "flush", store.keyspace)
    checked = 0
    for table in (QUEUE.messages_table, ACKS_TABLE, CLIENT_IDS_TABLE, PUBLISH_WRITERS_TABLE):
        files = node.sstables(store.keyspace, table)
        assert files, f"no sstable for {table}"
        for data_file in files:
            dump = await asyncio.to_thread(node.sstabledump, data_file)
            assert '"partition"' in dump and '"ttl"' in dump  # rows were dumped, with their TTLs
            assert not DELETION.search(dump), f"{table} holds a deletion: {DELETION.search(dump)}"
            checked += 1
    assert checked >= 3
    # (nodetool tablestats is no proof here: its tombstones-per-slice histogram reports 1 for
    # reads that met none, the same as for a plain insert-only table.)
