"""ZooKeeper losing its data, or going back to an older snapshot, under traffic, with real sidecars.

Cassandra keeps the log, the ack rows and the checkpoints (casque.engine.checkpoints); an
apply (what the operator's drift repair does) rebuilds the queue's and its subscriber's
znodes from them (casque.engine.rebuild). The history checker (tests.fixtures.history) then
demands what it demands of every fault: every acknowledged publish delivered, nothing
delivered again after its ack was answered, every member back in the group; and the log
read back whole: every message stored once, no batch written over.

The wipe stops the session's ZooKeeper and deletes its data, as a lost volume would: every
session ends with it, and clients must see that on their own (a server without their zxid
refuses their reconnects for good, casque.backends.zk).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from casque.backends.zk import keep_granted_timeout
from casque.engine import catalog, offsets
from casque.engine.batches import Log
from casque.engine.checkpoints import HEAD, Checkpoints
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.engine.rebuild import REBUILDS
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.group import Group, assert_sound, until
from tests.fixtures.sidecars import StartSidecar
from tests.fixtures.stack import Backends

QUEUE = QueueRef("default", "ledger")
SUBSCRIBER = "auditors"
SESSION = {"CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS": "4"}


@pytest.fixture(params=["leased", "shared"])
async def group(request: pytest.FixtureRequest, backends: Backends, store: Store,
                start_sidecar: StartSidecar) -> AsyncIterator[Group]:
    if backends.stack is None:
        pytest.skip("wipes the data of the ZooKeeper the test session started itself")
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION, delivery=request.param)
    yield running
    await running.stop()


@pytest.fixture
def root_client(backends: Backends) -> Iterator[KazooClient]:
    """A client of the whole tree (no chroot), to make the test's chroot again after a wipe."""
    client = keep_granted_timeout(KazooClient(hosts=backends.zookeeper_hosts))
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def create(store: Store, delivery: str, shards: int = 3) -> QueueSpec:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=10, delivery=delivery))
    return spec


async def serving(store: Store, group: Group, published: int) -> QueueSpec:
    """The queue and three members serving it, `published` messages through them, all acked."""
    spec = create(store, group.delivery)
    await group.add(3)
    await group.whole(spec.log_shards())
    await group.publish(published, "before")
    await group.drained()
    return spec


def data_dirs(backends: Backends) -> list[Path]:
    assert backends.stack is not None
    return [member.directory / "data" / "version-2" for member in backends.stack.zookeeper().members()]


def replace_zookeeper_data(backends: Backends, chroot: str, root_client: KazooClient,
                           snapshot: list[Path] | None = None) -> None:
    """Stop ZooKeeper, delete its data (or put `snapshot`'s copy in its place), start it; then
    the test's chroot again, as the installation's root would be after a restore."""
    assert backends.stack is not None
    ensemble = backends.stack.zookeeper()
    ensemble.stop()
    for index, directory in enumerate(data_dirs(backends)):
        shutil.rmtree(directory, ignore_errors=True)
        if snapshot is not None:
            shutil.copytree(snapshot[index], directory)
    ensemble.start()
    ensemble.wait_ready()
    # The test's own clients come back with new sessions (their zxids are unknown here).
    root_client.retry(root_client.ensure_path, chroot)


def copy_data(backends: Backends, into: Path) -> list[Path]:
    """A copy of ZooKeeper's data as it is now (its transaction log is append-only: a copy
    taken while it runs is a consistent prefix, as a volume snapshot would be)."""
    copies = []
    for index, directory in enumerate(data_dirs(backends)):
        target = into / f"member-{index}"
        shutil.copytree(directory, target)
        copies.append(target)
    return copies


def reapply(store: Store, delivery: str) -> None:
    """What the operator does when it finds the znodes gone: apply the resources again."""
    store.zk.retry(store.zk.ensure_path, "/")
    create(store, delivery)


async def log_read_back(store: Store, spec: QueueSpec) -> dict[str, tuple[int, int, int]]:
    """Every message id in the log with its position; each must be there once, in batches
    numbered without a gap from the first."""
    log = Log(store, QUEUE, "ONE")
    found: dict[str, tuple[int, int, int]] = {}
    for shard in spec.log_shards():
        batch = 1
        while chunk := await log.read_from(shard, batch):
            for read in chunk:
                assert read.header.batch == batch, f"gap before batch {shard}/{read.header.batch}"
                assert len(read.messages) == read.header.message_count, f"batch {shard}/{batch} is incomplete"
                for message in read.messages:
                    assert message.message_id not in found, f"{message.message_id} stored twice"
                    found[message.message_id] = (shard, batch, message.position.seq)
                batch += 1
    return found


