"""Profiles a `casque sidecar` process under one of bench_sidecar.py's cost phases.

    python bench/profile_sidecar.py --phase batched [--seconds 15] [--out profile.json]
        [--format speedscope|raw] [--rate 200] [--size 1024] [--shards 4] [--native] [--no-profile]
        [--no-subscriber] [--floor] [--protocol N]

Phases, as bench_sidecar.py makes them: `single` (one-message publishes, 32 in flight),
`batched` (100-message publishes, 4 in flight), `keyed` (the same with producer
sequences, each call the next 100 numbers of one producer), `consume_batched` (receive 100 + ack 100,
4 loops, on a queue filled first), `pair` (receive 1 + ack 1, 32 loops). The phase runs
until `py-spy record` (all threads, idle samples left out; `--nonblocking` unless `--native`,
since C frames are read only from a paused process) has sampled
the sidecar for `--seconds`; then the sidecar's CPU per message over that window is
printed, so a profile and the figure it explains come from the same load, and split by
thread (from /proc/<pid>/task, named by `py-spy dump`): the event loop, the Cassandra
driver's I/O loop, kazoo's connection and callback threads, the executors. The sidecar
runs in a scratch keyspace of its own, dropped at the end, like bench_sidecar.py's; it
consumes for the queue's subscriber (whose reader then follows the publishes), or with
`--no-subscriber` for none, as a publishing app's would. `--floor` profiles the drivers'
floor (driver_floor_server.py: the same calls written durably and nothing else) instead of
the sidecar, under the same load, so that the two can be set side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from casque.engine import catalog, protocol, protocol_change
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from bench_sidecar import (
    BATCH,
    COST_BATCH_WINDOW,
    COST_WINDOW,
    RECEIVERS,
    backend_env,
    start_server,
    start_sidecar,
    wait_ready,
)
from benchlib import (
    cpu_seconds,
    drop_scratch,
    pipeline,
    scratch_settings,
    sidecar_url,
    text_payload,
    thread_cpu_seconds,
    thread_names,
)
from keepalive import KeepAliveClient

PHASES = ("single", "batched", "keyed", "consume_batched", "pair")


@dataclass
class Load:
    """The phase's state: set once its calls are what is measured, and the messages they moved."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    done: int = 0


async def drive(url: str, queue: str, phase: str, text: str, load: Load) -> None:
    """Runs `phase` until `load.stop` is set, counting the messages it publishes or consumes."""
    base = f"/v1/queues/{queue}"
    sub = f"{base}/subscribers/{queue}"
    body = {"data": text, "datacontenttype": "text/plain"}
    async with KeepAliveClient(url, limit=COST_WINDOW + 4) as http:
        post = http.post_ok

        async def publish(messages: int, window: int, producer: str | None = None) -> None:
            if producer is not None:
                numbered = iter(range(10**9))

                async def once() -> None:
                    first = next(numbered) * messages
                    await post(f"{base}/messages/batch", {"messages": [
                        {**body, "producerid": producer, "producerseq": first + n} for n in range(messages)]})
            elif messages == 1:
                async def once() -> None:
                    await post(f"{base}/messages", body)
            else:
                batch = {"messages": [body] * messages}

                async def once() -> None:
                    await post(f"{base}/messages/batch", batch)

            async def loop() -> None:
                while not load.stop.is_set():
                    await once()
                    load.done += messages

            await asyncio.gather(*(loop() for _ in range(window)))

        async def consume(per_call: int, loops: int) -> None:
            async def loop() -> None:
                while not load.stop.is_set():
                    messages = (await post(f"{sub}/receive", {"max": per_call, "wait": 1}))["messages"]
                    if not messages:
                        continue
                    if len(messages) == 1:
                        await post(f"{sub}/ack", {"receipt": messages[0]["receipt"]})
                    else:
                        await post(f"{sub}/ack", {"receipts": [m["receipt"] for m in messages]})
                    load.done += len(messages)

            await asyncio.gather(*(loop() for _ in range(loops)))

        if phase == "single":
            load.started.set()
            await publish(1, COST_WINDOW)
        elif phase == "batched":
            load.started.set()
            await publish(BATCH, COST_BATCH_WINDOW)
        elif phase == "keyed":
            load.started.set()
            await publish(BATCH, COST_BATCH_WINDOW, producer=f"profile-{time.time_ns()}")
        else:
            # The queue is filled first, with more than the phase can consume, so that every
            # receive finds messages: the profile is then of consuming, not of waiting.
            batch = {"messages": [body] * BATCH}
            await pipeline(600, COST_BATCH_WINDOW, lambda i: post(f"{base}/messages/batch", batch))
            load.started.set()
            await (consume(BATCH, RECEIVERS) if phase == "consume_batched" else consume(1, COST_WINDOW))


async def batches_written(url: str, store: Store, queue: QueueRef, shards: int, floor: bool) -> int:
    if floor:
        async with KeepAliveClient(url, limit=1) as http:
            return int((await http.get("/stats"))[1]["batches"])
    # Every batch up to a shard's head was written by this run (the queue is new).
    return sum(int(store.zk.get(store.paths(queue).head(shard))[0] or b"0") for shard in range(shards))


