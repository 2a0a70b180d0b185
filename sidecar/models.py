"""The sidecar API's request and response bodies: validated here, described in the OpenAPI document.

A published and a delivered message have the shape of a CloudEvent in structured JSON
mode (`specversion`, `id`, `source`, `type`, `time`, `datacontenttype`, `data` or
`data_base64`), so apps and tools that speak CloudEvents read them as they are. casque's
own fields are CloudEvents extension attributes (lowercase, no separators): `partitionkey`
(the CloudEvents partitioning extension), `traceparent` and `tracestate` (the distributed
tracing extension), `messageid` (the id casque gave the message), `priority`,
`deliverycount`, `receipt`, `shard`, `batch`, `seq`, `visibleuntil`, `expiresat`, and
`schemaversion` (the version of the queue's schema the message was checked against at
publish, on queues with a schema).
Application attributes travel in `attributes`. Publishing also takes casque's scheduling
fields `delay`, `deliverAt` and `priority`.

The producer's `id`, `source`, `type`, `subject`, `time`, `dataschema` and trace context
are kept in the message's attributes under `ce-` names, which apps cannot use (the
engine's own attributes are `casque-`), and come back as the event's attributes on
receive and push. `id` and `source` together name an event (the CloudEvents rule), so
they are also the idempotency key; see `dedup_key`.

The other bodies use camelCase. Every body refuses unknown fields: a misspelt `delay`
must not publish at once a message that was meant to wait.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    RootModel,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from casque.engine.messages import (
    DEFAULT_EVENT_TYPE,
    ENGINE_ATTRIBUTE_PREFIX,
    ENGINE_CLIENT_ID_PREFIXES,
    EVENT_ATTRIBUTES,
    SCHEMA_VERSION_ATTRIBUTE,
    Delivery,
    OutgoingMessage,
    Published,
    event_source_of,
    reserved_client_id,
)
from casque.engine.sequences import MAX_SEQUENCE, producer_key
from casque.engine.stats import QueueStats, SubscriberStats
from casque.schema import MAX_RETENTION_SECONDS, NAME_PATTERN, QueueRef
from casque.sidecar import strictjson
from casque.specs import MAX_PRIORITIES, priority_of

MAX_BATCH_MESSAGES = 1000
MAX_RECEIVE = 1000
MAX_RECEIPTS = 1000
MAX_VISIBILITY_SECONDS = 12 * 3600
MAX_ATTRIBUTES = 64
SPECVERSION: Literal["1.0"] = "1.0"
DEFAULT_TYPE = DEFAULT_EVENT_TYPE
# CloudEvents attributes of a published event ride in these message attributes.
CE_ATTRIBUTES = EVENT_ATTRIBUTES
# W3C trace context, version 00: version-traceid-parentid-flags. A later version may append
# fields after the flags; its first four read the same way.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACESTATE = 512
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"


def _encodable(value: str) -> str:
    # A JSON string may carry an unpaired surrogate ("\ud800"); Cassandra's text columns
    # and our size accounting need real UTF-8, so refuse it here as bad input.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError("text must be valid Unicode (no unpaired surrogates)") from error
    return value


Text = Annotated[str, AfterValidator(_encodable)]


def _integral(value: object) -> object:
    """JSON has one kind of number: 47.0 is the integer 47, as JSON Schema's `integer` says
    (the document promises that); any other float stays one and is refused as not an integer."""
    return int(value) if type(value) is float and value.is_integer() else value


# After an int's own constraints (`Annotated[int, Field(...), INTEGRAL]`): so they stay in its JSON Schema.
INTEGRAL = BeforeValidator(_integral)


# Rules between members that no one member's schema says, for the OpenAPI document. A member
# sent as null counts as left out, as the validators below read it.
def _given(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _exactly_one_of(*names: str) -> dict[str, Any]:
    # (A client generator may need to be told to keep the properties beside a oneOf of
    # `required` alone: openapi-generator's REMOVE_ANYOF_ONEOF_AND_KEEP_PROPERTIES_ONLY.)
    return {"oneOf": [_given(name) for name in names]}


def _together(first: str, second: str) -> list[dict[str, Any]]:
    return [{"if": _given(first), "then": _given(second)}, {"if": _given(second), "then": _given(first)}]


def _not_both(first: str, second: str) -> dict[str, Any]:
    return {"not": {"allOf": [_given(first), _given(second)]}}


def _in_utc_range(value: datetime) -> datetime:
    # 9999-12-31T23:59:59-23:59 is a valid timestamp whose UTC form lies past year 9999:
    # Python cannot represent it, so it is refused here rather than failing later.
    try:
        value.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError("the time is outside what can be expressed in UTC (years 1 to 9999)") from None
    return value


Instant = Annotated[AwareDatetime, AfterValidator(_in_utc_range)]


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
AttributeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$"), AfterValidator(_encodable)]
# A receipt is 24 bytes (casque.engine.messages.encode_receipt) in unpadded base64url: 32
# characters. One sent alone must be one; one of a list may be anything of its alphabet, and
# a malformed one gets its own `invalid_receipt` result beside the others'.
Receipt = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{32}$")]
ListedReceipt = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_-]+$")]
# Attribute names the API refuses: CloudEvents' own header prefix, and the engine's.
_RESERVED_ATTRIBUTE = r"^([cC][eE]-|[cC][aA][sS][qQ][uU][eE]-)"
_RESERVED_ID = "^(" + "|".join(re.escape(prefix) for prefix in ENGINE_CLIENT_ID_PREFIXES) + ")"
# Refused in `id` and `source` (_no_nul).
_NUL = "\\x00"
# A content type whose `data` is JSON (is_json_type), as a pattern; any other takes a string.
_JSON_CONTENT_TYPE = (r"^(([aA][pP][pP][lL][iI][cC][aA][tT][iI][oO][nN]|[tT][eE][xX][tT])/[jJ][sS][oO][nN]"
                      r"|[^;/]+/[^;]*\+[jJ][sS][oO][nN])(\s*;.*)?$")
Seconds = Annotated[float, Field(ge=0, le=MAX_VISIBILITY_SECONDS)]
Visibility = Annotated[float, Field(gt=0, le=MAX_VISIBILITY_SECONDS)]


# `defer_build`: a model's validator and serializer are built at its first use, not at
# import. Most calls take the quick paths (decoding.py, rendering.py, answers.py), so a
# sidecar that never meets a body they leave to the models never builds those: 1.4 MiB of
# RSS for the models below. The first call that needs one waits for its build (a few ms).


class Body(BaseModel):
    """A request body: strict JSON types, no unknown fields, finite numbers."""

    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class Reply(BaseModel):
    """A response body: camelCase on the wire."""

    model_config = ConfigDict(defer_build=True, alias_generator=to_camel, populate_by_name=True)

    def wire(self) -> dict[str, Any]:
        # Fields left unset (optional ones such as `error`) are left out; a field set to
        # None on purpose (an unknown count) is sent as null.
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def wire_json(self) -> bytes:
        """`wire()` as JSON text, serialised by pydantic's own encoder: the HTTP answers use
        this, since going through dicts and the json module cost twice as much for a
        receive of 100 messages."""
        return self.model_dump_json(by_alias=True, exclude_unset=True).encode()


# --- errors -------------------------------------------------------------------------------
class ErrorDetail(Reply):
    field: str
    problem: str
    # Set for a schema violation (code schema_violation): where in the message's data
    # (a JSON pointer, "" for the whole), the schema keyword that failed, and the version.
    path: str | None = Field(default=None, description="JSON pointer into the message's data (schema_violation).")
    rule: str | None = Field(default=None, description="The schema keyword that failed (schema_violation).")
    schema_version: int | None = Field(default=None, description="The queue schema version checked against.")


class ErrorBody(Reply):
    code: str = Field(description="Stable, machine-readable: queue_not_found, stale_receipt, ...")
    message: str = Field(description="For people; wording may change.")
    details: list[ErrorDetail] | None = None


class ErrorResponse(Reply):
    error: ErrorBody


# --- publishing ---------------------------------------------------------------------------
def is_json_type(content_type: str | None) -> bool:
    """Whether a content type is JSON (absent: JSON too, the default of `data`)."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")


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
        {"if": _given("data_base64"), "then": {"not": {"required": ["data"]}}},
        _not_both("delay", "deliverAt"),
        *_together("producerid", "producerseq"),
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
    time: Instant | None = Field(default=None, description="When the event happened (the producer's time).")
    dataschema: Annotated[Text | None, Field(min_length=1, max_length=1024)] = None
    traceparent: Annotated[str | None, Field(max_length=512)] = Field(
        default=None, description="W3C trace context of the event's creation (CloudEvents distributed tracing). "
        "The request's `traceparent` header is used when absent; a malformed one is ignored."
    )
    tracestate: Annotated[str | None, Field(max_length=MAX_TRACESTATE)] = None
    datacontenttype: Annotated[
        str, Field(max_length=256, pattern=r"^[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(\s*;.*)?$"),
        AfterValidator(_encodable),
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
            _encodable(self.data)
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
                value = value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
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
        description="Written all or none: one invalid message refuses the whole request."
    )


