"""Finding batch numbers in a shard's log: the earliest live batch, the first batch at a time.

Batches of a shard are numbered 1, 2, 3, ... without gaps and, under one retention, expire
oldest first (by the table TTL), so "has this batch's header row" is false on an expired
prefix and true up to the head: a binary search over batch numbers finds the boundary in
O(log n) point reads. After a lowered retention that no longer holds until the rows written
before it have expired (`QueueState.expiry_in_order`): newer batches go first, and a
binary search can land past live batches. Then the earliest batch is found by reading every
bucket from the start (casque.engine.gaps does the same for readers), and a batch found
missing while searching by time is replaced by the next one that exists.
The same holds for publish times, up to clock skew between publishers: a seek by time is
exact to within that skew.
"""

from __future__ import annotations

from datetime import datetime, timezone

from cassandra.query import SimpleStatement

from casque.backends import cql
from casque.engine.gaps import bucket_slices
from casque.schema import BATCHES_PER_BUCKET, HEADER_SEQ, QueueRef, bucket_of
from casque.store import Store


def read_header_time(store: Store, queue: QueueRef, shard: int, batch: int) -> datetime | None:
    row = store.session.execute(
        f"SELECT published_at FROM {store.table(queue)} WHERE shard = %s AND bucket = %s "
        "AND batch_no = %s AND seq = %s",
        (shard, bucket_of(batch, BATCHES_PER_BUCKET), batch, HEADER_SEQ),
    ).one()
    return None if row is None else row.published_at


def first_existing(store: Store, queue: QueueRef, shard: int, low: int, high: int) -> int | None:
    """The first batch in [low, high) whose header exists, reading each bucket in turn at
    SERIAL (as casque.engine.gaps does: no lagging replica hides a batch); None if none does."""
    consistency = cql.consistency("SERIAL")  # only while expiry is out of order: rarely
    for bucket_low, bucket_high in bucket_slices(low, high):
        statement = SimpleStatement(
            f"SELECT batch_no FROM {store.table(queue)} WHERE shard = %s AND bucket = %s AND batch_no >= %s "
            "AND batch_no < %s AND seq = %s LIMIT 1 ALLOW FILTERING", consistency_level=consistency)
        row = store.session.execute(statement, (shard, bucket_of(bucket_low), bucket_low, bucket_high,
                                                HEADER_SEQ)).one()
        if row is not None:
            return int(row.batch_no)
    return None


def earliest_batch(store: Store, queue: QueueRef, shard: int, head: int, expiry_in_order: bool = True) -> int:
    """The first batch still within retention, or head + 1 when every batch has expired."""
    lo, hi = 1, head + 1  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if read_header_time(store, queue, shard, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    if expiry_in_order:
        return lo
    # Live batches may sit before the boundary found: read every bucket before it.
    found = first_existing(store, queue, shard, 1, lo)
    return lo if found is None else found


def batch_at_time(store: Store, queue: QueueRef, shard: int, head: int, when: datetime,
                  expiry_in_order: bool = True) -> int:
    """The first live batch published at or after `when` (head + 1 if none is)."""
    lo, hi = earliest_batch(store, queue, shard, head, expiry_in_order), head + 1
    when_naive = _utc_naive(when) if when.tzinfo is not None else when
    while lo < hi:
        mid = (lo + hi) // 2
        published = read_header_time(store, queue, shard, mid)
        if published is None and not expiry_in_order:
            # Gone, but not for being old: judge by the next batch that exists instead.
            found = first_existing(store, queue, shard, mid, hi)
            if found is None:
                hi = mid  # nothing live in [mid, hi): a start there crosses to hi
                continue
            mid, published = found, read_header_time(store, queue, shard, found)
        if published is None or published < when_naive:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _utc_naive(moment: datetime) -> datetime:
    """The driver returns timestamps as naive UTC datetimes; compare like with like."""
    return moment.astimezone(timezone.utc).replace(tzinfo=None)
