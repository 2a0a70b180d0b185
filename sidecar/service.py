"""What the sidecar does, without HTTP: publish, receive, settle, seek, report, and shut down well.

One `QueueService` per sidecar. It keeps a publisher per queue it has published to
(reloaded when the queue's spec changes) and a consumer per subscriber it serves. Routes
translate HTTP to these calls and back; push delivery uses them too.

Shutdown order (see `drain`): refuse new publishes and receives, let the publishes that
were accepted finish their writes, keep answering acks for the messages already handed out
until they are settled or the drain time is over, then write acks and offsets and release
the leases. A publish is answered only after its batch is written, and the sidecar acks
only what the app acked, so a stop at any point loses nothing that was confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kazoo.exceptions import NoNodeError

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.delayed import DelayMover
from casque.engine.history import MessageHistory, message_history
from casque.engine.messages import Delivery, OutgoingMessage, Published
from casque.engine.offsets import SeekTarget, seek
from casque.engine.pipelines import keyed_outputs
from casque.engine.presence import Presence
from casque.engine.protocol import ProtocolLevel
from casque.engine.publisher import Publisher
from casque.engine.stats import QueueStats, SubscriberStats, queue_stats, subscriber_stats, with_live_report
from casque.errors import (
    BackendUnavailable,
    CasqueError,
    InvalidSpec,
    MessageTooLarge,
    NewerFormat,
    PartiallyPublished,
    PositionOutOfRange,
    QueueNotFound,
    SchemaViolation,
    SubscriberNotFound,
)
from casque.schema import QueueRef, validate_name
from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import BACKEND_FAILURES, NotReady, SubscriberNotServed, schema_refusal
from casque.sidecar.metrics import SidecarMetrics
from casque.sidecar.publishers import QueuePublishers
from casque.sidecar.models.receiving import SeekRequest
from casque.sidecar.stalls import StallWatch
from casque.specs import QueueState
from casque.store import Store

if TYPE_CHECKING:
    from casque.sidecar.push import PushWorker

log = logging.getLogger(__name__)

T = TypeVar("T")

# Blocking client calls (catalog, seek) fail with the drivers' own exceptions; these mean
# "a backend did not answer" and become 503s like the engine's BackendUnavailable.
_UNAVAILABLE = BACKEND_FAILURES
# A consumer that cannot start yet (its queue or subscriber not created, a backend down) is retried.
# A queue or subscriber written by a later casque (NewerFormat) waits too, in readiness, until
# this sidecar is upgraded or the installation rolled back.
_NOT_STARTED: tuple[type[BaseException], ...] = (QueueNotFound, SubscriberNotFound, BackendUnavailable, NewerFormat,
                                                 *_UNAVAILABLE)
# A long poll checks for shutdown this often, so a stopping sidecar answers its waiting
# receives at once instead of after their full wait.
POLL_SLICE_SECONDS = 1.0
# A drain waits this long at most for head watermarks to be written.
HEAD_FLUSH_SECONDS = 5.0
START_RETRY_MIN_SECONDS = 0.5
START_RETRY_MAX_SECONDS = 5.0
# Accepted publishes get this long to finish their writes during shutdown; the driver's
# own request timeout (10 s) ends each write well before.
WRITE_DRAIN_SECONDS = 30.0


def member_name() -> str:
    """A group member's name: the pod's (host) name, so stats say which pods consume, and a
    random suffix, since a restarted container must not pass for its predecessor."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "sidecar"
    return f"{host}-{uuid.uuid4().hex[:6]}"


async def blocking(call: Callable[..., T], *args: Any) -> T:
    """Run a blocking catalog call in a thread; an unreachable backend becomes BackendUnavailable."""
    try:
        return await asyncio.to_thread(call, *args)
    except _UNAVAILABLE as error:
        raise BackendUnavailable(f"{type(error).__name__}: {error}") from error


