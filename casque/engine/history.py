"""A message's history: where it sits and what each subscriber did with it.

Read from the bookkeeping casque keeps anyway, so it costs the publish and consume paths
nothing: no index row is written per message.

- **Where**: a message id carries the time the message was due in the log (see
  messages.time_ordered_ids), and every batch is written at or after the due times of its
  messages. So each log of the queue is read from the first batch published a little before
  that time (positions.batch_at_time), light columns only, until the id turns up or the
  batches are past the time by more than a claim can take (SEARCH_AFTER). A delayed
  message not yet due is read from the delayed table, where it is keyed by that same time.
- **What each subscriber did**: its ack rows for the message's batch in its current seek
  epoch (acked, dead-lettered, each delivery's count and visibility, each nack), its offset
  (a batch behind it is done), its filter, and for a dead letter the copy's id in the
  dead-letter queue (the copy's client id is made from the position).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from cassandra.query import SimpleStatement
from kazoo.exceptions import NoNodeError

from casque.backends import cql, zk
from casque.engine import catalog, offsets, positions
from casque.engine.acks import ACK, DEAD, BatchMarks
from casque.engine.batches import Log
from casque.engine.deadletters import FOR_SUBSCRIBER, MESSAGE_ID as DEAD_LETTER_SOURCE_ID, dead_letter_client_id
from casque.engine.delayed import MOVED_PREFIX, due_bucket, moved_client_id
from casque.engine.idempotency import IdempotencyGuard
from casque.engine.messages import (Position, StoredMessage, event_source_of, filter_variables, id_time,
                                    in_id_form, reserved_client_id)
from casque.engine.pipelines import PIPELINE_CLIENT_ID_PREFIX
from casque.engine.shard_writer import SETTLE_SECONDS
from casque.engine.sequences import parse_producer_key
from casque.errors import CasqueError, MessageNotFound, UntraceableId
from casque.filters import compile_filter
from casque.schema import ACKS_TABLE, BATCHES_PER_BUCKET, DELAYED_TABLE, HEADER_SEQ, QueueRef, bucket_of
from casque.specs import QueueState, SubscriberState, priority_of
from casque.store import Store
from casque.znodes import decode_head

# A batch may be published this long before the time in its messages' ids: the id's time is
# read from Cassandra's clock as this process estimates it, the batch's from another's (a
# delayed message moved by another sidecar), and a message due within a second goes to the
# log at once.
SEARCH_BEFORE = timedelta(seconds=5)
# ... and this long after it: the longest a claim takes to settle, and a margin for the
# group commit's wait and clock estimates. A publish retried by its client id across a
# longer outage may be written later still; its history is then not found.
SEARCH_AFTER = timedelta(seconds=SETTLE_SECONDS + 30)
# Rows of the log one page of the search reads.
SEARCH_PAGE_ROWS = 1000

SubscriberStateName = Literal[
    "pending", "in_flight", "nacked", "acked", "dead_lettered", "filtered", "expired", "passed", "not_addressed"]


@dataclass(frozen=True)
class SubscriberHistory:
    subscriber: str
    state: SubscriberStateName
    deliveries: int = 0
    # in_flight: until when its delivery is invisible; nacked: when it is visible again.
    until: datetime | None = None
    epoch: int = 0
    offset: int | None = None
    # A dead letter's copy in the subscriber's dead-letter queue (when it can be found).
    dead_letter_queue: str | None = None
    dead_letter_id: str | None = None


OriginKind = Literal["pipeline_output", "dead_letter", "redrive", "replay", "delayed"]


@dataclass(frozen=True)
class Origin:
    """What published a message the engine made: read from the client id it was given."""

    kind: OriginKind
    # The message it came from (a pipeline's input, a dead letter's or a redrive's source), and
    # where that one is, as far as the id says.
    queue: str | None = None
    subscriber: str | None = None
    message_id: str | None = None
    position: Position | None = None
    index: int | None = None  # a pipeline output's index among its input's outputs


def origin_of(client_id: str, attributes: dict[str, str]) -> Origin | None:
    """The origin an engine-made client id names (see ENGINE_CLIENT_ID_PREFIXES); None for an
    app's own id. `attributes`: the message's, where a dead letter keeps its source's id."""
    kind, _, rest = client_id.partition("/")
    if client_id.startswith(PIPELINE_CLIENT_ID_PREFIX):
        subscriber, input_id, index = rest.rsplit("/", 2)
        return Origin("pipeline_output", subscriber=subscriber.partition("#")[0], message_id=input_id,
                      index=int(index))
    if kind == "dlq":
        namespace, name, subscriber, _, shard, batch, seq = rest.split("/")
        return Origin("dead_letter", queue=f"{namespace}/{name}", subscriber=subscriber.partition("#")[0],
                      message_id=attributes.get(DEAD_LETTER_SOURCE_ID),
                      position=Position(int(shard), int(batch), int(seq)))
    if kind == "redrive":
        return Origin("redrive", message_id=rest)
    if client_id.startswith(MOVED_PREFIX):
        return Origin("delayed")
    if client_id.startswith("replay:"):  # casque.spark.replay: replay:<namespace>/<queue>:<shard>:<batch>:<seq>
        queue, shard, batch, seq = client_id.removeprefix("replay:").rsplit(":", 3)
        return Origin("replay", queue=queue, position=Position(int(shard), int(batch), int(seq)))
    return None


