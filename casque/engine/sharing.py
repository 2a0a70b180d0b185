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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kazoo.recipe.watchers import ChildrenWatch, DataWatch

from casque.backends import zk
from casque.engine import claims, positions
from casque.engine.acks import BatchMarks
from casque.engine.batches import Batch
from casque.engine.claims import ClaimRecord, Completion, Cursor
from casque.engine.deadletters import addressed_elsewhere
from casque.engine.keylocks import KeyLocks, key_hash
from casque.engine.messages import Delivery, Position, decode_receipt
from casque.engine.shard_state import ShardState
from casque.errors import BackendUnavailable, CasqueError, LeaseLost
from casque.schema import bucket_of
from casque.specs import priority_of
from casque.znodes import decode_offset

if TYPE_CHECKING:
    from casque.engine.consumer import Consumer

log = logging.getLogger(__name__)

# A claim takes whole batches until it holds at least this many messages (one batch at least):
# two ZooKeeper writes per claim stay under ten per 1,000 messages.
CLAIM_MESSAGES = 256
# A member claims more while fewer than this many messages are ready (loaded, not handed out) here.
CLAIM_LOW_WATER = 64
# ... and only while its app asked for messages this recently: an idle member hoards nothing.
DEMAND_SECONDS = 5.0
# ... and while it holds (loaded, in flight included) fewer messages and payload bytes than
# these over all its ranges: an app that receives and never acks cannot make it read the
# whole backlog into memory (a sidecar's container has 256 MiB).
MAX_LOADED_MESSAGES = 4000
MAX_LOADED_BYTES = 16 * 1024 * 1024
# Another member takes over a lapsed claim only this long after its time: clocks may differ.
SKEW_MARGIN_SECONDS = 1.0
# With nothing to claim, look again this often (claims of others lapse without a watch firing).
RECHECK_SECONDS = 2.0
RENEW_INTERVAL_SECONDS = 0.5
SCAN_SECONDS = 1.0
RETRY_MIN_SECONDS, RETRY_MAX_SECONDS = 0.1, 5.0
STOP_COMPLETION_SECONDS = 10.0


def now_ms() -> int:
    return int(time.time() * 1000)


class ClaimReader:
    """One claimed range of batches [start, end) of a shard, as this member delivers it."""

    def __init__(self, sharing: SharedDelivery, record: ClaimRecord) -> None:
        self.sharing = sharing
        self.record = record
        self.shard = record.shard
        self.epoch = record.epoch
        # The epoch comes from the claim, not from an offset read after a seek mark: each ack
        # reads the shard's offset znode to tell whether a seek moved it (Consumer._moved_by_seeks).
        self.seek_mark: int | None = None
        self.state = ShardState(shard=record.shard, offset=record.start, locks=sharing.locks_for(record.shard))
        self.problem = ""
        self.last_handout = time.monotonic()
        # Every claim version this reader wrote: the claim is still ours while it is at one of them.
        self._mine = {record.version}
        self._zk = asyncio.Lock()
        self._completing: asyncio.Task[None] | None = None
        self._dropped = False
        self._released = False

    # --- what the consumer needs of a source of deliveries ------------------------------------
    @property
    def current(self) -> bool:
        return not self._dropped and self.sharing.holds(self)

    @property
    def releasing(self) -> bool:
        """No new deliveries: released, or the claim's time no longer covers one visibility timeout."""
        if self._released or self._dropped:
            return True
        return time.time() + self.sharing.consumer.visibility_timeout > self.record.until_ms / 1000

    def space_freed(self) -> None:
        self.sharing.space_freed()

    def schedule_commit(self) -> None:
        self.state.advance_offset()
        if self.complete and self._completing is None and not self._dropped:
            self._completing = asyncio.get_running_loop().create_task(self._complete_loop())

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
        """Worth renewing: messages in flight, or ready ones and an app that asks for them."""
        if self.state.in_flight:
            return True
        return self.state.loaded_messages > 0 and now - self.sharing.last_demand < DEMAND_SECONDS

    async def renew_past(self, wall_deadline: float) -> bool:
        """Make the claim last past a delivery's new visibility deadline (wall-clock seconds)."""
        if wall_deadline * 1000 <= self.record.until_ms:
            return True
        visibility = self.sharing.consumer.visibility_timeout
        return await self.renew(int((wall_deadline + _headroom(visibility)) * 1000))

    async def renew(self, until_ms: int) -> bool:
        """Extend the claim to `until_ms` (never shorten it); False if it is no longer ours."""
        if self._dropped or self._released:
            return False
        async with self._zk:
            if self.record.until_ms >= until_ms:
                return True
            renewed = await claims.rewrite(self.sharing.client, self.sharing.paths, self.record,
                                           self.record.member, until_ms)
            self.sharing.zk_writes += 1
            if renewed is None:
                self.drop("taken over by another member")
                return False
            self.record = renewed
            self._mine.add(renewed.version)
            return True

    async def release(self) -> None:
        """Give the range up at once (the member stops or no longer uses it): others take it now."""
        if self._dropped or self._released:
            return
        self._released = True
        async with self._zk:
            try:
                released = await claims.rewrite(self.sharing.client, self.sharing.paths, self.record,
                                                self.record.member, 0)
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
                    async with self._zk:
                        outcome, offset = await claims.complete(self.sharing.client, self.sharing.paths, self.record)
                    self.sharing.zk_writes += 1
                except CasqueError as error:
                    self.problem = f"completing: {error}"
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_SECONDS)
                    continue
                self.problem = ""
                if outcome is Completion.LOST:
                    self.drop("taken over before it was completed")
                    return
                # DONE, or MOOT (a seek replays or skips the range).
                self.sharing.completed(self, offset)
                self._dropped = True
                self.sharing.forget(self)
                return
        finally:
            self._completing = None


