"""Handing out a member's messages: which sources a receive takes from, the delivery counts
made durable before a receive returns, deliveries handed back that never reached the app,
nacks answered once their NACK rows are durable, and messages over the subscriber's max
deliveries moved to its dead-letter queue when their time ends (`Deliverer.run_timers`,
whether or not anybody receives).

Taking is pure bookkeeping on the sources' ShardState (no I/O): higher priority levels
first, with every PRIORITY_FAIRNESS-th delivery reserved for lower levels that have
messages ready, round-robin over the shards of a level, so no shard is stranded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from kazoo.exceptions import KazooException

from casque.engine import catalog
from casque.engine.acking import NotHeldHere, Source, each_settled
from casque.engine.acks import DEAD, NACK, AckEvent
from casque.engine.claim_reader import ClaimReader
from casque.engine.clock import clock_of
from casque.engine.counters import QueueCounters, dead_lettered, filtered
from casque.engine.deadletters import dead_letter_copy
from casque.engine.member import Member
from casque.engine.messages import Delivery, Position, StoredMessage, decode_receipt, encode_receipt
from casque.engine.publisher import Publisher
from casque.engine.entries import ByteBudget, Handout
from casque.errors import BackendUnavailable, CasqueError, InvalidSpec, LeaseLost, StaleReceipt
from casque.schema import QueueRef
from casque.specs import priority_of
from casque.store import Store

log = logging.getLogger(__name__)

# With several priority levels ready, at least one delivery in this many comes from a lower level.
PRIORITY_FAIRNESS = 10
# The member's timers look at its sources at least this often (a nack with no wait, or a
# range loaded with a wait already over, is settled within this), and at most this often:
# acked deliveries leave their deadlines in the heap, and waking for each costs CPU for nothing.
TIMER_SECONDS = 1.0
TIMER_GRAIN_SECONDS = 0.05


class DeadLetters:
    """Moves a subscriber's messages over its max deliveries to its dead-letter queue."""

    def __init__(self, member: Member, store: Store, publisher: Publisher, queue_counters: QueueCounters,
                 retention_seconds: Callable[[], int]) -> None:
        self._member = member
        self._store = store
        self._publisher = publisher
        self._queue_counters = queue_counters
        self._retention_seconds = retention_seconds

    async def move(self, handouts: list[tuple[Source, Handout]]) -> list[CasqueError | None]:
        """Publish messages over max deliveries to the dead-letter queue, then mark them done;
        per handout, None once done or why not (it stays in flight to the dead-letter queue
        and is tried again when that ends; the copy's client id keeps it there once).

        Done means durable: the DEAD row is written and the source proven still this
        member's before the message counts as done here, so its key's next message is handed
        out only then, and a crash can never bring it back after its successor."""
        try:
            publisher = await self._current()
        except (CasqueError, KazooException) as error:
            log.warning("dead-letter queue unavailable (%s); %d messages will be tried again", error, len(handouts))
            return [BackendUnavailable(f"dead-letter queue unavailable: {error}")] * len(handouts)
        return list(await asyncio.gather(*(self._move_one(publisher, r, h) for r, h in handouts)))

    async def _move_one(self, publisher: Publisher, reader: Source, handout: Handout) -> CasqueError | None:
        member = self._member
        message = handout.entry.message
        p = message.position
        copy = dead_letter_copy(
            message, member.queue, member.subscriber, reader.epoch, handout.entry.deliveries,
            handout.entry.last_error, subscriber_key=member.subscriber_state.ack_key(member.subscriber),
            retention_seconds=self._retention_seconds())
        try:
            await publisher.publish([copy])
            if reader.state.held_entry(p, handout.nonce) is None:
                return StaleReceipt("the message was acked, or its shard reset, meanwhile")
            await member.acks.record(AckEvent(reader.epoch, p.shard, p.batch, p.seq, outcome=DEAD))
            held = await reader.still_leased()
        except Exception as error:  # every driver error: the move is tried again
            log.warning("dead-lettering %s failed (%r); it will be tried again", message.message_id, error)
            return error if isinstance(error, CasqueError) else BackendUnavailable(f"dead-lettering failed: {error!r}")
        if not held or not reader.current:
            return LeaseLost(f"shard {p.shard} moved to another member while the message was dead-lettered; "
                             "it may be delivered again (its dead-letter copy is kept once)")
        if reader.state.dead_letter(p) is None:
            return None  # done meanwhile by another path
        member.counters.dead_lettered += 1
        reader.schedule_commit()
        reader.space_freed()
        try:
            await self._queue_counters.add(dead_lettered(member.subscriber_state.ack_key(member.subscriber)), 1)
        except CasqueError as error:  # a statistic: the message is done whatever it says
            log.info("dead-letter count of %s not written (%s)", message.message_id, error)
        return None

    async def flush(self) -> None:
        """Write the head checkpoints the dead-letter queue's publisher has yet to write (a
        clean stop; not waiting for heads, which may wait on ZooKeeper)."""
        await self._publisher.checkpoints.flush()

    async def _current(self) -> Publisher:
        """The dead-letter queue's publisher, renewed when that queue changed or was created again.

        Dead-lettering is rare, so one read of the queue's znode each time costs nothing and
        never leaves copies going to a deleted incarnation.
        """
        known = self._publisher
        state = await asyncio.to_thread(catalog.read_queue, self._store, known.queue)
        if state != known.state:
            known = self._publisher = await asyncio.to_thread(Publisher, self._store, known.queue, state)
        return known


