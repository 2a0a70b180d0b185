"""Sidecar benchmark: the HTTP API against the engine in-process and the raw driver, in one run.

    python bench/bench_sidecar.py [--messages 10000] [--size 1024] [--shards 4] [--runs 3]
        [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. The
sidecar runs as its own process (`casque sidecar`), as beside an app; this process is the
app. Reports, each figure the median of `--runs` runs:
- the limits: plain unlogged batches of the same rows at the batch sizes the engine's group
  commit reached for each publish form;
- publish msgs/s, one message per call and 100 per call, and receive+ack msgs/s, each for
  the engine in-process and over HTTP, with the HTTP/engine and HTTP/limit ratios
  (the HTTP calls through keepalive.py's lean client, so that the figures are the sidecar's);
- latency p50/p99 of each hop, one call at a time: an HTTP round trip alone (/healthz),
  publish and ack in-process and over HTTP (the difference is what the sidecar adds), and
  publish-to-receive over HTTP with a long-polling receiver;
- the sidecar process's own cost (`sidecar_cost`): CPU µs of its process (utime + stime
  from /proc/<pid>/stat) per message for each phase (publish 1 per call, 100 per call,
  100 per call with producer sequences; receive 100 + ack 100, receive 1 + ack 1), its
  RSS idle and after each phase, and the same requests answered by a bare aiohttp server
  of its own process (bare_server.py, same loop setup): its CPU per request is the floor,
  and each sidecar figure is also given as a ratio to it, measured in the same run. The
  bare server answers at once, so it serves many times the sidecar's rate and shares each
  turn of its event loop among more requests; the one-message publish is also measured
  against the bare server answering each call after the sidecar's mean latency for it, the
  floor at the sidecar's own pace;
- the drivers' floor: the same publishes answered by driver_floor_server.py, which writes them
  durably (one conditional batch for the calls side by side, a watermark znode after) with
  the same drivers and nothing else: what any publish on these components costs, the
  sidecar's figures as a ratio to it, and its own ratio to the bare server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from casque.config import Settings
from casque.engine import catalog, protocol, protocol_change
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import (
    Figure,
    arguments,
    cpu_seconds,
    drop_scratch,
    parse,
    percentiles,
    pipeline,
    plain_batch_rate,
    repeat_async,
    report,
    scratch_settings,
    sidecar_url,
    text_payload,
)
from keepalive import KeepAliveClient

SINGLE_WINDOW = 64  # single-message publishes in flight (many app threads or tasks)
BATCH_WINDOW = 16  # 100-message publishes in flight
BATCH = 100
RECEIVERS = 4  # concurrent receive+ack loops
PROBES = 300
# The sidecar process's cost: the calls of each phase, as a new user would make them.
COST_WINDOW = 32  # one-message publishes, and receive 1 + ack 1 loops, in flight
COST_BATCH_WINDOW = 4  # 100-message publishes in flight
COST_SINGLE = 4000  # one-message publishes (and as many receive 1 + ack 1 pairs)
COST_BATCHES = 200  # 100-message publishes (and receives of 100 + acks of 100)
MIB = 2**20

FIGURES = [
    Figure("limit_single", "limit: plain unlogged batches, engine's 1-msg/call batch size", "rows/s"),
    Figure("engine_single", f"publish 1 msg/call ({SINGLE_WINDOW} in flight), engine", "msgs/s"),
    Figure("http_single", "  over HTTP", "msgs/s"),
    Figure("single_ratio", "  HTTP / engine", "x"),
    Figure("single_of_limit", "  HTTP / limit", "x"),
    Figure("limit_batched", f"limit: plain unlogged batches, engine's {BATCH}-msg/call batch size", "rows/s"),
    Figure("engine_batched", f"publish {BATCH} msgs/call ({BATCH_WINDOW} in flight), engine", "msgs/s"),
    Figure("http_batched", "  over HTTP", "msgs/s"),
    Figure("batched_ratio", "  HTTP / engine", "x"),
    Figure("batched_of_limit", "  HTTP / limit", "x"),
    Figure("engine_consume", f"receive+ack ({RECEIVERS} loops of {BATCH}), engine", "msgs/s"),
    Figure("http_consume", "  over HTTP", "msgs/s"),
    Figure("consume_ratio", "  HTTP / engine", "x"),
    Figure("hop_p50", "latency one call at a time: HTTP round trip alone (/healthz) p50", "ms"),
    Figure("hop_p99", "  p99", "ms"),
    Figure("engine_publish_p50", "publish, engine in-process p50", "ms"),
    Figure("http_publish_p50", "publish over HTTP p50", "ms"),
    Figure("added_publish_p50", "  sidecar adds to a publish, p50", "ms"),
    Figure("added_publish_p99", "  sidecar adds to a publish, p99", "ms"),
    Figure("engine_ack_p50", "ack, engine in-process p50", "ms"),
    Figure("http_ack_p50", "ack over HTTP p50", "ms"),
    Figure("added_ack_p50", "  sidecar adds to an ack, p50", "ms"),
    Figure("added_ack_p99", "  sidecar adds to an ack, p99", "ms"),
    Figure("end_to_end_p50", "publish-to-receive over HTTP, long poll, p50", "ms"),
    Figure("end_to_end_p99", "  p99", "ms"),
    Figure("cpu_bare_request", "sidecar process CPU: bare aiohttp server, per one-message publish request (floor)",
           "µs"),
    Figure("cpu_single", f"  sidecar, per one-message publish ({COST_WINDOW} in flight)", "µs"),
    Figure("cpu_single_ratio", "  sidecar / bare (goal <= 2)", "x"),
    Figure("single_latency", "  its calls' mean latency on the sidecar", "ms"),
    Figure("cpu_bare_paced", "  bare, answering each after that latency (the floor at the sidecar's pace)", "µs"),
    Figure("cpu_single_paced_ratio", "  sidecar / bare at its pace", "x"),
    Figure("cpu_floor_single", "  the drivers' floor: the same publishes written durably and nothing else", "µs"),
    Figure("floor_single_batch", "    messages per conditional batch it wrote", "msgs"),
    Figure("cpu_floor_single_ratio", "    drivers' floor / bare", "x"),
    Figure("cpu_single_floor_ratio", "  sidecar / drivers' floor (goal <= 1.3)", "x"),
    Figure("cpu_batched", f"  sidecar, per message published {BATCH} per call", "µs"),
    Figure("cpu_batched_bare", "  bare, per message of those calls", "µs"),
    Figure("cpu_batched_floor", "  drivers' floor, per message of those calls", "µs"),
    Figure("cpu_batched_floor_ratio", "  sidecar / drivers' floor (goal <= 1.3)", "x"),
    Figure("cpu_keyed", f"  sidecar, per message published {BATCH} per call with producer sequences", "µs"),
    Figure("keyed_rate_ratio", "  msgs/s with producer sequences / without (goal >= 0.8)", "x"),
    Figure("cpu_consume_batched", f"  sidecar, per message received and acked, {BATCH} per call", "µs"),
    Figure("cpu_consume_batched_bare", "  bare, per message of those calls", "µs"),
    Figure("cpu_consume_batched_floor", "  drivers' floor, per message of those calls", "µs"),
    Figure("cpu_consume_batched_floor_ratio", "  sidecar / drivers' floor (goal <= 1.5)", "x"),
    Figure("cpu_pair", f"  sidecar, per receive 1 + ack 1 ({COST_WINDOW} loops)", "µs"),
    Figure("cpu_pair_bare", "  bare, per receive 1 + ack 1 (floor)", "µs"),
    Figure("cpu_pair_ratio", "  sidecar / bare (goal <= 3)", "x"),
    Figure("cpu_pair_floor", "  drivers' floor, per receive 1 + ack 1", "µs"),
    Figure("cpu_pair_floor_ratio", "    drivers' floor / bare", "x"),
    Figure("cpu_pair_over_floor", "  sidecar / drivers' floor (goal <= 1.5)", "x"),
    Figure("rss_bare", "sidecar process RSS: bare aiohttp server at the end", "MiB"),
    Figure("rss_idle", "  sidecar idle, backends connected (goal <= 72)", "MiB"),
    Figure("rss_single", "  after one-message publishes", "MiB"),
    Figure("rss_pair", "  after receive 1 + ack 1", "MiB"),
    Figure("rss_batched", f"  after {BATCH}-message publishes (with and without producer sequences)", "MiB"),
    Figure("rss_end", f"  after receive+ack {BATCH} per call: the end of the run (goal <= 128)", "MiB"),
]


# --- the engine in-process --------------------------------------------------------------------------
async def engine_rates(store: Store, queue: QueueRef, spec: QueueSpec, count: int, payload: bytes,
                       probes: int) -> dict[str, Any]:
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    message = OutgoingMessage(payload)
    single = count / await pipeline(count, SINGLE_WINDOW, lambda i: publisher.publish([message]))
    single_batch = publisher.counters.messages / max(1, publisher.counters.batches)
    calls = max(1, count // BATCH)
    before = publisher.counters.messages, publisher.counters.batches
    batched = calls * BATCH / await pipeline(calls, BATCH_WINDOW, lambda i: publisher.publish([message] * BATCH))
    batched_batch = (publisher.counters.messages - before[0]) / max(1, publisher.counters.batches - before[1])
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
    for _ in range(probes):
        started = time.perf_counter()
        await publisher.publish([message])
        publish_latency.append(time.perf_counter() - started)
        (delivery,) = await consumer.receive(max_messages=1, wait=10)
        started = time.perf_counter()
        await consumer.ack(delivery.receipt)
        ack_latency.append(time.perf_counter() - started)
    await consumer.stop()
    return {"single": single, "batched": batched, "consume": consume, "single_batch": single_batch,
            "batched_batch": batched_batch, "publish_latency": publish_latency, "ack_latency": ack_latency}


# --- the same over HTTP ---------------------------------------------------------------------------
async def http_rates(url: str, queue: str, subscriber: str, count: int, payload: str, probes: int) -> dict[str, Any]:
    base = f"/v1/queues/{queue}"
    sub = f"{base}/subscribers/{subscriber}"
    body = {"data": payload, "datacontenttype": "text/plain"}
    # A lean keep-alive client (keepalive.py): the figure is the sidecar's, not the client's.
    async with KeepAliveClient(url, limit=SINGLE_WINDOW + RECEIVERS) as http:
        post = http.post_ok

        single = count / await pipeline(count, SINGLE_WINDOW, lambda i: post(f"{base}/messages", body))
        calls = max(1, count // BATCH)
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
        for _ in range(probes):
            started = time.perf_counter()
            await http.get("/healthz")
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
            while len(end_to_end) < probes:
                messages = (await post(f"{sub}/receive", {"max": 10, "wait": 5}))["messages"]
                now = time.perf_counter()
                end_to_end.extend(now - float(m["data"]) for m in messages)
                if messages:
                    await post(f"{sub}/ack", {"receipts": [m["receipt"] for m in messages]})

        listening = asyncio.create_task(listen())
        for _ in range(probes):
            await post(f"{base}/messages", {"data": repr(time.perf_counter()), "datacontenttype": "text/plain"})
            await asyncio.sleep(0.005)  # a moderate rate, so each probe is measured alone
        await asyncio.wait_for(listening, 120)
    return {"single": single, "batched": batched, "consume": consume, "hop": hop,
            "publish_latency": publish_latency, "ack_latency": ack_latency, "end_to_end": end_to_end}


# --- the sidecar process's own cost -----------------------------------------------------------
def rss_bytes(pid: int) -> int:
    found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


async def process_cost(url: str, pid: int, queue: str, subscriber: str, payload: str, singles: int, batches: int,
                       producer: str) -> dict[str, float]:
    """CPU µs per message of the process at `url` (pid), phase by phase, and its RSS after each.

    The same calls go to the sidecar and to the bare server, so the bare figures are the
    floor of each phase; each phase consumes or publishes exactly what the others expect.
    """
    base = f"/v1/queues/{queue}"
    sub = f"{base}/subscribers/{subscriber}"
    body = {"data": payload, "datacontenttype": "text/plain"}
    figures: dict[str, float] = {}
    async with KeepAliveClient(url, limit=COST_WINDOW + 4) as http:
        post = http.post_ok

        async def phase(name: str, messages: int, run: Callable[[], Awaitable[None]]) -> float:
            before, started = cpu_seconds([pid]), time.perf_counter()
            await run()
            seconds = time.perf_counter() - started
            figures[f"cpu_{name}"] = (cpu_seconds([pid]) - before) / messages * 1e6
            figures[f"seconds_{name}"] = seconds
            figures[f"rss_{name}"] = rss_bytes(pid) / MIB
            return messages / seconds

        def consume(total: int, per_call: int, loops: int) -> Awaitable[None]:
            return receive_and_ack(post, sub, total, per_call, loops)

        batch_body = {"messages": [body] * BATCH}
        await phase("single", singles, lambda: pipeline(singles, COST_WINDOW, lambda i: post(f"{base}/messages", body)))
        await phase("pair", singles, lambda: consume(singles, 1, COST_WINDOW))
        plain = await phase("batched", batches * BATCH, lambda: pipeline(
            batches, COST_BATCH_WINDOW, lambda i: post(f"{base}/messages/batch", batch_body)))

        def keyed(i: int) -> dict[str, Any]:
            return {"messages": [{**body, "producerid": producer, "producerseq": i * BATCH + n} for n in range(BATCH)]}

        keyed_rate = await phase("keyed", batches * BATCH, lambda: pipeline(
            batches, COST_BATCH_WINDOW, lambda i: post(f"{base}/messages/batch", keyed(i))))
        figures["keyed_rate_ratio"] = keyed_rate / plain
        await phase("consume_batched", 2 * batches * BATCH, lambda: consume(2 * batches * BATCH, BATCH, RECEIVERS))
    return figures


async def receive_and_ack(post: Callable[[str, Any], Awaitable[Any]], sub: str, total: int, per_call: int,
                          loops: int) -> None:
    """`total` messages received `per_call` at a time and acked, by `loops` loops side by side."""
    received = 0

    async def loop() -> None:
        nonlocal received
        while received < total:
            got = (await post(f"{sub}/receive", {"max": min(per_call, total - received), "wait": 1}))
            messages = got["messages"]
            if not messages:
                continue
            received += len(messages)
            if len(messages) == 1:
                await post(f"{sub}/ack", {"receipt": messages[0]["receipt"]})
            else:
                await post(f"{sub}/ack", {"receipts": [m["receipt"] for m in messages]})

    await asyncio.gather(*(loop() for _ in range(loops)))


async def paced_floor(url: str, pid: int, queue: str, payload: str, calls: int, latency: float) -> float:
    """CPU µs per one-message publish of the bare server at `url` (pid) answering each after
    `latency` seconds, with as many in flight as the sidecar's phase had: its requests then
    come at the sidecar's rate, so fewer of them share each turn of the event loop."""
    body = {"data": payload, "datacontenttype": "text/plain"}
    path = f"/v1/queues/{queue}/messages?after={latency:.6f}"
    async with KeepAliveClient(url, limit=COST_WINDOW + 4) as http:
        before = cpu_seconds([pid])
        await pipeline(calls, COST_WINDOW, lambda i: http.post_ok(path, body))
        return (cpu_seconds([pid]) - before) / calls * 1e6


