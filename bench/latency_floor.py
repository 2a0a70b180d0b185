"""The least a message's trip from publisher to consumer costs on these backends, with the
drivers alone (cassandra-driver and kazoo, no casque code): bench_latency.py's floor.

A message is sent when it is handed to the writer, and arrives when a reader in the same
process has read it back. In between, only what any queue on Cassandra and ZooKeeper must do
to hand a durable message to a consumer that is not its publisher:
- a conditional write: the messages handed over meanwhile, side by side in one batch with a
  header row `IF NOT EXISTS` (one partition, one write in flight: a group commit);
- a ZooKeeper write: the batch's number set on a watermark znode (one write in flight, later
  numbers collapsed into the highest);
- a watch firing: the reader's own ZooKeeper session watches that znode;
- a read: the reader reads each batch up to the watermark, one partition read each.
No HTTP, ids, leases, claims, receipts or acks.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

from cassandra import ConsistencyLevel
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, ResponseFuture, Session
from cassandra.query import BatchStatement, BatchType
from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

TABLE = "latency_floor"
MAX_BATCH_MESSAGES = 100


def _awaitable(loop: asyncio.AbstractEventLoop, response: ResponseFuture) -> asyncio.Future[Any]:
    done: asyncio.Future[Any] = loop.create_future()

    def settle(set_outcome: Callable[[Any], None], outcome: Any) -> None:
        if not done.done():
            set_outcome(outcome)

    response.add_callbacks(lambda rows: loop.call_soon_threadsafe(settle, done.set_result, rows),
                           lambda error: loop.call_soon_threadsafe(settle, done.set_exception, error))
    return done


async def _zk_set(client: KazooClient, path: str, value: bytes) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished(result: Any) -> None:
        try:
            result.get()
        except Exception as error:  # handed to the waiting task
            loop.call_soon_threadsafe(lambda: done.done() or done.set_exception(error))
        else:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    client.set_async(path, value).rawlink(finished)
    await done


class Backends:
    """One Cassandra session and two ZooKeeper sessions (the writer's and the reader's)."""

    def __init__(self, cassandra: str, zookeeper: str, keyspace: str) -> None:
        host, _, port = cassandra.rpartition(":")
        profile = ExecutionProfile(consistency_level=ConsistencyLevel.ONE, request_timeout=10.0)
        self.cluster = Cluster([host], port=int(port), protocol_version=5,
                               execution_profiles={EXEC_PROFILE_DEFAULT: profile},
                               sockopts=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.session: Session = self.cluster.connect()
        self.keyspace = keyspace
        self.session.execute(f"CREATE TABLE IF NOT EXISTS {keyspace}.{TABLE} (shard int, number bigint, seq int, "
                             "sent double, PRIMARY KEY ((shard, number), seq))")
        self.writer_zk = KazooClient(hosts=zookeeper)
        self.reader_zk = KazooClient(hosts=zookeeper)
        self.writer_zk.start()
        self.reader_zk.start()

    def close(self) -> None:
        for client in (self.writer_zk, self.reader_zk):
            client.stop()
            client.close()
        self.cluster.shutdown()


class Trip:
    """One stream of messages through the floor, on a shard and a watermark znode of its own.
    `arrived` holds each message's trip (seconds), by the order it was sent in."""

    def __init__(self, backends: Backends, shard: int, znode: str) -> None:
        self._backends = backends
        self._shard = shard
        self._znode = znode
        self._loop = asyncio.get_running_loop()
        session, keyspace = backends.session, backends.keyspace
        self._header = session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq) VALUES (?, ?, -1) "
                                       "IF NOT EXISTS")
        self._row = session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq, sent) VALUES (?, ?, ?, ?)")
        self._select = session.prepare(f"SELECT seq, sent FROM {keyspace}.{TABLE} WHERE shard = ? AND number = ? "
                                       "AND seq >= 0")
        self._pending: list[float] = []
        self._writing: asyncio.Task[None] | None = None
        self._written = 0
        self._head_target = 0
        self._head_task: asyncio.Task[None] | None = None
        self._head_seen = 0
        self._read_to = 0
        self._reading: asyncio.Task[None] | None = None
        self.arrived: list[float] = []
        self.all_arrived = asyncio.Event()
        self._expected = 0
        self.failure: BaseException | None = None

    async def start(self, expected: int) -> None:
        self._expected = expected
        await asyncio.to_thread(self._backends.writer_zk.ensure_path, self._znode)
        DataWatch(self._backends.reader_zk, self._znode, self._watched)

    def send(self) -> None:
        self._pending.append(time.perf_counter())
        if self._writing is None or self._writing.done():
            self._writing = self._loop.create_task(self._write())

    async def _write(self) -> None:
        while self._pending:
            sent, self._pending = self._pending[:MAX_BATCH_MESSAGES], self._pending[MAX_BATCH_MESSAGES:]
            batch = self._written + 1
            statement = BatchStatement(batch_type=BatchType.UNLOGGED, serial_consistency_level=ConsistencyLevel.SERIAL)
            statement.add(self._header, (self._shard, batch))
            for seq, at in enumerate(sent):
                statement.add(self._row, (self._shard, batch, seq, at))
            rows = await self._guarded(_awaitable(self._loop, self._backends.session.execute_async(statement)))
            # The callback's rows are the first page: a list, the [applied] column first.
            if rows is None or not rows[0][0]:
                self._fail(RuntimeError(f"floor batch {batch} not applied"))
                return
            self._written = batch
            self._head_target = batch
            if self._head_task is None or self._head_task.done():
                self._head_task = self._loop.create_task(self._advance())

    async def _advance(self) -> None:
        written = 0
        while written < self._head_target:
            written = self._head_target
            await self._guarded(_zk_set(self._backends.writer_zk, self._znode, str(written).encode()))

    def _watched(self, data: bytes | None, *_: object) -> None:
        # In kazoo's thread: the reader's loop takes it from here.
        if data:
            self._loop.call_soon_threadsafe(self._head_moved, int(data))

    def _head_moved(self, head: int) -> None:
        self._head_seen = max(self._head_seen, head)
        if self._reading is None or self._reading.done():
            self._reading = self._loop.create_task(self._read())

    async def _read(self) -> None:
        while self._read_to < self._head_seen:
            batch = self._read_to + 1
            rows = await self._guarded(_awaitable(self._loop, self._backends.session.execute_async(
                self._select, (self._shard, batch))))
            if rows is None:
                return
            now = time.perf_counter()
            self.arrived.extend(now - sent for _, sent in rows)
            self._read_to = batch
        if len(self.arrived) >= self._expected:
            self.all_arrived.set()

    async def _guarded(self, work: Any) -> Any:
        try:
            return await work
        except Exception as error:  # the run ends with it
            self._fail(error)
            return None

    def _fail(self, error: BaseException) -> None:
        self.failure = error
        self.all_arrived.set()
