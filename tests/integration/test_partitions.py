"""The consumer group under network partitions: one sidecar cut off from ZooKeeper, from
Cassandra, or from both, while the others go on.

Every sidecar reaches its backends through TCP proxies of its own (tests.fixtures.proxy);
each test partitions one of them under load, for longer than its 4 s ZooKeeper session,
and demands, as tests/integration/test_group_faults.py does: while it is cut off, the
others deliver and ack everything published meanwhile (nothing stalls behind the cut
member's shards or ranges); once healed, every member back in the group and ready, every
shard leased by a live member, and a history (tests.fixtures.history) in which every
acknowledged publish was delivered and acked and nothing acked was delivered again.
Every test runs in both delivery modes. A cut refuses connections; a blackhole accepts them
and never answers (each request waits for its timeout); a slow link delivers everything late.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from casque.engine import catalog
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.group import Group, assert_sound, load_until_holding, until
from tests.fixtures.proxy import Proxy
from tests.fixtures.sidecars import SidecarProcess, StartSidecar
from tests.integration.test_group_faults import QUEUE, SESSION, SUBSCRIBER

SHARDS = 4


@pytest.fixture(params=["leased", "shared"])
async def group(request: pytest.FixtureRequest, store: Store, start_sidecar: StartSidecar) -> AsyncIterator[Group]:
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION, delivery=request.param, proxied=True)
    spec = QueueSpec(shards=SHARDS, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    # A short visibility: what the cut member holds comes back to the others soon after.
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=5, delivery=request.param))
    await running.add(3)
    await running.whole(spec.log_shards())
    yield running
    await running.stop()


def _proxies(sidecar: SidecarProcess, which: str) -> list[Proxy]:
    assert sidecar.proxies is not None
    return {"zookeeper": [sidecar.proxies.zookeeper], "cassandra": [sidecar.proxies.cassandra],
            "both": list(sidecar.proxies)}[which]


async def _partition(group: Group, which: str, blackhole: bool = False) -> None:
    victim = group.sidecars[0]
    others = group.sidecars[1:]
    publishing = await load_until_holding(group, victim, 300, "before")
    for proxy in _proxies(victim, which):
        proxy.blackhole() if blackhole else proxy.cut()
    # Past the session: the server expires the member's session (cut from ZooKeeper), or the
    # member steps back from a group it cannot serve (cut from Cassandra); either way its
    # member znode goes and the others take its share.
    await group.member_gone(victim)
    if which == "cassandra":
        # It is still connected to ZooKeeper: its /readyz says why it left.
        status, body = await asyncio.to_thread(victim.readiness)
        assert status == 503 and "Cassandra unreachable" in body["checks"][f"subscriber/{SUBSCRIBER}"], body
    await publishing
    await group.publish(300, "during", via=others)
    await group.drained()  # nothing stalls behind the cut member
    for proxy in _proxies(victim, which):
        proxy.heal()
    await group.whole(list(range(SHARDS)))
    if group.delivery == "leased":
        # Back in the group, it gets its share of the shards once their holders handed them
        # over (after their deliveries' visibility): only then can it have work in hand.
        await until(f"{group.members[victim]} to hold a shard again",
                    lambda: asyncio.to_thread(lambda: group.members[victim] in group.lease_holders().values()))
    await (await load_until_holding(group, victim, 300, "after", since=len(group.history.deliveries)))
    await group.drained()
    assert_sound(group.history)


async def test_a_member_cut_from_zookeeper_past_its_session_rejoins(group: Group) -> None:
    await _partition(group, "zookeeper")


async def test_a_member_cut_from_cassandra_gives_its_share_up_and_rejoins(group: Group) -> None:
    await _partition(group, "cassandra")


async def test_a_member_cut_from_both_backends_rejoins(group: Group) -> None:
    await _partition(group, "both")


async def test_a_member_blackholed_from_zookeeper_past_its_session_rejoins(group: Group) -> None:
    await _partition(group, "zookeeper", blackhole=True)


async def test_a_member_blackholed_from_cassandra_gives_its_share_up_and_rejoins(group: Group) -> None:
    # Its requests are accepted and never answered: every one waits for the driver's timeout.
    await _partition(group, "cassandra", blackhole=True)


async def test_a_member_behind_a_slow_link_keeps_up_and_loses_nothing(group: Group) -> None:
    """Both of one member's links slowed to 300 ms each way (a congested node): it stays in
    the group, serves its share, and the history stays sound."""
    victim = group.sidecars[0]
    publishing = await load_until_holding(group, victim, 300, "before")
    for proxy in _proxies(victim, "both"):
        proxy.slow(0.3)
    await publishing
    since = len(group.history.deliveries)
    await (await load_until_holding(group, victim, 300, "slow", since=since))
    await group.drained()
    assert group.members[victim] in await asyncio.to_thread(group.registered), "the slowed member left the group"
    for proxy in _proxies(victim, "both"):
        proxy.heal()
    await group.whole(list(range(SHARDS)))
    assert_sound(group.history)
