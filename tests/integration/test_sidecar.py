"""The sidecar's HTTP API on a real Cassandra and ZooKeeper: every operation and every error class."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import zlib
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import BaseRunner

from casque.config import Settings
from casque.engine import catalog, shard_reader
from casque.engine.batches import Claim, Log
from casque.engine.messages import OutgoingMessage
from casque.engine.pipelines import keyed_outputs
from casque.engine.idempotency import IdempotencyGuard
from casque.engine.publisher import Publisher
from casque.errors import WriteOutcomeUnknown
from casque.schema import QueueRef
from casque.sidecar.app import create_app, service_of
from casque.sidecar.config import SidecarSettings
from casque.sidecar.models.receipts import PipelineOutputs
from casque.specs import QueueSpec, RetryPolicy, SubscriberSpec
from casque.store import Store

QUEUE = "orders"
SUBSCRIBER = "billing"
REF = QueueRef("default", QUEUE)
BASE = f"/v1/queues/{QUEUE}"
SUB = f"{BASE}/subscribers/{SUBSCRIBER}"

Client = TestClient[web.Request, web.Application]
JSON = {"Content-Type": "application/json"}
MakeSidecar = Callable[..., Awaitable[Client]]


# How long a wait for the sidecar goes on before it fails: as tests/fixtures/group.until, for
# a machine loaded by other tests (a wait that succeeds ends as soon as its condition holds).
WAIT_LIMIT_S = 120.0


async def until(condition: Callable[[], Awaitable[bool]], limit_s: float = WAIT_LIMIT_S) -> None:
    """Wait for a condition, checking often; fail if it never holds."""
    deadline = time.monotonic() + limit_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def create_queue(store: Store, name: str = QUEUE, shards: int = 2, max_bytes: int = 4096,
                 subscribers: tuple[str, ...] = (SUBSCRIBER,), priorities: int = 1) -> None:
    ref = QueueRef("default", name)
    catalog.apply_queue(store, ref, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE",
                                              max_message_bytes=max_bytes, priorities=priorities))
    for subscriber in subscribers:
        catalog.apply_subscriber(store, ref, subscriber, SubscriberSpec(queue=name, start_position="earliest",
                                                                        visibility_timeout_seconds=30))


class ServedLikeTheSidecar(TestServer):
    """aiohttp's test server, but with handlers that run on when their client goes, as
    sidecar/server.py serves them (the test server cancels them, which hides what a real
    sidecar does then)."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


@pytest.fixture
def make_sidecar(store: Store, aiohttp_client: Any) -> MakeSidecar:
    async def make(subscribers: tuple[str, ...] = (SUBSCRIBER,), ready: bool = True, **options: Any) -> Client:
        options.setdefault("drain_seconds", 0.5)
        settings = SidecarSettings(queue=QUEUE, subscribers=list(subscribers), **options)
        client: Client = await aiohttp_client(ServedLikeTheSidecar(create_app(settings, Settings(), store)))
        if ready:
            async def is_ready() -> bool:
                return (await client.get("/readyz")).status == 200

            await until(is_ready)
        return client

    return make


async def call(client: Client, path: str, body: Any = None, status: int = 200, **kwargs: Any) -> Any:
    response = await (client.post(path, json=body, **kwargs) if body is not None or "data" in kwargs
                      else client.get(path, **kwargs))
    payload = await response.json()
    assert response.status == status, payload
    return payload


async def error_code(response: Any, status: int) -> str:
    payload = await response.json()
    assert response.status == status, payload
    assert set(payload) == {"error"} and payload["error"]["message"]
    return str(payload["error"]["code"])


async def receive_all(client: Client, count: int, ack: bool = True, limit_s: float = WAIT_LIMIT_S) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit_s
    while len(got) < count and time.monotonic() < deadline:
        messages = (await call(client, f"{SUB}/receive", {"max": 100, "wait": 1}))["messages"]
        if ack and messages:
            results = await call(client, f"{SUB}/ack", {"receipts": [m["receipt"] for m in messages]})
            assert all(r["status"] == "acked" for r in results["results"]), results
        got.extend(messages)
    return got


# --- operations ------------------------------------------------------------------------------------
async def test_publish_receive_ack_roundtrip_with_cloudevents_envelope(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store)
    client = await make_sidecar()
    published = await call(client, f"{BASE}/messages", {
        "data": {"order": 42}, "partitionkey": "customer-7", "attributes": {"region": "eu"},
        "type": "com.example.order.created", "source": "/shop", "subject": "order-42", "specversion": "1.0",
    })
    assert set(published) == {"messageId", "shard", "batch", "seq", "duplicate"} and not published["duplicate"]

    (message,) = await receive_all(client, 1, ack=False)
    assert message["specversion"] == "1.0"
    assert message["id"] == message["messageid"] == published["messageId"]  # no producer id: casque's
    assert (message["type"], message["source"], message["subject"]) == ("com.example.order.created", "/shop", "order-42")
    assert message["datacontenttype"] == "application/json" and message["data"] == {"order": 42}
    assert message["partitionkey"] == "customer-7" and message["attributes"] == {"region": "eu"}
    assert message["deliverycount"] == 1
    assert (message["shard"], message["batch"], message["seq"]) == (published["shard"], published["batch"], published["seq"])
    assert message["time"] and message["visibleuntil"] and message["receipt"]

    acked = await call(client, f"{SUB}/ack", {"receipt": message["receipt"]})
    assert acked == {"results": [{"receipt": message["receipt"], "status": "acked"}]}
    again = await call(client, f"{SUB}/ack", {"receipt": message["receipt"]})
    assert again["results"][0]["status"] == "already_acked"


async def test_text_binary_and_empty_payloads_come_back_as_sent(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    raw = bytes(range(256))
    bodies = [
        {"data": "plain words", "datacontenttype": "text/plain; charset=utf-8"},
        {"data_base64": base64.b64encode(raw).decode()},
        {"data_base64": base64.b64encode(b"\xff\xfe").decode(), "datacontenttype": "text/plain"},
        {"data": None},
        {},
    ]
    results = (await call(client, f"{BASE}/messages/batch", {"messages": bodies}))["results"]
    assert [r["seq"] for r in results] == [0, 1, 2, 3, 4]  # one batch, request order
    got = sorted(await receive_all(client, 5), key=lambda m: m["seq"])
    assert got[0]["data"] == "plain words"
    assert got[1]["datacontenttype"] == "application/octet-stream" and base64.b64decode(got[1]["data_base64"]) == raw
    assert "data" not in got[2] and base64.b64decode(got[2]["data_base64"]) == b"\xff\xfe"  # not the UTF-8 it claims
    assert "data" in got[3] and got[3]["data"] is None
    assert "data" not in got[4] and "data_base64" not in got[4]


async def test_publish_batch_is_all_or_nothing(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, max_bytes=1024)
    client = await make_sidecar()
    messages = [{"data": "small"}, {"data": "x" * 5000}, {"data": "small"}]
    response = await client.post(f"{BASE}/messages/batch", json={"messages": messages})
    assert await error_code(response, 413) == "message_too_large"
    assert "messages[1]" in (await response.json())["error"]["message"]
    stats = await call(client, f"{BASE}/stats")
    assert stats["publishedMessages"] == 0  # nothing of the refused batch was written
    ok = await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i} for i in range(10)]})
    assert len(ok["results"]) == 10


