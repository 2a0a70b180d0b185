"""Rebuilding a queue's and its subscribers' znodes from what Cassandra keeps, after ZooKeeper
lost them (a wiped ensemble, a deleted volume) or went back to an older snapshot.

What comes back, and from where (casque.engine.checkpoints):

- the queue's and each subscriber's state, with their incarnations, from the catalog: every
  shared row (ack rows, delayed messages, publish ids, counters, checkpoints) is keyed by
  them, so the rebuilt queue finds all of it;
- each shard's head: the last batch of the log, searched from the head's checkpoint up (and
  from no lower than any subscriber's offset checkpoint), so a publisher never claims a
  batch that exists and a reader never waits below one; its running totals from that
  batch's header;
- each subscriber's offsets and seek epoch from their checkpoints (what is acked past a
  checkpoint is in the ack rows of that epoch, which readers skip as always);
- the delayed-message mover's cursor, from the queue's retention: every delayed row older
  than that has expired, and a row moved twice is stored once (casque.engine.delayed).

Member registrations, leases, fences and claims are not rebuilt: they belong to live
sessions, which a ZooKeeper that lost its data has ended; members make them again.

A rebuild runs where a queue is applied (casque.engine.catalog, the operator's drift repair
included) and says what it did in the apply's actions, which the operator turns into an
event; it logs and counts itself too (`REBUILDS`).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

from cassandra.query import SimpleStatement
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from casque.backends import cql
from casque.engine import positions
from casque.engine.checkpoints import HEAD, Checkpoints, Position, recorded_subscribers
from casque.engine.delayed import Cursor
from casque.schema import BATCHES_PER_BUCKET, HEADER_SEQ, QueueRef, bucket_of
from casque.specs import QueueState, SubscriberState
from casque.store import Store
from casque.znodes import decode_head, decode_offset, encode_offset, encode_totals

log = logging.getLogger(__name__)

# Rebuilds done by this process, by what was rebuilt ("queue", "subscriber", "head", "epoch").
REBUILDS: dict[str, int] = {}


def _count(kind: str, what: str) -> str:
    REBUILDS[kind] = REBUILDS.get(kind, 0) + 1
    log.warning("%s", what)
    return what


def _header_totals(store: Store, queue: QueueRef, shard: int, batch: int) -> tuple[bool, tuple[int, int] | None]:
    """Whether the batch's header exists, read at SERIAL (no lagging replica hides a batch
    written by a Paxos round), and its running totals."""
    statement = SimpleStatement(
        f"SELECT total_messages, total_bytes FROM {store.table(queue)} WHERE shard = %s AND bucket = %s "
        "AND batch_no = %s AND seq = %s", consistency_level=cql.consistency("SERIAL"))
    row = store.session.execute(statement, (shard, bucket_of(batch, BATCHES_PER_BUCKET), batch, HEADER_SEQ)).one()
    if row is None:
        return False, None
    totals = None if row.total_messages is None or row.total_bytes is None else (
        int(row.total_messages), int(row.total_bytes))
    return True, totals


def last_batch(store: Store, queue: QueueRef, shard: int, floor: Position) -> Position:
    """The shard's last written batch at or above `floor` (a batch known written, or 0), with
    its totals: batches above any written one are contiguous (each is claimed only after the
    one before it exists), so a galloping search over header reads finds the end in
    O(log n) reads."""
    exists, totals = _header_totals(store, queue, shard, floor.batch + 1)
    if not exists:
        return floor
    low, low_totals, step = floor.batch + 1, totals, 1
    high = low + step
    while True:  # gallop: `low` exists; find a `high` that does not
        exists, totals = _header_totals(store, queue, shard, high)
        if not exists:
            break
        low, low_totals = high, totals
        step *= 2
        high = low + step
    while high - low > 1:  # low exists, high does not
        middle = (low + high) // 2
        exists, totals = _header_totals(store, queue, shard, middle)
        if exists:
            low, low_totals = middle, totals
        else:
            high = middle
    return Position(low, totals=low_totals)


def rebuilt_heads(store: Store, queue: QueueRef, state: QueueState,
                  offsets: dict[str, dict[int, Position]]) -> dict[int, Position]:
    """The head of every shard as the log and the checkpoints say."""
    checkpointed = Checkpoints(store, queue, state.shared_key(queue)).read(HEAD)
    heads: dict[int, Position] = {}
    for shard in state.spec.log_shards():
        floor = checkpointed.get(shard, Position(0))
        # An offset checkpoint says every batch below it was written, even when the head's
        # own checkpoint lags it or every batch has expired.
        below_offsets = max((o[shard].batch - 1 for o in offsets.values() if shard in o), default=0)
        if below_offsets > floor.batch:
            floor = Position(below_offsets)
        heads[shard] = last_batch(store, queue, shard, floor)
    return heads


def rebuild_queue(store: Store, queue: QueueRef, state: QueueState) -> list[str]:
    """Make the queue's znodes again with `state` (its recorded incarnation), its heads and
    its subscribers as Cassandra knows them; what was done, one line each.

    The queue's znode gets its data last: until then readers take it for no queue, as when
    a queue is created (casque.engine.catalog).
    """
    paths = store.paths(queue)
    subscribers = recorded_subscribers(store, queue)
    checkpoints = Checkpoints(store, queue, state.shared_key(queue))
    offsets = {name: checkpoints.read(sub.ack_key(name)) for name, sub in subscribers.items()}
    heads = rebuilt_heads(store, queue, state, offsets)
    store.zk.ensure_path(paths.base)
    for path in (paths.subscribers, paths.redrive, paths.publishers):
        _create_if_absent(store, path, b"")
    _create_if_absent(store, paths.mover, _mover_cursor(state).encode())
    for shard, head in heads.items():
        raise_head(store, queue, shard, head)
    store.zk.set(paths.base, state.model_dump_json().encode())
    actions = [_count("queue", f"queue {queue} rebuilt from Cassandra (incarnation {state.incarnation or '-'}): "
                      "ZooKeeper had lost it; heads " + ", ".join(f"{s}:{h.batch}" for s, h in sorted(heads.items())))]
    for name, subscriber in sorted(subscribers.items()):
        actions.extend(rebuild_subscriber(store, queue, state, name, subscriber, offsets[name], heads))
    return actions


def raise_head(store: Store, queue: QueueRef, shard: int, head: Position) -> bool:
    """Set the shard's head (and totals) to `head` if it is lower; whether it was raised."""
    paths = store.paths(queue)
    totals = encode_totals(head.batch, *head.totals) if head.totals is not None else b""
    try:
        store.zk.create(paths.head(shard), str(head.batch).encode(), makepath=True)
        _create_if_absent(store, paths.totals(shard), totals)
        return True
    except NodeExistsError:
        pass
    while True:
        data, stat = store.zk.get(paths.head(shard))
        if decode_head(data) >= head.batch:
            return False
        transaction = store.zk.transaction()
        transaction.set_data(paths.head(shard), str(head.batch).encode(), stat.version)
        if head.totals is not None:
            transaction.set_data(paths.totals(shard), totals)
        results = transaction.commit()
        if isinstance(results[0], BadVersionError):
            continue  # a publisher moved it meanwhile: compare again
        if isinstance(results[-1], NoNodeError):
            _create_if_absent(store, paths.totals(shard), totals)
            continue
        return True


