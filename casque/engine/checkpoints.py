"""What ZooKeeper coordinates, checkpointed in Cassandra: a ZooKeeper that loses its data, or
is restored from an older snapshot, is rebuilt from these (casque.engine.rebuild), not
restarted from zero.

Two shared tables (casque.schema):

- `catalog`, in the installation's keyspace: each queue's and each subscriber's state as the
  installation applied it (`QueueState`, `SubscriberState` as JSON: incarnation, creation
  time, schema version, spec). Written by every apply, removed by a deletion. Namespaces
  cannot write the installation's keyspace, so a rebuild never trusts what a tenant wrote.
- `checkpoints`, in the namespace's keyspace: for each queue incarnation, owner and shard,
  a position. The owner is the shard's head (`HEAD`: the last batch known written, with the
  running totals as of it) or a subscriber incarnation (`SubscriberState.ack_key`: the
  offset, with its seek epoch).

A checkpoint row is a max register. It is written `USING TIMESTAMP` of its own position
(`register_timestamp`: the epoch above the batch), so Cassandra's last-write-wins keeps the
highest (epoch, batch) ever written, in whatever order the writes land: no compare-and-set,
no read before the write, one row per shard for the queue's life (no TTL, no tombstones). A
seek moves a shard back only within a new epoch, which orders above every older one.

A checkpoint is a lower bound, never ahead of what it records: a head checkpoint names a
batch that was written; an offset checkpoint an offset ZooKeeper accepted (or a seek wrote).
They are grouped (`CheckpointWriter`): a sidecar writes each position that moved at most
every `CHECKPOINT_SECONDS`, and what it has on a clean stop. A rebuild therefore loses at
most that much of an offset's progress, and the ack rows (kept in Cassandra for the queue's
retention, keyed by the same incarnation and epoch) still say which messages past the
offset were done: what comes back after a wipe is what was in flight.

Every row carries the format it was written in (`FORMAT`); a reader meeting a newer one
refuses it (`NewerFormat`) rather than misread it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TypeVar

from cassandra import InvalidRequest
from cassandra.query import PreparedStatement
from pydantic import ValidationError

from casque.backends import cql
from casque.errors import NewerFormat
from casque.schema import CATALOG_TABLE, CHECKPOINTS_TABLE, QueueRef
from casque.specs import QueueState, SubscriberState
from casque.store import Store

log = logging.getLogger(__name__)

_State = TypeVar("_State", QueueState, SubscriberState)

# The format of the rows this version writes; readers refuse rows of a later one.
FORMAT = 1
# The owner of a shard's head checkpoint (no subscriber name is empty).
HEAD = ""
# The owner of the queue's own catalog row.
QUEUE_RECORD = ""
# A sidecar writes the positions that moved at most this often (and what it has on stop).
CHECKPOINT_SECONDS = 1.0
# Writes that fail are tried again after a wait doubling from CHECKPOINT_SECONDS up to this.
RETRY_MAX_SECONDS = 60.0
# Batches per epoch in a register timestamp: 2**40 batches (a trillion) per shard, and
# 2**22 seeks, within a positive 64-bit timestamp.
_EPOCH_SHIFT = 40


def register_timestamp(epoch: int, batch: int) -> int:
    """The write timestamp that orders a position: (epoch, batch), lexicographically."""
    if not 0 <= batch < 1 << _EPOCH_SHIFT or not 0 <= epoch < 1 << (62 - _EPOCH_SHIFT):
        raise ValueError(f"position {batch}@{epoch} is out of the checkpoint's range")
    return (epoch << _EPOCH_SHIFT) | batch


@dataclass(frozen=True)
class Position:
    """A checkpointed position: the batch, its seek epoch, and (heads) the totals as of it."""

    batch: int
    epoch: int = 0
    totals: tuple[int, int] | None = None

    @property
    def order(self) -> tuple[int, int]:
        return self.epoch, self.batch


def _refuse_newer(format_: int | None, what: str) -> None:
    if (format_ or 0) > FORMAT:
        raise NewerFormat(f"{what} was written in format {format_}; this version of casque reads up to {FORMAT}")


# --- the catalog ----------------------------------------------------------------------------
def _catalog(store: Store) -> str:
    return f"{store.keyspace}.{CATALOG_TABLE}"


def record_queue(store: Store, queue: QueueRef, state: QueueState) -> None:
    """The queue's state as the installation applied it (its incarnation above all)."""
    store.session.execute(
        f"INSERT INTO {_catalog(store)} (queue, subscriber, state, format) VALUES (%s, %s, %s, %s)",
        (queue.key, QUEUE_RECORD, state.model_dump_json(), FORMAT))


def record_subscriber(store: Store, queue: QueueRef, name: str, state: SubscriberState) -> None:
    store.session.execute(
        f"INSERT INTO {_catalog(store)} (queue, subscriber, state, format) VALUES (%s, %s, %s, %s)",
        (queue.key, name, state.model_dump_json(exclude_none=True), FORMAT))


