"""A message's history on the real servers: found from the moment its publish is answered."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest

from casque.engine import catalog, heads
from casque.engine.history import message_history
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

QUEUE = QueueRef("default", "traced")


async def test_a_shards_first_message_is_traced_before_the_shards_head_moves(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish is answered once its batch is durable; the shard's head follows in the
    background. A history read in between found every message but a shard's very first:
    with the head still 0 it searched nothing ("not published there")."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    head_may_move = asyncio.Event()
    write = heads.HeadAdvancer._write

    async def held_write(self: heads.HeadAdvancer, *args: object) -> int:
        await head_may_move.wait()
        return await write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(heads.HeadAdvancer, "_write", held_write)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    try:
        (first,) = await publisher.publish([OutgoingMessage(b"first")])
        assert catalog.read_int(store, store.paths(QUEUE).head(0)) == 0
        history = await message_history(store, QUEUE, first.message_id)
        assert (history.state, history.position.batch) == ("logged", first.batch)  # type: ignore[union-attr]
    finally:
        head_may_move.set()
        await publisher.flush_heads()
        catalog.delete_queue(store, QUEUE, "Delete")


async def test_a_message_published_with_a_delivery_time_long_past_is_traced(store: Store) -> None:
    """A delivery time already past means "at once". The message's id carried that past time,
    and history searched the log from there for a batch written within SEARCH_AFTER of it:
    an hour past, none was, and a message just published was "not published there"."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    try:
        past = datetime.now(timezone.utc) - timedelta(hours=1)
        (late,) = await publisher.publish([OutgoingMessage(b"overdue", deliver_at=past)])
        assert late.batch >= 1  # into the log at once
        history = await message_history(store, QUEUE, late.message_id)
        assert (history.state, history.position.batch) == ("logged", late.batch)  # type: ignore[union-attr]
    finally:
        await publisher.flush_heads()
        catalog.delete_queue(store, QUEUE, "Delete")


async def test_an_ephemeral_messages_history_says_expired_after_its_ttl(store: Store) -> None:
    """An ephemeral message's rows were written with its TTL and went with it, so its history,
    asked for a moment later, was "not found" for a message the publish had just answered
    (a fuzzer's stateful run found it). They are kept a while past it, and the history says
    what happened: logged, expired for the subscriber that never received it."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, QUEUE, "late", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    try:
        (ephemeral,) = await publisher.publish([OutgoingMessage(b"for a second", ttl_seconds=1)])
        # Cassandra counts a TTL from the write, which is before the answer: 2 s after the
        # answer, a row written with the message's TTL alone is gone.
        await asyncio.sleep(2)
        history = await message_history(store, QUEUE, ephemeral.message_id)
        assert history.state == "logged" and history.expires_at is not None
        assert history.expires_at <= datetime.now(timezone.utc)
        assert [(s.subscriber, s.state) for s in history.subscribers] == [("late", "expired")]
    finally:
        await publisher.flush_heads()
        catalog.delete_queue(store, QUEUE, "Delete")