def keys_on_shards(shards: int, each: int) -> dict[int, list[str]]:
    """`each` message keys that go to each shard of a queue of `shards`."""
    found: dict[int, list[str]] = {shard: [] for shard in range(shards)}
    for n in range(10_000):
        key = f"customer-{n}"
        lane = found[zlib.crc32(key.encode()) % shards]
        if len(lane) < each:
            lane.append(key)
        if all(len(lane) == each for lane in found.values()):
            return found
    raise AssertionError("no keys for every shard")


async def test_a_batch_whose_second_shard_is_refused_says_what_was_written_and_its_rest_lands_once(
    store: Store, make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publishBatch of keyed messages without ids spans two shards; shard 1's write is
    certainly not applied. The answer is a 503 naming, message by message, what was written
    and what was not; sending again only what was not stores every message once, each key's
    messages in the order they were sent."""
    create_queue(store, shards=2)
    client = await make_sidecar()
    keys = keys_on_shards(2, 2)
    claim = Log.claim
    refused = 0

    async def shard_1_refused_once(log: Log, shard: int, *args: Any, **kwargs: Any) -> Claim:
        nonlocal refused
        if shard == 1 and not refused:
            refused += 1
            raise WriteOutcomeUnknown("timed out before reaching any replica")
        return await claim(log, shard, *args, **kwargs)

    monkeypatch.setattr(Log, "claim", shard_1_refused_once)
    # Key a (shard 0), key b (shard 1), each twice, interleaved.
    a, b = keys[0][0], keys[1][0]
    sent = [{"data": f"{key}-{n}", "partitionkey": key} for n in range(2) for key in (a, b)]
    response = await client.post(f"{BASE}/messages/batch", json={"messages": sent})
    answer = await response.json()
    assert response.status == 503 and response.headers["Retry-After"], answer
    assert answer["error"]["code"] == "partially_published"
    results = answer["results"]
    written = [i for i, r in enumerate(results) if r is not None]
    assert written == [0, 2] and {results[i]["shard"] for i in written} == {0}
    details = {d["field"]: d["code"] for d in answer["error"]["details"]}
    assert details == {"messages[1]": "backend_unavailable", "messages[3]": "backend_unavailable"}
    assert refused == 1

    retry = [sent[i] for i, r in enumerate(results) if r is None]
    again = (await call(client, f"{BASE}/messages/batch", {"messages": retry}))["results"]
    assert [r["shard"] for r in again] == [1, 1]
    got = await receive_all(client, 4)
    assert sorted(m["data"] for m in got) == sorted(m["data"] for m in sent)  # each once
    for key in (a, b):
        of_key = sorted((m for m in got if m["partitionkey"] == key), key=lambda m: (m["batch"], m["seq"]))
        assert [m["data"] for m in of_key] == [f"{key}-0", f"{key}-1"]
    assert (await call(client, f"{BASE}/stats"))["publishedMessages"] == 4


async def test_a_publish_with_a_known_id_is_written_once(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store)
    client = await make_sidecar()
    first = await call(client, f"{BASE}/messages", {"id": "order-42-created", "data": 1})
    second = await call(client, f"{BASE}/messages", {"id": "order-42-created", "data": 1})
    assert second["duplicate"] and second["messageId"] == first["messageId"]
    assert (await call(client, f"{BASE}/stats"))["publishedMessages"] == 1


@pytest.mark.parametrize(("body", "first_write"), [
    ({"id": "order-43-created"}, "record_intents"),
    ({"producerid": "till-4", "producerseq": 1}, "record_intents"),
    ({"id": "order-44-created", "delay": 3600}, "record_positions"),
], ids=["client id", "producer key", "delayed"])
async def test_a_retry_during_a_spec_change_waits_for_the_publish_of_its_id_under_way(
    store: Store, make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], first_write: str,
) -> None:
    """A spec change gives the sidecar a new publisher while the old one still writes. The
    first attempt is held before its id reaches Cassandra (only memory knows it); the client's
    retry of the same id arrives at the new publisher, which must wait for that attempt and
    answer its message as a duplicate, not publish it a second time."""
    create_queue(store, shards=1)
    client = await make_sidecar()
    held, resume = asyncio.Event(), asyncio.Event()
    write = getattr(IdempotencyGuard, first_write)

    async def first_held(guard: IdempotencyGuard, *args: Any, **kwargs: Any) -> Any:
        if not held.is_set():
            held.set()
            await resume.wait()
        return await write(guard, *args, **kwargs)

    monkeypatch.setattr(IdempotencyGuard, first_write, first_held)
    asked, retry_asked = 0, asyncio.Event()
    earlier_here = IdempotencyGuard.earlier_here

    def counted(guard: IdempotencyGuard, client_id: str) -> Any:
        nonlocal asked
        asked += 1
        if asked == 2:  # the retry's look at what this process has under way
            retry_asked.set()
        return earlier_here(guard, client_id)

    monkeypatch.setattr(IdempotencyGuard, "earlier_here", counted)
    service = service_of(client.app)
    before = await service.publisher(QUEUE)
    first = asyncio.create_task(call(client, f"{BASE}/messages", {**body, "data": 1}))
    await asyncio.wait_for(held.wait(), 30)
    create_queue(store, shards=1, max_bytes=8192)  # the spec change

    async def replaced() -> bool:
        return await service.publisher(QUEUE) is not before

    await until(replaced)
    retry = asyncio.create_task(call(client, f"{BASE}/messages", {**body, "data": 1}))
    await asyncio.wait_for(retry_asked.wait(), 30)
    resume.set()
    answers = await asyncio.gather(first, retry)
    assert [a["duplicate"] for a in answers] == [False, True], answers
    assert answers[0]["messageId"] == answers[1]["messageId"]
    stats = await call(client, f"{BASE}/stats")
    assert stats["publishedMessages"] + stats["delayed"] == 1, stats


async def test_delayed_and_prioritised_messages(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1, priorities=3)
    client = await make_sidecar()
    later = await call(client, f"{BASE}/messages", {"data": "in an hour", "delay": 3600})
    assert later["deliverAt"] and (later["shard"], later["batch"], later["seq"]) == (None, None, None)
    assert (await call(client, f"{BASE}/stats"))["delayed"] == 1
    soon = await call(client, f"{BASE}/messages", {"data": "soon", "delay": 1.5, "priority": 1})
    past = await call(client, f"{BASE}/messages", {"data": "overdue", "deliverAt": "2020-01-01T00:00:00Z"})
    urgent = await call(client, f"{BASE}/messages", {"data": "urgent", "priority": 2})
    # (A delay this short may go straight into the log: the engine treats due times near
    # its mover's cursor as due now.)
    assert past["shard"] is not None and urgent["shard"] is not None

    got = {m["data"]: m for m in await receive_all(client, 3)}  # the sidecar moves "soon" when due
    assert set(got) == {"soon", "overdue", "urgent"}
    assert (got["urgent"]["priority"], got["soon"]["priority"], got["overdue"]["priority"]) == (2, 1, 0)
    assert got["soon"]["messageid"] == soon["messageId"]  # the id given at publish survives the move
    stats = await call(client, f"{BASE}/stats")
    assert stats["delayed"] == 1 and set(stats["publishedByPriority"]) == {"0", "1", "2"}
    assert {s["priority"] for s in stats["shards"]} == {0, 1, 2}


async def test_the_sidecar_moves_delayed_messages_into_the_log_when_due(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    create_queue(store, shards=1)
    # Published before any mover ran on this queue, so it waits in the delayed table.
    state = catalog.read_queue(store, REF)
    publisher = Publisher(store, REF, state)
    due = datetime.now(timezone.utc) + timedelta(seconds=2)
    (waiting,) = await publisher.publish([OutgoingMessage(b'"later"', content_type="application/json",
                                                          deliver_at=due)])
    # Due at the whole millisecond its message id carries (Cassandra's precision), never before.
    assert waiting.deliver_at is not None and timedelta(0) <= waiting.deliver_at - due < timedelta(milliseconds=1)
    client = await make_sidecar()  # its mover is elected and moves the message when due
    (message,) = await receive_all(client, 1)
    assert message["messageid"] == waiting.message_id and message["data"] == "later"
    assert datetime.fromisoformat(message["time"].replace("Z", "+00:00")) >= due - timedelta(seconds=1)


async def test_long_poll_wakes_when_a_message_is_published(
    store: Store, make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slow recheck of a caught-up shard is out of reach: only the head watch can wake it.
    monkeypatch.setattr(shard_reader, "CAUGHT_UP_RECHECK_SECONDS", 3600.0)
    create_queue(store)
    client = await make_sidecar()
    consumer = service_of(client.app).subscriptions[SUBSCRIBER].consumer
    assert consumer is not None

    async def caught_up() -> bool:
        return len(consumer.readers) == 2 and all(r.caught_up for r in consumer.readers.values())

    async def receive_waits() -> bool:
        return consumer.waiting_receives == 1

    await until(caught_up)
    waiting = asyncio.create_task(call(client, f"{SUB}/receive", {"max": 5, "wait": 120}))
    await until(receive_waits)
    published = await call(client, f"{BASE}/messages", {"data": "wake up"})
    messages = (await waiting)["messages"]
    assert [m["messageid"] for m in messages] == [published["messageId"]]


async def test_a_long_poll_cut_by_its_client_strands_nothing_published_after(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    """A receive whose client went away (a timeout, a restart) takes nothing for it: what
    it took is handed back at once, so the next receive gets every message, first delivery."""
    create_queue(store, shards=1)
    client = await make_sidecar()
    consumer = service_of(client.app).subscriptions[SUBSCRIBER].consumer
    assert consumer is not None

    async def receive_waits() -> bool:
        return consumer.waiting_receives == 1

    cut = asyncio.create_task(client.post(f"{SUB}/receive", json={"max": 10, "wait": 20}))
    await until(receive_waits)
    cut.cancel()  # the client gives up: its connection is closed under the waiting receive
    await asyncio.gather(cut, return_exceptions=True)
    published = await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i} for i in range(5)]})
    messages = await receive_all(client, 5)
    assert sorted(m["messageid"] for m in messages) == sorted(r["messageId"] for r in published["results"])
    assert [m["deliverycount"] for m in messages] == [1] * 5


async def test_receive_respects_max_and_takes_an_empty_body(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i} for i in range(7)]})
    await until(lambda: _ready_count(client, 7))
    first = (await call(client, f"{SUB}/receive", {"max": 3}))["messages"]
    assert len(first) == 3
    response = await client.post(f"{SUB}/receive")  # no body: defaults (max 10, no wait)
    assert response.status == 200
    assert len((await response.json())["messages"]) == 4


async def _ready_count(client: Client, expected: int) -> bool:
    stats = await call(client, f"{SUB}/stats")
    return bool(stats["lagMessages"] == expected)


async def receive_of(client: Client, subscriber: str, count: int, limit_s: float = WAIT_LIMIT_S) -> list[dict[str, Any]]:
    """Receive and ack `count` messages of `subscriber`, then make sure no more come."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit_s
    path = f"{BASE}/subscribers/{subscriber}"
    while len(got) < count and time.monotonic() < deadline:
        messages = (await call(client, f"{path}/receive", {"max": 100, "wait": 1}))["messages"]
        if messages:
            await call(client, f"{path}/ack", {"receipts": [m["receipt"] for m in messages]})
        got.extend(messages)
    assert (await call(client, f"{path}/receive", {"max": 100, "wait": 0.5}))["messages"] == []
    return got


async def filtered_count(client: Client, subscriber: str, expected: int) -> None:
    """Wait until the subscriber's stats count `expected` filtered messages and no lag (the
    count is written in the background, after the messages were passed over), receiving as a
    live app would meanwhile, and getting nothing: a message is passed over when a receive
    reaches it (docs/filters.md), and in shared delivery a range claimed after the last
    receive answered waited, with its lag, for a receive that never came."""
    async def counted() -> bool:
        path = f"{BASE}/subscribers/{subscriber}"
        assert (await call(client, f"{path}/receive", {"max": 100, "wait": 0.2}))["messages"] == []
        stats = await call(client, f"{BASE}/subscribers/{subscriber}/stats")
        assert stats["filtered"] <= expected, stats
        return bool(stats["filtered"] == expected and stats["lagMessages"] == 0)

    await until(counted)


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_two_subscribers_of_one_queue_get_what_their_filters_match_and_count_the_rest(
    store: Store, make_sidecar: MakeSidecar, delivery: str
) -> None:
    create_queue(store, shards=2, subscribers=(), priorities=2)
    filters = {"eu": 'has(attributes.region) && attributes.region == "eu"',
               "urgent-orders": 'priority > 0 && eventType.startsWith("order.")'}
    for name, expression in filters.items():
        catalog.apply_subscriber(store, REF, name, SubscriberSpec(
            queue=QUEUE, start_position="earliest", delivery=delivery, message_filter=expression,
            ordered_keys=delivery == "leased"))
    client = await make_sidecar(subscribers=tuple(filters))
    wanted: dict[str, set[str]] = {name: set() for name in filters}
    for n in range(40):
        region = ("eu", "us", None, "eu")[n % 4]
        body: dict[str, Any] = {"data": {"n": n}, "priority": n % 2, "partitionkey": f"customer-{n % 3}",
                                "type": "order.created" if n % 3 else "audit.logged"}
        if region:
            body["attributes"] = {"region": region}
        published = await call(client, f"{BASE}/messages", body)
        if region == "eu":
            wanted["eu"].add(published["messageId"])
        if n % 2 and n % 3:
            wanted["urgent-orders"].add(published["messageId"])
    for name, ids in wanted.items():
        got = await receive_of(client, name, len(ids))
        assert {m["messageid"] for m in got} == ids and len(got) == len(ids), name
        assert all(m["deliverycount"] == 1 for m in got)
        await filtered_count(client, name, 40 - len(ids))


async def test_a_filter_changed_under_a_live_consumer_applies_to_every_message_not_yet_delivered(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    create_queue(store, shards=1, subscribers=())
    spec = SubscriberSpec(queue=QUEUE, start_position="earliest", message_filter='attributes.region == "eu"')
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec)
    client = await make_sidecar()
    ids: dict[str, list[str]] = {"eu": [], "us": []}
    for n in range(6):
        region = "eu" if n < 2 else "us"
        ids[region].append((await call(client, f"{BASE}/messages",
                                       {"data": n, "attributes": {"region": region}}))["messageId"])
    (in_flight,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 5}))["messages"]
    assert in_flight["messageid"] == ids["eu"][0]
    consumer = service_of(client.app).subscriptions[SUBSCRIBER].consumer
    assert consumer is not None

    async def in_force(expression: str | None) -> None:
        """Wait until the sidecar's consumer has the spec written last (through its watch)."""
        async def seen() -> bool:
            return consumer.subscriber_state.spec.message_filter == expression

        await until(seen)

    us = 'attributes.region == "us"'
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec.model_copy(update={"message_filter": us}))
    await in_force(us)

    after_the_change: list[str] = []

    async def us_only() -> bool:
        """Receive until every us message came: the second eu message meets the new filter."""
        got = (await call(client, f"{SUB}/receive", {"max": 100, "wait": 0.2}))["messages"]
        if got:
            after_the_change.extend(m["messageid"] for m in got)
            await call(client, f"{SUB}/ack", {"receipts": [m["receipt"] for m in got]})
        return len(after_the_change) >= len(ids["us"])

    await until(us_only)
    assert after_the_change == ids["us"]
    # The delivery in flight before the change is still the app's to ack.
    assert (await call(client, f"{SUB}/ack", {"receipt": in_flight["receipt"]}))["results"][0]["status"] == "acked"
    await filtered_count(client, SUBSCRIBER, 1)

    # A seek applies the filter in force to the history it goes back over: the eu messages,
    # one acked and one passed over before, come again under a filter that matches them.
    catalog.apply_subscriber(store, REF, SUBSCRIBER, spec)
    await in_force(spec.message_filter)
    await call(client, f"{SUB}/seek", {"to": "earliest"})
    replayed = await receive_of(client, SUBSCRIBER, 2)
    assert [m["messageid"] for m in replayed] == ids["eu"]
    await filtered_count(client, SUBSCRIBER, 1 + 4)


