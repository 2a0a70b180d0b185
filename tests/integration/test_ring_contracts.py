"""The publish and consume contracts on the three-node ring at the default LOCAL_QUORUM (RF 3):
under contention for one shard, and with a node down."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from cassandra import ConsistencyLevel
from cassandra.query import SimpleStatement
from kazoo.client import KazooClient

from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable, PublishOutcomeUnknown
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import drop_keyspace, ring_cluster

QUEUE = QueueRef("default", "contended")
SPEC = QueueSpec(shards=1, retention_seconds=3600)  # consistency: the default, LOCAL_QUORUM
RETRIES = 20


@pytest.fixture
def ring_store(ring: Stack, zk: KazooClient) -> Iterator[Store]:
    """A Store on a keyspace of its own with three replicas on the ring."""
    cluster = ring_cluster(ring)
    session = cluster.connect()
    keyspace = f"r_{uuid.uuid4().hex[:16]}"
    store = Store(session, zk, keyspace, "/casque",
                  "{'class': 'SimpleStrategy', 'replication_factor': 3}", cluster)
    catalog.ensure_installation(store)
    try:
        yield store
    finally:
        drop_keyspace(session, keyspace)
        cluster.shutdown()


def stored_ids(store: Store) -> list[tuple[str, tuple[int, int, int]]]:
    """(client id, position) of every message row, read at QUORUM."""
    rows = store.session.execute(SimpleStatement(
        f"SELECT shard, batch_no, seq, client_id FROM {store.table(QUEUE)}", consistency_level=ConsistencyLevel.QUORUM))
    return [(r.client_id, (r.shard, r.batch_no, r.seq)) for r in rows if r.seq >= 0]


async def publish_all(publishers: list[Publisher], ids: list[str], first: int) -> dict[str, tuple[int, int, int]]:
    """Publish each id until answered; a failed attempt is retried, with its id, through the next publisher
    (another sidecar)."""
    answered: dict[str, tuple[int, int, int]] = {}
    for client_id in ids:
        for attempt in range(RETRIES):
            publisher = publishers[(first + attempt) % len(publishers)]
            try:
                (result,) = await publisher.publish([OutgoingMessage(client_id.encode(), client_id=client_id)])
            except BackendUnavailable:
                continue  # retryable: certainly not written, or the cluster did not answer
            answered[client_id] = (result.shard, result.batch, result.seq)
            break
        else:
            pytest.fail(f"{client_id} not published in {RETRIES} attempts")
    return answered


async def test_eight_publishers_contending_for_one_shard_lose_and_double_nothing(ring_store: Store) -> None:
    catalog.apply_queue(ring_store, QUEUE, SPEC)
    state = catalog.read_queue(ring_store, QUEUE)
    publishers = [Publisher(ring_store, QUEUE, state, publisher_id=f"p{i}") for i in range(8)]
    # Three streams per publisher, all on the one shard.
    streams = [[f"p{i}-s{s}-{n}" for n in range(25)] for i in range(8) for s in range(3)]
    try:
        results = await asyncio.gather(*(publish_all(publishers, ids, k % 8) for k, ids in enumerate(streams)))
    except PublishOutcomeUnknown as unknown:
        pytest.fail(f"an outcome was answered as unknown instead of settled: {unknown}")
    answered = {cid: where for result in results for cid, where in result.items()}
    assert len(answered) == 600
    stored = stored_ids(ring_store)
    copies = Counter(cid for cid, _ in stored)
    assert [cid for cid, n in copies.items() if n > 1] == [], "ids stored twice"
    assert {cid: where for cid, where in stored} == answered  # every acknowledged id, where its answer says
    batches = sorted({where[1] for _, where in stored})
    assert batches == list(range(1, len(batches) + 1)), "batches are contiguous"


async def test_publish_and_consume_at_local_quorum_with_a_node_down(ring: Stack, ring_store: Store) -> None:
    catalog.apply_queue(ring_store, QUEUE, SPEC.model_copy(update={"shards": 2}))
    catalog.apply_subscriber(ring_store, QUEUE, "workers", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    down = ring.cassandra_nodes()[2]
    down.stop()
    try:
        publisher = Publisher(ring_store, QUEUE, catalog.read_queue(ring_store, QUEUE))
        ids = [f"m-{n}" for n in range(200)]
        answered = {}
        for chunk in (ids[i:i + 20] for i in range(0, len(ids), 20)):
            answered.update(await publish_all([publisher], chunk, 0))
        await publisher.flush_heads()
        consumer = Consumer(ring_store, QUEUE, "workers")
        await consumer.start()
        try:
            delivered: Counter[str] = Counter()
            while set(delivered) != set(answered):
                batch = await consumer.receive(max_messages=50, wait=5)
                assert batch, f"nothing more delivered; missing {len(set(answered) - set(delivered))}"
                delivered.update(d.message.payload.decode() for d in batch)
                assert all(r is True for r in await consumer.ack_many([d.receipt for d in batch]))
            assert max(delivered.values()) == 1
        finally:
            await consumer.stop()
    finally:
        down.start()
        await asyncio.to_thread(down.wait_ready)
