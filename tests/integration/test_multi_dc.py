"""Claims across two datacenters: a LOCAL_QUORUM queue in a keyspace with replicas in dc1
and dc2, and a publisher in each datacenter contending for its one shard.

LOCAL_SERIAL would run each writer's Paxos round on its own datacenter's replicas only, so
both could win batch N: their rows would land in one batch and overwrite each other's
positions. Claims at SERIAL (what a keyspace spanning datacenters gets) make one of them
lose and move on to N+1.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from cassandra import ConsistencyLevel
from cassandra.query import SimpleStatement

from casque.config import ReplicationSettings, Settings
from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.history import Ack, Delivery, History, check
from tests.fixtures.stack import chroot_on, drop_keyspace
from tests.fixtures.waiting import wait_for

QUEUE = QueueRef("default", "two-dcs")
SPEC = QueueSpec(shards=1, retention_seconds=3600, consistency="LOCAL_QUORUM")
DATACENTERS = ("dc1", "dc2")
STREAMS = 6  # concurrent publish streams per datacenter
PER_STREAM = 25
RETRIES = 20


@pytest.fixture
def dc_zk_hosts(dc_ring: Stack) -> Iterator[str]:
    with chroot_on(dc_ring.zookeeper_hosts) as hosts:
        yield hosts


@pytest.fixture
def dc_stores(dc_ring: Stack, dc_zk_hosts: str) -> Iterator[dict[str, Store]]:
    """A Store per datacenter, each through `CASQUE_CASSANDRA_LOCAL_DC`'s setting, on one keyspace
    placed in both with NetworkTopologyStrategy (the installation's replication settings)."""
    keyspace = f"m_{uuid.uuid4().hex[:16]}"
    stores: dict[str, Store] = {}
    try:
        for dc in DATACENTERS:
            settings = Settings(
                cassandra_contact_points=dc_ring.contact_points, cassandra_port=dc_ring.ports.native,
                cassandra_local_dc=dc, keyspace=keyspace, zookeeper_hosts=dc_zk_hosts,
                replication=ReplicationSettings(strategy="NetworkTopologyStrategy", datacenters={"dc1": 1, "dc2": 1}),
            )
            stores[dc] = wait_for(f"a Store on {dc}'s node", lambda: _opened(settings))
        catalog.ensure_installation(stores["dc1"])
        yield stores
    finally:
        if stores:
            drop_keyspace(next(iter(stores.values())).session, keyspace)
        for store in stores.values():
            store.close()


def _opened(settings: Settings) -> Store | None:
    """A Store on `settings`, or None while the driver finds no node of the local datacenter
    it may use (retried, as the sidecar retries its start)."""
    try:
        return Store.open(settings)
    except BackendUnavailable:
        return None


async def publish_stream(publisher: Publisher, ids: list[str], history: History) -> dict[str, tuple[int, int, int]]:
    """Publish each id until answered (a retry keeps the id); the history records the answer."""
    answered: dict[str, tuple[int, int, int]] = {}
    for client_id in ids:
        for _ in range(RETRIES):
            try:
                (result,) = await publisher.publish([OutgoingMessage(client_id.encode(), client_id=client_id)])
            except BackendUnavailable:
                continue
            answered[client_id] = (result.shard, result.batch, result.seq)
            history.published[client_id] = history.now()
            break
        else:
            pytest.fail(f"{client_id} not published in {RETRIES} attempts")
    return answered


async def consume_all(store: Store, expected: set[str], history: History) -> None:
    consumer = Consumer(store, QUEUE, "workers")
    await consumer.start()
    try:
        while not expected <= history.delivered_ids():
            sent = history.now()
            batch = await consumer.receive(max_messages=100, wait=5)
            answered = history.now()
            assert batch, f"nothing more delivered; missing {len(expected - history.delivered_ids())}"
            for d in batch:
                history.deliveries.append(Delivery(d.message.payload.decode(), d.receipt, "c", d.delivery_count,
                                                   sent, answered))
            sent = history.now()
            outcomes = await consumer.ack_many([d.receipt for d in batch])
            answered = history.now()
            for d, outcome in zip(batch, outcomes):
                history.acks.append(Ack(d.message.payload.decode(), d.receipt,
                                        "acked" if outcome is True else str(outcome), sent, answered))
    finally:
        await consumer.stop()


def stored_rows(store: Store) -> list[tuple[int, int, str | None, str | None]]:
    """(batch, seq, client id, writer) of every row of the shard, read at ALL: both replicas."""
    rows = store.session.execute(SimpleStatement(
        f"SELECT batch_no, seq, client_id, writer FROM {store.table(QUEUE)}", consistency_level=ConsistencyLevel.ALL))
    return [(r.batch_no, r.seq, r.client_id, r.writer) for r in rows]


async def test_writers_in_two_datacenters_never_both_win_a_batch(dc_stores: dict[str, Store]) -> None:
    dc1 = dc_stores["dc1"]
    catalog.apply_queue(dc1, QUEUE, SPEC)
    catalog.apply_subscriber(dc1, QUEUE, "workers", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    publishers = {dc: Publisher(store, QUEUE, catalog.read_queue(store, QUEUE), publisher_id=dc)
                  for dc, store in dc_stores.items()}
    for dc, publisher in publishers.items():
        # The keyspace spans both datacenters, so the LOCAL_QUORUM queue claims at SERIAL.
        assert publisher.store.spans_datacenters()
        assert publisher.log.serial_consistency == ConsistencyLevel.SERIAL, dc
        # Each publisher's driver coordinates in its own datacenter.
        policy = publisher.store.session.cluster.profile_manager.default.load_balancing_policy
        assert policy._child_policy.local_dc == dc  # type: ignore[attr-defined]

    history = History()
    streams = [(publishers[dc], [f"{dc}-s{s}-{n}" for n in range(PER_STREAM)]) for dc in DATACENTERS
               for s in range(STREAMS)]
    results = await asyncio.gather(*(publish_stream(p, ids, history) for p, ids in streams))
    for publisher in publishers.values():
        await publisher.flush_heads()
    answered = {cid: where for result in results for cid, where in result.items()}
    assert len(answered) == len(DATACENTERS) * STREAMS * PER_STREAM

    rows = stored_rows(dc1)
    messages = [(batch, seq, cid) for batch, seq, cid, _ in rows if seq >= 0]
    copies = Counter(cid for _, _, cid in messages)
    assert [cid for cid, n in copies.items() if n > 1] == [], "ids stored twice"
    assert {cid: (0, batch, seq) for batch, seq, cid in messages if cid} == answered, \
        "every acknowledged id stored where its answer says"
    writers = {batch: writer for batch, seq, _, writer in rows if seq < 0}
    for batch in {b for b, _, _ in messages}:
        sources = {cid.split("-")[0] for b, _, cid in messages if b == batch and cid}
        assert len(sources) == 1, f"batch {batch} merged rows of {sorted(sources)}"
        assert (writers[batch] or "").split("/")[0] == sources.pop(), f"batch {batch}'s header names another writer"
    assert {cid.split("-")[0] for cid in copies} == set(DATACENTERS), "both datacenters won batches"

    await consume_all(dc_stores["dc2"], set(answered), history)
    verdict = check(history)
    assert verdict.ok, str(verdict)
