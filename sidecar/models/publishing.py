"""The publish bodies: a message as a CloudEvent (`PublishMessage`), a batch of them, and
their answers; the trace context and the idempotency key (`dedup_key`) a publish carries."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, AwareDatetime, ConfigDict, Field, JsonValue, RootModel, model_validator

from casque.engine.messages import (
    ENGINE_ATTRIBUTE_PREFIX,
    ENGINE_CLIENT_ID_PREFIXES,
    OutgoingMessage,
    Published,
    reserved_client_id,
)
from casque.engine.sequences import MAX_SEQUENCE, producer_key
from casque.instants import rfc3339
from casque.schema import MAX_RETENTION_SECONDS
from casque.sidecar.models.base import (
    CE_ATTRIBUTES,
    INTEGRAL,
    MAX_BATCH_MESSAGES,
    AttributeName,
    Body,
    ErrorResponse,
    Instant,
    Reply,
    Text,
    encodable,
    is_json_type,
    member_given,
    not_both,
    together,
)
from casque.specs import MAX_PRIORITIES

MAX_ATTRIBUTES = 64
# W3C trace context, version 00: version-traceid-parentid-flags. A later version may append
# fields after the flags; its first four read the same way.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACESTATE = 512
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"


def valid_traceparent(value: str | None) -> str | None:
    """`value` if it is a W3C traceparent a tracer can continue, else None.

    The trace context rules say a receiver that cannot parse the header starts a new trace
    rather than failing the request: a malformed traceparent is dropped, never refused.
    """
    if value is None:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return value.strip()


def valid_tracestate(value: str | None) -> str | None:
    if value is None or len(value) > MAX_TRACESTATE or not value.isascii() or not value.isprintable():
        return None
    return value.strip() or None


def _no_nul(value: str | None) -> str | None:
    # dedup_key joins source and id with NUL: with NUL refused in both, the join is unambiguous.
    if value is not None and "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def dedup_key(source: str | None, event_id: str | None) -> str | None:
    """The idempotency key of a published event: (source, id), the pair CloudEvents says is unique.

    An event without a source keeps its bare id as the key, so clients that send only `id`
    dedupe exactly as before. With a source the key starts with NUL, which no id can hold:
    it never meets a bare id, nor the engine's own key prefixes.
    """
    if event_id is None:
        return None
    if source is None:
        return event_id
    return f"\x00{source}\x00{event_id}"


# Attribute names the API refuses: CloudEvents' own header prefix, and the engine's.
_RESERVED_ATTRIBUTE = r"^([cC][eE]-|[cC][aA][sS][qQ][uU][eE]-)"
_RESERVED_ID = "^(" + "|".join(re.escape(prefix) for prefix in ENGINE_CLIENT_ID_PREFIXES) + ")"
# Refused in `id` and `source` (_no_nul).
_NUL = "\\x00"
# A content type whose `data` is JSON (is_json_type), as a pattern; any other takes a string.
_JSON_CONTENT_TYPE = (r"^(([aA][pP][pP][lL][iI][cC][aA][tT][iI][oO][nN]|[tT][eE][xX][tT])/[jJ][sS][oO][nN]"
                      r"|[^;/]+/[^;]*\+[jJ][sS][oO][nN])(\s*;.*)?$")


def json_bytes(value: JsonValue) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # An unpaired surrogate inside the JSON: escaped, it is still the same JSON value.
        return json.dumps(value, separators=(",", ":")).encode("ascii")


def non_finite(value: JsonValue) -> bool:
    """Whether a NaN or an infinity hides in the value: JSON has no such numbers, so a
    message holding one could not be delivered as JSON. Iterative: depth costs no stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class PublishMessage(Body):
    """One message, as a CloudEvent. Give `data` (JSON, or text for a text content type) or `data_base64`."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        # data_base64 excludes data, even a null one
        {"if": member_given("data_base64"), "then": {"not": {"required": ["data"]}}},
        not_both("delay", "deliverAt"),
        *together("producerid", "producerseq"),
        # data of a content type that is not JSON is text
        {"if": {"required": ["datacontenttype"], "properties": {"datacontenttype": {
            "type": "string", "not": {"pattern": _JSON_CONTENT_TYPE}}}},
         "then": {"properties": {"data": {"type": ["string", "null"]}}}},
    ]})

    specversion: Literal["1.0"] | None = None
    id: Annotated[Text | None, Field(min_length=1, max_length=256), AfterValidator(_no_nul)] = Field(
        default=None, json_schema_extra={"not": {"type": "string", "anyOf": [{"pattern": _RESERVED_ID},
                                                                            {"pattern": _NUL}]}},
        description="Idempotency key, with `source`: a publish of an (id, source) already published "
        "within 10 minutes is not written again and returns the first result with duplicate=true. "
        "Returned as the event's `id` on receive.",
    )
    type: Annotated[Text | None, Field(min_length=1, max_length=256)] = None
    source: Annotated[Text | None, Field(min_length=1, max_length=1024), AfterValidator(_no_nul)] = Field(
        default=None, json_schema_extra={"not": {"type": "string", "pattern": _NUL}})
    subject: Annotated[Text | None, Field(min_length=1, max_length=1024)] = None
    time: AwareDatetime | None = Field(default=None, description="When the event happened (the producer's time).")
    dataschema: Annotated[Text | None, Field(min_length=1, max_length=1024)] = None
    traceparent: Annotated[str | None, Field(max_length=512)] = Field(
        default=None, description="W3C trace context of the event's creation (CloudEvents distributed tracing). "
        "The request's `traceparent` header is used when absent; a malformed one is ignored."
    )
    tracestate: Annotated[str | None, Field(max_length=MAX_TRACESTATE)] = None
    datacontenttype: Annotated[
        str, Field(max_length=256, pattern=r"^[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(\s*;.*)?$"),
        AfterValidator(encodable),
    ] | None = None
    data: JsonValue = None
    data_base64: Annotated[
        str, Field(pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")
    ] | None = None
    partitionkey: Annotated[Text | None, Field(min_length=1, max_length=1024)] = Field(
        default=None, description="Messages with one key go to one shard, in publish order."
    )
    producerid: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] = Field(
        default=None, description="With `producerseq`, the idempotency key instead of (`source`, `id`): a "
        "producer that numbers its messages (an id it makes once, a number per message) is deduplicated a block "
        "of numbers at a time, far cheaper than one id at a time. The pair is kept for 10 minutes like an id.",
    )
    producerseq: Annotated[int, Field(ge=0, le=MAX_SEQUENCE), INTEGRAL] | None = Field(
        default=None, description="The message's number within its producer (`producerid`); a retry sends the "
        "same number. Numbers counting up from 0 cost least.",
    )
    attributes: Annotated[dict[AttributeName, Text], Field(max_length=MAX_ATTRIBUTES)] = Field(
        default_factory=dict, json_schema_extra={"additionalProperties": False, "propertyNames": {
            "pattern": r"^[A-Za-z0-9_.:/-]{1,128}$", "not": {"pattern": _RESERVED_ATTRIBUTE}}})
    ttl: Annotated[int, Field(ge=1, le=MAX_RETENTION_SECONDS), INTEGRAL] | None = Field(
        default=None, description="Seconds after publish when the message is no longer delivered."
    )
    priority: Annotated[int, Field(ge=0, lt=MAX_PRIORITIES), INTEGRAL] = Field(
        default=0, description="0 is the lowest level; a queue with N priorities takes 0..N-1."
    )
    delay: Annotated[float | None, Field(ge=0, le=MAX_RETENTION_SECONDS)] = Field(
        default=None, description="Seconds from now before the message is delivered (default: the queue's)."
    )
    deliver_at: Instant | None = Field(
        default=None, alias="deliverAt", description="Not delivered before this time (with a zone)."
    )

    @model_validator(mode="after")
    def _one_payload(self) -> PublishMessage:
        if self.data_base64 is not None:
            if "data" in self.model_fields_set:
                raise ValueError("give either data or data_base64, not both")
            try:
                base64.b64decode(self.data_base64, validate=True)
            except (binascii.Error, ValueError) as error:
                raise ValueError(f"data_base64 is not valid base64: {error}") from error
        elif is_json_type(self.datacontenttype):
            if non_finite(self.data):
                raise ValueError("data holds NaN or Infinity, which JSON has no numbers for")
        elif self.data is not None:
            if not isinstance(self.data, str):
                raise ValueError(f"data for content type {self.datacontenttype} must be a string (or use data_base64)")
            encodable(self.data)
        for name in self.attributes:
            if name[:3].lower() == "ce-":  # HTTP headers in binary mode: any case is one name
                raise ValueError(f"attribute {name!r}: names starting with 'ce-' (in any case) are reserved")
            if name.lower().startswith(ENGINE_ATTRIBUTE_PREFIX):
                raise ValueError(f"attribute {name!r}: names starting with {ENGINE_ATTRIBUTE_PREFIX!r} are "
                                 "written by casque itself")
        if self.id is not None and reserved_client_id(self.id):
            raise ValueError(f"id {self.id!r}: ids starting with {', '.join(ENGINE_CLIENT_ID_PREFIXES)} are "
                             "casque's own")
        if self.delay is not None and self.deliver_at is not None:
            raise ValueError("give either delay or deliverAt, not both")
        if (self.producerid is None) != (self.producerseq is None):
            raise ValueError("give producerid and producerseq together, or neither")
        return self

    def outgoing(self) -> OutgoingMessage:
        """The engine's message: payload bytes, content type, attributes, schedule."""
        content_type = self.datacontenttype
        if self.data_base64 is not None:
            payload = base64.b64decode(self.data_base64)
            content_type = content_type or BINARY_CONTENT_TYPE
        elif "data" not in self.model_fields_set:
            payload = b""
        elif is_json_type(content_type):
            payload = json_bytes(self.data)
            content_type = content_type or JSON_CONTENT_TYPE
        elif self.data is None:
            payload = b""
        else:
            assert isinstance(self.data, str)
            payload = self.data.encode("utf-8")
        attributes = dict(self.attributes)
        for field, attribute in CE_ATTRIBUTES.items():
            value = getattr(self, field)
            if field == "time" and value is not None:
                value = rfc3339(value)
            elif field == "traceparent":
                value = valid_traceparent(value)
            elif field == "tracestate":
                # A tracestate means nothing without the traceparent it belongs to.
                value = valid_tracestate(value) if valid_traceparent(self.traceparent) else None
            if value is not None:
                attributes[attribute] = value
        return OutgoingMessage(
            payload=payload,
            key=self.partitionkey,
            attributes=attributes,
            content_type=content_type,
            client_id=(dedup_key(self.source, self.id) if self.producerid is None or self.producerseq is None
                       else producer_key(self.producerid, self.producerseq)),
            ttl_seconds=self.ttl,
            priority=self.priority,
            deliver_at=self.deliver_at,
            delay_seconds=self.delay,
        )


