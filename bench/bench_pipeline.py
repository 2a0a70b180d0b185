"""Acks that publish: what the derived keys of a pipeline's outputs cost, beside the same
work done without them.

    python bench/bench_pipeline.py [--messages 2000] [--shards 4] [--runs 3] [--json] [--smoke]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. Each
run publishes `--messages` orders, and a member of the subscriber `billing` receives them
(10 a call) and handles each as an app would, 32 at a time: it publishes two invoice lines to
another queue and then acks the order. Twice, on fresh orders: plainly (the outputs without
idempotency keys, an ack after), and as an ack that publishes does
(QueueService.ack_publishing: the outputs keyed by casque.engine.pipelines.keyed_outputs,
which makes the publish record an intent per key and the key once its batch is written).

Figures, per phase: CQL requests per output (every request this process sent, counted by the
driver's request listener: the consumer's reads and ack rows, the publishes, the keys),
process CPU µs per input (all threads), and inputs per second; then the pipeline's extra
requests per output and its CPU over the plain phase's, within the run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchlib import Figure, arguments, drop_scratch, parse, repeat_async, report, scratch_settings

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import Delivery, OutgoingMessage
from casque.engine.pipelines import keyed_outputs
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

ORDERS, INVOICES = QueueRef("default", "orders"), QueueRef("default", "invoices")
SUBSCRIBER = "billing"
OUTPUTS = 2
IN_FLIGHT = 32
RECEIVE_MAX = 10

FIGURES = [
    Figure("plain_requests", "plain: CQL requests per output (publish, then ack)", ""),
    Figure("keyed_requests", "pipeline: CQL requests per output (keyed outputs, then ack)", ""),
    Figure("extra_requests", "pipeline's extra requests per output", ""),
    Figure("plain_cpu", "plain: process CPU per input (2 outputs)", "µs"),
    Figure("keyed_cpu", "pipeline: process CPU per input (2 outputs)", "µs"),
    Figure("cpu_ratio", "pipeline CPU / plain CPU", "x"),
    Figure("plain_rate", "plain: inputs per second", "msgs/s"),
    Figure("keyed_rate", "pipeline: inputs per second", "msgs/s"),
]


class Requests:
    """Every request the session sends, counted as it is made."""

    def __init__(self, store: Store) -> None:
        self.count = 0
        store.session.add_request_init_listener(self._made)

    def _made(self, _: Any) -> None:
        self.count += 1


async def handle_all(consumer: Consumer, outputs_of: Any, invoices: Publisher, messages: int) -> None:
    """Receive `messages` orders and handle each: publish its outputs, then ack it."""
    slots = asyncio.Semaphore(IN_FLIGHT)
    handled = 0
    tasks: set[asyncio.Task[None]] = set()

    async def handle(delivery: Delivery) -> None:
        nonlocal handled
        try:
            await invoices.publish(outputs_of(consumer, delivery))
            assert await consumer.ack(delivery.receipt)
            handled += 1
        finally:
            slots.release()

    received = 0
    while received < messages:
        for delivery in await consumer.receive(max_messages=RECEIVE_MAX, wait=5):
            await slots.acquire()
            task = asyncio.create_task(handle(delivery))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            received += 1
    await asyncio.gather(*tasks)
    assert handled == messages


def lines(delivery: Delivery) -> list[OutgoingMessage]:
    return [OutgoingMessage(delivery.message.payload + b"/line-%d" % i, key=delivery.message.key)
            for i in range(OUTPUTS)]


def plain(_: Consumer, delivery: Delivery) -> list[OutgoingMessage]:
    return lines(delivery)


def keyed(consumer: Consumer, delivery: Delivery) -> list[OutgoingMessage]:
    return keyed_outputs(lines(delivery), consumer.subscriber_state.ack_key(SUBSCRIBER), delivery.message.message_id,
                         consumer.queue_state.spec.retention_seconds)


async def once(store: Store, args: Any, requests: Requests) -> dict[str, float]:
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE")
    for queue in (ORDERS, INVOICES):
        await asyncio.to_thread(catalog.apply_queue, store, queue, spec)
    await asyncio.to_thread(catalog.apply_subscriber, store, ORDERS, SUBSCRIBER,
                            SubscriberSpec(queue=ORDERS.name, start_position="earliest"))
    orders = Publisher(store, ORDERS, await asyncio.to_thread(catalog.read_queue, store, ORDERS))
    invoices = Publisher(store, INVOICES, await asyncio.to_thread(catalog.read_queue, store, INVOICES))
    consumer = Consumer(store, ORDERS, SUBSCRIBER)
    await consumer.start()
    figures: dict[str, float] = {}
    try:
        for name, outputs_of in (("plain", plain), ("keyed", keyed)):
            for start in range(0, args.messages, 100):
                count = min(100, args.messages - start)
                await orders.publish([OutgoingMessage(b"order-%d" % (start + i), key=f"c{(start + i) % 50}")
                                      for i in range(count)])
            await orders.flush_heads()
            sent, cpu, wall = requests.count, time.process_time(), time.perf_counter()
            await handle_all(consumer, outputs_of, invoices, args.messages)
            wall, cpu, sent = time.perf_counter() - wall, time.process_time() - cpu, requests.count - sent
            figures[f"{name}_requests"] = sent / (args.messages * OUTPUTS)
            figures[f"{name}_cpu"] = cpu / args.messages * 1e6
            figures[f"{name}_rate"] = args.messages / wall
    finally:
        await consumer.stop()
        for queue in (ORDERS, INVOICES):
            await asyncio.to_thread(catalog.delete_queue, store, queue, "Delete")
    figures["extra_requests"] = figures["keyed_requests"] - figures["plain_requests"]
    figures["cpu_ratio"] = figures["keyed_cpu"] / figures["plain_cpu"]
    return figures


async def main() -> None:
    args = parse(arguments((__doc__ or "").splitlines()[0], messages=2000, size=0), smoke_messages=100)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = await asyncio.to_thread(Store.open, settings)
    try:
        await asyncio.to_thread(catalog.ensure_installation, store)
        requests = Requests(store)
        samples = await repeat_async(args.runs, lambda run: once(store, args, requests))
    finally:
        await asyncio.to_thread(drop_scratch, store, settings)
        await asyncio.to_thread(store.close)
    report("pipeline", args, {"messages": args.messages, "outputs per input": OUTPUTS, "in flight": IN_FLIGHT},
           FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