class SharedDelivery:
    """The claims one consumer holds over all shards of its subscriber, and their upkeep."""

    def __init__(self, consumer: Consumer, shards: list[int]) -> None:
        self.consumer = consumer
        self.client = consumer.store.zk
        self.paths = consumer.paths
        self.shards = list(shards)
        self.claims: dict[int, list[ClaimReader]] = {}
        self.last_demand = float("-inf")
        self.zk_writes = 0
        self.claims_taken = 0
        self.takeovers = 0
        self.problem = ""
        self._want = asyncio.Event()
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self._cursors: dict[int, Cursor] = {}
        # Batches read ahead of a shard's cursor, kept for the next claim after losing a race.
        self._read_ahead: dict[int, list[Batch]] = {}
        # The latest claim records of other members seen, by (shard, name): re-read only once lapsed.
        self._seen: dict[tuple[int, str], ClaimRecord] = {}
        self._rotation = 0
        self._scanned_at: dict[int, float] = {}
        self.ordered = consumer.subscriber_state.spec.ordered_keys
        self._locks: dict[int, KeyLocks] = {}
        # Ordered keys: claim names per shard (a watch), and other members' ranges read so far.
        self._names: dict[int, set[str] | None] = {}
        self._known: dict[tuple[int, str], ClaimRecord] = {}
        self._learning: set[tuple[int, str]] = set()
        # The seek epoch of each shard's cursor as last read (ranges of other epochs are moot).
        self._epochs: dict[int, int] = {}
        # Each shard's head as its watch last reported it.
        self._heads: dict[int, int] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for shard in self.shards:
            await self._prepare(shard)
        self._tasks = [loop.create_task(self._claim_loop()), loop.create_task(self._renew_loop())]

    def _watch_head(self, shard: int) -> None:
        if shard in self._heads:
            return
        self._heads[shard] = 0

        def changed(data: bytes | None, *_: object) -> None:
            if data:
                self._heads[shard] = max(self._heads.get(shard, 0), int(data))
            self.head_changed()

        DataWatch(self.client, self.consumer.store.paths(self.consumer.queue).head(shard),
                  zk.watch_in_loop(asyncio.get_running_loop(), changed, lambda: not self._stopped))

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

    def holds(self, reader: ClaimReader) -> bool:
        return reader in self.claims.get(reader.shard, [])

    def forget(self, reader: ClaimReader) -> None:
        held = self.claims.get(reader.shard, [])
        if reader in held:
            held.remove(reader)
            reader.state.release_keys()
        self.space_freed()

    # --- ordered keys ---------------------------------------------------------------------------
    def locks_for(self, shard: int) -> KeyLocks | None:
        if not self.ordered:
            return None
        locks = self._locks.get(shard)
        if locks is None:
            locks = self._locks[shard] = KeyLocks(foreign=lambda batch: self._foreign_keys(shard, batch),
                                                  on_release=self.consumer.notify)
        return locks

    def _foreign_keys(self, shard: int, batch: int) -> list[frozenset[int]] | None:
        """Key hashes of the open ranges of other members below `batch`; None while one is unknown."""
        names = self._names.get(shard)
        epoch_now = self._epochs.get(shard)
        if names is None or epoch_now is None:
            return None
        held = {r.record.name for r in self.claims.get(shard, [])}
        found: list[frozenset[int]] = []
        for name in names - held:
            epoch, _, start = name.partition("-")
            if int(epoch) != epoch_now or int(start) >= batch:
                continue
            record = self._known.get((shard, name))
            if record is None:
                self._learn(shard, name)
                return None
            found.append(record.keys)
        return found

    def _learn(self, shard: int, name: str) -> None:
        """Read another member's range (its keys) in the background; deliveries wait for it."""
        if (shard, name) in self._learning:
            return
        self._learning.add((shard, name))

        async def read() -> None:
            try:
                record = await claims.read_claim(self.client, self.paths, shard, name)
                if record is not None:
                    self._known[(shard, name)] = record
            except CasqueError as error:
                log.info("range %s of shard %s not read (%s); retried on the next receive", name, shard, error)
            finally:
                self._learning.discard((shard, name))
                self.consumer.notify()

        self.consumer._in_background(read())

    def _watch_claims(self, shard: int) -> None:
        self._names[shard] = None

        def changed(children: list[str], *_: object) -> None:
            present = set(children)
            self._names[shard] = present
            for key in [k for k in self._known if k[0] == shard and k[1] not in present]:
                del self._known[key]
            self.consumer.notify()  # a range completed: keys it held may be free

        ChildrenWatch(self.client, self.paths.claims(shard),
                      zk.watch_in_loop(asyncio.get_running_loop(), changed, lambda: not self._stopped))

    async def _see_ranges(self, shard: int) -> None:
        """Before delivering a new range with ordered keys: every range below it known, with its keys.

        Read after our claim or takeover was written, so it includes every range created
        before ours; a watch could still be catching up."""
        names = set(await claims.list_claims(self.client, self.paths, shard))
        self._names[shard] = names
        held = {r.record.name for r in self.claims.get(shard, [])}
        for name in sorted(names - held):
            if (shard, name) not in self._known:
                record = await claims.read_claim(self.client, self.paths, shard, name)
                if record is not None:
                    self._known[(shard, name)] = record

    def completed(self, reader: ClaimReader, offset: int) -> None:
        self.consumer.counters.offset_commits += 1

    def set_shards(self, shards: list[int]) -> None:
        added = [shard for shard in shards if shard not in self.shards]
        self.shards = list(shards)
        for shard in added:
            self.consumer._in_background(self._prepare(shard))
        self._want.set()

    async def _prepare(self, shard: int) -> None:
        """Watch the shard's head (new batches to claim) and, for ordered keys, its claims."""
        self._watch_head(shard)
        if self.ordered and shard not in self._names:
            # The directory must exist first: a watch set on a missing node never fires.
            await claims.ensure_dirs(self.client, self.paths, shard)
            self._watch_claims(shard)

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
        if time.monotonic() - self.last_demand >= DEMAND_SECONDS or self.ready_messages() >= CLAIM_LOW_WATER:
            return False
        sources = self.sources()
        return (sum(r.state.loaded_messages for r in sources) < MAX_LOADED_MESSAGES
                and sum(r.state.loaded_bytes for r in sources) < MAX_LOADED_BYTES)

    def ready_messages(self) -> int:
        return sum(r.state.loaded_messages - r.state.in_flight for r in self.sources())

    def demand(self) -> None:
        """The app asked for messages: claim more if few are ready here."""
        self.last_demand = time.monotonic()
        if self.ready_messages() < CLAIM_LOW_WATER:
            self._want.set()

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
            if not self._may_claim():
                continue
            try:
                got = await self._claim_one()
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

    def _ordered_shards(self) -> list[int]:
        """Higher priority levels first; within a level, a rotating start for fairness."""
        self._rotation += 1
        by_level: dict[int, list[int]] = {}
        for shard in sorted(self.shards):
            by_level.setdefault(priority_of(shard), []).append(shard)
        ordered: list[int] = []
        for level in sorted(by_level, reverse=True):
            shards = by_level[level]
            turn = self._rotation % len(shards)
            ordered.extend(shards[turn:] + shards[:turn])
        return ordered

    async def _claim_one(self) -> ClaimReader | None:
        """Take over a lapsed range (older messages first) or claim a new one; None if there is none."""
        order = self._ordered_shards()
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

    async def _cursor(self, shard: int) -> Cursor:
        cursor = self._cursors.get(shard)
        if cursor is None:
            cursor = await claims.ensure_cursor(self.client, self.paths, shard)
            self._cursors[shard] = cursor
            self._epochs[shard] = cursor.epoch
        return cursor

    def _until_ms(self) -> int:
        """A claim's time from now: one visibility timeout of deliveries plus room for handing them out."""
        visibility = self.consumer.visibility_timeout
        return now_ms() + int((visibility + _headroom(visibility)) * 1000)

    async def _take_over_lapsed(self, shard: int) -> ClaimReader | None:
        cursor = await self._cursor(shard)
        names = await claims.list_claims(self.client, self.paths, shard)
        present = set(names)
        for key in [k for k in self._seen if k[0] == shard and k[1] not in present]:
            del self._seen[key]
        held = {r.record.name for r in self.claims.get(shard, [])}
        for name in names:
            epoch = int(name.partition("-")[0])
            if epoch < cursor.epoch:
                await claims.delete_claim(self.client, self.paths, shard, name)  # moot since a seek
                continue
            if epoch > cursor.epoch:
                self._cursors.pop(shard, None)  # a seek we have not seen yet
                return None
            if name in held:
                continue
            seen = self._seen.get((shard, name))
            lapsed_at = now_ms() - int(SKEW_MARGIN_SECONDS * 1000)
            if seen is not None and seen.until_ms > lapsed_at:
                continue
            record = await claims.read_claim(self.client, self.paths, shard, name)
            if record is None:
                continue
            self._seen[(shard, name)] = record
            if record.until_ms > lapsed_at:
                continue
            taken = await claims.rewrite(self.client, self.paths, record, self.consumer.member_id, self._until_ms())
            self.zk_writes += 1
            if taken is None:
                continue  # another member was faster
            self.takeovers += 1
            log.info("shard %s: took over batches %s..%s from member %s", shard, taken.start, taken.end - 1,
                     record.member)
            batches = await self._read_range(shard, taken.start, taken.end)
            return await self._reader(taken, batches)
        return None

    async def _read_range(self, shard: int, start: int, end: int) -> list[Batch]:
        batches: list[Batch] = []
        first = start
        while first < end:
            got = [b for b in await self.consumer.log.read_from(shard, first) if b.header.batch < end]
            self.consumer.counters.batch_reads += 1
            if not got:
                break  # the rest expired
            batches.extend(got)
            first = got[-1].header.batch + 1
        return batches

    async def _claim_fresh(self, shard: int) -> ClaimReader | None:
        head = self._heads.get(shard, 0)
        for _ in range(20):  # races lost to other members; each loss means they progressed
            cursor = await self._cursor(shard)
            batches = [b for b in self._read_ahead.get(shard, []) if b.header.batch >= cursor.next]
            if not batches or batches[0].header.batch != cursor.next:
                if cursor.next > head:
                    return None
                batches = await self.consumer.log.read_from(shard, cursor.next)
                self.consumer.counters.batch_reads += 1
            if not batches:
                if cursor.next <= head:
                    await self._skip_expired(shard, cursor, head)
                return None
            first = batches[0].header.batch
            if first > cursor.next and await self.consumer.log.read_header(shard, cursor.next, serial=True):
                raise BackendUnavailable(f"shard {shard}: batch {cursor.next} exists but the read did not return it")
            taken: list[Batch] = []
            count = 0
            target = self._claim_target(sum(len(b.messages) for b in batches))
            for batch in batches:
                taken.append(batch)
                count += len(batch.messages)
                if count >= target:
                    break
            end = taken[-1].header.batch + 1
            keys = frozenset(key_hash(m.key) for b in taken for m in b.messages if m.key) if self.ordered else frozenset()
            record, now = await claims.claim_range(
                self.client, self.paths, shard, cursor, end, self.consumer.member_id, self._until_ms(), keys)
            self.zk_writes += 1
            if now is not None:
                self._cursors[shard] = now
            else:
                self._cursors.pop(shard, None)
            if record is None:
                self._read_ahead[shard] = batches
                continue
            self._read_ahead[shard] = [b for b in batches if b.header.batch >= end]
            self.claims_taken += 1
            return await self._reader(record, taken)
        return None

    def _claim_target(self, available: int) -> int:
        """Messages to claim: CLAIM_MESSAGES, or less when what is there to claim, split over
        the group's members, is less; so a small backlog still reaches every member."""
        members = len(self.consumer.group_members()) or 1
        return max(1, min(CLAIM_MESSAGES, available // members))

    async def _skip_expired(self, shard: int, cursor: Cursor, head: int) -> None:
        earliest = await asyncio.to_thread(
            positions.earliest_batch, self.consumer.store, self.consumer.queue, shard, head)
        if earliest > cursor.next:
            self.consumer.counters.expired_skipped += earliest - cursor.next
            await claims.skip_range(self.client, self.paths, cursor, shard, earliest)
            self.zk_writes += 1
            self._cursors.pop(shard, None)

    async def _reader(self, record: ClaimRecord, batches: list[Batch]) -> ClaimReader:
        """A reader of the range, loaded with its batches and what the ack rows say is done."""
        if self.ordered:
            await self._see_ranges(record.shard)
        reader = ClaimReader(self, record)
        consumer = self.consumer
        marks: dict[int, BatchMarks] = await consumer.acks.load_bucket(
            record.epoch, record.shard, bucket_of(record.start), record.start)
        consumer.counters.ack_bucket_reads += 1
        # Batches below the offset are done. Only leased delivery, before a switch to sharing,
        # can have moved the offset past the cursor (with no ack rows for whole batches).
        data, _ = await zk.call(self.client.get_async, self.paths.offset(record.shard))
        offset, epoch = decode_offset(data)
        done_below = offset if epoch == record.epoch else record.start
        by_batch = {b.header.batch: b for b in batches}
        for number in range(record.start, record.end):
            batch = by_batch.get(number)
            mark = marks.get(number, BatchMarks())
            if batch is None or number < done_below:
                reader.state.add_batch(number, [])  # expired or done: nothing left to deliver
                continue
            skipped = {m.position.seq for m in batch.messages if addressed_elsewhere(m, consumer.subscriber)}
            reader.state.add_batch(number, batch.messages, mark.done | skipped, mark.deliveries)
        return reader

    def _install(self, reader: ClaimReader) -> None:
        self.claims.setdefault(reader.shard, []).append(reader)
        self.claims[reader.shard].sort(key=lambda r: r.record.start)
        reader.schedule_commit()  # a range whose messages were all done before completes at once

    # --- keeping claims -------------------------------------------------------------------------
    async def cover(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Make sure every delivery's claim lasts past its visibility deadline; deliveries whose
        claim could not be renewed are put back and left out."""
        owners = {d.receipt: self.source_for(d.message.position) for d in deliveries}
        wanted: dict[ClaimReader, float] = {}
        wall_offset = time.time() - time.monotonic()
        for d in deliveries:
            reader = owners[d.receipt]
            if reader is not None:
                reader.last_handout = time.monotonic()
                wanted[reader] = max(wanted.get(reader, 0.0), d.visible_until + wall_offset)
        lost = {reader for reader, ends in wanted.items() if not await reader.renew_past(ends)}
        kept = []
        for d in deliveries:
            reader = owners[d.receipt]
            if reader is None or reader in lost:
                if reader is not None:
                    reader.state.undo_take(*decode_receipt(d.receipt))
                continue
            kept.append(d)
        return kept

    async def _renew_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(RENEW_INTERVAL_SECONDS)
            now, wall = time.monotonic(), time.time()
            visibility = self.consumer.visibility_timeout
            for reader in self.sources():
                remaining = reader.record.until_ms / 1000 - wall
                if remaining > visibility + _headroom(visibility) / 2 or reader.complete:
                    continue  # a complete range is being completed, not given up
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

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        self.consumer._in_background(work)

    def status(self) -> tuple[dict[int, str], str]:
        failing = {r.shard: r.problem for r in self.sources() if r.problem}
        return failing, self.problem


def _headroom(visibility: float) -> float:
    """Time beyond one visibility timeout that a claim is taken or renewed for: room to hand
    messages out without renewing for each receive, short enough that a dead member's
    range comes back soon after its deliveries' visibility ends."""
    return max(1.0, min(5.0, visibility))

