"""Soak: a sidecar's memory under a long run of mixed traffic, after its buffers have filled.

    python bench/soak_sidecar.py [--minutes 10] [--rate 300] [--size 1024] [--runs 1]
        [--trace-memory FRAMES] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

SIGINT or SIGTERM ends a run early: its figures so far are reported, and its keyspace dropped.

One `casque sidecar` (its own process, in a keyspace of its own, dropped at the end) serves
the mix of calls apps make, paced to about `--rate` messages per second published, for
`--minutes`: one-message publishes; 100-message publishes; publishes of one and of 20
messages with a new CloudEvents id each (the idempotency guard remembers up to 50,000 ids or
8 MiB of them by its estimate: at the default rate that memory is full within the warm-up);
calls of 20 messages numbered by a producer, which a new producer id replaces every 2,000 numbers
(an app that restarts); delayed messages with an id each; receive 50 + ack (one in 20
nacked, so it comes again), receive 1 + ack 1, each with a long poll; a malformed call now
and then (its 4xx is expected); the queue's and the subscriber's stats and the metrics page,
scraped. Everything published is consumed as it comes, so the backlog stays small. A call
answered 503 (a backend slow to answer, on a loaded machine) is sent again with backoff, as
casque's clients do, and counted.

The RSS of the sidecar is read from /proc every few seconds. The first quarter of the run is
its warm-up: connections, caches and the id memory fill there. Reported, each figure the
median of `--runs` runs: the RSS idle, at the end of the warm-up, at the end and at most;
its growth after the warm-up as the least-squares slope of the samples, in MiB per hour,
and as the end minus the end of the warm-up; the live containers (Python objects that hold
others) the sidecar's memory reports (SIGUSR2, sidecar/memory_report.py) count at the end of
the warm-up and at the end (those made since the sidecar started): objects that pile up
show there whatever the allocator does with its pages; the sidecar's CPU per message moved;
what was published and consumed; the calls sent again after a 503; calls answered other
than as expected, after those retries (0, or the run fails).

With `--trace-memory FRAMES` the sidecar traces its allocations, and those two reports write
snapshots; the source lines whose live allocations grew between them are printed, to say
where a growth comes from. Its CPU and RSS then include the tracing's own: compare a traced
run with traced runs only.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from casque.engine import catalog
from casque.sidecar.memory_report import growth
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from bench_sidecar import MIB, rss_bytes, start_sidecar, wait_ready
from benchlib import (
    Figure,
    arguments,
    cpu_seconds,
    drop_scratch,
    parse,
    report,
    repeat_async,
    scratch_settings,
    sidecar_url,
    text_payload,
)
from keepalive import KeepAliveClient

SAMPLE_SECONDS = 5.0
SMOKE_SAMPLE_SECONDS = 1.0
WARMUP_SHARE = 0.25
# The mix, per tick: each kind is (messages per call, calls per tick).
MIX = {
    "single": (1, 4),
    "batch": (100, 1),
    "identified": (1, 2),
    "identified_batch": (20, 1),
    "producer": (20, 1),
    "delayed": (1, 1),
}
# How long a sidecar may take to log a memory report (and write its snapshot), and the lines
# of growth shown.
REPORT_WAIT_SECONDS = 120.0
GROWTH_LINES = 15
# A call answered 503 is sent again this many times, the first after this long, doubling.
RETRIES = 5
RETRY_BACKOFF_SECONDS = 0.5
PRODUCER_SPAN = 2_000  # numbers per producer id before the "app" restarts with a new one
NACK_EVERY = 20
DELAY_SECONDS = 2.0
# A malformed call every this many ticks, and a scrape of stats and metrics.
BAD_EVERY = 10
SCRAPE_EVERY = 20

FIGURES = [
    Figure("minutes", "minutes of mixed traffic", "min"),
    Figure("published", "messages published", ""),
    Figure("consumed", "messages received and acked", ""),
    Figure("cpu_per_message", "sidecar CPU per message published", "µs"),
    Figure("rss_idle", "RSS idle", "MiB"),
    Figure("rss_warm", "RSS at the end of the warm-up (first quarter)", "MiB"),
    Figure("rss_end", "RSS at the end", "MiB"),
    Figure("rss_max", "RSS at most", "MiB"),
    Figure("growth_per_hour", "growth after the warm-up, least-squares slope", "MiB/h"),
    Figure("growth", "growth after the warm-up, end minus its start", "MiB"),
    Figure("objects_warm", "live containers at the end of the warm-up (memory report)", ""),
    Figure("objects_end", "live containers at the end", ""),
    Figure("object_growth", "live containers gained after the warm-up", ""),
    Figure("retried", "calls answered 503 and sent again, as clients do", ""),
    Figure("unexpected", "calls answered other than expected, retries included (must be 0)", ""),
]


@dataclass
class Traffic:
    """What the run has done so far."""

    published: Counter[str] = field(default_factory=Counter)
    consumed: int = 0
    nacked: int = 0
    retried: int = 0
    unexpected: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, MiB) samples, in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    xs = [t for t, _ in samples]
    ys = [m for _, m in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread * 3600


async def retrying(traffic: Traffic, call: Callable[[], Awaitable[tuple[int, Any]]]) -> tuple[int, Any]:
    """A call made again on 503 (a backend that did not answer in time, or the sidecar not
    ready), with backoff, as casque's clients do: the answer it ends with."""
    backoff = RETRY_BACKOFF_SECONDS
    for _ in range(RETRIES):
        status, answer = await call()
        if status != 503:
            return status, answer
        traffic.retried += 1
        await asyncio.sleep(backoff)
        backoff *= 2
    return await call()