async def test_a_wiped_zookeeper_is_rebuilt_from_cassandra_and_nothing_acked_comes_back(
    store: Store, group: Group, backends: Backends, zk_hosts: str, root_client: KazooClient
) -> None:
    spec = await serving(store, group, 300)
    rebuilt_before = REBUILDS.get("queue", 0)
    publishing = asyncio.create_task(group.publish(300, "during"))
    await asyncio.to_thread(replace_zookeeper_data, backends, zk_hosts[zk_hosts.index("/"):], root_client)
    await asyncio.to_thread(reapply, store, group.delivery)
    assert REBUILDS.get("queue", 0) == rebuilt_before + 1, "the apply did not rebuild the queue"
    await publishing
    await group.whole(spec.log_shards())
    await group.publish(300, "after")
    await group.drained()
    # Nothing acked before the wipe, nor after it, was delivered again; nothing was lost.
    assert_sound(group.history)
    stored = await log_read_back(store, spec)
    assert set(group.history.published) <= set(stored)


async def test_a_zookeeper_restored_from_an_older_snapshot_writes_over_no_batch_and_moves_no_offset_back(
    store: Store, group: Group, backends: Backends, zk_hosts: str, root_client: KazooClient, tmp_path: Path
) -> None:
    spec = await serving(store, group, 150)
    snapshot = await asyncio.to_thread(copy_data, backends, tmp_path)
    # After the snapshot: more batches, more acks, offsets further on.
    await group.publish(300, "since")
    await group.drained()
    state = catalog.read_queue(store, QUEUE)
    subscriber = catalog.read_subscriber(store, QUEUE, SUBSCRIBER)
    checkpoints = Checkpoints(store, QUEUE, state.shared_key(QUEUE))
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)

    async def checkpointed_up_to_zookeeper() -> bool:
        found = checkpoints.read(subscriber.ack_key(SUBSCRIBER))
        for shard in spec.log_shards():
            record = await offsets.read_offset(store.zk, paths, shard)
            if shard not in found or found[shard].order < (record.epoch, record.offset):
                return False
        return True

    # The sidecars write their checkpoints within a second of an offset's move.
    await until("every offset checkpointed", checkpointed_up_to_zookeeper)
    checkpointed = checkpoints.read(subscriber.ack_key(SUBSCRIBER))
    heads = checkpoints.read(HEAD)
    await asyncio.to_thread(replace_zookeeper_data, backends, zk_hosts[zk_hosts.index("/"):], root_client, snapshot)
    await asyncio.to_thread(reapply, store, group.delivery)
    for shard, head in heads.items():
        assert catalog.read_int(store, store.paths(QUEUE).head(shard)) >= head.batch, f"shard {shard}'s head is behind"
    await group.whole(spec.log_shards())
    # Every shard is served again: its offset is where its checkpoint was, or further.
    for shard, position in checkpointed.items():
        record = await offsets.read_offset(store.zk, paths, shard)
        assert (record.epoch, record.offset) >= position.order, f"shard {shard}'s offset went back"
    await group.publish(300, "after")
    await group.drained()
    assert_sound(group.history)
    stored = await log_read_back(store, spec)
    assert set(group.history.published) <= set(stored)


async def test_a_lease_taken_over_an_offset_behind_its_checkpoint_starts_from_the_checkpoint(store: Store) -> None:
    """ZooKeeper restored from before the offset moved: the next holder of the shard moves
    the offset up to its checkpoint before it reads, instead of reading again (and skipping by
    their ack rows) batches that were done."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    for number in range(20):  # a batch each
        await publisher.publish([OutgoingMessage(f"m{number}".encode())])
    await publisher.flush_heads()
    first = Consumer(store, QUEUE, SUBSCRIBER)
    await first.start()
    try:
        done = 0
        while done < 20:
            deliveries = await first.receive(max_messages=20, wait=1.0)
            done += sum(await first.ack_many([d.receipt for d in deliveries]))
        paths = store.paths(QUEUE).subscriber(SUBSCRIBER)

        async def committed() -> bool:
            return (await offsets.read_offset(store.zk, paths, 0)).offset == 21

        await until("the offset committed past every batch", committed)
    finally:
        await first.stop()  # its checkpoints written on the way out
    store.zk.set(paths.offset(0), b"1")  # as a snapshot taken before any ack would have it
    second = Consumer(store, QUEUE, SUBSCRIBER)
    await second.start()
    try:
        async def raised() -> bool:
            return second.counters.offsets_rebuilt == 1

        await until("the offset moved up to its checkpoint", raised)
        assert (await offsets.read_offset(store.zk, paths, 0)).offset == 21
        assert await second.receive(max_messages=20, wait=0.5) == []
    finally:
        await second.stop()
