"""Ordered keys benchmark: publish-to-first-delivery latency of a shared subscriber with and
without `orderedKeys`, at a steady publish rate, in the same run.

    python bench/bench_keys.py [--messages 2600] [--rate 65] [--keys 40] [--members 4] [--shards 2]
        [--runs 3] [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. One
queue, two shared subscribers of it, one with `orderedKeys` and one without, each with
`--members` consumers that receive (up to 10 messages a call, a long poll) and ack at once.
One publisher sends `--messages` single-message publishes at `--rate` a second, each with one
of `--keys` keys and its send time (`time.time()`) in the payload; both subscribers see the
same publishes on the same cores, so their latencies compare within a run.

The publisher runs in this process and each subscriber's members in a process of their own
(this script started again, with its own Store and event loop). With all three in one
process, at 65 publishes a second that process kept most of a core busy and the latency
measured was mostly its own event loop's queue (unordered p50 about 2 s, 0.1 s at 20 a
second), and the two subscribers took CPU from each other. A subscriber's process sends
this one each message's latency (delivery time minus send time, one host's clock), its
consumers' ZooKeeper writes and its CPU time, as JSON on its stdout. A process that fails
or does not answer in time ends the benchmark with one line that names it (its stderr is
kept, the line says where); every child is stopped whatever happens.

Figures: p50 and p99 of send-to-first-delivery per subscriber, the ordered p50 over the
unordered p50 (the goal: at most 2), each subscriber's ZooKeeper writes (claims, renewals,
completions, published key sets) per 1,000 messages, and each process's CPU seconds (user +
system, all its threads) per 1,000 messages: the publisher's while it publishes, a
subscriber's from when its members run to its last first delivery. At `--rate` r, 1000/r
seconds (15.4 at 65/s) per 1,000 messages is a core busy all along: a process near that was
saturated, and its latencies include its own queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import Figure, arguments, drop_scratch, parse, percentiles, repeat_async, report, scratch_settings

RECEIVE_MAX = 10
RECEIVE_WAIT = 1.0
# After the last publish, how long the subscribers may take to deliver the rest.
DRAIN_LIMIT_SECONDS = 120.0
# A subscriber's process imports casque and the driver, connects and starts its members
# before it is ready: several seconds on a loaded machine.
READY_LIMIT_SECONDS = 120.0
# Past its own drain limit, how long a subscriber's process may take to stop its members and
# report before it counts as hung.
REPORT_GRACE_SECONDS = 60.0
# Between SIGTERM and SIGKILL of a subscriber's process that is still running at the end.
STOP_GRACE_SECONDS = 10.0
SUBSCRIBERS = {"unordered": False, "ordered": True}
# The (undocumented) argument that makes this script one subscriber's process.
SUBSCRIBER_PROCESS = "--subscriber-process"
PUBLISHED = b"published\n"
# A report holds a float per message: beyond asyncio's default 64 KiB line limit at a few
# thousand messages.
ANSWER_LIMIT_BYTES = 2**26


@dataclass(frozen=True)
class Assignment:
    """What a subscriber's process is told: where the stack and queue are, which subscriber it runs."""

    cassandra: str
    zookeeper: str
    keyspace: str
    queue: str
    subscriber: str
    members: int
    messages: int


@dataclass(frozen=True)
class Delivered:
    """What a subscriber's process reports: each message's first delivery latency (s), its
    consumers' ZooKeeper writes, and its CPU seconds from when its members ran to the last
    first delivery."""

    latency: list[float]
    zk_writes: int
    cpu_seconds: float


class Group:
    """The members of one subscriber, and each message's first delivery latency."""

    def __init__(self, store: Store, queue: QueueRef, name: str, members: int, expected: int) -> None:
        self.consumers = [Consumer(store, queue, name) for _ in range(members)]
        self.latency: dict[str, float] = {}
        self.expected = expected
        self.all_seen = asyncio.Event()

    async def start(self) -> None:
        for consumer in self.consumers:
            await consumer.start()

    async def member(self, consumer: Consumer, stop: asyncio.Event) -> None:
        while not stop.is_set():
            got = await consumer.receive(max_messages=RECEIVE_MAX, wait=RECEIVE_WAIT)
            now = time.time()
            for delivery in got:
                (sent,) = struct.unpack("!d", delivery.message.payload[:8])
                self.latency.setdefault(delivery.message.message_id, now - sent)
            if got:
                await consumer.ack_many([d.receipt for d in got])
            if len(self.latency) >= self.expected:
                self.all_seen.set()

    async def stop(self) -> None:
        for consumer in self.consumers:
            await consumer.stop()

    def zk_writes(self) -> int:
        return sum(c._sharing.zk_writes for c in self.consumers if c._sharing is not None)


