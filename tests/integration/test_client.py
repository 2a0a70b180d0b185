"""The Python client (sync and async, and subscribe()) against a sidecar on the real stack, retries included."""

from __future__ import annotations

import asyncio
import json
import socket
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from casque.config import Settings
from casque.engine import catalog
from casque.schema import QueueRef
from casque.sidecar.app import create_app
from casque.sidecar.config import SidecarSettings
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import (
    ApiError,
    AsyncClient,
    Client,
    Message,
    Outputs,
    RetryPolicy,
    SidecarUnreachable,
    message,
    subscribe,
)

QUEUE = "mail"
SUBSCRIBER = "sender"
REF = QueueRef("default", QUEUE)
FAST = RetryPolicy(attempts=4, backoff=0.01, max_backoff=0.05)


@pytest.fixture
async def sidecar_url(store: Store, aiohttp_server: Any) -> str:
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE",
                                              max_message_bytes=2048))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(queue=QUEUE, start_position="earliest"))
    settings = SidecarSettings(queue=QUEUE, subscribers=[SUBSCRIBER], drain_seconds=0.5)
    server = await aiohttp_server(create_app(settings, Settings(), store))
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            async with http.get(f"{url}/readyz") as answer:
                if answer.status == 200:
                    return url
            await asyncio.sleep(0.05)
    raise AssertionError("sidecar not ready")


async def test_async_client_covers_the_api(sidecar_url: str) -> None:
    async with AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
        one = await client.publish({"to": "ada@example.org"}, key="ada", attributes={"kind": "welcome"},
                                   type="com.example.mail")
        raw = await client.publish(payload=b"\x00\x01binary")
        text = await client.publish("hello", content_type="text/plain")
        batch = await client.publish_batch([message(i) for i in range(5)])
        assert len(batch) == 5 and not any(r.duplicate for r in [one, raw, text, *batch])

        got = []
        while len(got) < 8:
            got.extend(await client.receive(max=10, wait=5))
        by_id = {m.message_id: m for m in got}
        assert by_id[one.message_id].data == {"to": "ada@example.org"}
        assert by_id[one.message_id].key == "ada" and by_id[one.message_id].type == "com.example.mail"
        assert by_id[one.message_id].attributes == {"kind": "welcome"}
        assert by_id[raw.message_id].payload == b"\x00\x01binary"
        assert by_id[text.message_id].data == "hello" and by_id[text.message_id].payload == b"hello"
        assert all(m.delivery_count == 1 for m in got)

        first, second, *rest = got
        assert await client.ack(first.receipt) == "acked"
        assert await client.ack(first.receipt) == "already_acked"
        later = await client.extend(second.receipt, 600)
        assert later > second.visible_until
        await client.nack(second.receipt)
        outcomes = await client.ack_batch([m.receipt for m in rest] + [second.receipt])
        assert [o.ok for o in outcomes] == [True] * len(rest) + [False]
        assert outcomes[-1].error_code == "stale_receipt"
        (again,) = await client.receive(max=1, wait=5)
        assert again.id == second.id and again.delivery_count == 2
        assert [o.status for o in await client.nack_batch([again.receipt], delay=3600)] == ["nacked"]

        stats = await client.subscriber_stats()
        assert stats["subscriber"] == SUBSCRIBER and stats["lagBatches"] >= 1
        assert (await client.queue_stats())["publishedMessages"] == 8
        offsets = await client.seek(time=datetime.now(timezone.utc))
        assert set(offsets) == {0, 1}
        assert set(await client.seek("earliest")) == {0, 1}
        assert set(await client.seek(batches={0: 1})) == {0}

        with pytest.raises(ApiError) as refused:
            await client.publish("x" * 5000)
        assert refused.value.code == "message_too_large" and refused.value.status == 413
        with pytest.raises(ApiError) as missing:
            await client.queue_stats(queue="nope")
        assert missing.value.code == "queue_not_found"


