"""Which push URLs the sidecar accepts, its push token, and how pushes that fail in the
sidecar itself are settled."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import cast

import pytest
from pydantic import ValidationError

from casque.engine.consumer import Consumer
from casque.engine.messages import Delivery, Position, StoredMessage
from casque.errors import InvalidSpec
from casque.schema import QueueRef
from casque.sidecar import push
from casque.sidecar.config import SidecarSettings, push_target
from casque.sidecar.metrics import SidecarMetrics
from casque.sidecar.push import QUOTED_ANSWER_CHARS, PushWorker, error_reason, push_token
from casque.specs import RetryPolicy, SubscriberSpec, SubscriberState


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/events", "http://localhost/x", "https://[::1]:9/e",
                                 "http://127.3.4.5/e"])
def test_loopback_push_urls_are_accepted(url: str) -> None:
    assert push_target(url, allow_remote=False) == url
    assert SidecarSettings(push_url=url).push_url == url


@pytest.mark.parametrize("url", ["http://10.0.0.7/events", "http://app.default.svc/e", "http://localhost.evil.com/",
                                 "http://169.254.169.254/latest/meta-data"])
def test_other_push_urls_need_the_explicit_setting(url: str) -> None:
    with pytest.raises(ValueError, match="not on the pod's loopback"):
        push_target(url, allow_remote=False)
    with pytest.raises(ValidationError, match="PUSH_ALLOW_REMOTE"):
        SidecarSettings(push_url=url)
    assert SidecarSettings(push_url=url, push_allow_remote=True).push_url == url


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "127.0.0.1:80", "http:///path"])
def test_push_urls_must_be_http_with_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        push_target(url, allow_remote=True)


def test_the_push_token_is_configured_or_fresh_per_start() -> None:
    configured = SidecarSettings(push_token="t" * 32)
    assert push_token(configured) == "t" * 32
    generated = {push_token(SidecarSettings()) for _ in range(2)}
    assert len(generated) == 2 and all(len(token) >= 32 for token in generated)
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        SidecarSettings(push_token="short")


# --- settling pushes that fail in the sidecar ---------------------------------------------
class RecordingConsumer:
    """Stands in for the engine's Consumer: records how each delivery was settled."""

    visibility_timeout = 30.0

    def __init__(self, dead_letter_queue: bool, retry: RetryPolicy | None = None) -> None:
        self.dead_letter_queue = dead_letter_queue
        self.subscriber_state = SubscriberState(spec=SubscriberSpec(queue="events", retry=retry),
                                                created_at=datetime.now(timezone.utc))
        self.settled: list[tuple[str, str, float | None, str | None]] = []

    async def ack(self, receipt: str) -> bool:
        self.settled.append(("ack", receipt, None, None))
        return True

    async def nack(self, receipt: str, delay: float | None = None, error: str | None = None) -> None:
        self.settled.append(("nack", receipt, delay, error))

    async def dead_letter(self, receipt: str, error: str | None = None) -> None:
        if not self.dead_letter_queue:
            raise InvalidSpec("no dead-letter queue")
        self.settled.append(("dead_letter", receipt, None, error))


def delivery(attributes: dict[str, str]) -> Delivery:
    stored = StoredMessage(Position(0, 1, 2), "m-1", datetime.now(timezone.utc), b'"x"',
                           attributes=attributes, content_type="application/json")
    return Delivery(stored, "r-1", delivery_count=1, visible_until=time.monotonic() + 30)


def worker(consumer: RecordingConsumer) -> PushWorker:
    settings = SidecarSettings(push_backoff_seconds=2, push_max_backoff_seconds=60)
    return PushWorker(cast(Consumer, consumer), QueueRef("default", "events"), "webhook", settings,
                      SidecarMetrics(), "t" * 32)


def push_errors(pusher: PushWorker, stage: str) -> float | None:
    return pusher.metrics.registry.get_sample_value(
        "casque_sidecar_push_errors_total", {"subscriber": "webhook", "stage": stage})


@pytest.mark.parametrize(("error", "reason"), [
    (RecursionError("maximum recursion depth exceeded"), "RecursionError: maximum recursion depth exceeded"),
    (ValueError("two\n  lines"), "ValueError: two lines"),
    (TimeoutError(), "TimeoutError"),
])
def test_a_failure_reason_is_the_error_type_and_its_message_on_one_line(error: Exception, reason: str) -> None:
    assert error_reason(error) == reason


def test_a_failure_reason_is_kept_short() -> None:
    reason = error_reason(ValueError("x" * 10_000))
    assert reason.startswith("ValueError: xxx") and len(reason) <= len("ValueError: ") + QUOTED_ANSWER_CHARS


@pytest.mark.parametrize("dead_letter_queue", [True, False])
async def test_a_message_that_cannot_be_rendered_is_a_permanent_failure(
    dead_letter_queue: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = RecordingConsumer(dead_letter_queue)
    pusher = worker(consumer)

    def unrenderable(delivery: Delivery, queue: QueueRef) -> bytes:
        raise ValueError("1 validation error for Message")  # as pydantic's ValidationError would

    monkeypatch.setattr(push, "message_json", unrenderable)
    await pusher._deliver(delivery({}), "http://127.0.0.1:9/events")
    ((how, receipt, delay, reason),) = consumer.settled
    assert (how, receipt) == (("dead_letter", "r-1") if dead_letter_queue else ("nack", "r-1"))
    if not dead_letter_queue:
        assert delay == 60  # kept, never dropped: the longest backoff
    assert reason is not None and "cannot render" in reason and "validation error" in reason
    assert push_errors(pusher, "render") == 1


async def deliver_through_a_broken_push(consumer: RecordingConsumer) -> PushWorker:
    """One delivery whose push raises (a bug in it, not the app's answer)."""
    pusher = worker(consumer)

    async def broken(delivery: Delivery, url: str) -> None:
        raise RuntimeError("a bug in the push")

    pusher._push = broken  # type: ignore[method-assign]
    await pusher._deliver(delivery({}), "http://127.0.0.1:9/events")
    return pusher


async def test_an_error_escaping_a_push_is_still_settled_with_backoff_and_counted() -> None:
    consumer = RecordingConsumer(dead_letter_queue=True)
    pusher = await deliver_through_a_broken_push(consumer)
    ((how, receipt, delay, reason),) = consumer.settled
    assert (how, receipt) == ("nack", "r-1")
    assert delay is not None and 1 <= delay <= 2  # the first delivery's backoff, jittered in its upper half
    assert reason is not None and "RuntimeError: a bug in the push" in reason
    assert push_errors(pusher, "task") == 1


async def test_a_subscribers_retry_policy_decides_a_failed_pushs_backoff() -> None:
    """With `spec.retry` the push names no delay, so the engine applies the policy (not the
    sidecar's own push backoff)."""
    consumer = RecordingConsumer(dead_letter_queue=True, retry=RetryPolicy(minimum_backoff_seconds=7))
    await deliver_through_a_broken_push(consumer)
    ((how, receipt, delay, _),) = consumer.settled
    assert (how, receipt, delay) == ("nack", "r-1", None)
