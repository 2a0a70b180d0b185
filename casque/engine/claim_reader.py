"""One claimed range of batches [start, end) of a shard, as the member that claimed it delivers it.

Recipe: the claim znode (casque.engine.claims) says until when the range is this member's;
the member delivers from it only while that covers a visibility timeout more, renews it
(a compare-and-set on its version) while the range is in use, and completes it once every
message is done: the claim goes and the shard's offset moves over the completed prefix in
one fenced write. The claim is still ours while it is at a version this reader wrote; an
ack row is answered only after that is read again (the taker of a lapsed claim reads the
ack rows after its takeover, so it sees the row or the ack is refused).

Connection loss: a renewal or completion that fails is retried; the claim's time, not a
ZooKeeper session, bounds what it protects, so a member cut off past it stops delivering
from the range (`releasing`) and the others take it over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kazoo.client import KazooClient

from casque.backends import zk
from casque.engine import claims, completion
from casque.engine.acks import BatchMarks
from casque.engine.batches import Batch
from casque.engine.claims import ClaimRecord
from casque.engine.completion import Completion, OffsetSeen
from casque.engine.clock import BackendClock
from casque.engine.deadletters import addressed_elsewhere
from casque.engine.keylocks import KeyLocks, key_hash
from casque.engine.member import (RETRY_MAX_SECONDS, RETRY_MIN_SECONDS, Member, dead_letter_limit, message_filter,
                                  redelivery_backoff)
from casque.engine.shard_state import ShardState
from casque.errors import BackendUnavailable, CasqueError
from casque.schema import bucket_of
from casque.znodes import SubscriberPaths, decode_offset

log = logging.getLogger(__name__)

# A range is worth renewing while its app asked for messages this recently.
DEMAND_SECONDS = 5.0
# Times one member writes and another judges (a claim's, a delivery's deadline) are trusted
# only this long after they pass. Every member reads Cassandra's clock (casque.engine.clock),
# to within its sample's error (a millisecond or so) and the coordinators' own NTP skew: this
# covers both, whatever the sidecars' clocks say.
SKEW_MARGIN_SECONDS = 1.0


def headroom(visibility: float) -> float:
    """Time beyond one visibility timeout that a claim is taken or renewed for: room to hand
    messages out without renewing for each receive, short enough that a dead member's
    range comes back soon after its deliveries' visibility ends."""
    return max(1.0, min(5.0, visibility))


def registration_of(member: Member) -> int:
    """The member's registration in its group now (casque.engine.leases)."""
    return member.leases.registrations if member.leases is not None else 0


def vouches(member: Member, registration: int) -> bool:
    return member.leases is not None and member.leases.vouches(registration)


def session_of(member: Member) -> int:
    return member.leases.session_id if member.leases is not None else 0


class RangeKeeper(Protocol):
    """The member's shared delivery, as each of its claimed ranges sees it."""

    # ZooKeeper writes of claims and completions (counted for the benchmarks).
    zk_writes: int
    # The ranges the member holds, by shard, in order of their starts.
    claims: dict[int, list[ClaimReader]]
    # Per shard, the offset znode as the member last read or wrote it, and in which
    # ZooKeeper session (saw_offset).
    offsets_seen: dict[int, tuple[int | None, OffsetSeen]]
    # The clock claims' times are written and judged by (Cassandra's, casque.engine.clock).
    clock: BackendClock

    @property
    def consumer(self) -> Member: ...

    @property
    def client(self) -> KazooClient: ...

    @property
    def paths(self) -> SubscriberPaths: ...

    @property
    def last_demand(self) -> float: ...

    def holds(self, reader: ClaimReader) -> bool: ...

    def forget(self, reader: ClaimReader) -> None: ...

    def completed(self, reader: ClaimReader, offset: int, written: bool) -> None: ...

    def space_freed(self) -> None: ...

    def locks_for(self, shard: int) -> KeyLocks | None: ...

    async def zk_call(self, method: Callable[..., Any], *args: Any) -> Any: ...


