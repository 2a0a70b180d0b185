"""The HTTP operations: each handler parses its body, calls the service, and shapes the answer.

`OPERATIONS` is the API's table of contents: the app registers its routes from it, under
their operationIds (which the metrics use as labels), and the OpenAPI document is built
from the same table, so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from casque.engine.messages import Delivery, OutgoingMessage, Published
from casque.errors import CasqueError, PartiallyPublished
from casque.logs import REQUEST_ID
from casque.sidecar.answers import acked_json, one_published_json, published_json
from casque.sidecar.bodies import decode_body, parse_body, read_json, read_limited, validate
from casque.sidecar.decoding import Decoded, Shape, decode_publish, with_trace_context
from casque.sidecar.errors import RETRY_AFTER_SECONDS, error_body, partly_published
from casque.sidecar.events import binary_event, is_batch, is_binary
from casque.sidecar.health import readiness, refresh_gauges
from casque.sidecar.keys import METRICS, OPENAPI, RUNTIME, SETTINGS, TRACING
from casque.sidecar.history import MessageHistoryResult
from casque.sidecar.logs import REQUEST_ID_HEADER
from casque.sidecar.models.base import CE_ATTRIBUTES, Body, ErrorResponse, Reply
from casque.sidecar.models.publishing import (
    PublishBatchError,
    PublishBatchRequest,
    PublishBatchResult,
    PublishEventBatch,
    PublishMessage,
    PublishResult,
    valid_traceparent,
    valid_tracestate,
)
from casque.sidecar.models.receipts import (
    AckRequest,
    ExtendRequest,
    NackRequest,
    PipelineAck,
    ReceiptResult,
    ReceiptResults,
)
from casque.sidecar.models.receiving import ReceiveRequest, ReceiveResult, SeekRequest, SeekResult, wall_clock
from casque.sidecar.models.status import Health, HealthStatus, QueueStatsResult, SubscriberStatsResult
from casque.sidecar.rendering import receive_body
from casque.sidecar.scopes import Scope, Scopes
from casque.sidecar.service import QueueService

B = TypeVar("B", bound=Body | PublishEventBatch)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

QUEUE_PATH = "/v1/queues/{queue}"
SUBSCRIBER_PATH = "/v1/queues/{queue}/subscribers/{subscriber}"


@dataclass(frozen=True)
class Operation:
    operation_id: str
    method: str
    path: str
    handler: Handler
    summary: str
    request: type[Body] | None
    response: type[Reply]
    # HTTP statuses (besides 200) with an error body that this operation answers with.
    errors: tuple[int, ...]
    body_optional: bool = False
    # The body of its error answers: ErrorResponse, or one that adds to it.
    error_response: type[ErrorResponse] = ErrorResponse
    # Which of the pod's scopes (casque.sidecar.scopes) must include the path's queue or subscriber.
    scope: Scope | None = None


def _service(request: web.Request) -> QueueService:
    return request.app[RUNTIME].require()


async def parse(request: web.Request, model: type[B], optional: bool = False) -> B:
    return await parse_body(request, request.app[SETTINGS], model, optional)


def reply(body: Reply) -> web.Response:
    return web.Response(body=body.wire_json(), content_type="application/json", charset="utf-8")


def _json(body: bytes | None) -> web.Response | None:
    """An answer written by answers.py, as `reply` sends a model's; None if it wrote none."""
    return None if body is None else web.Response(body=body, content_type="application/json", charset="utf-8")


# --- publishing ---------------------------------------------------------------------------
async def publish(request: web.Request) -> web.Response:
    """One event in structured or binary mode, or a CloudEvents batch (answered as publishBatch)."""
    if is_batch(request.content_type):
        return await _publish_events(request, await _parse_messages(request, "events"))
    if is_binary(request.headers):
        message: Messages = [binary_event(request.headers, await read_limited(request, request.app[SETTINGS]))]
    else:
        message = await _parse_messages(request, "message")
    (result,) = await _publish(request, message)
    return _json(one_published_json(result)) or reply(PublishResult.of(result))


