"""Latency benchmark: publish to first delivery through real sidecars, in each delivery mode,
beside the drivers' floor measured in the same run.

    python bench/bench_latency.py [--seconds 8] [--rates 10,100,1000] [--keys 20] [--shards 2]
        [--hogs 0] [--runs 3] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. This
process is the apps: one publisher and the consumers. It publishes through a sidecar of its
own (`casque sidecar`, no subscriber), one message per call, each call sent on schedule at
each rate (not after the last answer) for `--seconds`, with one of `--keys` keys. Each mode
has a queue of `--shards` shards and one subscriber, consumed through two sidecars of their
own, each long-polled by two loops that ack what they receive at once (one call per receive):
- leased: `delivery: leased`;
- shared: `delivery: shared`;
- ordered: `delivery: shared` with `orderedKeys`.
Each message carries its send time (`time.perf_counter()` of this process) in its data, so
publish -> first delivery is read on one clock: from before the publish call to the answer
of the receive that carried it. With ordered keys, a key's message that was published
before its predecessor's ack returned waited for that ack: its `hand-off` is the time from
the ack's answer to its delivery. After the rates, `--burst` messages of one key are
published in one call: the hand-off of each after the first, and how many of that key the
consumers get through a second (an app that acks at once).

The floor (latency_floor.py) is the same schedule through the drivers alone: a conditional
write, a ZooKeeper write, a watch firing and a read, nothing else. Each mode's p50 and p99
are also given as ratios to the floor's at the same rate, measured in the same run. Before
each mode's rates, a few messages warm it up (connections, the publisher of the queue, the
members' first claims); they are not counted. Each mode's rows give the CPU its two consuming
sidecars used per message (utime + stime from /proc). `--hogs 2` runs two busy processes
beside it all: the figures of a machine loaded by other work, to set beside a quiet run's.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from casque.config import Settings
from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

import latency_floor
from bench_sidecar import start_sidecar, wait_ready
from benchlib import (Figure, arguments, cpu_hogs, cpu_seconds, drop_scratch, parse, repeat_async, report,
                      scratch_settings, sidecar_url)
from keepalive import KeepAliveClient

MODES = {"leased": ("leased", False), "shared": ("shared", False), "ordered": ("shared", True)}
SIDECARS_PER_MODE = 2
LOOPS_PER_SIDECAR = 2
RECEIVE_MAX = 10
RECEIVE_WAIT = 2.0
PUBLISH_CONNECTIONS = 64
WARM_UP = 20
# After the last publish of a phase, how long its messages may take to arrive.
DRAIN_LIMIT_SECONDS = 60.0


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    """p50, p90 and p99 of `samples` (seconds), in milliseconds."""
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] * 1000

    return at(0.5), at(0.9), at(0.99)


@dataclass
class Phase:
    """The messages of one schedule: when each was sent, first delivered and acked, and its key."""

    name: str
    expected: int
    sent: dict[int, float] = field(default_factory=dict)
    key: dict[int, str] = field(default_factory=dict)
    delivered: dict[int, float] = field(default_factory=dict)
    acked: dict[int, float] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def latencies(self) -> list[float]:
        return [self.delivered[i] - self.sent[i] for i in self.delivered]

    def hand_offs(self, waited_only: bool) -> list[float]:
        """Per key, each message's delivery after its predecessor's ack answered; only those
        sent before that ack answered (they waited for it), with `waited_only`."""
        by_key: dict[str, list[int]] = {}
        for i in sorted(self.sent):
            by_key.setdefault(self.key[i], []).append(i)
        found = []
        for numbers in by_key.values():
            for before, after in zip(numbers, numbers[1:]):
                acked, delivered = self.acked.get(before), self.delivered.get(after)
                if acked is None or delivered is None:
                    continue
                if waited_only and self.sent[after] >= acked:
                    continue
                found.append(delivered - acked)
        return found


class Consumers:
    """Loops that long-poll a subscriber's sidecars and ack at once, noting each message's
    first delivery and ack in the phase its data names."""

    def __init__(self, urls: list[str], queue: str, subscriber: str) -> None:
        self._urls = urls
        self._path = f"/v1/queues/{queue}/subscribers/{subscriber}"
        self.phases: dict[str, Phase] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: list[KeepAliveClient] = []

    def start(self) -> None:
        for url in self._urls:
            client = KeepAliveClient(url, limit=LOOPS_PER_SIDECAR * 2)
            self._clients.append(client)
            self._tasks += [asyncio.create_task(self._loop(client)) for _ in range(LOOPS_PER_SIDECAR)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for client in self._clients:
            await client.close()

    async def _loop(self, http: KeepAliveClient) -> None:
        while not self._stop.is_set():
            got = (await http.post_ok(f"{self._path}/receive", {"max": RECEIVE_MAX, "wait": RECEIVE_WAIT}))["messages"]
            if not got:
                continue
            now = time.perf_counter()
            seen = []
            for message in got:
                name, number, _ = message["data"].split(" ")
                phase = self.phases.get(name)
                if phase is not None:
                    phase.delivered.setdefault(int(number), now)
                    seen.append((phase, int(number)))
            await http.post_ok(f"{self._path}/ack", {"receipts": [m["receipt"] for m in got]})
            acked = time.perf_counter()
            for phase, number in seen:
                phase.acked.setdefault(number, acked)
                if len(phase.delivered) >= phase.expected:
                    phase.done.set()


async def publish_phase(http: KeepAliveClient, queue: str, consumers: Consumers, phase: Phase, rate: float,
                        keys: int) -> None:
    """`phase.expected` one-message publishes, one every 1/rate s, then waits for them all to arrive."""
    consumers.phases[phase.name] = phase
    path = f"/v1/queues/{queue}/messages"

    async def send(i: int) -> None:
        phase.key[i] = f"key-{i % keys}"
        phase.sent[i] = time.perf_counter()
        await http.post_ok(path, {"data": f"{phase.name} {i} {phase.sent[i]!r}", "datacontenttype": "text/plain",
                                  "partitionkey": phase.key[i]})

    started = time.perf_counter()
    calls = []
    for i in range(phase.expected):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        calls.append(asyncio.create_task(send(i)))
    await asyncio.gather(*calls)
    await arrival(phase)


async def publish_burst(http: KeepAliveClient, queue: str, consumers: Consumers, phase: Phase) -> None:
    """`phase.expected` messages of one key in one call."""
    consumers.phases[phase.name] = phase
    sent = time.perf_counter()
    for i in range(phase.expected):
        phase.sent[i], phase.key[i] = sent, "burst"
    await http.post_ok(f"/v1/queues/{queue}/messages/batch", {"messages": [
        {"data": f"{phase.name} {i} {sent!r}", "datacontenttype": "text/plain", "partitionkey": "burst"}
        for i in range(phase.expected)]})
    await arrival(phase)


async def arrival(phase: Phase) -> None:
    try:
        await asyncio.wait_for(phase.done.wait(), DRAIN_LIMIT_SECONDS)
    except TimeoutError:
        raise SystemExit(f"bench_latency: {phase.name}: {len(phase.delivered)} of {phase.expected} messages "
                         f"delivered {DRAIN_LIMIT_SECONDS:.0f}s after the last publish") from None


async def floor_phase(backends: latency_floor.Backends, shard: int, znode: str, count: int, rate: float) -> list[float]:
    trip = latency_floor.Trip(backends, shard, znode)
    await trip.start(count)
    started = time.perf_counter()
    for i in range(count):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        trip.send()
    try:
        await asyncio.wait_for(trip.all_arrived.wait(), DRAIN_LIMIT_SECONDS)
    except TimeoutError:
        raise SystemExit(f"bench_latency: floor at {rate:g}/s: {len(trip.arrived)} of {count} arrived") from None
    if trip.failure is not None:
        raise SystemExit(f"bench_latency: floor at {rate:g}/s failed: {trip.failure!r}")
    return trip.arrived


@dataclass
class Setting:
    """What every run shares: the stack, the scratch keyspace, the publishing sidecar."""

    args: argparse.Namespace
    settings: Settings
    store: Store
    publisher_url: str
    logs: Path


def counts(args: argparse.Namespace) -> dict[int, int]:
    return {rate: max(10, round(rate * args.seconds)) for rate in args.rates}


async def measure_floor(setting: Setting, run: int) -> dict[str, float]:
    args, figures, root = setting.args, {}, setting.settings.zookeeper_root
    backends = await asyncio.to_thread(latency_floor.Backends, args.cassandra, args.zookeeper,
                                       setting.settings.keyspace)
    try:
        await floor_phase(backends, 10_000 + run, f"{root}/floor-warm-{run}", WARM_UP, 50)
        for index, (rate, count) in enumerate(counts(args).items()):
            arrived = await floor_phase(backends, 100 * run + index, f"{root}/floor-{run}-{rate}", count, rate)
            figures.update(zip((f"floor_{rate}_p50", f"floor_{rate}_p90", f"floor_{rate}_p99"), quantiles(arrived)))
    finally:
        await asyncio.to_thread(backends.close)
    return figures


async def measure_mode(setting: Setting, run: int, mode: str, floor: dict[str, float]) -> dict[str, float]:
    args, store = setting.args, setting.store
    delivery, ordered = MODES[mode]
    queue = QueueRef("default", f"{mode}-{run}")
    catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, queue, "app", SubscriberSpec(
        queue=queue.name, start_position="earliest", visibility_timeout_seconds=30, delivery=delivery,
        ordered_keys=ordered))
    processes = []
    figures: dict[str, float] = {}
    try:
        urls = []
        for n in range(SIDECARS_PER_MODE):
            log = setting.logs / f"{queue.name}-{n}.log"
            process = start_sidecar(setting.settings, queue.name, "app", log)
            processes.append(process)
            url = await asyncio.to_thread(sidecar_url, process, log)
            await wait_ready(url, process, log)
            urls.append(url)
        consumers = Consumers(urls, queue.name, "app")
        consumers.start()
        try:
            async with KeepAliveClient(setting.publisher_url, limit=PUBLISH_CONNECTIONS) as http:
                await publish_phase(http, queue.name, consumers, Phase("warm", WARM_UP), 50, args.keys)
                for rate, count in counts(args).items():
                    phase = Phase(f"r{rate}", count)
                    cpu_before = cpu_seconds(p.pid for p in processes)
                    await publish_phase(http, queue.name, consumers, phase, rate, args.keys)
                    figures[f"{mode}_{rate}_cpu"] = (cpu_seconds(p.pid for p in processes) - cpu_before) / count * 1000
                    p50, p90, p99 = quantiles(phase.latencies())
                    figures |= {f"{mode}_{rate}_p50": p50, f"{mode}_{rate}_p90": p90, f"{mode}_{rate}_p99": p99,
                                f"{mode}_{rate}_p50_floor": p50 / floor[f"floor_{rate}_p50"],
                                f"{mode}_{rate}_p99_floor": p99 / floor[f"floor_{rate}_p99"]}
                    waited = phase.hand_offs(waited_only=True)
                    if ordered and waited:
                        p50, _, p99 = quantiles(waited)
                        figures[f"{mode}_{rate}_handoff_p50"], figures[f"{mode}_{rate}_handoff_p99"] = p50, p99
                if ordered:
                    burst = Phase("burst", args.burst)
                    await publish_burst(http, queue.name, consumers, burst)
                    figures["burst_handoff_p50"], _, figures["burst_handoff_p99"] = quantiles(burst.hand_offs(False))
                    times = sorted(burst.delivered.values())
                    figures["burst_rate"] = (len(times) - 1) / max(1e-6, times[-1] - times[0])
        finally:
            await consumers.stop()
    finally:
        for process in processes:
            stop(process)
    return figures


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def once(setting: Setting, run: int) -> dict[str, float]:
    figures = await measure_floor(setting, run)
    for mode in MODES:
        figures |= await measure_mode(setting, run, mode, figures)
    for rate in setting.args.rates:
        for mode in ("shared", "ordered"):
            figures[f"{mode}_{rate}_of_leased"] = figures[f"{mode}_{rate}_p50"] / figures[f"leased_{rate}_p50"]
    return figures


def figure_list(rates: list[int]) -> list[Figure]:
    listed = []
    for rate in rates:
        listed += [Figure(f"floor_{rate}_p50", f"{rate} msgs/s: drivers' floor, publish -> read p50", "ms"),
                   Figure(f"floor_{rate}_p90", "  p90", "ms"), Figure(f"floor_{rate}_p99", "  p99", "ms")]
        for mode in MODES:
            listed += [Figure(f"{mode}_{rate}_p50", f"  {mode}: publish -> first delivery p50", "ms"),
                       Figure(f"{mode}_{rate}_p90", "    p90", "ms"), Figure(f"{mode}_{rate}_p99", "    p99", "ms"),
                       Figure(f"{mode}_{rate}_p50_floor", "    p50 / floor's p50", "x"),
                       Figure(f"{mode}_{rate}_p99_floor", "    p99 / floor's p99", "x"),
                       Figure(f"{mode}_{rate}_cpu", "    CPU of the consuming sidecars per message", "ms")]
            if mode != "leased":
                listed.append(Figure(f"{mode}_{rate}_of_leased", "    p50 / leased p50 (goal <= 1.5)", "x"))
        listed += [Figure(f"ordered_{rate}_handoff_p50", "  ordered: ack -> next of the key, when it waited, p50",
                          "ms"),
                   Figure(f"ordered_{rate}_handoff_p99", "    p99", "ms")]
    return listed + [
        Figure("burst_handoff_p50", "one key's burst, ordered: ack -> next of the key p50 (goal <= 10)", "ms"),
        Figure("burst_handoff_p99", "  p99", "ms"),
        Figure("burst_rate", "  the key's messages delivered a second (goal >= 50)", "msgs/s"),
    ]


async def main() -> None:
    parser = arguments((__doc__ or "").splitlines()[0], messages=0, size=0)
    parser.set_defaults(shards=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each rate publishes")
    parser.add_argument("--rates", default="10,100,1000", help="publishes a second, comma-separated")
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--burst", type=int, default=200, help="messages of one key published in one call")
    parser.add_argument("--hogs", type=int, default=0, help="busy processes beside the whole run (a loaded machine)")
    args = parse(parser, smoke_messages=0)
    args.rates = [int(rate) for rate in args.rates.split(",")]
    if args.smoke:
        args.seconds, args.burst = 0.5, 20
    settings = scratch_settings(args.cassandra, args.zookeeper)
    logs = Path(tempfile.mkdtemp(prefix="casque-bench-latency-"))
    store = Store.open(settings)
    publisher = None
    hogs = cpu_hogs(args.hogs)
    try:
        catalog.ensure_installation(store)
        log = logs / "publisher.log"
        # The apps' publishing sidecar consumes for nobody: the queue it names is never read.
        publisher = start_sidecar(settings, "unused", None, log)
        url = await asyncio.to_thread(sidecar_url, publisher, log)
        await wait_ready(url, publisher, log)
        setting = Setting(args, settings, store, url, logs)
        samples = await repeat_async(args.runs, lambda run: once(setting, run))
    finally:
        for process in [publisher, *hogs] if publisher is not None else hogs:
            stop(process)
        drop_scratch(store, settings)
        store.close()
    report("latency", args, {"seconds per rate": args.seconds, "keys": args.keys, "shards": args.shards,
                             "sidecars per subscriber": SIDECARS_PER_MODE, "loops per sidecar": LOOPS_PER_SIDECAR,
                             "CPU hogs": args.hogs},
           figure_list(args.rates), samples)


if __name__ == "__main__":
    asyncio.run(main())
