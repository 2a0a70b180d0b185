"""What a shard's state answers without changing anything: lookups of a message's entry by
position and receipt, and the counts the prefetch budget, hand-overs and timers read.

casque.engine.shard_state.ShardState moves messages between states; this is its read side,
kept apart so that each file holds one job.
"""

from __future__ import annotations

from casque.engine.entries import Entry, LoadedBatch, State
from casque.engine.messages import Position
from casque.errors import StaleReceipt

# States of a delivery still in the app's hands (counted in flight).
HELD = (State.IN_FLIGHT, State.ACKING)


class ShardViews:
    """The read side of ShardState (which declares these as its fields)."""

    batches: dict[int, LoadedBatch]
    _ready: list[tuple[int, int]]
    _delayed: list[tuple[float, int, int]]
    _deadlines: list[tuple[float, int, int, int]]
    _in_flight: int
    _loaded_messages: int
    _loaded_bytes: int

    def has_entry(self, position: Position) -> bool:
        """Whether the message is loaded and not done."""
        return self._entry(position.batch, position.seq) is not None

    def held_entry(self, position: Position, nonce: int) -> Entry | None:
        """The entry of the delivery under `nonce` while the app holds it (in flight, or its
        ack being recorded); None once it is done or was delivered again."""
        entry = self._entry(position.batch, position.seq)
        return entry if entry is not None and entry.state in HELD and entry.nonce == nonce else None

    def in_flight_entry_or_none(self, position: Position) -> Entry | None:
        entry = self._entry(position.batch, position.seq)
        return entry if entry is not None and entry.state is State.IN_FLIGHT else None


    @property
    def ready_count(self) -> int:
        return sum(
            1 for loaded in self.batches.values() for e in loaded.entries.values() if e.state is State.READY
        )

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def loaded_messages(self) -> int:
        """Messages held in memory: loaded and not done."""
        return self._loaded_messages

    @property
    def loaded_bytes(self) -> int:
        """Payload bytes of the messages held in memory."""
        return self._loaded_bytes

    @property
    def heap_entries(self) -> int:
        return len(self._ready) + len(self._delayed) + len(self._deadlines)


    def waits_for_dead_letters(self, max_deliveries: int) -> bool:
        """Whether a waiting message was delivered `max_deliveries` times (if > 0): when its
        wait ends it goes to the dead-letter queue, so its holder must still be around."""
        if not max_deliveries:
            return False
        return any(e.state is State.DELAYED and e.deadline == due and e.deliveries >= max_deliveries
                   for due, batch, seq in self._delayed if (e := self._entry(batch, seq)) is not None)

    def dead_letter_due(self, max_deliveries: int, now: float) -> float | None:
        """The earliest time (this process's monotonic clock) a loaded message goes to the
        dead-letter queue with nobody receiving it: delivered `max_deliveries` times (if > 0),
        when its wait or visibility ends, or `now` if it already has. None: no such message."""
        if not max_deliveries:
            return None
        due = [now if e.state is State.READY else e.deadline for loaded in self.batches.values()
               for e in loaded.entries.values()
               if e.deliveries >= max_deliveries and e.state in (State.READY, State.DELAYED, State.IN_FLIGHT)]
        return min(due, default=None)

    def next_due(self) -> float | None:
        """The earliest time a delayed or in-flight message may become ready."""
        times = []
        if self._delayed:
            times.append(self._delayed[0][0])
        if self._deadlines:
            times.append(self._deadlines[0][0])
        return min(times) if times else None


    def _entry(self, batch: int, seq: int) -> Entry | None:
        loaded = self.batches.get(batch)
        return None if loaded is None else loaded.entries.get(seq)

    def _require_current(self, entry: Entry, nonce: int) -> None:
        if entry.state is State.ACKING and entry.nonce == nonce:
            raise StaleReceipt("an ack of this delivery is being recorded; it can no longer be nacked or extended")
        if entry.state is not State.IN_FLIGHT or entry.nonce != nonce:
            raise StaleReceipt(
                "receipt is stale: the message's visibility expired or it was delivered again"
            )

    def in_flight_entry(self, position: Position, nonce: int) -> Entry:
        """The entry of a message in flight under this nonce; StaleReceipt otherwise."""
        entry = self._entry(position.batch, position.seq)
        if entry is None:
            raise StaleReceipt(f"message {position.batch}/{position.seq} is not held by this consumer")
        self._require_current(entry, nonce)
        return entry
