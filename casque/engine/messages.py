"""Messages as the engine sees them: what a publisher sends, what is stored, what a consumer gets."""

from __future__ import annotations

import base64
import binascii
import functools
import os
import re
import struct
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

from casque.errors import CasqueError


class InvalidReceipt(CasqueError):
    code = "invalid_receipt"


# Client ids the engine gives its own publishes: delayed messages moved into the log, dead
# letters, redrives, Spark replays, the outputs of an ack (casque.engine.pipelines). An app
# using one could make the engine's own publish pass for a duplicate of it, and be dropped:
# the API refuses them.
ENGINE_CLIENT_ID_PREFIXES = ("delayed/", "dlq/", "redrive/", "replay:", "pipe/")
# Attributes the engine writes (dead-letter history, redrive addressing); the API refuses them.
ENGINE_ATTRIBUTE_PREFIX = "casque-"
# The version of the queue's schema a message was checked against at publish (casque.dataschema);
# absent when the queue had no schema. Copies (dead letters, redrives, replays) keep it.
SCHEMA_VERSION_ATTRIBUTE = "casque-schema-version"


# A published CloudEvent's own attributes ride in these message attributes (apps cannot use
# `ce-` names); a message published without a type has DEFAULT_EVENT_TYPE, without a source
# its queue's (event_source_of).
EVENT_ATTRIBUTES = {
    "id": "ce-id", "type": "ce-type", "source": "ce-source", "subject": "ce-subject", "time": "ce-time",
    "dataschema": "ce-dataschema", "traceparent": "ce-traceparent", "tracestate": "ce-tracestate",
}
EVENT_ATTRIBUTE_PREFIX = "ce-"
DEFAULT_EVENT_TYPE = "casque.message"


def event_source_of(namespace: str, queue: str) -> str:
    return f"/casque/{namespace}/{queue}"


def reserved_client_id(client_id: str) -> bool:
    return client_id.startswith(ENGINE_CLIENT_ID_PREFIXES)


# Random bytes for ids, read from the OS a pool at a time: uuid4() asks the kernel for 16
# bytes on every call, and that system call was the largest single cost of a one-message
# publish's own work. The pool is dropped in a forked child, which must not repeat its
# parent's ids.
_POOL_BYTES = 16 * 256
_pool = memoryview(b"")
_pool_lock = threading.Lock()  # threads never take the same bytes


def _drop_pool() -> None:
    global _pool
    _pool = memoryview(b"")


os.register_at_fork(after_in_child=_drop_pool)


def random_uuid() -> uuid.UUID:
    """A random (version 4) UUID, as uuid.uuid4() makes, from the OS's random bytes."""
    global _pool
    with _pool_lock:
        if len(_pool) < 16:
            _pool = memoryview(os.urandom(_POOL_BYTES))
        raw, _pool = bytes(_pool[:16]), _pool[16:]
    return uuid.UUID(bytes=raw, version=4)


# Message ids are UUIDs in the layout of RFC 9562's version 7: the first 48 bits are a time in
# ms, the rest random (74 bits, version and variant aside). The time is when the message is
# due in the log (the publish, or the end of its delay), on Cassandra's clock: the message is
# written there at or after it, which is how its history finds it (casque.engine.history)
# without an index row per message. Bytes 6 and 8 carry the version and variant bits.
_VERSION_7 = bytes((b & 0x0F) | 0x70 for b in range(256))
_VARIANT = bytes((b & 0x3F) | 0x80 for b in range(256))
_MAX_ID_MS = (1 << 48) - 1
# The ids message history can trace, as text: a version 7 UUID of RFC 9562's variant, hyphenated.
MESSAGE_ID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"
_TRACEABLE_ID = re.compile(MESSAGE_ID_PATTERN[1:-1])


def time_ordered_ids(count: int, at_seconds: float) -> list[str]:
    """`count` distinct message ids for `at_seconds` (Unix time), in the UUID text form: one
    read of random bytes and one hex conversion for them all, not a UUID object per id (a
    100-message publish spent 2-3% of the sidecar's CPU making its ids one by one)."""
    if count == 0:
        return []
    stamp = min(max(int(at_seconds * 1000), 0), _MAX_ID_MS).to_bytes(6, "big").hex()
    if count == 1:
        global _pool
        with _pool_lock:
            if len(_pool) < 10:
                _pool = memoryview(os.urandom(_POOL_BYTES))
            raw, _pool = bytearray(_pool[:10]), _pool[10:]
    else:
        raw = bytearray(os.urandom(10 * count))
    raw[0::10] = raw[0::10].translate(_VERSION_7)
    raw[2::10] = raw[2::10].translate(_VARIANT)
    text = raw.hex()
    head = f"{stamp[:8]}-{stamp[8:12]}-"
    return [f"{head}{text[i:i + 4]}-{text[i + 4:i + 8]}-{text[i + 8:i + 20]}" for i in range(0, 20 * count, 20)]


