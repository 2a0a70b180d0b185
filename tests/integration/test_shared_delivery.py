"""Shared delivery (`delivery: shared`), engine-level, on a real Cassandra and ZooKeeper.

More members than shards all receive; ranges are claimed, never delivered by two members at
once; a member that vanishes without releasing has its range taken over after the claim's
time; a member that lost its range can neither complete it nor have an ack answered; the
offset moves over the completed prefix only; a seek replays in a new epoch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest

from casque.engine import catalog, claim_turns, claims, completion, heads
from casque.engine.claim_reader import ClaimReader
from casque.engine.consumer import Consumer
from casque.engine.foreign_ranges import ForeignRanges
from casque.engine.keylocks import key_hash
from casque.engine.leases import assign
from casque.engine.member import Member
from casque.engine.messages import Delivery, OutgoingMessage, Published
from casque.engine.offsets import SeekTarget, seek
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable, CasqueError, LeaseLost, StaleReceipt
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque.znodes import SubscriberPaths, decode_offset
from tests.fixtures.positions import heads_of, offsets_of
from tests.fixtures.stack import expire_session

QUEUE = QueueRef("default", "shared")
SUBSCRIBER = "pool"


async def until(what: str, condition: Callable[[], bool], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def setup(store: Store, shards: int, visibility: int = 30) -> QueueSpec:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=visibility, delivery="shared"))
    return spec


def setup_ordered(store: Store) -> None:
    """One shard, and the subscriber shared with ordered keys."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=30, delivery="shared",
        ordered_keys=True))


async def received_by(consumer: Consumer, count: int, who: str) -> dict[str, Delivery]:
    """At least `count` deliveries to `consumer`, by message id (none of them acked)."""
    held: dict[str, Delivery] = {}
    deadline = time.monotonic() + 60
    while len(held) < count:
        assert time.monotonic() < deadline, f"{who} received only {sorted(held)}"
        held.update({d.message.message_id: d for d in await consumer.receive(max_messages=10, wait=1)})
    return held


async def publish(store: Store, count: int, prefix: str, per_call: int = 10) -> set[str]:
    """`count` messages, `per_call` to a publish call (a batch each on a one-shard queue)."""
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    ids: set[str] = set()
    for start in range(0, count, per_call):
        results = await publisher.publish([OutgoingMessage(f"{prefix}-{i}".encode(), key=f"k{i % 7}")
                                           for i in range(start, min(count, start + per_call))])
        ids |= {r.message_id for r in results}
    await publisher.flush_heads()
    return ids


async def start(consumers: list[Consumer], store: Store) -> Consumer:
    consumer = Consumer(store, QUEUE, SUBSCRIBER)
    consumers.append(consumer)
    await consumer.start()
    return consumer


def open_claims(store: Store, shards: list[int]) -> list[str]:
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    found = []
    for shard in shards:
        if store.zk.exists(paths.claims(shard)):
            found.extend(f"{shard}/{n}" for n in store.zk.get_children(paths.claims(shard)))
    return found


async def rewrite_the_claim(store: Store, until_ms: int | None = None) -> None:
    """Rewrite shard 0's one claim as another writer would: a new version, and the time given
    (else the claim's own), so its holder's next renewal fails."""
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    (name,) = store.zk.get_children(paths.claims(0))
    record = await claims.read_claim(store.zk, paths, 0, name)
    assert record is not None
    until = record.until_ms if until_ms is None else until_ms
    assert await claims.rewrite(store.zk, paths, record, record.member, until) is not None


async def work(consumer: Consumer, received: dict[str, list[Consumer]], stop: asyncio.Event,
               acked: set[str]) -> None:
    """Receive and ack as an app would, recording who got what."""
    while not stop.is_set():
        got = await consumer.receive(max_messages=20, wait=0.5)
        for d in got:
            received.setdefault(d.message.message_id, []).append(consumer)
        if got:
            results = await consumer.ack_many([d.receipt for d in got])
            for d, result in zip(got, results):
                if result is True:
                    acked.add(d.message.message_id)
                elif result is not False:
                    assert isinstance(result, CasqueError), result


