"""A loaded message's state in its member's bookkeeping (casque.engine.shard_state), and
what a receive takes: the handout of one delivery and the byte budget it is taken under.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from casque.engine.messages import StoredMessage


class State(Enum):
    r"""Where a loaded message is in its life at the member that holds it (ShardState moves it).

    ::

        READY --take--> IN_FLIGHT --visibility ends, or nack--> DELAYED (a wait), or READY
          ^  ^            |  \--hand back (it never reached the app)--> READY
          |  |            \--ack--> ACKING --row written--> DONE
          |  |                       \--write failed--> IN_FLIGHT
          |  \--due-- DELAYED
        DELAYED or IN_FLIGHT whose time ends after maxDeliveries --> IN_FLIGHT to the dead-letter queue --> DONE

    A message's waiting time (DELAYED) is recorded in a NACK row before anybody is told about
    it, so a member that loads the message later (after a restart, a lease hand-over or a
    range take-over) loads it DELAYED until the same time.
    """

    READY = "ready"
    """Visible: the next receive may hand it out, once the messages of its key before it are done."""
    DELAYED = "delayed"
    """Waiting until `Entry.deadline`: nacked with a delay, or backing off under the retry
    policy after a nack naming none or an expired visibility. Then READY, or dead-lettered
    when its deliveries reached the subscriber's maxDeliveries (and it has a dead-letter queue)."""
    IN_FLIGHT = "in_flight"
    """In the app's hands until `Entry.deadline` (its key held, counted in flight); only the
    receipt of this delivery (`Entry.nonce`) may ack, nack or extend it. Also a message being
    moved to the dead-letter queue: if the move fails, its deadline ends and it is tried again."""
    ACKING = "acking"
    """An ack of the current delivery is being made durable: still in flight (its key held,
    counted in flight, never expired), done only once the write is confirmed."""
    DONE = "done"
    """Acked, dead-lettered, filtered out or past its TTL: its entry is dropped at once."""


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
class ShardCounters:
    delivered: int = 0
    redelivered: int = 0
    acked: int = 0
    expired_visibility: int = 0
    expired_ttl: int = 0
    filtered: int = 0


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