def forget_queue(store: Store, queue: QueueRef) -> None:
    """The queue and every subscriber of it: a rebuild must not bring a deleted queue back."""
    store.session.execute(f"DELETE FROM {_catalog(store)} WHERE queue = %s", (queue.key,))


def forget_subscriber(store: Store, queue: QueueRef, name: str) -> None:
    store.session.execute(f"DELETE FROM {_catalog(store)} WHERE queue = %s AND subscriber = %s", (queue.key, name))


def recorded_queue(store: Store, queue: QueueRef) -> QueueState | None:
    row = store.session.execute(
        f"SELECT state, format FROM {_catalog(store)} WHERE queue = %s AND subscriber = %s",
        (queue.key, QUEUE_RECORD)).one()
    if row is None:
        return None
    _refuse_newer(row.format, f"the catalog record of queue {queue}")
    return _parse(QueueState, row.state, f"queue {queue}")


def recorded_subscribers(store: Store, queue: QueueRef) -> dict[str, SubscriberState]:
    """Every subscriber of the queue the catalog holds, by name."""
    rows = store.session.execute(
        f"SELECT subscriber, state, format FROM {_catalog(store)} WHERE queue = %s", (queue.key,))
    found: dict[str, SubscriberState] = {}
    for row in rows:
        if row.subscriber == QUEUE_RECORD:
            continue
        _refuse_newer(row.format, f"the catalog record of subscriber {row.subscriber} of queue {queue}")
        state = _parse(SubscriberState, row.state, f"subscriber {row.subscriber} of queue {queue}")
        if state is not None:
            found[row.subscriber] = state
    return found


def _parse(kind: type[_State], text: str, what: str) -> _State | None:
    try:
        return kind.model_validate_json(text)
    except ValidationError as error:
        # A record this version cannot read is skipped, loudly: the apply goes on as if there
        # were none (a new incarnation), which loses positions, never messages.
        log.error("the catalog record of %s cannot be read (%s); it is not used", what, error)
        return None


# --- checkpoints ----------------------------------------------------------------------------
class Checkpoints:
    """Reading and writing one queue incarnation's checkpoints (in its namespace's keyspace).

    >>> checkpoints = Checkpoints(store, queue, queue_state.shared_key(queue))
    >>> checkpoints.write_sync(HEAD, 0, Position(17, totals=(120, 4096)))
    >>> checkpoints.read(HEAD)
    {0: Position(batch=17, epoch=0, totals=(120, 4096))}
    """

    def __init__(self, store: Store, queue: QueueRef, queue_key: str) -> None:
        """`queue_key`: the queue's incarnation key (`QueueState.shared_key`)."""
        self._store = store
        self._queue_key = queue_key
        self._keyspace = store.keyspace_of(queue.namespace)
        self._table = f"{self._keyspace}.{CHECKPOINTS_TABLE}"
        self._insert: PreparedStatement | None = None

    def prepare(self) -> bool:
        """Prepare the write now (it blocks for a round trip: not on an event loop's hot path);
        False, preparing nothing, if the keyspace does not exist (its namespace was deleted):
        asked first, since a failed prepare is an error in the driver's log at every try."""
        if self._insert is None and self._store.session.execute(
                "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = %s",
                (self._keyspace,)).one() is None:
            return False
        self._statement()
        return True

    def _statement(self) -> PreparedStatement:
        if self._insert is None:
            self._insert = self._store.session.prepare(
                f"INSERT INTO {self._table} (queue, owner, shard, epoch, batch_no, total_messages, total_bytes, "
                "format) VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?")
        return self._insert

    def _values(self, owner: str, shard: int, position: Position) -> tuple[object, ...]:
        messages, size = position.totals if position.totals is not None else (None, None)
        return (self._queue_key, owner, shard, position.epoch, position.batch, messages, size, FORMAT,
                register_timestamp(position.epoch, position.batch))

    def write_sync(self, owner: str, shard: int, position: Position) -> None:
        """Write one checkpoint now (seeks, applies and rebuilds: rare, and synchronous)."""
        self._store.session.execute(self._statement(), self._values(owner, shard, position))

    async def write(self, owner: str, shard: int, position: Position) -> None:
        await cql.execute(self._store.session, self._statement(), self._values(owner, shard, position))

    def read(self, owner: str) -> dict[int, Position]:
        """The owner's checkpoint of every shard that has one."""
        rows = self._store.session.execute(
            f"SELECT shard, epoch, batch_no, total_messages, total_bytes, format FROM {self._table} "
            "WHERE queue = %s AND owner = %s", (self._queue_key, owner))
        found: dict[int, Position] = {}
        for row in rows:
            _refuse_newer(row.format, f"the checkpoint of {owner or 'the head'} in shard {row.shard}")
            totals = (None if row.total_messages is None or row.total_bytes is None
                      else (int(row.total_messages), int(row.total_bytes)))
            found[int(row.shard)] = Position(int(row.batch_no), int(row.epoch or 0), totals)
        return found

    async def read_async(self, owner: str) -> dict[int, Position]:
        return await asyncio.to_thread(self.read, owner)

    async def read_shard(self, owner: str, shard: int) -> Position | None:
        """The owner's checkpoint of one shard, if it has one (without blocking the loop)."""
        return (await self.read_async(owner)).get(shard)


