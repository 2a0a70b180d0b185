"""CloudEvents content modes, trace context, idempotency keys and JSON logs, without servers."""

from __future__ import annotations

import io
import json
import logging
from datetime import datetime, timezone

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from casque.engine.messages import Delivery, Position, StoredMessage
from casque.engine.sequences import producer_key
from casque.logs import REQUEST_ID, JsonFormatter, configure
from casque.schema import QueueRef
from casque.sidecar.errors import InvalidRequest
from casque.sidecar.events import binary_event, is_batch, is_binary
from casque.sidecar.logs import request_id_of
from casque.sidecar.models.publishing import PublishMessage, dedup_key, valid_traceparent, valid_tracestate
from casque.sidecar.models.receiving import envelope

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_dedup_keys_of_sourced_events_never_meet_bare_ids_or_each_other() -> None:
    keys = {dedup_key(None, "a"), dedup_key("s", "a"), dedup_key("sa", ""), dedup_key("s", "aa"),
            dedup_key("/x", "a")}
    assert dedup_key(None, "a") == "a" and dedup_key("s", None) is None
    assert len(keys) == 5
    for key in keys - {None, "a"}:
        assert key is not None and key.startswith("\x00")  # never an engine prefix (delayed/, dlq/, ...)
    with pytest.raises(ValueError):
        PublishMessage.model_validate({"id": "a\x00b"})
    with pytest.raises(ValueError):
        PublishMessage.model_validate({"id": "a", "source": "s\x00"})


@pytest.mark.parametrize("value, valid", [
    (TRACEPARENT, True),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", True),  # a later version's extra field
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", False),  # version 00 has exactly four
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),
    ("garbage", False),
])
def test_traceparent_is_kept_only_when_a_tracer_can_continue_it(value: str, valid: bool) -> None:
    assert (valid_traceparent(value) is not None) == valid
    # Malformed trace context is dropped, never a refusal (the W3C rule for receivers).
    out = PublishMessage.model_validate({"data": 1, "traceparent": value, "tracestate": "a=b"}).outgoing()
    assert out.attributes.get("ce-traceparent") == (value if valid else None)
    assert out.attributes.get("ce-tracestate") == ("a=b" if valid else None)
    assert valid_tracestate("x" * 600) is None and valid_tracestate("a=\u00e9") is None


def _delivery(**attributes: str) -> Delivery:
    stored = StoredMessage(Position(0, 3, 1), "casque-id", datetime(2030, 1, 1, tzinfo=timezone.utc), b"{}",
                           attributes=attributes, content_type="application/json")
    return Delivery(stored, "r", 1, 0.0)


def test_a_delivered_event_carries_the_producers_attributes_and_casques_id_apart() -> None:
    produced = PublishMessage.model_validate_json(json.dumps({
        "id": "order-1", "source": "/shop", "type": "t", "time": "2029-12-31T23:00:00+01:00",
        "dataschema": "https://example.org/s", "traceparent": TRACEPARENT, "tracestate": "v=1", "data": {},
    })).outgoing()
    event = envelope(_delivery(**produced.attributes), QueueRef("ns", "q")).wire()
    assert (event["id"], event["source"], event["messageid"]) == ("order-1", "/shop", "casque-id")
    assert (event["traceparent"], event["tracestate"]) == (TRACEPARENT, "v=1")
    assert event["time"] == "2029-12-31T22:00:00Z" and event["publishedat"] == "2030-01-01T00:00:00Z"
    assert event["dataschema"] == "https://example.org/s" and event["attributes"] == {}
    plain = envelope(_delivery(), QueueRef("ns", "q")).wire()
    assert plain["id"] == plain["messageid"] == "casque-id" and "publishedat" not in plain
    assert "traceparent" not in plain and plain["source"] == "/casque/ns/q"


def test_binary_mode_takes_attributes_from_headers_and_the_body_as_it_is() -> None:
    headers = CIMultiDict({
        "ce-specversion": "1.0", "ce-id": "e1", "ce-source": "/src", "ce-type": "t",
        "ce-time": "2030-01-01T00:00:00Z", "Content-Type": "text/csv", "ce-partitionkey": "k",
        "ce-traceparent": TRACEPARENT,
    })
    assert is_binary(headers) and not is_batch("text/csv") and is_batch("application/cloudevents-batch+json")
    out = binary_event(headers, b"a,b\n1,2\n").outgoing()
    assert (out.payload, out.content_type, out.key) == (b"a,b\n1,2\n", "text/csv", "k")
    assert out.attributes["ce-id"] == "e1" and out.attributes["ce-traceparent"] == TRACEPARENT
    assert out.client_id == dedup_key("/src", "e1")
    # A producer's number comes as a header string like every attribute, and is read as one.
    numbered = binary_event(CIMultiDict({"ce-specversion": "1.0", "ce-producerid": "p", "ce-producerseq": "12"}), b"")
    assert numbered.outgoing().client_id == producer_key("p", 12)
    with pytest.raises(InvalidRequest):
        binary_event(CIMultiDict({"ce-specversion": "1.0", "ce-madeup": "x"}), b"")
    with pytest.raises(InvalidRequest):
        binary_event(CIMultiDict({"ce-specversion": "0.3"}), b"")


def test_json_log_lines_parse_and_name_the_request() -> None:
    stream = io.StringIO()
    configure("json", stream=stream)
    try:
        logger = logging.getLogger("casque.test")
        token = REQUEST_ID.set("req-1")
        try:
            logger.info("hello %s", "there\nagain", extra={"path": "/v1", "when": datetime(2030, 1, 1)})
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logger.exception("failed")
        finally:
            REQUEST_ID.reset(token)
        logger.warning("outside")
    finally:
        configure("text")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["hello there\nagain", "failed", "outside"]
    assert lines[0]["request_id"] == lines[1]["request_id"] == "req-1" and "request_id" not in lines[2]
    assert lines[0]["path"] == "/v1" and lines[0]["when"].startswith("2030-01-01")
    assert "RuntimeError: boom" in lines[1]["exception"] and lines[2]["level"] == "WARNING"
    assert isinstance(JsonFormatter().format(logging.makeLogRecord({"msg": "x"})), str)


def test_an_explicit_null_source_or_id_is_the_same_as_none() -> None:
    """A null `source` or `id` is accepted like an absent one (it reached the NUL check once: a 500)."""
    message = PublishMessage.model_validate_json('{"data": 1, "source": null, "id": null}', strict=True)
    assert message.source is None and message.id is None


def test_request_ids_made_by_the_sidecar_differ_and_a_callers_plain_id_is_kept() -> None:
    made = {request_id_of(make_mocked_request("GET", "/healthz")) for _ in range(1000)}
    assert len(made) == 1000
    given = make_mocked_request("GET", "/healthz", headers={"X-Request-Id": "req-7"})
    assert request_id_of(given) == "req-7"
    hostile = make_mocked_request("GET", "/healthz", headers={"X-Request-Id": "a\u2028b"})
    assert request_id_of(hostile) != "a\u2028b"
