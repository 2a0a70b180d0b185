"""The consumer group on a three-member ZooKeeper ensemble whose leader, or a follower, is
killed with SIGKILL while a publisher and two consumers of one subscriber run.

The sidecars and the test's own clients are given all three members in the connect string.
A killed follower drops the sessions connected to it; a killed leader makes every member
drop its clients while the other two elect a new leader. Either way each client reconnects
to a serving member within its session timeout (the sidecars' 10 s default), so the session
survives: the members keep their member ids and their leases, and the history checker
finds every acknowledged publish delivered and acked and nothing acked delivered again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from casque.devstack import processes
from casque.devstack.zookeeper import ZooKeeperEnsemble, ZooKeeperServer
from casque.store import Store
from tests.fixtures.group import PUBLISH_CHUNK, Group, assert_sound, has_delivered, until
from tests.fixtures.history import History
from tests.fixtures.sidecars import StartSidecar
from tests.integration.test_group_faults import QUEUE, SUBSCRIBER, create


@pytest.fixture
def ensemble(zookeeper_ensemble: ZooKeeperEnsemble) -> Iterator[ZooKeeperEnsemble]:
    """The session's ensemble, whole before the test and made whole again after it."""
    zookeeper_ensemble.start()
    zookeeper_ensemble.wait_ready()
    yield zookeeper_ensemble
    zookeeper_ensemble.start()
    zookeeper_ensemble.wait_ready()


@pytest.fixture
def zk_hosts(ensemble_zk_hosts: str) -> str:
    """Every ZooKeeper client of these tests (store, sidecars) works on the ensemble."""
    return ensemble_zk_hosts


@pytest.fixture
async def group(store: Store, start_sidecar: StartSidecar, ensemble: ZooKeeperEnsemble) -> AsyncIterator[Group]:
    # The product's default session timeout (10 s): long enough to outlive an election.
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER)
    yield running
    await running.stop()


def victim(ensemble: ZooKeeperEnsemble, role: str) -> ZooKeeperServer:
    if role == "leader":
        leader = ensemble.leader()
        assert leader is not None, ensemble.modes()
        return leader
    followers = ensemble.followers()
    assert followers, ensemble.modes()
    # The one most clients are connected to (clients pick members at random), so that the
    # kill cuts sessions off rather than only shrinking the quorum.
    return max(followers, key=lambda member: member.connections())


@pytest.mark.parametrize("role", ["leader", "follower"])
async def test_a_killed_ensemble_member_costs_no_session_and_no_acknowledged_message(
    store: Store, group: Group, ensemble: ZooKeeperEnsemble, role: str
) -> None:
    spec = create(group, shards=4)
    sidecars = await group.add(2)
    await group.whole(spec.log_shards())
    members = {sidecar: group.members[sidecar] for sidecar in sidecars}

    # The publisher runs through the fault: it stops only once publishes sent after the kill
    # have been answered.
    stop = asyncio.Event()

    async def keep_publishing() -> None:
        chunk = 0
        while not stop.is_set():
            await group.publish(PUBLISH_CHUNK, f"load{chunk}")
            chunk += 1

    publishing = asyncio.create_task(keep_publishing())
    for sidecar in sidecars:
        await until("both members to have work in hand", has_delivered(group, sidecar))
    killed = victim(ensemble, role)
    await asyncio.to_thread(processes.kill, killed.directory)
    killed_at = History.now()
    # Two of three still make a quorum: a leader again (a new one if the leader died).
    await until("the two survivors to serve", lambda: asyncio.to_thread(ensemble.serving, 2),
                describe=ensemble.modes)

    async def published_after_the_kill() -> bool:
        return sum(1 for answered in group.history.published.values() if answered > killed_at) >= 2 * PUBLISH_CHUNK

    await until("publishes answered after the kill", published_after_the_kill)
    stop.set()
    await publishing

    await group.whole(spec.log_shards())
    await group.drained()
    assert_sound(group.history)
    # The sessions survived: the same member ids, and both members hold shards.
    assert {sidecar: group.members[sidecar] for sidecar in sidecars} == members

    async def both_hold_shards() -> bool:
        return set((await asyncio.to_thread(group.lease_holders)).values()) == set(members.values())

    await until("both members to hold shards", both_hold_shards, describe=group.lease_holders)

    # The killed member rejoins as a follower, and the group goes on.
    await asyncio.to_thread(ensemble.start)
    await asyncio.to_thread(ensemble.wait_ready)
    await group.publish(100, "after")
    await group.drained()
    assert_sound(group.history)
    assert {sidecar: group.members[sidecar] for sidecar in sidecars} == members
