"""Publishing on a real Cassandra and ZooKeeper: atomic, contiguous, unmerged batches."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

import pytest

from casque.engine import catalog, idempotency, protocol_change
from casque.engine.batches import Claim, Header, Log
from casque.engine.messages import OutgoingMessage, Published
from casque.engine.publisher import Publisher
from casque.engine.stats import queue_stats
from casque.errors import (
    BackendUnavailable,
    MessageTooLarge,
    PartiallyPublished,
    PublishOutcomeUnknown,
    WriteOutcomeUnknown,
)
from casque.engine.sequences import SEQUENCE_BLOCK, parse_producer_key, producer_key
from casque.schema import (
    CLIENT_ID_BUCKETS,
    LEGACY_PUBLISH_IDS_TABLE,
    PRODUCER_SEQS_TABLE,
    SCHEMA_CHANGE_TIMEOUT_SECONDS,
    QueueRef,
    client_id_bucket,
    ensure_keyspace,
)
from casque.specs import QueueSpec
from casque.store import Store

QUEUE = QueueRef("default", "pub")
Key = Callable[[str], str]


def numbered(name: str) -> str:
    """"order-9" as producer "producer-order"'s message number 9."""
    return producer_key(f"producer-{name.rsplit('-', 1)[0]}", int(name.rsplit("-", 1)[1]))


def keys_of(request: pytest.FixtureRequest, store: Store) -> Key:
    if request.param == "client id":
        return lambda name: name
    if request.param == "producer sequence, protocol 2":
        # Block rows carry their writer's claim facts: no writer row, no completion.
        protocol_change.set_version(store, 2)
    return numbered


@pytest.fixture(params=["client id", "producer sequence", "producer sequence, protocol 2"])
def key(request: pytest.FixtureRequest, store: Store) -> Key:
    """The idempotency key a test's name stands for ("order-9"): as a client id, or as a
    producer's numbered message ("order" producer, number 9), whose intents live in blocks,
    their claim facts on the writer's row (protocol 1) or on the blocks' rows (protocol 2)."""
    return keys_of(request, store)


@pytest.fixture(params=["client id", "producer sequence"])
def key_with_writer_row(request: pytest.FixtureRequest, store: Store) -> Key:
    """As `key`, for the faults of a writer's row: protocol 2's producer keys write none."""
    return keys_of(request, store)


async def read_shard(log: Log, shard: int, head: int) -> dict[int, list[str]]:
    """batch -> message ids, read back in log order."""
    found: dict[int, list[str]] = {}
    batch = 1
    while batch <= head:
        chunk = await log.read_from(shard, batch)
        if not chunk:
            break
        for b in chunk:
            found[b.header.batch] = [m.message_id for m in b.messages]
        batch = chunk[-1].header.batch + 1
    return found


async def read_all(store: Store, spec: QueueSpec) -> dict[int, dict[int, list[str]]]:
    log = Log(store, QUEUE, spec.consistency)
    result = {}
    for shard in range(spec.shards):
        head = catalog.read_int(store, store.paths(QUEUE).head(shard))
        result[shard] = await read_shard(log, shard, head)
    return result


async def test_concurrent_publishers_never_merge_or_lose_batches(store: Store) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publishers = [Publisher(store, QUEUE, catalog.read_queue(store, QUEUE), publisher_id=f"p{i}") for i in range(4)]

    async def burst(publisher: Publisher, n: int) -> list[Published]:
        # Keys force every publisher onto the same two shards: maximum contention.
        tasks = [publisher.publish([OutgoingMessage(f"{publisher.publisher_id}-{i}".encode(), key=str(i % 2))])
                 for i in range(n)]
        return [r for rs in await asyncio.gather(*tasks) for r in rs]

    results = await asyncio.gather(*(burst(p, 150) for p in publishers))
    for p in publishers:
        await p.flush_heads()
    by_publisher = {p.publisher_id: {r.message_id for r in rs} for p, rs in zip(publishers, results)}
    acked = {r.message_id: r for rs in results for r in rs}
    assert len(acked) == 600

    stored = await read_all(store, spec)
    positions: dict[str, tuple[int, int, int]] = {}
    for shard, batches in stored.items():
        head = catalog.read_int(store, store.paths(QUEUE).head(shard))
        # Contiguous: batches 1..head, no gaps, and the head covers all of them.
        assert sorted(batches) == list(range(1, head + 1))
        for batch, ids in batches.items():
            owners = {name for name, mine in by_publisher.items() if set(ids) <= mine}
            assert len(owners) == 1, f"batch {shard}/{batch} mixes publishers"
            for seq, message_id in enumerate(ids):
                assert message_id not in positions, "a message is stored twice"
                positions[message_id] = (shard, batch, seq)
    # Every acknowledged publish is stored exactly where its result said.
    assert positions == {m: (r.shard, r.batch, r.seq) for m, r in acked.items()}
    assert sum(p.counters.conflicts for p in publishers) > 0  # the race really happened


