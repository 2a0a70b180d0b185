"""Pure logic of the sidecar: settings, message shapes, the error mapping, the OpenAPI document, push rules."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from casque.engine.member import ConsumerStopped
from casque.engine.deadletters import dead_letter_copy, redrive_copy
from casque.engine.delayed import moved_client_id
from casque.engine.messages import (
    ENGINE_ATTRIBUTE_PREFIX,
    Delivery,
    InvalidReceipt,
    OutgoingMessage,
    Position,
    Published,
    StoredMessage,
    reserved_client_id,
)
from casque.engine.sequences import parse_producer_key, producer_key
from casque.errors import (
    BackendUnavailable,
    CasqueError,
    InvalidChange,
    InvalidSpec,
    MessageTooLarge,
    PositionOutOfRange,
    QueueNotFound,
    StaleReceipt,
    SubscriberNotFound,
)
from casque.schema import QueueRef
from casque.sidecar.config import SidecarSettings, parse_statuses
from casque.sidecar.errors import NotReady, SubscriberNotServed, Unauthorized, status_of
from casque.sidecar.models.base import ErrorBody, Reply
from casque.sidecar.models.publishing import PublishMessage, PublishResult, dedup_key
from casque.sidecar.models.receipts import ReceiptResult, ReceiptResults
from casque.sidecar.models.receiving import ReceiveResult, SeekRequest, SeekResult, envelope
from casque.sidecar.models.status import Health
from casque.sidecar.openapi import build
from casque.sidecar.push import backoff, classify
from casque.sidecar.routes import OPERATIONS
from casque.spark import replay
from casque_client import Message, RetryPolicy, message
from casque_client.client import _Requests

OPERATION_IDS = {"publish", "publishBatch", "receive", "ack", "nack", "extendVisibility", "seek", "queueStats",
                 "subscriberStats", "messageHistory"}


def test_status_lists() -> None:
    assert parse_statuses("408, 429,500-502") == {408, 429, 500, 501, 502}
    assert parse_statuses("") == frozenset()
    for bad in ("abc", "99", "500-400", "600"):
        with pytest.raises(ValueError):
            parse_statuses(bad)


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASQUE_SIDECAR_QUEUE", "orders")
    monkeypatch.setenv("CASQUE_SIDECAR_SUBSCRIBERS", "billing, audit,billing")
    monkeypatch.setenv("CASQUE_SIDECAR_PUSH_RETRY_STATUSES", "503")
    settings = SidecarSettings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8717)  # localhost by default
    assert settings.subscribers == ["billing", "audit"]
    assert settings.push_retry_statuses == {503}
    assert SidecarSettings(port=9000).base_url == "http://127.0.0.1:9000"
    monkeypatch.delenv("CASQUE_SIDECAR_QUEUE")
    with pytest.raises(ValidationError, match="subscribers need the queue"):
        SidecarSettings()
    with pytest.raises(ValidationError):
        SidecarSettings(queue="orders", subscribers=["Not_A_Name"])


def parse(body: dict[str, Any]) -> PublishMessage:
    return PublishMessage.model_validate_json(json.dumps(body), strict=True)


def test_publish_bodies_become_engine_messages() -> None:
    structured = parse({"data": {"a": [1, "é"]}, "partitionkey": "k", "attributes": {"x": "y"}, "id": "c1",
                        "ttl": 60, "type": "t", "source": "/s", "subject": "sub", "specversion": "1.0"})
    out = structured.outgoing()
    assert out.payload == '{"a":[1,"é"]}'.encode() and out.content_type == "application/json"
    # (source, id) is the idempotency key; the id alone when there is no source.
    assert out.key == "k" and out.client_id == dedup_key("/s", "c1") and out.ttl_seconds == 60
    assert parse({"id": "c1"}).outgoing().client_id == "c1"
    assert out.attributes == {"x": "y", "ce-id": "c1", "ce-type": "t", "ce-source": "/s", "ce-subject": "sub"}
    text = parse({"data": "hi", "datacontenttype": "text/plain"}).outgoing()
    assert (text.payload, text.content_type) == (b"hi", "text/plain")
    json_string = parse({"data": "hi"}).outgoing()
    assert (json_string.payload, json_string.content_type) == (b'"hi"', "application/json")
    binary = parse({"data_base64": base64.b64encode(b"\x00\xff").decode()}).outgoing()
    assert (binary.payload, binary.content_type) == (b"\x00\xff", "application/octet-stream")
    # A producer's id and number are the key, also beside an `id` (which then only names the event).
    numbered = parse({"id": "e1", "producerid": "p-1", "producerseq": 7}).outgoing()
    assert numbered.client_id == producer_key("p-1", 7) and parse_producer_key(numbered.client_id) == ("p-1", 7)
    empty = parse({}).outgoing()
    assert (empty.payload, empty.content_type, empty.priority, empty.deliver_at) == (b"", None, 0, None)
    delayed = parse({"delay": 90, "priority": 2}).outgoing()
    assert (delayed.delay_seconds, delayed.deliver_at) == (90, None)  # the publisher dates it, on its clock
    assert parse({"deliverAt": "2030-01-02T00:00:00+01:00"}).outgoing().deliver_at == datetime(
        2030, 1, 1, 23, tzinfo=timezone.utc)


@pytest.mark.parametrize("body", [
    {"data": 1, "data_base64": "AA=="},
    {"data_base64": "***"},
    {"data": {"a": 1}, "datacontenttype": "text/plain"},
    {"attributes": {"ce-type": "x"}},
    {"attributes": {"bad name": "x"}},
    {"ttl": 0},
    {"specversion": "0.3"},
    {"delay": 5, "deliverAt": "2030-01-01T00:00:00Z"},
    {"deliverAt": "2030-01-01T00:00:00"},  # no zone
    {"delay": -1},
    {"priority": -1},
    {"dealy": 5},  # misspelt: refused, never published at once
    {"datacontenttype": "not a media type"},
    # casque's own: an app's publish must never pass for the engine's (or hide one).
    {"id": "delayed/5f0c"}, {"id": "dlq/default/q/s/0/0/1/0"}, {"id": "redrive/abc"}, {"id": "replay:default/q:0:1:0"},
    {"attributes": {"casque-for-subscriber": "billing"}}, {"attributes": {"Casque-dlq-source": "x"}},
    # A producer key is a pair: half of one would be no key at all.
    {"producerid": "p1"}, {"producerseq": 3}, {"producerid": "p1", "producerseq": -1},
    {"producerid": "has space", "producerseq": 1}, {"producerid": "", "producerseq": 1},
    {"producerid": "p1", "producerseq": "3"},
])
def test_publish_bodies_that_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse(body)


def test_the_engines_own_client_ids_and_attributes_are_the_reserved_ones() -> None:
    source = QueueRef("default", "orders")
    stored = StoredMessage(Position(0, 3, 1), "m-1", datetime.now(timezone.utc), b"x")
    copy = dead_letter_copy(stored, source, "billing", 0, 5, "boom")

    def copy_as_stored(message: OutgoingMessage) -> StoredMessage:  # as the dead-letter queue holds it
        return StoredMessage(Position(0, 1, 0), "m-2", datetime.now(timezone.utc), message.payload,
                             attributes=message.attributes)

    redriven = redrive_copy(copy_as_stored(copy), QueueRef("default", "orders-dlq"))
    own_ids = [copy.client_id, redriven.client_id, moved_client_id(stored.message_id), replay.client_id(source, 0, 3, 1)]
    assert all(i is not None and reserved_client_id(i) for i in own_ids), own_ids
    own_attributes = set(copy.attributes) | set(redriven.attributes)
    assert own_attributes and all(a.startswith(ENGINE_ATTRIBUTE_PREFIX) for a in own_attributes)


def test_seek_takes_exactly_one_target() -> None:
    assert SeekRequest.model_validate_json('{"to": "earliest"}', strict=True).to == "earliest"
    assert SeekRequest.model_validate_json('{"batches": {"0": 5}}', strict=True).batches == {"0": 5}
    for raw in ('{}', '{"to": "latest", "time": "2024-01-01T00:00:00Z"}', '{"time": "2024-01-01T00:00:00"}',
                '{"batches": {}}', '{"batches": {"x": 1}}'):
        with pytest.raises(ValidationError):
            SeekRequest.model_validate_json(raw, strict=True)


def delivery(payload: bytes, content_type: str | None, **attributes: str) -> Delivery:
    stored = StoredMessage(Position(1, 7, 3), "m-1", datetime(2030, 1, 1, tzinfo=timezone.utc), payload,
                           key="k", attributes=attributes, content_type=content_type)
    return Delivery(stored, "receipt", 2, 0.0)


def test_envelope_is_a_cloudevent_with_casque_extensions() -> None:
    event = envelope(delivery(b'{"a":1}', "application/json", **{"ce-type": "t", "x": "y"}), QueueRef("ns", "q")).wire()
    assert event["specversion"] == "1.0" and event["id"] == "m-1" and event["type"] == "t"
    assert event["source"] == "/casque/ns/q" and event["data"] == {"a": 1} and event["attributes"] == {"x": "y"}
    assert (event["shard"], event["batch"], event["seq"], event["deliverycount"]) == (1, 7, 3, 2)
    assert event["partitionkey"] == "k" and event["receipt"] == "receipt" and "visibleuntil" in event
    text = envelope(delivery(b"caf\xc3\xa9", "text/plain; charset=utf-8"), QueueRef("ns", "q")).wire()
    assert text["data"] == "café"
    broken = envelope(delivery(b"{nope", "application/json"), QueueRef("ns", "q")).wire()
    assert "data" not in broken and base64.b64decode(broken["data_base64"]) == b"{nope"
    # The client reads the same event back.
    read = Message.of(envelope(delivery(b'{"a":1}', None), QueueRef("ns", "q")).wire())
    assert read.type == "casque.message" and read.payload == b'{"a":1}' and read.delivery_count == 2


@pytest.mark.parametrize("answer", [
    PublishResult.of(Published("m-1", 2, 40, 7)),
    PublishResult.of(Published("m-2", -1, -1, -1, deliver_at=datetime(2030, 1, 1, tzinfo=timezone.utc))),
    ReceiveResult(messages=[envelope(delivery(payload, content_type), QueueRef("ns", "q")) for payload, content_type in (
        (b'{"a":[1,2.5,null]}', "application/json"), (b"null", None), (b"caf\xc3\xa9", "text/plain"),
        (b"\xff\x00", "application/octet-stream"), (b"", None))]),
    ReceiveResult(messages=[]),
    ReceiptResults(results=[ReceiptResult(receipt="r1", status="acked"),
                            ReceiptResult(receipt="r2", error=ErrorBody(code="stale_receipt", message="x")),
                            ReceiptResult(receipt="r3", status="extended",
                                          visible_until=datetime(2030, 1, 1, 0, 0, 0, 500, tzinfo=timezone.utc))]),
    SeekResult(offsets={"0": 5}),
    Health(status="ok"),
], ids=lambda answer: type(answer).__name__)
def test_answers_as_json_text_say_what_wire_says(answer: Reply) -> None:
    """The HTTP answers are serialised by pydantic straight to JSON text; the dict form
    (`wire`) is what push, the CLI and the OpenAPI examples use: the two must agree."""
    assert json.loads(answer.wire_json()) == answer.wire()


@pytest.mark.parametrize(("error", "status"), [
    (InvalidReceipt("x"), 400), (InvalidSpec("x"), 409), (PositionOutOfRange("x"), 409), (InvalidChange("x"), 409),
    (QueueNotFound("x"), 404), (SubscriberNotFound("x"), 404), (SubscriberNotServed("x"), 404),
    (StaleReceipt("x"), 409), (MessageTooLarge("x"), 413), (Unauthorized("x"), 401),
    (BackendUnavailable("x"), 503), (ConsumerStopped("x"), 503), (NotReady("x"), 503), (CasqueError("x"), 500),
])
def test_each_error_has_one_status(error: CasqueError, status: int) -> None:
    assert status_of(error) == status


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_openapi_document_names_exactly_the_api_operations() -> None:
    import schemathesis

    document = build(OPERATIONS, "1.0", bearer_token=False)
    assert document["openapi"].startswith("3.1")
    ids = [op["operationId"] for path in document["paths"].values() for op in path.values()]
    assert sorted(ids) == sorted(OPERATION_IDS)
    schemas = document["components"]["schemas"]
    for ref in _refs(document):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    assert "security" not in document
    schemathesis.openapi.from_dict(document).validate()
    secured = build(OPERATIONS, "1.0", bearer_token=True)
    assert secured["security"] == [{"bearer": []}]
    assert "401" in secured["paths"]["/v1/queues/{queue}/messages"]["post"]["responses"]


def test_push_outcomes_and_backoff() -> None:
    settings = SidecarSettings()
    assert [classify(s, settings) for s in (200, 204, 299)] == ["ack"] * 3
    assert [classify(s, settings) for s in (None, 408, 429, 500, 503)] == ["retry"] * 5
    assert [classify(s, settings) for s in (400, 404, 410, 422)] == ["drop"] * 4
    assert classify(302, settings) == "retry"  # unexpected: keep the message
    for count in range(1, 12):
        delay = backoff(count, 1.0, 300.0)
        assert min(300.0, 2.0 ** (count - 1)) / 2 <= delay <= min(300.0, 2.0 ** (count - 1))
    assert backoff(1000, 1.0, 300.0) <= 300.0


def test_client_keys_every_publish_and_honours_retry_after() -> None:
    calls = _Requests("http://127.0.0.1:8717", "q", None, None, 1.0, RetryPolicy())
    first, second = message({"a": 1}), message({"a": 1})
    assert "id" not in first  # numbered by the client that sends it
    keyed = [calls.publish(first, None).body, calls.publish(second, None).body]
    batch = calls.publish_batch([first, message(1, id="mine")], None).body
    assert batch is not None and keyed[0] is not None and keyed[1] is not None
    numbered = [keyed[0], keyed[1], batch["messages"][0]]
    assert {body["producerid"] for body in numbered} == {calls.producer}
    assert [body["producerseq"] for body in numbered] == [0, 1, 2]
    assert batch["messages"][1]["id"] == "mine" and "producerid" not in batch["messages"][1]
    # Another client is another producer.
    assert _Requests("http://127.0.0.1:8717", "q", None, None, 1.0, RetryPolicy()).producer != calls.producer
    assert message(payload=b"\x00")["data_base64"] == "AA=="
    assert "data" not in message()
    with pytest.raises(ValueError):
        message(1, payload=b"x")
    policy = RetryPolicy(backoff=0.1, max_backoff=1.0)
    assert policy.delay(0, 3.0) == 3.0
    assert all(0.5 <= policy.delay(10, None) <= 1.0 for _ in range(20))