async def test_more_members_than_shards_all_receive_and_each_message_is_acked_once(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = setup(store, shards=1)
    group = [await start(consumers, store) for _ in range(4)]
    published = await publish(store, 2000, "m", per_call=100)
    received: dict[str, list[Consumer]] = {}
    acked: set[str] = set()
    stop = asyncio.Event()
    workers = [asyncio.create_task(work(c, received, stop, acked)) for c in group]
    await until("every message acked", lambda: published <= acked)
    stop.set()
    await asyncio.gather(*workers)
    assert set(received) == published
    doubles = {m: len(cs) for m, cs in received.items() if len(cs) > 1}
    assert not doubles, f"delivered twice while nothing failed: {list(doubles.items())[:3]}"
    assert all(any(c in cs for cs in received.values()) for c in group), "a member of the pool received nothing"
    shards = spec.log_shards()
    await until("the offset past every batch",
                lambda: offsets_of(store, QUEUE, SUBSCRIBER, shards) == {s: h + 1 for s, h in heads_of(store, QUEUE, shards).items()})
    assert open_claims(store, shards) == []
    writes = sum(c._sharing.zk_writes for c in group if c._sharing is not None)
    assert writes <= 2 * 2000 // 100 + 10 * len(group), f"{writes} ZooKeeper writes for 20 batches"


async def test_a_vanished_members_range_is_taken_over_after_its_claim_and_its_acks_are_refused(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = setup(store, shards=1, visibility=2)
    first = await start(consumers, store)
    published = await publish(store, 30, "m", per_call=30)
    held = await first.receive(max_messages=30, wait=10)
    assert len(held) == 30
    # The first member stops renewing, as a paused or dead one would: its claim lapses.
    assert first._sharing is not None
    first._sharing._stopped = True
    for task in first._sharing._tasks:
        task.cancel()
    second = await start(consumers, store)
    redelivered: list[Delivery] = []
    deadline = time.monotonic() + 60
    while {d.message.message_id for d in redelivered} != published:
        assert time.monotonic() < deadline, "the lapsed range was not taken over"
        redelivered.extend(await second.receive(max_messages=30, wait=1))
    assert all(d.delivery_count == 2 for d in redelivered), "the delivery count did not survive the takeover"
    # The first member's acks come after the takeover: refused, never answered as done.
    results = await first.ack_many([d.receipt for d in held])
    assert not any(r is True for r in results), results
    assert all(isinstance(r, (LeaseLost, StaleReceipt)) for r in results), results
    assert all(r is True for r in await second.ack_many([d.receipt for d in redelivered]))
    shards = spec.log_shards()
    await until("the offset past the range", lambda: offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] == heads_of(store, QUEUE, shards)[0] + 1)


async def test_a_member_that_lost_its_range_early_can_neither_ack_nor_complete_it(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = setup(store, shards=1, visibility=30)
    first = await start(consumers, store)
    published = await publish(store, 30, "m", per_call=30)
    held = await first.receive(max_messages=30, wait=10)
    assert len(held) == 30
    # A member whose clock runs ahead sees the claim as lapsed long before its holder does:
    # here the claim's time is set to the past, and a second member takes the range over
    # while the first member's deliveries are still in flight by its own clock.
    await rewrite_the_claim(store, until_ms=0)
    second = await start(consumers, store)
    redelivered: list[Delivery] = []
    deadline = time.monotonic() + 60
    while {d.message.message_id for d in redelivered} != published:
        assert time.monotonic() < deadline, "the range was not taken over"
        redelivered.extend(await second.receive(max_messages=30, wait=1))
    # Part of the range (ack rows, then the claim's version checked) and then the rest (the
    # range's completion, a multi that checks the claim's version): both refused.
    partly = await first.ack_many([d.receipt for d in held[:10]])
    assert all(isinstance(r, (LeaseLost, StaleReceipt)) for r in partly), partly
    rest = await first.ack_many([d.receipt for d in held[10:]])
    assert all(isinstance(r, (LeaseLost, StaleReceipt)) for r in rest), rest
    assert all(r is True for r in await second.ack_many([d.receipt for d in redelivered]))
    shards = spec.log_shards()
    await until("the offset past the range", lambda: offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] == heads_of(store, QUEUE, shards)[0] + 1)


async def test_an_ack_retried_after_its_range_went_says_an_earlier_try_may_have_counted(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ack's row is written, then the check of the claim fails (ZooKeeper lost the
    connection): a 503, and the app sends the ack again. Meanwhile the member lost the range
    (its session ended). Whoever reads the range's ack rows next finds the row, and the message
    is never delivered again: the ack counted. The retry must not say `stale_receipt`, which
    tells the app the ack certainly did nothing, but `lease_lost`: it may have been recorded.
    Before, it said `stale_receipt`, and an app waiting for the message to come back waited
    for good."""
    spec = setup(store, shards=1)
    first = await start(consumers, store)
    await publish(store, 1, "m")
    (held,) = await first.receive(max_messages=1, wait=10)

    real_check = ClaimReader.still_leased
    lost: list[ClaimReader] = []

    async def connection_lost(reader: ClaimReader) -> bool:
        if not lost:
            lost.append(reader)
            raise BackendUnavailable("ZooKeeper: ConnectionLoss")
        return await real_check(reader)
    monkeypatch.setattr(ClaimReader, "still_leased", connection_lost)
    (answer,) = await first.ack_many([held.receipt])
    assert isinstance(answer, BackendUnavailable), answer
    await lost[0].release()  # as a member whose session ended gives its ranges up

    (retried,) = await first.ack_many([held.receipt])
    assert isinstance(retried, LeaseLost) and retried.code == "lease_lost", retried

    second = await start(consumers, store)
    shards = spec.log_shards()

    async def past_the_range() -> bool:
        assert await second.receive(max_messages=1, wait=0.2) == [], "the acked message came again"
        return offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] == heads_of(store, QUEUE, shards)[0] + 1
    deadline = time.monotonic() + 60
    while not await past_the_range():
        assert time.monotonic() < deadline, "the range was not taken over and completed"


async def test_deliveries_whose_claim_cannot_be_extended_are_handed_back_uncounted(
    store: Store, consumers: list[Consumer]
) -> None:
    setup(store, shards=1, visibility=30)
    member = await start(consumers, store)
    await publish(store, 30, "m", per_call=30)
    held = await member.receive(max_messages=10, wait=10)
    assert len(held) == 10
    # Another writer moves the claim's version (as a takeover does), so the member's next
    # renewal fails and it drops the range: the deliveries that needed the renewal reached
    # nobody, and are not counted as delivered.
    await rewrite_the_claim(store)
    assert await member.receive(max_messages=20, visibility=600) == []
    assert member.report()["delivered"] == 10


async def test_the_offset_waits_for_the_lowest_open_range(store: Store, consumers: list[Consumer]) -> None:
    spec = setup(store, shards=1)
    slow, fast = await start(consumers, store), await start(consumers, store)
    await publish(store, 600, "m", per_call=100)
    low = await slow.receive(max_messages=10, wait=10)  # claims the first range
    assert low and low[0].message.position.batch == 1
    later: list[Delivery] = []
    while len(later) < 300:
        got = await fast.receive(max_messages=50, wait=2)
        assert got, "the second member found nothing beyond the first member's range"
        later.extend(got)
        assert all(r is True for r in await fast.ack_many([d.receipt for d in got]))
    shards = spec.log_shards()
    assert offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] == 1, "the offset passed a range with unacked messages"
    rest = low + [d for d in await slow.receive(max_messages=500, wait=2)]
    assert all(r is True for r in await slow.ack_many([d.receipt for d in rest]))
    await until("the offset past the completed prefix", lambda: offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] > 3)


async def test_a_seek_replays_through_the_pool_in_a_new_epoch(store: Store, consumers: list[Consumer]) -> None:
    spec = setup(store, shards=2)
    group = [await start(consumers, store) for _ in range(3)]
    published = await publish(store, 400, "m", per_call=40)
    received: dict[str, list[Consumer]] = {}
    acked: set[str] = set()
    stop = asyncio.Event()
    workers = [asyncio.create_task(work(c, received, stop, acked)) for c in group]
    await until("every message acked", lambda: published <= acked)
    await asyncio.to_thread(seek, store, QUEUE, SUBSCRIBER, SeekTarget("earliest"))
    received.clear()
    acked.clear()
    await until("every message acked again after the seek", lambda: published <= acked)
    stop.set()
    await asyncio.gather(*workers)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    cursors = [await claims.read_cursor(store.zk, paths, s) for s in spec.log_shards()]
    assert all(c is not None and c.epoch == 1 for c in cursors), cursors


async def test_ordered_keys_deliver_the_next_message_of_a_key_only_after_the_previous_is_acked(
    store: Store, consumers: list[Consumer]
) -> None:
    setup_ordered(store)
    group = [await start(consumers, store) for _ in range(3)]
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    order: dict[str, list[str]] = {}
    for start_at in range(0, 300, 30):  # ten batches, four keys spread over all of them
        results = await publisher.publish([OutgoingMessage(f"m{i}".encode(), key=f"k{i % 4}")
                                           for i in range(start_at, start_at + 30)])
        for r, i in zip(results, range(start_at, start_at + 30)):
            order.setdefault(f"k{i % 4}", []).append(r.message_id)
    await publisher.flush_heads()
    published = {m for ids in order.values() for m in ids}
    # Per message: when its first delivery was answered, and when its ack was sent.
    delivered_at: dict[str, float] = {}
    ack_sent_at: dict[str, float] = {}
    receivers: dict[str, str] = {}
    stop = asyncio.Event()

    async def ordered_worker(consumer: Consumer) -> None:
        while not stop.is_set():
            got = await consumer.receive(max_messages=10, wait=0.5)
            answered = time.monotonic()
            for d in got:
                delivered_at.setdefault(d.message.message_id, answered)
                receivers[d.message.message_id] = consumer.member_id
            await asyncio.sleep(0.01)  # the app's work
            if got:
                ack_sent = time.monotonic()
                for d, result in zip(got, await consumer.ack_many([d.receipt for d in got])):
                    if result is True:
                        ack_sent_at[d.message.message_id] = ack_sent

    # One member works alone first: with four keys everything it holds waits behind its own
    # messages, and it used to claim range after range for them until it held the whole
    # backlog and the others, asking later, had nothing to claim.
    workers = [asyncio.create_task(ordered_worker(group[0]))]
    await until("the first member to have acked some", lambda: len(ack_sent_at) >= 8)
    workers += [asyncio.create_task(ordered_worker(c)) for c in group[1:]]
    await until("every message acked", lambda: published <= set(ack_sent_at), limit_s=120)
    stop.set()
    await asyncio.gather(*workers)
    for key, ids in order.items():
        for earlier, later in zip(ids, ids[1:]):
            assert delivered_at[later] > ack_sent_at[earlier], (
                f"{key}: {later} was delivered before {earlier} was acked")
    assert len(set(receivers.values())) > 1, "one member received everything: nothing was shared"


async def test_a_key_finished_in_another_members_open_range_moves_on_before_that_range_completes(
    store: Store, consumers: list[Consumer]
) -> None:
    """Member A holds a range with x1 (acked) and y1 (in flight, never acked until the end); B
    claims the next range, with x2 and y2. x2 goes out while A's range is still open and A's
    (its claim publishes that x finished there); y2 waits until A acks y1. Before, x2 waited
    for A's whole range: until A's claim lapsed and B took it over, redelivering y1."""
    setup_ordered(store)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    x1, y1 = await publisher.publish([OutgoingMessage(b"x1", key="x"), OutgoingMessage(b"y1", key="y")])
    await publisher.flush_heads()
    a = await start(consumers, store)
    held = await received_by(a, 2, "A")
    assert set(held) == {x1.message_id, y1.message_id}
    assert a._sharing is not None
    a._sharing.last_demand = float("-inf")  # A's app stops asking: A claims nothing more
    assert await a.ack(held[x1.message_id].receipt) is True

    x2, y2 = await publisher.publish([OutgoingMessage(b"x2", key="x"), OutgoingMessage(b"y2", key="y")])
    await publisher.flush_heads()
    b = await start(consumers, store)
    got: dict[str, Delivery] = {}
    deadline = time.monotonic() + 60
    while x2.message_id not in got:
        assert time.monotonic() < deadline, f"B received only {sorted(got)}"
        got.update({d.message.message_id: d for d in await b.receive(max_messages=10, wait=1)})
    assert y1.message_id not in got, "A's range was taken over: x2 waited for it to lapse"
    assert y2.message_id not in got, "y2 went out while y1 was in flight at A"
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    records = [await claims.read_claim(store.zk, paths, 0, name) for name in await claims.list_claims(store.zk, paths, 0)]
    assert [r.member for r in records if r is not None and r.start == x1.batch] == [a.member_id]

    assert await a.ack(held[y1.message_id].receipt) is True  # still A's: it never lapsed
    deadline = time.monotonic() + 60
    while y2.message_id not in got:
        assert time.monotonic() < deadline, f"B received only {sorted(got)}"
        got.update({d.message.message_id: d for d in await b.receive(max_messages=10, wait=1)})
    assert await b.ack_many([d.receipt for d in got.values()]) == [True, True]


class RangeWatcher:
    """What ForeignRanges asks of its member, and nothing else: here nothing evaluates a
    key's hold while a range is read (a member's receives would, and read it again)."""

    def __init__(self, store: Store, paths: SubscriberPaths) -> None:
        self.store, self.paths = store, paths
        self.tasks: list[asyncio.Future[object]] = []

    def notify(self) -> None:
        pass

    def in_background(self, work: Coroutine[Any, Any, object]) -> None:
        self.tasks.append(asyncio.ensure_future(work))


async def a_holds_one_of_each(store: Store, consumers: list[Consumer], keys: str
                              ) -> tuple[Consumer, list[Published], dict[str, Delivery], str, int]:
    """Member A holds in flight one message of each key (`{key}1`) in its one range of shard 0:
    A, the messages, A's deliveries by id, the range's name and its epoch."""
    setup_ordered(store)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    published = await publisher.publish([OutgoingMessage(f"{k}1".encode(), key=k) for k in keys])
    await publisher.flush_heads()
    a = await start(consumers, store)
    held = await received_by(a, len(keys), "A")
    (name,) = await claims.list_claims(store.zk, store.paths(QUEUE).subscriber(SUBSCRIBER), 0)
    return a, published, held, name, int(name.partition("-")[0])


def range_reader(store: Store, epoch: int) -> tuple[RangeWatcher, ForeignRanges]:
    """Another member's view of A's ranges, its member duties stood in (RangeWatcher)."""
    watcher = RangeWatcher(store, store.paths(QUEUE).subscriber(SUBSCRIBER))
    return watcher, ForeignRanges(cast(Member, watcher), lambda shard: set(), lambda shard: epoch, lambda: True)


async def test_a_range_whose_keys_change_while_another_member_first_reads_it_is_read_again(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member A holds a range with y1 and z1 in flight. Another member reads A's range (its
    open keys, y and z) with a watch, and A acks y1 just then: A rewrites the range's keys to
    z alone, and the watch fires before the reader has stored what it read. The reader must
    read the range again. Before, it dropped that change (it knew nothing of the range yet)
    and kept y open there until A's whole range completed: a test node's autoscaled group
    held a key's next message for good."""
    a, (x1, y1, z1), held, name, epoch = await a_holds_one_of_each(store, consumers, "xyz")

    read_claim = claims.read_claim
    changed_while_read = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def read_while_y_finishes(client: Any, claim_paths: SubscriberPaths, shard: int, claim: str,
                                    watch: Callable[..., object] | None = None) -> claims.ClaimRecord | None:
        if watch is None or changed_while_read.is_set():
            return await read_claim(client, claim_paths, shard, claim, watch)

        def fired(event: object) -> None:  # kazoo's thread: the reader's handler is queued before ours
            watch(event)
            loop.call_soon_threadsafe(changed_while_read.set)

        record = await read_claim(client, claim_paths, shard, claim, fired)
        assert await a.ack(held[y1.message_id].receipt) is True
        await asyncio.wait_for(changed_while_read.wait(), 60)
        return record  # what the reader read: y and z open

    monkeypatch.setattr(claims, "read_claim", read_while_y_finishes)
    watcher, foreign = range_reader(store, epoch)
    await foreign.see(0)
    await asyncio.gather(*watcher.tasks)  # the first read, and nothing that asks for a hold meanwhile
    assert changed_while_read.is_set()
    x_and_z = frozenset({key_hash("x"), key_hash("z")})  # y finished at A during the read
    deadline = time.monotonic() + 30
    while (record := foreign._known.get((0, name))) is None or record.keys != x_and_z:
        assert time.monotonic() < deadline, (
            f"A's range is known with {None if record is None else len(record.keys)} open keys, not x and z")
        await asyncio.sleep(0.05)
    await asyncio.gather(*watcher.tasks)
    assert await a.ack(held[z1.message_id].receipt) is True
    assert await a.ack(held[x1.message_id].receipt) is True


