"""What a Queue and a Subscriber are: the specs users declare (as custom resources or files).

The same models validate a CR's spec in the operator, a file given to `casque apply`, and the
JSON kept in the queue's and subscriber's znodes. Durations are written as `30s`, `15m`,
`12h`, `7d` (or plain seconds).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from casque.dataschema.validation import invalid_schema
from casque.errors import NewerFormat
from casque.filters import compile_filter
from casque.schema import MAX_RETENTION_SECONDS, MIN_RETENTION_SECONDS, NAME_PATTERN, QueueRef

_DURATION = re.compile(r"^(\d+)(s|m|h|d)?$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

MAX_SHARDS = 256
MAX_PRIORITIES = 10
# Each priority level of a queue is a log of its own, with its own shards. The log's number
# (the `shard` column and the shard znodes) is priority * PRIORITY_STRIDE + shard.
PRIORITY_STRIDE = 1000
# A message is at most this many bytes (payload + key + attributes); a batch always holds at
# least one message, so this also bounds a single-message batch.
MAX_MESSAGE_BYTES_LIMIT = 1024 * 1024
# Idempotency keys are remembered this long unless the queue says otherwise (and the
# retention is not shorter); a window shorter than MIN_DEDUPLICATION_WINDOW_SECONDS would
# end while a publish's own claims may still be in flight (casque.engine.idempotency).
DEFAULT_DEDUPLICATION_WINDOW_SECONDS = 600
MIN_DEDUPLICATION_WINDOW_SECONDS = 10
StartPosition = Literal["earliest", "latest"] | datetime


def parse_duration(value: object) -> int:
    """Seconds in `value`: an int, or a string such as '90s', '15m', '12h', '7d'."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '15m'")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match:
            return int(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    raise ValueError(f"invalid duration {value!r}: use seconds or a number with s, m, h or d")


def log_shard(priority: int, shard: int) -> int:
    return priority * PRIORITY_STRIDE + shard


def priority_of(log: int) -> int:
    return log // PRIORITY_STRIDE


def by_priority(logs: list[int], turn: int) -> list[int]:
    """Logs by priority level, highest first; within a level, starting at the `turn`-th
    (modulo the level's size), so that each turn favours another log of the level."""
    by_level: dict[int, list[int]] = {}
    for log in sorted(logs):
        by_level.setdefault(priority_of(log), []).append(log)
    ordered: list[int] = []
    for level in sorted(by_level, reverse=True):
        level_logs = by_level[level]
        first = turn % len(level_logs)
        ordered.extend(level_logs[first:] + level_logs[:first])
    return ordered


def format_duration(seconds: int) -> str:
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNIT_SECONDS[unit] == 0:
            return f"{seconds // _UNIT_SECONDS[unit]}{unit}"
    return f"{seconds}s"


class _Spec(BaseModel):
    # camelCase on the wire (Kubernetes style), snake_case in Python.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class QueueSpec(_Spec):
    shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] = 4
    retention_seconds: Annotated[
        int, Field(ge=MIN_RETENTION_SECONDS, le=MAX_RETENTION_SECONDS, alias="retention")
    ] = 7 * 86400
    max_message_bytes: Annotated[int, Field(ge=1024, le=MAX_MESSAGE_BYTES_LIMIT)] = 256 * 1024
    priorities: Annotated[int, Field(ge=1, le=MAX_PRIORITIES)] = 1
    default_delay_seconds: Annotated[int, Field(ge=0, alias="defaultDelay")] = 0
    consistency: Literal["ONE", "LOCAL_ONE", "QUORUM", "LOCAL_QUORUM", "EACH_QUORUM", "ALL"] = "LOCAL_QUORUM"
    deletion_policy: Literal["Retain", "Delete"] = "Retain"
    # None: DEFAULT_DEDUPLICATION_WINDOW_SECONDS, or the retention if shorter (see
    # `deduplication_window`). Not a fixed default, so a queue with a short retention needs
    # no window spelled out. Left out of the znode while unset: sidecars of the version
    # before, which refuse unknown fields, still read the queue during a rolling upgrade.
    deduplication_window_seconds: Annotated[
        int | None,
        Field(ge=MIN_DEDUPLICATION_WINDOW_SECONDS, alias="deduplicationWindow", exclude_if=lambda v: v is None),
    ] = None

    # The JSON Schema (draft 2020-12, casque.dataschema) the queue's messages must match;
    # None: any data. Left out of the znode while unset, like the window above.
    data_schema: Annotated[dict[str, Any] | None, Field(alias="schema", exclude_if=lambda v: v is None)] = None
    # backward: a new schema must accept every message the one in force accepts
    # (casque.dataschema.compatibility), else the change is refused; none: any change goes.
    schema_compatibility: Annotated[
        Literal["backward", "none"], Field(exclude_if=lambda v: v == "backward")
    ] = "backward"

    @field_validator("retention_seconds", "default_delay_seconds", mode="before")
    @classmethod
    def _durations(cls, value: object) -> int:
        return parse_duration(value)

    @field_validator("data_schema")
    @classmethod
    def _usable_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # A pattern RE2 refuses passes here: a spec read back must read as it was accepted,
        # and a schema in force from before keeps one (casque.dataschema.patterns). A new or
        # changed schema must be linear: casque.engine.schema_versions checks that.
        problem = None if value is None else invalid_schema(value, linear_only=False)
        if problem is not None:
            raise ValueError(f"schema: {problem}")
        return value

    @field_validator("deduplication_window_seconds", mode="before")
    @classmethod
    def _window(cls, value: object) -> int | None:
        return None if value is None else parse_duration(value)

    @model_validator(mode="after")
    def _delay_within_retention(self) -> QueueSpec:
        if self.default_delay_seconds >= self.retention_seconds:
            raise ValueError("defaultDelay must be shorter than retention")
        # A retry after its message expired would find nothing to answer with.
        if self.deduplication_window_seconds is not None and self.deduplication_window_seconds > self.retention_seconds:
            raise ValueError("deduplicationWindow must not be longer than retention")
        return self

    @property
    def deduplication_window(self) -> int:
        """Seconds an idempotency key is remembered."""
        if self.deduplication_window_seconds is not None:
            return self.deduplication_window_seconds
        return min(DEFAULT_DEDUPLICATION_WINDOW_SECONDS, self.retention_seconds)

    def log_shards(self) -> list[int]:
        """Every log of the queue: its shards at every priority level."""
        return [log_shard(p, s) for p in range(self.priorities) for s in range(self.shards)]


