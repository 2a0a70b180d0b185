"""Push delivery: the sidecar POSTs each message to the app instead of the app polling.

The body is the same CloudEvent a receive returns (`Content-Type:
application/cloudevents+json`). The app's answer settles the message:
- 2xx: acked (an ack that fails for a backend's reason is sent again while the delivery's
  visibility lasts, never turned into a nack: the app has processed the message).
- a retry status (default 408, 425, 429, 5xx), a refused connection or a timeout: nacked
  with the subscriber's retry policy (`spec.retry`) if it has one, else with exponential
  backoff and jitter on the delivery count, so a struggling app gets fewer requests,
  spread out, instead of a burst of retries.
- a drop status (default the other 4xx): the app says it will never take the message.
  With a dead-letter queue it is dead-lettered at once, the app's answer kept as its last
  error. Without one it is never dropped: it is nacked with the longest backoff and
  logged.

Every nack carries the reason (the status, or the connection error), which the engine
keeps in the message's history for the dead-letter queue.

Every push ends in a settlement, whatever fails. The event is the one a receive renders
(rendering.message_json: a payload its content type calls JSON but that JSON cannot carry goes
as `data_base64`). A message that cannot be rendered even so is a permanent failure, as if
the app had answered a drop status: every later try would fail the same way, since the
rendering reads nothing but the stored message. Any other error while sending, not only a
connection error or a timeout, is nacked with backoff. Whatever still escapes a push is
caught around it and the message nacked with backoff, so no message waits for its
visibility to end (holding its key under orderedKeys) only to fail again. Each such error
is counted in `casque_sidecar_push_errors_total{stage}`.

At most `push_concurrency` pushes run at once; a slot frees when the app answers. The
visibility timeout covers the push timeout, so a slow app is not raced by a redelivery.

What a push trusts: the URL must name the loopback unless `push_allow_remote` is set
(config.push_target); redirects are answered as statuses, never followed, so a loopback
app cannot bounce messages elsewhere; at most `MAX_ANSWER_BYTES` of an answer are read
(an endless answer cannot hold a slot until the timeout, nor fill memory). Every push
carries the `Casque-Push-Token` header.

The URL and the visibility are read from the Subscriber as it is now (the consumer watches
its znode), so editing pushUrl starts, moves or stops pushing without a restart. Without
a URL the worker idles, checking once per RECEIVE_WAIT_SECONDS: a read of memory, not of
a backend.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time

import aiohttp

from casque.engine.consumer import Consumer
from casque.engine.messages import Delivery
from casque.errors import BackendUnavailable, CasqueError, InvalidSpec, StaleReceipt
from casque.schema import QueueRef
from casque.sidecar.config import SidecarSettings, push_target
from casque.sidecar.metrics import SidecarMetrics
from casque.sidecar.models.base import CE_ATTRIBUTES
from casque.sidecar.rendering import message_json
from casque.sidecar.tracing import Tracing

log = logging.getLogger(__name__)

CLOUDEVENTS_JSON = "application/cloudevents+json"
PUSH_TOKEN_HEADER = "Casque-Push-Token"
# An ack of a message the app took, failing for a backend's reason, is sent again after this
# long, doubling up to the maximum (see PushWorker._ack_until_recorded).
ACK_RETRY_SECONDS = 0.1
ACK_RETRY_MAX_SECONDS = 2.0
# Enough of an answer to quote in the nack reason; the rest is never read.
MAX_ANSWER_BYTES = 4096
QUOTED_ANSWER_CHARS = 200
# Receives wait at most this long, so a stopping worker notices soon.
RECEIVE_WAIT_SECONDS = 1.0
# A push may take the whole push timeout; the message stays invisible a little longer.
VISIBILITY_MARGIN_SECONDS = 5.0


def backoff(delivery_count: int, base: float, ceiling: float) -> float:
    """Seconds before the next try: doubling per delivery, capped, with jitter in its upper half.

    The jitter spreads the retries of messages that failed together (an app restart) over
    time instead of sending them back in one burst.
    """
    exponent = min(max(delivery_count - 1, 0), 32)
    delay = min(ceiling, base * 2.0**exponent)
    return delay / 2 + random.uniform(0, delay / 2)


def error_reason(error: BaseException) -> str:
    """The exception's type and message on one line, short enough to keep in a message's history."""
    text = " ".join(str(error).split())
    if len(text) > QUOTED_ANSWER_CHARS:
        text = text[: QUOTED_ANSWER_CHARS - 1] + "\u2026"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def push_token(settings: SidecarSettings) -> str:
    """The configured push token, else a fresh random one (call once per sidecar start)."""
    if settings.push_token is not None:
        return settings.push_token.get_secret_value()
    return secrets.token_urlsafe(32)


def classify(status: int | None, settings: SidecarSettings) -> str:
    """ack, retry or drop for an HTTP status (None: no answer at all)."""
    if status is not None and 200 <= status < 300:
        return "ack"
    if status is None or status in settings.push_retry_statuses:
        return "retry"
    if status in settings.push_drop_statuses:
        return "drop"
    return "retry"


class PushWorker:
    """Pushes one subscriber's messages while it has a push URL; idles while it has none."""

    def __init__(
        self,
        consumer: Consumer,
        queue: QueueRef,
        subscriber: str,
        settings: SidecarSettings,
        metrics: SidecarMetrics,
        token: str,
        tracing: Tracing | None = None,
    ) -> None:
        self.consumer = consumer
        self.queue = queue
        self.subscriber = subscriber
        self.settings = settings
        self.metrics = metrics
        self.token = token
        self.tracing = tracing
        # Why the subscriber's push URL is not used ("" when it is, or there is none); readiness shows it.
        self.problem = ""
        self._active: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._url: str | None = None

    def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.push_timeout_seconds)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def current_url(self) -> str | None:
        """The sidecar's push URL, else the Subscriber's as it is now; None: do not push."""
        url = self.settings.push_url or self.consumer.subscriber_state.spec.push_url
        if url != self._url:
            self._url = url
            self.problem = ""
            if url:
                try:
                    push_target(url, self.settings.push_allow_remote)
                except ValueError as error:
                    self.problem = f"not pushing: {error}"
                    log.error("%s/%s: %s", self.queue, self.subscriber, self.problem)
                else:
                    log.info("pushing %s/%s to %s", self.queue, self.subscriber, url)
            else:
                log.info("not pushing %s/%s: no push URL", self.queue, self.subscriber)
        return url if url and not self.problem else None

    @property
    def visibility(self) -> float:
        subscriber_default: float = self.consumer.visibility_timeout
        push_bound: float = self.settings.push_timeout_seconds + VISIBILITY_MARGIN_SECONDS
        return max(subscriber_default, push_bound)

    async def _run(self) -> None:
        limit = self.settings.push_concurrency
        while not self._stopping and not self.consumer.gone_reason:
            url = self.current_url()
            if url is None:
                await asyncio.sleep(RECEIVE_WAIT_SECONDS)
                continue
            free = limit - len(self._active)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            try:
                deliveries = await self.consumer.receive(free, RECEIVE_WAIT_SECONDS, self.visibility)
            except CasqueError as error:  # the consumer stopped, or a backend hiccup
                if self._stopping:
                    return
                log.warning("push receive failed: %s", error)
                await asyncio.sleep(RECEIVE_WAIT_SECONDS)
                continue
            if deliveries:
                self.metrics.received.labels(self.queue.name, self.subscriber).inc(len(deliveries))
            for delivery in deliveries:
                task = asyncio.get_running_loop().create_task(self._deliver(delivery, url))
                self._active.add(task)
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._active.discard(task)
        self._slot_free.set()
        if not task.cancelled() and task.exception() is not None:
            # _deliver settles and catches everything but cancellation, so this is a bug
            # of ours; it is still counted, not only logged, so that it shows.
            self.metrics.push_errors.labels(self.subscriber, "task").inc()
            log.error("push task failed", exc_info=task.exception())

    async def _deliver(self, delivery: Delivery, url: str) -> None:
        """Push one message and see that it is settled, whatever escapes the push.

        Cancellation (a stopping sidecar) is let through unsettled: the message stays in
        flight and returns after its visibility, as documented for stop().
        """
        try:
            await self._push(delivery, url)
        except Exception as error:
            self.metrics.push_errors.labels(self.subscriber, "task").inc()
            log.error("push of %s failed unexpectedly; it is tried again", delivery.message.message_id,
                      exc_info=error)
            reason = f"push to {url} failed: {error_reason(error)}"
            try:
                await self._settle(delivery, "retry", reason)
            except Exception as again:
                # Settled already (the error came after the settlement), or the backend is
                # away: either way the message is not lost, it returns after its visibility.
                log.warning("push of %s not settled (%s); it returns after its visibility",
                            delivery.message.message_id, error_reason(again))

    async def _push(self, delivery: Delivery, url: str) -> None:
        """Push with the message's trace context in the W3C headers as well as in the event:
        the app's HTTP server instrumentation reads the headers, not the body."""
        headers = {"Content-Type": CLOUDEVENTS_JSON, PUSH_TOKEN_HEADER: self.token}
        attributes = delivery.message.attributes
        traceparent = attributes.get(CE_ATTRIBUTES["traceparent"])
        tracestate = attributes.get(CE_ATTRIBUTES["tracestate"])
        if self.tracing is None:
            if traceparent is not None:
                headers["traceparent"] = traceparent
                if tracestate is not None:
                    headers["tracestate"] = tracestate
            await self._send(delivery, url, headers)
            return
        with self.tracing.span(f"push {self.queue.name}/{self.subscriber}", "client", (traceparent, tracestate),
                               attributes={"messaging.system": "casque", "messaging.operation.type": "process",
                                           "messaging.destination.name": self.queue.name,
                                           "messaging.consumer.group.name": self.subscriber,
                                           "messaging.message.id": delivery.message.message_id}) as span:
            headers["traceparent"], state = self.tracing.context_of(span)
            if state is not None:
                headers["tracestate"] = state
            await self._send(delivery, url, headers)

    async def _send(self, delivery: Delivery, url: str, headers: dict[str, str]) -> None:
        try:
            body = message_json(delivery, self.queue)
        except Exception as error:
            # Rendering reads nothing but the stored message, so every later try would fail
            # alike: a permanent failure, settled as the app's drop status is.
            reason = f"cannot render the message as a CloudEvent: {error_reason(error)}"
            log.error("message %s at %s: %s", delivery.message.message_id, delivery.message.position, reason)
            self.metrics.push_errors.labels(self.subscriber, "render").inc()
            self.metrics.pushes.labels(self.subscriber, "drop").inc()
            await self._settle_unless_stale(delivery, "drop", reason)
            return
        assert self._session is not None
        started = time.perf_counter()
        status: int | None = None
        failure = ""
        answer = b""
        try:
            async with self._session.post(url, data=body, headers=headers, allow_redirects=False) as reply:
                status = reply.status
                answer = await read_capped(reply, MAX_ANSWER_BYTES)
        except (aiohttp.ClientError, TimeoutError) as error:
            failure = f"push to {url} failed: {error or type(error).__name__}"
            log.info("push of %s failed: %s", delivery.message.message_id, failure)
        except Exception as error:
            # Not the app's answer but a fault in the client or in us: the push did not
            # happen as it should, so it is a retry whatever status came before the fault.
            status = None
            failure = f"push to {url} failed: {error_reason(error)}"
            self.metrics.push_errors.labels(self.subscriber, "send").inc()
            log.warning("push of %s failed: %s", delivery.message.message_id, failure, exc_info=error)
        finally:
            self.metrics.push_latency.labels(self.subscriber).observe(time.perf_counter() - started)
        outcome = classify(status, self.settings)
        self.metrics.pushes.labels(self.subscriber, outcome).inc()
        quoted = answer[:QUOTED_ANSWER_CHARS].decode("utf-8", "replace").strip()
        reason = failure or f"push to {url}: HTTP {status}" + (f": {quoted}" if quoted else "")
        await self._settle_unless_stale(delivery, outcome, reason)

    async def _settle_unless_stale(self, delivery: Delivery, outcome: str, reason: str) -> None:
        try:
            await self._settle(delivery, outcome, reason)
        except StaleReceipt:
            # The visibility ran out (or the shard moved) while the app was busy: the
            # message is someone else's now, and will be pushed again from there.
            log.warning("push of %s settled too late; it will be delivered again", delivery.message.message_id)

    async def _settle(self, delivery: Delivery, outcome: str, reason: str) -> None:
        labels = (self.queue.name, self.subscriber)
        if outcome == "ack":
            await self._ack_until_recorded(delivery)
            self.metrics.acked.labels(*labels).inc()
            return
        ceiling = self.settings.push_max_backoff_seconds
        delay: float | None
        if outcome == "drop":
            try:
                await self.consumer.dead_letter(delivery.receipt, reason)
                self.metrics.acked.labels(*labels).inc()
                return
            except InvalidSpec:
                # No dead-letter queue: never drop a message; try it again after the longest backoff.
                log.warning("message %s cannot be delivered (%s) and the subscriber has no dead-letter queue; "
                            "it is tried again in %ss", delivery.message.message_id, reason, ceiling)
                delay = ceiling
            except CasqueError as error:
                log.warning("dead-lettering %s failed (%s); it is tried again", delivery.message.message_id, error)
                delay = ceiling
        elif self.consumer.subscriber_state.spec.retry is not None:
            delay = None  # the subscriber's retry policy decides (casque.specs.RetryPolicy)
        else:
            delay = backoff(delivery.delivery_count, self.settings.push_backoff_seconds, ceiling)
        await self.consumer.nack(delivery.receipt, delay, reason)
        self.metrics.nacked.labels(*labels).inc()

    async def _ack_until_recorded(self, delivery: Delivery) -> None:
        """The app took the message (2xx): an ack that fails for a backend's reason is sent
        again, with backoff, while the delivery's visibility lasts. Settling it otherwise (a
        nack) would push a message the app already processed again. Past the visibility,
        the error goes up and the message is delivered again, as for any unacked delivery."""
        wait = ACK_RETRY_SECONDS
        while True:
            try:
                await self.consumer.ack(delivery.receipt)
                return
            except BackendUnavailable as error:
                if self._stopping or time.monotonic() + wait >= delivery.visible_until:
                    raise
                log.info("ack of pushed %s failed (%s); sent again in %.2fs", delivery.message.message_id,
                         error, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, ACK_RETRY_MAX_SECONDS)

    async def stop(self, timeout: float) -> None:
        """Take no more messages; let pushes under way finish (up to `timeout`) and settle."""
        self._stopping = True
        self._slot_free.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._active:
            _, late = await asyncio.wait(set(self._active), timeout=timeout)
            for task in late:
                # Unsettled: the message stays in flight and returns after its visibility.
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


async def read_capped(reply: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most `limit` bytes of an answer; the connection is closed if more would follow."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await reply.content.read(limit - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    if not reply.content.at_eof():
        reply.close()  # not reused: the rest of the answer would still be on the wire
    return b"".join(chunks)