async def test_an_ack_that_publishes_what_its_message_resulted_in_publishes_each_output_once(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    """Each order results in two invoice lines. The ack is sent twice, and one order's lines
    are published as a sidecar killed between its outputs and its ack would leave them; its
    next delivery's ack then publishes nothing anew. The invoices hold each line once."""
    create_queue(store, shards=2)
    create_queue(store, name="invoices", shards=2, subscribers=())
    client = await make_sidecar(subscribers=(SUBSCRIBER,))
    for n in range(3):
        await call(client, f"{BASE}/messages", {"data": {"order": n}})
    orders = await receive_all(client, 3, ack=False)

    def lines(order: dict[str, Any]) -> dict[str, Any]:
        n = order["data"]["order"]
        return {"queue": "invoices", "messages": [{"data": {"order": n, "line": i}, "partitionkey": f"o{n}"}
                                                  for i in range(2)]}

    first = await call(client, f"{SUB}/ack", {"receipt": orders[0]["receipt"], "publish": lines(orders[0])})
    (result,) = first["results"]
    assert result["status"] == "acked" and [p["duplicate"] for p in result["published"]] == [False, False]
    again = await call(client, f"{SUB}/ack", {"receipt": orders[0]["receipt"], "publish": lines(orders[0])})
    assert again["results"][0]["status"] == "already_acked" and again["results"][0].get("published") is None

    # Order 1: its lines published as the first half of its ack, and then the sidecar "dies".
    consumer = service_of(client.app).subscriptions[SUBSCRIBER].consumer
    assert consumer is not None
    held = consumer.held_message(orders[1]["receipt"])
    assert held is not None
    outputs = [m.outgoing() for m in PipelineOutputs.model_validate(lines(orders[1])).messages]
    await service_of(client.app).publish("invoices", keyed_outputs(
        outputs, consumer.subscriber_state.ack_key(SUBSCRIBER), held.message_id, 3600))
    await call(client, f"{SUB}/nack", {"receipt": orders[1]["receipt"]})  # as its visibility would end
    (redelivered,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 5}))["messages"]
    assert redelivered["messageid"] == orders[1]["messageid"] and redelivered["deliverycount"] == 2
    batch = await call(client, f"{SUB}/ack", {"acks": [
        {"receipt": redelivered["receipt"], "publish": lines(redelivered)},
        {"receipt": orders[2]["receipt"], "publish": lines(orders[2])},
    ]})
    replayed, fresh = batch["results"]
    assert replayed["status"] == "acked" and [p["duplicate"] for p in replayed["published"]] == [True, True]
    assert fresh["status"] == "acked" and [p["duplicate"] for p in fresh["published"]] == [False, False]

    stored = [json.loads(row.payload) for row in store.session.execute(
        f"SELECT seq, payload FROM {store.table(QueueRef('default', 'invoices'))}") if row.seq >= 0]
    assert sorted((line["order"], line["line"]) for line in stored) == [(n, i) for n in range(3) for i in range(2)]
    # An output's history leads back to the message whose ack published it.
    second_line = result["published"][1]["messageId"]
    traced = await call(client, f"/v1/queues/invoices/messages/{second_line}")
    assert traced["origin"] == {"kind": "pipeline_output", "subscriber": SUBSCRIBER,
                                "messageId": orders[0]["messageid"], "index": 1}


