"""A Python client for apps: the sidecar's HTTP API, synchronous (`Client`) or asyncio (`AsyncClient`).

    from casque_client import Client
    with Client(queue="orders", subscriber="billing") as queue:
        queue.publish({"order": 42}, key="customer-7")
        for message in queue.receive(max=10, wait=20):
            handle(message.data)
            queue.ack(message.receipt)

Both retry a call that met a refused connection or a 503 (a backend hiccup, or a sidecar
starting or draining), with exponential backoff that honours Retry-After: the sidecar did
nothing, or (an ack) what it did counts the same when done again. A call that timed out or
lost its connection after it was sent may have been done, so only calls that can be done twice are sent again: publishes (every publish
carries a key the sidecar writes at most once within its window, answering a retry with
the first result, `duplicate=True`: the caller's `id`, or else the client's producer id and
the message's number, which the sidecar checks a block of numbers at a time, far cheaper
than an id per message), acks, extends and stats. A receive, nack or seek is not: a second
receive would hand out more messages while the first ones sit invisible, a second nack or
seek would act again; they raise `SidecarUnreachable` for the caller to decide. Other 4xx
answers are not retried; they raise `ApiError` with the sidecar's error code.

The sidecar is on the pod's loopback, so the clients never send to it through a proxy
(HTTP_PROXY and the like are ignored for loopback URLs).

The sync client uses only the standard library; the async one uses aiohttp.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import itertools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

import aiohttp

from casque_client.errors import ApiError, SchemaViolation, SidecarUnreachable
from casque_client.loopback import is_loopback

DEFAULT_URL = "http://127.0.0.1:8717"
_MISSING: Any = object()


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    backoff: float = 0.1
    max_backoff: float = 5.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        # Jittered so that many clients of one restarting sidecar do not return in step.
        wanted: float = min(self.max_backoff, self.backoff * 2.0**attempt)
        wanted = wanted / 2 + random.uniform(0, wanted / 2)
        return max(wanted, retry_after or 0.0)


@dataclass(frozen=True)
class PublishResult:
    message_id: str
    # None for a delayed message until it is due; `deliver_at` says when.
    shard: int | None
    batch: int | None
    seq: int | None
    duplicate: bool
    deliver_at: datetime | None = None


@dataclass(frozen=True)
class Message:
    """A delivered message (the CloudEvent the sidecar returns, with handy accessors).

    `id` and `source` are the producer's when it gave them (together they name the event);
    `message_id` is the id the sidecar gave the message when it was written, as publish
    answered it.
    """

    id: str
    receipt: str
    delivery_count: int
    data: Any
    content_type: str | None
    key: str | None
    attributes: Mapping[str, str]
    priority: int
    type: str
    source: str
    subject: str | None
    time: datetime
    shard: int
    batch: int
    seq: int
    visible_until: datetime
    event: Mapping[str, Any] = field(repr=False)
    message_id: str = ""
    traceparent: str | None = None
    tracestate: str | None = None
    # The version of the queue's schema the message was checked against at publish (None: no schema).
    schema_version: int | None = None

    @property
    def payload(self) -> bytes:
        """The message's bytes as published."""
        if "data_base64" in self.event:
            return base64.b64decode(self.event["data_base64"])
        if "data" not in self.event:
            return b""
        if isinstance(self.data, str) and not _is_json(self.content_type):
            return self.data.encode()
        return json.dumps(self.data, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def of(cls, event: Mapping[str, Any]) -> Message:
        return cls(
            id=event["id"],
            receipt=event["receipt"],
            delivery_count=event["deliverycount"],
            data=event.get("data"),
            content_type=event.get("datacontenttype"),
            key=event.get("partitionkey"),
            attributes=dict(event.get("attributes", {})),
            priority=int(event.get("priority", 0)),
            type=event["type"],
            source=event["source"],
            subject=event.get("subject"),
            time=_parse_time(event["time"]),
            shard=event["shard"],
            batch=event["batch"],
            seq=event["seq"],
            visible_until=_parse_time(event["visibleuntil"]),
            event=dict(event),
            # A sidecar from before producer ids were kept sends casque's id as `id`.
            message_id=event.get("messageid", event["id"]),
            traceparent=event.get("traceparent"),
            tracestate=event.get("tracestate"),
            schema_version=event.get("schemaversion"),
        )


@dataclass(frozen=True)
class ReceiptOutcome:
    receipt: str
    status: str | None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class Outputs:
    """What a message resulted in, published by its ack exactly once (the sidecar derives each
    output's idempotency key from the message, so `message(...)` bodies here take no `id`).
    A `subscribe()` handler may return one."""

    queue: str
    messages: Sequence[Mapping[str, Any]]

    def body(self) -> dict[str, Any]:
        return {"queue": self.queue, "messages": [dict(m) for m in self.messages]}


def _outputs_field(outputs: Outputs | None) -> dict[str, Any]:
    return {} if outputs is None else {"publish": outputs.body()}


def message(
    data: Any = _MISSING,
    *,
    payload: bytes | None = None,
    content_type: str | None = None,
    key: str | None = None,
    attributes: Mapping[str, str] | None = None,
    id: str | None = None,
    ttl: int | None = None,
    type: str | None = None,
    source: str | None = None,
    subject: str | None = None,
    priority: int | None = None,
    delay: float | None = None,
    deliver_at: datetime | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> dict[str, Any]:
    """The publish body of one message. `data` is JSON (or text with a text content type); `payload` is raw bytes.

    `delay` (seconds) or `deliver_at` (an aware datetime) hold the message back; `priority`
    picks the queue's level (higher is delivered first). Without an `id`, the client that
    publishes it gives it its producer id and next number, which make the publish idempotent.
    `traceparent` and `tracestate` (W3C trace context) travel with the message to every
    receive and push, so consumers continue the producer's trace (`subscribe()` does); the
    sidecar drops a malformed one rather than refuse the message.
    """
    body: dict[str, Any] = {"id": id} if id else {}
    if payload is not None:
        if data is not _MISSING:
            raise ValueError("give data or payload, not both")
        body["data_base64"] = base64.b64encode(payload).decode("ascii")
    elif data is not _MISSING:
        body["data"] = data
    optional = {
        "datacontenttype": content_type, "partitionkey": key, "ttl": ttl, "type": type, "source": source,
        "subject": subject, "priority": priority, "delay": delay,
        "deliverAt": deliver_at.isoformat() if deliver_at is not None else None,
        "traceparent": traceparent, "tracestate": tracestate,
    }
    body.update({name: value for name, value in optional.items() if value is not None})
    if attributes:
        body["attributes"] = dict(attributes)
    return body


@dataclass(frozen=True)
class _Call:
    method: Literal["GET", "POST"]
    path: str
    body: Mapping[str, Any] | None = None
    timeout: float | None = None
    # May be sent again after it could have reached the sidecar (a timeout, a lost answer):
    # doing it twice must do no more than doing it once.
    resendable: bool = True


class _Requests:
    """The calls and their answers, shared by both clients; only the transport differs."""

    def __init__(
        self,
        url: str | None,
        queue: str | None,
        subscriber: str | None,
        token: str | None,
        timeout: float,
        retry: RetryPolicy,
    ) -> None:
        self.url = (url or os.environ.get("CASQUE_SIDECAR_URL") or DEFAULT_URL).rstrip("/")
        self.queue = queue or os.environ.get("CASQUE_SIDECAR_QUEUE")
        subscribers = os.environ.get("CASQUE_SIDECAR_SUBSCRIBERS", "").split(",")
        self.subscriber = subscriber or (subscribers[0].strip() or None)
        self.token = token if token is not None else os.environ.get("CASQUE_SIDECAR_TOKEN")
        self.timeout = timeout
        self.retry = retry
        self.local = is_loopback(urllib.parse.urlsplit(self.url).hostname or "")
        # This client's producer id, made once, and its messages' numbers (count() hands out
        # each number once, also to threads sharing a sync client).
        self.producer = uuid.uuid4().hex
        self._sequence = itertools.count()

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _queue_path(self, queue: str | None) -> str:
        name = queue or self.queue
        if not name:
            raise ValueError("no queue: pass queue=... to the client or the call")
        return f"/v1/queues/{quote(name, safe='')}"

    def _subscriber_path(self, queue: str | None, subscriber: str | None) -> str:
        name = subscriber or self.subscriber
        if not name:
            raise ValueError("no subscriber: pass subscriber=... to the client or the call")
        return f"{self._queue_path(queue)}/subscribers/{quote(name, safe='')}"

    def numbered(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A publish body with its idempotency key: the caller's id, or this client's producer
        id and the next number. Numbered once, before the first attempt: every resend carries
        the same key."""
        if body.get("id") or "producerid" in body:
            return dict(body)
        return {**body, "producerid": self.producer, "producerseq": next(self._sequence)}

    # Each call: the request, then a parser of the answer's JSON.
    def publish(self, body: Mapping[str, Any], queue: str | None) -> _Call:
        return _Call("POST", f"{self._queue_path(queue)}/messages", self.numbered(body))

    def publish_batch(self, bodies: Iterable[Mapping[str, Any]], queue: str | None) -> _Call:
        return _Call("POST", f"{self._queue_path(queue)}/messages/batch",
                     {"messages": [self.numbered(body) for body in bodies]})

    def receive(
        self, max: int, wait: float, visibility: float | None, queue: str | None, subscriber: str | None
    ) -> _Call:
        body: dict[str, Any] = {"max": max, "wait": wait}
        if visibility is not None:
            body["visibility"] = visibility
        # The long poll must not outlast the HTTP timeout.
        return _Call("POST", f"{self._subscriber_path(queue, subscriber)}/receive", body, self.timeout + wait,
                     resendable=False)

    def settle(
        self, action: str, receipts: Sequence[str], single: bool, extra: Mapping[str, Any],
        queue: str | None, subscriber: str | None,
    ) -> _Call:
        body: dict[str, Any] = {"receipt": receipts[0]} if single else {"receipts": list(receipts)}
        body.update(extra)
        # A second ack answers already_acked and a second extend sets the same deadline;
        # a second nack would find the message handed out again.
        return _Call("POST", f"{self._subscriber_path(queue, subscriber)}/{action}", body,
                     resendable=action != "nack")

    def seek(
        self, to: str | None, at: datetime | None, batches: Mapping[int, int] | None,
        queue: str | None, subscriber: str | None,
    ) -> _Call:
        if at is not None:
            body: dict[str, Any] = {"time": at.isoformat()}
        elif batches is not None:
            body = {"batches": {str(shard): batch for shard, batch in batches.items()}}
        else:
            body = {"to": to}
        return _Call("POST", f"{self._subscriber_path(queue, subscriber)}/seek", body, resendable=False)

    def queue_stats(self, queue: str | None) -> _Call:
        return _Call("GET", f"{self._queue_path(queue)}/stats")

    def subscriber_stats(self, queue: str | None, subscriber: str | None) -> _Call:
        return _Call("GET", f"{self._subscriber_path(queue, subscriber)}/stats")

    def message_history(self, message_id: str, queue: str | None) -> _Call:
        return _Call("GET", f"{self._queue_path(queue)}/messages/{urllib.parse.quote(message_id, safe='')}")

    @staticmethod
    def error(status: int, raw: bytes, retry_after: str | None) -> ApiError:
        try:
            error = json.loads(raw)["error"]
            code, text = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, text = "http_error", raw.decode("utf-8", "replace")[:200] or f"HTTP {status}"
        else:
            if code == "schema_violation" and error.get("details"):
                return _schema_violation(status, text, error["details"][0])
        seconds: float | None = None
        if retry_after:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = None
        return ApiError(status, code, text, seconds)


def _schema_violation(status: int, text: str, detail: Mapping[str, Any]) -> SchemaViolation:
    # The detail's field is `data`, or `messages[N].data` for the Nth message of a batch.
    field = str(detail.get("field", ""))
    index = int(field[9:field.index("]")]) if field.startswith("messages[") and "]" in field else None
    version = detail.get("schemaVersion")
    return SchemaViolation(status, text, path=str(detail.get("path", "")), rule=str(detail.get("rule", "")),
                           schema_version=int(version) if version is not None else None, index=index)


def _published(answer: Mapping[str, Any]) -> PublishResult:
    due = answer.get("deliverAt")
    return PublishResult(answer["messageId"], answer["shard"], answer["batch"], answer["seq"], answer["duplicate"],
                         _parse_time(due) if due else None)


def _nack_fields(delay: float | None, error: str | None) -> dict[str, Any]:
    """A nack's body; without a delay the subscriber's retry policy (or none: at once) decides."""
    fields: dict[str, Any] = {} if delay is None else {"delay": delay}
    return fields if error is None else {**fields, "error": error}


def _outcomes(answer: Mapping[str, Any]) -> list[ReceiptOutcome]:
    outcomes = []
    for result in answer["results"]:
        error = result.get("error") or {}
        outcomes.append(ReceiptOutcome(result["receipt"], result.get("status"), error.get("code"), error.get("message")))
    return outcomes


class Client:
    """Synchronous client (standard library only)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        queue: str | None = None,
        subscriber: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self._calls = _Requests(url, queue, subscriber, token, timeout, retry)
        # No ProxyHandler entries: a proxy from the environment would not reach the pod's loopback.
        handlers = [urllib.request.ProxyHandler({})] if self._calls.local else []
        self._opener = urllib.request.build_opener(*handlers)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: each call uses its own connection."""

    def _send(self, call: _Call) -> Any:
        data = None if call.body is None else json.dumps(call.body).encode()
        last: Exception | None = None
        for attempt in range(self._calls.retry.attempts):
            request = urllib.request.Request(self._calls.url + call.path, data=data, method=call.method, headers=self._calls.headers())
            try:
                with self._opener.open(request, timeout=call.timeout or self._calls.timeout) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as refused:
                error = _Requests.error(refused.code, refused.read(), refused.headers.get("Retry-After"))
                if refused.code != 503:
                    raise error from None
                last = error
            except (urllib.error.URLError, ConnectionError, socket.timeout) as failure:
                last = SidecarUnreachable(f"sidecar at {self._calls.url}: {getattr(failure, 'reason', failure)}")
                if not call.resendable and not isinstance(getattr(failure, "reason", failure), ConnectionRefusedError):
                    raise last from failure
            if attempt + 1 < self._calls.retry.attempts:
                time.sleep(self._calls.retry.delay(attempt, getattr(last, "retry_after", None)))
        assert last is not None
        raise last

    def publish(
        self, data: Any = _MISSING, *, queue: str | None = None, **fields: Any
    ) -> PublishResult:
        """Publish one message (see `message` for the fields); answered once it is written."""
        return _published(self._send(self._calls.publish(message(data, **fields), queue)))

    def publish_batch(
        self, messages: Iterable[Mapping[str, Any]], *, queue: str | None = None
    ) -> list[PublishResult]:
        """Publish several messages, each numbered, so the whole call can be sent again. Build
        each with `casque_client.message(...)`."""
        return [_published(r) for r in self._send(self._calls.publish_batch(messages, queue))["results"]]

    def receive(
        self, max: int = 10, wait: float = 0.0, visibility: float | None = None, *,
        queue: str | None = None, subscriber: str | None = None,
    ) -> list[Message]:
        answer = self._send(self._calls.receive(max, wait, visibility, queue, subscriber))
        return [Message.of(event) for event in answer["messages"]]

    def ack(
        self, receipt: str, *, outputs: Outputs | None = None, queue: str | None = None,
        subscriber: str | None = None,
    ) -> str:
        """'acked', or 'already_acked'; a stale receipt raises ApiError(code='stale_receipt').
        With `outputs`, they are published first, exactly once however often this is sent."""
        answer = self._send(self._calls.settle("ack", [receipt], True, _outputs_field(outputs), queue, subscriber))
        return str(answer["results"][0]["status"])

    def ack_batch(
        self, receipts: Sequence[str], *, queue: str | None = None, subscriber: str | None = None
    ) -> list[ReceiptOutcome]:
        return _outcomes(self._send(self._calls.settle("ack", receipts, False, {}, queue, subscriber)))

    def nack(
        self, receipt: str, delay: float | None = None, *, error: str | None = None, queue: str | None = None,
        subscriber: str | None = None,
    ) -> None:
        """Deliver again after `delay` seconds (None: after the subscriber's retry backoff, or at
        once without one); `error` is kept in the message's history."""
        self._send(self._calls.settle("nack", [receipt], True, _nack_fields(delay, error), queue, subscriber))

    def nack_batch(
        self, receipts: Sequence[str], delay: float | None = None, *, queue: str | None = None,
        subscriber: str | None = None,
    ) -> list[ReceiptOutcome]:
        return _outcomes(self._send(self._calls.settle("nack", receipts, False, _nack_fields(delay, None), queue,
                                                       subscriber)))

    def extend(
        self, receipt: str, visibility: float, *, queue: str | None = None, subscriber: str | None = None
    ) -> datetime:
        """Keep a message invisible `visibility` more seconds; returns the new deadline."""
        answer = self._send(self._calls.settle("extend", [receipt], True, {"visibility": visibility}, queue, subscriber))
        return _parse_time(answer["results"][0]["visibleUntil"])

    def seek(
        self, to: Literal["earliest", "latest"] | None = None, *, time: datetime | None = None,
        batches: Mapping[int, int] | None = None, queue: str | None = None, subscriber: str | None = None,
    ) -> dict[int, int]:
        answer = self._send(self._calls.seek(to, time, batches, queue, subscriber))
        return {int(shard): batch for shard, batch in answer["offsets"].items()}

    def queue_stats(self, *, queue: str | None = None) -> dict[str, Any]:
        return dict(self._send(self._calls.queue_stats(queue)))

    def subscriber_stats(
        self, *, queue: str | None = None, subscriber: str | None = None
    ) -> dict[str, Any]:
        return dict(self._send(self._calls.subscriber_stats(queue, subscriber)))

    def message_history(self, message_id: str, *, queue: str | None = None) -> dict[str, Any]:
        """Where a published message is and each subscriber's state of it (pending, in_flight,
        nacked, acked, dead_lettered, filtered, ...): the sidecar's messageHistory answer."""
        return dict(self._send(self._calls.message_history(message_id, queue)))


class AsyncClient:
    """asyncio client on aiohttp; use it as `async with AsyncClient(...) as queue:`."""

    def __init__(
        self,
        url: str | None = None,
        *,
        queue: str | None = None,
        subscriber: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self._calls = _Requests(url, queue, subscriber, token, timeout, retry)
        self._session: aiohttp.ClientSession | None = None

    @property
    def queue(self) -> str | None:
        """The queue of calls that name none (given, or the pod's CASQUE_SIDECAR_QUEUE)."""
        return self._calls.queue

    @property
    def subscriber(self) -> str | None:
        """The subscriber of calls that name none (given, or the first of CASQUE_SIDECAR_SUBSCRIBERS)."""
        return self._calls.subscriber

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(self, call: _Call) -> Any:
        if self._session is None:
            # trust_env stays off: no proxy from the environment for the pod's loopback.
            self._session = aiohttp.ClientSession(headers=self._calls.headers(), trust_env=not self._calls.local)
        last: Exception | None = None
        timeout = aiohttp.ClientTimeout(total=call.timeout or self._calls.timeout)
        for attempt in range(self._calls.retry.attempts):
            try:
                async with self._session.request(
                    call.method, self._calls.url + call.path, json=call.body, timeout=timeout
                ) as answer:
                    raw = await answer.read()
                    if answer.status < 400:
                        return json.loads(raw)
                    error = _Requests.error(answer.status, raw, answer.headers.get("Retry-After"))
                    if answer.status != 503:
                        raise error
                    last = error
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as failure:
                last = SidecarUnreachable(f"sidecar at {self._calls.url}: {failure or type(failure).__name__}")
                # A failed connect sent nothing; anything later may have been done.
                if not call.resendable and not isinstance(failure, aiohttp.ClientConnectorError):
                    raise last from failure
            if attempt + 1 < self._calls.retry.attempts:
                await asyncio.sleep(self._calls.retry.delay(attempt, getattr(last, "retry_after", None)))
        assert last is not None
        raise last

    async def publish(
        self, data: Any = _MISSING, *, queue: str | None = None, **fields: Any
    ) -> PublishResult:
        return _published(await self._send(self._calls.publish(message(data, **fields), queue)))

    async def publish_batch(
        self, messages: Iterable[Mapping[str, Any]], *, queue: str | None = None
    ) -> list[PublishResult]:
        return [_published(r) for r in (await self._send(self._calls.publish_batch(messages, queue)))["results"]]

    async def receive(
        self, max: int = 10, wait: float = 0.0, visibility: float | None = None, *,
        queue: str | None = None, subscriber: str | None = None,
    ) -> list[Message]:
        answer = await self._send(self._calls.receive(max, wait, visibility, queue, subscriber))
        return [Message.of(event) for event in answer["messages"]]

    async def ack(
        self, receipt: str, *, outputs: Outputs | None = None, queue: str | None = None,
        subscriber: str | None = None,
    ) -> str:
        answer = await self._send(self._calls.settle("ack", [receipt], True, _outputs_field(outputs), queue,
                                                     subscriber))
        return str(answer["results"][0]["status"])

    async def ack_batch(
        self, receipts: Sequence[str], *, queue: str | None = None, subscriber: str | None = None
    ) -> list[ReceiptOutcome]:
        return _outcomes(await self._send(self._calls.settle("ack", receipts, False, {}, queue, subscriber)))

    async def nack(
        self, receipt: str, delay: float | None = None, *, error: str | None = None, queue: str | None = None,
        subscriber: str | None = None,
    ) -> None:
        await self._send(self._calls.settle("nack", [receipt], True, _nack_fields(delay, error), queue, subscriber))

    async def nack_batch(
        self, receipts: Sequence[str], delay: float | None = None, *, queue: str | None = None,
        subscriber: str | None = None,
    ) -> list[ReceiptOutcome]:
        return _outcomes(await self._send(self._calls.settle("nack", receipts, False, _nack_fields(delay, None), queue,
                                                             subscriber)))

    async def extend(
        self, receipt: str, visibility: float, *, queue: str | None = None, subscriber: str | None = None
    ) -> datetime:
        answer = await self._send(self._calls.settle("extend", [receipt], True, {"visibility": visibility}, queue, subscriber))
        return _parse_time(answer["results"][0]["visibleUntil"])

    async def seek(
        self, to: Literal["earliest", "latest"] | None = None, *, time: datetime | None = None,
        batches: Mapping[int, int] | None = None, queue: str | None = None, subscriber: str | None = None,
    ) -> dict[int, int]:
        answer = await self._send(self._calls.seek(to, time, batches, queue, subscriber))
        return {int(shard): batch for shard, batch in answer["offsets"].items()}

    async def queue_stats(self, *, queue: str | None = None) -> dict[str, Any]:
        return dict(await self._send(self._calls.queue_stats(queue)))

    async def subscriber_stats(
        self, *, queue: str | None = None, subscriber: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._send(self._calls.subscriber_stats(queue, subscriber)))

    async def message_history(self, message_id: str, *, queue: str | None = None) -> dict[str, Any]:
        """See Client.message_history."""
        return dict(await self._send(self._calls.message_history(message_id, queue)))
