"""Trace context from publish to receive and push, CloudEvents conformance with the SDK, and
JSON logs with request ids, on the real Cassandra and ZooKeeper of the session."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from cloudevents.v1.conversion import to_binary, to_json, to_structured
from cloudevents.v1.http import CloudEvent, from_http, from_json
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from casque.config import Settings
from casque.engine import catalog
from casque.schema import QueueRef
from casque.sidecar.app import create_app
from casque.sidecar.config import SidecarSettings
from casque.sidecar.tracing import Tracing
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.sidecars import StartSidecar

QUEUE = "traced"
PULL = "billing"
PUSH = "hook"
REF = QueueRef("default", QUEUE)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
Client = TestClient[web.Request, web.Application]


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


async def until(condition: Callable[[], Awaitable[bool]], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


class PushTarget:
    """An app endpoint that records each push's headers and event."""

    def __init__(self) -> None:
        self.pushes: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.pushes.append((dict(request.headers), await request.read()))
        self.arrived.set()
        return web.Response(status=204)


async def sidecars(store: Store, aiohttp_client: Any, aiohttp_server: Any,
                   tracing: Tracing | None) -> tuple[Client, Client, PushTarget]:
    """A publishing sidecar, and a consuming one that pulls for PULL and pushes for PUSH."""
    target = PushTarget()
    app = web.Application()
    app.router.add_post("/events", target.handle)
    server = await aiohttp_server(app)
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, PULL, SubscriberSpec(queue=QUEUE, start_position="earliest"))
    catalog.apply_subscriber(store, REF, PUSH, SubscriberSpec(queue=QUEUE, start_position="earliest",
                                                             push_url=str(server.make_url("/events"))))
    publisher: Client = await aiohttp_client(create_app(SidecarSettings(drain_seconds=0.5), Settings(), store,
                                                        tracing=tracing))
    consumer: Client = await aiohttp_client(create_app(
        SidecarSettings(queue=QUEUE, subscribers=[PULL, PUSH], drain_seconds=0.5), Settings(), store,
        tracing=tracing))

    async def ready() -> bool:
        return all([(await c.get("/readyz")).status == 200 for c in (publisher, consumer)])

    await until(ready)
    return publisher, consumer, target


