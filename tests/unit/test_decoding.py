"""The quick path for publish bodies takes only what the models take, and makes the same messages."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from casque.engine.messages import OutgoingMessage
from casque.engine.sequences import MAX_SEQUENCE, producer_key
from casque.sidecar.decoding import Shape, decode_publish, with_trace_context
from casque.sidecar.models.publishing import PublishBatchRequest, PublishEventBatch, PublishMessage

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def by_models(raw: bytes, shape: Shape) -> list[OutgoingMessage]:
    if shape == "events":
        return [m.outgoing() for m in PublishEventBatch.model_validate_json(raw, strict=True).root]
    if shape == "batch":
        return [m.outgoing() for m in PublishBatchRequest.model_validate_json(raw, strict=True).messages]
    return [PublishMessage.model_validate_json(raw, strict=True).outgoing()]


def same_as_models(raw: bytes, shape: Shape = "message") -> bool:
    """The quick path's answer is None or what the models make (and then the models accept)."""
    quick = decode_publish(raw, shape)
    return quick is None or quick == by_models(raw, shape)


TAKEN = [
    {"data": "casque-" * 146, "datacontenttype": "text/plain"},
    {"data": {"a": [1, 2.5, None, True, "é"]}},
    {"data": None},
    {"data": None, "datacontenttype": "text/plain"},
    {},
    {"data": "x", "datacontenttype": "application/cloudevents+json; charset=utf-8"},
    {"data_base64": base64.b64encode(b"\x00\xff").decode()},
    {"data_base64": "", "datacontenttype": "image/png"},
    {"data_base64": None, "data": 3},
    {"id": "e1", "source": "/s", "type": "t", "subject": "sub", "specversion": "1.0", "data": 1},
    {"id": "e1", "data": 1},
    {"producerid": "p-1", "producerseq": 7, "id": "e1"},
    {"producerid": "p", "producerseq": MAX_SEQUENCE},
    {"partitionkey": "k", "attributes": {"a": "b", "x/y:z": ""}, "priority": 9, "ttl": 60},
    {"specversion": None, "id": None, "source": None, "type": None, "subject": None, "partitionkey": None,
     "datacontenttype": None, "producerid": None, "producerseq": None, "ttl": None},
    {"data": "\ud83d\ude00 \u2028", "datacontenttype": "text/plain"},
    {"data": [[[[[[1]]]]]]},
]