async def drive(http: KeepAliveClient, queue: str, text: str, tick: float, traffic: Traffic) -> None:
    """The publishing side: one tick's calls each `tick` seconds until told to stop."""
    base = f"/v1/queues/{queue}"
    body = {"data": text, "datacontenttype": "text/plain"}
    counter = 0
    sequence = 0
    producer = 0

    async def expect(kind: str, messages: int, path: str, payload: Any) -> None:
        # The same body again on a 503: an identified message is stored once however often it is sent.
        status, answer = await retrying(traffic, lambda: http.post(path, payload))
        if status == 200:
            traffic.published[kind] += messages
        else:
            traffic.unexpected.append(f"{kind}: HTTP {status}: {str(answer)[:200]}")

    ticks = 0
    next_tick = time.monotonic()
    while not traffic.stop.is_set():
        calls: list[Awaitable[None]] = []
        for _ in range(MIX["single"][1]):
            calls.append(expect("single", 1, f"{base}/messages", body))
        calls.append(expect("batch", 100, f"{base}/messages/batch", {"messages": [body] * 100}))
        for _ in range(MIX["identified"][1]):
            counter += 1
            calls.append(expect("identified", 1, f"{base}/messages", {**body, "id": f"soak-{counter}", "source": "soak"}))
        size = MIX["identified_batch"][0]
        identified = [{**body, "id": f"soak-{counter + n}", "source": "soak"} for n in range(1, size + 1)]
        counter += size
        calls.append(expect("identified_batch", size, f"{base}/messages/batch", {"messages": identified}))
        size = MIX["producer"][0]
        if sequence + size > PRODUCER_SPAN:
            producer, sequence = producer + 1, 0
        numbered = [{**body, "producerid": f"soak-app-{producer}", "producerseq": sequence + n} for n in range(size)]
        sequence += size
        calls.append(expect("producer", size, f"{base}/messages/batch", {"messages": numbered}))
        # With an id, as a delayed publish answered 503 asks: its row may be stored already.
        counter += 1
        calls.append(expect("delayed", 1, f"{base}/messages",
                            {**body, "id": f"soak-{counter}", "source": "soak", "delay": DELAY_SECONDS}))
        if ticks % BAD_EVERY == 0:
            calls.append(_expect_refused(http, f"{base}/messages", traffic))
        if ticks % SCRAPE_EVERY == 0:
            calls.append(_scrape(http, queue, traffic))
        await asyncio.gather(*calls)
        ticks += 1
        next_tick += tick
        await asyncio.sleep(max(0.0, next_tick - time.monotonic()))


async def _expect_refused(http: KeepAliveClient, path: str, traffic: Traffic) -> None:
    status, answer = await http.request("POST", path, b'{"data": "x", "unknown": NaN')
    if status != 400:
        traffic.unexpected.append(f"malformed body: HTTP {status}: {str(answer)[:200]}")


async def _scrape(http: KeepAliveClient, queue: str, traffic: Traffic) -> None:
    for path in (f"/v1/queues/{queue}/stats", f"/v1/queues/{queue}/subscribers/{queue}/stats", "/metrics"):
        status, answer = await http.request_raw("GET", path, None)
        if status != 200:
            traffic.unexpected.append(f"GET {path}: HTTP {status}: {str(answer)[:200]}")


