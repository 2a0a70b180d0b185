"""Publishing to one queue: the public `Publisher`.

A publish is checked against the queue's schema and limits, given time-ordered message
ids, and handed to the group-commit writer of its shard (casque.engine.shard_writer), or,
with a delivery time, to the delayed route (casque.engine.delayed_publish). A publish is
acknowledged only after its batch is written at the queue's consistency level.

Shard choice: a message with a key goes to the shard of its key (per-key order); others go
to this publisher's preferred shard (a hash of its id, so publishers rarely contend for one
shard) and spill to the least busy shard when the preferred one has a backlog.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, cast

from casque.dataschema.validation import CompiledSchema
from casque.engine.batches import Log
from casque.engine.checkpoints import CheckpointWriter, Checkpoints
from casque.engine.clock import clock_of
from casque.engine.delayed import MOVED_PREFIX, due_and_id
from casque.engine.delayed_publish import DelayedRoute
from casque.engine.idempotency import IdempotencyGuard
from casque.engine.messages import SCHEMA_VERSION_ATTRIBUTE, OutgoingMessage, Published, time_ordered_ids
from casque.engine.pending import PendingPublish, PublishCall
from casque.engine.protocol import ProtocolLevel
from casque.engine.shard_writer import PublisherCounters, ShardWriter
from casque.errors import InvalidSpec, MessageTooLarge, PartiallyPublished
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState, log_shard
from casque.store import Store

# A preferred shard with this many messages waiting behind a write in flight spills over.
SPILL_BACKLOG = 64


@dataclass
class Publisher:
    """Publishes to one queue. One per process and queue; safe for concurrent use."""

    store: Store
    queue: QueueRef
    # Read from the queue's znode (`catalog.read_queue`): its spec and its incarnation.
    state: QueueState
    publisher_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Group commit: a batch waits `linger` seconds for more publishes before it is written;
    # with none, it waits `group_linger` only after a batch that several publishes shared.
    # Concurrent one-message publishes then share batches of many instead of alternating
    # big and small ones (each batch costs a claim and a head write, whatever its size),
    # while publishes that come one at a time are never held.
    linger: float = 0.0
    group_linger: float = 0.0
    # The protocol whose records to write (casque.engine.protocol): a sidecar's follows the
    # installation's; None: the installation's as it is when the publisher is made.
    protocol: ProtocolLevel | None = None

    @property
    def spec(self) -> QueueSpec:
        return self.state.spec

    def __post_init__(self) -> None:
        self.log = Log(self.store, self.queue, self.spec.consistency)
        # Due times and intent deadlines are judged by other processes: Cassandra's clock.
        self.clock = clock_of(self.store.session)
        self.counters = PublisherCounters()
        # The heads written, checkpointed in Cassandra for a ZooKeeper that loses them.
        self.checkpoints = CheckpointWriter(Checkpoints(self.store, self.queue, self.state.shared_key(self.queue)))
        self._writers = {shard: ShardWriter(self, shard) for shard in self.spec.log_shards()}
        self._preferred = zlib.crc32(self.publisher_id.encode()) % self.spec.shards
        if self.protocol is None:
            self.protocol = ProtocolLevel.of(self.store)
        self.idempotency = IdempotencyGuard(self.store, self.state.shared_key(self.queue), self.log,
                                            self.spec.deduplication_window, self.protocol)
        self.delayed_route = DelayedRoute(self.store, self.queue, self.state, self.clock, self.idempotency,
                                          self.publish, self._to_log)
        self._background: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Compiled once per schema version (casque.dataschema.validation keeps them): a spec
        # change gives the process a new Publisher, so this is the version in force.
        schema = self.spec.data_schema
        self.schema = None if schema is None else CompiledSchema.of(schema, self.state.schema_version)

    @property
    def delayed_moves(self) -> int:
        """Delayed rows this publisher moved itself, the mover having passed them."""
        return self.delayed_route.moves

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop, kept while it runs: on Python 3.11 every
        `asyncio.get_running_loop()` makes a getpid(2) call, a few µs per message here. (A
        publisher is used from one thread; one used again under a new loop finds the old
        one stopped and asks again.)"""
        if self._loop is None or not self._loop.is_running():
            self._loop = asyncio.get_running_loop()
        return self._loop

    def checked(self, message: OutgoingMessage) -> OutgoingMessage:
        """`message` checked against the queue's schema and limits, and marked with the schema
        version it matched; raises SchemaViolation, MessageTooLarge or InvalidSpec."""
        if self.schema is not None:
            self.schema.check(message.payload, message.content_type)
            attributes = {**message.attributes, SCHEMA_VERSION_ATTRIBUTE: str(self.schema.version)}
            message = replace(message, attributes=attributes)
        self.validate(message)
        return message

    def validate(self, message: OutgoingMessage) -> None:
        if message.size > self.spec.max_message_bytes:
            raise MessageTooLarge(
                f"message of {message.size} bytes exceeds the queue's limit of {self.spec.max_message_bytes}"
            )
        if message.ttl_seconds is not None and message.ttl_seconds <= 0:
            raise InvalidSpec("ttl must be a positive number of seconds")
        if not 0 <= message.priority < self.spec.priorities:
            raise InvalidSpec(
                f"priority {message.priority} is out of range: the queue has levels 0..{self.spec.priorities - 1}"
            )
        if message.deliver_at is not None:
            if message.deliver_at.tzinfo is None:
                raise InvalidSpec("deliverAt needs a timezone (e.g. 2026-01-01T12:00:00Z)")
            horizon = self.clock.now() + timedelta(seconds=self.spec.retention_seconds)
            if message.deliver_at > horizon:
                raise InvalidSpec(
                    f"deliverAt is beyond the queue's retention ({self.spec.retention_seconds}s from now)"
                )
        if message.delay_seconds is not None and not 0 <= message.delay_seconds <= self.spec.retention_seconds:
            raise InvalidSpec(f"delay must be from 0 to the queue's retention ({self.spec.retention_seconds}s)")

    async def publish(
        self, messages: Sequence[OutgoingMessage], message_ids: Sequence[str] | None = None
    ) -> list[Published]:
        """Publish; results in input order. A validation error refuses the whole call before
        anything is written. A backend failure fails what it kept out: when the call spanned
        shards or batches and some were written, PartiallyPublished says which (within a
        shard, what a call wrote is always the beginning of its messages there, see
        ShardWriter).

        `message_ids` keeps ids given earlier (the delayed-message mover); new ones otherwise.
        """
        for message in messages:
            self.validate(message)
        drawn = message_ids is None
        ids = time_ordered_ids(len(messages), self.clock.time()) if message_ids is None else list(message_ids)
        if len(messages) == 1:
            # The common one-message call: awaited in this task, without a gathering future.
            return [await self._start(messages[0], ids[0], self._due(messages[0]), drawn=drawn)]
        # The call's messages without a key go to one shard per priority level, chosen once:
        # they share a batch, and a producer's numbered keys stay in runs (see sequences).
        chosen: dict[int, int] = {}
        guard = self.idempotency
        call = PublishCall(self.loop().create_future(), len(messages), guard)
        apart: dict[int, asyncio.Future[Published]] = {}
        for index, (message, message_id) in enumerate(zip(messages, ids)):
            due = self._due(message)
            client_id = message.client_id
            earlier = None if client_id is None or due is not None else guard.earlier_here(client_id)
            if due is None and earlier is None:
                call.remaining += 1
                if client_id is not None:
                    call.track(index, client_id)
                self._writers[self._choose_shard(message, chosen)].submit(
                    PendingPublish(message_id, message, None, call=call, index=index))
            else:  # a publish of its id under way or done, or its own route to a delivery time
                apart[index] = earlier if earlier is not None else self._start(message, message_id, due, chosen, drawn)
        if not apart:
            return written_whole(await call.future)
        waits = [call.future] if call.remaining else []
        answers: list[Any] = list(await asyncio.gather(*waits, *apart.values(), return_exceptions=True))
        outcomes: list[Published | BaseException | None] = answers[0] if waits else [None] * len(messages)
        for index, answer in zip(apart, answers[len(waits):]):
            outcomes[index] = answer
        return written_whole(outcomes)

    def _start(self, message: OutgoingMessage, message_id: str, due: datetime | None,
               chosen: dict[int, int] | None = None, drawn: bool = False) -> asyncio.Future[Published]:
        """Start publishing one message, to be delivered at `due` (None: at once): the future
        of its result. A message for the log is handed to its shard writer at once, with a
        future and no task of its own: a task per message cost as much as the rest of a batch
        call's work on it. One with a delivery time takes the coroutine path, in a task.
        `drawn`: the id was made for this call, so a delayed message's is made again for its
        due time (ids carry when the message is due in the log, see messages.time_ordered_ids)."""
        guard = self.idempotency
        client_id = message.client_id
        if client_id is not None:
            earlier = guard.earlier_here(client_id)
            if earlier is not None:
                return earlier
        if due is not None and drawn:
            due, message_id = due_and_id(due)
        publication = (self._to_log(message, message_id, chosen) if due is None
                       else asyncio.get_running_loop().create_task(self.delayed_route.route(message, message_id, due)))
        if client_id is not None:
            guard.track(client_id, publication)
        return publication

    def _due(self, message: OutgoingMessage) -> datetime | None:
        """When a message is to be delivered: its own time or delay, or the queue's default
        delay from now (not for a delayed message being moved into the log); None: at once."""
        if message.deliver_at is not None:
            # A time already past is now: the message's id carries when it is due in the log,
            # where history looks for it (a time an hour past named no batch it could search).
            return max(message.deliver_at, self.clock.now())
        if message.delay_seconds is not None:
            return self.clock.now() + timedelta(seconds=message.delay_seconds)
        if self.spec.default_delay_seconds and not (message.client_id or "").startswith(MOVED_PREFIX):
            return self.clock.now() + timedelta(seconds=self.spec.default_delay_seconds)
        return None

    def _to_log(self, message: OutgoingMessage, message_id: str,
                chosen: dict[int, int] | None = None) -> asyncio.Future[Published]:
        """Hand a message to its shard's writer: the future of where it was written."""
        future: asyncio.Future[Published] = self.loop().create_future()
        self._writers[self._choose_shard(message, chosen)].submit(PendingPublish(message_id, message, future))
        return future

    def _choose_shard(self, message: OutgoingMessage, chosen: dict[int, int] | None = None) -> int:
        """The log shard for a message: within its priority level, by key or by load. Without
        a key, the shard `chosen` for its level holds if one was, else it is chosen and kept
        there: the unkeyed messages of one call go to one shard."""
        level = message.priority
        if message.key is not None:
            return log_shard(level, zlib.crc32(message.key.encode()) % self.spec.shards)
        if chosen is not None:
            shard = chosen.get(level)
            if shard is None:
                shard = chosen[level] = self._least_busy(level)
            return shard
        return self._least_busy(level)

    def _least_busy(self, level: int) -> int:
        """This publisher's preferred shard of a level unless it has a backlog; then the least busy."""
        preferred = self._writers[log_shard(level, self._preferred)]
        if not preferred.busy or len(preferred.pending) < SPILL_BACKLOG:
            return preferred.shard
        lane = [self._writers[log_shard(level, s)] for s in range(self.spec.shards)]
        return min(lane, key=lambda w: (w.busy, len(w.pending))).shard

    def writer_of(self, shard: int) -> ShardWriter:
        """The writer of a log shard; one this publisher's spec does not know yet (the queue
        grew since it started) is made on first use."""
        writer = self._writers.get(shard)
        if writer is None:
            writer = self._writers[shard] = ShardWriter(self, shard)
        return writer

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # A failure was handed to the waiting publish already; this only keeps it from being logged twice.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def background_done(self) -> None:
        """Wait for the work started in the background so far (completions, settles): tests
        and benchmarks that count statements."""
        await asyncio.gather(*self._background, return_exceptions=True)

    def zookeeper_operations(self) -> int:
        """ZooKeeper requests made so far (head syncs, head reads and writes)."""
        return self.counters.zookeeper_reads + sum(w.heads.reads + w.heads.writes for w in self._writers.values())

    async def flush_heads(self) -> None:
        """Wait until head watermarks reflect every batch written, and their checkpoints
        (shutdown and tests)."""
        for writer in self._writers.values():
            await writer.heads.wait()
        await self.checkpoints.flush()


def written_whole(outcomes: list[Published | BaseException | None]) -> list[Published]:
    """A call's results when every message was written; else its failure: the error itself
    when none was, PartiallyPublished (naming each message's outcome) when some were."""
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if not failures:
        return cast(list[Published], outcomes)
    if len(failures) == len(outcomes):
        raise failures[0]
    raise PartiallyPublished(outcomes)
