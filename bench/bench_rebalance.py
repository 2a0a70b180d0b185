"""Rebalance benchmark: what a member joining costs, and how fast a paused member is back.

    python bench/bench_rebalance.py [--shards 12] [--members 3] [--messages 3000]
        [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end.

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
import re
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

from benchlib import arguments, drop_scratch, scratch_settings

QUEUE = QueueRef("default", "rebalance")
REJOIN_QUEUE = QueueRef("default", "rejoin")
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


async def join(store: Store, shards: int, members: int, messages: int) -> dict[str, float]:
    spec = QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE.name, start_position="earliest", visibility_timeout_seconds=300))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    for start in range(0, messages, 500):
        await publisher.publish([OutgoingMessage(f"m{i}".encode(), key=f"k{i}")
                                 for i in range(start, min(messages, start + 500))])
    await publisher.flush_heads()

    group = [Consumer(store, QUEUE, SUBSCRIBER) for _ in range(members)]
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
    newcomer = Consumer(store, QUEUE, SUBSCRIBER)
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


def rejoin(settings_env: dict[str, str], store: Store) -> float:
    """Seconds from SIGCONT to /readyz 200 for a sidecar paused past its session."""
    catalog.apply_queue(store, REJOIN_QUEUE, QueueSpec(shards=4, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REJOIN_QUEUE, SUBSCRIBER, SubscriberSpec(queue=REJOIN_QUEUE.name))
    log = Path(tempfile.mkstemp(prefix="casque-bench-sidecar-", suffix=".log")[1])
    env = dict(os.environ, **settings_env, CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS=str(SESSION_SECONDS))
    command = [sys.executable, "-m", "casque.cli", "sidecar", "--port", "0", "--queue", REJOIN_QUEUE.name,
               "--subscriber", SUBSCRIBER]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = _wait_url(process, log)
        _wait_ready(url, process)
        member = _readiness(url)[1]["checks"][f"member/{SUBSCRIBER}"]
        members = store.paths(REJOIN_QUEUE).subscriber(SUBSCRIBER).members
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


def _wait_url(process: subprocess.Popen[bytes], log: Path) -> str:
    while True:
        found = re.search(rb"casque sidecar listening on (http://\S+)", log.read_bytes())
        if found:
            return found.group(1).decode()
        if process.poll() is not None:
            raise SystemExit(f"sidecar exited: {log.read_text()[-2000:]}")
        time.sleep(0.05)


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


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], messages=3000, size=0)
    parser.add_argument("--members", type=int, default=3)
    parser.set_defaults(shards=12)
    options = parser.parse_args()
    settings = scratch_settings(options.cassandra, options.zookeeper)
    store = Store.open(settings)
    try:
        catalog.ensure_installation(store)
        joined = asyncio.run(join(store, options.shards, options.members, options.messages))
        host, _, port = options.cassandra.rpartition(":")
        env = {"CASQUE_CASSANDRA_CONTACT_POINTS": host, "CASQUE_CASSANDRA_PORT": port,
               "CASQUE_KEYSPACE": settings.keyspace, "CASQUE_ZOOKEEPER_HOSTS": options.zookeeper,
               "CASQUE_ZOOKEEPER_ROOT": settings.zookeeper_root, "CASQUE_CONSISTENCY": "ONE"}
        back = rejoin(env, store)
    finally:
        drop_scratch(store, settings)
        store.close()
    print(f"member joining {options.members} members on {options.shards} shards:")
    print(f"  shards moved            {joined['moved']:>6}  (ideal {joined['ideal']:.1f}: "
          f"ratio {joined['moved'] / joined['ideal']:.2f})")
    print(f"  messages redelivered    {joined['redelivered']:>6}  (in flight on the moved shards: "
          f"{joined['in_flight_on_moved']}; ratio "
          f"{joined['redelivered'] / max(1, joined['in_flight_on_moved']):.2f})")
    print(f"  seconds to settle       {joined['seconds']:>6.2f}")
    print(f"paused past its session, SIGCONT to ready: {back:.2f} s "
          f"(session timeout {SESSION_SECONDS:.0f} s: ratio {back / SESSION_SECONDS:.2f})")


if __name__ == "__main__":
    main()
