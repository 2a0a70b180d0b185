"""The stall signal on real sidecar processes: a consumer stopped on purpose with messages
waiting shows up in the sidecar's gauge, in its /readyz detail (which stays ready) and in
`casque describe subscriber`; an idle consumer with nothing to do, and a slow one whose
offset keeps moving, do not.

Each subscriber sets `stallAfter` to a few seconds so the test does not wait for the
default (2 x visibility + 20 s); every check awaits its condition.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime, timezone
from typing import Any

import aiohttp
import pytest
from click.testing import Result
from typer.testing import CliRunner

from casque.cli.main import app
from casque.engine import catalog
from casque.engine.stats import SubscriberStats, subscriber_stats
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import SidecarProcess, StartSidecar
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

QUEUE = "stalls"
REF = QueueRef("default", QUEUE)
STUCK, IDLE, SLOW = "stuck", "idle", "slow"
MESSAGES = 12
# Long enough that the never-acked message stays in flight for the whole test.
VISIBILITY = 600


def gauge(text: str, name: str, subscriber: str) -> float | None:
    found = re.search(rf'^{name}{{queue="{QUEUE}",subscriber="{subscriber}"}} (\S+)$', text, re.MULTILINE)
    return None if found is None else float(found.group(1))


async def scrape(sidecar: SidecarProcess) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{sidecar.url}/metrics") as answer:
        assert answer.status == 200
        return await answer.text()


def describe(env: dict[str, str], subscriber: str, *output: str) -> Result:
    result = CliRunner().invoke(app, ["describe", "subscriber", QUEUE, subscriber, *output], env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


async def described(env: dict[str, str], subscriber: str) -> dict[str, Any]:
    """`casque describe subscriber -o json`'s status, run from outside any sidecar."""
    result = await asyncio.to_thread(describe, env, subscriber, "-o", "json")
    status: dict[str, Any] = json.loads(result.stdout)["status"]
    return status