def rebuild_subscriber(store: Store, queue: QueueRef, queue_state: QueueState, name: str, state: SubscriberState,
                       checkpointed: dict[int, Position], heads: dict[int, Position] | None = None) -> list[str]:
    """Make a subscriber's znodes again with its recorded incarnation, offsets and seek epoch."""
    paths = store.paths(queue).subscriber(name)
    now = datetime.now(timezone.utc)
    wanted: dict[int, Position] = {}
    for shard in queue_state.spec.log_shards():
        found = checkpointed.get(shard)
        if found is None:
            # Never checkpointed (a subscriber older than checkpoints): from the earliest live
            # batch; ack rows of epoch 0 skip what was acked.
            head = heads[shard].batch if heads is not None else _read_head(store, queue, shard)
            found = Position(positions.earliest_batch(store, queue, shard, head, queue_state.expiry_in_order(now)))
        wanted[shard] = found
    epoch = max((p.epoch for p in wanted.values()), default=0)
    transaction = store.zk.transaction()
    transaction.create(paths.base, b"")
    for directory in (paths.offsets, paths.members, paths.leases, paths.fences, paths.cursors, paths.claims_root):
        transaction.create(directory, b"")
    transaction.create(paths.seek, _seek_record(epoch, wanted) if epoch else b"")
    for shard, position in wanted.items():
        transaction.create(paths.offset(shard), encode_offset(position.batch, position.epoch))
    failures = [r for r in transaction.commit() if isinstance(r, Exception)]
    if failures:
        if any(isinstance(f, NodeExistsError) for f in failures):
            return []  # rebuilt meanwhile by another apply
        raise next(f for f in failures if not isinstance(f, NodeExistsError))
    # Data last, as the queue's: a subscriber znode without data is no subscriber yet.
    store.zk.set(paths.base, state.model_dump_json(exclude_none=True).encode())
    return [_count("subscriber", f"subscriber {name} of queue {queue} rebuilt from Cassandra (incarnation "
                   f"{state.incarnation or '-'}, epoch {epoch}): offsets "
                   + ", ".join(f"{s}:{p.batch}" for s, p in sorted(wanted.items())))]


