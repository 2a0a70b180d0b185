"""Delayed messages: stored by due time, published into the log when due by one mover.

A message published with a delay (or to a queue with a default delay) is written to the
`delayed` table, partitioned by due minute, and its publish is acknowledged then. The
queue's mover, elected in ZooKeeper, publishes due rows into the log with the message ids
they were given at publish time, each with a client id derived from its id, so a row moved
twice (a mover that died between publishing and recording its progress) is stored once.

The mover records in its znode the time up to which everything due has been moved (the
cursor), and rescans a lookback window behind it on every pass. A publisher whose clock is
far behind the mover's could write a row older than that window; publishers therefore
publish a message directly into the log when its due time is not well inside the window.
Lateness is bounded by the mover's pass interval plus the clock skew between the
publisher and the mover; nothing due is lost while the skew stays below the lookback.
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
from casque.engine.counters import DELAYED_IN, DELAYED_OUT, QueueCounters
from casque.engine.messages import OutgoingMessage
from casque.errors import CasqueError
from casque.schema import DELAY_BUCKET_SECONDS, DELAYED_TABLE, QueueRef
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
# Every pass re-reads this far behind its cursor, for rows written by lagging clocks.
LOOKBACK = timedelta(minutes=2)
# Publishers treat a due time less than this after the start of the mover's rescan window
# (cursor - LOOKBACK) as due now.
CURSOR_MARGIN = timedelta(seconds=30)


def due_bucket(moment: datetime) -> int:
    return math.floor(moment.timestamp() / DELAY_BUCKET_SECONDS)


@dataclass(frozen=True)
class DueMessage:
    message_id: str
    due_at: datetime
    message: OutgoingMessage


class DelayedStore:
    def __init__(self, store: Store, queue: QueueRef, retention_seconds: int) -> None:
        self._store = store
        self._queue = queue.key
        self._retention = retention_seconds
        table = f"{store.keyspace}.{DELAYED_TABLE}"
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, due_bucket, due_at, message_id, published_at, key, attributes, payload, "
            "content_type, priority, ttl_seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._select = store.session.prepare(
            f"SELECT * FROM {table} WHERE queue = ? AND due_bucket = ? AND due_at > ? AND due_at <= ?"
        )
        self._next = store.session.prepare(
            f"SELECT due_at FROM {table} WHERE queue = ? AND due_bucket = ? AND due_at > ? LIMIT 1"
        )
        self.counters = QueueCounters(store, queue)

    async def insert(self, message_id: str, due_at: datetime, message: OutgoingMessage) -> None:
        now = datetime.now(timezone.utc)
        ttl = int((due_at - now).total_seconds()) + self._retention
        values: list[Any] = [
            self._queue, due_bucket(due_at), due_at, message_id, now, message.key,
            dict(message.attributes) or None, message.payload, message.content_type, message.priority,
            message.ttl_seconds, max(ttl, 1),
        ]
        await cql.execute(self._store.session, self._insert, [UNSET_VALUE if v is None else v for v in values])
        await self.counters.add(DELAYED_IN, 1)

    async def due_between(self, after: datetime, until: datetime) -> list[DueMessage]:
        found: list[DueMessage] = []
        for bucket in range(due_bucket(after), due_bucket(until) + 1):
            rows = await cql.execute(self._store.session, self._select, (self._queue, bucket, after, until))
            for row in rows:
                found.append(
                    DueMessage(
                        row.message_id,
                        row.due_at.replace(tzinfo=timezone.utc),
                        OutgoingMessage(
                            payload=row.payload or b"", key=row.key, attributes=dict(row.attributes or {}),
                            content_type=row.content_type, priority=row.priority or 0,
                            ttl_seconds=row.ttl_seconds, client_id=moved_client_id(row.message_id),
                        ),
                    )
                )
        return found

    async def next_due(self, after: datetime) -> datetime | None:
        row = (await cql.execute(self._store.session, self._next, (self._queue, due_bucket(after), after))).one()
        return None if row is None else row.due_at.replace(tzinfo=timezone.utc)



def moved_client_id(message_id: str) -> str:
    """The client id of a delayed message's move into the log: a move done twice is stored once."""
    return f"{MOVED_PREFIX}{message_id}"


def read_cursor(data: bytes | None) -> datetime | None:
    if not data:
        return None
    return datetime.fromisoformat(json.loads(data)["until"])


class DelayMover:
    """Contends for the queue's mover election and, while elected, moves due messages.

    Connection states: on SUSPENDED or LOST the mover stops at once (another contender may
    be elected); it contends again when connected. Stopping mid-pass is safe: moved rows
    are idempotent and the cursor only moves after a pass.
    """

    def __init__(self, store: Store, queue: QueueRef, publish: Any, retention_seconds: int, identifier: str) -> None:
        self._store = store
        self._queue = queue
        self._publish = publish  # async (list[(message_id, OutgoingMessage)]) -> list[Published]
        self.delayed = DelayedStore(store, queue, retention_seconds)
        self._path = store.paths(queue).mover
        self._identifier = identifier
        self._task: asyncio.Task[None] | None = None
        self._leading: asyncio.Event = asyncio.Event()
        self.moved = 0
        self.passes = 0
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

    async def _contend(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            lock = self._store.zk.Lock(f"{self._path}/election", self._identifier)
            lost = asyncio.Event()

            def on_state(state: str) -> None:
                if state in (KazooState.SUSPENDED, KazooState.LOST):
                    loop.call_soon_threadsafe(lost.set)

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
        cursor = await self._read_cursor()
        while True:
            now = datetime.now(timezone.utc)
            due = await self.delayed.due_between(cursor - LOOKBACK, now)
            if due:
                results = await self._publish([(d.message_id, d.message) for d in due])
                fresh = sum(1 for r in results if not r.duplicate)
                if fresh:
                    self.moved += fresh
                    await self.delayed.counters.add(DELAYED_OUT, fresh)
            cursor = now
            await zk.call(self._store.zk.set_async, self._path, json.dumps({"until": now.isoformat()}).encode())
            self.passes += 1
            upcoming = await self.delayed.next_due(now)
            pause = PASS_SECONDS
            if upcoming is not None:
                pause = min(pause, max(0.01, (upcoming - datetime.now(timezone.utc)).total_seconds()))
            await asyncio.sleep(pause)

    async def _read_cursor(self) -> datetime:
        try:
            data, _ = await zk.call(self._store.zk.get_async, self._path)
        except NoNodeError:
            data = b""
        cursor = read_cursor(data)
        if cursor is None:
            # First mover of this queue: anything older than the lookback was published directly.
            cursor = datetime.now(timezone.utc)
        return cursor
