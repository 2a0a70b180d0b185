"""What one message costs when messages come one at a time: CPU seconds and backend requests
per message, by delivery mode, in the engine alone.

    python bench/trickle_cost.py [--modes leased,shared,ordered] [--rate 50] [--messages 1000] [--members 1]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

First the floor of one request: a prepared INSERT at a time, back to back, CPU per request.
Then one process runs a publisher and `--members` members of a subscriber (each of two receive
loops that ack at once) on a two-shard queue, in a keyspace of its own, dropped at the end. It
publishes one message per call at `--rate`, waits until every one was received, and prints for
each mode: this process's CPU per message by thread (from /proc), the whole machine's busy CPU
per message (Cassandra and ZooKeeper included, when nothing else runs), the publish -> receive
p50 and p90, and each kind of Cassandra statement and ZooKeeper request per message.

At a trickle nothing is shared between messages: each request costs the drivers a round
trip of their own threads, and the requests per message are the cost. Nothing is judged;
docs/performance.md keeps what it found.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import cassandra.cluster
import kazoo.client

from casque.backends import cql
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import drop_scratch, scratch_settings

MODES = {"leased": ("leased", False), "shared": ("shared", False), "ordered": ("shared", True)}
LOOPS = 2
WARM_UP = 30
ZOOKEEPER_CALLS = ("get_async", "set_async", "exists_async", "create_async", "delete_async", "get_children_async")


class Requests:
    """The backend requests this process sends, counted by kind while `counting`."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.counting = False

    def note(self, kind: str) -> None:
        if self.counting:
            self.counts[kind] += 1

    def install(self) -> None:
        """Wrap the drivers' entry points (every call of the engine goes through them)."""
        execute_async = cassandra.cluster.Session.execute_async

        def counted_execute(session: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            self.note("CQL " + statement_kind(query))
            return execute_async(session, query, *args, **kwargs)

        cassandra.cluster.Session.execute_async = counted_execute
        for name in ZOOKEEPER_CALLS:
            setattr(kazoo.client.KazooClient, name, self._counted_zookeeper(name))
        commit_async = kazoo.client.TransactionRequest.commit_async

        def counted_commit(transaction: Any) -> Any:
            operations = sorted({type(op).__name__ for op in transaction.operations})
            self.note(f"ZK multi ({', '.join(operations)})")
            return commit_async(transaction)

        kazoo.client.TransactionRequest.commit_async = counted_commit

    def _counted_zookeeper(self, name: str) -> Callable[..., Any]:
        original = getattr(kazoo.client.KazooClient, name)

        def counted(client: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            self.note(f"ZK {name.removesuffix('_async')} {znode_kind(path)}")
            return original(client, path, *args, **kwargs)

        return counted


def statement_kind(query: Any) -> str:
    """A statement's first words and table, without the keyspace: `INSERT INTO checkpoints`."""
    text = query if isinstance(query, str) else getattr(query, "query_string", None)
    if text is None and getattr(query, "prepared_statement", None) is not None:
        text = query.prepared_statement.query_string
    if text is None:
        return type(query).__name__
    words = text.split()
    table = next((w for w in words if "." in w), "").split(".")[-1].split("(")[0]
    if table.startswith("m_"):
        table = "(the queue's messages)"
    return " ".join(words[:2] + ([table] if table else []))


def znode_kind(path: str) -> str:
    """A znode path's last two names, numbers and sequential names as N: `.../offsets/N`."""
    names = path.strip("/").split("/")[-2:]
    return ".../" + "/".join("N" if name.isdigit() or "-000" in name else name for name in names)


def thread_ticks() -> dict[int, int]:
    """Each thread's CPU so far (user + system, in clock ticks), by native id."""
    ticks = {}
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks[int(task)] = int(fields[11]) + int(fields[12])
    return ticks


def machine_busy_ticks() -> int:
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


async def receive_loop(consumer: Consumer, received: dict[bytes, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        got = await consumer.receive(max_messages=10, wait=0.5)
        for delivery in got:
            received.setdefault(delivery.message.payload, time.monotonic())
        if got:
            await consumer.ack_many([d.receipt for d in got])


async def driver_alone(store: Store, keyspace: str, count: int) -> None:
    """The floor of a request: one prepared INSERT at a time through casque's `cql.execute`,
    back to back, nothing else under way; CPU per request of this thread and the others."""
    session, table = store.session, f"{keyspace}.trickle_floor"
    session.execute(f"CREATE TABLE IF NOT EXISTS {table} (k int, c int, v text, PRIMARY KEY (k, c))")
    insert = session.prepare(f"INSERT INTO {table} (k, c, v) VALUES (?, ?, ?)")
    for c in range(100):
        await cql.execute(session, insert, (0, c, "x"))
    caller = threading.get_native_id()
    before = thread_ticks()
    for c in range(count):
        await cql.execute(session, insert, (1, c, "x"))
    spent = {tid: ticks - before.get(tid, 0) for tid, ticks in thread_ticks().items()}
    per_request = 1e6 / os.sysconf("SC_CLK_TCK") / count
    own = spent.pop(caller, 0)
    print(f"one INSERT at a time, {count} back to back: CPU {(own + sum(spent.values())) * per_request:.0f} µs "
          f"a request ({own * per_request:.0f} in the caller's thread, {sum(spent.values()) * per_request:.0f} in "
          "the drivers' threads)")


async def measure(store: Store, requests: Requests, mode: str, args: argparse.Namespace) -> None:
    delivery, ordered = MODES[mode]
    queue = QueueRef("default", f"trickle-{mode}")
    catalog.apply_queue(store, queue, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, queue, "app", SubscriberSpec(
        queue=queue.name, start_position="earliest", visibility_timeout_seconds=30, delivery=delivery,
        ordered_keys=ordered))
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    consumers = [Consumer(store, queue, "app") for _ in range(args.members)]
    for consumer in consumers:
        await consumer.start()
    received: dict[bytes, float] = {}
    stop = asyncio.Event()
    loops = [asyncio.create_task(receive_loop(consumer, received, stop))
             for consumer in consumers for _ in range(LOOPS)]
    try:
        for i in range(WARM_UP):
            await publisher.publish([OutgoingMessage(f"warm-{i}".encode(), key=f"k{i % 20}")])
        while len(received) < WARM_UP:
            await asyncio.sleep(0.01)
        sent: dict[bytes, float] = {}
        requests.counts.clear()
        requests.counting = True
        threads_before, machine_before = thread_ticks(), machine_busy_ticks()
        started = time.monotonic()
        for i in range(args.messages):
            payload = f"m-{i}".encode()
            sent[payload] = time.monotonic()
            await publisher.publish([OutgoingMessage(payload, key=f"k{i % 20}")])
            await asyncio.sleep(max(0.0, started + (i + 1) / args.rate - time.monotonic()))
        while not sent.keys() <= received.keys():
            await asyncio.sleep(0.01)
        threads_after, machine_after = thread_ticks(), machine_busy_ticks()
        requests.counting = False
    finally:
        stop.set()
        await asyncio.gather(*loops)
        for consumer in consumers:
            await consumer.stop()
        await publisher.flush_heads()
    report(mode, args, sent, received, threads_before, threads_after, machine_after - machine_before, requests)


def report(mode: str, args: argparse.Namespace, sent: dict[bytes, float], received: dict[bytes, float],
           before: dict[int, int], after: dict[int, int], machine: int, requests: Requests) -> None:
    per_message = 1e6 / os.sysconf("SC_CLK_TCK") / args.messages  # µs per tick per message
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    latencies = sorted((received[p] - at) * 1000 for p, at in sent.items())
    print(f"\n{mode} at {args.rate:g} msgs/s, {args.messages} messages one per call: publish -> receive "
          f"p50 {latencies[len(latencies) // 2]:.1f} ms, p90 {latencies[int(len(latencies) * 0.9)]:.1f} ms")
    spent = {tid: ticks - before.get(tid, 0) for tid, ticks in after.items()}
    for tid, ticks in sorted(spent.items(), key=lambda item: -item[1]):
        if ticks:
            print(f"  CPU {ticks * per_message:7.0f} µs/msg  thread {names.get(tid, tid)}")
    print(f"  CPU {sum(spent.values()) * per_message:7.0f} µs/msg  this process")
    print(f"  CPU {machine * per_message:7.0f} µs/msg  the machine (Cassandra and ZooKeeper included)")
    total = sum(requests.counts.values())
    for kind, count in requests.counts.most_common():
        print(f"  {count / args.messages:5.2f} per msg  {kind}")
    print(f"  {total / args.messages:5.2f} per msg  backend requests in all")


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", default="leased,shared,ordered")
    parser.add_argument("--rate", type=float, default=50.0, help="messages published a second, one per call")
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--members", type=int, default=1, help="members of the subscriber, each of two receive loops")
    parser.add_argument("--cassandra", default="127.0.0.1:9042")
    parser.add_argument("--zookeeper", default="127.0.0.1:2181")
    args = parser.parse_args()
    requests = Requests()
    requests.install()
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        await driver_alone(store, settings.keyspace, args.messages * 3)
        for mode in args.modes.split(","):
            await measure(store, requests, mode, args)
    finally:
        drop_scratch(store, settings)
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