async def subscriber_process() -> None:
    """One subscriber's members, in a process of their own. On stdin: the Assignment (a JSON
    line), then PUBLISHED once the last message is sent. On stdout: {"ready": true} once the
    members receive, then the Delivered report (a JSON line) once every message arrived."""
    # The parent reads this process's stdout as its answers: whatever else prints goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    control = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
    job = Assignment(**json.loads(await control.readline()))
    store = Store.open(scratch_settings(job.cassandra, job.zookeeper, job.keyspace))
    try:
        group = Group(store, QueueRef("default", job.queue), job.subscriber, job.members, job.messages)
        await group.start()
        stop = asyncio.Event()
        members = [asyncio.create_task(group.member(consumer, stop)) for consumer in group.consumers]
        try:
            started = time.process_time()
            tell(answers, {"ready": True})
            # EOF instead: the parent is gone, and nobody will publish or read the report.
            if await control.readline() != PUBLISHED:
                raise SystemExit(f"{job.subscriber}: the publishing process went away")
            try:
                await asyncio.wait_for(group.all_seen.wait(), DRAIN_LIMIT_SECONDS)
            except TimeoutError:
                raise SystemExit(f"{job.subscriber}: not every message delivered {DRAIN_LIMIT_SECONDS:.0f}s after "
                                 f"the last publish: {len(group.latency)} of {job.messages}") from None
            cpu = time.process_time() - started
        finally:
            stop.set()
            await asyncio.gather(*members)
            writes = group.zk_writes()
            await group.stop()
        tell(answers, asdict(Delivered(list(group.latency.values()), writes, cpu)))
    finally:
        store.close()


def tell(answers: TextIO, document: dict[str, Any]) -> None:
    answers.write(json.dumps(document) + "\n")
    answers.flush()