def keyspace_gone(error: BaseException) -> bool:
    """Whether Cassandra refused a statement because its keyspace does not exist (a missing
    table, as before the operator's first apply after an upgrade, is not this)."""
    return isinstance(error, InvalidRequest) and "keyspace" in str(error).lower() and "does not exist" in str(error)


class CheckpointWriter:
    """Writes the latest position of each (owner, shard) noted, at most every
    CHECKPOINT_SECONDS, in the background; `flush` writes what is left (a clean stop).

    A write that fails is kept and tried with the next one: a checkpoint only bounds what a
    rebuild replays, so nothing waits for it, and nothing is answered on it.
    """

    def __init__(self, checkpoints: Checkpoints, interval: float = CHECKPOINT_SECONDS) -> None:
        self.checkpoints = checkpoints
        self._interval = interval
        self._pending: dict[tuple[str, int], Position] = {}
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.failures = 0

    def note(self, owner: str, shard: int, position: Position) -> None:
        """`position` is durable in ZooKeeper (or, for a head, in the log): checkpoint it soon."""
        key = (owner, shard)
        current = self._pending.get(key)
        if current is not None and current.order >= position.order:
            return
        self._pending[key] = position
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        wait = self._interval
        while self._pending:
            await asyncio.sleep(wait)
            failures = self.failures
            await self._write_pending()
            # A keyspace or queue that is gone (or a Cassandra away) is asked less and less.
            wait = self._interval if self.failures == failures else min(wait * 2, RETRY_MAX_SECONDS)

    async def _write_pending(self) -> None:
        pending, self._pending = self._pending, {}
        try:
            # Prepared here, off the event loop: a keyspace whose table an older operator has
            # not made yet (the operator makes it at its next apply) fails only the checkpoints.
            if not await asyncio.to_thread(self.checkpoints.prepare):
                log.info("%d checkpoints dropped: keyspace of the queue is gone", len(pending))
                return
            results = await asyncio.gather(
                *(self.checkpoints.write(owner, shard, position) for (owner, shard), position in pending.items()),
                return_exceptions=True)
        except Exception as error:  # every driver error: kept, and tried again with the next
            self.failures += 1
            if keyspace_gone(error):
                # Its namespace was deleted: written into nothing for ever otherwise, each try
                # an error in the driver's log.
                log.info("%d checkpoints dropped: %s", len(pending), error)
                return
            (log.warning if self.failures == 1 else log.debug)("checkpoints not written (%r); trying again", error)
            self._keep(pending)
            return
        except asyncio.CancelledError:
            self._keep(pending)  # a flush took over: it writes them (a write that landed is harmless again)
            raise
        for (key, position), result in zip(pending.items(), results):
            if isinstance(result, BaseException) and keyspace_gone(result):
                log.info("checkpoint of %s in shard %d dropped: %s", key[0] or "the head", key[1], result)
            elif isinstance(result, BaseException):
                self.failures += 1
                log.info("checkpoint of %s in shard %d not written (%r); trying again", key[0] or "the head",
                         key[1], result)
                self._keep({key: position})
            else:
                self.writes += 1

    def _keep(self, positions: dict[tuple[str, int], Position]) -> None:
        """Positions not written: noted again, unless a later one was noted meanwhile."""
        for key, position in positions.items():
            current = self._pending.get(key)
            if current is None or current.order < position.order:
                self._pending[key] = position

    def offset(self, owner: str) -> OffsetCheckpoints:
        """A view noting the offsets of one subscriber incarnation (`SubscriberState.ack_key`)."""
        return OffsetCheckpoints(self, owner)

    async def flush(self) -> None:
        """Write what is noted now (a clean stop; failures are logged and kept for later)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pending:
            await self._write_pending()


@dataclass(frozen=True)
class OffsetCheckpoints:
    """One subscriber incarnation's offsets, as its readers report the ones ZooKeeper accepted."""

    writer: CheckpointWriter
    owner: str

    def note(self, shard: int, offset: int, epoch: int) -> None:
        self.writer.note(self.owner, shard, Position(offset, epoch))

    async def read(self, shard: int) -> Position | None:
        return await self.writer.checkpoints.read_shard(self.owner, shard)

    async def flush(self) -> None:
        await self.writer.flush()