async def publish_batch(request: web.Request) -> web.Response:
    shape: Shape = "events" if is_batch(request.content_type) else "batch"
    return await _publish_events(request, await _parse_messages(request, shape))


# A publish's messages: checked by the quick path and made already (decoding.py), or models.
Messages = list[PublishMessage] | Decoded


async def _parse_messages(request: web.Request, shape: Shape) -> Messages:
    raw = await read_json(request, request.app[SETTINGS])
    return await decode_body(raw, functools.partial(_decode_messages, shape))


def _decode_messages(shape: Shape, raw: bytes) -> Messages:
    """The quick path's messages, or else the models' (which refuse what they refused before)."""
    quick = decode_publish(raw, shape)
    if quick is not None:
        return Decoded(quick)
    if shape == "events":
        return validate(PublishEventBatch, raw).root
    if shape == "batch":
        return validate(PublishBatchRequest, raw).messages
    return [validate(PublishMessage, raw)]


async def _publish_events(request: web.Request, messages: Messages) -> web.Response:
    try:
        results = await _publish(request, messages)
    except PartiallyPublished as partial:
        return partly_published(partial)
    return _json(published_json(results)) or reply(
        PublishBatchResult(results=[PublishResult.of(r) for r in results]))


def _trace_header(request: web.Request) -> tuple[str | None, str | None]:
    traceparent = valid_traceparent(request.headers.get("traceparent"))
    if traceparent is None:
        return None, None
    return traceparent, valid_tracestate(request.headers.get("tracestate"))


def _traced(message: PublishMessage, context: tuple[str | None, str | None]) -> PublishMessage:
    """The message with `context` as its trace context, unless it brought a valid one itself."""
    if context[0] is None or valid_traceparent(message.traceparent) is not None:
        return message
    return message.model_copy(update={"traceparent": context[0], "tracestate": context[1]})


def _outgoing(messages: Messages, context: tuple[str | None, str | None]) -> list[OutgoingMessage]:
    if isinstance(messages, Decoded):
        return with_trace_context(messages.messages, context)
    return [_traced(m, context).outgoing() for m in messages]


async def _publish(request: web.Request, messages: Messages) -> list[Published]:
    queue = request.match_info["queue"]
    header = _trace_header(request)
    tracing = request.app[TRACING]
    if tracing is None:
        # The request's trace context goes with the messages that have none of their own.
        return await _service(request).publish(queue, _outgoing(messages, header))
    count = len(messages.messages) if isinstance(messages, Decoded) else len(messages)
    parent = header
    if parent[0] is None and isinstance(messages, list) and len(messages) == 1:
        parent = (valid_traceparent(messages[0].traceparent), valid_tracestate(messages[0].tracestate))
    with tracing.span(f"publish {queue}", "producer", parent, attributes={
        "messaging.system": "casque", "messaging.operation.type": "send",
        "messaging.destination.name": queue, "messaging.batch.message_count": count,
    }) as span:
        return await _service(request).publish(queue, _outgoing(messages, tracing.context_of(span)))


def trace_context(delivery: Delivery) -> tuple[str, str | None] | None:
    """The trace context a delivered message was stored with, if any."""
    attributes = delivery.message.attributes
    traceparent = attributes.get(CE_ATTRIBUTES["traceparent"])
    return None if traceparent is None else (traceparent, attributes.get(CE_ATTRIBUTES["tracestate"]))


