"""Acks that publish, killed with -9 at each step: every order's lines are published exactly
once, and every order is acked, whichever step each sidecar died at."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from casque.engine import catalog
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends
from tests.integration.pipeline_then_die import LINES, LINES_PER_ORDER, ORDERS, SUBSCRIBER

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("before-outputs", "between-outputs", "before-ack")


async def test_an_ack_that_publishes_killed_at_each_step_publishes_every_line_once(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    orders, lines = QueueRef("default", ORDERS), QueueRef("default", LINES)
    catalog.apply_queue(store, orders, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_queue(store, lines, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    # A short visibility: an order a victim took comes back soon after it died.
    catalog.apply_subscriber(store, orders, SUBSCRIBER, SubscriberSpec(
        queue=ORDERS, start_position="earliest", visibility_timeout_seconds=3))
    publisher = Publisher(store, orders, catalog.read_queue(store, orders))
    count = len(STEPS)
    await publisher.publish([OutgoingMessage(json.dumps({"order": n}).encode()) for n in range(count)])
    await publisher.flush_heads()

    cassandra = f"{backends.contact_points[0]}:{backends.cql_port}"
    arguments = [store.keyspace, cassandra, zk_hosts]
    for step in STEPS:
        seen = await _run(arguments + [step], -signal.SIGKILL)
        (reached,) = [line for line in seen if line["kind"] == "step"]
        assert reached["step"] == step and [line["kind"] for line in seen] == ["delivery", "step"]
    survivor = await _run(arguments + ["survive", str(count)], 0)
    acked = [line for line in survivor if line["kind"] == "acked"]
    assert sorted(line["order"] for line in acked) == list(range(count))
    # Victims died with lines written (between-outputs, before-ack): the survivor's acks of
    # those orders found them published, and wrote none of them again.
    assert any(any(line["duplicates"]) for line in acked), "no order had lines from a victim"

    written = Counter((line["order"], line["line"]) for line in _stored(store, lines))
    assert written == Counter({(n, i): 1 for n in range(count) for i in range(LINES_PER_ORDER)})


async def _run(arguments: list[str], code: int) -> list[dict[str, object]]:
    process = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "tests.integration.pipeline_then_die", *arguments],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert process.returncode == code, process.stderr[-3000:]
    return [json.loads(line) for line in process.stdout.splitlines() if line.strip()]


def _stored(store: Store, queue: QueueRef) -> list[dict[str, int]]:
    return [json.loads(row.payload) for row in store.session.execute(
        f"SELECT seq, payload FROM {store.table(queue)}") if row.seq >= 0]