async def floor_cost(url: str, pid: int, queue: str, payload: str, singles: int, batches: int) -> dict[str, float]:
    """CPU µs per message of the drivers' floor at `url` (pid) for the sidecar's phases (not
    the producer sequences, which it has not), the same calls with as many in flight, and the
    messages per batch its one-message publishes shared. Each phase consumes what the one
    before it published."""
    body = {"data": payload, "datacontenttype": "text/plain"}
    base = f"/v1/queues/{queue}"
    sub = f"{base}/subscribers/{queue}"
    figures: dict[str, float] = {}
    async with KeepAliveClient(url, limit=COST_WINDOW + 4) as http:

        async def phase(name: str, messages: int, run: Awaitable[Any]) -> None:
            before = cpu_seconds([pid])
            await run
            figures[name] = (cpu_seconds([pid]) - before) / messages * 1e6

        _, before_stats = await http.get("/stats")
        await phase("cpu_floor_single", singles,
                    pipeline(singles, COST_WINDOW, lambda i: http.post_ok(f"{base}/messages", body)))
        _, stats = await http.get("/stats")
        figures["floor_single_batch"] = singles / (stats["batches"] - before_stats["batches"])
        await phase("cpu_pair_floor", singles, receive_and_ack(http.post_ok, sub, singles, 1, COST_WINDOW))
        batch_body = {"messages": [body] * BATCH}
        await phase("cpu_batched_floor", batches * BATCH, pipeline(
            batches, COST_BATCH_WINDOW, lambda i: http.post_ok(f"{base}/messages/batch", batch_body)))
        await phase("cpu_consume_batched_floor", batches * BATCH,
                    receive_and_ack(http.post_ok, sub, batches * BATCH, BATCH, RECEIVERS))
    return figures