@pytest.mark.parametrize("body", TAKEN)
def test_what_the_quick_path_takes_it_makes_as_the_models_do(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    assert decode_publish(raw, "message") == by_models(raw, "message")
    batch = json.dumps({"messages": [body, body]}).encode()
    assert decode_publish(batch, "batch") == by_models(batch, "batch")
    events = json.dumps([body]).encode()
    assert decode_publish(events, "events") == by_models(events, "events")


REFUSED: list[tuple[bytes, Shape]] = [
    (b'{"data": NaN}', "message"),
    (b'{"data": {"x": [Infinity]}}', "message"),
    (b'{"data": -Infinity}', "message"),
    (b'{"data": 1e999}', "message"),
    (b'{"dta": 1}', "message"),  # unknown field
    (b'{"messages": [{"data": 1}], "extra": 1}', "batch"),
    (b'{"data": "caf\xe9", "datacontenttype": "text/plain"}', "message"),  # not UTF-8
    (b'\xef\xbb\xbf{"data": 1}', "message"),  # a BOM
    ('{"data": "x"}'.encode("utf-16"), "message"),
    ('{"data": "x"}'.encode("utf-32"), "message"),
    (b'{"data_base64": "QQ=="  , "data": null}', "message"),  # both
    (b'{"data_base64": "QQ="}', "message"),  # bad base64
    (b'{"data_base64": "QQ==\\n"}', "message"),
    (b'{"data_base64": "Q Q=="}', "message"),
    (b'{"data_base64": 5}', "message"),
    (b'{"id": "delayed/x"}', "message"),  # reserved ids
    (b'{"id": "dlq/x"}', "message"),
    (b'{"id": "redrive/x"}', "message"),
    (b'{"id": "replay:x"}', "message"),
    (b'{"id": "a\\u0000b"}', "message"),
    (b'{"source": "s\\u0000"}', "message"),
    (b'{"id": ""}', "message"),
    (b'{"id": "' + b"x" * 257 + b'"}', "message"),  # oversize fields
    (b'{"source": "' + b"x" * 1025 + b'"}', "message"),
    (b'{"partitionkey": "' + b"x" * 1025 + b'"}', "message"),
    (b'{"datacontenttype": "' + b"a/" + b"x" * 255 + b'"}', "message"),
    (b'{"attributes": {' + b",".join(b'"a%d": "v"' % i for i in range(65)) + b"}}", "message"),
    (b'{"attributes": {"' + b"a" * 129 + b'": "v"}}', "message"),
    (b'{"messages": [' + b",".join([b"{}"] * 1001) + b"]}", "batch"),
    (b"[" + b",".join([b"{}"] * 1001) + b"]", "events"),
    (b'{"messages": []}', "batch"),
    (b"[]", "events"),
    (b'{"id": "\\ud800"}', "message"),  # lone surrogates
    (b'{"data": "\\udc00", "datacontenttype": "text/plain"}', "message"),
    (b'{"data": ["\\uD800"]}', "message"),
    (b'{"attributes": {"a": "\\ud800"}}', "message"),
    (b'{"attributes": {"ce-id": "x"}}', "message"),  # reserved attribute names
    (b'{"attributes": {"Casque-x": "x"}}', "message"),
    (b'{"attributes": {"a b": "x"}}', "message"),
    (b'{"attributes": {"a": 1}}', "message"),
    (b'{"attributes": null}', "message"),
    (b'{"priority": true}', "message"),
    (b'{"priority": 1.5}', "message"),
    (b'{"priority": 10}', "message"),
    (b'{"priority": -1}', "message"),
    (b'{"priority": null}', "message"),
    (b'{"ttl": 0}', "message"),
    (b'{"ttl": 315360001}', "message"),
    (b'{"producerid": "p"}', "message"),
    (b'{"producerseq": 1}', "message"),
    (b'{"producerid": "p q", "producerseq": 1}', "message"),
    (b'{"producerid": "p", "producerseq": -1}', "message"),
    (b'{"producerid": "p", "producerseq": 9223372036854775808}', "message"),
    (b'{"producerid": "p", "producerseq": false}', "message"),
    (b'{"specversion": "0.3"}', "message"),
    (b'{"specversion": 1.0}', "message"),
    (b'{"datacontenttype": "text/plain; a\\n", "data": "x"}', "message"),
    (b'{"datacontenttype": "text", "data": "x"}', "message"),
    (b'{"datacontenttype": "text/plain", "data": 1}', "message"),
    (b'{"id": 1}', "message"),
    (b'{"data": ' + b"[" * 300 + b"]" * 300 + b"}", "message"),
    (b"[1]", "message"),
    (b"null", "message"),
    (b'{"messages": {}}', "batch"),
    (b'{"data": 1} x', "message"),
]


@pytest.mark.parametrize(("raw", "shape"), REFUSED)
def test_what_the_models_refuse_the_quick_path_leaves_to_them(raw: bytes, shape: Shape) -> None:
    assert decode_publish(raw, shape) is None
    with pytest.raises(ValidationError):
        by_models(raw, shape)


@pytest.mark.parametrize("body", [b'{"time": "2026-01-01T00:00:00Z"}', b'{"deliverAt": "2030-01-01T00:00:00Z"}',
                                  b'{"delay": 1}', b'{"traceparent": "x"}', b'{"dataschema": "https://s"}',
                                  b'{"deliver_at": "2030-01-01T00:00:00Z"}',
                                  b'{"datacontenttype": "text/plain;\\u00e9"}'])
def test_fields_the_quick_path_does_not_check_go_to_the_models(body: bytes) -> None:
    assert decode_publish(body, "message") is None
    by_models(body, "message")  # and the models take them


def test_the_request_trace_context_goes_with_quick_messages_as_with_models() -> None:
    raw = b'{"data": 1}'
    for context in ((TRACEPARENT, "a=b"), (TRACEPARENT, None), (None, None), ("garbage", "a=b")):
        quick = decode_publish(raw, "message")
        assert quick is not None
        model = PublishMessage.model_validate_json(raw, strict=True).model_copy(
            update={"traceparent": context[0], "tracestate": context[1]})
        assert with_trace_context(quick, context) == [model.outgoing()]


text = st.text(max_size=6) | st.text(st.sampled_from("a/\x00é;"), max_size=4)
value = st.none() | st.booleans() | st.integers(-2, 2**64) | st.floats(allow_nan=False) | text
json_data: Any = st.recursive(value, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner,
                                                                                                   max_size=3),
                              max_leaves=8)
