"""The consumer group under faults, through the sidecar HTTP API, with sidecar processes.

Each test runs a group of `casque sidecar` processes for one subscriber, with a worker per
sidecar that receives and acks as the app in its pod would, injects one fault, and then
demands: every member back in the group and ready, every shard leased by a live member,
and a history (tests.fixtures.history) in which every acknowledged publish was delivered
and acked, nothing was delivered after a successful ack (outside seeks), and no ack of a
superseded delivery was answered `acked`. Every test runs in both delivery modes: leased
shards, and shared delivery where every member claims ranges of every shard (there, "every
shard leased" becomes every live member registered and ready).

The sidecars ask for 4 s ZooKeeper sessions, so a pause "past the session" is a pause
until the server has expired it, which the test observes (the member znode goes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError

from casque.engine import catalog, offsets
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.group import Group, assert_sound, load_until_holding, until
from tests.fixtures.history import History, Seek
from tests.fixtures.positions import heads_of, offsets_and_epochs
from tests.fixtures.sidecars import StartSidecar

QUEUE = QueueRef("default", "orders")
SUBSCRIBER = "fulfilment"
SESSION = {"CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS": "4"}


def create(group: Group, shards: int, visibility: int = 10) -> QueueSpec:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(group.store, QUEUE, spec)
    catalog.apply_subscriber(group.store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=visibility,
        delivery=group.delivery))
    return spec


# The whole suite runs in both delivery modes: leased shards, and ranges claimed by every member.
@pytest.fixture(params=["leased", "shared"])
async def group(request: pytest.FixtureRequest, store: Store, start_sidecar: StartSidecar) -> AsyncIterator[Group]:
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION, delivery=request.param)
    yield running
    await running.stop()


async def test_a_member_paused_past_its_session_rejoins_and_takes_its_share_back(
    store: Store, group: Group
) -> None:
    spec = create(group, shards=4)
    first, *_ = await group.add(3)
    await group.whole(spec.log_shards())
    await group.publish(150, "before")
    first.pause()
    await group.member_gone(first)
    await group.publish(150, "during")  # the others take its shards and its unacked messages
    await group.drained()
    first.resume()
    await group.whole(spec.log_shards())
    if group.delivery == "leased":
        assert group.members[first] in set((await asyncio.to_thread(group.lease_holders)).values())
    # Leased, it holds shards again and gets the first round's share. Shared, it claims
    # ranges as the others do, and on a loaded machine they may claim a whole round first:
    # rounds go on until it delivers (at most 10, or the test fails).
    await (await load_until_holding(group, first, 300, "after", since=len(group.history.deliveries)))
    await group.drained()
    assert_sound(group.history)


async def test_every_member_paused_past_its_session_rejoins_and_consumption_resumes(
    store: Store, group: Group
) -> None:
    spec = create(group, shards=3)
    sidecars = await group.add(3)
    await group.whole(spec.log_shards())
    await group.publish(150, "before")
    for sidecar in sidecars:
        sidecar.pause()
    for sidecar in sidecars:
        await group.member_gone(sidecar)
    for sidecar in sidecars:
        sidecar.resume()
    await group.whole(spec.log_shards())
    await group.publish(150, "after")
    await group.drained()
    assert_sound(group.history)


async def test_a_member_killed_with_sigkill_loses_nothing_and_its_replacement_joins(
    store: Store, group: Group
) -> None:
    spec = create(group, shards=4)
    victim, *_ = await group.add(3)
    await group.whole(spec.log_shards())
    # Published through every sidecar, the victim too: a publish it had written but not
    # answered is retried elsewhere with the same ids, and must not land twice (a phantom).
    publishing = await load_until_holding(group, victim, 600, "load")
    victim.kill()  # no drain, no release: its leases go with its session
    await group.add(1)
    await publishing
    await group.whole(spec.log_shards())
    await group.drained()
    assert_sound(group.history)


async def test_a_rolling_restart_redelivers_only_what_the_leaving_members_held(
    store: Store, group: Group
) -> None:
    spec = create(group, shards=6, visibility=60)
    originals = await group.add(3)
    await group.whole(spec.log_shards())
    held_at_leave = 0
    for index, leaving in enumerate(originals):
        publishing = await load_until_holding(group, leaving, 200, f"wave{index}-")
        held_at_leave += _unacked(group.history, group.members[leaving])
        assert await asyncio.to_thread(leaving.terminate) == 0  # drains, releases its leases
        await group.add(1)
        await publishing
        await group.whole(spec.log_shards())
    await group.drained()
    assert_sound(group.history)
    assert group.history.redeliveries() <= held_at_leave


async def test_shards_added_under_live_members_are_consumed_and_counted_by_readiness(
    store: Store, group: Group
) -> None:
    create(group, shards=2)
    await group.add(3)
    await group.whole([0, 1])
    await group.publish(100, "small")
    grown = QueueSpec(shards=6, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, grown)
    await group.whole(grown.log_shards())
    await group.publish(300, "grown")
    await group.drained()
    assert_sound(group.history)


async def replayed_after_the_seek(group: Group, shards: list[int], before: dict[int, tuple[int, int]]) -> None:
    """Every message published is acked again after the seek, and the history is sound.

    Judged from the subscriber's offsets, not from when acks were sent: members learn of a
    seek from a watch, and under load one replayed and acked messages before the seek's
    answer reached the test, so "acked after the answer" missed them. In the seek's epoch
    an offset passes a batch only once the app acked every message in it there (nothing
    here expires or is dead-lettered): every shard's offset past its head in a new epoch
    is every message delivered and acked again."""
    await group.drained()

    def describe() -> str:
        now = offsets_and_epochs(group.store, QUEUE, SUBSCRIBER, shards)
        return f"(offsets and epochs {now}, before {before}, heads {heads_of(group.store, QUEUE, shards)})"

    async def replayed() -> bool:
        now = await asyncio.to_thread(offsets_and_epochs, group.store, QUEUE, SUBSCRIBER, shards)
        top = await asyncio.to_thread(heads_of, group.store, QUEUE, shards)
        return all(now[s][1] > before[s][1] and now[s][0] > top[s] for s in shards)

    await until("every message acked again in the seek's epoch", replayed, describe=describe)
    assert_sound(group.history)


async def test_a_seek_under_load_replays_everything_and_loses_nothing(store: Store, group: Group) -> None:
    spec = create(group, shards=3)
    first, *_ = await group.add(2)
    await group.whole(spec.log_shards())
    await group.publish(200, "history")
    await group.drained()
    publishing = asyncio.create_task(group.publish(200, "live"))
    before = await asyncio.to_thread(offsets_and_epochs, store, QUEUE, SUBSCRIBER, spec.log_shards())
    await group.seek(first, {"to": "earliest"})
    await publishing
    await replayed_after_the_seek(group, spec.log_shards(), before)


async def test_a_seek_across_sixteen_busy_shards_succeeds_when_first_asked(store: Store, group: Group) -> None:
    """Consumers commit offsets on every shard while the seek is asked, and a commit lands on
    every shard between the seek's reads and its transaction (as one does under load, at up
    to 20 a second per busy shard): the seek must not race the commits (it compared-and-set
    every offset and answered 503 after 20 lost races), and the replay afterwards delivers
    everything from the target."""
    spec = create(group, shards=16)
    await group.add(4)
    await group.whole(spec.log_shards())
    await group.publish(400, "history")
    await group.drained()
    acks_before = len(group.history.acks)
    publishing = asyncio.create_task(group.publish(2000, "live"))

    async def busy() -> bool:
        return len(group.history.acks) - acks_before >= 200

    await until("the consumers acking live messages", busy)
    sent = History.now()
    before = await asyncio.to_thread(offsets_and_epochs, store, QUEUE, SUBSCRIBER, spec.log_shards())
    committing = dataclasses.replace(store, zk=_CommitsInTheWay(store, spec.log_shards()))
    # Raises BackendUnavailable (the sidecar's 503) if the seek loses to the commits.
    await asyncio.to_thread(offsets.seek, committing, QUEUE, SUBSCRIBER, offsets.SeekTarget("earliest"))
    group.history.seeks.append(Seek(sent, History.now()))
    await publishing
    await replayed_after_the_seek(group, spec.log_shards(), before)


class _CommitsInTheWay:
    """The test's ZooKeeper client, whose transactions meet a commit of every shard's offset
    just before they are sent: what a seek's transaction meets on busy shards."""

    def __init__(self, store: Store, shards: list[int]) -> None:
        self._client = store.zk
        self._offsets = [store.paths(QUEUE).subscriber(SUBSCRIBER).offset(shard) for shard in shards]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def transaction(self) -> Any:
        transaction = self._client.transaction()
        send = transaction.commit

        def commit() -> Any:
            for path in self._offsets:
                _commit_in_place(self._client, path)
            return send()

        transaction.commit = commit
        return transaction


