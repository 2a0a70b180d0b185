"""Stalls: a shard with lag whose subscriber offset has not moved for too long.

A consumer that stops while messages wait is the failure nobody notices: every probe still
answers, and lag alone cannot tell a stopped consumer from a busy one. The offset znode
holds the answer in its modification time. Per shard, from stored state only (so a sidecar,
the CLI and the operator all read the same thing):

    waiting since = max(when the offset was last written, when the batch at the offset was published)
    stalled       = lag > 0 and now - waiting since >= the subscriber's stall threshold

The second term matters after an idle spell: an offset written an hour ago is not a stall
of a message published a second ago. What an offset write means differs by delivery mode:
a leased reader writes only when the offset moves, so a message that is never done (a
poison message nacked forever, a key held by a worker that never acks) stalls its shard
however busy the rest is. In shared delivery every completed range rewrites the offset,
even when a lower range still holds it: the shard counts as progressing while any range of
it completes, and stalls once nothing completes.

The clocks: the offset's time is ZooKeeper's, the batch's its publisher's, "now" the
reader's. The threshold is tens of seconds; skew of a few seconds moves the signal by as
much, never more.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from casque.backends import zk
from casque.engine.batches import Log
from casque.specs import SubscriberSpec
from casque.store import Store
from casque.znodes import SubscriberPaths, decode_head, decode_offset

# The longest a receive waits for a message (the sidecar's default maxWait): an app that
# long-polls asks again at least this often.
RECEIVE_WAIT_SECONDS = 20.0


def stall_threshold(spec: SubscriberSpec) -> float:
    """Seconds without an offset move, with lag, after which a shard is stalled.

    Unless `stallAfter` says otherwise: a healthy consumer may still be working, for up to a
    visibility timeout, on messages it took just before the one at the offset was published;
    its next receive comes within a long poll's wait; and that message is then acked within
    another visibility timeout (or comes back, after a crash, and is delivered again). Past
    2 x visibility + wait, nothing a healthy consumer does explains an offset standing still;
    with a retry policy, a message that failed may also wait out the longest backoff first.
    """
    if spec.stall_after_seconds is not None:
        return float(spec.stall_after_seconds)
    backoff = spec.retry.maximum_backoff_seconds if spec.retry is not None else 0
    return 2.0 * spec.visibility_timeout_seconds + RECEIVE_WAIT_SECONDS + backoff


@dataclass(frozen=True)
class ShardProgress:
    """What the stored state says of one shard's progress for a subscriber."""

    shard: int
    offset: int
    head: int
    # When the offset znode was last written (ZooKeeper's clock).
    offset_moved_at: datetime
    # When the batch at the offset was published; None with no lag (or a batch not readable).
    pending_since: datetime | None

    @property
    def lagging(self) -> bool:
        return self.head >= self.offset

    @property
    def waiting_since(self) -> datetime | None:
        """Since when the shard's first pending message has waited with the offset unmoved; None without lag."""
        if not self.lagging:
            return None
        if self.pending_since is None:
            return self.offset_moved_at
        return max(self.offset_moved_at, self.pending_since)

    def stalled_since(self, threshold: float, now: datetime) -> datetime | None:
        """`waiting_since` if it is at least `threshold` seconds old, else None (not stalled)."""
        since = self.waiting_since
        if since is None or now - since < timedelta(seconds=threshold):
            return None
        return since


def zk_time(milliseconds: int) -> datetime:
    """A znode stat's time (ms since the epoch) as an aware datetime."""
    return datetime.fromtimestamp(milliseconds / 1000, timezone.utc)


async def read_progress(store: Store, log: Log, paths: SubscriberPaths, shard: int) -> ShardProgress:
    """One shard's progress: its head, the offset znode (value and time) and, with lag, the
    header of the batch at the offset. Two ZooKeeper reads and at most one Cassandra read."""
    data, _ = await zk.call(store.zk.get_async, paths.queue.head(shard))
    head = decode_head(data)
    data, stat = await zk.call(store.zk.get_async, paths.offset(shard))
    offset, _epoch = decode_offset(data)
    pending = await log.read_header(shard, offset) if head >= offset >= 1 else None
    return ShardProgress(shard, offset, head, zk_time(stat.mtime), pending.published_at if pending else None)
