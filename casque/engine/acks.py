"""Insert-only records of what a subscriber did with messages of incomplete batches.

Writes are group-committed: events that arrive while a write is in flight go out together,
as one row per batch and kind (the set of acked seqs, or the delivery counts), in one
unlogged batch per partition; each event is confirmed to its caller only after its row is
written. Rows are never updated or deleted, and expire with the queue's retention.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.errors import NewerFormat
from casque.formats import unmarked
from casque.schema import ACKS_TABLE, QueueRef, bucket_of
from casque.store import Store

ACK = "ack"
DEAD = "dead"
# A nack of delivery `deliveries`: the message is visible again at `visible_until_ms`. Its
# row carries no seqs, so readers that take a row's seqs as done (load_bucket) pass it by; it
# records, for a message's history and a member taking the range over, when the message may
# be delivered again.
NACK = "nack"
# The kinds of ack row this release reads (None: a delivery row). A row of a later format
# marks its kind (casque.formats), or is of a kind this release does not know: either way
# it is refused rather than folded in as a delivery row.
ROW_KINDS = frozenset({None, ACK, DEAD, NACK})


class AckEvent(NamedTuple):
    """One message's ack, dead-lettering or delivery count (a tuple: two are made per
    message delivered and acked, and a frozen dataclass costs twice as much to build)."""

    epoch: int
    shard: int
    batch: int
    seq: int
    outcome: str | None = None  # ACK, DEAD or NACK
    deliveries: int | None = None
    # Until when the delivery (or its extension) is invisible, in ms on Cassandra's clock: a
    # member that takes a departed member's range over keeps it in flight until then.
    visible_until_ms: int | None = None


@dataclass
class BatchMarks:
    """What the ack table says about one batch.

    Two kinds of time are kept apart: a delivery row's `visible_until` says until when that
    delivery is in flight (an app may hold it); a NACK row's says when the message it handed
    back is visible again (nobody holds it, and it waits until then). A NACK row speaks for
    the message only while no later delivery was recorded: its delivery count is at least
    the highest one.
    """

    done: set[int] = field(default_factory=set)
    # The highest delivery count recorded for each seq (by a delivery or a NACK row).
    deliveries: dict[int, int] = field(default_factory=dict)
    # The latest visibility deadline of each seq's deliveries and extensions (ms on
    # Cassandra's clock); NACK rows are not in it.
    visible_until: dict[int, int] = field(default_factory=dict)
    # Per seq, the delivery count the latest NACK row names, and when that row makes the
    # message visible again (ms on Cassandra's clock).
    nacked: dict[int, int] = field(default_factory=dict)
    nacked_until: dict[int, int] = field(default_factory=dict)

    def add_row(self, outcome: str | None, seqs: set[int] | frozenset[int] | None,
                deliveries: dict[int, int] | None, visible_until: dict[int, int] | None) -> None:
        """Fold one ack row in (rows come in any order); NewerFormat for a row of a later format."""
        if outcome not in ROW_KINDS:
            unmarked(outcome or "", "an ack row of kind")
            raise NewerFormat(f"an ack row of kind {outcome!r} was written by a later version of casque; this "
                              "version reads kinds ack, dead, nack and deliveries: upgrade it")
        if outcome in (ACK, DEAD):
            self.done.update(seqs or ())
            return
        for seq, count in (deliveries or {}).items():
            self.deliveries[seq] = max(count, self.deliveries.get(seq, 0))
        if outcome == NACK:
            for seq, count in (deliveries or {}).items():
                until = (visible_until or {}).get(seq, 0)
                known = self.nacked.get(seq, 0)
                if count > known:
                    self.nacked[seq], self.nacked_until[seq] = count, until
                elif count == known:
                    self.nacked_until[seq] = max(until, self.nacked_until.get(seq, 0))
            return
        for seq, until in (visible_until or {}).items():
            self.visible_until[seq] = max(until, self.visible_until.get(seq, 0))

    def waiting_until(self, seq: int) -> int | None:
        """When a nacked (or backing-off) message is visible again, if its last record is a
        NACK row; None when a delivery was recorded after it, or it was never nacked."""
        count = self.nacked.get(seq)
        if count is None or count < self.deliveries.get(seq, 0):
            return None
        return self.nacked_until[seq]

    def resting_until(self, seq: int, backoff: Callable[[int], float] | None, now_ms: int) -> int | None:
        """When a message nobody holds may be delivered again (ms on Cassandra's clock): its
        NACK row's time or, if its last delivery's visibility ended by `now_ms`, that end plus
        the retry policy's backoff after as many deliveries (`backoff`: seconds for a count).
        The latter is what its member records as a NACK row when the visibility ends; derived
        here, it holds even when that member died before writing it. None: no wait known."""
        if (until := self.waiting_until(seq)) is not None:
            return until
        visible_until = self.in_flight_until(seq)
        if visible_until is None or visible_until > now_ms or backoff is None:
            return None
        wait = backoff(self.deliveries.get(seq, 0))
        return visible_until + int(wait * 1000) if wait > 0 else None

    def in_flight_until(self, seq: int) -> int | None:
        """Until when the message's latest recorded delivery may be in an app's hands; None
        when it was handed back (nacked) since, or never delivered."""
        if seq in self.done or self.waiting_until(seq) is not None:
            return None
        return self.visible_until.get(seq)


class AckLog:
    def __init__(self, store: Store, queue: QueueRef, subscriber_key: str, retention_seconds: int) -> None:
        """`subscriber_key`: the subscriber's name and incarnation (`SubscriberState.ack_key`)."""
        self._store = store
        self._queue = queue.key
        self._subscriber = subscriber_key
        table = f"{store.keyspace_of(queue.namespace)}.{ACKS_TABLE}"
        self._insert_outcome = store.session.prepare(
            f"INSERT INTO {table} (queue, subscriber, epoch, shard, bucket, batch_no, entry, outcome, seqs) "
            f"VALUES (?, ?, ?, ?, ?, ?, now(), ?, ?) USING TTL {int(retention_seconds)}"
        )
        self._insert_deliveries = store.session.prepare(
            f"INSERT INTO {table} (queue, subscriber, epoch, shard, bucket, batch_no, entry, deliveries, "
            f"visible_until) VALUES (?, ?, ?, ?, ?, ?, now(), ?, ?) USING TTL {int(retention_seconds)}"
        )
        self._insert_nack = store.session.prepare(
            f"INSERT INTO {table} (queue, subscriber, epoch, shard, bucket, batch_no, entry, outcome, deliveries, "
            f"visible_until) VALUES (?, ?, ?, ?, ?, ?, now(), '{NACK}', ?, ?) USING TTL {int(retention_seconds)}"
        )
        self._select = store.session.prepare(
            f"SELECT batch_no, outcome, seqs, deliveries, visible_until FROM {table} WHERE queue = ? "
            "AND subscriber = ? "
            "AND epoch = ? AND shard = ? AND bucket = ? AND batch_no >= ?"
        )
        self._pending: list[tuple[list[AckEvent], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.rows_written = 0
        self.statements = 0

    async def load_bucket(self, epoch: int, shard: int, bucket: int, from_batch: int) -> dict[int, BatchMarks]:
        rows = await cql.fetch_all(
            self._store.session, self._select, (self._queue, self._subscriber, epoch, shard, bucket, from_batch)
        )
        marks: dict[int, BatchMarks] = defaultdict(BatchMarks)
        for row in rows:
            marks[row.batch_no].add_row(row.outcome, row.seqs, row.deliveries, row.visible_until)
        return dict(marks)

    def record(self, event: AckEvent) -> asyncio.Future[None]:
        """Queue `event` for writing; the future completes when its row is durable."""
        return self.record_many([event])

    def record_many(self, events: list[AckEvent]) -> asyncio.Future[None]:
        """Queue `events` for writing; the future completes when all their rows are durable.

        One future for a whole receive or ack call, not one per message: with hundreds of
        messages a call, the futures and their gathering cost more CPU than the rows.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not events:
            future.set_result(None)
            return future
        self._pending.append((events, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return future

    async def flush(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        while self._pending:
            items, self._pending = self._pending, []
            partitions: dict[tuple[int, int, int], list[AckEvent]] = defaultdict(list)
            for events, _ in items:
                for event in events:
                    partitions[(event.epoch, event.shard, bucket_of(event.batch))].append(event)
            writes = [self._write(events) for events in partitions.values()]
            results = await asyncio.gather(*writes, return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            for _, future in items:
                if future.done():
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

    async def _write(self, events: list[AckEvent]) -> None:
        outcomes: dict[tuple[int, str], set[int]] = defaultdict(set)
        deliveries: dict[int, dict[int, int]] = defaultdict(dict)
        visible_until: dict[int, dict[int, int]] = defaultdict(dict)
        nacks: dict[int, tuple[dict[int, int], dict[int, int]]] = defaultdict(lambda: ({}, {}))
        for e in events:
            if e.outcome == NACK:
                nacked, until = nacks[e.batch]
                nacked[e.seq], until[e.seq] = e.deliveries or 0, e.visible_until_ms or 0
                continue
            if e.outcome is not None:
                outcomes[(e.batch, e.outcome)].add(e.seq)
            if e.deliveries is not None:
                deliveries[e.batch][e.seq] = e.deliveries
            if e.visible_until_ms is not None:
                visible_until[e.batch][e.seq] = e.visible_until_ms
        first = events[0]
        partition = (self._queue, self._subscriber, first.epoch, first.shard, bucket_of(first.batch))
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        for (batch, outcome), seqs in outcomes.items():
            statement.add(self._insert_outcome, (*partition, batch, outcome, seqs))
        for batch in deliveries.keys() | visible_until.keys():
            statement.add(self._insert_deliveries,
                          (*partition, batch, deliveries.get(batch) or None, visible_until.get(batch) or None))
        for batch, (nacked, until) in nacks.items():
            statement.add(self._insert_nack, (*partition, batch, nacked, until))
        await cql.execute(self._store.session, statement)
        self.statements += 1
        self.rows_written += len(events)
