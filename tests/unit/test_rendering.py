"""The one-pass rendering of delivered messages writes the bytes the pydantic model path writes."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from casque.engine.messages import SCHEMA_VERSION_ATTRIBUTE, Delivery, Position, StoredMessage
from casque.schema import QueueRef
from casque.sidecar.models import receiving
from casque.sidecar.models.receiving import envelope
from casque.sidecar.rendering import message_json, receive_body, render

QUEUE = QueueRef("default", "orders")
T0 = datetime(2026, 1, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def frozen_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # visibleuntil is read off the clocks: both paths must see the same instant.
    monkeypatch.setattr(receiving.time, "time", lambda: 1_800_000_000.25)
    monkeypatch.setattr(receiving.time, "monotonic", lambda: 1000.0)


def model_path(delivery: Delivery) -> bytes:
    return json.dumps(envelope(delivery, QUEUE).wire(), allow_nan=False, separators=(",", ":")).encode("ascii")


def delivery(payload: bytes, content_type: str | None = "application/json", key: str | None = None,
             expires_at: datetime | None = None, published_at: datetime = T0, shard: int = 0,
             **attributes: str) -> Delivery:
    message = StoredMessage(Position(shard, 7, 3), "0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f", published_at, payload,
                            key=key, attributes=attributes, content_type=content_type, expires_at=expires_at)
    return Delivery(message, "AAAAAAAAAAEAAAAAAAAAAQ", 2, 1030.5)


CASES: list[Delivery] = [
    delivery(b'{"a":[1,2.5,null,true,"x"]}'),
    delivery(b"casque-" * 146, "text/plain"),
    delivery(b"caf\xc3\xa9 \xe2\x98\x83 \xf0\x9f\x98\x80", "text/plain; charset=utf-8"),
    delivery(b"\xff\xfe", "text/plain"),
    *(delivery(b"a" + bytes([c]) + b"z", "text/plain") for c in (*range(0x20), 0x7f, ord('"'), ord("\\"), 0x80)),
    delivery(b"\x00\x01", None),
    delivery(b"", None),
    delivery(b"", "application/json"),
    delivery(b"", "text/plain"),
    delivery(b"{nope", "application/json"),
    delivery(b"[NaN]"),
    delivery(b'{"n": 1e999}'),
    delivery(b'"\\ud800 lone"'),
    delivery(b"[" * 255 + b"]" * 255),
    delivery(b"[" * 256 + b"]" * 256),
    delivery(b'{"s": "[[[[' + b"[" * 300 + b'"}'),
    delivery(b"12345678901234567890123456789", "application/cloudevents+json"),
    delivery(b'{"a":1}', "Application/JSON ; charset=utf-8"),
    delivery(b"x", "image/png", key="k\u00e9y \"quoted\""),
    delivery(b"1", expires_at=T0 + timedelta(seconds=30)),
    delivery(b"1", expires_at=datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=2)))),
    delivery(b"1", published_at=datetime(2026, 1, 1, 0, 0)),
    delivery(b"1", published_at=datetime(2026, 1, 1, tzinfo=timezone(timedelta(seconds=30)))),
    delivery(b"1", shard=3_000_007),
    delivery(b"1", **{"ce-id": "e-1", "ce-source": "/src", "ce-type": "t", "ce-subject": "s\n\t",
                      "ce-time": "2026-02-03T04:05:06+01:00", "ce-dataschema": "https://x/y",
                      "ce-traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                      "ce-tracestate": "a=b", "app": "v\u2028", SCHEMA_VERSION_ATTRIBUTE: "3"}),
    delivery(b"1", **{"ce-time": "not a time", SCHEMA_VERSION_ATTRIBUTE: "x3"}),
    delivery(b"1", **{"ce-time": "1700000000"}),
    delivery(b"1", **{"ce-time": "2026-02-03T04:05:06.123Z"}),
]


@pytest.mark.parametrize("case", CASES)
def test_each_case_renders_as_the_model_path_does(case: Delivery) -> None:
    try:
        expected = model_path(case)
    except (ValueError, TypeError, RecursionError):
        # What the model path cannot render goes through its own fallback, as before.
        expected = json.dumps(envelope(case, QUEUE, raw=True).wire(), separators=(",", ":")).encode()
        assert "data_base64" in json.loads(expected)
    assert message_json(case, QUEUE) == expected


def test_what_render_leaves_to_the_model_path() -> None:
    assert render(delivery(b"[" * 256 + b"]" * 256), QUEUE) is None  # deeper than pydantic's JsonValue takes
    assert render(delivery(b"1", published_at=datetime(2026, 1, 1, 0, 0)), QUEUE) is None  # no zone
    with pytest.raises(ValueError):
        render(delivery(b'{"n": 1e999}'), QUEUE)  # infinity: JSON has no form for it
    assert render(delivery(b"casque-", "text/plain"), QUEUE) is not None


def test_a_superscript_schema_version_fails_as_before() -> None:
    # "²".isdigit() holds but int("²") raises: the model path raised, and still does.
    with pytest.raises(ValueError):
        message_json(delivery(b"1", **{SCHEMA_VERSION_ATTRIBUTE: "\u00b2"}), QUEUE)


def test_a_receive_body_is_the_messages_in_order() -> None:
    body = json.loads(receive_body(CASES[:3], QUEUE))
    assert [m["data"] for m in body["messages"]][:2] == [{"a": [1, 2.5, None, True, "x"]}, "casque-" * 146]
    assert receive_body([], QUEUE) == b'{"messages":[]}'


def test_a_receive_body_writes_shared_times_as_each_message_would() -> None:
    # Times written once per receive are the same text for every message that shares them.
    cases = [delivery(b"1", expires_at=T0 + timedelta(seconds=30)) for _ in range(3)] + CASES
    renderable = [c for c in cases if _renders(c)]
    assert receive_body(renderable, QUEUE) == b'{"messages":[' + b",".join(map(model_path, renderable)) + b"]}"


def _renders(case: Delivery) -> bool:
    try:
        model_path(case)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
json_values: Any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=json_values, content_type=st.sampled_from([None, "application/json", "text/plain", "text/csv; x=y",
                                                        "application/octet-stream", "application/x+json"]),
       attributes=st.dictionaries(st.sampled_from(["ce-id", "ce-type", "ce-source", "ce-subject", "ce-time",
                                                   "ce-traceparent", "a", "b/c", SCHEMA_VERSION_ATTRIBUTE]),
                                  text, max_size=5),
       key=st.none() | text, raw=st.binary(max_size=12), use_raw=st.booleans())
def test_any_message_renders_as_the_model_path_does(value: Any, content_type: str | None, attributes: dict[str, str],
                                                    key: str | None, raw: bytes, use_raw: bool) -> None:
    payload = raw if use_raw else json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    case = delivery(payload, content_type, key=key, **attributes)
    try:
        expected = model_path(case)
    except (ValueError, TypeError, RecursionError):
        return  # as above: the model path's own fallback renders those
    assert message_json(case, QUEUE) == expected
