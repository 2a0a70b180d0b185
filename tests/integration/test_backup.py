"""`casque backup`, both backends emptied, `casque restore`, and an apply: every message
within retention, every subscriber's position, the schema and the filter as of the backup."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

from casque.engine import catalog
from casque.engine.batches import Log
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends, drop_keyspace

QUEUE = QueueRef("default", "invoices")
CLI = [sys.executable, "-m", "casque.cli"]
SCHEMA = {"type": "object", "required": ["amount"], "properties": {"amount": {"type": "number"}}}
FILTER = "attributes.region == 'eu'"


def casque(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)


async def log_of(store: Store, spec: QueueSpec) -> dict[str, tuple[int, int, int, bytes]]:
    log = Log(store, QUEUE, "ONE")
    found: dict[str, tuple[int, int, int, bytes]] = {}
    for shard in spec.log_shards():
        batch = 1
        while chunk := await log.read_from(shard, batch):
            for read in chunk:
                for message in read.messages:
                    found[message.message_id] = (shard, read.header.batch, message.position.seq, message.payload)
                batch = read.header.batch + 1
    return found


async def test_a_backup_restored_into_empty_backends_holds_every_message_and_position(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, tmp_path: Path
) -> None:
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE", schema=SCHEMA)
    catalog.apply_queue(store, QUEUE, spec)
    subscriber = SubscriberSpec(queue=QUEUE.name, start_position="earliest", filter=FILTER)
    catalog.apply_subscriber(store, QUEUE, "billing", subscriber)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    for number in range(30):
        await publisher.publish([OutgoingMessage(f'{{"amount": {number}}}'.encode(), content_type="application/json",
                                                 attributes={"region": "eu"}, key=f"k{number % 4}")])
    later = datetime.now(timezone.utc) + timedelta(minutes=30)
    (delayed,) = await publisher.publish([OutgoingMessage(b'{"amount": 1}', content_type="application/json",
                                                          attributes={"region": "eu"}, deliver_at=later)])
    await publisher.flush_heads()
    consumer = Consumer(store, QUEUE, "billing")
    await consumer.start()
    acked: set[str] = set()
    try:
        while len(acked) < 12:
            deliveries = await consumer.receive(max_messages=12 - len(acked), wait=1.0)
            results = await consumer.ack_many([d.receipt for d in deliveries])
            acked |= {d.message.message_id for d, ok in zip(deliveries, results) if ok is True}
    finally:
        await consumer.stop()
    logged = await log_of(store, spec)
    state = catalog.read_queue(store, QUEUE)

    done = casque(env, "backup", str(tmp_path / "b1"))
    assert done.returncode == 0, done.stderr
    assert "backed up" in done.stdout

    # Both backends emptied: the keyspace dropped, the installation's znodes gone.
    drop_keyspace(store.session, keyspace)
    store.zk.delete(store.zk_root, recursive=True)
    assert not store.zk.exists(store.zk_root)

    done = casque(env, "restore", str(tmp_path / "b1"))
    assert done.returncode == 0, done.stderr
    assert "default/invoices" in done.stdout
    # What the operator does next: apply the resources again.
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "billing", subscriber)

    restored = catalog.read_queue(store, QUEUE)
    assert restored.incarnation == state.incarnation
    assert restored.spec.data_schema == SCHEMA
    assert catalog.read_subscriber(store, QUEUE, "billing").spec.message_filter == FILTER
    assert await log_of(store, spec) == logged
    again = Consumer(store, QUEUE, "billing")
    await again.start()
    received: set[str] = set()
    try:
        while len(received) < 18:
            deliveries = await again.receive(max_messages=30, wait=1.0)
            await again.ack_many([d.receipt for d in deliveries])
            received |= {d.message.message_id for d in deliveries}
            assert not received & acked, "a message acked before the backup was delivered again"
    finally:
        await again.stop()
    assert received == set(logged) - acked
    # The delayed message waits in Cassandra for its time, as before.
    rows = store.session.execute(f"SELECT message_id FROM {keyspace}.delayed").all()
    assert [r.message_id for r in rows] == [delayed.message_id]


def test_a_directory_that_is_not_a_backup_is_refused_in_one_line(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, tmp_path: Path
) -> None:
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    done = casque(env, "restore", str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"casque: {tmp_path} holds no finished backup (no manifest.json)"]
    (tmp_path / "x").write_text("")
    done = casque(env, "backup", str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"casque: {tmp_path} is not empty: a backup goes into a new directory"]
