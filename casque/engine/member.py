"""What the parts of a consumer-group member share: its counters, its retry backoff, the
subscriber's redelivery backoff and filter, and the view of the member that its shard
readers, claimed ranges and shared delivery work through.

The member (casque.engine.consumer.Consumer) sits above all of them; they see it only as the
`Member` protocol below, so no module of the group imports the one that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from casque.engine.acks import AckLog
from casque.engine.batches import Log
from casque.engine.checkpoints import OffsetCheckpoints
from casque.engine.leases import ShardLeases
from casque.engine.messages import StoredMessage, event_source_of, filter_variables
from casque.errors import CasqueError
from casque.filters import compile_filter
from casque.schema import QueueRef
from casque.specs import SubscriberState, priority_of
from casque.store import Store
from casque.znodes import SubscriberPaths

# A failing read, commit or resync is tried again after a backoff between these bounds.
RETRY_MIN_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0


class ConsumerStopped(CasqueError):
    code = "consumer_stopped"


@dataclass
class ConsumerCounters:
    deliveries: int = 0
    redeliveries: int = 0
    acks: int = 0
    nacks: int = 0
    dead_lettered: int = 0
    # Messages the subscriber's filter did not match: done without being delivered.
    filtered: int = 0
    offset_commits: int = 0
    batch_reads: int = 0
    ack_bucket_reads: int = 0
    expired_skipped: int = 0
    retries: int = 0
    leases_lost: int = 0
    seeks_applied: int = 0
    # Offsets found behind their checkpoint at a lease acquisition and moved up to it.
    offsets_rebuilt: int = 0
    # Deliveries put back because the app never got them (its connection had closed).
    handed_back: int = 0
    # Lease checks after ack rows: answered by ZooKeeper, and proven without asking it.
    lease_checks: int = 0
    lease_proofs: int = 0


@dataclass(frozen=True)
class ShardStatus:
    held: list[int]
    # Due to this member but not held, and held but failing to read or commit.
    missing: list[int] = field(default_factory=list)
    failing: dict[int, str] = field(default_factory=dict)
    problem: str = ""

    @property
    def unread(self) -> int:
        """Shards due to this member that nobody reads now (all of them, as far as it knows, when
        it is not in the group: then the count is what it holds, at least one)."""
        if self.problem and not self.missing and not self.failing:
            return max(1, len(self.held))
        return len(self.missing) + len(self.failing)


class Backoff:
    """Exponential backoff for a retried step; `reset` after a success."""

    def __init__(self) -> None:
        self.delay = RETRY_MIN_SECONDS

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, RETRY_MAX_SECONDS)
        return delay

    def reset(self) -> None:
        self.delay = RETRY_MIN_SECONDS


class LeasedReader(Protocol):
    """A leased shard's reader, as the member keeps it."""

    @property
    def shard(self) -> int: ...

    @property
    def fence(self) -> int: ...

    def wake(self) -> None: ...

    async def stop(self, flush: bool) -> None: ...


class Member(Protocol):
    """The member of a subscriber's group, as its readers and claimed ranges see it."""

    # Set by a reader that found the member's whole prefetch budget spent; cleared when space frees.
    prefetch_blocked: bool
    # The offsets' checkpoints in Cassandra (casque.engine.checkpoints); None before start.
    checkpoints: OffsetCheckpoints | None

    @property
    def store(self) -> Store: ...

    @property
    def queue(self) -> QueueRef: ...

    @property
    def subscriber(self) -> str: ...

    @property
    def member_id(self) -> str: ...

    @property
    def paths(self) -> SubscriberPaths: ...

    @property
    def log(self) -> Log: ...

    @property
    def acks(self) -> AckLog: ...

    @property
    def counters(self) -> ConsumerCounters: ...

    @property
    def subscriber_state(self) -> SubscriberState: ...

    @property
    def visibility_timeout(self) -> float: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def leases(self) -> ShardLeases | None: ...

    @property
    def readers(self) -> Mapping[int, LeasedReader]: ...

    def notify(self) -> None:
        """Wake the receives waiting for a message."""

    def loaded_bytes(self) -> int:
        """Payload bytes held over all the member's sources."""

    def group_members(self) -> list[str]:
        """The live members of the group, as last seen."""

    def in_background(self, work: Coroutine[Any, Any, object]) -> None:
        """Run `work` as a task the member awaits when it stops."""

    def lease_lost(self, reader: LeasedReader) -> None:
        """A commit found the shard's fence moved: drop the shard."""

    def subscriber_gone(self, reason: str) -> None:
        """The subscriber no longer exists: end."""

    def resync(self) -> None:
        """Compare the held shards' epochs with their offsets (a seek may have moved them)."""



def message_filter(member: Member) -> Callable[[StoredMessage], bool]:
    """The subscriber's filter as a shard's state asks for it (ShardState.matches): read at
    each use, so a changed filter applies to every message not yet delivered."""
    queue = member.queue
    default_source = event_source_of(queue.namespace, queue.name)

    def matches(message: StoredMessage) -> bool:
        expression = member.subscriber_state.spec.message_filter
        if expression is None:
            return True
        return compile_filter(expression).matches(
            filter_variables(message, priority_of(message.position.shard), default_source))

    return matches


def redelivery_backoff(member: Member) -> Callable[[int], float]:
    """The subscriber's retry policy as a shard's state asks for it (ShardState.backoff):
    read at each use, so a changed policy applies to the messages already loaded."""

    def backoff(deliveries: int) -> float:
        retry = member.subscriber_state.spec.retry
        return 0.0 if retry is None else retry.backoff(deliveries)

    return backoff


def dead_letter_limit(member: Member) -> int:
    """The deliveries after which a message goes to the dead-letter queue; 0 without one
    (redelivery is unlimited then: nothing is ever dropped)."""
    spec = member.subscriber_state.spec
    return spec.max_deliveries if spec.dead_letter_queue else 0
