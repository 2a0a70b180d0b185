"""Nack delays and retry backoffs outlive the member that made them, and a message over its
max deliveries is dead-lettered when its wait ends, whether or not anybody receives.

Each test runs `casque sidecar` processes for one subscriber in both delivery modes, nacks a
delivery with a delay (or with none, under a retry policy), then restarts the sidecar with
SIGTERM, kills it with SIGKILL right after the nack was answered, or lets another sidecar
take its shard (leased) or range (shared) over. The message must not come back before its
due time, and must come back after it.

The sidecars ask for 4 s ZooKeeper sessions and a 3 s visibility, so a killed member's
shard or range moves on well before the delay ends. A nack whose row cannot be written is
refused and changes nothing (a member in this process, its row write failing at the driver).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from casque.engine import catalog
from casque.engine.acks import NACK, AckEvent, AckLog
from casque.engine.consumer import Consumer
from casque.engine.leases import ShardLeases
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable, LeaseLost, StaleReceipt
from casque.schema import QueueRef
from casque.specs import QueueSpec, RetryPolicy, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient, Client
from casque_client.client import Message
from tests.fixtures.sidecars import SidecarProcess, StartSidecar
from tests.fixtures.waiting import wait_for

QUEUE = "orders"
DEAD_LETTERS = "orders-dead"
SUBSCRIBER = "billing"
REF = QueueRef("default", QUEUE)
SESSION = {"CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS": "4"}
DELAY = 9.0
VISIBILITY = 3
# Each sidecar turns the recorded due time (Cassandra's clock) into its own monotonic clock
# from its own sample of that clock: on one machine the samples agree to a few ms.
CLOCK_SLACK = 0.2


@pytest.fixture(params=["leased", "shared"])
def delivery(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def create(store: Store, delivery: str, shards: int = 1, retry: RetryPolicy | None = None,
           max_deliveries: int = 10, dead_letters: bool = False) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE"))
    if dead_letters:
        catalog.apply_queue(store, QueueRef("default", DEAD_LETTERS),
                            QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=VISIBILITY, delivery=delivery,
        retry=retry, max_deliveries=max_deliveries, dead_letter_queue=DEAD_LETTERS if dead_letters else None))


def start(start_sidecar: StartSidecar) -> SidecarProcess:
    return start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER, env=SESSION)


async def nack_all(sidecar: SidecarProcess, count: int, delay: float | None) -> dict[str, float]:
    """Publish `count` messages (one per shard key), receive them all and nack them: the
    time before each nack was sent plus its wait, by message id."""
    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        await client.publish_batch([{"data": i, "partitionkey": f"k{i}"} for i in range(count)])
        held: list[Message] = []
        while len(held) < count:
            held.extend(await client.receive(max=count, wait=5))
        due: dict[str, float] = {}
        for message in held:
            assert message.delivery_count == 1
            sent = time.time()
            await client.nack(message.receipt, delay)
            due[message.message_id] = sent + DELAY
        return due


async def redeliveries(sidecars: list[SidecarProcess], due: dict[str, float],
                       by: dict[str, SidecarProcess] | None = None) -> dict[str, float]:
    """Receive from every sidecar until each message of `due` came back; when each did (and
    into `by`, which sidecar delivered it)."""
    back: dict[str, float] = {}

    async def take(sidecar: SidecarProcess) -> None:
        async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
            while not due.keys() <= back.keys():
                for message in await client.receive(max=10, wait=2):
                    back.setdefault(message.message_id, time.time())
                    if by is not None:
                        by[message.message_id] = sidecar
                    assert message.delivery_count == 2, message
                    await client.ack(message.receipt)

    await asyncio.wait_for(asyncio.gather(*(take(s) for s in sidecars)), 90)
    return back


def assert_not_early(due: dict[str, float], back: dict[str, float]) -> None:
    early = {m: round(due[m] - back[m], 2) for m in due if back[m] < due[m] - CLOCK_SLACK}
    assert not early, f"delivered again this many seconds before their due time: {early}"


Fault = Callable[[SidecarProcess], None]


def sigterm(sidecar: SidecarProcess) -> None:
    assert sidecar.terminate() == 0, sidecar.tail()


def sigkill(sidecar: SidecarProcess) -> None:
    sidecar.kill()  # no drain, no lease or claim release, nothing flushed


@pytest.mark.parametrize("fault", [sigterm, sigkill], ids=["sigterm", "sigkill"])
async def test_a_nack_delay_outlives_the_sidecar(
    store: Store, start_sidecar: StartSidecar, delivery: str, fault: Fault
) -> None:
    create(store, delivery)
    first = start(start_sidecar)
    due = await nack_all(first, 1, DELAY)
    fault(first)
    second = await asyncio.to_thread(start, start_sidecar)
    assert_not_early(due, await redeliveries([second], due))


@pytest.mark.parametrize("fault", [sigterm, sigkill], ids=["sigterm", "sigkill"])
async def test_a_retry_backoff_outlives_the_sidecar(
    store: Store, start_sidecar: StartSidecar, delivery: str, fault: Fault
) -> None:
    create(store, delivery, retry=RetryPolicy(minimum_backoff_seconds=int(DELAY), maximum_backoff_seconds=60))
    first = start(start_sidecar)
    due = await nack_all(first, 1, None)  # no delay named: the policy's backoff after one delivery
    fault(first)
    second = await asyncio.to_thread(start, start_sidecar)
    assert_not_early(due, await redeliveries([second], due))


@pytest.mark.parametrize("delay", [DELAY, None], ids=["delay", "backoff"])
async def test_a_nack_delay_holds_at_the_member_that_takes_the_shard_or_range_over(
    store: Store, start_sidecar: StartSidecar, delivery: str, delay: float | None
) -> None:
    create(store, delivery, shards=2,
           retry=RetryPolicy(minimum_backoff_seconds=int(DELAY), maximum_backoff_seconds=60))
    first = start(start_sidecar)
    due = await nack_all(first, 8, delay)  # keys k0-k3 go to one shard, k4-k7 to the other
    second = await asyncio.to_thread(start, start_sidecar)
    # Leased, the newcomer gets one of the two shards. Shared, the first sidecar's app asks
    # for nothing more, so it gives up its ranges and the newcomer takes them over.
    takers = [first, second] if delivery == "leased" else [second]
    by: dict[str, SidecarProcess] = {}
    assert_not_early(due, await redeliveries(takers, due, by))
    assert second in by.values()  # what it delivered, it loaded from the first one's nacks


async def test_a_message_over_max_deliveries_is_dead_lettered_when_its_delay_ends_with_no_receive(
    store: Store, start_sidecar: StartSidecar, delivery: str
) -> None:
    create(store, delivery, max_deliveries=1, dead_letters=True)
    sidecar = start(start_sidecar)
    (message_id, due), = (await nack_all(sidecar, 1, DELAY)).items()
    dead_letter_id, seen = dead_letter_watch(sidecar, message_id)
    # Nobody receives: the sidecar's own timer moves it when the delay ends.
    copy = await asyncio.to_thread(wait_for, "the message in the dead-letter queue", dead_letter_id, DELAY + 30)
    assert copy
    early = [(round(due - at, 2), state) for at, state in seen if at < due - CLOCK_SLACK and state != "nacked"]
    assert not early, f"before its delay ended (seconds before, state): {early}"


def dead_letter_watch(sidecar: SidecarProcess, message_id: str) -> tuple[Callable[[], str | None],
                                                                          list[tuple[float, str]]]:
    """A probe of the message's history at `sidecar`: its dead-letter copy's id once it has
    one; and every (time, state) it saw."""
    seen: list[tuple[float, str]] = []

    def dead_letter_id() -> str | None:
        with Client(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
            (history,) = client.message_history(message_id)["subscribers"]
        seen.append((time.time(), history["state"]))
        return history.get("deadLetterMessageId") if history["state"] == "dead_lettered" else None

    return dead_letter_id, seen


async def receive_one(sidecar: SidecarProcess) -> tuple[Message, float, float]:
    """Publish one message and receive it: the delivery, and the earliest and the latest
    time its visibility may end (from when the receive was sent and answered)."""
    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        await client.publish({"order": 1})
        while True:
            sent = time.time()
            if got := await client.receive(max=1, wait=5):
                return got[0], sent + VISIBILITY, time.time() + VISIBILITY


@pytest.mark.parametrize("end", ["nack-delay-then-sigterm", "visibility-then-sigkill"])
async def test_a_message_over_max_deliveries_is_dead_lettered_on_time_after_its_member_went(
    store: Store, start_sidecar: StartSidecar, delivery: str, end: str
) -> None:
    """Its member stopped (its ranges released) or was killed (its ranges lapse) before the
    message's last wait or visibility ended; the sidecar started after it serves an app that
    asks for nothing. The message must still reach the dead-letter queue at its time: shared
    delivery claims ranges only for apps that ask, so a range whose claim says a dead letter
    is due is taken over for it (casque.engine.claims, `wake`)."""
    create(store, delivery, max_deliveries=1, dead_letters=True)
    first = start(start_sidecar)
    if end == "nack-delay-then-sigterm":
        (message_id, due), = (await nack_all(first, 1, DELAY)).items()
        sigterm(first)
    else:
        message, due, _ = await receive_one(first)
        message_id = message.message_id
        sigkill(first)
    second = await asyncio.to_thread(start, start_sidecar)
    dead_letter_id, seen = dead_letter_watch(second, message_id)
    copy = await asyncio.to_thread(wait_for, "the message in the dead-letter queue", dead_letter_id, DELAY + 30)
    assert copy
    early = [(round(due - at, 2), state) for at, state in seen
             if at < due - CLOCK_SLACK and state == "dead_lettered"]
    assert not early, f"before its wait ended (seconds before, state): {early}"


async def test_a_backoff_after_a_visibility_ran_out_holds_though_its_member_died_before_recording_it(
    store: Store, start_sidecar: StartSidecar, delivery: str
) -> None:
    """The member records the backoff when the visibility ends; one paused from before that
    and then killed never does. The next member derives the same wait from the delivery's
    own row (its visibility's end and count, and the retry policy)."""
    create(store, delivery, retry=RetryPolicy(minimum_backoff_seconds=int(DELAY), maximum_backoff_seconds=60))
    first = start(start_sidecar)
    message, visible_from, visible_until = await receive_one(first)
    first.pause()  # from before the visibility ends: its timer cannot record the backoff
    await asyncio.to_thread(wait_for, "the delivery's visibility to end",
                            lambda: time.time() > visible_until + CLOCK_SLACK, VISIBILITY + 30)
    sigkill(first)
    second = await asyncio.to_thread(start, start_sidecar)
    due = {message.message_id: visible_from + DELAY}
    assert_not_early(due, await redeliveries([second], due))


async def member_in_this_process(store: Store) -> Consumer:
    """A started member of a leased subscriber, one message published for it."""
    create(store, "leased")
    publisher = Publisher(store, REF, catalog.read_queue(store, REF))
    await publisher.publish([OutgoingMessage(b"x", key="k0")])
    await publisher.flush_heads()
    consumer = Consumer(store, REF, SUBSCRIBER)
    await consumer.start()
    return consumer


async def test_a_nack_whose_row_is_not_written_answers_unavailable_and_changes_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = await member_in_this_process(store)
    try:
        (delivery,) = await consumer.receive(1, wait=30, visibility=120)
        written = AckLog._write

        async def failing(self: AckLog, events: list[AckEvent]) -> None:
            if any(e.outcome == NACK for e in events):
                raise BackendUnavailable("Cassandra: OperationTimedOut: errors={}, last_host=injected")
            await written(self, events)

        monkeypatch.setattr(AckLog, "_write", failing)
        with pytest.raises(BackendUnavailable):
            await consumer.nack(delivery.receipt, DELAY)
        assert consumer.held_message(delivery.receipt) is not None  # in flight under its receipt, as it was
        monkeypatch.setattr(AckLog, "_write", written)
        sent = time.time()
        await consumer.nack(delivery.receipt, DELAY)  # sent again, as a client does after a 503
        with pytest.raises(StaleReceipt):
            consumer.held_message(delivery.receipt)  # waiting now
        (again,) = await consumer.receive(1, wait=DELAY + 30)
        assert time.time() >= sent + DELAY - CLOCK_SLACK and again.delivery_count == 2
    finally:
        await consumer.stop()


async def test_a_nack_whose_shard_moves_on_while_its_row_is_written_is_answered_lease_lost(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row may land after the next holder loaded the batch, which then does not know of the
    wait: the nack must not be answered as if it held (as an ack is not, casque.engine.acking)."""
    consumer = await member_in_this_process(store)
    try:
        (delivery,) = await consumer.receive(1, wait=30, visibility=120)
        written = AckLog._write
        fence = store.paths(REF).subscriber(SUBSCRIBER).fence(0)

        async def taken_over_meanwhile(self: AckLog, events: list[AckEvent]) -> None:
            if any(e.outcome == NACK for e in events):
                data, stat = store.zk.get(fence)
                store.zk.set(fence, data, version=stat.version)  # what another member's acquisition does
                # ... after this member's lease znode went: it can no longer prove the lease itself.
                monkeypatch.setattr(ShardLeases, "surely_held", lambda *_: False)
            await written(self, events)

        monkeypatch.setattr(AckLog, "_write", taken_over_meanwhile)
        with pytest.raises(LeaseLost):
            await consumer.nack(delivery.receipt, DELAY)
    finally:
        await consumer.stop()
