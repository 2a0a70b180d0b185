"""Sidecars of the previous release and of main in one subscriber group, as a rolling upgrade
has them for minutes, and a rollback that leaves the previous release to read what main wrote.

The previous release is built from its commit (tests.fixtures.releases,
scripts/install-releases.sh). main's installation applies the queue (the operator is upgraded
first, docs/operations.md "Versions"); the history checker then demands what it demands of
every fault: every acknowledged publish delivered, nothing delivered again after its ack was
answered, every member in its group, whichever version published, delivered or acked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.group import Group, assert_sound
from tests.fixtures.releases import release_python
from tests.fixtures.sidecars import StartSidecar

QUEUE = QueueRef("default", "shipments")
SUBSCRIBER = "carriers"
SESSION = {"CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS": "4"}
MODES = {"leased": ("leased", False), "shared": ("shared", False), "ordered": ("shared", True)}


@pytest.fixture(params=sorted(MODES))
async def group(request: pytest.FixtureRequest, store: Store, start_sidecar: StartSidecar) -> AsyncIterator[Group]:
    delivery, ordered = MODES[request.param]
    spec = QueueSpec(shards=3, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=10, delivery=delivery,
        ordered_keys=ordered))
    running = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION, delivery=delivery)
    yield running
    await running.stop()


async def test_a_rolling_upgrade_and_a_rollback_lose_nothing_and_redeliver_nothing_acked(group: Group) -> None:
    shards = QueueSpec(shards=3).log_shards()
    previous = release_python()
    old = await group.add(2, python=previous)
    await group.whole(shards)
    await group.publish(150, "before")
    # The upgrade rolls one pod at a time: old and new side by side, publishing through both.
    new = await group.add(1)
    await group.whole(shards)
    await group.publish(150, "mixed", via=[*old, *new])
    assert await asyncio.to_thread(old[0].terminate) == 0  # drains, releases what it holds
    new += await group.add(1)
    await group.whole(shards)
    await group.publish(150, "rolling", via=[old[1], *new])
    assert await asyncio.to_thread(old[1].terminate) == 0
    await group.whole(shards)
    await group.publish(150, "upgraded")
    await group.drained()
    # Rolled back: the previous release reads the ack rows, offsets and checkpoints main wrote.
    back = await group.add(2, python=previous)
    for sidecar in new:
        assert await asyncio.to_thread(sidecar.terminate) == 0
    await group.whole(shards)
    await group.publish(150, "rolled-back", via=back)
    await group.drained()
    assert_sound(group.history)
