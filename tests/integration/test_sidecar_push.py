"""Push delivery to an app that fails some requests: retries with backoff, acks on 2xx, drops kept."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from aiohttp import web

from casque.config import Settings
from casque.engine import catalog
from casque.schema import QueueRef
from casque.sidecar.app import METRICS, create_app
from casque.sidecar.config import SidecarSettings
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = "events"
SUBSCRIBER = "webhook"
REF = QueueRef("default", QUEUE)
COUNT = 30


async def test_push_acks_2xx_retries_failures_with_backoff_and_keeps_dropped_messages(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    seen: dict[Any, list[int]] = defaultdict(list)
    accepted: set[int] = set()
    all_accepted = asyncio.Event()
    poison_retried = asyncio.Event()

    async def app_endpoint(request: web.Request) -> web.StreamResponse:
        assert request.content_type == "application/cloudevents+json"
        event = await request.json()
        assert event["specversion"] == "1.0" and event["receipt"]
        value = event["data"]
        seen[value].append(event["deliverycount"])
        if value == "poison":
            if len(seen[value]) >= 2:
                poison_retried.set()
            return web.Response(status=422)  # the app will never take it
        first_try = event["deliverycount"] == 1
        if value % 3 == 0 and first_try:
            return web.Response(status=503)  # overloaded: try again later
        if value % 5 == 0 and first_try:
            assert request.transport is not None
            request.transport.close()  # the app crashed mid-request
            return web.Response(status=500)
        accepted.add(value)
        if len(accepted) == COUNT:
            all_accepted.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", app_endpoint)
    server = await aiohttp_server(target)
    push_url = str(server.make_url("/events"))

    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", push_url=push_url))
    settings = SidecarSettings(
        queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1, push_concurrency=4,
        push_backoff_seconds=0.05, push_max_backoff_seconds=0.3,
    )
    client = await aiohttp_client(create_app(settings, Settings(), store))
    answer = await client.post(f"/v1/queues/{QUEUE}/messages/batch",
                               json={"messages": [{"data": i} for i in range(COUNT)] + [{"data": "poison"}]})
    assert answer.status == 200

    await asyncio.wait_for(all_accepted.wait(), 60)
    await asyncio.wait_for(poison_retried.wait(), 60)

    for value in range(COUNT):
        expected = [1, 2] if value % 3 == 0 or value % 5 == 0 else [1]
        assert seen[value] == expected, (value, seen[value])  # 2xx settles: no push after the ack
    assert seen["poison"][:2] == [1, 2]  # dropped, but not lost: no dead-letter queue yet, so it returns

    metrics = client.app[METRICS]
    outcomes = {
        o: metrics.registry.get_sample_value(
            "casque_sidecar_push_deliveries_total", {"subscriber": SUBSCRIBER, "outcome": o}
        )
        for o in ("ack", "retry", "drop")
    }
    failures = sum(1 for v in range(COUNT) if v % 3 == 0 or v % 5 == 0)
    assert outcomes["ack"] == COUNT and outcomes["retry"] == failures and (outcomes["drop"] or 0) >= 2