async def test_an_ack_that_publishes_refuses_keys_of_its_own_and_a_mixed_form(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    create_queue(store, shards=1)
    create_queue(store, name="invoices", shards=1, subscribers=())
    client = await make_sidecar()
    await call(client, f"{BASE}/messages", {"data": "order"})
    (order,) = await receive_all(client, 1, ack=False)
    keyed = {"queue": "invoices", "messages": [{"data": "line", "id": "line-1"}]}
    refused = await client.post(f"{SUB}/ack", json={"receipt": order["receipt"], "publish": keyed})
    assert await error_code(refused, 400) == "invalid_request"
    mixed = {"receipts": [order["receipt"]], "publish": {"queue": "invoices", "messages": [{"data": "line"}]}}
    assert await error_code(await client.post(f"{SUB}/ack", json=mixed), 400) == "invalid_request"
    nowhere = {"receipt": order["receipt"], "publish": {"queue": "nowhere", "messages": [{"data": "line"}]}}
    assert await error_code(await client.post(f"{SUB}/ack", json=nowhere), 404) == "queue_not_found"
    # Nothing refused was acked: the order is still in flight, and its ack goes through.
    assert (await call(client, f"{SUB}/ack", {"receipt": order["receipt"]}))["results"][0]["status"] == "acked"


async def test_nack_redelivers_now_or_after_its_delay(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages", {"data": "retry me"})
    (first,) = await receive_all(client, 1, ack=False)
    assert (await call(client, f"{SUB}/nack", {"receipt": first["receipt"]}))["results"][0]["status"] == "nacked"
    (second,) = await receive_all(client, 1, ack=False)
    assert second["id"] == first["id"] and second["deliverycount"] == 2

    await call(client, f"{SUB}/nack", {"receipt": second["receipt"], "delay": 3600})
    assert (await call(client, f"{SUB}/receive", {"max": 10}))["messages"] == []  # an hour away

    # A short delay: the long poll wakes when it is due.
    publish = await call(client, f"{BASE}/messages", {"data": "later"})
    (third,) = [m for m in await receive_all(client, 1, ack=False) if m["messageid"] == publish["messageId"]]
    await call(client, f"{SUB}/nack", {"receipt": third["receipt"], "delay": 0.2})
    again = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 10}))["messages"]
    assert [m["messageid"] for m in again] == [publish["messageId"]] and again[0]["deliverycount"] == 2


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_a_retry_policy_spaces_out_redeliveries_and_a_nacks_own_delay_wins(
    store: Store, make_sidecar: MakeSidecar, delivery: str
) -> None:
    """Backoff 2 s after the first delivery, doubling, at most 5 s: each gap is read from the
    times this test sent a settle (or a receive) and got the message back, which can only be
    later than when the sidecar made it ready, so load lengthens gaps but cannot fake them."""
    create_queue(store, shards=1, subscribers=())
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", delivery=delivery,
        retry=RetryPolicy(minimum_backoff_seconds=2, maximum_backoff_seconds=5)))
    client = await make_sidecar()
    await call(client, f"{BASE}/messages", {"data": "flaky downstream"})
    (message,) = await receive_all(client, 1, ack=False)

    async def back_after(settle: dict[str, Any], visibility: float = 30, wait: float = 15) -> tuple[dict[str, Any], float]:
        """Nack the message; its next delivery and the gap to it."""
        since = time.monotonic()
        await call(client, f"{SUB}/nack", {"receipt": message["receipt"], **settle})
        (again,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": wait, "visibility": visibility}))["messages"]
        assert again["id"] == message["id"] and again["deliverycount"] == message["deliverycount"] + 1
        return again, time.monotonic() - since

    message, gap = await back_after({})
    assert gap >= 2  # delivered once: the minimum
    nacked = time.monotonic()
    message, gap = await back_after({}, visibility=0.5)
    assert gap >= 4  # twice: doubled
    (lapsed,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 15}))["messages"]
    # Delivered three times, then its visibility of 0.5 s ran out: 8 s capped at the maximum, 5.
    assert time.monotonic() - nacked >= 4 + 0.5 + 5
    assert lapsed["id"] == message["id"] and lapsed["deliverycount"] == 4
    message = lapsed
    message, _ = await back_after({"delay": 0}, wait=3)  # the policy would say 5 s; the nack's own delay wins
    assert (await call(client, f"{SUB}/ack", {"receipt": message["receipt"]}))["results"][0]["status"] == "acked"


