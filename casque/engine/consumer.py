"""A consumer: one member of a subscriber's group, delivering from the shards it leases or ranges it claims.

The member is the facade over one module per concern: shard leases and membership
(casque.engine.leases), a leased shard's reading and offset commits (shard_reader), shared
delivery's claimed ranges (sharing, claim_reader, foreign_ranges), taking deliveries and
dead letters (delivering), and acks answered only when durable (acking). Those see the
member only as casque.engine.member.Member.

`receive` takes ready messages round-robin over all sources, so no shard is stranded, and
long-polls on an event instead of a timer. Each delivery gets a receipt naming its nonce;
ack, nack and extend must present the current one.

Faults: seeks are recognised by the epoch in the offset znode and handled shard by shard; a
session loss drops every shard, and the member rejoins (casque.engine.leases). A member cut
from Cassandra for a session timeout steps back: it leaves the group, hands its shards over,
lets its claims lapse, and rejoins once Cassandra answers (casque.engine.reachability). A
subscriber deleted (or deleted and created again) ends this consumer: its waiting calls get
SubscriberNotFound, and the owner starts a new consumer for the new incarnation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import DataWatch
from pydantic import ValidationError

from casque.backends import zk
from casque.engine import catalog, grants, offsets
from casque.engine.acking import AckTaker, Source
from casque.engine.acks import AckLog
from casque.engine.batches import Log
from casque.engine.checkpoints import CheckpointWriter, Checkpoints, OffsetCheckpoints
from casque.engine.counters import QueueCounters
from casque.engine.delivering import Deliverer, deliverer_of
from casque.engine.entries import ByteBudget
from casque.engine.leases import ShardLeases
from casque.engine.member import Backoff, ConsumerCounters, ConsumerStopped, LeasedReader, ShardStatus
from casque.engine.messages import Delivery, Position, StoredMessage
from casque.engine.protocol import PROTOCOL
from casque.engine.publisher import Publisher
from casque.engine.leased_delivery import LeasedDelivery
from casque.engine.reachability import CassandraReach
from casque.engine.shard_reader import ShardReader
from casque.engine.sharing import SharedDelivery
from casque.errors import BackendUnavailable, CasqueError, NewerFormat, QuotaExceeded, SubscriberNotFound
from casque.schema import QueueRef
from casque.specs import QueueState, SubscriberState
from casque.store import Store

log = logging.getLogger(__name__)

__all__ = ["Consumer", "ConsumerStopped"]
# Each consumer reports its in-flight and delivery counts in its member znode this often.
REPORT_INTERVAL_SECONDS = 5.0


@dataclass
class Consumer:
    """Receives from one subscriber of one queue. Start it, use it, stop it."""

    store: Store
    queue: QueueRef
    subscriber: str
    member_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self.counters = ConsumerCounters()
        self._leased = LeasedDelivery(self)
        self.prefetch_blocked = False
        self._available = asyncio.Event()
        self.waiting_receives = 0  # receives waiting for a message to become available (long polls)
        self._leases: ShardLeases | None = None
        self._sharing: SharedDelivery | None = None  # shared delivery: claimed ranges instead of leases
        self._reach: CassandraReach | None = None
        self.checkpoints: OffsetCheckpoints | None = None
        self._stopped = False
        self._resync_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[object]] = set()
        # Why this consumer ended by itself (its subscriber was deleted); empty while it serves.
        self.gone_reason = ""
        # Whether the subscriber still exists after this consumer ended (a delivery mode change).
        self._gone_but_present = False
        self.on_gone: list[Callable[[Consumer], None]] = []

    async def start(self) -> None:
        self.queue_state: QueueState = await asyncio.to_thread(catalog.read_queue, self.store, self.queue)
        self.subscriber_state: SubscriberState = await asyncio.to_thread(
            catalog.read_subscriber, self.store, self.queue, self.subscriber
        )
        spec = self.queue_state.spec
        self.log = Log(self.store, self.queue, spec.consistency)
        self.acks = AckLog(self.store, self.queue, self.subscriber_state.ack_key(self.subscriber),
                           spec.retention_seconds)
        self.checkpoints = CheckpointWriter(Checkpoints(self.store, self.queue, self.queue_state.shared_key(self.queue))
                                            ).offset(self.subscriber_state.ack_key(self.subscriber))
        self.paths = self.store.paths(self.queue).subscriber(self.subscriber)
        subscriber_spec = self.subscriber_state.spec
        self._deliverer = await deliverer_of(self, self.sources, self._source_for,
                                             self.queue_state.shared_key(self.queue),
                                             lambda: self.queue_state.spec.retention_seconds)
        self._ack_taker = AckTaker(self, self._deliverer.source_of)
        shared = subscriber_spec.delivery == "shared"
        # In shared delivery the leases only keep the member registered (no shard is leased).
        self._leases = ShardLeases(
            self.store.zk, self.paths, self.member_id, [] if shared else spec.log_shards(),
            on_acquired=self._leased.acquired, on_released=self._leased.released, on_lost=self._leased.lost,
            on_trusted=self.notify,
        )
        if shared:
            self._sharing = SharedDelivery(self, spec.log_shards())
        loop = asyncio.get_running_loop()
        active = lambda: not self._stopped  # noqa: E731
        DataWatch(self.store.zk, self.paths.seek, zk.watch_in_loop(loop, self._seek_changed, active))
        DataWatch(self.store.zk, self.store.paths(self.queue).base, zk.watch_in_loop(loop, self._queue_changed, active))
        DataWatch(self.store.zk, self.paths.base, zk.watch_in_loop(loop, self._subscriber_changed, active))
        await self._leases.start()
        if self._sharing is not None:
            await self._sharing.start()
        leases = self._leases
        probed = spec.log_shards()[0]
        self._reach = CassandraReach(lambda: self.log.read_header(probed, 0), lambda: leases.session_seconds,
                                     self._reach_changed)
        self._reach.start()
        self._tasks = [loop.create_task(self._report_loop()), loop.create_task(self._resync_loop()),
                       loop.create_task(self._deliverer.run_timers(lambda: self._stopped))]

    def report(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight(), "delivered": self.counters.deliveries,
            "redelivered": self.counters.redeliveries,
            "dead_lettered": self.counters.dead_lettered,
            "filtered": self.counters.filtered,
            "acked": self.counters.acks,
            "shards": len(self.held_shards),
            "protocol": PROTOCOL,  # what it speaks, for a raise of the installation's (protocol_change)
        }

    async def publish_report(self) -> None:
        """Write this consumer's counters into its member znode (read by subscriber stats)."""
        try:
            await zk.call(self.store.zk.set_async, self.paths.member(self.member_id), json.dumps(self.report()).encode())
        except (NoNodeError, BackendUnavailable):
            pass  # re-registering after a session loss; the next report lands

    async def _report_loop(self) -> None:
        while not self._stopped:
            await self.publish_report()
            await asyncio.sleep(REPORT_INTERVAL_SECONDS)

    @property
    def stopping(self) -> bool:
        return self._stopped

    @property
    def visibility_timeout(self) -> float:
        return float(self.subscriber_state.spec.visibility_timeout_seconds)

    @property
    def held_shards(self) -> set[int]:
        """Shards this member delivers from now: leased, or with a claimed range in shared delivery."""
        if self._sharing is not None:
            return {source.shard for source in self._sharing.sources()}
        return set(self.readers)

    def answered_shards(self) -> list[int]:
        """The shards whose progress this member answers for: its leased ones, or all (shared)."""
        if self._sharing is not None:
            return list(self._sharing.shards)
        return sorted(self.readers)

    @property
    def leases(self) -> ShardLeases | None:
        """The shard leases of leased delivery (None in shared delivery, or before start)."""
        return self._leases

    def group_members(self) -> list[str]:
        """The live members of this consumer's group, as last seen."""
        return self._leases.members if self._leases is not None else []

    def sources(self) -> list[Source]:
        """What deliveries come from: the leased shards' readers, or the claimed ranges."""
        if self._sharing is not None:
            return list(self._sharing.sources())
        return [self.readers[shard] for shard in sorted(self.readers)]

    def _source_for(self, position: Position) -> Source | None:
        if self._sharing is not None:
            return self._sharing.source_for(position)
        return self.readers.get(position.shard)

    def notify(self) -> None:
        self._available.set()

    def in_background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _reach_changed(self, reachable: bool) -> None:
        """Cassandra stopped or started answering (casque.engine.reachability): step back or rejoin."""
        if self._leases is not None:
            if reachable:
                self._leases.rejoin()
            else:
                self._leases.step_back()
        if self._sharing is not None:
            self._sharing.stepped_back = not reachable
            self._sharing.space_freed()
        self.notify()

    # --- leased shards ----------------------------------------------------------------------
    @property
    def readers(self) -> dict[int, ShardReader]:
        """The readers of the shards this member leases (none in shared delivery)."""
        return self._leased.readers

    def lease_lost(self, reader: LeasedReader) -> None:
        self._leased.lease_lost(reader)

    # --- seeks and spec changes ------------------------------------------------------------
    def _seek_changed(self, *_: object) -> None:
        self.resync()

    def resync(self) -> None:
        """Compare every held shard's epoch with its offset znode and restart the ones a seek moved.

        An event, not a flag: a seek noticed while a resync runs causes one more pass."""
        self._resync_wanted.set()

    async def _resync_loop(self) -> None:
        backoff = Backoff()
        while not self._stopped:
            await self._resync_wanted.wait()
            self._resync_wanted.clear()
            try:
                await self._resync()
                backoff.reset()
            except Exception as error:
                log.warning("applying a seek failed (%s); retrying", error)
                self.counters.retries += 1
                await asyncio.sleep(backoff.next())
                self._resync_wanted.set()

    async def _resync(self) -> None:
        if self._sharing is not None:
            await self._sharing.resync()
        else:
            await self._leased.resync()
        self.notify()

    def _queue_changed(self, data: bytes | None, *_: object) -> None:
        if not data:
            return  # the queue's deletion removes the subscriber too, which ends this consumer
        try:
            state = QueueState.model_validate_json(data)
        except (ValidationError, NewerFormat) as error:
            log.error("queue %s changed to a state this consumer cannot read, it keeps its own: %s", self.queue, error)
            return
        if grants.excess(state.spec, grants.QueueGrant.of(self.queue_state.spec)):
            # More than this consumer acts on: only within the queue's grant (a namespace may write its spec znode).
            self.in_background(self._adopt_checked_queue_state())
            return
        self._adopt_queue_state(state)

    async def _adopt_checked_queue_state(self) -> None:
        try:
            state = await asyncio.to_thread(catalog.read_queue, self.store, self.queue)
        except QuotaExceeded as refused:
            log.error("%s", refused)
            return
        except (CasqueError, *zk.RETRYABLE) as error:
            # The next change of the spec reads it again; until then the consumer keeps what it had.
            log.warning("queue %s changed, and reading it again failed: %s", self.queue, error)
            return
        self._adopt_queue_state(state)

    def _adopt_queue_state(self, state: QueueState) -> None:
        self.queue_state = state
        if self._sharing is not None:
            self._sharing.set_shards(state.spec.log_shards())
        elif self._leases is not None:
            # Shards or priority levels added: take part in consuming them at once.
            self._leases.set_shards(state.spec.log_shards())

    def _subscriber_changed(self, data: bytes | None, *_: object) -> None:
        if not data:
            self.subscriber_gone(f"subscriber {self.subscriber} was deleted")
            return
        try:
            state = SubscriberState.model_validate_json(data)
        except (ValidationError, NewerFormat) as error:
            log.error("subscriber %s changed to a state this consumer cannot read: %s", self.subscriber, error)
            return
        if state.incarnation != self.subscriber_state.incarnation:
            self.subscriber_gone(f"subscriber {self.subscriber} was deleted and created again")
            return
        old = self.subscriber_state.spec
        if (state.spec.delivery, state.spec.ordered_keys) != (old.delivery, old.ordered_keys):
            # Leases and claims do not mix, nor do ranges claimed with and without their keys:
            # end, and the owner starts a consumer in the new mode.
            self._gone_but_present = True
            self.subscriber_gone(f"subscriber {self.subscriber} switched to {state.spec.delivery} delivery"
                                 f"{' with ordered keys' if state.spec.ordered_keys else ''}")
            return
        self.subscriber_state = state

    def subscriber_gone(self, reason: str) -> None:
        """The subscriber this consumer serves no longer exists: end, and tell the owner."""
        if self.gone_reason or self._stopped:
            return
        self.gone_reason = reason
        log.warning("%s: this consumer stops", reason)
        self.in_background(self._end())

    async def _end(self) -> None:
        await self.stop()
        for callback in self.on_gone:
            callback(self)

    # --- the queue API -----------------------------------------------------------------
    async def receive(
        self, max_messages: int = 10, wait: float = 0.0, visibility: float | None = None, max_bytes: int | None = None,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> list[Delivery]:
        """Up to `max_messages` deliveries; waits up to `wait` seconds for the first one.
        With `max_bytes`, the payloads handed out stop at that sum (one message at least).

        Each delivery's count is durable before it is returned, so a message that crashes
        every consumer it reaches still reaches the subscriber's max deliveries. Once
        `abandoned()` is true (the caller's client has gone) it returns nothing, and hands
        back what it took: no delivery is stranded invisible for a client that left.
        """
        deadline = time.monotonic() + wait
        while True:
            if abandoned():
                return []
            if self.gone_reason:
                if self._gone_but_present:
                    raise ConsumerStopped(f"{self.gone_reason}; try again")
                raise SubscriberNotFound(self.gone_reason)
            if self._stopped:
                raise ConsumerStopped("the consumer is shutting down")
            self._available.clear()
            if self._sharing is not None:
                self._sharing.demand()
            budget = ByteBudget(max_bytes) if max_bytes is not None else None
            got = self._take(max_messages, visibility or self.visibility_timeout, budget)
            if got:
                try:
                    if self._sharing is not None:
                        # Claims first: a delivery whose range could not be kept is put back uncounted.
                        got, uncovered = await self._sharing.cover(got)
                        self.hand_back(uncovered)
                    if got and abandoned():
                        self.hand_back(got)
                        return []
                    if got:
                        await self._deliverer.record(got)
                        if self._sharing is None or self._sharing.vouched_for(got):
                            return got
                        # Recorded, but a range may have gone to another member meanwhile.
                        self.hand_back(got)
                        continue
                except BaseException:
                    self.hand_back(got)  # cancelled, or not recorded: nothing was handed to anybody
                    raise
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return []
            due = [t for r in self.sources() if (t := r.state.next_due()) is not None]
            if due:
                remaining = min(remaining, max(0.0, min(due) - now) + 0.001)
            self.waiting_receives += 1
            try:
                await asyncio.wait_for(self._available.wait(), remaining)
            except TimeoutError:
                pass
            finally:
                self.waiting_receives -= 1

    def _take(self, max_messages: int, visibility: float, budget: ByteBudget | None) -> list[Delivery]:
        if self._reach is not None and not self._reach.reachable:
            return []  # stepped back: its shards and ranges are going to the other members
        if self._sharing is None and self._leases is not None and not self._leases.trusted:
            # SUSPENDED, or no word from ZooKeeper for a while (a pause): our leases may be
            # gone to other members; hand out nothing until the session is confirmed alive.
            # (Claims need no such check: each one says itself until when it is ours.)
            return []
        return self._deliverer.take(max_messages, visibility, budget)

    def hand_back(self, deliveries: list[Delivery]) -> int:
        """Put back deliveries that never reached the app (casque.engine.delivering)."""
        return self._deliverer.hand_back(deliveries)

    async def ack(self, receipt: str) -> bool:
        """Acknowledge a delivery. True if this ack completed it, False if it was done already."""
        (result,) = await self.ack_many([receipt])
        if isinstance(result, CasqueError):
            raise result
        return result

    async def ack_many(self, receipts: list[str]) -> list[bool | CasqueError]:
        """Acknowledge several deliveries at once; one result (or error) per receipt, in order.
        Each is answered only once it is durable (casque.engine.acking)."""
        return await self._ack_taker.ack_many(receipts)

    def held_message(self, receipt: str) -> StoredMessage | None:
        """The message of a delivery the app holds; None once done (acked); StaleReceipt if not its."""
        return self._deliverer.held_message(receipt)

    async def nack(self, receipt: str, delay: float | None = None, error: str | None = None) -> None:
        """Visible again after `delay` seconds (None: the retry backoff, or at once); answered once durable."""
        (result,) = await self.nack_many([receipt], delay, error)
        if result is not None:
            raise result

    async def nack_many(self, receipts: list[str], delay: float | None, error: str | None) -> list[None | CasqueError]:
        """Nack deliveries in one write: None or the error per receipt (casque.engine.delivering)."""
        return await self._deliverer.nack_many(receipts, delay, error)

    async def extend(self, receipt: str, visibility: float) -> float:
        """Keep a delivery invisible for `visibility` more seconds; returns seconds until it is visible."""
        return await self._deliverer.extend(receipt, visibility)

    async def dead_letter(self, receipt: str, error: str | None = None) -> None:
        """Send a delivery to the dead-letter queue now: the app says it can never be processed.

        Returns once the copy is published and the message is done; raises InvalidSpec if the
        subscriber has no dead-letter queue, StaleReceipt if the receipt is not current.
        """
        await self._deliverer.dead_letter(receipt, error)

    async def health(self) -> tuple[bool, str]:
        """Whether this member consumes everything due to it, and if not, why (for readiness)."""
        status = await self.shard_status()
        return status.problem == "", status.problem or f"holding shards {','.join(map(str, status.held)) or 'none'}"

    async def shard_status(self) -> ShardStatus:
        """Which shards are due to this member, held, and failing."""
        held = sorted(self.held_shards)
        if self.gone_reason:
            return ShardStatus(held, problem=self.gone_reason)
        leases = self._leases
        if leases is None:
            return ShardStatus(held, problem="starting")
        if self._reach is not None and self._reach.problem:
            return ShardStatus(held, problem=self._reach.problem)
        if not leases.connected or not leases.registered:
            return ShardStatus(held, problem="not in the group: rejoining after a ZooKeeper session loss")
        if self._sharing is not None:
            return self._sharing.status(held)
        return await self._leased.status(leases, held)

    def in_flight(self) -> int:
        return sum(r.state.in_flight for r in self.sources())

    def loaded_bytes(self) -> int:
        """Payload bytes held over all leased shards or claimed ranges (the prefetch budget's measure)."""
        return sum(r.state.loaded_bytes for r in self.sources())

    async def stop(self, drain_seconds: float = 0.0) -> None:
        """Stop: wait up to `drain_seconds` for in-flight messages to be acked, write acks, offsets
        and checkpoints, release the leases. Unacked messages go to the next holder."""
        deadline = time.monotonic() + drain_seconds
        while self.in_flight() and time.monotonic() < deadline and not self.gone_reason:
            await asyncio.sleep(0.05)
        if self._stopped:
            return
        self._stopped = True
        self.notify()
        current = asyncio.current_task()
        others = [t for t in self._background if t is not current]
        if others:
            await asyncio.gather(*others, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reach is not None:
            await self._reach.stop()
        if self._sharing is not None:
            await self._sharing.stop()
        if self._leases is not None:
            await self._leases.stop()
        for shard, reader in list(self.readers.items()):
            await self._leased.released(shard, reader.fence)
        if (deliverer := getattr(self, "_deliverer", None)) is not None:  # None: start failed early
            await deliverer.flush()
        if self.checkpoints is not None:
            await self.checkpoints.flush()
