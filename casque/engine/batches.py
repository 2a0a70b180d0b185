"""Reading and writing a queue's log of numbered batches in Cassandra.

A batch is claimed and written in one step: a conditional single-partition batch whose
header row (seq -1) is inserted IF NOT EXISTS together with every message row. Cassandra
applies it whole or not at all, so whoever wins batch N owns it entirely and a loser's rows
never exist: two writers can never merge into one batch, and no crash can leave a claimed
batch half written.

Publishers only ever claim N after learning that N-1 exists (they wrote it, or lost it to
someone else), so a shard's batches are contiguous: a reader that finds N knows 1..N-1
exist or have expired, and a reader that does not find N knows nobody has it yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from cassandra.query import UNSET_VALUE, BatchStatement, BatchType, PreparedStatement

from casque.backends import cql
from casque.engine.clock import clock_of
from casque.engine.messages import OutgoingMessage, Position, StoredMessage, random_uuid
from casque.formats import unmarked_or_none
from casque.schema import HEADER_SEQ, QueueRef, bucket_of
from casque.store import Store

# An ephemeral message's rows outlive its TTL by this much, so that its history, asked for
# just after, says `expired` instead of not found; every reader skips a message past its
# expires_at, so none is delivered meanwhile.
EXPIRED_KEPT_SECONDS = 60
# Rows fetched per read of a shard; a read never ends inside a batch it returns.
READ_ROWS = 2000
# A read asks for rows a page at a time and stops once this much payload is in: the rows of
# a read all sit in memory at once (a sidecar's budget), and READ_ROWS of large messages
# would be tens of MiB. Far above a batch's size, so a read always returns a whole batch.
READ_BYTES = 2 * 1024 * 1024
# Pages are sized from the rows a shard's last read returned, to about READ_PAGE_BYTES: a
# page of large messages is itself all in memory at once. The first read of a shard, with
# nothing to go by, asks for FIRST_PAGE_ROWS.
READ_PAGE_BYTES = 512 * 1024
FIRST_PAGE_ROWS = 50
MIN_PAGE_ROWS, MAX_PAGE_ROWS = 10, 1000

# What a read of the log selects, rows coming as plain tuples in this order (cql.tuple_rows):
# a message row's columns, then a header row's.
_READ_COLUMNS = ("batch_no, seq, message_id, published_at, key, attributes, payload, content_type, expires_at, "
                 "writer, message_count, total_messages, total_bytes")


@dataclass(frozen=True)
class Header:
    batch: int
    published_at: datetime | None
    writer: str | None
    message_count: int
    total_messages: int | None
    total_bytes: int | None


@dataclass(frozen=True)
class Claim:
    """The outcome of one attempt to write batch N: ours, or someone else's (whose header we got)."""

    applied: bool
    header: Header | None


@dataclass(frozen=True)
class Batch:
    header: Header
    messages: list[StoredMessage]


