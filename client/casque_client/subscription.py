"""Handler-style consuming: `subscribe()` receives, runs a handler per message, and settles it.

    async def handle(message: Message) -> None:
        await charge(message.data)

    await subscribe("orders", "billing", handle, concurrency=8)

What it guarantees:

- at most `concurrency` handlers run at once; a receive asks only for as many messages as
  there are free slots, so no message waits invisible in the client while its visibility
  timeout runs out;
- while a handler runs, its message's visibility is extended in the background when half
  of what is left has passed, so a slow handler is not raced by a redelivery to another
  worker. Half, not "just before": an extend is an HTTP call that may be retried, and the
  margin has to cover those retries on a loaded machine;
- a handler that returns acks its message; one that returns `Outputs` acks it with them, so
  they are published exactly once however often the message comes back; one that raises nacks it, with the exception's
  text (kept in the message's history, and in the dead-letter queue after `maxDeliveries`)
  and a delay from `nack_delay` (by default exponential on the delivery count, jittered, so
  messages that failed together do not all come back together; None leaves the delay to
  the subscriber's retry policy, `spec.retry`);
- stopping (cancelling the task, or setting `stop`) stops receiving, lets the handlers that
  run finish for up to `grace` seconds (their messages are acked or nacked as usual), and
  nacks with no delay the messages of those still running after that, so another worker
  takes them at once. A receive cut off by the stop may have had messages in flight on the
  wire: they come back after their visibility timeout. Nothing is lost either way; delivery
  is at-least-once, so handlers must be idempotent (the message `id` is stable).

Errors the sidecar may get over (a 5xx, a refused connection while it restarts) make the
receive loop back off and try again; a refusal that will not change by itself (an unknown
queue or subscriber, a bad token) stops the subscription with its `ApiError`, after the
running handlers are settled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from casque_client.client import AsyncClient, Message, Outputs, RetryPolicy
from casque_client.errors import ApiError, ClientError, SidecarUnreachable
from casque_client.tracing import handler_span

log = logging.getLogger("casque_client")
T = TypeVar("T")

Handler = Callable[[Message], Awaitable[object]] | Callable[[Message], object]
NackDelay = float | Callable[[Message, BaseException], float] | None

# The sidecar keeps at most this much of a nack's reason (sidecar/models/receipts.py).
MAX_ERROR_TEXT = 1024
# An extend is pointless with less than this left, and a sleep shorter than it only spins.
MIN_EXTEND_INTERVAL = 0.05


@dataclass(frozen=True)
class Backoff:
    """Nack delay that doubles with each delivery: first, 2*first, 4*first ... up to `max`, jittered."""

    first: float = 1.0
    max: float = 300.0
    jitter: bool = True

    def __call__(self, message: Message, error: BaseException) -> float:
        return self.delay(message.delivery_count)

    def delay(self, delivery_count: int, draw: Callable[[float, float], float] = random.uniform) -> float:
        # Capped exponent: a message delivered a thousand times must not overflow a float.
        wanted = min(self.max, self.first * 2.0 ** min(max(delivery_count - 1, 0), 60))
        if not self.jitter:
            return wanted
        return wanted / 2 + draw(0.0, wanted / 2)


def error_text(error: BaseException) -> str:
    """The reason a nack carries: the exception's type and message, cut to what the sidecar keeps."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 3] + "..."
    return text


def extension_due(remaining: float) -> float:
    """Seconds from now until the next extend, given the seconds left before the message is visible again."""
    return max(remaining / 2, 0.0)


def lease_seconds(visible_until: datetime, received_at: datetime) -> float:
    """The visibility a delivery was given, to ask for the same again at each extend."""
    return max((visible_until - received_at).total_seconds(), 1.0)


def receive_size(concurrency: int, running: int, limit: int = 1000) -> int:
    """How many messages to ask for: the free handler slots, within the sidecar's per-receive limit."""
    return max(min(concurrency - running, limit), 0)


def is_transient(error: ClientError) -> bool:
    """Whether the receive loop should wait and try again rather than stop."""
    if isinstance(error, SidecarUnreachable):
        return True
    # 408/429 and 5xx: the sidecar is busy, draining or its backends are down for a while.
    return isinstance(error, ApiError) and (error.status >= 500 or error.status in (408, 429))