async def test_a_known_range_whose_read_after_a_change_fails_is_read_again(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member knows A's range with x and y open. A acks x1, the range's keys change,
    and the reader's read of the change fails (ZooKeeper answered too late). The watch that
    fired is spent and the failed read set none, so the reader must read the range again when
    next asked, and hold keyed messages above it back until then. Before, it kept x open there
    for as long as the range lasted: nothing would ever have told it otherwise."""
    a, (x1, y1), held, name, epoch = await a_holds_one_of_each(store, consumers, "xy")
    watcher, foreign = range_reader(store, epoch)
    await foreign.see(0)
    await asyncio.gather(*watcher.tasks)
    both, only_y = frozenset({key_hash("x"), key_hash("y")}), frozenset({key_hash("y")})
    assert foreign._foreign_keys(0, 1 << 62) == [both]

    read_claim = claims.read_claim
    failed: list[str] = []

    async def failing_once(client: Any, claim_paths: SubscriberPaths, shard: int, claim: str,
                           watch: Callable[..., object] | None = None) -> claims.ClaimRecord | None:
        if not failed:
            failed.append(claim)
            raise BackendUnavailable("reading a claim: ZooKeeper did not answer in time")
        return await read_claim(client, claim_paths, shard, claim, watch)

    monkeypatch.setattr(claims, "read_claim", failing_once)
    assert await a.ack(held[x1.message_id].receipt) is True
    await until("the change's read tried and failed", lambda: bool(failed))
    await asyncio.gather(*watcher.tasks)
    deadline = time.monotonic() + 30
    while (found := foreign._foreign_keys(0, 1 << 62)) != [only_y]:  # as each receive asks
        assert time.monotonic() < deadline, f"A's range is still known as {found}, not with y alone open"
        await asyncio.sleep(0.05)
    await asyncio.gather(*watcher.tasks)
    assert await a.ack(held[y1.message_id].receipt) is True


async def test_a_range_that_completes_while_another_member_lists_the_ranges_is_forgotten(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member A holds a range with x1 in flight. Another member, which follows the shard's
    ranges with a watch, lists them before its own first delivery, and A acks x1 just then: the
    range completes and goes, and the watch's event reaches the reader before the listing's
    answer, which still names the range. The reader must forget the range once it finds it gone.
    Before, the stale listing overwrote what the watch had said, the range could never be read,
    and every keyed message above it waited until some other range came or went."""
    a, (x1,), held, name, epoch = await a_holds_one_of_each(store, consumers, "x")
    watcher, foreign = range_reader(store, epoch)
    foreign.watch(0)
    list_claims = claims.list_claims
    armed = [False]  # A lists ranges too: only the reader's listing, the first once armed, is delayed

    async def list_while_x_finishes(client: Any, claim_paths: SubscriberPaths, shard: int) -> list[str]:
        if not armed[0]:
            return await list_claims(client, claim_paths, shard)
        armed[0] = False
        listed = await list_claims(client, claim_paths, shard)
        assert await a.ack(held[x1.message_id].receipt) is True
        deadline = time.monotonic() + 30
        while (names := foreign._names.get(0)) is None or name in names:
            assert time.monotonic() < deadline, "the watch never saw A's range go"
            await asyncio.sleep(0.05)
        return listed  # what the reader listed: A's range, gone by now

    monkeypatch.setattr(claims, "list_claims", list_while_x_finishes)
    armed[0] = True
    await foreign.see(0)  # its listing is the first call: see() lists before it first awaits
    deadline = time.monotonic() + 30
    while foreign._foreign_keys(0, 1 << 62) is None:
        assert time.monotonic() < deadline, (
            f"ranges {sorted(foreign._names.get(0) or ())} still wait to be read; A's is gone")
        await asyncio.sleep(0.05)
    await asyncio.gather(*watcher.tasks)


async def test_a_known_range_is_read_again_after_the_readers_session_expired(
    store: Store, consumers: list[Consumer], new_store: Callable[..., Store], zk_hosts: str
) -> None:
    """Another member, with a ZooKeeper session of its own, follows the shard's ranges and
    knows A's with x and y open. Its session expires (a pause past its timeout): every watch
    it set ends, with an event that says neither "changed" nor "deleted". A then acks x1 and
    rewrites its range's keys. The reader must read the range again. Before, it kept the
    record with no watch left to say it changed: x open there for as long as the range lasted."""
    a, (x1, y1), held, name, epoch = await a_holds_one_of_each(store, consumers, "xy")
    reader = new_store(10.0)
    watcher, foreign = range_reader(reader, epoch)
    foreign.watch(0)
    await foreign.see(0)
    await asyncio.gather(*watcher.tasks)
    both, only_y = frozenset({key_hash("x"), key_hash("y")}), frozenset({key_hash("y")})
    assert foreign._foreign_keys(0, 1 << 62) == [both]

    (expired, _) = reader.zk.client_id
    await asyncio.to_thread(expire_session, reader.zk, zk_hosts)
    await until("the reader in a new session", lambda: reader.zk.connected and reader.zk.client_id is not None
                and reader.zk.client_id[0] != expired)
    assert await a.ack(held[x1.message_id].receipt) is True
    deadline = time.monotonic() + 30
    while (found := foreign._foreign_keys(0, 1 << 62)) != [only_y]:  # as each receive asks
        assert time.monotonic() < deadline, f"A's range is still known as {found}, not with y alone open"
        await asyncio.gather(*watcher.tasks)
        await asyncio.sleep(0.05)
    assert await a.ack(held[y1.message_id].receipt) is True


async def test_a_member_whose_backlog_waits_on_a_released_range_takes_that_range_over(
    store: Store, consumers: list[Consumer]
) -> None:
    """A holds a range with k's first message in flight; B claims the rest of k's backlog,
    every message of it waiting behind that one. A stops (its range released, the message
    still in flight there until its recorded deadline). B must take the range over, deliver
    the message again and then the rest. Before, the messages waiting behind the first one
    counted as ready at B, so with CLAIM_LOW_WATER of them B claimed nothing more: nobody
    took the range over, and k stopped for good (a test node's autoscaled group, shrinking)."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=5, delivery="shared",
        ordered_keys=True))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (first,) = await publisher.publish([OutgoingMessage(b"k-0", key="k")])
    await publisher.flush_heads()
    a = await start(consumers, store)
    deadline = time.monotonic() + 60
    while not (got := await a.receive(max_messages=10, wait=1)):
        assert time.monotonic() < deadline, "A received nothing"
    assert [d.message.message_id for d in got] == [first.message_id]
    assert a._sharing is not None
    a._sharing.last_demand = float("-inf")  # A's app stops asking: A claims nothing more
    backlog: list[str] = []
    for start_at in range(1, 121, 10):  # a batch of ten each: B's claims take whole batches
        results = await publisher.publish([OutgoingMessage(f"k-{i}".encode(), key="k")
                                           for i in range(start_at, start_at + 10)])
        backlog += [r.message_id for r in results]
    await publisher.flush_heads()
    b = await start(consumers, store)
    assert await b.receive(max_messages=10, wait=1) == []  # all behind k-0, in flight at A

    def loaded_at_b() -> int:
        assert b._sharing is not None
        return sum(r.state.loaded_messages for r in b._sharing.sources())

    deadline = time.monotonic() + 60
    while loaded_at_b() < 64:  # CLAIM_LOW_WATER of k's messages at B, all waiting
        assert time.monotonic() < deadline, f"B loaded only {loaded_at_b()}"
        assert await b.receive(max_messages=10, wait=0.5) == []
    await a.stop()
    consumers.remove(a)
    order: list[str] = []
    deadline = time.monotonic() + 90
    while len(order) < 1 + len(backlog):
        assert time.monotonic() < deadline, f"B received {len(order)} of {1 + len(backlog)} messages of k"
        got = await b.receive(max_messages=10, wait=1)
        order += [d.message.message_id for d in got]
        assert all(result is True for result in await b.ack_many([d.receipt for d in got]))
    assert order == [first.message_id, *backlog]


async def test_a_range_its_member_gives_up_and_takes_back_twice_does_not_stop_its_key(
    store: Store, consumers: list[Consumer]
) -> None:
    """A holds k's first message in flight in one range and k's second, waiting behind it, in
    the next. A's app stops asking, so A releases that unused range; asking again, A takes it
    back; twice. Then every later message of k must still come, each after the one before is
    acked. Before, A's key locks kept one open copy of the second message too many: k stopped
    at A for good, and with it at every member (a test node's autoscaled group, whose members
    released and took back their own ranges, stalled on one key)."""
    setup_ordered(store)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def publish_k(i: int) -> Published:
        (published,) = await publisher.publish([OutgoingMessage(f"k-{i}".encode(), key="k")])
        await publisher.flush_heads()
        return published

    first = await publish_k(0)
    a = await start(consumers, store)
    sharing = a._sharing
    assert sharing is not None
    (held,) = (await received_by(a, 1, "A")).values()
    assert held.message.message_id == first.message_id
    second = await publish_k(1)

    async def holds_the_second(asking: bool) -> bool:
        if asking:
            assert await a.receive(max_messages=10, wait=0.2) == []  # k-1 waits behind k-0
        return any(r.record.start == second.batch for r in sharing.sources())

    for round_ in range(3):
        deadline = time.monotonic() + 60
        while not await holds_the_second(asking=True):
            assert time.monotonic() < deadline, f"A did not take the range of k-1 (round {round_})"
        if round_ == 2:
            break
        sharing.last_demand = float("-inf")  # A's app stops asking: the range of k-1 is unused
        await until("A to give up the range of k-1", lambda: not any(
            r.record.start == second.batch for r in sharing.sources()))
    assert sharing.takeovers == 2

    later = [second.message_id] + [(await publish_k(i)).message_id for i in range(2, 5)]
    assert await a.ack(held.receipt) is True
    order: list[str] = []
    deadline = time.monotonic() + 60
    while len(order) < len(later):
        assert time.monotonic() < deadline, f"k stopped at A: received {order} of {later}"
        got = await a.receive(max_messages=10, wait=1)
        order += [d.message.message_id for d in got]
        assert all(result is True for result in await a.ack_many([d.receipt for d in got]))
    assert order == later


async def test_a_poison_message_goes_to_the_dead_letter_queue_and_its_range_completes(
    store: Store, consumers: list[Consumer]
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    dead_letters = QueueRef(QUEUE.namespace, "shared-dlq")
    catalog.apply_queue(store, dead_letters, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=30, delivery="shared",
        max_deliveries=2, dead_letter_queue=dead_letters.name))
    first, second = await start(consumers, store), await start(consumers, store)
    published = await publish(store, 20, "m", per_call=20)
    poison: str | None = None
    acked: set[str] = set()
    shards = spec.log_shards()
    deadline = time.monotonic() + 60
    # The app keeps asking (a receive is what finds a message over its max deliveries).
    while offsets_of(store, QUEUE, SUBSCRIBER, shards)[0] <= heads_of(store, QUEUE, shards)[0]:
        assert time.monotonic() < deadline, f"{len(acked)} acked, poison {poison}"
        for consumer in (first, second):
            for d in await consumer.receive(max_messages=20, wait=0.2):
                if poison is None:
                    poison = d.message.message_id
                if d.message.message_id == poison:
                    await consumer.nack(d.receipt, error="cannot parse")
                elif await consumer.ack(d.receipt):
                    acked.add(d.message.message_id)
    assert poison is not None and acked == published - {poison}
    head = catalog.read_int(store, store.paths(dead_letters).head(0))
    assert head == 1, "the poison message did not reach the dead-letter queue"


async def test_an_app_that_never_acks_does_not_make_its_member_load_the_whole_backlog(
    store: Store, consumers: list[Consumer]
) -> None:
    from casque.engine.sharing import CLAIM_MESSAGES, MAX_LOADED_MESSAGES

    setup(store, shards=1, visibility=300)
    member = await start(consumers, store)
    await publish(store, MAX_LOADED_MESSAGES + 2000, "m", per_call=100)
    held = 0
    deadline = time.monotonic() + 120
    while held < MAX_LOADED_MESSAGES:
        assert time.monotonic() < deadline, f"only {held} received"
        held += len(await member.receive(max_messages=100, wait=2))
    sharing = member._sharing
    assert sharing is not None
    sharing.demand()
    assert not sharing._may_claim(), "the member would claim more while holding its limit"
    loaded = sum(r.state.loaded_messages for r in sharing.sources())
    assert loaded < MAX_LOADED_MESSAGES + CLAIM_MESSAGES, loaded


@pytest.mark.parametrize("acked", ["one of its range", "its whole range"])
async def test_an_ack_between_a_seek_and_the_member_noticing_it_is_stale(
    store: Store, consumers: list[Consumer], acked: str
) -> None:
    """As with leases: a delivery made from a range of the old epoch after a seek was answered
    (this member's watch comes later) is replayed, so its ack is stale, whether an ack row or
    the range's completion would make it durable."""
    setup(store, shards=1)
    published = await publish(store, 3, "s", per_call=3)
    consumer = await start(consumers, store)
    delivered: list[Delivery] = []

    async def received_all() -> bool:
        delivered.extend(await consumer.receive(max_messages=3, wait=0.5))
        return len(delivered) == 3

    deadline = time.monotonic() + 60
    while not await received_all():
        assert time.monotonic() < deadline, "timed out waiting for the three messages"

    consumer.resync = lambda: None  # type: ignore[method-assign]  # the seek's watch is late here
    await asyncio.to_thread(seek, store, QUEUE, SUBSCRIBER, SeekTarget("earliest"))
    chosen = delivered[:1] if acked == "one of its range" else delivered
    answers = await consumer.ack_many([d.receipt for d in chosen])
    assert all(isinstance(a, StaleReceipt) for a in answers), answers

    del consumer.resync  # the watch arrives
    consumer.resync()
    replayed: set[str] = set()
    stop = asyncio.Event()
    worker = asyncio.create_task(work(consumer, {}, stop, replayed))
    await until("every message acked after the seek", lambda: published <= replayed)
    stop.set()
    await worker


@pytest.fixture
def deaf_to_mode_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer given `deaf_to_switches = True` before it starts keeps serving its
    subscriber as it was: a member whose watch on the subscriber has not fired yet."""
    heard = Consumer._subscriber_changed

    def unless_deaf(consumer: Consumer, data: bytes | None, *rest: object) -> None:
        if not getattr(consumer, "deaf_to_switches", False):
            heard(consumer, data, *rest)

    monkeypatch.setattr(Consumer, "_subscriber_changed", unless_deaf)


async def test_a_member_switching_to_leased_delivery_misses_no_ack_a_shared_member_answered(
    store: Store, consumers: list[Consumer], deaf_to_mode_switches: None
) -> None:
    """The subscriber switches from shared to leased delivery while a member that has not
    seen the switch still holds a claim and a delivery from it. The leased member reads the
    shard once the claim's time ran out; then the shared member's app acks. Had that ack been
    answered `acked`, the leased member, which read the ack rows before it, would deliver the
    message again. The claim is deleted before the shard is read, so the ack is refused and
    the message comes to the leased member; and the shared member claims nothing more from a
    leased shard."""
    setup(store, shards=1, visibility=5)  # the leased member waits out the claim's time
    (first,) = await publish(store, 1, "first")
    leased_id, shared_id = ids_giving_shard_0_to_the_first()
    shared, held = await deaf_member_holding(consumers, store, shared_id, first)

    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=5, delivery="leased"))
    leased = Consumer(store, QUEUE, SUBSCRIBER, member_id=leased_id)
    consumers.append(leased)
    await leased.start()
    await until("the leased member read the shard", lambda: leased.held_shards == {0} and leased.readers[0].caught_up)
    with pytest.raises(StaleReceipt):
        await shared.ack(held.receipt)
    assert open_claims(store, [0]) == []
    again = await leased.receive(max_messages=10, wait=30)
    assert [d.message.message_id for d in again] == [first]
    assert await leased.ack(again[0].receipt)

    (second,) = await publish(store, 1, "second")
    assert await shared.receive(max_messages=1, wait=0) == []
    await claims_refused(shared)
    assert open_claims(store, [0]) == []
    after = await leased.receive(max_messages=10, wait=30)
    assert [d.message.message_id for d in after] == [second]


async def deaf_member_holding(consumers: list[Consumer], store: Store, member_id: str,
                              message_id: str) -> tuple[Consumer, Delivery]:
    """A member deaf to mode switches (see `deaf_to_mode_switches`), started in the mode the
    subscriber has now, holding the delivery of `message_id`, the one message published."""
    member = Consumer(store, QUEUE, SUBSCRIBER, member_id=member_id)
    member.deaf_to_switches = True  # type: ignore[attr-defined]
    consumers.append(member)
    await member.start()
    (held,) = await member.receive(max_messages=1, wait=30)
    assert held.message.message_id == message_id
    return member, held


def ids_giving_shard_0_to_the_first() -> tuple[str, str]:
    """Member ids of which the first is given shard 0 of a one-shard queue: a member that has
    not switched yet still counts in the leased members' assignment, and would otherwise
    take the shard from the leased member half the time."""
    for n in range(100):
        first, second = f"first-{n}", f"second-{n}"
        if assign([first, second], [0])[first] == {0}:
            return first, second
    raise AssertionError("no such ids")


async def claims_refused(member: Consumer) -> None:
    """Wait until a member in shared delivery reports its claims refused by a shard's lease."""
    deadline = time.monotonic() + 60
    while "ShardLeased" not in (await member.shard_status()).problem:
        assert time.monotonic() < deadline, "the shared member's claim on a leased shard was not refused"
        await asyncio.sleep(0.05)


async def test_a_member_switching_to_shared_delivery_claims_nothing_while_a_leased_member_reads_the_shard(
    store: Store, consumers: list[Consumer], deaf_to_mode_switches: None
) -> None:
    """The other way round: the subscriber switches from leased to shared delivery while a
    member that has not seen it still holds the shard's lease and a delivery. A shared member
    that claimed the shard then would read the ack rows before that delivery's ack, answered
    `acked` under the lease, and deliver it again. No claim is made while the lease exists;
    once the leased member lets the shard go, the shared member reads on from its offset."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    leased_spec = SubscriberSpec(queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=30)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased_spec)
    (first,) = await publish(store, 1, "first")
    leased_id, shared_id = ids_giving_shard_0_to_the_first()
    leased, held = await deaf_member_holding(consumers, store, leased_id, first)

    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased_spec.model_copy(update={"delivery": "shared"}))
    shared = Consumer(store, QUEUE, SUBSCRIBER, member_id=shared_id)
    consumers.append(shared)
    await shared.start()
    assert await shared.receive(max_messages=1, wait=0) == []
    await claims_refused(shared)
    assert await leased.ack(held.receipt)  # acked, under its lease
    await leased.stop()  # the lease goes with it

    (second,) = await publish(store, 1, "second")
    after = await shared.receive(max_messages=10, wait=30)
    assert [d.message.message_id for d in after] == [second]


async def test_a_switch_to_leased_delivery_and_back_strands_nothing_left_unacked(
    store: Store, consumers: list[Consumer]
) -> None:
    """Shared members claim a backlog whole, switch to leased delivery before acking it, and
    the leased member acks part of it before the switch back. The claims that covered the
    rest went with the switch to leased; the next shared members must claim it again from the
    shard's offset, not from past it (where the cursor had got to)."""
    setup(store, shards=1, visibility=5)
    published = await publish(store, 30, "backlog", per_call=3)
    shared = await start(consumers, store)
    held = await shared.receive(max_messages=30, wait=30)
    assert held, "the shared member received nothing"
    leased_spec = SubscriberSpec(queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=5)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased_spec)
    leased = await start(consumers, store)
    await until("the leased member holds the shard", lambda: leased.held_shards == {0})
    acked: set[str] = set()
    for delivery in await leased.receive(max_messages=5, wait=30):
        assert await leased.ack(delivery.receipt)
        acked.add(delivery.message.message_id)
    assert acked, "the leased member received nothing"

    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, leased_spec.model_copy(update={"delivery": "shared"}))
    again = await start(consumers, store)
    deadline = time.monotonic() + 120
    while acked != published:
        assert time.monotonic() < deadline, f"{len(published - acked)} messages never came back after the switches"
        for delivery in await again.receive(max_messages=30, wait=1):
            if await again.ack(delivery.receipt):
                acked.add(delivery.message.message_id)


