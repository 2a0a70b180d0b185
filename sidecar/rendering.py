"""Delivered messages as JSON: each one rendered in one pass, straight to text.

`models.receiving.envelope` builds a pydantic `Message` per delivery, dumps it to a dict and the json
module encodes the dict: three passes and a model per message, the largest share of a
receive of 100 (py-spy: 13% of the sidecar's CPU receiving and acking 100 per call).
`render` writes the same JSON text directly, field by field in `Message`'s order, with
the json module's own C string encoder; strings are escaped to ASCII and numbers written
as `json.dumps` writes them, so the bytes are those of the model path.

Whatever `render` is not sure to write exactly as the model path would (a time zone other
than UTC, a payload nested deeper than pydantic takes, a number JSON has no form for, a
stored attribute that does not parse), it leaves to that path: `message_json` then renders
the message through `models.receiving.envelope` as before, with its fallback to `data_base64` for a
message that cannot go as JSON. tests/unit/test_rendering.py compares both on such cases.
"""

from __future__ import annotations

import base64
import json
import logging
from datetime import datetime, timezone
from json.encoder import encode_basestring_ascii
from typing import Any

from pydantic import TypeAdapter, ValidationError

from casque.engine.messages import SCHEMA_VERSION_ATTRIBUTE, Delivery
from casque.schema import QueueRef
from casque.sidecar import strictjson
from casque.sidecar.models.base import is_json_type
from casque.sidecar.models.receiving import DEFAULT_TYPE, envelope, source_of, wall_clock
from casque.specs import priority_of

log = logging.getLogger(__name__)

# pydantic's JsonValue refuses data nested deeper than this; a payload with more brackets
# than that (strings included, to count cheaply) goes the model path, which decides.
MAX_QUICK_BRACKETS = 255
_TIME = TypeAdapter(datetime)
# The ASCII bytes json's encoder escapes (controls, DEL, quote, backslash): text without any
# of them is its own JSON string, quoted.
_ESCAPED_ASCII = bytes(range(0x20)) + b'\x7f"\\'


def message_json(delivery: Delivery, queue: QueueRef, times: dict[float | datetime, str | None] | None = None
                 ) -> bytes:
    """One delivered message as JSON, built on its own.

    A payload that its content type calls JSON but that cannot be rendered as JSON (nested
    deeper than the parsers go, non-finite numbers, stored before such checks existed) goes
    as `data_base64` instead: the bytes reach the app untouched, and neither the receive that
    carries it nor the other messages in it fail. Otherwise one such message would fail
    every receive that includes it, and be dead-lettered with its neighbours.
    """
    try:
        quick = render(delivery, queue, {} if times is None else times)
    except (ValueError, TypeError, RecursionError):
        quick = None
    if quick is not None:
        return quick
    try:
        return _dumps(envelope(delivery, queue).wire())
    except (ValueError, TypeError, RecursionError) as error:  # pydantic's ValidationError is a ValueError
        log.warning("message %s at %s is not renderable as JSON (%s); delivered as data_base64",
                    delivery.message.message_id, delivery.message.position, type(error).__name__)
        return _dumps(envelope(delivery, queue, raw=True).wire())


def receive_body(deliveries: list[Delivery], queue: QueueRef) -> bytes:
    """A receive's answer (the shape of `ReceiveResult`), each message rendered on its own."""
    # The messages of a receive mostly share their visibility deadline and, batch by batch,
    # their publish time: each is written once per receive.
    times: dict[float | datetime, str | None] = {}
    return b'{"messages":[' + b",".join([message_json(d, queue, times) for d in deliveries]) + b"]}"


def render(delivery: Delivery, queue: QueueRef, times: dict[float | datetime, str | None] | None = None
           ) -> bytes | None:
    """The JSON `envelope(delivery, queue).wire()` encodes to, or None to leave it to that path.
    `times`: the times written so far (a publish time, or a visibility deadline) and how."""
    if times is None:
        times = {}
    stored = delivery.message
    attributes = dict(stored.attributes)
    pop = attributes.pop
    position = stored.position
    event_id = pop("ce-id", stored.message_id)
    event_type = pop("ce-type", DEFAULT_TYPE)
    source = pop("ce-source", None)
    time = _time(stored.published_at, times)
    if time is None:
        return None
    published = None
    produced = attributes.get("ce-time")
    if produced is not None:
        given = _produced_time(produced)
        if given is not None:
            del attributes["ce-time"]
            time, published = given, time
    subject = pop("ce-subject", None)
    dataschema = pop("ce-dataschema", None)
    traceparent = pop("ce-traceparent", None)
    tracestate = pop("ce-tracestate", None)
    version = pop(SCHEMA_VERSION_ATTRIBUTE, None)
    data = _data(stored.payload, stored.content_type)
    if data is None:
        return None
    parts = [
        '{"specversion":"1.0","id":', encode_basestring_ascii(event_id),
        ',"source":', encode_basestring_ascii(source_of(queue) if source is None else source),
        ',"type":', encode_basestring_ascii(event_type),
    ]
    if subject is not None:
        parts += (',"subject":', encode_basestring_ascii(subject))
    parts += (',"time":', time)
    if dataschema is not None:
        parts += (',"dataschema":', encode_basestring_ascii(dataschema))
    if stored.content_type is not None:
        parts += (',"datacontenttype":', encode_basestring_ascii(stored.content_type))
    parts.append(data)
    if stored.key is not None:
        parts += (',"partitionkey":', encode_basestring_ascii(stored.key))
    if traceparent is not None:
        parts += (',"traceparent":', encode_basestring_ascii(traceparent))
    if tracestate is not None:
        parts += (',"tracestate":', encode_basestring_ascii(tracestate))
    parts += (',"messageid":', encode_basestring_ascii(stored.message_id))
    if published is not None:
        parts += (',"publishedat":', published)
    parts.append(',"attributes":{')
    parts.append(",".join([encode_basestring_ascii(k) + ":" + encode_basestring_ascii(v)
                           for k, v in attributes.items()]))
    visible = times.get(delivery.visible_until)
    if visible is None:
        visible = times[delivery.visible_until] = _time(wall_clock(delivery.visible_until), times)
    if visible is None:
        return None
    parts += (
        '},"priority":', str(priority_of(position.shard)), ',"deliverycount":', str(delivery.delivery_count),
        ',"receipt":', encode_basestring_ascii(delivery.receipt), ',"shard":', str(position.shard),
        ',"batch":', str(position.batch), ',"seq":', str(position.seq), ',"visibleuntil":', visible,
    )
    if stored.expires_at is not None:
        expires = _time(stored.expires_at, times)
        if expires is None:
            return None
        parts += (',"expiresat":', expires)
    if version is not None and version.isdigit():
        parts += (',"schemaversion":', str(int(version)))
    parts.append("}")
    return "".join(parts).encode("ascii")


def _time(moment: datetime, times: dict[float | datetime, str | None] | None = None) -> str | None:
    """A UTC time as pydantic writes it (`2026-01-02T03:04:05.000006Z`, the fraction only when
    not zero, as isoformat), quoted; None for any other zone, which the model path writes.
    `times` keeps those written: UTC times equal as datetimes are written alike."""
    if moment.tzinfo is not timezone.utc:
        return None
    text = None if times is None else times.get(moment)
    if text is None:
        text = f'"{moment.isoformat()[:-6]}Z"'
        if times is not None:
            times[moment] = text
    return text


def _produced_time(value: str) -> str | None:
    """A stored `ce-time` as the model path writes it: parsed and written again by pydantic,
    quoted; None when it is no time (it then stays an attribute, as `envelope` keeps it)."""
    try:
        return _TIME.dump_json(_TIME.validate_python(value)).decode("ascii")
    except ValidationError:
        return None


def _data(payload: bytes, content_type: str | None) -> str | None:
    """`,"data":...` or `,"data_base64":...` as `models.receiving._data_fields` chooses them ("" for
    neither); None when the model path must decide (see the module's docstring)."""
    if not payload and content_type is None:
        return ""
    if content_type is not None and is_json_type(content_type):
        if payload.count(b"[") + payload.count(b"{") > MAX_QUICK_BRACKETS:
            return None
        try:
            value = strictjson.loads(payload)
        except ValueError:
            return _base64(payload)
        # allow_nan=False raises for 1e999 (read as infinity): the model path decides then.
        return ',"data":' + json.dumps(value, allow_nan=False, separators=(",", ":"))
    if content_type is not None and content_type.split(";", 1)[0].strip().lower().startswith("text/"):
        if payload.isascii() and len(payload.translate(None, _ESCAPED_ASCII)) == len(payload):
            return ',"data":"' + payload.decode("ascii") + '"'  # nothing to escape: 2-4x quicker
        try:
            text = payload.decode("utf-8")
        except ValueError:
            return _base64(payload)
        return ',"data":' + encode_basestring_ascii(text)
    return _base64(payload)


def _base64(payload: bytes) -> str:
    return ',"data_base64":"' + base64.b64encode(payload).decode("ascii") + '"'



def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("ascii")
