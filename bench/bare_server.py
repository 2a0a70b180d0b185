"""A bare aiohttp server answering the sidecar's requests with canned answers: the floor.

    python bench/bare_server.py

Run as its own process on the same event loop setup as the sidecar (uvloop, an AppRunner
without access log, the same keep-alive and header limits), it reads each request's body
whole and answers with a body of the shape the sidecar would send: a publish result per
message published, `max` canned messages (1 KiB of data each) per receive, a result per
receipt acked. What this process spends in CPU per request is what aiohttp itself costs on
this machine: bench_sidecar.py divides the sidecar's CPU per request by it. A publish with
`?after=S` is answered S seconds after it is read, for the floor at the sidecar's pace. It logs
`bare server listening on http://...` once it listens on the port the kernel gave it.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvloop
from aiohttp import web

MESSAGE = json.dumps({
    "specversion": "1.0", "id": "0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f", "source": "/casque/default/http",
    "type": "casque.message", "time": "2026-11-27T08:00:00.000000Z", "datacontenttype": "text/plain",
    "data": "casque-" * 146, "messageid": "0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f", "attributes": {},
    "priority": 0, "deliverycount": 1, "receipt": "AAAAAAAAAAEAAAAAAAAAAQAAAAEAAAAAAAAAAQ", "shard": 0,
    "batch": 1, "seq": 0, "visibleuntil": "2026-11-27T08:00:30.000000Z",
}, separators=(",", ":")).encode()
RESULT = b'{"messageId":"0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f","shard":0,"batch":1,"seq":0,"duplicate":false}'
ACKED = b'{"receipt":"AAAAAAAAAAEAAAAAAAAAAQAAAAEAAAAAAAAAAQ","status":"acked"}'


def _many(item: bytes, count: int) -> bytes:
    return b",".join([item] * count)


async def publish(request: web.Request) -> web.Response:
    await request.read()
    # `?after=S`: answered S seconds later, as a publish is once its batch is written; the
    # floor at the sidecar's own pace (fewer requests per turn of the loop cost more each).
    after = request.query.get("after")
    if after:
        await asyncio.sleep(float(after))
    return web.Response(body=RESULT, content_type="application/json")


async def publish_batch(request: web.Request) -> web.Response:
    # The count of messages without parsing them: the sidecar's answer has one result each.
    count = (await request.read()).count(b'"data"')
    return web.Response(body=b'{"results":[' + _many(RESULT, count) + b"]}", content_type="application/json")


async def receive(request: web.Request) -> web.Response:
    raw = await request.read()
    count = json.loads(raw).get("max", 10) if raw else 10
    return web.Response(body=b'{"messages":[' + _many(MESSAGE, count) + b"]}", content_type="application/json")


async def ack(request: web.Request) -> web.Response:
    raw = await request.read()
    count = raw.count(b",") + 1 if b'"receipts"' in raw else 1
    if count == 1 and b'"receipt"' in raw:
        return web.Response(body=b'{"results":[' + ACKED + b"]}", content_type="application/json")
    return web.Response(body=b'{"results":[' + _many(ACKED, count) + b"]}", content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def serve() -> None:
    app = web.Application()
    app.router.add_post("/v1/queues/{queue}/messages", publish)
    app.router.add_post("/v1/queues/{queue}/messages/batch", publish_batch)
    app.router.add_post("/v1/queues/{queue}/subscribers/{subscriber}/receive", receive)
    app.router.add_post("/v1/queues/{queue}/subscribers/{subscriber}/ack", ack)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    await serve_until_stopped(app, "bare server")


async def serve_until_stopped(app: web.Application, name: str) -> None:
    """`app` on a port the kernel gives, with the sidecar's own protocol options
    (server.protocol_options: keep-alive and header limits); logs `<name> listening on <url>`."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=15, max_headers=32)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, reuse_address=True)
    await site.start()
    print(f"{name} listening on http://127.0.0.1:{runner.addresses[0][1]}", file=sys.stderr, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        loop.run(serve())
