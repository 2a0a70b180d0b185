"""Shared delivery: one member's part of a subscriber whose members all deliver from every shard.

Each member claims ranges of batches (casque.engine.claims) when its app asks for messages
and few are ready here, delivers them with receipts and visibility as leased delivery does
(one ShardState per range), records acks in the subscriber's ack rows, and completes a range
once every message in it is done: the range's claim goes and the shard's offset moves over
the completed prefix, in one fenced ZooKeeper write. So ZooKeeper sees about two writes per
range, whatever the number of members.

Time bounds what a claim protects, not a session: a range is delivered only while its claim
lasts for at least a visibility timeout more, and the member renews the claims it is using
before that. A member that dies, pauses or stops asking for messages lets its claims lapse,
and the others take them over after the claim's time (plus a margin for clock skew) and
deliver what was not done, reading the ack rows after taking over. Nothing here waits for a
ZooKeeper session to expire.

A member whose app asks for nothing still takes over a range that was released, or whose
member died, once the claim's `wake` has come (a message in it is due for the dead-letter
queue: casque.engine.claims), so dead letters move on time with nobody receiving.

Stepped back (the member cannot reach Cassandra: casque.engine.reachability): it claims
nothing, releases at once the ranges with nothing in flight, and renews none, so the
others take over the rest once their deliveries' visibility has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from casque.backends import zk
from casque.engine import claims, completion, gaps
from casque.engine.batches import Batch
from casque.engine.claim_reader import (DEMAND_SECONDS, ClaimReader, headroom, load_claim_reader, registration_of,
                                        session_of, vouches)
from casque.engine.claim_turns import ClaimTurns
from casque.engine.claims import ClaimRecord, Cursor
from casque.engine.clock import clock_of
from casque.engine.foreign_ranges import ForeignRanges
from casque.engine.heads import WatchedHeads
from casque.engine.keylocks import KeyLocks, key_hash
from casque.engine.lapsed_ranges import LapsedRanges, SeekAhead
from casque.engine.member import RETRY_MAX_SECONDS, RETRY_MIN_SECONDS, Member, ShardStatus, dead_letter_limit
from casque.engine.messages import Delivery, Position
from casque.errors import BackendUnavailable, CasqueError
from casque.specs import by_priority
from casque.znodes import decode_offset

log = logging.getLogger(__name__)

# A claim takes whole batches until it holds at least this many messages (one batch at least):
# two ZooKeeper writes per claim stay under ten per 1,000 messages.
CLAIM_MESSAGES = 256
# ... or this many with ordered keys. A range holds back its keys at the other members until
# they finish in it, and its holder hands out a key's messages one after the other: a large
# range behind a backlog holds every key, so the group delivered at the pace of one member.
ORDERED_CLAIM_MESSAGES = 32
# A member claims more while fewer than this many messages are ready (loaded, not handed out) here.
CLAIM_LOW_WATER = 64
# ... and only while its app asked for messages within DEMAND_SECONDS: an idle member hoards nothing.
# ... and while it holds (loaded, in flight included) fewer messages and bytes than these: an app that
# receives and never acks cannot make it read the whole backlog into memory (a sidecar has 256 MiB).
MAX_LOADED_MESSAGES = 4000
MAX_LOADED_BYTES = 16 * 1024 * 1024
# With nothing to claim, look again this often (claims of others lapse without a watch firing).
RECHECK_SECONDS = 2.0
RENEW_INTERVAL_SECONDS = 0.5
SCAN_SECONDS = 1.0
# With no app asking, look this often for ranges with messages due for the dead-letter queue
# (a claim's `wake`): how late such a message may be moved after a member stopped or died.
WAKE_SCAN_SECONDS = 5.0
STOP_COMPLETION_SECONDS = 10.0


class SharedDelivery:
    """The claims one consumer holds over all shards of its subscriber, and their upkeep."""

    def __init__(self, consumer: Member, shards: list[int]) -> None:
        self.consumer = consumer
        self.client = consumer.store.zk
        self.paths = consumer.paths
        self.shards = list(shards)
        self.claims: dict[int, list[ClaimReader]] = {}
        self.offsets_seen: dict[int, tuple[int | None, completion.OffsetSeen]] = {}
        self.last_demand = float("-inf")
        self.zk_writes = 0
        self.claims_taken = 0
        self.takeovers = 0
        self.problem = ""
        # Cassandra unreachable: claim and renew nothing, give the ranges up (see above).
        self.stepped_back = False
        self._want = asyncio.Event()
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self._cursors: dict[int, Cursor] = {}
        # Batches read ahead of a shard's cursor, kept for the next claim after losing a race.
        self._read_ahead: dict[int, list[Batch]] = {}
        self._lapsed = LapsedRanges(self)
        self._rotation = 0
        self._scanned_at: dict[int, float] = {}
        self._woken_scan_at = float("-inf")
        # The seek epoch of each shard's cursor as last read (ranges of other epochs are moot).
        self._epochs: dict[int, int] = {}
        self.ordered = consumer.subscriber_state.spec.ordered_keys
        # Claims' times are written by one member and judged by the others: one clock for all.
        self.clock = clock_of(consumer.store.session)
        # Ordered keys: what is known of other members' ranges (and the keys' locks).
        self.foreign = ForeignRanges(consumer, self._held_names, self._epochs.get, lambda: not self._stopped) \
            if self.ordered else None
        # Each shard's head as its watch last reported it, or as found past it and repaired here.
        self.heads = WatchedHeads(self.client, consumer.store.paths(consumer.queue).head, self.head_changed,
                                  lambda: not self._stopped)
        self.turns = ClaimTurns(consumer.member_id, consumer.group_members,
                                lambda seconds: asyncio.get_running_loop().call_later(seconds, self._want.set))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for shard in self.shards:
            await self._prepare(shard)
        self._tasks = [loop.create_task(self._claim_loop()), loop.create_task(self._renew_loop())]

    async def zk_call(self, method: Callable[..., Any], *args: Any) -> Any:
        return await zk.call(method, *args)

    # --- bookkeeping ----------------------------------------------------------------------------
    def sources(self) -> list[ClaimReader]:
        return [reader for shard in sorted(self.claims) for reader in self.claims[shard]]

    def source_for(self, position: Position) -> ClaimReader | None:
        for reader in self.claims.get(position.shard, []):
            if reader.record.start <= position.batch < reader.record.end:
                return reader
        return None

    def _held_names(self, shard: int) -> set[str]:
        return {r.record.name for r in self.claims.get(shard, [])}

    def holds(self, reader: ClaimReader) -> bool:
        return reader in self.claims.get(reader.shard, [])

    def forget(self, reader: ClaimReader) -> None:
        held = self.claims.get(reader.shard, [])
        if reader in held:
            held.remove(reader)
            reader.state.release_keys()
        self.space_freed()

    def vouched_for(self, deliveries: list[Delivery]) -> bool:
        """Whether every delivery's range is still provably ours, its deliveries recorded: no
        member can take it over without finding them in the ack rows."""
        return all((reader := self.source_for(d.message.position)) is not None and reader.vouched
                   for d in deliveries)

    def locks_for(self, shard: int) -> KeyLocks | None:
        return self.foreign.locks_for(shard) if self.foreign is not None else None

    def completed(self, reader: ClaimReader, offset: int, written: bool) -> None:
        """`written`: the range wrote `offset` in its epoch (not moot after a seek): checkpoint it."""
        self.consumer.counters.offset_commits += 1
        if written and self.consumer.checkpoints is not None:
            self.consumer.checkpoints.note(reader.record.shard, offset, reader.record.epoch)

    def set_shards(self, shards: list[int]) -> None:
        added = [shard for shard in shards if shard not in self.shards]
        self.shards = list(shards)
        for shard in added:
            self.consumer.in_background(self._prepare(shard))
        self._want.set()

    async def _prepare(self, shard: int) -> None:
        """Watch the shard's head (new batches to claim) and, for ordered keys, its claims."""
        self.heads.watch(shard)
        if self.foreign is not None and not self.foreign.watching(shard):
            # The directory must exist first: a watch set on a missing node never fires.
            await claims.ensure_dirs(self.client, self.paths, shard)
            self.foreign.watch(shard)

    async def resync(self) -> None:
        """A seek: drop the ranges of shards it moved to a new epoch; claiming goes on from their new offsets."""
        for shard in self.shards:
            data, _ = await zk.call(self.client.get_async, self.paths.offset(shard))
            _, epoch = decode_offset(data)
            cursor = self._cursors.get(shard)
            if cursor is not None and cursor.epoch != epoch:
                self._cursors.pop(shard, None)
                self._read_ahead.pop(shard, None)
            for reader in list(self.claims.get(shard, [])):
                if reader.epoch != epoch:
                    reader.drop("a seek moved the shard")
                    self.consumer.counters.seeks_applied += 1
        self._want.set()

    def _may_claim(self) -> bool:
        if self.stepped_back:
            return False
        if time.monotonic() - self.last_demand >= DEMAND_SECONDS or self.ready_messages() >= CLAIM_LOW_WATER:
            return False
        return self._below_caps()

    def _below_caps(self) -> bool:
        sources = self.sources()
        return (sum(r.state.loaded_messages for r in sources) < MAX_LOADED_MESSAGES
                and sum(r.state.loaded_bytes for r in sources) < MAX_LOADED_BYTES)

    def _wake_scan_due(self) -> bool:
        """Whether to look for ranges due to wake (messages due for the dead-letter queue) with no
        app asking: at most every WAKE_SCAN_SECONDS, not stepped back nor holding all it may."""
        if self.stepped_back or time.monotonic() - self._woken_scan_at < WAKE_SCAN_SECONDS:
            return False
        return self._below_caps()

    def ready_messages(self) -> int:
        """Messages loaded here the app could have: not in flight nor (ordered keys) held back behind
        others' ranges as the last receive found (else a member stopped claiming while it waited)."""
        return sum(max(0, r.state.loaded_messages - r.state.in_flight - r.state.held_by_others)
                   for r in self.sources())

    def demand(self) -> None:
        """The app asked for messages: claim more if few are ready here."""
        self.last_demand = time.monotonic()
        self.space_freed()

    def space_freed(self) -> None:
        if time.monotonic() - self.last_demand < DEMAND_SECONDS and self.ready_messages() < CLAIM_LOW_WATER:
            self._want.set()

    def head_changed(self) -> None:
        self.space_freed()

    # --- claiming -------------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        backoff = RETRY_MIN_SECONDS
        while not self._stopped:
            try:
                await asyncio.wait_for(self._want.wait(), RECHECK_SECONDS)
            except TimeoutError:
                pass
            self._want.clear()
            if self._stopped:
                return
            woken_only = not self._may_claim()
            if woken_only and not self._wake_scan_due():
                continue
            try:
                got = await (self._take_over_woken() if woken_only else self._claim_one())
            except asyncio.CancelledError:
                raise
            except Exception as error:  # every failure is retried: a member must never stop claiming
                self.problem = f"claiming: {type(error).__name__}: {error}"
                self.consumer.counters.retries += 1
                log.warning("claiming batches failed (%s); retrying", self.problem)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)
                self._want.set()
                continue
            self.problem = ""
            backoff = RETRY_MIN_SECONDS
            if got is not None:
                self._install(got)
                self.consumer.notify()
                self._want.set()  # more, if still few are ready

    async def _claim_one(self) -> ClaimReader | None:
        """Take over a lapsed range (older messages first) or claim a new one; None if there is none."""
        self._rotation += 1
        order = by_priority(self.shards, self._rotation)  # fair within a level
        now = time.monotonic()
        for shard in order:
            # Listing the claims (and reading those not seen lapsing before) costs reads:
            # at most once a SCAN_SECONDS per shard, which delays a takeover by as much.
            if now - self._scanned_at.get(shard, float("-inf")) < SCAN_SECONDS:
                continue
            self._scanned_at[shard] = now
            reader = await self._take_over_lapsed(shard)
            if reader is not None:
                self._scanned_at.pop(shard, None)  # there may be more
                return reader
        for shard in order:
            reader = await self._claim_fresh(shard)
            if reader is not None:
                return reader
        return None

    async def _take_over_woken(self) -> ClaimReader | None:
        """Take over a released or lapsed range whose wake has come (casque.engine.claims): its
        dead letters are moved when they are due, with or without an app that asks."""
        self._woken_scan_at = time.monotonic()
        for shard in by_priority(self.shards, self._rotation):
            reader = await self._take_over_lapsed(shard, woken_only=True)
            if reader is not None:
                self._woken_scan_at = float("-inf")  # there may be more
                return reader
        return None

    async def _cursor(self, shard: int, read: bool = False) -> Cursor:
        cursor = self._cursors.get(shard)
        if cursor is None or read:
            cursor = await claims.current_cursor(self.client, self.paths, shard, cursor)
            self._cursors[shard] = cursor
            self._epochs[shard] = cursor.epoch
        return cursor

    def _until_ms(self) -> int:
        """A claim's time from now: one visibility timeout of deliveries plus room for handing them out."""
        visibility = self.consumer.visibility_timeout
        return self.clock.ms() + int((visibility + headroom(visibility)) * 1000)

    async def _take_over_lapsed(self, shard: int, woken_only: bool = False) -> ClaimReader | None:
        """A lapsed range of `shard` taken over (`woken_only`: only one whose wake has come)."""
        cursor = await self._cursor(shard)
        held = {r.record.name for r in self.claims.get(shard, [])}
        try:
            taken = await self._lapsed.take_over(shard, cursor, held, self._until_ms(), woken_only)
        except SeekAhead:
            self._cursors.pop(shard, None)  # a seek we have not seen yet
            return None
        if taken is None:
            return None
        self.takeovers += 1
        record = taken.record
        batches = await gaps.read_range(self.consumer.log, shard, record.start, record.end)
        reader = await self._reader(record, taken.registration, batches)
        log.info("shard %s: took over batches %s..%s from member %s (%s); %d of its deliveries still run",
                 shard, record.start, record.end - 1, taken.previous.member, taken.why, reader.held_at_load)
        return reader

    async def _claim_fresh(self, shard: int) -> ClaimReader | None:
        head = self.heads.get(shard)
        for _ in range(20):  # races lost to other members; each loss means they progressed
            cursor = await self._cursor(shard)
            batches = [b for b in self._read_ahead.get(shard, []) if b.header.batch >= cursor.next]
            if not batches or batches[0].header.batch != cursor.next:
                if cursor.next > head and not self.heads.probe_due(shard):
                    return None
                if cursor.next <= head:  # fresh batches: this member's turn, or another's (claim_turns)
                    taking = await self.turns.cursor_to_claim(shard, head, cursor, lambda: self._cursor(shard, True))
                    if taking is None or taking.next > head:
                        return None
                    cursor = taking
                batches = await self.consumer.log.read_from(shard, cursor.next)
                self.consumer.counters.batch_reads += 1
                if batches and batches[-1].header.batch > head:
                    # Past the head: its publisher's advance failed or never came. Claim them,
                    # and repair the head for the other members and for lag.
                    head = batches[-1].header.batch
                    self.heads.found(shard, head)
            if not batches:
                if cursor.next <= head:
                    await self._skip_expired(shard, cursor, head)
                return None
            # The range claimed starts at the cursor: batches missing before or between those
            # read must be gone (the claim's reader takes them as expired).
            missing = await gaps.prove_read(self.consumer.log, shard, cursor.next, batches)
            taken: list[Batch] = []
            count = 0
            target = claims.claim_target(sum(len(b.messages) for b in batches), len(self.consumer.group_members()),
                                         ORDERED_CLAIM_MESSAGES if self.ordered else CLAIM_MESSAGES)
            for batch in batches:
                taken.append(batch)
                count += len(batch.messages)
                if count >= target:
                    break
            end = taken[-1].header.batch + 1
            keys = frozenset(key_hash(m.key) for b in taken for m in b.messages if m.key) if self.ordered else frozenset()
            registration = registration_of(self.consumer)
            record, now = await claims.claim_range(
                self.client, self.paths, shard, cursor, end, self.consumer.member_id, self._until_ms(), keys,
                session_of(self.consumer))
            self.zk_writes += 1
            if now is not None:
                self._cursors[shard] = now
            else:
                self._cursors.pop(shard, None)
            if record is None:
                self._read_ahead[shard] = batches
                continue
            self._read_ahead[shard] = [b for b in batches if b.header.batch >= end]
            self.consumer.counters.expired_skipped += sum(high - low for low, high in missing if high < end)
            self.claims_taken += 1
            return await self._reader(record, registration, taken, now)
        return None

    async def _skip_expired(self, shard: int, cursor: Cursor, head: int) -> None:
        """Batches from the cursor up to the head were not read: move the cursor to the next
        one that exists, in whatever order they expired (casque.engine.gaps)."""
        live = await gaps.next_live(self.consumer.log, shard, cursor.next, head + 1)
        if live > cursor.next:
            self.consumer.counters.expired_skipped += live - cursor.next
            await claims.skip_range(self.client, self.paths, cursor, shard, live)
            self.zk_writes += 1
            self._cursors.pop(shard, None)

    async def _reader(self, record: ClaimRecord, registration: int, batches: list[Batch],
                      cursor: Cursor | None = None) -> ClaimReader:
        # Ordered keys: what other members hold of the shard is read beside the range's acks.
        seen = self.foreign.see(record.shard) if self.foreign is not None else asyncio.sleep(0)
        return await load_claim_reader(self, record, registration, batches, seen, cursor)

    def _install(self, reader: ClaimReader) -> None:
        self.claims.setdefault(reader.shard, []).append(reader)
        self.claims[reader.shard].sort(key=lambda r: r.record.start)
        reader.schedule_commit()  # a range whose messages were all done before completes at once

    # --- keeping claims -------------------------------------------------------------------------
    async def cover(self, deliveries: list[Delivery]) -> tuple[list[Delivery], list[Delivery]]:
        """Make sure every delivery's claim lasts past its visibility deadline. Returns the
        deliveries it could cover and those it could not (their range is no longer ours, or its
        claim could not be renewed): the caller hands the latter back."""
        owners = {d.receipt: self.source_for(d.message.position) for d in deliveries}
        wanted: dict[ClaimReader, float] = {}
        last_deliveries: set[ClaimReader] = set()
        limit = dead_letter_limit(self.consumer)
        wall_offset = self.clock.time() - time.monotonic()
        for d in deliveries:
            reader = owners[d.receipt]
            if reader is not None:
                reader.last_handout = time.monotonic()
                wanted[reader] = max(wanted.get(reader, 0.0), d.visible_until + wall_offset)
                if limit and d.delivery_count >= limit:
                    last_deliveries.add(reader)
        lost = {reader for reader, ends in wanted.items()
                if not await reader.renew_past(ends, dead_letter=reader in last_deliveries)}
        kept: list[Delivery] = []
        uncovered: list[Delivery] = []
        for d in deliveries:
            reader = owners[d.receipt]
            (uncovered if reader is None or reader in lost else kept).append(d)
        return kept, uncovered

    async def _renew_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(RENEW_INTERVAL_SECONDS)
            now, wall = time.monotonic(), self.clock.time()
            visibility = self.consumer.visibility_timeout
            for reader in self.sources():
                remaining = reader.record.until_ms / 1000 - wall
                reader.state.expire(now)  # what is in flight is judged below: not what ran out
                if self.stepped_back and not reader.complete:
                    if not reader.state.in_flight:
                        await reader.release()
                    elif remaining <= 0:
                        reader.drop("its time ran out while Cassandra was unreachable")
                    continue
                if reader.complete:
                    continue  # a complete range is being completed, not given up
                # A claim written before the member's latest registration is rewritten at once
                # (once the member is back in the group): it hands out nothing from it until then.
                now_registered = registration_of(self.consumer)
                rejoined = reader.registration != now_registered and vouches(self.consumer, now_registered)
                if remaining > visibility + headroom(visibility) / 2 and not rejoined:
                    continue
                try:
                    if reader.in_use(now):
                        await reader.renew(self._until_ms())
                    else:
                        await reader.release()  # unused and lapsing: let a member with demand have it
                except BackendUnavailable as error:
                    reader.problem = f"renewing: {error}"
                    if remaining <= 0:
                        reader.drop("its time ran out while ZooKeeper was unreachable")

    async def stop(self) -> None:
        """Complete what is done and release the rest, so other members take it over at once."""
        self._stopped = True
        self._want.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.consumer.acks.flush()
        except CasqueError as error:
            log.warning("acks not flushed on stop: %s", error)
        completions = []
        for reader in self.sources():
            reader.state.advance_offset()
            if reader.complete:
                reader.schedule_commit()
                if reader._completing is not None:
                    completions.append(reader._completing)
            else:
                await reader.release()
        if completions:
            # A completion that cannot be written (ZooKeeper away) is given up: the range lapses
            # and another member finds its acks in the ack rows.
            _, pending = await asyncio.wait(completions, timeout=STOP_COMPLETION_SECONDS)
            for task in pending:
                task.cancel()

    def in_background(self, work: Coroutine[Any, Any, object]) -> None:
        self.consumer.in_background(work)

    def status(self, held: list[int]) -> ShardStatus:
        """The member's own problem, and the claimed ranges that fail, by shard."""
        failing = {r.shard: r.problem for r in self.sources() if r.problem}
        problems = [self.problem] if self.problem else []
        problems.extend(f"shard {s}: {p}" for s, p in sorted(failing.items()))
        return ShardStatus(held, failing=failing, problem="; ".join(problems))