MAX_BACKOFF_SECONDS = 12 * 3600


class RetryPolicy(_Spec):
    """How long a message waits before it is delivered again after a nack that names no delay
    or an expired visibility: `minimumBackoff` after its first delivery, doubling with each
    delivery after that, never more than `maximumBackoff`."""

    minimum_backoff_seconds: Annotated[int, Field(ge=0, le=MAX_BACKOFF_SECONDS, alias="minimumBackoff")] = 10
    maximum_backoff_seconds: Annotated[int, Field(ge=0, le=MAX_BACKOFF_SECONDS, alias="maximumBackoff")] = 600

    @field_validator("minimum_backoff_seconds", "maximum_backoff_seconds", mode="before")
    @classmethod
    def _durations(cls, value: object) -> int:
        return parse_duration(value)

    @model_validator(mode="after")
    def _ordered(self) -> RetryPolicy:
        if self.maximum_backoff_seconds < self.minimum_backoff_seconds:
            raise ValueError("retry.maximumBackoff must not be shorter than retry.minimumBackoff")
        return self

    def backoff(self, deliveries: int) -> float:
        """Seconds before the next delivery of a message delivered `deliveries` times so far."""
        if deliveries <= 0 or self.minimum_backoff_seconds == 0:
            return 0.0
        # Capped before the power, so a message delivered a thousand times cannot overflow it.
        doublings = min(deliveries - 1, self.maximum_backoff_seconds.bit_length())
        return float(min(self.maximum_backoff_seconds, self.minimum_backoff_seconds << doublings))


