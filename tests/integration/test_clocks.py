"""Sidecars whose wall clocks are off by seconds (libfaketime): one 5 s ahead, one 5 s behind.

Times that one process writes and another judges (a delayed message's due time, a shared
claim's `until`) are read from Cassandra's clock (casque.engine.clock), so a sidecar's own
skew moves nothing: no message is delivered before its time, and no range is taken over
while its holder's deliveries are still within their visibility. Monotonic clocks are left
alone (a process's visibility deadlines never leave it). The test process's clock is the
host's, which Cassandra's is too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import SidecarProcess

QUEUE = "clocks"
SUBSCRIBER = "workers"
REF = QueueRef("default", QUEUE)
SKEW_SECONDS = 5
# What reading Cassandra's clock may be off by: half the shortest of a few local round
# trips, a few milliseconds, more on a loaded machine. Skew is seconds.
READING_ERROR_SECONDS = 0.25
DELAY_SECONDS = 8


def libfaketime() -> Path:
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))
    assert found, "libfaketime is missing: scripts/install.sh installs Debian's faketime package"
    return found[0]


def skewed(seconds: int) -> dict[str, str]:
    """A sidecar's environment whose wall clock runs `seconds` off (its monotonic clock is not touched)."""
    return {"LD_PRELOAD": str(libfaketime()), "FAKETIME": f"{seconds:+d}", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def create(store: Store, shards: int, delivery: Literal["leased", "shared"], visibility: int) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=visibility, delivery=delivery))


def start_skewed(start_sidecar: Callable[..., SidecarProcess], seconds: int) -> SidecarProcess:
    return start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER, env=skewed(seconds))


async def test_a_sidecar_ahead_or_behind_delivers_no_delayed_message_before_its_time(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    create(store, shards=2, delivery="leased", visibility=30)
    # Started first, the sidecar ahead leads the queue's delayed-message mover.
    ahead = await asyncio.to_thread(start_skewed, start_sidecar, SKEW_SECONDS)
    behind = await asyncio.to_thread(start_skewed, start_sidecar, -SKEW_SECONDS)
    due: dict[str, float] = {}  # message id -> the earliest true time it may be delivered
    async with AsyncClient(ahead.url, queue=QUEUE, subscriber=SUBSCRIBER) as first, \
            AsyncClient(behind.url, queue=QUEUE, subscriber=SUBSCRIBER) as second:
        for client in (first, second):
            for i in range(4):
                at = datetime.now(timezone.utc) + timedelta(seconds=DELAY_SECONDS)
                given = await client.publish({"n": i}, deliver_at=at)
                due[given.message_id] = at.timestamp()
                sent = time.time()
                # A delay is turned into a time when the publish is handled: after `sent`.
                later = await client.publish({"n": i}, delay=DELAY_SECONDS)
                due[later.message_id] = sent + DELAY_SECONDS

        received: dict[str, float] = {}

        async def drain(client: AsyncClient) -> None:
            while set(received) != set(due):
                for message in await client.receive(max=10, wait=1):
                    received.setdefault(message.message_id, time.time())
                    await client.ack(message.receipt)

        await asyncio.wait_for(asyncio.gather(drain(first), drain(second)), DELAY_SECONDS + 120)
    early = {m: round(due[m] - at, 2) for m, at in received.items() if at < due[m] - READING_ERROR_SECONDS}
    assert not early, f"delivered before their time (seconds early): {early}"


async def test_a_claim_written_behind_in_time_is_not_taken_over_by_a_member_ahead_while_its_deliveries_run(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    # Short enough that, 10 s apart, the member ahead would see every renewal of the claim
    # (one visibility and half the headroom ahead of its holder's clock) as lapsed.
    visibility = 4
    create(store, shards=1, delivery="shared", visibility=visibility)
    behind = await asyncio.to_thread(start_skewed, start_sidecar, -SKEW_SECONDS)
    ahead = await asyncio.to_thread(start_skewed, start_sidecar, SKEW_SECONDS)
    async with AsyncClient(behind.url, queue=QUEUE, subscriber=SUBSCRIBER) as holder, \
            AsyncClient(ahead.url, queue=QUEUE, subscriber=SUBSCRIBER) as other:
        published = {r.message_id for r in await holder.publish_batch([{"data": i} for i in range(20)])}
        asked = time.time()
        held = {m.message_id for m in await holder.receive(max=10, wait=10)}
        assert held, "the member behind received nothing"
        # The holder neither acks nor asks again: its deliveries' visibility runs out, its
        # claim lapses, and the member ahead takes the range over and delivers them again.
        delivered_again: dict[str, float] = {}
        acked: set[str] = set()
        deadline = time.monotonic() + 120
        while acked != published:
            assert time.monotonic() < deadline, f"never delivered: {sorted(published - acked)}"
            for message in await other.receive(max=20, wait=1):
                if message.message_id in held:
                    delivered_again.setdefault(message.message_id, time.time())
                if await other.ack(message.receipt) in ("acked", "already_acked"):
                    acked.add(message.message_id)
    # Handed out again only after the holder's handout (after `asked`) plus its visibility.
    within = {m: round(at - asked, 2) for m, at in delivered_again.items() if at < asked + visibility}
    assert not within, f"delivered again within the holder's {visibility}s visibility (seconds after): {within}"
    assert set(delivered_again) == held


@pytest.fixture(autouse=True, scope="module")
def _preload_skews_a_process() -> None:
    """Not vacuous: a process with the preload reads a clock that far ahead."""
    child = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                           env={**os.environ, **skewed(SKEW_SECONDS)}, capture_output=True, text=True, check=True)
    assert float(child.stdout) - time.time() > SKEW_SECONDS - 1, "libfaketime did not move the clock"