class ClaimReader:
    """One claimed range of batches [start, end) of a shard, as this member delivers it."""

    def __init__(self, sharing: RangeKeeper, record: ClaimRecord, registration: int) -> None:
        self.sharing = sharing
        self.record = record
        # The member's registration (casque.engine.leases) in which the claim was last written:
        # handing out from it needs the member to vouch it has stayed in the group since.
        self.registration = registration
        self.shard = record.shard
        self.epoch = record.epoch
        # The epoch comes from the claim, not from an offset read after a seek mark: each ack
        # reads the shard's offset znode to tell whether a seek moved it (casque.engine.acking).
        self.seek_mark: int | None = None
        self.state = ShardState(shard=record.shard, offset=record.start, locks=sharing.locks_for(record.shard),
                                backoff=redelivery_backoff(sharing.consumer),
                                matches=message_filter(sharing.consumer))
        self.problem = ""
        self.last_handout = time.monotonic()
        # Every claim version this reader wrote: the claim is still ours while it is at one of them.
        self._mine = {record.version}
        self._zk = asyncio.Lock()
        self._completing: asyncio.Task[None] | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._dropped = False
        self._released = False
        # Messages loaded in flight (at the member that had the range before), for the log.
        self.held_at_load = 0
        # The shard's cursor as this member's claim left it (None for a range taken over):
        # while it and the offset are still as the member knows them, the range completes in
        # one request (casque.engine.completion).
        self.cursor_after_claim: claims.Cursor | None = None

    # --- what the consumer needs of a source of deliveries ------------------------------------
    @property
    def current(self) -> bool:
        return not self._dropped and self.sharing.holds(self)

    @property
    def releasing(self) -> bool:
        """No new deliveries: released, the claim's time no longer covers one visibility timeout,
        or the member cannot vouch that the claim is still its own."""
        if self._released or self._dropped or not self.vouched:
            return True
        ends = self.sharing.clock.time() + self.sharing.consumer.visibility_timeout
        return bool(ends > self.record.until_ms / 1000)

    @property
    def vouched(self) -> bool:
        """Whether no other member can have taken the range over as a departed member's: the
        member has stayed in the group, its session provably alive, since it last wrote the
        claim. What it hands out while this holds is recorded before its session can end."""
        return not self._dropped and vouches(self.sharing.consumer, self.registration)

    def space_freed(self) -> None:
        self.sharing.space_freed()

    def schedule_commit(self) -> None:
        self.state.advance_offset()
        if self.complete and self._completing is None and not self._dropped:
            self._completing = asyncio.get_running_loop().create_task(self._complete_loop())
        self._publish_finished_keys()

    # --- ordered keys: the keys still open in the range ---------------------------------------
    def _open_keys(self) -> frozenset[int]:
        """Hashes of the keys of the range's messages not done (acking ones are not done)."""
        return frozenset(key_hash(entry.message.key) for loaded in self.state.batches.values()
                         for entry in loaded.entries.values() if entry.message.key is not None)

    def _publish_finished_keys(self) -> None:
        """Keys finished here stop holding back the other members' later messages of them: write
        the keys still open to the claim (one write in flight per range; those finished while
        it is in flight go in the next). Without this, a key's next message elsewhere waited
        for the whole range to complete."""
        if (self.state.locks is None or self._publishing is not None or self._dropped or self._released
                or self.complete or not self.record.keys):
            return  # a complete range clears its keys as it completes (_complete_loop)
        if self._open_keys() >= self.record.keys:
            return
        self._publishing = asyncio.get_running_loop().create_task(self._publish_keys_loop())

    async def _publish_keys_loop(self) -> None:
        try:
            while not (self._dropped or self._released or self.complete):
                # What is finished must be durable before others act on it: acks are (they are
                # answered only then), dead letters' rows are written in the background.
                await self.sharing.consumer.acks.flush()
                if not await self._write_keys(self._open_keys()):
                    break
        except CasqueError as error:
            # Not fatal: the keys stay held back longer; the next ack here tries again.
            log.info("shard %s: finished keys of claim %s not published (%s)", self.shard, self.record.name, error)
            return
        finally:
            self._publishing = None
        # A key that finished after the last look found this loop still running: look again.
        self._publish_finished_keys()

    async def _write_keys(self, keys: frozenset[int]) -> bool:
        """Write `keys` as the range's open keys; False once there is nothing more to write
        (written already, or the range is no longer ours)."""
        async with self._zk:
            keys &= self.record.keys  # only ever shrinks: another write may have come first
            if self._dropped or self._released or keys == self.record.keys:
                return False
            return await self._rewrite(self.record.until_ms, keys)

    @property
    def complete(self) -> bool:
        return self.state.offset >= self.record.end

    async def still_leased(self) -> bool:
        """Whether the claim is still at a version this reader wrote (read after an ack row is written)."""
        if self._dropped:
            return False
        async with self._zk:
            stat = await self.sharing.zk_call(
                self.sharing.client.exists_async, f"{self.sharing.paths.claims(self.shard)}/{self.record.name}")
            return stat is not None and stat.version in self._mine

    # --- claim upkeep ---------------------------------------------------------------------------
    def in_use(self, now: float) -> bool:
        """Worth renewing: messages in flight, messages waiting to be dead-lettered, or ready
        ones and an app that asks for them."""
        # (The renewal loop expired what ran out first: an app that stopped asking for
        # messages holds nothing in flight once their visibility ends.)
        if self.state.in_flight:
            return True
        if self.state.waits_for_dead_letters(dead_letter_limit(self.sharing.consumer)):
            return True  # their wait ends in the dead-letter queue: this member moves them then
        return self.state.loaded_messages > 0 and now - self.sharing.last_demand < DEMAND_SECONDS

    async def renew_past(self, wall_deadline: float, dead_letter: bool = False) -> bool:
        """Make the claim last past a delivery's new visibility deadline (wall-clock seconds).
        `dead_letter`: the delivery was the message's last (it goes to the dead-letter queue
        at that deadline unless acked): the claim must say so before the app has it, or the
        range of a member killed now would wait for an app to ask before anyone moves it."""
        woken = dead_letter and not 0 < self.record.wake_ms <= int(wall_deadline * 1000)
        if wall_deadline * 1000 <= self.record.until_ms and not woken:
            return True
        visibility = self.sharing.consumer.visibility_timeout
        return await self.renew(int((wall_deadline + headroom(visibility)) * 1000), rewrite=woken)

    async def renew(self, until_ms: int, rewrite: bool = False) -> bool:
        """Extend the claim to `until_ms` (never shorten it); False if it is no longer ours.
        A claim last written before the member's latest registration is rewritten whatever
        its time (only that proves nobody took it over while the member was gone), and so is
        one the caller wants `rewrite`n."""
        if self._dropped or self._released:
            return False
        async with self._zk:
            if (self.record.until_ms >= until_ms and not rewrite
                    and self.registration == registration_of(self.sharing.consumer)):
                return True
            return await self._rewrite(max(until_ms, self.record.until_ms))

    def _wake_ms(self) -> int:
        """When a message here is due for the dead-letter queue at the latest (ms, wall clock; 0:
        none): written with every rewrite of the claim (casque.engine.claims)."""
        now = time.monotonic()
        due = self.state.dead_letter_due(dead_letter_limit(self.sharing.consumer), now)
        return 0 if due is None else int(self.sharing.clock.wall_of(due) * 1000)

    async def _rewrite(self, until_ms: int, keys: frozenset[int] | None = None) -> bool:
        """Rewrite our claim record (under `self._zk`); False, and the range dropped, if another
        member took it over."""
        registration = registration_of(self.sharing.consumer)  # before the write: a later one needs another
        updated = await claims.rewrite(self.sharing.client, self.sharing.paths, self.record,
                                       self.record.member, until_ms, keys, session_of(self.sharing.consumer),
                                       self._wake_ms())
        self.sharing.zk_writes += 1
        if updated is None:
            self.drop("taken over by another member")
            return False
        self.record = updated
        self.registration = registration
        self._mine.add(updated.version)
        return True

    async def release(self) -> None:
        """Give the range up at once (the member stops or no longer uses it): others take it now,
        or, with a message due for the dead-letter queue, at its time whether or not their apps
        ask for messages (its `wake`)."""
        if self._dropped or self._released:
            return
        self._released = True
        async with self._zk:
            try:
                released = await claims.rewrite(self.sharing.client, self.sharing.paths, self.record,
                                                self.record.member, 0, wake_ms=self._wake_ms())
                self.sharing.zk_writes += 1
                if released is not None:
                    self.record = released
            except BackendUnavailable as error:
                log.info("claim %s/%s not released (%s); it lapses", self.shard, self.record.name, error)
        self.drop("released")

    def drop(self, why: str) -> None:
        if self._dropped:
            return
        self._dropped = True
        log.info("shard %s: claim %s..%s dropped: %s", self.shard, self.record.start, self.record.end - 1, why)
        self.sharing.forget(self)

    async def _complete_loop(self) -> None:
        backoff = RETRY_MIN_SECONDS
        try:
            while not self._dropped:
                await self.sharing.consumer.acks.flush()
                try:
                    known = offset_known(self.sharing, self.shard)
                    next_held = self._next_held()
                    alone = completion.may_complete_alone(self.record, known, self.cursor_after_claim, next_held)
                    if self.state.locks is not None and self.record.keys and not alone:
                        # Free the range's keys with one plain write first: the completion
                        # below reads three znodes and contends with every other completion
                        # for the shard's offset, and other members' keys wait for it (one
                        # that needs no reads frees them as soon, deleting the claim).
                        await self._write_keys(frozenset())
                        if self._dropped:
                            return
                    async with self._zk:
                        outcome, offset, seen = await completion.complete(
                            self.sharing.client, self.sharing.paths, self.record, known, self.cursor_after_claim,
                            next_held)
                    self.sharing.zk_writes += 1
                    if seen is not None:
                        saw_offset(self.sharing, self.shard, seen)
                except CasqueError as error:
                    self.problem = f"completing: {error}"
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_SECONDS)
                    continue
                self.problem = ""
                if outcome is Completion.LOST:
                    self.drop("taken over before it was completed")
                    return
                if outcome is Completion.ENDED:
                    self.drop("its shard went to leased delivery, which reads the range's acks from their rows")
                    return
                # DONE, or MOOT (a seek replays or skips the range).
                self.sharing.completed(self, offset, written=outcome is Completion.DONE)
                self._dropped = True
                self.sharing.forget(self)
                return
        finally:
            self._completing = None

    def _next_held(self) -> bool:
        """Whether this member holds the range that starts where this one ends."""
        return any(other.record.start == self.record.end and other.epoch == self.epoch and other.current
                   for other in self.sharing.claims.get(self.shard, []))