def in_memory_tracing() -> tuple[InMemorySpanExporter, Tracing]:
    """Sidecar tracing whose spans are kept in memory, for the test to read."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Tracing(provider)


async def receive_one(client: Client) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = await client.post(f"/v1/queues/{QUEUE}/subscribers/{PULL}/receive", json={"max": 1, "wait": 1})
        assert answer.status == 200, await answer.text()
        messages = (await answer.json())["messages"]
        if messages:
            assert len(messages) == 1, messages
            settled = await client.post(f"/v1/queues/{QUEUE}/subscribers/{PULL}/ack",
                                        json={"receipt": messages[0]["receipt"]},
                                        headers={k: v for k, v in messages[0].items() if k == "traceparent"})
            assert settled.status == 200, await settled.text()
            return dict(messages[0])
    raise AssertionError("nothing received")


async def test_the_publishers_trace_context_comes_back_on_receive_and_push(
    store: Store, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    publisher, consumer, target = await sidecars(store, aiohttp_client, aiohttp_server, tracing=None)
    answer = await publisher.post(f"/v1/queues/{QUEUE}/messages", json={"data": {"n": 1}},
                                  headers={"traceparent": TRACEPARENT, "tracestate": "shop=7"})
    assert answer.status == 200, await answer.text()

    received = await receive_one(consumer)
    assert (received["traceparent"], received["tracestate"]) == (TRACEPARENT, "shop=7")
    await asyncio.wait_for(target.arrived.wait(), 60)
    headers, body = target.pushes[0]
    # Without tracing the sidecar adds no span: the app continues the publisher's own context.
    assert headers["traceparent"] == TRACEPARENT and headers["tracestate"] == "shop=7"
    assert json.loads(body)["traceparent"] == TRACEPARENT


async def test_with_an_exporter_the_sidecars_spans_join_the_publishers_trace(
    store: Store, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    exporter, tracing = in_memory_tracing()
    publisher, consumer, target = await sidecars(store, aiohttp_client, aiohttp_server, tracing=tracing)

    # The trace context as an event attribute (structured mode), not a header this time.
    answer = await publisher.post(f"/v1/queues/{QUEUE}/messages", json={"data": 1, "traceparent": TRACEPARENT})
    assert answer.status == 200, await answer.text()
    untraced = await publisher.post(f"/v1/queues/{QUEUE}/messages/batch", json={"messages": [{"data": 2}]})
    assert untraced.status == 200

    got = [await receive_one(consumer), await receive_one(consumer)]
    by_data = {m["data"]: m for m in got}
    assert by_data[1]["traceparent"] == TRACEPARENT  # the producer's own context is kept as it came
    # A message published without one carries the publish span's: consumers continue that trace.
    started_here = trace_id(by_data[2]["traceparent"])
    assert started_here != TRACE_ID

    expected = {f"publish {QUEUE}", f"push {QUEUE}/{PUSH}", f"ack {QUEUE}/{PULL}"}

    def in_trace() -> set[str]:
        return {s.name for s in exporter.get_finished_spans()
                if s.context is not None and f"{s.context.trace_id:032x}" == TRACE_ID}

    async def both_pushed_and_their_spans_ended() -> bool:
        # The app has the push before the pusher reads its answer and ends the push's span.
        return len(target.pushes) >= 2 and expected <= in_trace()

    await until(both_pushed_and_their_spans_ended)
    pushed = {json.loads(body)["data"]: headers for headers, body in target.pushes}
    assert trace_id(pushed[1]["traceparent"]) == TRACE_ID and pushed[1]["traceparent"] != TRACEPARENT
    assert trace_id(pushed[2]["traceparent"]) == started_here

    spans: list[ReadableSpan] = list(exporter.get_finished_spans())
    push_span = next(s for s in spans if s.name == f"push {QUEUE}/{PUSH}" and s.context is not None
                     and f"{s.context.trace_id:032x}" == TRACE_ID)
    assert push_span.context is not None and pushed[1]["traceparent"].split("-")[2] == f"{push_span.context.span_id:016x}"
    receives = [s for s in spans if s.name == f"receive {QUEUE}/{PULL}"]
    linked = {f"{link.context.trace_id:032x}" for s in receives for link in s.links}
    assert {TRACE_ID, started_here} <= linked  # each receive links the trace of what it handed out


async def test_every_settlement_is_a_span_of_the_message_trace(
    store: Store, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    exporter, tracing = in_memory_tracing()
    publisher, consumer, _ = await sidecars(store, aiohttp_client, aiohttp_server, tracing=tracing)
    answer = await publisher.post(f"/v1/queues/{QUEUE}/messages", json={"data": 1, "traceparent": TRACEPARENT})
    assert answer.status == 200, await answer.text()
    subscriber = f"/v1/queues/{QUEUE}/subscribers/{PULL}"
    # The app settles in the message's trace: it sends the message's traceparent along.
    for operation, body in (("extend", {"visibility": 60}), ("nack", {})):
        message = None
        while message is None:
            got = await consumer.post(f"{subscriber}/receive", json={"max": 1, "wait": 1})
            assert got.status == 200, await got.text()
            message = next(iter((await got.json())["messages"]), None)
        settled = await consumer.post(f"{subscriber}/{operation}", json={"receipt": message["receipt"], **body},
                                      headers={"traceparent": message["traceparent"]})
        assert settled.status == 200, await settled.text()
    await receive_one(consumer)  # redelivered after the nack, and acked

    spans = [s for s in exporter.get_finished_spans()
             if s.context is not None and f"{s.context.trace_id:032x}" == TRACE_ID]
    settles = {s.name: s for s in spans if s.attributes and s.attributes.get("messaging.operation.type") == "settle"}
    assert set(settles) == {f"{op} {QUEUE}/{PULL}" for op in ("extend", "nack", "ack")}, settles
    for name, span in settles.items():
        assert span.attributes is not None
        assert span.attributes["messaging.operation.name"] == name.split()[0]
        assert span.attributes["messaging.batch.message_count"] == 1
        assert span.parent is not None and f"{span.parent.span_id:016x}" == TRACEPARENT.split("-")[2]


async def test_cloudevents_sdk_events_in_every_mode_are_accepted_and_received_events_parse(
    store: Store, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    publisher, consumer, target = await sidecars(store, aiohttp_client, aiohttp_server, tracing=None)
    path = f"/v1/queues/{QUEUE}/messages"

    def event(n: int, **attributes: str) -> CloudEvent:
        return CloudEvent({"type": "com.example.n", "source": "/producer", "id": f"e{n}",
                           "datacontenttype": "application/json", **attributes}, {"n": n})

    headers, body = to_structured(event(1, subject="one", traceparent=TRACEPARENT))
    structured = await publisher.post(path, data=body, headers=headers)
    assert structured.status == 200, await structured.text()
    headers, body = to_binary(event(2, partitionkey="k2"))
    binary = await publisher.post(path, data=body, headers=headers)
    assert binary.status == 200, await binary.text()
    batch_body = b"[" + b",".join(to_json(event(n)) for n in (3, 4)) + b"]"
    batch = await publisher.post(path, data=batch_body, headers={"Content-Type": "application/cloudevents-batch+json"})
    assert batch.status == 200, await batch.text()
    results = (await batch.json())["results"]
    assert len(results) == 2 and not any(r["duplicate"] for r in results)

    # (source, id) names an event: the same pair again is a duplicate, the same id from
    # another source is a new event.
    headers, body = to_binary(event(2, partitionkey="k2"))
    again = await (await publisher.post(path, data=body, headers=headers)).json()
    assert again["duplicate"] and again["messageId"] == (await binary.json())["messageId"]
    headers, body = to_structured(event(1, source="/elsewhere"))
    other = await (await publisher.post(path, data=body, headers=headers)).json()
    assert not other["duplicate"]

    received = [await receive_one(consumer) for _ in range(5)]
    parsed = [from_json(json.dumps(m)) for m in received]
    by_key = {(e["source"], e["id"]): (e, m) for e, m in zip(parsed, received)}
    assert set(by_key) == {("/producer", "e1"), ("/producer", "e2"), ("/producer", "e3"), ("/producer", "e4"),
                           ("/elsewhere", "e1")}
    for (source, event_id), (parsed_event, raw) in by_key.items():
        assert parsed_event.data == {"n": int(event_id[1:])} and parsed_event["type"] == "com.example.n"
        assert raw["messageid"] and raw["messageid"] != event_id  # casque's own id, in its own field
    first = by_key[("/producer", "e1")][0]
    assert first["subject"] == "one" and first["traceparent"] == TRACEPARENT
    assert by_key[("/producer", "e2")][1]["partitionkey"] == "k2"

    async def all_pushed() -> bool:
        return len({json.loads(body)["messageid"] for _, body in target.pushes}) >= 5

    await until(all_pushed)
    for headers, body in target.pushes:
        pushed = from_http(headers, body)
        assert pushed["source"] in ("/producer", "/elsewhere") and pushed.data is not None


def test_a_sidecar_with_json_logs_names_each_request_in_every_line(
    store: Store, start_sidecar: StartSidecar
) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    sidecar = start_sidecar("--access-log", env={"CASQUE_LOG_FORMAT": "json"})

    def post(path: str, body: bytes, request_id: str | None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        request = urllib.request.Request(f"{sidecar.url}{path}", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.headers["X-Request-Id"]
        except urllib.error.HTTPError as error:
            return error.code, error.headers["X-Request-Id"]

    status, echoed = post(f"/v1/queues/{QUEUE}/messages", b'{"data": 1}', "req-ok-42")
    assert (status, echoed) == (200, "req-ok-42")
    status, refused = post("/v1/queues/no-such-queue/messages", b'{"data": 1}', "req-bad-43")
    assert (status, refused) == (404, "req-bad-43")
    status, generated = post(f"/v1/queues/{QUEUE}/messages", b'{"data": 2}', None)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", generated)  # none given: the sidecar makes one

    def logged() -> list[dict[str, Any]]:
        # Every line must parse: a JSON log with one plain line in it breaks a collector.
        return [json.loads(line) for line in sidecar.log.read_text().splitlines() if line.strip()]

    deadline = time.monotonic() + 30
    while not {"req-ok-42", "req-bad-43", generated} <= {line.get("request_id") for line in logged()}:
        assert time.monotonic() < deadline, sidecar.tail()
        time.sleep(0.05)
    lines = logged()
    access = {line["request_id"]: line for line in lines if line["logger"] == "casque.sidecar.access"}
    assert access["req-ok-42"]["status"] == 200 and access["req-ok-42"]["path"] == f"/v1/queues/{QUEUE}/messages"
    assert access["req-bad-43"]["status"] == 404 and access[generated]["status"] == 200
    assert any(line["message"].startswith("casque sidecar listening on") for line in lines)