def start_server(script: str, log: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """bench/`script` in a process of its own; its URL, from the `listening on` line it logs."""
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, str(Path(__file__).with_name(script))], env=env,
                                   stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(rb"listening on (http://\S+)", log.read_bytes())
        if found:
            return process, found.group(1).decode()
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise SystemExit(f"{script} did not start: {log.read_text()[-2000:]}")


async def sidecar_cost(processes: Processes, queue: str, text: str, smoke: bool, run: int) -> dict[str, float]:
    url, pid, bare_pid = processes.url, processes.pid, processes.bare_pid
    singles, batches = (200, 10) if smoke else (COST_SINGLE, COST_BATCHES)
    bare = await process_cost(processes.bare_url, bare_pid, queue, queue, text, singles, batches, f"bench-bare-{run}")
    floor = await floor_cost(processes.floor_url, processes.floor_pid, queue, text, singles, batches)
    sidecar = await process_cost(url, pid, queue, queue, text, singles, batches, f"bench-{run}")
    # Each of the window's calls took this long on the sidecar, on average.
    latency = sidecar["seconds_single"] * COST_WINDOW / singles
    paced = await paced_floor(processes.bare_url, bare_pid, queue, text, singles, latency)
    return {
        **floor,
        "cpu_floor_single_ratio": floor["cpu_floor_single"] / bare["cpu_single"],
        "cpu_single_floor_ratio": sidecar["cpu_single"] / floor["cpu_floor_single"],
        "cpu_pair_floor_ratio": floor["cpu_pair_floor"] / bare["cpu_pair"],
        "cpu_pair_over_floor": sidecar["cpu_pair"] / floor["cpu_pair_floor"],
        "cpu_batched_floor_ratio": sidecar["cpu_batched"] / floor["cpu_batched_floor"],
        "cpu_consume_batched_floor_ratio": sidecar["cpu_consume_batched"] / floor["cpu_consume_batched_floor"],
        "cpu_bare_request": bare["cpu_single"],
        "cpu_single": sidecar["cpu_single"], "cpu_single_ratio": sidecar["cpu_single"] / bare["cpu_single"],
        "single_latency": latency * 1e3, "cpu_bare_paced": paced, "cpu_single_paced_ratio": sidecar["cpu_single"] / paced,
        "cpu_batched": sidecar["cpu_batched"], "cpu_batched_bare": bare["cpu_batched"],
        "cpu_keyed": sidecar["cpu_keyed"], "keyed_rate_ratio": sidecar["keyed_rate_ratio"],
        "cpu_consume_batched": sidecar["cpu_consume_batched"],
        "cpu_consume_batched_bare": bare["cpu_consume_batched"],
        "cpu_pair": sidecar["cpu_pair"], "cpu_pair_bare": bare["cpu_pair"],
        "cpu_pair_ratio": sidecar["cpu_pair"] / bare["cpu_pair"],
        "rss_bare": rss_bytes(bare_pid) / MIB, "rss_idle": processes.rss_idle,
        "rss_single": sidecar["rss_single"], "rss_pair": sidecar["rss_pair"], "rss_batched": sidecar["rss_keyed"],
        "rss_end": sidecar["rss_consume_batched"],
    }


