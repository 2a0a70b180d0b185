"""Subscriber offsets, lease fences and seeks in ZooKeeper.

An offset znode holds the first batch of its shard with a message not yet done, and the
shard's seek epoch ("N@E", see casque.znodes), read together in one read. Only the lease
holder writes it, in one ZooKeeper multi that checks the shard's fence znode: every lease
acquisition bumps the fence's version, so a holder that lost its lease (a session expiry it
has not noticed yet, a pause past it) can never write an offset once a new holder exists.
The set also carries the offset znode's version: a seek in between makes it fail, and the
holder learns it was a seek from the epoch it then reads, never from the failure alone.

A seek writes the new offsets of the shards it names with their epoch bumped, and a record
of the seek, in one ZooKeeper transaction. The epoch keys the ack records, so a replay of a
range delivers its messages again instead of skipping those acked in the earlier pass; a
shard the seek does not name keeps its epoch, its offset and its reader.

The seek overwrites the offsets without checking their versions: it sets where the shards
resume, so a commit that landed just before it has nothing to keep, and every commit
prepared before it fails on the version the seek bumped, after which its writer reads the
new epoch. Only the seek record is compared-and-set, against another seek. (Checking every
offset's version made a seek race each shard's commits, up to 20 a second per busy shard,
and lose: 503 after 20 tries.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from enum import Enum
from typing import Literal

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from casque.backends import zk
from casque.engine import catalog, checkpoints, positions
from casque.engine.clock import clock_of
from casque.errors import BackendUnavailable, PositionOutOfRange, SubscriberNotFound
from casque.schema import QueueRef
from casque.specs import QueueState
from casque.store import Store
from casque.znodes import SubscriberPaths, decode_offset, encode_offset

# Seeks that lose the seek record's compare-and-set to another seek try again.
SEEK_ATTEMPTS = 20


@dataclass(frozen=True)
class SeekTarget:
    """earliest, latest, a time, or explicit batches per shard."""

    kind: Literal["earliest", "latest", "time", "batch"]
    time: datetime | None = None
    batches: dict[int, int] | None = None


@dataclass(frozen=True)
class OffsetRecord:
    """An offset znode as read: where the shard resumes, in which epoch, at which znode version."""

    offset: int
    epoch: int
    version: int


class CommitOutcome(Enum):
    WRITTEN = "written"
    LEASE_LOST = "lease_lost"  # the fence moved: another member holds the shard now
    MOVED = "moved"  # the offset znode changed under us: a seek, or our own write whose reply was lost
    GONE = "gone"  # the subscriber was deleted


def read_epoch(client: KazooClient, paths: SubscriberPaths) -> tuple[int, int]:
    """(latest epoch any shard was sought to, znode version) of the seek record; (0, -1) before any seek."""
    try:
        data, stat = client.get(paths.seek)
    except NoNodeError:
        return 0, -1
    return int(json.loads(data or b"{}").get("epoch", 0)), stat.version


async def read_seek_mark(client: KazooClient, paths: SubscriberPaths) -> int:
    """Which seek is the subscriber's latest: its record's last-modified zxid (0 before any seek).

    Every seek writes this record in the transaction that moves its shards, so two equal
    marks, read in order by one session, mean no seek happened in between: an epoch read
    after the first mark is still the shard's epoch at the second. One read answers that
    for every shard at once.
    """
    stat = await zk.call(client.exists_async, paths.seek)
    return 0 if stat is None else int(stat.mzxid)


async def read_offset(client: KazooClient, paths: SubscriberPaths, shard: int) -> OffsetRecord:
    data, stat = await zk.call(client.get_async, paths.offset(shard))
    offset, epoch = decode_offset(data)
    return OffsetRecord(offset, epoch, stat.version)


async def commit_offset(
    client: KazooClient, paths: SubscriberPaths, shard: int, offset: int, epoch: int, version: int, fence: int
) -> tuple[CommitOutcome, int]:
    """Write `offset` if the fence and the offset znode are still at the versions we know.

    Returns the outcome and, when written, the offset znode's new version.
    """
    transaction = client.transaction()
    transaction.check(paths.fence(shard), fence)
    transaction.set_data(paths.offset(shard), encode_offset(offset, epoch), version)
    results = await zk.call(transaction.commit_async)
    fence_result, offset_result = results
    if isinstance(fence_result, NoNodeError) or isinstance(offset_result, NoNodeError):
        return CommitOutcome.GONE, version
    if isinstance(fence_result, BadVersionError):
        return CommitOutcome.LEASE_LOST, version
    if isinstance(offset_result, BadVersionError):
        return CommitOutcome.MOVED, version
    if isinstance(offset_result, Exception):
        raise BackendUnavailable(f"ZooKeeper refused the offset write: {offset_result!r}")
    return CommitOutcome.WRITTEN, int(offset_result.version)


def seek(store: Store, queue: QueueRef, subscriber: str, target: SeekTarget) -> dict[int, int]:
    """Move a subscriber; returns the new offset of each shard it moved."""
    queue_state = catalog.read_queue(store, queue)
    catalog.read_subscriber(store, queue, subscriber)  # raises SubscriberNotFound
    paths = store.paths(queue).subscriber(subscriber)
    oldest_allowed = clock_of(store.session).now() - timedelta(seconds=queue_state.spec.retention_seconds)
    if target.kind == "time":
        assert target.time is not None
        moment = target.time if target.time.tzinfo else target.time.replace(tzinfo=timezone.utc)
        if moment < oldest_allowed:
            raise PositionOutOfRange(
                f"{moment.isoformat()} is older than the queue's retention ({queue_state.spec.retention_seconds}s)"
            )
    offsets: dict[int, int] = {}
    in_order = queue_state.expiry_in_order(clock_of(store.session).now())
    for shard in queue_state.spec.log_shards():
        head = catalog.read_int(store, store.paths(queue).head(shard))
        if target.kind == "latest":
            offsets[shard] = head + 1
        elif target.kind == "earliest":
            offsets[shard] = positions.earliest_batch(store, queue, shard, head, in_order)
        elif target.kind == "time":
            assert target.time is not None
            offsets[shard] = positions.batch_at_time(store, queue, shard, head, target.time, in_order)
        else:
            wanted = (target.batches or {}).get(shard)
            if wanted is None:
                continue
            earliest = positions.earliest_batch(store, queue, shard, head, in_order)
            if not earliest <= wanted <= head + 1:
                raise PositionOutOfRange(
                    f"shard {shard} holds batches {earliest}..{head}; cannot seek to batch {wanted}"
                )
            offsets[shard] = wanted
    for _ in range(SEEK_ATTEMPTS):
        epoch = _try_seek(store.zk, paths, target, offsets)
        if epoch is not None:
            _checkpoint(store, queue, queue_state, subscriber, offsets, epoch)
            return offsets
    raise BackendUnavailable(f"subscriber {subscriber}: other seeks kept coming first; try again")


def _checkpoint(store: Store, queue: QueueRef, queue_state: QueueState, subscriber: str, offsets: dict[int, int],
                epoch: int) -> None:
    """The sought offsets checkpointed at once (casque.engine.checkpoints): a ZooKeeper lost
    after the seek is rebuilt with its epoch, and a replay keeps its own ack rows."""
    state = catalog.read_subscriber(store, queue, subscriber)
    positions_of = checkpoints.Checkpoints(store, queue, queue_state.shared_key(queue))
    for shard, offset in offsets.items():
        positions_of.write_sync(state.ack_key(subscriber), shard, checkpoints.Position(offset, epoch))


def _try_seek(client: KazooClient, paths: SubscriberPaths, target: SeekTarget, offsets: dict[int, int]) -> int | None:
    """Every moved offset, and the seek record compared-and-set: the new epoch, or None if
    another seek came first."""
    epoch, version = read_epoch(client, paths)
    new_epoch = epoch + 1
    transaction = client.transaction()
    for shard, offset in offsets.items():
        # Unconditional (module docstring): commits compare-and-set, so they lose to the seek.
        transaction.set_data(paths.offset(shard), encode_offset(offset, new_epoch))
        if client.exists(paths.cursor(shard)) is not None:
            # Shared delivery: ranges are claimed from the new position on; claims of the old
            # epoch are moot (casque.engine.claims). Unconditional: claiming only ever checks it.
            transaction.set_data(paths.cursor(shard), encode_offset(offset, new_epoch))
    record = json.dumps(
        {"epoch": new_epoch, "target": target.kind, "offsets": {str(s): o for s, o in offsets.items()},
         "requested_at": datetime.now(timezone.utc).isoformat()}
    ).encode()
    if version < 0:
        transaction.create(paths.seek, record)
    else:
        transaction.set_data(paths.seek, record, version=version)
    results = transaction.commit()
    failures = [r for r in results if isinstance(r, Exception)]
    if not failures:
        return new_epoch
    cause = next(f for f in failures if not isinstance(f, RolledBackError))
    if isinstance(cause, (BadVersionError, NodeExistsError)):
        return None
    if isinstance(cause, NoNodeError):
        raise SubscriberNotFound(f"subscriber {paths.name} was removed during the seek")
    raise cause