@dataclass(frozen=True)
class MessageHistory:
    queue: str
    message_id: str
    # When the message was due in the log (the time its id carries).
    due_at: datetime
    # "logged": in the log at `position`; "delayed": waiting in the delayed table until due_at.
    state: Literal["logged", "delayed"]
    position: Position | None = None
    priority: int | None = None
    published_at: datetime | None = None
    expires_at: datetime | None = None
    size: int | None = None
    content_type: str | None = None
    # Who published it: its idempotency key, or its producer's id and number.
    client_id: str | None = None
    producer_id: str | None = None
    producer_seq: int | None = None
    # The sidecar process that wrote its batch (its publisher id).
    publisher: str | None = None
    # For a message the engine published: what it came from.
    origin: Origin | None = None
    subscribers: list[SubscriberHistory] = field(default_factory=list)


async def message_history(store: Store, queue: QueueRef, message_id: str,
                          now: datetime | None = None) -> MessageHistory:
    """The history of message `message_id` of `queue`; UntraceableId, MessageNotFound."""
    due = id_time(message_id)
    if due is None and in_id_form(message_id):  # the form of an id, a time past year 9999: none of ours
        raise MessageNotFound(f"no message {message_id} in queue {queue}")
    if due is None:
        raise UntraceableId(f"{message_id!r} is not a message id casque can trace: ids carry the time their "
                            "message was due (a version 7 UUID) since message history exists")
    now = now or datetime.now(timezone.utc)
    state = await asyncio.to_thread(catalog.read_queue, store, queue)
    found = await _find_in_log(store, queue, state, message_id, due, now)
    if found is None and due < now - SEARCH_AFTER:
        found = await _moved_late(store, queue, state, message_id)
    if found is None:
        if await _is_delayed(store, queue, state, message_id, due):
            return MessageHistory(str(queue), message_id, due, "delayed")
        raise MessageNotFound(f"message {message_id} is not in queue {queue}: not published there, expired, "
                              "or written later than its id's time allows for")
    message, client_id, writer = found
    names = await asyncio.to_thread(catalog.list_subscribers, store, queue)
    subscribers = await asyncio.gather(*(_subscriber_history(store, queue, n, message, now) for n in names))
    producer = parse_producer_key(client_id) if client_id else None
    engine_made = client_id is not None and reserved_client_id(client_id)
    origin = None
    if client_id is not None and engine_made:
        try:
            origin = origin_of(client_id, dict(message.attributes))
        except ValueError:
            origin = None  # an id of a form this version does not know: no origin, the rest stands
    return MessageHistory(
        queue=str(queue), message_id=message_id, due_at=due, state="logged", position=message.position,
        priority=priority_of(message.position.shard), published_at=message.published_at,
        expires_at=message.expires_at, size=message.size, content_type=message.content_type,
        client_id=None if producer is not None or engine_made else client_id,
        producer_id=None if producer is None else producer.producer,
        producer_seq=None if producer is None else producer.sequence,
        publisher=writer.rpartition("/")[0] or None if writer else None, origin=origin,
        subscribers=[s for s in subscribers if s is not None],
    )


# --- where -------------------------------------------------------------------------------------
_FOUND = tuple[StoredMessage, str | None, str | None]  # the message, its client id, its batch's writer


async def _find_in_log(store: Store, queue: QueueRef, state: QueueState, message_id: str, due: datetime,
                       now: datetime) -> _FOUND | None:
    searches = [asyncio.ensure_future(_find_in_shard(store, queue, state, shard, message_id, due, now))
                for shard in state.spec.log_shards()]
    try:
        for search in asyncio.as_completed(searches):
            position = await search
            if position is not None:
                return await _read_message(store, queue, position)
        return None
    finally:
        for search in searches:
            search.cancel()


