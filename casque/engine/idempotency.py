"""Idempotent publish: a client message id seen within the window returns the first result.

Within one sidecar (the app's retries reach its own localhost sidecar) concurrent publishes
of one id wait for the first, and recent ids are remembered in memory. Across sidecars and
restarts, ids are found in the `client_ids` table, whose rows expire after the window. A
queue's ids are spread over a few partitions there (`casque.schema.client_id_bucket`), so a
group commit checks and records all its ids with a few requests, however many there are.

A crash must not let a retry publish an id twice, so the link from id to batch is recorded
before the batch exists, not after: the shard writer records an intent per id (its message
id, the shard, its seq in the batch, the writer id its claims carry) and the writer's row
(the first batch it will try, and a claim deadline), and only then claims. The window opens
when it checks the ids, before the read: it writes no intent and sends no claim once
CLAIM_SECONDS of it have passed, since by then a retry through another sidecar may have
found the ids unpublished too and published them (an attempt stopped between its check and
its intents must not overwrite that retry's record). A retry through another sidecar sent
while the first attempt is still inside its window can race it; an app's retries reach its
own sidecar, which makes them wait for the first. After the batch is written,
the batch number on the writer's row completes the intents of all its ids. From protocol 2
on, a batch whose ids are all producer keys keeps the writer's facts on its block rows
instead and writes neither a writer row nor a completion (casque.engine.sequences).

A retry that finds only an intent settles it: it reads the shard's headers at SERIAL from
the intent's first batch on, looking for the intent's writer. Found: the publish happened,
and its position is the answer. A batch nobody has claimed yet: the writer may still claim
it, so the retry looks again until the writer can send no more claims: CLAIM_SECONDS after
the retry first saw the intent (the writer's window started before the intent was written),
or the intent's deadline plus CLOCK_SKEW_SECONDS, whichever comes first. Then the retry
publishes anew, after taking the id over with one conditional write (`take_over`, the
intent's writer as the condition): a client that gave up waiting and retried through
another sidecar leaves two retries settling one intent, and only one of them may publish.
The other finds the new intent (a settle re-reads the row while it waits) and settles that
one.

A claim sent inside the window may still land after it: its process was stopped (SIGSTOP,
a long pause) after checking the window, or a coordinator holds its Paxos round. Batches
are claimed in order, so that claim is for the first batch the retry found unclaimed
(`Unclaimed.fence_batch`) or for one already taken. The retry therefore claims exactly that
batch first, on the intent's shard, and that claim is the fence: whoever wins it, the late
claim loses. If the late claim won, the retry answers its position. The new intent's writer
row names the writers it replaced (`replaces`), so a later retry that finds one of them on
that first batch knows the id was published there.

An intent whose writer has no row yet is waited for the same way: its writer claims only
once the row is written, so a row still missing after the window means no claim was sent,
and the retry takes the id over without a fence.

A delayed message's id is recorded the same way round: its record (the message id, with
shard, batch and seq -1) is written before its row in the delayed table, so a retry after
any failure finds the message id and stores that same row again rather than a second
message (the states are `delayed_publish.DelayedPublish`). No intent is needed there: a row
stored twice under one key is one row, where a batch claimed twice would be two.

"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from cassandra import InvalidRequest
from cassandra.query import UNSET_VALUE, BatchStatement, BatchType, PreparedStatement

from casque.backends import cql
from casque.engine.batches import Log
from casque.engine.clock import clock_of
from casque.engine.messages import OutgoingMessage, Published
from casque.engine.protocol import SEQUENCE_CLAIM_FACTS, ProtocolLevel
from casque.engine.sequences import (
    PRODUCER_KEY_PREFIX,
    BlockEntry,
    BlockRecord,
    ClaimFacts,
    Sequenced,
    SequenceBlocks,
    parse_producer_key,
)
from casque.formats import unmarked_or_none
from casque.schema import (
    CLIENT_IDS_TABLE,
    LEGACY_PUBLISH_IDS_TABLE,
    PRODUCER_SEQS_TABLE,
    PUBLISH_WRITERS_TABLE,
    client_id_bucket,
    has_table,
)
from casque.store import Store

DEFAULT_WINDOW_SECONDS = 600
TTL_GRANULARITY_SECONDS = 1
# Recent ids kept in memory per queue, bounded by count and by an estimate of their bytes:
# ids may be 256 characters, and the sidecar's container has 256 MiB. A forgotten id is
# still found in Cassandra, at the cost of a read.
REMEMBERED_IDS = 50_000
REMEMBERED_BYTES = 8 * 1024 * 1024
# What one remembered id holds beyond its strings' characters: their headers, the ordered
# dict's entry, the Published and its ints, the tuple and the time. Measured with tracemalloc
# on CPython 3.11: 400-405 bytes (240, the figure before, let the 8 MiB hold 12.5).
REMEMBERED_OVERHEAD_BYTES = 420
# An intent's claim deadline lies this far ahead; its writer sends claims only during the
# first CLAIM_SECONDS of it, so a claim in flight lands well before the deadline.
DEADLINE_SECONDS = 30.0
CLAIM_SECONDS = 15.0
# How far apart two sidecars' clocks may be for a retry to trust an intent's deadline.
CLOCK_SKEW_SECONDS = 5.0
# Ids named per read of one bucket partition, and rows per write to one: a group commit
# (at most 1,000 messages) needs one of each per bucket. A single-partition batch is one
# mutation, which Cassandra neither warns about nor refuses for its size (only batches
# spanning partitions are checked), far below the commit log's mutation limit here.
LOOKUP_CHUNK = 1000
WRITE_CHUNK = 1000
# The legacy table has a partition per id: ids read per request there (see LegacyIds).
LEGACY_LOOKUP_CHUNK = 100
# A retry looks for an intent's batch again this often while the deadline has not passed.
RESOLVE_POLL_SECONDS = 0.25

_COLUMNS = "client_id, message_id, shard, batch_no, seq, writer, TTL(writer) AS intent_ttl"
_LEGACY_COLUMNS = f"{_COLUMNS}, since_batch, claim_deadline"


class CallSlots(Protocol):
    """Messages of one publish call that share the call's future (the publisher's): a
    future for one of them alone is made only when asked."""

    def watch(self, index: int) -> asyncio.Future[Published]: ...


@dataclass(frozen=True)
class IdRecord:
    """What Cassandra holds for a client id: an intent, completed with a position once written."""

    client_id: str
    message_id: str
    shard: int
    batch_no: int | None
    seq: int | None
    writer: str | None
    since_batch: int | None
    claim_deadline: datetime | None
    # Seconds left to the intent (None: no intent, a row written only with its position).
    intent_ttl: int | None
    # False: found outside `client_ids` (the legacy table, or a producer key's block row),
    # so a take-over inserts the id's row there rather than replacing it.
    in_client_ids: bool = True
    # Writers this intent's writer took the id over from that may have won `since_batch`.
    replaces: frozenset[str] = frozenset()
    # A producer key's block row of protocol 2, which holds its writer's claim facts itself
    # (casque.engine.sequences): settled with one search per writer (`_settle_block_intent`).
    facts_on_block: bool = False


@dataclass(frozen=True)
class Unclaimed:
    """An intent its writer can no longer claim a batch for: the id may be published anew.

    `fence_batch`: the first batch the writer had not won when its window ended; a claim of
    its sent before may still land there, so the new publish claims that batch first (None:
    the writer never claimed at all). `replaces`: the writers whose late claim could win it.
    """

    shard: int
    fence_batch: int | None
    replaces: frozenset[str] = frozenset()


def _record(row: Any) -> IdRecord:
    """A `client_ids` row; an intent's claim facts are on its writer's row (`_with_writer`)."""
    return IdRecord(row.client_id, row.message_id, row.shard, row.batch_no, row.seq, _writer_of(row), None, None,
                    row.intent_ttl)


def _legacy_record(row: Any) -> IdRecord:
    return IdRecord(row.client_id, row.message_id, row.shard, row.batch_no, row.seq, _writer_of(row),
                    row.since_batch, row.claim_deadline, row.intent_ttl, in_client_ids=False)


def _writer_of(row: Any) -> str | None:
    """A publish-id record's writer, which carries the record's format (casque.formats)."""
    return unmarked_or_none(row.writer, f"the writer of publish id {row.client_id!r}")


def _block_record(entry: BlockEntry) -> IdRecord:
    return IdRecord(entry.key, entry.message_id, entry.shard, entry.batch_no, entry.seq, entry.writer,
                    entry.since_batch, entry.claim_deadline, entry.ttl, in_client_ids=False,
                    facts_on_block=entry.since_batch is not None)


def _with_writer(record: IdRecord, writer: Any) -> IdRecord:
    """An intent with its writer's claim facts, and the batch the writer won if it did."""
    return replace(record, since_batch=writer.since_batch, claim_deadline=writer.claim_deadline,
                   batch_no=record.batch_no if writer.batch_no is None else writer.batch_no,
                   replaces=frozenset(writer.replaces or ()))


