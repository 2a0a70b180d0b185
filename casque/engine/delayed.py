"""Delayed messages: stored by due time, published into the log when due by one mover.

A message published with a delay (or to a queue with a default delay) is written to the
`delayed` table, partitioned by due minute, and its publish is acknowledged then. The
queue's mover, elected in ZooKeeper, publishes due rows into the log with the message ids
they were given at publish time, each with a client id derived from its id and remembered
for the queue's retention (as long as the row can be read again), so a row moved twice (a
mover that died between publishing and recording its progress, and a successor that rescans
it however much later) is stored once.

Each due row is read once. The mover remembers, per due bucket, the highest (due time,
message id) it has read, and a pass reads only the rows after it that are due. Rows land
behind that mark only when written late (a publisher's clock behind the mover's, a slow
write), and those are the writer's to move. The cursor in the mover's znode says how far
the mover has gone:

- `until`: written *before* a pass reads, so a pass reading rows due up to it may have run.
  A publisher reads it (fresh) after its row is written, before it answers: if `until` has
  reached the row's due time, the pass that should have moved it may have read before the
  row landed, so the publisher moves the row itself, with the same client id the mover
  uses (the id makes the two moves one), once that pass is done (`moved` has reached the
  row): the pass may be moving the row, and two first attempts of one id at once could
  both publish. Otherwise every pass that covers the row starts reading after it landed,
  and reads it.
- `moved`: every row due up to it that a pass could read has been moved. A new leader
  (after a failover, or this one re-elected) starts from it, its marks being gone: only
  the rows of the pass the last leader had under way are read twice.

So in steady state a row is read once by the mover (`rows_read` / `offered`), and a row
moved twice (a mover and its writer, a failover) is stored once. Lateness is bounded by the
mover's pass interval (plus a write's duration for a row its writer moves), whatever the
publishers' clocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from cassandra.query import UNSET_VALUE
from kazoo.client import KazooState
from kazoo.exceptions import LockTimeout, NoNodeError

from casque.backends import cql, zk
from casque.engine import grants
from casque.engine.clock import clock_of
from casque.engine.counters import DELAYED_IN, DELAYED_OUT, QueueCounters
from casque.engine.messages import OutgoingMessage, id_time, time_ordered_ids
from casque.errors import CasqueError, QueueNotFound, QuotaExceeded
from casque.formats import unmarked
from casque.schema import DELAY_BUCKET_SECONDS, DELAYED_TABLE, QueueRef
from casque.specs import QueueState
from casque.backends.loop_handoff import call_soon_unless_closed
from casque.store import Store

log = logging.getLogger(__name__)

# Client ids of moves start so (one of the engine's reserved prefixes, casque.engine.messages).
MOVED_PREFIX = "delayed/"
# A follower waits this long for the election at a time, so that stop() is never stuck behind it.
ELECTION_WAIT_SECONDS = 5.0
# Messages due within this many seconds of now are published straight into the log.
IMMEDIATE_SECONDS = 1.0
# The mover wakes at least this often (sooner when a message is due sooner).
PASS_SECONDS = 1.0
# What a cursor written by an earlier version (`until` alone, with rescans of this much
# behind it) guarantees was moved.
LEGACY_LOOKBACK = timedelta(minutes=2)
# Rows one pass reads at most (a backlog after an outage is moved in passes of this many).
PASS_ROWS = 1000
# A writer's fresh read of the cursor gives up after this long (and is retried apart).
CURSOR_READ_SECONDS = 5.0
# A mover whose queue was deleted looks for it again this often.
ABSENT_QUEUE_RECHECK_SECONDS = 5.0
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def due_bucket(moment: datetime) -> int:
    return math.floor(moment.timestamp() / DELAY_BUCKET_SECONDS)


@dataclass(frozen=True)
class Cursor:
    """How far the mover has gone (see the module): a pass reading rows due up to `until`
    may have run; every row due up to `moved` has been moved."""

    until: datetime
    moved: datetime

    def encode(self) -> bytes:
        return json.dumps({"until": self.until.isoformat(), "moved": self.moved.isoformat()}).encode()


@dataclass(frozen=True)
class DueMessage:
    message_id: str
    due_at: datetime
    message: OutgoingMessage


class DelayedStore:
    def __init__(self, store: Store, queue_key: str, retention_seconds: int) -> None:
        self._clock = clock_of(store.session)
        """`queue_key`: the queue's incarnation key (`QueueState.shared_key`)."""
        self._store = store
        self._queue = queue_key
        self._retention = retention_seconds
        table = f"{store.namespace_view_keyspace('delayed messages')}.{DELAYED_TABLE}"
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, due_bucket, due_at, message_id, published_at, key, attributes, payload, "
            "content_type, priority, ttl_seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        # The rows of a bucket after a (due time, message id) mark, due by a time, in key order.
        self._select = store.session.prepare(
            f"SELECT * FROM {table} WHERE queue = ? AND due_bucket = ? AND (due_at, message_id) > (?, ?) "
            "AND (due_at) <= (?) LIMIT ?"
        )
        self._next = store.session.prepare(
            f"SELECT due_at FROM {table} WHERE queue = ? AND due_bucket = ? AND due_at > ? LIMIT 1"
        )
        self.counters = QueueCounters(store, queue_key)
        self.rows_read = 0

    async def insert(self, message_id: str, due_at: datetime, message: OutgoingMessage, count: bool = True) -> None:
        """Store a row (a row stored again, same message id and due time, is the same row);
        `count`: a new message (not a row stored again for one, see DelayedRoute._keep)."""
        now = self._clock.now()
        ttl = int((due_at - now).total_seconds()) + self._retention
        values: list[Any] = [
            self._queue, due_bucket(due_at), due_at, message_id, now, message.key,
            dict(message.attributes) or None, message.payload, message.content_type, message.priority,
            message.ttl_seconds, max(ttl, 1),
        ]
        await cql.execute(self._store.session, self._insert, [UNSET_VALUE if v is None else v for v in values])
        if count:
            await self.counters.add(DELAYED_IN, 1)

    async def due_after(self, bucket: int, mark: tuple[datetime, str], until: datetime, limit: int) -> list[DueMessage]:
        """Up to `limit` rows of `bucket` after `mark` (due time, message id) and due by
        `until`, in key order."""
        rows = await cql.fetch_all(self._store.session, self._select, (self._queue, bucket, *mark, until, limit))
        self.rows_read += len(rows)
        return [
            DueMessage(
                unmarked(row.message_id, "a delayed message"),  # carries the row's format (casque.formats)
                row.due_at.replace(tzinfo=timezone.utc),
                moved_message(row.message_id, OutgoingMessage(
                    payload=row.payload or b"", key=row.key, attributes=dict(row.attributes or {}),
                    content_type=row.content_type, priority=row.priority or 0, ttl_seconds=row.ttl_seconds,
                ), self._retention),
            )
            for row in rows
        ]

    async def next_due(self, after: datetime) -> datetime | None:
        row = (await cql.execute(self._store.session, self._next, (self._queue, due_bucket(after), after))).one()
        return None if row is None else row.due_at.replace(tzinfo=timezone.utc)