# --- consuming ------------------------------------------------------------------------------
async def receive(request: web.Request) -> web.StreamResponse:
    ask = await parse(request, ReceiveRequest, optional=True)
    service = _service(request)
    queue, subscriber = request.match_info["queue"], request.match_info["subscriber"]
    tracing = request.app[TRACING]

    def abandoned() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    if tracing is None:
        deliveries = await service.receive(queue, subscriber, ask.max_messages, ask.wait, ask.visibility, abandoned)
    else:
        with tracing.span(f"receive {queue}/{subscriber}", "consumer", _trace_header(request), attributes={
            "messaging.system": "casque", "messaging.operation.type": "receive",
            "messaging.destination.name": queue, "messaging.consumer.group.name": subscriber,
        }) as span:
            deliveries = await service.receive(queue, subscriber, ask.max_messages, ask.wait, ask.visibility,
                                               abandoned)
            span.set_attribute("messaging.batch.message_count", len(deliveries))
            # Links are set when the span starts; the messages are known only now, so each
            # one's trace context is added as a link to the span that is still open.
            for context in filter(None, map(trace_context, deliveries)):
                tracing.link(span, context)
    response = web.Response(body=receive_body(deliveries, service.queue_ref(queue)), content_type="application/json")
    if not deliveries:
        return response
    # Written here, not after the middlewares, so that a client that has gone is known: its
    # deliveries are handed back at once instead of waiting out their visibility.
    request_id = REQUEST_ID.get()
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    try:
        if abandoned():
            raise ConnectionResetError("the client closed the connection during the receive")
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        await service.hand_back(queue, subscriber, deliveries)
        return response
    service.count_deliveries(queue, subscriber, deliveries)
    return response


def _results(
    receipts: Sequence[str], outcomes: Sequence[object], single: bool, shape: Callable[[str, object], ReceiptResult]
) -> web.Response:
    """The batch form reports each receipt; the single form answers an error with its 4xx."""
    if single and isinstance(outcomes[0], CasqueError):
        raise outcomes[0]
    results = [
        ReceiptResult(receipt=r, error=error_body(o)) if isinstance(o, CasqueError) else shape(r, o)
        for r, o in zip(receipts, outcomes)
    ]
    return reply(ReceiptResults(results=results))


@contextlib.contextmanager
def _settle_span(request: web.Request, operation: str, receipts: int) -> Iterator[None]:
    """A consumer span around settling `receipts` deliveries (ack, nack, extend), when tracing."""
    tracing = request.app[TRACING]
    if tracing is None:
        yield
        return
    queue, subscriber = request.match_info["queue"], request.match_info["subscriber"]
    with tracing.span(f"{operation} {queue}/{subscriber}", "consumer", _trace_header(request), attributes={
        "messaging.system": "casque", "messaging.operation.type": "settle", "messaging.operation.name": operation,
        "messaging.destination.name": queue, "messaging.consumer.group.name": subscriber,
        "messaging.batch.message_count": receipts,
    }):
        yield


async def ack(request: web.Request) -> web.Response:
    body = await parse(request, AckRequest)
    queue, subscriber = request.match_info["queue"], request.match_info["subscriber"]
    pipelined = body.pipelined
    if pipelined is not None:
        return await _ack_publishing(request, pipelined, body.single)
    receipts = body.all
    with _settle_span(request, "ack", len(receipts)):
        outcomes = await _service(request).ack(queue, subscriber, receipts)
    return _json(acked_json(receipts, outcomes)) or _results(
        receipts, outcomes, body.single,
        lambda r, newly: ReceiptResult(receipt=r, status="acked" if newly else "already_acked"),
    )


async def _ack_publishing(request: web.Request, items: list[PipelineAck], single: bool) -> web.Response:
    """Acks that publish what their messages resulted in (casque.engine.pipelines), each
    delivery on its own: its outputs published, then it is acked."""
    queue, subscriber = request.match_info["queue"], request.match_info["subscriber"]
    settings = request.app[SETTINGS]
    scopes = Scopes.of(settings.publish_scope, settings.subscribe_scope)
    for item in items:
        if item.publish is not None:
            scopes.check("publish", item.publish.queue)
    service = _service(request)

    async def one(item: PipelineAck) -> tuple[list[Published] | None, bool | CasqueError]:
        if item.publish is None:
            (outcome,) = await service.ack(queue, subscriber, [item.receipt])
            return None, outcome
        outputs = [message.outgoing() for message in item.publish.messages]
        return await service.ack_publishing(queue, subscriber, item.receipt, item.publish.queue, outputs)

    with _settle_span(request, "ack", len(items)):
        results = await asyncio.gather(*(one(item) for item in items))
    if single and isinstance(results[0][1], CasqueError):
        raise results[0][1]
    return reply(ReceiptResults(results=[
        ReceiptResult(receipt=item.receipt, error=error_body(outcome)) if isinstance(outcome, CasqueError)
        else ReceiptResult(receipt=item.receipt, status="acked" if outcome else "already_acked",
                           published=None if published is None else [PublishResult.of(p) for p in published])
        for item, (published, outcome) in zip(items, results)
    ]))