class Log:
    """Prepared statements for one queue's messages table."""

    def __init__(self, store: Store, queue: QueueRef, consistency: str) -> None:
        # Publish times are compared across shards (a seek to a time): one clock for all writers.
        self._clock = clock_of(store.session)
        self.store = store
        self.queue = queue
        self.consistency = cql.consistency(consistency)
        self.serial_consistency = cql.serial_consistency(consistency, store.spans_datacenters())
        table = store.table(queue)
        prepare = store.session.prepare
        self._insert_header: PreparedStatement = prepare(
            f"INSERT INTO {table} (shard, bucket, batch_no, seq, published_at, writer, message_count, "
            "total_messages, total_bytes) VALUES (?, ?, ?, -1, ?, ?, ?, ?, ?) IF NOT EXISTS"
        )
        # The columns every row of a batch shares come first (see cql.BatchRows).
        columns = ("shard, bucket, batch_no, published_at, seq, message_id, key, attributes, payload, "
                   "content_type, client_id, expires_at")
        self._message_rows = cql.BatchRows(prepare(
            f"INSERT INTO {table} ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        ))
        self._message_rows_ttl = cql.BatchRows(prepare(
            f"INSERT INTO {table} ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        ))
        self._read_header = prepare(
            f"SELECT batch_no, published_at, writer, message_count, total_messages, total_bytes FROM {table} "
            "WHERE shard = ? AND bucket = ? AND batch_no = ? AND seq = -1"
        )
        self._read_header.consistency_level = self.consistency
        self._read_header_serial = prepare(self._read_header.query_string)
        self._read_header_serial.consistency_level = self.serial_consistency
        # The first header in a slice of one bucket, read at SERIAL: what proves a gap
        # (casque.engine.gaps). Filtering on seq stays within the one partition.
        self._first_header = prepare(
            f"SELECT batch_no FROM {table} WHERE shard = ? AND bucket = ? AND batch_no >= ? AND batch_no < ? "
            "AND seq = -1 LIMIT 1 ALLOW FILTERING"
        )
        self._first_header.consistency_level = self.serial_consistency
        self._read_from = prepare(
            f"SELECT {_READ_COLUMNS} FROM {table} WHERE shard = ? AND bucket = ? AND batch_no >= ? LIMIT {READ_ROWS}"
        )
        self._read_from.consistency_level = self.consistency
        # Mean payload bytes of the rows of each shard's last read (see page_rows).
        self._row_bytes: dict[int, float] = {}

    async def claim(
        self,
        shard: int,
        batch: int,
        messages: Sequence[tuple[str, OutgoingMessage]],
        writer: str,
        totals: tuple[int, int] | None,
        now: datetime | None = None,
    ) -> Claim:
        """Try to write batch `batch` of `shard` with `messages` (message id, message)."""
        published_at = now or self._clock.now()
        bucket = bucket_of(batch)
        size = sum(m.size for _, m in messages)
        total_messages = totals[0] + len(messages) if totals else None
        total_bytes = totals[1] + size if totals else None
        statement = BatchStatement(
            batch_type=BatchType.UNLOGGED,  # one partition: atomic without the batchlog
            consistency_level=self.consistency,
            serial_consistency_level=self.serial_consistency,
        )
        statement.add(
            self._insert_header,
            _unset_nulls((shard, bucket, batch, published_at, writer, len(messages), total_messages, total_bytes)),
        )
        rows, rows_ttl = self._message_rows, self._message_rows_ttl
        shared = rows.shared((shard, bucket, batch, published_at))
        for seq, (message_id, message) in enumerate(messages):
            if message.ttl_seconds:
                rows_ttl.add(statement, shared, (
                    seq, message_id, message.key, dict(message.attributes) or None, message.payload,
                    message.content_type, message.client_id, published_at + timedelta(seconds=message.ttl_seconds),
                    message.ttl_seconds + EXPIRED_KEPT_SECONDS))
            else:
                rows.add(statement, shared, (
                    seq, message_id, message.key, dict(message.attributes) or None, message.payload,
                    message.content_type, message.client_id, None))
        result = await cql.execute(self.store.session, statement)
        if cql.applied(result):
            return Claim(True, Header(batch, published_at, writer, len(messages), total_messages, total_bytes))
        return Claim(False, _header_from_row(batch, result.one()))

    async def read_header(self, shard: int, batch: int, serial: bool = False) -> Header | None:
        """The header of a batch; `serial` settles any Paxos round still in progress for it first."""
        statement = self._read_header_serial if serial else self._read_header
        rows = await cql.execute(self.store.session, statement, (shard, bucket_of(batch), batch))
        row = rows.one()
        return None if row is None else _header_from_row(batch, row)

    async def first_header(self, shard: int, low: int, high: int) -> int | None:
        """The first batch in [low, high), all in one bucket, whose header exists, read at
        SERIAL: every batch was written by a Paxos round in its partition, which a serial
        read completes and reads from a quorum, so no lagging replica hides one."""
        bucket = bucket_of(low)
        if bucket_of(high - 1) != bucket:
            raise ValueError(f"batches {low}..{high - 1} span buckets")
        row = (await cql.execute(self.store.session, self._first_header, (shard, bucket, low, high))).one()
        return None if row is None else int(row.batch_no)

    async def read_from(self, shard: int, first_batch: int) -> list[Batch]:
        """Whole batches from `first_batch` on, within first_batch's bucket, in order: at most
        READ_ROWS rows, and no further page once READ_BYTES of payload are in (at least one
        batch, since a batch is far smaller)."""
        batches: list[Batch] = []
        open_batch: tuple[Header, list[StoredMessage]] | None = None
        count = size = 0
        cut = False
        read = self._read_from.bind((shard, bucket_of(first_batch), first_batch))
        read.fetch_size = page_rows(self._row_bytes.get(shard))
        # The rows of a batch share its publish time: converted once per batch, not per row.
        published: tuple[Any, datetime] | None = None
        async for page in cql.pages(self.store.session, read, profile=cql.tuple_rows(self.store.session)):
            for row in page:
                count += 1
                batch_no, seq, payload = row[0], row[1], row[6]
                if payload:
                    size += len(payload)
                if seq == HEADER_SEQ:
                    if open_batch is not None:
                        batches.append(Batch(*open_batch))
                    open_batch = (_header_from_tuple(row), [])
                elif open_batch is not None and open_batch[0].batch == batch_no:
                    raw = row[3]
                    if published is None or published[0] != raw:
                        published = (raw, _utc(raw))
                    open_batch[1].append(_message_from_tuple(shard, row, published[1]))
                # else: rows of a batch whose header lies before the read (cannot happen when
                # reading from its start)
            if size >= READ_BYTES:
                cut = True
                break
            if count:
                # The first read of a shard starts with small pages, knowing nothing of its
                # rows; from its second page on it knows (40 round trips of 50 rows made the
                # first receive of a consumer wait for a fifth of a second).
                read.fetch_size = page_rows(size / count)
        if count:
            self._row_bytes[shard] = size / count
        if open_batch is not None:
            header, messages = open_batch
            # A read cut at the row or byte limit may have cut the last batch; it is read
            # again, whole, next time. A batch is also "short" when ephemeral rows expired.
            if len(messages) == header.message_count or not (cut or count >= READ_ROWS):
                batches.append(Batch(header, messages))
        return batches



def page_rows(mean_row_bytes: float | None) -> int:
    """Rows per page for a read of a shard whose last read's rows were `mean_row_bytes`
    long on average: about READ_PAGE_BYTES a page."""
    if mean_row_bytes is None:
        return FIRST_PAGE_ROWS
    return max(MIN_PAGE_ROWS, min(MAX_PAGE_ROWS, int(READ_PAGE_BYTES / max(mean_row_bytes, 1.0))))


def _message_from_tuple(shard: int, row: tuple[Any, ...], published_at: datetime) -> StoredMessage:
    """A message from a row of `_READ_COLUMNS`."""
    batch_no, seq, message_id, _, key, attributes, payload, content_type, expires_at = row[:9]
    return StoredMessage(
        Position(shard, batch_no, seq),
        message_id,
        published_at,
        payload or b"",
        key,
        dict(attributes) if attributes else {},
        content_type,
        _utc(expires_at) if expires_at else None,
    )


def _header_from_tuple(row: tuple[Any, ...]) -> Header:
    """A header from a row of `_READ_COLUMNS`."""
    published = row[3]
    return Header(
        batch=row[0],
        published_at=_utc(published) if published else None,
        writer=unmarked_or_none(row[9], f"batch {row[0]}'s writer"),
        message_count=row[10] or 0,
        total_messages=row[11],
        total_bytes=row[12],
    )


def _unset_nulls(values: Sequence[Any]) -> tuple[Any, ...]:
    """Absent values are left unset: binding null would write a cell tombstone."""
    return tuple(UNSET_VALUE if v is None else v for v in values)


def new_writer_id(publisher_id: str) -> str:
    """A unique id for the claims of one batch of messages: after a timeout, the header tells
    whether it was ours, and a retry of a publish finds its batch by it."""
    return f"{publisher_id}/{random_uuid().hex[:12]}"


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment


def _header_from_row(batch: int, row: Any) -> Header | None:
    if row is None:
        return None
    published = getattr(row, "published_at", None)
    return Header(
        batch=batch,
        published_at=_utc(published) if published else None,
        writer=unmarked_or_none(getattr(row, "writer", None), f"batch {batch}'s writer"),
        message_count=getattr(row, "message_count", None) or 0,
        total_messages=getattr(row, "total_messages", None),
        total_bytes=getattr(row, "total_bytes", None),
    )
