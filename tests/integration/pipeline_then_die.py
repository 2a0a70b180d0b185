"""A sidecar's queue service for the pipeline fault test: it receives orders and acks each
with the invoice lines it results in (`QueueService.ack_publishing`), and kills itself with
SIGKILL at a given step of that ack.

Usage: python -m tests.integration.pipeline_then_die KEYSPACE CQL_HOST:PORT ZK_HOSTS STEP [ORDERS]
STEP: `before-outputs` (nothing published yet), `between-outputs` (the first line written,
the others not), `before-ack` (every line written, the order not acked), or `survive`: ack
every order it gets until it has acked ORDERS of them, then exit 0. Prints one JSON line per
order received and per step reached, flushed before the kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence

from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage, Published
from casque.sidecar.config import SidecarSettings
from casque.sidecar.metrics import SidecarMetrics
from casque.sidecar.service import QueueService
from tests.integration.ack_then_die import connect_store, emit

ORDERS, SUBSCRIBER, LINES = "orders", "billing", "lines"
LINES_PER_ORDER = 3


def die() -> None:
    # No drain, no release, no flush: whatever the ack had left to do is lost now.
    os.kill(os.getpid(), signal.SIGKILL)


def lines_of(order: int) -> list[OutgoingMessage]:
    return [OutgoingMessage(json.dumps({"order": order, "line": i}).encode(), content_type="application/json")
            for i in range(LINES_PER_ORDER)]


def kill_at(service: QueueService, step: str) -> None:
    """Make the service's ack_publishing die at `step`, wrapping the calls it makes in order."""
    publish, ack = service.publish, service.ack

    async def publishing(queue: str, messages: Sequence[OutgoingMessage]) -> list[Published]:
        if step == "before-outputs":
            emit(kind="step", step=step)
            die()
        if step == "between-outputs":
            await publish(queue, messages[:1])
            emit(kind="step", step=step, written=1)
            die()
        return await publish(queue, messages)

    async def acking(queue: str, subscriber: str, receipts: Sequence[str]) -> list[bool | Exception]:
        if step == "before-ack":
            emit(kind="step", step=step)
            die()
        return list(await ack(queue, subscriber, receipts))

    service.publish = publishing  # type: ignore[method-assign]
    service.ack = acking  # type: ignore[method-assign, assignment]


async def consumer_of(service: QueueService) -> Consumer:
    for _ in range(1200):
        consumer = service.subscriptions[SUBSCRIBER].consumer
        if consumer is not None:
            return consumer
        await asyncio.sleep(0.05)
    raise SystemExit("the consumer did not start")


async def main(keyspace: str, cassandra: str, zk_hosts: str, step: str, orders: int) -> None:
    store = connect_store(keyspace, cassandra, zk_hosts)
    service = QueueService(store, SidecarSettings(queue=ORDERS, subscribers=[SUBSCRIBER]), SidecarMetrics())
    service.start()
    consumer = await consumer_of(service)
    if step != "survive":
        kill_at(service, step)
    acked: set[int] = set()
    while len(acked) < orders:
        # Long: a victim before this one holds the shard until its session expires, and its
        # order until the visibility it was given ends.
        deliveries = await consumer.receive(max_messages=1, wait=60)
        if not deliveries:
            raise SystemExit("nothing to receive")
        (delivery,) = deliveries
        order = json.loads(delivery.message.payload)["order"]
        emit(kind="delivery", order=order, count=delivery.delivery_count)
        published, outcome = await service.ack_publishing(ORDERS, SUBSCRIBER, delivery.receipt, LINES,
                                                          lines_of(order))
        if outcome is not True:
            raise SystemExit(f"order {order} not acked: {outcome!r}")
        assert published is not None
        emit(kind="acked", order=order, duplicates=[p.duplicate for p in published])
        acked.add(order)


if __name__ == "__main__":
    keyspace, cassandra, zk_hosts, step = sys.argv[1:5]
    asyncio.run(main(keyspace, cassandra, zk_hosts, step, int(sys.argv[5]) if len(sys.argv) > 5 else 1))
