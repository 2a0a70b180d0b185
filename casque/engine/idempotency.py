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
machines' clocks) has passed; then the writer never will, and the retry publishes anew.

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

from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.engine.batches import Log
from casque.engine.messages import Published
from casque.schema import PUBLISH_IDS_TABLE, QueueRef
from casque.store import Store

DEFAULT_WINDOW_SECONDS = 600
REMEMBERED_IDS = 100_000
# An intent's claim deadline lies this far ahead; its writer sends claims only during the
# first CLAIM_SECONDS of it, so a claim in flight lands well before the deadline.
DEADLINE_SECONDS = 30.0
CLAIM_SECONDS = 15.0
# How far apart two sidecars' clocks may be for a retry to trust an intent's deadline.
CLOCK_SKEW_SECONDS = 5.0
# A retry looks for an intent's batch again this often while the deadline has not passed.
RESOLVE_POLL_SECONDS = 0.25


class IdempotencyGuard:
    def __init__(self, store: Store, queue: QueueRef, log: Log, window_seconds: int = DEFAULT_WINDOW_SECONDS) -> None:
        self._store = store
        self._queue = queue.key
        self._log = log
        table = f"{store.keyspace}.{PUBLISH_IDS_TABLE}"
        self._select = store.session.prepare(
            f"SELECT message_id, shard, batch_no, seq, writer, since_batch, claim_deadline FROM {table} "
            "WHERE queue = ? AND client_id = ?"
        )
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, client_id, message_id, shard, batch_no, seq) "
            f"VALUES (?, ?, ?, ?, ?, ?) USING TTL {int(window_seconds)}"
        )
        self._insert_intent = store.session.prepare(
            f"INSERT INTO {table} (queue, client_id, message_id, shard, writer, since_batch, claim_deadline) "
            f"VALUES (?, ?, ?, ?, ?, ?, ?) USING TTL {int(window_seconds)}"
        )
        self._consistency = log.consistency
        for statement in (self._select, self._insert, self._insert_intent):
            statement.consistency_level = self._consistency
        self._recent: OrderedDict[str, Published] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Published]] = {}
        self.resolved_intents = 0

    async def publish_once(self, client_id: str, publish: Callable[[], Awaitable[Published]]) -> Published:
        known = self._recent.get(client_id)
        if known is not None:
            return _as_duplicate(known)
        running = self._inflight.get(client_id)
        if running is not None:
            return _as_duplicate(await asyncio.shield(running))
        future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
        self._inflight[client_id] = future
        try:
            row = (await cql.execute(self._store.session, self._select, (self._queue, client_id))).one()
            earlier = await self._earlier(row) if row is not None else None
            if earlier is not None:
                result = _as_duplicate(earlier)
            else:
                result = await publish()
            await cql.execute(
                self._store.session,
                self._insert,
                (self._queue, client_id, result.message_id, result.shard, result.batch, result.seq),
            )
            self._remember(client_id, result)
            future.set_result(result)
            return result
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here: waiters re-raise it themselves
            raise
        finally:
            del self._inflight[client_id]

    async def record_intents(
        self, intents: Sequence[tuple[str, str]], shard: int, writer: str, since_batch: int, deadline: datetime
    ) -> None:
        """Before a claim: (client id, message id) of each message of the batch that has an id."""
        statement = BatchStatement(batch_type=BatchType.UNLOGGED, consistency_level=self._consistency)
        for client_id, message_id in intents:
            statement.add(self._insert_intent, (self._queue, client_id, message_id, shard, writer, since_batch, deadline))
        await cql.execute(self._store.session, statement)

    async def _earlier(self, row: Any) -> Published | None:
        """The publish a row records: its position, or the intent's, settled."""
        if row.batch_no is not None:
            return Published(row.message_id, row.shard, row.batch_no, row.seq)
        if row.writer is None or row.since_batch is None or row.claim_deadline is None:
            return None
        self.resolved_intents += 1
        give_up = row.claim_deadline.replace(tzinfo=timezone.utc) + timedelta(seconds=CLOCK_SKEW_SECONDS)
        batch = int(row.since_batch)
        while True:
            header = await self._log.read_header(row.shard, batch, serial=True)
            if header is not None:
                if header.writer == row.writer:
                    return Published(row.message_id, row.shard, batch, await self._seq_of(row.shard, batch, row.message_id))
                batch += 1
                continue
            # Nobody holds `batch` yet: the intent's writer may still claim it, until its deadline.
            if datetime.now(timezone.utc) > give_up:
                return None
            await asyncio.sleep(RESOLVE_POLL_SECONDS)

    async def _seq_of(self, shard: int, batch: int, message_id: str) -> int:
        (found, *_) = await self._log.read_from(shard, batch)
        return next(m.position.seq for m in found.messages if m.message_id == message_id)

    def _remember(self, client_id: str, result: Published) -> None:
        self._recent[client_id] = result
        while len(self._recent) > REMEMBERED_IDS:
            self._recent.popitem(last=False)


def claim_deadline() -> tuple[datetime, float]:
    """A new intent's deadline (wall clock, for other machines) and the monotonic time after
    which its writer sends no more claims."""
    return (datetime.now(timezone.utc) + timedelta(seconds=DEADLINE_SECONDS),
            time.monotonic() + CLAIM_SECONDS)


def _as_duplicate(result: Published) -> Published:
    return Published(result.message_id, result.shard, result.batch, result.seq, duplicate=True,
                     deliver_at=result.deliver_at)