class IdempotencyGuard:
    """Ids of one queue: exact within this process, and in `client_ids` for everyone.

    A queue's ids live in CLIENT_ID_BUCKETS partitions, so the shard writer checks the ids
    of a whole batch with one read per bucket its ids fall in (`lookup`) and records their
    intents with one single-partition unlogged batch per bucket (`record_intents`); an
    intent names its writer and its seq, so one row for the writer (`record_won`) completes
    them all once the batch is written. At most 2 x CLIENT_ID_BUCKETS + 1 requests, each
    touching one partition, for a batch of 1,000 ids, where a partition per id cost 3,000
    partition operations.
    """

    def __init__(self, store: Store, queue_key: str, log: Log, window_seconds: int | None = None,
                 protocol: ProtocolLevel | None = None) -> None:
        """`queue_key`: the queue's incarnation key (`QueueState.shared_key`); `protocol`: the
        level whose records to write (the installation's, as a sidecar follows it; BASELINE,
        which every release reads, without one)."""
        self._clock = clock_of(store.session)
        self._protocol = protocol or ProtocolLevel()
        self._store = store
        self._queue = queue_key
        self._window = int(window_seconds or DEFAULT_WINDOW_SECONDS)
        self._log = log
        # The shared tables of the queue's namespace (its own keyspace under isolation).
        keyspace = store.keyspace_of(log.queue.namespace)
        table = f"{keyspace}.{CLIENT_IDS_TABLE}"
        self._select = store.session.prepare(
            f"SELECT {_COLUMNS} FROM {table} WHERE queue = ? AND bucket = ? AND client_id IN ?"
        )
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, bucket, client_id, message_id, shard, batch_no, seq) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        # An id's intent: the facts shared by the whole batch (where its claims start, until
        # when they may be sent) are on the writer's row, written with the intents.
        self._insert_intent = store.session.prepare(
            f"INSERT INTO {table} (queue, bucket, client_id, message_id, shard, seq, writer) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        writers = f"{keyspace}.{PUBLISH_WRITERS_TABLE}"
        self._insert_writer = store.session.prepare(
            f"INSERT INTO {writers} (queue, writer, shard, since_batch, claim_deadline, replaces) "
            "VALUES (?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._insert_won = store.session.prepare(
            f"INSERT INTO {writers} (queue, writer, batch_no) VALUES (?, ?, ?) USING TTL ?"
        )
        self._select_writers = store.session.prepare(
            f"SELECT writer, since_batch, claim_deadline, batch_no, replaces FROM {writers} "
            "WHERE queue = ? AND writer IN ?"
        )
        # A retry that found an intent never claimed takes the id over only if nobody else
        # did meanwhile: two retries at two sidecars would otherwise both publish it.
        self._take_over = store.session.prepare(
            f"UPDATE {table} USING TTL ? SET message_id = ?, shard = ?, seq = 0, writer = ? "
            "WHERE queue = ? AND bucket = ? AND client_id = ? IF writer = ? AND batch_no = null"
        )
        # The same for an intent found in the legacy table: the first retry to move it here wins.
        self._take_over_legacy = store.session.prepare(
            f"INSERT INTO {table} (queue, bucket, client_id, message_id, shard, seq, writer) "
            "VALUES (?, ?, ?, ?, ?, 0, ?) IF NOT EXISTS USING TTL ?"
        )
        self._consistency = log.consistency
        for statement in (self._select, self._insert, self._insert_intent, self._insert_writer, self._insert_won,
                          self._select_writers, self._take_over, self._take_over_legacy):
            statement.consistency_level = self._consistency
        for statement in (self._take_over, self._take_over_legacy):
            statement.serial_consistency_level = log.serial_consistency
        self._legacy = (
            LegacyIds(store, keyspace, queue_key, self._consistency)
            if has_table(store.session, keyspace, LEGACY_PUBLISH_IDS_TABLE) else None
        )
        # The operator creates the table with its first reconcile after an upgrade; a sidecar
        # that starts before then keeps producer keys in `client_ids`, as plain ids (correct,
        # at an id's cost). It looks for the table again when it restarts.
        self._blocks = (
            SequenceBlocks(store, keyspace, queue_key, self._consistency)
            if has_table(store.session, keyspace, PRODUCER_SEQS_TABLE) else None
        )
        # Cassandra expires a row at the whole second after its write plus the TTL, up to a
        # second early: memory forgets a second before the rows can, so it never answers a
        # retry as a duplicate that another sidecar would publish anew.
        self._recent = RecentIds(window_seconds=self._window - TTL_GRANULARITY_SECONDS)
        # This process's publishes under way, by id: a future, or a slot of a publish call.
        self._inflight: dict[str, asyncio.Future[Published] | tuple[CallSlots, int]] = {}
        self.resolved_intents = 0
        # Searches for the batch a writer of protocol 2 block rows won, by (shard, writer,
        # first batch): a retry of a whole call settles all its keys with one search.
        self._searches: dict[tuple[int, str, int], asyncio.Task[int | Unclaimed]] = {}
        self._statements = 0

    @property
    def statements(self) -> int:
        """Cassandra statements sent for ids so far (each touches one partition)."""
        return self._statements + (self._blocks.statements if self._blocks is not None else 0)

    @property
    def under_way(self) -> int:
        """Ids whose publish in this process has not ended yet."""
        return len(self._inflight)

    def _claim_facts_on_blocks(self) -> bool:
        """Whether block rows carry their claim facts (protocol 2), as they are read and written now."""
        return (self._blocks is not None and self._protocol.version >= SEQUENCE_CLAIM_FACTS
                and self._blocks.ensure_claim_facts())

    def _sequenced(self, client_id: str) -> Sequenced | None:
        """The producer and number of a producer key kept in blocks; None for any other id."""
        return parse_producer_key(client_id) if self._blocks is not None else None

    def earlier_here(self, client_id: str) -> asyncio.Future[Published] | None:
        """Within this process, at once: the first result of a recent id, or the publish of it
        under way, as a duplicate; None if neither (the publish goes on to the durable check,
        the shard writer's `lookup`, and is `track`ed)."""
        known = self._recent.get(client_id)
        if known is not None:
            answer = asyncio.get_running_loop().create_future()
            answer.set_result(_as_duplicate(known))
            return answer
        running = self._inflight.get(client_id)
        if running is None:
            return None
        if isinstance(running, tuple):
            call, index = running
            running = call.watch(index)
        return asyncio.get_running_loop().create_task(_duplicate_of(running))

    def continue_from(self, previous: IdempotencyGuard) -> None:
        """Take over the ids of `previous`, the guard of this queue incarnation's publisher
        before a spec change replaced it: its publishes still under way finish there, and a
        retry of one of their ids must wait for them here. Before its intents are written an
        id is known to memory alone; a guard that started empty would publish it again."""
        self._inflight = previous._inflight  # shared: either guard's publishes end in it
        if previous._window == self._window:
            self._recent = previous._recent  # otherwise the rows answer for what it held

    def track(self, client_id: str, publication: asyncio.Future[Published]) -> None:
        """`publication` is this process's publish of `client_id`: until it ends, publishes of
        the id wait for it (`earlier_here`), and its result is remembered."""
        self._inflight[client_id] = publication
        started = time.monotonic()  # before its intent rows are written, so memory ends first

        def ended(done: asyncio.Future[Published]) -> None:
            if self._inflight.get(client_id) is done:
                del self._inflight[client_id]
            # A producer key is not kept in memory: it is found again at the cost of one read
            # of its block, and a producer's keys would crowd out the client ids.
            if not done.cancelled() and done.exception() is None and not client_id.startswith(PRODUCER_KEY_PREFIX):
                self._recent.remember(client_id, done.result(), started)

        publication.add_done_callback(ended)

    def track_slot(self, client_id: str, call: CallSlots, index: int) -> None:
        """As `track`, for a message answered through its call's shared future: the call
        reports when it lands (`slot_ended`), and makes a future for it only for a publish
        of the same id that waits meanwhile."""
        self._inflight[client_id] = (call, index)

    def slot_ended(self, client_id: str, call: CallSlots, index: int, result: Published | None,
                   started: float) -> None:
        """The message of a `track_slot` landed (`result`) or failed (None). `started`: when
        its call tracked its first id, before any of the call's intents was written."""
        running = self._inflight.get(client_id)
        if isinstance(running, tuple) and running[0] is call and running[1] == index:
            del self._inflight[client_id]
        if result is not None and not client_id.startswith(PRODUCER_KEY_PREFIX):
            self._recent.remember(client_id, result, started)

    async def lookup(self, client_ids: Sequence[str]) -> dict[str, IdRecord]:
        """The records of these ids, by client id: one read per bucket partition the client
        ids fall in and one per block the producer keys fall in, all at once (and, on an
        installation that still has the legacy table, one more look there for the client ids
        not found). A producer key found in its block is looked up in `client_ids` too: a
        retry that settled it or took it over wrote there."""
        plain: list[str] = []
        sequenced: list[Sequenced] = []
        for client_id in dict.fromkeys(client_ids):
            parsed = self._sequenced(client_id)
            if parsed is None:
                plain.append(client_id)
            else:
                sequenced.append(parsed)
        if sequenced:
            self._claim_facts_on_blocks()  # read rows of protocol 2 whole once it is in force
        found, blocks = await asyncio.gather(self._read_listed(plain), self._read_blocks(sequenced))
        if blocks:
            found.update(await self._read_listed(list(blocks)))
            for key, entry in blocks.items():
                found.setdefault(key, _block_record(entry))
        # Intents whose claim facts are on their writer's row (a block row of protocol 2 has its own).
        intents = [r for r in found.values() if r.batch_no is None and r.writer is not None and r.since_batch is None]
        if intents:
            self._statements += 1
            writers = {row.writer: row for row in await cql.fetch_all(
                self._store.session, self._select_writers, (self._queue, list({r.writer for r in intents})))}
            found.update([(r.client_id, _with_writer(r, writers[r.writer])) for r in intents if r.writer in writers])
        if self._legacy is not None:
            missing = [c for c in plain if c not in found]
            if missing:
                self._statements += -(-len(missing) // LEGACY_LOOKUP_CHUNK)
                try:
                    found.update(await self._legacy.lookup(missing))
                except InvalidRequest:
                    # Dropped since this guard started (see LegacyIds): nothing left to honour.
                    self._legacy = None
        return found

    async def _read_listed(self, client_ids: Sequence[str]) -> dict[str, IdRecord]:
        """The `client_ids` rows of these ids: one read per bucket partition they fall in."""
        reads = [
            (bucket, ids[i:i + LOOKUP_CHUNK])
            for bucket, ids in _by_bucket(client_ids).items()
            for i in range(0, len(ids), LOOKUP_CHUNK)
        ]
        self._statements += len(reads)
        pages = await asyncio.gather(
            *(cql.fetch_all(self._store.session, self._select, (self._queue, bucket, chunk)) for bucket, chunk in reads))
        return {row.client_id: _record(row) for rows in pages for row in rows}

    async def _read_blocks(self, keys: Sequence[Sequenced]) -> dict[str, BlockEntry]:
        return await self._blocks.lookup(keys) if keys and self._blocks is not None else {}

    async def earlier(self, client_id: str) -> Published | None:
        """The publish of an id made before (settling an intent), or None."""
        record = (await self.lookup([client_id])).get(client_id)
        if record is None:
            return None
        outcome = await self.settle(record)
        return outcome if isinstance(outcome, Published) else None

    async def record_intents(
        self, intents: Sequence[tuple[OutgoingMessage, str, int]], shard: int, writer: str, since_batch: int,
        deadline: datetime,
    ) -> bool:
        """Before a claim: (message, message id, seq in the batch) of each message of the batch
        that has a client id, and the writer's row, all at once. Returns whether the batch
        wants its completion (`record_won`): not when its keys are all producer keys under
        protocol 2, whose block rows carry the writer's facts and need no writer row."""
        rows = []
        sequenced = []
        ttl = 0
        for message, message_id, seq in intents:
            client_id = message.client_id
            if not client_id:
                continue
            message_ttl = self._ttl(message)
            ttl = max(ttl, message_ttl)
            parsed = self._sequenced(client_id)
            if parsed is None:
                rows.append((self._queue, client_id_bucket(client_id), client_id, message_id, shard, seq, writer,
                             message_ttl))
            else:
                sequenced.append(BlockRecord(parsed, message_id, shard, seq))
        if not (rows or sequenced):
            return False
        facts = ClaimFacts(since_batch, deadline) if sequenced and self._claim_facts_on_blocks() else None
        writes = []
        if rows or facts is None:
            writes.append(self._write_writer(writer, shard, since_batch, deadline, ttl))
        if rows:
            writes.append(self._write_rows(self._insert_intent, rows))
        if sequenced:
            writes.append(self._write_blocks(sequenced, writer, ttl, facts=facts))
        await asyncio.gather(*writes)
        return bool(rows) or facts is None

    async def _write_blocks(self, records: Sequence[BlockRecord], writer: str, ttl: int,
                            batch_no: int | None = None, facts: ClaimFacts | None = None) -> None:
        if records and self._blocks is not None:
            await self._blocks.record(records, writer, ttl, batch_no, facts)

    async def _write_writer(self, writer: str, shard: int, since_batch: int, deadline: datetime, ttl: int,
                            replaces: frozenset[str] = frozenset()) -> None:
        self._statements += 1
        await cql.execute(self._store.session, self._insert_writer, (
            self._queue, writer, shard, since_batch, deadline, set(replaces) or UNSET_VALUE, ttl))

    async def record_won(self, messages: Sequence[OutgoingMessage], writer: str, shard: int, batch: int) -> None:
        """After a write: the batch `writer` won, which completes the intents of its ids
        (`messages`, those with a client id), for as long as the longest of them lives."""
        self._statements += 1
        ttl = max(self._ttl(m) for m in messages)
        await cql.execute(self._store.session, self._insert_won, (self._queue, writer, batch, ttl))

    async def record_positions(self, published: Sequence[tuple[OutgoingMessage, Published]]) -> None:
        """Where each id's message is, on a row of its own (one write per bucket partition,
        and a block row per producer key): for publishes that are not group commits. A
        delayed message's is written before its row (see `delayed_publish.DelayedPublish`)."""
        rows = []
        for message, result in published:
            if not message.client_id:
                continue
            parsed = self._sequenced(message.client_id)
            if parsed is None:
                rows.append((self._queue, client_id_bucket(message.client_id), message.client_id, result.message_id,
                             result.shard, result.batch, result.seq, self._ttl(message)))
            else:
                # Its own writer name: the row is a position, and no writer row names it.
                await self._write_blocks([BlockRecord(parsed, result.message_id, result.shard, result.seq)],
                                         f"at:{result.message_id}", self._ttl(message), result.batch)
        await self._write_rows(self._insert, rows)

    async def take_over(
        self, record: IdRecord, message: OutgoingMessage, shard: int, writer: str, since_batch: int,
        deadline: datetime, replaces: frozenset[str] = frozenset(),
    ) -> bool:
        """Replace an intent whose writer can claim no more (`settle` said so) with ours,
        unless another retry replaced it first (or it was completed): one conditional write,
        on this rare path only. The message keeps the intent's message id, so whichever of
        the replaced and the new writer wins, the id names the one message stored."""
        assert message.client_id is not None
        # The new writer's row first: whoever sees the new intent finds its claim facts.
        await self._write_writer(writer, shard, since_batch, deadline, self._ttl(message), replaces)
        self._statements += 1
        bucket = client_id_bucket(message.client_id)
        if not record.in_client_ids:
            result = await cql.execute(self._store.session, self._take_over_legacy, (
                self._queue, bucket, message.client_id, record.message_id, shard, writer, self._ttl(message)))
        else:
            result = await cql.execute(self._store.session, self._take_over, (
                self._ttl(message), record.message_id, shard, writer, self._queue, bucket, message.client_id,
                record.writer))
        return cql.applied(result)

    async def complete(self, client_id: str, message_id: str, shard: int, batch: int, seq: int | None,
                       ttl: int | None = None) -> Published:
        """Record where an id's message was found (its seq read from the batch if unknown),
        for as long as its intent was to live, and answer that publish."""
        if seq is None:
            seq = await self._seq_of(shard, batch, message_id)
        found = Published(message_id, shard, batch, seq)
        await self._write_rows(self._insert, [
            (self._queue, client_id_bucket(client_id), client_id, message_id, shard, batch, seq,
             max(1, int(ttl or self._window)))])
        return _as_duplicate(found)

    def _ttl(self, message: OutgoingMessage) -> int:
        return max(self._window, message.client_id_window_seconds or 0)

    async def _write_rows(self, statement: PreparedStatement, rows: Sequence[tuple[Any, ...]]) -> None:
        """Rows (queue, bucket, ...) in one unlogged batch per bucket partition (per
        WRITE_CHUNK of its rows), sent at once: one mutation per partition, not per row."""
        if not rows:
            return
        batches = []
        for bucket_rows in _by_bucket_rows(rows).values():
            for start in range(0, len(bucket_rows), WRITE_CHUNK):
                batch = BatchStatement(batch_type=BatchType.UNLOGGED, consistency_level=self._consistency)
                for row in bucket_rows[start:start + WRITE_CHUNK]:
                    batch.add(statement, row)
                batches.append(batch)
        self._statements += len(batches)
        await asyncio.gather(*(cql.execute(self._store.session, b) for b in batches))

    async def settle(self, row: IdRecord) -> Published | Unclaimed:
        """The publish a record holds: its position, or its intent's, settled (see the module)."""
        if row.batch_no is not None:
            return recorded(row)
        if row.writer is None:
            return Unclaimed(row.shard, None)
        if row.facts_on_block and row.since_batch is not None and row.seq is not None:
            return await self._settle_block_intent(row)
        self.resolved_intents += 1
        # The intent was written after its writer's claim window opened, and we see it now.
        window_over = time.monotonic() + CLAIM_SECONDS
        batch = row.since_batch
        while True:
            if row.since_batch is not None and batch is not None:
                header = await self._log.read_header(row.shard, batch, serial=True)
                if header is not None:
                    if header.writer == row.writer:
                        return await self.complete(row.client_id, row.message_id, row.shard, batch, row.seq,
                                                   row.intent_ttl)
                    if header.writer in row.replaces and batch == row.since_batch:
                        # A replaced writer's late claim won our first batch: its message is the one.
                        return await self.complete(row.client_id, row.message_id, row.shard, batch, None,
                                                   row.intent_ttl)
                    batch += 1
                    continue
            if _window_over(row, window_over, self._clock.now()):
                if batch is None:
                    return Unclaimed(row.shard, None)
                replaced = row.replaces if batch == row.since_batch else frozenset()
                return Unclaimed(row.shard, batch, replaced | {row.writer})
            await asyncio.sleep(RESOLVE_POLL_SECONDS)
            # Another retry may have taken the id over (a new writer) or completed it; the
            # writer's row may have appeared.
            fresh = (await self.lookup([row.client_id])).get(row.client_id)
            if fresh is None:
                return Unclaimed(row.shard, None)  # expired: a window past any claim
            if fresh.batch_no is not None or fresh.writer != row.writer:
                return await self.settle(fresh)
            if row.since_batch is None and fresh.since_batch is not None:
                row, batch = fresh, fresh.since_batch

    async def _settle_block_intent(self, row: IdRecord) -> Published | Unclaimed:
        """A protocol 2 block row's intent: the batch its writer won, searched for once for
        every key of the writer (they share it), answered from the key's own seq. Nothing is
        recorded: a later retry searches again, one header read per writer. Another retry
        that took the key over meanwhile is found by the take-over's condition."""
        assert row.writer is not None and row.since_batch is not None and row.seq is not None
        self.resolved_intents += 1
        search_key = (row.shard, row.writer, row.since_batch)
        search = self._searches.get(search_key)
        if search is None:
            search = self._searches[search_key] = asyncio.get_running_loop().create_task(self._won_batch(row))
            search.add_done_callback(lambda _: self._searches.pop(search_key, None))
        outcome = await asyncio.shield(search)
        if isinstance(outcome, Unclaimed):
            return outcome
        return _as_duplicate(Published(row.message_id, row.shard, outcome, row.seq))

    async def _won_batch(self, row: IdRecord) -> int | Unclaimed:
        """The batch the intent's writer won from its first batch on, or Unclaimed once it can
        claim no more (the loop of `settle`, for facts no other row can change)."""
        assert row.since_batch is not None
        window_over = time.monotonic() + CLAIM_SECONDS
        batch = row.since_batch
        while True:
            header = await self._log.read_header(row.shard, batch, serial=True)
            if header is not None:
                if header.writer == row.writer:
                    return batch
                batch += 1
                continue
            if _window_over(row, window_over, self._clock.now()):
                return Unclaimed(row.shard, batch, frozenset({row.writer}) if row.writer else frozenset())
            await asyncio.sleep(RESOLVE_POLL_SECONDS)

    async def _seq_of(self, shard: int, batch: int, message_id: str) -> int:
        (found, *_) = await self._log.read_from(shard, batch)
        return next(m.position.seq for m in found.messages if m.message_id == message_id)

class RecentIds:
    """The first results of recent ids, oldest forgotten first once over `ids` or `max_bytes`,
    and none trusted once the window has passed since its publish began: its rows expire
    then too (they are written after it began), and a retry after the window is a new message."""

    def __init__(self, ids: int = REMEMBERED_IDS, max_bytes: int = REMEMBERED_BYTES,
                 window_seconds: float = DEFAULT_WINDOW_SECONDS) -> None:
        self._results: OrderedDict[str, tuple[Published, float]] = OrderedDict()
        self._ids = ids
        self._max_bytes = max_bytes
        self._window = window_seconds
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._results)

    def get(self, client_id: str) -> Published | None:
        known = self._results.get(client_id)
        if known is None or time.monotonic() - known[1] >= self._window:
            return None  # an id with a longer window of its own is still found in Cassandra
        return known[0]

    def remember(self, client_id: str, result: Published, started: float | None = None) -> None:
        previous = self._results.pop(client_id, None)
        if previous is not None:
            self.bytes -= _cost(client_id, previous[0])
        self._results[client_id] = (result, time.monotonic() if started is None else started)
        self.bytes += _cost(client_id, result)
        while len(self._results) > self._ids or self.bytes > self._max_bytes:
            oldest, (forgotten, _) = self._results.popitem(last=False)
            self.bytes -= _cost(oldest, forgotten)


def _cost(client_id: str, result: Published) -> int:
    return len(client_id) + len(result.message_id) + REMEMBERED_OVERHEAD_BYTES


def recorded(row: IdRecord) -> Published:
    """The first publish of an id, from its completed record."""
    assert row.batch_no is not None and row.seq is not None
    return _as_duplicate(Published(row.message_id, row.shard, row.batch_no, row.seq))


def _by_bucket(client_ids: Iterable[str]) -> dict[int, list[str]]:
    grouped: dict[int, list[str]] = {}
    for client_id in client_ids:
        grouped.setdefault(client_id_bucket(client_id), []).append(client_id)
    return grouped


def _by_bucket_rows(rows: Iterable[tuple[Any, ...]]) -> dict[int, list[tuple[Any, ...]]]:
    grouped: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        grouped.setdefault(row[1], []).append(row)
    return grouped


class LegacyIds:
    """Reads of the table of one partition per id that installations made before
    CLIENT_IDS_TABLE still have: what an earlier version recorded there is honoured until an
    operator drops the table (once every sidecar runs this version and the longest window,
    the longest queue retention, has passed)."""

    def __init__(self, store: Store, keyspace: str, queue_key: str, consistency: int) -> None:
        self._store = store
        self._queue = queue_key
        self._select = store.session.prepare(
            f"SELECT {_LEGACY_COLUMNS} FROM {keyspace}.{LEGACY_PUBLISH_IDS_TABLE} "
            "WHERE queue = ? AND client_id IN ?"
        )
        self._select.consistency_level = consistency

    async def lookup(self, client_ids: Sequence[str]) -> dict[str, IdRecord]:
        chunks = [list(client_ids[i:i + LEGACY_LOOKUP_CHUNK]) for i in range(0, len(client_ids), LEGACY_LOOKUP_CHUNK)]
        pages = await asyncio.gather(
            *(cql.fetch_all(self._store.session, self._select, (self._queue, chunk)) for chunk in chunks))
        return {row.client_id: _legacy_record(row) for rows in pages for row in rows}


def _window_over(row: IdRecord, window_over: float, now: datetime) -> bool:
    """Whether the intent's writer can send no more claims: our own window has run, or the
    intent's deadline has passed on Cassandra's clock as both read it (`now`; allowing for
    the error of those readings and the coordinators' skew)."""
    if time.monotonic() > window_over:
        return True
    if row.claim_deadline is None:
        return False
    give_up = row.claim_deadline.replace(tzinfo=timezone.utc) + timedelta(seconds=CLOCK_SKEW_SECONDS)
    return now > give_up


def claim_deadline(now: datetime) -> tuple[datetime, float]:
    """A new intent's deadline (on Cassandra's clock, `now`, for other machines) and the
    monotonic time after which its writer sends no more claims."""
    return (now + timedelta(seconds=DEADLINE_SECONDS),
            time.monotonic() + CLAIM_SECONDS)


async def _duplicate_of(running: asyncio.Future[Published]) -> Published:
    # Shielded: a waiter given up (cancelled) must not cancel the publish it waits for.
    return _as_duplicate(await asyncio.shield(running))


def _as_duplicate(result: Published) -> Published:
    return Published(result.message_id, result.shard, result.batch, result.seq, duplicate=True,
                     deliver_at=result.deliver_at)