async def test_sync_client_covers_the_api(sidecar_url: str) -> None:
    def session() -> tuple[list[str], dict[str, Any]]:
        with Client(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
            published = [client.publish({"n": i}).message_id for i in range(3)]
            published += [r.message_id for r in client.publish_batch([message("a"), message("b")])]
            received: list[str] = []
            while len(received) < 5:
                messages = client.receive(max=10, wait=5)
                for m in messages:
                    client.ack(m.receipt)
                received.extend(m.message_id for m in messages)
            assert sorted(received) == sorted(published)
            with pytest.raises(ApiError) as stale:
                client.nack("AAAAAQAAAAAAAAABAAAAACnit9BDrPMR")
            assert stale.value.code == "stale_receipt"
            history = client.message_history(published[0])
            # The client numbers what it publishes: the history names its producer and the number.
            assert (history["messageId"], history["producerSeq"]) == (published[0], 0) and history["producerId"]
            assert [(s["subscriber"], s["state"]) for s in history["subscribers"]] == [(SUBSCRIBER, "acked")]
            return published, client.queue_stats()

    published, stats = await asyncio.to_thread(session)
    assert stats["publishedMessages"] == len(published) == 5


async def test_a_retried_publish_after_a_lost_answer_is_written_once(sidecar_url: str, aiohttp_server: Any) -> None:
    """A proxy forwards the first publish but answers 503, as if the reply had been lost."""
    forwarded: list[tuple[dict[str, Any], int]] = []

    async def lossy(request: web.Request) -> web.Response:
        body = await request.json()
        async with aiohttp.ClientSession() as http:
            async with http.post(sidecar_url + request.path, json=body) as answer:
                result = await answer.json()
        forwarded.append((body, answer.status))
        if len(forwarded) == 1:
            return web.json_response({"error": {"code": "backend_unavailable", "message": "lost"}}, status=503,
                                     headers={"Retry-After": "0"})
        return web.json_response(result, status=answer.status)

    proxy = web.Application()
    proxy.router.add_post("/v1/queues/{queue}/messages", lossy)
    server = await aiohttp_server(proxy)
    async with AsyncClient(str(server.make_url("")), queue=QUEUE, retry=FAST) as client:
        result = await client.publish({"send": "once"})
    # The same key every time: the client's producer id and the message's number. (On a loaded
    # machine the sidecar itself may answer a forward 503 too: then the client sends it again.)
    assert len(forwarded) >= 2 and all("id" not in body for body, _ in forwarded)
    assert len({(body["producerid"], body["producerseq"]) for body, _ in forwarded}) == 1
    if forwarded[0][1] < 300:
        assert result.duplicate  # the lost answer's publish was written: the sidecar recognised the retry
    async with AsyncClient(sidecar_url, queue=QUEUE, retry=FAST) as client:
        assert (await client.queue_stats())["publishedMessages"] == 1


async def test_no_sidecar_means_retries_then_one_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    async with AsyncClient(f"http://127.0.0.1:{port}", queue=QUEUE, retry=FAST) as client:
        with pytest.raises(SidecarUnreachable):
            await client.publish(1)
    with pytest.raises(SidecarUnreachable):
        await asyncio.to_thread(Client(f"http://127.0.0.1:{port}", queue=QUEUE, retry=FAST).publish, 1)


# --- subscribe() ------------------------------------------------------------------------------


class CountingClient(AsyncClient):
    """Records how many messages each receive asked for."""

    asked: list[int]

    async def receive(self, max: int = 10, wait: float = 0.0, visibility: float | None = None, **where: Any) -> list[Message]:
        self.asked = [*getattr(self, "asked", []), max]
        return await super().receive(max, wait, visibility, **where)


async def test_subscribe_nacks_a_failing_handler_and_the_message_comes_back(sidecar_url: str) -> None:
    deliveries: list[tuple[str, int]] = []
    receipts: list[str] = []
    done = asyncio.Event()

    async def handle(m: Message) -> None:
        deliveries.append((m.data["order"], m.delivery_count))
        receipts.append(m.receipt)
        if m.delivery_count == 1:
            raise RuntimeError("payment service timed out")
        done.set()

    async with AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
        await client.publish({"order": "o-1"})
        stop = asyncio.Event()
        task = asyncio.create_task(subscribe(QUEUE, SUBSCRIBER, handle, client=client, wait=1, nack_delay=0, stop=stop))
        await asyncio.wait_for(done.wait(), 60)
        stop.set()
        await asyncio.wait_for(task, 60)
        assert deliveries == [("o-1", 1), ("o-1", 2)]
        # The second delivery was acked by subscribe(): nothing is left to hand out.
        assert await client.ack(receipts[1]) == "already_acked"
        assert await client.receive(max=10) == []


async def test_a_handler_that_returns_outputs_gets_them_published_with_its_ack_once(
    sidecar_url: str, store: Store
) -> None:
    receipts_queue = QueueRef("default", "receipts")
    catalog.apply_queue(store, receipts_queue, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    handled: list[Message] = []
    done = asyncio.Event()

    def outputs_of(m: Message) -> Outputs:
        return Outputs("receipts", [message({"for": m.data["order"], "copy": i}) for i in range(2)])

    async def handle(m: Message) -> Outputs:
        handled.append(m)
        done.set()
        return outputs_of(m)

    async with AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
        await client.publish({"order": "o-7"})
        stop = asyncio.Event()
        task = asyncio.create_task(subscribe(QUEUE, SUBSCRIBER, handle, client=client, wait=1, stop=stop))
        await asyncio.wait_for(done.wait(), 60)
        stop.set()
        await asyncio.wait_for(task, 60)
        (m,) = handled
        # The ack subscribe() sent, sent again with its outputs (an answer lost on the way):
        # acked before, and nothing published anew.
        assert await client.ack(m.receipt, outputs=outputs_of(m)) == "already_acked"
        assert await client.receive(max=10) == []
    stored = [json.loads(row.payload) for row in store.session.execute(
        f"SELECT seq, payload FROM {store.table(receipts_queue)}") if row.seq >= 0]
    assert sorted(s["copy"] for s in stored) == [0, 1] and all(s["for"] == "o-7" for s in stored)


async def test_subscribe_extends_a_slow_handler_past_its_visibility_timeout(sidecar_url: str) -> None:
    """A handler that outlives its delivery's visibility (1 s) keeps the message: a competing
    receive on the same subscriber gets nothing meanwhile, and the ack at the end is taken."""
    competitor_got: list[Message] = []
    handled: list[Message] = []
    finished = asyncio.Event()

    async with AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client, \
            AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as competitor:

        async def slow(m: Message) -> None:
            handled.append(m)
            # Outlive the first deadline by a clear margin, receiving as a competitor all along:
            # without extends the message would be visible again, and handed to it.
            past = m.visible_until + timedelta(seconds=1.5)
            while datetime.now(timezone.utc) < past:
                competitor_got.extend(await competitor.receive(max=10, wait=0.3))
            finished.set()

        await client.publish({"order": "slow"})
        stop = asyncio.Event()
        task = asyncio.create_task(subscribe(QUEUE, SUBSCRIBER, slow, client=client, visibility=1, wait=1, stop=stop))
        await asyncio.wait_for(finished.wait(), 60)
        stop.set()  # the stop waits for the handler's ack
        await asyncio.wait_for(task, 60)
        assert [m.delivery_count for m in handled] == [1] and competitor_got == []
        # Still the current delivery when the handler finished: subscribe()'s ack was taken.
        assert await client.ack(handled[0].receipt) == "already_acked"


async def test_subscribe_runs_at_most_its_concurrency_of_handlers(sidecar_url: str) -> None:
    concurrency, total = 3, 12
    running, most = 0, 0
    seen: set[int] = set()
    full = asyncio.Event()
    release = asyncio.Event()
    everything = asyncio.Event()

    async def handle(m: Message) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        if running == concurrency:
            full.set()
        # The first handlers hold their slots until the limit is reached, so that an
        # over-eager subscribe would show more than `concurrency` running at once.
        await release.wait()
        running -= 1
        seen.add(m.data["n"])
        if len(seen) == total:
            everything.set()

    async with CountingClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
        await client.publish_batch([message({"n": n}) for n in range(total)])
        stop = asyncio.Event()
        task = asyncio.create_task(subscribe(QUEUE, SUBSCRIBER, handle, client=client, concurrency=concurrency,
                                             wait=1, stop=stop))
        await asyncio.wait_for(full.wait(), 60)
        release.set()
        await asyncio.wait_for(everything.wait(), 60)
        stop.set()
        await asyncio.wait_for(task, 60)
        # Every message was acked: none is left to receive.
        assert await client.receive(max=100) == []
    assert most == concurrency and seen == set(range(total))
    # No receive asked for more messages than there were free handler slots.
    assert all(1 <= asked <= concurrency for asked in client.asked[:-1])


# --- tracing ----------------------------------------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE"


async def test_the_trace_context_given_on_publish_comes_back_on_receive_and_subscribe_continues_it(
    sidecar_url: str,
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    async with AsyncClient(sidecar_url, queue=QUEUE, subscriber=SUBSCRIBER, retry=FAST) as client:
        await client.publish({"n": 1}, key="k", traceparent=TRACEPARENT, tracestate=TRACESTATE)
        await client.publish_batch([message({"n": 2}, key="k", traceparent=TRACEPARENT), message({"n": 3}, key="k")])
        got: list[Message] = []
        while len(got) < 3:
            got.extend(await client.receive(max=10, wait=5))
        by_n = {m.data["n"]: m for m in got}
        assert (by_n[1].traceparent, by_n[1].tracestate) == (TRACEPARENT, TRACESTATE)
        assert by_n[1].event["traceparent"] == TRACEPARENT and by_n[1].event["tracestate"] == TRACESTATE
        assert (by_n[2].traceparent, by_n[2].tracestate) == (TRACEPARENT, None)
        assert by_n[3].traceparent is None  # none given, none made up: this sidecar does not trace
        # Handed back, so that subscribe() gets them again, and runs each in a span of its trace.
        await client.nack_batch([m.receipt for m in got], delay=0)

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        stop = asyncio.Event()
        handled: list[int] = []

        async def handle(received: Message) -> None:
            handled.append(received.data["n"])
            if len(handled) == 3:
                stop.set()

        await asyncio.wait_for(subscribe(QUEUE, SUBSCRIBER, handle, client=client, wait=1, stop=stop,
                                         tracer_provider=provider), 60)
    spans = {span.attributes["messaging.message.id"]: span for span in exporter.get_finished_spans()}
    assert len(spans) == 3
    traced = {by_n[n].id for n in (1, 2)}
    for message_id, span in spans.items():
        continued = span.parent is not None and format(span.context.trace_id, "032x") == TRACE_ID
        assert continued == (message_id in traced), message_id
