"""`casque spark replay`: re-publish a range of one queue into another, once.

Spark reads the range (pushed down to its partitions); the driver publishes the rows in log
order through the engine's Publisher, so replayed messages are claimed into batches,
counted and delivered like any other publish. Every message carries a client id made from
its source position, `replay:<namespace>/<queue>:<shard>:<batch>:<seq>`, and that makes a
rerun add nothing, in two ways:

- Before publishing, the job reads the target queue's client ids (stored on every message
  row) and leaves out the messages already there. This holds for as long as the target
  retains them, and also covers a run that crashed after writing a batch but before
  recording its ids.
- The Publisher's idempotency (the client_ids table) covers the rest: a message published
  by a concurrent run, or during this one.

Order: messages of one source shard are published in (batch, seq) order, and a keyed
message keeps its key, so per-key order survives the replay. A message keeps its payload,
key, attributes and content type; its priority level is kept when the target has that
level (else the target's highest); an ephemeral message keeps what is left of its TTL, and
one that already expired is not replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from casque.engine import catalog
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import CasqueError
from casque.schema import QueueRef
from casque.spark import readers
from casque.spark.errors import SparkJobError
from casque.spark.progress import Progress
from casque.spark.ranges import ResolvedRange
from casque.specs import priority_of
from casque.store import Store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Messages handed to the Publisher at once; it groups them into batches per shard.
CHUNK = 500
CLIENT_ID_PREFIX = "replay:"


@dataclass
class ReplayResult:
    source: str
    target: str
    selected: int = 0  # messages in the range
    already_there: int = 0  # found in the target before publishing (an earlier run)
    published: int = 0  # newly written to the target
    duplicates: int = 0  # the Publisher's idempotency answered with an earlier result
    expired: int = 0  # ephemeral messages whose TTL ran out: not replayed
    per_target_shard: dict[int, int] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source, "target": self.target, "selected": self.selected,
            "already_there": self.already_there, "published": self.published, "duplicates": self.duplicates,
            "expired": self.expired,
        }


def client_id_prefix(source: QueueRef) -> str:
    return f"{CLIENT_ID_PREFIX}{source.key}:"


def client_id(source: QueueRef, shard: int, batch: int, seq: int) -> str:
    """The replayed message's client id: its source position, so a rerun finds it."""
    return f"{client_id_prefix(source)}{shard}:{batch}:{seq}"


def pending_frame(spark: SparkSession, keyspace: str, resolved: ResolvedRange, target: QueueRef,
                  target_keyspace: str | None = None) -> DataFrame:
    """The range's messages whose replay is not in the target yet, in log order.
    `target_keyspace`: the target queue's, when not `keyspace` (another namespace's, with
    keyspace isolation)."""
    from pyspark.sql import functions as F

    prefix = client_id_prefix(resolved.queue)
    source = readers.messages(
        spark, keyspace, resolved,
        ["shard", "batch_no", "seq", "key", "attributes", "payload", "content_type", "expires_at"],
    ).withColumn(
        "client_id",
        F.concat(F.lit(prefix), F.col("shard").cast("string"), F.lit(":"), F.col("batch_no").cast("string"),
                 F.lit(":"), F.col("seq").cast("string")),
    )
    # No index on client_id: this reads the target's client id column whole (one column,
    # no payloads), which is what makes a rerun safe after the publish-id window.
    there = (
        readers.table(spark, target_keyspace or keyspace, target.messages_table)
        .select("client_id")
        .where(F.col("client_id").startswith(prefix))
        .distinct()
    )
    return source.join(there, "client_id", "left_anti").orderBy("shard", "batch_no", "seq")


def _outgoing(row: Any, target_levels: int, now: datetime) -> OutgoingMessage | None:
    ttl: int | None = None
    if row["expires_at"] is not None:
        expires = row["expires_at"]
        expires = expires if expires.tzinfo else expires.replace(tzinfo=timezone.utc)
        remaining = (expires - now).total_seconds()
        if remaining <= 0:
            return None
        ttl = max(1, math.ceil(remaining))
    return OutgoingMessage(
        payload=bytes(row["payload"] or b""),
        key=row["key"],
        attributes=dict(row["attributes"] or {}),
        content_type=row["content_type"],
        client_id=row["client_id"],
        ttl_seconds=ttl,
        priority=min(priority_of(row["shard"]), target_levels - 1),
    )


def waves(messages: list[OutgoingMessage]) -> list[list[OutgoingMessage]]:
    """Split a chunk so that no wave holds two messages of one key.

    The messages of one publish call are submitted concurrently (each first looks up its
    client id), so two messages of a key in one call could swap places. Waves go out one
    after the other: the nth message of every key is in the nth wave, and per-key order holds.
    """
    result: list[list[OutgoingMessage]] = []
    seen: dict[str, int] = {}
    for message in messages:
        index = 0
        if message.key is not None:
            index = seen.get(message.key, 0)
            seen[message.key] = index + 1
        while len(result) <= index:
            result.append([])
        result[index].append(message)
    return result


async def replay(spark: SparkSession, store: Store, resolved: ResolvedRange, target: QueueRef,
                 progress: Progress | None = None) -> ReplayResult:
    """Publish the range into `target`; returns what was done. Safe to run again."""
    if target == resolved.queue:
        raise SparkJobError(f"cannot replay {target} into itself")
    target_state = await asyncio.to_thread(catalog.read_queue, store, target)  # QueueNotFound if absent
    result = ReplayResult(str(resolved.queue), str(target))
    keyspace = store.keyspace_of(resolved.queue.namespace)
    selected_frame = readers.messages(spark, keyspace, resolved, ["shard", "batch_no", "seq"])
    result.selected = await asyncio.to_thread(selected_frame.count)
    pending = pending_frame(spark, keyspace, resolved, target, store.keyspace_of(target.namespace))
    pending.persist()
    try:
        total = await asyncio.to_thread(pending.count)
        result.already_there = result.selected - total
        if progress is not None:
            progress.start(total)
        publisher = Publisher(store.for_namespace(target.namespace), target, target_state)
        rows = pending.toLocalIterator(prefetchPartitions=True)

        def next_chunk() -> list[Any]:
            return list(itertools.islice(rows, CHUNK))

        while chunk := await asyncio.to_thread(next_chunk):
            now = datetime.now(timezone.utc)
            messages = []
            for row in chunk:
                message = _outgoing(row, target_state.spec.priorities, now)
                if message is None:
                    result.expired += 1
                    continue
                try:
                    # The target's schema too: a replayed message is stamped with its version.
                    message = publisher.checked(message)
                except CasqueError as error:
                    raise SparkJobError(
                        f"message at {row['shard']}:{row['batch_no']}:{row['seq']} cannot go to {target}: {error}"
                    ) from error
                messages.append(message)
            for wave in waves(messages):
                for published in await publisher.publish(wave):
                    if published.duplicate:
                        result.duplicates += 1
                    else:
                        result.published += 1
                        result.per_target_shard[published.shard] = result.per_target_shard.get(published.shard, 0) + 1
            if progress is not None:
                progress.advance(len(chunk))
        await publisher.flush_heads()
    finally:
        pending.unpersist()
    return result