async def nack(request: web.Request) -> web.Response:
    body = await parse(request, NackRequest)
    with _settle_span(request, "nack", len(body.all)):
        outcomes = await _service(request).nack(
            request.match_info["queue"], request.match_info["subscriber"], body.all, body.delay, body.error
        )
    return _results(body.all, outcomes, body.single, lambda r, _: ReceiptResult(receipt=r, status="nacked"))


async def extend_visibility(request: web.Request) -> web.Response:
    body = await parse(request, ExtendRequest)
    with _settle_span(request, "extend", len(body.all)):
        outcomes = await _service(request).extend(
            request.match_info["queue"], request.match_info["subscriber"], body.all, body.visibility
        )

    def extended(receipt: str, until: object) -> ReceiptResult:
        assert isinstance(until, float)
        return ReceiptResult(receipt=receipt, status="extended", visible_until=wall_clock(until))

    return _results(body.all, outcomes, body.single, extended)


async def seek(request: web.Request) -> web.Response:
    body = await parse(request, SeekRequest)
    offsets = await _service(request).seek(request.match_info["queue"], request.match_info["subscriber"], body)
    return reply(SeekResult(offsets={str(shard): batch for shard, batch in sorted(offsets.items())}))


# --- message history --------------------------------------------------------------------------
async def message_history(request: web.Request) -> web.Response:
    history = await _service(request).message_history(request.match_info["queue"], request.match_info["messageId"])
    return reply(MessageHistoryResult.of(history))


# --- stats ----------------------------------------------------------------------------------
async def queue_stats(request: web.Request) -> web.Response:
    stats = await _service(request).queue_stats(request.match_info["queue"])
    return reply(QueueStatsResult.of(stats))


async def subscriber_stats(request: web.Request) -> web.Response:
    stats = await _service(request).subscriber_stats(request.match_info["queue"], request.match_info["subscriber"])
    return reply(SubscriberStatsResult.of(stats))


# --- operations outside the API: probes, metrics, the document itself -------------------------
async def healthz(request: web.Request) -> web.Response:
    return await health_of(request.app)


async def health_of(app: web.Application) -> web.Response:
    """Alive: the process answers. Starting (backends not connected yet) and draining are
    alive too: restarting would not bring a backend back, nor finish the work faster.
    For /healthz and for the separate health port."""
    service = app[RUNTIME].service
    status: HealthStatus = "starting" if service is None else ("draining" if service.draining else "ok")
    return reply(Health(status=status))


async def readyz(request: web.Request) -> web.Response:
    # ?scope=serving: what the Pod's readiness probe asks (see SidecarService.readiness).
    return await readiness_of(request.app, serving_only=request.query.get("scope") == "serving")