async def test_group_commit_puts_concurrent_publishes_in_few_batches(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    results = await asyncio.gather(*(publisher.publish([OutgoingMessage(b"x")]) for _ in range(500)))
    batches = {r.batch for rs in results for r in rs}
    assert len(batches) < 100
    per_batch: dict[int, list[int]] = defaultdict(list)
    for rs in results:
        per_batch[rs[0].batch].append(rs[0].seq)
    for seqs in per_batch.values():
        assert sorted(seqs) == list(range(len(seqs)))


async def test_a_linger_lets_a_publish_wait_for_the_next_one_to_share_its_batch(store: Store) -> None:
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))

    async def first_then_second(linger: float) -> tuple[Published, Published]:
        publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE), linger=linger)
        first = asyncio.ensure_future(publisher.publish([OutgoingMessage(b"first")]))
        writer = publisher._writers[0]
        # The first publish reaches its shard writer, which starts on it: it takes it into a
        # batch at once, or lingers with it.
        deadline = time.monotonic() + 30
        while not (writer.busy and (linger > 0 or not writer.pending)):
            assert time.monotonic() < deadline, "the first publish never reached its shard writer"
            await asyncio.sleep(0)
        assert not first.done()
        (second,) = await publisher.publish([OutgoingMessage(b"second")])
        (result,) = await first
        return result, second

    # Without a linger the first message's batch is under way before the second arrives ...
    alone, after = await first_then_second(0.0)
    assert after.batch > alone.batch
    # ... with one, the writer waits for company: one batch, in arrival order.
    first, second = await first_then_second(1.0)
    assert first.batch == second.batch and (first.seq, second.seq) == (0, 1)


def places(stored: dict[int, dict[int, list[str]]]) -> dict[str, tuple[int, int, int]]:
    """message id -> (shard, batch, seq) as read back from the log."""
    return {message_id: (shard, batch, seq) for shard, batches in stored.items()
            for batch, ids in batches.items() for seq, message_id in enumerate(ids)}


async def test_a_call_mixing_plain_identified_and_delayed_messages_answers_each_where_it_landed(
    store: Store,
) -> None:
    """A call's plain messages are answered together, its messages with an id or a delivery
    time each on its own path: every answer names the message's place, in the call's order."""
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    messages = [
        OutgoingMessage(b"plain-0"), OutgoingMessage(b"keyed-a", key="a"),
        OutgoingMessage(b"with-id", client_id="mixed-1"), OutgoingMessage(b"later", delay_seconds=600),
        OutgoingMessage(b"keyed-b", key="b"), OutgoingMessage(b"plain-1"),
    ]
    results = await publisher.publish(messages)
    await publisher.flush_heads()
    logged = places(await read_all(store, spec))
    assert len(results) == len(messages)
    assert results[3].batch == -1 and results[3].deliver_at is not None
    in_log = [r for i, r in enumerate(results) if i != 3]
    assert {r.message_id: (r.shard, r.batch, r.seq) for r in in_log} == logged
    # The call's order holds within each shard.
    for shard in range(spec.shards):
        on_shard = [logged[r.message_id] for r in in_log if r.shard == shard]
        assert on_shard == sorted(on_shard)
    (again,) = await publisher.publish([OutgoingMessage(b"with-id", client_id="mixed-1")])
    assert again.message_id == results[2].message_id