class PublishEventBatch(RootModel[Annotated[list[PublishMessage], Field(min_length=1, max_length=MAX_BATCH_MESSAGES)]]):
    """CloudEvents batch mode (`application/cloudevents-batch+json`): a JSON array of events, all or none."""

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


# --- receiving ----------------------------------------------------------------------------
class ReceiveRequest(Body):
    max_messages: Annotated[int, Field(ge=1, le=MAX_RECEIVE), INTEGRAL] = Field(default=10, alias="max")
    wait: Seconds = Field(default=0.0, description="Seconds to wait for a first message (long poll).")
    visibility: Visibility | None = Field(
        default=None, description="Seconds the messages stay invisible to others (default: the Subscriber's)."
    )


class Message(BaseModel):
    """A delivered message: a CloudEvent with casque's extension attributes."""

    model_config = ConfigDict(defer_build=True, populate_by_name=True)

    specversion: Literal["1.0"] = SPECVERSION
    id: str = Field(description="The producer's id when it gave one, else casque's message id.")
    source: str
    type: str
    subject: str | None = None
    time: datetime = Field(description="The producer's time when it gave one, else when casque wrote the message.")
    dataschema: str | None = None
    datacontenttype: str | None = None
    data: JsonValue = None
    data_base64: str | None = None
    partitionkey: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    messageid: str = Field(description="The id casque gave the message when it was written (publish's messageId).")
    publishedat: datetime | None = Field(
        default=None, description="When casque wrote the message; given when `time` is the producer's."
    )
    attributes: dict[str, str] = Field(default_factory=dict)
    priority: int = 0
    deliverycount: int = Field(description="1 on first delivery; counts redeliveries after nack or expiry.")
    receipt: str = Field(description="Names this delivery; ack, nack and extend take it.")
    shard: int
    batch: int
    seq: int
    visibleuntil: datetime = Field(description="When the message is handed out again unless acked.")
    expiresat: datetime | None = None
    schemaversion: int | None = Field(
        default=None, description="The version of the queue's schema the message was checked against at publish."
    )

    def wire(self) -> dict[str, Any]:
        # `data` may be a JSON null on purpose; absent fields are left out.
        return self.model_dump(mode="json", exclude_unset=True)