async def consume(http: KeepAliveClient, queue: str, per_call: int, traffic: Traffic) -> None:
    """Receive and ack (nacking one in NACK_EVERY) until told to stop."""
    sub = f"/v1/queues/{queue}/subscribers/{queue}"
    while not traffic.stop.is_set():
        status, answer = await retrying(traffic, lambda: http.post(f"{sub}/receive", {"max": per_call, "wait": 1}))
        if status != 200:
            traffic.unexpected.append(f"receive: HTTP {status}: {str(answer)[:200]}")
            continue
        receipts = [m["receipt"] for m in answer["messages"]]
        nack = [r for n, r in enumerate(receipts) if (traffic.consumed + n) % NACK_EVERY == NACK_EVERY - 1]
        ack = [r for r in receipts if r not in nack]
        if nack:
            status, answer = await retrying(traffic, lambda: http.post(f"{sub}/nack", {"receipts": nack, "delay": 1}))
            if status != 200:
                traffic.unexpected.append(f"nack: HTTP {status}: {str(answer)[:200]}")
            traffic.nacked += len(nack)
        if ack:
            body = {"receipts": ack} if len(ack) > 1 else {"receipt": ack[0]}
            status, answer = await retrying(traffic, lambda: http.post(f"{sub}/ack", body))
            if status != 200:
                traffic.unexpected.append(f"ack: HTTP {status}: {str(answer)[:200]}")
                continue
            traffic.consumed += len(ack)