async def test_a_call_larger_than_a_batch_is_answered_with_every_batch_it_took(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    messages = [OutgoingMessage(bytes([65 + i]) * 200_000) for i in range(12)]  # 2.4 MB: over one batch's bytes
    results = await publisher.publish(messages)
    await publisher.flush_heads()
    logged = places(await read_all(store, spec))
    assert len({r.batch for r in results}) >= 3
    assert [logged[r.message_id] for r in results] == [(r.shard, r.batch, r.seq) for r in results]
    assert [(r.batch, r.seq) for r in results] == sorted((r.batch, r.seq) for r in results)


async def test_a_call_whose_later_batch_is_not_written_says_which_of_its_messages_were(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its first batch is written, its second certainly not: the call fails retryable (not
    left waiting), naming each message's outcome. What was written stays written, and it is
    the call's first messages only: nothing after the failed batch is written, so the ones
    sent again follow them in order."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    claim = Log.claim
    claims = 0

    async def second_claim_lost(self: Log, *args: Any, **kwargs: Any) -> Claim:
        nonlocal claims
        claims += 1
        if claims == 2:
            raise WriteOutcomeUnknown("timed out before reaching anyone")
        return await claim(self, *args, **kwargs)

    monkeypatch.setattr(Log, "claim", second_claim_lost)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    with pytest.raises(PartiallyPublished) as raised:
        await publisher.publish([OutgoingMessage(bytes([65 + i]) * 200_000) for i in range(12)])
    outcomes = raised.value.outcomes
    written = [o for o in outcomes if isinstance(o, Published)]
    assert written and outcomes[:len(written)] == written, "the written ones are the call's first"
    assert all(isinstance(o, BackendUnavailable) and not isinstance(o, PublishOutcomeUnknown)
               for o in outcomes[len(written):])
    await publisher.flush_heads()
    stored = await read_all(store, spec)
    assert stored[0] == {1: [o.message_id for o in written]}, "only the first batch of the call was written"


async def test_a_publish_of_an_id_a_failing_call_holds_answers_that_messages_own_outcome(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch, short_claim_window: None
) -> None:
    """A call of identified messages spans three batches and its second is certainly not
    written, so the call fails. Publishes of its ids sent meanwhile (the client retrying a
    call it gave up on) wait for each message alone: the ones written are answered as
    duplicates at their places, the others fail retryable. Retried once more, every id is
    in the log once, and no publish of them is left under way in the process."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    claim = Log.claim
    claims = 0
    started = asyncio.Event()

    async def second_claim_lost(self: Log, *args: Any, **kwargs: Any) -> Claim:
        nonlocal claims
        claims += 1
        if claims == 1:
            started.set()
            await asyncio.sleep(0)  # the waiting publishes go in while this claim is out
        if claims == 2:
            raise WriteOutcomeUnknown("timed out before reaching anyone")
        return await claim(self, *args, **kwargs)

    monkeypatch.setattr(Log, "claim", second_claim_lost)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    ids = [key(f"held-{n}") for n in range(12)]
    messages = [OutgoingMessage(bytes([65 + n]) * 200_000, client_id=ids[n]) for n in range(12)]  # 3+ batches
    call = asyncio.create_task(publisher.publish(messages))
    await asyncio.wait_for(started.wait(), 60)
    waiting = [asyncio.create_task(publisher.publish([message])) for message in messages]
    with pytest.raises(BackendUnavailable):
        await call
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    landed = {n: o[0] for n, o in enumerate(outcomes) if isinstance(o, list)}
    failed = [n for n, o in enumerate(outcomes) if isinstance(o, BackendUnavailable)]
    assert len(landed) + len(failed) == 12, outcomes
    assert landed and failed
    for n, result in landed.items():
        assert result.duplicate and copies_of(store, ids[n]) == [(result.shard, result.batch, result.seq)]
    for n in failed:
        assert copies_of(store, ids[n]) == []
    assert publisher.idempotency.under_way == 0
    again = await publisher.publish(messages)
    for n, result in enumerate(again):
        assert copies_of(store, ids[n]) == [(result.shard, result.batch, result.seq)]
        if n in landed:
            assert result.message_id == landed[n].message_id
    assert publisher.idempotency.under_way == 0


async def test_idempotent_publish_returns_the_first_result(store: Store, key: Key) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600)
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    first, second = await asyncio.gather(
        publisher.publish([OutgoingMessage(b"a", client_id=key("order-1"))]),
        publisher.publish([OutgoingMessage(b"a", client_id=key("order-1"))]),
    )
    assert first[0].message_id == second[0].message_id
    assert [first[0].duplicate, second[0].duplicate].count(True) == 1
    # Another publisher (another sidecar, or after a restart) finds it in Cassandra.
    other = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (third,) = await other.publish([OutgoingMessage(b"a", client_id=key("order-1"))])
    assert third.duplicate and third.message_id == first[0].message_id
    await publisher.flush_heads()  # publish does not wait for the head; reading up to it does
    stored = await read_all(store, spec)
    assert sum(len(ids) for batches in stored.values() for ids in batches.values()) == 1


async def test_one_call_with_an_id_twice_stores_it_once_and_answers_both(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600)
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    first, again, plain = await publisher.publish([
        OutgoingMessage(b"a", client_id=key("order-2")), OutgoingMessage(b"a", client_id=key("order-2")), OutgoingMessage(b"b"),
    ])
    assert again.duplicate and not first.duplicate and not plain.duplicate
    assert (again.message_id, again.shard, again.batch, again.seq) == (first.message_id, first.shard, first.batch,
                                                                        first.seq)
    if parse_producer_key(key("order-2")) is None:
        # Remembered once the call ended: the next publish of the id is answered without a lookup.
        async def no_lookup(client_ids: object) -> NoReturn:
            raise AssertionError(f"looked up {client_ids} in Cassandra")

        monkeypatch.setattr(publisher.idempotency, "lookup", no_lookup)
    # (A producer key is not kept in memory: it is found again by one read of its block.)
    (later,) = await publisher.publish([OutgoingMessage(b"a", client_id=key("order-2"))])
    assert later.duplicate and later.message_id == first.message_id
    await publisher.flush_heads()
    stored = await read_all(store, spec)
    assert sorted(i for batches in stored.values() for ids in batches.values() for i in ids) == sorted(
        [first.message_id, plain.message_id])


async def test_a_retry_lands_once_within_the_queues_deduplication_window_and_again_after_it(
    store: Store, key: Key
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, deduplication_window_seconds=10)
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (first,) = await publisher.publish([OutgoingMessage(b"a", client_id=key("order-3"))])
    # A retry inside the window, through this process and through another: the first result.
    (again,) = await publisher.publish([OutgoingMessage(b"a", client_id=key("order-3"))])
    (elsewhere,) = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish(
        [OutgoingMessage(b"a", client_id=key("order-3"))])
    assert again.duplicate and elsewhere.duplicate
    assert again.message_id == elsewhere.message_id == first.message_id
    # The window's end: the key's rows expire with it (10 s, not the default 600 s).
    ended = time.monotonic() + 60

    while await publisher.idempotency.lookup([key("order-3")]):
        assert time.monotonic() < ended, "the key's rows outlived the queue's 10 s window by far"
        await asyncio.sleep(0.2)
    (later,) = await publisher.publish([OutgoingMessage(b"a", client_id=key("order-3"))])
    assert not later.duplicate and later.message_id != first.message_id
    await publisher.flush_heads()
    stored = await read_all(store, spec)
    assert sorted(i for batches in stored.values() for ids in batches.values() for i in ids) == sorted(
        [first.message_id, later.message_id])


async def until(what: str, condition: Callable[[], bool], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def intent_of(store: Store, client_id: str) -> str | None:
    queue_key = catalog.read_queue(store, QUEUE).shared_key(QUEUE)
    numbered = parse_producer_key(client_id)
    if numbered is not None:
        block = numbered.sequence // SEQUENCE_BLOCK
        rows = store.session.execute(
            f"SELECT writer, first_seq, last_seq FROM {store.keyspace}.{PRODUCER_SEQS_TABLE} "
            "WHERE queue = %s AND producer = %s AND block = %s", (queue_key, numbered.producer, block))
        return next((r.writer for r in rows if r.first_seq <= numbered.sequence <= r.last_seq), None)
    row = store.session.execute(
        f"SELECT writer FROM {store.keyspace}.client_ids WHERE queue = %s AND bucket = %s AND client_id = %s",
        (queue_key, client_id_bucket(client_id), client_id)
    ).one()
    return None if row is None else row.writer


class Crash(Exception):
    """The publishing process dies here."""


def copies_of(store: Store, client_id: str) -> list[tuple[int, int, int]]:
    rows = store.session.execute(f"SELECT shard, batch_no, seq, client_id FROM {store.table(QUEUE)}")
    return [(r.shard, r.batch_no, r.seq) for r in rows if r.client_id == client_id]


async def test_a_retry_after_a_crash_between_the_batch_and_its_id_record_finds_the_batch(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    crashing = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def dies_before_recording(*args: object) -> None:
        raise Crash()

    # The batch is written and the publish answered, but the writer's row never lands.
    monkeypatch.setattr(crashing.idempotency, "record_won", dies_before_recording)
    await crashing.publish([OutgoingMessage(b"pay", client_id=key("order-9"))])
    monkeypatch.undo()
    (written,) = copies_of(store, key("order-9"))  # the batch made it

    retry = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))  # the client retries through another sidecar
    (result,) = await retry.publish([OutgoingMessage(b"pay", client_id=key("order-9"))])
    assert result.duplicate and (result.shard, result.batch, result.seq) == written
    assert copies_of(store, key("order-9")) == [written]
    assert retry.idempotency.resolved_intents == 1


async def test_a_retry_after_a_crash_before_the_claim_publishes_once_the_claim_window_closed(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    monkeypatch.setattr(idempotency, "DEADLINE_SECONDS", 1.0)
    monkeypatch.setattr(idempotency, "CLAIM_SECONDS", 0.5)
    monkeypatch.setattr(idempotency, "CLOCK_SKEW_SECONDS", 0.2)
    claim = Log.claim

    async def dies_before_claiming(self: Log, *args: Any, **kwargs: Any) -> Claim:
        raise Crash()

    monkeypatch.setattr(Log, "claim", dies_before_claiming)
    with pytest.raises(Crash):
        await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([OutgoingMessage(b"pay", client_id=key("order-10"))])
    monkeypatch.setattr(Log, "claim", claim)
    assert copies_of(store, key("order-10")) == []
    retry = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (result,) = await retry.publish([OutgoingMessage(b"pay", client_id=key("order-10"))])
    assert not result.duplicate and retry.idempotency.resolved_intents == 1
    assert copies_of(store, key("order-10")) == [(result.shard, result.batch, result.seq)]


async def test_two_retries_at_two_sidecars_after_a_crash_before_the_claim_publish_once(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    monkeypatch.setattr(idempotency, "DEADLINE_SECONDS", 1.0)
    monkeypatch.setattr(idempotency, "CLAIM_SECONDS", 0.5)
    monkeypatch.setattr(idempotency, "CLOCK_SKEW_SECONDS", 0.2)
    claim = Log.claim

    async def dies_before_claiming(self: Log, *args: Any, **kwargs: Any) -> Claim:
        raise Crash()

    monkeypatch.setattr(Log, "claim", dies_before_claiming)
    with pytest.raises(Crash):
        await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([OutgoingMessage(b"pay", client_id=key("order-12"))])
    monkeypatch.setattr(Log, "claim", claim)
    # The client gave up on its first retry (it waited past its own timeout) and retried
    # through another sidecar: both find the intent, both see its window close.
    retries = [Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)) for _ in range(2)]
    answers = await asyncio.gather(*(r.publish([OutgoingMessage(b"pay", client_id=key("order-12"))]) for r in retries))
    (one,), (two,) = answers
    assert (one.shard, one.batch, one.seq) == (two.shard, two.batch, two.seq)
    assert [one.duplicate, two.duplicate].count(False) == 1
    assert copies_of(store, key("order-12")) == [(one.shard, one.batch, one.seq)]


async def test_a_retry_while_the_first_attempt_still_claims_finds_its_batch(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    slow = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    claim = Log.claim
    go_on = asyncio.Event()

    async def paused_before_claiming(self: Log, *args: Any, **kwargs: Any) -> Claim:
        if self is slow.log:
            await go_on.wait()  # a GC pause: the intent is recorded, the claim not sent yet
        return await claim(self, *args, **kwargs)

    monkeypatch.setattr(Log, "claim", paused_before_claiming)
    first = asyncio.create_task(slow.publish([OutgoingMessage(b"pay", client_id=key("order-11"))]))
    await until("the first attempt's intent", lambda: intent_of(store, key("order-11")) is not None)
    retry = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    second = asyncio.create_task(retry.publish([OutgoingMessage(b"pay", client_id=key("order-11"))]))
    await until("the retry waiting on the intent", lambda: retry.idempotency.resolved_intents == 1)
    go_on.set()
    (one,), (two,) = await asyncio.gather(first, second)
    assert not one.duplicate and two.duplicate
    assert (two.shard, two.batch, two.seq) == (one.shard, one.batch, one.seq)
    assert copies_of(store, key("order-11")) == [(one.shard, one.batch, one.seq)]


async def test_ids_cost_a_few_statements_per_batch_not_two_per_message(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    messages = [OutgoingMessage(f"m{i}".encode(), client_id=f"id-{i}") for i in range(500)]
    results = await publisher.publish(messages)
    assert len({r.message_id for r in results}) == 500 and not any(r.duplicate for r in results)
    # Per batch: a read and a write of intents per bucket partition, and the writer's row
    # written with the intents and again (in the background) with the batch it won.
    buckets = len({client_id_bucket(m.client_id or "") for m in messages})
    assert publisher.counters.batches == 1
    await until("the writer's row", lambda: publisher.idempotency.statements == 2 * buckets + 2)
    assert 2 * buckets + 2 <= 2 * CLIENT_ID_BUCKETS + 2
    # Another sidecar finds every id with a read per bucket and one read of the writer's row.
    other = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    again = await other.publish(messages)
    assert [r.message_id for r in again] == [r.message_id for r in results] and all(r.duplicate for r in again)
    assert [(r.shard, r.batch, r.seq) for r in again] == [(r.shard, r.batch, r.seq) for r in results]
    assert other.idempotency.statements == buckets + 1 and other.counters.batches == 0


def two_producers_crossing_a_block() -> list[OutgoingMessage]:
    """Two producers, 500 numbers each; the second's cross a block boundary."""
    return [OutgoingMessage(f"a{i}".encode(), client_id=producer_key("a", i)) for i in range(500)] + [
        OutgoingMessage(f"b{i}".encode(), client_id=producer_key("b", SEQUENCE_BLOCK - 250 + i)) for i in range(500)]


async def test_producer_sequences_cost_a_few_statements_per_batch_whatever_its_size(store: Store) -> None:
    """A producer's numbered messages: one read per run of numbers and one row per run,
    where client ids cost a row and a key read each."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    messages = two_producers_crossing_a_block()
    results = await publisher.publish(messages)
    assert len({r.message_id for r in results}) == 1000 and not any(r.duplicate for r in results)
    assert publisher.counters.batches == 1
    # Reads: one per (producer, block); rows: one per (producer, block); the writer's row
    # with the intents and again with the batch it won.
    await until("the writer's row", lambda: publisher.idempotency.statements == 3 + 3 + 2)
    # Another sidecar finds every key: a read per block, one of their client_ids buckets
    # (settled keys are recorded there), and one read of the writer's row.
    other = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    again = await other.publish(messages)
    assert all(r.duplicate for r in again) and other.counters.batches == 0
    assert [(r.message_id, r.shard, r.batch, r.seq) for r in again] == [
        (r.message_id, r.shard, r.batch, r.seq) for r in results]
    assert other.idempotency.statements <= 3 + CLIENT_ID_BUCKETS + 1
    # Numbers skipped, published later, are new; a run around them finds the rest.
    gaps = [OutgoingMessage(b"late", client_id=producer_key("a", n)) for n in (498, 499, 500, 501)]
    late = await other.publish(gaps)
    assert [r.duplicate for r in late] == [True, True, False, False]


async def test_under_protocol_2_producer_sequences_cost_a_read_and_a_row_per_block(store: Store) -> None:
    """Protocol 2: the blocks' rows carry the writer's claim facts, so a numbered batch writes
    no writer row and no completion; a retry of the whole call through another sidecar finds
    the batch with one search for its writer, and answers every key where it landed."""
    protocol_change.set_version(store, 2)
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    messages = two_producers_crossing_a_block()
    results = await publisher.publish(messages)
    assert len({r.message_id for r in results}) == 1000 and publisher.counters.batches == 1
    # Reads: one per (producer, block); rows: one per (producer, block); nothing after the claim.
    await publisher.background_done()
    assert publisher.idempotency.statements == 3 + 3
    other = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    again = await other.publish(messages)
    assert all(r.duplicate for r in again) and other.counters.batches == 0
    assert [(r.message_id, r.shard, r.batch, r.seq) for r in again] == [
        (r.message_id, r.shard, r.batch, r.seq) for r in results]
    # A read per block and of the keys' client_ids buckets; no writer row to read.
    assert other.idempotency.statements <= 3 + CLIENT_ID_BUCKETS
    assert other.idempotency.resolved_intents == 1000
    for message, result in zip(messages[::97], results[::97]):
        assert message.client_id is not None
        assert copies_of(store, message.client_id) == [(result.shard, result.batch, result.seq)]


async def test_a_delayed_message_with_a_producer_key_is_published_once(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    state = catalog.read_queue(store, QUEUE)
    due = datetime.now(timezone.utc) + timedelta(hours=1)
    message = OutgoingMessage(b"later", client_id=producer_key("delayed-producer", 7), deliver_at=due)
    (first,) = await Publisher(store, QUEUE, state).publish([message])
    # Due at the whole millisecond (Cassandra's precision) its message id carries, never before.
    assert not first.duplicate and first.deliver_at is not None
    assert timedelta(0) <= first.deliver_at - due < timedelta(milliseconds=1)
    (again,) = await Publisher(store, QUEUE, state).publish([message])  # a retry through another sidecar
    assert again.duplicate and again.message_id == first.message_id and again.deliver_at == first.deliver_at
    waiting = store.session.execute(f"SELECT message_id FROM {store.keyspace}.delayed").all()
    assert [row.message_id for row in waiting] == [first.message_id]


async def test_a_claim_of_unknown_outcome_is_settled_before_the_publish_is_answered(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write lands but its answer is lost (a timeout, CAS_WRITE_UNKNOWN), and the serial
    reads that settle it fail a few times too: the publish still answers its real position."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    claim, read_header = Log.claim, Log.read_header
    serial_failures = iter([WriteOutcomeUnknown("serial read timed out")] * 3)

    async def applied_but_unanswered(self: Log, *args: Any, **kwargs: Any) -> Claim:
        await claim(self, *args, **kwargs)
        raise WriteOutcomeUnknown("CAS write unknown")

    async def flaky_serial_read(self: Log, shard: int, batch: int, serial: bool = False) -> Header | None:
        failure = next(serial_failures, None) if serial else None
        if failure is not None:
            raise failure
        return await read_header(self, shard, batch, serial)

    monkeypatch.setattr(Log, "claim", applied_but_unanswered)
    monkeypatch.setattr(Log, "read_header", flaky_serial_read)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    (result,) = await publisher.publish([OutgoingMessage(b"once")])
    assert (result.shard, result.batch, result.seq) == (0, 1, 0)
    assert next(serial_failures, None) is None  # every failed read was retried
    await publisher.flush_heads()
    assert await read_all(store, spec) == {0: {1: [result.message_id]}}


async def test_a_claim_certainly_not_written_is_a_retryable_failure(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)

    async def lost_before_reaching_anyone(self: Log, *args: Any, **kwargs: Any) -> Claim:
        raise WriteOutcomeUnknown("timed out")

    monkeypatch.setattr(Log, "claim", lost_before_reaching_anyone)
    with pytest.raises(BackendUnavailable) as raised:
        await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([OutgoingMessage(b"never")])
    assert not isinstance(raised.value, PublishOutcomeUnknown)  # the serial read said: not written


async def test_running_totals_survive_publishers_contending_for_one_shard(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    # Enough contention that writers lose several claims in a row and resync from a head
    # that lags what they know (where the totals used to be lost).
    publishers = [Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)) for _ in range(6)]

    async def publish_from(publisher: Publisher, name: str) -> None:
        for i in range(20):
            await publisher.publish([OutgoingMessage(f"{name}-{i}".encode())])

    await asyncio.gather(*(publish_from(p, f"p{n}") for n, p in enumerate(publishers)))
    assert sum(p.counters.conflicts for p in publishers) > 0, "the publishers never contended"
    for publisher in publishers:
        await publisher.flush_heads()
    head = catalog.read_int(store, store.paths(QUEUE).head(0))
    log = Log(store, QUEUE, "ONE")
    running, size = 0, 0
    for batch in range(1, head + 1):
        header = await log.read_header(0, batch)
        stored = (await log.read_from(0, batch))[0]
        assert header is not None and stored.header.batch == batch
        running += header.message_count
        size += sum(m.size for m in stored.messages)
        assert (header.total_messages, header.total_bytes) == (running, size), f"batch {batch}"
    assert running == 120  # every message counted once


async def test_totals_count_on_after_the_queue_idled_past_its_retention(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    table = store.table(QUEUE)
    # A short retention for what is published now (the spec's floor is 60 s).
    store.session.execute(f"ALTER TABLE {table} WITH default_time_to_live = 2")
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    early = [OutgoingMessage(b"early-%d" % i) for i in range(3)]
    for message in early:
        await publisher.publish([message])
    await publisher.flush_heads()
    store.session.execute(f"ALTER TABLE {table} WITH default_time_to_live = 3600")
    log = Log(store, QUEUE, "ONE")
    idle_head = catalog.read_int(store, store.paths(QUEUE).head(0))
    ends = time.monotonic() + 60
    while await log.read_header(0, idle_head) is not None:  # the queue idles past its retention
        assert time.monotonic() < ends, "the head's header never expired"
        await asyncio.sleep(0.2)
    assert (await queue_stats(store, QUEUE)).published_messages == 3  # idle, still counted

    # A publisher that starts now (a restarted sidecar), and the one that knew the shard.
    later = [OutgoingMessage(b"later-0"), OutgoingMessage(b"later-1")]
    await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([later[0]])
    await publisher.publish([later[1]])
    await publisher.flush_heads()
    head = catalog.read_int(store, store.paths(QUEUE).head(0))
    header = await log.read_header(0, head)
    assert header is not None and head == idle_head + 2
    assert (header.total_messages, header.total_bytes) == (5, sum(m.size for m in early + later))
    assert (await queue_stats(store, QUEUE)).published_messages == 5


async def test_oversize_message_rejects_the_whole_request(store: Store) -> None:
    spec = QueueSpec(shards=1, retention_seconds=3600, max_message_bytes=1024)
    catalog.apply_queue(store, QUEUE, spec)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    with pytest.raises(MessageTooLarge):
        await publisher.publish([OutgoingMessage(b"ok"), OutgoingMessage(b"x" * 2000)])
    assert catalog.read_int(store, store.paths(QUEUE).head(0)) == 0


async def test_ids_an_earlier_version_recorded_in_its_table_are_honoured(store: Store) -> None:
    """An installation made before `client_ids` has `publish_ids`, a partition per id: what
    sidecars of the earlier version recorded there (a position, or an intent whose writer
    died before claiming) still decides a retry through a sidecar of this version."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    legacy = f"{store.keyspace}.{LEGACY_PUBLISH_IDS_TABLE}"
    # The table as its first release made it; the installation step adds the later columns.
    store.session.execute(f"CREATE TABLE {legacy} (queue text, client_id text, message_id text, shard int, "
                          "batch_no bigint, seq int, PRIMARY KEY ((queue, client_id)))")
    ensure_keyspace(store.session, store.keyspace, store.replication_cql)
    key = catalog.read_queue(store, QUEUE).shared_key(QUEUE)
    store.session.execute(f"INSERT INTO {legacy} (queue, client_id, message_id, shard, batch_no, seq) "
                          "VALUES (%s, 'old-done', 'm-old', 0, 7, 3) USING TTL 600", (key,))
    store.session.execute(
        f"INSERT INTO {legacy} (queue, client_id, message_id, shard, writer, since_batch, claim_deadline) "
        "VALUES (%s, 'old-intent', 'm-dead', 0, 'dead-writer', 1, %s) USING TTL 600",
        (key, datetime.now(timezone.utc) - timedelta(seconds=60)))

    (done,) = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish(
        [OutgoingMessage(b"x", client_id="old-done")])
    assert done.duplicate and (done.message_id, done.shard, done.batch, done.seq) == ("m-old", 0, 7, 3)
    # The dead writer's intent: two retries at two sidecars, one publish.
    retries = [Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)) for _ in range(2)]
    (one,), (two,) = await asyncio.gather(
        *(r.publish([OutgoingMessage(b"y", client_id="old-intent")]) for r in retries))
    assert (one.shard, one.batch, one.seq) == (two.shard, two.batch, two.seq)
    assert [one.duplicate, two.duplicate].count(False) == 1
    assert copies_of(store, "old-intent") == [(one.shard, one.batch, one.seq)]
    assert copies_of(store, "old-done") == []
    # Once the operator drops the old table, sidecars that still look there stop looking.
    store.session.execute(f"DROP TABLE {legacy}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    (fresh,) = await retries[0].publish([OutgoingMessage(b"z", client_id="new-1")])
    assert not fresh.duplicate and copies_of(store, "new-1") == [(fresh.shard, fresh.batch, fresh.seq)]


async def test_producer_keys_are_kept_as_client_ids_where_the_operator_has_not_made_their_table(
    store: Store,
) -> None:
    """A sidecar upgraded before the operator finds no `producer_seqs`: it keeps producer
    keys in `client_ids` like any id, so they are still published once, at an id's cost."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    store.session.execute(f"DROP TABLE {store.keyspace}.{PRODUCER_SEQS_TABLE}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    messages = [OutgoingMessage(f"m{n}".encode(), client_id=producer_key("old-operator", n)) for n in range(3)]
    first = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish(messages)
    again = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish(messages)
    assert not any(r.duplicate for r in first) and all(r.duplicate for r in again)
    assert [(r.shard, r.batch, r.seq) for r in again] == [(r.shard, r.batch, r.seq) for r in first]
    for message, result in zip(messages, first):
        assert message.client_id is not None
        assert copies_of(store, message.client_id) == [(result.shard, result.batch, result.seq)]


async def test_an_intent_whose_writers_row_never_landed_is_taken_over_once_its_window_passed(
    store: Store, key_with_writer_row: Key, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intents of a batch land but its writer's row does not (the process dies between
    them): claims start only once both are written, so once the claim window has passed a
    retry publishes, once."""
    key = key_with_writer_row
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    monkeypatch.setattr(idempotency, "CLAIM_SECONDS", 0.5)
    crashing = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))

    async def dies_before_the_writers_row(*args: object) -> None:
        raise Crash()

    monkeypatch.setattr(crashing.idempotency, "_write_writer", dies_before_the_writers_row)
    with pytest.raises(Crash):
        await crashing.publish([OutgoingMessage(b"pay", client_id=key("order-13"))])
    await until("the intent", lambda: intent_of(store, key("order-13")) is not None)
    assert copies_of(store, key("order-13")) == []
    retries = [Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)) for _ in range(2)]
    (one,), (two,) = await asyncio.gather(
        *(r.publish([OutgoingMessage(b"pay", client_id=key("order-13"))]) for r in retries))
    assert (one.shard, one.batch, one.seq) == (two.shard, two.batch, two.seq)
    assert [one.duplicate, two.duplicate].count(False) == 1
    assert copies_of(store, key("order-13")) == [(one.shard, one.batch, one.seq)]