async def readiness_of(app: web.Application, serving_only: bool) -> web.Response:
    """For /readyz and for the separate health port."""
    runtime = app[RUNTIME]
    if runtime.service is None:
        body = Health(status="starting", checks={"backends": runtime.problem})
        return web.json_response(body.wire(), status=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    ready, checks = await readiness(runtime.service, serving_only=serving_only)
    status: HealthStatus = "ok" if ready else ("draining" if runtime.service.draining else "unready")
    return web.json_response(Health(status=status, checks=checks).wire(), status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return await metrics_of(request.app)


async def metrics_of(app: web.Application) -> web.Response:
    """The sidecar app's metrics, for its own /metrics and for the separate metrics port."""
    service = app[RUNTIME].service
    if service is not None:
        await refresh_gauges(service)
    body = generate_latest(app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI]())


_CONSUMER_ERRORS = (400, 403, 404, 409, 503)

OPERATIONS: tuple[Operation, ...] = (
    Operation("publish", "POST", f"{QUEUE_PATH}/messages", publish,
              "Publish one message (answered after it is written)", PublishMessage, PublishResult,
              (400, 403, 404, 409, 413, 503), scope="publish", error_response=PublishBatchError),
    Operation("publishBatch", "POST", f"{QUEUE_PATH}/messages/batch", publish_batch,
              "Publish several messages: refused whole if one is invalid; if a backend fails part of it, "
              "answered 503 partially_published naming what was written", PublishBatchRequest, PublishBatchResult,
              (400, 403, 404, 409, 413, 503), scope="publish", error_response=PublishBatchError),
    Operation("receive", "POST", f"{SUBSCRIBER_PATH}/receive", receive,
              "Receive up to `max` messages, waiting up to `wait` seconds for the first",
              ReceiveRequest, ReceiveResult, (400, 403, 404, 503), body_optional=True, scope="subscribe"),
    Operation("ack", "POST", f"{SUBSCRIBER_PATH}/ack", ack,
              "Acknowledge deliveries: they are done and never delivered again; with `publish` or `acks`, "
              "first publish what each resulted in, exactly once", AckRequest, ReceiptResults,
              tuple(sorted({*_CONSUMER_ERRORS, 413})), scope="subscribe"),
    Operation("nack", "POST", f"{SUBSCRIBER_PATH}/nack", nack,
              "Hand deliveries back, to be delivered again after `delay` seconds (or the retry backoff)", NackRequest, ReceiptResults,
              _CONSUMER_ERRORS, scope="subscribe"),
    Operation("extendVisibility", "POST", f"{SUBSCRIBER_PATH}/extend", extend_visibility,
              "Keep deliveries invisible for `visibility` more seconds", ExtendRequest, ReceiptResults,
              _CONSUMER_ERRORS, scope="subscribe"),
    Operation("seek", "POST", f"{SUBSCRIBER_PATH}/seek", seek,
              "Move a subscriber to the earliest or latest message, a time, or given batches",
              SeekRequest, SeekResult, (400, 403, 404, 503), scope="subscribe"),
    Operation("messageHistory", "GET", f"{QUEUE_PATH}/messages/{{messageId}}", message_history,
              "Where a message is and, for each subscriber, whether it is pending, in flight, nacked, acked, "
              "filtered or dead-lettered (metadata only, never its data)", None, MessageHistoryResult,
              (400, 404, 503)),
    Operation("queueStats", "GET", f"{QUEUE_PATH}/stats", queue_stats,
              "Messages and bytes published, per shard and in total", None, QueueStatsResult, (404, 503)),
    Operation("subscriberStats", "GET", f"{SUBSCRIBER_PATH}/stats", subscriber_stats,
              "Lag, oldest unacked message, in-flight and redelivered counts", None, SubscriberStatsResult,
              (404, 503)),
)


def add_routes(app: web.Application) -> None:
    for operation in OPERATIONS:
        # A message id is never `batch`: without this, /messages/batch also matched the history's
        # route, and a wrong method there was answered as if GET were allowed.
        path = operation.path.replace("{messageId}", "{messageId:(?!batch$)[^{}/]+}")
        app.router.add_route(operation.method, path, operation.handler, name=operation.operation_id)
    app.router.add_get("/healthz", healthz, name="healthz")
    app.router.add_get("/readyz", readyz, name="readyz")
    app.router.add_get("/metrics", metrics, name="metrics")
    app.router.add_get("/openapi.json", openapi, name="openapi")