async def soak_once(url: str, pid: int, log: Path, queue: str, text: str, seconds: float, rate: float,
                    sample_every: float, rss_idle: float, stop: asyncio.Event) -> dict[str, float]:
    """One run of `seconds`, or until `stop` is set (SIGINT, SIGTERM): its figures so far.
    The sidecar (logging to `log`) is asked for a memory report at the end of the warm-up and
    at the end; a tracing sidecar's reports carry snapshots, and the lines that grew between
    the two are printed."""
    per_tick = sum(messages * calls for messages, calls in MIX.values())
    traffic = Traffic()
    samples: list[tuple[float, float]] = []
    async with KeepAliveClient(url, limit=32) as http:
        started = time.monotonic()
        cpu_before = cpu_seconds([pid])
        workers = [asyncio.create_task(drive(http, queue, text, per_tick / rate, traffic))]
        workers += [asyncio.create_task(consume(http, queue, 50, traffic)) for _ in range(3)]
        workers += [asyncio.create_task(consume(http, queue, 1, traffic)) for _ in range(2)]
        warm: MemoryReport | None = None
        while (elapsed := time.monotonic() - started) < seconds:
            samples.append((elapsed, rss_bytes(pid) / MIB))
            if warm is None and elapsed >= seconds * WARMUP_SHARE:
                warm = await memory_report(pid, log, 1)
            if any(w.done() for w in workers):
                break  # a worker failed: its exception is raised below
            try:
                await asyncio.wait_for(stop.wait(), sample_every)
                break  # ended early: what was measured so far is reported
            except asyncio.TimeoutError:
                pass
        traffic.stop.set()
        await asyncio.gather(*workers)
        cpu = cpu_seconds([pid]) - cpu_before
        final = rss_bytes(pid) / MIB
        if final > 0:  # 0: the sidecar went first (a signal to the whole process group)
            samples.append((time.monotonic() - started, final))
        end = await memory_report(pid, log, 2 if warm is not None else 1)
        warm = warm or end  # stopped within the warm-up: no growth to tell
        if warm.snapshot is not None and end.snapshot is not None and end is not warm:
            print_growth(warm.snapshot, end.snapshot)
    if traffic.unexpected:
        raise SystemExit("soak: unexpected answers:\n" + "\n".join(traffic.unexpected[:20]))
    warm_until = samples[-1][0] * WARMUP_SHARE
    after = [s for s in samples if s[0] >= warm_until]
    published = sum(traffic.published.values())
    print(f"soak: published {dict(traffic.published)}, consumed {traffic.consumed}, nacked {traffic.nacked}; "
          f"RSS every {sample_every:.0f}s: " + " ".join(f"{m:.1f}" for _, m in samples[:: max(1, len(samples) // 40)]),
          file=sys.stderr, flush=True)
    return {
        "minutes": samples[-1][0] / 60,
        "published": published,
        "consumed": traffic.consumed,
        "cpu_per_message": cpu / max(1, published) * 1e6,
        "rss_idle": rss_idle,
        "rss_warm": after[0][1],
        "rss_end": samples[-1][1],
        "rss_max": max(m for _, m in samples),
        "growth_per_hour": slope_per_hour(after),
        "growth": samples[-1][1] - after[0][1],
        "objects_warm": warm.objects,
        "objects_end": end.objects,
        "object_growth": end.objects - warm.objects,
        "retried": traffic.retried,
        "unexpected": len(traffic.unexpected),
    }


@dataclass(frozen=True)
class MemoryReport:
    """What the sidecar's `number`th memory report said: its live containers, and its
    allocation snapshot when it traces."""

    objects: int
    snapshot: Path | None


async def memory_report(pid: int, log: Path, number: int) -> MemoryReport:
    """SIGUSR2 to the sidecar, then its report's line in `log` (logged once the snapshot, if
    any, is written whole)."""
    os.kill(pid, signal.SIGUSR2)
    line = re.compile(rf"memory report {number}: RSS [\d.]+ MiB, (\d+) tracked objects[^\n]*?(?:, snapshot (\S+))?$",
                      re.MULTILINE)
    deadline = time.monotonic() + REPORT_WAIT_SECONDS
    while time.monotonic() < deadline:
        found = line.search(log.read_text(errors="replace"))
        if found:
            return MemoryReport(int(found.group(1)), Path(found.group(2)) if found.group(2) else None)
        await asyncio.sleep(0.2)
    raise SystemExit(f"soak: the sidecar logged no memory report {number} in {REPORT_WAIT_SECONDS:.0f}s")


def print_growth(before: Path, after: Path) -> None:
    print("soak: live allocations grown from the end of the warm-up to the end, by source line:", file=sys.stderr)
    for grown in growth(before, after, GROWTH_LINES):
        print(f"  {grown.line()}", file=sys.stderr)
    print(file=sys.stderr, flush=True)


async def main() -> None:
    parser = arguments((__doc__ or "").splitlines()[0], 0, 1024)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=300.0, help="messages published per second, about")
    parser.add_argument("--trace-memory", type=int, default=0, metavar="FRAMES",
                        help="trace the sidecar's allocations (this many frames each) and print the source lines "
                             "whose live allocations grew after the warm-up; its CPU and RSS then include the "
                             "tracing's own")
    parser.set_defaults(runs=1)
    args = parse(parser, smoke_messages=0)
    seconds = 20.0 if args.smoke else args.minutes * 60
    sample_every = SMOKE_SAMPLE_SECONDS if args.smoke else SAMPLE_SECONDS

    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    queue = QueueRef("default", "soak")
    text = text_payload(args.size)
    log = Path(tempfile.gettempdir()) / f"{settings.keyspace}-soak-sidecar.log"
    snapshots = Path(tempfile.mkdtemp(prefix="casque-soak-memory-")) if args.trace_memory > 0 else None
    tracing = {} if snapshots is None else {"CASQUE_SIDECAR_MEMORY_TRACE_FRAMES": str(args.trace_memory),
                                            "CASQUE_SIDECAR_MEMORY_SNAPSHOT_DIR": str(snapshots)}
    process = None
    try:
        catalog.ensure_installation(store)
        catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE"))
        catalog.apply_subscriber(store, queue, queue.name, SubscriberSpec(
            queue=queue.name, start_position="earliest", visibility_timeout_seconds=30))

        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)

        async def once(run: int) -> dict[str, float]:
            nonlocal process
            process = start_sidecar(settings, queue.name, queue.name, log, tracing)
            url = await asyncio.to_thread(sidecar_url, process, log)
            await wait_ready(url, process, log)
            await asyncio.sleep(2)  # idle: connected, its consumer started, no request yet
            try:
                return await soak_once(url, process.pid, log, queue.name, text, seconds, args.rate, sample_every,
                                       rss_bytes(process.pid) / MIB, stop)
            finally:
                process.terminate()
                process.wait(30)

        samples = await repeat_async(args.runs, once)
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        drop_scratch(store, settings)
        store.close()
    log.unlink(missing_ok=True)
    if snapshots is not None:
        shutil.rmtree(snapshots, ignore_errors=True)
    report("soak", args, {"minutes": round(seconds / 60, 1), "rate": args.rate, "size": args.size,
                          "shards": args.shards, "sidecar": "own process"}, FIGURES, samples)



if __name__ == "__main__":
    asyncio.run(main())