def publisher_id_preferring(shard: int, shards: int) -> str:
    """A publisher id whose preferred shard (unkeyed messages) is `shard`."""
    return next(f"p{n}" for n in range(1000) if zlib.crc32(f"p{n}".encode()) % shards == shard)


def publishers_preferring_two_shards(store: Store) -> tuple[Publisher, Publisher]:
    """Two publishers (sidecars) of a two-shard queue, preferring shard 0 and shard 1."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    state = catalog.read_queue(store, QUEUE)
    return (Publisher(store, QUEUE, state, publisher_id=publisher_id_preferring(0, 2)),
            Publisher(store, QUEUE, state, publisher_id=publisher_id_preferring(1, 2)))


class PausedClaims:
    """Claims of chosen publishers held where a stopped process (SIGSTOP, a long pause) would
    hold them: past the claim window's check, not yet sent to Cassandra."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: dict[int, tuple[asyncio.Event, asyncio.Event]] = {}
        claim = Log.claim

        async def held_claim(log: Log, *args: Any, **kwargs: Any) -> Claim:
            events = self.held.get(id(log))
            if events is not None:
                waiting, resume = events
                waiting.set()
                await resume.wait()
            return await claim(log, *args, **kwargs)

        monkeypatch.setattr(Log, "claim", held_claim)

    def hold(self, publisher: Publisher) -> tuple[asyncio.Event, asyncio.Event]:
        """(set once a claim is held, set to let it go)."""
        events = self.held[id(publisher.log)] = (asyncio.Event(), asyncio.Event())
        return events


