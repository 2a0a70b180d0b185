"""Shared delivery under faults, through the sidecar HTTP API, with sidecar processes.

Eight sidecars share a two-shard queue (`delivery: shared`): every one of them receives,
and after kill -9 or a pause of a member past its claims, a history checker
(tests.fixtures.history) finds every acknowledged publish delivered and acked, nothing
delivered again after an ack answered `acked`, and no ack of a superseded delivery answered
`acked`; every live member is back in the group and ready.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.group import Group, load_until_holding
from tests.fixtures.history import Delivery as HistoryDelivery, History, check, keys_in_flight_twice
from tests.fixtures.sidecars import StartSidecar

QUEUE = QueueRef("default", "pool")
SUBSCRIBER = "workers"
# Short visibility, so that a dead member's claims come back within seconds.
VISIBILITY = 4


def create(store: Store, shards: int) -> QueueSpec:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=VISIBILITY, delivery="shared"))
    return spec


@pytest.fixture
async def group(store: Store, start_sidecar: StartSidecar) -> AsyncIterator[Group]:
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER)
    yield running
    await running.stop()


def _receivers(group: Group) -> set[str]:
    return {d.member for d in group.history.deliveries}


async def test_eight_members_on_two_shards_all_receive_and_a_killed_one_loses_nothing(
    store: Store, group: Group
) -> None:
    create(store, shards=2)
    members = await group.add(8)
    await group.whole(None)
    rounds = 0
    while not {group.members[s] for s in members} <= _receivers(group):
        # Claims are sized to reach every member: a few rounds of 400 messages suffice even
        # when some sidecars are slow to start asking (a loaded machine).
        assert rounds < 10, f"members that never received: {set(group.members.values()) - _receivers(group)}"
        await group.publish(400, f"warm{rounds}")
        await group.drained()
        rounds += 1
    victim = members[0]
    publishing = await load_until_holding(group, victim, 800, "load")
    victim.kill()  # its claims stay until their time runs out; the others take them over then
    await group.add(1)
    await publishing
    await group.whole(None)
    await group.drained()
    verdict = check(group.history)
    assert verdict.ok, str(verdict)


async def test_a_member_paused_past_its_claims_has_its_acks_refused_and_serves_again(
    store: Store, group: Group
) -> None:
    create(store, shards=2)
    members = await group.add(4)
    await group.whole(None)
    sleeper = members[0]
    # Published through every member, the sleeper too: a publish the pause cuts in two is
    # retried elsewhere, and its late claim, sent on the resume, must not store its messages twice.
    publishing = await load_until_holding(group, sleeper, 300, "load")
    sleeper.pause()
    await publishing
    await group.drained()  # the others took its ranges over once their time ran out
    sleeper.resume()
    await group.whole(None)
    after: set[str] = set()

    def served_again() -> bool:
        return any(d.member == group.members[sleeper] and d.message_id in after for d in group.history.deliveries)

    for round_ in range(10):  # rounds again: the others may drain a round before it asks
        after |= await group.publish(400, f"after{round_}")
        await group.drained()
        if served_again():
            break
    assert served_again(), "the resumed member received nothing in 10 rounds"
    verdict = check(group.history)
    assert verdict.ok, str(verdict)
    assert stored_more_than_once(store) == {}


def stored_more_than_once(store: Store) -> dict[str, int]:
    """Client ids with more than one message in the queue's log."""
    copies = Counter(row.client_id for row in store.session.execute(
        f"SELECT client_id FROM {store.table(QUEUE)}") if row.client_id)
    return {client_id: n for client_id, n in copies.items() if n > 1}


async def test_switching_a_live_group_from_leased_to_shared_delivery_loses_nothing(
    store: Store, group: Group
) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    leased = SubscriberSpec(queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=VISIBILITY)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased)
    await group.add(3)
    await group.whole(spec.log_shards())
    await group.publish(300, "leased")
    await group.drained()
    publishing = asyncio.create_task(group.publish(600, "switching"))
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased.model_copy(update={"delivery": "shared"}))
    await publishing
    await group.whole(None)
    await group.drained()
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    assert all(store.zk.exists(paths.cursor(s)) for s in spec.log_shards()), "the members did not switch"
    assert not await asyncio.to_thread(group.lease_holders), "a member still holds a shard lease"
    verdict = check(group.history)
    assert verdict.ok, str(verdict)