async def test_a_message_is_followed_from_publish_through_nack_redelivery_ack_and_dead_letter(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    """GET .../messages/{id} for one message as three subscribers handle it: billing fails it
    twice into its dead-letter queue, audit acks it, eu-only filters it out."""
    create_queue(store, shards=2, subscribers=("audit",))
    catalog.apply_queue(store, QueueRef("default", "orders-dead"), QueueSpec(shards=1, retention_seconds=3600,
                                                                             consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", max_deliveries=2, dead_letter_queue="orders-dead"))
    catalog.apply_subscriber(store, REF, "eu-only", SubscriberSpec(
        queue=QUEUE, start_position="earliest", filter='attributes.region == "eu"'))
    client = await make_sidecar(subscribers=(SUBSCRIBER, "audit", "eu-only"))
    billing, audit = SUB, f"{BASE}/subscribers/audit"

    published = await call(client, f"{BASE}/messages", {"id": "order-7", "data": {"total": 12},
                                                        "attributes": {"region": "us"}})
    message_id = published["messageId"]

    async def history() -> dict[str, Any]:
        return await call(client, f"{BASE}/messages/{message_id}")

    async def states() -> dict[str, tuple[str, int]]:
        return {s["subscriber"]: (s["state"], s["deliveries"]) for s in (await history())["subscribers"]}

    traced = await history()
    assert (traced["state"], traced["messageId"], traced["eventId"]) == ("logged", message_id, "order-7")
    assert traced["place"] == {"shard": published["shard"], "priority": 0, "batch": published["batch"],
                               "seq": published["seq"]}
    assert traced["publishedAt"] and traced["size"] > 0 and traced["publisher"]
    assert "data" not in traced and "attributes" not in traced  # metadata only
    assert await states() == {SUBSCRIBER: ("pending", 0), "audit": ("pending", 0), "eu-only": ("filtered", 0)}

    async def delivered(path: str) -> dict[str, Any]:
        (got,) = [m for m in (await call(client, f"{path}/receive", {"max": 10, "wait": 5}))["messages"]
                  if m["messageid"] == message_id]
        return got

    first = await delivered(billing)
    billing_now = [s for s in (await history())["subscribers"] if s["subscriber"] == SUBSCRIBER][0]
    assert (billing_now["state"], billing_now["deliveries"]) == ("in_flight", 1)
    assert datetime.fromisoformat(billing_now["until"]) > datetime.now(timezone.utc)
    await call(client, f"{billing}/nack", {"receipt": first["receipt"], "error": "downstream 503"})

    async def billing_visible_again() -> bool:
        return (await states())[SUBSCRIBER] == ("pending", 1)

    await until(billing_visible_again)  # the nack's record is written after it is answered
    second = await delivered(billing)
    assert second["deliverycount"] == 2 and (await states())[SUBSCRIBER] == ("in_flight", 2)

    acked_by_audit = await delivered(audit)
    await call(client, f"{audit}/ack", {"receipt": acked_by_audit["receipt"]})
    assert (await states())["audit"] == ("acked", 1)

    await call(client, f"{billing}/nack", {"receipt": second["receipt"], "error": "downstream 503"})

    async def dead_lettered() -> bool:
        await call(client, f"{billing}/receive", {"max": 10})  # a take finds it past its deliveries
        return (await states())[SUBSCRIBER] == ("dead_lettered", 2)

    await until(dead_lettered)
    (final,) = [s for s in (await history())["subscribers"] if s["subscriber"] == SUBSCRIBER]
    assert final["deadLetterQueue"] == "orders-dead"
    copy = await call(client, f"/v1/queues/orders-dead/messages/{final['deadLetterMessageId']}")
    assert copy["state"] == "logged" and copy["place"]["shard"] == 0
    assert copy["messageId"] == final["deadLetterMessageId"] != message_id


async def test_a_delayed_message_and_ids_that_name_no_message(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    later = await call(client, f"{BASE}/messages", {"data": "in an hour", "delay": 3600})
    traced = await call(client, f"{BASE}/messages/{later['messageId']}")
    assert (traced["state"], traced["subscribers"]) == ("delayed", [])
    due, deliver_at = datetime.fromisoformat(traced["dueAt"]), datetime.fromisoformat(later["deliverAt"])
    assert timedelta(0) <= deliver_at - due < timedelta(milliseconds=1) and "place" not in traced  # ids carry ms
    now = await call(client, f"{BASE}/messages", {"data": "now"})
    other = await call(client, f"{BASE}/messages", {"data": "now too"})
    # A made-up id with the time of a real one: the search covers that time and finds nothing.
    made_up = now["messageId"][:24] + "0" * 12
    assert made_up not in (now["messageId"], other["messageId"])
    assert await error_code(await client.get(f"{BASE}/messages/{made_up}"), 404) == "message_not_found"
    for untraceable in ("3b241101-e2bb-4255-8caf-4136c566a962", "not-an-id"):
        assert await error_code(await client.get(f"{BASE}/messages/{untraceable}"), 404) == "untraceable_id"
    assert await error_code(await client.get(f"/v1/queues/nosuch/messages/{now['messageId']}"), 404) == \
        "queue_not_found"


async def test_extend_keeps_a_message_and_expiry_makes_the_old_receipt_stale(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages", {"data": "slow work"})
    (held,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 10, "visibility": 30}))["messages"]
    extended = await call(client, f"{SUB}/extend", {"receipt": held["receipt"], "visibility": 3600})
    assert extended["results"][0]["status"] == "extended"
    assert extended["results"][0]["visibleUntil"] > held["visibleuntil"]
    assert (await call(client, f"{SUB}/ack", {"receipt": held["receipt"]}))["results"][0]["status"] == "acked"

    await call(client, f"{BASE}/messages", {"data": "too slow"})
    (lapsed,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 10, "visibility": 0.2}))["messages"]
    (redelivered,) = (await call(client, f"{SUB}/receive", {"max": 1, "wait": 10}))["messages"]
    assert redelivered["id"] == lapsed["id"] and redelivered["deliverycount"] == 2
    for action, extra in (("ack", {}), ("nack", {}), ("extend", {"visibility": 10})):
        response = await client.post(f"{SUB}/{action}", json={"receipt": lapsed["receipt"], **extra})
        assert await error_code(response, 409) == "stale_receipt"
    assert (await call(client, f"{SUB}/ack", {"receipt": redelivered["receipt"]}))["results"][0]["status"] == "acked"


async def test_batch_settles_report_each_receipt(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i} for i in range(3)]})
    messages = await receive_all(client, 3, ack=False)
    receipts = [m["receipt"] for m in messages]
    answer = await call(client, f"{SUB}/ack", {"receipts": [receipts[0], receipts[0], "bm90LWEtcmVjZWlwdA"]})
    statuses = [(r.get("status"), (r.get("error") or {}).get("code")) for r in answer["results"]]
    assert sorted(statuses[:2], key=str) == [("acked", None), ("already_acked", None)]
    assert statuses[2] == (None, "invalid_receipt")
    nacked = await call(client, f"{SUB}/nack", {"receipts": receipts[1:], "delay": 0})
    assert [r["status"] for r in nacked["results"]] == ["nacked", "nacked"]
    extended = await call(client, f"{SUB}/extend", {"receipts": receipts[1:], "visibility": 5})
    assert [r["error"]["code"] for r in extended["results"]] == ["stale_receipt", "stale_receipt"]