def source_of(queue: QueueRef) -> str:
    return event_source_of(queue.namespace, queue.name)


_TIME = TypeAdapter(datetime)


def _is_time(value: str) -> bool:
    # This API only stores valid times as `ce-time`; a message written another way (the
    # engine's own publisher, a replay) may carry anything there, and keeps it as an attribute.
    try:
        _TIME.validate_python(value)
    except ValidationError:
        return False
    return True


def envelope(delivery: Delivery, queue: QueueRef, raw: bool = False) -> Message:
    """The CloudEvent for one delivery; with `raw`, the payload as `data_base64` whatever its type."""
    stored = delivery.message
    attributes = dict(stored.attributes)
    fields: dict[str, Any] = {
        "specversion": SPECVERSION,
        "id": attributes.pop(CE_ATTRIBUTES["id"], stored.message_id),
        "type": attributes.pop(CE_ATTRIBUTES["type"], DEFAULT_TYPE),
        "source": attributes.pop(CE_ATTRIBUTES["source"], source_of(queue)),
        "time": stored.published_at,
        "messageid": stored.message_id,
        "attributes": attributes,
        "priority": priority_of(stored.position.shard),
        "deliverycount": delivery.delivery_count,
        "receipt": delivery.receipt,
        "shard": stored.position.shard,
        "batch": stored.position.batch,
        "seq": stored.position.seq,
        # The engine keeps deadlines on the monotonic clock; apps need a wall-clock time.
        "visibleuntil": wall_clock(delivery.visible_until),
    }
    produced = attributes.get(CE_ATTRIBUTES["time"])
    if produced is not None and _is_time(produced):
        del attributes[CE_ATTRIBUTES["time"]]
        fields["time"] = produced
        fields["publishedat"] = stored.published_at
    for name in ("subject", "dataschema", "traceparent", "tracestate"):
        value = attributes.pop(CE_ATTRIBUTES[name], None)
        if value is not None:
            fields[name] = value
    version = attributes.pop(SCHEMA_VERSION_ATTRIBUTE, None)
    if version is not None and version.isdigit():
        fields["schemaversion"] = int(version)
    if stored.key is not None:
        fields["partitionkey"] = stored.key
    if stored.expires_at is not None:
        fields["expiresat"] = stored.expires_at
    if stored.content_type is not None:
        fields["datacontenttype"] = stored.content_type
    if raw:
        fields["data_base64"] = base64.b64encode(stored.payload).decode("ascii")
    else:
        fields.update(_data_fields(stored.payload, stored.content_type))
    return Message(**fields)