async def test_a_range_completed_while_a_leased_member_ends_the_claims_does_not_move_the_offset_over_a_released_one(
    store: Store,
) -> None:
    """A switch to leased delivery: the leased member holds the shard's lease and ends its
    claims, the released ones at once, the one still in use once it goes. A member still in
    shared delivery then completes its range below them. Had the completion moved the
    offset as it does in shared delivery (to the lowest claim still open, or the cursor), it
    would pass the released range, whose claim is already gone, and the leased reader would
    start above that range's messages, which nobody acked: they would never be delivered."""
    setup(store, shards=1)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    await claims.ensure_dirs(store.zk, paths, 0)
    cursor = await claims.ensure_cursor(store.zk, paths, 0)
    later_ms = int(time.time() * 1000) + 60_000
    ranges = []
    for member in ("finishing", "switched", "finishing"):
        record, cursor = await claims.claim_range(store.zk, paths, 0, cursor, cursor.next + 1, member, later_ms)
        assert record is not None and cursor is not None
        ranges.append(record)
    finished, released, still_in_use = ranges
    assert await claims.rewrite(store.zk, paths, released, released.member, 0) is not None
    store.zk.create(paths.lease(0), b"")  # the leased member's lease
    ending = asyncio.create_task(claims.end_sharing(store.zk, paths, 0, lambda: int(time.time() * 1000), 0))
    await until("the released claim is ended", lambda: f"0/{released.name}" not in open_claims(store, [0]))

    outcome = (await completion.complete(store.zk, paths, finished)).outcome
    now = await claims.read_claim(store.zk, paths, 0, still_in_use.name)
    assert now is not None and await claims.rewrite(store.zk, paths, now, now.member, 0) is not None
    await ending

    offset, _ = decode_offset(store.zk.get(paths.offset(0))[0])
    assert offset <= released.start, f"the offset moved to {offset}, over the released range at {released.start}"
    assert outcome is completion.Completion.ENDED
    assert open_claims(store, [0]) == []