@pytest.fixture
def short_claim_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough that a loaded machine still gets from the intent to the claim within it.
    monkeypatch.setattr(idempotency, "CLAIM_SECONDS", 3.0)
    monkeypatch.setattr(idempotency, "DEADLINE_SECONDS", 6.0)
    monkeypatch.setattr(idempotency, "CLOCK_SKEW_SECONDS", 0.5)


async def test_a_claim_sent_late_by_a_paused_first_attempt_loses_to_the_retrys_fence(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch, short_claim_window: None
) -> None:
    """The first attempt checks its claim window, then its process stops before the claim
    leaves. The client retries through a sidecar that prefers another shard; the window
    passes and the retry publishes. When the first attempt resumes, its claim goes out:
    it must not land the message a second time."""
    paused, retry = publishers_preferring_two_shards(store)
    claims = PausedClaims(monkeypatch)
    claiming, resume = claims.hold(paused)
    first = asyncio.create_task(paused.publish([OutgoingMessage(b"pay", client_id=key("order-14"))]))
    await asyncio.wait_for(claiming.wait(), 60)
    (second,) = await retry.publish([OutgoingMessage(b"pay", client_id=key("order-14"))])
    assert not second.duplicate and retry.idempotency.resolved_intents == 1
    resume.set()
    with pytest.raises(BackendUnavailable):  # its claim lost; past its window it sends no other
        await first
    assert copies_of(store, key("order-14")) == [(second.shard, second.batch, second.seq)]
    # The client's next retry, back at the first sidecar, gets the one publish.
    (third,) = await paused.publish([OutgoingMessage(b"pay", client_id=key("order-14"))])
    assert third.duplicate and (third.message_id, third.shard, third.batch, third.seq) == (
        second.message_id, second.shard, second.batch, second.seq)


