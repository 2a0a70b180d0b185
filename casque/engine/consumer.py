"""A consumer: one member of a subscriber's group, delivering from the shards it leases.

For each leased shard a reader loads batches ahead of the offset (skipping messages that
the ack log says are done), wakes on the shard's head znode watch when it has caught up,
and commits the offset when batches complete. `receive` takes ready messages round-robin
over all leased shards, so no shard is stranded, and long-polls on an event instead of a
timer. Each delivery gets a receipt naming its nonce; ack, nack and extend must present
the current one.

Faults: every per-shard task (fetch, commit) retries any error with backoff and reports it
as the shard's `problem` (readiness says so); offset commits are fenced by the lease
acquisition (casque.engine.offsets), so a member that lost a shard without noticing cannot
move its offset, and acks written as rows are answered only after the fence is checked
again; seeks are recognised by the epoch in the offset znode and handled shard by shard;
a session loss drops every shard, and the member rejoins (casque.engine.leases). A
subscriber deleted (or deleted and created again) ends this consumer: its waiting calls get
SubscriberNotFound, and the owner starts a new consumer for the new incarnation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Union

from kazoo.exceptions import KazooException, NoNodeError
from kazoo.recipe.watchers import DataWatch
from pydantic import ValidationError

from casque.backends import zk
from casque.engine import catalog, offsets, positions
from casque.engine.acks import ACK, DEAD, AckEvent, AckLog, BatchMarks
from casque.engine.batches import Log
from casque.engine.counters import QueueCounters, dead_lettered
from casque.engine.deadletters import addressed_elsewhere, dead_letter_copy
from casque.engine.keylocks import KeyLocks
from casque.engine.leases import ShardLeases
from casque.engine.messages import Delivery, Position, decode_receipt, encode_receipt
from casque.engine.offsets import CommitOutcome, OffsetRecord
from casque.engine.publisher import Publisher
from casque.engine.shard_state import AckStart, ByteBudget, Handout, ShardState
from casque.engine.sharing import ClaimReader, SharedDelivery
from casque.errors import (
    BackendUnavailable,
    CasqueError,
    InvalidSpec,
    LeaseLost,
    StaleReceipt,
    SubscriberNotFound,
)
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueState, SubscriberState, priority_of
from casque.store import Store

log = logging.getLogger(__name__)

# Where a delivery comes from: a leased shard's reader, or a claimed range (shared delivery).
Source = Union["ShardReader", ClaimReader]

# Load more batches while fewer than this many messages, and fewer than this many payload
# bytes, of the shard are held in memory (loaded and not done).
PREFETCH_MESSAGES = 2000
PREFETCH_BYTES = 8 * 1024 * 1024
# ... and fewer than this many payload bytes over all the consumer's shards: a sidecar may
# hold dozens of shards (shards x priority levels), and its container has 256 MiB.
CONSUMER_PREFETCH_BYTES = 16 * 1024 * 1024
# When caught up, the head watch wakes the reader; this slow check only covers a publisher
# that died between writing a batch and advancing the head.
CAUGHT_UP_RECHECK_SECONDS = 5.0
OFFSET_COMMIT_INTERVAL = 0.05
# A failing read, commit or resync is tried again after a backoff between these bounds.
RETRY_MIN_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
# With several priority levels ready, at least one delivery in this many comes from a lower level.
PRIORITY_FAIRNESS = 10
# Each consumer reports its in-flight and delivery counts in its member znode this often.
REPORT_INTERVAL_SECONDS = 5.0


# An ack this call started: its index in the call's results, where it came from, its ack
# event, and the delivery's nonce.
_Acking = tuple[int, Source, AckEvent, int]


def _seek_overtook(reader: Source) -> StaleReceipt:
    """The answer to an ack of a delivery whose shard a seek moved before this member applied it.

    A seek is answered once its transaction is in ZooKeeper; members learn of it through a
    watch, later, and until then deliver from the old epoch. Such a delivery is one the seek
    replays (or skips), so its ack must not be answered `acked`: the message may come again.
    """
    return StaleReceipt(f"a seek moved shard {reader.shard} after this delivery; it is replayed from the new position")


class ConsumerStopped(CasqueError):
    code = "consumer_stopped"


@dataclass
class ConsumerCounters:
    deliveries: int = 0
    redeliveries: int = 0
    acks: int = 0
    nacks: int = 0
    dead_lettered: int = 0
    offset_commits: int = 0
    batch_reads: int = 0
    ack_bucket_reads: int = 0
    expired_skipped: int = 0
    retries: int = 0
    leases_lost: int = 0
    seeks_applied: int = 0
    # Deliveries put back because the app never got them (its connection had closed).
    handed_back: int = 0
    # Lease checks after ack rows: answered by ZooKeeper, and proven without asking it.
    lease_checks: int = 0
    lease_proofs: int = 0


@dataclass(frozen=True)
class ShardStatus:
    held: list[int]
    # Due to this member but not held, and held but failing to read or commit.
    missing: list[int] = field(default_factory=list)
    failing: dict[int, str] = field(default_factory=dict)
    problem: str = ""

    @property
    def unread(self) -> int:
        """Shards due to this member that nobody reads now (all of them, as far as it knows, when
        it is not in the group: then the count is what it holds, at least one)."""
        if self.problem and not self.missing and not self.failing:
            return max(1, len(self.held))
        return len(self.missing) + len(self.failing)


class Backoff:
    """Exponential backoff for a retried step; `reset` after a success."""

    def __init__(self) -> None:
        self.delay = RETRY_MIN_SECONDS

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, RETRY_MAX_SECONDS)
        return delay

    def reset(self) -> None:
        self.delay = RETRY_MIN_SECONDS


class ShardReader:
    def __init__(self, consumer: Consumer, shard: int, record: OffsetRecord, fence: int, seek_mark: int) -> None:
        """`seek_mark`: the subscriber's seek mark read before `record` (offsets.read_seek_mark)."""
        self.consumer = consumer
        self.shard = shard
        self.epoch = record.epoch
        # While the seek mark is still this, no seek has moved the shard from `epoch`.
        self.seek_mark: int | None = seek_mark
        self.fence = fence
        ordered = consumer.subscriber_state.spec.ordered_keys
        self.state = ShardState(shard=shard, offset=record.offset,
                                locks=KeyLocks(on_release=consumer.notify) if ordered else None)
        # What went wrong last in this shard's reading or committing; empty while all is well.
        self.problem = ""
        self._committed = record.offset
        self._version = record.version
        self._head = 0
        self._wake = asyncio.Event()
        # Read all there is and waiting for the head watch (or the slow recheck) to wake it.
        self.caught_up = False
        # Holding as much as the prefetch allows: freed space wakes the reader. Otherwise it
        # waits for the head to move: an ack never makes new batches exist, and waking a
        # caught-up reader on every ack cost an empty Cassandra read per shard per ack call.
        self._full = False
        self._marks: dict[int, dict[int, BatchMarks]] = {}
        self._stopped = False
        # Handing the shard over: no new deliveries from it; acks of those in flight still taken.
        self.releasing = False
        self._settled = asyncio.Event()
        # No offset writes any more: the lease is gone, or a seek owns the offset now.
        self._fenced = False
        self._stopping: asyncio.Task[None] | None = None
        self._fetch_task: asyncio.Task[None] | None = None
        self._commit_task: asyncio.Task[None] | None = None
        self._commit_wanted = asyncio.Event()
        self._stop_event = asyncio.Event()
        # Batch ranges [start, end) confirmed expired: the offset jumps over them.
        self._gaps: dict[int, int] = {}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        paths = self.consumer.store.paths(self.consumer.queue)
        DataWatch(
            self.consumer.store.zk,
            paths.head(self.shard),
            zk.watch_in_loop(loop, self._head_changed, lambda: not self._stopped),
        )
        self._fetch_task = loop.create_task(self._supervised("read", self._fetch_loop))
        self._commit_task = loop.create_task(self._supervised("commit", self._commit_loop))

    @property
    def current(self) -> bool:
        """Whether this reader still is the consumer's reader of its shard."""
        return self.consumer.readers.get(self.shard) is self and not self._stopped

    def _head_changed(self, data: bytes | None, *_: object) -> None:
        if data:
            self._head = int(data)
        self._wake.set()

    def space_freed(self) -> None:
        if self._full:
            self._wake.set()
        consumer = self.consumer
        if consumer.prefetch_blocked and consumer.loaded_bytes() < CONSUMER_PREFETCH_BYTES:
            consumer.prefetch_blocked = False
            for reader in consumer.readers.values():
                reader._wake.set()
        if self.state.in_flight == 0:
            self._settled.set()

    async def hand_over(self) -> None:
        """Stop delivering from this shard and wait until every delivery in flight is settled
        (acked, nacked, dead-lettered) or its visibility has ended, so that the next holder
        never redelivers a message the app may still be working on, and with ordered keys no
        key is in flight at two members. An extend during the hand-over is honoured too. It
        ends early if the shard is lost or the consumer stops (its drain has run already)."""
        self.releasing = True
        while self.current and not self.consumer.stopping:
            now = time.monotonic()
            self.state.has_ready(now)  # counts expired visibility out of the in-flight total
            if self.state.in_flight == 0:
                return
            self._settled.clear()
            due = self.state.next_due()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.01, min((due or now + 1) - now, 1.0)))
            except TimeoutError:
                pass

    async def _supervised(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run a loop until the reader stops; whatever escapes it is logged and the loop restarted."""
        backoff = Backoff()
        while not self._stopped:
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.problem = f"{name}: {type(error).__name__}: {error}"
                self.consumer.counters.retries += 1
                log.exception("shard %s: %s loop failed; restarting it", self.shard, name)
                await self._pause(backoff.next())

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake up at once when the reader stops."""
        try:
            await asyncio.wait_for(self._stop_event.wait(), seconds)
        except TimeoutError:
            pass

    # --- reading -------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        backoff = Backoff()
        while not self._stopped:
            self._wake.clear()
            try:
                progressed = await self._fetch_once()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # every driver error: retry with backoff, say so meanwhile
                self.problem = f"read: {type(error).__name__}: {error}"
                self.consumer.counters.retries += 1
                log.warning("shard %s: reading failed (%s); retrying", self.shard, self.problem)
                await self._pause(backoff.next())
                continue
            self.problem = ""
            backoff.reset()
            if progressed:
                continue
            self.caught_up = True
            try:
                await asyncio.wait_for(self._wake.wait(), CAUGHT_UP_RECHECK_SECONDS)
            except TimeoutError:
                pass
            finally:
                self.caught_up = False

    async def _fetch_once(self) -> bool:
        """Load the next batches if there is room; True if something changed."""
        state = self.state
        self._full = True
        if state.loaded_messages >= PREFETCH_MESSAGES or state.loaded_bytes >= PREFETCH_BYTES:
            return False
        consumer = self.consumer
        if consumer.loaded_bytes() >= CONSUMER_PREFETCH_BYTES:
            consumer.prefetch_blocked = True  # space_freed anywhere wakes this reader again
            return False
        self._full = False
        first = state.next_batch
        batches = await consumer.log.read_from(self.shard, first)
        consumer.counters.batch_reads += 1
        if batches:
            found = batches[0].header.batch
            if found > first:
                await self._skip_missing(first, found)
            marks = await self._marks_for(found)
            for batch in batches:
                mark = marks.get(batch.header.batch, BatchMarks())
                # Redriven messages addressed to another subscriber are done for this one.
                skipped = {m.position.seq for m in batch.messages
                           if m.attributes and addressed_elsewhere(m, consumer.subscriber)}
                state.add_batch(batch.header.batch, batch.messages, mark.done | skipped, mark.deliveries)
            consumer.notify()
            self.schedule_commit()
            return True
        if first <= self._head:
            # Batches up to the head exist unless retention expired them.
            earliest = await asyncio.to_thread(
                positions.earliest_batch, consumer.store, consumer.queue, self.shard, self._head
            )
            if earliest > first:
                await self._skip_missing(first, earliest)
                self.schedule_commit()
                return True
        return False

    async def _skip_missing(self, first: int, found: int) -> None:
        """Batches first..found-1 were not read: move past them once they are known to be gone.

        Batches are contiguous and expire oldest first, so a missing batch below a live one
        has expired (TTL, a lowered retention), unless the read at a weak consistency missed
        it. A serial read of `first` settles that; if it exists after all, read again.
        """
        if await self.consumer.log.read_header(self.shard, first, serial=True) is not None:
            raise BackendUnavailable(f"batch {first} exists but the read did not return it")
        self.consumer.counters.expired_skipped += found - first
        self._gaps[first] = found
        self.state.next_batch = max(self.state.next_batch, found)

    async def _marks_for(self, first_batch: int) -> dict[int, BatchMarks]:
        bucket = bucket_of(first_batch)
        if bucket not in self._marks:
            self._marks = {b: m for b, m in self._marks.items() if b >= bucket}
            self._marks[bucket] = await self.consumer.acks.load_bucket(
                self.epoch, self.shard, bucket, self.state.offset
            )
            self.consumer.counters.ack_bucket_reads += 1
        return self._marks[bucket]

    # --- committing ----------------------------------------------------------------------
    def _advance(self) -> None:
        while True:
            self.state.advance_offset()
            end = self._gaps.pop(self.state.offset, None)
            if end is None:
                return
            self.state.skip_to(end)

    def schedule_commit(self) -> None:
        self._advance()
        if self.state.offset != self._committed:
            self._commit_wanted.set()

    def proves_rows_locally(self) -> bool:
        """Whether the lease check after an ack row is answered without ZooKeeper now."""
        leases = self.consumer.leases
        return not self._fenced and leases is not None and leases.surely_held(self.shard, self.fence)

    async def _commit_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            written = await self.commit()
            if self._stopped:
                return
            if not written:
                await self._pause(backoff.next())
                continue
            backoff.reset()
            # No ack waits for an offset write (acks are durable in rows): coalesce, at most
            # one write per interval.
            await self._pause(OFFSET_COMMIT_INTERVAL)

    async def commit(self) -> bool:
        """Write the offset if it moved; False if it could not be written (and will be retried)."""
        if self._fenced:
            return True
        offset = self.state.offset
        if offset == self._committed:
            return True
        consumer = self.consumer
        try:
            outcome, version = await offsets.commit_offset(
                consumer.store.zk, consumer.paths, self.shard, offset, self.epoch, self._version, self.fence
            )
        except BackendUnavailable as error:
            self.problem = f"commit: {error}"
            self._commit_wanted.set()
            return False
        if outcome is CommitOutcome.WRITTEN:
            self._version = version
            self._committed = offset
            self.problem = ""
            consumer.counters.offset_commits += 1
            return True
        if outcome is CommitOutcome.LEASE_LOST:
            self._fenced = True
            consumer.lease_lost(self)
            return True
        if outcome is CommitOutcome.GONE:
            self._fenced = True
            consumer.subscriber_gone(f"subscriber {consumer.subscriber} was deleted")
            return True
        # MOVED: a seek (the epoch changed), or our own earlier write whose reply was lost.
        record = await offsets.read_offset(consumer.store.zk, consumer.paths, self.shard)
        if record.epoch != self.epoch:
            self._fenced = True
            consumer.resync()
            return True
        self._version = record.version
        self._committed = record.offset
        self._commit_wanted.set()
        return True

    async def still_leased(self) -> bool:
        """Whether our acquisition is still the shard's latest (read after a write it must cover).

        Proven locally while our lease znode provably exists (`ShardLeases.surely_held`: the
        fence moves only with a new lease, which cannot be created while ours exists);
        otherwise read from ZooKeeper."""
        if self._fenced:
            return False
        counters = self.consumer.counters
        if self.proves_rows_locally():
            counters.lease_proofs += 1
            return True
        counters.lease_checks += 1
        stat = await zk.call(self.consumer.store.zk.exists_async, self.consumer.paths.fence(self.shard))
        return stat is not None and stat.version == self.fence

    async def stop(self, flush: bool) -> None:
        """Stop reading. With `flush`, write pending acks and the offset first (a clean release);
        an offset write already under way is always awaited, never cancelled."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(flush))
        await asyncio.shield(self._stopping)

    async def _stop(self, flush: bool) -> None:
        self._stopped = True
        self._stop_event.set()
        self._wake.set()
        if self._fetch_task is not None:
            self._fetch_task.cancel()
            await asyncio.gather(self._fetch_task, return_exceptions=True)
        if flush and not self._fenced:
            try:
                await self.consumer.acks.flush()
            except CasqueError as error:
                log.warning("shard %s: acks not flushed on release: %s", self.shard, error)
            self._advance()
        else:
            self._fenced = True
        # The commit loop makes one last pass (a final write when flushing) and ends.
        self._commit_wanted.set()
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)


@dataclass
class Consumer:
    """Receives from one subscriber of one queue. Start it, use it, stop it."""

    store: Store
    queue: QueueRef
    subscriber: str
    member_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self.counters = ConsumerCounters()
        self.readers: dict[int, ShardReader] = {}
        self.prefetch_blocked = False
        self._available = asyncio.Event()
        # Receives waiting for a message to become available (long polls).
        self.waiting_receives = 0
        self._rotation = 0
        # Deliveries served by each priority level while lower levels had messages ready.
        self._served: dict[int, int] = {}
        self._leases: ShardLeases | None = None
        # Shared delivery (spec.delivery == "shared"): claimed batch ranges instead of leased shards.
        self._sharing: SharedDelivery | None = None
        self._stopped = False
        self._resync_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_letters: Publisher | None = None
        self._max_deliveries = 0
        self._background: set[asyncio.Task[None]] = set()
        # Acks being made durable, by (shard, batch, seq, nonce): a resent ack shares the answer.
        self._acking: dict[tuple[int, int, int, int], asyncio.Future[bool | CasqueError]] = {}
        # Why this consumer ended by itself (its subscriber was deleted); empty while it serves.
        self.gone_reason = ""
        # Whether the subscriber still exists after this consumer ended (a delivery mode change).
        self._gone_but_present = False
        self.on_gone: list[Callable[[Consumer], None]] = []

    async def start(self) -> None:
        self.queue_state: QueueState = await asyncio.to_thread(catalog.read_queue, self.store, self.queue)
        self.subscriber_state: SubscriberState = await asyncio.to_thread(
            catalog.read_subscriber, self.store, self.queue, self.subscriber
        )
        spec = self.queue_state.spec
        self.log = Log(self.store, self.queue, spec.consistency)
        self.acks = AckLog(self.store, self.queue, self.subscriber_state.ack_key(self.subscriber),
                           spec.retention_seconds)
        self._queue_counters = QueueCounters(self.store.for_namespace(self.queue.namespace), self.queue_state.shared_key(self.queue))
        self.paths = self.store.paths(self.queue).subscriber(self.subscriber)
        subscriber_spec = self.subscriber_state.spec
        if subscriber_spec.dead_letter_queue and subscriber_spec.max_deliveries:
            # Without a dead-letter queue, redelivery is unlimited: nothing is ever dropped.
            dead_letter_queue = QueueRef(self.queue.namespace, subscriber_spec.dead_letter_queue)
            dlq_state = await asyncio.to_thread(catalog.read_queue, self.store, dead_letter_queue)
            self._dead_letters = Publisher(self.store.for_namespace(dead_letter_queue.namespace), dead_letter_queue,
                                           dlq_state)
            self._max_deliveries = subscriber_spec.max_deliveries
        shared = subscriber_spec.delivery == "shared"
        # In shared delivery the leases only keep the member registered (no shard is leased).
        self._leases = ShardLeases(
            self.store.zk, self.paths, self.member_id, [] if shared else spec.log_shards(),
            on_acquired=self._acquired, on_released=self._released, on_lost=self._lost,
            on_trusted=self.notify,
        )
        if shared:
            self._sharing = SharedDelivery(self, spec.log_shards())
        loop = asyncio.get_running_loop()
        active = lambda: not self._stopped  # noqa: E731
        DataWatch(self.store.zk, self.paths.seek, zk.watch_in_loop(loop, self._seek_changed, active))
        DataWatch(self.store.zk, self.store.paths(self.queue).base, zk.watch_in_loop(loop, self._queue_changed, active))
        DataWatch(self.store.zk, self.paths.base, zk.watch_in_loop(loop, self._subscriber_changed, active))
        await self._leases.start()
        if self._sharing is not None:
            await self._sharing.start()
        self._tasks = [loop.create_task(self._report_loop()), loop.create_task(self._resync_loop())]

    def report(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight(),
            "delivered": self.counters.deliveries,
            "redelivered": self.counters.redeliveries,
            "dead_lettered": self.counters.dead_lettered,
            "acked": self.counters.acks,
            "shards": len(self.held_shards),
        }

    async def publish_report(self) -> None:
        """Write this consumer's counters into its member znode (read by subscriber stats)."""
        try:
            await zk.call(self.store.zk.set_async, self.paths.member(self.member_id), json.dumps(self.report()).encode())
        except (NoNodeError, BackendUnavailable):
            pass  # re-registering after a session loss; the next report lands

    async def _report_loop(self) -> None:
        while not self._stopped:
            await self.publish_report()
            await asyncio.sleep(REPORT_INTERVAL_SECONDS)

    @property
    def stopping(self) -> bool:
        return self._stopped

    @property
    def visibility_timeout(self) -> float:
        return float(self.subscriber_state.spec.visibility_timeout_seconds)

    @property
    def held_shards(self) -> set[int]:
        """Shards this member delivers from now: leased, or with a claimed range in shared delivery."""
        if self._sharing is not None:
            return {source.shard for source in self._sharing.sources()}
        return set(self.readers)

    @property
    def leases(self) -> ShardLeases | None:
        """The shard leases of leased delivery (None in shared delivery, or before start)."""
        return self._leases

    def group_members(self) -> list[str]:
        """The live members of this consumer's group, as last seen."""
        return self._leases.members if self._leases is not None else []

    def sources(self) -> list[Source]:
        """What deliveries come from: the leased shards' readers, or the claimed ranges."""
        if self._sharing is not None:
            return list(self._sharing.sources())
        return [self.readers[shard] for shard in sorted(self.readers)]

    def _source_for(self, position: Position) -> Source | None:
        if self._sharing is not None:
            return self._sharing.source_for(position)
        return self.readers.get(position.shard)

    def notify(self) -> None:
        self._available.set()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- lease callbacks -------------------------------------------------------------------
    async def _acquired(self, shard: int, fence: int) -> None:
        mark = await offsets.read_seek_mark(self.store.zk, self.paths)
        record = await offsets.read_offset(self.store.zk, self.paths, shard)
        reader = ShardReader(self, shard, record, fence, mark)
        self.readers[shard] = reader
        reader.start()

    async def _released(self, shard: int) -> None:
        reader = self.readers.get(shard)
        if reader is None:
            return
        if not self._stopped:
            # A rebalance moves the shard: let the app finish what it holds from it first
            # (a stopping consumer has had its drain time already).
            await reader.hand_over()
        if self.readers.get(shard) is reader:
            del self.readers[shard]
        await reader.stop(flush=True)

    async def _lost(self) -> None:
        readers, self.readers = self.readers, {}
        await asyncio.gather(*(reader.stop(flush=False) for reader in readers.values()))

    def lease_lost(self, reader: ShardReader) -> None:
        """A commit found the shard's fence moved: drop the shard; the leases rebalance."""
        self.counters.leases_lost += 1
        log.warning("shard %s: another member acquired it; dropping it", reader.shard)
        if self.readers.get(reader.shard) is reader:
            del self.readers[reader.shard]
        if self._leases is not None and self._leases.held.get(reader.shard) == reader.fence:
            self._leases.forget(reader.shard)
        self._in_background(reader.stop(flush=False))

    # --- seeks and spec changes ------------------------------------------------------------
    def _seek_changed(self, *_: object) -> None:
        self.resync()

    def resync(self) -> None:
        """Compare every held shard's epoch with its offset znode and restart the ones a seek moved.

        An event, not a flag: a seek noticed while a resync runs causes one more pass."""
        self._resync_wanted.set()

    async def _resync_loop(self) -> None:
        backoff = Backoff()
        while not self._stopped:
            await self._resync_wanted.wait()
            self._resync_wanted.clear()
            try:
                await self._resync()
                backoff.reset()
            except Exception as error:
                log.warning("applying a seek failed (%s); retrying", error)
                self.counters.retries += 1
                await asyncio.sleep(backoff.next())
                self._resync_wanted.set()

    async def _resync(self) -> None:
        if self._sharing is not None:
            await self._sharing.resync()
            self.notify()
            return
        mark = await offsets.read_seek_mark(self.store.zk, self.paths)
        for shard, reader in sorted(self.readers.items()):
            record = await offsets.read_offset(self.store.zk, self.paths, shard)
            if record.epoch == reader.epoch:
                reader.seek_mark = mark  # read after the mark, and unmoved: current as of it
                continue
            if not reader.current:
                continue
            await reader.stop(flush=False)
            fence = self._leases.held.get(shard) if self._leases is not None else None
            if self.readers.get(shard) is not reader or fence != reader.fence:
                continue  # released or lost meanwhile: the lease callbacks own the shard now
            fresh = ShardReader(self, shard, record, reader.fence, mark)
            self.readers[shard] = fresh
            fresh.start()
            self.counters.seeks_applied += 1
        self.notify()

    def _queue_changed(self, data: bytes | None, *_: object) -> None:
        if not data:
            return  # the queue's deletion removes the subscriber too, which ends this consumer
        try:
            state = QueueState.model_validate_json(data)
        except ValidationError:
            return
        self.queue_state = state
        if self._sharing is not None:
            self._sharing.set_shards(state.spec.log_shards())
        elif self._leases is not None:
            # Shards or priority levels added: take part in consuming them at once.
            self._leases.set_shards(state.spec.log_shards())

    def _subscriber_changed(self, data: bytes | None, *_: object) -> None:
        if not data:
            self.subscriber_gone(f"subscriber {self.subscriber} was deleted")
            return
        try:
            state = SubscriberState.model_validate_json(data)
        except ValidationError:
            return
        if state.incarnation != self.subscriber_state.incarnation:
            self.subscriber_gone(f"subscriber {self.subscriber} was deleted and created again")
            return
        old = self.subscriber_state.spec
        if (state.spec.delivery, state.spec.ordered_keys) != (old.delivery, old.ordered_keys):
            # Leases and claims do not mix, nor do ranges claimed with and without their keys:
            # end, and the owner starts a consumer in the new mode.
            self._gone_but_present = True
            self.subscriber_gone(f"subscriber {self.subscriber} switched to {state.spec.delivery} delivery"
                                 f"{' with ordered keys' if state.spec.ordered_keys else ''}")
            return
        self.subscriber_state = state

    def subscriber_gone(self, reason: str) -> None:
        """The subscriber this consumer serves no longer exists: end, and tell the owner."""
        if self.gone_reason or self._stopped:
            return
        self.gone_reason = reason
        log.warning("%s: this consumer stops", reason)
        self._in_background(self._end())

    async def _end(self) -> None:
        await self.stop()
        for callback in self.on_gone:
            callback(self)

    # --- the queue API -----------------------------------------------------------------
    async def receive(
        self, max_messages: int = 10, wait: float = 0.0, visibility: float | None = None, max_bytes: int | None = None,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> list[Delivery]:
        """Up to `max_messages` deliveries; waits up to `wait` seconds for the first one.
        With `max_bytes`, the payloads handed out stop at that sum (one message at least).

        Each delivery's count is durable before it is returned, so a message that crashes
        every consumer it reaches still reaches the subscriber's max deliveries. Once
        `abandoned()` is true (the caller's client has gone) it returns nothing, and hands
        back what it took: no delivery is stranded invisible for a client that left.
        """
        deadline = time.monotonic() + wait
        while True:
            if abandoned():
                return []
            if self.gone_reason:
                if self._gone_but_present:
                    raise ConsumerStopped(f"{self.gone_reason}; try again")
                raise SubscriberNotFound(self.gone_reason)
            if self._stopped:
                raise ConsumerStopped("the consumer is shutting down")
            self._available.clear()
            if self._sharing is not None:
                self._sharing.demand()
            budget = ByteBudget(max_bytes) if max_bytes is not None else None
            got = self._take(max_messages, visibility or self.visibility_timeout, budget)
            if got:
                try:
                    if self._sharing is not None:
                        # Claims first: a delivery whose range could not be kept is put back uncounted.
                        got = await self._sharing.cover(got)
                    if got and abandoned():
                        self.hand_back(got)
                        return []
                    if got:
                        await self._record_deliveries(got)
                        return got
                except BaseException:
                    self.hand_back(got)  # cancelled, or not recorded: nothing was handed to anybody
                    raise
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return []
            due = [t for r in self.sources() if (t := r.state.next_due()) is not None]
            if due:
                remaining = min(remaining, max(0.0, min(due) - now) + 0.001)
            self.waiting_receives += 1
            try:
                await asyncio.wait_for(self._available.wait(), remaining)
            except TimeoutError:
                pass
            finally:
                self.waiting_receives -= 1

    def _take(self, max_messages: int, visibility: float, budget: ByteBudget | None = None) -> list[Delivery]:
        """Deliveries from the leased shards: higher priority levels first, with every
        PRIORITY_FAIRNESS-th delivery reserved for lower levels that have messages ready,
        so a busy high level cannot starve them; round-robin over the shards of a level."""
        if self._sharing is None and self._leases is not None and not self._leases.trusted:
            # SUSPENDED, or no word from ZooKeeper for a while (a pause): our leases may be
            # gone to other members; hand out nothing until the session is confirmed alive.
            # (Claims need no such check: each one says itself until when it is ours.)
            return []
        now, wall = time.monotonic(), time.time()
        levels: dict[int, list[Source]] = {}
        for reader in self.sources():
            if not reader.releasing and reader.state.has_ready(now):
                levels.setdefault(priority_of(reader.shard), []).append(reader)
        if not levels:
            return []
        order = sorted(levels, reverse=True)
        plan = self._plan(order, max_messages)
        deliveries: list[Delivery] = []
        for level, want in plan:
            deliveries.extend(self._take_level(levels[level], min(want, max_messages - len(deliveries)), now, wall,
                                               visibility, budget))
        for level in order:  # whatever a level could not fill goes to the others, highest first
            deliveries.extend(self._take_level(levels[level], max_messages - len(deliveries), now, wall, visibility,
                                               budget))
        for level in order[:-1]:  # levels that had lower ones waiting count what they served
            self._served[level] = self._served.get(level, 0) + sum(
                1 for d in deliveries if priority_of(d.message.position.shard) == level
            )
        return deliveries

    def _plan(self, order: list[int], count: int) -> list[tuple[int, int]]:
        """How many deliveries each ready level gets: the highest all but every
        PRIORITY_FAIRNESS-th, which go to the levels below it (planned the same way)."""
        if len(order) == 1:
            return [(order[0], count)]
        served = self._served.get(order[0], 0)
        lower = (served + count) // PRIORITY_FAIRNESS - served // PRIORITY_FAIRNESS
        return self._plan(order[1:], lower) + [(order[0], count - lower)]

    def _take_level(
        self, readers: list[Source], want: int, now: float, wall: float, visibility: float,
        budget: ByteBudget | None = None,
    ) -> list[Delivery]:
        deliveries: list[Delivery] = []
        if want <= 0:
            return deliveries
        dead: list[tuple[Source, Handout]] = []
        self._rotation = (self._rotation + 1) % len(readers)
        order = readers[self._rotation:] + readers[: self._rotation]
        # Several passes with small shares each, so every shard with messages gets a turn.
        while len(deliveries) < want:
            progressed = False
            share = max(1, (want - len(deliveries)) // len(order))
            for reader in order:
                take = min(share, want - len(deliveries))
                if take <= 0:
                    break
                for handout in reader.state.take(take, now, visibility, wall, self._max_deliveries, budget):
                    progressed = True
                    if handout.dead:
                        dead.append((reader, handout))
                        continue
                    position = handout.entry.message.position
                    deliveries.append(
                        Delivery(
                            message=handout.entry.message,
                            receipt=encode_receipt(position, handout.nonce),
                            delivery_count=handout.entry.deliveries,
                            visible_until=handout.entry.deadline,
                        )
                    )
                    self.counters.deliveries += 1
                    if handout.redelivery:
                        self.counters.redeliveries += 1
                reader.space_freed()
            if not progressed:
                break
        if dead:
            self._in_background(self._dead_letter(dead))
        return deliveries

    async def _dead_letter(self, handouts: list[tuple[Source, Handout]]) -> None:
        """Publish messages over max deliveries to the dead-letter queue, then mark them done.

        If publishing fails they stay invisible for a while and then are tried again.
        """
        try:
            publisher = await self._current_dead_letters()
        except (CasqueError, KazooException) as error:
            log.warning("dead-letter queue unavailable (%s); %d messages will be tried again", error, len(handouts))
            return

        async def move(reader: Source, handout: Handout) -> None:
            entry = handout.entry
            message = entry.message
            copy = dead_letter_copy(
                message, self.queue, self.subscriber, reader.epoch, entry.deliveries, entry.last_error,
                subscriber_key=self.subscriber_state.ack_key(self.subscriber),
                retention_seconds=self.queue_state.spec.retention_seconds)
            try:
                await publisher.publish([copy])
            except CasqueError as error:
                log.warning("dead-lettering %s failed (%s); it will be tried again", message.message_id, error)
                return
            if not reader.current or reader.state.dead_letter(message.position) is None:
                return  # the shard moved or was reset meanwhile; the copy's client id prevents a double
            self.counters.dead_lettered += 1
            await self._queue_counters.add(dead_lettered(self.subscriber_state.ack_key(self.subscriber)), 1)
            p = message.position
            await self.acks.record(AckEvent(reader.epoch, p.shard, p.batch, p.seq, outcome=DEAD))
            reader.schedule_commit()
            reader.space_freed()

        await asyncio.gather(*(move(r, h) for r, h in handouts))

    async def _current_dead_letters(self) -> Publisher:
        """The dead-letter queue's publisher, renewed when that queue changed or was created again.

        Dead-lettering is rare, so one read of the queue's znode each time costs nothing and
        never leaves copies going to a deleted incarnation.
        """
        known = self._dead_letters
        assert known is not None
        state = await asyncio.to_thread(catalog.read_queue, self.store, known.queue)
        if state != known.state:
            known = self._dead_letters = await asyncio.to_thread(Publisher, self.store, known.queue, state)
        return known

    async def _record_deliveries(self, deliveries: list[Delivery]) -> None:
        """Write every delivery's count; if that fails, put the messages back and raise."""
        events: list[AckEvent] = []
        for d in deliveries:
            p = d.message.position
            reader = self._source_for(p)
            if reader is not None:
                events.append(AckEvent(reader.epoch, p.shard, p.batch, p.seq, deliveries=d.delivery_count))
        try:
            await self.acks.record_many(events)
            return
        except Exception as error:  # every driver error: the deliveries are handed back
            self.hand_back(deliveries)
            if isinstance(error, CasqueError):
                raise
            raise BackendUnavailable(f"delivery counts not recorded: {error!r}") from error

    def hand_back(self, deliveries: list[Delivery]) -> int:
        """Put back deliveries that never reached the app (its connection closed before the
        answer was written, or recording them failed): visible again at once, their delivery
        counts as before. Returns how many were still current and went back."""
        back = 0
        for d in deliveries:
            position, nonce = decode_receipt(d.receipt)
            reader = self._source_for(position)
            if reader is not None and reader.state.undo_take(position, nonce):
                back += 1
                self.counters.deliveries -= 1
                if d.delivery_count > 1:
                    self.counters.redeliveries -= 1
        if back:
            self.counters.handed_back += back
            self.notify()
        return back

    def _reader_for(self, receipt: str) -> tuple[Source, Position, int]:
        position, nonce = decode_receipt(receipt)
        reader = self._source_for(position)
        if reader is None:
            if self._sharing is not None:
                raise StaleReceipt(f"batch {position.shard}/{position.batch} is no longer claimed by this consumer")
            raise StaleReceipt(f"shard {position.shard} is no longer leased by this consumer")
        return reader, position, nonce

    async def ack(self, receipt: str) -> bool:
        """Acknowledge a delivery. True if this ack completed it, False if it was done already."""
        (result,) = await self.ack_many([receipt])
        if isinstance(result, CasqueError):
            raise result
        return result

    async def ack_many(self, receipts: list[str]) -> list[bool | CasqueError]:
        """Acknowledge several deliveries at once; one result (or error) per receipt, in order.

        An ack is answered only once it is durable: its ack row is written and the source's
        lease (or claim) is confirmed still ours afterwards (a next holder reads the rows only
        after it takes the lease, so it sees the row). Until then the delivery is ACKING (see
        ShardState.start_ack): still in flight, its key still held. True: this call acked it.
        False: it was acked before (durably), or an ack of it that is being recorded now
        succeeded; a resent ack that arrives meanwhile waits for that one and gets its answer.
        An error: nothing changed; the receipt stays valid until its visibility ends.
        """
        results: list[bool | CasqueError] = [False] * len(receipts)
        started: list[_Acking] = []
        joined: list[tuple[int, asyncio.Future[bool | CasqueError]]] = []
        acking = self._acking
        for index, receipt in enumerate(receipts):
            try:
                reader, position, nonce = self._reader_for(receipt)
                start = reader.state.start_ack(position, nonce)
            except CasqueError as error:
                results[index] = error
                continue
            key = (position.shard, position.batch, position.seq, nonce)
            if start is AckStart.STARTED:
                acking[key] = asyncio.get_running_loop().create_future()
                event = AckEvent(reader.epoch, reader.shard, position.batch, position.seq, outcome=ACK)
                started.append((index, reader, event, nonce))
            elif start is AckStart.PENDING:
                joined.append((index, acking[key]))
        if started:
            try:
                outcomes = await self._make_durable(started)
            except BaseException:
                # Cancelled (a shutdown): nothing is answered, so put every delivery back in flight.
                for _, reader, event, nonce in started:
                    reader.state.abort_ack(Position(event.shard, event.batch, event.seq), nonce)
                    future = acking.pop((event.shard, event.batch, event.seq, nonce), None)
                    if future is not None and not future.done():
                        future.set_result(BackendUnavailable("the ack was interrupted; send it again"))
                raise
            for (index, reader, event, nonce), outcome in zip(started, outcomes):
                results[index] = outcome
                future = acking.pop((event.shard, event.batch, event.seq, nonce), None)
                if future is not None and not future.done():
                    # What a resend of this delivery's ack hears: done already, or the same error.
                    future.set_result(False if outcome is True else outcome)
        for index, shared in joined:
            results[index] = await asyncio.shield(shared)
        return results

    async def _make_durable(self, started: list[_Acking]) -> list[bool | CasqueError]:
        """Write the ack rows of `started`, confirm their sources, and move each delivery to
        done (True), or back to in flight with the reason it is not acked (an error)."""
        readers = list({r for _, r, _, _ in started})

        async def written_and_held() -> list[bool | BaseException]:
            await self.acks.record_many([e for _, _, e, _ in started])
            return await asyncio.gather(*(r.still_leased() for r in readers), return_exceptions=True)

        # Seeks are looked for alongside (see _seek_overtook).
        rows, moved = await asyncio.gather(written_and_held(), self._moved_by_seeks(set(readers)),
                                           return_exceptions=True)
        failure = next((o for o in (rows, moved) if isinstance(o, BaseException)), None)
        outcomes: list[bool | CasqueError] = []
        if failure is not None:
            if not isinstance(failure, Exception):
                raise failure  # cancelled: the deliveries stay ACKING only until the finally below
            error = failure if isinstance(failure, CasqueError) else BackendUnavailable(
                f"acks not recorded: {failure!r}")
            for _, reader, event, nonce in started:
                reader.state.abort_ack(Position(event.shard, event.batch, event.seq), nonce)
            return [error] * len(started)
        assert isinstance(rows, list) and isinstance(moved, set)
        held = dict(zip(readers, rows))
        for _, reader, event, nonce in started:
            position = Position(event.shard, event.batch, event.seq)
            verdict = held[reader]
            if verdict is not True:
                reader.state.abort_ack(position, nonce)
                if isinstance(verdict, CasqueError):
                    outcomes.append(verdict)
                elif isinstance(verdict, BaseException):
                    outcomes.append(BackendUnavailable(f"lease not confirmed: {verdict!r}"))
                else:
                    what = "its batches" if isinstance(reader, ClaimReader) else "shard"
                    outcomes.append(LeaseLost(f"{what} {reader.shard} moved to another member before the ack was "
                                              "recorded; the message may be delivered again"))
                continue
            reader.state.finish_ack(position, nonce)
            self.counters.acks += 1
            outcomes.append(_seek_overtook(reader) if reader in moved else True)
        for reader in readers:
            reader.schedule_commit()
            reader.space_freed()
        return outcomes

    async def _moved_by_seeks(self, sources: set[Source]) -> set[Source]:
        """The sources whose shard a seek has moved to another epoch than theirs, as ZooKeeper tells it now.

        One read of the seek mark answers for every source whose epoch was read after a
        mark that is still current; only the others read their shard's offset znode (a
        claimed range, or a reader after a seek it has not checked against yet).
        """
        zk_client = self.store.zk

        async def epochs(shards: set[int]) -> dict[int, int]:
            records = await asyncio.gather(*(offsets.read_offset(zk_client, self.paths, s) for s in shards))
            return {shard: record.epoch for shard, record in zip(shards, records)}

        marked = {s for s in sources if s.seek_mark is not None}
        epoch_of: dict[int, int] = {}
        if marked:
            mark, epoch_of = await asyncio.gather(offsets.read_seek_mark(zk_client, self.paths),
                                                  epochs({s.shard for s in sources - marked}))
            unsure = {s.shard for s in marked if s.seek_mark != mark}
            if unsure:
                epoch_of.update(await epochs(unsure))
        elif sources:
            epoch_of = await epochs({s.shard for s in sources})
        return {s for s in sources if s.shard in epoch_of and epoch_of[s.shard] != s.epoch}

    async def nack(self, receipt: str, delay: float = 0.0, error: str | None = None) -> None:
        """Make a delivery visible again after `delay` seconds; `error` is kept for its history."""
        reader, position, nonce = self._reader_for(receipt)
        reader.state.nack(position, nonce, delay, time.monotonic(), error)
        self.counters.nacks += 1
        self.notify()

    async def extend(self, receipt: str, visibility: float) -> float:
        """Keep a delivery invisible for `visibility` more seconds; returns seconds until it is visible."""
        reader, position, nonce = self._reader_for(receipt)
        now = time.monotonic()
        deadline = reader.state.extend(position, nonce, visibility, now)
        if isinstance(reader, ClaimReader) and not await reader.renew_past(time.time() + (deadline - now)):
            raise StaleReceipt("the message's batches went to another member; it may be delivered again")
        return deadline - now

    async def dead_letter(self, receipt: str, error: str | None = None) -> None:
        """Send a delivery to the dead-letter queue now: the app says it can never be processed.

        Returns once the copy is published and the message is done; raises InvalidSpec if the
        subscriber has no dead-letter queue, StaleReceipt if the receipt is not current.
        """
        if self._dead_letters is None:
            raise InvalidSpec(f"subscriber {self.subscriber} has no dead-letter queue")
        reader, position, nonce = self._reader_for(receipt)
        entry = reader.state.in_flight_entry(position, nonce)
        entry.last_error = error or entry.last_error
        await self._dead_letter([(reader, Handout(entry, nonce, redelivery=False, dead=True))])
        if reader.state.in_flight_entry_or_none(position) is not None:
            raise BackendUnavailable("the dead-letter queue did not take the message; try again")

    async def health(self) -> tuple[bool, str]:
        """Whether this member consumes everything due to it, and if not, why (for readiness)."""
        status = await self.shard_status()
        return status.problem == "", status.problem or f"holding shards {','.join(map(str, status.held)) or 'none'}"

    async def shard_status(self) -> ShardStatus:
        """Which shards are due to this member, held, and failing."""
        held = sorted(self.held_shards)
        if self.gone_reason:
            return ShardStatus(held, problem=self.gone_reason)
        leases = self._leases
        if leases is None:
            return ShardStatus(held, problem="starting")
        if not leases.connected or not leases.registered:
            return ShardStatus(held, problem="not in the group: rejoining after a ZooKeeper session loss")
        if self._sharing is not None:
            failing, problem = self._sharing.status()
            problems = [problem] if problem else []
            problems.extend(f"shard {s}: {p}" for s, p in sorted(failing.items()))
            return ShardStatus(held, failing=failing, problem="; ".join(problems))
        due = await leases.assigned()
        if due is None:
            return ShardStatus(held, problem="not in the group: registering")
        missing = sorted(due - set(self.readers))
        failing = {s: r.problem for s, r in sorted(self.readers.items()) if r.problem}
        problems = []
        if missing:
            why = f" ({leases.last_error})" if leases.last_error else ""
            problems.append(f"waiting for leases on shards {missing}{why}")
        problems.extend(f"shard {s}: {problem}" for s, problem in failing.items())
        return ShardStatus(held, missing, failing, "; ".join(problems))

    def in_flight(self) -> int:
        return sum(r.state.in_flight for r in self.sources())

    def loaded_bytes(self) -> int:
        """Payload bytes held over all leased shards or claimed ranges (the prefetch budget's measure)."""
        return sum(r.state.loaded_bytes for r in self.sources())

    async def stop(self, drain_seconds: float = 0.0) -> None:
        """Stop: wait up to `drain_seconds` for in-flight messages to be acked, write
        acks and offsets, release the leases. Unacked messages go to the next holder."""
        deadline = time.monotonic() + drain_seconds
        while self.in_flight() and time.monotonic() < deadline and not self.gone_reason:
            await asyncio.sleep(0.05)
        if self._stopped:
            return
        self._stopped = True
        self.notify()
        current = asyncio.current_task()
        others = [t for t in self._background if t is not current]
        if others:
            await asyncio.gather(*others, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sharing is not None:
            await self._sharing.stop()
        if self._leases is not None:
            await self._leases.stop()
        for shard in list(self.readers):
            await self._released(shard)
