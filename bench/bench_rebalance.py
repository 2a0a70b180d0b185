"""Rebalance benchmark: what a member joining costs, and how fast a paused member is back.

    python bench/bench_rebalance.py [--shards 12] [--members 3] [--messages 3000] [--runs 3]
        [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end; each
figure is the median of `--runs` runs, each run on queues of its own.

1. Join. `--members` consumers (in this process) consume a backlog, each holding up to 100
   messages in flight (acked a little later, as a worker would). A new member joins; the
   run counts the shards that changed hands against the ideal shards/(members+1), and the
   messages delivered a second time against the messages that were in flight on the moved
   shards when the join began (what a sticky, flushing handover may redeliver at most).
2. Rejoin. A `casque sidecar` process with 4 s ZooKeeper sessions is SIGSTOPped until its
   session expires, then SIGCONTed: the figure is the seconds from SIGCONT to its /readyz
   answering 200 again (every shard due to it held and read), against the session timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import Delivery, OutgoingMessage
from casque.engine.publisher import Publisher
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import Figure, arguments, drop_scratch, parse, repeat, report, scratch_settings, sidecar_url

SUBSCRIBER = "workers"
IN_FLIGHT = 100
SESSION_SECONDS = 4.0


async def hold_and_ack(consumer: Consumer, stop: asyncio.Event, seen: list[Delivery]) -> None:
    """Receive, keep up to IN_FLIGHT messages, ack the oldest half whenever full."""
    held: list[Delivery] = []
    while not stop.is_set():
        got = await consumer.receive(max_messages=IN_FLIGHT - len(held), wait=0.2)
        seen.extend(got)
        held.extend(got)
        if len(held) >= IN_FLIGHT or not got:
            done, held = held[: len(held) // 2 or len(held)], held[len(held) // 2 or len(held):]
            if done:
                await consumer.ack_many([d.receipt for d in done])
        await asyncio.sleep(0)


async def join(store: Store, shards: int, members: int, messages: int, run: int) -> dict[str, float]:
    queue = QueueRef("default", f"rebalance-{run}")
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, queue, spec)
    catalog.apply_subscriber(store, queue, SUBSCRIBER, SubscriberSpec(
        queue=queue.name, start_position="earliest", visibility_timeout_seconds=300))
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    for start in range(0, messages, 500):
        await publisher.publish([OutgoingMessage(f"m{i}".encode(), key=f"k{i}")
                                 for i in range(start, min(messages, start + 500))])
    await publisher.flush_heads()

    group = [Consumer(store, queue, SUBSCRIBER) for _ in range(members)]
    for consumer in group:
        await consumer.start()
    while sum(len(c.held_shards) for c in group) < shards:
        await asyncio.sleep(0.05)
    stop = asyncio.Event()
    seen: list[Delivery] = []
    loops = [asyncio.create_task(hold_and_ack(c, stop, seen)) for c in group]
    while sum(c.in_flight() for c in group) < members * IN_FLIGHT // 2:
        await asyncio.sleep(0.05)

    before = {s: c.member_id for c in group for s in c.held_shards}
    in_flight = {s: r.state.in_flight for c in group for s, r in c.readers.items()}
    newcomer = Consumer(store, queue, SUBSCRIBER)
    await newcomer.start()
    group.append(newcomer)
    loops.append(asyncio.create_task(hold_and_ack(newcomer, stop, seen)))
    started = time.monotonic()
    while not newcomer.held_shards or sum(len(c.held_shards) for c in group) < shards:
        await asyncio.sleep(0.05)
    settled = time.monotonic() - started
    after = {s: c.member_id for c in group for s in c.held_shards}
    moved = [s for s in range(shards) if before.get(s) != after.get(s)]
    while len({d.message.message_id for d in seen}) < messages:
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*loops)
    for consumer in group:
        await consumer.stop()
    redelivered = sum(1 for d in seen if d.delivery_count > 1)
    return {
        "moved": len(moved), "ideal": shards / (members + 1), "redelivered": redelivered,
        "in_flight_on_moved": sum(in_flight.get(s, 0) for s in moved), "seconds": settled,
    }


def rejoin(settings_env: dict[str, str], store: Store, run: int) -> float:
    """Seconds from SIGCONT to /readyz 200 for a sidecar paused past its session."""
    rejoin_queue = QueueRef("default", f"rejoin-{run}")
    catalog.apply_queue(store, rejoin_queue, QueueSpec(shards=4, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, rejoin_queue, SUBSCRIBER, SubscriberSpec(queue=rejoin_queue.name))
    log = Path(tempfile.mkstemp(prefix="casque-bench-sidecar-", suffix=".log")[1])
    env = dict(os.environ, **settings_env, CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS=str(SESSION_SECONDS))
    command = [sys.executable, "-m", "casque.cli", "sidecar", "--port", "0", "--queue", rejoin_queue.name,
               "--subscriber", SUBSCRIBER]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = sidecar_url(process, log)
        _wait_ready(url, process)
        member = _readiness(url)[1]["checks"][f"member/{SUBSCRIBER}"]
        members = store.paths(rejoin_queue).subscriber(SUBSCRIBER).members
        process.send_signal(signal.SIGSTOP)
        while member in store.zk.get_children(members):
            time.sleep(0.05)
        process.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        _wait_ready(url, process)
        return time.monotonic() - resumed
    finally:
        process.kill()
        process.wait(30)
        log.unlink(missing_ok=True)


def _readiness(url: str) -> tuple[int, dict[str, dict[str, str]]]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    while _readiness(url)[0] != 200:
        if process.poll() is not None:
            raise SystemExit("sidecar exited")
        time.sleep(0.05)


FIGURES = [
    Figure("moved", "member joining: shards moved", ""),
    Figure("moved_ratio", "  of the ideal shards/(members+1)", "x"),
    Figure("redelivered", "  messages redelivered", ""),
    Figure("in_flight_on_moved", "  in flight on the moved shards at the join", ""),
    Figure("redelivered_ratio", "  redelivered / in flight on the moved shards", "x"),
    Figure("settle_s", "  seconds to settle", "s"),
    Figure("rejoin_s", "paused past its session, SIGCONT to ready", "s"),
    Figure("rejoin_ratio", "  of the session timeout", "x"),
]


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], messages=3000, size=0)
    parser.add_argument("--members", type=int, default=3)
    parser.set_defaults(shards=12)
    options = parse(parser, smoke_messages=400)
    if options.smoke:
        options.shards, options.members = min(options.shards, 4), min(options.members, 2)
    settings = scratch_settings(options.cassandra, options.zookeeper)
    store = Store.open(settings)
    host, _, port = options.cassandra.rpartition(":")
    env = {"CASQUE_CASSANDRA_CONTACT_POINTS": host, "CASQUE_CASSANDRA_PORT": port,
           "CASQUE_KEYSPACE": settings.keyspace, "CASQUE_ZOOKEEPER_HOSTS": options.zookeeper,
           "CASQUE_ZOOKEEPER_ROOT": settings.zookeeper_root, "CASQUE_CONSISTENCY": "ONE"}

    def once(run: int) -> dict[str, float]:
        joined = asyncio.run(join(store, options.shards, options.members, options.messages, run))
        back = rejoin(env, store, run)
        return {
            "moved": joined["moved"], "moved_ratio": joined["moved"] / joined["ideal"],
            "redelivered": joined["redelivered"], "in_flight_on_moved": joined["in_flight_on_moved"],
            "redelivered_ratio": joined["redelivered"] / max(1, joined["in_flight_on_moved"]),
            "settle_s": joined["seconds"], "rejoin_s": back, "rejoin_ratio": back / SESSION_SECONDS,
        }

    try:
        catalog.ensure_installation(store)
        samples = repeat(options.runs, once)
    finally:
        drop_scratch(store, settings)
        store.close()
    report("rebalance", options, {"members": options.members, "shards": options.shards,
                                  "messages": options.messages, "session timeout s": SESSION_SECONDS}, FIGURES, samples)


if __name__ == "__main__":
    main()