def raise_epoch(store: Store, queue: QueueRef, queue_state: QueueState, name: str, state: SubscriberState) -> list[str]:
    """A ZooKeeper restored from before a seek holds the older epoch: the seek record is
    raised to the latest epoch any offset was checkpointed in, so the next seek takes a new
    one (a replay must never share its ack rows with an earlier pass)."""
    paths = store.paths(queue).subscriber(name)
    checkpointed = Checkpoints(store, queue, queue_state.shared_key(queue)).read(state.ack_key(name))
    latest = max((p.epoch for p in checkpointed.values()), default=0)
    if latest == 0:
        return []
    try:
        data, stat = store.zk.get(paths.seek)
    except NoNodeError:
        return []
    if int(json.loads(data or b"{}").get("epoch", 0)) >= latest:
        return []
    try:
        store.zk.set(paths.seek, _seek_record(latest, checkpointed), version=stat.version)
    except BadVersionError:
        return []  # a seek came meanwhile: it bumped the epoch itself
    return [_count("epoch", f"subscriber {name} of queue {queue}: seek epoch raised to {latest}, its checkpoints' "
                   "(ZooKeeper held an older one)")]


def raise_heads(store: Store, queue: QueueRef, state: QueueState) -> list[str]:
    """Heads behind their checkpoints (a ZooKeeper restored from an older snapshot) raised to
    the last batch written: publishers would otherwise walk the log one lost claim at a time.
    A head at or past its checkpoint (every apply but after a restore: a checkpoint lags its
    head) costs one read and no search."""
    checkpointed = Checkpoints(store, queue, state.shared_key(queue)).read(HEAD)
    actions = []
    for shard, floor in sorted(checkpointed.items()):
        if shard not in state.spec.log_shards() or _read_head(store, queue, shard) >= floor.batch:
            continue
        head = last_batch(store, queue, shard, floor)
        if raise_head(store, queue, shard, head):
            actions.append(_count("head", f"queue {queue}: head of shard {shard} raised to {head.batch}, the last "
                                  "batch in the log (ZooKeeper held an older one)"))
    return actions


def raise_shared_offsets(store: Store, queue: QueueRef, queue_state: QueueState, name: str,
                         state: SubscriberState) -> list[str]:
    """Offsets of a shared subscriber behind their checkpoints raised to them. Shared
    delivery's completions take the offset as they find it (compare-and-set, then the
    larger), so moving it up under them is safe. Leased delivery's holder keeps its offset
    in memory and would write it back: there the next lease acquisition moves it up
    (casque.engine.leased_delivery)."""
    if state.spec.delivery != "shared":
        return []
    paths = store.paths(queue).subscriber(name)
    checkpointed = Checkpoints(store, queue, queue_state.shared_key(queue)).read(state.ack_key(name))
    actions = []
    for shard, position in sorted(checkpointed.items()):
        while True:
            try:
                data, stat = store.zk.get(paths.offset(shard))
            except NoNodeError:
                break
            offset, epoch = decode_offset(data)
            if position.order <= (epoch, offset):
                break
            try:
                store.zk.set(paths.offset(shard), encode_offset(position.batch, position.epoch), version=stat.version)
            except BadVersionError:
                continue  # a completion or a seek came first: compare again
            actions.append(_count("offset", f"subscriber {name} of queue {queue}: offset of shard {shard} raised "
                                  f"to {position.batch}@{position.epoch}, its checkpoint (ZooKeeper held "
                                  f"{offset}@{epoch})"))
            break
    return actions


def _seek_record(epoch: int, offsets: dict[int, Position]) -> bytes:
    return json.dumps({"epoch": epoch, "target": "rebuilt", "offsets": {str(s): p.batch for s, p in offsets.items()},
                       "requested_at": datetime.now(timezone.utc).isoformat()}).encode()


def _mover_cursor(state: QueueState) -> Cursor:
    """Where a rebuilt mover starts: no delayed row due before the retention is still there
    (rows live until due time + retention), and rows it moves again are stored once."""
    start = max(state.created_at, datetime.now(timezone.utc) - timedelta(seconds=state.spec.retention_seconds))
    return Cursor(start, start)


def _read_head(store: Store, queue: QueueRef, shard: int) -> int:
    try:
        data, _ = store.zk.get(store.paths(queue).head(shard))
    except NoNodeError:
        return 0
    return decode_head(data)


def _create_if_absent(store: Store, path: str, value: bytes) -> None:
    try:
        store.zk.create(path, value, makepath=True)
    except NodeExistsError:
        pass
