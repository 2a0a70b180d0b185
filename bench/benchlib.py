"""What the benchmarks share: the load pipeline, the raw driver limit, percentiles."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from casque.config import Settings
from casque.schema import bucket_of
from casque.store import Store


async def pipeline(count: int, window: int, submit: Callable[[int], Awaitable[Any]]) -> float:
    """Run submit(i) for i < count with `window` calls in flight; returns seconds."""
    next_index = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            await submit(i)

    await asyncio.gather(*(worker() for _ in range(window)))
    return time.perf_counter() - started


def raw_insert_rate(store: Store, table: str, count: int, payload: bytes, window: int = 256) -> float:
    """Single-row inserts of message-like rows through the driver's own callback pipeline
    (its fastest form, no asyncio), `window` in flight: the node's write limit here."""
    insert = store.session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    now = datetime.now(timezone.utc)
    slots = threading.Semaphore(window)
    finished = threading.Event()
    remaining = [count]
    lock = threading.Lock()

    def done(_: object = None) -> None:
        slots.release()
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                finished.set()

    started = time.perf_counter()
    for i in range(count):
        slots.acquire()
        batch = 1 + i // 100
        future = store.session.execute_async(insert, (900 + i % 4, bucket_of(batch), batch, i % 100, str(i), now, payload))
        future.add_callbacks(done, done)
    finished.wait()
    return count / (time.perf_counter() - started)


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000


def arguments(description: str, messages: int, size: int) -> argparse.ArgumentParser:
    """The options every benchmark takes: load size and where the local stack listens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--messages", type=int, default=messages)
    parser.add_argument("--size", type=int, default=size)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cassandra", default="127.0.0.1:9042")
    parser.add_argument("--zookeeper", default="127.0.0.1:2181")
    return parser


def scratch_settings(cassandra: str, zookeeper: str) -> Settings:
    """Settings for a keyspace and znode root of the benchmark's own (see `drop_scratch`)."""
    host, _, port = cassandra.rpartition(":")
    keyspace = f"bench_{uuid.uuid4().hex[:8]}"
    return Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency="ONE",
                    keyspace=keyspace, zookeeper_hosts=zookeeper, zookeeper_root=f"/bench-{keyspace}")


def drop_scratch(store: Store, settings: Settings) -> None:
    store.session.execute(f"DROP KEYSPACE IF EXISTS {settings.keyspace}")
    store.zk.delete(settings.zookeeper_root, recursive=True)