def backend_env(settings: Settings) -> dict[str, str]:
    """This process's environment with the backends `settings` name, for a child to connect to."""
    return dict(
        os.environ,
        CASQUE_CASSANDRA_CONTACT_POINTS=",".join(settings.cassandra_contact_points),
        CASQUE_CASSANDRA_PORT=str(settings.cassandra_port),
        CASQUE_KEYSPACE=settings.keyspace,
        CASQUE_ZOOKEEPER_HOSTS=settings.zookeeper_hosts,
        CASQUE_ZOOKEEPER_ROOT=settings.zookeeper_root,
        CASQUE_CONSISTENCY=settings.consistency,
    )


def start_sidecar(settings: Settings, queue: str, subscriber: str | None, log: Path,
                  extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`casque sidecar` on port 0: it logs the port it got (see `sidecar_url`); consuming for
    `subscriber`, or for none; `extra_env`: its own settings beyond the backends'."""
    env = dict(backend_env(settings), **(extra_env or {}))
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "casque.cli", "sidecar", "--port", "0", "--queue", queue,
             *(["--subscriber", subscriber] if subscriber else []), "--drain-seconds", "1"],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )


async def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"sidecar exited:\n{log.read_text()[-2000:]}")
            try:
                async with http.get(f"{url}/readyz") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise SystemExit(f"sidecar never became ready:\n{log.read_text()[-2000:]}")


@dataclass(frozen=True)
class Processes:
    """The sidecar's, the bare server's and the drivers' floor's URLs and pids, and the
    sidecar's RSS when idle."""

    url: str
    pid: int
    bare_url: str
    bare_pid: int
    floor_url: str
    floor_pid: int
    rss_idle: float


async def run_once(store: Store, args: argparse.Namespace, run: int, processes: Processes, http_queue: QueueRef,
                   spec: QueueSpec, text: str) -> dict[str, float]:
    """One run: the sidecar process's own cost first (on a sidecar that has served only the
    runs before), then the engine on a queue of its own, HTTP on the sidecar's queue (each
    run consumes everything it publishes), limits on the engine's table."""
    url = processes.url
    cost = await sidecar_cost(processes, http_queue.name, text, args.smoke, run)
    probes = 20 if args.smoke else PROBES
    engine_queue = QueueRef("default", f"engine-{run}")
    catalog.apply_queue(store, engine_queue, spec)
    catalog.apply_subscriber(store, engine_queue, "engine", SubscriberSpec(queue=engine_queue.name,
                                                                           start_position="earliest"))
    engine = await engine_rates(store, engine_queue, spec, args.messages, text.encode(), probes)
    http = await http_rates(url, http_queue.name, http_queue.name, args.messages, text, probes)
    table = store.table(engine_queue)
    limit_single = await plain_batch_rate(store, table, args.messages, text.encode(),
                                          max(1, round(engine["single_batch"])), shard_base=500)
    limit_batched = await plain_batch_rate(store, table, args.messages, text.encode(),
                                           max(1, round(engine["batched_batch"])), shard_base=800)
    figures = {
        **cost,
        "limit_single": limit_single, "limit_batched": limit_batched,
        "engine_single": engine["single"], "http_single": http["single"],
        "single_ratio": http["single"] / engine["single"], "single_of_limit": http["single"] / limit_single,
        "engine_batched": engine["batched"], "http_batched": http["batched"],
        "batched_ratio": http["batched"] / engine["batched"], "batched_of_limit": http["batched"] / limit_batched,
        "engine_consume": engine["consume"], "http_consume": http["consume"],
        "consume_ratio": http["consume"] / engine["consume"],
    }
    for key, samples in (("hop", http["hop"]), ("engine_publish", engine["publish_latency"]),
                         ("http_publish", http["publish_latency"]), ("engine_ack", engine["ack_latency"]),
                         ("http_ack", http["ack_latency"]), ("end_to_end", http["end_to_end"])):
        figures[f"{key}_p50"], figures[f"{key}_p99"] = percentiles(samples)
    for what in ("publish", "ack"):
        for p in ("p50", "p99"):
            figures[f"added_{what}_{p}"] = figures[f"http_{what}_{p}"] - figures[f"engine_{what}_{p}"]
    return figures


async def main() -> None:
    parser = arguments((__doc__ or "").splitlines()[0], 10000, 1024)
    parser.add_argument("--protocol", type=int, default=protocol.PROTOCOL,
                        help="the installation's protocol version to measure (casque.engine.protocol)")
    args = parse(parser, smoke_messages=300)

    settings = scratch_settings(args.cassandra, args.zookeeper)
    keyspace = settings.keyspace
    store = Store.open(settings)
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE", max_message_bytes=64 * 1024)
    http_queue = QueueRef("default", "http")
    text = text_payload(args.size)
    log = Path(tempfile.gettempdir()) / f"{keyspace}-sidecar.log"
    process = bare = floor = None
    bare_log = Path(tempfile.gettempdir()) / f"{keyspace}-bare.log"
    floor_log = Path(tempfile.gettempdir()) / f"{keyspace}-floor.log"
    try:
        catalog.ensure_installation(store)
        protocol_change.set_version(store, args.protocol)
        catalog.apply_queue(store, http_queue, spec)
        catalog.apply_subscriber(store, http_queue, http_queue.name, SubscriberSpec(queue=http_queue.name,
                                                                                    start_position="earliest"))
        process = start_sidecar(settings, http_queue.name, http_queue.name, log)
        url = await asyncio.to_thread(sidecar_url, process, log)
        await wait_ready(url, process, log)
        bare, bare_url = start_server("bare_server.py", bare_log)
        floor, floor_url = await asyncio.to_thread(start_server, "driver_floor_server.py", floor_log,
                                                   backend_env(settings))
        await asyncio.sleep(2)  # idle: connected, its consumer started, no request yet
        processes = Processes(url, process.pid, bare_url, bare.pid, floor_url, floor.pid,
                              rss_bytes(process.pid) / MIB)
        samples = await repeat_async(args.runs, lambda run: run_once(store, args, run, processes, http_queue, spec,
                                                                     text))
    finally:
        for child in (process, bare, floor):
            if child is not None and child.poll() is None:
                child.terminate()
                child.wait(30)
        drop_scratch(store, settings)
        store.close()
    log.unlink(missing_ok=True)
    bare_log.unlink(missing_ok=True)
    floor_log.unlink(missing_ok=True)
    report("sidecar", args, {"messages per publish form": args.messages, "size": args.size, "shards": args.shards,
                             "sidecar": "own process", "protocol": args.protocol}, FIGURES, samples)


if __name__ == "__main__":
    asyncio.run(main())