class FilteredCount:
    """The subscriber's durable count of the messages its filter did not match (statistics):
    added up in memory and written in the background, one counter write at a time, what came
    meanwhile going into the next. A count a stopped member had not written yet is lost, and
    messages filtered again after a restart before their offset was committed count twice."""

    def __init__(self, member: Member, queue_counters: Callable[[], QueueCounters]) -> None:
        """`queue_counters` makes the counters at the first write (it prepares statements)."""
        self._member = member
        self._make_counters = queue_counters
        self._queue_counters: QueueCounters | None = None
        self._unwritten = 0
        self._writing = False

    def add(self, count: int) -> None:
        if count <= 0:
            return
        self._member.counters.filtered += count
        self._unwritten += count
        if not self._writing:
            self._writing = True
            self._member.in_background(self._write())

    async def _write(self) -> None:
        name = filtered(self._member.subscriber_state.ack_key(self._member.subscriber))
        try:
            while self._unwritten:
                count, self._unwritten = self._unwritten, 0
                try:
                    if self._queue_counters is None:
                        self._queue_counters = await asyncio.to_thread(self._make_counters)
                    await self._queue_counters.add(name, count)
                except Exception as error:  # every driver error: the count waits for the next write
                    self._unwritten += count
                    log.debug("filtered count not written (%r); it goes with the next", error)
                    return
        finally:
            self._writing = False


async def deliverer_of(member: Member, sources: Callable[[], list[Source]],
                       source_for: Callable[[Position], Source | None], queue_key: str,
                       retention_seconds: Callable[[], int]) -> Deliverer:
    """The member's deliverer, moving messages over the subscriber's max deliveries to its
    dead-letter queue when it has one; without one, redelivery is unlimited (nothing is ever
    dropped). `queue_key`: the queue's incarnation key (QueueState.shared_key);
    `retention_seconds`: the queue's, as it is at each use (dead letters keep it)."""
    spec = member.subscriber_state.spec
    queue = member.queue
    queue_counters = partial(QueueCounters, member.store.for_namespace(queue.namespace), queue_key)
    if not (spec.dead_letter_queue and spec.max_deliveries):
        return Deliverer(member, sources, source_for, 0, None, queue_counters)
    dead_letter_queue = QueueRef(queue.namespace, spec.dead_letter_queue)
    dlq_store = member.store.for_namespace(dead_letter_queue.namespace)
    dlq_state = await asyncio.to_thread(catalog.read_queue, dlq_store, dead_letter_queue)
    dead_letters = DeadLetters(member, dlq_store, Publisher(dlq_store, dead_letter_queue, dlq_state),
                               queue_counters(), retention_seconds)
    return Deliverer(member, sources, source_for, spec.max_deliveries, dead_letters, queue_counters)


