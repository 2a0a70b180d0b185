"""A sidecar that only publishes joins no subscriber group, yet a raise of the installation's
protocol must wait for it: it is present among the queue's publishers (casque.engine.presence),
again after its ZooKeeper session was lost, and a raise refuses while one there speaks less."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from casque.engine import catalog, protocol
from casque.schema import QueueRef
from casque.specs import QueueSpec
from casque.store import Store
from tests.fixtures.sidecars import StartSidecar
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

QUEUE = QueueRef("default", "leaflets")
SESSION = {"CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS": "4"}


def protocol_with(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "casque.cli", "protocol", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def publish(url: str) -> int:
    request = urllib.request.Request(f"{url}/v1/queues/{QUEUE.name}/messages", method="POST", data=b'{"data": 1}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return int(answer.status)


def test_a_sidecar_that_only_publishes_holds_a_raise_of_the_protocol_back_as_a_member_would(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, start_sidecar: StartSidecar
) -> None:
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    present = store.paths(QUEUE).publishers
    sidecar = start_sidecar(env=SESSION)  # no queue of its own, no subscriber: it only publishes
    assert publish(sidecar.url) == 200
    (name,) = wait_for("the sidecar's presence", lambda: store.zk.get_children(present))
    assert json.loads(store.zk.get(f"{present}/{name}")[0]) == {"protocol": protocol.PROTOCOL}
    shown = protocol_with(env, "show", "-o", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["publishers"] == [
        {"queue": str(QUEUE), "sidecar": name, "protocol": protocol.PROTOCOL}]

    # Paused past its session: the presence ends with the session, and the sidecar makes it
    # again in its next one.
    sidecar.pause()
    try:
        wait_for("the paused sidecar's session to end", lambda: not store.zk.get_children(present), timeout=60)
    finally:
        sidecar.resume()
    wait_for("the presence again", lambda: store.zk.get_children(present) == [name], timeout=60)
    assert publish(sidecar.url) == 200

    # One that speaks less (crafted: a sidecar of a release that speaks only protocol 1, as a
    # sidecar of this one will be to the next): the raise waits for it, naming it.
    store.zk.create(f"{present}/older-pod-1a2b3c", json.dumps({"protocol": 1}).encode(), ephemeral=True)
    refused = protocol_with(env, "set", str(protocol.PROTOCOL))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"{QUEUE} publisher older-pod-1a2b3c (protocol 1)" in refused.stderr, refused.stderr
    assert protocol.read(store).version == protocol.BASELINE
    store.zk.delete(f"{present}/older-pod-1a2b3c")
    raised = protocol_with(env, "set", str(protocol.PROTOCOL))
    assert raised.returncode == 0, raised.stdout + raised.stderr
    assert protocol.read(store).version == protocol.PROTOCOL