async def test_a_late_claim_that_wins_the_fence_is_the_publish_every_retry_answers(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch, short_claim_window: None
) -> None:
    """As above, but the first attempt's late claim reaches Cassandra before the retry's own
    claim: the retry answers the first attempt's position. Its sidecar dies before recording
    that; a third retry still finds it, through the writers the retry's intent replaced."""
    paused, retry = publishers_preferring_two_shards(store)
    claims = PausedClaims(monkeypatch)
    first_claiming, first_resume = claims.hold(paused)
    retry_claiming, retry_resume = claims.hold(retry)
    first = asyncio.create_task(paused.publish([OutgoingMessage(b"pay", client_id=key("order-15"))]))
    await asyncio.wait_for(first_claiming.wait(), 60)

    async def dies_before_recording(*args: object, **kwargs: object) -> Published:
        raise Crash()

    monkeypatch.setattr(retry.idempotency, "complete", dies_before_recording)
    second = asyncio.create_task(retry.publish([OutgoingMessage(b"pay", client_id=key("order-15"))]))
    await asyncio.wait_for(retry_claiming.wait(), 60)  # the id taken over, its fence claim about to go
    first_resume.set()
    (one,) = await first
    assert not one.duplicate
    retry_resume.set()
    with pytest.raises(Crash):
        await second
    assert copies_of(store, key("order-15")) == [(one.shard, one.batch, one.seq)]
    (third,) = await Publisher(store, QUEUE, catalog.read_queue(store, QUEUE)).publish([OutgoingMessage(b"pay", client_id=key("order-15"))])
    assert third.duplicate and (third.message_id, third.shard, third.batch, third.seq) == (
        one.message_id, one.shard, one.batch, one.seq)
    assert copies_of(store, key("order-15")) == [(one.shard, one.batch, one.seq)]