class SubscriberSpec(_Spec):
    queue: Annotated[str, Field(pattern=NAME_PATTERN.pattern)]
    start_position: StartPosition = "latest"
    visibility_timeout_seconds: Annotated[int, Field(ge=1, le=12 * 3600, alias="visibilityTimeout")] = 30
    max_deliveries: Annotated[int, Field(ge=0, le=1000)] = 10
    dead_letter_queue: Annotated[str | None, Field(pattern=NAME_PATTERN.pattern)] = None
    push_url: str | None = None
    # leased: each shard is delivered by one member at a time (per-key order holds);
    # shared: every member delivers from every shard, in claimed batch ranges
    # (casque.engine.claims), so a group can have more members than the queue has shards.
    delivery: Literal["leased", "shared"] = "leased"
    # The next message of a key is delivered only once the one before it is acked or
    # dead-lettered (casque.engine.keylocks), also across the members of shared delivery.
    ordered_keys: bool = False
    # A shard with lag whose offset has not moved for this long is reported stalled
    # (casque.engine.stalls); unset, it follows from the visibility timeout.
    stall_after_seconds: Annotated[int | None, Field(ge=1, le=7 * 86400, alias="stallAfter")] = None
    # Backoff between deliveries of a message nacked without a delay, or whose visibility
    # ran out; None: delivered again at once. A nack's own delay always wins. Left out of the
    # znode while unset, so sidecars of the version before still read the subscriber.
    retry: Annotated[RetryPolicy | None, Field(exclude_if=lambda v: v is None)] = None
    # A CEL condition (casque.filters): messages it does not match are done for this
    # subscriber without being delivered, and counted as filtered. None: every message.
    # Left out of the znode while unset, like `retry`.
    message_filter: Annotated[str | None, Field(alias="filter", exclude_if=lambda v: v is None)] = None

    @field_validator("visibility_timeout_seconds", "stall_after_seconds", mode="before")
    @classmethod
    def _durations(cls, value: object) -> int | None:
        return None if value is None else parse_duration(value)

    @field_validator("message_filter")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            compile_filter(value)  # InvalidFilter is a ValueError: the checker's message is the error
        return value

    @model_validator(mode="after")
    def _dead_letter_elsewhere(self) -> SubscriberSpec:
        if self.dead_letter_queue is not None and self.dead_letter_queue == self.queue:
            raise ValueError("deadLetterQueue must be another queue than the subscriber's own")
        return self


# The format of the queue's and subscriber's znode data this version writes; a reader refuses
# a later one (NewerFormat) rather than misread it. Readers before the field existed ignore it.
STATE_FORMAT = 1


def _readable(format_: int, what: str) -> None:
    if format_ > STATE_FORMAT:
        raise NewerFormat(f"{what} was written in format {format_}; this version of casque reads up to "
                          f"{STATE_FORMAT}: upgrade it")


class QueueState(BaseModel):
    """A queue's znode data: its spec plus what is fixed when the queue is created."""

    model_config = ConfigDict(frozen=True)

    # Which format wrote it (STATE_FORMAT).
    format: int = STATE_FORMAT

    spec: QueueSpec
    created_at: datetime
    # Set once at creation: a queue deleted (with its table) and created again under the same
    # name is a new incarnation and inherits nothing kept in the shared tables (publish ids,
    # delayed messages, counters are keyed by it). Empty for queues created before
    # incarnations existed.
    incarnation: str = ""
    # Counts the schemas the queue has had: 1 for the first, one more for each accepted
    # change (removing the schema included), 0 while it never had one. A message records the
    # version it was checked against (casque.engine.messages.SCHEMA_VERSION_ATTRIBUTE).
    schema_version: int = 0
    # Until when batches may expire out of order: a lowered retention applies only to rows
    # written after it, so newer batches expire before older ones until the last row written
    # under the longer retention has gone. None: always in order (oldest first).
    expiry_mixed_until: datetime | None = None

    @model_validator(mode="after")
    def _known_format(self) -> QueueState:
        _readable(self.format, "the queue's state")
        return self

    def expiry_in_order(self, now: datetime) -> bool:
        """Whether a shard's live batches are, at `now`, exactly those after an expired prefix."""
        return self.expiry_mixed_until is None or now >= self.expiry_mixed_until

    def shared_key(self, queue: QueueRef) -> str:
        """The `queue` key of this incarnation's rows in the shared tables."""
        return f"{queue.key}#{self.incarnation}" if self.incarnation else queue.key


class SubscriberState(BaseModel):
    """A subscriber's znode data."""

    model_config = ConfigDict(frozen=True)

    # Which format wrote it (STATE_FORMAT).
    format: int = STATE_FORMAT

    spec: SubscriberSpec
    created_at: datetime
    # Set once at creation: a subscriber deleted and created again under the same name is a
    # new incarnation and inherits nothing (ack rows are keyed by it). Empty for subscribers
    # created before incarnations existed.
    incarnation: str = ""

    @model_validator(mode="after")
    def _known_format(self) -> SubscriberState:
        _readable(self.format, "the subscriber's state")
        return self

    def ack_key(self, name: str) -> str:
        """The `subscriber` key of this incarnation's ack rows."""
        return f"{name}#{self.incarnation}" if self.incarnation else name