@dataclass
class Subscription:
    """A subscriber this sidecar consumes for; `consumer` is None until it has started."""

    name: str
    consumer: Consumer | None = None
    problem: str = "starting"
    push: PushWorker | None = None


class QueueService:
    def __init__(self, store: Store, settings: SidecarSettings, metrics: SidecarMetrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.queue = QueueRef(settings.namespace, settings.queue) if settings.queue else None
        self.subscriptions = {name: Subscription(name) for name in settings.subscribers}
        self.draining = False
        self._publishers = QueuePublishers(store, self._new_publisher)
        self._writes = 0
        self._writes_idle = asyncio.Event()
        self._writes_idle.set()
        self._starter: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._mover: DelayMover | None = None
        self._presence: Presence | None = None
        self.stalls = StallWatch()
        # Push workers (casque.sidecar.push) register here; the service stops them first on drain.
        self.on_consumer_started: list[Callable[[Subscription], None]] = []
        self.stoppers: list[Callable[[float], Awaitable[None]]] = []
        # The installation's protocol, followed from its znode (casque.engine.protocol).
        self.protocol = ProtocolLevel.watching(store)
        metrics.track_protocol(lambda: self.protocol.version, lambda: float(self.protocol.refusal is not None))

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start consuming in the background: the queue or subscriber may not exist yet."""
        if self.subscriptions:
            self._starter = asyncio.get_running_loop().create_task(self._start_consumers())

    async def _start_consumers(self) -> None:
        assert self.queue is not None
        delay = START_RETRY_MIN_SECONDS
        while not self.draining:
            if self._mover is None:
                await self._start_mover()
            pending = [s for s in self.subscriptions.values() if s.consumer is None]
            if not pending and self._mover is not None:
                return
            for subscription in pending:
                consumer = Consumer(self.store, self.queue, subscription.name, member_id=member_name())
                try:
                    await consumer.start()
                except _NOT_STARTED as error:
                    subscription.problem = f"{type(error).__name__}: {error}"
                    log.warning("subscriber %s not started yet: %s", subscription.name, subscription.problem)
                    with contextlib.suppress(Exception):
                        await consumer.stop()
                    continue
                if self.draining:
                    await consumer.stop()
                    return
                subscription.consumer = consumer
                subscription.problem = ""
                consumer.on_gone.append(functools.partial(self._consumer_ended, subscription))
                log.info("consuming %s for subscriber %s as member %s", self.queue, subscription.name,
                         consumer.member_id)
                for hook in self.on_consumer_started:
                    hook(subscription)
            if self._mover is not None and all(s.consumer for s in self.subscriptions.values()):
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, START_RETRY_MAX_SECONDS)

    def _consumer_ended(self, subscription: Subscription, consumer: Consumer) -> None:
        """The subscriber was deleted (or re-created): serve its next incarnation when there is one."""
        if subscription.consumer is not consumer:
            return
        subscription.consumer = None
        subscription.problem = consumer.gone_reason
        if not self.draining and (self._starter is None or self._starter.done()):
            self._starter = asyncio.get_running_loop().create_task(self._start_consumers())

    async def _start_mover(self) -> None:
        """Contend for moving the served queue's delayed messages into its log when due.

        Every sidecar of the queue contends and one is elected, so delayed messages keep
        moving while any of them runs.
        """
        queue = self.queue
        assert queue is not None
        try:
            await self.publisher(queue.name)  # the queue exists
        except (QueueNotFound, BackendUnavailable, NewerFormat) as error:
            log.info("delayed-message mover of %s not started yet: %s", queue, error)
            return

        async def move(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[Published]:
            # The current publisher: a spec change (more shards) replaces it.
            current = await self.publisher(queue.name)
            if current.state.incarnation != state.incarnation:
                raise QueueNotFound(f"queue {queue} was re-created while its delayed messages moved")
            return await current.publish([m for _, m in items], [i for i, _ in items])

        self._mover = DelayMover(self.store, queue, move,
                                 f"sidecar-{socket.gethostname()}-{os.getpid()}")
        self._mover.start()

    async def drain(self) -> None:
        """Stop taking work and finish what was taken (safe to call more than once)."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_seconds
        if self._starter is not None:
            self._starter.cancel()
            await asyncio.gather(self._starter, return_exceptions=True)
        # Push workers first: they stop receiving and settle what they are pushing.
        await asyncio.gather(*(stop(max(0.0, deadline - time.monotonic())) for stop in self.stoppers),
                             return_exceptions=True)
        try:
            await asyncio.wait_for(self._writes_idle.wait(), WRITE_DRAIN_SECONDS)
        except TimeoutError:
            log.error("%d publishes still writing after %ss; their callers get no answer", self._writes,
                      WRITE_DRAIN_SECONDS)
        if self._mover is not None:
            await self._mover.stop()
        consumers = [s.consumer for s in self.subscriptions.values() if s.consumer is not None]
        results = await asyncio.gather(
            *(c.stop(max(0.0, deadline - time.monotonic())) for c in consumers), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                log.error("stopping a consumer failed: %r", result)
        for publisher in self._publishers:
            # Bounded: heads retry until ZooKeeper answers, and readers repair a head left behind.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(publisher.flush_heads(), HEAD_FLUSH_SECONDS)
        log.info("drained: leases released, acks and offsets written")

    def _admit(self) -> None:
        if self.draining:
            raise NotReady("the sidecar is shutting down; retry on another sidecar or after its restart")

    # --- publishing ----------------------------------------------------------------------
    def queue_ref(self, name: str) -> QueueRef:
        try:
            return QueueRef(self.settings.namespace, name)
        except InvalidSpec as error:
            raise QueueNotFound(f"no queue {name!r}: {error}") from error

    async def publisher(self, name: str) -> Publisher:
        return await self._publishers.get(name)

    async def _new_publisher(self, name: str) -> Publisher:
        ref = self.queue_ref(name)
        state = await blocking(catalog.read_queue, self.store, ref)
        publisher = await blocking(
            lambda: Publisher(self.store, ref, state, linger=self.settings.publish_linger_seconds,
                              group_linger=self.settings.publish_group_linger_seconds, protocol=self.protocol)
        )
        # Seen by a raise of the protocol, though it may join no subscriber group.
        if self._presence is None:
            self._presence = Presence(self.store, member_name())
        await self._presence.announce(ref)
        return publisher

    async def publish(self, queue: str, messages: Sequence[OutgoingMessage]) -> list[Published]:
        """All or none: every message is checked before any is written."""
        self._admit()
        self.protocol.check()
        publisher = await self.publisher(queue)
        checked = list(messages)
        for index, message in enumerate(messages):
            try:
                checked[index] = publisher.checked(message)
            except SchemaViolation as error:
                self.metrics.schema_refusals.labels(queue, error.rule).inc()
                raise schema_refusal(error, index if len(messages) > 1 else None) from error
            except (MessageTooLarge, InvalidSpec) as error:
                where = f"messages[{index}]: " if len(messages) > 1 else ""
                raise type(error)(f"{where}{error}") from error
        messages = checked
        # The count of writes in flight, kept inline: an async context manager per publish
        # cost more than the count itself.
        self._writes += 1
        self._writes_idle.clear()
        try:
            results = await publisher.publish(messages)
        except PartiallyPublished as partial:
            self._count_published(queue, [o for o in partial.outcomes if isinstance(o, Published)])
            raise
        finally:
            self._writes -= 1
            if self._writes == 0:
                self._writes_idle.set()
        self._count_published(queue, results)
        return results

    def _count_published(self, queue: str, results: list[Published]) -> None:
        fresh = sum(1 for r in results if not r.duplicate)
        self.metrics.published.labels(queue).inc(fresh)
        if fresh != len(results):
            self.metrics.duplicates.labels(queue).inc(len(results) - fresh)

    # --- consuming -----------------------------------------------------------------------
    async def served(self, queue: str, subscriber: str) -> tuple[Subscription, Consumer]:
        """The running consumer of a subscriber this sidecar serves, or the right refusal."""
        subscription = self.subscriptions.get(subscriber) if self.queue and queue == self.queue.name else None
        if subscription is None:
            ref = self.queue_ref(queue)
            await self._require_subscriber(ref, subscriber)
            served = ", ".join(f"{self.queue.name}/{s}" for s in self.subscriptions) if self.queue else "none"
            raise SubscriberNotServed(
                f"this sidecar does not consume for {ref}/{subscriber} (it serves: {served or 'none'})"
            )
        if subscription.consumer is None:
            raise NotReady(f"subscriber {subscriber} is not consuming yet: {subscription.problem}")
        return subscription, subscription.consumer

    async def _require_subscriber(self, ref: QueueRef, subscriber: str) -> None:
        try:
            validate_name("subscriber", subscriber)
        except InvalidSpec as error:
            raise SubscriberNotFound(f"no subscriber {subscriber!r}: {error}") from error
        await blocking(catalog.read_queue, self.store, ref)
        await blocking(catalog.read_subscriber, self.store, ref, subscriber)

    async def receive(
        self, queue: str, subscriber: str, max_messages: int, wait: float, visibility: float | None,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> list[Delivery]:
        """Deliveries for the app; `abandoned()` says its connection has closed (then nothing
        is taken for it, and what was taken is handed back: Consumer.receive)."""
        self._admit()
        _, consumer = await self.served(queue, subscriber)
        deadline = time.monotonic() + min(wait, self.settings.max_wait_seconds)
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            got = await consumer.receive(max_messages, min(remaining, POLL_SLICE_SECONDS), visibility,
                                         self.settings.max_receive_bytes, abandoned)
            if got or remaining <= POLL_SLICE_SECONDS or self.draining or abandoned():
                break
        return got

    async def hand_back(self, queue: str, subscriber: str, deliveries: list[Delivery]) -> None:
        """Deliveries whose answer never reached the app: visible again at once, uncounted."""
        _, consumer = await self.served(queue, subscriber)
        back = consumer.hand_back(deliveries)
        if back:
            self.metrics.handed_back.labels(queue, subscriber).inc(back)

    def count_deliveries(self, queue: str, subscriber: str, deliveries: Sequence[Delivery]) -> None:
        """Deliveries the app got (counted once its answer is written)."""
        if deliveries:
            self.metrics.received.labels(queue, subscriber).inc(len(deliveries))
            again = sum(1 for d in deliveries if d.delivery_count > 1)
            if again:
                self.metrics.redelivered.labels(queue, subscriber).inc(again)

    # --- settling deliveries ----------------------------------------------------------------
    # Allowed while draining: finishing what was handed out is what the drain waits for.
    # Each receipt succeeds or fails on its own; concurrent acks share ack-log writes.
    async def ack(self, queue: str, subscriber: str, receipts: Sequence[str]) -> list[bool | CasqueError]:
        _, consumer = await self.served(queue, subscriber)
        # One call for the lot: acks of a completed batch become durable with one offset write.
        outcomes = await consumer.ack_many(list(receipts))
        acked = sum(1 for o in outcomes if o is True)
        if acked:
            self.metrics.acked.labels(queue, subscriber).inc(acked)
        return outcomes

    async def ack_publishing(
        self, queue: str, subscriber: str, receipt: str, target: str, outputs: Sequence[OutgoingMessage]
    ) -> tuple[list[Published] | None, bool | CasqueError]:
        """Ack a delivery with the messages it resulted in (casque.engine.pipelines): they are
        published first, under keys derived from the delivered message, then it is acked. What
        was published (None if nothing was, the delivery being acked before) and the ack's
        outcome; a refused publish is the outcome, and the delivery stays in flight."""
        _, consumer = await self.served(queue, subscriber)
        published = None
        try:
            message = consumer.held_message(receipt)
            if message is not None:
                keyed = keyed_outputs(outputs, consumer.subscriber_state.ack_key(subscriber), message.message_id,
                                      consumer.queue_state.spec.retention_seconds)
                published = await self.publish(target, keyed)
        except CasqueError as error:
            return None, error
        (outcome,) = await self.ack(queue, subscriber, [receipt])
        return published, outcome

    async def nack(
        self, queue: str, subscriber: str, receipts: Sequence[str], delay: float | None, error: str | None = None
    ) -> list[None | CasqueError]:
        _, consumer = await self.served(queue, subscriber)
        outcomes = await consumer.nack_many(list(receipts), delay, error)
        nacked = sum(1 for o in outcomes if o is None)
        if nacked:
            self.metrics.nacked.labels(queue, subscriber).inc(nacked)
        return outcomes

    async def extend(
        self, queue: str, subscriber: str, receipts: Sequence[str], visibility: float
    ) -> list[float | CasqueError]:
        """Per receipt: the monotonic time until which it stays invisible, or why not."""
        _, consumer = await self.served(queue, subscriber)

        async def one(receipt: str) -> float:
            return time.monotonic() + await consumer.extend(receipt, visibility)

        return await _each(receipts, one)

    # --- stats and seek --------------------------------------------------------------------
    async def queue_stats(self, queue: str) -> QueueStats:
        return await _guarded(queue_stats(self.store, self.queue_ref(queue)))

    async def subscriber_stats(self, queue: str, subscriber: str) -> SubscriberStats:
        ref = self.queue_ref(queue)
        try:
            validate_name("subscriber", subscriber)
        except InvalidSpec as error:
            raise SubscriberNotFound(f"no subscriber {subscriber!r}: {error}") from error
        stats = await _guarded(subscriber_stats(self.store, ref, subscriber))
        subscription = self.subscriptions.get(subscriber) if self.queue == ref else None
        if subscription is not None and subscription.consumer is not None:
            consumer = subscription.consumer
            stats = with_live_report(stats, consumer.member_id, consumer.report())
        return stats

    async def message_history(self, queue: str, message_id: str) -> MessageHistory:
        return await _guarded(message_history(self.store, self.queue_ref(queue), message_id))

    async def seek(self, queue: str, subscriber: str, request: SeekRequest) -> dict[int, int]:
        ref = self.queue_ref(queue)
        await self._require_subscriber(ref, subscriber)
        if request.to is not None:
            target = SeekTarget(kind=request.to)
        elif request.time is not None:
            target = SeekTarget(kind="time", time=request.time)
        else:
            batches = {int(shard): batch for shard, batch in (request.batches or {}).items()}
            logs = set((await blocking(catalog.read_queue, self.store, ref)).spec.log_shards())
            outside = sorted(set(batches) - logs)
            if outside:
                raise PositionOutOfRange(
                    f"queue {ref} has no shard {outside[0]} (its shards: {', '.join(map(str, sorted(logs)))})"
                )
            target = SeekTarget(kind="batch", batches=batches)
        return await blocking(seek, self.store, ref, subscriber, target)


async def _each(receipts: Sequence[str], action: Callable[[str], Awaitable[T]]) -> list[T | CasqueError]:
    """`action` on every receipt at once; casque's refusals are results, anything else is raised."""
    results = await asyncio.gather(*(action(r) for r in receipts), return_exceptions=True)
    outcomes: list[T | CasqueError] = []
    for result in results:
        if isinstance(result, CasqueError):
            outcomes.append(result)
        elif isinstance(result, BaseException):
            raise result
        else:
            outcomes.append(result)
    return outcomes


async def _guarded(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except NoNodeError as error:  # before the other ZooKeeper errors, which are retryable
        # A znode that vanished under the read: the queue or subscriber was deleted meanwhile.
        raise QueueNotFound(f"the queue or subscriber was removed while reading: {error}") from error
    except _UNAVAILABLE as error:
        raise BackendUnavailable(f"{type(error).__name__}: {error}") from error
