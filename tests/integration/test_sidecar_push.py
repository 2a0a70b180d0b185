"""Push delivery to an app that fails some requests: retries with backoff, acks on 2xx, drops
kept without a dead-letter queue and dead-lettered at once with one; messages the sidecar
cannot render are settled too."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import defaultdict
from typing import Any

import pytest
from aiohttp import web

from casque.config import Settings
from casque.engine import catalog
from casque.engine.acks import ACK, AckEvent, AckLog
from casque.engine.consumer import Consumer
from casque.engine.deadletters import DELIVERIES, LAST_ERROR, SOURCE, SUBSCRIBER as SUBSCRIBER_ATTRIBUTE
from casque.engine.messages import Delivery, OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.sidecar import push
from casque.sidecar.app import METRICS, create_app
from casque.sidecar.config import SidecarSettings
from casque.sidecar.push import MAX_ANSWER_BYTES
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = "events"
SUBSCRIBER = "webhook"
REF = QueueRef("default", QUEUE)
COUNT = 30



async def first_letters(inspector: Consumer, limit_s: float = 120.0) -> list[Delivery]:
    """What the dead-letter queue's inspector first receives, however long a loaded machine
    takes to move it there (within `limit_s`)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = await inspector.receive(max_messages=10, wait=5)
        if got:
            return got
    pytest.fail(f"nothing reached the dead-letter queue within {limit_s:.0f}s")


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



async def test_a_dropped_push_goes_to_the_dead_letter_queue_at_once_with_the_apps_answer(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    pushed: dict[Any, list[int]] = defaultdict(list)
    fine_acked = asyncio.Event()

    async def app_endpoint(request: web.Request) -> web.StreamResponse:
        event = await request.json()
        pushed[event["data"]].append(event["deliverycount"])
        if event["data"] == "poison":
            return web.Response(status=422, text="no such customer")
        if len(pushed) == 4:
            fine_acked.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", app_endpoint)
    server = await aiohttp_server(target)
    dead = QueueRef("default", "events-dead")
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, REF, spec)
    catalog.apply_queue(store, dead, spec)
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", max_deliveries=5, dead_letter_queue=dead.name,
        push_url=str(server.make_url("/events"))))
    catalog.apply_subscriber(store, dead, "inspector", SubscriberSpec(queue=dead.name, start_position="earliest"))
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.3)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    answer = await client.post(f"/v1/queues/{QUEUE}/messages/batch",
                               json={"messages": [{"data": "poison", "attributes": {"kind": "order"}}]
                                     + [{"data": i} for i in range(3)]})
    assert answer.status == 200
    await asyncio.wait_for(fine_acked.wait(), 60)

    inspector = Consumer(store, dead, "inspector")
    await inspector.start()
    try:
        (letter,) = await first_letters(inspector)
    finally:
        await inspector.stop()
    assert json.loads(letter.message.payload) == "poison"
    assert letter.message.attributes["kind"] == "order"
    assert (letter.message.attributes[SOURCE], letter.message.attributes[SUBSCRIBER_ATTRIBUTE]) == (REF.key, SUBSCRIBER)
    assert letter.message.attributes[DELIVERIES] == "1"  # not after maxDeliveries: the app said never
    assert "HTTP 422" in letter.message.attributes[LAST_ERROR]
    assert "no such customer" in letter.message.attributes[LAST_ERROR]
    assert pushed["poison"] == [1]
    outcomes = {o: client.app[METRICS].registry.get_sample_value(
        "casque_sidecar_push_deliveries_total", {"subscriber": SUBSCRIBER, "outcome": o}) for o in ("ack", "drop")}
    assert outcomes == {"ack": 3, "drop": 1}


