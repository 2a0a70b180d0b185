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
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from casque.engine import catalog, protocol
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import ApiError, AsyncClient
from tests.fixtures.group import Group, assert_sound
from tests.fixtures.releases import release_python
from tests.fixtures.sidecars import StartSidecar
from tests.fixtures.stack import Backends

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


RESOURCES = """\
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {{name: shipments}}
spec: {{shards: {shards}, retention: 1h, consistency: ONE}}
---
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {{name: carriers}}
spec: {{queue: shipments, startPosition: earliest, delivery: {delivery}}}
"""


def apply_with(python: Path | str, env: dict[str, str], file: Path) -> subprocess.CompletedProcess[str]:
    """`casque apply -f` of one installation: the reconcile its operator runs (casque.engine.catalog)."""
    return subprocess.run([str(python), "-m", "casque.cli", "apply", "-f", str(file)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=file.parent)


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_the_installation_of_main_takes_over_what_the_previous_made_and_hands_it_back(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, start_sidecar: StartSidecar, tmp_path: Path,
    delivery: str,
) -> None:
    previous = release_python()
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    file = tmp_path / "shipments.yaml"
    file.write_text(RESOURCES.format(shards=2, delivery=delivery))
    made = apply_with(previous, env, file)
    assert made.returncode == 0, made.stderr
    incarnation = catalog.read_queue(store, QUEUE).incarnation
    group = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION, delivery=delivery)
    try:
        await group.add(2, python=previous)
        await group.whole([0, 1])
        await group.publish(150, "by-previous")
        await group.drained()
        # The operator upgraded: it applies what the previous one made; nothing is made anew.
        taken = apply_with(sys.executable, env, file)
        assert taken.returncode == 0, taken.stderr
        assert catalog.read_queue(store, QUEUE).incarnation == incarnation
        await group.add(1)
        file.write_text(RESOURCES.format(shards=3, delivery=delivery))  # a change made by the new one
        grown = apply_with(sys.executable, env, file)
        assert grown.returncode == 0 and "shard 2 added" in grown.stdout, grown.stdout + grown.stderr
        await group.whole([0, 1, 2])
        await group.publish(150, "by-main")
        await group.drained()
        # Rolled back: the previous operator applies the same resources over what main wrote.
        back = apply_with(previous, env, file)
        assert back.returncode == 0, back.stderr
        assert back.stdout.splitlines() == ["queue default/shipments: unchanged",
                                            "subscriber default/carriers (queue shipments): unchanged"]
        await group.publish(150, "after-rollback")
        await group.drained()
        assert_sound(group.history)
    finally:
        await group.stop()


KEPT_PATTERN = "^o-(?=[0-9])"  # a lookahead: the previous release took it (Python's re), RE2 does not
SCHEMA_QUEUE = """\
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {{name: shipments}}
spec:
  shards: 1
  retention: 1h
  consistency: ONE
  schemaCompatibility: none
  schema: {{type: object, properties: {{id: {{type: string, pattern: "{pattern}"}}}}}}
"""


async def test_a_schema_the_previous_release_applied_stays_in_force_though_a_new_one_like_it_is_refused(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, start_sidecar: StartSidecar, tmp_path: Path,
) -> None:
    """Patterns are now matched by RE2 (casque.dataschema.patterns). A queue whose schema has one
    RE2 refuses, applied by the previous release, must still be read, served and re-applied by
    main (with a warning), its messages checked as before; only a new schema must be linear."""
    previous = release_python()
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    file = tmp_path / "shipments.yaml"
    file.write_text(SCHEMA_QUEUE.format(pattern=KEPT_PATTERN))
    made = apply_with(previous, env, file)
    assert made.returncode == 0, made.stderr
    assert catalog.read_queue(store, QUEUE).spec.data_schema is not None  # main reads it
    sidecar = start_sidecar("--queue", QUEUE.name)
    async with AsyncClient(sidecar.url, queue=QUEUE.name) as client:
        await client.publish({"id": "o-7"})
        with pytest.raises(ApiError) as refused:
            await client.publish({"id": "o-x"})
        assert (refused.value.status, refused.value.code) == (400, "schema_violation")
    again = apply_with(sys.executable, env, file)  # the upgraded operator's next reconcile
    assert again.returncode == 0, again.stderr
    assert "stays in force" in again.stdout + again.stderr and "RE2" in again.stdout + again.stderr
    file.write_text(SCHEMA_QUEUE.format(pattern=KEPT_PATTERN + "[0-9]+"))  # a change: must be linear
    changed = apply_with(sys.executable, env, file)
    assert changed.returncode != 0 and "RE2" in changed.stderr, changed.stdout + changed.stderr
    assert catalog.read_queue(store, QUEUE).spec.data_schema["properties"]["id"]["pattern"] == KEPT_PATTERN


def protocol_with(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "casque.cli", "protocol", *args], capture_output=True, text=True,
                          env=env, timeout=120)


async def test_the_protocol_is_raised_only_once_no_sidecar_of_the_previous_release_is_in_a_group(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, start_sidecar: StartSidecar,
) -> None:
    """Protocol 2's producer-sequence records would be read by the previous release as intents
    whose writer never recorded itself, and published again: the raise is refused while a
    member of it runs, taken once it left, and retries of numbered publishes through other
    sidecars then find every message where it landed. Lowered, the previous release may come
    back once the records' window has passed (here: at once, its members' first publishes
    are new numbers)."""
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    previous = release_python()
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=10))
    shards = [0, 1]
    group = Group(start_sidecar, store, QUEUE, SUBSCRIBER, env=SESSION)
    try:
        old = await group.add(1, python=previous)
        new = await group.add(2)
        await group.whole(shards)
        await group.publish(100, "mixed", via=[*old, *new], numbered=True)
        shown = protocol_with(env, "show", "-o", "json")
        assert shown.returncode == 0, shown.stderr
        seen = json.loads(shown.stdout)
        assert (seen["version"], seen["speaks"]) == (protocol.BASELINE, protocol.PROTOCOL)
        assert sorted(m["protocol"] for m in seen["members"]) == [1, 2, 2]  # 0.1.0's says none: 1
        # main's sidecars published, and are present among the queue's publishers; 0.1.0's is not.
        assert [m["protocol"] for m in seen["publishers"]] == [2, 2]
        refused = protocol_with(env, "set", "2")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert refused.stderr.count("\n") == 1 and "1 sidecar(s) speak less" in refused.stderr, refused.stderr
        assert f"{QUEUE}/{SUBSCRIBER} member" in refused.stderr and "(protocol 1)" in refused.stderr
        assert protocol.read(store).version == protocol.BASELINE
        assert await asyncio.to_thread(old[0].terminate) == 0
        await group.whole(shards)
        raised = protocol_with(env, "set", "2")
        assert raised.returncode == 0 and "protocol 1 -> 2" in raised.stdout, raised.stdout + raised.stderr
        # Each chunk published through one sidecar and retried whole through the other.
        for chunk in range(3):
            first = await group.publish(50, f"raised-{chunk}", via=[new[0]], numbered=True)
            again = await group.publish(50, f"raised-{chunk}", via=[new[1]], numbered=True)
            assert again == first, "a retry through another sidecar published again"
        await group.drained()
        lowered = protocol_with(env, "set", "1")
        assert lowered.returncode == 0 and "roll sidecars back after" in lowered.stdout, lowered.stdout
        back = await group.add(1, python=previous)
        await group.whole(shards)
        await group.publish(100, "lowered", via=[*back, *new], numbered=True)
        await group.drained()
        assert_sound(group.history)
    finally:
        await group.stop()