def _commit_in_place(client: KazooClient, path: str) -> None:
    """A commit as a holder makes it (compare-and-set on the version it read), of the offset
    that is there already; the real consumers commit meanwhile too, so until one lands."""
    while True:
        data, stat = client.get(path)
        try:
            client.set(path, data, version=stat.version)
            return
        except BadVersionError:
            continue


async def test_a_recreated_subscriber_is_served_from_its_new_incarnation(store: Store, group: Group) -> None:
    spec = create(group, shards=2)
    await group.add(2)
    await group.whole(spec.log_shards())
    await group.publish(100, "old")
    await group.drained()
    recreated_at = History.now()
    catalog.delete_subscriber(store, QUEUE, SUBSCRIBER)
    create(group, shards=2)
    # The new incarnation starts at `earliest` and inherits no acks: a reset, like a seek.
    group.history.seeks.append(Seek(recreated_at, History.now()))
    await group.whole(spec.log_shards())
    await group.publish(100, "new")

    async def served_again() -> bool:
        again = {a.message_id for a in group.history.acks if a.sent > recreated_at and a.outcome == "acked"}
        return set(group.history.published) <= again

    await until("every message acked again by the new incarnation", served_again)
    assert_sound(group.history)


async def test_a_backlog_older_than_retention_is_skipped_and_the_group_stays_ready(
    store: Store, group: Group
) -> None:
    spec = create(group, shards=2)
    table = store.table(QUEUE)
    # Published while nobody consumes, then expired: a subscriber fallen behind retention.
    store.session.execute(f"ALTER TABLE {table} WITH default_time_to_live = 2")
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    expired = [await publisher.publish([OutgoingMessage(f"old-{i}".encode(), key=f"k{i}")]) for i in range(20)]
    await publisher.flush_heads()
    store.session.execute(f"ALTER TABLE {table} WITH default_time_to_live = 3600")
    positions = [(r.shard, r.batch) for (r,) in expired]
    await until("the old batches to expire", lambda: asyncio.to_thread(_all_expired, store, positions))

    await group.add(2)
    await group.whole(spec.log_shards())
    await group.publish(100, "fresh")
    await group.drained()
    assert_sound(group.history)
    assert not {r.message_id for (r,) in expired} & group.history.delivered_ids()
    paths = store.paths(QUEUE)

    async def offsets_past_heads() -> bool:
        return all(
            catalog.read_offset(store, paths.subscriber(SUBSCRIBER), shard) > catalog.read_int(store, paths.head(shard))
            for shard in spec.log_shards()
        )

    await until("every offset past its head", offsets_past_heads)


def _all_expired(store: Store, positions: list[tuple[int, int]]) -> bool:
    query = f"SELECT batch_no FROM {store.table(QUEUE)} WHERE shard = %s AND bucket = %s AND batch_no = %s AND seq = -1"
    return all(store.session.execute(query, (shard, bucket_of(batch), batch)).one() is None
               for shard, batch in positions)


def _unacked(history: History, member: str) -> int:
    """Messages a member has delivered whose ack has not been answered `acked`."""
    acked = {a.receipt for a in history.acks if a.outcome in ("acked", "already_acked")}
    return sum(1 for d in history.deliveries if d.member == member and d.receipt not in acked)