async def test_keyed_messages_keep_their_order_through_the_api(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=3)
    client = await make_sidecar()
    keys = [f"customer-{k}" for k in range(6)]
    rounds = 8

    async def publish_in_order(key: str) -> list[dict[str, Any]]:
        """One app thread per key: each publish answered before the next is sent, alternating
        the one-message and the batch forms; the keys' publishes interleave."""
        results = []
        for n in range(rounds):
            if n % 2:
                results.append(await call(client, f"{BASE}/messages", {"data": f"{key}/{n}", "partitionkey": key}))
            else:
                (result,) = (await call(client, f"{BASE}/messages/batch", {
                    "messages": [{"data": f"{key}/{n}", "partitionkey": key}]}))["results"]
                results.append(result)
        return results

    published = dict(zip(keys, await asyncio.gather(*(publish_in_order(k) for k in keys))))
    got = await receive_all(client, len(keys) * rounds)
    assert len(got) == len(keys) * rounds
    for key in keys:
        mine = [m for m in got if m["partitionkey"] == key]
        # Delivered in publish order, which is their order in the log, all in the key's shard.
        assert [m["data"] for m in mine] == [f"{key}/{n}" for n in range(rounds)]
        positions = [(m["shard"], m["batch"], m["seq"]) for m in mine]
        assert positions == sorted(positions) and len({shard for shard, _, _ in positions}) == 1
        assert [m["id"] for m in mine] == [r["messageId"] for r in published[key]]


async def test_seek_replays_and_skips(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=2)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i, "partitionkey": str(i)} for i in range(20)]})
    first = await receive_all(client, 20)
    assert len(first) == 20

    moved = await call(client, f"{SUB}/seek", {"to": "earliest"})
    assert moved == {"offsets": {"0": 1, "1": 1}}
    replayed = await receive_all(client, 20)
    assert sorted(m["id"] for m in replayed) == sorted(m["id"] for m in first)
    assert all(m["deliverycount"] == 1 for m in replayed)  # a replay is a new pass, not a redelivery

    latest = await call(client, f"{SUB}/seek", {"to": "latest"})
    heads = {s["shard"]: s["head"] for s in (await call(client, f"{BASE}/stats"))["shards"]}
    assert latest["offsets"] == {str(shard): head + 1 for shard, head in heads.items()}
    await call(client, f"{SUB}/seek", {"time": "2000-01-01T00:00:00Z"}, status=409)  # before retention
    await call(client, f"{SUB}/seek", {"batches": {"0": 1}})
    shard_zero = sorted(m["id"] for m in first if m["shard"] == 0)
    assert sorted(m["id"] for m in await receive_all(client, len(shard_zero))) == shard_zero  # shard 0 again
    for bad in ({"batches": {"0": 999}}, {"batches": {"7": 1}}):
        response = await client.post(f"{SUB}/seek", json=bad)
        assert await error_code(response, 409) == "position_out_of_range"
    now = await call(client, f"{SUB}/seek", {"time": "2999-01-01T00:00:00+00:00"})
    assert now["offsets"] == latest["offsets"]


async def test_queue_and_subscriber_stats(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, shards=2)
    client = await make_sidecar()
    await call(client, f"{BASE}/messages/batch", {"messages": [{"data": "abcd"} for _ in range(6)]})

    async def counted() -> bool:
        # Stats read the head watermarks, which a publish advances after it answers.
        return bool((await call(client, f"{BASE}/stats"))["publishedMessages"] == 6)

    await until(counted)
    queue = await call(client, f"{BASE}/stats")
    assert queue["queue"] == "default/orders" and queue["publishedMessages"] == 6
    assert len(queue["shards"]) == 2 and queue["publishedBytes"] == 6 * len('"abcd"')
    lagging = await call(client, f"{SUB}/stats")
    assert lagging["lagMessages"] == 6 and lagging["subscriber"] == SUBSCRIBER
    held = await receive_all(client, 2, ack=False)

    # At once: this sidecar's own member counts as it is now, not as its znode said seconds ago.
    stats = await call(client, f"{SUB}/stats")
    assert stats["inFlight"] == len(held) and stats["delivered"] >= len(held), stats
    await call(client, f"{SUB}/ack", {"receipts": [m["receipt"] for m in held]})
    await receive_all(client, 6 - len(held))

    async def caught_up() -> bool:
        return bool((await call(client, f"{SUB}/stats"))["lagMessages"] == 0)

    await until(caught_up)


async def test_health_readiness_metrics_and_openapi(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store)
    client = await make_sidecar()
    assert (await call(client, "/healthz"))["status"] == "ok"
    ready = await call(client, "/readyz")
    assert ready["checks"]["subscriber/billing"] == "holding shards 0,1"
    await call(client, f"{BASE}/messages", {"data": 1})
    await receive_all(client, 1)
    metrics = await (await client.get("/metrics")).text()
    for line in ('casque_sidecar_published_messages_total{queue="orders"} 1.0',
                 'casque_sidecar_received_messages_total{queue="orders",subscriber="billing"} 1.0',
                 'casque_sidecar_acked_messages_total{queue="orders",subscriber="billing"} 1.0',
                 'casque_sidecar_leased_shards{subscriber="billing"} 2.0',
                 'casque_sidecar_in_flight_messages{subscriber="billing"} 0.0',
                 'casque_sidecar_requests_total{operation="publish",status="200"} 1.0',
                 'casque_sidecar_request_seconds_bucket{le="0.5",operation="receive"}'):
        assert line in metrics, line
    assert "casque_subscriber_" not in metrics  # the operator's to export, once for every sidecar
    document = await call(client, "/openapi.json")
    operations = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert operations == {"publish", "publishBatch", "receive", "ack", "nack", "extendVisibility", "seek",
                          "queueStats", "subscriberStats", "messageHistory"}
    # A publish's history is found by the id it answered with, not by an `id` the client gave
    # it (a fuzzer inferring the link from the body's `id` found "created, then not found").
    published = document["paths"]["/v1/queues/{queue}/messages"]["post"]["responses"]["200"]
    assert published["links"]["messageHistory"]["parameters"]["messageId"] == "$response.body#/messageId"


