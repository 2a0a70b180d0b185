"""What a message stuck at the head of a subscriber costs the sidecar: a constant.

A poison message, nacked every time it is delivered, keeps the subscriber's offset from
moving; 20,000 messages published behind it, five times what a member may hold loaded, are
received and acked through the sidecar's HTTP API. The engine's own accounting
(casque.engine.shard_state) must show only what is live: no batch held that has no message left to deliver, the loaded messages within the
prefetch budget, and heaps that stale entries cannot grow without bound. (A marker per
completed batch behind the stuck message, ~740 bytes each, ran a 256 MiB sidecar out of
memory within minutes at 1,000 batches a second.)
"""

from __future__ import annotations

import pytest

from casque.engine import batches, catalog, shard_reader, sharing
from casque.engine.heaps import HEAP_FLOOR, HEAP_SLACK
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.sidecar.app import service_of
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.integration.test_sidecar import (
    QUEUE,
    REF,
    SUB,
    SUBSCRIBER,
    MakeSidecar,
    call,
    make_sidecar as make_sidecar,  # the fixture
)

# Five times the most a member holds loaded (sharing.MAX_LOADED_MESSAGES plus a claim): a
# reader that kept what it passed would go over the budget, and one that kept a batch per
# completed batch would hold about 200 of them.
BEHIND = 20_000
BATCH = 100  # messages per publish, so one batch each: 200 batches behind the poison


@pytest.mark.parametrize("delivery", ["leased", "shared"])
async def test_a_poison_message_nacked_behind_20000_messages_holds_only_itself(
    store: Store, make_sidecar: MakeSidecar, delivery: str
) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=30, delivery=delivery))
    publisher = Publisher(store, REF, catalog.read_queue(store, REF))
    (poison,) = await publisher.publish([OutgoingMessage(b'"poison"', content_type="application/json")])
    for start in range(0, BEHIND, BATCH):
        await publisher.publish([OutgoingMessage(b"%d" % n, content_type="application/json")
                                 for n in range(start, start + BATCH)])
    client = await make_sidecar()
    consumer = service_of(client.app).subscriptions[SUBSCRIBER].consumer
    assert consumer is not None
    # A leased reader reads on while it holds fewer than its prefetch, a read at a time; a
    # shared member claims on while it holds fewer than its maximum, a range at a time.
    budget = (shard_reader.PREFETCH_MESSAGES + batches.READ_ROWS if delivery == "leased"
              else sharing.MAX_LOADED_MESSAGES + sharing.CLAIM_MESSAGES + BATCH)
    acked = nacks = peak_loaded = 0
    while acked < BEHIND:
        messages = (await call(client, f"{SUB}/receive", {"max": 100, "wait": 1}))["messages"]
        others = [m["receipt"] for m in messages if m["messageid"] != poison.message_id]
        for m in messages:
            if m["messageid"] == poison.message_id:
                await call(client, f"{SUB}/nack", {"receipt": m["receipt"]})
                nacks += 1
        if others:
            results = (await call(client, f"{SUB}/ack", {"receipts": others}))["results"]
            assert all(r["status"] == "acked" for r in results), results
            acked += len(others)
        states = [source.state for source in consumer.sources()]
        loaded = sum(s.loaded_messages for s in states)
        peak_loaded = max(peak_loaded, loaded)
        for state in states:
            # Every batch held has a message left to deliver: none is kept for being behind.
            empty = [number for number, loaded in state.batches.items() if not loaded.entries]
            assert not empty, f"{len(empty)} batches held with nothing left to deliver, e.g. {empty[:3]}"
            # Stale heap entries (one per nack) are compacted away: three heaps, each bounded.
            assert state.heap_entries <= 3 * (HEAP_FLOOR + HEAP_SLACK * state.loaded_messages + 1)
    assert nacks > 1, "the poison message was not delivered over and over"
    assert peak_loaded <= budget, f"{peak_loaded} messages loaded at once; the budget is {budget}"
    # All that is left is the poison message in its own batch.
    states = [source.state for source in consumer.sources()]
    assert sum(s.loaded_messages for s in states) == 1
    assert sum(len(s.batches) for s in states) == 1