async def _find_in_shard(store: Store, queue: QueueRef, state: QueueState, shard: int, message_id: str,
                         due: datetime, now: datetime) -> Position | None:
    data, _ = await zk.call(store.zk.get_async, store.paths(queue).head(shard))
    # Even at head 0: a publish is answered once its batch is written, before the head moves.
    head = decode_head(data)
    first = await asyncio.to_thread(positions.batch_at_time, store, queue, shard, head, due - SEARCH_BEFORE,
                                    state.expiry_in_order(now))
    past = (due + SEARCH_AFTER).astimezone(timezone.utc).replace(tzinfo=None)  # the driver's naive UTC
    statement = SimpleStatement(
        f"SELECT batch_no, seq, message_id, published_at FROM {store.table(queue)} "
        "WHERE shard = %s AND bucket = %s AND batch_no >= %s", fetch_size=SEARCH_PAGE_ROWS,
        consistency_level=cql.consistency(state.spec.consistency))
    batch = first
    # A batch past the head may exist (written, head not yet advanced): one bucket past it is read too.
    while batch <= head + 1:
        bucket = bucket_of(batch)
        async for page in cql.pages(store.session, statement, (shard, bucket, batch)):
            for row in page:
                if row.seq == HEADER_SEQ:
                    if row.published_at is not None and row.published_at > past:
                        return None
                elif row.message_id == message_id:
                    return Position(shard, row.batch_no, row.seq)
        batch = (bucket + 1) * BATCHES_PER_BUCKET
    return None


async def _read_message(store: Store, queue: QueueRef, position: Position) -> _FOUND | None:
    p = position
    row = (await cql.execute(store.session, (
        f"SELECT message_id, published_at, key, attributes, payload, content_type, expires_at, client_id "
        f"FROM {store.table(queue)} WHERE shard = %s AND bucket = %s AND batch_no = %s AND seq = %s"),
        (p.shard, bucket_of(p.batch), p.batch, p.seq))).one()
    header = await Log(store, queue, "ONE").read_header(p.shard, p.batch)
    if row is None:
        return None
    message = StoredMessage(
        position, row.message_id, _utc(row.published_at), row.payload or b"", row.key,
        dict(row.attributes or {}), row.content_type, _utc(row.expires_at) if row.expires_at else None)
    return message, row.client_id, None if header is None else header.writer


async def _moved_late(store: Store, queue: QueueRef, state: QueueState, message_id: str) -> _FOUND | None:
    """A delayed message the mover wrote later than the search allows for (it was down when
    the message was due): its move's idempotency record says where it went."""
    guard = IdempotencyGuard(store, state.shared_key(queue), Log(store, queue, state.spec.consistency))
    moved = await guard.earlier(moved_client_id(message_id))
    if moved is None or moved.batch < 1:
        return None
    return await _read_message(store, queue, Position(moved.shard, moved.batch, moved.seq))


async def _is_delayed(store: Store, queue: QueueRef, state: QueueState, message_id: str, due: datetime) -> bool:
    """Whether the delayed table holds the message (due at `due`, to the millisecond)."""
    table = f"{store.for_namespace(queue.namespace).namespace_view_keyspace('delayed messages')}.{DELAYED_TABLE}"
    rows = await cql.fetch_all(store.session, (
        f"SELECT message_id FROM {table} WHERE queue = %s AND due_bucket = %s AND due_at >= %s AND due_at < %s"),
        (state.shared_key(queue), due_bucket(due), due, due + timedelta(milliseconds=1)))
    return any(row.message_id == message_id for row in rows)


# --- what each subscriber did ------------------------------------------------------------------
@dataclass
class _Marks:
    """What one subscriber's ack rows say of one message."""

    outcome: str | None = None
    deliveries: int = 0
    visible_until_ms: int = 0  # the latest delivery's (or its extension's)
    nacked: int = 0  # the delivery a nack names, and when that nack makes it visible again
    nacked_until_ms: int = 0


def read_marks(rows: Sequence[Any], seq: int) -> _Marks:
    """Fold ack rows (outcome, seqs, deliveries, visible_until), in any order, for one message,
    as a member loading its batch folds them (acks.BatchMarks): what it shows is what a
    member restarted now would do with the message."""
    batch = BatchMarks()
    dead = False
    for row in rows:
        batch.add_row(row.outcome, row.seqs, row.deliveries, row.visible_until)
        dead = dead or (row.outcome == DEAD and seq in (row.seqs or ()))
    marks = _Marks(deliveries=batch.deliveries.get(seq, 0), visible_until_ms=batch.visible_until.get(seq, 0),
                   nacked=batch.nacked.get(seq, 0), nacked_until_ms=batch.nacked_until.get(seq, 0))
    if seq in batch.done:
        marks.outcome = DEAD if dead else ACK
    return marks


