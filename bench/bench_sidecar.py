"""Sidecar benchmark: the HTTP API against the engine in-process and the raw driver, in one run.

    python bench/bench_sidecar.py [--messages 10000] [--size 1024] [--shards 4]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. The
sidecar runs as its own process (`casque sidecar`), as beside an app; this process is the
app. Prints:
- the raw driver's single-row insert rate (callback pipeline), the limit of the same node;
- publish msgs/s, one message per call and 100 per call, and receive+ack msgs/s, each for
  the engine in-process and over HTTP, with the HTTP/engine and HTTP/raw ratios;
- latency p50/p99 of each hop, one call at a time: an HTTP round trip alone (/healthz),
  publish and ack in-process and over HTTP (the difference is what the sidecar adds), and
  publish-to-receive over HTTP with a long-polling receiver.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from casque.config import Settings
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import arguments, drop_scratch, percentiles, pipeline, raw_insert_rate, scratch_settings

SINGLE_WINDOW = 64  # single-message publishes in flight (many app threads or tasks)
BATCH_WINDOW = 16  # 100-message publishes in flight
BATCH = 100
RECEIVERS = 4  # concurrent receive+ack loops
PROBES = 300


# --- the engine in-process --------------------------------------------------------------------------
async def engine_rates(store: Store, queue: QueueRef, spec: QueueSpec, count: int, payload: bytes) -> dict[str, Any]:
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    message = OutgoingMessage(payload)
    single = count / await pipeline(count, SINGLE_WINDOW, lambda i: publisher.publish([message]))
    calls = count // BATCH
    batched = calls * BATCH / await pipeline(calls, BATCH_WINDOW, lambda i: publisher.publish([message] * BATCH))
    await publisher.flush_heads()

    consumer = Consumer(store, queue, "engine")
    await consumer.start()
    total = count + calls * BATCH
    received = 0

    async def receiver() -> None:
        nonlocal received
        while received < total:
            deliveries = await consumer.receive(max_messages=BATCH, wait=1)
            if deliveries:
                await consumer.ack_many([d.receipt for d in deliveries])
                received += len(deliveries)

    started = time.perf_counter()
    await asyncio.gather(*(receiver() for _ in range(RECEIVERS)))
    consume = total / (time.perf_counter() - started)

    publish_latency, ack_latency = [], []
    for _ in range(PROBES):
        started = time.perf_counter()
        await publisher.publish([message])
        publish_latency.append(time.perf_counter() - started)
        (delivery,) = await consumer.receive(max_messages=1, wait=10)
        started = time.perf_counter()
        await consumer.ack(delivery.receipt)
        ack_latency.append(time.perf_counter() - started)
    await consumer.stop()
    return {"single": single, "batched": batched, "consume": consume,
            "publish_latency": publish_latency, "ack_latency": ack_latency}


# --- the same over HTTP ---------------------------------------------------------------------------
async def http_rates(url: str, queue: str, subscriber: str, count: int, payload: str) -> dict[str, Any]:
    base = f"/v1/queues/{queue}"
    sub = f"{base}/subscribers/{subscriber}"
    body = {"data": payload, "datacontenttype": "text/plain"}
    connector = aiohttp.TCPConnector(limit=SINGLE_WINDOW + RECEIVERS)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        async def post(path: str, json: Any) -> Any:
            async with http.post(path, json=json) as answer:
                if answer.status != 200:
                    raise SystemExit(f"{path}: HTTP {answer.status}: {await answer.text()}")
                return await answer.json()

        single = count / await pipeline(count, SINGLE_WINDOW, lambda i: post(f"{base}/messages", body))
        calls = count // BATCH
        batch_body = {"messages": [body] * BATCH}
        batched = calls * BATCH / await pipeline(calls, BATCH_WINDOW, lambda i: post(f"{base}/messages/batch", batch_body))

        total = count + calls * BATCH
        received = 0

        async def receiver() -> None:
            nonlocal received
            while received < total:
                messages = (await post(f"{sub}/receive", {"max": BATCH, "wait": 1}))["messages"]
                if messages:
                    await post(f"{sub}/ack", {"receipts": [m["receipt"] for m in messages]})
                    received += len(messages)

        started = time.perf_counter()
        await asyncio.gather(*(receiver() for _ in range(RECEIVERS)))
        consume = total / (time.perf_counter() - started)

        hop, publish_latency, ack_latency = [], [], []
        for _ in range(PROBES):
            started = time.perf_counter()
            async with http.get("/healthz") as answer:
                await answer.read()
            hop.append(time.perf_counter() - started)
            started = time.perf_counter()
            await post(f"{base}/messages", body)
            publish_latency.append(time.perf_counter() - started)
            (message,) = (await post(f"{sub}/receive", {"max": 1, "wait": 10}))["messages"]
            started = time.perf_counter()
            await post(f"{sub}/ack", {"receipt": message["receipt"]})
            ack_latency.append(time.perf_counter() - started)

        # Publish-to-receive: a long-polling receiver; each probe carries its send time.
        end_to_end: list[float] = []

        async def listen() -> None:
            while len(end_to_end) < PROBES:
                messages = (await post(f"{sub}/receive", {"max": 10, "wait": 5}))["messages"]
                now = time.perf_counter()
                end_to_end.extend(now - float(m["data"]) for m in messages)
                if messages:
                    await post(f"{sub}/ack", {"receipts": [m["receipt"] for m in messages]})

        listening = asyncio.create_task(listen())
        for _ in range(PROBES):
            await post(f"{base}/messages", {"data": repr(time.perf_counter()), "datacontenttype": "text/plain"})
            await asyncio.sleep(0.005)  # a moderate rate, so each probe is measured alone
        await asyncio.wait_for(listening, 120)
    return {"single": single, "batched": batched, "consume": consume, "hop": hop,
            "publish_latency": publish_latency, "ack_latency": ack_latency, "end_to_end": end_to_end}


def start_sidecar(settings: Settings, queue: str, subscriber: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(
        os.environ,
        CASQUE_CASSANDRA_CONTACT_POINTS=",".join(settings.cassandra_contact_points),
        CASQUE_CASSANDRA_PORT=str(settings.cassandra_port),
        CASQUE_KEYSPACE=settings.keyspace,
        CASQUE_ZOOKEEPER_HOSTS=settings.zookeeper_hosts,
        CASQUE_ZOOKEEPER_ROOT=settings.zookeeper_root,
        CASQUE_CONSISTENCY=settings.consistency,
    )
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "casque.cli", "sidecar", "--port", str(port), "--queue", queue,
             "--subscriber", subscriber, "--drain-seconds", "1"],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    return process, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(1200):
            if process.poll() is not None:
                raise SystemExit(f"sidecar exited:\n{log.read_text()[-2000:]}")
            try:
                async with http.get(f"{url}/readyz") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise SystemExit("sidecar never became ready")


async def main() -> None:
    parser = arguments((__doc__ or "").splitlines()[0], 10000, 1024)
    args = parser.parse_args()

    settings = scratch_settings(args.cassandra, args.zookeeper)
    keyspace = settings.keyspace
    store = Store.open(settings)
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE", max_message_bytes=64 * 1024)
    engine_queue, http_queue = QueueRef("default", "engine"), QueueRef("default", "http")
    text = ("casque-" * (args.size // 7 + 1))[: args.size]
    log = Path(f"/tmp/{keyspace}-sidecar.log")
    process = None
    try:
        catalog.ensure_installation(store)
        for queue in (engine_queue, http_queue):
            catalog.apply_queue(store, queue, spec)
            catalog.apply_subscriber(store, queue, queue.name, SubscriberSpec(queue=queue.name,
                                                                              start_position="earliest"))
        process, url = start_sidecar(settings, http_queue.name, http_queue.name, log)
        await wait_ready(url, process, log)

        raw = await asyncio.to_thread(raw_insert_rate, store, store.table(engine_queue), args.messages * 2,
                                      text.encode())
        engine = await engine_rates(store, engine_queue, spec, args.messages, text.encode())
        http = await http_rates(url, http_queue.name, http_queue.name, args.messages, text)

        print(f"casque sidecar benchmark: {args.messages} messages per publish form, {args.size} B, "
              f"{args.shards} shards, Cassandra {args.cassandra}, sidecar in its own process")
        print(f"raw driver single-row inserts {raw:10.0f} rows/s (the node's limit in this run)")
        print(f"{'':34s} {'engine':>10s} {'HTTP':>10s}   HTTP/engine  HTTP/raw")
        for label, key in ((f"publish 1 msg/call ({SINGLE_WINDOW} in flight)", "single"),
                           (f"publish {BATCH} msgs/call ({BATCH_WINDOW} in flight)", "batched"),
                           (f"receive+ack ({RECEIVERS} loops of {BATCH})", "consume")):
            e, h = engine[key], http[key]
            print(f"{label:34s} {e:10.0f} {h:10.0f}   {h / e:11.2f}  {h / raw:8.2f}  msgs/s")
        print(f"latency, one call at a time ({PROBES} samples)    p50 ms    p99 ms")
        rows = (
            ("HTTP round trip alone (/healthz)", http["hop"]),
            ("publish, engine in-process", engine["publish_latency"]),
            ("publish over HTTP", http["publish_latency"]),
            ("ack, engine in-process", engine["ack_latency"]),
            ("ack over HTTP", http["ack_latency"]),
            ("publish-to-receive over HTTP", http["end_to_end"]),
        )
        for label, samples in rows:
            p50, p99 = percentiles(samples)
            print(f"  {label:40s} {p50:8.2f} {p99:9.2f}")
        for what in ("publish", "ack"):
            e50, e99 = percentiles(engine[f"{what}_latency"])
            h50, h99 = percentiles(http[f"{what}_latency"])
            print(f"  sidecar adds to {what:8s} p50 {h50 - e50:+.2f} ms, p99 {h99 - e99:+.2f} ms")
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait(30)
        drop_scratch(store, settings)
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
