"""The body of a message-history answer (casque.engine.history): where the message is and
each subscriber's state of it. Metadata only: never the payload, key or attributes, so it
is served to any pod of the namespace, as stats are."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from casque.engine.history import MessageHistory, Origin, OriginKind, SubscriberHistory, SubscriberStateName
from casque.sidecar.models.base import Reply
from casque.specs import priority_of


class MessagePlace(Reply):
    shard: int
    priority: int
    batch: int
    seq: int


class OriginBody(Reply):
    kind: OriginKind = Field(description=(
        "pipeline_output: published by an ack of `messageId` (its output number `index`) by `subscriber`; "
        "dead_letter: `subscriber` gave up on `messageId` at `place` of `queue`; redrive: the dead letter "
        "`messageId` sent back; replay: a Spark replay of `place` of `queue`; delayed: moved from the "
        "delayed table when due"))
    queue: str | None = None
    subscriber: str | None = None
    message_id: str | None = None
    place: MessagePlace | None = None
    index: int | None = None

    @classmethod
    def of(cls, origin: Origin) -> OriginBody:
        body = cls(kind=origin.kind)
        for name in ("queue", "subscriber", "message_id", "index"):
            if getattr(origin, name) is not None:
                setattr(body, name, getattr(origin, name))
        if origin.position is not None:
            p = origin.position
            body.place = MessagePlace(shard=p.shard, priority=priority_of(p.shard), batch=p.batch, seq=p.seq)
        return body


class SubscriberHistoryBody(Reply):
    subscriber: str
    state: SubscriberStateName = Field(description=(
        "pending: not yet delivered, or visible again; in_flight: delivered, invisible until `until`; nacked: "
        "handed back, or waiting out its retry backoff after its visibility ran out: visible again at `until`; "
        "acked; dead_lettered; filtered: its filter does not match; "
        "expired: its TTL passed first; passed: behind the subscriber's offset (done before its last seek, or "
        "before it started); not_addressed: a redriven copy for another subscriber"))
    deliveries: int
    until: datetime | None = None
    epoch: int
    offset: int | None
    dead_letter_queue: str | None = None
    dead_letter_message_id: str | None = None

    @classmethod
    def of(cls, history: SubscriberHistory) -> SubscriberHistoryBody:
        body = cls(subscriber=history.subscriber, state=history.state, deliveries=history.deliveries,
                   epoch=history.epoch, offset=history.offset)
        if history.until is not None:
            body.until = history.until
        if history.dead_letter_queue is not None:
            body.dead_letter_queue = history.dead_letter_queue
            body.dead_letter_message_id = history.dead_letter_id
        return body


class MessageHistoryResult(Reply):
    queue: str
    message_id: str
    state: Literal["logged", "delayed"] = Field(
        description="logged: in the queue's log at `place`; delayed: waiting until `dueAt`")
    due_at: datetime = Field(description="When the message was due in the log (the time its id carries)")
    place: MessagePlace | None = None
    published_at: datetime | None = None
    expires_at: datetime | None = None
    size: int | None = None
    content_type: str | None = None
    event_id: str | None = Field(default=None, description="The id it was published with (its idempotency key)")
    event_source: str | None = None
    producer_id: str | None = None
    producer_seq: int | None = None
    publisher: str | None = Field(default=None, description="The publisher id of the sidecar that wrote it")
    origin: OriginBody | None = Field(default=None, description="For a message casque published: what it came from")
    subscribers: list[SubscriberHistoryBody]

    @classmethod
    def of(cls, history: MessageHistory) -> MessageHistoryResult:
        body = cls(queue=history.queue, message_id=history.message_id, state=history.state,
                   due_at=history.due_at, subscribers=[SubscriberHistoryBody.of(s) for s in history.subscribers])
        p = history.position
        if p is None:
            return body
        body.place = MessagePlace(shard=p.shard, priority=history.priority or 0, batch=p.batch, seq=p.seq)
        body.published_at, body.expires_at = history.published_at, history.expires_at
        body.size, body.content_type = history.size, history.content_type
        body.publisher, body.producer_id, body.producer_seq = history.publisher, history.producer_id, history.producer_seq
        if history.origin is not None:
            body.origin = OriginBody.of(history.origin)
        if history.client_id is not None:
            # A key made of (source, id) starts with NUL (models.publishing.dedup_key); a bare id is itself.
            if history.client_id.startswith("\x00"):
                _, source, event_id = history.client_id.split("\x00", 2)
                body.event_source, body.event_id = source, event_id
            else:
                body.event_id = history.client_id
        return body
