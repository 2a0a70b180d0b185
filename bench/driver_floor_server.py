"""The least a durable publish costs with these drivers: aiohttp, the Cassandra driver and kazoo.

    CASQUE_*=... python bench/driver_floor_server.py

Run as its own process on the sidecar's event loop setup (uvloop, an AppRunner without
access log, the same keep-alive and header limits) and connected as the sidecar connects
(`Store.open` with the same settings, so the same driver options), it answers the sidecar's
publish requests after doing only what any queue on these backends must do before answering
one: read the body and decode its JSON, give each message an id, write the messages of the
requests side by side in one conditional batch (a header row `IF NOT EXISTS` and a row per
message, one partition, as a claim writes them) and advance a watermark znode in ZooKeeper
for readers (in the background, one write in flight, as the head is). No idempotency, no
schema, no metrics, no routing of delayed messages, no consumer.

What this process spends in CPU per message is what the components themselves cost per
publish on this machine, at the batch sizes its own group commit reaches: a floor no design
on these drivers goes below. bench_sidecar.py reports it beside the bare server's floor (which
writes nothing) and the sidecar. It logs `driver floor listening on http://...` once it listens
on the port the kernel gave it; `GET /stats` answers the batches and messages written so far.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import deque

import uvloop
from aiohttp import web
from cassandra.query import BatchStatement, BatchType

from casque.backends import cql, zk
from casque.config import Settings
from casque.store import Store

TABLE = "driver_floor"
# A call's messages are written in one batch; calls side by side share one up to this many.
MAX_BATCH_MESSAGES = 100
SHARD = 0


class Call:
    """One publish request's messages, waiting for the batch that holds them."""

    __slots__ = ("ids", "payloads", "done")

    def __init__(self, payloads: list[bytes], done: asyncio.Future[int]) -> None:
        self.ids = [uuid.uuid4() for _ in payloads]
        self.payloads = payloads
        self.done = done


class GroupWriter:
    """Writes the calls side by side in one conditional batch each, and a watermark after."""

    def __init__(self, store: Store, head_path: str) -> None:
        self._store = store
        self._head_path = head_path
        self._pending: deque[Call] = deque()
        self._task: asyncio.Task[None] | None = None
        self._batch = 0
        self._head_target = 0
        self._head_task: asyncio.Task[None] | None = None
        session, keyspace = store.session, store.keyspace
        session.execute(f"CREATE TABLE IF NOT EXISTS {keyspace}.{TABLE} (shard int, number bigint, seq int, "
                        f"id uuid, data blob, PRIMARY KEY ((shard, number), seq))")
        self._header = session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq) VALUES (?, ?, -1) "
                                       "IF NOT EXISTS")
        # Rows serialized as the sidecar's claims serialize them (cql.BatchRows: the driver's
        # own binding per row costs about as much again), so that this is a floor.
        self._rows = cql.BatchRows(session.prepare(f"INSERT INTO {keyspace}.{TABLE} (shard, number, seq, id, data) "
                                                   "VALUES (?, ?, ?, ?, ?)"))
        store.zk.ensure_path(head_path)
        self.batches = 0
        self.messages = 0

    async def publish(self, payloads: list[bytes]) -> tuple[list[uuid.UUID], int]:
        call = Call(payloads, asyncio.get_running_loop().create_future())
        self._pending.append(call)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return call.ids, await call.done

    async def _drain(self) -> None:
        while self._pending:
            calls = [self._pending.popleft()]
            size = len(calls[0].payloads)
            while self._pending and size + len(self._pending[0].payloads) <= MAX_BATCH_MESSAGES:
                size += len(self._pending[0].payloads)
                calls.append(self._pending.popleft())
            self._batch += 1
            batch = self._batch
            try:
                await self._write(batch, calls)
            except Exception as error:  # each waiting request is answered with it
                for call in calls:
                    call.done.set_exception(error)
                continue
            self.batches += 1
            self.messages += size
            self._advance(batch)
            for call in calls:
                call.done.set_result(batch)

    async def _write(self, batch: int, calls: list[Call]) -> None:
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        statement.add(self._header, (SHARD, batch))
        shared = self._rows.shared((SHARD, batch))
        seq = 0
        for call in calls:
            for message_id, payload in zip(call.ids, call.payloads):
                self._rows.add(statement, shared, (seq, message_id, payload))
                seq += 1
        result = await cql.execute(self._store.session, statement)
        if not cql.applied(result):
            raise RuntimeError(f"batch {batch} was claimed by another writer")

    def _advance(self, batch: int) -> None:
        self._head_target = batch
        if self._head_task is None or self._head_task.done():
            self._head_task = asyncio.get_running_loop().create_task(self._write_head())

    async def _write_head(self) -> None:
        written = 0
        while written < self._head_target:
            written = self._head_target
            await zk.call(self._store.zk.set_async, self._head_path, str(written).encode())


def _result(message_id: uuid.UUID, batch: int, seq: int) -> dict[str, object]:
    return {"messageId": str(message_id), "shard": SHARD, "batch": batch, "seq": seq, "duplicate": False}


def _payload(message: object) -> bytes:
    data = message.get("data") if isinstance(message, dict) else None
    if not isinstance(data, str):
        raise web.HTTPBadRequest(text='{"code":"invalid_message","message":"a message needs data"}',
                                 content_type="application/json")
    return data.encode()


def routes(writer: GroupWriter) -> web.Application:
    async def publish(request: web.Request) -> web.Response:
        ids, batch = await writer.publish([_payload(json.loads(await request.read()))])
        return web.json_response(_result(ids[0], batch, 0))

    async def publish_batch(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        ids, batch = await writer.publish([_payload(message) for message in body.get("messages", [])])
        # The seqs within the batch are the call's own order: enough for an answer's shape.
        return web.json_response({"results": [_result(i, batch, seq) for seq, i in enumerate(ids)]})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"batches": writer.batches, "messages": writer.messages})

    app = web.Application()
    app.router.add_post("/v1/queues/{queue}/messages", publish)
    app.router.add_post("/v1/queues/{queue}/messages/batch", publish_batch)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/stats", stats)
    return app


async def serve() -> None:
    settings = Settings()
    # The namespace of the benchmark's queues, as the sidecar opens its store for it.
    store = await asyncio.to_thread(Store.open, settings, "default")
    writer = GroupWriter(store, f"{settings.zookeeper_root}/driver-floor/head")
    # The sidecar's own protocol options (server.protocol_options): keep-alive and header limits.
    runner = web.AppRunner(routes(writer), handle_signals=False, access_log=None, keepalive_timeout=15,
                           max_headers=32)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, reuse_address=True)
    await site.start()
    print(f"driver floor listening on http://127.0.0.1:{runner.addresses[0][1]}", file=sys.stderr, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        store.close()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        loop.run(serve())