class Deliverer:
    def __init__(self, member: Member, sources: Callable[[], list[Source]],
                 source_for: Callable[[Position], Source | None], max_deliveries: int,
                 dead_letters: DeadLetters | None, queue_counters: Callable[[], QueueCounters]) -> None:
        """`max_deliveries`: 0 for unlimited (no dead-letter queue: nothing is ever dropped)."""
        self._member = member
        self._filtered = FilteredCount(member, queue_counters)
        self._sources = sources
        self._source_for = source_for
        self._max_deliveries = max_deliveries
        self._dead_letters = dead_letters
        self._rotation = 0
        # Message TTLs count from the publish time, which the publisher read from this clock.
        self._clock = clock_of(member.store.session)
        # Deliveries served by each priority level while lower levels had messages ready.
        self._served: dict[int, int] = {}

    def take(self, max_messages: int, visibility: float, budget: ByteBudget | None = None) -> list[Delivery]:
        """Deliveries from the sources: higher priority levels first, with every
        PRIORITY_FAIRNESS-th delivery reserved for lower levels that have messages ready,
        so a busy high level cannot starve them; round-robin over the shards of a level."""
        now, wall = time.monotonic(), self._clock.time()
        levels: dict[int, list[Source]] = {}
        for reader in self._sources():
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
                counters = reader.state.counters
                finished_before = counters.filtered + counters.expired_ttl
                filtered_before = counters.filtered
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
                    self._member.counters.deliveries += 1
                    if handout.redelivery:
                        self._member.counters.redeliveries += 1
                if counters.filtered + counters.expired_ttl != finished_before:
                    # Done without a delivery: their batches may be complete now.
                    progressed = True
                    self._filtered.add(counters.filtered - filtered_before)
                    reader.schedule_commit()
                reader.space_freed()
            if not progressed:
                break
        if dead:
            if self._dead_letters is not None:
                self._member.in_background(self._dead_letters.move(dead))
        return deliveries

    async def record(self, deliveries: list[Delivery]) -> None:
        """Write every delivery's count; raise if that fails (the caller puts the messages back)."""
        events: list[AckEvent] = []
        for d in deliveries:
            p = d.message.position
            reader = self._source_for(p)
            if reader is not None:
                events.append(AckEvent(reader.epoch, p.shard, p.batch, p.seq, deliveries=d.delivery_count,
                                       visible_until_ms=int(self._clock.wall_of(d.visible_until) * 1000)))
        try:
            await self._member.acks.record_many(events)
            return
        except Exception as error:  # every driver error; the caller hands the deliveries back
            if isinstance(error, CasqueError):
                raise
            raise BackendUnavailable(f"delivery counts not recorded: {error!r}") from error

    def hand_back(self, deliveries: list[Delivery]) -> int:
        """Put back deliveries that never reached the app (its connection closed before the
        answer was written, or recording them failed): visible again at once, their delivery
        counts as before. Returns how many were still current and went back."""
        back = 0
        for d in deliveries:
            # Counted when taken, received by nobody: uncounted even when its range has gone
            # meanwhile (nothing to put back then).
            self._member.counters.deliveries -= 1
            if d.delivery_count > 1:
                self._member.counters.redeliveries -= 1
            position, nonce = decode_receipt(d.receipt)
            reader = self._source_for(position)
            if reader is not None and reader.state.undo_take(position, nonce):
                back += 1
        if back:
            self._member.counters.handed_back += back
            self._member.notify()
        return back

    # --- what the app does with a receipt ---------------------------------------------------------
    def source_of(self, receipt: str) -> tuple[Source, Position, int]:
        """The source that delivered a receipt's message, with its position and nonce."""
        position, nonce = decode_receipt(receipt)
        reader = self._source_for(position)
        if reader is None:
            if self._member.subscriber_state.spec.delivery == "shared":
                raise NotHeldHere(f"batch {position.shard}/{position.batch} is no longer claimed by this consumer",
                                  position, nonce)
            raise NotHeldHere(f"shard {position.shard} is no longer leased by this consumer", position, nonce)
        return reader, position, nonce

    def held_message(self, receipt: str) -> StoredMessage | None:
        """The message of a delivery the app still holds (in flight, or its ack being
        recorded); None once it is done. StaleReceipt if it went to another delivery or member."""
        reader, position, nonce = self.source_of(receipt)
        entry = reader.state.held_entry(position, nonce)
        if entry is not None:
            return entry.message
        if reader.state.has_entry(position):  # ready, waiting, or delivered again since
            raise StaleReceipt("receipt is stale: the message's visibility expired or it was delivered again")
        return None

    async def nack_many(self, receipts: list[str], delay: float | None,
                        error: str | None) -> list[None | CasqueError]:
        """Hand deliveries back, visible again after `delay` seconds (None: the retry policy's
        backoff, or at once); one result (None or the error) per receipt, in order.

        Each is answered only once its NACK row (when it is visible again) is durable, so a
        member that loads the message later, after a restart, a kill or a hand-over, keeps it
        waiting until the same time. Until then the delivery stays in flight as it was: a
        write that fails answers BackendUnavailable and leaves the delivery here unchanged (the
        receipt stays valid until its visibility ends), though its row may have landed (a
        timeout, a failed check after the write) and a later holder would honour it. All the
        call's rows go in one group-committed write.
        """
        now = time.monotonic()
        outcomes: list[None | CasqueError] = [None] * len(receipts)
        events: list[AckEvent] = []
        planned: list[tuple[int, Source, Position, int]] = []
        for index, receipt in enumerate(receipts):
            try:
                reader, position, nonce = self.source_of(receipt)
                entry, visible_at = reader.state.nack_due(position, nonce, delay, now)
            except CasqueError as refused:
                outcomes[index] = refused
                continue
            events.append(AckEvent(reader.epoch, position.shard, position.batch, position.seq, outcome=NACK,
                                   deliveries=entry.deliveries,
                                   visible_until_ms=int(self._clock.wall_of(visible_at) * 1000)))
            planned.append((index, reader, position, nonce))
        sources = list({reader for _, reader, _, _ in planned})
        try:
            await self._member.acks.record_many(events)
            # Still ours once the rows are written (as for acks, casque.engine.acking): a member
            # that took the shard or range over meanwhile may have loaded it before a row landed,
            # and would not keep the message waiting.
            held = dict(zip(sources, await each_settled([s.still_leased() for s in sources])))
        except Exception as unwritten:  # every driver error: unchanged here, the nack may be sent again
            failure = unwritten if isinstance(unwritten, CasqueError) else BackendUnavailable(
                f"nack not recorded: {unwritten!r}")
            for index, *_ in planned:
                outcomes[index] = failure
            return outcomes
        for index, reader, position, nonce in planned:
            verdict = held[reader]
            if verdict is not True:
                outcomes[index] = _not_proven(verdict, position.shard)
                continue
            try:
                # Its visibility may have ended during the write, or an ack begun: then the row
                # speaks of a delivery that is over, and the nack is refused as stale.
                reader.state.nack(position, nonce, delay, now, error)
            except StaleReceipt as stale:
                outcomes[index] = stale
                continue
            self._member.counters.nacks += 1
        self._member.notify()
        return outcomes

    async def flush(self) -> None:
        """At a clean stop: what the dead-letter queue's publisher has yet to write down."""
        if self._dead_letters is not None:
            await self._dead_letters.flush()

    # --- what happens when times end ---------------------------------------------------------------
    async def run_timers(self, stopped: Callable[[], bool]) -> None:
        """Settle every source as its times end, whether or not anybody receives: move the
        messages whose wait or visibility ended over max deliveries to the dead-letter queue,
        and record the retry backoff of deliveries whose visibility ended (ShardState.settle)."""
        while not stopped():
            now = time.monotonic()
            due = now + TIMER_SECONDS
            for reader in self._sources():
                try:
                    if reader.current:
                        self._settle(reader, now)
                except Exception:  # a bug here must not stop the timers of every other source
                    log.exception("shard %s: settling ended times failed", reader.shard)
                if (next_due := reader.state.next_due()) is not None:
                    due = min(due, next_due)
            await asyncio.sleep(max(TIMER_GRAIN_SECONDS, due - time.monotonic()))

    def _settle(self, reader: Source, now: float) -> None:
        dead, waits = reader.state.settle(now, self._max_deliveries)
        if dead and self._dead_letters is not None:
            self._member.in_background(self._dead_letters.move([(reader, handout) for handout in dead]))
        if waits:
            # Nobody was answered about these: written in the background, and a failed write
            # costs only that a restart delivers them without their backoff.
            self._member.in_background(self._record_waits([AckEvent(
                reader.epoch, e.message.position.shard, e.message.position.batch, e.message.position.seq,
                outcome=NACK, deliveries=e.deliveries, visible_until_ms=int(self._clock.wall_of(e.deadline) * 1000))
                for e in waits]))

    async def _record_waits(self, events: list[AckEvent]) -> None:
        try:
            await self._member.acks.record_many(events)
        except Exception as error:  # every driver error: see _settle
            log.info("retry backoff of %d messages not recorded (%r)", len(events), error)

    async def extend(self, receipt: str, visibility: float) -> float:
        reader, position, nonce = self.source_of(receipt)
        now = time.monotonic()
        deadline = reader.state.extend(position, nonce, visibility, now)
        if isinstance(reader, ClaimReader):
            # The claim must last past the new deadline, and a member that takes the range over
            # from us once we are gone must find the deadline, or it may deliver the message.
            wall = reader.sharing.clock.wall_of(deadline)
            if not await reader.renew_past(wall):
                raise StaleReceipt("the message's batches went to another member; it may be delivered again")
            await self._member.acks.record(AckEvent(reader.epoch, position.shard, position.batch, position.seq,
                                                    visible_until_ms=int(wall * 1000)))
            if not reader.vouched:
                raise BackendUnavailable("this member cannot prove its claim on the message now; try again")
        return deadline - now

    async def dead_letter(self, receipt: str, error: str | None) -> None:
        if self._dead_letters is None:
            raise InvalidSpec(f"subscriber {self._member.subscriber} has no dead-letter queue")
        reader, position, nonce = self.source_of(receipt)
        entry = reader.state.in_flight_entry(position, nonce)
        entry.last_error = error or entry.last_error
        (refusal,) = await self._dead_letters.move([(reader, Handout(entry, nonce, redelivery=False, dead=True))])
        if refusal is not None:
            raise refusal


def _not_proven(verdict: object, shard: int) -> CasqueError:
    """Why a nack whose row was written is not answered as holding: its source is not provably
    this member's any more (LeaseLost), or the check failed (retryable)."""
    if isinstance(verdict, CasqueError):
        return verdict
    if isinstance(verdict, BaseException):
        return BackendUnavailable(f"lease not confirmed: {verdict!r}")
    return LeaseLost(f"shard {shard} moved to another member while the nack was recorded; the message may be "
                     "delivered again before its delay")