async def test_a_writers_row_landing_late_lets_no_claim_out_after_the_retry_published(
    store: Store, key_with_writer_row: Key, monkeypatch: pytest.MonkeyPatch, short_claim_window: None
) -> None:
    """The first attempt's intents land, its process stops before its writer's row does.
    The retry waits out the claim window, sees no row, and publishes; then the row lands
    and the first attempt resumes: it must send no claim."""
    key = key_with_writer_row
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    state = catalog.read_queue(store, QUEUE)
    paused = Publisher(store, QUEUE, state)
    write_writer = paused.idempotency._write_writer
    resume = asyncio.Event()

    async def stopped_before_the_writers_row(*args: Any, **kwargs: Any) -> None:
        await resume.wait()
        await write_writer(*args, **kwargs)

    monkeypatch.setattr(paused.idempotency, "_write_writer", stopped_before_the_writers_row)
    first = asyncio.create_task(paused.publish([OutgoingMessage(b"pay", client_id=key("order-16"))]))
    await until("the intent", lambda: intent_of(store, key("order-16")) is not None)
    retry = Publisher(store, QUEUE, state)
    (second,) = await retry.publish([OutgoingMessage(b"pay", client_id=key("order-16"))])
    assert not second.duplicate and retry.idempotency.resolved_intents == 1
    resume.set()
    with pytest.raises(BackendUnavailable):
        await first
    assert copies_of(store, key("order-16")) == [(second.shard, second.batch, second.seq)]