async def test_the_documents_links_lead_from_a_publish_to_its_history_and_from_a_receive_to_settling_it(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    """A client that follows the document's links (their values from the answers it got)
    publishes, finds the message's history, receives it, extends, nacks and acks it."""
    create_queue(store)
    client = await make_sidecar()
    document = await call(client, "/openapi.json")
    operations = {op["operationId"]: (method, path, op) for path, item in document["paths"].items()
                  for method, op in item.items()}

    def pointer(value: Any, path: str) -> Any:
        for part in path.strip("/").split("/"):
            value = value[int(part)] if isinstance(value, list) else value[part]
        return value

    async def follow(source: str, link: str, request_path: dict[str, str], answer: Any,
                     body: Any = None) -> tuple[dict[str, str], Any]:
        """Call the operation `link` of `source`'s 200 answer leads to; its path and answer."""
        definition = operations[source][2]["responses"]["200"]["links"][link]

        def value(expression: Any) -> Any:
            if isinstance(expression, dict):
                return {k: value(v) for k, v in expression.items()}
            if isinstance(expression, str) and expression.startswith("$request.path."):
                return request_path[expression.removeprefix("$request.path.")]
            if isinstance(expression, str) and expression.startswith("$response.body#"):
                return pointer(answer, expression.removeprefix("$response.body#"))
            return expression

        method, template, _ = operations[definition["operationId"]]
        names = {"subscriber": SUBSCRIBER, **value(definition["parameters"])}
        path = template.format(**names)
        linked = value(definition["requestBody"]) if "requestBody" in definition else body
        assert method == "get" or isinstance(linked, dict), f"{link}: the link names no body and the client gave none"
        response = await (client.post(path, json=linked) if method == "post" else client.get(path))
        assert response.status == 200, (link, linked, await response.text())
        return names, await response.json()

    publish_path = {"queue": QUEUE}
    published = await call(client, f"{BASE}/messages", {"id": "my-own-key", "data": "linked"})
    _, history = await follow("publish", "messageHistory", publish_path, published)
    assert history["messageId"] == published["messageId"]

    async def received() -> tuple[dict[str, str], Any]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            names, answer = await follow("publish", "receive", publish_path, published, {"max": 1, "wait": 5})
            if answer["messages"]:
                assert answer["messages"][0]["messageid"] == published["messageId"]
                return names, answer
        raise AssertionError("the message was not received again within 60 s")

    names, answer = await received()
    _, history = await follow("receive", "messageHistory", names, answer)
    assert history["messageId"] == published["messageId"]
    receipt = answer["messages"][0]["receipt"]  # where the settling links' descriptions say
    _, extended = await follow("receive", "extendVisibility", names, answer, {"receipt": receipt, "visibility": 30})
    _, nacked = await follow("receive", "nack", names, answer, {"receipt": receipt})
    assert [extended["results"][0]["status"], nacked["results"][0]["status"]] == ["extended", "nacked"]
    names, answer = await received()
    _, acked = await follow("receive", "ack", names, answer, {"receipt": answer["messages"][0]["receipt"]})
    assert acked["results"][0]["status"] == "acked"
    assert (await call(client, f"{SUB}/receive", {"max": 1, "wait": 0.5}))["messages"] == []


# --- errors ----------------------------------------------------------------------------------------
async def test_bad_input_gets_a_4xx_with_a_code(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, max_bytes=1024)
    client = await make_sidecar(max_request_bytes=64 * 1024)
    post = client.post
    cases: list[tuple[Awaitable[Any], int, str]] = [
        (post(f"{BASE}/messages", data=b'{"data": ', headers=JSON), 400, "invalid_json"),
        (post(f"{BASE}/messages", data=b"\xff\xfe", headers=JSON), 400, "invalid_json"),
        (post(f"{BASE}/messages", data=b"", headers=JSON), 400, "invalid_json"),
        (post(f"{BASE}/messages", json=[1, 2]), 400, "invalid_request"),
        (post(f"{BASE}/messages/batch", json={}), 400, "invalid_request"),  # messages missing
        (post(f"{BASE}/messages/batch", json={"messages": []}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"data": 1, "dealy": 30}), 400, "invalid_request"),  # misspelt
        (post(f"{BASE}/messages", json={"delay": 30, "deliverAt": "2030-01-01T00:00:00Z"}), 400, "invalid_request"),
        # The document allows these; the queue cannot take them (a conflict with its spec).
        (post(f"{BASE}/messages", json={"priority": 3}), 409, "invalid_spec"),  # the queue has one level
        (post(f"{BASE}/messages", json={"deliverAt": "2999-01-01T00:00:00Z"}), 409, "invalid_spec"),  # > retention
        (post(f"{BASE}/messages", json={"data": 1, "data_base64": "AA=="}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"data_base64": "not base64!"}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"data": 1, "ttl": "60"}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"data": 1, "attributes": {"ce-type": "x"}}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"partitionkey": "\ud800"}), 400, "invalid_json"),  # lone surrogate
        (post(f"{BASE}/messages", json={"data": "x" * 2000}), 413, "message_too_large"),
        (post(f"{BASE}/messages", json={"data": "x" * 100_000}), 413, "request_too_large"),
        (post(f"{SUB}/receive", json={"max": 0}), 400, "invalid_request"),
        (post(f"{SUB}/receive", json={"wait": float("nan")}), 400, "invalid_request"),
        (post(f"{SUB}/receive", json={"max": 10, "wait": -1}), 400, "invalid_request"),
        (post(f"{SUB}/ack", json={}), 400, "invalid_request"),
        (post(f"{SUB}/ack", json={"receipt": "a", "receipts": ["b"]}), 400, "invalid_request"),
        (post(f"{SUB}/ack", json={"receipt": "AAAA"}), 400, "invalid_request"),  # a receipt is 32 characters
        (post(f"{SUB}/ack", json={"receipt": "AAAA", "receipts": None}), 400, "invalid_request"),
        (post(f"{BASE}/messages", json={"attributes": {"CE-type": "x"}}), 400, "invalid_request"),
        (post(f"{SUB}/receive", json={"max": 2.5}), 400, "invalid_request"),
        (post(f"{SUB}/ack", json={"receipt": "not a receipt!"}), 400, "invalid_request"),
        (post(f"{SUB}/extend", json={"receipt": "AAAA"}), 400, "invalid_request"),  # visibility missing
        (post(f"{SUB}/seek", json={"to": "earliest", "batches": {"0": 1}}), 400, "invalid_request"),
        (post(f"{SUB}/seek", json={"time": "2024-01-01T00:00:00"}), 400, "invalid_request"),  # no zone
        (post(f"{SUB}/seek", json={"to": "middle"}), 400, "invalid_request"),
        (client.get("/v1/nothing/here"), 404, "not_found"),
        (client.get(f"{BASE}/messages"), 405, "method_not_allowed"),
    ]
    for request, status, code in cases:
        assert await error_code(await request, status) == code, (status, code)
    detail = await (await post(f"{BASE}/messages/batch", json={"messages": [{"data": 1, "ttl": 0}]})).json()
    assert detail["error"]["details"][0]["field"] == "messages.0.ttl"
    # None of it was written.
    assert (await call(client, f"{BASE}/stats"))["publishedMessages"] == 0


