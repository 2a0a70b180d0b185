"""A leased shard's reader: loads batches ahead of the offset, hands its state to the
member's receives, and commits the offset as batches complete.

It loads batches (skipping messages that the ack rows say are done) while the shard's and
the member's prefetch budgets allow, wakes on the shard's head znode watch when it has
caught up, and writes the offset, coalesced, in the background. Offset writes are fenced by
the lease acquisition (casque.engine.offsets), so a member that lost the shard without
noticing cannot move its offset; a write that finds the epoch moved means a seek, which the
member applies (Member.resync). Every loop retries any error with backoff and reports it as
the shard's `problem` (readiness says so).

The hand-over (a rebalance moves the shard): no new deliveries, acks still taken, and the
lease goes only once every delivery in flight is settled or its visibility has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kazoo.recipe.watchers import DataWatch

from casque.backends import zk
from casque.engine import gaps, offsets
from casque.engine.acks import BatchMarks
from casque.engine.clock import clock_of
from casque.engine.deadletters import addressed_elsewhere
from casque.engine.heads import HeadAdvancer
from casque.engine.keylocks import KeyLocks
from casque.engine.member import Backoff, Member, message_filter, redelivery_backoff
from casque.engine.offsets import CommitOutcome, OffsetRecord
from casque.engine.shard_state import ShardState
from casque.errors import BackendUnavailable, CasqueError
from casque.schema import bucket_of
from casque.znodes import decode_head

log = logging.getLogger(__name__)

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
# At most one offset write a shard per this many seconds. No ack waits for it (the ack rows
# hold acks), a next holder skips what the rows say is done, and a write here is a ZooKeeper
# transaction: at 0.05 s a trickle of messages paid one for every two of them.
OFFSET_COMMIT_INTERVAL = 0.25


class ShardReader:
    def __init__(self, consumer: Member, shard: int, record: OffsetRecord, fence: int, seek_mark: int) -> None:
        """`seek_mark`: the subscriber's seek mark read before `record` (offsets.read_seek_mark)."""
        self.consumer = consumer
        self.shard = shard
        self.epoch = record.epoch
        # While the seek mark is still this, no seek has moved the shard from `epoch`.
        self.seek_mark: int | None = seek_mark
        self.fence = fence
        ordered = consumer.subscriber_state.spec.ordered_keys
        self.state = ShardState(shard=shard, offset=record.offset,
                                locks=KeyLocks(on_release=consumer.notify) if ordered else None,
                                backoff=redelivery_backoff(consumer), matches=message_filter(consumer))
        # What went wrong last in this shard's reading or committing; empty while all is well.
        self.problem = ""
        self._committed = record.offset
        self._version = record.version
        self._head = 0
        # The highest batch read, and the head advancer that repairs a head found behind it
        # (made on first use).
        self._loaded_to = 0
        self._repair: HeadAdvancer | None = None
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
            self._head = decode_head(data)
        self._wake.set()

    def wake(self) -> None:
        """Look for more batches now (the member's prefetch budget has room again)."""
        self._wake.set()

    def space_freed(self) -> None:
        if self._full:
            self._wake.set()
        consumer = self.consumer
        if consumer.prefetch_blocked and consumer.loaded_bytes() < CONSUMER_PREFETCH_BYTES:
            consumer.prefetch_blocked = False
            for reader in consumer.readers.values():
                reader.wake()
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
                if self._loaded_to > self._head:
                    # A whole recheck later the head's watch still has not reached what was
                    # read: its publisher's advance failed or never came. Repair the head,
                    # for the other readers and for lag.
                    self._head_repair().advance(self._loaded_to)
            finally:
                self.caught_up = False

    async def _fetch_once(self) -> bool:
        """Load the next batches if there is room; True if reading again at once may find more.

        Batches loaded up to the head the watch last reported are all there is to know of: a
        later batch moves the head, and its watch wakes the reader. Reading again at once
        found nothing every time, a Cassandra read per message at a trickle, where one read
        costs more CPU in the drivers than the rest of a message's delivery."""
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
        # The head as the read starts: a batch the watch reports while the read is under way
        # may have landed after the read was served. It is new, not missing: the watch's wake
        # reads again at once.
        head = self._head
        batches = await consumer.log.read_from(self.shard, first)
        consumer.counters.batch_reads += 1
        if batches:
            # Batches missing before or between those read are proven gone before any is
            # loaded (casque.engine.gaps); if one exists after all, this raises: read again.
            before = {high: low for low, high in await gaps.prove_read(consumer.log, self.shard, first, batches)}
            marks = await self._marks_for(batches[0].header.batch)
            # Nacked messages wait until their recorded time, whoever nacked them (this member
            # before a restart, or the shard's holder before a hand-over or a kill).
            now, now_ms = time.monotonic(), clock_of(consumer.store.session).ms()
            for batch in batches:
                if batch.header.batch in before:
                    self._skip(before[batch.header.batch], batch.header.batch)
                mark = marks.get(batch.header.batch, BatchMarks())
                # Redriven messages addressed to another subscriber are done for this one.
                skipped = {m.position.seq for m in batch.messages
                           if m.attributes and addressed_elsewhere(m, consumer.subscriber)}
                state.add_batch(batch.header.batch, batch.messages, mark.done | skipped, mark.deliveries,
                                waiting_until=_waiting(mark, state.backoff, now, now_ms))
            self._loaded_to = max(self._loaded_to, batches[-1].header.batch)
            consumer.notify()
            self.schedule_commit()
            return self._loaded_to < self._head
        if first <= head:
            # Batches up to the head exist unless they expired, in whatever order (a lowered
            # retention expires newer ones first): find the next one that exists.
            live = await gaps.next_live(consumer.log, self.shard, first, head + 1)
            if live == first:
                raise BackendUnavailable(f"batch {first} exists but the read did not return it")
            self._skip(first, live)
            self.schedule_commit()
            return True
        return False

    def _head_repair(self) -> HeadAdvancer:
        if self._repair is None:
            self._repair = HeadAdvancer(self.consumer.store.zk, self.consumer.store.paths(self.consumer.queue).head(self.shard))
        return self._repair

    def _skip(self, first: int, end: int) -> None:
        """Batches first..end-1 are gone: the offset jumps over them (nothing below `next_batch`
        that the state does not hold holds it back)."""
        self.consumer.counters.expired_skipped += end - first
        self.state.next_batch = max(self.state.next_batch, end)

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
        self.state.advance_offset()

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
            if consumer.checkpoints is not None:
                consumer.checkpoints.note(self.shard, offset, self.epoch)
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


def _waiting(mark: BatchMarks, backoff: Callable[[int], float] | None, now: float,
             now_ms: int) -> dict[int, float]:
    """The seqs of a batch that wait until a time still to come, on this clock: a NACK row's,
    or the retry backoff after a delivery whose visibility ended (BatchMarks.resting_until)."""
    return {seq: now + (until - now_ms) / 1000 for seq in mark.deliveries
            if seq not in mark.done and (until := mark.resting_until(seq, backoff, now_ms)) is not None and until > now_ms}