async def test_a_first_attempt_stopped_after_its_id_check_sends_nothing_once_its_window_passed(
    store: Store, key: Key, monkeypatch: pytest.MonkeyPatch, short_claim_window: None
) -> None:
    """The first attempt finds its id unpublished, then its process stops before it records
    an intent. The client gives up on it and retries through another sidecar, which finds
    nothing either and publishes. When the first attempt resumes, the window that its check
    opened is over: it must write no intent over the retry's record and send no claim."""
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    state = catalog.read_queue(store, QUEUE)
    paused = Publisher(store, QUEUE, state)
    lookup = paused.idempotency.lookup
    checked, resume = asyncio.Event(), asyncio.Event()
    stopped_at: list[float] = []

    async def stopped_after_the_check(client_ids: Any) -> Any:
        found = await lookup(client_ids)
        stopped_at.append(time.monotonic())
        checked.set()
        await resume.wait()
        return found

    monkeypatch.setattr(paused.idempotency, "lookup", stopped_after_the_check)
    first = asyncio.create_task(paused.publish([OutgoingMessage(b"pay", client_id=key("order-17"))]))
    await asyncio.wait_for(checked.wait(), 60)
    (second,) = await Publisher(store, QUEUE, state).publish([OutgoingMessage(b"pay", client_id=key("order-17"))])
    assert not second.duplicate
    await until("the first attempt's claim window over",
                lambda: time.monotonic() > stopped_at[0] + idempotency.CLAIM_SECONDS)
    resume.set()
    with pytest.raises(BackendUnavailable):
        await first
    monkeypatch.setattr(paused.idempotency, "lookup", lookup)
    assert copies_of(store, key("order-17")) == [(second.shard, second.batch, second.seq)]
    (third,) = await paused.publish([OutgoingMessage(b"pay", client_id=key("order-17"))])
    assert third.duplicate and (third.message_id, third.batch, third.seq) == (
        second.message_id, second.batch, second.seq)
