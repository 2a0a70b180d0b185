"""Publishing: group commit of concurrent publishes into atomically claimed batches.

Each shard has one writer with at most one batch write in flight. Publishes that arrive
while a write is in flight wait in the shard's pending list and go out together in the
next batch, so under load one conditional write carries many messages and at low load a
message waits only for its own write. A publish is acknowledged only after its batch is
written at the queue's consistency level.

Shard choice: a message with a key goes to the shard of its key (per-key order); others go
to this publisher's preferred shard (a hash of its id, so publishers rarely contend for one
shard) and spill to the least busy shard when the preferred one has a backlog.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from kazoo.exceptions import KazooException
from kazoo.recipe.watchers import DataWatch

from casque.backends import zk
from casque.engine.batches import Claim, Header, Log, new_writer_id
from casque.engine.clock import clock_of
from casque.engine.counters import DELAYED_OUT
from casque.engine.delayed import (
    IMMEDIATE_SECONDS,
    MOVED_PREFIX,
    CursorReads,
    DelayedStore,
    due_and_id,
    moved_message,
    read_cursor,
    stored_due,
)
from casque.engine import totals as shard_totals
from casque.engine.checkpoints import HEAD, CheckpointWriter, Checkpoints, Position
from casque.engine.heads import HeadAdvancer
from casque.engine.idempotency import IdempotencyGuard, IdRecord, claim_deadline, recorded
from casque.dataschema.validation import CompiledSchema
from casque.engine.messages import SCHEMA_VERSION_ATTRIBUTE, OutgoingMessage, Published, time_ordered_ids
from casque.errors import BackendUnavailable, CasqueError, InvalidSpec, MessageTooLarge, PublishOutcomeUnknown
from casque.schema import MAX_BATCH_BYTES, QueueRef
from casque.engine.protocol import ProtocolLevel
from casque.specs import QueueSpec, QueueState, log_shard
from casque.store import Store

log = logging.getLogger(__name__)

# What a delayed row's check against the mover's cursor may meet, and retry.
_CHECK_FAILURES = (CasqueError, asyncio.TimeoutError, KazooException)
# A delayed publish waits this long at most for its check (a fresh cursor read takes up to
# CURSOR_READ_SECONDS; a ZooKeeper client cut off reconnects within its session), trying
# again this often; past it, the publish fails as retryable.
CHECK_SECONDS = 15.0
CHECK_RETRY_SECONDS = 0.5

MAX_BATCH_MESSAGES = 1000
# A preferred shard with this many messages waiting behind a write in flight spills over.
SPILL_BACKLOG = 64
# A claim whose outcome is unknown is settled by serial reads of its header, retried with
# backoff for up to this long: the publish is answered only once it is known.
SETTLE_SECONDS = 60.0
SETTLE_RETRY_MIN_SECONDS = 0.1
SETTLE_RETRY_MAX_SECONDS = 2.0
# After this many lost claims in a row, re-read the head instead of walking one batch at a time.
RESYNC_AFTER_CONFLICTS = 3


class _Call:
    """The messages of one publish call that go straight to the log (those without a
    delivery time), answered together: one future for the call instead of one per message,
    which with its gathering cost about as much as the rest of a batch call's work on a
    message. Results land at the messages' places in the call; the first failure fails the
    call, as a gather would.

    A message with a client id (or producer key) is tracked by the idempotency guard as
    this call's slot (`keys`, by index): a publish of the same id meanwhile waits on a
    future made for that slot alone (`watch`), and the guard hears when each slot lands
    (`IdempotencyGuard.slot_ended`), whatever became of the call."""

    __slots__ = ("future", "results", "remaining", "guard", "keys", "started", "watchers")

    def __init__(self, future: asyncio.Future[list[Published | None]], size: int, guard: IdempotencyGuard) -> None:
        self.future = future
        self.results: list[Published | None] = [None] * size
        self.remaining = 0
        self.guard = guard
        self.keys: dict[int, str] | None = None
        # When its first id was tracked, before any intent of the call is written: what memory
        # keeps of its ids ends before their rows do.
        self.started = 0.0
        self.watchers: dict[int, asyncio.Future[Published]] | None = None

    def track(self, index: int, client_id: str) -> None:
        if self.keys is None:
            self.keys = {}
            self.started = time.monotonic()
        self.keys[index] = client_id
        self.guard.track_slot(client_id, self, index)

    def watch(self, index: int) -> asyncio.Future[Published]:
        """A future of the message at `index` alone (made for a publish of its id that waits)."""
        if self.watchers is None:
            self.watchers = {}
        watcher = self.watchers.get(index)
        if watcher is None:
            watcher = self.watchers[index] = self.future.get_loop().create_future()
        return watcher

    def resolve(self, index: int, result: Published) -> None:
        if self.results[index] is not None:
            return  # answered already
        self.results[index] = result
        self._ended(index, result, None)
        if self.future.done():
            return  # failed, or its caller went away
        self.remaining -= 1
        if self.remaining == 0:
            self.future.set_result(self.results)

    def fail(self, index: int, error: BaseException) -> None:
        self._ended(index, None, error)
        if not self.future.done():
            self.future.set_exception(error)

    def _ended(self, index: int, result: Published | None, error: BaseException | None) -> None:
        if self.keys is not None and index in self.keys:
            self.guard.slot_ended(self.keys[index], self, index, result, self.started)
        if self.watchers is not None:
            watcher = self.watchers.pop(index, None)
            if watcher is not None and not watcher.done():
                if result is not None:
                    watcher.set_result(result)
                else:
                    watcher.set_exception(error or asyncio.CancelledError())


@dataclass
class _Pending:
    message_id: str
    message: OutgoingMessage
    # Its own future; or None, answered through `call` at `index`.
    future: asyncio.Future[Published] | None
    # Its client id is known not to be published (checked, or an intent settled): no check again.
    checked: bool = False
    # Set when this publish took its id over from an intent whose writer can claim no more.
    taken_over: TakeOver | None = None
    # The claim window its id check opened: (wall-clock deadline, monotonic end of claims).
    window: tuple[datetime, float] | None = None
    call: _Call | None = None
    index: int = 0

    def resolve(self, result: Published) -> None:
        if self.future is None:
            assert self.call is not None
            self.call.resolve(self.index, result)
        elif not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if self.future is None:
            assert self.call is not None
            self.call.fail(self.index, error)
        elif not self.future.done():
            self.future.set_exception(error)


@dataclass
class TakeOver:
    """A publish that took its id over: its intent is recorded already, under `writer`, whose
    claims end at `claims_until` (monotonic). Its first claim is for `fence_batch` (if any),
    where a late claim of one of the `replaces` writers may land instead (see idempotency)."""

    writer: str
    claims_until: float
    fence_batch: int | None
    replaces: frozenset[str]


class DelayedPublish:
    """The states of a delayed publish with an id (a client id or a producer key) on its
    way to the log (`Publisher._route`), and what a retry of the id does in each: whatever
    fails in between, the message is stored once, and moved into the log once.

    A delayed message's id carries its due time, and its row is stored at exactly that time
    (`delayed.due_and_id`), so the id alone finds the row again (`delayed.stored_due`).
    """

    NEW = "NEW"
    """Nothing holds the id. A retry publishes it as a first attempt, under a new message id:
    no row was stored either (the record comes first)."""

    RECORDED = "RECORDED"
    """The id's record names the message id, as a delayed message (shard, batch and seq -1);
    the row may not be stored yet. A record written before its row, not after: a row stored
    (or applied unanswered) with no record was found by nobody, and the retry stored a
    second message. A retry, through any sidecar, stores the row again at the due time the
    id carries (the same row), checks it against the mover, and answers the first publish,
    `duplicate: true` (`Publisher._keep_delayed`). A record write that failed may have been
    applied or not: the retry finds RECORDED or NEW, one message either way."""

    STORED = "STORED"
    """The row is in `delayed` and counted in (`delayed_in`; a count that failed leaves the
    retry to answer, uncounted: counts are statistics). The mover may have passed its due
    time before the row landed, so the publish is not answered yet."""

    CHECKED = "CHECKED"
    """The mover's cursor was read after the row landed: the mover will read the row, or this
    writer moved it (`Publisher._move_if_passed`). Answered now; any failure before this
    is answered 503, and the retry completes the publish from RECORDED."""

    MOVED = "MOVED"
    """In the log under the client id `delayed/<message id>`: moved twice (the mover and the
    writer, a failover, a retry's check), it is stored once."""


@dataclass
class PublisherCounters:
    messages: int = 0
    batches: int = 0
    conflicts: int = 0
    unknown_outcomes: int = 0
    cassandra_writes: int = 0
    zookeeper_reads: int = 0


class ShardWriter:
    def __init__(self, publisher: Publisher, shard: int) -> None:
        self._publisher = publisher
        self.shard = shard
        self.pending: deque[_Pending] = deque()
        self.busy = False
        self._last_batch: int | None = None
        self._totals: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        # Whether the last batch written held more than one message: publishes arrive side by
        # side, so the next batch is worth a short wait (Publisher.group_linger).
        self._shared = False
        paths = publisher.store.paths(publisher.queue)
        checkpoints = publisher.checkpoints
        self.heads = HeadAdvancer(publisher.store.zk, paths.head(shard), paths.totals(shard),
                                  written=lambda batch, totals: checkpoints.note(HEAD, shard, Position(batch, 0, totals)))

    def submit(self, item: _Pending) -> None:
        self.pending.append(item)
        if self._task is None or self._task.done():
            # Busy from now on, not from when the task first runs: the shard choice of the
            # publishes arriving meanwhile depends on it.
            self.busy = True
            self._task = self._publisher.loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            linger = self._publisher.linger or (self._publisher.group_linger if self._shared else 0.0)
            if linger > 0:
                await asyncio.sleep(linger)
            while self.pending:
                items = self._take()
                self._shared = len(items) > 1
                try:
                    items = await self._unpublished(items)
                    if not items:
                        continue
                    written = await self._write(items)
                    if isinstance(written, Published):
                        items[0].resolve(written)  # a replaced writer's claim won the fence
                        continue
                    batch, writer, completes = written
                    results = [Published(item.message_id, self.shard, batch, seq) for seq, item in enumerate(items)]
                    with_ids = [item.message for item in items if item.message.client_id]
                    if with_ids and completes:
                        # Only spares a retry the serial reads that settle an intent (the
                        # intents lead it here without it), so it does not hold up the answer
                        # or the next batch.
                        self._publisher.in_background(
                            self._publisher.idempotency.record_won(with_ids, writer, self.shard, batch))
                except BaseException as error:
                    self._last_batch = None  # knowledge of the shard is unsure: resync before the next claim
                    for item in items:
                        item.fail(error)
                    if isinstance(error, asyncio.CancelledError):
                        raise
                    continue
                for item, result in zip(items, results):
                    item.resolve(result)
        finally:
            self.busy = False

    async def _unpublished(self, items: list[_Pending]) -> list[_Pending]:
        """The items to write: those whose client id was published before are answered with
        the first publish (one read for the batch); one whose id has only an intent is settled
        apart, so that a wait for its deadline holds up nothing else."""
        ids = [item.message.client_id for item in items if item.message.client_id and not item.checked]
        if not ids:
            return items
        guard = self._publisher.idempotency
        # "Not published" holds only until a retry elsewhere finds the same and publishes: the
        # window opens before the check, so intents and claims after it are never sent.
        window = claim_deadline(self._publisher.clock.now())
        rows = await guard.lookup(ids)
        fresh: list[_Pending] = []
        for item in items:
            row = None if item.checked or not item.message.client_id else rows.get(item.message.client_id)
            if row is None:
                if item.message.client_id and not item.checked:
                    item.window = window
                fresh.append(item)
            elif row.batch_no is not None:
                item.resolve(recorded(row))
            else:
                self._publisher.in_background(self._settle_apart(item, row))
        return fresh

    async def _settle_apart(self, item: _Pending, row: IdRecord) -> None:
        try:
            outcome = await self._settle_or_take_over(item, row)
        except BaseException as error:
            item.fail(error)
            raise
        if isinstance(outcome, Published):
            item.resolve(outcome)
        else:
            outcome.submit(item)

    async def _settle_or_take_over(self, item: _Pending, row: IdRecord) -> Published | ShardWriter:
        """The earlier publish of the item's id; or the shard writer to publish it with, once
        it may be published: it took the id over (its intent recorded), or the id expired."""
        guard = self._publisher.idempotency
        client_id = item.message.client_id
        assert client_id is not None
        while True:
            outcome = await guard.settle(row)
            if isinstance(outcome, Published):
                return outcome
            # The intent's writer can claim no more. Take the id over, unless another retry
            # (another sidecar) did first: then settle that one's intent. A late claim of the
            # writer can only land on the fence batch of the intent's shard: the publish
            # claims that batch first (see idempotency).
            target = self if outcome.fence_batch is None else self._publisher.writer_of(outcome.shard)
            writer = new_writer_id(self._publisher.publisher_id)
            since = outcome.fence_batch if outcome.fence_batch is not None else await target.next_batch()
            deadline, claims_until = claim_deadline(self._publisher.clock.now())
            if await guard.take_over(row, item.message, target.shard, writer, since, deadline, outcome.replaces):
                item.message_id = row.message_id
                item.checked = True
                item.taken_over = TakeOver(writer, claims_until, outcome.fence_batch, outcome.replaces)
                return target
            fresh = (await guard.lookup([client_id])).get(client_id)
            if fresh is None:
                return self  # expired meanwhile: published as a first attempt
            if fresh.batch_no is not None:
                return recorded(fresh)
            row = fresh

    async def next_batch(self) -> int:
        """The batch this writer claims next, as far as it knows: never above the one it gets."""
        return (self._last_batch if self._last_batch is not None else await self._read_head()) + 1

    def _take(self) -> list[_Pending]:
        items = [self.pending.popleft()]
        if items[0].taken_over is not None:
            return items  # a batch of its own, under the writer id its intent names
        size = items[0].message.size
        while self.pending and len(items) < MAX_BATCH_MESSAGES and self.pending[0].taken_over is None:
            nxt = self.pending[0].message.size
            if size + nxt > MAX_BATCH_BYTES:
                break
            items.append(self.pending.popleft())
            size += nxt
        return items

    async def _checkpointed_head(self) -> int:
        publisher = self._publisher
        try:
            found = await publisher.checkpoints.checkpoints.read_shard(HEAD, self.shard)
        except Exception as error:  # every driver error: walking on is slower, not wrong
            log.info("shard %d: head checkpoint not read (%r)", self.shard, error)
            return 0
        return 0 if found is None else found.batch

    async def _read_head(self) -> int:
        """The shard's head watermark: every batch up to it exists."""
        store = self._publisher.store
        data, _ = await _zk_get(store, store.paths(self._publisher.queue).head(self.shard))
        self._publisher.counters.zookeeper_reads += 1
        return int(data or b"0")

    async def _sync(self) -> None:
        """Learn the latest batch from the head watermark (and its running totals)."""
        head = await self._read_head()
        self._last_batch = head
        self._totals = await shard_totals.as_of(self._publisher.store, self._publisher.log, self.shard, head)

    async def _write(self, items: list[_Pending]) -> tuple[int, str, bool] | Published:
        """The batch the items were written in, the writer id that won it, and whether its
        ids want their completion (`IdempotencyGuard.record_won`); or, for a publish that
        took its id over, the replaced writer's publish if that won the fence."""
        publisher = self._publisher
        counters = publisher.counters
        conflicts = 0
        # One writer id for every claim attempt of these items: an intent names it, and a
        # retry of one of their ids finds the batch by it.
        writer = new_writer_id(publisher.publisher_id)
        intents = [(item.message, item.message_id, seq) for seq, item in enumerate(items) if item.message.client_id]
        claims_until: float | None = None
        completes = True
        taken_over = items[0].taken_over
        if taken_over is not None:  # alone in its batch, its intent recorded already
            writer, claims_until, intents = taken_over.writer, taken_over.claims_until, []
            if taken_over.fence_batch is not None:
                fenced = await self._claim_fence(items, taken_over)
                if fenced is not None:
                    return fenced
        while True:
            if self._last_batch is None or conflicts >= RESYNC_AFTER_CONFLICTS:
                previous = self._last_batch
                await self._sync()
                assert self._last_batch is not None
                if previous is not None and self._last_batch < previous:
                    # The head lags what we learned (a repair pending, or a ZooKeeper restored
                    # from an older snapshot): go on from the head's checkpoint if it is further,
                    # rather than walk the log one lost claim at a time.
                    self._last_batch = max(previous, await self._checkpointed_head())
                    self._totals = None
                conflicts = 0
            if self._totals is None:
                await self._recover_totals(self._last_batch)
            batch = self._last_batch + 1
            if intents and claims_until is None:
                deadline, claims_until = min((i.window for i in items if i.window is not None), key=lambda w: w[1])
                # Past the window a retry may have published these ids: its record must not be
                # overwritten by our intents.
                _check_window(self.shard, claims_until)
                completes = await publisher.idempotency.record_intents(intents, self.shard, writer, batch, deadline)
            _check_window(self.shard, claims_until)
            claim = await self._claim(batch, items, writer, self._totals)
            counters.cassandra_writes += 1
            self._learn(batch, claim)
            if claim.applied:
                counters.batches += 1
                counters.messages += len(items)
                self.heads.advance(batch, self._totals)
                return batch, writer, completes
            counters.conflicts += 1
            conflicts += 1

    async def _claim_fence(self, items: list[_Pending], taken_over: TakeOver) -> tuple[int, str, bool] | Published | None:
        """A taken-over publish's first claim, for its fence batch (whatever this writer knows
        of later batches): won, lost to a replaced writer (whose publish is the answer), or
        lost to anyone else (None: the replaced writers can no longer land; go on as usual)."""
        assert taken_over.fence_batch is not None
        batch = taken_over.fence_batch
        _check_window(self.shard, taken_over.claims_until)
        totals = await self._totals_before(batch)
        claim = await self._claim(batch, items, taken_over.writer, totals)
        self._publisher.counters.cassandra_writes += 1
        if self._last_batch is None or batch > self._last_batch:
            self._learn(batch, claim)
        if claim.applied:
            self._publisher.counters.batches += 1
            self._publisher.counters.messages += 1
            self.heads.advance(batch, shard_totals.of_header(claim.header))
            return batch, taken_over.writer, True
        self._publisher.counters.conflicts += 1
        if claim.header is not None and claim.header.writer in taken_over.replaces:
            item = items[0]
            assert item.message.client_id is not None
            return await self._publisher.idempotency.complete(
                item.message.client_id, item.message_id, self.shard, batch, None)
        return None

    def _learn(self, batch: int, claim: Claim) -> None:
        """What a claim (won or lost) tells of the shard: its batch exists, with these totals."""
        header = claim.header
        self._last_batch = batch
        self._totals = shard_totals.of_header(header)

    async def _totals_before(self, batch: int) -> tuple[int, int] | None:
        """The running totals as of the batch before `batch`, from its header read at SERIAL."""
        publisher = self._publisher
        return await shard_totals.as_of(publisher.store, publisher.log, self.shard, batch - 1, serial=True)

    async def _recover_totals(self, batch: int) -> None:
        """The running totals as of `batch` (known to exist), from its header read at SERIAL.

        A claim must never carry unknown totals: the next claims build on its header, so one
        unknown total (a head that lagged, a header not yet visible at a weak consistency)
        would leave every later batch of the shard without published counts, and stats
        without lag in messages, for good.
        """
        publisher = self._publisher
        self._totals = await shard_totals.as_of(publisher.store, publisher.log, self.shard, batch, serial=True)

    async def _claim(self, batch: int, items: list[_Pending], writer: str, totals: tuple[int, int] | None) -> Claim:
        log_ = self._publisher.log
        payload = [(item.message_id, item.message) for item in items]
        try:
            return await log_.claim(self.shard, batch, payload, writer, totals)
        except BackendUnavailable as error:
            # A failed conditional write (a timeout, CAS_WRITE_UNKNOWN, a lost connection) may
            # still have been applied. A serial read settles the Paxos round, so afterwards
            # the header tells whose batch it is: ours, another writer's, or nobody's, and
            # only "nobody's" may be answered as a failure the client can retry.
            self._publisher.counters.unknown_outcomes += 1
            header = await self._settle(batch, error)
            if header is None:
                raise BackendUnavailable(f"batch {batch} of shard {self.shard} was not written: {error}") from error
            return Claim(applied=header.writer == writer, header=header)

    async def _settle(self, batch: int, cause: BackendUnavailable) -> Header | None:
        """The header of `batch` read at SERIAL, retried until the cluster answers (or give up
        after SETTLE_SECONDS with PublishOutcomeUnknown: the publish may have happened)."""
        deadline = time.monotonic() + SETTLE_SECONDS
        delay = SETTLE_RETRY_MIN_SECONDS
        while True:
            try:
                return await self._publisher.log.read_header(self.shard, batch, serial=True)
            except BackendUnavailable as error:
                if time.monotonic() + delay > deadline:
                    raise PublishOutcomeUnknown(
                        f"batch {batch} of shard {self.shard} may have been written ({cause}); Cassandra did not "
                        f"answer which in {SETTLE_SECONDS:.0f}s: retry with the same id"
                    ) from error
                await asyncio.sleep(delay)
                delay = min(delay * 2, SETTLE_RETRY_MAX_SECONDS)


def _check_window(shard: int, claims_until: float | None) -> None:
    """Refuse to send a claim after the window its intents allow: past it, a retry of these
    ids may decide they were never published. Checked right before every claim."""
    if claims_until is not None and time.monotonic() > claims_until:
        raise BackendUnavailable(f"shard {shard}: no batch won within the claim window; retry")


async def _zk_get(store: Store, path: str) -> tuple[bytes, object]:
    result: tuple[bytes, object] = await zk.call(store.zk.get_async, path)
    return result


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
        self._delayed: DelayedStore | None = None
        self._cursor_reads: CursorReads | None = None
        # The mover's `until` as its znode's watch last told.
        self._mover_cursor: datetime | None = None
        # Delayed rows this publisher moved itself, the mover having passed them (see _move_if_passed).
        self.delayed_moves = 0
        self.counters = PublisherCounters()
        # The heads written, checkpointed in Cassandra for a ZooKeeper that loses them.
        self.checkpoints = CheckpointWriter(Checkpoints(self.store, self.queue, self.state.shared_key(self.queue)))
        self._writers = {shard: ShardWriter(self, shard) for shard in self.spec.log_shards()}
        self._preferred = zlib.crc32(self.publisher_id.encode()) % self.spec.shards
        if self.protocol is None:
            self.protocol = ProtocolLevel.of(self.store)
        self.idempotency = IdempotencyGuard(self.store, self.state.shared_key(self.queue), self.log,
                                            self.spec.deduplication_window, self.protocol)
        self._background: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Compiled once per schema version (casque.dataschema.validation keeps them): a spec
        # change gives the process a new Publisher, so this is the version in force.
        schema = self.spec.data_schema
        self.schema = None if schema is None else CompiledSchema.of(schema, self.state.schema_version)

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
        """Publish all or, on a validation error, none; results in input order.

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
        call = _Call(self.loop().create_future(), len(messages), guard)
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
                    _Pending(message_id, message, None, call=call, index=index))
            else:  # a publish of its id under way or done, or its own route to a delivery time
                apart[index] = earlier if earlier is not None else self._start(message, message_id, due, chosen, drawn)
        if not apart:
            return cast(list[Published], await call.future)
        waits = [call.future] if call.remaining else []
        answers: list[Any] = list(await asyncio.gather(*waits, *apart.values()))
        results: list[Published | None] = answers[0] if waits else [None] * len(messages)
        for index, result in zip(apart, answers[len(waits):]):
            results[index] = result
        return cast(list[Published], results)

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
                       else asyncio.get_running_loop().create_task(self._route(message, message_id, due)))
        if client_id is not None:
            guard.track(client_id, publication)
        return publication

    def _due(self, message: OutgoingMessage) -> datetime | None:
        """When a message is to be delivered: its own time or delay, or the queue's default
        delay from now (not for a delayed message being moved into the log); None: at once."""
        if message.deliver_at is not None:
            return message.deliver_at
        if message.delay_seconds is not None:
            return self.clock.now() + timedelta(seconds=message.delay_seconds)
        if self.spec.default_delay_seconds and not (message.client_id or "").startswith(MOVED_PREFIX):
            return self.clock.now() + timedelta(seconds=self.spec.default_delay_seconds)
        return None

    def _to_log(self, message: OutgoingMessage, message_id: str,
                chosen: dict[int, int] | None = None) -> asyncio.Future[Published]:
        """Hand a message to its shard's writer: the future of where it was written."""
        future: asyncio.Future[Published] = self.loop().create_future()
        self._writers[self._choose_shard(message, chosen)].submit(_Pending(message_id, message, future))
        return future

    async def _route(self, message: OutgoingMessage, message_id: str, due: datetime) -> Published:
        """A message with a delivery time: into the delayed table, or into the log if due
        already. With an id, through the states of DelayedPublish."""
        if message.client_id:
            earlier = await self.idempotency.earlier(message.client_id)
            if earlier is not None:
                if earlier.batch >= 0:
                    return earlier
                return await self._keep_delayed(earlier, due, message)  # RECORDED, by an attempt before
        if not self._is_later(due):
            return await self._to_log(message, message_id)
        result = Published(message_id, -1, -1, -1, deliver_at=due)
        state = DelayedPublish.NEW
        try:
            if message.client_id:
                # Before the row: whatever fails from here on, a retry finds the message id.
                await self.idempotency.record_positions([(message, result)])
                state = DelayedPublish.RECORDED
            await self._delayed_store().insert(message_id, due, message)
            state = DelayedPublish.STORED
            await self._move_if_passed(message_id, due, message)
        except Exception as error:
            if message.client_id:
                log.info("queue %s: delayed message %s failed after %s (%s): a retry with its id stores it once",
                         self.queue, message_id, state, error)
            raise
        return result

    async def _keep_delayed(self, earlier: Published, due: datetime, message: OutgoingMessage) -> Published:
        """A retry of a delayed publish whose id an attempt before recorded (RECORDED): that
        attempt may have failed before its row was stored, or after (its write unanswered,
        its count or its check against the mover failed, its process gone), so its row may be
        missing or lie behind the mover, unread. The row is stored again under the recorded
        message id at the due time that id carries: the same row, whatever this retry's own
        delay says. Then it is checked, or moved now if due; both moves are under one client
        id, so the message is stored once. Not counted in again. Answered as the first
        publish, with its due time."""
        due = stored_due(earlier.message_id, due)
        if self._is_later(due):
            await self._delayed_store().insert(earlier.message_id, due, message, count=False)
            await self._move_if_passed(earlier.message_id, due, message)
        else:
            await self._move_now(earlier.message_id, message)
        return replace(earlier, deliver_at=due)

    def _is_later(self, due: datetime) -> bool:
        """Whether a message due at `due` waits in the delayed table (else: straight into the log)."""
        now = self.clock.now()
        if (due - now).total_seconds() <= IMMEDIATE_SECONDS:
            return False
        # The mover has read up to its cursor (our clock may lag its): a row due before that
        # is due now. (Its watch may lag too; `_move_if_passed` settles what it missed.)
        cursor = self._mover_cursor
        return cursor is None or due > cursor

    async def _move_if_passed(self, message_id: str, due: datetime, message: OutgoingMessage) -> None:
        """After a delayed row is written, before the publish is answered: if the mover has
        started a pass that reads rows due by `due`, that pass may have read before the row
        landed, so the row is moved now, with the mover's client id for it (both moves store
        one message). Otherwise every pass that reads it starts after it landed.

        The publish is answered only once this is done: a check left to the background was
        lost with its process (kill -9), and the row behind the mover with it. If ZooKeeper
        does not answer within CHECK_SECONDS the publish fails as retryable; its row is
        stored, and a retry (same client id) stores and checks it again (`_keep_delayed`)."""
        deadline = asyncio.get_running_loop().time() + CHECK_SECONDS
        while True:
            try:
                await self._check_and_move(message_id, due, message)
                return
            except _CHECK_FAILURES as error:
                if asyncio.get_running_loop().time() >= deadline:
                    raise BackendUnavailable(
                        f"delayed message {message_id} is stored but could not be checked against the "
                        f"mover's cursor ({type(error).__name__}: {error}); publish it again") from error
                log.info("queue %s: delayed message %s not checked against the mover's cursor yet (%s)",
                         self.queue, message_id, error)
            await asyncio.sleep(CHECK_RETRY_SECONDS)

    async def _check_and_move(self, message_id: str, due: datetime, message: OutgoingMessage) -> None:
        assert self._cursor_reads is not None
        cursor = await self._cursor_reads.read()
        if cursor is not None and cursor.until >= due:
            await self._move_now(message_id, message)

    async def _move_now(self, message_id: str, message: OutgoingMessage) -> None:
        self.delayed_moves += 1
        (moved,) = await self.publish([moved_message(message_id, message, self.spec.retention_seconds)], [message_id])
        if not moved.duplicate:
            await self._delayed_store().counters.add(DELAYED_OUT, 1)

    def _delayed_store(self) -> DelayedStore:
        if self._delayed is None:
            self._delayed = DelayedStore(self.store, self.state.shared_key(self.queue), self.spec.retention_seconds)
            self._cursor_reads = CursorReads(self.store, self.store.paths(self.queue).mover)
            loop = asyncio.get_running_loop()
            DataWatch(self.store.zk, self.store.paths(self.queue).mover,
                      zk.watch_in_loop(loop, self._cursor_changed, lambda: True))
        return self._delayed

    def _cursor_changed(self, data: bytes | None, *_: object) -> None:
        try:
            cursor = read_cursor(data)
        except (ValueError, KeyError):
            cursor = None
        self._mover_cursor = None if cursor is None else cursor.until

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
