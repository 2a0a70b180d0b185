"""Dead letters: messages over a subscriber's max deliveries go to its dead-letter queue.

The dead-letter queue is an ordinary queue. A dead-lettered message keeps its payload, key,
content type and attributes, and gains attributes with its history (where it came from,
how often it was delivered, its last error). The copy is published with a client id made
from its position, so a retried move (or a new lease holder repeating it) never doubles it.

Redrive publishes dead letters back to their source queue, addressed to the subscriber that
gave up on them (`casque-for-subscriber`): the other subscribers of the source queue, which
had processed the message already, skip it. A run that takes every dead letter (no time
filter) records per shard the batch it got to, and every run starts there (or at the
earliest retained batch): a rerun reads only what was dead-lettered since. A run cut short
between publishing and recording its mark is covered by the copies' client ids.

A dead letter's source is only what its `casque-dlq-source` attribute says, and a tenant
writes its dead-letter queue's rows itself (its sidecars, or its own keyspace's role), while
a redrive may run with the installation's rights. So a redrive follows only sources that
name, as `namespace/name`, another queue of the dead-letter queue's own namespace; a dead
letter naming a queue elsewhere, its own queue, or nothing readable is skipped and counted
by what it named (`RedriveResult.skipped`), never published and never an error that stops
the run.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

from kazoo.exceptions import NoNodeError

from casque.backends import zk
from casque.engine import catalog, positions
from casque.engine.batches import Log
from casque.engine.messages import OutgoingMessage, Position, StoredMessage
from casque.engine.publisher import Publisher
from casque.errors import InvalidSpec
from casque.schema import QueueRef
from casque.store import Store

SOURCE = "casque-dlq-source"
SUBSCRIBER = "casque-dlq-subscriber"
MESSAGE_ID = "casque-dlq-message-id"
POSITION = "casque-dlq-position"
DELIVERIES = "casque-dlq-deliveries"
PUBLISHED_AT = "casque-dlq-published-at"
DEAD_AT = "casque-dlq-dead-at"
LAST_ERROR = "casque-dlq-last-error"
HISTORY = (SOURCE, SUBSCRIBER, MESSAGE_ID, POSITION, DELIVERIES, PUBLISHED_AT, DEAD_AT, LAST_ERROR)
# On a redriven message: only this subscriber of the source queue receives it.
FOR_SUBSCRIBER = "casque-for-subscriber"
REDRIVEN_FROM = "casque-redriven-from"


def dead_letter_client_id(queue: QueueRef, subscriber_key: str, epoch: int, position: Position) -> str:
    """The client id of the dead-letter copy of the message at `position`, as the subscriber
    incarnation `subscriber_key` gave up on it in seek epoch `epoch`."""
    p = position
    return f"dlq/{queue.key}/{subscriber_key}/{epoch}/{p.shard}/{p.batch}/{p.seq}"


def dead_letter_copy(
    message: StoredMessage, queue: QueueRef, subscriber: str, epoch: int, deliveries: int, last_error: str | None,
    *, subscriber_key: str | None = None, retention_seconds: int | None = None,
) -> OutgoingMessage:
    """The copy of a message `subscriber` failed too often, for its dead-letter queue.

    Its client id names the delivery (subscriber incarnation, seek epoch, position) and is
    remembered as long as the source keeps the message (`retention_seconds`), so the message
    dead-lettered again after a crash, however much later, is stored once.
    """
    p = message.position
    history = {
        SOURCE: queue.key,
        SUBSCRIBER: subscriber,
        MESSAGE_ID: message.message_id,
        POSITION: f"{p.shard}/{p.batch}/{p.seq}",
        DELIVERIES: str(deliveries),
        PUBLISHED_AT: message.published_at.isoformat(),
        DEAD_AT: datetime.now(timezone.utc).isoformat(),
    }
    if last_error:
        history[LAST_ERROR] = last_error[:1024]
    attributes = {k: v for k, v in message.attributes.items() if k != FOR_SUBSCRIBER}
    return OutgoingMessage(
        payload=message.payload,
        key=message.key,
        attributes={**attributes, **history},
        content_type=message.content_type,
        client_id=dead_letter_client_id(queue, subscriber_key or subscriber, epoch, p),
        client_id_window_seconds=retention_seconds,
    )


def addressed_elsewhere(message: StoredMessage, subscriber: str) -> bool:
    """A redriven message meant for another subscriber: this one skips it."""
    target = message.attributes.get(FOR_SUBSCRIBER)
    return target is not None and target != subscriber


@dataclass(frozen=True)
class RedriveResult:
    redriven: int
    duplicates: int
    by_source: dict[str, int]
    # Dead letters not followed, by the source they named (see the module's docstring).
    skipped: dict[str, int] = field(default_factory=dict)

    def skipped_line(self, dead_letter_queue: QueueRef, shown: int = 5) -> str | None:
        """The skipped dead letters in one line for people (None: none was skipped)."""
        if not self.skipped:
            return None
        named = sorted(self.skipped.items())
        listed = ", ".join(f"{source!r} ({count})" for source, count in named[:shown])
        more = f" and {len(named) - shown} more" if len(named) > shown else ""
        return (f"skipped {sum(self.skipped.values())} dead letter(s) whose source is not a queue of namespace "
                f"{dead_letter_queue.namespace}: {listed}{more}")


def source_queue(source: str, dead_letter_queue: QueueRef) -> QueueRef | None:
    """The queue a dead letter's source attribute names, if a redrive may follow it: another
    queue of the dead-letter queue's namespace, written `namespace/name` (None otherwise)."""
    try:
        ref = QueueRef.parse(source)
    except InvalidSpec:
        return None
    if ref.key != source or ref.namespace != dead_letter_queue.namespace or ref == dead_letter_queue:
        return None
    return ref