def _data_fields(payload: bytes, content_type: str | None) -> dict[str, Any]:
    """`data` when the payload reads as its content type says (JSON or text), else `data_base64`."""
    if not payload and content_type is None:
        return {}
    media = (content_type or "").split(";", 1)[0].strip().lower()
    try:
        if content_type is not None and is_json_type(content_type):
            return {"data": strictjson.loads(payload)}
        if media.startswith("text/"):
            return {"data": payload.decode("utf-8")}
    except ValueError:  # not what the content type claims: hand the bytes over untouched
        pass
    return {"data_base64": base64.b64encode(payload).decode("ascii")}


def wall_clock(monotonic_deadline: float) -> datetime:
    return datetime.fromtimestamp(time.time() + (monotonic_deadline - time.monotonic()), timezone.utc)


class ReceiveResult(Reply):
    messages: list[Message]

    def wire(self) -> dict[str, Any]:
        return {"messages": [m.wire() for m in self.messages]}

    def wire_json(self) -> bytes:
        # Message has no aliases, so by_alias changes nothing inside it (a unit test checks
        # that both forms agree).
        return self.model_dump_json(by_alias=True, exclude_unset=True).encode()


# --- ack, nack, extend --------------------------------------------------------------------
class _Receipts(Body):
    receipt: Receipt | None = Field(default=None, description="One delivery; errors are answered with a 4xx.")
    receipts: Annotated[list[ListedReceipt] | None, Field(min_length=1, max_length=MAX_RECEIPTS)] = Field(
        default=None, description="Several deliveries; each gets its own result, errors included."
    )

    @model_validator(mode="after")
    def _one_form(self) -> _Receipts:
        problem = self._form_problem()
        if problem is not None:
            raise ValueError(problem)
        return self

    def _form_problem(self) -> str | None:
        if (self.receipt is None) == (self.receipts is None):
            return "give either receipt or receipts"
        return None

    @property
    def single(self) -> bool:
        return self.receipt is not None

    @property
    def all(self) -> list[str]:
        return [self.receipt] if self.receipt is not None else list(self.receipts or [])


def _outputs_without_keys(schema: dict[str, Any]) -> None:
    """An output message leaves its idempotency key to the engine: no id, producerid or producerseq."""
    messages = schema["properties"]["messages"]
    messages["items"] = {"allOf": [messages["items"], {
        "not": {"anyOf": [_given(name) for name in ("id", "producerid", "producerseq")]}}]}


