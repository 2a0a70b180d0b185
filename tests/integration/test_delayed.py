"""Delayed delivery on the real servers: not before its time, and a mover failover that
loses and doubles nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import pytest
from kazoo.client import KazooState

from casque.engine import catalog, delayed, history
from casque.engine.batches import Log
from casque.engine.clock import clock_of
from casque.engine.consumer import Consumer
from casque.engine.counters import DELAYED_IN, DELAYED_OUT, QueueCounters
from casque.engine.delayed import PASS_SECONDS, DelayMover
from casque.engine.idempotency import IdempotencyGuard
from casque.engine.messages import OutgoingMessage, Published
from casque.engine.publisher import Publisher
from casque.engine.sequences import producer_key
from casque.errors import BackendUnavailable, InvalidSpec, MessageNotFound, WriteOutcomeUnknown
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import StartSidecar

QUEUE = QueueRef("default", "later")
# Lateness allowed here: the mover's pass interval plus scheduling slack on a loaded machine.
LATENESS_BOUND = PASS_SECONDS + 4.0


@pytest.fixture
async def running() -> AsyncIterator[list[object]]:
    things: list[object] = []
    yield things
    for thing in things:
        await thing.stop()  # type: ignore[attr-defined]


def mover_for(store: Store, spec: QueueSpec, name: str, offered: Counter[str] | None = None) -> DelayMover:
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def publish(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[object]:
        assert state.incarnation == publisher.state.incarnation
        if offered is not None:
            offered.update(m.payload.decode() for _, m in items)
        return await publisher.publish([m for _, m in items], [i for i, _ in items])

    return DelayMover(store, QUEUE, publish, name)


async def test_delayed_messages_arrive_not_before_their_time(store: Store, running: list[object]) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "waiter", SubscriberSpec(queue="later", start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    with pytest.raises(InvalidSpec, match="retention"):
        await publisher.publish([OutgoingMessage(b"x", deliver_at=datetime.now(timezone.utc) + timedelta(days=2))])
    offered: Counter[str] = Counter()
    mover = mover_for(store, spec, "m1", offered)
    mover.start()
    running.append(mover)
    consumer = Consumer(store, QUEUE, "waiter")
    await consumer.start()
    running.append(consumer)

    # The mover judges due times on Cassandra's clock (casque.engine.clock): arrivals are read
    # on the same one, sampled now so that no later sample moves it by its error in between.
    clock = clock_of(store.session)
    await clock.sample()
    due = {f"d{i}": datetime.now(timezone.utc) + timedelta(seconds=3 + i) for i in range(3)}
    results = await publisher.publish([OutgoingMessage(name.encode(), deliver_at=at) for name, at in due.items()])
    assert all(r.deliver_at is not None and r.batch == -1 for r in results)
    (now_result,) = await publisher.publish([OutgoingMessage(b"now")])
    assert now_result.batch > 0

    from casque.engine.stats import queue_stats

    assert (await queue_stats(store, QUEUE)).delayed == 3
    arrived: dict[str, datetime] = {}
    deadline = time.monotonic() + 60
    while len(arrived) < 4:
        assert time.monotonic() < deadline
        for d in await consumer.receive(max_messages=10, wait=2):
            arrived[d.message.payload.decode()] = clock.now()
            await consumer.ack(d.receipt)
    for name, at in due.items():
        assert arrived[name] >= at, f"{name} arrived early"
        assert (arrived[name] - at).total_seconds() < LATENESS_BOUND
    counts = await mover.delayed.counters.read()
    assert counts == {"delayed_in": 3, "delayed_out": 3}
    # Later passes read none of the moved rows again, and publish none again.
    passes = mover.passes
    deadline = time.monotonic() + 60
    while mover.passes <= passes + 5:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert offered == Counter({name: 1 for name in due})
    assert mover.rows_read == 3


async def test_mover_failover_loses_and_doubles_nothing(
    store: Store, new_store: Callable[[], Store], running: list[object]
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    first_store, second_store = new_store(), new_store()
    first, second = mover_for(first_store, spec, "first"), mover_for(second_store, spec, "second")
    first.start()
    deadline = time.monotonic() + 30
    while not first.leading:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    second.start()
    running.extend([first, second])

    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    start = datetime.now(timezone.utc)
    results = await publisher.publish(
        [OutgoingMessage(f"m{i}".encode(), deliver_at=start + timedelta(seconds=1.5 + i * 0.05)) for i in range(120)]
    )
    # Once the first mover has moved some, its session dies; the second takes over.
    while first.moved == 0:
        assert time.monotonic() < deadline + 30
        await asyncio.sleep(0.02)
    first_store.zk.stop()
    while not second.leading:
        assert time.monotonic() < deadline + 60
        await asyncio.sleep(0.05)

    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    seen: Counter[str] = Counter()
    while sum(seen.values()) < 120:
        assert time.monotonic() < deadline + 120, f"only {sum(seen.values())} of 120 delivered"
        deliveries = await consumer.receive(max_messages=50, wait=2)
        seen.update(d.message.message_id for d in deliveries)
        await consumer.ack_many([d.receipt for d in deliveries])
    assert seen == Counter(r.message_id for r in results)  # the ids given at publish, each once
    assert await consumer.receive(max_messages=10, wait=PASS_SECONDS * 2) == []
    assert second.moved > 0


async def test_a_follower_waits_for_the_election_without_logging_errors(
    store: Store, new_store: Callable[[], Store], running: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    leader, follower = mover_for(new_store(), spec, "leader"), mover_for(new_store(), spec, "follower")
    leader.start()
    running.append(leader)
    deadline = time.monotonic() + 30
    while not leader.leading:
        assert time.monotonic() < deadline, "the first mover was never elected"
        await asyncio.sleep(0.05)
    caplog.set_level(logging.INFO, logger="casque.engine.delayed")
    follower.start()
    running.append(follower)
    # Two whole election waits lost to the leader: the follower keeps contending, quietly.
    while follower.contentions < 2:
        assert time.monotonic() < deadline + 60, "the follower stopped contending"
        await asyncio.sleep(0.1)
    assert not follower.leading
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage() for r in noisy]


async def test_the_queues_default_delay_holds_back_messages_that_name_no_time(
    store: Store, running: list[object]
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE", default_delay_seconds=3)
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "waiter", SubscriberSpec(queue="later", start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    mover = mover_for(store, spec, "m1")
    mover.start()
    running.append(mover)
    consumer = Consumer(store, QUEUE, "waiter")
    await consumer.start()
    running.append(consumer)

    # Due times are on Cassandra's clock (casque.engine.clock): the test reads the same one,
    # sampled now so that no later sample moves it by its error in between.
    clock = clock_of(store.session)
    await clock.sample()
    before = clock.now()
    (held,) = await publisher.publish([OutgoingMessage(b"held")])
    assert held.batch == -1 and held.deliver_at is not None
    assert held.deliver_at >= before + timedelta(seconds=3)
    # A message that names its own time is not delayed further.
    (now,) = await publisher.publish([OutgoingMessage(b"now", deliver_at=datetime.now(timezone.utc))])
    assert now.batch >= 0 and now.deliver_at is None

    arrived: dict[bytes, datetime] = {}
    deadline = time.monotonic() + 60
    while len(arrived) < 2:
        assert time.monotonic() < deadline, f"only {sorted(arrived)} arrived"
        for d in await consumer.receive(max_messages=10, wait=2):
            arrived[d.message.payload] = clock.now()
            await consumer.ack(d.receipt)
    assert arrived[b"held"] >= held.deliver_at, "the default delay was not kept"


async def until_true(what: str, condition: Callable[[], bool], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def until_async(what: str, condition: Callable[[], Awaitable[bool]], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def receive_all(consumer: Consumer, count: int, limit_s: float = 120.0) -> Counter[str]:
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + limit_s
    while sum(seen.values()) < count:
        assert time.monotonic() < deadline, f"only {sum(seen.values())} of {count} delivered"
        deliveries = await consumer.receive(max_messages=100, wait=2)
        seen.update(d.message.message_id for d in deliveries)
        await consumer.ack_many([d.receipt for d in deliveries])
    return seen


async def test_under_steady_load_the_mover_reads_each_due_row_once(store: Store, running: list[object]) -> None:
    """Delayed messages keep arriving while the mover moves them: a pass reads only the rows
    after what it read before, so rows read per row moved stays 1 (it was ~20 with rescans)."""
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    mover = mover_for(store, spec, "m1")
    mover.start()
    running.append(mover)
    await until_true("the mover to lead", lambda: mover.leading)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    results = []
    # 20 rounds of 20 messages, each due 2 s after it is published: the mover's passes meet
    # rows due throughout, never all at once.
    for round_ in range(20):
        due = datetime.now(timezone.utc) + timedelta(seconds=2)
        results += await publisher.publish(
            [OutgoingMessage(f"r{round_}-{i}".encode(), deliver_at=due + timedelta(milliseconds=10 * i))
             for i in range(20)])
        await asyncio.sleep(0.25)
    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    seen = await receive_all(consumer, 400)
    assert seen == Counter(r.message_id for r in results)
    # No pass read a row another had read. (A write slower than its 2 s to spare on a loaded
    # machine makes its writer move the row, which the mover may then not read at all.)
    assert mover.passes > 10
    assert mover.rows_read == mover.offered
    assert mover.offered + publisher.delayed_moves >= 400 and mover.moved >= 400 - publisher.delayed_moves


@pytest.mark.parametrize("late", ["slow write", "due before the mover's cursor"])
async def test_a_row_that_lands_behind_the_mover_is_moved_once_by_its_writer(
    store: Store, running: list[object], monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    """The mover never reads behind what it has read, so a row written after its pass went
    by (a write slower than the time left to its due time, or a publisher whose clock lags
    the mover's) is moved by its writer, which reads the mover's cursor after writing."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    mover = mover_for(store, spec, "m1")
    mover.start()
    running.append(mover)
    await until_true("the mover to lead", lambda: mover.leading)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    cursor_path = store.paths(QUEUE).mover

    def mover_moved() -> datetime:
        cursor = delayed.read_cursor(store.zk.get(cursor_path)[0])
        assert cursor is not None
        return cursor.moved

    insert = delayed.DelayedStore.insert
    if late == "slow write":
        due = datetime.now(timezone.utc) + timedelta(seconds=2)

        async def slow_insert(self: delayed.DelayedStore, *args: object) -> None:
            # The write lands only once the pass that reads rows due at its due time is done
            # (`moved`, not `until`: a pass sets `until` before it reads, and a row landing
            # while it reads is read and moved by the mover itself).
            while not mover_moved() > due:
                await asyncio.sleep(0.05)
            await insert(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(delayed.DelayedStore, "insert", slow_insert)
    else:
        # This publisher's clock lags the mover's by a minute: by its own clock the message
        # is due 5 s from now, by the mover's it is overdue (and the watch has not told it
        # where the mover is yet).
        publisher_now = publisher.clock.now
        monkeypatch.setattr(publisher.clock, "now", lambda: publisher_now() - timedelta(seconds=60))
        due = datetime.now(timezone.utc) - timedelta(seconds=55)
        monkeypatch.setattr(publisher.delayed_route, "is_later", lambda at: True)
    (result,) = await publisher.publish([OutgoingMessage(b"late", deliver_at=due)])
    assert result.batch == -1
    monkeypatch.undo()

    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    # (The mover alone would never deliver it: it does not read behind its marks.)
    assert await receive_all(consumer, 1, limit_s=30) == Counter([result.message_id])
    assert publisher.delayed_moves == 1
    # Whatever the mover reads later (nothing here), the message is stored once.
    passes = mover.passes
    await until_true("two more passes", lambda: mover.passes >= passes + 2)
    assert await consumer.receive(max_messages=10, wait=PASS_SECONDS * 2) == []
    assert (await mover.delayed.counters.read()) == {"delayed_in": 1, "delayed_out": 1}  # type: ignore[union-attr]


async def test_a_writer_that_finds_the_mover_moving_its_row_waits_for_it_instead_of_moving_it_beside_it(
    store: Store, running: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delayed row lands before the mover's pass reads it, and its writer checks the cursor
    only once that pass is moving it: both would move it. Their moves share a client id, but
    two first attempts of one id at once may both publish (casque.engine.idempotency), so
    the writer waits for the pass to be done and its move is then a retry of the mover's,
    answered as a duplicate. Before, it moved the row at once beside the mover."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    moves: list[str] = []
    mover_holds_it, mover_may_go = asyncio.Event(), asyncio.Event()
    mover_publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def publish(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[Published]:
        contested = any(m.payload == b"contested" for _, m in items)
        if contested:
            mover_holds_it.set()
            await mover_may_go.wait()
        results = await mover_publisher.publish([m for _, m in items], [i for i, _ in items])
        if contested:
            moves.append("mover")
        return results

    mover = DelayMover(store, QUEUE, publish, "m1")
    mover.start()
    running.append(mover)
    await until_true("the mover to lead", lambda: mover.leading)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    read_cursor = delayed.CursorReads.read
    reads = 0

    async def late_read(self: delayed.CursorReads) -> delayed.Cursor | None:
        # The writer's check comes once the mover holds the row; from its second read on,
        # the mover may go (a writer that moves at once never reads twice).
        nonlocal reads
        await mover_holds_it.wait()
        reads += 1
        if reads >= 2:
            mover_may_go.set()
        return await read_cursor(self)

    route = publisher.delayed_route
    move_now = route._move_now

    async def writer_moves(message_id: str, message: OutgoingMessage) -> None:
        moves.append("writer")
        mover_may_go.set()
        await move_now(message_id, message)

    monkeypatch.setattr(delayed.CursorReads, "read", late_read)
    monkeypatch.setattr(route, "_move_now", writer_moves)
    due = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    (result,) = await publisher.publish([OutgoingMessage(b"contested", deliver_at=due)])
    monkeypatch.undo()
    assert moves == ["mover", "writer"], "the writer moved the row while the mover was moving it"
    # One message moved, counted once: the writer's move was a duplicate of the mover's.
    assert (mover.moved, publisher.delayed_moves) == (1, 0)
    assert (await mover.delayed.counters.read())[DELAYED_OUT] == 1  # type: ignore[union-attr]

    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    assert await receive_all(consumer, 1, limit_s=30) == Counter([result.message_id])
    passes = mover.passes
    await until_true("two more passes", lambda: mover.passes >= passes + 2)
    assert await consumer.receive(max_messages=10, wait=PASS_SECONDS * 2) == []


async def test_a_pass_whose_leadership_ends_while_it_moves_still_counts_what_it_moved(
    store: Store, running: list[object]
) -> None:
    """The mover's ZooKeeper connection is suspended while a pass publishes its due row: it
    stops leading at once, but the publish goes on in the shard writer and lands. Re-elected,
    the mover reads the row again and finds it published. Before, the pass was cancelled
    before counting the row out and the next one counted no duplicate, so the queue's delayed
    count stayed at 1 for good (a machine under load suspends sessions now and then)."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    mover_publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    listeners_before = set(store.zk.state_listeners)
    mover: DelayMover | None = None
    suspended = False

    async def publish(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[Published]:
        nonlocal suspended
        results = await mover_publisher.publish([m for _, m in items], [i for i, _ in items])
        if not suspended:
            suspended = True
            for listener in set(store.zk.state_listeners) - listeners_before:
                listener(KazooState.SUSPENDED)  # the mover's own listener: what kazoo calls
            await until_true("the mover to stop leading", lambda: mover is not None and not mover.leading)
        return results

    mover = DelayMover(store, QUEUE, publish, "suspended")
    mover.start()
    running.append(mover)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    due = datetime.now(timezone.utc) + timedelta(seconds=2)  # ahead of the mover: its row, not its writer
    (result,) = await publisher.publish([OutgoingMessage(b"moved", deliver_at=due)])
    await until_true("the suspension", lambda: suspended)
    passes = mover.passes
    await until_true("two passes after the mover leads again", lambda: mover.passes >= passes + 2)
    counts = await QueueCounters(store, catalog.read_queue(store, QUEUE).shared_key(QUEUE)).read()
    assert (counts.get(DELAYED_IN), counts.get(DELAYED_OUT)) == (1, 1)
    assert mover.moved == 1
    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    assert await receive_all(consumer, 1, limit_s=30) == Counter([result.message_id])


@pytest.mark.parametrize("hung", [1, 4], ids=["checked-again", "answered-503-then-retried"])
async def test_a_delayed_publish_answered_after_its_cursor_check_timed_out_survives_a_kill(
    store: Store, start_sidecar: StartSidecar, hung: int
) -> None:
    """A sidecar writes a delayed row that lands behind the mover (its clock lags the
    mover's), and its fresh reads of the mover's cursor get no answer from ZooKeeper. The
    publish is answered only once the row is certain to move: with one read lost, the check
    is tried again and the writer moves the row; with four, the publish is answered 503,
    and the app client's retry (same id) stores the row again, checks it and moves it. The
    sidecar is then killed with -9, and the message reaches a subscriber of a fresh sidecar,
    once. Before, the publish was answered when the read timed out, the check went on in
    the background and died with the process, and the row stayed behind the mover's marks
    for good: an acknowledged message never delivered."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    silent = start_sidecar("--queue", QUEUE.name, module="tests.integration.silent_cursor_sidecar",
                           env={"CASQUE_TEST_HUNG_MOVER_SYNCS": str(hung)})
    due = datetime.now(timezone.utc) - timedelta(seconds=30)

    def mover_passed_due() -> bool:
        data = store.zk.exists(store.paths(QUEUE).mover) and store.zk.get(store.paths(QUEUE).mover)[0]
        cursor = delayed.read_cursor(data or None)
        return cursor is not None and cursor.moved > due

    await until_true("the mover to pass the due time", mover_passed_due)
    async with AsyncClient(silent.url, queue=QUEUE.name) as app:
        published = await app.publish("late", deliver_at=due, id="late-1")
    assert published.batch is None or published.batch < 0  # stored as a delayed row, not in the log
    async with aiohttp.ClientSession() as http, http.get(f"{silent.url}/metrics") as answer:
        metrics = await answer.text()
    silent.kill()
    assert "not checked against the mover's cursor" in silent.tail(20000), "the cursor check did not time out"

    fresh = start_sidecar("--queue", QUEUE.name, "--subscriber", "all")
    seen: list[str] = []
    deadline = time.monotonic() + 60
    async with AsyncClient(fresh.url, queue=QUEUE.name, subscriber="all") as app:
        while published.message_id not in seen:
            assert time.monotonic() < deadline, "the acknowledged delayed message was never delivered"
            for message in await app.receive(max=10, wait=2):
                seen.append(message.message_id)
                await app.ack(message.receipt)
    assert seen == [published.message_id]
    # With four reads lost the first attempt gave up (503) and the client's retry was answered.
    answered_503 = 'casque_sidecar_requests_total{operation="publish",status="503"}' in metrics
    assert answered_503 == (hung > 1) and published.duplicate == (hung > 1)


# The writes a delayed publish with an id makes before it is answered, each failed once in
# a way that leaves the client unsure: the first attempt is answered 503 and retried.
DELAYED_FAULTS = ["id record applied, answer lost", "row applied, answer lost", "count failed"]


def fail_once(monkeypatch: pytest.MonkeyPatch, fault: str, first_ids: list[str]) -> None:
    """Make the first delayed publish fail at `fault`, noting its message id in `first_ids`."""
    if fault == "id record applied, answer lost":
        record = IdempotencyGuard.record_positions

        async def record_unanswered(self: IdempotencyGuard, published: list[tuple[OutgoingMessage, Published]]) -> None:
            await record(self, published)
            if not first_ids:
                first_ids.extend(result.message_id for _, result in published)
                raise WriteOutcomeUnknown("write timed out (it was applied)")

        monkeypatch.setattr(IdempotencyGuard, "record_positions", record_unanswered)
        return
    insert = delayed.DelayedStore.insert

    async def noted_insert(self: delayed.DelayedStore, message_id: str, *args: Any, **kwargs: Any) -> None:
        first = not first_ids
        if first:
            first_ids.append(message_id)
        if fault == "row applied, answer lost":
            await insert(self, message_id, *args, **kwargs)
            if first:
                raise WriteOutcomeUnknown("write timed out (it was applied)")
            return
        await insert(self, message_id, *args, **kwargs)

    add = QueueCounters.add

    async def count_failing(self: QueueCounters, name: str, amount: int) -> None:
        if name == DELAYED_IN and len(first_ids) == 1 and not failed:
            failed.append(name)
            raise BackendUnavailable("counter write timed out")
        await add(self, name, amount)

    failed: list[str] = []
    monkeypatch.setattr(delayed.DelayedStore, "insert", noted_insert)
    if fault == "count failed":
        monkeypatch.setattr(QueueCounters, "add", count_failing)


@pytest.mark.parametrize("fault", DELAYED_FAULTS)
@pytest.mark.parametrize("keyed", ["client id", "producer key"])
async def test_a_delayed_publish_with_an_id_that_failed_midway_is_stored_and_moved_once(
    store: Store, running: list[object], monkeypatch: pytest.MonkeyPatch, fault: str, keyed: str
) -> None:
    """A delayed publish with an id whose write is applied but answered with a timeout (or
    whose count fails after its row was stored) is answered 503; the client's retry, with a
    delay again (so a due time of its own), finds the first attempt's message id: the row is
    stored once, moved into the log once, and the retry is answered as a duplicate of the
    first publish. Before, the retry found no record, drew a new message id and stored a
    second row, and the mover published both."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "all", SubscriberSpec(queue="later", start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    client_id = "order-7" if keyed == "client id" else producer_key("producer-order", 7)
    message = OutgoingMessage(b"once", client_id=client_id, delay_seconds=5)
    first_ids: list[str] = []
    fail_once(monkeypatch, fault, first_ids)
    with pytest.raises(BackendUnavailable):
        await publisher.publish([message])
    (retry,) = await publisher.publish([message])
    monkeypatch.undo()
    assert retry.duplicate and [retry.message_id] == first_ids
    rows = store.session.execute(f"SELECT message_id, due_at FROM {store.keyspace}.delayed").all()
    assert [row.message_id for row in rows] == first_ids, "the delayed row is not stored once"
    # The duplicate says when the message is due: when its one row is.
    assert retry.batch == -1 and retry.deliver_at == rows[0].due_at.replace(tzinfo=timezone.utc)

    mover = mover_for(store, spec, "m1")
    mover.start()
    running.append(mover)
    consumer = Consumer(store, QUEUE, "all")
    await consumer.start()
    running.append(consumer)
    assert await receive_all(consumer, 1, limit_s=60) == Counter(first_ids)
    # Whatever the mover reads later, nothing more reaches the log.
    await until_true("the mover to pass the due time", lambda: mover.moved + publisher.delayed_moves >= 1)
    passes = mover.passes
    await until_true("two more passes", lambda: mover.passes >= passes + 2)
    assert await consumer.receive(max_messages=10, wait=PASS_SECONDS * 2) == []
    (again,) = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([message])
    assert again.duplicate and again.message_id == retry.message_id  # through another sidecar too


async def test_the_history_of_a_message_the_mover_moved_later_than_the_search_window_says_where_it_is(
    store: Store, running: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mover was down when the message was due, for longer than message history's search
    past a message's due time (SEARCH_AFTER, 90 s; 1 s here to keep the test short). The
    history must find it in the log through its move's record, not call it delayed or lost."""
    monkeypatch.setattr(history, "SEARCH_AFTER", timedelta(seconds=1))
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    due = datetime.now(timezone.utc) + timedelta(seconds=delayed.IMMEDIATE_SECONDS + 2)
    (published,) = await publisher.publish([OutgoingMessage(b"late", deliver_at=due)])
    assert published.batch == -1  # waiting in the delayed table
    # No mover runs until the message is overdue by more than the search allows for.
    clock = clock_of(store.session)
    await until_true("the message overdue past the search", lambda: clock.now() > due + timedelta(seconds=3))
    mover_publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def publish(state: QueueState, items: list[tuple[str, OutgoingMessage]]) -> list[object]:
        return await mover_publisher.publish([m for _, m in items], [i for i, _ in items])

    mover = DelayMover(store, QUEUE, publish, "late-mover")
    mover.start()
    running.append(mover)

    async def logged() -> bool:
        try:
            return (await history.message_history(store, QUEUE, published.message_id)).state == "logged"
        except MessageNotFound:
            return False

    await until_async("the moved message found in the log", logged)
    found = await history.message_history(store, QUEUE, published.message_id)
    assert found.position is not None and found.position.batch >= 1
    header = await Log(store, QUEUE, "ONE").read_header(found.position.shard, found.position.batch)
    assert header is not None and header.published_at is not None
    assert header.published_at > due + timedelta(seconds=1)  # written past the (shortened) search
    await mover_publisher.flush_heads()  # nothing left to write once the test's keyspace goes
