"""Subscriber offsets and seeks in ZooKeeper.

An offset znode holds the first batch of its shard with a message not yet done. Only the
lease holder writes it, with the znode version as compare-and-set: a write that fails means
a seek moved the offset, and the holder must reload instead of overwriting it.

A seek writes the new offsets of every shard and bumps the subscriber's epoch in one
ZooKeeper transaction. The epoch keys the ack records, so a replay of a range delivers its
messages again instead of skipping those acked in the earlier pass. Lease holders watch the
seek znode and restart their shards from the new offsets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from casque.engine import catalog, positions
from casque.errors import PositionOutOfRange
from casque.schema import QueueRef
from casque.store import Store
from casque.znodes import SubscriberPaths


@dataclass(frozen=True)
class SeekTarget:
    """earliest, latest, a time, or explicit batches per shard."""

    kind: Literal["earliest", "latest", "time", "batch"]
    time: datetime | None = None
    batches: dict[int, int] | None = None


def read_epoch(client: KazooClient, paths: SubscriberPaths) -> tuple[int, int]:
    """(epoch, znode version) of the subscriber's seek znode; (0, -1) before any seek."""
    try:
        data, stat = client.get(paths.seek)
    except NoNodeError:
        return 0, -1
    return int(json.loads(data or b"{}").get("epoch", 0)), stat.version


def seek(store: Store, queue: QueueRef, subscriber: str, target: SeekTarget) -> dict[int, int]:
    """Move a subscriber; returns the new offset of each shard."""
    queue_state = catalog.read_queue(store, queue)
    catalog.read_subscriber(store, queue, subscriber)  # raises SubscriberNotFound
    paths = store.paths(queue).subscriber(subscriber)
    oldest_allowed = datetime.now(timezone.utc) - timedelta(seconds=queue_state.spec.retention_seconds)
    if target.kind == "time":
        assert target.time is not None
        moment = target.time if target.time.tzinfo else target.time.replace(tzinfo=timezone.utc)
        if moment < oldest_allowed:
            raise PositionOutOfRange(
                f"{moment.isoformat()} is older than the queue's retention ({queue_state.spec.retention_seconds}s)"
            )
    offsets: dict[int, int] = {}
    for shard in queue_state.spec.log_shards():
        head = catalog.read_int(store, store.paths(queue).head(shard))
        if target.kind == "latest":
            offsets[shard] = head + 1
        elif target.kind == "earliest":
            offsets[shard] = positions.earliest_batch(store, queue, shard, head)
        elif target.kind == "time":
            assert target.time is not None
            offsets[shard] = positions.batch_at_time(store, queue, shard, head, target.time)
        else:
            wanted = (target.batches or {}).get(shard)
            if wanted is None:
                continue
            earliest = positions.earliest_batch(store, queue, shard, head)
            if not earliest <= wanted <= head + 1:
                raise PositionOutOfRange(
                    f"shard {shard} holds batches {earliest}..{head}; cannot seek to batch {wanted}"
                )
            offsets[shard] = wanted
    epoch, version = read_epoch(store.zk, paths)
    seek_record = json.dumps(
        {"epoch": epoch + 1, "target": target.kind, "offsets": offsets,
         "requested_at": datetime.now(timezone.utc).isoformat()}
    ).encode()
    transaction = store.zk.transaction()
    for shard, offset in offsets.items():
        transaction.set_data(paths.offset(shard), str(offset).encode())
    if version < 0:
        transaction.create(paths.seek, seek_record)
    else:
        transaction.set_data(paths.seek, seek_record, version=version)
    results = transaction.commit()
    failures = [r for r in results if isinstance(r, Exception)]
    if failures:
        raise failures[0]
    return offsets
