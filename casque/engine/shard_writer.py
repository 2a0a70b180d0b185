"""The group commit of one log shard: a writer with at most one batch write in flight.

Publishes that arrive while a write is in flight wait in the writer's pending list and go
out together in the next batch, so under load one conditional write carries many messages
and at low load a message waits only for its own write. A publish is answered only after
its batch is claimed (written at the queue's consistency level) or known lost to a retry.

The writer sees its publisher (casque.engine.publisher.Publisher) only as `PublisherView`,
so this module does not import the one that owns it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from casque.backends import zk
from casque.engine import totals as shard_totals
from casque.engine.batches import Claim, Header, Log, new_writer_id
from casque.engine.checkpoints import HEAD, CheckpointWriter, Position
from casque.engine.clock import BackendClock
from casque.engine.heads import HeadAdvancer
from casque.engine.idempotency import IdempotencyGuard, IdRecord, claim_deadline, recorded
from casque.engine.messages import Published
from casque.engine.pending import PendingPublish, TakeOver
from casque.errors import BackendUnavailable, PublishOutcomeUnknown
from casque.schema import MAX_BATCH_BYTES, QueueRef
from casque.store import Store
from casque.znodes import decode_head

log = logging.getLogger(__name__)

MAX_BATCH_MESSAGES = 1000
# A claim whose outcome is unknown is settled by serial reads of its header, retried with
# backoff for up to this long: the publish is answered only once it is known.
SETTLE_SECONDS = 60.0
SETTLE_RETRY_MIN_SECONDS = 0.1
SETTLE_RETRY_MAX_SECONDS = 2.0
# After this many lost claims in a row, re-read the head instead of walking one batch at a time.
RESYNC_AFTER_CONFLICTS = 3


@dataclass
class PublisherCounters:
    messages: int = 0
    batches: int = 0
    conflicts: int = 0
    unknown_outcomes: int = 0
    cassandra_writes: int = 0
    zookeeper_reads: int = 0


class PublisherView(Protocol):
    """What a shard writer uses of its publisher: where to write, the shared guard of client
    ids, the counters, the group-commit lingers, and the other writers of the queue."""

    store: Store
    queue: QueueRef
    publisher_id: str
    linger: float
    group_linger: float
    log: Log
    clock: BackendClock
    counters: PublisherCounters
    checkpoints: CheckpointWriter
    idempotency: IdempotencyGuard

    def loop(self) -> asyncio.AbstractEventLoop: ...

    def in_background(self, work: Coroutine[Any, Any, None]) -> None: ...

    def writer_of(self, shard: int) -> ShardWriter: ...


class ShardWriter:
    def __init__(self, publisher: PublisherView, shard: int) -> None:
        self._publisher = publisher
        self.shard = shard
        self.pending: deque[PendingPublish] = deque()
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

    def submit(self, item: PendingPublish) -> None:
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
                    self._drop_rest_of_calls(items, error)
                    continue
                for item, result in zip(items, results):
                    item.resolve(result)
        finally:
            self.busy = False

    def _drop_rest_of_calls(self, failed: list[PendingPublish], error: BaseException) -> None:
        """Fail, unwritten, the messages waiting here of the calls a failed batch belonged to.
        What a call writes to a shard is then always the beginning of its messages there, so
        a client that sends the failed ones again keeps each key's order."""
        calls = {id(item.call) for item in failed if item.call is not None}
        if not calls or not any(id(item.call) in calls for item in self.pending):
            return
        cause = BackendUnavailable(f"shard {self.shard}: not written, after an earlier batch of its call failed "
                                   f"({type(error).__name__}: {error})")
        kept: deque[PendingPublish] = deque()
        for item in self.pending:
            if id(item.call) in calls:
                item.fail(cause)
            else:
                kept.append(item)
        self.pending = kept

    async def _unpublished(self, items: list[PendingPublish]) -> list[PendingPublish]:
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
        fresh: list[PendingPublish] = []
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

    async def _settle_apart(self, item: PendingPublish, row: IdRecord) -> None:
        try:
            outcome = await self._settle_or_take_over(item, row)
        except BaseException as error:
            item.fail(error)
            raise
        if isinstance(outcome, Published):
            item.resolve(outcome)
        else:
            outcome.submit(item)

    async def _settle_or_take_over(self, item: PendingPublish, row: IdRecord) -> Published | ShardWriter:
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

    def _take(self) -> list[PendingPublish]:
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
        return decode_head(data)

    async def _sync(self) -> None:
        """Learn the latest batch from the head watermark (and its running totals)."""
        head = await self._read_head()
        self._last_batch = head
        self._totals = await shard_totals.as_of(self._publisher.store, self._publisher.log, self.shard, head)

    async def _write(self, items: list[PendingPublish]) -> tuple[int, str, bool] | Published:
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

    async def _claim_fence(self, items: list[PendingPublish], taken_over: TakeOver) -> tuple[int, str, bool] | Published | None:
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

    async def _claim(self, batch: int, items: list[PendingPublish], writer: str, totals: tuple[int, int] | None) -> Claim:
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