def subscriber_state(marks: _Marks, batch: int, offset: int, matches: bool, expired: bool,
                     addressed: bool, now_ms: int, backoff_ms: int = 0) -> tuple[SubscriberStateName, int | None]:
    """A subscriber's state for a message (and the time in ms it names, if any). `backoff_ms`:
    the retry policy's wait after as many deliveries as the message had, which follows a
    visibility that ran out (acks.BatchMarks.resting_until)."""
    if not addressed:
        return "not_addressed", None
    if marks.outcome == DEAD:
        return "dead_lettered", None
    if marks.outcome == ACK:
        return "acked", None
    if not matches:
        return "filtered", None
    if batch < offset:
        return "passed", None
    if marks.deliveries and marks.nacked >= marks.deliveries:
        if marks.nacked_until_ms > now_ms:
            return "nacked", marks.nacked_until_ms
    elif marks.deliveries and marks.visible_until_ms > now_ms:
        return "in_flight", marks.visible_until_ms
    elif marks.deliveries and marks.visible_until_ms and marks.visible_until_ms + backoff_ms > now_ms:
        return "nacked", marks.visible_until_ms + backoff_ms
    if expired:
        return "expired", None
    return "pending", None


async def _subscriber_history(store: Store, queue: QueueRef, name: str, message: StoredMessage,
                              now: datetime) -> SubscriberHistory | None:
    try:
        subscriber = await asyncio.to_thread(catalog.read_subscriber, store, queue, name)
        record = await offsets.read_offset(store.zk, store.paths(queue).subscriber(name), message.position.shard)
    except (CasqueError, NoNodeError):
        return None  # deleted meanwhile, or not yet set up by the operator
    p = message.position
    key = subscriber.ack_key(name)
    rows = await cql.fetch_all(store.session, (
        f"SELECT outcome, seqs, deliveries, visible_until FROM {store.keyspace_of(queue.namespace)}.{ACKS_TABLE} "
        "WHERE queue = %s AND subscriber = %s AND epoch = %s AND shard = %s AND bucket = %s AND batch_no = %s"),
        (queue.key, key, record.epoch, p.shard, bucket_of(p.batch), p.batch))
    marks = read_marks(rows, p.seq)
    state, until_ms = subscriber_state(
        marks, p.batch, record.offset, _matches(subscriber, queue, message),
        message.expires_at is not None and message.expires_at <= now,
        message.attributes.get(FOR_SUBSCRIBER, name) == name, int(now.timestamp() * 1000),
        0 if subscriber.spec.retry is None else int(subscriber.spec.retry.backoff(marks.deliveries) * 1000))
    dead_letter_queue = dead_letter_id = None
    if state == "dead_lettered" and subscriber.spec.dead_letter_queue:
        dead_letter_queue = subscriber.spec.dead_letter_queue
        dead_letter_id = await _dead_letter_id(store, QueueRef(queue.namespace, dead_letter_queue),
                                               dead_letter_client_id(queue, key, record.epoch, p))
    return SubscriberHistory(
        subscriber=name, state=state, deliveries=marks.deliveries,
        until=None if until_ms is None else datetime.fromtimestamp(until_ms / 1000, timezone.utc),
        epoch=record.epoch, offset=record.offset, dead_letter_queue=dead_letter_queue, dead_letter_id=dead_letter_id)


def _matches(subscriber: SubscriberState, queue: QueueRef, message: StoredMessage) -> bool:
    expression = subscriber.spec.message_filter
    if expression is None:
        return True
    variables = filter_variables(message, priority_of(message.position.shard),
                                 event_source_of(queue.namespace, queue.name))
    return compile_filter(expression).matches(variables)


async def _dead_letter_id(store: Store, queue: QueueRef, client_id: str) -> str | None:
    """The id of the dead-letter copy published with `client_id`; None when it cannot be read."""
    try:
        state = await asyncio.to_thread(catalog.read_queue, store, queue)
        guard = IdempotencyGuard(store, state.shared_key(queue), Log(store, queue, state.spec.consistency))
        earlier = await guard.earlier(client_id)
    except CasqueError:
        return None
    return None if earlier is None else earlier.message_id


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment
