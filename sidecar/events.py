"""CloudEvents over HTTP: the three content modes a publish may come in.

- structured: one event as a JSON object (`application/json` or `application/cloudevents+json`);
- batch: a JSON array of events (`application/cloudevents-batch+json`), answered as a publishBatch
  like a `publishBatch`;
- binary: the payload is the body, as it is, under its own `Content-Type`, and the event's
  attributes are `ce-*` headers (`ce-id`, `ce-source`, `ce-type`, ...). The distributed
  tracing extension may also come as the W3C `traceparent`/`tracestate` headers.

A request is in binary mode when it carries `ce-specversion`. Browsers cannot send that
header cross-site without a CORS preflight, which the sidecar never grants, so accepting
any content type in binary mode opens nothing to web pages (guards.py).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from casque.sidecar.errors import InvalidRequest, from_validation
from casque.sidecar.models.publishing import PublishMessage

CLOUDEVENTS_JSON = "application/cloudevents+json"
CLOUDEVENTS_BATCH = "application/cloudevents-batch+json"
SPECVERSION_HEADER = "ce-specversion"
# Binary-mode headers and the event attributes they carry; a `ce-` header not listed is
# refused, as an unknown field is in a JSON body.
_BINARY_ATTRIBUTES = (
    "id", "source", "type", "subject", "time", "dataschema", "partitionkey", "producerid", "producerseq",
    "traceparent", "tracestate",
)


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_binary(headers: Mapping[str, str]) -> bool:
    return SPECVERSION_HEADER in headers


def is_batch(content_type: str | None) -> bool:
    return media_type(content_type) == CLOUDEVENTS_BATCH


def binary_event(headers: Mapping[str, str], body: bytes) -> PublishMessage:
    """The event a binary-mode request carries (headers are case-insensitive, as aiohttp's are)."""
    if headers.get(SPECVERSION_HEADER) != "1.0":
        raise InvalidRequest(f"ce-specversion must be 1.0 (got {headers.get(SPECVERSION_HEADER, '')[:20]!r})")
    fields: dict[str, Any] = {"specversion": "1.0"}
    for name in headers:
        lowered = name.lower()
        if lowered.startswith("ce-") and lowered != SPECVERSION_HEADER and lowered[3:] not in _BINARY_ATTRIBUTES:
            raise InvalidRequest(f"header {name}: casque takes no such event attribute; application "
                                 "attributes go in structured mode's `attributes`")
    for attribute in _BINARY_ATTRIBUTES:
        value = headers.get(f"ce-{attribute}")
        if value is not None:
            fields[attribute] = value
    content_type = headers.get("Content-Type")
    if content_type:
        fields["datacontenttype"] = content_type
    if body:
        # The bytes go in as they came; the content type says how they are read back.
        fields["data_base64"] = base64.b64encode(body).decode("ascii")
    try:
        # Not strict: header values are all strings, and `time` must parse from one.
        return PublishMessage.model_validate(fields, strict=False)
    except ValidationError as error:
        raise from_validation(error) from None


def with_trace(message: PublishMessage, traceparent: str | None, tracestate: str | None) -> PublishMessage:
    """`message` with the request's trace context when it carries none of its own."""
    if traceparent is None or message.traceparent is not None:
        return message
    return message.model_copy(update={"traceparent": traceparent, "tracestate": tracestate})
