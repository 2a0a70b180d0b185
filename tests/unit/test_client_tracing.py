"""The client's part of tracing: publish carries a W3C trace context in the message, and
subscribe() runs each handler in a span that continues its message's trace.

Against a stand-in sidecar that records what it is sent, and an in-memory span exporter; the
round trip through a real sidecar is in tests/integration/test_client.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from casque_client import AsyncClient, Client, Message, message, subscribe
from casque_client import tracing as client_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
PUBLISHED = {"messageId": "m", "shard": 0, "batch": 1, "seq": 0, "duplicate": False}


class RecordingSidecar:
    """Answers every publish as written, and keeps each request body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                sidecar.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                batch = self.path.endswith("/batch")
                body = json.dumps({"results": [PUBLISHED] * len(sidecar.bodies[-1]["messages"])} if batch
                                  else PUBLISHED).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sidecar() -> Iterator[RecordingSidecar]:
    stand_in = RecordingSidecar()
    yield stand_in
    stand_in.close()


def test_message_carries_the_trace_context_only_when_given() -> None:
    body = message({"n": 1}, traceparent=TRACEPARENT, tracestate=TRACESTATE)
    assert body["traceparent"] == TRACEPARENT and body["tracestate"] == TRACESTATE
    assert "traceparent" not in message({"n": 1}) and "tracestate" not in message({"n": 1})


def test_publish_sends_the_trace_context_in_the_message(sidecar: RecordingSidecar) -> None:
    with Client(sidecar.url, queue="orders") as client:
        client.publish({"n": 1}, traceparent=TRACEPARENT, tracestate=TRACESTATE)
        client.publish_batch([message({"n": 2}, traceparent=TRACEPARENT), message({"n": 3})])
    single, batch = sidecar.bodies
    assert (single["traceparent"], single["tracestate"]) == (TRACEPARENT, TRACESTATE)
    assert batch["messages"][0]["traceparent"] == TRACEPARENT and "traceparent" not in batch["messages"][1]


async def test_the_async_client_sends_it_too(sidecar: RecordingSidecar) -> None:
    async with AsyncClient(sidecar.url, queue="orders") as client:
        await client.publish({"n": 1}, traceparent=TRACEPARENT, tracestate=TRACESTATE)
    assert (sidecar.bodies[0]["traceparent"], sidecar.bodies[0]["tracestate"]) == (TRACEPARENT, TRACESTATE)


def test_a_received_message_exposes_its_trace_context() -> None:
    received = delivery(1, traceparent=TRACEPARENT, tracestate=TRACESTATE)
    assert (received.traceparent, received.tracestate) == (TRACEPARENT, TRACESTATE)
    assert delivery(2).traceparent is None and delivery(2).tracestate is None


# --- subscribe(): a span per handler ----------------------------------------------------------


def delivery(n: int, **trace: str) -> Message:
    now = datetime.now(timezone.utc)
    return Message.of({
        "id": f"m{n}", "receipt": f"r{n}", "deliverycount": 1, "data": {"n": n}, "type": "t", "source": "/s",
        "time": now.isoformat(), "shard": 1, "batch": 1, "seq": n,
        "visibleuntil": (now + timedelta(seconds=30)).isoformat(), **trace,
    })


class OneShotClient:
    """Hands out the given messages once, then long-polls until cancelled; records settles."""

    queue = "orders"
    subscriber = "billing"

    def __init__(self, messages: list[Message]) -> None:
        self.pending = list(messages)
        self.settled: list[str] = []
        self.all_settled = asyncio.Event()
        self.total = len(messages)

    async def receive(self, max: int, *_: Any, **__: Any) -> list[Message]:
        if not self.pending:
            await asyncio.Event().wait()
        taken, self.pending = self.pending[:max], self.pending[max:]
        return taken

    def _settle(self, receipt: str) -> None:
        self.settled.append(receipt)
        if len(self.settled) == self.total:
            self.all_settled.set()

    async def ack(self, receipt: str, **_: Any) -> str:
        self._settle(receipt)
        return "acked"

    async def nack(self, receipt: str, *_: Any, **__: Any) -> None:
        self._settle(receipt)

    async def extend(self, receipt: str, visibility: float, **_: Any) -> datetime:
        return datetime.now(timezone.utc) + timedelta(seconds=visibility)


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def consume(messages: list[Message], handler: Any, provider: TracerProvider) -> OneShotClient:
    client = OneShotClient(messages)
    stop = asyncio.Event()
    task = asyncio.create_task(subscribe(None, None, handler, client=client, stop=stop,  # type: ignore[arg-type]
                                         tracer_provider=provider))
    await asyncio.wait_for(client.all_settled.wait(), 30)
    stop.set()
    await task
    return client


async def test_each_handler_runs_in_a_consumer_span_that_continues_its_messages_trace(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    from opentelemetry import trace

    provider, exporter = spans
    seen: dict[str, Any] = {}

    async def handle(received: Message) -> None:
        seen[received.id] = trace.get_current_span().get_span_context()
        if received.id == "m2":
            raise ValueError("card declined")

    await consume([delivery(1, traceparent=TRACEPARENT, tracestate=TRACESTATE),
                   delivery(2, traceparent=TRACEPARENT), delivery(3)], handle, provider)
    by_message = {span.attributes["messaging.message.id"]: span for span in exporter.get_finished_spans()}
    assert set(by_message) == {"m1", "m2", "m3"}
    for message_id in ("m1", "m2"):
        span = by_message[message_id]
        assert span.kind == SpanKind.CONSUMER and span.name == "process orders"
        assert format(span.context.trace_id, "032x") == TRACE_ID  # the producer's trace ...
        assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID  # ... continued
        assert seen[message_id] == span.context  # current while the handler ran
        assert span.attributes["messaging.destination.name"] == "orders"
        assert span.attributes["messaging.consumer.group.name"] == "billing"
    assert by_message["m1"].context.trace_state.get("congo") == "t61rcWkgMzE"
    assert by_message["m1"].status.status_code == StatusCode.UNSET
    assert by_message["m2"].status.status_code == StatusCode.ERROR  # the handler raised: recorded
    assert [e.name for e in by_message["m2"].events] == ["exception"]
    # A message without a trace context starts a trace of its own.
    assert by_message["m3"].parent is None and format(by_message["m3"].context.trace_id, "032x") != TRACE_ID


async def test_a_plain_function_handler_sees_its_span_in_its_thread(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    from opentelemetry import trace

    provider, exporter = spans
    seen = []
    await consume([delivery(1, traceparent=TRACEPARENT)],
                  lambda m: seen.append(trace.get_current_span().get_span_context()), provider)
    (span,) = exporter.get_finished_spans()
    assert seen == [span.context] and format(span.context.trace_id, "032x") == TRACE_ID


async def test_without_opentelemetry_the_handler_runs_without_a_span(
    monkeypatch: pytest.MonkeyPatch, spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    monkeypatch.setattr(client_tracing, "available", lambda: False)  # as when it is not installed
    ran = []
    client = await consume([delivery(1, traceparent=TRACEPARENT)], lambda m: ran.append(m.id), provider)
    assert ran == ["m1"] and client.settled == ["r1"]
    assert exporter.get_finished_spans() == ()


def test_the_client_package_imports_no_opentelemetry_until_a_handler_runs() -> None:
    """Importing casque_client must work in an app without OpenTelemetry."""
    import subprocess
    import sys

    code = ("import sys; import casque_client; "
            "assert not any(m.startswith('opentelemetry') for m in sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
