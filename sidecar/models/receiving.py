"""A receive and its answer, each delivery a CloudEvent (`envelope`); and a seek, which
moves where a subscriber reads next."""

from __future__ import annotations

import base64
import time
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from casque.engine.messages import (
    DEFAULT_EVENT_TYPE,
    SCHEMA_VERSION_ATTRIBUTE,
    Delivery,
    event_source_of,
)
from casque.schema import QueueRef
from casque.sidecar import strictjson
from casque.sidecar.models.base import (
    CE_ATTRIBUTES,
    INTEGRAL,
    Body,
    Instant,
    Reply,
    Seconds,
    Visibility,
    exactly_one_of,
    is_json_type,
)
from casque.specs import priority_of

MAX_RECEIVE = 1000
SPECVERSION: Literal["1.0"] = "1.0"
DEFAULT_TYPE = DEFAULT_EVENT_TYPE


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


class SeekRequest(Body):
    model_config = ConfigDict(json_schema_extra=exactly_one_of("to", "time", "batches"))

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