async def test_unknown_queues_and_subscribers_are_404(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, subscribers=(SUBSCRIBER, "audit"))
    client = await make_sidecar()
    cases = [
        (client.post("/v1/queues/nope/messages", json={"data": 1}), "queue_not_found"),
        (client.post("/v1/queues/Not_A_Name/messages", json={"data": 1}), "queue_not_found"),
        (client.post("/v1/queues/nope/messages/batch", json={"messages": [{"data": 1}]}), "queue_not_found"),
        (client.get("/v1/queues/nope/stats"), "queue_not_found"),
        (client.get(f"{BASE}/subscribers/nobody/stats"), "subscriber_not_found"),
        (client.post(f"{BASE}/subscribers/nobody/receive", json={}), "subscriber_not_found"),
        (client.post("/v1/queues/nope/subscribers/billing/receive", json={}), "queue_not_found"),
        (client.post(f"{BASE}/subscribers/nobody/ack", json={"receipt": "A" * 32}), "subscriber_not_found"),
        (client.post(f"{BASE}/subscribers/nobody/seek", json={"to": "latest"}), "subscriber_not_found"),
        (client.post(f"{BASE}/subscribers/audit/receive", json={}), "subscriber_not_served"),
    ]
    for request, code in cases:
        assert await error_code(await request, 404) == code
    # The subscriber this sidecar does not consume for can still be sought and measured.
    await call(client, f"{BASE}/subscribers/audit/seek", {"to": "latest"})
    await call(client, f"{BASE}/subscribers/audit/stats")


async def test_bearer_token(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store)
    client = await make_sidecar(token="s3cret", ready=False)
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert (await client.get(path)).status == 200
    assert (await client.get("/readyz")).status in (200, 503)  # open, whatever it says
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = await client.post(f"{BASE}/messages", json={"data": 1}, headers=headers)
        assert await error_code(response, 401) == "unauthorized"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    ok = await client.post(f"{BASE}/messages", json={"data": 1}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    document = await (await client.get("/openapi.json")).json()
    assert document["security"] == [{"bearer": []}]


async def test_scopes_refuse_other_queues_and_subscribers_with_403(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, subscribers=(SUBSCRIBER, "shipping"))
    create_queue(store, "audit", subscribers=("reader",))
    client = await make_sidecar(subscribers=(SUBSCRIBER, "shipping"), publish_scope=[QUEUE],
                                subscribe_scope=[f"{QUEUE}/{SUBSCRIBER}"])
    await call(client, f"{BASE}/messages", {"data": 1})
    for path, body in (("/v1/queues/audit/messages", {"data": 2}),
                       ("/v1/queues/audit/messages/batch", {"messages": [{"data": 3}]})):
        assert await error_code(await client.post(path, json=body), 403) == "out_of_scope"
    assert (await call(client, "/v1/queues/audit/stats"))["publishedMessages"] == 0  # nothing written

    (message,) = await receive_all(client, 1, ack=False)
    other = f"{BASE}/subscribers/shipping"
    for operation, body in (("receive", {}), ("ack", {"receipt": message["receipt"]}),
                            ("nack", {"receipt": message["receipt"]}),
                            ("extend", {"receipt": message["receipt"], "visibility": 5}),
                            ("seek", {"to": "latest"})):
        response = await client.post(f"{other}/{operation}", json=body)
        assert await error_code(response, 403) == "out_of_scope", operation
    seek_audit = await client.post("/v1/queues/audit/subscribers/reader/seek", json={"to": "latest"})
    assert await error_code(seek_audit, 403) == "out_of_scope"
    await call(client, f"{other}/stats")  # reading stats is not consuming
    # Its own subscriber is in scope: the ack first (after the seek its receipt is stale).
    await call(client, f"{SUB}/ack", {"receipt": message["receipt"]})
    await call(client, f"{SUB}/seek", {"to": "earliest"})


async def test_not_ready_until_the_subscriber_exists(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store, subscribers=())
    client = await make_sidecar(ready=False)

    async def says_why() -> bool:
        readiness = await client.get("/readyz")
        assert readiness.status == 503
        return "SubscriberNotFound" in (await readiness.json())["checks"]["subscriber/billing"]

    await until(says_why)
    # The Pod's readiness probe asks only whether the sidecar can take calls: it can, and
    # the app's own traffic is not taken away while its subscriber is missing.
    assert (await client.get("/readyz?scope=serving")).status == 200
    response = await client.post(f"{SUB}/receive", json={})
    assert await error_code(response, 503) == "not_ready" and response.headers["Retry-After"]
    await call(client, f"{BASE}/messages", {"data": "early"})  # publishing needs no subscriber

    create_queue(store)  # now the subscriber exists: the sidecar starts consuming by itself

    async def is_ready() -> bool:
        return (await client.get("/readyz")).status == 200

    await until(is_ready)
    assert [m["data"] for m in await receive_all(client, 1)] == ["early"]


async def test_unreachable_backend_is_503_with_retry_after(store: Store, make_sidecar: MakeSidecar) -> None:
    create_queue(store)
    client = await make_sidecar(subscribers=())
    store.zk.stop()  # ZooKeeper gone: the queue's spec cannot be read
    response = await client.post(f"{BASE}/messages", json={"data": 1})
    assert await error_code(response, 503) == "backend_unavailable"
    assert response.headers["Retry-After"] == "1"
    assert (await client.get("/readyz")).status == 503


async def test_draining_refuses_new_work_but_takes_acks_of_what_it_handed_out(
    store: Store, make_sidecar: MakeSidecar
) -> None:
    create_queue(store, shards=1)
    client = await make_sidecar(drain_seconds=60)
    await call(client, f"{BASE}/messages/batch", {"messages": [{"data": i} for i in range(2)]})
    held = await receive_all(client, 2, ack=False)
    service = service_of(client.app)
    draining = asyncio.create_task(service.drain())
    await until(lambda: _draining(service))
    for request in (client.post(f"{BASE}/messages", json={"data": "late"}), client.post(f"{SUB}/receive", json={})):
        response = await request
        assert await error_code(response, 503) == "not_ready"
    assert (await client.get("/readyz")).status == 503 and (await client.get("/healthz")).status == 200
    assert not draining.done()  # still waiting for the app to finish what it holds
    acks = await call(client, f"{SUB}/ack", {"receipts": [m["receipt"] for m in held]})
    assert [r["status"] for r in acks["results"]] == ["acked", "acked"]
    await asyncio.wait_for(draining, 30)  # everything settled: the drain ends well before 60 s
    offset = catalog.read_offset(store, store.paths(REF).subscriber(SUBSCRIBER), 0)
    head = catalog.read_int(store, store.paths(REF).head(0))
    assert offset == head + 1  # acks and offsets written before the leases went


async def _draining(service: Any) -> bool:
    return bool(service.draining)
