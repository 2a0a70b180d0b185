"""A consumer: one member of a subscriber's group, delivering from the shards it leases.

For each leased shard a reader loads batches ahead of the offset (skipping messages that
the ack log says are done), wakes on the shard's head znode watch when it has caught up,
and commits the offset when batches complete. `receive` takes ready messages round-robin
over all leased shards, so no shard is stranded, and long-polls on an event instead of a
timer. Each delivery gets a receipt naming its nonce; ack, nack and extend must present
the current one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.recipe.watchers import DataWatch

from casque.backends import zk
from casque.engine import catalog, positions
from casque.engine.acks import ACK, DEAD, AckEvent, AckLog, BatchMarks
from casque.engine.batches import Log
from casque.engine.messages import Delivery, Position, decode_receipt, encode_receipt
from casque.engine.offsets import read_epoch
from casque.engine.leases import ShardLeases
from casque.engine.counters import QueueCounters, dead_lettered
from casque.engine.deadletters import addressed_elsewhere, dead_letter_copy
from casque.engine.publisher import Publisher
from casque.engine.shard_state import Handout, ShardState
from casque.errors import BackendUnavailable, CasqueError, InvalidSpec, StaleReceipt
from casque.schema import QueueRef, bucket_of
from casque.specs import QueueState, SubscriberState, priority_of
from casque.store import Store

log = logging.getLogger(__name__)

# Load more batches while fewer than this many messages of the shard are undone in memory.
PREFETCH_MESSAGES = 2000
# When caught up, the head watch wakes the reader; this slow check only covers a publisher
# that died between writing a batch and advancing the head.
CAUGHT_UP_RECHECK_SECONDS = 5.0
OFFSET_COMMIT_INTERVAL = 0.05
# With several priority levels ready, at least one delivery in this many comes from a lower level.
PRIORITY_FAIRNESS = 10
# Each consumer reports its in-flight and delivery counts in its member znode this often.
REPORT_INTERVAL_SECONDS = 5.0


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


class ShardReader:
    def __init__(self, consumer: Consumer, shard: int, offset: int, version: int, epoch: int) -> None:
        self.consumer = consumer
        self.shard = shard
        self.epoch = epoch
        self.state = ShardState(shard=shard, offset=offset)
        self._committed = offset
        self._version = version
        self._head = 0
        self._wake = asyncio.Event()
        self._marks: dict[int, dict[int, BatchMarks]] = {}
        self._stopped = False
        self._fetch_task: asyncio.Task[None] | None = None
        self._commit_task: asyncio.Task[None] | None = None
        self._commit_wanted = asyncio.Event()
        # Acks waiting for an offset write that covers their batch: (batch, future).
        self._waiting_for_offset: list[tuple[int, asyncio.Future[None]]] = []
        self._waiter_added = asyncio.Event()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        paths = self.consumer.store.paths(self.consumer.queue)
        DataWatch(
            self.consumer.store.zk,
            paths.head(self.shard),
            zk.watch_in_loop(loop, self._head_changed, lambda: not self._stopped),
        )
        self._fetch_task = loop.create_task(self._fetch_loop())
        self._commit_task = loop.create_task(self._commit_loop())

    def _head_changed(self, data: bytes | None, *_: object) -> None:
        if data:
            self._head = int(data)
        self._wake.set()

    def space_freed(self) -> None:
        self._wake.set()

    async def _fetch_loop(self) -> None:
        log_ = self.consumer.log
        while not self._stopped:
            if self.state.loaded_messages >= PREFETCH_MESSAGES:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._wake.clear()
            first = self.state.next_batch
            try:
                batches = await log_.read_from(self.shard, first)
                self.consumer.counters.batch_reads += 1
                if batches:
                    marks = await self._marks_for(first)
                    subscriber = self.consumer.subscriber
                    for batch in batches:
                        mark = marks.get(batch.header.batch, BatchMarks())
                        # Redriven messages addressed to another subscriber are done for this one.
                        skipped = {m.position.seq for m in batch.messages if addressed_elsewhere(m, subscriber)}
                        self.state.add_batch(batch.header.batch, batch.messages, mark.done | skipped, mark.deliveries)
                    self.consumer.notify()
                    self._schedule_commit()
                    continue
                if first <= self._head:
                    # Batches up to the head exist unless retention expired them: move on.
                    earliest = await asyncio.to_thread(
                        positions.earliest_batch, self.consumer.store, self.consumer.queue, self.shard, self._head
                    )
                    if earliest > first:
                        self.consumer.counters.expired_skipped += earliest - first
                        self.state.skip_to(earliest)
                        self._schedule_commit()
                        continue
            except BackendUnavailable:
                log.warning("shard %s: backend unavailable while reading; retrying", self.shard)
                await asyncio.sleep(1.0)
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), CAUGHT_UP_RECHECK_SECONDS)
            except TimeoutError:
                pass

    async def _marks_for(self, first_batch: int) -> dict[int, BatchMarks]:
        bucket = bucket_of(first_batch)
        if bucket not in self._marks:
            self._marks = {b: m for b, m in self._marks.items() if b >= bucket}
            self._marks[bucket] = await self.consumer.acks.load_bucket(
                self.epoch, self.shard, bucket, self.state.offset
            )
            self.consumer.counters.ack_bucket_reads += 1
        return self._marks[bucket]

    def _schedule_commit(self) -> None:
        self.state.advance_offset()
        if self.state.offset != self._committed:
            self._commit_wanted.set()

    def offset_covering(self, batch: int) -> asyncio.Future[None]:
        """A future done once a written offset is past `batch` (the batch is durably complete)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if batch < self._committed:
            future.set_result(None)
        else:
            self._waiting_for_offset.append((batch, future))
            self._commit_wanted.set()
            self._waiter_added.set()
        return future

    def _settle_waiters(self, error: BaseException | None = None) -> None:
        still: list[tuple[int, asyncio.Future[None]]] = []
        for batch, future in self._waiting_for_offset:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            elif batch < self._committed:
                future.set_result(None)
            else:
                still.append((batch, future))
        self._waiting_for_offset = still

    async def _commit_loop(self) -> None:
        while not self._stopped:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self.commit()
            if not self._waiting_for_offset:
                # Nobody waits for an offset write: coalesce, at most one per interval, unless
                # an ack starts waiting for one.
                self._waiter_added.clear()
                try:
                    await asyncio.wait_for(self._waiter_added.wait(), OFFSET_COMMIT_INTERVAL)
                except TimeoutError:
                    pass

    async def commit(self) -> None:
        """Write the offset if it moved. A version conflict means a seek: the consumer reloads."""
        offset = self.state.offset
        if offset == self._committed:
            self._settle_waiters()
            return
        path = self.consumer.store.paths(self.consumer.queue).subscriber(self.consumer.subscriber).offset(self.shard)
        try:
            stat = await zk.call(self.consumer.store.zk.set_async, path, str(offset).encode(), self._version)
        except BadVersionError:
            # A seek moved the offset: the acks waiting here are moot, the range will be replayed.
            self._committed = offset
            self._settle_waiters()
            self.consumer.seek_detected()
            return
        except BackendUnavailable as error:
            self._settle_waiters(error)
            self._commit_wanted.set()
            return
        self._version = stat.version
        self._committed = offset
        self.consumer.counters.offset_commits += 1
        self._settle_waiters()

    async def stop(self, flush: bool) -> None:
        self._stopped = True
        self._wake.set()
        self._commit_wanted.set()
        self._waiter_added.set()
        for task in (self._fetch_task, self._commit_task):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._fetch_task, self._commit_task) if t), return_exceptions=True)
        if flush:
            await self.consumer.acks.flush()
            self.state.advance_offset()
            await self.commit()
        # Acks still waiting for an offset write fall back to ack rows.
        self._settle_waiters(ConsumerStopped(f"shard {self.shard} released"))


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
        self._available = asyncio.Event()
        self._rotation = 0
        # Deliveries served by each priority level while lower levels had messages ready.
        self._served: dict[int, int] = {}
        self._leases: ShardLeases | None = None
        self._stopped = False
        self._reset_pending = False
        self._report_task: asyncio.Task[None] | None = None
        self._dead_letters: Publisher | None = None
        self._max_deliveries = 0
        self._moving: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.queue_state: QueueState = await asyncio.to_thread(catalog.read_queue, self.store, self.queue)
        self.subscriber_state: SubscriberState = await asyncio.to_thread(
            catalog.read_subscriber, self.store, self.queue, self.subscriber
        )
        spec = self.queue_state.spec
        self.log = Log(self.store, self.queue, spec.consistency)
        self.acks = AckLog(self.store, self.queue, self.subscriber, spec.retention_seconds)
        self._queue_counters = QueueCounters(self.store, self.queue)
        self.paths = self.store.paths(self.queue).subscriber(self.subscriber)
        subscriber_spec = self.subscriber_state.spec
        if subscriber_spec.dead_letter_queue and subscriber_spec.max_deliveries:
            # Without a dead-letter queue, redelivery is unlimited: nothing is ever dropped.
            dead_letter_queue = QueueRef(self.queue.namespace, subscriber_spec.dead_letter_queue)
            dlq_state = await asyncio.to_thread(catalog.read_queue, self.store, dead_letter_queue)
            self._dead_letters = Publisher(self.store, dead_letter_queue, dlq_state.spec)
            self._max_deliveries = subscriber_spec.max_deliveries
        self._leases = ShardLeases(
            self.store.zk, self.paths, self.member_id, spec.log_shards(),
            on_acquired=self._acquired, on_released=self._released, on_lost=self._lost,
        )
        loop = asyncio.get_running_loop()
        DataWatch(self.store.zk, self.paths.seek, zk.watch_in_loop(loop, self._seek_changed, lambda: not self._stopped))
        await self._leases.start()
        self._report_task = loop.create_task(self._report_loop())

    def report(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight(),
            "delivered": self.counters.deliveries,
            "redelivered": self.counters.redeliveries,
            "dead_lettered": self.counters.dead_lettered,
            "acked": self.counters.acks,
            "shards": len(self.readers),
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
    def visibility_timeout(self) -> float:
        return float(self.subscriber_state.spec.visibility_timeout_seconds)

    @property
    def held_shards(self) -> set[int]:
        return set(self.readers)

    def notify(self) -> None:
        self._available.set()

    # --- lease callbacks -------------------------------------------------------------
    async def _acquired(self, shard: int) -> None:
        epoch, _ = await asyncio.to_thread(read_epoch, self.store.zk, self.paths)
        data, stat = await zk.call(self.store.zk.get_async, self.paths.offset(shard))
        reader = ShardReader(self, shard, int(data or b"1"), stat.version, epoch)
        self.readers[shard] = reader
        reader.start()

    async def _released(self, shard: int) -> None:
        reader = self.readers.pop(shard, None)
        if reader is not None:
            await reader.stop(flush=True)

    async def _lost(self) -> None:
        readers, self.readers = self.readers, {}
        for reader in readers.values():
            await reader.stop(flush=False)

    # --- seeks -------------------------------------------------------------------------
    def _seek_changed(self, *_: object) -> None:
        self.seek_detected()

    def seek_detected(self) -> None:
        """Restart every held shard from the offsets in ZooKeeper (a seek moved them)."""
        if self._reset_pending or not self.readers:
            return
        self._reset_pending = True
        asyncio.get_running_loop().create_task(self._reset_all())

    async def _reset_all(self) -> None:
        try:
            for shard in sorted(self.readers):
                old = self.readers.pop(shard)
                await old.stop(flush=False)
                await self._acquired(shard)
        finally:
            self._reset_pending = False
        self.notify()

    # --- the queue API -----------------------------------------------------------------
    async def receive(self, max_messages: int = 10, wait: float = 0.0, visibility: float | None = None) -> list[Delivery]:
        """Up to `max_messages` deliveries; waits up to `wait` seconds for the first one."""
        deadline = time.monotonic() + wait
        while True:
            if self._stopped:
                raise ConsumerStopped("the consumer is shutting down")
            self._available.clear()
            got = self._take(max_messages, visibility or self.visibility_timeout)
            if got:
                await self._record_redeliveries(got)
                return got
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return []
            due = [t for r in self.readers.values() if (t := r.state.next_due()) is not None]
            if due:
                remaining = min(remaining, max(0.0, min(due) - now) + 0.001)
            try:
                await asyncio.wait_for(self._available.wait(), remaining)
            except TimeoutError:
                pass

    def _take(self, max_messages: int, visibility: float) -> list[Delivery]:
        """Deliveries from the leased shards: higher priority levels first, with every
        PRIORITY_FAIRNESS-th delivery reserved for lower levels that have messages ready,
        so a busy high level cannot starve them; round-robin over the shards of a level."""
        if self._leases is not None and not self._leases.connected:
            return []  # SUSPENDED: our leases may be gone; hand out nothing until we know
        now, wall = time.monotonic(), time.time()
        levels: dict[int, list[ShardReader]] = {}
        for shard in sorted(self.readers):
            reader = self.readers[shard]
            if reader.state.has_ready(now):
                levels.setdefault(priority_of(shard), []).append(reader)
        if not levels:
            return []
        order = sorted(levels, reverse=True)
        plan = self._plan(order, max_messages)
        deliveries: list[Delivery] = []
        for level, want in plan:
            deliveries.extend(self._take_level(levels[level], min(want, max_messages - len(deliveries)), now, wall, visibility))
        for level in order:  # whatever a level could not fill goes to the others, highest first
            deliveries.extend(self._take_level(levels[level], max_messages - len(deliveries), now, wall, visibility))
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
        self, readers: list[ShardReader], want: int, now: float, wall: float, visibility: float
    ) -> list[Delivery]:
        deliveries: list[Delivery] = []
        if want <= 0:
            return deliveries
        dead: list[tuple[ShardReader, Handout]] = []
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
                for handout in reader.state.take(take, now, visibility, wall, self._max_deliveries):
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
            task = asyncio.get_running_loop().create_task(self._dead_letter(dead))
            self._moving.add(task)
            task.add_done_callback(self._moving.discard)
        return deliveries

    async def _dead_letter(self, handouts: list[tuple[ShardReader, Handout]]) -> None:
        """Publish messages over max deliveries to the dead-letter queue, then mark them done.

        If publishing fails they stay invisible for a while and then are tried again.
        """
        assert self._dead_letters is not None
        publisher = self._dead_letters

        async def move(reader: ShardReader, handout: Handout) -> None:
            entry = handout.entry
            message = entry.message
            copy = dead_letter_copy(message, self.queue, self.subscriber, reader.epoch, entry.deliveries, entry.last_error)
            try:
                await publisher.publish([copy])
            except CasqueError as error:
                log.warning("dead-lettering %s failed (%s); it will be tried again", message.message_id, error)
                return
            if self.readers.get(reader.shard) is not reader or reader.state.dead_letter(message.position) is None:
                return  # the shard moved or was reset meanwhile; the copy's client id prevents a double
            self.counters.dead_lettered += 1
            await self._queue_counters.add(dead_lettered(self.subscriber), 1)
            p = message.position
            await self.acks.record(AckEvent(reader.epoch, p.shard, p.batch, p.seq, outcome=DEAD))
            reader._schedule_commit()
            reader.space_freed()

        await asyncio.gather(*(move(r, h) for r, h in handouts))

    async def _record_redeliveries(self, deliveries: list[Delivery]) -> None:
        """Persist delivery counts above one, so a new lease holder keeps counting."""
        futures = []
        for d in deliveries:
            if d.delivery_count > 1:
                reader = self.readers.get(d.message.position.shard)
                if reader is not None:
                    p = d.message.position
                    futures.append(self.acks.record(AckEvent(reader.epoch, p.shard, p.batch, p.seq,
                                                             deliveries=d.delivery_count)))
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)

    def _reader_for(self, receipt: str) -> tuple[ShardReader, Position, int]:
        position, nonce = decode_receipt(receipt)
        reader = self.readers.get(position.shard)
        if reader is None:
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

        Returns once every newly done message is durable: either a written offset is past
        its batch (the batch is complete: one ZooKeeper write covers all of its acks) or its
        ack row is written.
        """
        results: list[bool | CasqueError] = []
        covering: dict[ShardReader, int] = {}
        newly: list[tuple[ShardReader, AckEvent]] = []
        for receipt in receipts:
            try:
                reader, position, nonce = self._reader_for(receipt)
                done = reader.state.ack(position, nonce)
            except CasqueError as error:
                results.append(error)
                continue
            results.append(done)
            if done:
                self.counters.acks += 1
                newly.append((reader, AckEvent(reader.epoch, reader.shard, position.batch, position.seq, outcome=ACK)))
        # Yield once, so that acks sent concurrently by other requests land before deciding
        # how to make these durable.
        await asyncio.sleep(0)
        rows: list[asyncio.Future[None]] = []
        for reader in {r for r, _ in newly}:
            reader._schedule_commit()
            reader.space_freed()
        for reader, event in newly:
            if event.batch < reader.state.offset:
                covering[reader] = max(covering.get(reader, 0), event.batch)
            else:
                rows.append(self.acks.record(event))
        offset_writes = {reader: reader.offset_covering(batch) for reader, batch in covering.items()}
        for reader, outcome in zip(offset_writes, await asyncio.gather(*offset_writes.values(), return_exceptions=True)):
            if isinstance(outcome, BaseException):
                # ZooKeeper is away: make those acks durable as rows instead.
                rows.extend(self.acks.record(e) for r, e in newly if r is reader and e.batch <= covering[reader])
        if rows:
            await asyncio.gather(*rows)
        return results

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
        return reader.state.extend(position, nonce, visibility, now) - now

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

    async def due_shards(self) -> set[int]:
        """The shards the lease recipe gives this member now (it may not hold them all yet)."""
        return set() if self._leases is None else await self._leases.assigned()

    def in_flight(self) -> int:
        return sum(r.state.in_flight for r in self.readers.values())

    async def stop(self, drain_seconds: float = 0.0) -> None:
        """Stop: wait up to `drain_seconds` for in-flight messages to be acked, write
        acks and offsets, release the leases. Unacked messages go to the next holder."""
        deadline = time.monotonic() + drain_seconds
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopped = True
        self.notify()
        if self._moving:
            await asyncio.gather(*self._moving, return_exceptions=True)
        if self._report_task is not None:
            self._report_task.cancel()
        if self._leases is not None:
            await self._leases.stop()
        for shard in list(self.readers):
            await self._released(shard)
