"""A loaded message's state in its member's bookkeeping (casque.engine.shard_state), and
what a receive takes: the handout of one delivery and the byte budget it is taken under.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from casque.engine.messages import StoredMessage


class State(Enum):
    READY = "ready"
    DELAYED = "delayed"
    IN_FLIGHT = "in_flight"
    # An ack of the current delivery is being made durable: still in flight (its key held,
    # counted in flight, never expired), done only once the write is confirmed.
    ACKING = "acking"
    DONE = "done"


# Which of an ack's answers applies (ShardState.start_ack).
class AckStart(Enum):
    STARTED = "started"  # this ack moved the delivery to ACKING: the caller makes it durable
    PENDING = "pending"  # an ack of the same delivery is being made durable: share its outcome
    DONE = "done"  # done and durable already


@dataclass
class Entry:
    message: StoredMessage
    state: State = State.READY
    deliveries: int = 0
    nonce: int = 0
    deadline: float = 0.0  # in flight: visible again at this time; delayed: due at this time
    first_delivered_at: float | None = None
    last_error: str | None = None


@dataclass
class LoadedBatch:
    # Messages not done yet: a done one's entry is deleted, and so is the batch with its last.
    entries: dict[int, Entry]
    remaining: int


@dataclass
class ByteBudget:
    """Payload bytes one receive may still hand out, over all its shards. The first message
    always fits, so a message larger than the whole budget is still delivered, alone."""

    remaining: int
    spent: bool = False

    def fits(self, size: int) -> bool:
        return not self.spent or size <= self.remaining

    def spend(self, size: int) -> None:
        self.remaining -= size
        self.spent = True


@dataclass(frozen=True)
class Handout:
    entry: Entry
    nonce: int
    redelivery: bool
    # Over the subscriber's max deliveries: to be dead-lettered, not delivered.
    dead: bool = False
