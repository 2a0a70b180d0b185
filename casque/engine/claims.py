"""Batch claims: the members of a shared subscriber divide each shard's batches between them.

Recipe, per subscriber and shard (paths in casque.znodes):

    .../cursors/{shard}                  "N@E": batch N is the first nobody has claimed in seek epoch E
    .../claims/{shard}/{E}-{start}       JSON {member, end, until[, keys, session, wake]}: batches
                                         [start, end) are being delivered by `member` until
                                         `until` (ms, wall clock)

- A member claims the next range by moving the cursor from N to N+k (compare-and-set on
  the cursor's version) and creating the range's claim znode, in one multi: ranges never
  overlap, and there is one ZooKeeper write per range, not per message.
- A claim is not ephemeral: a member that dies or pauses keeps it only until `until`, after
  which any member takes it over by rewriting its data with a compare-and-set on the claim's
  version. The version names the holder: the holder's ack rows count only if the version is
  still its own after they are written (the taker reads the ack rows after its takeover),
  and a completion is a multi that checks it. So a member that lost a claim without
  noticing can neither complete it nor have an ack answered as done. Clocks only decide
  when a takeover may happen (a fast clock redelivers early, it never loses a message).
- Completing a range deletes its claim and moves the shard's offset, in one multi that
  checks both versions: the offset becomes the lowest start of the claims still open, or the
  cursor when none is. The offset is read first, then the cursor, then the claims: a claim
  created after the cursor was read starts at or above that cursor, and one deleted after
  the claims were read only leaves the offset lower than it could be, which the next
  completion corrects. Every completion writes the offset (version checked), so completions
  are serialised and none leaves the offset behind a range completed concurrently. A holder
  that knows the offset is still at its range's start, and that nothing can be open above
  the range but its own next one (the cursor unmoved since its claim, or the next range its
  own), completes without the reads, in one multi that checks what it knows
  (casque.engine.completion).
- Batches below the head that no read returns have expired: the cursor moves over them with
  nothing claimed, and the offset with it (the same rule, in the same multi), since no
  range of them will ever complete to move it.
- With ordered keys a claim carries the 32-bit hashes of its range's keys that are still
  open (a message not done). It starts with all of them; its holder writes the set again
  (a compare-and-set like a renewal) once keys are finished in it, after their acks are
  durable, so others stop waiting for those keys before the whole range completes. A key
  finished stays finished (done is durable, and a taker reads the ack rows), so the set
  only shrinks and a taker keeps it as it finds it.
- A claim written with a message in it that goes to the dead-letter queue when its wait or
  visibility ends (it was delivered max deliveries times) says when, at the latest (`wake`,
  ms): members take ranges over when their apps ask for messages, so a released or lapsed
  range with a `wake` is taken over at that time by a member whose app asks for nothing,
  and the message is dead-lettered on time whether or not anyone receives. An earlier
  `wake` than the truth costs a takeover, never a message; older members drop the field.
- Leases and claims never serve one shard at once (a subscriber switching between leased
  and shared delivery has members of both for a moment). A claim, and a skip that moves the
  offset, assert in their multi that the shard has no lease znode (a create and a delete of
  it, which fail together while it exists); a member that acquires a lease ends the shard's
  claims (each once released or out of time) and deletes its cursor (`end_sharing`) before
  it reads the offset and the ack rows. A completion asserts the same: once the lease exists
  it deletes its claim and leaves the offset alone, since the claims above it may be gone
  already and the next open start or the cursor would pass ranges nobody finished. A
  claim's holder checks the claim after each ack row, so an ack answered `acked` was
  written before the claim went, and the leased reader, reading after, sees it; one written
  after is refused. Without the cursor, shared members
  of a later switch back claim from the offset again, not past ranges whose claims went.
- A seek writes the offsets with a new epoch and resets the cursors (casque.engine.offsets).
  Claims of an older epoch are moot: their completion leaves the offset alone, and members
  delete them when they meet them.

Connection states: every call is one request; connection loss surfaces as
BackendUnavailable and the caller retries. A claim outlives sessions on purpose: what it
protects is bounded by its time, not by a session, so nothing waits for a session to expire.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from casque.backends import zk
from casque.errors import BackendUnavailable, SubscriberNotFound
from casque.znodes import SubscriberPaths, decode_offset, encode_offset


# How often a member that acquired a lease looks again at claims it waits to end (end_sharing).
CLAIM_END_POLL_SECONDS = 0.1


class ShardLeased(BackendUnavailable):
    """A member in leased delivery holds the shard: no claim may be made on it (the
    subscriber is switching delivery modes, and this member has not switched yet)."""

    code = "shard_leased"


@dataclass(frozen=True)
class Cursor:
    next: int
    epoch: int
    version: int


@dataclass(frozen=True)
class ClaimRecord:
    shard: int
    epoch: int
    start: int
    end: int
    member: str
    until_ms: int
    version: int
    # Hashes of the keys in the range (casque.engine.keylocks), kept only for ordered keys.
    keys: frozenset[int] = frozenset()
    # The ZooKeeper session of the member when it wrote the claim (0: not known): once that
    # session has ended, the claim may be taken over before its time (casque.engine.sharing).
    session: int = 0
    # When (ms, wall clock) a message in the range is due for the dead-letter queue at the
    # latest, as its holder last wrote it (0: none): see the module's recipe.
    wake_ms: int = 0

    @property
    def name(self) -> str:
        return claim_name(self.epoch, self.start)

    def data(self) -> bytes:
        fields: dict[str, object] = {"member": self.member, "end": self.end, "until": self.until_ms}
        if self.keys:
            fields["keys"] = sorted(self.keys)
        if self.session:
            fields["session"] = self.session
        if self.wake_ms:
            fields["wake"] = self.wake_ms
        return json.dumps(fields).encode()


# A backlog of up to this many messages is claimed whole, not split over the group's members:
# each claim costs a Cassandra read and a ZooKeeper write before its first message goes out,
# so a steady trickle split over two members made claims of a message or two, and messages
# queued behind claims (shared delivery's p50 at 100 msgs/s was 200 ms, leased 15 ms).
WHOLE_CLAIM_MESSAGES = 10


def claim_target(available: int, members: int, most: int) -> int:
    """Messages a new range takes of the `available` ones: a backlog of up to
    WHOLE_CLAIM_MESSAGES whole, a larger one split over the group's `members` so that it still
    reaches every member; never more than `most`, never less than one batch."""
    share = max(min(available, WHOLE_CLAIM_MESSAGES), available // max(1, members))
    return max(1, min(most, share))


def claim_name(epoch: int, start: int) -> str:
    # Zero-padded, so that names sort by start within an epoch.
    return f"{epoch}-{start:015d}"


def parse_claim(shard: int, name: str, data: bytes, version: int) -> ClaimRecord:
    epoch, _, start = name.partition("-")
    fields = json.loads(data)
    return ClaimRecord(shard, int(epoch), int(start), int(fields["end"]), str(fields["member"]),
                       int(fields["until"]), version, frozenset(int(k) for k in fields.get("keys", ())),
                       int(fields.get("session", 0)), int(fields.get("wake", 0)))


async def read_cursor(client: KazooClient, paths: SubscriberPaths, shard: int) -> Cursor | None:
    try:
        data, stat = await zk.call(client.get_async, paths.cursor(shard))
    except NoNodeError:
        return None
    next_batch, epoch = decode_offset(data)
    return Cursor(next_batch, epoch, stat.version)


async def ensure_dirs(client: KazooClient, paths: SubscriberPaths, shard: int) -> None:
    """The shard's claims directory and the cursors directory. Never with makepath: that would
    bring back a subscriber deleted meanwhile, empty.

    Only the missing ones: ZooKeeper checks the parent's ACL before it says a znode exists,
    and the cursors and claims containers are the installation's to create (they come with
    the subscriber), so a create of one that exists is refused, not NodeExists."""
    for path in (paths.cursors, paths.claims_root, paths.claims(shard)):
        if await zk.call(client.exists_async, path) is not None:
            continue
        try:
            await zk.call(client.create_async, path, b"")
        except NodeExistsError:
            pass
        except NoNodeError as error:
            raise SubscriberNotFound(f"subscriber {paths.name} was deleted") from error


async def ensure_cursor(client: KazooClient, paths: SubscriberPaths, shard: int) -> Cursor:
    """The shard's cursor, created at the offset if missing and moved up to the offset if a
    seek (a new epoch) or leased delivery (before a switch to sharing) left it behind."""
    while True:
        data, _ = await zk.call(client.get_async, paths.offset(shard))
        offset, epoch = decode_offset(data)
        cursor = await read_cursor(client, paths, shard)
        if cursor is None:
            try:
                await zk.call(client.create_async, paths.cursor(shard), encode_offset(offset, epoch))
            except NodeExistsError:
                pass
            except NoNodeError:
                await ensure_dirs(client, paths, shard)
            continue
        if cursor.epoch == epoch and cursor.next >= offset:
            return cursor
        if cursor.epoch > epoch:
            return cursor  # the seek's offsets are written with its cursors: read again soon
        try:
            stat = await zk.call(client.set_async, paths.cursor(shard), encode_offset(offset, epoch), cursor.version)
        except BadVersionError:
            continue
        return Cursor(offset, epoch, stat.version)


async def current_cursor(client: KazooClient, paths: SubscriberPaths, shard: int, known: Cursor | None) -> Cursor:
    """The shard's cursor as it is now. One read when one of the same epoch is `known` here:
    claiming from a cursor left behind the offset claims only batches the range's reader
    finds done, and a completion never moves the offset back. Else `ensure_cursor`."""
    if known is not None:
        cursor = await read_cursor(client, paths, shard)
        if cursor is not None and cursor.epoch == known.epoch:
            return cursor
    return await ensure_cursor(client, paths, shard)


async def claim_range(
    client: KazooClient, paths: SubscriberPaths, shard: int, cursor: Cursor, end: int, member: str, until_ms: int,
    keys: frozenset[int] = frozenset(), session: int = 0,
) -> tuple[ClaimRecord | None, Cursor | None]:
    """Claim batches [cursor.next, end). Returns the claim, or None and the cursor as it is now
    (another member moved it first)."""
    record = ClaimRecord(shard, cursor.epoch, cursor.next, end, member, until_ms, 0, keys, session)
    transaction = client.transaction()
    assert_unleased(transaction, paths, shard)
    transaction.set_data(paths.cursor(shard), encode_offset(end, cursor.epoch), cursor.version)
    transaction.create(f"{paths.claims(shard)}/{record.name}", record.data())
    results = past_lease_check(await zk.call(transaction.commit_async), shard)
    cursor_result, claim_result = results
    if isinstance(cursor_result, BadVersionError):
        return None, await read_cursor(client, paths, shard)
    if isinstance(claim_result, NodeExistsError):
        # A range starting here exists though the cursor was here: a claim of this epoch
        # left by a seek back to the same batch. It is moot; remove it and try again.
        await delete_claim(client, paths, shard, record.name)
        return None, await read_cursor(client, paths, shard)
    if isinstance(claim_result, NoNodeError):
        await ensure_dirs(client, paths, shard)
        return None, await read_cursor(client, paths, shard)
    raise_failure(results, "claiming batches")
    return record, Cursor(end, cursor.epoch, int(cursor_result.version))


async def skip_range(client: KazooClient, paths: SubscriberPaths, cursor: Cursor, shard: int, end: int) -> bool:
    """Move the cursor over batches known to be gone (expired): there is nothing to claim.

    The offset moves with it, in the same multi, as a completion would move it (to the lowest
    start of the claims still open, or the new cursor): no range of the skipped batches will
    ever complete to move it, and a shard with nothing left would otherwise show lag, and a
    stall, until its next publish. The claims are listed after `cursor` was read, and the
    multi checks the cursor's version, so no claim made since can be below the target.
    Returns False when the cursor moved meanwhile (another member claimed or skipped)."""
    while True:
        data, offset_stat = await zk.call(client.get_async, paths.offset(shard))
        offset, epoch = decode_offset(data)
        transaction = client.transaction()
        assert_unleased(transaction, paths, shard)
        transaction.set_data(paths.cursor(shard), encode_offset(end, cursor.epoch), cursor.version)
        if epoch == cursor.epoch:
            starts = [int(n.partition("-")[2]) for n in await list_claims(client, paths, shard)
                      if n.startswith(f"{epoch}-")]
            target = max(offset, min([*starts, end]))
            if target > offset:
                transaction.set_data(paths.offset(shard), encode_offset(target, epoch), offset_stat.version)
        results = past_lease_check(await zk.call(transaction.commit_async), shard)
        if isinstance(results[0], BadVersionError):
            return False
        if len(results) > 1 and isinstance(results[1], BadVersionError):
            continue  # a completion or a seek wrote the offset first: read it again
        raise_failure(results, "skipping expired batches")
        return True


async def list_claims(client: KazooClient, paths: SubscriberPaths, shard: int) -> list[str]:
    try:
        return sorted(await zk.call(client.get_children_async, paths.claims(shard)))
    except NoNodeError:
        return []


async def read_claim(
    client: KazooClient, paths: SubscriberPaths, shard: int, name: str, watch: Callable[..., object] | None = None,
) -> ClaimRecord | None:
    """The claim as it is now; with `watch`, kazoo calls it (in its own thread) once the claim
    changes or goes (not when it is missing now)."""
    try:
        if watch is None:
            data, stat = await zk.call(client.get_async, f"{paths.claims(shard)}/{name}")
        else:
            data, stat = await zk.call(client.get_async, f"{paths.claims(shard)}/{name}", watch=watch)
    except NoNodeError:
        return None
    return parse_claim(shard, name, data, stat.version)


async def rewrite(
    client: KazooClient, paths: SubscriberPaths, record: ClaimRecord, member: str, until_ms: int,
    keys: frozenset[int] | None = None, session: int | None = None, wake_ms: int | None = None,
) -> ClaimRecord | None:
    """Renew (same member), release (until 0) or take over (another member) a claim, or publish
    the keys still open in it (`keys`, ordered keys only: a subset of those it had), if it is
    still at the version `record` was read at; None if it changed or is gone. `wake_ms`: the
    range's dead-letter time as the writer knows it (None keeps the record's)."""
    updated = replace(record, member=member, until_ms=until_ms, keys=record.keys if keys is None else keys,
                      session=record.session if session is None else session,
                      wake_ms=record.wake_ms if wake_ms is None else wake_ms)
    try:
        stat = await zk.call(client.set_async, f"{paths.claims(record.shard)}/{record.name}", updated.data(),
                             record.version)
    except (BadVersionError, NoNodeError):
        return None
    return replace(updated, version=stat.version)


async def departed(client: KazooClient, paths: SubscriberPaths, record: ClaimRecord) -> bool:
    """Whether the session that wrote the claim has ended (its member's znode is gone, or is
    a later session's) or its member left the group: it hands out nothing from the claim any
    more without rewriting it first (casque.engine.claim_reader)."""
    if not record.session:
        return False  # written by a member that does not say: wait for its time
    stat = await zk.call(client.exists_async, paths.member(record.member))
    return stat is None or stat.ephemeralOwner != record.session


async def still_held(client: KazooClient, paths: SubscriberPaths, record: ClaimRecord) -> bool:
    stat = await zk.call(client.exists_async, f"{paths.claims(record.shard)}/{record.name}")
    return stat is not None and stat.version == record.version


async def delete_claim(client: KazooClient, paths: SubscriberPaths, shard: int, name: str) -> None:
    try:
        await zk.call(client.delete_async, f"{paths.claims(shard)}/{name}")
    except NoNodeError:
        pass


async def end_sharing(client: KazooClient, paths: SubscriberPaths, shard: int, now_ms: Callable[[], int],
                      skew_ms: int) -> int:
    """End shared delivery of `shard`: called by a member in leased delivery once it holds the
    shard's lease, before it reads the offset and the ack rows (see the recipe). No claim can
    be made once the lease exists. A claim still in use is let run until its holder releases
    it (a member switching modes releases its claims as it stops) or until the time it had
    when first seen, plus `skew_ms`: an ack its holder answers meanwhile is answered
    `acked`, and its row is there when the offset and the ack rows are read. Then the claim
    is deleted, whatever its version, and every later ack of its holder is refused.

    The cursor goes too: the leased reader delivers from the offset, and the ranges between
    the offset and the cursor lose the claims that covered them, so shared members of a later
    switch back must claim from the offset (ensure_cursor makes the cursor there), not from
    past those ranges. Returns how many claims there were."""
    names = await list_claims(client, paths, shard)
    deadlines: dict[str, int] = {}
    for name in names:
        record = await read_claim(client, paths, shard, name)
        if record is not None:
            deadlines[name] = record.until_ms + skew_ms
    while deadlines:
        for name, deadline in list(deadlines.items()):
            record = await read_claim(client, paths, shard, name)
            if record is None or record.until_ms == 0 or now_ms() >= deadline:
                await delete_claim(client, paths, shard, name)
                del deadlines[name]
        if deadlines:
            await asyncio.sleep(CLAIM_END_POLL_SECONDS)
    try:
        await zk.call(client.delete_async, paths.cursor(shard))
    except NoNodeError:
        pass
    return len(names)


def assert_unleased(transaction: TransactionRequest, paths: SubscriberPaths, shard: int) -> None:
    """The first two operations of a multi that must not run while the shard has a lease."""
    transaction.create(paths.lease(shard), b"")
    transaction.delete(paths.lease(shard))


def past_lease_check(results: list[Any], shard: int) -> list[Any]:
    """The results of a multi begun with `assert_unleased`, without its two; raises
    ShardLeased if the lease existed."""
    if isinstance(results[0], NodeExistsError):
        raise ShardLeased(f"shard {shard} is read by a member in leased delivery: no batches are claimed from it "
                          "until this member switches too")
    if isinstance(results[0], Exception) and not isinstance(results[0], RolledBackError):
        raise BackendUnavailable(f"shard {shard}: its lease could not be checked: {results[0]!r}")
    return results[2:]


def raise_failure(results: list[object], what: str) -> None:
    failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
    if failures:
        raise BackendUnavailable(f"ZooKeeper refused {what}: {failures[0]!r}")