class PipelineOutputs(Body):
    """The messages an acked delivery resulted in (casque.engine.pipelines)."""

    model_config = ConfigDict(json_schema_extra=_outputs_without_keys)

    queue: Annotated[str, Field(pattern=NAME_PATTERN.pattern)] = Field(
        description="The queue of this namespace the messages go to."
    )
    messages: Annotated[list[PublishMessage], Field(min_length=1, max_length=MAX_BATCH_MESSAGES)] = Field(
        description="Published all or none, each exactly once per acked delivery's message and subscriber."
    )

    @model_validator(mode="after")
    def _keys_derived(self) -> PipelineOutputs:
        for index, message in enumerate(self.messages):
            if message.id is not None or message.producerid is not None or message.producerseq is not None:
                raise ValueError(f"messages[{index}]: an output's idempotency key is derived from the message "
                                 "it results from: leave out id, producerid and producerseq")
        return self


class PipelineAck(Body):
    receipt: ListedReceipt
    publish: PipelineOutputs | None = Field(default=None, description="What the message resulted in.")


class AckRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra={
        **_exactly_one_of("receipt", "receipts", "acks"),
        "if": _given("publish"), "then": _given("receipt"),
    })

    publish: PipelineOutputs | None = Field(
        default=None, description="With `receipt`: messages to publish as the result of the acked one, exactly "
        "once however often the ack is sent again or the message delivered again.",
    )
    acks: Annotated[list[PipelineAck] | None, Field(min_length=1, max_length=MAX_RECEIPTS)] = Field(
        default=None, description="Several deliveries, each with the messages it resulted in; each gets its own "
        "result, errors included.",
    )

    def _form_problem(self) -> str | None:
        if sum(form is not None for form in (self.receipt, self.receipts, self.acks)) != 1:
            return "give one of receipt, receipts or acks"
        if self.publish is not None and self.receipt is None:
            return "publish goes with receipt; for several deliveries, give acks"
        return None

    @property
    def all(self) -> list[str]:
        if self.acks is not None:
            return [item.receipt for item in self.acks]
        return super().all

    @property
    def pipelined(self) -> list[PipelineAck] | None:
        """Each delivery with its outputs, when any has some; None for a plain ack."""
        if self.publish is not None:
            assert self.receipt is not None
            return [PipelineAck(receipt=self.receipt, publish=self.publish)]
        return self.acks if self.acks is not None and any(a.publish for a in self.acks) else None


class NackRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra=_exactly_one_of("receipt", "receipts"))

    delay: Seconds | None = Field(
        default=None, description="Seconds before the message is delivered again. Left out: after the "
        "subscriber's retry backoff (`spec.retry`), or at once if it has none.",
    )
    error: Annotated[Text | None, Field(max_length=1024)] = Field(
        default=None, description="Why it failed: kept in the message's history if it is dead-lettered."
    )


class ExtendRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra=_exactly_one_of("receipt", "receipts"))

    visibility: Visibility = Field(description="Seconds from now during which the message stays invisible.")


class ReceiptResult(Reply):
    receipt: str
    status: Literal["acked", "already_acked", "nacked", "extended"] | None = None
    visible_until: datetime | None = None
    published: list[PublishResult] | None = Field(
        default=None, description="An ack with `publish`: where its messages are (`duplicate` when an earlier "
        "ack of the same message published them). Absent when the delivery was acked before.",
    )
    error: ErrorBody | None = None


class ReceiptResults(Reply):
    results: list[ReceiptResult] = Field(description="In the order of the request's receipts.")