def due_and_id(due: datetime) -> tuple[datetime, str]:
    """The due time a delayed message is stored at (`due` rounded up to the millisecond,
    Cassandra's precision, so never earlier) and a new message id that carries exactly that
    time (message ids carry when the message is due in the log, to the millisecond)."""
    millis = -(-((due - _EPOCH) // timedelta(microseconds=1)) // 1000)
    # Half a millisecond in: the id's own float conversion cannot round it to the one before.
    (message_id,) = time_ordered_ids(1, (millis + 0.5) / 1000)
    return _EPOCH + timedelta(milliseconds=millis), message_id


def stored_due(message_id: str, fallback: datetime) -> datetime:
    """The due time of the row a delayed message's first attempt stored, from its message id
    (see `due_and_id`): a retry that knows only the id stores that same row again. An id
    that carries no time (made by a version before ids did) gives `fallback`, the retry's
    own due time: a second row, moved under the same client id, so still stored once in the log."""
    carried = id_time(message_id)
    return fallback if carried is None else carried


def moved_client_id(message_id: str) -> str:
    """The client id of a delayed message's move into the log: a move done twice is stored once."""
    return f"{MOVED_PREFIX}{message_id}"


def moved_message(message_id: str, message: OutgoingMessage, retention_seconds: int) -> OutgoingMessage:
    """A delayed message as its move publishes it: due now, under its move's client id."""
    return OutgoingMessage(
        payload=message.payload, key=message.key, attributes=message.attributes, content_type=message.content_type,
        priority=message.priority, ttl_seconds=message.ttl_seconds, client_id=moved_client_id(message_id),
        # A due row can be read again until it expires, after its retention.
        client_id_window_seconds=retention_seconds,
    )


def read_cursor(data: bytes | None) -> Cursor | None:
    if not data:
        return None
    fields = json.loads(data)
    until = datetime.fromisoformat(fields["until"])
    if "moved" not in fields:
        # Written by an earlier version, whose mover rescanned LEGACY_LOOKBACK behind it.
        return Cursor(until, until - LEGACY_LOOKBACK)
    return Cursor(until, datetime.fromisoformat(fields["moved"]))


class CursorReads:
    """Fresh reads of the mover's cursor, for writers of delayed rows: each caller gets a
    read that started after it asked (a ZooKeeper sync first, since a server may lag the
    leader), and callers that ask while a read runs share the next one."""

    def __init__(self, store: Store, path: str) -> None:
        self._zk = store.zk
        self._path = path
        self._next: asyncio.Future[Cursor | None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> Cursor | None:
        """The cursor as of now; None if the queue has none (it was deleted)."""
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
            if self._task is None or self._task.done():
                self._task = loop.create_task(self._run())
        return await asyncio.shield(self._next)

    async def _run(self) -> None:
        while self._next is not None:
            waiting, self._next = self._next, None
            try:
                cursor = await asyncio.wait_for(self._read(), CURSOR_READ_SECONDS)
            except BaseException as error:
                waiting.set_exception(error)
                waiting.exception()  # retrieved here: the callers re-raise it themselves
                if isinstance(error, asyncio.CancelledError):
                    raise
            else:
                waiting.set_result(cursor)

    async def _read(self) -> Cursor | None:
        try:
            await zk.call(self._zk.sync_async, self._path)
            data, _ = await zk.call(self._zk.get_async, self._path)
        except NoNodeError:
            return None
        return read_cursor(data)


class DelayMover:
    """Contends for the queue's mover election and, while elected, moves due messages.

    Connection states: on SUSPENDED or LOST the mover stops at once (another contender may
    be elected); it contends again when connected. Stopping mid-pass is safe: moved rows
    are idempotent, and `moved` in the cursor only passes a pass's rows in the next pass. The
    pass's publish is finished and counted all the same (the rows it moved are published
    whether it waits or not, and their next mover finds them published and counts nothing).
    """

    def __init__(self, store: Store, queue: QueueRef, publish: Any, identifier: str) -> None:
        self._store = store
        # Due times are judged on Cassandra's clock, which publishers wrote them with.
        self._clock = clock_of(store.session)
        self._queue = queue
        # async (QueueState, list[(message_id, OutgoingMessage)]) -> list[Published]: publishes
        # into the incarnation given, or raises QueueNotFound.
        self._publish = publish
        # The rows of the queue's incarnation seen when leading began (`_lead`).
        self.delayed: DelayedStore | None = None
        self._path = store.paths(queue).mover
        self._identifier = identifier
        self._task: asyncio.Task[None] | None = None
        # The last pass's move, which outlives the leadership it started under (`_lead`).
        self._moving: asyncio.Future[None] | None = None
        self._leading: asyncio.Event = asyncio.Event()
        self.moved = 0
        self.passes = 0
        # Rows handed to `publish` (a row is handed once while one mover leads).
        self.offered = 0
        # Rows the due reads returned: about `offered` in steady state (each row read once).
        self.rows_read = 0
        # Elections this mover waited out without winning (another sidecar leads).
        self.contentions = 0

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._contend())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._moving is not None:
            await asyncio.gather(self._moving, return_exceptions=True)

    async def _contend(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not await self._queue_exists():
                # Contending would re-create the election's znodes under a deleted queue.
                await asyncio.sleep(ABSENT_QUEUE_RECHECK_SECONDS)
                continue
            lock = self._store.zk.Lock(f"{self._path}/election", self._identifier)
            lost = asyncio.Event()

            def on_state(state: str) -> None:
                if state in (KazooState.SUSPENDED, KazooState.LOST):
                    call_soon_unless_closed(loop, lost.set)

            self._store.zk.add_listener(on_state)
            try:
                if not await asyncio.to_thread(self._acquire, lock):
                    self.contentions += 1
                    continue
                self._leading.set()
                lead = loop.create_task(self._lead())
                waiter = loop.create_task(lost.wait())
                try:
                    await asyncio.wait({lead, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in (lead, waiter):
                        task.cancel()
                    outcomes = await asyncio.gather(lead, waiter, return_exceptions=True)
                failure = outcomes[0]
                if isinstance(failure, Exception):
                    log.warning("mover of %s stopped leading: %s", self._queue, failure)
            except CasqueError as error:
                log.warning("mover of %s: %s", self._queue, error)
            except Exception:
                log.exception("mover of %s failed; contending again", self._queue)
            finally:
                self._leading.clear()
                self._store.zk.remove_listener(on_state)
                try:
                    await asyncio.to_thread(lock.release)
                except Exception:
                    pass  # the session is gone, and with it the lock
            await asyncio.sleep(0.5)

    @staticmethod
    def _acquire(lock: Any) -> bool:
        """Wait a while for the election; False if another contender still leads.

        kazoo 2.11 raises LockTimeout where older versions returned False: both mean "not
        elected yet", the normal state of every follower, not a failure to log.
        """
        try:
            return bool(lock.acquire(True, ELECTION_WAIT_SECONDS))
        except LockTimeout:
            return False

    async def _lead(self) -> None:
        if self._clock.error is None:
            await self._clock.sample()  # due times are never judged on this process's clock
        # Checked against the queue's grant once, when it starts to lead: the passes below
        # only compare incarnations, and a spec changed meanwhile takes effect at the next lead.
        try:
            state = await self._read_state(granted=True)
        except QuotaExceeded as refused:
            # Nothing is moved for a spec beyond its grant. Contend again after a pause, not
            # at once: the operator's next reconcile restores the spec.
            log.error("%s", refused)
            await asyncio.sleep(ABSENT_QUEUE_RECHECK_SECONDS)
            raise
        self.delayed = delayed = DelayedStore(
            self._store.for_namespace(self._queue.namespace), state.shared_key(self._queue), state.spec.retention_seconds
        )
        cursor = await self._read_cursor()
        until, moved = cursor.until, cursor.moved
        # Per due bucket, the highest (due time, message id) read while this mover leads;
        # below `lower`, buckets without a mark hold nothing more to read.
        marks: dict[int, tuple[datetime, str]] = {}
        lower = moved
        while True:
            # A queue deleted and created again took this election's znodes with it: the
            # new incarnation elects its own mover, which starts from its creation.
            if (await self._read_state()).incarnation != state.incarnation:
                raise QueueNotFound(f"queue {self._queue} was re-created; contending for its new incarnation")
            now = self._clock.now()
            # Before reading: a row that lands after the reads below, due by `now`, is moved
            # by its writer, which reads `until` after its write. `until` never goes back
            # (a previous leader's clock may have run ahead of ours and read further).
            until = max(now, until)
            await zk.call(self._store.zk.set_async, self._path, Cursor(until, moved).encode())
            due: list[DueMessage] = []
            for bucket in range(due_bucket(lower), due_bucket(now) + 1):
                rows = await delayed.due_after(bucket, marks.get(bucket, (lower, "")), now, PASS_ROWS - len(due))
                if rows:
                    marks[bucket] = (rows[-1].due_at, rows[-1].message_id)
                due.extend(rows)
                if len(due) >= PASS_ROWS:
                    break
            self.rows_read += len(due)
            if due:
                self.offered += len(due)
                # Shielded from a lost leadership: the publish goes on in its shard writers
                # anyway, and a successor that moves these rows again finds them published and
                # counts none of them, so this pass must count what it moved.
                self._moving = asyncio.ensure_future(self._move(state, delayed, due))
                await asyncio.shield(self._moving)
            self.passes += 1
            if len(due) >= PASS_ROWS:
                # A backlog: everything before the last row read is moved; go on at once.
                moved = lower = max(moved, due[-1].due_at - timedelta(milliseconds=1))
                marks = {b: m for b, m in marks.items() if b >= due_bucket(lower)}
                continue
            moved = lower = now
            marks = {b: m for b, m in marks.items() if b >= due_bucket(now)}
            upcoming = await delayed.next_due(now)
            pause = PASS_SECONDS
            if upcoming is not None:
                pause = min(pause, max(0.01, (upcoming - self._clock.now()).total_seconds()))
            await asyncio.sleep(pause)

    async def _move(self, state: QueueState, delayed: DelayedStore, due: list[DueMessage]) -> None:
        """Publish the due rows into the log and count those not published before."""
        results = await self._publish(state, [(d.message_id, d.message) for d in due])
        fresh = sum(1 for r in results if not r.duplicate)
        if fresh:
            self.moved += fresh
            await delayed.counters.add(DELAYED_OUT, fresh)

    async def _queue_exists(self) -> bool:
        try:
            await self._read_state()
        except QueueNotFound:
            return False
        except Exception:
            return True  # unknown: contending finds out, and reports it
        return True

    async def _read_state(self, granted: bool = False) -> QueueState:
        try:
            data, _ = await zk.call(self._store.zk.get_async, self._store.paths(self._queue).base)
        except NoNodeError:
            data = b""
        if not data:
            raise QueueNotFound(f"queue {self._queue} does not exist")
        state = QueueState.model_validate_json(data)
        return await asyncio.to_thread(grants.check, self._store, self._queue, state) if granted else state

    async def _read_cursor(self) -> Cursor:
        try:
            data, _ = await zk.call(self._store.zk.get_async, self._path)
        except NoNodeError:
            data = b""
        cursor = read_cursor(data)
        if cursor is None:
            # No cursor (a queue made before movers kept one): nothing was delayed before now.
            now = self._clock.now()
            cursor = Cursor(now, now)
        return cursor