class SubscriberProcess:
    """The parent's handle on a subscriber's process: what it says, and its end."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, errors: Path) -> None:
        self.name = name
        self.process = process
        self.errors = errors

    @classmethod
    async def start(cls, job: Assignment, errors: Path) -> SubscriberProcess:
        with errors.open("wb") as sink:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).resolve()), SUBSCRIBER_PROCESS,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=sink,
                limit=ANSWER_LIMIT_BYTES)
        child = cls(job.subscriber, process, errors)
        await child.say(json.dumps(asdict(job)).encode() + b"\n")
        return child

    async def say(self, line: bytes) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line)
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it exited: reading its answer says how

    async def answer(self, limit: float) -> dict[str, Any]:
        """Its next line; a SystemExit naming it if it exits or stays silent for `limit` s instead."""
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), max(0.0, limit))
        except TimeoutError:
            raise self.failure(f"did not answer within {limit:.0f}s") from None
        if not line:
            raise self.failure(await self.exit_status())
        answered: dict[str, Any] = json.loads(line)
        return answered

    async def finish(self) -> None:
        """Wait for it to exit after its report; anything but a clean exit fails the run."""
        try:
            await asyncio.wait_for(self.process.wait(), STOP_GRACE_SECONDS)
        except TimeoutError:
            raise self.failure(f"did not exit within {STOP_GRACE_SECONDS:.0f}s of its report") from None
        if self.process.returncode != 0:
            raise self.failure(await self.exit_status())

    async def exit_status(self) -> str:
        try:
            code = await asyncio.wait_for(self.process.wait(), STOP_GRACE_SECONDS)
        except TimeoutError:
            return "closed its stdout but did not exit"
        return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def failure(self, what: str) -> SystemExit:
        lines = [line.strip() for line in self.errors.read_text(errors="replace").splitlines() if line.strip()]
        said = f": {lines[-1]}" if lines else ""
        return SystemExit(f"bench_keys: the {self.name} subscriber's process {what}{said} (stderr: {self.errors})")

    async def close(self) -> None:
        """End it if it still runs (a failed or interrupted run), and release its pipes."""
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), STOP_GRACE_SECONDS)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()


async def publish_steadily(store: Store, queue: QueueRef, count: int, rate: float, keys: int, size: int) -> None:
    """`count` single-message publishes, one every 1/rate s (each sent on time, not after the last answer)."""
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    padding = b"x" * max(0, size - 8)
    started = time.monotonic()
    calls: list[asyncio.Task[object]] = []
    for i in range(count):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        message = OutgoingMessage(struct.pack("!d", time.time()) + padding, key=f"key-{i % keys}")
        calls.append(asyncio.create_task(publisher.publish([message])))
    await asyncio.gather(*calls)
    await publisher.flush_heads()


async def once(store: Store, args: argparse.Namespace, logs: Path, run: int) -> dict[str, float]:
    messages: int = args.messages
    queue = QueueRef("default", f"keys-{run}")
    catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE"))
    for name, ordered in SUBSCRIBERS.items():
        catalog.apply_subscriber(store, queue, name, SubscriberSpec(
            queue=queue.name, start_position="earliest", visibility_timeout_seconds=30, delivery="shared",
            ordered_keys=ordered))
    loop = asyncio.get_running_loop()
    children: list[SubscriberProcess] = []
    try:
        for name in SUBSCRIBERS:
            job = Assignment(args.cassandra, args.zookeeper, store.keyspace, queue.name, name, args.members, messages)
            children.append(await SubscriberProcess.start(job, logs / f"run{run}-{name}.stderr"))
        deadline = loop.time() + READY_LIMIT_SECONDS
        for child in children:
            await child.answer(deadline - loop.time())
        started = time.process_time()
        await publish_steadily(store, queue, messages, args.rate, args.keys, args.size)
        publisher_cpu = time.process_time() - started
        for child in children:
            await child.say(PUBLISHED)
        deadline = loop.time() + DRAIN_LIMIT_SECONDS + REPORT_GRACE_SECONDS
        reports: dict[str, Delivered] = {}
        for child in children:
            reports[child.name] = Delivered(**await child.answer(deadline - loop.time()))
            await child.finish()
    finally:
        for child in children:
            await child.close()
    figures: dict[str, float] = {"publisher_cpu_per_1000": publisher_cpu * 1000 / messages}
    for name, delivered in reports.items():
        p50, p99 = percentiles(delivered.latency)
        figures[f"{name}_p50"], figures[f"{name}_p99"] = p50, p99
        figures[f"{name}_zk_writes_per_1000"] = delivered.zk_writes * 1000 / messages
        figures[f"{name}_cpu_per_1000"] = delivered.cpu_seconds * 1000 / messages
    figures["ratio_p50"] = figures["ordered_p50"] / figures["unordered_p50"]
    figures["ratio_p99"] = figures["ordered_p99"] / figures["unordered_p99"]
    return figures


FIGURES = [
    Figure("unordered_p50", "shared, no orderedKeys: publish to first delivery p50", "ms"),
    Figure("unordered_p99", "  p99", "ms"),
    Figure("ordered_p50", "shared, orderedKeys: publish to first delivery p50", "ms"),
    Figure("ordered_p99", "  p99", "ms"),
    Figure("ratio_p50", "ordered p50 / unordered p50 (goal <= 2)", "x"),
    Figure("ratio_p99", "ordered p99 / unordered p99", "x"),
    Figure("unordered_zk_writes_per_1000", "no orderedKeys: ZooKeeper writes per 1,000 messages", ""),
    Figure("ordered_zk_writes_per_1000", "orderedKeys: ZooKeeper writes per 1,000 messages", ""),
    Figure("publisher_cpu_per_1000", "publisher process: CPU seconds per 1,000 messages (one core: 1000/rate)", "s"),
    Figure("unordered_cpu_per_1000", "no orderedKeys process: CPU seconds per 1,000 messages", "s"),
    Figure("ordered_cpu_per_1000", "orderedKeys process: CPU seconds per 1,000 messages", "s"),
]


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], messages=2600, size=64)
    parser.set_defaults(shards=2)
    parser.add_argument("--rate", type=float, default=65.0, help="publishes a second")
    parser.add_argument("--keys", type=int, default=40)
    parser.add_argument("--members", type=int, default=4, help="members of each subscriber")
    args = parse(parser, smoke_messages=200)
    settings = scratch_settings(args.cassandra, args.zookeeper)
    # The subscriber processes' stderr: removed after a good run, kept after a failed one.
    logs = Path(tempfile.mkdtemp(prefix="casque-bench-keys-"))
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        samples = await repeat_async(args.runs, lambda run: once(store, args, logs, run))
    finally:
        drop_scratch(store, settings)
        store.close()
    shutil.rmtree(logs)
    report("keys", args, {"messages": args.messages, "rate": args.rate, "keys": args.keys,
                          "members": args.members, "shards": args.shards}, FIGURES, samples)


if __name__ == "__main__":
    if sys.argv[1:] == [SUBSCRIBER_PROCESS]:
        asyncio.run(subscriber_process())
    else:
        asyncio.run(main())