class PublishBatchRequest(Body):
    messages: Annotated[list[PublishMessage], Field(min_length=1, max_length=MAX_BATCH_MESSAGES)] = Field(
        description="Checked all or none: one invalid message refuses the whole request. A backend failure that "
        "kept part of it out answers 503 partially_published, naming what was written."
    )


class PublishEventBatch(RootModel[Annotated[list[PublishMessage], Field(min_length=1, max_length=MAX_BATCH_MESSAGES)]]):
    """CloudEvents batch mode (`application/cloudevents-batch+json`): a JSON array of events, as a publishBatch."""

    model_config = ConfigDict(defer_build=True, strict=True)


class PublishResult(Reply):
    message_id: str
    # null for a delayed message: it enters the log (and gets its place) when due.
    shard: int | None
    batch: int | None
    seq: int | None
    duplicate: bool = Field(description="true when the id was published before; nothing new was written")
    deliver_at: datetime | None = Field(default=None, description="Set for a delayed message: when it is due.")

    @classmethod
    def of(cls, published: Published) -> PublishResult:
        if published.deliver_at is not None:
            return cls(message_id=published.message_id, shard=None, batch=None, seq=None,
                       duplicate=published.duplicate, deliver_at=published.deliver_at)
        return cls(message_id=published.message_id, shard=published.shard, batch=published.batch,
                   seq=published.seq, duplicate=published.duplicate)


class PublishBatchResult(Reply):
    results: list[PublishResult] = Field(description="In the order of the request's messages.")


class PublishBatchError(ErrorResponse):
    """A publishBatch refused: as every error, and for `partially_published` where each
    written message is."""

    results: list[PublishResult | None] | None = Field(
        default=None, description="With `partially_published`: in the order of the request's messages, where each "
        "written message is; null for one not written (its error in `error.details`, field `messages[i]`).",
    )