async def until(what: str, condition: Any, limit_s: float = 90.0) -> Any:
    """Await an async condition (polled in the test's loop); its truthy value."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        value = await condition()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def consume_all(client: AsyncClient, subscriber: str, count: int) -> None:
    got = 0
    while got < count:
        messages = await client.receive(max=count, wait=5, subscriber=subscriber)
        if messages:
            outcomes = await client.ack_batch([m.receipt for m in messages], subscriber=subscriber)
            assert all(o.status == "acked" for o in outcomes)
        got += len(messages)


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_a_stopped_consumer_is_reported_stalled_and_an_idle_one_is_not(
    store: Store, start_sidecar: StartSidecar, backends: Backends, keyspace: str, zk_hosts: str, delivery: str
) -> None:
    env = backends.client_env(keyspace, zk_hosts, store.zk_root)
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    common: dict[str, Any] = dict(queue=QUEUE, start_position="earliest", visibility_timeout_seconds=VISIBILITY,
                                  delivery=delivery, stall_after_seconds=2)
    # One key: with ordered keys its first message, never acked, holds all the others back.
    catalog.apply_subscriber(store, REF, STUCK, SubscriberSpec(**common, ordered_keys=True))
    catalog.apply_subscriber(store, REF, IDLE, SubscriberSpec(**common))
    sidecar = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", STUCK, "--subscriber", IDLE)
    async with AsyncClient(sidecar.url, queue=QUEUE) as client:
        for i in range(MESSAGES):
            await client.publish({"n": i}, key="one-key")
        (held,) = await client.receive(max=MESSAGES, wait=10, subscriber=STUCK)  # and never acked
        await consume_all(client, IDLE, MESSAGES)

    stats = await subscriber_stats(store, REF, STUCK)
    (shard,) = [s.shard for s in stats.shards if s.lag_batches > 0]  # the key's shard

    # The gauge: one stalled shard, the one holding the key; the idle subscriber none.
    async def stalled_gauge() -> str | None:
        text = await scrape(sidecar)
        return text if gauge(text, "casque_sidecar_stalled_shards", STUCK) == 1.0 else None

    text = await until("the stuck subscriber's stalled-shards gauge", stalled_gauge)
    assert gauge(text, "casque_sidecar_stall_threshold_seconds", STUCK) == 2.0
    stall_seconds = gauge(text, "casque_sidecar_stall_seconds", STUCK)
    assert stall_seconds is not None and stall_seconds >= 2.0

    # /readyz: the stall is a detail; the sidecar stays ready (a restart would not help).
    status, body = await asyncio.to_thread(sidecar.readiness)
    assert status == 200 and body["status"] == "ok", body
    assert body["checks"][f"stall/{STUCK}"].startswith(f"stalled: shard {shard} since "), body

    # `casque describe subscriber`, from the stored state alone.
    status_doc = await described(env, STUCK)
    assert status_doc["stalledShards"] == [shard] and status_doc["stallAfterSeconds"] == 2.0
    by_shard = {s["shard"]: s for s in status_doc["shards"]}
    assert by_shard[shard]["stalled"] is True and by_shard[shard]["stalledSince"] is not None
    assert by_shard[1 - shard]["stalled"] is False and by_shard[1 - shard]["lagBatches"] == 0
    text_doc = (await asyncio.to_thread(describe, env, STUCK)).stdout
    assert "stalled: True" in text_doc and "stalledShards:" in text_doc
    table = (await asyncio.to_thread(CliRunner().invoke, app, ["get", "subscribers", QUEUE], env=env)).stdout
    header, *rows = table.splitlines()
    column = header.index("STALLED")
    stalled_column = {row.split()[1]: row[column:].split()[0] for row in rows}
    assert stalled_column == {STUCK: str(shard), IDLE: "-"}, table

    # The idle subscriber: lag 0, its offset unmoved for longer than its threshold, yet not stalled.
    async def idle_past_threshold() -> SubscriberStats | None:
        idle = await subscriber_stats(store, REF, IDLE)
        now = datetime.now(timezone.utc)
        quiet = all(s.offset_moved_at is not None and (now - s.offset_moved_at).total_seconds() > 2 * 2.0
                    for s in idle.shards)
        return idle if quiet and idle.lag_batches == 0 else None

    idle = await until("the idle subscriber's offsets to stand still past its threshold", idle_past_threshold)
    assert idle.stalled_shards == []
    assert (await described(env, IDLE))["stalledShards"] == []

    async def idle_reported() -> str | None:
        # Reports are reused for a moment: wait for one made after the idle spell began.
        text = await scrape(sidecar)
        _, body = await asyncio.to_thread(sidecar.readiness)
        fresh = gauge(text, "casque_sidecar_stall_seconds", IDLE) == 0.0
        return text if fresh and body["checks"][f"stall/{IDLE}"].startswith("none") else None

    text = await until("the idle subscriber's report", idle_reported)
    assert gauge(text, "casque_sidecar_stalled_shards", IDLE) == 0.0
    assert gauge(text, "casque_sidecar_stalled_shards", STUCK) == 1.0


async def test_a_slow_consumer_whose_offset_keeps_moving_is_not_stalled(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """A backlog older than the threshold, worked off one message at a time for longer than
    the threshold: the offset moves at every ack, so the shard never counts as stalled, although
    it did while nobody consumed, and the oldest message waited longer than the threshold."""
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SLOW, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=VISIBILITY, stall_after_seconds=4))
    sidecar = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SLOW)
    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SLOW) as client:
        for i in range(MESSAGES):
            await client.publish({"n": i})  # one batch each: the offset can move at every ack

        # Nobody consumes: the backlog stalls the shard.
        async def stalled() -> bool:
            return gauge(await scrape(sidecar), "casque_sidecar_stalled_shards", SLOW) == 1.0

        await until("the unconsumed backlog to stall", stalled)

        async def one() -> None:
            (message,) = await client.receive(max=1, wait=10)
            await asyncio.sleep(0.5)  # the app's work on it
            assert await client.ack(message.receipt) == "acked"

        await one()

        async def recovered() -> bool:
            return gauge(await scrape(sidecar), "casque_sidecar_stalled_shards", SLOW) == 0.0

        await until("progress to clear the stall", recovered)
        # 11 more at half a second each: longer than the threshold in all.
        for _ in range(MESSAGES - 1):
            await one()
            text = await scrape(sidecar)
            assert gauge(text, "casque_sidecar_stalled_shards", SLOW) == 0.0
            assert (await subscriber_stats(store, REF, SLOW)).stalled_shards == []
        stats = await subscriber_stats(store, REF, SLOW)
        assert stats.lag_batches == 0 and stats.stalled_shards == []