async def claimed(store: Store, *members: str) -> list[tuple[claims.ClaimRecord, claims.Cursor]]:
    """One range of one batch for each of `members`, claimed in turn on shard 0 (whose batches
    need not exist: claims and completions are ZooKeeper's alone), each with the cursor its
    claim left."""
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    await claims.ensure_dirs(store.zk, paths, 0)
    cursor = await claims.ensure_cursor(store.zk, paths, 0)
    made = []
    for member in members:
        record, after = await claims.claim_range(store.zk, paths, 0, cursor, cursor.next + 1, member,
                                                 int(time.time() * 1000) + 60_000)
        assert record is not None and after is not None
        made.append((record, after))
        cursor = after
    return made


def offset_seen(store: Store) -> completion.OffsetSeen:
    data, stat = store.zk.get(store.paths(QUEUE).subscriber(SUBSCRIBER).offset(0))
    return completion.OffsetSeen(*decode_offset(data), stat.version)


@pytest.fixture
def zk_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every ZooKeeper request the claims recipe makes from now on."""
    made: list[str] = []
    call = claims.zk.call

    async def counted(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        made.append(method.__name__)
        return await call(method, *args, **kwargs)

    monkeypatch.setattr(claims.zk, "call", counted)
    return made


async def test_a_range_alone_on_its_shard_completes_in_one_request(store: Store, zk_requests: list[str]) -> None:
    """The offset at the range's start and the cursor at its end, as the holder knows them:
    nothing else can be open, and one multi deletes the claim and moves the offset (a
    completion read the offset, the cursor and the claims first: four requests)."""
    setup(store, shards=1)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    ((record, cursor),) = await claimed(store, "alone")
    seen = offset_seen(store)
    zk_requests.clear()
    done = await completion.complete(store.zk, paths, record, seen, cursor)
    assert done[:2] == (completion.Completion.DONE, record.end)
    assert zk_requests == ["commit_async"]
    assert offset_seen(store).offset == record.end and open_claims(store, [0]) == []


async def test_ranges_claimed_back_to_back_by_one_member_complete_in_one_request_each(
    store: Store, zk_requests: list[str],
) -> None:
    """A member that claimed the next range before finishing this one (the cursor moved on,
    by its own claim) still completes each in one multi: the range after it is its own and
    open, so the offset belongs at its start; the offset each completion writes is what the
    next one knows."""
    setup(store, shards=1)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    (first, after_first), (second, after_second) = await claimed(store, "one", "one")
    zk_requests.clear()
    outcome, offset, seen = await completion.complete(store.zk, paths, first, offset_seen(store), after_first,
                                                  next_held=True)
    assert (outcome, offset) == (completion.Completion.DONE, second.start) and seen == offset_seen(store)
    assert seen is not None
    assert (await completion.complete(store.zk, paths, second, seen, after_second))[:2] == (
        completion.Completion.DONE, second.end)
    assert zk_requests == ["commit_async", "commit_async"]

    # Held, as the member believes, but completed meanwhile by a taker (which wrote the
    # offset, held back here): the multi fails on the offset's version and nothing is passed.
    (third, _), (fourth, after_fourth) = await claimed(store, "one", "one")
    seen = offset_seen(store)
    taken = await claims.rewrite(store.zk, paths, fourth, "taker", int(time.time() * 1000) + 60_000)
    assert taken is not None
    assert (await completion.complete(store.zk, paths, taken))[:2] == (completion.Completion.DONE, third.start)
    assert (await completion.complete(store.zk, paths, third, seen, None, next_held=True))[:2] == (
        completion.Completion.DONE, after_fourth.next)


async def test_a_range_completed_after_the_shard_moved_on_is_judged_on_what_is_there_now(store: Store) -> None:
    """What the holder knew of the offset and the cursor is no longer so: the offset moves
    exactly as far as a completion that reads them allows, never over an open range."""
    setup(store, shards=1)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    (first, after_first), (second, after_second) = await claimed(store, "a", "b")
    start = offset_seen(store)

    # A range open below: the offset stays at its start.
    assert (await completion.complete(store.zk, paths, second, start, after_second))[:2] == (
        completion.Completion.DONE, first.start)
    # Another range claimed after this one and still open (the cursor moved since this
    # claim): the offset stops at that range's start.
    (second, after_second), = await claimed(store, "b")
    assert (await completion.complete(store.zk, paths, first, offset_seen(store), after_first))[:2] == (
        completion.Completion.DONE, second.start)

    # The offset written by another completion since it was seen (its value the same, its
    # version new): read again, and the offset moves up to the cursor.
    stale = offset_seen(store)
    store.zk.set(paths.offset(0), store.zk.get(paths.offset(0))[0])
    assert (await completion.complete(store.zk, paths, second, stale, after_second))[:2] == (
        completion.Completion.DONE, second.end)

    # Taken over by another member since: lost, and nothing moves.
    ((third, after_third),) = await claimed(store, "c")
    seen = offset_seen(store)
    taken = await claims.rewrite(store.zk, paths, third, "taker", int(time.time() * 1000) + 60_000)
    assert taken is not None
    lost = await completion.complete(store.zk, paths, third, seen, after_third)
    assert lost[:2] == (completion.Completion.LOST, third.start)
    assert offset_seen(store) == seen

    # The cursor moved over expired batches while the range was open: the offset follows it.
    skipped_to = after_third.next + 5
    assert await claims.skip_range(store.zk, paths, after_third, 0, skipped_to)
    assert (await completion.complete(store.zk, paths, taken, offset_seen(store), after_third))[:2] == (
        completion.Completion.DONE, skipped_to)
    assert open_claims(store, [0]) == []


@pytest.fixture
def races_lost(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The member of every claim of a fresh range refused because another member claimed first."""
    lost: list[str] = []
    claim_range = claims.claim_range

    async def counted(*args: Any) -> tuple[claims.ClaimRecord | None, claims.Cursor | None]:
        record, now = await claim_range(*args)
        if record is None and now != args[3]:  # not a first claim that made the claims' znode
            lost.append(args[5])
        return record, now

    monkeypatch.setattr(claims, "claim_range", counted)
    return lost