fields = st.fixed_dictionaries({}, optional={
    "specversion": st.sampled_from(["1.0", None, "1", 1]),
    "id": text | st.sampled_from(["dlq/1", "e1", None, 5]),
    "source": text, "type": text, "subject": text, "partitionkey": text,
    "datacontenttype": st.sampled_from([None, "text/plain", "application/json", "image/png", "text/csv; x=y",
                                        "bad", "a/b\n", 3]),
    "data": json_data,
    "data_base64": st.sampled_from([None, "", "QQ==", "QQ=", "#", 1]),
    "producerid": st.sampled_from([None, "p", "p q", 1]),
    "producerseq": st.sampled_from([None, 0, -1, 2**63, True, 1.0]),
    "attributes": st.dictionaries(st.sampled_from(["a", "ce-x", "casque-x", "a b", "", "k"]), text | st.integers(),
                                  max_size=3) | st.none(),
    "ttl": st.sampled_from([None, 0, 1, 10**10, 1.5]),
    "priority": st.sampled_from([0, 9, 10, -1, True, None]),
    "delay": st.just(1),
    "unknown": st.just(1),
})


@settings(max_examples=400, deadline=None)
@given(messages=st.lists(fields, min_size=1, max_size=3), ascii_only=st.booleans())
def test_any_body_the_quick_path_takes_the_models_take_alike(messages: list[dict[str, Any]], ascii_only: bool) -> None:
    encode = json.dumps if ascii_only else (lambda v: json.dumps(v, ensure_ascii=False))
    for raw, shape in ((encode(messages[0]), "message"), (encode({"messages": messages}), "batch"),
                       (encode(messages), "events")):
        try:
            encoded = raw.encode("utf-8")
        except UnicodeEncodeError:
            encoded = raw.encode("utf-8", "surrogatepass")
        assert same_as_models(encoded, shape)  # type: ignore[arg-type]


def test_content_types_past_the_cache_are_checked_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from casque.sidecar import decoding

    monkeypatch.setattr(decoding, "MAX_CONTENT_TYPES", 0)
    monkeypatch.setattr(decoding, "_content_types", {})
    for body in TAKEN:
        raw = json.dumps(body).encode()
        assert decode_publish(raw, "message") == by_models(raw, "message")
    assert decode_publish(b'{"datacontenttype": "text/plain; a\\n", "data": "x"}', "message") is None


def test_an_integral_float_is_an_integer_to_the_models_and_left_to_them_by_the_quick_path() -> None:
    # JSON has one kind of number, and JSON Schema's `integer` (the OpenAPI document's) takes 1.0.
    raw = b'{"priority": 1.0, "ttl": 60.0, "producerid": "p", "producerseq": 7.0}'
    assert decode_publish(raw, "message") is None
    (message,) = by_models(raw, "message")
    assert (message.priority, message.ttl_seconds, message.client_id) == (1, 60, producer_key("p", 7))
