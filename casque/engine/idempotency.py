"""Idempotent publish: a client message id seen within the window returns the first result.

Within one sidecar (the app's retries reach its own localhost sidecar) concurrent publishes
of one id wait for the first, and recent ids are remembered in memory. Across sidecars and
restarts, ids are found in the `publish_ids` table, whose rows expire after the window.

A crash must not let a retry publish an id twice, so the link from id to batch is recorded
before the batch exists, not after: the shard writer records an intent (the id, its message
id, the shard, the writer id its claims carry, the first batch it will try, and a claim
deadline) and only then claims. It never sends a claim after CLAIM_SECONDS of the deadline's
window have passed. After the batch is written, the row is completed with the position.

A retry that finds only an intent settles it: it reads the shard's headers at SERIAL from
the intent's first batch on, looking for the intent's writer. Found: the publish happened,
and its position is the answer. A batch nobody has claimed yet: the writer may still claim
it, so the retry looks again until the deadline (plus CLOCK_SKEW_SECONDS for the two
machines' clocks) has passed; then the writer never will, and the retry publishes anew,
after taking the id over with one conditional write (`take_over`, the intent's writer as
the condition): a client that gave up waiting and retried through another sidecar leaves
two retries settling one intent, and only one of them may publish. The other finds the
new intent (a settle re-reads the row while it waits) and settles that one.

What this does not cover: two first attempts of one id at two sidecars at the same instant,
neither seeing the other's intent (a client retries after a timeout, by which time the first
attempt has recorded its intent).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from cassandra.query import BatchStatement, BatchType, PreparedStatement

from casque.backends import cql
from casque.engine.batches import Log
from casque.engine.messages import OutgoingMessage, Published
from casque.schema import PUBLISH_IDS_TABLE
from casque.store import Store

DEFAULT_WINDOW_SECONDS = 600
# Recent ids kept in memory per queue, bounded by count and by an estimate of their bytes:
# ids may be 256 characters, and the sidecar's container has 256 MiB. A forgotten id is
# still found in `publish_ids`, at the cost of a read.
REMEMBERED_IDS = 50_000
REMEMBERED_BYTES = 8 * 1024 * 1024
# What one remembered id costs beyond its strings: the dict slot, the Published, the ints.
REMEMBERED_OVERHEAD_BYTES = 240
# An intent's claim deadline lies this far ahead; its writer sends claims only during the
# first CLAIM_SECONDS of it, so a claim in flight lands well before the deadline.
DEADLINE_SECONDS = 30.0
CLAIM_SECONDS = 15.0
# How far apart two sidecars' clocks may be for a retry to trust an intent's deadline.
CLOCK_SKEW_SECONDS = 5.0
# Ids read per request, and rows written per unlogged batch (a row is ~100 bytes).
LOOKUP_CHUNK = 100
WRITE_CHUNK = 40
# A retry looks for an intent's batch again this often while the deadline has not passed.
RESOLVE_POLL_SECONDS = 0.25


class IdempotencyGuard:
    """Ids of one queue: exact within this process, and in `publish_ids` for everyone.

    The shard writer checks the ids of a whole batch with one read per LOOKUP_CHUNK ids
    (`lookup`), records their intents and later their positions with one unlogged batch per
    WRITE_CHUNK (`record_intents`, `record_positions`): about 60 requests for 1,000 ids
    instead of 2,000.
    """

    def __init__(self, store: Store, queue_key: str, log: Log, window_seconds: int | None = None) -> None:
        """`queue_key`: the queue's incarnation key (`QueueState.shared_key`)."""
        self._store = store
        self._queue = queue_key
        self._window = int(window_seconds or DEFAULT_WINDOW_SECONDS)
        self._log = log
        table = f"{store.keyspace}.{PUBLISH_IDS_TABLE}"
        self._select = store.session.prepare(
            "SELECT client_id, message_id, shard, batch_no, seq, writer, since_batch, claim_deadline, "
            f"TTL(writer) AS intent_ttl FROM {table} "
            "WHERE queue = ? AND client_id IN ?"
        )
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, client_id, message_id, shard, batch_no, seq) "
            "VALUES (?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._insert_intent = store.session.prepare(
            f"INSERT INTO {table} (queue, client_id, message_id, shard, writer, since_batch, claim_deadline) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        # A retry that found an intent never claimed takes the id over only if nobody else
        # did meanwhile: two retries at two sidecars would otherwise both publish it.
        self._take_over = store.session.prepare(
            f"UPDATE {table} USING TTL ? SET message_id = ?, shard = ?, writer = ?, since_batch = ?, "
            "claim_deadline = ? WHERE queue = ? AND client_id = ? IF writer = ? AND batch_no = null"
        )
        self._take_over.serial_consistency_level = log.serial_consistency
        self._consistency = log.consistency
        for statement in (self._select, self._insert, self._insert_intent, self._take_over):
            statement.consistency_level = self._consistency
        self._recent = RecentIds()
        self._inflight: dict[str, asyncio.Future[Published]] = {}
        self.resolved_intents = 0
        self.statements = 0

    async def publish_once(self, client_id: str, publish: Callable[[], Awaitable[Published]]) -> Published:
        """Within this process: one publish per id at a time, and recent ids answered from memory.
        `publish` does the durable check (the shard writer's `lookup`)."""
        known = self._recent.get(client_id)
        if known is not None:
            return _as_duplicate(known)
        running = self._inflight.get(client_id)
        if running is not None:
            return _as_duplicate(await asyncio.shield(running))
        future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
        self._inflight[client_id] = future
        try:
            result = await publish()
            self._remember(client_id, result)
            future.set_result(result)
            return result
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here: waiters re-raise it themselves
            raise
        finally:
            del self._inflight[client_id]

    async def lookup(self, client_ids: Sequence[str]) -> dict[str, Any]:
        """The `publish_ids` rows of these ids, by client id (a read per LOOKUP_CHUNK ids, at once)."""
        chunks = [list(client_ids[i:i + LOOKUP_CHUNK]) for i in range(0, len(client_ids), LOOKUP_CHUNK)]
        self.statements += len(chunks)
        pages = await asyncio.gather(
            *(cql.fetch_all(self._store.session, self._select, (self._queue, chunk)) for chunk in chunks))
        return {row.client_id: row for rows in pages for row in rows}

    async def earlier(self, client_id: str) -> Published | None:
        """The publish of an id made before (settling an intent), or None."""
        row = (await self.lookup([client_id])).get(client_id)
        return None if row is None else await self.settle(row)

    async def record_intents(
        self, intents: Sequence[tuple[OutgoingMessage, str]], shard: int, writer: str, since_batch: int,
        deadline: datetime,
    ) -> None:
        """Before a claim: (message, message id) of each message of the batch that has a client id."""
        await self._write_rows(self._insert_intent, [
            (self._queue, message.client_id, message_id, shard, writer, since_batch, deadline, self._ttl(message))
            for message, message_id in intents
        ])

    async def record_positions(self, published: Sequence[tuple[OutgoingMessage, Published]]) -> None:
        """After a write: where each id's message is (one write for the lot)."""
        await self._write_rows(self._insert, [
            (self._queue, message.client_id, result.message_id, result.shard, result.batch, result.seq,
             self._ttl(message))
            for message, result in published
        ])

    async def take_over(
        self, row: Any, message: OutgoingMessage, message_id: str, shard: int, writer: str, since_batch: int,
        deadline: datetime,
    ) -> bool:
        """Replace an intent whose writer never claimed (`settle` said so) with ours, unless
        another retry replaced it first (or it was completed): one conditional write, on
        this rare path only."""
        self.statements += 1
        result = await cql.execute(self._store.session, self._take_over, (
            self._ttl(message), message_id, shard, writer, since_batch, deadline, self._queue, message.client_id,
            row.writer))
        return bool(result.was_applied)

    def _ttl(self, message: OutgoingMessage) -> int:
        return max(self._window, message.client_id_window_seconds or 0)

    async def _write_rows(self, statement: PreparedStatement, rows: Sequence[tuple[Any, ...]]) -> None:
        """Rows of many partitions in unlogged batches of WRITE_CHUNK, sent at once: one
        request per chunk instead of one per row, each small enough for Cassandra's batch
        size warning (5 KiB by default)."""
        batches = []
        for start in range(0, len(rows), WRITE_CHUNK):
            batch = BatchStatement(batch_type=BatchType.UNLOGGED, consistency_level=self._consistency)
            for row in rows[start:start + WRITE_CHUNK]:
                batch.add(statement, row)
            batches.append(batch)
        self.statements += len(batches)
        await asyncio.gather(*(cql.execute(self._store.session, b) for b in batches))

    async def settle(self, row: Any) -> Published | None:
        """The publish a row records: its position, or its intent's, settled (see the module)."""
        if row.batch_no is not None:
            return recorded(row)
        if row.writer is None or row.since_batch is None or row.claim_deadline is None:
            return None
        self.resolved_intents += 1
        give_up = row.claim_deadline.replace(tzinfo=timezone.utc) + timedelta(seconds=CLOCK_SKEW_SECONDS)
        batch = int(row.since_batch)
        while True:
            header = await self._log.read_header(row.shard, batch, serial=True)
            if header is not None:
                if header.writer == row.writer:
                    seq = await self._seq_of(row.shard, batch, row.message_id)
                    found = Published(row.message_id, row.shard, batch, seq)
                    # The completed row lives as long as the intent was to.
                    ttl = max(1, int(row.intent_ttl or self._window))
                    await self._write_rows(self._insert, [
                        (self._queue, row.client_id, found.message_id, found.shard, found.batch, found.seq, ttl)])
                    return _as_duplicate(found)
                batch += 1
                continue
            # Nobody holds `batch` yet: the intent's writer may still claim it, until its deadline.
            if datetime.now(timezone.utc) > give_up:
                return None
            await asyncio.sleep(RESOLVE_POLL_SECONDS)
            # Another retry may have taken the id over (a new writer) or completed it.
            fresh = (await self.lookup([row.client_id])).get(row.client_id)
            if fresh is not None and (fresh.batch_no is not None or fresh.writer != row.writer):
                return await self.settle(fresh)

    async def _seq_of(self, shard: int, batch: int, message_id: str) -> int:
        (found, *_) = await self._log.read_from(shard, batch)
        return next(m.position.seq for m in found.messages if m.message_id == message_id)

    def _remember(self, client_id: str, result: Published) -> None:
        self._recent.remember(client_id, result)