async def trickle(store: Store, members: list[Consumer], count: int, group: int) -> dict[str, list[Consumer]]:
    """`count` messages published one at a time, each once the one before was acked, to
    members that receive and ack as apps do (in a group of `group`); who received what."""
    await until("the members see the group", lambda: all(len(m.group_members()) == group for m in members))
    received: dict[str, list[Consumer]] = {}
    acked: set[str] = set()
    stop = asyncio.Event()
    apps = [asyncio.create_task(work(m, received, stop, acked)) for m in members]
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    try:
        for i in range(count):
            (result,) = await publisher.publish([OutgoingMessage(f"trickle-{i}".encode())])
            await publisher.flush_heads()
            await until(f"trickle-{i} acked", lambda: result.message_id in acked)
    finally:
        stop.set()
        await asyncio.gather(*apps)
    return received


async def test_members_take_turns_with_a_trickle_and_lose_no_race_for_it(
    store: Store, consumers: list[Consumer], races_lost: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new batch wakes every member; the one whose turn it is claims it and the others
    leave it (all went after it from the same cursor, and all but one lost the race)."""
    monkeypatch.setattr(claim_turns, "TURN_WAIT_SECONDS", 3600.0)  # no turn runs out here
    # A member whose head watch is late may find the batch by looking past the head, which
    # claims without asking whose turn it is; no looking past the head here.
    monkeypatch.setattr(heads, "PAST_HEAD_PROBE_SECONDS", 3600.0)
    setup(store, shards=1)
    a, b = await start(consumers, store), await start(consumers, store)
    received = await trickle(store, [a, b], 20, group=2)
    assert len(received) == 20 and all(len(who) == 1 for who in received.values())
    # On the code before, nearly every message cost one member a lost race. A member still
    # loses one now and then in CI runs (one race in two runs of the suite, its path not
    # found yet): a lost race costs requests, never a range claimed twice.
    assert len(races_lost) < 5, races_lost
    assert {who[0].member_id for who in received.values()} == {a.member_id, b.member_id}


async def test_a_member_whose_app_asks_for_nothing_costs_the_others_one_wait_for_its_turns(
    store: Store, consumers: list[Consumer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B leaves A's first turn to A, finds its batch still there when the wait runs out, claims
    it, and takes A's turns at once from then on."""
    monkeypatch.setattr(claim_turns, "ABSENT_SECONDS", 3600.0)
    setup(store, shards=1)
    await start(consumers, store)  # A: its app asks for nothing
    b = await start(consumers, store)
    assert b._sharing is not None
    received = await trickle(store, [b], 20, group=2)
    assert len(received) == 20 and all(who == [b] for who in received.values())
    assert b._sharing.turns.absences == 1 and b._sharing.turns.waits == 1


async def test_the_cursor_read_again_while_one_of_its_epoch_is_known_takes_one_request(
    store: Store, zk_requests: list[str]
) -> None:
    setup(store, shards=1)
    paths = store.paths(QUEUE).subscriber(SUBSCRIBER)
    known = await claims.ensure_cursor(store.zk, paths, 0)
    ((_, moved),) = await claimed(store, "other")  # another member claimed since
    zk_requests.clear()
    assert await claims.current_cursor(store.zk, paths, 0, known) == moved
    assert zk_requests == ["get_async"]
    # None known, or one of another epoch (a seek not seen here): the offset is read too.
    zk_requests.clear()
    assert await claims.current_cursor(store.zk, paths, 0, None) == moved
    assert zk_requests == ["get_async", "get_async"]
    zk_requests.clear()
    assert await claims.current_cursor(store.zk, paths, 0, dataclasses.replace(known, epoch=known.epoch + 1)) == moved
    assert zk_requests == ["get_async"] * 3