async def redrive(
    store: Store,
    dead_letter_queue: QueueRef,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = None,
) -> RedriveResult:
    """Publish the dead letters of `dead_letter_queue` (dead between `since` and `until`, all
    by default) back to their source queues. Running it again redrives nothing twice.

    Each shard is read from its earliest retained batch; the dead letters of each chunk read
    go back in one publish per source queue.
    """
    state = await asyncio.to_thread(catalog.read_queue, store, dead_letter_queue)
    log = Log(store, dead_letter_queue, state.spec.consistency)
    publishers: dict[str, Publisher] = {}
    redriven = duplicates = 0
    by_source: dict[str, int] = {}
    skipped: dict[str, int] = {}

    async def publisher_of(ref: QueueRef) -> Publisher:
        if ref.key not in publishers:
            source_state = await asyncio.to_thread(catalog.read_queue, store, ref)
            publishers[ref.key] = await asyncio.to_thread(Publisher, store.for_namespace(ref.namespace), ref,
                                                          source_state)
        return publishers[ref.key]

    marks = RedriveMarks(store, dead_letter_queue)
    everything = since is None and until is None
    for shard in state.spec.log_shards():
        head = await asyncio.to_thread(catalog.read_int, store, store.paths(dead_letter_queue).head(shard))
        batch = max(await marks.start(shard),
                    await asyncio.to_thread(positions.earliest_batch, store, dead_letter_queue, shard, head,
                                            state.expiry_in_order(datetime.now(timezone.utc))))
        while batch <= head:
            chunk = await log.read_from(shard, batch)
            if not chunk:
                batch += 1  # expired since the search above: move on
                continue
            copies: dict[QueueRef, list[OutgoingMessage]] = {}
            taken = redriven + duplicates
            for message in (m for entry in chunk for m in entry.messages):
                source = message.attributes.get(SOURCE)
                if source is None or not _dead_within(message, since, until):
                    continue
                if limit is not None and taken >= limit:
                    break
                ref = source_queue(source, dead_letter_queue)
                if ref is None:
                    skipped[source] = skipped.get(source, 0) + 1
                    continue
                copies.setdefault(ref, []).append(
                    redrive_copy(message, dead_letter_queue, state.spec.retention_seconds))
                taken += 1
            for ref, messages in copies.items():
                results = await (await publisher_of(ref)).publish(messages)
                fresh = sum(1 for r in results if not r.duplicate)
                redriven += fresh
                duplicates += len(results) - fresh
                if fresh:
                    by_source[ref.key] = by_source.get(ref.key, 0) + fresh
            if limit is not None and taken >= limit:
                break
            batch = chunk[-1].header.batch + 1
            if everything:
                await marks.advance(shard, batch)
        if limit is not None and redriven + duplicates >= limit:
            break
    for publisher in publishers.values():
        await publisher.flush_heads()
    return RedriveResult(redriven, duplicates, by_source, skipped)


class RedriveMarks:
    """Per shard of a dead-letter queue, the batch below which every dead letter was redriven."""

    def __init__(self, store: Store, dead_letter_queue: QueueRef) -> None:
        self._store = store
        self._path = store.paths(dead_letter_queue).redrive
        self._marks: dict[str, int] | None = None

    async def start(self, shard: int) -> int:
        if self._marks is None:
            try:
                data, _ = await zk.call(self._store.zk.get_async, self._path)
                self._marks = {k: int(v) for k, v in json.loads(data or b"{}").items()}
            except NoNodeError:
                self._marks = {}
        return self._marks.get(str(shard), 1)

    async def advance(self, shard: int, batch: int) -> None:
        assert self._marks is not None
        self._marks[str(shard)] = batch
        data = json.dumps(self._marks, sort_keys=True).encode()
        try:
            await zk.call(self._store.zk.set_async, self._path, data)
        except NoNodeError:
            # Never makepath: under a queue deleted meanwhile that would bring it back, empty.
            await zk.call(self._store.zk.create_async, self._path, data)


def redrive_copy(
    message: StoredMessage, dead_letter_queue: QueueRef, dead_letter_retention_seconds: int | None = None
) -> OutgoingMessage:
    """A dead letter sent back to its source: addressed to the subscriber that failed it, its
    history dropped, and a client id from its id, remembered as long as the dead letter
    itself, so a rerun at any distance sends nothing twice."""
    attributes = {k: v for k, v in message.attributes.items() if k not in HISTORY}
    attributes[FOR_SUBSCRIBER] = message.attributes.get(SUBSCRIBER, "")
    attributes[REDRIVEN_FROM] = f"{dead_letter_queue.key}/{message.message_id}"
    return OutgoingMessage(payload=message.payload, key=message.key, attributes=attributes,
                           content_type=message.content_type, client_id=f"redrive/{message.message_id}",
                           client_id_window_seconds=dead_letter_retention_seconds)


def _dead_within(message: StoredMessage, since: datetime | None, until: datetime | None) -> bool:
    dead_at = message.attributes.get(DEAD_AT)
    if dead_at is None:
        return since is None and until is None
    moment = datetime.fromisoformat(dead_at)
    return (since is None or moment >= since) and (until is None or moment < until)
