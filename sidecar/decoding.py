"""Publish bodies decoded straight to the engine's messages, without a pydantic model each.

Validating a publish body through `models.publishing.PublishMessage` and turning each model into an
`OutgoingMessage` cost about 13% of the sidecar's CPU publishing 100 messages per call
(py-spy): a model, its validators and a dozen attribute reads per message. `decode_publish`
parses the body with the json module's C parser and checks the common fields by hand.

It is a quick path, never a second set of rules: it takes only bodies it can prove the
models would take, and returns what `PublishMessage.outgoing()` would have made of them.
Anything else (a field it does not check, such as `time`, `deliverAt` or `traceparent`; a
value of another type or out of range; an escaped lone surrogate, which pydantic's parser
refuses and the json module takes; data nested deeper than it looks; NaN or infinite
numbers; bytes that are not UTF-8) makes it return None, and the body goes through the
models, which accept it or refuse it with their own error answer, exactly as before.
tests/unit/test_decoding.py checks that on the refusals the models make and on generated
bodies.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any, Literal

from casque.engine.messages import ENGINE_ATTRIBUTE_PREFIX, OutgoingMessage, reserved_client_id
from casque.engine.sequences import MAX_SEQUENCE, producer_key
from casque.schema import MAX_RETENTION_SECONDS
from casque.sidecar import strictjson
from casque.sidecar.models.base import CE_ATTRIBUTES, MAX_BATCH_MESSAGES, is_json_type
from casque.sidecar.models.publishing import (
    BINARY_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    MAX_ATTRIBUTES,
    dedup_key,
    json_bytes,
    non_finite,
    valid_traceparent,
    valid_tracestate,
)
from casque.specs import MAX_PRIORITIES

Shape = Literal["message", "batch", "events"]

# (member, attribute): the CloudEvents fields kept as attributes, in outgoing()'s order.
_CE_FIELDS = tuple((name, CE_ATTRIBUTES[name]) for name in ("id", "type", "source", "subject"))
# Narrower than the model's pattern (ASCII parameters, no line breaks): whatever this takes,
# the model's takes too; the rest goes to the model.
_CONTENT_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(?:[ \t]*;[ -~]*)?")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_PRODUCER = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# Data nested deeper than this goes to the model, whose parser has a recursion limit.
MAX_QUICK_DEPTH = 32


@dataclass(frozen=True)
class Decoded:
    """Messages the quick path decoded, still without the request's trace context."""

    messages: list[OutgoingMessage]


def decode_publish(raw: bytes, shape: Shape) -> list[OutgoingMessage] | None:
    """The messages of a publish body (one message, `{"messages": [...]}`, or a CloudEvents
    batch array), as the models would make them, or None to leave the body to the models."""
    try:
        body = strictjson.loads(raw.decode("utf-8"))
        if b"\\u" in raw and _SURROGATE_ESCAPE.search(raw):
            # Escaped surrogates: a pair reads as one character, but a lone one stays a
            # surrogate, which pydantic's parser refuses and UTF-8 cannot encode.
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeDecodeError and -EncodeError, JSONDecodeError are ValueErrors
        return None
    if shape == "message":
        items = [body]
    elif shape == "batch":
        if type(body) is not dict or body.keys() != {"messages"}:
            return None
        items = body["messages"]
    else:
        items = body
    if type(items) is not list or not 1 <= len(items) <= MAX_BATCH_MESSAGES:
        return None
    messages = []
    for item in items:
        message = _message(item)
        if message is None:
            return None
        messages.append(message)
    return messages


def with_trace_context(messages: list[OutgoingMessage], context: tuple[str | None, str | None]
                       ) -> list[OutgoingMessage]:
    """The messages with `context` (the request's or the span's) as their trace context: a
    quick-path message never brings its own, so it takes the context as `_traced` gives it."""
    traceparent = valid_traceparent(context[0])
    if traceparent is None:
        return messages
    added = {CE_ATTRIBUTES["traceparent"]: traceparent}
    tracestate = valid_tracestate(context[1])
    if tracestate is not None:
        added[CE_ATTRIBUTES["tracestate"]] = tracestate
    return [replace(m, attributes={**m.attributes, **added}) for m in messages]


def _message(item: Any) -> OutgoingMessage | None:
    if type(item) is not dict:
        return None
    # Each member present is checked alone (only those present: most messages have two or
    # three), then what the members say together.
    for name, value in item.items():
        check = _CHECKS.get(name)
        if check is None or (value is not None and not check(value)):
            return None
    get = item.get
    content_type = get("datacontenttype")
    payload = _payload(item, content_type)
    if payload is None:
        return None
    producer, sequence = get("producerid"), get("producerseq")
    if (producer is None) != (sequence is None):
        return None
    priority = get("priority", 0)
    attributes = get("attributes", _NONE)
    if priority is None or attributes is None:  # neither may be null
        return None
    attributes = dict(attributes)
    if not _PLAIN.issuperset(item):
        for name, attribute in _CE_FIELDS:
            value = get(name)
            if value is not None:
                attributes[attribute] = value
    return OutgoingMessage(
        payload=payload[0],
        key=get("partitionkey"),
        attributes=attributes,
        content_type=payload[1],
        client_id=(dedup_key(get("source"), get("id")) if producer is None or sequence is None
                   else producer_key(producer, sequence)),
        ttl_seconds=get("ttl"),
        priority=priority,
    )


def _text_of(longest: int) -> Callable[[Any], bool]:
    """A text field (not null: nulls are taken before): 1 to `longest` characters. No lone
    surrogate reaches here: a body with one goes to the models."""
    return lambda value: type(value) is str and 0 < len(value) <= longest


def _content_type(value: Any) -> bool:
    if type(value) is not str:
        return False
    known = _content_types.get(value)
    if known is None:
        known = (len(value) <= 256 and _CONTENT_TYPE.fullmatch(value) is not None, is_json_type(value))
        if len(_content_types) < MAX_CONTENT_TYPES:
            _content_types[value] = known
    return known[0]


_NONE: dict[str, str] = {}
# Content types checked (whether valid, whether JSON): apps send few, and the pattern and
# the parse of the media type cost more than the lookup. A type not kept is checked again.
MAX_CONTENT_TYPES = 256
_content_types: dict[str, tuple[bool, bool]] = {}
# A message with only these members needs no CloudEvents attribute added.
_PLAIN = frozenset({"specversion", "datacontenttype", "data", "data_base64", "partitionkey", "producerid",
                    "producerseq", "attributes", "ttl", "priority"})


def _check_id(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= 256 and "\x00" not in value and not reserved_client_id(value)


def _check_source(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= 1024 and "\x00" not in value


def _anything(value: Any) -> bool:
    return True  # checked with the payload, by _payload


# The members the quick path checks, each alone; a message with any other member goes
# through the models. The payload's members are checked together, by _payload.
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "specversion": lambda value: value == "1.0" and type(value) is str,
    "id": _check_id,
    "type": _text_of(256),
    "source": _check_source,
    "subject": _text_of(1024),
    "partitionkey": _text_of(1024),
    "datacontenttype": _content_type,
    "data": _anything,
    "data_base64": _anything,
    "producerid": lambda value: type(value) is str and _PRODUCER.fullmatch(value) is not None,
    "producerseq": lambda value: type(value) is int and 0 <= value <= MAX_SEQUENCE,
    "attributes": lambda value: _attributes(value),
    "ttl": lambda value: type(value) is int and 1 <= value <= MAX_RETENTION_SECONDS,
    "priority": lambda value: type(value) is int and 0 <= value < MAX_PRIORITIES,
}


def _payload(item: dict[str, Any], content_type: str | None) -> tuple[bytes, str | None] | None:
    """(payload, content type) as `outgoing()` makes them, or None when the model decides."""
    encoded = item.get("data_base64")
    if encoded is not None:
        if "data" in item or type(encoded) is not str or not _BASE64.fullmatch(encoded):
            return None
        try:
            return base64.b64decode(encoded, validate=True), content_type or BINARY_CONTENT_TYPE
        except (binascii.Error, ValueError):
            return None
    if "data" not in item:
        return b"", content_type
    data = item["data"]
    known = None if content_type is None else _content_types.get(content_type)
    if content_type is None or (known[1] if known is not None else is_json_type(content_type)):
        if not _shallow(data) or non_finite(data):
            return None
        return json_bytes(data), content_type or JSON_CONTENT_TYPE
    if data is None:
        return b"", content_type
    if type(data) is not str:
        return None
    return data.encode("utf-8"), content_type


def _attributes(attributes: Any) -> bool:
    if type(attributes) is not dict or len(attributes) > MAX_ATTRIBUTES:
        return False
    for name, value in attributes.items():
        if type(value) is not str or not _ATTRIBUTE_NAME.fullmatch(name):
            return False
        if name[:3].lower() == "ce-" or name.lower().startswith(ENGINE_ATTRIBUTE_PREFIX):
            return False
    return True


def _shallow(value: Any) -> bool:
    """Whether JSON data nests at most MAX_QUICK_DEPTH deep (scalars at once)."""
    if type(value) not in (list, dict):
        return True
    level = [value]
    for _ in range(MAX_QUICK_DEPTH):
        inner = []
        for container in level:
            for child in (container.values() if type(container) is dict else container):
                if type(child) in (list, dict):
                    inner.append(child)
        if not inner:
            return True
        level = inner
    return False