def in_id_form(message_id: str) -> bool:
    """Whether `message_id` has the form casque's ids are made in (MESSAGE_ID_PATTERN)."""
    return _TRACEABLE_ID.fullmatch(message_id) is not None


def id_time(message_id: str) -> datetime | None:
    """When a message with this id was due in the log; None for an id that carries no time
    (not a version 7 UUID in the form ids are made in: made before ids carried one, or not a
    message id at all)."""
    if not in_id_form(message_id):
        return None
    try:
        return datetime.fromtimestamp((uuid.UUID(message_id).int >> 80) / 1000, timezone.utc)
    except (ValueError, OverflowError, OSError):
        return None  # a time past year 9999: casque never made it


@dataclass(frozen=True)
class OutgoingMessage:
    payload: bytes
    key: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)
    content_type: str | None = None
    # Idempotent publish: a second publish with the same id within the window returns the first result.
    client_id: str | None = None
    # How long the id is remembered, if not for the idempotency window. The engine's own
    # publishes (delayed moves, dead letters, redrives) remember theirs for as long as what
    # they copy can be read again, so that a rerun at any distance sends nothing twice.
    client_id_window_seconds: int | None = None
    # Ephemeral messages: never delivered after this many seconds from publish.
    ttl_seconds: int | None = None
    # 0 is the lowest level; a queue with N levels accepts 0..N-1.
    priority: int = 0
    # Delayed delivery: not delivered before this time (UTC). None: the queue's default delay.
    deliver_at: datetime | None = None
    # ... or this many seconds after the publish, on Cassandra's clock (casque.engine.clock),
    # not the publishing process's: a sidecar whose clock is off must not schedule early.
    delay_seconds: float | None = None

    @functools.cached_property
    def size(self) -> int:
        """Bytes counted against the queue's max message size (computed once: validation,
        batching and the claim each ask for it)."""
        return (
            len(self.payload)
            + len((self.key or "").encode())
            + sum(len(k.encode()) + len(v.encode()) for k, v in self.attributes.items())
        )


@dataclass(frozen=True)
class Published:
    """Where a published message was stored. A delayed message is not in the log yet: its
    shard, batch and seq are -1 and `deliver_at` says when it will be."""

    message_id: str
    shard: int
    batch: int
    seq: int
    duplicate: bool = False
    deliver_at: datetime | None = None


@dataclass(frozen=True)
class Position:
    """Where a message sits in a queue's log."""

    shard: int
    batch: int
    seq: int


@dataclass(frozen=True)
class StoredMessage:
    position: Position
    message_id: str
    published_at: datetime
    payload: bytes
    key: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)
    content_type: str | None = None
    expires_at: datetime | None = None

    @property
    def size(self) -> int:
        return len(self.payload)


def filter_variables(message: StoredMessage, priority: int, default_source: str) -> dict[str, object]:
    """What a subscriber filter (casque.filters.VARIABLES) sees of a message: the attributes
    and event fields the app would be delivered, absent ones as empty strings."""
    attributes = message.attributes
    return {
        "attributes": {name: value for name, value in attributes.items()
                       if not name.startswith((EVENT_ATTRIBUTE_PREFIX, ENGINE_ATTRIBUTE_PREFIX))},
        "key": message.key or "",
        "priority": priority,
        "source": attributes.get(EVENT_ATTRIBUTES["source"], default_source),
        "eventType": attributes.get(EVENT_ATTRIBUTES["type"], DEFAULT_EVENT_TYPE),
        "subject": attributes.get(EVENT_ATTRIBUTES["subject"], ""),
    }


@dataclass(frozen=True)
class Delivery:
    message: StoredMessage
    receipt: str
    delivery_count: int
    # Monotonic-clock second after which the message becomes visible again unless acked.
    visible_until: float


# A receipt names the message and the one delivery it was handed out with. The nonce changes
# with every delivery, so a worker whose visibility timeout expired cannot ack (or nack) the
# message after it was handed to someone else. Receipts are not stored: they come back to
# the sidecar that gave them out. Format 1 is these 24 bytes; a later format will be of
# another length, which this release refuses as not a receipt it reads (casque.formats).
_RECEIPT = struct.Struct(">IqiQ")


def encode_receipt(position: Position, nonce: int) -> str:
    raw = _RECEIPT.pack(position.shard, position.batch, position.seq, nonce)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_receipt(receipt: str) -> tuple[Position, int]:
    try:
        raw = base64.urlsafe_b64decode(receipt + "=" * (-len(receipt) % 4))
    except (binascii.Error, ValueError) as error:
        raise InvalidReceipt(f"not a casque receipt: {receipt[:40]!r}") from error
    if len(raw) != _RECEIPT.size:
        raise InvalidReceipt(f"not a receipt this version of casque reads (a later one's, or not a receipt): "
                             f"{receipt[:40]!r}")
    shard, batch, seq, nonce = _RECEIPT.unpack(raw)
    return Position(shard, batch, seq), nonce