def saw_offset(keeper: RangeKeeper, shard: int, seen: OffsetSeen) -> None:
    """Keep the newest of what the member read or wrote of the shard's offset: the higher
    version, in this ZooKeeper session (a rebuild after ZooKeeper lost its data makes the
    znode again, its versions from 0, and has ended every session; casque.engine.rebuild)."""
    session = _session(keeper)
    known = keeper.offsets_seen.get(shard)
    if known is None or known[0] != session or seen.version > known[1].version:
        keeper.offsets_seen[shard] = (session, seen)


def offset_known(keeper: RangeKeeper, shard: int) -> OffsetSeen | None:
    """The shard's offset as last seen in this session, if it was."""
    known = keeper.offsets_seen.get(shard)
    return known[1] if known is not None and known[0] == _session(keeper) else None


def _session(keeper: RangeKeeper) -> int | None:
    client_id = keeper.client.client_id
    return None if client_id is None else int(client_id[0])


async def load_claim_reader(keeper: RangeKeeper, record: ClaimRecord, registration: int, batches: list[Batch],
                            alongside: Awaitable[object], cursor: claims.Cursor | None = None) -> ClaimReader:
    """A reader of the range, loaded with its batches and what the ack rows say: done, in
    flight at a member that had the range before (until the deadline recorded with the
    delivery, plus the skew margin), and nacked (waiting until the time the nack recorded).
    `registration`: the member's when it wrote the claim; `cursor`: as its claim left it.
    `alongside` is awaited with the reads (they are all on the way from publish to delivery)."""
    reader = ClaimReader(keeper, record, registration)
    reader.cursor_after_claim = cursor
    member = keeper.consumer
    # Batches below the offset are done. Only leased delivery, before a switch to sharing,
    # can have moved the offset past the cursor (with no ack rows for whole batches).
    marks, (data, offset_stat), _ = await asyncio.gather(
        member.acks.load_bucket(record.epoch, record.shard, bucket_of(record.start), record.start),
        zk.call(keeper.client.get_async, keeper.paths.offset(record.shard)),
        alongside)
    member.counters.ack_bucket_reads += 1
    offset, epoch = decode_offset(data)
    saw_offset(keeper, record.shard, OffsetSeen(offset, epoch, offset_stat.version))
    done_below = offset if epoch == record.epoch else record.start
    by_batch = {b.header.batch: b for b in batches}
    now, now_ms = time.monotonic(), keeper.clock.ms()
    margin_ms = int(SKEW_MARGIN_SECONDS * 1000)
    for number in range(record.start, record.end):
        batch = by_batch.get(number)
        mark = marks.get(number, BatchMarks())
        if batch is None or number < done_below:
            reader.state.add_batch(number, [])  # expired or done: nothing left to deliver
            continue
        skipped = {m.position.seq for m in batch.messages if addressed_elsewhere(m, member.subscriber)}
        held = {seq: now + (until + margin_ms - now_ms) / 1000 for seq in mark.visible_until
                if (until := mark.in_flight_until(seq)) is not None and until + margin_ms > now_ms}
        # A nacked message (or one backing off after its visibility ended) waits until its
        # time, no margin: nobody holds it.
        waiting = {seq: now + (until - now_ms) / 1000 for seq in mark.deliveries
                   if seq not in mark.done and seq not in held
                   and (until := mark.resting_until(seq, reader.state.backoff, now_ms)) is not None and until > now_ms}
        reader.state.add_batch(number, batch.messages, mark.done | skipped, mark.deliveries, held, waiting)
        reader.held_at_load += len(held)
    return reader
