"""What one consumer knows about one leased shard or claimed range: loaded batches and each
message's state (casque.engine.entries.State: its life, state by state).

Pure logic, no I/O: the consumer feeds it batches, acks and the clock. Every operation is
O(log n) in the number of loaded messages: ready messages sit in a heap by log position,
delayed ones by due time, in-flight ones by visibility deadline, stale items skipped when
they surface and pruned once they dominate (casque.engine.heaps). So one long-invisible
message never makes a receive scan the messages behind it.

The offset is the first batch with a message not yet done; it moves forward only over
complete batches. A done message's entry is dropped at once, and a batch the moment its last
message is done: `batches` holds only batches with a message not done, in batch order, and
every batch below `next_batch` not in it is complete (or proven gone). So one message nacked
for hours costs its own entry and those of its batch, not a marker per batch behind it. The
prefetch budget (`loaded_messages`, `loaded_bytes`) counts exactly what is held.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from casque.engine.entries import AckStart, ByteBudget, Entry, Handout, LoadedBatch, ShardCounters, State
from casque.engine.heaps import pruned
from casque.engine.keylocks import Hold, KeyLocks, holder_token
from casque.engine.shard_views import HELD, ShardViews
from casque.engine.messages import Position, StoredMessage
from casque.errors import StaleReceipt


# A message being dead-lettered stays invisible this long; if moving it fails, it comes
# back and the move is tried again.
DEAD_LETTER_RETRY_SECONDS = 30.0


@dataclass
class ShardState(ShardViews):
    shard: int
    offset: int
    # Every batch below this has been loaded (or skipped as done); the next read starts here.
    next_batch: int = 0
    # The loaded batches with a message not done, in rising batch order (they are added so).
    batches: dict[int, LoadedBatch] = field(default_factory=dict)
    counters: ShardCounters = field(default_factory=ShardCounters)
    # Ordered keys (casque.engine.keylocks): a keyed message waits for the one before it.
    locks: KeyLocks | None = None
    # This state's token in `locks`, which other states of the shard share (a range given up
    # and taken back is a new state holding the same positions).
    lock_holder: int = field(default_factory=holder_token)
    # Ready messages the last take held back behind another member's range (their key's
    # earlier messages are there): not ready for the app, so shared delivery claims more
    # rather than wait for them. Those behind an earlier message held here are not counted
    # (the app gets them as it acks, and claiming more for them made one member take a whole
    # backlog of a few keys while the others had none), unless that earlier message is
    # itself held back by another member's range.
    held_by_others: int = 0
    # The subscriber's retry policy (casque.specs.RetryPolicy.backoff): seconds a message
    # delivered n times waits before it is ready again after a nack naming no delay or an
    # expired visibility. None: ready at once.
    backoff: Callable[[int], float] | None = None
    # The subscriber's filter (casque.engine.member.message_filter): a message it does not
    # match is done when its turn comes, never delivered. None: every message matches.
    matches: Callable[[StoredMessage], bool] | None = None
    _ready: list[tuple[int, int]] = field(default_factory=list)
    _delayed: list[tuple[float, int, int]] = field(default_factory=list)
    _deadlines: list[tuple[float, int, int, int]] = field(default_factory=list)
    # Messages whose time ended (a wait, a visibility, or a wait found over at load) since the
    # last `settle`: it dead-letters those over max deliveries. And deliveries whose
    # visibility ended into a retry backoff: `settle` hands them out to be recorded.
    _ended: list[tuple[int, int]] = field(default_factory=list)
    _backed_off: list[tuple[float, int, int]] = field(default_factory=list)
    _in_flight: int = 0
    _loaded_messages: int = 0
    _loaded_bytes: int = 0

    def __post_init__(self) -> None:
        self.next_batch = max(self.next_batch, self.offset)

    # --- loading -------------------------------------------------------------------------
    def add_batch(
        self,
        batch: int,
        messages: list[StoredMessage],
        done: set[int] | None = None,
        deliveries: dict[int, int] | None = None,
        in_flight_until: dict[int, float] | None = None,
        waiting_until: dict[int, float] | None = None,
    ) -> None:
        """Load a batch read from the log; `done` seqs were acked before (by any lease holder).
        `in_flight_until` seqs may still be in an app's hands (delivered by a member that has
        gone): in flight until then, holding their keys, and delivered again after.
        `waiting_until` seqs were nacked (or are backing off) until then: DELAYED until then,
        READY after, with no backoff on top (the recorded time already has it)."""
        if batch < self.next_batch:
            return
        done = done or set()
        deliveries = deliveries or {}
        in_flight_until = in_flight_until or {}
        waiting_until = waiting_until or {}
        loaded = LoadedBatch({}, 0)
        entries = loaded.entries
        locks = self.locks
        # Every heap entry is of a batch below next_batch, so below this one: appending this
        # batch's positions in rising seq order (as read) keeps the list a heap.
        ready = self._ready
        size = 0
        top = -1
        for message in messages:
            seq = message.position.seq
            if seq in done:
                continue
            entry = entries[seq] = Entry(message, State.READY, deliveries.get(seq, 0))
            if locks is not None:
                locks.add(message.key, message.position, self.lock_holder)
            size += len(message.payload)
            deadline = in_flight_until.get(seq)
            if deadline is not None:
                entry.state, entry.deadline, entry.nonce = State.IN_FLIGHT, deadline, random.getrandbits(63) | 1
                heapq.heappush(self._deadlines, (deadline, batch, seq, entry.nonce))
                self._in_flight += 1
                continue
            due = waiting_until.get(seq)
            if due is not None:
                entry.state, entry.deadline = State.DELAYED, due
                heapq.heappush(self._delayed, (due, batch, seq))
                continue
            if entry.deliveries:
                self._ended.append((batch, seq))  # its wait may have ended while nobody held it
            if seq > top:
                ready.append((batch, seq))
                top = seq
            else:
                heapq.heappush(ready, (batch, seq))
        loaded.remaining = len(entries)
        self._loaded_bytes += size
        self._loaded_messages += loaded.remaining
        if loaded.remaining:
            self.batches[batch] = loaded
        self.next_batch = batch + 1

    def skip_to(self, batch: int) -> None:
        """Batches below `batch` no longer exist (expired): drop them and move on."""
        for old in [b for b in self.batches if b < batch]:
            self._forget(old)
        self.offset = max(self.offset, batch)
        self.next_batch = max(self.next_batch, batch)

    # --- delivering ----------------------------------------------------------------------
    def take(
        self, limit: int, now: float, visibility: float, expired_ttl: float, max_deliveries: int = 0,
        budget: ByteBudget | None = None,
    ) -> list[Handout]:
        """Hand out up to `limit` messages, lowest position first, each with a new nonce.

        `expired_ttl` is the wall-clock now, to drop ephemeral messages past their TTL. A
        message the filter does not match is done instead of delivered (counted filtered). A
        message already delivered `max_deliveries` times (if > 0) comes out as `dead`. With a
        `budget`, taking stops at the first message whose payload no longer fits in it.
        """
        self._release_due(now)
        handed: list[Handout] = []
        held_back: list[tuple[int, int]] = []
        held_by_others = 0
        while self._ready and len(handed) < limit:
            batch, seq = heapq.heappop(self._ready)
            entry = self._entry(batch, seq)
            if entry is None or entry.state is not State.READY:
                continue
            if self.matches is not None and not self.matches(entry.message):
                # Never delivered, so it need not wait for its key's earlier messages either.
                self.counters.filtered += 1
                self._finish(batch, entry)
                continue
            if self.locks is not None:
                hold = self.locks.hold(entry.message.key, entry.message.position)
                if hold is not Hold.NONE:
                    held_back.append((batch, seq))  # an earlier message of its key is not done yet
                    # Behind another member's range, directly or behind a first message of its
                    # key that is: counted as ready, these kept a member from claiming the range
                    # it waited on once they were CLAIM_LOW_WATER (casque.engine.sharing).
                    held_by_others += hold is Hold.ELSEWHERE or self.locks.waits_elsewhere(entry.message.key)
                    continue
            expires = entry.message.expires_at
            if expires is not None and expires.timestamp() <= expired_ttl:
                # An ephemeral message past its TTL is never delivered; it counts as done.
                self.counters.expired_ttl += 1
                self._finish(batch, entry)
                continue
            if max_deliveries and entry.deliveries >= max_deliveries:
                handed.append(self._to_dead_letters(batch, entry, now))
                continue
            if budget is not None:
                if not budget.fits(entry.message.size):
                    heapq.heappush(self._ready, (batch, seq))  # stays first in line for the next receive
                    break
                budget.spend(entry.message.size)
            entry.state = State.IN_FLIGHT
            entry.nonce = random.getrandbits(63) | 1
            entry.deliveries += 1
            entry.deadline = now + visibility
            if entry.first_delivered_at is None:
                entry.first_delivered_at = now
            heapq.heappush(self._deadlines, (entry.deadline, batch, seq, entry.nonce))
            self._in_flight += 1
            redelivery = entry.deliveries > 1
            self.counters.delivered += 1
            if redelivery:
                self.counters.redelivered += 1
            handed.append(Handout(entry, entry.nonce, redelivery))
        for item in held_back:
            heapq.heappush(self._ready, item)
        self.held_by_others = held_by_others
        return handed

    def ack(self, position: Position, nonce: int) -> bool:
        """Mark a message done at once (start and finish an ack with nothing to wait for).
        True if this call did it; False if it was already done."""
        if self.start_ack(position, nonce) is not AckStart.STARTED:
            return False
        self.finish_ack(position, nonce)
        return True

    def start_ack(self, position: Position, nonce: int) -> AckStart:
        """Begin acking the delivery under `nonce`: in flight -> ACKING.

        The message is done only when `finish_ack` confirms the write; until then a second
        ack of the same delivery is PENDING (it shares the first one's outcome), and nothing
        about the message changes for anybody else. Raises StaleReceipt if the message is in
        flight under another delivery, or waiting to be delivered again.
        """
        loaded = self.batches.get(position.batch)
        if loaded is None:
            if position.batch < self.next_batch:
                return AckStart.DONE  # its batch is complete: acks are idempotent
            raise StaleReceipt(f"message {position.batch}/{position.seq} is not held by this consumer")
        entry = loaded.entries.get(position.seq)
        if entry is None:
            return AckStart.DONE  # its batch may be complete and waiting for the offset
        if entry.state is State.ACKING and entry.nonce == nonce:
            return AckStart.PENDING
        self._require_current(entry, nonce)
        entry.state = State.ACKING
        return AckStart.STARTED

    def finish_ack(self, position: Position, nonce: int) -> bool:
        """The ack started under `nonce` is durable: the message is done (its key moves on)."""
        entry = self._entry(position.batch, position.seq)
        if entry is None or entry.state is not State.ACKING or entry.nonce != nonce:
            return False
        self.counters.acked += 1
        self._finish(position.batch, entry)
        return True

    def abort_ack(self, position: Position, nonce: int) -> None:
        """The ack started under `nonce` could not be made durable: the delivery is in flight
        again, as it was, and its receipt stays valid until its visibility ends."""
        entry = self._entry(position.batch, position.seq)
        if entry is None or entry.state is not State.ACKING or entry.nonce != nonce:
            return
        entry.state = State.IN_FLIGHT
        # Its deadline's heap entry may have surfaced (and been dropped) while it was acking.
        heapq.heappush(self._deadlines, (entry.deadline, position.batch, position.seq, nonce))

    def nack_due(self, position: Position, nonce: int, delay: float | None, now: float) -> tuple[Entry, float]:
        """What a nack at `now` of the delivery under `nonce` would do, changing nothing: the
        entry, and when it would be visible again (`now` for at once). The caller makes that
        durable, then calls `nack` with the same arguments. StaleReceipt as `nack`."""
        entry = self.in_flight_entry(position, nonce)
        wait = self._backoff(entry) if delay is None else delay
        return entry, now + wait if wait > 0 else now

    def nack(
        self, position: Position, nonce: int, delay: float | None, now: float, error: str | None = None
    ) -> Entry:
        """Make an in-flight message visible again after `delay` seconds; None: after the
        retry policy's backoff, or at once without one."""
        entry = self.in_flight_entry(position, nonce)
        entry.last_error = error or entry.last_error
        self._in_flight -= 1
        if not self._wait_or_ready(entry, now, self._backoff(entry) if delay is None else delay):
            self._ended.append((position.batch, position.seq))  # no wait: its time ended now
        self._compact()
        return entry

    def _backoff(self, entry: Entry) -> float:
        return 0.0 if self.backoff is None else self.backoff(entry.deliveries)

    def _wait_or_ready(self, entry: Entry, since: float, delay: float) -> bool:
        """DELAYED until `since + delay` (True), or READY when there is no delay (False)."""
        position = entry.message.position
        if delay > 0:
            entry.state = State.DELAYED
            entry.deadline = since + delay
            heapq.heappush(self._delayed, (entry.deadline, position.batch, position.seq))
            return True
        entry.state = State.READY
        heapq.heappush(self._ready, (position.batch, position.seq))
        return False

    def extend(self, position: Position, nonce: int, visibility: float, now: float) -> float:
        entry = self.in_flight_entry(position, nonce)
        entry.deadline = now + visibility
        heapq.heappush(self._deadlines, (entry.deadline, position.batch, position.seq, nonce))
        self._compact()
        return entry.deadline

    def undo_take(self, position: Position, nonce: int) -> bool:
        """Put back a message handed out under `nonce` that never reached the app, as if it had
        not been taken (its delivery count too). False if that delivery is no longer current."""
        entry = self._entry(position.batch, position.seq)
        if entry is None or entry.state is not State.IN_FLIGHT or entry.nonce != nonce:
            return False
        entry.state = State.READY
        self.counters.delivered -= 1
        if entry.deliveries > 1:
            self.counters.redelivered -= 1
        entry.deliveries = max(0, entry.deliveries - 1)
        entry.nonce = 0
        self._in_flight -= 1
        heapq.heappush(self._ready, (position.batch, position.seq))
        return True

    def dead_letter(self, position: Position) -> Entry | None:
        """Mark a message done because it went to the dead-letter queue."""
        entry = self._entry(position.batch, position.seq)
        if entry is None or entry.state is State.DONE:
            return None
        if entry.state in HELD:
            self._in_flight -= 1
        self._finish(position.batch, entry, counted=False)
        return entry

    def release_keys(self) -> None:
        """This state is dropped (its range went to another member): its messages no longer hold keys here."""
        if self.locks is not None:
            for loaded in self.batches.values():
                for entry in loaded.entries.values():
                    self.locks.release(entry.message.key, entry.message.position, self.lock_holder)

    # --- progress ------------------------------------------------------------------------
    def advance_offset(self) -> int:
        """Move the offset to the first batch with a message not done (past every complete
        or proven-gone batch loaded so far); returns the offset."""
        first = next(iter(self.batches), self.next_batch)
        self.offset = max(self.offset, first)
        return self.offset

    def expire(self, now: float) -> None:
        """Make visible again what is due by `now`: deliveries whose visibility ended and nacked
        messages whose delay ran out (taking messages does this too, but an app may stop asking)."""
        self._release_due(now)

    def has_ready(self, now: float) -> bool:
        self._release_due(now)
        while self._ready:
            batch, seq = self._ready[0]
            entry = self._entry(batch, seq)
            if entry is not None and entry.state is State.READY:
                return True
            heapq.heappop(self._ready)
        return False

    def settle(self, now: float, max_deliveries: int) -> tuple[list[Handout], list[Entry]]:
        """What the member must do now that times ended, whether or not anybody receives.

        Returns the messages to move to the dead-letter queue (their wait or visibility ended
        and they were delivered `max_deliveries` times, if > 0: each is in flight to the
        dead-letter queue under a new nonce, as `take` hands them out) and the deliveries
        whose visibility ended into a retry backoff (DELAYED until `deadline`), whose wait
        the caller records so that a restart honours it.
        """
        self._release_due(now)
        dead: list[Handout] = []
        if max_deliveries:
            for batch, seq in self._ended:
                entry = self._entry(batch, seq)
                if (entry is not None and entry.state in (State.READY, State.DELAYED)
                        and entry.deliveries >= max_deliveries):
                    dead.append(self._to_dead_letters(batch, entry, now))
        self._ended.clear()
        waits: list[Entry] = []
        for due, batch, seq in self._backed_off:
            entry = self._entry(batch, seq)
            if entry is not None and entry.state is State.DELAYED and entry.deadline == due:
                waits.append(entry)
        self._backed_off.clear()
        return dead, waits

    # --- internals -----------------------------------------------------------------------
    def _release_due(self, now: float) -> None:
        # Expired deliveries first: with a retry policy they wait out their backoff from
        # their deadline, and one whose backoff has also passed is released just below.
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, batch, seq, nonce = heapq.heappop(self._deadlines)
            entry = self._entry(batch, seq)
            if (
                entry is not None
                and entry.state is State.IN_FLIGHT
                and entry.nonce == nonce
                and entry.deadline == deadline
            ):
                self._in_flight -= 1
                self.counters.expired_visibility += 1
                self._ended.append((batch, seq))
                if self._wait_or_ready(entry, deadline, self._backoff(entry)):
                    self._backed_off.append((entry.deadline, batch, seq))
        while self._delayed and self._delayed[0][0] <= now:
            due, batch, seq = heapq.heappop(self._delayed)
            entry = self._entry(batch, seq)
            if entry is not None and entry.state is State.DELAYED and entry.deadline == due:
                entry.state = State.READY
                heapq.heappush(self._ready, (batch, seq))
                self._ended.append((batch, seq))

    def _to_dead_letters(self, batch: int, entry: Entry, now: float) -> Handout:
        """Hand a ready or waiting message out to the dead-letter queue (not to the app): in
        flight under a new nonce until the move marks it done, or, if the move fails, until
        DEAD_LETTER_RETRY_SECONDS pass and it is tried again."""
        entry.state = State.IN_FLIGHT
        entry.nonce = random.getrandbits(63) | 1
        entry.deadline = now + DEAD_LETTER_RETRY_SECONDS
        heapq.heappush(self._deadlines, (entry.deadline, batch, entry.message.position.seq, entry.nonce))
        self._in_flight += 1
        return Handout(entry, entry.nonce, redelivery=False, dead=True)

    def _finish(self, batch: int, entry: Entry, counted: bool = True) -> None:
        if entry.state in HELD and counted:
            self._in_flight -= 1
        entry.state = State.DONE
        loaded = self.batches[batch]
        seq = entry.message.position.seq
        if self.locks is not None:
            self.locks.release(entry.message.key, entry.message.position, self.lock_holder)
        del loaded.entries[seq]
        loaded.remaining -= 1
        self._loaded_messages -= 1
        self._loaded_bytes -= entry.message.size
        if not loaded.remaining:
            del self.batches[batch]  # complete: the offset passes it at its next advance

    def _forget(self, batch: int) -> None:
        loaded = self.batches.pop(batch, None)
        if loaded is not None:
            if self.locks is not None:
                for entry in loaded.entries.values():
                    self.locks.release(entry.message.key, entry.message.position, self.lock_holder)
            self._in_flight -= sum(1 for e in loaded.entries.values() if e.state in HELD)
            self._loaded_messages -= loaded.remaining
            self._loaded_bytes -= sum(e.message.size for e in loaded.entries.values())

    def _compact(self) -> None:
        """Drop stale heap items once they dominate (casque.engine.heaps)."""
        live, entry = self._loaded_messages, self._entry
        self._deadlines = pruned(self._deadlines, self._in_flight, lambda i: (e := entry(i[1], i[2])) is not None
                                 and e.state is State.IN_FLIGHT and e.nonce == i[3] and e.deadline == i[0])
        self._ready = pruned(self._ready, live, lambda i: (e := entry(*i)) is not None and e.state is State.READY)
        self._delayed = pruned(self._delayed, live, lambda i: (e := entry(i[1], i[2])) is not None
                               and e.state is State.DELAYED and e.deadline == i[0])
        # Noted for `settle`, which a state nobody runs timers for never calls.
        self._ended = pruned(self._ended, live, lambda i: entry(*i) is not None)
        self._backed_off = pruned(self._backed_off, live,
                                  lambda i: (e := entry(i[1], i[2])) is not None and e.deadline == i[0])
