"""The least a durable queue costs with these drivers: aiohttp, the Cassandra driver and kazoo.

    CASQUE_*=... python bench/driver_floor_server.py

Run as its own process on the sidecar's event loop setup (uvloop, an AppRunner without
access log, the same keep-alive and header limits) and connected as the sidecar connects
(`Store.open` with the same settings, so the same driver options), it answers the sidecar's
publish, receive and ack requests after doing only what any queue on these backends must do
before answering them:
- publish: read the body and decode its JSON, give each message an id, write the messages of
  the requests side by side in one conditional batch (a header row `IF NOT EXISTS` and a row
  per message, one partition, as a claim writes them) and advance a watermark znode in
  ZooKeeper for readers (in the background, one write in flight, as the head is);
- receive: hand out messages in order from batches read whole, one partition read each,
  and render them with a receipt;
- ack: write an ack row per receipt, the acks of the calls side by side in one batch.
No idempotency, schema, metrics, leases, visibility timeouts, redelivery, offsets or
watches: one process, one shard, one reader, which learns the batches from its own writer.

What this process spends in CPU per message is what the components themselves cost per
message on this machine, at the batch sizes its own group commits reach: a floor no design on
these drivers goes below. bench_sidecar.py reports it beside the bare server's floor (which
stores nothing) and the sidecar. It logs `driver floor listening on http://...` once it
listens on the port the kernel gave it; `GET /stats` answers the batches and messages written
so far.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvloop
from aiohttp import web
from cassandra.query import BatchStatement, BatchType

from casque.backends import cql, zk
from casque.config import Settings
from casque.engine.messages import time_ordered_ids
from casque.store import Store

from bare_server import serve_until_stopped

TABLE = "driver_floor"
ACKS_TABLE = "driver_floor_acks"
# A call's messages are written in one batch; calls side by side share one up to this many.
MAX_BATCH_MESSAGES = 100
SHARD = 0


def _invalid(what: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"code": "invalid_request", "message": what}),
                              content_type="application/json")


class GroupCommit:
    """Calls side by side written in one batch by `write` (which answers the batch's number);
    each call waits for it."""

    def __init__(self, write: Callable[[list[Any]], Awaitable[int]]) -> None:
        self._write = write
        self._pending: deque[tuple[Sequence[Any], asyncio.Future[int]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0

    async def submit(self, items: Sequence[Any]) -> int:
        """Waits until `items` are written; the number of the batch that held them."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((items, done))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        while self._pending:
            calls = [self._pending.popleft()]
            size = len(calls[0][0])
            while self._pending and size + len(self._pending[0][0]) <= MAX_BATCH_MESSAGES:
                size += len(self._pending[0][0])
                calls.append(self._pending.popleft())
            try:
                batch = await self._write([item for items, _ in calls for item in items])
            except Exception as error:  # each waiting request is answered with it
                for _, done in calls:
                    done.set_exception(error)
                continue
            self.batches += 1
            self.items += size
            for _, done in calls:
                done.set_result(batch)


class LogWriter:
    """Messages, (id, payload) each, in one conditional batch per group; the watermark after."""

    def __init__(self, store: Store, head_path: str) -> None:
        self.commit = GroupCommit(self._write_batch)
        self._store = store
        self._head_path = head_path
        self.last_batch = 0
        # Resolved (and replaced) at each batch written: receives that found nothing wait on it.
        self.written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._head_target = 0
        self._head_task: asyncio.Task[None] | None = None
        session, keyspace = store.session, store.keyspace
        self._header = session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq) VALUES (?, ?, -1) "
                                       "IF NOT EXISTS")
        # Rows serialized as the sidecar's claims serialize them (cql.BatchRows: the driver's
        # own binding per row costs about as much again), so that this is a floor.
        self._rows = cql.BatchRows(session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq, id, data) "
                                                   "VALUES (?, ?, ?, ?, ?)"))

    async def _write_batch(self, items: list[tuple[str, bytes]]) -> int:
        batch = self.last_batch + 1
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        statement.add(self._header, (SHARD, batch))
        shared = self._rows.shared((SHARD, batch))
        for seq, (message_id, payload) in enumerate(items):
            self._rows.add(statement, shared, (seq, message_id, payload))
        if not cql.applied(await cql.execute(self._store.session, statement)):
            raise RuntimeError(f"batch {batch} was claimed by another writer")
        self.last_batch = batch
        self.written.set_result(None)
        self.written = asyncio.get_running_loop().create_future()
        self._head_target = batch
        if self._head_task is None or self._head_task.done():
            self._head_task = asyncio.get_running_loop().create_task(self._write_head())
        return batch

    async def _write_head(self) -> None:
        written = 0
        while written < self._head_target:
            written = self._head_target
            await zk.call(self._store.zk.set_async, self._head_path, str(written).encode())


class AckWriter:
    """Acks, (batch, seq) each, one row each, in one batch per group."""

    def __init__(self, store: Store) -> None:
        self.commit = GroupCommit(self._write_batch)
        self._store = store
        self._row = store.session.prepare(f"INSERT INTO {store.keyspace}.{ACKS_TABLE} (shard, number, seq) "
                                          "VALUES (?, ?, ?)")

    async def _write_batch(self, items: list[tuple[int, int]]) -> int:
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        for number, seq in items:
            statement.add(self._row, (SHARD, number, seq))
        await cql.execute(self._store.session, statement)
        return 0