# --- seek ---------------------------------------------------------------------------------
class SeekRequest(Body):
    model_config = ConfigDict(json_schema_extra=_exactly_one_of("to", "time", "batches"))

    to: Literal["earliest", "latest"] | None = None
    time: Instant | None = Field(default=None, description="The first batch published at or after this time.")
    batches: Annotated[
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,5}$")], Annotated[int, Field(ge=1, le=2**62), INTEGRAL]] | None,
        Field(min_length=1),
    ] = Field(default=None, description="Shard number -> the batch to read next; other shards stay.",
              json_schema_extra={"additionalProperties": False})

    @model_validator(mode="after")
    def _one_target(self) -> SeekRequest:
        given = [name for name in ("to", "time", "batches") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of to, time or batches")
        return self


class SeekResult(Reply):
    offsets: dict[str, int] = Field(description="Shard -> the batch each shard reads next.")


# --- stats --------------------------------------------------------------------------------
class ShardStatsBody(Reply):
    shard: int
    priority: int
    head: int
    published_messages: int | None
    published_bytes: int | None
    last_published_at: datetime | None


class QueueStatsResult(Reply):
    queue: str
    published_messages: int | None
    published_bytes: int | None
    published_by_priority: dict[str, int | None]
    delayed: int = Field(description="Published with a delay and not yet due.")
    batches: int
    shards: list[ShardStatsBody]
    sampled_at: datetime

    @classmethod
    def of(cls, stats: QueueStats) -> QueueStatsResult:
        return cls(
            queue=stats.queue,
            published_messages=stats.published_messages,
            published_bytes=stats.published_bytes,
            published_by_priority={str(p): n for p, n in sorted(stats.published_by_priority().items())},
            delayed=stats.delayed,
            batches=stats.batches,
            shards=[
                ShardStatsBody(
                    shard=s.shard,
                    priority=priority_of(s.shard),
                    head=s.head,
                    published_messages=s.published_messages,
                    published_bytes=s.published_bytes,
                    last_published_at=s.last_published_at,
                )
                for s in stats.shards
            ],
            sampled_at=stats.sampled_at,
        )


class SubscriberShardStatsBody(Reply):
    shard: int
    priority: int
    offset: int
    head: int
    lag_batches: int
    lag_messages: int | None
    oldest_unacked_at: datetime | None
    leased_by: str | None
    # A stall: lag, and the offset unmoved since `stalledSince` for at least stallAfterSeconds.
    stalled: bool = False
    stalled_since: datetime | None = None
    offset_moved_at: datetime | None = None


class SubscriberStatsResult(Reply):
    queue: str
    subscriber: str
    lag_batches: int
    lag_messages: int | None
    lag_by_priority: dict[str, int | None]
    oldest_unacked_age_seconds: float | None
    in_flight: int
    delivered: int
    redelivered: int
    dead_lettered: int
    filtered: int
    members: list[str]
    shards: list[SubscriberShardStatsBody]
    sampled_at: datetime
    stall_after_seconds: float
    stalled_shards: list[int]

    @classmethod
    def of(cls, stats: SubscriberStats) -> SubscriberStatsResult:
        return cls(
            queue=stats.queue,
            subscriber=stats.subscriber,
            lag_batches=stats.lag_batches,
            lag_messages=stats.lag_messages,
            lag_by_priority={str(p): n for p, n in sorted(stats.lag_by_priority().items())},
            oldest_unacked_age_seconds=stats.oldest_unacked_age_seconds,
            in_flight=stats.in_flight,
            delivered=stats.delivered,
            redelivered=stats.redelivered,
            dead_lettered=stats.dead_lettered,
            filtered=stats.filtered,
            members=stats.members,
            shards=[
                SubscriberShardStatsBody(
                    shard=s.shard,
                    priority=priority_of(s.shard),
                    offset=s.offset,
                    head=s.head,
                    lag_batches=s.lag_batches,
                    lag_messages=s.lag_messages,
                    oldest_unacked_at=s.oldest_unacked_at,
                    leased_by=s.leased_by,
                    stalled=s.stalled_since is not None,
                    stalled_since=s.stalled_since,
                    offset_moved_at=s.offset_moved_at,
                )
                for s in stats.shards
            ],
            sampled_at=stats.sampled_at,
            stall_after_seconds=stats.stall_after_seconds,
            stalled_shards=stats.stalled_shards,
        )


HealthStatus = Literal["ok", "starting", "unready", "draining"]


class Health(Reply):
    status: HealthStatus
    checks: dict[str, str] = Field(default_factory=dict)