async def test_a_message_that_cannot_be_rendered_goes_to_the_dead_letter_queue_at_once(
    store: Store, aiohttp_server: Any, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pushed: list[Any] = []
    fine_acked = asyncio.Event()

    async def app_endpoint(request: web.Request) -> web.StreamResponse:
        pushed.append((await request.json())["data"])
        fine_acked.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", app_endpoint)
    server = await aiohttp_server(target)
    dead = QueueRef("default", "events-dead")
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, REF, spec)
    catalog.apply_queue(store, dead, spec)
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", max_deliveries=5, dead_letter_queue=dead.name,
        push_url=str(server.make_url("/events"))))
    catalog.apply_subscriber(store, dead, "inspector", SubscriberSpec(queue=dead.name, start_position="earliest"))
    # Rendering falls back to data_base64 and plain attributes, so no stored message is known
    # that it cannot render; the fault is injected, as a rendering bug would strike.
    rendered = push.message_json

    def render(delivery: Delivery, queue: QueueRef) -> bytes:
        if delivery.message.payload == b'"late"':
            raise RecursionError("maximum recursion depth exceeded")
        return rendered(delivery, queue)

    monkeypatch.setattr(push, "message_json", render)
    publisher = Publisher(store, REF, catalog.read_queue(store, REF))
    await publisher.publish([OutgoingMessage(b'"late"', content_type="application/json",
                                             attributes={"kind": "order"})])
    await publisher.flush_heads()
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.3)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    assert (await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": "fine"})).status == 200
    await asyncio.wait_for(fine_acked.wait(), 60)

    inspector = Consumer(store, dead, "inspector")
    await inspector.start()
    try:
        (letter,) = await first_letters(inspector)
    finally:
        await inspector.stop()
    assert letter.message.payload == b'"late"' and letter.message.attributes["kind"] == "order"
    assert letter.message.attributes[DELIVERIES] == "1"  # at once: a later try would fail alike
    assert "cannot render" in letter.message.attributes[LAST_ERROR]
    assert "RecursionError" in letter.message.attributes[LAST_ERROR]
    assert pushed == ["fine"]  # the app never saw it
    registry = client.app[METRICS].registry
    assert registry.get_sample_value(
        "casque_sidecar_push_errors_total", {"subscriber": SUBSCRIBER, "stage": "render"}) == 1
    assert registry.get_sample_value(
        "casque_sidecar_push_deliveries_total", {"subscriber": SUBSCRIBER, "outcome": "drop"}) == 1


async def test_json_nested_deeper_than_parsers_go_is_pushed_as_data_base64_like_a_receive(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    events: list[dict[str, Any]] = []
    pushed = asyncio.Event()

    async def app_endpoint(request: web.Request) -> web.StreamResponse:
        events.append(await request.json())
        pushed.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", app_endpoint)
    server = await aiohttp_server(target)
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", push_url=str(server.make_url("/events"))))
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.3)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    deep = b"[" * 100_000 + b"]" * 100_000  # valid JSON, beyond any parser's recursion limit
    answer = await client.post(f"/v1/queues/{QUEUE}/messages", json={
        "data_base64": base64.b64encode(deep).decode("ascii"), "datacontenttype": "application/json"})
    assert answer.status == 200

    await asyncio.wait_for(pushed.wait(), 60)
    (event,) = events
    assert "data" not in event and base64.b64decode(event["data_base64"]) == deep
    assert event["datacontenttype"] == "application/json"
    registry = client.app[METRICS].registry

    async def acked() -> bool:  # the app's 204 reached the sidecar and settled the push
        return registry.get_sample_value(
            "casque_sidecar_push_deliveries_total", {"subscriber": SUBSCRIBER, "outcome": "ack"}) == 1

    await _until(acked)
    assert registry.get_sample_value(
        "casque_sidecar_push_errors_total", {"subscriber": SUBSCRIBER, "stage": "render"}) is None


PUSH_TOKEN = "p" * 40


async def _readyz_checks(client: Any) -> dict[str, str]:
    return dict((await (await client.get("/readyz")).json()).get("checks") or {})


async def _until(condition: Any, limit_s: float = 60.0) -> None:
    """Wait for a condition, checking often; fail if it never holds."""
    deadline = time.monotonic() + limit_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_pushes_carry_the_token_and_redirects_are_answers_not_followed(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    tokens: list[str | None] = []
    deliveries: list[int] = []
    settled = asyncio.Event()
    followed = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        tokens.append(request.headers.get("Casque-Push-Token"))
        deliveries.append((await request.json())["deliverycount"])
        if len(deliveries) == 1:
            raise web.HTTPTemporaryRedirect("/elsewhere")  # 307 keeps the POST when followed
        settled.set()
        return web.Response(status=204)

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        followed.set()
        settled.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", events)
    target.router.add_post("/elsewhere", elsewhere)
    server = await aiohttp_server(target)
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", push_url=str(server.make_url("/events"))))
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1, push_token=PUSH_TOKEN,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.1)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    assert (await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": 1})).status == 200

    await asyncio.wait_for(settled.wait(), 60)
    assert not followed.is_set()
    assert deliveries == [1, 2]  # the 3xx was retried like any non-2xx, at the same URL
    assert tokens == [PUSH_TOKEN, PUSH_TOKEN]


async def test_an_endless_answer_is_read_only_up_to_the_cap(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    deliveries: list[int] = []
    hung_up = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        deliveries.append((await request.json())["deliverycount"])
        # No Content-Length: a chunked answer, whose end only the final empty chunk would mark.
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"x" * (2 * MAX_ANSWER_BYTES))
        try:
            # That chunk never comes: a reader that wants the whole answer waits for good.
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # the test server cancels a handler when its client hangs up
            hung_up.set()
            raise
        return response

    target = web.Application()
    target.router.add_post("/events", events)
    server = await aiohttp_server(target)
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", push_url=str(server.make_url("/events"))))
    # The longest push timeout: it must not be what ends the read (an uncapped read would
    # then end, and ack, too); only the cap may, well before the test's own limit.
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1, push_timeout_seconds=3600,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.1)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    assert (await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": 1})).status == 200
    metrics = client.app[METRICS]

    def pushes(outcome: str) -> float:
        return metrics.registry.get_sample_value(
            "casque_sidecar_push_deliveries_total", {"subscriber": SUBSCRIBER, "outcome": outcome}) or 0.0

    async def settled() -> bool:
        return pushes("ack") + pushes("retry") > 0

    await _until(settled)
    assert pushes("ack") == 1 and pushes("retry") == 0  # a 200 whose answer never ends still acks
    await asyncio.wait_for(hung_up.wait(), 60)  # the sidecar closed the connection after the cap
    assert deliveries == [1]


async def test_push_url_changes_apply_without_a_restart_and_remote_urls_are_refused(
    store: Store, aiohttp_server: Any, aiohttp_client: Any
) -> None:
    pushed = asyncio.Event()
    values: list[Any] = []

    async def events(request: web.Request) -> web.StreamResponse:
        values.append((await request.json())["data"])
        pushed.set()
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", events)
    server = await aiohttp_server(target)
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    spec = SubscriberSpec(queue=QUEUE, start_position="earliest")
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec)
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1)
    client = await aiohttp_client(create_app(settings, Settings(), store))

    async def ready() -> bool:
        return (await client.get("/readyz")).status == 200

    await _until(ready)
    # A remote URL is refused (and said so in readiness); the app can still pull.
    remote = "http://192.0.2.1:8080/events"
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec.model_copy(update={"push_url": remote}))

    async def refused() -> bool:
        return "not on the pod's loopback" in (await _readyz_checks(client)).get(f"push/{SUBSCRIBER}", "")

    await _until(refused)
    assert (await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": "pulled"})).status == 200
    got = await (await client.post(f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}/receive",
                                   json={"max": 1, "wait": 10})).json()
    assert [m["data"] for m in got["messages"]] == ["pulled"]
    acked = await client.post(f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}/ack",
                              json={"receipt": got["messages"][0]["receipt"]})
    assert acked.status == 200

    # Pointing the Subscriber at the app starts pushing, with no restart.
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec.model_copy(
        update={"push_url": str(server.make_url("/events"))}))

    async def accepted() -> bool:
        return f"push/{SUBSCRIBER}" not in await _readyz_checks(client)

    await _until(accepted)
    assert (await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": "pushed"})).status == 200
    await asyncio.wait_for(pushed.wait(), 60)
    assert values == ["pushed"]


async def test_a_push_the_app_took_is_not_pushed_again_when_its_ack_write_fails_for_a_while(
    store: Store, aiohttp_server: Any, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app answered 2xx; the ack's row write then failed twice (a backend hiccup). The ack
    is sent again until it is recorded; before, the failure became a nack and the app was
    handed the message a second time."""
    pushed: list[int] = []
    acked = asyncio.Event()

    async def app_endpoint(request: web.Request) -> web.StreamResponse:
        event = await request.json()
        pushed.append(event["deliverycount"])
        return web.Response(status=204)

    target = web.Application()
    target.router.add_post("/events", app_endpoint)
    server = await aiohttp_server(target)
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", push_url=str(server.make_url("/events")),
        visibility_timeout_seconds=30))
    written = AckLog._write
    failures = [BackendUnavailable("Cassandra: WriteTimeout: injected")] * 2

    async def flaky(self: AckLog, events: list[AckEvent]) -> None:
        if any(e.outcome == ACK for e in events):
            if failures:
                raise failures.pop()
            await written(self, events)
            acked.set()
            return
        await written(self, events)

    monkeypatch.setattr(AckLog, "_write", flaky)
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=1, push_concurrency=1,
                               push_backoff_seconds=0.05, push_max_backoff_seconds=0.3)
    client = await aiohttp_client(create_app(settings, Settings(), store))
    answer = await client.post(f"/v1/queues/{QUEUE}/messages", json={"data": "once"})
    assert answer.status == 200
    await asyncio.wait_for(acked.wait(), 60)
    assert not failures and pushed == [1]
    stats = await (await client.get(f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}/stats")).json()
    assert stats["inFlight"] == 0