def by_thread(before: dict[int, float], after: dict[int, float], names: dict[int, str]) -> list[tuple[str, float]]:
    """CPU seconds spent between the two readings, per thread name (threads of one name,
    such as a pool's workers, summed, and so are those Python did not start), largest first."""
    spent: dict[str, float] = {}
    for tid, now in after.items():
        # "Thread-3 (_run_loop)" is its target's; a pool's workers ("…_0", "…_1") are one.
        name = re.sub(r"_\d+$", "", re.sub(r"^Thread-\d+ \((.*)\)$", r"\1", names.get(tid, "(not Python's)")))
        spent[name] = spent.get(name, 0.0) + now - before.get(tid, 0.0)
    return sorted(spent.items(), key=lambda item: -item[1])


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--phase", choices=PHASES, required=True)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--out", type=Path, default=Path("profile.json"))
    parser.add_argument("--format", choices=("speedscope", "raw"), default="speedscope")
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames too (the GC, the parsers)")
    parser.add_argument("--no-profile", action="store_true", help="only the CPU per message, no py-spy")
    parser.add_argument("--no-subscriber", action="store_true",
                        help="the sidecar consumes for no subscriber (a publishing app's): publish phases only")
    parser.add_argument("--floor", action="store_true",
                        help="profile the drivers' floor (driver_floor_server.py) instead of the sidecar")
    parser.add_argument("--protocol", type=int, default=protocol.PROTOCOL,
                        help="the installation's protocol version to profile (casque.engine.protocol)")
    parser.add_argument("--cassandra", default="127.0.0.1:9042")
    parser.add_argument("--zookeeper", default="127.0.0.1:2181")
    args = parser.parse_args()
    if args.floor and (args.phase == "keyed" or args.no_subscriber):
        parser.error("--floor: it has no producer sequences (keyed) and always serves its one reader")
    if args.no_subscriber and args.phase not in ("single", "batched", "keyed"):
        parser.error("--no-subscriber: only the publish phases (single, batched, keyed) consume nothing")

    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    queue = QueueRef("default", "http")
    text = text_payload(args.size)
    log = Path(tempfile.gettempdir()) / f"{settings.keyspace}-{'floor' if args.floor else 'sidecar'}.log"
    process = None
    try:
        catalog.ensure_installation(store)
        protocol_change.set_version(store, args.protocol)
        catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE",
                                                    max_message_bytes=64 * 1024))
        catalog.apply_subscriber(store, queue, queue.name, SubscriberSpec(queue=queue.name, start_position="earliest"))
        if args.floor:
            process, url = await asyncio.to_thread(start_server, "driver_floor_server.py", log, backend_env(settings))
        else:
            process = start_sidecar(settings, queue.name, None if args.no_subscriber else queue.name, log)
            url = await asyncio.to_thread(sidecar_url, process, log)
            await wait_ready(url, process, log)
        load = Load()
        driver = asyncio.create_task(drive(url, queue.name, args.phase, text, load))
        await load.started.wait()
        await asyncio.sleep(1)  # past the first calls' warm-up
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
        names = thread_names(process.pid, spy)
        before_threads = thread_cpu_seconds(process.pid)
        before_cpu, before_done, before = cpu_seconds([process.pid]), load.done, time.perf_counter()
        if args.no_profile:
            await asyncio.sleep(args.seconds)
        else:
            await asyncio.to_thread(subprocess.run, [
                spy, "record", "--pid", str(process.pid), "--duration", str(int(args.seconds)),
                "--rate", str(args.rate), "--threads",
                # Native frames need the process paused while its stack is read.
                *(["--native"] if args.native else ["--nonblocking"]), "--format", args.format,
                "--output", str(args.out)], check=True)
        cpu, seconds = cpu_seconds([process.pid]) - before_cpu, time.perf_counter() - before
        after_threads = thread_cpu_seconds(process.pid)
        done = load.done - before_done
        load.stop.set()
        await driver
        print(f"phase {args.phase}: {done} messages in {seconds:.1f} s; {'floor' if args.floor else 'sidecar'} "
              f"CPU {cpu:.2f} s "
              f"({cpu / seconds:.0%} of a core), {cpu / max(1, done) * 1e6:.1f} µs per message", file=sys.stderr)
        if args.phase in ("single", "batched"):
            batches = await batches_written(url, store, queue, args.shards, args.floor)
            print(f"  {load.done} messages published in {batches} batches, "
                  f"{load.done / max(1, batches):.1f} per batch", file=sys.stderr)
        names.update(thread_names(process.pid, spy))
        for name, spent in by_thread(before_threads, after_threads, names):
            print(f"  {name:<40} {spent / max(1, done) * 1e6:8.1f} µs per message ({spent / cpu:.0%})",
                  file=sys.stderr)
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait(30)
        drop_scratch(store, settings)
        store.close()
    log.unlink(missing_ok=True)


if __name__ == "__main__":
    asyncio.run(main())