async def subscribe(
    queue: str | None,
    subscriber: str | None,
    handler: Handler,
    *,
    concurrency: int = 8,
    visibility: float | None = None,
    wait: float = 20.0,
    nack_delay: NackDelay = Backoff(),
    grace: float = 30.0,
    stop: asyncio.Event | None = None,
    client: AsyncClient | None = None,
    url: str | None = None,
    token: str | None = None,
    tracer_provider: Any = None,
) -> None:
    """Consume `queue` as `subscriber` with `handler` until cancelled or `stop` is set.

    `handler` takes a `Message`; a coroutine function runs on the event loop, a plain
    function in a worker thread. `visibility` asks the sidecar for that many seconds per
    delivery (default: the Subscriber's). `queue` and `subscriber` default to the pod's
    (`CASQUE_SIDECAR_QUEUE`, `CASQUE_SIDECAR_SUBSCRIBERS`). Pass `client` to share one, or
    `url`/`token` to have one made (and closed at the end).

    With OpenTelemetry importable, each handler runs in a consumer span that continues the
    message's trace (casque_client.tracing), through `tracer_provider` or the global one.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    own = client is None
    session = client or AsyncClient(url, queue=queue, subscriber=subscriber, token=token)
    try:
        await _Subscription(session, queue, subscriber, handler, concurrency, visibility, wait, nack_delay,
                            grace, stop or asyncio.Event(), tracer_provider).run()
    finally:
        if own:
            await session.close()


class _Subscription:
    def __init__(
        self, client: AsyncClient, queue: str | None, subscriber: str | None, handler: Handler, concurrency: int,
        visibility: float | None, wait: float, nack_delay: NackDelay, grace: float, stop: asyncio.Event,
        tracer_provider: Any = None,
    ) -> None:
        self.client = client
        self.queue = queue
        self.subscriber = subscriber
        self.handler = handler
        self.concurrency = concurrency
        self.visibility = visibility
        self.wait = wait
        self.nack_delay = nack_delay
        self.grace = grace
        self.stop = stop
        self.tracer_provider = tracer_provider
        self.running: set[asyncio.Task[None]] = set()
        self.threaded = not (inspect.iscoroutinefunction(handler)
                             or inspect.iscoroutinefunction(getattr(handler, "__call__", None)))

    async def run(self) -> None:
        try:
            await self._receive_loop()
        finally:
            # Reached on a stop, a cancel or a fatal refusal alike: settle what was handed out.
            await asyncio.shield(self._drain())

    async def _receive_loop(self) -> None:
        failures = 0
        retry = RetryPolicy()
        while not self.stop.is_set():
            wanted = receive_size(self.concurrency, len(self.running))
            if wanted == 0:
                await self._first_of(asyncio.wait(set(self.running), return_when=asyncio.FIRST_COMPLETED))
                continue
            try:
                received_at = datetime.now(timezone.utc)
                messages = await self._first_of(self.client.receive(
                    wanted, self.wait, self.visibility, queue=self.queue, subscriber=self.subscriber))
            except ClientError as error:
                if not is_transient(error):
                    raise
                log.warning("receive failed, trying again: %s", error)
                await self._first_of(asyncio.sleep(retry.delay(min(failures, 10), getattr(error, "retry_after", None))))
                failures += 1
                continue
            failures = 0
            for message in messages or ():
                task = asyncio.get_running_loop().create_task(self._handle(message, received_at))
                self.running.add(task)
                task.add_done_callback(self.running.discard)

    async def _first_of(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None once `stop` is set first (the work is then cancelled)."""
        job = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({job, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not job.done():
                job.cancel()
        # Both may be done at once: a result that came is kept, never dropped for the stop.
        return job.result() if job in done else None

    async def _drain(self) -> None:
        if not self.running:
            return
        _, late = await asyncio.wait(set(self.running), timeout=self.grace)
        for task in late:
            task.cancel()
        if late:
            # Each cancelled handler nacks its own message (see _handle); wait for those nacks.
            await asyncio.wait(late)

    async def _handle(self, message: Message, received_at: datetime) -> None:
        extender = asyncio.get_running_loop().create_task(self._extend(message, received_at))
        try:
            try:
                # A plain function runs in a thread so that a blocking handler cannot starve
                # the extends; whatever it returns that can be awaited (a coroutine made by a
                # lambda, say) is awaited here.
                with handler_span(message, self.queue or self.client.queue, self.subscriber or self.client.subscriber,
                                  self.tracer_provider):
                    outcome = (await asyncio.to_thread(self.handler, message) if self.threaded
                               else self.handler(message))
                    if inspect.isawaitable(outcome):
                        outcome = await outcome
            finally:
                extender.cancel()
        except asyncio.CancelledError:
            # Stopped past the grace period: hand the message back at once for another worker.
            await self._settle("nack", message, delay=0.0, error="the subscriber stopped before the handler finished")
            raise
        except Exception as error:  # noqa: BLE001 - any failure of the app's handler is the message's
            log.info("handler failed for message %s (delivery %d): %s", message.id, message.delivery_count,
                     error_text(error))
            delay = self.nack_delay(message, error) if callable(self.nack_delay) else self.nack_delay
            await self._settle("nack", message, delay=delay, error=error_text(error))
        else:
            await self._settle("ack", message, outputs=outcome if isinstance(outcome, Outputs) else None)

    async def _settle(
        self, action: str, message: Message, delay: float | None = 0.0, error: str | None = None,
        outputs: Outputs | None = None,
    ) -> None:
        try:
            if action == "ack":
                await self.client.ack(message.receipt, outputs=outputs, queue=self.queue, subscriber=self.subscriber)
            else:
                await self.client.nack(message.receipt, delay, error=error, queue=self.queue,
                                       subscriber=self.subscriber)
        except ClientError as failure:
            # A stale receipt: the visibility lapsed (an extend failed) and the message went to
            # another worker, which settles it. Otherwise the message comes back after its
            # visibility timeout. Either way nothing is lost, and the loop goes on.
            log.warning("%s of message %s failed: %s", action, message.id, failure)

    async def _extend(self, message: Message, received_at: datetime) -> None:
        lease = self.visibility or lease_seconds(message.visible_until, received_at)
        # On the monotonic clock from here on: the deadline is the sidecar's, read on the same host.
        deadline = time.monotonic() + (message.visible_until - datetime.now(timezone.utc)).total_seconds()
        while True:
            await asyncio.sleep(max(extension_due(deadline - time.monotonic()), MIN_EXTEND_INTERVAL))
            try:
                until = await self.client.extend(message.receipt, lease, queue=self.queue,
                                                 subscriber=self.subscriber)
            except ApiError as refused:
                if is_transient(refused):
                    continue
                log.warning("extend of message %s refused, it may be delivered again: %s", message.id, refused)
                return
            except SidecarUnreachable as failure:
                log.warning("extend of message %s failed, trying again: %s", message.id, failure)
                continue
            deadline = time.monotonic() + (until - datetime.now(timezone.utc)).total_seconds()
