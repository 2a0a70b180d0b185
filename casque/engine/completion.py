"""Completing a claimed range (the recipe in casque.engine.claims): its claim deleted and the
shard's offset moved over the completed prefix, in one multi that checks the offset's version,
so completions are serialised and none leaves the offset behind a range completed beside it.

The offset's target is the lowest start of the claims still open, or the cursor when none is.
A completion reads the offset, the cursor and the claims to find it; a holder that knows the
shard is as it left it needs no reads (`_complete_alone`): at a trickle, where ranges are a
message or two, that is three requests of a completion's four.

Connection states: every call is one request; a lost connection surfaces as
BackendUnavailable, and the caller completes again (a completion that was written answers
LOST the second time: its claim is gone, and the offset moved with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from casque.backends import zk
from casque.engine import claims
from casque.engine.claims import ClaimRecord, Cursor
from casque.znodes import SubscriberPaths, decode_offset, encode_offset


@dataclass(frozen=True)
class OffsetSeen:
    """The shard's offset znode as a member read or wrote it: its batch, epoch and version."""

    offset: int
    epoch: int
    version: int


class Completion(Enum):
    DONE = "done"  # the claim is gone and the offset covers what it allows
    LOST = "lost"  # another member took the claim over (or it was removed): nothing written
    MOOT = "moot"  # a seek moved the shard to another epoch: the range no longer counts
    ENDED = "ended"  # a member in leased delivery holds the shard: the claim is deleted, the offset left alone


class Completed(NamedTuple):
    outcome: Completion
    offset: int  # the offset written (DONE), else as read
    seen: OffsetSeen | None  # the offset znode as a DONE left it, for the holder's next completion


async def complete(client: KazooClient, paths: SubscriberPaths, record: ClaimRecord, seen: OffsetSeen | None = None,
                   cursor: Cursor | None = None, next_held: bool = False) -> Completed:
    """Delete a finished claim and move the offset as far as the open claims allow.

    What the holder knows may spare the reads (`_complete_alone`): `seen`, the offset as it
    last read or wrote it; `cursor`, the cursor as this range's claim left it; `next_held`,
    whether it holds the range that starts where this one ends. Otherwise, or when the shard
    moved on since, the offset, the cursor and the claims are read first."""
    if seen is not None:
        alone = await _complete_alone(client, paths, record, seen, cursor, next_held)
        if alone is not None:
            return alone
    while True:
        data, offset_stat = await zk.call(client.get_async, paths.offset(record.shard))
        offset, epoch = decode_offset(data)
        if epoch != record.epoch:
            if await claims.still_held(client, paths, record):
                await claims.delete_claim(client, paths, record.shard, record.name)
            return Completed(Completion.MOOT, offset, None)
        cursor_now = await claims.read_cursor(client, paths, record.shard)
        names = await claims.list_claims(client, paths, record.shard)
        starts = [int(n.partition("-")[2]) for n in names if n != record.name and n.startswith(f"{epoch}-")]
        bound = cursor_now.next if cursor_now is not None and cursor_now.epoch == epoch else record.end
        target = max(offset, min([*starts, bound]))
        transaction = client.transaction()
        claims.assert_unleased(transaction, paths, record.shard)
        transaction.delete(f"{paths.claims(record.shard)}/{record.name}", record.version)
        transaction.set_data(paths.offset(record.shard), encode_offset(target, epoch), offset_stat.version)
        try:
            results = claims.past_lease_check(await zk.call(transaction.commit_async), record.shard)
        except claims.ShardLeased:
            return Completed(await _end_under_lease(client, paths, record), offset, None)
        claim_result, offset_result = results
        if isinstance(claim_result, (BadVersionError, NoNodeError)):
            return Completed(Completion.LOST, offset, None)
        if isinstance(offset_result, BadVersionError):
            continue  # another completion or a seek came first: read again
        claims.raise_failure(results, "completing a claim")
        return Completed(Completion.DONE, target, OffsetSeen(target, epoch, int(offset_result.version)))


def may_complete_alone(record: ClaimRecord, seen: OffsetSeen | None, cursor: Cursor | None, next_held: bool) -> bool:
    """Whether what the holder knows lets the range complete without reads (_complete_alone)."""
    if seen is None or seen.epoch != record.epoch or seen.offset != record.start:
        return False
    return next_held or (cursor is not None and cursor.epoch == record.epoch and cursor.next == record.end)


async def _complete_alone(client: KazooClient, paths: SubscriberPaths, record: ClaimRecord, seen: OffsetSeen,
                          cursor: Cursor | None, next_held: bool) -> Completed | None:
    """Complete the range in one multi, without reading, when the offset is still at the
    range's start (version `seen`) and either the holder holds the range that starts at this
    one's end, or the cursor is still where this range's claim left it, at its end (version
    `cursor`). No claim of the epoch below the offset can be open (every completion leaves
    the offset at or below each open start), so the offset belongs at this range's end: the
    next range starts there, or, with the cursor unmoved, nothing was claimed since. That is
    where `complete` would put it after its three reads.

    The next range cannot have gone meanwhile without the offset's version changing: its
    completion would have written the offset (held back at this range's start), a seek
    writes every offset, and a lease, which ends claims, fails the multi's first check.
    None when the shard is not so (nothing written): the caller reads and judges as usual.
    At a trickle, where ranges are a message or two, this saves three of a completion's four
    requests."""
    if not may_complete_alone(record, seen, cursor, next_held):
        return None
    transaction = client.transaction()
    claims.assert_unleased(transaction, paths, record.shard)
    transaction.delete(f"{paths.claims(record.shard)}/{record.name}", record.version)
    transaction.set_data(paths.offset(record.shard), encode_offset(record.end, record.epoch), seen.version)
    if not next_held and cursor is not None:
        transaction.check(paths.cursor(record.shard), cursor.version)
    try:
        results = claims.past_lease_check(await zk.call(transaction.commit_async), record.shard)
    except claims.ShardLeased:
        return Completed(await _end_under_lease(client, paths, record), seen.offset, None)
    if isinstance(results[0], (BadVersionError, NoNodeError)):
        return Completed(Completion.LOST, seen.offset, None)
    if any(isinstance(result, Exception) for result in results):
        return None  # the offset or the cursor moved since (or a seek came)
    return Completed(Completion.DONE, record.end, OffsetSeen(record.end, record.epoch, int(results[1].version)))


async def _end_under_lease(client: KazooClient, paths: SubscriberPaths, record: ClaimRecord) -> Completion:
    """A finished range of a shard a member in leased delivery now holds: `end_sharing` may
    have deleted claims above it already, so moving the offset past the range (to the next
    claim still open, or the cursor) could pass ranges whose messages nobody acked. The
    offset stays; the leased reader reads it after every claim is gone and finds this
    range's acks in their rows. Deleting the claim now spares it the wait for its time."""
    try:
        await zk.call(client.delete_async, f"{paths.claims(record.shard)}/{record.name}", record.version)
    except (BadVersionError, NoNodeError):
        return Completion.LOST
    return Completion.ENDED
