"""subscribe(): its pure rules, and its settling and stopping against an in-memory stand-in for the client.

The stand-in answers receives from a list and records acks, nacks and extends; what happens
against a real sidecar is in tests/integration/test_client.py.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from casque_client import ApiError, Message, SidecarUnreachable, subscribe
from casque_client.subscription import (
    MAX_ERROR_TEXT,
    Backoff,
    error_text,
    extension_due,
    is_transient,
    lease_seconds,
    receive_size,
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def delivery(n: int, count: int = 1, visible_for: float = 30.0) -> Message:
    now = datetime.now(timezone.utc)
    return Message.of({
        "id": f"m{n}", "receipt": f"r{n}", "deliverycount": count, "data": {"n": n}, "type": "t", "source": "/s",
        "time": now.isoformat(), "shard": 0, "batch": 1, "seq": n,
        "visibleuntil": (now + timedelta(seconds=visible_for)).isoformat(),
    })


# --- pure rules -----------------------------------------------------------------------------


def test_backoff_doubles_per_delivery_up_to_its_cap() -> None:
    plain = Backoff(first=1.0, max=10.0, jitter=False)
    assert [plain.delay(n) for n in (1, 2, 3, 4, 5, 6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert plain.delay(10_000) == 10.0  # no overflow on a message delivered very often
    assert plain.delay(0) == 1.0


def test_backoff_jitter_stays_between_half_and_whole() -> None:
    jittered = Backoff(first=4.0, max=100.0)
    assert jittered.delay(1, draw=lambda low, high: low) == 2.0
    assert jittered.delay(1, draw=lambda low, high: high) == 4.0
    assert jittered(delivery(1, count=2), RuntimeError()) <= 8.0


def test_error_text_names_the_exception_and_fits_the_sidecars_limit() -> None:
    assert error_text(ValueError("bad total")) == "ValueError: bad total"
    assert error_text(KeyError()) == "KeyError"
    long = error_text(RuntimeError("x" * 5000))
    assert len(long) == MAX_ERROR_TEXT and long.endswith("...")


def test_extension_is_due_at_half_of_what_is_left() -> None:
    assert extension_due(30.0) == 15.0
    assert extension_due(0.0) == 0.0
    assert extension_due(-5.0) == 0.0  # already late: at once


def test_lease_is_what_the_delivery_was_given() -> None:
    assert lease_seconds(NOW + timedelta(seconds=60), NOW) == 60.0
    assert lease_seconds(NOW, NOW) == 1.0  # never ask for nothing


def test_receive_asks_only_for_free_slots() -> None:
    assert receive_size(8, 0) == 8
    assert receive_size(8, 5) == 3
    assert receive_size(8, 8) == 0
    assert receive_size(5000, 0) == 1000  # the sidecar's per-receive limit


def test_what_the_receive_loop_waits_out() -> None:
    assert is_transient(SidecarUnreachable("gone"))
    assert is_transient(ApiError(503, "not_ready", "draining"))
    assert is_transient(ApiError(429, "too_many", "slow down"))
    assert not is_transient(ApiError(404, "subscriber_not_found", "no such subscriber"))
    assert not is_transient(ApiError(401, "unauthorized", "bad token"))


# --- behaviour against a stand-in client ----------------------------------------------------


class FakeClient:
    """Hands out the given messages once, then long-polls until cancelled; records settles."""

    def __init__(self, messages: list[Message], refuse: ApiError | None = None) -> None:
        self.pending = list(messages)
        self.refuse = refuse
        self.acked: list[str] = []
        self.nacked: list[tuple[str, float, str | None]] = []
        self.extended: list[str] = []
        self.extended_twice = asyncio.Event()
        self.asked: list[int] = []
        self.settled = asyncio.Event()
        self.total = len(messages)
        self.queue = "q"
        self.subscriber = "s"

    async def receive(self, max: int, wait: float, visibility: float | None, **_: Any) -> list[Message]:
        self.asked.append(max)
        if self.refuse is not None:
            raise self.refuse
        if not self.pending:
            await asyncio.Event().wait()  # a long poll that finds nothing
        taken, self.pending = self.pending[:max], self.pending[max:]
        return taken

    def _check(self) -> None:
        if len(self.acked) + len(self.nacked) == self.total:
            self.settled.set()

    async def ack(self, receipt: str, **_: Any) -> str:
        self.acked.append(receipt)
        self._check()
        return "acked"

    async def nack(self, receipt: str, delay: float = 0.0, *, error: str | None = None, **_: Any) -> None:
        self.nacked.append((receipt, delay, error))
        self._check()

    async def extend(self, receipt: str, visibility: float, **_: Any) -> datetime:
        self.extended.append(receipt)
        if len(self.extended) >= 2:
            self.extended_twice.set()
        return datetime.now(timezone.utc) + timedelta(seconds=visibility)

    async def close(self) -> None:
        pass


async def test_success_acks_failure_nacks_with_the_error_and_the_delay() -> None:
    fake = FakeClient([delivery(1), delivery(2, count=3)])

    async def handle(message: Message) -> None:
        if message.data["n"] == 2:
            raise ValueError("card declined")

    stop = asyncio.Event()
    task = asyncio.create_task(subscribe("q", "s", handle, client=fake, stop=stop,
                                         nack_delay=lambda m, e: 10.0 * m.delivery_count))
    await asyncio.wait_for(fake.settled.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert fake.acked == ["r1"]
    assert fake.nacked == [("r2", 30.0, "ValueError: card declined")]


async def test_a_plain_function_handler_runs_and_is_settled() -> None:
    fake = FakeClient([delivery(1), delivery(2)])
    seen: list[int] = []
    stop = asyncio.Event()
    task = asyncio.create_task(subscribe("q", "s", lambda m: seen.append(m.data["n"]), client=fake,
                                         stop=stop))
    await asyncio.wait_for(fake.settled.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert sorted(seen) == [1, 2] and sorted(fake.acked) == ["r1", "r2"]


async def test_never_more_handlers_than_the_concurrency_and_receives_ask_for_free_slots() -> None:
    fake = FakeClient([delivery(n) for n in range(10)])
    running, most = 0, 0
    gate = asyncio.Event()
    started = asyncio.Event()

    async def handle(message: Message) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        if running == 3:
            started.set()
        await gate.wait()
        running -= 1

    stop = asyncio.Event()
    task = asyncio.create_task(subscribe("q", "s", handle, client=fake, concurrency=3, stop=stop))
    await asyncio.wait_for(started.wait(), 30)
    gate.set()
    await asyncio.wait_for(fake.settled.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert most == 3 and len(fake.acked) == 10
    assert all(1 <= asked <= 3 for asked in fake.asked)


async def test_a_running_handler_has_its_message_extended() -> None:
    # Visible for 0.2 s: the first extend is due at half of that.
    fake = FakeClient([delivery(1, visible_for=0.2)])
    gate = asyncio.Event()

    async def handle(message: Message) -> None:
        await gate.wait()

    stop = asyncio.Event()
    task = asyncio.create_task(subscribe("q", "s", handle, client=fake, stop=stop))
    await asyncio.wait_for(fake.extended_twice.wait(), 30)
    gate.set()
    await asyncio.wait_for(fake.settled.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert fake.acked == ["r1"] and set(fake.extended) == {"r1"}


@pytest.mark.parametrize("how", ["cancel", "stop"])
async def test_stopping_lets_handlers_finish_within_grace_and_nacks_the_rest(how: str) -> None:
    fake = FakeClient([delivery(1), delivery(2)])
    both = asyncio.Event()
    finishing = asyncio.Event()
    started: list[int] = []

    async def handle(message: Message) -> None:
        started.append(message.data["n"])
        if len(started) == 2:
            both.set()
        if message.data["n"] == 1:
            await finishing.wait()  # finishes once the stop has begun
        else:
            await asyncio.Event().wait()  # never finishes by itself

    stop = asyncio.Event()
    task = asyncio.create_task(subscribe("q", "s", handle, client=fake, stop=stop, grace=2.0))
    await asyncio.wait_for(both.wait(), 30)
    if how == "cancel":
        task.cancel()
    else:
        stop.set()
    finishing.set()
    if how == "cancel":
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    else:
        await asyncio.wait_for(task, 30)
    assert fake.acked == ["r1"]
    assert [(receipt, delay) for receipt, delay, _ in fake.nacked] == [("r2", 0.0)]


async def test_a_refusal_that_will_not_change_stops_the_subscription() -> None:
    fake = FakeClient([], refuse=ApiError(404, "subscriber_not_found", "no such subscriber"))
    with pytest.raises(ApiError, match="subscriber_not_found"):
        await asyncio.wait_for(subscribe("q", "s", lambda m: None, client=fake), 30)


async def test_concurrency_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        await subscribe("q", "s", lambda m: None, concurrency=0)