class Reader:
    """Hands out the log's messages in order, reading each batch whole once its writer wrote it."""

    def __init__(self, store: Store, writer: LogWriter) -> None:
        self._store = store
        self._writer = writer
        self._read_to = 0
        self._ready: deque[tuple[int, int, str, bytes]] = deque()
        self._reading = asyncio.Lock()
        self._select = store.session.prepare(f"SELECT seq, id, data FROM {store.keyspace}.{TABLE} "
                                             "WHERE shard = ? AND number = ? AND seq >= 0")

    async def take(self, most: int, wait: float) -> list[tuple[int, int, str, bytes]]:
        """Up to `most` messages; when there are none, waits up to `wait` seconds for a batch."""
        taken = await self._take(most)
        if not taken and wait > 0:
            try:
                await asyncio.wait_for(asyncio.shield(self._writer.written), wait)
            except asyncio.TimeoutError:
                return []
            taken = await self._take(most)
        return taken

    async def _take(self, most: int) -> list[tuple[int, int, str, bytes]]:
        async with self._reading:
            while len(self._ready) < most and self._read_to < self._writer.last_batch:
                number = self._read_to + 1
                rows = await cql.execute(self._store.session, self._select, (SHARD, number),
                                         cql.tuple_rows(self._store.session))
                self._ready.extend((number, seq, message_id, data) for seq, message_id, data in rows.current_rows)
                self._read_to = number
        return [self._ready.popleft() for _ in range(min(most, len(self._ready)))]


def _result(message_id: str, batch: int, seq: int) -> dict[str, object]:
    return {"messageId": message_id, "shard": SHARD, "batch": batch, "seq": seq, "duplicate": False}


def _delivery(queue: str, number: int, seq: int, message_id: str, data: bytes) -> dict[str, object]:
    return {"specversion": "1.0", "id": message_id, "source": f"/casque/default/{queue}", "type": "casque.message",
            "datacontenttype": "text/plain", "data": data.decode(), "messageid": message_id,
            "receipt": f"{number}-{seq}", "shard": SHARD, "batch": number, "seq": seq, "deliverycount": 1}


def _payloads(messages: list[object]) -> list[tuple[str, bytes]]:
    """Each message's id (made as the sidecar makes them) and its data."""
    payloads = []
    for message in messages:
        data = message.get("data") if isinstance(message, dict) else None
        if not isinstance(data, str):
            raise _invalid("a message needs data")
        payloads.append(data.encode())
    return list(zip(time_ordered_ids(len(payloads), time.time()), payloads))


def _receipt(text: object) -> tuple[int, int]:
    number, _, seq = str(text).partition("-")
    if not (number.isdigit() and seq.isdigit()):
        raise _invalid(f"not a receipt: {text!r}")
    return int(number), int(seq)


def routes(writer: LogWriter, reader: Reader, acks: AckWriter) -> web.Application:
    async def publish(request: web.Request) -> web.Response:
        messages = _payloads([json.loads(await request.read())])
        batch = await writer.commit.submit(messages)
        return web.json_response(_result(messages[0][0], batch, 0))

    async def publish_batch(request: web.Request) -> web.Response:
        messages = _payloads(json.loads(await request.read()).get("messages", []))
        batch = await writer.commit.submit(messages)
        # The seqs within the batch are the call's own order: enough for an answer's shape.
        return web.json_response({"results": [_result(m[0], batch, seq) for seq, m in enumerate(messages)]})

    async def receive(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        taken = await reader.take(body.get("max", 10), body.get("wait", 0))
        queue = request.match_info["queue"]
        return web.json_response({"messages": [_delivery(queue, *message) for message in taken]})

    async def ack(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        receipts = body["receipts"] if "receipts" in body else [body.get("receipt")]
        await acks.commit.submit([_receipt(receipt) for receipt in receipts])
        return web.json_response({"results": [{"receipt": receipt, "status": "acked"} for receipt in receipts]})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"batches": writer.commit.batches, "messages": writer.commit.items,
                                  "ack_batches": acks.commit.batches, "acks": acks.commit.items})

    app = web.Application()
    app.router.add_post("/v1/queues/{queue}/messages", publish)
    app.router.add_post("/v1/queues/{queue}/messages/batch", publish_batch)
    app.router.add_post("/v1/queues/{queue}/subscribers/{subscriber}/receive", receive)
    app.router.add_post("/v1/queues/{queue}/subscribers/{subscriber}/ack", ack)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/stats", stats)
    return app


def _create(store: Store, head_path: str) -> None:
    """Its tables and its watermark znode (blocking: before it serves)."""
    session, keyspace = store.session, store.keyspace
    session.execute(f"CREATE TABLE IF NOT EXISTS {keyspace}.{TABLE} (shard int, number bigint, seq int, "
                    "id text, data blob, PRIMARY KEY ((shard, number), seq))")
    session.execute(f"CREATE TABLE IF NOT EXISTS {keyspace}.{ACKS_TABLE} (shard int, number bigint, seq int, "
                    "PRIMARY KEY ((shard, number), seq))")
    store.zk.ensure_path(head_path)


async def serve() -> None:
    settings = Settings()
    # The namespace of the benchmark's queues, as the sidecar opens its store for it.
    store = await asyncio.to_thread(Store.open, settings, "default")
    head_path = f"{settings.zookeeper_root}/driver-floor/head"
    await asyncio.to_thread(_create, store, head_path)
    writer = LogWriter(store, head_path)
    try:
        await serve_until_stopped(routes(writer, Reader(store, writer), AckWriter(store)), "driver floor")
    finally:
        store.close()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        loop.run(serve())