class RecentIds:
    """The first results of recent ids, oldest forgotten first once over `ids` or `max_bytes`."""

    def __init__(self, ids: int = REMEMBERED_IDS, max_bytes: int = REMEMBERED_BYTES) -> None:
        self._results: OrderedDict[str, Published] = OrderedDict()
        self._ids = ids
        self._max_bytes = max_bytes
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._results)

    def get(self, client_id: str) -> Published | None:
        return self._results.get(client_id)

    def remember(self, client_id: str, result: Published) -> None:
        previous = self._results.pop(client_id, None)
        if previous is not None:
            self.bytes -= _cost(client_id, previous)
        self._results[client_id] = result
        self.bytes += _cost(client_id, result)
        while len(self._results) > self._ids or self.bytes > self._max_bytes:
            oldest, forgotten = self._results.popitem(last=False)
            self.bytes -= _cost(oldest, forgotten)


def _cost(client_id: str, result: Published) -> int:
    return len(client_id) + len(result.message_id) + REMEMBERED_OVERHEAD_BYTES


def recorded(row: Any) -> Published:
    """The first publish of an id, from its completed `publish_ids` row."""
    return _as_duplicate(Published(row.message_id, row.shard, row.batch_no, row.seq))


def claim_deadline() -> tuple[datetime, float]:
    """A new intent's deadline (wall clock, for other machines) and the monotonic time after
    which its writer sends no more claims."""
    return (datetime.now(timezone.utc) + timedelta(seconds=DEADLINE_SECONDS),
            time.monotonic() + CLAIM_SECONDS)


def _as_duplicate(result: Published) -> Published:
    return Published(result.message_id, result.shard, result.batch, result.seq, duplicate=True,
                     deliver_at=result.deliver_at)