async def test_switching_a_live_group_from_shared_to_leased_delivery_and_back_redelivers_nothing_acked(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """Members switch one by one, each when its watch fires: for a moment a member that
    switched to leased delivery loads a shard while others still hold shared claims on it
    and their apps still ack (each holds what it received for a moment, so acks are always
    in flight). Nothing acked may be delivered again, either way round."""
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    shared = SubscriberSpec(queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=VISIBILITY,
                            delivery="shared")
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, shared)
    group = Group(start_sidecar, store, QUEUE, SUBSCRIBER, ack_delay=0.3)
    try:
        await group.add(3)
        await group.whole(None)
        await group.publish(300, "shared")
        for round, delivery in enumerate(["leased", "shared", "leased"]):
            publishing = asyncio.create_task(group.publish(300, f"switching-{round}"))
            catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, shared.model_copy(update={"delivery": delivery}))
            group.delivery = delivery
            await publishing
            await group.whole(spec.log_shards() if delivery == "leased" else None)
        await group.drained()
        verdict = check(group.history)
        assert verdict.ok, str(verdict)
    finally:
        await group.stop()


async def test_a_member_whose_app_stops_asking_lets_its_range_go_once_the_visibility_ends(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """An app that receives and then goes away, its sidecar still running: once its
    deliveries' visibility ends, its member lets the range go to members whose apps ask.
    Visibility used to end only when the member took messages, so that range stayed in
    flight and its claim was renewed for good."""
    create(store, shards=1)
    left = await asyncio.to_thread(start_sidecar, "--queue", QUEUE.name, "--subscriber", SUBSCRIBER)
    working = await asyncio.to_thread(start_sidecar, "--queue", QUEUE.name, "--subscriber", SUBSCRIBER)
    async with AsyncClient(left.url, queue=QUEUE.name, subscriber=SUBSCRIBER) as gone, \
            AsyncClient(working.url, queue=QUEUE.name, subscriber=SUBSCRIBER) as worker:
        published = {r.message_id for r in await gone.publish_batch([{"data": i} for i in range(20)])}
        assert await gone.receive(max=10, wait=10), "the member whose app leaves received nothing"
        acked: set[str] = set()
        deadline = time.monotonic() + 120
        while acked != published:
            assert time.monotonic() < deadline, f"{len(published - acked)} messages stranded at a member nobody asks"
            for message in await worker.receive(max=20, wait=1):
                if await worker.ack(message.receipt) in ("acked", "already_acked"):
                    acked.add(message.message_id)


async def test_a_killed_members_ordered_keys_move_on_once_its_session_ends_not_when_its_claims_lapse(
    store: Store, group: Group
) -> None:
    # A visibility far longer than the sidecars' ZooKeeper session (10 s): the victim's claim
    # lasts that long and more, and its deliveries too, but its session ends 10 s after the kill.
    visibility = 60
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=visibility, delivery="shared",
        ordered_keys=True))
    (victim,) = await group.add(1, work=False)  # the test is its app: it takes two, acks none
    await group.publish(64, "k")  # keys k-0 .. k-15, four messages each
    keys = {row.message_id: row.key for row in store.session.execute(f"SELECT message_id, key FROM {store.table(QUEUE)}")
            if row.message_id}
    sent = History.now()
    async with AsyncClient(victim.url, queue=QUEUE.name, subscriber=SUBSCRIBER) as client:
        held = await client.receive(max=2, wait=10)
    answered = History.now()
    assert held, "the victim received nothing"
    group.history.deliveries.extend(
        HistoryDelivery(m.message_id, m.receipt, group.members[victim], m.delivery_count, sent, answered)
        for m in held)
    claimed = await asyncio.to_thread(claims_of, store, group.members[victim])
    assert claimed, "the victim claimed nothing"
    await group.add(2)
    victim.kill()
    await group.drained(limit_s=visibility * 3)

    verdict = check(group.history)
    assert verdict.ok, str(verdict)
    twice = keys_in_flight_twice(group.history, keys, visibility)
    assert not twice, f"{len(twice)} keys in flight twice, e.g. {twice[:2]}"
    # The messages the victim had not handed out, of keys it did not hold, went to the others
    # once its session ended: before any message it held was delivered again (at the end of its
    # visibility). Waiting for its claim to lapse, all come back together, the held ones first.
    held_ids = {m.message_id for m in held}
    held_keys = {keys[m] for m in held_ids}
    again = [d for d in group.history.deliveries if d.message_id in held_ids and d.delivery_count > 1]
    assert again, "the messages the victim held were never delivered again"
    free = [d for d in group.history.deliveries if d.message_id not in held_ids and keys[d.message_id] not in held_keys]
    late = [d for d in free if d.answered > min(r.sent for r in again)]
    assert not late, f"{len(late)} of {len(free)} free messages waited for the victim's claim, e.g. {late[:2]}"


def claims_of(store: Store, member: str) -> list[str]:
    """The names of the claims `member` holds now."""
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    mine = []
    for shard in (0,):
        for name in store.zk.get_children(paths.claims(shard)):
            data, _ = store.zk.get(f"{paths.claims(shard)}/{name}")
            if json.loads(data)["member"] == member:
                mine.append(name)
    return mine
