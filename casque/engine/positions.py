"""Finding batch numbers in a shard's log: the earliest live batch, the first batch at a time.

Batches of a shard are numbered 1, 2, 3, ... without gaps and, under one retention, expire
oldest first (by the table TTL), so "has this batch's header row" is false on an expired
prefix and true up to the head: a binary search over batch numbers finds the boundary in
O(log n) point reads. After a retention change that no longer holds (newer batches may
expire first), so these are only where seeks start; readers cross the gaps they meet
without assuming an order (casque.engine.gaps).
The same holds for publish times, up to clock skew between publishers: a seek by time is
exact to within that skew.
"""

from __future__ import annotations

from datetime import datetime, timezone

from casque.schema import BATCHES_PER_BUCKET, HEADER_SEQ, QueueRef, bucket_of
from casque.store import Store


def read_header_time(store: Store, queue: QueueRef, shard: int, batch: int) -> datetime | None:
    row = store.session.execute(
        f"SELECT published_at FROM {store.table(queue)} WHERE shard = %s AND bucket = %s "
        "AND batch_no = %s AND seq = %s",
        (shard, bucket_of(batch, BATCHES_PER_BUCKET), batch, HEADER_SEQ),
    ).one()
    return None if row is None else row.published_at


def earliest_batch(store: Store, queue: QueueRef, shard: int, head: int) -> int:
    """The first batch still within retention, or head + 1 when every batch has expired."""
    lo, hi = 1, head + 1  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if read_header_time(store, queue, shard, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def batch_at_time(store: Store, queue: QueueRef, shard: int, head: int, when: datetime) -> int:
    """The first live batch published at or after `when` (head + 1 if none is)."""
    lo, hi = earliest_batch(store, queue, shard, head), head + 1
    when_naive = _utc_naive(when) if when.tzinfo is not None else when
    while lo < hi:
        mid = (lo + hi) // 2
        published = read_header_time(store, queue, shard, mid)
        if published is None or published < when_naive:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _utc_naive(moment: datetime) -> datetime:
    """The driver returns timestamps as naive UTC datetimes; compare like with like."""
    return moment.astimezone(timezone.utc).replace(tzinfo=None)
